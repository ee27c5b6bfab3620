import os
import sys
from pathlib import Path

import pytest

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Tests run on two workers (pyproject's addopts): one intra-op thread each, and in the
    # processes they start, so two workers share two cores instead of fighting over them.
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"


@pytest.fixture(autouse=True)
def _each_test_alone(monkeypatch, tmp_path_factory):
    monkeypatch.setenv("COLUMNS", "200")
    # Each test runs in its own empty folder: what a command saves under reports/ by default
    # (`ckplan profile`'s profile, bench's files) stays out of the checkout and out of other tests.
    monkeypatch.chdir(tmp_path_factory.mktemp("cwd"))


def _write_spec(tmp_path: Path, text: str, name: str = "spec.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def _tiny_gpt_spec(tmp_path: Path, **over) -> Path:
    args = dict(vocab_size=97, block_size=32, n_layer=3, n_head=2, n_embd=32, dropout=0.0)
    args.update(over)
    return _write_spec(tmp_path, f"""
model:
  builtin: gpt
  args: {args}
input: {{batch_size: 2, shape: [16], dtype: int64, high: 97, name: input_ids, labels: copy}}
chain: blocks
""", "tiny-gpt.yaml")


def _plan_grads(model, batch, plan, device: str = "cpu"):
    import torch

    from ckplan.execute import apply_plan
    from ckplan.spec import to_loss
    from ckplan.training import forward_loss
    torch.manual_seed(0)
    model.zero_grad(set_to_none=True)
    ex = apply_plan(model, plan) if plan is not None else None
    try:
        loss = forward_loss(model, *batch, to_loss, "fp32", device)
        loss.backward()
    finally:
        if ex is not None:
            ex.remove()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


# Test helpers are fixtures (no `from conftest import`): each returns the helper itself, so a test
# writes `def test_x(tiny_gpt_spec, tmp_path): spec = tiny_gpt_spec(tmp_path, n_layer=4)`.

@pytest.fixture
def configs() -> Path:
    """The shipped configs folder."""
    return CONFIGS


@pytest.fixture
def write_spec():
    """``write_spec(tmp_path, yaml_text, name="spec.yaml") -> Path``."""
    return _write_spec


@pytest.fixture
def plan_grads():
    """``plan_grads(model, batch, plan, device="cpu") -> (loss, {name: grad})``: one fp32 step from
    seed 0 with ``plan`` applied by ``ckplan.apply_plan`` (None: without checkpoints), removed after."""
    return _plan_grads


@pytest.fixture
def tiny_gpt_spec():
    """``tiny_gpt_spec(tmp_path, **gpt_args) -> Path``: a 3-layer zoo GPT spec, fast on CPU."""
    return _tiny_gpt_spec


def _processes_with(token: str) -> list[int]:
    """Live processes other than this one (zombies excluded) whose environment holds
    ``CKPLAN_TEST_RUN=<token>``: every process a run started inherits it, also once its parent
    is gone (found by /proc, not by ancestry)."""
    import os
    needle = f"CKPLAN_TEST_RUN={token}".encode()
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            if needle not in (d / "environ").read_bytes().split(b"\0"):
                continue
            state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state not in ("Z", "X"):
            found.append(int(d.name))
    return found


@pytest.fixture
def processes_with():
    """``processes_with(token) -> [pid]``: live processes started under ``CKPLAN_TEST_RUN=token``."""
    return _processes_with


# Test models imported by `target:` specs (tests/ckmodels.py) are found from the tests folder.
sys.path.insert(0, str(Path(__file__).parent))
