"""GPU tier: predicted peaks against the CUDA caching allocator (torch.cuda.max_memory_allocated).
Skipped without CUDA.

Run with: python -m pytest -m gpu   (each test prints its rows; add -s to see them)

The profile on CUDA measures every layer with the allocator too, so the predictions here are
checked against the same counter; the meta-plan test checks a plan made on fake tensors (the CUDA
kernels' saved tensors, sizes unrounded) against the real allocator.
"""
import json
import os

import pytest
import torch

from ckplan import api

# CKPLAN_GPU_TESTS_ON=cpu runs the same checks on the CPU (to try the tests themselves without a GPU).
DEVICE = os.environ.get("CKPLAN_GPU_TESTS_ON", "cuda")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PEAK_TOL = 0.02  # relative; the rows print their errors, the benchmark reports hold the figures


def _show(res) -> None:
    for r in res.rows:
        print(f"{r.strategy:>24} {r.status:>10} pred {r.predicted_peak_bytes} meas {r.measured_peak_bytes} "
              f"err {r.peak_error} dgrad {r.max_grad_diff} tol {r.grad_tolerance} ms {r.step_ms} {r.message}")


def _check(res, *, peers_ok: bool = True) -> None:
    _show(res)
    for r in res.rows:
        if r.status == "infeasible":
            continue
        assert r.status == "ok", (r.strategy, r.status, r.message)
        if r.kind == "ckplan":
            assert r.peak_error is not None and r.peak_error < PEAK_TOL, \
                (r.strategy, r.predicted_peak_bytes, r.measured_peak_bytes)


@pytest.fixture
def tiny(tmp_path, tiny_gpt_spec):
    return tiny_gpt_spec(tmp_path, n_layer=8, n_embd=256, n_head=4, block_size=256)


@pytest.mark.parametrize("config,over", [
    ("tiny-gpt", dict(batch_size=8, seq_len=256)),
    ("gpt2-small.yaml", dict(batch_size=4, seq_len=512)),
    ("resnet.yaml", dict(batch_size=32)),
])
def test_predicted_peak_matches_cuda_allocator(configs, tiny, config, over):
    path = tiny if config == "tiny-gpt" else configs / config
    spec = api.load(path, **over)
    res = api.bench(spec, strategies=["none", "every-k", "sqrtn", "dp"], budget="70%", k=1,
                    steps=2, warmup=1, device=DEVICE)
    _check(res)
    for r in res.rows:
        if r.status == "ok":
            assert r.max_grad_diff <= r.grad_tolerance, r


def test_selective_options_and_peers_on_cuda(configs):
    """SAC options measured on the GPU, the plans that use them, and the eager peers, on
    gpt2-small at 8 x 512 tokens. (On small layers, 256 wide, SAC's dispatch costs more CPU time
    per layer than the GPU's whole forward: every option is dominated there, rightly.)"""
    spec = api.load(configs / "gpt2-small.yaml", batch_size=8, seq_len=512)
    prof = api.profile(spec, device=DEVICE, repeats=1, options=True)
    print("notes:", prof.notes)
    for r in prof.chain_layers[:2]:
        print(r.name, "saved", r.saved_bytes, "fwd_ms", r.fwd_ms, "options",
              [(o.name, o.saved_bytes, round(o.recompute_ms, 3)) for o in r.options])
    res = api.bench(spec, strategies=["none", "dp-layer", "dp", "selective", "sac-policy", "hf"],
                    steps=2, warmup=1, device=DEVICE, options=True)
    _check(res)
    by = {r.strategy: r for r in res.rows}
    assert by["dp"].measured_peak_bytes < by["none"].measured_peak_bytes
    assert ":sac-" in by["selective"].plan


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_on_cuda(tiny, precision):
    spec = api.load(tiny, batch_size=8, seq_len=256, precision=precision)
    res = api.bench(spec, strategies=["none", "every-k", "dp"], budget="60%", k=2, steps=2, warmup=1,
                    device=DEVICE)
    _check(res)


