"""bench: measured peaks against predictions, OOM handling, atomic reports, an unseen model."""
import json
import textwrap

import pytest
from typer.testing import CliRunner

from ckplan import api, report
from ckplan.cli import app

STRATS = ["none", "every-k", "sqrtn", "chen", "dp"]


def _bench(spec, **kw):
    kw.setdefault("steps", 1)
    kw.setdefault("warmup", 1)
    return api.bench(spec, strategies=STRATS, device="cpu", **kw)


@pytest.mark.parametrize("which", ["gpt", "resnet"])
def test_measured_peak_matches_prediction(configs, tiny_gpt_spec, tmp_path, which):
    if which == "gpt":
        spec = api.load(tiny_gpt_spec(tmp_path, n_layer=6, n_embd=64, dropout=0.1), batch_size=8, seq_len=32)
    else:
        spec = api.load(configs / "resnet.yaml", batch_size=4)
    # ResNet at this size is parameter-bound: no budget, so dp plans for its smallest peak.
    res = _bench(spec, budget="60%" if which == "gpt" else None, k=1)
    rows = {r.strategy: r for r in res.rows}
    for r in res.rows:
        assert r.status == "ok", r
        assert r.peak_error < 0.05, (r.strategy, r.predicted_peak_bytes, r.measured_peak_bytes)
        assert r.max_grad_diff is not None and r.max_grad_diff < 1e-5
        assert r.loss == pytest.approx(rows["none"].loss, rel=1e-6)
    # Peaks order as predicted: none above full per-layer recomputation; dp within its budget.
    assert rows["none"].measured_peak_bytes > rows["every-k"].measured_peak_bytes
    assert rows["dp"].measured_peak_bytes <= (res.budget_bytes or rows["none"].measured_peak_bytes) * 1.05


def test_adamw_step_counters_are_in_the_prediction(tiny_gpt_spec, tmp_path):
    # AdamW's step counters are 4-byte CPU tensors made by torch.tensor(), outside dispatch; a
    # tracker that missed them predicted every row 4 B per parameter tensor low.
    spec = api.load(tiny_gpt_spec(tmp_path))
    res = api.bench(spec, strategies=["none", "every-k"], device="cpu", steps=1, warmup=1, k=1)
    prof = api.profile(spec, device="cpu", repeats=1, warmup=0)
    n_tensors = 2 + 3 * 12 + 2  # embeddings, 3 blocks of 12 tensors, the final norm (tied head)
    assert res.optimizer == prof.optimizer == "adamw"
    assert prof.totals.optimizer_scalar_bytes == 4 * n_tensors
    for r in res.rows:
        assert r.status == "ok", r.message
        assert r.measured_peak_bytes == r.predicted_peak_bytes, r.strategy
        assert r.measured_fwd_bwd_peak_bytes == r.predicted_fwd_bwd_peak_bytes, r.strategy


def test_oom_row_and_the_run_goes_on(tiny_gpt_spec, tmp_path):
    spec = api.load(tiny_gpt_spec(tmp_path, n_layer=6, n_embd=64), batch_size=8, seq_len=32)
    prof = api.profile(spec, device="cpu", repeats=1, warmup=0)
    none_peak = prof.totals.predicted_peak_bytes
    res = api.bench(spec, strategies=["none", "every-k"], k=1, device="cpu", steps=1, warmup=0,
                    memory_limit=int(none_peak * 0.97))
    rows = {r.strategy: r for r in res.rows}
    assert rows["none"].status == "OOM" and rows["none"].measured_peak_bytes is None
    limit = int(none_peak * 0.97)
    assert "over --memory-limit" in rows["none"].message and f"({limit} bytes)" in rows["none"].message
    reached = int(rows["none"].message.split("(")[1].split(" bytes")[0])
    assert reached > limit  # the step's bytes, resident included, in the limit's own terms
    assert rows["every-k"].status == "ok" and rows["every-k"].measured_peak_bytes < none_peak * 0.97


def test_infeasible_budget_row(tiny_gpt_spec, tmp_path):
    spec = api.load(tiny_gpt_spec(tmp_path))
    res = api.bench(spec, strategies=["none", "dp"], budget="1KB", device="cpu", steps=1, warmup=0)
    rows = {r.strategy: r for r in res.rows}
    assert rows["dp"].status == "infeasible" and "smallest feasible peak" in rows["dp"].message
    assert rows["none"].status == "ok"


