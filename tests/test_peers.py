"""Peers in the bench (hf, sac-policy, torch-compile) and the timing-noise rule."""
import shutil

import pytest
import torch
from rich.console import Console

from ckplan import api
from ckplan.api import profile_model
from ckplan.bench import compiled_rows, profiled_step_memory, run_bench, within_noise
from ckplan.peers import budget_fraction
from ckplan.render import bench_table


@pytest.fixture
def run_peers(tiny_gpt_spec, tmp_path):
    """``run_peers(strategies) -> (model, BenchResult)`` on a 3-layer zoo GPT."""
    return lambda strategies: _run_peers(tiny_gpt_spec(tmp_path, n_layer=3, n_embd=32), strategies)


def _run_peers(spec_path, strategies):
    spec = api.load(spec_path, batch_size=4, seq_len=16)
    dev = torch.device("cpu")
    torch.manual_seed(0)
    model = api.build_model(spec, "cpu")
    batch = api.make_batch(spec, "cpu")
    prof = profile_model(model, *batch, name="tiny", chain=spec.chain, device=dev,
                         optimizer=spec.train.optimizer, precision=spec.train.precision,
                         accum=spec.train.accum, lr=spec.train.lr, spec=spec.model_dump(mode="json"))
    return model, run_bench(model, batch, api.to_loss, prof, strategies=strategies, budget_bytes=None, k=1,
                            steps=2, warmup=1, device=dev, lr=spec.train.lr)


def test_hf_and_sac_rows_gradients_and_peak_order(run_peers):
    model, res = run_peers(["none", "every-k", "hf", "sac-policy"])
    rows = {r.strategy: r for r in res.rows}
    for r in res.rows:
        assert r.status == "ok", r
        assert r.max_grad_diff is not None and r.max_grad_diff <= r.grad_tolerance
        assert r.loss == pytest.approx(rows["none"].loss, rel=1e-6)
    assert rows["hf"].kind == rows["sac-policy"].kind == "peer" and rows["none"].kind == "ckplan"
    none, k1 = rows["none"].measured_peak_bytes, rows["every-k"].measured_peak_bytes
    sac, hf = rows["sac-policy"].measured_peak_bytes, rows["hf"].measured_peak_bytes
    # hf is per-layer checkpointing: every-k k=1's peak and prediction.
    assert hf == k1 and rows["hf"].predicted_peak_bytes == rows["every-k"].predicted_peak_bytes
    # SAC keeps the matmul outputs: between full per-layer recomputation and none, strictly inside.
    assert k1 < sac < none, (k1, sac, none)
    assert rows["sac-policy"].predicted_peak_bytes is None
    # The layers are restored: no forward left wrapped.
    assert all("forward" not in b.__dict__ for b in model.blocks)
    con = Console(record=True, width=250)
    bench_table(res, wide=True, console=con)
    assert "sac-policy" in con.export_text()


@pytest.mark.parametrize("times, ref, expect", [
    ([10.0, 10.0, 10.0], [10.0, 10.0, 10.0], True),          # identical
    ([9.0, 11.0, 10.0], [10.0, 10.0, 10.0], True),           # straddles 1: noise
    ([9.2, 9.1, 9.3], [10.0, 10.0, 10.0], False),            # faster every round: real
    ([13.0, 12.5, 14.0], [10.0, 10.0, 10.0], False),         # slower every round: real
    ([12.0, 12.0], [11.0, 13.0], True),                      # ref varies across it
    ([], [10.0], False),                                     # nothing paired: not judged
])
def test_within_noise_rule(times, ref, expect):
    noisy, lo, hi = within_noise(times, ref)
    assert noisy is expect
    if times:
        assert lo == min(t / r for t, r in zip(times, ref)) and hi == max(t / r for t, r in zip(times, ref))


def test_budget_fraction():
    assert budget_fraction(None, 100, 300) == 1.0
    assert budget_fraction(200, 100, 300) == 0.5
    assert budget_fraction(50, 100, 300) == 0.0 and budget_fraction(900, 100, 300) == 1.0


