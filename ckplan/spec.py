"""Model spec (YAML) -> validated config -> model, batch and loss.

A spec names the model in exactly one of three ways (``builtin`` from ckplan's zoo, ``hf`` a
Hugging Face config built offline with random weights, ``target`` the user's own factory), the
inputs, the chain of checkpointable layers and the training settings. See README "Spec format".

A spec is code. ``target: "package.module:callable"`` imports that module (running whatever it
runs on import) and calls the callable with ``args:``, before ckplan can look at the result:
``target: "os:system"`` would run a shell command. That happens on every device, ``meta``
included (fake tensors spare the memory, not the code), and in ``bench --plan``'s early check.
Run only specs you trust, as you would a Python script.
"""
from __future__ import annotations

import copy
import difflib
import importlib
import sys
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .errors import DependencyError, ModelRunError, SpecError, UsageError
from .options import OPTIMIZER_ALIASES, OPTIMIZERS, PRECISIONS

DTYPES = ("float32", "float16", "bfloat16", "float64", "int64", "int32")
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int64": 8, "int32": 4}
MAX_INPUT_BYTES = 2**63 - 1  # what torch can count (int64): no machine has this much memory


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _no_bools_for_numbers(cls, data):
        # YAML's true/false would pass as 1/0 where a count is asked (batch_size: true -> 1)
        if isinstance(data, dict):
            for name, field in cls.model_fields.items():
                v = data.get(name)
                ann = str(field.annotation)
                if "int" in ann and "bool" not in ann and (
                        isinstance(v, bool) or (isinstance(v, list) and any(isinstance(x, bool) for x in v))):
                    raise ValueError(f"{name} must be a number, not {v!r}")
        return data