def test_hf_gpt2_on_cuda(configs):
    pytest.importorskip("transformers")
    spec = api.load(configs / "hf-gpt2.yaml", batch_size=4, seq_len=512)
    res = api.bench(spec, strategies=["none", "every-k", "dp"], budget="60%", k=2, steps=2, warmup=1,
                    device=DEVICE)
    _check(res)


def test_meta_plan_runs_on_cuda_as_predicted(tiny, tmp_path):
    """A plan made on fake tensors for a CUDA target, run on the GPU: its peak as the meta pass
    said, the CUDA runtime's own blocks (cuBLAS workspaces) counted as this GPU's profile measured
    them (the device model's default is printed beside them)."""
    spec = api.load(tiny, batch_size=8, seq_len=256)
    runtime = api.profile(spec, device=DEVICE, repeats=1).totals.runtime_bytes
    rep = api.plan(spec, device="meta", budget="60%", strategy="dp")
    modelled = rep.profile.totals.runtime_bytes
    assert modelled > 0
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(rep.to_doc()))
    res = api.bench(spec, strategies=["none"], steps=1, warmup=1, device=DEVICE, plan_path=path)
    _show(res)
    row = next(r for r in res.rows if r.strategy.startswith("plan:"))
    assert row.status == "ok", row.message
    meta_peak = rep.chosen.score.peak_bytes - modelled + runtime
    print("meta predicted", meta_peak, "(runtime measured", runtime, "modelled", modelled, ") measured",
          row.measured_peak_bytes)
    assert abs(row.measured_peak_bytes - meta_peak) / row.measured_peak_bytes < PEAK_TOL


def test_compiled_layers_and_compile_peer_on_cuda(tiny):
    spec = api.load(tiny, batch_size=8, seq_len=256)
    res = api.bench(spec, strategies=["none", "dp", "torch-compile"], budget="60%", steps=2, warmup=1,
                    device=DEVICE, compile=True)
    _check(res)


def test_whole_model_compile_scope_on_cuda(tiny):
    """--compile-scope model on the allocator: every ckplan row one whole-model compile, its peak
    predicted from measured whole-model steps, gradients equal to the compiled none's."""
    spec = api.load(tiny, batch_size=8, seq_len=256)
    res = api.bench(spec, strategies=["none", "dp", "torch-compile"], budget="60%", steps=2, warmup=1,
                    device=DEVICE, compile_scope="model")
    _check(res)
    assert res.compile_scope == "model"


def test_one_nccl_rank(tiny):
    pytest.importorskip("torch.distributed.fsdp")
    import torch.distributed as dist
    if not dist.is_nccl_available():
        pytest.skip("no NCCL")
    spec = api.load(tiny, batch_size=8, seq_len=256)
    res = api.bench_distributed(spec, nproc=1, parallel="fsdp", strategies=["none", "every-k", "dp"],
                                budget="60%", k=2, steps=1, warmup=1, device=DEVICE, timeout_s=240)
    for r in res.rows:
        print(r)
    for r in res.rows:
        assert r.status == "ok", r.message
        assert abs(r.measured_peak_bytes - r.predicted_peak_bytes) / r.measured_peak_bytes < PEAK_TOL


def test_options_with_dropout_keep_the_gradients(tmp_path, tiny_gpt_spec, plan_grads):
    """Dropout in attention runs inside CUDA's fused attention kernel, which sac-compute keeps:
    ckplan's policies then keep the later random ops too (ckplan.sac.KeepLaterRandom), so every
    option, stored or nested in a checkpoint, gives the gradients of no checkpointing. torch's
    documented policy as is (the sac-policy peer) is printed, not asserted: on BERT-large on an
    H200 its gradients were off by 0.038."""
    from ckplan.planner import Plan
    from ckplan.planner.plan import Checkpoint, Store
    from ckplan.sac import POLICIES
    from ckplan.spec import build_model, make_batch

    path = tiny_gpt_spec(tmp_path, n_layer=2, n_embd=256, n_head=4, block_size=256, dropout=0.1)
    spec = api.load(path, batch_size=4, seq_len=256)
    model, batch = build_model(spec, DEVICE), make_batch(spec, DEVICE)

    def grads(plan):
        return plan_grads(model, batch, plan, DEVICE)[1]

    g0 = grads(None)
    tol = 1e-5 * max(g.abs().max().item() for g in g0.values()) + 1e-8
    plans = {opt: (Store(0, opt), Store(1, opt)) for opt in POLICIES}
    plans["nested"] = (Checkpoint(0, 2, (Store(0, "sac-compute"), Store(1, "sac-compute"))),)
    for name, items in plans.items():
        g = grads(Plan("custom", 2, items))
        worst = max((g0[n] - g[n]).abs().max().item() for n in g0)
        print(name, "max |dgrad|", worst, "tol", tol)
        assert worst <= tol, (name, worst, tol)
    from ckplan.peers import sac_policy
    with sac_policy(model):
        g = grads(None)
    print("sac-policy peer (torch's policy as is): max |dgrad|", max((g0[n] - g[n]).abs().max().item() for n in g0))


