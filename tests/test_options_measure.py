"""Selective options in the profile: analytic kept bytes, predicted vs measured peaks, meta == cpu,
calibration, dominance, JSON compatibility and the CLI.

Oracles: an MLP layer under ``sac-compute`` keeps its two matmul outputs and its output (by hand from
the shapes); ``sac-linear`` on an attention layer recomputes its two batched matmuls (their FLOPs by
hand); plans storing layers with options, some checkpointed, predict the peak that the bench
measures on the same model within 1%.
"""
import dataclasses
import json

import pytest
import torch
import torch.nn as nn
from typer.testing import CliRunner

from ckplan import api
from ckplan.bench import run_bench
from ckplan.cli import app
from ckplan.planner import Checkpoint, Plan, Store, chain_from_profile, plan_none, simulate
from ckplan.planner.calibrate import TIE_BYTES, undominated
from ckplan.planner.chain import Layer, Option
from ckplan.records import Profile
from ckplan.spec import build_model, make_batch, to_loss

B, D, H = 8, 32, 96


class Mlp(nn.Module):
    """x + fc2(gelu(fc1(x)))."""

    def __init__(self, d=D, h=H):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(d, h), nn.GELU(), nn.Linear(h, d)

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(x)))


class Attn(nn.Module):
    """Single-head attention written out: linear q/k/v, bmm, softmax, bmm, linear out."""

    def __init__(self, d=D):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x):
        s = self.q(x) @ self.k(x).transpose(1, 2)
        return x + self.o(torch.softmax(s, dim=-1) @ self.v(x))


class Stack(nn.Module):
    def __init__(self, block, n=3, d_in=16):
        super().__init__()
        self.inp = nn.Linear(d_in, D)
        self.blocks = nn.ModuleList([block() for _ in range(n)])

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return x


def _profile(model, x, device="cpu", options=True):
    return api.profile_model(model.to(device), (x.to(device),), {}, name="m", chain="blocks", device=device,
                             repeats=1, warmup=0, options=options)


def test_mlp_options_keep_bytes_by_hand():
    torch.manual_seed(0)
    prof = _profile(Stack(Mlp), torch.randn(B, 16))
    for r in prof.chain_layers:
        # sac-compute and sac-linear: fc1's and fc2's outputs (the matmuls) and the block's output;
        # GELU's output (fc2's input, which plain autograd keeps) is recomputed.
        assert r.option("sac-compute").saved_bytes == 4 * B * (H + D + D)
        assert r.option("sac-linear").saved_bytes == 4 * B * (H + D + D)
        # sac-attn (no attention here) keeps every op's output: fc1, GELU, fc2, the sum.
        assert r.option("sac-attn").saved_bytes == 4 * B * (H + H + D + D)
        # pointwise ops only are recomputed: no FLOPs
        assert all(o.recompute_flops == 0 for o in r.options)
    assert [o.name for o in prof.chain_layers[0].options] == ["sac-compute", "sac-linear", "sac-attn"]
    assert prof.pre.options == () and prof.post.options == ()


def test_attention_sac_linear_recomputes_the_two_bmms():
    torch.manual_seed(0)
    T = 12
    prof = _profile(Stack(Attn, n=2), torch.randn(2, T, 16), options=["sac-linear", "sac-compute"])
    for r in prof.chain_layers:
        assert r.option("sac-linear").recompute_flops == 2 * (2 * 2 * T * T * D)  # q @ k^T and p @ v
        assert r.option("sac-compute").recompute_flops == 0  # keeps the bmm outputs
        # sac-compute keeps q, k, v, scores, p @ v, the o projection and the output; softmax's
        # output (which plain autograd keeps) is recomputed.
        assert r.option("sac-compute").saved_bytes == 4 * 2 * T * (5 * D + T + D)


def test_meta_sizes_equal_cpu():
    torch.manual_seed(0)
    cpu = _profile(Stack(Mlp), torch.randn(B, 16))
    meta = _profile(Stack(Mlp), torch.randn(B, 16), device="meta")
    for a, b in zip(cpu.chain_layers, meta.chain_layers):
        for oa, ob in zip(a.options, b.options):
            assert (oa.name, oa.saved_bytes, oa.fwd_peak_bytes, oa.bwd_peak_bytes, oa.recompute_flops) == \
                   (ob.name, ob.saved_bytes, ob.fwd_peak_bytes, ob.bwd_peak_bytes, ob.recompute_flops)
        assert all(o.recompute_ms == 0.0 for o in b.options)  # meta time = FLOPs at the assumed rate