class ModelSpec(_Strict):
    builtin: Optional[str] = None
    hf: Optional[dict[str, Any]] = None
    target: Optional[str] = None
    args: dict[str, Any] = Field(default_factory=dict)
    task: Optional[Literal["causal-lm", "masked-lm", "seq2seq-lm", "sequence-classification",
                           "image-classification", "base"]] = None

    @model_validator(mode="after")
    def _exactly_one(self):
        given = [k for k in ("builtin", "hf", "target") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError("name the model in exactly one way: `builtin: NAME`, `hf: {model_type: ...}` "
                             f"or `target: \"module:callable\"` (found {given or 'none'})")
        if self.hf is not None and "model_type" not in self.hf:
            raise ValueError("`hf:` needs `model_type` (e.g. gpt2, bert, llama)")
        if self.target is not None and ":" not in self.target:
            raise ValueError(f"target {self.target!r} must look like \"package.module:callable\"")
        if self.hf is not None and self.args:
            raise ValueError("`args:` goes with builtin/target; put Hugging Face config fields inside `hf:`")
        return self


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class LabelSpec(_Strict):
    shape: list[int] = Field(default_factory=list)
    dtype: Literal[DTYPES] = "int64"  # type: ignore[valid-type]
    high: Optional[int] = None


class InputSpec(_Strict):
    batch_size: int = Field(gt=0)
    shape: list[int]
    dtype: Literal[DTYPES] = "float32"  # type: ignore[valid-type]
    high: Optional[int] = Field(default=None, gt=0)
    name: Optional[str] = None  # keyword to pass the input by; positional when absent
    labels: Union[Literal["copy", "none"], LabelSpec] = "none"

    @field_validator("shape")
    @classmethod
    def _positive(cls, v):
        if not v:
            raise ValueError("shape is [], but it must list at least one dimension: the shape of one sample "
                             "after the batch dimension, e.g. [512] for 512 token ids or [3, 224, 224] for "
                             "an image")
        if any(d <= 0 for d in v):
            raise ValueError(f"every dimension of shape must be positive, got {v}")
        return v

    def tensors(self) -> list[tuple[str, list[int], str]]:
        """``(what, shape, dtype)`` of each tensor of one batch: the input, and the labels when drawn."""
        out = [("input", [self.batch_size, *self.shape], self.dtype)]
        if isinstance(self.labels, LabelSpec):
            out.append(("labels", [self.batch_size, *self.labels.shape], self.labels.dtype))
        return out

    def nbytes(self) -> int:
        """Bytes of one batch (input and drawn labels), worked out without making it."""
        return sum(_numel(shape) * DTYPE_BYTES[dtype] for _, shape, dtype in self.tensors())

    @model_validator(mode="after")
    def _fits_a_machine(self):
        # torch counts elements in int64; a batch past 8 EiB is a typo, and torch's own error
        # for it is a C++ stack dump
        for what, shape, dtype in self.tensors():
            size = _numel(shape) * DTYPE_BYTES[dtype]
            if size > MAX_INPUT_BYTES:
                raise ValueError(f"the {what} (batch_size {self.batch_size} x shape {shape[1:]}, {dtype}) would "
                                 f"take about {size:.2g} bytes, larger than any machine's memory (8 EiB)")
        return self

    @model_validator(mode="after")
    def _ints_need_high(self):
        if self.dtype.startswith("int") and self.high is None:
            raise ValueError("an integer input needs `high:` (e.g. the vocabulary size for token ids)")
        if not self.dtype.startswith("int") and self.high is not None:
            # a float input is drawn from a normal distribution: `high` would be ignored silently
            raise ValueError(f"`high: {self.high}` is set on a {self.dtype} input, but `high` is the "
                             "exclusive upper bound of integer inputs (token ids) and a float input is "
                             "drawn from a normal distribution; remove `high:`, or set `dtype: int64` "
                             "for token ids")
        return self


class TrainSpec(_Strict):
    optimizer: str = "adamw"
    precision: Literal[PRECISIONS] = "fp32"  # type: ignore[valid-type]
    accum: int = Field(default=1, gt=0)
    lr: float = Field(default=1e-4, gt=0)

    @field_validator("optimizer")
    @classmethod
    def _opt(cls, v):
        v = OPTIMIZER_ALIASES.get(v, v)
        if v not in OPTIMIZERS:
            raise ValueError(f"optimizer {v!r} is not one of {', '.join(OPTIMIZERS)}")
        return v


class ParallelSpec(_Strict):
    """How the job runs across ranks: ``plan`` and ``bench`` default to it (``--world-size`` /
    ``--nproc`` and ``--parallel`` override). ``input.batch_size`` is per rank."""

    world_size: int = Field(default=1, gt=0)
    kind: Literal["fsdp", "ddp"] = "fsdp"


class Spec(_Strict):
    name: Optional[str] = None
    model: ModelSpec
    input: InputSpec
    chain: Optional[str] = None
    train: TrainSpec = Field(default_factory=TrainSpec)
    parallel: ParallelSpec = Field(default_factory=ParallelSpec)
    seed: int = 0

    def with_overrides(self, *, batch_size: int | None = None, seq_len: int | None = None,
                       precision: str | None = None, optimizer: str | None = None,
                       accum: int | None = None) -> Spec:
        """The spec with overrides applied (the CLI's --batch-size etc., the API's keywords), validated.

        Each override is checked on its own first, so a bad one is named as the argument it came
        from (``precision='int8'``), not as the spec field it would have replaced.
        """
        check_overrides(batch_size=batch_size, seq_len=seq_len, precision=precision, optimizer=optimizer,
                        accum=accum)
        if seq_len is not None and not self.input.dtype.startswith("int"):
            inp = self.input
            what = " (an image)" if len(inp.shape) == 3 else " (features)" if len(inp.shape) == 1 else ""
            raise UsageError(f"seq_len={seq_len} (--seq-len) sets the sequence length, the first dimension of a "
                             f"token-id input, but this spec's input{f' {inp.name!r}' if inp.name else ''} is "
                             f"a {inp.dtype} tensor of shape {inp.shape}{what}, not a token sequence",
                             tip=f"drop the sequence length; to change the input's shape, edit input.shape "
                                 f"{inp.shape} in the spec (the batch size override still applies)")
        d = self.model_dump()
        if batch_size is not None:
            d["input"]["batch_size"] = batch_size
        if seq_len is not None:
            d["input"]["shape"] = [seq_len, *d["input"]["shape"][1:]]
            if isinstance(d["input"]["labels"], dict) and d["input"]["labels"]["shape"]:
                d["input"]["labels"]["shape"] = [seq_len, *d["input"]["labels"]["shape"][1:]]
        for key, val in (("precision", precision), ("optimizer", optimizer), ("accum", accum)):
            if val is not None:
                d["train"][key] = str(val) if key != "accum" else val
        given = ", ".join(f"{k}={getattr(v, 'value', v)!r}" for k, v in
                          (("batch_size", batch_size), ("seq_len", seq_len), ("precision", precision),
                           ("optimizer", optimizer), ("accum", accum)) if v is not None)
        return validate(d, source=f"with the override {given}")


def _positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UsageError(f"{name}={value!r} must be a whole number of at least 1")


def check_overrides(*, batch_size=None, seq_len=None, precision=None, optimizer=None, accum=None) -> None:
    """Reject a bad override by its argument name (``accum=0``, ``precision='int8'``)."""
    for name, value in (("batch_size", batch_size), ("seq_len", seq_len), ("accum", accum)):
        if value is not None:
            _positive_int(name, value)
    if precision is not None and str(precision) not in PRECISIONS:
        raise UsageError(f"precision={precision!r} is not one of {', '.join(PRECISIONS)}")
    if optimizer is not None and OPTIMIZER_ALIASES.get(str(optimizer), str(optimizer)) not in OPTIMIZERS:
        raise UsageError(f"optimizer={optimizer!r} is not one of {', '.join(OPTIMIZERS)}")


def _loc(err: dict) -> str:
    return ".".join(str(p) for p in err["loc"] if not str(p).startswith("function-after")) or "(top level)"


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _fields_at(loc: tuple) -> list[str] | None:
    """The keys the spec takes in the mapping that holds ``loc``'s last key, or None."""
    model: Any = Spec
    for part in loc[:-1]:
        field = getattr(model, "model_fields", {}).get(str(part))
        if field is None:
            return None
        ann = field.annotation
        model = next((a for a in (ann, *getattr(ann, "__args__", ())) if isinstance(a, type)
                      and issubclass(a, BaseModel)), None)
        if model is None:
            return None
    return list(getattr(model, "model_fields", {}))


def _explain(err: dict) -> tuple[str, str | None]:
    """One validation error as ``where: what (got value)`` and its fix, or None for no fix."""
    loc = tuple(p for p in err["loc"] if not str(p).startswith("function-after"))
    where = _loc(err)
    parent = ".".join(map(str, loc[:-1]))
    if err["type"] == "extra_forbidden":
        keys = _fields_at(loc) or []
        close = difflib.get_close_matches(str(loc[-1]), keys, n=1)
        tip = (f"did you mean {close[0]!r}?" if close else
               f"the keys of `{parent or 'the spec'}` are {', '.join(keys)}" if keys else None)
        return f"{where}: unknown key", tip
    if err["type"] == "missing":
        return f"{where}: required key is missing", f"add `{loc[-1]}:` under `{parent}:`" if parent else None
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] != "value_error":  # pydantic's own messages do not show the value given
        msg += f" (got {_shown(err.get('input'))})"
    return f"{where}: {msg}", None


