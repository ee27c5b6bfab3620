"""Golden output of the rich tables: essentials at 80 columns, nothing cut to an ellipsis, all at 200.

Every table is rendered from records built by hand (no torch run) to a fixed-width console.
"""
import io

import pytest
from fake_records import MiB, _row, make_bench, make_plan_report, make_profile
from rich.console import Console

from ckplan import render
from ckplan.bench_records import BenchResult
from ckplan.planner import STRATEGIES, chain_from_profile, sweep


def _render(fn, width, **kw) -> str:
    con = Console(record=True, width=width, file=io.StringIO(), color_system=None)
    fn(console=con, **kw)
    return con.export_text()


TABLES = {
    "bench": (lambda **kw: render.bench_table(make_bench(), **kw),
              ["strategy", "status", "predicted", "measured", "error", "slowdown"],
              ["wrong-gradients", "plan:every-k", "OOM", "1.21 GiB"]),
    "profile": (lambda **kw: render.profile_table(make_profile(), **kw),
                ["#", "layer", "params", "output", "saved", "fwd", "bwd"],
                ["transformer.h.11", "27 MiB", "170 MiB", "1.25 ms", "2.5 ms"]),
    "plan": (lambda **kw: render.plan_tables(make_plan_report(), **kw),
             ["strategy", "predicted", "overhead", "fits", "ckpts", "layers", "first forward", "forward"],
             ["every-k", "sqrtn", "chen", "dp"]),
    "sweep": (lambda **kw: render.sweep_table(sweep(chain_from_profile(make_profile()), list(STRATEGIES), 5),
                                              **kw),
              ["strategy", "param", "predicted", "overhead"], ["every-k", "k=1", "budget"]),
}
ALL_HEADERS = {"bench": ["fwd+bwd pred / meas", "held for bwd pred / meas", "growth tensors / RSS",
                         "step (median)", "min-max", "max |dgrad|"],
               "profile": ["type", "fwd FLOPs", "fwd tmp", "bwd tmp"],
               "plan": ["saved vs none", "recompute", "peak reached at", "names"],
               "sweep": ["recompute", "ckpts"]}


@pytest.mark.parametrize("name", sorted(TABLES))
def test_table_fits_80_columns_without_ellipsis(name):
    fn, headers, cells = TABLES[name]
    text = _render(fn, 80)
    table_lines = [line for line in text.splitlines() if line[:1] in "┏┃┡│└"]
    assert "…" not in text, text
    # Tables fit; free text (plan strings, notes) is soft-wrapped by the terminal itself.
    assert table_lines and max(len(line) for line in table_lines) <= 80, text
    words = text.split()
    for h in headers:
        for w in h.split():
            assert w in words or any(w in x for x in words), (h, text)
    for c in cells:
        assert c in text, (c, text)


def _n_columns(text: str) -> int:
    return max(line.count("┃") for line in text.splitlines()) - 1


@pytest.mark.parametrize("name", sorted(TABLES))
def test_wide_shows_every_column_and_200_more_than_80(name):
    fn, headers, _ = TABLES[name]
    wide = _render(fn, 80, wide=True)
    assert "…" not in wide, wide
    for h in headers + ALL_HEADERS[name]:
        assert h in wide, (h, wide)
    at200 = _render(fn, 200)
    assert "…" not in at200 and all(h in at200 for h in headers), at200
    assert _n_columns(_render(fn, 80)) <= _n_columns(at200) <= _n_columns(wide)
    if name in ("bench", "profile"):  # too wide for 80 columns, not for 200
        assert _n_columns(_render(fn, 80)) < _n_columns(at200)


def test_narrow_bench_table_drops_extras_first():
    text = _render(TABLES["bench"][0], 80)
    assert "min-max" not in text and "held for bwd" not in text
    # The wrong-gradients row and its message are shown, in full.
    assert "wrong-gradients" in text and "dp: max |grad - grad(none)| = 0.031" in text


def test_piped_output_gets_every_column(monkeypatch, capsys):
    monkeypatch.delenv("COLUMNS", raising=False)
    con = Console(file=io.StringIO(), width=80, force_terminal=False)
    monkeypatch.setattr(render.consoles, "stdout", con)
    render.bench_table(make_bench())
    text = con.file.getvalue()
    assert "…" not in text and "min-max" in text and "growth tensors / RSS" in text
    monkeypatch.setenv("COLUMNS", "80")  # an explicit width is honoured, piped or not
    con.file = io.StringIO()
    render.bench_table(make_bench())
    assert "min-max" not in con.file.getvalue() and "…" not in con.file.getvalue()