def _keep_all(prof: Profile) -> Profile:
    """The profile with each option's recompute time made tiny and proportional to the bytes it
    frees: on a loaded CPU a tiny layer's recompute is mostly checkpoint overhead, so the planner
    would drop every option as slower than ``full``; the peaks tested here do not depend on time."""
    def fix(r):
        return dataclasses.replace(r, options=tuple(
            dataclasses.replace(o, recompute_ms=1e-9 * max(0, r.saved_bytes - o.saved_bytes)) for o in r.options))
    return dataclasses.replace(prof, layers=tuple(fix(r) for r in prof.layers))


def _bench_rows(model, batch, prof, plans):
    res = run_bench(model, batch, to_loss, prof, strategies=["none", "sac-policy"], budget_bytes=None, k=2,
                    steps=1, warmup=0, device=torch.device("cpu"), lr=1e-4, extra_plans=plans)
    return {r.strategy.split(":", 1)[-1]: r for r in res.rows}


def _assert_close(row, predicted=None):
    assert row.status == "ok", row.message
    predicted = row.predicted_peak_bytes if predicted is None else predicted
    assert abs(predicted - row.measured_peak_bytes) <= 0.01 * row.measured_peak_bytes, row
    if row.predicted_fwd_bwd_peak_bytes is not None:
        assert abs(row.predicted_fwd_bwd_peak_bytes - row.measured_fwd_bwd_peak_bytes) \
            <= 0.01 * row.measured_fwd_bwd_peak_bytes, row


@pytest.mark.slow
def test_tiny_gpt_option_plans_predicted_vs_measured(tiny_gpt_spec, tmp_path):
    spec = api.load(tiny_gpt_spec(tmp_path, n_layer=4))
    torch.manual_seed(0)
    model, batch = build_model(spec, "cpu"), make_batch(spec, "cpu")
    prof = _keep_all(api.profile_model(model, *batch, name="g", chain="blocks", device="cpu", repeats=1,
                                       warmup=0, options=True))
    chain = chain_from_profile(prof)
    kept = [{o.name for o in ly.options} for ly in chain.layers]
    # With recompute times proportional to the bytes freed, an option survives exactly when it keeps
    # less than store by more than a near tie (sac-attn keeps nearly all of it: a few hundred bytes
    # less, or more, for next to no recompute, so it is store within the noise).
    for r, k in zip(prof.chain_layers, kept):
        assert {"sac-compute", "sac-linear"} <= k
        attn = r.option("sac-attn").saved_bytes
        assert ("sac-attn" in k) == (r.saved_bytes - attn > TIE_BYTES * attn)
    n = chain.n_layers
    plans = {
        "all-sac-compute": plan_none(n).with_options(["sac-compute"] * n),
        "all-sac-linear": plan_none(n).with_options(["sac-linear"] * n),
        "mixed": Plan("mixed", n, (Store(0, "sac-compute"), Checkpoint(1, 3, (Store(1), Store(2))),
                                   Store(3, "sac-linear")), {}),
        "mixed2": Plan("mixed2", n, (Checkpoint(0, 2, (Store(0), Store(1))), Store(2, "sac-linear"),
                                     Store(3)), {}),
    }
    rows = _bench_rows(model, batch, prof, plans)
    for name in plans:
        _assert_close(rows[name])
    none = rows["none"]
    assert rows["all-sac-linear"].measured_fwd_bwd_peak_bytes < none.measured_fwd_bwd_peak_bytes
    # the sac-policy peer (sac-compute on every layer, wrapped as ckplan.peers does) is predicted
    # by the all-sac-compute plan
    _assert_close(rows["sac-policy"], simulate(chain, plans["all-sac-compute"]).peak_bytes)


def test_mlp_option_plans_predicted_vs_measured():
    torch.manual_seed(0)
    model, batch = Stack(Mlp, n=4), ((torch.randn(64, 16),), {})
    prof = _keep_all(api.profile_model(model, *batch, name="mlp", chain="blocks", device="cpu", repeats=1,
                                       warmup=0, options=["sac-compute"]))
    n = 4
    plans = {"all-sac-compute": plan_none(n).with_options(["sac-compute"] * n),
             "mixed": Plan("mixed", n, (Store(0, "sac-compute"), Checkpoint(1, 3, (Store(1), Store(2))),
                                        Store(3)), {})}
    rows = _bench_rows(model, batch, prof, plans)
    for name in plans:
        _assert_close(rows[name])
    chain = chain_from_profile(prof)
    _assert_close(rows["sac-policy"], simulate(chain, plans["all-sac-compute"]).peak_bytes)


def _layer(xbar=100, x=10, fwd_ms=5.0):
    return Layer("l", fwd_ms, 2 * fwd_ms, x, xbar, 0, 0, 0)