def validate(data: Any, *, source: str = "spec") -> Spec:
    if not isinstance(data, dict):
        raise SpecError(f"{source}: expected a mapping with `model:` and `input:`, got {type(data).__name__}",
                        tip="see README, section 'Spec format'")
    try:
        return Spec.model_validate(data)
    except ValidationError as e:
        found = [_explain(err) for err in e.errors()]
        tips = list(dict.fromkeys(t for _, t in found if t))
        raise SpecError(f"{source}: " + "; ".join(m for m, _ in found), tip="; ".join(tips) or None) from None


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


# ----------------------------------------------------------------------------- building

def torch_dtype(name: str):
    import torch
    return getattr(torch, name)


def build_model(spec: Spec, device: str = "cpu"):
    """Instantiate the model on ``device`` (``meta``: no memory is allocated) in train mode."""
    import torch
    torch.manual_seed(spec.seed)
    if spec.model.builtin is not None:
        _check_builtin_vocab(spec)
        _check_builtin_length(spec)
    if str(device) == "meta":
        # Modules a model imports lazily (transformers' GenerationMixin pulls in torch._dynamo)
        # run tensor code at import; under the meta device that code fails (torch 2.6: .item()
        # on a meta tensor). Import dynamo first, outside the device.
        import torch._dynamo
    with torch.device(device):
        if spec.model.builtin is not None:
            model = _build_builtin(spec.model.builtin, spec.model.args)
        elif spec.model.hf is not None:
            model = _build_hf(spec.model.hf, spec.model.task, inp=spec.input)
        else:
            model = _build_target(spec.model.target, spec.model.args)
    if spec.model.hf is not None:
        _check_position_table(model, spec.input)
    if not isinstance(model, torch.nn.Module):
        where = f"model.target {spec.model.target!r}" if spec.model.target else "model.builtin"
        raise SpecError(f"{where} returned {type(model).__name__}, not a torch.nn.Module",
                        tip="a target is any importable callable and ckplan has already run it: "
                            "run only specs you trust" if spec.model.target else None)
    return model.train()