def test_torch_compile_rows_say_why_when_unavailable(run_peers, monkeypatch):
    # No compiler: both rows are unavailable with the reason and the budget, the others run.
    monkeypatch.setattr(compiled_rows, "compile_unavailable", lambda device_type: "no C++ compiler on PATH (test)")
    _, res = run_peers(["none", "torch-compile", "torch-compile-nobudget"])
    rows = {r.strategy: r for r in res.rows}
    assert rows["none"].status == "ok"
    for name in ("torch-compile", "torch-compile-nobudget"):
        r = rows[name]
        assert r.kind == "peer" and r.status == "unavailable" and r.measured_peak_bytes is None
        assert r.message.startswith("activation_memory_budget ") and "no C++ compiler on PATH (test)" in r.message
    assert rows["torch-compile-nobudget"].message.startswith("activation_memory_budget 1.00")


def test_compile_unavailable_says_why(monkeypatch):
    import ckplan.peers as peers
    assert peers.compile_unavailable("meta").startswith("TorchInductor does not compile for device 'meta'")
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert peers.compile_unavailable("cpu").startswith("no C++ compiler on PATH")


def test_a_failing_compiler_makes_the_row_unavailable(run_peers, monkeypatch):
    # The backend raising (a broken toolchain) is a row that says why, never a traceback.
    from ckplan.peers import CompiledPeer

    def broken(self, gm, example_inputs):
        self.graphs += 1
        raise OSError("cc1plus: fatal error (test)")
    monkeypatch.setattr(CompiledPeer, "_backend", broken)
    # torch's config modules keep their settings off the module __dict__: monkeypatch (pytest 9.2)
    # would delete the setting on undo, and every later torch.compile in the process would fail
    with torch._dynamo.config.patch(suppress_errors=False):
        _, res = run_peers(["none", "torch-compile"])
    r = {r.strategy: r for r in res.rows}["torch-compile"]
    assert r.status == "unavailable" and "torch.compile failed here" in r.message and "cc1plus" in r.message


def test_profiled_step_memory_replays_allocations():
    # Analytic: 4 KB live at the forward mark, 12 KB peak before the backward mark, 20 KB after it.
    def step(after_forward, after_backward):
        a = torch.empty(1000)
        after_forward()
        b = torch.empty(2000)
        del a
        after_backward()
        c = torch.empty(3000)
        del b, c
    m = profiled_step_memory(step)
    assert (m.after_forward, m.fwd_bwd_peak, m.peak) == (4000, 12000, 20000)


def test_shared_copy_shares_parameters_and_buffers():
    from ckplan.peers import shared_copy
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3))
    c = shared_copy(model)
    assert c is not model and c[0] is not model[0]
    assert all(a is b for a, b in zip(model.parameters(), c.parameters()))
    assert all(a is b for a, b in zip(model.buffers(), c.buffers()))


@pytest.mark.slow
def test_torch_compile_rows_run_with_gradients_in_tolerance(run_peers):
    model, res = run_peers(["none", "torch-compile", "torch-compile-nobudget"])
    rows = {r.strategy: r for r in res.rows}
    for name in ("torch-compile", "torch-compile-nobudget"):
        r = rows[name]
        assert r.status == "ok", r.message
        assert r.kind == "peer" and r.plan.startswith("torch.compile, budget")
        assert r.max_grad_diff is not None and r.max_grad_diff <= r.grad_tolerance
        assert r.measured_peak_bytes > 0 and r.measured_activation_bytes > 0 and r.step_ms > 0
        assert "compiled" in r.message and "PyTorch profiler" in r.message
    # The budget (below 1: the bench's default lies between the smallest peak and none's) makes the
    # partitioner save less for the backward than it does at budget 1.0.
    frac = float(rows["torch-compile"].plan.split()[-1])
    assert frac < 1.0
    assert (rows["torch-compile"].measured_activation_bytes
            < rows["torch-compile-nobudget"].measured_activation_bytes)
    # The profiler and the live-tensor tracker agree on the eager step (the note gives both).
    note = next(n for n in res.notes if n.startswith("torch-compile rows' memory"))
    assert f"{rows['none'].measured_peak_bytes} bytes (live-tensor tracker: " in note
    assert note.endswith(f"(live-tensor tracker: {rows['none'].measured_peak_bytes})")
    # The model itself was never compiled or changed: the same parameters, no plan left on it.
    assert not isinstance(model, torch._dynamo.eval_frame.OptimizedModule)
    assert all("forward" not in b.__dict__ for b in model.blocks)