def test_report_files_are_complete_or_absent(tiny_gpt_spec, tmp_path, monkeypatch):
    spec = api.load(tiny_gpt_spec(tmp_path))
    res = api.bench(spec, strategies=["none", "every-k"], device="cpu", steps=1, warmup=0)
    out = tmp_path / "reports"
    report.write_bench(out, res)
    good = {p.name: p.read_bytes() for p in out.iterdir()}
    assert len(good) == 4 and json.loads(good[f"bench-{res.model}-cpu.json"])["command"] == "bench"
    frontier = json.loads(good[f"bench-{res.model}-cpu.json"])["frontier"]  # the predicted dp curve
    assert frontier and all(list(p) == ["strategy", "peak_bytes", "slowdown"] for p in frontier)
    assert frontier == [{"strategy": p.strategy, "peak_bytes": p.peak_bytes, "slowdown": p.slowdown}
                        for p in res.frontier]

    def interrupted(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(report.sets, "plot_bench", interrupted)
    with pytest.raises(KeyboardInterrupt):
        report.write_bench(out, res)
    # The PNG from before is intact, nothing half-written or temporary is left behind.
    assert {p.name for p in out.iterdir()} == set(good)
    assert (out / f"bench-{res.model}-cpu.png").read_bytes() == good[f"bench-{res.model}-cpu.png"]


def test_unseen_target_model_benched_end_to_end(write_spec, tmp_path, monkeypatch):
    (tmp_path / "fresh_net.py").write_text(textwrap.dedent("""
        import torch.nn as nn

        class Block(nn.Module):
            def __init__(self, d):
                super().__init__()
                self.norm = nn.LayerNorm(d)
                self.ff = nn.Sequential(nn.Linear(d, 3 * d), nn.SiLU(), nn.Linear(3 * d, d))
            def forward(self, x):
                return x + self.ff(self.norm(x))

        class Net(nn.Module):
            def __init__(self, d, n):
                super().__init__()
                self.embed = nn.Linear(d, d)
                self.stack = nn.ModuleList(Block(d) for _ in range(n))
            def forward(self, x):
                x = self.embed(x)
                for blk in self.stack:
                    x = blk(x)
                return x

        def make(d=32, n=6):
            return Net(d, n)
    """))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = write_spec(tmp_path, """
model: {target: "fresh_net:make", args: {d: 32, n: 6}}
input: {batch_size: 64, shape: [32], dtype: float32}
""")
    r = CliRunner().invoke(app, ["bench", str(spec), "--device", "cpu", "--steps", "1", "--warmup", "1",
                                 "--budget", "80%", "--out-dir", str(tmp_path / "out"), "-f", "json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["schema_version"] == 1 and doc["command"] == "bench" and doc["device"] == "cpu"
    for row in doc["rows"]:
        for key in ("strategy", "status", "predicted_peak_bytes", "measured_peak_bytes", "peak_error",
                    "step_ms", "slowdown", "predicted_overhead", "max_grad_diff"):
            assert key in row
        assert row["status"] == "ok" and row["peak_error"] < 0.05 and row["max_grad_diff"] < 1e-5
    assert sorted(p.suffix for p in (tmp_path / "out").iterdir()) == [".csv", ".json", ".png", ".png"]


FLAKY_NET = textwrap.dedent("""
    import torch
    import torch.nn as nn

    class Flaky(nn.Module):
        '''A layer whose output depends on how often it ran in this step: a recompute is a second
        call, so a checkpointed copy computes something else (as a cache or counter in a real model).'''
        def __init__(self, d):
            super().__init__()
            self.lin = nn.Linear(d, d)
            self.calls = 0
        def forward(self, x):
            self.calls += 1
            return torch.tanh(self.lin(x) * self.calls)  # tanh saves its output for backward

    class Net(nn.Module):
        def __init__(self, d, n, poison):
            super().__init__()
            self.stack = nn.ModuleList(Flaky(d) for _ in range(n))
            self.poison = poison
        def forward(self, x):
            for blk in self.stack:
                blk.calls = 0
            for blk in self.stack:
                x = blk(x)
            return x * float("nan") if self.poison else x

    def make(d=16, n=4, poison=False):
        return Net(d, n, poison)
""")


@pytest.fixture
def flaky_spec(write_spec, tmp_path, monkeypatch):
    """``flaky_spec(poison=False)``: a real model whose layer changes between calls."""
    (tmp_path / "flaky_net.py").write_text(FLAKY_NET)
    monkeypatch.syspath_prepend(str(tmp_path))
    return lambda poison=False: write_spec(tmp_path, f"""
model: {{target: "flaky_net:make", args: {{d: 16, n: 4, poison: {str(poison).lower()}}}}}
input: {{batch_size: 8, shape: [16], dtype: float32}}
chain: stack
""", "flaky-net.yaml")


def test_a_plan_that_changes_the_gradients_fails_the_bench(flaky_spec, tmp_path):
    spec = flaky_spec()
    out = tmp_path / "out"
    r = CliRunner().invoke(app, ["bench", str(spec), "--device", "cpu", "--compare", "none,every-k", "--k", "1",
                                 "--steps", "1", "--warmup", "0", "--out-dir", str(out)])
    assert r.exit_code == 4, r.output
    # The table came first, the reports were written, then the one-line error.
    assert "wrong-gradients" in r.stdout and "over the tolerance" in r.stdout
    assert "Error:" in r.output and "every-k (wrong-gradients)" in r.output
    doc = json.loads((out / "bench-flaky-net-cpu.json").read_text())
    rows = {row["strategy"]: row for row in doc["rows"]}
    assert rows["none"]["status"] == "ok" and rows["none"]["max_grad_diff"] == 0.0
    bad = rows["every-k"]
    assert bad["status"] == "wrong-gradients" and bad["max_grad_diff"] > bad["grad_tolerance"] > 0
    assert bad["loss"] == pytest.approx(rows["none"]["loss"])  # the first forward is right; the recompute is not


def test_nan_loss_is_non_finite(flaky_spec, tmp_path):
    spec = api.load(flaky_spec(poison=True))
    res = api.bench(spec, strategies=["none", "every-k"], k=1, device="cpu", steps=1, warmup=0)
    assert {r.status for r in res.rows} == {"non-finite"} and len(res.failed_rows) == 2
    assert "the loss is nan" in res.rows[0].message


def test_cpu_rows_carry_the_resident_high_water_mark(tiny_gpt_spec, tmp_path):
    import mmap

    from ckplan.measure import ResidentPeak
    with ResidentPeak() as rss:
        # 64 MiB of fresh anonymous pages, each written once: whatever the heap kept from earlier
        # tests (glibc may serve even a large tensor from memory that is already resident).
        m = mmap.mmap(-1, 64 * 2**20)
        for off in range(0, len(m), 4096):
            m[off] = 1
        m.close()
    if rss.peak_bytes is None:
        pytest.skip("no /proc/self/clear_refs here")
    assert rss.growth_bytes >= 63 * 2**20 and rss.peak_bytes >= rss.start_bytes + rss.growth_bytes
    spec = api.load(tiny_gpt_spec(tmp_path))
    res = api.bench(spec, strategies=["none", "every-k"], device="cpu", steps=1, warmup=0)
    for r in res.rows:
        assert r.measured_rss_peak_bytes > r.measured_rss_growth_bytes >= 0
        assert 0 < r.measured_growth_bytes < r.measured_peak_bytes
    assert any("MALLOC_MMAP_THRESHOLD_" in n for n in res.notes)
    from ckplan.measure import KEPT_MEMORY_NOTE, KeptFreedMemory
    assert (KEPT_MEMORY_NOTE in res.notes) == KeptFreedMemory("cpu").active  # the timed steps kept memory


def test_out_dir_checked_before_the_run(tiny_gpt_spec, tmp_path):
    blocker = tmp_path / "reports"
    blocker.write_text("a file, not a folder")
    r = CliRunner().invoke(app, ["bench", str(tiny_gpt_spec(tmp_path)), "--device", "cpu", "--steps", "1",
                                 "--out-dir", str(blocker)])
    assert r.exit_code == 2 and "not a folder" in r.output and "strategy" not in r.stdout


@pytest.mark.parametrize("failure", ["disk-full", "ctrl-c"])
def test_results_printed_even_when_the_reports_cannot_be_written(tiny_gpt_spec, tmp_path, monkeypatch, failure):
    def fail(result, path):  # the PNG is the last file: the disk fills up, or Ctrl-C, while writing it
        if failure == "ctrl-c":
            raise KeyboardInterrupt
        raise OSError(28, "No space left on device", str(path))
    monkeypatch.setattr(report.sets, "plot_bench", fail)
    out = tmp_path / "out"
    r = CliRunner().invoke(app, ["bench", str(tiny_gpt_spec(tmp_path)), "--device", "cpu", "--compare",
                                 "none,every-k", "--steps", "1", "--warmup", "0", "--out-dir", str(out),
                                 "-f", "json"])
    assert r.exit_code == (130 if failure == "ctrl-c" else 1), r.output
    doc = json.loads(r.stdout)  # the whole result, on stdout
    assert [row["strategy"] for row in doc["rows"]] == ["none", "every-k"]
    if failure == "ctrl-c":
        assert "Error:" in r.output and "the previous set (if any) is intact" in r.output
    else:
        assert "Error:" in r.output and "not written" in r.output and "No space left" in r.output
    assert list(out.iterdir()) == []  # no CSV and JSON without their PNG, no temporary files


def test_selective_without_options_is_one_error_row_not_the_whole_bench(tiny_gpt_spec, tmp_path):
    # A profile without options (or whose options were all dominated) cannot plan `selective`;
    # known only after the profile, so that row says why and the other rows still run.
    spec = api.load(tiny_gpt_spec(tmp_path))
    res = api.bench(spec, strategies=["none", "selective", "every-k"], device="cpu", steps=1, warmup=0,
                    options=False)
    rows = {r.strategy: r for r in res.rows}
    assert rows["selective"].status == "error" and "this chain has none that pays" in rows["selective"].message
    assert rows["none"].status == "ok" and rows["every-k"].status == "ok"
    assert rows["every-k"].measured_peak_bytes == pytest.approx(rows["every-k"].predicted_peak_bytes, rel=1e-3)
    assert not res.failed_rows


def test_slowdowns_from_one_or_two_steps_carry_a_caveat(tiny_gpt_spec, tmp_path):
    from types import SimpleNamespace

    from ckplan.bench import few_steps_note
    rows = [SimpleNamespace(strategy="none", slowdown=1.0), SimpleNamespace(strategy="sqrtn", slowdown=0.2),
            SimpleNamespace(strategy="dp", slowdown=1.3), SimpleNamespace(strategy="chen", slowdown=None)]
    note = few_steps_note(1, rows)
    assert note.startswith("--steps 1: each slowdown is one step against one of none")
    assert "(sqrtn 0.20x: faster than none, which recomputes nothing, so that is noise)" in note
    assert "dp" not in note and "use --steps 5 or more" in note
    assert "2 steps against as many" in few_steps_note(2, rows[:1])
    assert few_steps_note(3, rows) is None
    res = api.bench(api.load(tiny_gpt_spec(tmp_path)), strategies=["none"], device="cpu", steps=1, warmup=0)
    assert any(n.startswith("--steps 1:") for n in res.notes)


def test_error_is_a_share_of_the_prediction():
    from ckplan.bench_records import over_budget, peak_error
    # "predicted 1.0 GB, measured 12.6% more": the error is read against the prediction
    assert peak_error(1_000, 1_126) == pytest.approx(0.126)
    assert peak_error(1_000, 874) == pytest.approx(0.126)
    assert peak_error(None, 5) is None and peak_error(5, None) is None
    assert over_budget(100, 101, 100) and not over_budget(100, 100, 100)
    assert not over_budget(120, 130, 100)  # never predicted to fit: not a broken prediction
    assert not over_budget(100, 130, None)  # no explicit budget


def test_a_plan_measured_over_an_explicit_budget_is_over_budget_and_exits_3(tiny_gpt_spec, tmp_path, monkeypatch):
    """A row predicted to fit --budget that measures above it: status over-budget (red), its
    error against the prediction, exit 3 (the budget was not met) after the table and files."""
    from ckplan.bench import runner
    from ckplan.planner import chain_from_profile, min_peak, plan_chain

    extra = 10 * 2**20
    real = runner.memory_step

    def short(run, e):  # dp's prediction 10 MiB short of what its step holds
        real(run, e)
        if e.name == "dp":
            e.mem["measured"] += extra
    monkeypatch.setattr(runner, "memory_step", short)
    spec = tiny_gpt_spec(tmp_path)
    chain = chain_from_profile(api.profile(api.load(spec), device="cpu", repeats=1, warmup=0))
    budget = (min_peak(chain) + plan_chain(chain, "none").score.peak_bytes) // 2
    r = CliRunner().invoke(app, ["bench", str(spec), "--device", "cpu", "--compare", "none,dp", "--budget",
                                 str(budget), "--steps", "1", "--warmup", "0", "--no-options", "-f", "json",
                                 "--out-dir", str(tmp_path / "out")])
    assert r.exit_code == 3, r.output
    assert "measured above the budget they were predicted to fit" in r.stderr
    assert any((tmp_path / "out").iterdir())  # the files first
    rows = {row["strategy"]: row for row in json.loads(r.stdout)["rows"]}
    dp = rows["dp"]
    assert dp["status"] == "over-budget" and "over)" in dp["message"]
    assert dp["predicted_peak_bytes"] <= budget < dp["measured_peak_bytes"]
    assert dp["peak_error"] == pytest.approx(extra / dp["predicted_peak_bytes"])
    assert rows["none"]["status"] == "ok"  # never predicted to fit the budget


def test_a_given_plan_with_an_option_the_profile_found_dominated_is_benched(tiny_gpt_spec, tmp_path):
    """A plan made elsewhere (on meta, with another device model) may store a layer with an option
    this machine's profile measured but found dominated (on the tiny GPT on CPU every option is): the
    bench runs it and predicts it from the measured option, to the byte."""
    from ckplan.planner import Plan
    from ckplan.planner.plan import Store
    spec = api.load(tiny_gpt_spec(tmp_path))
    plan = Plan("meta", 3, (Store(0), Store(1, "sac-linear"), Store(2, "sac-compute")))
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan.to_dict()))
    res = api.bench(spec, strategies=["none"], plan_path=path, steps=1, warmup=1, device="cpu",
                    options=True)
    row = next(r for r in res.rows if r.strategy != "none")
    assert row.status == "ok", row.message
    assert row.plan == plan.describe()
    assert row.measured_peak_bytes == row.predicted_peak_bytes
    assert row.max_grad_diff is not None and row.max_grad_diff < 1e-5


def test_a_peer_measured_above_the_budget_says_by_how_much_and_stays_ok():
    """Peers predict no peak, so they are never over-budget; their message says where they landed."""
    from ckplan.bench.entry import Entry
    from ckplan.bench.result import row_of
    peer = Entry("torch-compile", None, kind="peer")
    peer.mem["measured"] = 1_350
    peer.times = [2.0]
    none = Entry("none", None)
    none.times = [1.0]
    row = row_of(peer, none, budget_bytes=1_000)
    assert row.status == "ok" and "measured 350 bytes above the budget" in row.message
    assert "above the budget" not in row_of(peer, none, budget_bytes=2_000).message
    assert "above the budget" not in row_of(peer, none, budget_bytes=None).message


@pytest.mark.parametrize("value,scope,says", [
    ("half", "model", "partitioner_budget is 'half', not a share in (0, 1]"),
    (0.6, "layers", "--compile-scope model"),
])
def test_a_plan_with_a_partitioner_budget_is_checked_before_anything_runs(tiny_gpt_spec, tmp_path, value, scope,
                                                                         says):
    from ckplan.planner import Plan, plan_none
    plan = tmp_path / "plan.json"
    n = 2
    plan.write_text(json.dumps(Plan("mine", n, plan_none(n).items, {"partitioner_budget": value}).to_dict()))
    r = CliRunner().invoke(app, ["bench", str(tiny_gpt_spec(tmp_path, n_layer=n)), "--device", "cpu", "--plan",
                                 str(plan), "--compile-scope", scope, "--steps", "1", "--out-dir",
                                 str(tmp_path / "out")])
    assert r.exit_code == 2 and says in r.output, r.output
    assert not (tmp_path / "out").exists()


def test_a_model_with_an_empty_parameter_is_benched(write_spec, tmp_path, monkeypatch):
    """DINOv3 with no register tokens holds a 0-element parameter: its gradient is empty, and the
    gradient check compares the others."""
    (tmp_path / "empty_param_net.py").write_text(textwrap.dedent("""
        import torch
        import torch.nn as nn

        class Net(nn.Module):
            def __init__(self, d=16, n=4):
                super().__init__()
                self.registers = nn.Parameter(torch.zeros(1, 0, d))
                self.layers = nn.ModuleList(nn.Sequential(nn.Linear(d, d), nn.Tanh()) for _ in range(n))
            def forward(self, x):
                x = torch.cat([self.registers.expand(x.shape[0], -1, -1), x], dim=1)
                for layer in self.layers:
                    x = layer(x)
                return x.pow(2).mean()

        def make():
            return Net()
    """))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = write_spec(tmp_path, """
model: {target: "empty_param_net:make"}
input: {batch_size: 4, shape: [8, 16], dtype: float32}
""")
    r = CliRunner().invoke(app, ["bench", str(spec), "--compare", "none,every-k", "--steps", "1", "--warmup", "0",
                                 "--no-options", "--out-dir", str(tmp_path / "out"), "-f", "json"])
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout)["rows"]
    assert [row["status"] for row in rows] == ["ok", "ok"]