def check_token_range(inp: InputSpec, vocab_size: Any, where: str) -> None:
    """Token ids are drawn from [0, input.high): ``high`` above the model's vocabulary would index
    past its embedding table, an IndexError only at run time (and never on the meta device)."""
    if (inp.dtype.startswith("int") and inp.high is not None and isinstance(vocab_size, int)
            and not isinstance(vocab_size, bool) and inp.high > vocab_size):
        raise SpecError(f"input.high {inp.high} is above the model's vocabulary size {vocab_size} ({where}): "
                        f"token ids up to {inp.high - 1} would index past its embedding table",
                        tip=f"set input.high to at most {vocab_size} (usually equal to the vocabulary size), "
                            f"or raise {where.split(',')[0]}")


def _check_builtin_vocab(spec: Spec) -> None:
    """A zoo model that embeds token ids (gpt, bert) declares ``vocab_size``: check ``input.high``."""
    from .zoo import zoo_args
    name = spec.model.builtin
    try:
        defaults = zoo_args(str(name))
    except KeyError:
        return  # an unknown builtin: _build_builtin says so
    if "vocab_size" not in defaults:
        return
    given = "vocab_size" in spec.model.args
    vocab = spec.model.args["vocab_size"] if given else defaults["vocab_size"]
    check_token_range(spec.input, vocab, "model.args.vocab_size" if given else
                      f"model.args.vocab_size, the default of builtin {name!r}")


# The argument that sizes each zoo model's position table (the longest sequence it takes).
_BUILTIN_LENGTH = {"gpt": "block_size", "bert": "max_position"}


def _token_length(inp: InputSpec) -> int | None:
    """The sequence length of a token-id input (its first dimension), else None."""
    return inp.shape[0] if inp.dtype.startswith("int") else None


def _too_long(length: int, limit: int, where: str) -> SpecError:
    return SpecError(f"input.shape[0], the sequence length, is {length}, above the {limit} positions the model "
                     f"takes ({where}): the forward would fail after the whole batch was allocated",
                     tip=f"use a sequence length of at most {limit} (--seq-len {limit}, seq_len= in the API), "
                         f"or raise {where.split(',')[0]}")


def _check_builtin_length(spec: Spec) -> None:
    """A zoo model's position table (gpt's ``block_size``, bert's ``max_position``) bounds the
    sequence: refuse a longer one before anything is built or allocated."""
    from .zoo import zoo_args
    name = str(spec.model.builtin)
    arg, length = _BUILTIN_LENGTH.get(name), _token_length(spec.input)
    if arg is None or length is None:
        return
    given = arg in spec.model.args
    limit = spec.model.args[arg] if given else zoo_args(name)[arg]
    if isinstance(limit, int) and not isinstance(limit, bool) and length > limit:
        raise _too_long(length, limit, f"model.args.{arg}" if given else
                        f"model.args.{arg}, the default of builtin {name!r}")


def _check_position_table(model, inp: InputSpec) -> None:
    """A Hugging Face model with a learned position table (GPT-2's ``wpe``, BERT's
    ``position_embeddings``, OPT's ``embed_positions``) takes at most its rows of tokens; rotary
    models have no table and no such bound."""
    import torch
    length = _token_length(inp)
    if length is None:
        return
    for name, m in model.named_modules():
        last = name.rsplit(".", 1)[-1].lower()
        if isinstance(m, torch.nn.Embedding) and (last == "wpe" or "position" in last):
            limit = m.num_embeddings - int(getattr(m, "offset", 0) or 0)
            if length > limit:
                raise _too_long(length, limit, f"the position table {name} has {limit} rows")
            return