@pytest.mark.slow
def test_hf_peer_calls_the_models_own_checkpointing(write_spec, tmp_path):
    pytest.importorskip("transformers")
    spec = api.load(write_spec(tmp_path, """
model:
  hf: {model_type: gpt2, n_layer: 2, n_head: 2, n_embd: 32, n_positions: 32, vocab_size: 97, use_cache: false}
  task: causal-lm
input: {batch_size: 2, shape: [16], dtype: int64, high: 97, name: input_ids, labels: copy}
train: {optimizer: sgd, precision: fp32, accum: 1}
""", "hf-tiny.yaml"))
    dev = torch.device("cpu")
    model = api.build_model(spec, "cpu")
    batch = api.make_batch(spec, "cpu")
    prof = profile_model(model, *batch, name="hf-tiny", chain=spec.chain, device=dev, optimizer="sgd",
                         precision="fp32", accum=1, lr=spec.train.lr, spec=spec.model_dump(mode="json"))
    res = run_bench(model, batch, api.to_loss, prof, strategies=["none", "every-k", "hf"], budget_bytes=None,
                    k=1, steps=1, warmup=1, device=dev, lr=spec.train.lr)
    rows = {r.strategy: r for r in res.rows}
    assert rows["hf"].status == "ok" and "activation_checkpointing_enable" in rows["hf"].message
    assert rows["hf"].max_grad_diff <= rows["hf"].grad_tolerance
    assert rows["hf"].measured_peak_bytes < rows["none"].measured_peak_bytes
    assert not model.is_activation_checkpointing  # disabled again


def test_hf_peer_leaves_frozen_embeddings_as_they_were(write_spec, tmp_path):
    """Hugging Face's checkpointing hooks the input embeddings so that their output requires grad
    (for LoRA and other frozen-embedding fine-tuning) and its disable leaves the hook. With frozen
    embeddings that hook makes the chain input require grad: none, measured after the hf row's
    gradient run, was 132,096 B above its prediction (the chain input's gradient and more)."""
    pytest.importorskip("transformers")
    spec = api.load(write_spec(tmp_path, """
model:
  hf: {model_type: llama, hidden_size: 64, intermediate_size: 128, num_hidden_layers: 3, num_attention_heads: 4,
       num_key_value_heads: 2, vocab_size: 128, max_position_embeddings: 64, use_cache: false}
  task: causal-lm
input: {batch_size: 2, shape: [32], dtype: int64, high: 128, name: input_ids, labels: copy}
train: {optimizer: sgd, precision: fp32}
""", "frozen.yaml"))
    dev = torch.device("cpu")
    torch.manual_seed(0)
    model = api.build_model(spec, "cpu")
    model.get_input_embeddings().weight.requires_grad_(False)
    batch = api.make_batch(spec, "cpu")
    prof = profile_model(model, *batch, name="frozen", chain=spec.chain, device=dev, optimizer="sgd",
                         precision="fp32", accum=1, lr=spec.train.lr, repeats=1, warmup=0, options=())
    res = run_bench(model, batch, api.to_loss, prof, strategies=["none", "every-k", "hf"], budget_bytes=None,
                    k=2, steps=1, warmup=0, device=dev, lr=spec.train.lr)
    rows = {r.strategy: r for r in res.rows}
    assert rows["hf"].status == "ok" and rows["hf"].max_grad_diff == 0.0
    # the rows' memory steps run after every row's gradient run: none's after hf's
    for name in ("none", "every-k"):
        assert rows[name].measured_peak_bytes == rows[name].predicted_peak_bytes, name
    ids = batch[1]["input_ids"]
    assert not model.get_input_embeddings()(ids).requires_grad


