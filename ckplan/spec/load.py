"""A spec file: YAML read strictly (no key given twice, no Python objects), then validated."""
from __future__ import annotations

from pathlib import Path

import yaml

from ..errors import SpecError
from .schema import Spec, validate


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.safe_load`` that refuses a key given twice in one mapping (plain YAML keeps the
    last one silently: an edit to the first ``input:`` block would do nothing)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, (str, int, float, bool)) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} is given twice in one mapping", key_node.start_mark)
            seen.add(key) if isinstance(key, (str, int, float, bool)) else None
        return super().construct_mapping(node, deep=deep)


def load_spec(path: str | Path) -> Spec:
    p = Path(path)
    tip = "pass a YAML spec such as configs/gpt2-small.yaml"
    if p.is_dir():
        raise SpecError(f"spec file {str(p)!r} is a folder, not a spec file", tip=tip)
    if not p.exists():
        raise SpecError(f"spec file {str(p)!r} does not exist", tip=tip)
    if not p.is_file():
        raise SpecError(f"spec file {str(p)!r} is not a regular file", tip=tip)
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise SpecError(f"spec file {str(p)!r} cannot be read ({e.strerror})", tip=tip) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SpecError(f"{p}: not a UTF-8 text file (byte 0x{raw[e.start]:02x} at offset {e.start} is not "
                        "UTF-8), so not a YAML spec", tip=f"save the spec as UTF-8 text; {tip}") from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader subclass: no arbitrary objects
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        at = f" at line {where.line + 1}, column {where.column + 1}" if where else ""
        raise SpecError(f"{p}: invalid YAML{at}: {getattr(e, 'problem', e)}",
                        tip="check indentation and quoting") from None
    if isinstance(data, dict) and "schema_version" in data and "command" in data:
        # JSON is YAML: a ckplan output given where its input goes
        kind = str(data["command"])
        fix = ("pass it as `ckplan plan --profile " + str(p) + "` (with no SPEC)" if kind == "profile" else
               "pass it as `ckplan bench SPEC --plan " + str(p) + "`" if kind == "plan" else tip)
        raise SpecError(f"{p} is a ckplan {kind!r} document (what `ckplan {kind.split('-')[0]} -f json` writes), "
                        "not a model spec", tip=fix)
    spec = validate(data, source=str(p))
    if spec.name is None:
        spec = spec.model_copy(update={"name": p.stem})
    return spec