def _build_builtin(name: str, args: dict):
    from .zoo import ZOO, build_builtin
    if name not in ZOO:
        raise SpecError(f"model.builtin: unknown model {name!r}",
                        tip=f"choose one of {', '.join(sorted(ZOO))}, or use `hf:` / `target:`")
    try:
        return build_builtin(name, dict(args))
    except TypeError as e:
        raise SpecError(f"model.args for builtin {name!r}: {e}") from None


_HF_TASKS = {
    "causal-lm": "AutoModelForCausalLM",
    "masked-lm": "AutoModelForMaskedLM",
    "seq2seq-lm": "AutoModelForSeq2SeqLM",
    "sequence-classification": "AutoModelForSequenceClassification",
    "image-classification": "AutoModelForImageClassification",
    "base": "AutoModel",
}
_HF_DEFAULT_TASK = {"bert": "masked-lm", "roberta": "masked-lm", "distilbert": "masked-lm",
                    "albert": "masked-lm", "deberta": "masked-lm", "deberta-v2": "masked-lm"}


def _build_hf(fields: dict, task: str | None, inp: InputSpec | None = None):
    try:
        import transformers
    except ImportError:
        raise DependencyError("model.hf needs Hugging Face transformers, which is not installed",
                              tip="pip install 'ckplan[hf]'") from None
    fields = dict(fields)
    model_type = fields.pop("model_type")
    config_cls = _hf_config_class(transformers, model_type)
    _check_hf_fields(config_cls, model_type, fields)
    try:
        config = config_cls(**fields)
    except (TypeError, ValueError) as e:
        raise SpecError(f"model.hf for model_type {model_type!r}: {e}".split("\n")[0]) from None
    if inp is not None and inp.name == "input_ids":  # only then is the input surely the token ids
        check_token_range(inp, getattr(config, "vocab_size", None),
                          "model.hf.vocab_size" if "vocab_size" in fields else
                          f"model.hf.vocab_size, the default of the {model_type} config")
    task = task or _HF_DEFAULT_TASK.get(model_type, "causal-lm")
    if task == "seq2seq-lm" and getattr(config, "decoder_start_token_id", None) is None:
        # T5's configs on the Hub say 0, its padding id; built from fields the config has none,
        # and the model needs it to shift the labels into decoder inputs.
        pad = getattr(config, "pad_token_id", None)
        config.decoder_start_token_id = pad if pad is not None else 0
    auto = getattr(transformers, _HF_TASKS[task])
    try:  # a task with several classes (DeiT: with and without the teacher head) takes the first
        classes = auto._model_mapping[type(config)]
        if isinstance(classes, (tuple, list)) and not getattr(config, "architectures", None):
            config.architectures = [classes[0].__name__]
    except (KeyError, AttributeError):
        pass  # not a model of this task: from_config says so below
    try:
        return auto.from_config(copy.deepcopy(config), attn_implementation="sdpa")
    except (ValueError, ImportError):
        # Architectures without SDPA attention (Bloom, GPT-J): transformers' own attention. A
        # failed attempt leaves "sdpa" set on the config it was given, hence the copy above.
        return auto.from_config(config, attn_implementation="eager")


def _hf_config_class(transformers, model_type):
    mapping = transformers.CONFIG_MAPPING
    try:
        return mapping[model_type]
    except KeyError:
        close = difflib.get_close_matches(str(model_type), list(mapping.keys()), n=3)
        hint = f"did you mean {' or '.join(map(repr, close))}?" if close else \
            "use a model_type transformers knows, e.g. gpt2, bert, llama"
        raise SpecError(f"model.hf.model_type {model_type!r} is not a model type transformers "
                        f"{transformers.__version__} knows", tip=hint) from None


def hf_config_fields(config_cls) -> set[str]:
    """Every field name a Hugging Face config class takes: its signature, its defaults, its aliases."""
    import dataclasses
    import inspect
    known = set(getattr(config_cls, "attribute_map", {}) or {})
    for cls in config_cls.__mro__:
        init = cls.__dict__.get("__init__")
        if init is not None:
            known |= {p.name for p in inspect.signature(init).parameters.values()
                      if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and p.name != "self"}
    # settable properties: PretrainedConfig's num_labels (which fills id2label), say
    known |= {n for cls in config_cls.__mro__ for n, v in vars(cls).items()
              if isinstance(v, property) and v.fset is not None and not n.startswith("_")}
    if dataclasses.is_dataclass(config_cls):
        known |= {f.name for f in dataclasses.fields(config_cls)}
    try:
        default = config_cls()
        known |= set(default.to_dict())
        known |= {a for a in vars(default) if not a.startswith("_")}
    except Exception:  # a config that needs arguments: the signature above is what we have
        pass
    return known


