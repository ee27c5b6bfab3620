"""Multi-layer checkpoints on a torch whose checkpoint frames save their inputs the older way
(torch <= 2.11: ``frame.input_saver = _NoopSaveInputs.apply(dummy, kwargs, *args)``, the
recompute called with ``(kwargs, *args)``), emulated on this torch: the same gradients, and the
peaks predicted to the byte, as with the frames of this torch.

The first GPU run (torch 2.11 on an H200) found ckplan's executor falling back to one checkpoint
per layer there: 72-192 MiB over the prediction on gpt2-small and BERT-large sqrtn/dp plans.
"""
import re
import warnings

import pytest
import torch
from torch.utils import checkpoint as tc

from ckplan import api, execute
from ckplan.planner import Plan
from ckplan.planner.plan import Checkpoint, Store, items_from_ranges
from ckplan.spec import build_model, make_batch


class _NoopSaveInputs(torch.autograd.Function):
    """torch 2.11's, as in torch/utils/checkpoint.py there."""

    @staticmethod
    def forward(*args):
        return torch.empty((0,))

    @staticmethod
    def setup_context(ctx, inputs, output):
        tensor_indices, tensors = zip(*[(i, o) for i, o in enumerate(inputs) if isinstance(o, torch.Tensor)])
        idx2saved_idx = {b: a for a, b in enumerate(tensor_indices)}
        args = [None if isinstance(o, torch.Tensor) else o for o in inputs]

        def get_args(saved_tensors):
            ret = [saved_tensors[idx2saved_idx[i]] if i in tensor_indices else o for i, o in enumerate(args)]
            return ret[1:]

        ctx.get_args = get_args
        ctx.save_for_backward(*tensors)

    @staticmethod
    def backward(ctx, *grad_outputs):
        raise AssertionError("Did not expect to backward on this graph")


class _OldFrame(tc._CheckpointFrame):
    """A frame that reads its inputs back as torch 2.11's unpack hook does."""

    def save_inputs(self, *args):  # pragma: no cover - must not be called on the old path
        raise AssertionError("the old frame API has no save_inputs")

    def get_inputs(self):
        ctx = self.input_saver.grad_fn
        return ctx.get_args(ctx.saved_tensors)


class _TorchsOwnFrame(tc._CheckpointFrame):
    """torch's own frames (nested ``checkpoint`` calls in a recompute) saving as torch 2.11 does:
    the dummy tensor first, so that a parent frame counts the same saved tensors in the forward
    (ckplan's frames, the old way) and in the recompute."""

    def save_inputs(self, *args):
        self.input_saver = _NoopSaveInputs.apply(torch.empty((0,), requires_grad=True), None, *args)

    def get_inputs(self):
        ctx = self.input_saver.grad_fn
        return ctx.get_args(ctx.saved_tensors)[1:]


@pytest.fixture
def old_frames(monkeypatch):
    monkeypatch.setattr(tc, "_CheckpointFrame", _TorchsOwnFrame)
    monkeypatch.setattr(execute.frames, "_SAVES_INPUTS", False)
    monkeypatch.setattr(execute.executor, "_CAN_SPAN", True)
    monkeypatch.setattr(execute.executor, "_PROBED", None)  # the probe runs on these frames
    monkeypatch.setattr(execute.frames, "_CheckpointFrame", _OldFrame)
    monkeypatch.setattr(tc, "_NoopSaveInputs", _NoopSaveInputs, raising=False)


@pytest.mark.parametrize("items", [
    items_from_ranges(4, [(0, 2), (2, 4)]),
    items_from_ranges(4, [(0, 3), (0, 1), (1, 3), (2, 3)]),
    (Checkpoint(0, 3, (Store(0, "sac-compute"), Store(1), Store(2, "sac-linear"))), Store(3)),
])
def test_old_frames_give_the_same_gradients(old_frames, tiny_gpt_spec, tmp_path, items, plan_grads):
    spec = api.load(tiny_gpt_spec(tmp_path, n_layer=4, dropout=0.2))
    model, batch = build_model(spec), make_batch(spec)
    loss0, g0 = plan_grads(model, batch, None)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no fallback to a checkpoint per layer
        loss1, g1 = plan_grads(model, batch, Plan("custom", 4, tuple(items)))
    assert loss1 == pytest.approx(loss0, rel=1e-6)
    for n in g0:
        assert torch.allclose(g0[n], g1[n], rtol=1e-5, atol=1e-7), n