# ---- JSON documents: one envelope each, key sets pinned (scripts depend on them) -------------

ENVELOPE = ["schema_version", "command"]


def test_profile_document_keys():
    from ckplan.report import profile_doc
    doc = profile_doc(make_profile(3))
    assert list(doc)[:2] == ENVELOPE and doc["command"] == "profile" and doc["schema_version"] == 1
    assert {"model", "device", "chain", "layers", "totals", "notes", "batch_size", "precision",
            "optimizer", "accum"} <= set(doc)
    assert all(isinstance(r["saved_bytes"], int) and "cast_bytes" in r for r in doc["layers"])


def test_plan_document_keys():
    from ckplan.report import plan_doc
    doc = plan_doc(make_plan_report())
    assert list(doc)[:2] == ENVELOPE and doc["command"] == "plan"
    assert {"strategy", "budget_bytes", "budget_source", "fits", "predicted_peak_bytes",
            "predicted_overhead", "no_checkpoint_peak_bytes", "plan", "layers", "strategies",
            "notes", "infeasible"} <= set(doc)
    assert isinstance(doc["predicted_peak_bytes"], int)


def test_bench_document_keys():
    from ckplan.report import bench_doc
    doc = bench_doc(make_bench())
    assert list(doc)[:2] == ENVELOPE and doc["command"] == "bench"
    row = doc["rows"][0]
    assert {"strategy", "status", "predicted_peak_bytes", "measured_peak_bytes", "peak_error",
            "slowdown", "max_grad_diff", "grad_tolerance", "measured_rss_peak_bytes"} <= set(row)


def test_control_characters_in_names_reach_the_terminal_as_text():
    from dataclasses import replace
    evil = "evil\x1b[31mRED\x07\r\u202e"
    prof = make_profile(3)
    layers = list(prof.layers)
    layers[1] = replace(layers[1], name=f"h.0{evil}", type=f"Block{evil}")
    prof = replace(prof, model=evil, layers=tuple(layers), notes=(f"note {evil}",))
    buf = io.StringIO()
    render.profile_table(prof, console=Console(file=buf, width=200, color_system=None))
    text = buf.getvalue()
    assert not any(c in text for c in "\x1b\x07\r\u202e")
    assert "evil\\x1b[31mRED\\x07\\x0d\\u202e" in text
    assert render.clean("a\tb\nc") == "a\tb\nc" and render.clean("\x00") == "\\x00"


def test_a_row_over_its_budget_is_red_with_its_overshoot():
    from ckplan.distributed import DistBenchResult, RankRow
    rows = tuple(RankRow("dp", rank, "over-budget", "C[0,8){S0 ... S7}", 1_071 * MiB, 1_225 * MiB,
                         154 / 1_071, None, None, 800.0, 4.5, None, None,
                         "measured above the per-rank budget it was predicted to fit (86 MiB over)")
                 for rank in (0, 1))
    res = DistBenchResult("gpt2-small", "fsdp", 2, "gloo", "cpu", 2, "sgd", 1_140 * MiB, 2, 1, 0, rows,
                          1_900 * MiB)
    con = Console(record=True, width=120, file=io.StringIO(), color_system="truecolor")
    render.dist_bench_table(res, console=con)
    text = con.export_text(clear=False)
    assert text.count("over-budget") == 2 and "14.4%" in text  # the error is against the prediction
    assert text.count("predicted to fit (86 MiB over)") == 1  # once, not per rank
    assert "\x1b[31m" in con.export_text(styles=True)  # red
    bench = make_bench()
    row = _row("dp", "over-budget", message="measured above the budget it was predicted to fit (9 bytes over)")
    con = Console(record=True, width=200, file=io.StringIO(), color_system="truecolor")
    render.bench_table(BenchResult(**{**bench.__dict__, "rows": (row,)}), console=con)
    assert "over-budget" in con.export_text(clear=False) and "\x1b[31m" in con.export_text(styles=True)