def test_cli_runs_peers_beside_strategies(tiny_gpt_spec, tmp_path, monkeypatch):
    import json

    from typer.testing import CliRunner

    from ckplan.cli import app
    from ckplan.options import PEERS
    from ckplan.peers import COMPILE_PEERS, PEER_NAMES
    assert set(PEERS) == set(PEER_NAMES) | set(COMPILE_PEERS)
    # Compiling is slow (the slow test runs it); here the row only has to be there and say why.
    monkeypatch.setattr(compiled_rows, "compile_unavailable", lambda device_type: "not compiled in this test")
    r = CliRunner().invoke(app, ["bench", str(tiny_gpt_spec(tmp_path)), "--device", "cpu", "--steps", "1",
                                 "--compare", "none,every-k,hf,sac-policy,torch-compile", "--k", "1",
                                 "--out-dir", str(tmp_path / "out"), "-f", "json"])
    assert r.exit_code == 0, r.output
    rows = {row["strategy"]: row for row in json.loads(r.stdout)["rows"]}
    assert rows["hf"]["kind"] == "peer" and rows["hf"]["status"] == "ok"
    assert rows["sac-policy"]["status"] == "ok" and rows["torch-compile"]["status"] == "unavailable"
    assert rows["hf"]["measured_peak_bytes"] == rows["every-k"]["measured_peak_bytes"]


@pytest.mark.slow
def test_torch_compile_rows_with_dropout_match_eager_gradients(tiny_gpt_spec, tmp_path):
    """Compiled dropout would draw other masks than eager; the rows keep eager's random ops
    (inductor's fallback_random), so the gradient check compares like with like."""
    _, res = _run_peers(tiny_gpt_spec(tmp_path, n_layer=2, n_embd=32, dropout=0.1),
                        ["none", "torch-compile"])
    r = {r.strategy: r for r in res.rows}["torch-compile"]
    assert r.status == "ok", r.message
    assert r.max_grad_diff <= r.grad_tolerance


@pytest.mark.parametrize("peer", ["offload-all", "offload-attn"])
def test_offload_peers_are_refused_on_a_cpu(tiny_gpt_spec, tmp_path, peer):
    """Offloading to host memory needs a device that is not the host: one clear message, before
    anything is built."""
    from ckplan.errors import UsageError
    spec = api.load(tiny_gpt_spec(tmp_path))
    with pytest.raises(UsageError, match=f"{peer} needs a CUDA device") as e:
        api.bench(spec, strategies=["none", peer], device="cpu", steps=1, warmup=0)
    assert "--device cuda" in e.value.tip


def test_a_plan_that_offloads_is_refused_on_a_cpu(tiny_gpt_spec, tmp_path):
    """A plan file with offloaded layers (made for a GPU) benched on a CPU: one clear message."""
    import json

    from ckplan.errors import UsageError
    from ckplan.planner.plan import OFFLOAD, Plan, Store
    spec = api.load(tiny_gpt_spec(tmp_path))
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(Plan("dp", 3, (Store(0, OFFLOAD), Store(1), Store(2))).to_dict()))
    with pytest.raises(UsageError, match="offloads layers to host memory, which needs a CUDA device"):
        api.bench(spec, strategies=["none"], device="cpu", plan_path=path, steps=1, warmup=0)