def test_old_frames_keep_the_predicted_peaks(old_frames, tiny_gpt_spec, tmp_path):
    spec = api.load(tiny_gpt_spec(tmp_path, n_layer=6, n_embd=64, block_size=64), batch_size=2, seq_len=64,
                    optimizer="sgd")
    res = api.bench(spec, strategies=["none", "sqrtn", "dp"], k=1, steps=1, warmup=1,
                    device="cpu")
    for r in res.rows:
        assert r.status == "ok", r.message
        assert r.measured_peak_bytes == r.predicted_peak_bytes, (r.strategy, r.plan)
    assert any("C[" in r.plan and "S1" in r.plan.split("}")[0] for r in res.rows if r.strategy != "none")


class _UnknownFrame:
    """A checkpoint frame API this ckplan does not know (a future torch's): other arguments."""

    def __init__(self, *args, **kwargs):
        raise TypeError("_CheckpointFrame.__init__() got an unexpected keyword argument")


@pytest.fixture
def unknown_frames(monkeypatch):
    monkeypatch.setattr(execute.frames, "_CheckpointFrame", _UnknownFrame)
    monkeypatch.setattr(execute.executor, "_PROBED", None)


def test_unknown_frames_fall_back_to_one_layer_checkpoints_predicted(unknown_frames, tiny_gpt_spec, tmp_path):
    """Where the frames fail the probe, the profile cuts every layer apart, so the plans are
    one-layer checkpoints (what the executor can run) and their peaks are predicted exactly."""
    assert not execute.spans_layers()
    spec = api.load(tiny_gpt_spec(tmp_path, n_layer=6, n_embd=64, block_size=64), batch_size=2, seq_len=64,
                    optimizer="sgd")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # plans made here need no fallback
        res = api.bench(spec, strategies=["none", "every-k", "sqrtn", "dp"], k=3, steps=1, warmup=1,
                        device="cpu")
    assert any("cannot span several layers" in n for n in res.notes)
    for r in res.rows:
        assert all(int(b) - int(a) == 1 for a, b in re.findall(r"C\[(\d+),(\d+)\)", r.plan)), r.plan
        assert r.status == "ok", r.message
        assert r.measured_peak_bytes == r.predicted_peak_bytes, (r.strategy, r.plan)
        assert r.max_grad_diff is not None and r.max_grad_diff < 1e-5
    assert any(r.n_checkpoints > 0 for r in res.rows)


def test_unknown_frames_run_a_foreign_plan_per_layer_with_one_warning(unknown_frames, tiny_gpt_spec, tmp_path,
                                                                       plan_grads):
    spec = api.load(tiny_gpt_spec(tmp_path, n_layer=4, dropout=0.2))
    model, batch = build_model(spec), make_batch(spec)
    loss0, g0 = plan_grads(model, batch, None)
    with pytest.warns(RuntimeWarning, match="cannot span several layers") as seen:
        loss1, g1 = plan_grads(model, batch, Plan("custom", 4, items_from_ranges(4, [(0, 4), (1, 3)])))
    assert all("\n" not in str(w.message) for w in seen)
    assert loss1 == pytest.approx(loss0, rel=1e-6)
    for n in g0:
        assert torch.allclose(g0[n], g1[n], rtol=1e-5, atol=1e-7), n


def test_a_layer_with_an_option_keeps_its_cache_out_of_outer_saved_tensor_hooks():
    """ckplan's own saved-tensor hooks around a layer with a selective option (the profile's
    tracker, the executor's offload hooks) see what they saw before torch 2.14: the tensors the
    policy keeps stay in SAC's cache, out of those hooks, and torch does not warn that a later
    release will route them through (``sac.SAC_KWARGS`` asks for that by name where torch has the
    switch). The gradients are the layer's own."""
    from torch.autograd.graph import saved_tensors_hooks

    from ckplan.sac import run_with_option
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 16)

    def layer(x):
        return torch.relu(lin(x)) * 2

    x = torch.randn(4, 8, requires_grad=True)
    want = torch.autograd.grad(layer(x).sum(), (x, lin.weight))
    packed: list[tuple[int, ...]] = []
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with saved_tensors_hooks(lambda t: (packed.append(tuple(t.shape)), t)[1], lambda t: t):
            y = run_with_option(layer, "sac-compute", x)
        got = torch.autograd.grad(y.sum(), (x, lin.weight))
    assert not [w for w in seen if "saved_tensors_hooks" in str(w.message)]
    assert (4, 16) not in packed  # the linear's output, which sac-compute keeps, stayed in SAC's cache
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