def test_rows_measured_above_an_explicit_budget_are_named(tiny_gpt_spec, tmp_path):
    """none is not planned to the budget: it stays ok, and a note says it does not fit."""
    spec = api.load(tiny_gpt_spec(tmp_path, n_layer=4, n_embd=64), batch_size=8, seq_len=32)
    none_peak = api.profile(spec, device="cpu", repeats=1, warmup=0).totals.predicted_peak_bytes
    budget = int(none_peak * 0.95)
    res = api.bench(spec, strategies=["none", "every-k"], k=1, device="cpu", steps=1, warmup=0, budget=budget,
                    options=False)
    rows = {r.strategy: r for r in res.rows}
    assert rows["none"].status == "ok" and rows["none"].measured_peak_bytes > budget
    note = next(n for n in res.notes if n.startswith("measured above --budget"))
    assert "none (" in note and "every-k" not in note


RESEEDING_NET = textwrap.dedent("""
    import torch, torch.nn as nn

    class Block(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.fc = nn.Linear(d, d)

        def forward(self, x):
            g = torch.Generator().manual_seed(torch.seed())  # as Reformer's dropout: a seed from the OS
            return x + torch.tanh(self.fc(x)) * (torch.rand(x.shape, generator=g) > 0.1)

    class Net(nn.Module):
        def __init__(self, d, n):
            super().__init__()
            self.stack = nn.ModuleList(Block(d) for _ in range(n))

        def forward(self, x):
            for blk in self.stack:
                x = blk(x)
            return x

    def make(d=16, n=4):
        return Net(d, n)
""")