@pytest.mark.skipif(DEVICE != "cuda", reason="offload needs a CUDA device's host link")
def test_offload_plan_on_cuda(configs, tmp_path):
    """A plan that offloads layers 0..10 of gpt2-small at 8 x 512 (the last one stored): the
    gradients of no checkpointing (the bench's check), the peak predicted within PEAK_TOL and below
    none's; then dp at 50%act, offloading where the profile's host link says it is faster."""
    from ckplan.planner.plan import OFFLOAD, STORE, Plan, Store
    spec = api.load(configs / "gpt2-small.yaml", batch_size=8, seq_len=512)
    plan = Plan("offload", 12, tuple(Store(i, OFFLOAD if i < 11 else STORE) for i in range(12)))
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan.to_dict()))
    res = api.bench(spec, strategies=["none", "dp"], budget="50%act", plan_path=path, steps=3, warmup=1,
                    device=DEVICE)
    _check(res)
    by = {r.strategy: r for r in res.rows}
    assert by["plan:offload"].measured_peak_bytes < by["none"].measured_peak_bytes


@pytest.mark.skipif(DEVICE != "cuda", reason="offload needs a CUDA device's host link")
def test_offload_release_points_on_cuda(configs, tmp_path):
    """The plan offloading layers 0..10, once with every copy released at the next layer's forward
    and once with its copies queued (release points from the profile): both peaks predicted within
    PEAK_TOL (the device bytes follow the release points), gradients of no checkpointing, and the
    queued plan's held-for-backward bytes no higher."""
    from ckplan.planner.plan import OFFLOAD, RELEASE, STORE, Plan, Store
    spec = api.load(configs / "gpt2-small.yaml", batch_size=8, seq_len=512)
    items = tuple(Store(i, OFFLOAD if i < 11 else STORE) for i in range(12))
    rows = {}
    for name, params in (("next", {RELEASE: {i: i + 1 for i in range(11)}}), ("queued", {})):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(Plan(name, 12, items, params).to_dict()))
        res = api.bench(spec, strategies=["none"], plan_path=path, steps=3, warmup=1, device=DEVICE)
        _check(res)
        rows[name] = next(r for r in res.rows if r.strategy == f"plan:{name}")
    assert rows["next"].offload_release == " ".join(f"{i}:{i + 1}:{i + 1}" for i in range(11))
    assert rows["queued"].predicted_activation_bytes <= rows["next"].predicted_activation_bytes


def test_offload_peers_on_cuda(configs):
    """offload-all (every tensor the chain layers save in pinned host memory) and offload-attn (the
    attention blocks' only) on gpt2-small at 8 x 512: the gradients of no checkpointing (the
    bench's check) and peaks below none's, offload-all's the lowest."""
    spec = api.load(configs / "gpt2-small.yaml", batch_size=8, seq_len=512)
    res = api.bench(spec, strategies=["none", "every-k", "offload-all", "offload-attn"], k=1, steps=2, warmup=1,
                    device=DEVICE)
    _check(res)
    by = {r.strategy: r for r in res.rows}
    for peer in ("offload-all", "offload-attn"):
        assert by[peer].max_grad_diff is not None
        assert by[peer].measured_peak_bytes < by["none"].measured_peak_bytes
    assert by["offload-all"].measured_peak_bytes < by["offload-attn"].measured_peak_bytes