def test_dominated_options_are_dropped():
    ly = _layer()
    opts = [Option("a", 60, 1.0, 0, 0), Option("b", 60, 2.0, 0, 0),  # b: a keeps as much, faster
            Option("c", 100, 0.5, 0, 0),  # store keeps as much and redoes nothing
            Option("d", 10, 5.0, 0, 0),  # full: the output only, the whole forward
            Option("e", 30, 4.0, 0, 0), Option("f", 30, 4.0, 0, 0)]  # a tie: the first stays
    assert [o.name for o in undominated(ly, opts)] == ["a", "e"]


def test_near_ties_keep_the_earlier_option():
    """Kept bytes within 1% and recomputes within 5% of the forward are one choice: the earlier
    stays whichever the noise made faster; a real difference in either keeps both."""
    ly = _layer(xbar=10_000, x=100, fwd_ms=10.0)
    p, q = Option("p", 5000, 1.3, 0, 0), Option("q", 4990, 1.0, 0, 0)  # q: 0.2% less, 0.3 ms faster
    assert [o.name for o in undominated(ly, [p, q])] == ["p"]
    assert [o.name for o in undominated(ly, [q, p])] == ["q"]
    far = Option("r", 4000, 3.0, 0, 0)  # 20% less memory, slower
    slow = Option("s", 4995, 2.0, 0, 0)  # 7% of the forward slower than p, less memory
    assert [o.name for o in undominated(ly, [p, far, slow])] == ["p", "r", "s"]
    assert [o.name for o in undominated(ly, [Option("t", 9950, 0.4, 0, 0)])] == []  # ~store


def test_old_profile_json_without_options_loads(tmp_path):
    torch.manual_seed(0)
    prof = _profile(Stack(Mlp, n=2), torch.randn(4, 16), options=["sac-compute"])
    d = json.loads(json.dumps(prof.to_dict()))
    assert Profile.from_dict(d) == prof  # round trip, options included
    assert isinstance(d["layers"][1]["options"][0]["saved_bytes"], int)
    for r in d["layers"]:
        del r["options"]
    p = tmp_path / "old.json"
    p.write_text(json.dumps(d))
    old = api.load_profile(p)
    assert all(r.options == () for r in old.layers) and not old.option_names
    assert not chain_from_profile(old).has_options
    d["layers"][1]["options"] = [{"name": "sac-compute", "saved_bytes": -1}]
    assert "recompute_ms is missing" in api.profile_problem(d)


def test_cli_profile_options_table_and_json(tiny_gpt_spec, tmp_path):
    spec = tiny_gpt_spec(tmp_path)
    runner = CliRunner()
    out = runner.invoke(app, ["profile", str(spec), "--device", "meta", "--format", "json"])
    assert out.exit_code == 0, out.output
    layers = json.loads(out.stdout)["layers"]
    assert [o["name"] for o in layers[1]["options"]] == ["sac-compute", "sac-linear", "sac-attn"]
    assert all(isinstance(o["saved_bytes"], int) for o in layers[1]["options"])
    out = runner.invoke(app, ["profile", str(spec), "--device", "meta", "--format", "json", "--no-options"])
    assert all(r["options"] == [] for r in json.loads(out.stdout)["layers"])
    out = runner.invoke(app, ["profile", str(spec), "--device", "meta"], env={"COLUMNS": "80"})
    assert out.exit_code == 0, out.output
    assert "selective options" in out.stdout and "sac-compute" in out.stdout
    assert max(len(line) for line in out.stdout.splitlines() if line.startswith(("┃", "│"))) <= 80


def test_options_table_with_six_options_fits_80_columns(tiny_gpt_spec, tmp_path):
    """Compiled profiles have six options: on an 80-column terminal each cell puts the bytes over
    the time instead of running off the edge; every value is still there, and --wide keeps one line."""
    from rich.console import Console

    from ckplan.render import options_table
    prof = api.profile(api.load(tiny_gpt_spec(tmp_path)), device="meta", options=True)
    more = [dataclasses.replace(r, options=tuple(  # measured-looking times: "+12.3 ms" in each cell
        dataclasses.replace(o, recompute_ms=12.345 + i) for i, o in enumerate(r.options + tuple(
            dataclasses.replace(o, name=f"mincut-{k}") for k, o in zip((80, 50, 20), r.options)))))
        if r.role == "chain" else r for r in prof.layers]
    prof = dataclasses.replace(prof, layers=tuple(more))
    assert len(prof.option_names) == 6
    narrow = Console(width=80, record=True, color_system=None)
    options_table(prof, console=narrow)
    text = narrow.export_text()
    assert max(len(line) for line in text.splitlines() if line.startswith(("┃", "│", "┏", "└"))) <= 80
    from ckplan.units import format_bytes
    assert "…" not in text  # no value cut short
    r = prof.chain_layers[0]
    assert format_bytes(max(r.saved_bytes, r.output_bytes)) in text and "+16.3 ms" in text
    wide = Console(width=80, record=True, color_system=None)
    options_table(prof, console=wide, wide=True)
    rows = [line for line in wide.export_text().splitlines() if line.startswith("│")]
    assert len(rows) == len(prof.chain_layers) and max(len(line) for line in rows) > 80