# Read by the models from any config though no config class declares them (transformers 5).
HF_GENERIC_FIELDS = frozenset({"decoder_start_token_id", "pad_token_id", "bos_token_id", "eos_token_id",
                               "sep_token_id", "problem_type", "id2label", "label2id", "num_labels",
                               "tie_word_embeddings", "is_encoder_decoder"})


def _check_hf_fields(config_cls, model_type: str, fields: dict) -> None:
    # transformers keeps unknown keywords as attributes without a word, so `n_layers: 2` (a typo
    # for n_layer) would silently build the default 12 layers.
    known = hf_config_fields(config_cls) | HF_GENERIC_FIELDS
    for name in fields:
        if name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=1)
            raise SpecError(f"model.hf.{name}: {config_cls.__name__} ({model_type}) has no field {name!r}",
                            tip=f"did you mean {close[0]!r}?" if close else
                            f"see the fields of transformers.{config_cls.__name__}")


def _build_target(target: str, args: dict):
    mod_name, _, fn_name = target.partition(":")
    if "" not in sys.path and "." not in sys.path:
        sys.path.insert(0, "")  # the current directory, as `python -m` would
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise SpecError(f"model.target: cannot import module {mod_name!r}: {e}",
                        tip="run ckplan from the directory that holds it, or add it to PYTHONPATH") from None
    fn = mod
    for part in fn_name.split("."):
        fn = getattr(fn, part, None)
        if fn is None:
            raise SpecError(f"model.target: module {mod_name!r} has no attribute {fn_name!r}")
    try:
        return fn(**args)
    except TypeError as e:
        raise SpecError(f"model.target {target!r} rejected args {args}: {e}") from None
    except Exception as e:
        raise ModelRunError(f"model.target {target!r} raised {type(e).__name__}: {e}") from e


def make_batch(spec: Spec, device: str = "cpu", *, seed: int | None = None):
    """Random inputs (and labels) for one micro-batch: returns (args, kwargs) for model(*args, **kwargs)."""
    import torch
    inp = spec.input
    gen = torch.Generator().manual_seed(spec.seed if seed is None else seed)

    def rand(shape, dtype, high):
        if device == "meta":
            return torch.empty(shape, dtype=torch_dtype(dtype), device="meta")
        if dtype.startswith("int"):
            t = torch.randint(0, high, shape, generator=gen, dtype=torch_dtype(dtype))
        else:
            t = torch.randn(shape, generator=gen, dtype=torch_dtype(dtype))
        return t.to(device)

    x = rand([inp.batch_size, *inp.shape], inp.dtype, inp.high)
    args, kwargs = ((), {inp.name: x}) if inp.name else ((x,), {})
    if inp.labels == "copy":
        kwargs["labels"] = x
    elif isinstance(inp.labels, LabelSpec):
        lab = inp.labels
        if lab.dtype.startswith("int") and lab.high is None:
            raise SpecError("input.labels: integer labels need `high:` (number of classes)")
        kwargs["labels"] = rand([inp.batch_size, *lab.shape], lab.dtype, lab.high)
    return args, kwargs


def batch_bytes(args, kwargs) -> int:
    """Bytes of the batch's tensors, each storage once."""
    from .measure import unique_storage_bytes
    return unique_storage_bytes((list(args), list(kwargs.values())))


def to_loss(out):
    """The training loss from a model's output: its loss when it returns one, else mean(out**2)."""
    import torch
    if isinstance(out, torch.Tensor):
        return out if out.dim() == 0 else out.float().pow(2).mean()
    loss = getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(out, dict) and isinstance(out.get("loss"), torch.Tensor):
        return out["loss"]
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return to_loss(out[0])
    first = out[0] if hasattr(out, "__getitem__") else None
    if isinstance(first, torch.Tensor):
        return to_loss(first)
    raise ModelRunError(f"cannot make a loss from the model's output of type {type(out).__name__}",
                        tip="return a tensor or an object with a `.loss`")