def test_offload_hooks_leave_cpu_tensors_and_gradients_alone():
    """On a CPU the hooks keep every saved tensor as it is: the same gradients, nothing offloaded."""
    from ckplan.execute.offload import OffloadHooks, layers_offloaded
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
    x = torch.randn(32, 64)
    net(x).square().sum().backward()
    ref = [p.grad.clone() for p in net.parameters()]
    net.zero_grad()
    with layers_offloaded(list(net)):
        net(x).square().sum().backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(ref, net.parameters()))
    hooks = OffloadHooks(min_bytes=0)
    with hooks:
        net(x).sum().backward()
    assert hooks.offloaded_bytes == 0


@pytest.mark.parametrize("prefetch", [False, True])
def test_offload_hooks_unpack_views_of_one_storage(monkeypatch, prefetch):
    """Three saved tensors of one storage (``exp`` saves ``b``, ``b[:2] * b[2:]`` both halves) are
    copied out once and unpacked three times, on demand or after a prefetch: the gradients of no offload, and after
    the backward no copy back, no host copy and no use left (CPU tensors treated as a GPU's)."""
    import ckplan.execute.offload as offload
    monkeypatch.setattr(offload, "DEVICE_TYPES", ("cuda", "cpu"))
    a = torch.randn(4, 64, requires_grad=True)

    def loss():
        b = a.exp()
        return (b[:2] * b[2:]).square().sum()

    loss().backward()
    ref, a.grad = a.grad.clone(), None
    hooks = offload.OffloadHooks(min_bytes=0)
    with hooks:
        out = loss()
    # b's storage copied once for three saved tensors (exp's output, the two halves), the product once
    assert sorted(p.uses for p in hooks.packed) == [1, 3]
    if prefetch:
        hooks.prefetch()
    out.backward()
    assert torch.equal(a.grad, ref)
    assert hooks.prefetched == prefetch
    assert all(p.uses == 0 and p.back is None and p.host is None for p in hooks.packed)


def test_a_second_backward_over_offloaded_tensors_is_one_clear_error(monkeypatch):
    """Offloaded host copies are released at their last use, so ``backward(retain_graph=True)``
    followed by a second backward is refused with ModelRunError naming the fix."""
    import ckplan.execute.offload as offload
    from ckplan.errors import ModelRunError
    monkeypatch.setattr(offload, "DEVICE_TYPES", ("cuda", "cpu"))
    a = torch.randn(4, 64, requires_grad=True)
    with offload.OffloadHooks(min_bytes=0):
        out = a.exp().square().sum()
    out.backward(retain_graph=True)
    with pytest.raises(ModelRunError, match=r"retain_graph=True.*--no-offload"):
        out.backward()


def _step_grads(model, ids):
    for p in model.parameters():
        p.grad = None
    out = model(ids, labels=ids)
    getattr(out, "loss", out).backward()  # a Hugging Face model returns an output object with .loss
    return [p.grad.clone() for p in model.parameters()]