def test_a_model_that_differs_from_itself_gets_no_gradient_verdict(write_spec, tmp_path, monkeypatch):
    """Reformer reseeds its dropout from torch.seed(): none differs from none, so a checkpointed
    row's gradients cannot be judged. The rows say so (status error, exit 0), instead of
    wrong-gradients blaming the plan (exit 4)."""
    (tmp_path / "reseeding_net.py").write_text(RESEEDING_NET)
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = write_spec(tmp_path, """
model: {target: "reseeding_net:make", args: {d: 16, n: 4}}
input: {batch_size: 8, shape: [16], dtype: float32}
chain: stack
""", "reseeding.yaml")
    out = tmp_path / "out"
    r = CliRunner().invoke(app, ["bench", str(spec), "--device", "cpu", "--compare", "none,every-k", "--k", "1",
                                 "--steps", "1", "--warmup", "0", "--out-dir", str(out), "--format", "json"])
    assert r.exit_code == 0, r.output
    rows = {row["strategy"]: row for row in json.loads(r.stdout)["rows"]}
    assert rows["none"]["status"] == "ok"
    assert rows["every-k"]["status"] == "error"
    assert rows["every-k"]["message"].startswith("gradients not compared: none itself gave other gradients")
    assert "set its dropout to 0" not in rows["every-k"]["message"]  # it has no dropout to set