@pytest.mark.parametrize("bad", [["nope"], ["sac-compute", "store"]])
def test_unknown_option_is_a_usage_error(bad):
    from ckplan.errors import UsageError
    with pytest.raises(UsageError):
        api.option_names(bad)


def test_option_cost_adds_what_sac_adds_around_its_recompute():
    # Oracle by hand: two layers of one type and equal FLOPs. Plain windows: forward 10 ms,
    # backward 20 ms. Under the option: forwards 12 and 14 ms (SAC's dispatch mode), backwards
    # 25 and 27 ms of which the recompute is 4 ms. Costs: 4 + 2 + 1 = 7 and 4 + 4 + 3 = 11,
    # shared by FLOPs: 9 each. A forward that ran faster under the option adds nothing, and a
    # compiled pass's difference (whole) is taken as it is.
    from ckplan.profiling.option_passes import OptionPass, _option_cost_ms
    from ckplan.records import CHAIN, StageRecord

    def row(i):
        return StageRecord(index=i, name=f"l{i}", type="Block", role=CHAIN, param_bytes=0, grad_bytes=0,
                           output_bytes=4, saved_bytes=8, fwd_ms=10.0, bwd_ms=20.0, fwd_flops=100,
                           bwd_flops=200, fwd_tmp_bytes=0, bwd_tmp_bytes=0, fwd_peak_bytes=0,
                           bwd_peak_bytes=0, recompute_ms=9.0)

    rows = (row(0), row(1))
    times = {("F", 0): [12.0, 12.0, 30.0], ("F", 1): [14.0], ("B", 0): [25.0], ("B", 1): [27.0]}
    p = OptionPass("sac-x", None, times, {0: [4.0, 3.0, 5.0], 1: [4.0]})
    assert _option_cost_ms(p, rows) == {0: pytest.approx(9.0), 1: pytest.approx(9.0)}
    faster = OptionPass("sac-x", None, {("F", 0): [8.0], ("F", 1): [8.0], ("B", 0): [24.0], ("B", 1): [24.0]},
                        {0: [4.0], 1: [4.0]})
    assert _option_cost_ms(faster, rows) == {0: pytest.approx(4.0), 1: pytest.approx(4.0)}
    whole = dataclasses.replace(p, whole=True)
    assert _option_cost_ms(whole, rows) == {0: pytest.approx(4.0), 1: pytest.approx(4.0)}


def test_option_costs_from_whole_steps_where_kernels_run_ahead(monkeypatch, tiny_gpt_spec, tmp_path):
    """On CUDA an option's cost is what it adds to whole steps (the windows wait for the GPU at
    every layer, exposing SAC's CPU time); the path runs here on CPU when asked to: the chain's
    option costs then add up to the measured step difference, equal layers equally."""
    from ckplan import api
    from ckplan.profiling import option_passes
    monkeypatch.setattr(option_passes, "WHOLE_STEP_OPTION_COSTS", ("cpu", "cuda"))
    seen = []
    orig = option_passes._option_step_extra_ms

    def spy(*a, **k):
        seen.append(orig(*a, **k))
        return seen[-1]
    monkeypatch.setattr(option_passes, "_option_step_extra_ms", spy)
    spec = api.load(tiny_gpt_spec(tmp_path, n_layer=3, n_embd=64, block_size=64), batch_size=2, seq_len=64)
    prof = api.profile(spec, device="cpu", repeats=2, options=["sac-compute"])
    assert len(seen) == 1 and seen[0] >= 0
    costs = [r.option("sac-compute").recompute_ms for r in prof.chain_layers]
    assert sum(costs) == pytest.approx(seen[0], rel=1e-6, abs=1e-9)
    assert costs[0] == pytest.approx(costs[1]) == pytest.approx(costs[2])


def test_after_the_warm_up_a_policy_dispatches_only_the_layers_ops():
    # the first SAC checkpoint of a process initialises torch's own machinery (80 ops on torch
    # 2.6); the profile warms it up so that the first layer it measures is not billed for them
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.checkpoint import checkpoint

    from ckplan.sac import context_fn, warm_up

    warm_up()
    names: list[str] = []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            names.append(func.__name__.split(".")[0])
            return func(*args, **(kwargs or {}))

    x = torch.ones(3, requires_grad=True)
    with Count():
        checkpoint(torch.cos, x, use_reentrant=False, context_fn=context_fn("sac-compute"))
    # the layer's op, what the policy's cache detaches, and (some torch versions) the
    # checkpoint's own allocations
    assert "cos" in names and set(names) <= {"cos", "detach", "alias", "empty"}