def test_offload_attn_moves_what_attention_saves_and_keeps_gradients(monkeypatch):
    """offload-attn (Megatron-style), its hooks run on CPU tensors treated as a GPU's: the gradients
    are no checkpointing's, bit for bit, and each attention block but the last layer's offloads, to
    the byte, what a GPT attention saves besides its input: the fused q/k/v projection's output
    (q, k and v are views of it), the attention output with its log-sum-exp, and the merged heads
    (the output projection's input; a view of the attention output, which the CPU's attention
    kernel lays out as (B, T, heads, head dim)), each storage once."""
    import ckplan.execute.offload as offload
    from ckplan.peers import attention_blocks, offload_attention
    from ckplan.zoo.gpt import build_gpt

    monkeypatch.setattr(offload, "DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(offload, "MIN_BYTES", 0)
    B, T, C, nh, V, L = 2, 16, 32, 4, 50, 3
    torch.manual_seed(0)
    model = build_gpt(vocab_size=V, block_size=T, n_layer=L, n_head=nh, n_embd=C, dropout=0.0)
    assert all(attention_blocks(b) == [b.attn] for b in model.blocks)
    ids = torch.randint(0, V, (B, T))
    plain = _step_grads(model, ids)
    hooks: list = []
    with offload_attention(model, "blocks", hooks=hooks):
        moved = _step_grads(model, ids)
    assert all(torch.equal(a, b) for a, b in zip(plain, moved))
    f = 4  # fp32
    per_block = B * T * 3 * C * f + B * T * C * f + B * nh * T * f
    assert [h.offloaded_bytes for h in hooks] == [per_block] * (L - 1)
    assert all(p.back is None for h in hooks for p in h.packed)  # every copy back dropped after use


def test_attention_blocks_of_hugging_face_layers():
    """The outermost attention block of each layer: Llama's self_attn, BERT's BertAttention (not
    the BertSelfAttention inside it); an MLP has none, and offload-attn says so."""
    transformers = pytest.importorskip("transformers")
    from ckplan.errors import UsageError
    from ckplan.peers import attention_blocks, offload_attention

    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2))
    assert [type(m).__name__ for m in attention_blocks(llama.model.layers[0])] == ["LlamaAttention"]
    bert = transformers.BertModel(transformers.BertConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4))
    assert [type(m).__name__ for m in attention_blocks(bert.encoder.layer[0])] == ["BertAttention"]
    mlp = torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in range(3)))
    assert attention_blocks(mlp[0]) == []
    with pytest.raises(UsageError, match="no attention block in chain layer Linear"):
        offload_attention(torch.nn.Sequential(mlp), "0")


def test_offload_attn_on_a_hugging_face_llama_keeps_gradients(monkeypatch):
    """A model ckplan did not write, whose attention takes the rotary pair as a keyword argument
    (kept on the device as an input): offload-attn's gradients are no checkpointing's."""
    transformers = pytest.importorskip("transformers")
    import ckplan.execute.offload as offload
    from ckplan.peers import offload_attention

    monkeypatch.setattr(offload, "DEVICE_TYPES", ("cuda", "cpu"))
    torch.manual_seed(0)
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, attn_implementation="sdpa"))
    ids = torch.randint(0, 64, (2, 16))
    plain = _step_grads(llama, ids)
    hooks: list = []
    with offload_attention(llama, "model.layers", hooks=hooks):
        moved = _step_grads(llama, ids)
    assert len(hooks) == 2 and all(h.offloaded_bytes > 0 for h in hooks)
    assert all(torch.equal(a, b) for a, b in zip(plain, moved))


@pytest.mark.slow  # ten TorchInductor compiles of a small MLP: about half a minute on 2 cores
def test_many_compiled_copies_of_one_model_each_compile():
    # every copy is one more cache entry of the same forward code; past Dynamo's default
    # recompile limit (8) the next copy would run eagerly without a word
    from ckplan.peers import CompiledPeer, compile_unavailable
    if compile_unavailable("cpu"):
        pytest.skip(compile_unavailable("cpu"))
    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    x = torch.randn(8, 16)
    for i in range(10):
        peer = CompiledPeer(model, 1.0 - 0.05 * i)
        with peer.compiling():
            peer.module(x).sum().backward()
        assert peer.graphs == 1, i


def test_hf_row_where_only_some_chain_layers_checkpoint_is_predicted_as_they_do(write_spec, tmp_path):
    """MobileViT-v2's chain holds MobileNet blocks and MobileViT blocks; only the latter are
    GradientCheckpointingLayers, so Hugging Face checkpoints those alone. Predicted as every-k
    k=1 the row measured 38% above its prediction; predicted as what it runs, exact."""
    pytest.importorskip("transformers")
    spec = api.load(write_spec(tmp_path, """
model:
  hf: {model_type: mobilevitv2, image_size: 64, n_attn_blocks: [1, 2, 1], base_attn_unit_dims: [32, 48, 64],
       width_multiplier: 0.5, num_labels: 10}
  task: image-classification
input: {batch_size: 2, shape: [3, 64, 64], dtype: float32, name: pixel_values, labels: {shape: [], high: 10}}
train: {optimizer: sgd, precision: fp32}
""", "mvit.yaml"))
    res = api.bench(spec, strategies=["none", "hf"], k=1, device="cpu", steps=1, warmup=0)
    hf = {r.strategy: r for r in res.rows}["hf"]
    assert hf.status == "ok" and hf.max_grad_diff == 0.0
    assert hf.plan == "S0 S1 C[2,3){S2} C[3,4){S3} C[4,5){S4}", hf.plan
    assert hf.measured_peak_bytes == hf.predicted_peak_bytes