def test_a_model_that_counts_its_calls_is_told_it_keeps_state(write_spec, tmp_path, monkeypatch):
    """A layer that scales by how often it ran: none's second run differs from its first, and the
    message names state kept between runs (no dropout tip: every dropout is 0)."""
    (tmp_path / "counting_net.py").write_text(textwrap.dedent("""
        import torch.nn as nn

        class Block(nn.Module):
            def __init__(self, d):
                super().__init__()
                self.fc, self.drop, self.n = nn.Linear(d, d), nn.Dropout(0.0), 0

            def forward(self, x):
                self.n += 1
                return x + self.drop(self.fc(x)) * (1 + 0.1 * self.n)

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.stack = nn.ModuleList(Block(16) for _ in range(4))

            def forward(self, x):
                for blk in self.stack:
                    x = blk(x)
                return x
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = write_spec(tmp_path, 'model: {target: "counting_net:Net"}\ninput: {batch_size: 8, shape: [16]}\n'
                      "chain: stack\n", "counting.yaml")
    r = CliRunner().invoke(app, ["bench", str(spec), "--device", "cpu", "--compare", "none,every-k", "--k", "1",
                                 "--steps", "1", "--warmup", "0", "--out-dir", str(tmp_path / "o"), "-f", "json"])
    assert r.exit_code == 0, r.output
    message = {row["strategy"]: row for row in json.loads(r.stdout)["rows"]}["every-k"]["message"]
    assert "keeps state from one run to the next" in message and "dropout" not in message