def test_offloaded_layers_show_where_their_device_bytes_are_freed():
    """The plan table's offloaded rows name the forwards after which the layers' device bytes go
    (the plan's release points): one, or the first and last of a run."""
    from dataclasses import replace

    from ckplan.planner.plan import OFFLOAD, RELEASE, Plan, Store
    rep = make_plan_report()
    n = rep.chosen.plan.n_layers
    items = tuple(Store(i, OFFLOAD if i < 3 or i == 5 else "store") for i in range(n))
    plan = Plan("dp", n, items, {RELEASE: {0: 2, 1: 4, 2: 4, 5: 7}})
    text = _render(render.plan_tables, 120, rep=replace(rep, chosen=replace(rep.chosen, plan=plan)))
    assert "offloaded, freed after F(2)..F(4)" in text
    assert "offloaded, freed after F(7)" in text and "F(7)..F" not in text


def test_side_inputs_row_counts_those_no_layer_saves():
    from dataclasses import replace

    from ckplan.records import SideInput
    prof = replace(make_profile(), side_inputs=(SideInput(3 * MiB, (0, 1)), SideInput(5 * MiB, (0, 1), saved_by=(1,))))
    buf = io.StringIO()
    render.profile_table(prof, console=Console(file=buf, width=200, color_system=None))
    row = next(line for line in buf.getvalue().splitlines() if "side inputs" in line)
    assert row.split()[-2:] == ["3", "MiB"]  # the saved one is among the activations


def test_headers_name_gradient_accumulation():
    from dataclasses import replace
    base = make_profile()
    prof = replace(base, accum=4, totals=replace(base.totals, measured_peak_bytes=base.totals.predicted_peak_bytes))
    profile = _render(render.profile_table, 200, prof=prof)
    assert "| batch 8 | accum 4 |" in profile.splitlines()[0]
    assert "measured peak, a later micro-batch's fwd+bwd (gradients held)" in profile
    plan = _render(render.plan_tables, 200, rep=replace(make_plan_report(), profile=prof))
    assert "| accum 4 |" in plan.splitlines()[0]
    assert "accum" not in _render(render.profile_table, 200, prof=make_profile()).splitlines()[0]


def test_world_size_table_keeps_the_plan_folded_at_any_width():
    """The per-rank plan is the answer: it folds into the width left, never dropped for extras."""
    from ckplan.planner.parallel import WorldSizeRow
    from ckplan.planner.plan import Checkpoint, Plan, Store
    plan = Plan("dp", 40, tuple(Store(i) for i in range(8))
                + tuple(Checkpoint(i, i + 1, (Store(i),)) for i in range(8, 40))).describe(runs=True)
    assert plan == "S0..S7 C[8,9){S8}..C[39,40){S39}"
    rows = [WorldSizeRow(8, "fsdp", "dp", 40 * MiB, 300 * MiB, None, 90 * MiB, 80 * MiB, False, None, None,
                         "", message="budget 80 MiB is below the smallest feasible peak 90 MiB"),
            WorldSizeRow(16, "fsdp", "dp", 20 * MiB, 280 * MiB, 78 * MiB, 70 * MiB, 80 * MiB, True, 0.25, 33,
                         plan)]
    prof = make_profile()
    for width in (80, 100, 200):
        text = _render(lambda **kw: render.world_size_table(prof, rows, **kw), width)
        table_lines = [line for line in text.splitlines() if line[:1] in "┏┃┡│└"]
        assert max(len(line) for line in table_lines) <= width, text
        folded = "".join(line.split("│")[-2].strip() for line in table_lines if line.startswith("│"))
        assert plan.replace(" ", "") in folded.replace(" ", ""), text
        assert "lowest peak" in text or width < 100, text
    assert "no plan at 8 ranks: budget 80 MiB is below" in " ".join(_render(
        lambda **kw: render.world_size_table(prof, rows, **kw), 200).split())


def test_a_slowdown_within_noise_shows_its_median_marked_and_named_in_a_note():
    bench = make_bench()
    rows = (_row("none", n_checkpoints=0, slowdown=1.0),
            _row("chen", slowdown=1.12, slowdown_within_noise=True), _row("dp", slowdown=1.04))
    con = Console(record=True, width=80, file=io.StringIO())
    render.bench_table(BenchResult(**{**bench.__dict__, "rows": rows}), console=con)
    text = con.export_text()
    assert "~1.12x │" in text and "(within noise)" not in text.split("note:")[0]
    assert "│    1.04x │" in text
    notes = [line for line in text.splitlines() if line.startswith("note: ~")]
    assert notes == ["note: ~ (chen): within noise, the timed rounds ran both faster and slower than none's "
                     "(the median is shown)"]