def test_sac_policy_row_on_in_place_blocks_says_why_and_the_fix():
    """A block ``Linear -> ReLU(inplace=True)`` (torchvision's and timm's CNNs): torch's policy
    keeps the Linear's output, the ReLU changes it, and torch refuses. The row says so, with the fix."""
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.blocks = torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(inplace=True))
                                         for _ in range(3)))
    model.forward = model.blocks.forward
    x = torch.randn(8, 16)
    dev = torch.device("cpu")
    prof = profile_model(model, (x,), {}, name="inplace", chain="blocks", device=dev, optimizer="sgd",
                         repeats=1, warmup=0, options=())
    res = run_bench(model, ((x,), {}), api.to_loss, prof, strategies=["none", "sac-policy"], budget_bytes=None,
                    k=1, steps=1, warmup=0, device=dev, lr=1e-3)
    rows = {r.strategy: r for r in res.rows}
    assert rows["none"].status == "ok"
    assert rows["sac-policy"].status == "error"
    assert rows["sac-policy"].message.startswith("torch's selective checkpointing cannot run this model")
    assert "inplace=False" in rows["sac-policy"].message and "mutated" in rows["sac-policy"].message


def test_hf_row_names_checkpointed_blocks_nested_in_chain_layers(write_spec, tmp_path):
    # Zamba2's hybrid layers (GradientCheckpointingLayers) run their Mamba layer, another one, in a
    # checkpoint inside theirs: that inner call keeps its arguments made in the layer until its
    # backward (measured +29,184 B on a 4-layer Zamba2), which the hf row's prediction leaves out.
    transformers = pytest.importorskip("transformers")
    if int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip("Zamba2's layer types are named differently before transformers 5")
    from ckplan.bench.peer_rows import _hf_nested
    spec = api.load(write_spec(tmp_path, """
model:
  hf: {model_type: zamba2, hidden_size: 64, num_hidden_layers: 4, num_attention_heads: 4, num_key_value_heads: 4,
       vocab_size: 97, max_position_embeddings: 64, use_cache: false, intermediate_size: 128,
       layers_block_type: [linear_attention, hybrid, linear_attention, hybrid], mamba_d_state: 16,
       n_mamba_heads: 4, chunk_size: 32, adapter_rank: 8}
  task: causal-lm
input: {batch_size: 1, shape: [32], dtype: int64, high: 97, name: input_ids, labels: copy}
train: {optimizer: sgd, precision: fp32, accum: 1}
""", "zamba2.yaml"))
    model = api.build_model(spec, "cpu")
    nested = _hf_nested(model, "model.layers")
    if not nested:
        pytest.skip("this transformers checkpoints no block inside Zamba2's layers")
    assert nested == {1: "Zamba2MambaDecoderLayer", 3: "Zamba2MambaDecoderLayer"}
    gpt2 = api.build_model(api.load(write_spec(tmp_path, """
model:
  hf: {model_type: gpt2, n_layer: 2, n_head: 2, n_embd: 32, n_positions: 32, vocab_size: 97, use_cache: false}
  task: causal-lm
input: {batch_size: 2, shape: [16], dtype: int64, high: 97, name: input_ids, labels: copy}
train: {optimizer: sgd, precision: fp32, accum: 1}
""", "gpt2.yaml")), "cpu")
    assert _hf_nested(gpt2, "transformer.h") == {}
