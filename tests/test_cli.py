"""The command line: JSON envelopes (key sets pinned), exit codes, one-line errors."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from ckplan.cli import app

runner = CliRunner()


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def test_progress_lines_in_a_log_are_never_broken(tiny_gpt_spec, tmp_path):
    # stderr in a log or pipe (not a terminal): each step is one line, however long (it was
    # wrapped at 80 columns, leaving "selective options" alone on the next line)
    r = subprocess.run([sys.executable, "-m", "ckplan", "profile", str(tiny_gpt_spec(tmp_path)), "--device", "meta",
                        "-f", "json"], capture_output=True, text=True, timeout=300, env={**os.environ, "COLUMNS": "60"})
    assert r.returncode == 0, r.stderr
    line = next(ln for ln in r.stderr.splitlines() if ln.startswith("profiling one training step"))
    assert line.endswith("selective options") and len(line) > 60


def test_profile_json_envelope(tiny_gpt_spec, tmp_path):
    spec = tiny_gpt_spec(tmp_path)
    r = run("profile", spec, "--device", "cpu", "--format", "json", "--repeats", "1")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["schema_version"] == 1 and doc["command"] == "profile"
    for key in ("model", "device", "layers", "totals", "chain"):
        assert key in doc
    row = doc["layers"][1]
    for key in ("index", "name", "type", "param_bytes", "output_bytes", "saved_bytes", "fwd_ms", "bwd_ms", "fwd_flops"):
        assert key in row
    for key in ("param_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes", "predicted_peak_bytes"):
        assert isinstance(doc["totals"][key], int)


def test_profile_saved_json_feeds_plan(tiny_gpt_spec, tmp_path):
    spec = tiny_gpt_spec(tmp_path)
    saved = tmp_path / "p.json"
    assert run("profile", spec, "--device", "meta", "-o", saved, "-f", "json").exit_code == 0
    r = run("plan", "--profile", saved, "--budget", "98%", "--format", "json", "-o", tmp_path / "plan.json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    for key in ("schema_version", "command", "strategy", "budget_bytes", "predicted_peak_bytes",
                "predicted_recompute_ms", "predicted_overhead", "layers", "plan"):
        assert key in doc
    assert doc["command"] == "plan" and doc["predicted_peak_bytes"] <= doc["budget_bytes"]
    assert json.loads((tmp_path / "plan.json").read_text())["plan"]["n_layers"] == 3


def test_profile_saves_what_plan_and_bench_use_without_a_spec(tiny_gpt_spec, tmp_path):
    """The design card's flow: `ckplan profile SPEC`, then `ckplan plan --budget ...` and `ckplan
    bench --compare ...` with no SPEC. Oracles: the saved file is the document `-f json` printed; plan
    from it equals plan --profile of it; bench runs the spec it was made from, overrides included."""
    spec = tiny_gpt_spec(tmp_path)
    r = run("profile", spec, "--device", "cpu", "--repeats", "1", "--batch-size", "3", "-f", "json")
    assert r.exit_code == 0, r.output
    saved = Path("reports/profile-tiny-gpt-cpu.json")
    assert json.loads(saved.read_text()) == json.loads(r.stdout)
    got = run("plan", "-f", "json")
    assert got.exit_code == 0, got.output
    assert f"planning from {saved}" in got.stderr
    want = run("plan", "--profile", saved, "-f", "json")
    assert json.loads(got.stdout) == json.loads(want.stdout)
    assert json.loads(got.stdout)["batch_size"] == 3
    b = run("bench", "--compare", "none,every-k", "--steps", "1", "--warmup", "0", "-f", "json")
    assert b.exit_code == 0, b.output
    doc = json.loads(b.stdout)
    assert doc["model"] == "tiny-gpt" and doc["batch_size"] == 3
    assert [row["status"] for row in doc["rows"]] == ["ok", "ok"]
    assert Path("reports/bench-tiny-gpt-cpu.json").is_file()


def test_plan_without_a_spec_reads_the_newest_profile(tiny_gpt_spec, tmp_path):
    older, newer = tiny_gpt_spec(tmp_path, n_layer=3), tmp_path / "four.yaml"
    newer.write_text(older.read_text().replace("n_layer': 3", "n_layer': 4"))
    for s in (older, newer):
        assert run("profile", s, "--device", "meta", "--no-options").exit_code == 0
    files = sorted(Path("reports").glob("profile-*.json"))
    assert [f.name for f in files] == ["profile-four-meta.json", "profile-tiny-gpt-meta.json"]
    os.utime(files[1], (1, 1))  # tiny-gpt's is now the older one
    r = run("plan", "-f", "json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["n_layers"] == 4 and "profile-four-meta.json" in r.stderr


def test_a_saved_profile_plans_per_rank_as_its_spec_says(tiny_gpt_spec, tmp_path):
    spec = tiny_gpt_spec(tmp_path)
    spec.write_text(spec.read_text() + "parallel: {world_size: 4, kind: fsdp}\n")
    want = run("plan", spec, "--device", "meta", "-f", "json")
    assert want.exit_code == 0, want.output
    assert run("profile", spec, "--device", "meta", "-f", "json").exit_code == 0
    for args in ((), ("--profile", "reports/profile-tiny-gpt-meta.json")):
        got = run("plan", *args, "-f", "json")
        assert got.exit_code == 0, got.output
        assert json.loads(got.stdout) == json.loads(want.stdout)
    assert json.loads(want.stdout)["world_size"] == 4


@pytest.mark.parametrize("target,says", [("h100", "times come from the h100 device model"),
                                         ("cpu", "times are estimated from FLOPs")])
def test_a_meta_plan_says_where_its_times_come_from(tiny_gpt_spec, tmp_path, target, says):
    r = run("plan", tiny_gpt_spec(tmp_path), "--device", "meta", "--target", target, "--no-options", "-f", "json")
    assert r.exit_code == 0, r.output
    assert any(says in n for n in json.loads(r.stdout)["notes"])


def test_plan_and_bench_without_spec_or_profile_exit_2(tmp_path):
    for command in ("plan", "bench"):
        r = run(command, "--budget", "1GB")
        assert r.exit_code == 2 and f"{command} was given no SPEC" in r.output and "ckplan profile" in r.output
    assert not Path("reports").exists()  # bench's --out-dir, made before the check, is gone again


def test_plan_without_a_spec_refuses_what_would_profile_again(tiny_gpt_spec, tmp_path):
    assert run("profile", tiny_gpt_spec(tmp_path), "--device", "meta", "--no-options").exit_code == 0
    r = run("plan", "--budget", "90%", "--batch-size", "4", "--device", "cpu")
    assert r.exit_code == 2 and "--batch-size 4 --device cpu: plan was given no SPEC" in r.output
    assert "ckplan plan SPEC --batch-size 4 --device cpu" in r.output


def test_csv_output(tiny_gpt_spec, tmp_path):
    r = run("profile", tiny_gpt_spec(tmp_path), "--device", "meta", "--format", "csv")
    assert r.exit_code == 0
    lines = r.stdout.strip().splitlines()
    assert lines[0].startswith("index,name,type") and len(lines) == 1 + 5  # pre, 3 layers, post
    # byte and FLOP counts stay whole numbers in the CSV, as in the JSON, even in columns that are
    # blank for pre and post (early-stop sizes, options)
    header = lines[0].split(",")
    for line in lines[1:]:
        for col, value in zip(header, line.split(",")):
            if (col.endswith("_bytes") or col.endswith("_flops")) and value:
                assert value.isdigit(), (col, value)


@pytest.mark.parametrize("budget", ["12 parsecs", "-5GB", "0", "abc%", "0%"])
@pytest.mark.parametrize("ranks", [[], ["--world-size", "2,4"]])
def test_bad_budgets_exit_2(tiny_gpt_spec, tmp_path, budget, ranks):
    r = run("plan", tiny_gpt_spec(tmp_path), "--device", "meta", "--budget", budget, *ranks)
    assert r.exit_code == 2
    assert "Error:" in r.output and "12GiB" in r.output and "Traceback" not in r.output
    assert len(r.output.strip().splitlines()) == 1, r.output  # no progress line before the error


def test_infeasible_budget_exit_3(tiny_gpt_spec, tmp_path):
    r = run("plan", tiny_gpt_spec(tmp_path), "--device", "meta", "--budget", "1KB")
    assert r.exit_code == 3
    assert "smallest feasible peak" in r.output and "optimizer state" in r.output


@pytest.mark.parametrize("text,needle", [
    ("model: [unclosed", "invalid YAML"),
    ("model: {builtin: gpt}\ninput: {batch_size: 2, shape: [4], colour: red}", "input.colour: unknown key"),
    ("model: {builtin: transformer9000}\ninput: {batch_size: 2, shape: [4]}", "unknown model 'transformer9000'"),
    ("model: {builtin: mlp}\ninput: {batch_size: 2, shape: [4], dtype: float33}", "input.dtype"),
    ("model: {builtin: mlp, args: {depth: 2, width: 4, in_features: 4}}\ninput: {batch_size: 2, shape: [4]}\n"
     "chain: body.layers", "no submodule 'body.layers'"),
    ("model: {builtin: mlp, args: {dept: 2}}\ninput: {batch_size: 2, shape: [4]}", "dept"),
    ("model: {target: 'nonexistent_mod_xyz:make'}\ninput: {batch_size: 2, shape: [4]}", "cannot import"),
])
def test_bad_specs_exit_2(write_spec, tmp_path, text, needle):
    r = run("profile", write_spec(tmp_path, text), "--device", "cpu")
    assert r.exit_code == 2, r.output
    assert needle in r.output and "Traceback" not in r.output


def test_missing_file_exit_2():
    r = run("profile", "no/such/spec.yaml")
    assert r.exit_code == 2 and "does not exist" in r.output


def test_model_that_raises_exit_1(write_spec, tmp_path, monkeypatch):
    (tmp_path / "broken_model.py").write_text(
        "import torch.nn as nn\n"
        "class M(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__(); self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))\n"
        "    def forward(self, x):\n"
        "        raise ValueError('shape mismatch in my model')\n"
        "def make():\n    return M()\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = write_spec(tmp_path, "model: {target: 'broken_model:make'}\ninput: {batch_size: 2, shape: [4]}")
    r = run("profile", spec, "--device", "cpu")
    assert r.exit_code == 1 and "shape mismatch in my model" in r.output and "Traceback" not in r.output


def test_cuda_without_gpu_exit_2(tiny_gpt_spec, tmp_path):
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    r = run("profile", tiny_gpt_spec(tmp_path), "--device", "cuda")
    assert r.exit_code == 2 and "no CUDA GPU" in r.output


def test_seed_article_arithmetic_on_mlp100(configs):
    # 100 layers that keep ~1 GB each: every-10 needs about 10 boundaries + one 10-layer segment
    # being recomputed, i.e. ~20 GB of activations, not the article's 10 GB.
    r = run("plan", configs / "mlp-100.yaml", "--device", "meta", "--batch-size", "244141",
            "--strategy", "all", "--k", "10", "--budget", "25GB", "--format", "json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    rows = {x["strategy"]: x for x in doc["strategies"]}
    persistent = doc["persistent_bytes"]
    act = rows["every-k"]["predicted_peak_bytes"] - persistent
    assert 19e9 <= act <= 22e9
    assert rows["dp"]["predicted_recompute_ms"] <= rows["every-k"]["predicted_recompute_ms"] + 1e-9


@pytest.mark.slow
def test_plan_exact_proves_what_the_banded_dp_found(configs):
    """100 layers: dp is the banded DP (not proven, a note says so); --exact runs the exact DP,
    which here costs the same."""
    args = ("plan", configs / "mlp-100.yaml", "--device", "meta", "--batch-size", "244141",
            "--budget", "25GB", "--format", "json")
    docs = []
    for extra in ((), ("--exact",)):
        r = run(*args, *extra)
        assert r.exit_code == 0, r.output
        docs.append(json.loads(r.stdout))
    banded, exact = docs
    assert not banded["exact"] and any("near-optimal" in n for n in banded["notes"])
    assert exact["exact"] and not exact["notes"]
    assert banded["predicted_recompute_ms"] == pytest.approx(exact["predicted_recompute_ms"], rel=1e-9)


def test_plan_exact_is_refused_where_it_would_be_ignored(configs):
    for extra in (("--sweep",), ("--world-size", "2,4")):
        r = run("plan", configs / "gpt-tiny-dist.yaml", "--device", "meta", "--exact", *extra)
        assert r.exit_code == 2, r.output
        assert "--exact" in r.output


def test_plan_json_round_trips_into_bench(tiny_gpt_spec, tmp_path):
    spec = tiny_gpt_spec(tmp_path)
    plan_file = tmp_path / "plan.json"
    r = run("plan", spec, "--device", "cpu", "--strategy", "every-k", "--k", "1", "-o", plan_file, "-f", "json")
    assert r.exit_code == 0, r.output
    r = run("bench", spec, "--device", "cpu", "--compare", "none", "--plan", plan_file, "--steps", "1",
            "--warmup", "0", "--out-dir", tmp_path / "out", "-f", "json")
    assert r.exit_code == 0, r.output
    rows = {x["strategy"]: x for x in json.loads(r.stdout)["rows"]}
    assert set(rows) == {"none", "plan:every-k"}
    assert rows["plan:every-k"]["status"] == "ok" and rows["plan:every-k"]["max_grad_diff"] < 1e-5
    assert rows["plan:every-k"]["peak_error"] < 0.05


def test_bad_plan_file_exit_2(tiny_gpt_spec, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"n_layers": 3, "checkpoints": [[0, 2], [1, 3]]}')
    r = run("bench", tiny_gpt_spec(tmp_path), "--device", "cpu", "--compare", "none", "--plan", bad)
    assert r.exit_code == 2 and "overlap" in r.output


# ---- usage errors: one line, exit 2, before anything runs -------------------------------------

@pytest.mark.parametrize("args,needle", [
    (["plan", "x.yaml", "--k", "0"], "--k"),
    (["profile"], "Missing argument 'SPEC'"),
    (["profile", "x.yaml", "--bogus"], "No such option: --bogus"),
    (["plan", "x.yaml", "--strategy", "fastest"], "'fastest' is not one of"),
    (["profile", "x.yaml", "--precision", "int8"], "'int8' is not one of"),
    (["bench", "x.yaml", "--device", "tpu"], "'tpu' is not one of"),
    (["frobnicate"], "No such command"),
])
def test_typer_usage_errors_are_one_error_line(args, needle):
    r = run(*args)
    assert r.exit_code == 2, r.output
    lines = [x for x in r.output.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: "), r.output
    assert needle in lines[0] and "Tip: see `" in lines[0] and "--help`" in lines[0]
    assert "╭" not in r.output and "Traceback" not in r.output


@pytest.fixture
def model_that_must_not_run(write_spec, tmp_path, monkeypatch):
    (tmp_path / "never_built.py").write_text("def make():\n    raise SystemExit('the model was built')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return write_spec(tmp_path, "model: {target: 'never_built:make'}\ninput: {batch_size: 2, shape: [4]}")


@pytest.mark.parametrize("args,needle", [
    (["plan", "--budget", "12 parsecs"], "budget '12 parsecs'"),
    (["plan", "--budget", "1e400"], "larger than any machine"),
    (["plan", "--budget", "nan%"], "not a percentage"),
    (["plan", "--budget", "-5%"], "budget '-5%': a share must be above 0%"),
    (["bench", "--budget", "1e400GB"], "larger than any machine"),
    (["bench", "--memory-limit", "lots"], "memory_limit 'lots'"),
])
def test_options_checked_before_the_model_is_built(model_that_must_not_run, tmp_path, args, needle):
    spec = model_that_must_not_run
    r = run(args[0], spec, "--device", "cpu", *args[1:], "--out-dir", tmp_path / "out")
    assert r.exit_code == 2, r.output
    assert needle in r.output and "the model was built" not in r.output and "Traceback" not in r.output


@pytest.mark.parametrize("extra,needle", [
    (["SPEC"], "SPEC (spec)"),
    (["--batch-size", "4"], "batch_size=4"),
    (["--precision", "bf16"], "precision='bf16'"),
    (["--device", "cpu"], "device='cpu'"),
])
def test_plan_profile_with_what_it_would_ignore_is_an_error(tiny_gpt_spec, tmp_path, extra, needle):
    spec = tiny_gpt_spec(tmp_path)
    saved = tmp_path / "p.json"
    assert run("profile", spec, "--device", "meta", "-o", saved, "-f", "json").exit_code == 0
    extra = [spec if x == "SPEC" else x for x in extra]
    r = run("plan", *extra, "--profile", saved)
    assert r.exit_code == 2, r.output
    assert needle in r.output and "would be ignored" in r.output


@pytest.fixture
def saved_profile(tiny_gpt_spec, tmp_path):
    spec = tiny_gpt_spec(tmp_path)
    saved = tmp_path / "p.json"
    assert run("profile", spec, "--device", "meta", "-o", saved, "-f", "json").exit_code == 0
    return json.loads(saved.read_text())


def _dup(doc):
    doc["layers"].insert(2, dict(doc["layers"][1]))


def _drop(doc):
    del doc["layers"][2]


def _swap(doc):
    doc["layers"][1], doc["layers"][2] = doc["layers"][2], doc["layers"][1]


@pytest.mark.parametrize("breakit,needle", [
    (lambda d: d["layers"][2].update(fwd_ms=float("nan")), "layers[2].fwd_ms"),
    (lambda d: d["layers"][1].update(bwd_ms=-1.0), "layers[1].bwd_ms"),
    (lambda d: d["layers"][3].update(saved_bytes=-5), "layers[3].saved_bytes"),
    (lambda d: d["layers"][1].update(output_bytes=1.5), "layers[1].output_bytes"),
    (lambda d: d["totals"].update(optimizer_bytes=-1), "totals.optimizer_bytes"),
    (lambda d: d["totals"].pop("param_bytes"), "totals.param_bytes is missing"),
    (lambda d: d["layers"][2].pop("fwd_flops"), "layers[2].fwd_flops is missing"),
    (_dup, "layers[2].index"),
    (_drop, "layers[2].index"),
    (_swap, "layers[1].index"),
    (lambda d: d.update(batch_size=0), "batch_size"),
    (lambda d: d.update(side_inputs=[{"bytes": -4, "layers": [0]}]), "side_inputs[0].bytes"),
    (lambda d: d.update(side_inputs=[{"bytes": 4, "layers": [99]}]), "side_inputs[0].layers"),
    (lambda d: d.update(side_inputs=[{"bytes": 4}]), "side_inputs[0] is not an object"),
    (lambda d: d.update(side_inputs=[{"bytes": 4, "layers": [1], "saved_by": [2]}]), "side_inputs[0].saved_by"),
    (lambda d: d.update(side_inputs=[{"bytes": 4, "layers": [2], "made_by": 0, "unrelayed": "2"}]),
     "side_inputs[0].unrelayed"),
    (lambda d: d.update(side_inputs=[{"bytes": 4, "layers": [1], "partial_span": [1]}]), "side_inputs[0].partial_span"),
    (lambda d: d.update(side_inputs=[{"bytes": 4, "layers": [1], "grad_from": 2}]), "side_inputs[0].grad_from"),
])
@pytest.mark.slow
def test_bad_profile_json_is_rejected_with_the_field_named(saved_profile, tmp_path, breakit, needle):
    doc = saved_profile
    breakit(doc)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc))  # NaN is written as the NaN literal, as json.dumps does
    r = run("plan", "--profile", bad)
    assert r.exit_code == 2, r.output
    assert needle in " ".join(r.output.split()) and "Traceback" not in r.output


def test_output_checked_before_running(model_that_must_not_run, tmp_path):
    spec = model_that_must_not_run
    (tmp_path / "adir").mkdir()
    r = run("profile", spec, "--device", "cpu", "-o", tmp_path / "adir")
    assert r.exit_code == 2 and "the model was built" not in r.output
    (tmp_path / "afile").write_text("x")
    r = run("plan", spec, "--device", "cpu", "--sweep", "--out-dir", tmp_path / "afile")
    assert r.exit_code == 2 and "the model was built" not in r.output


def test_wide_flag_is_accepted(tiny_gpt_spec, tmp_path):
    spec = tiny_gpt_spec(tmp_path)
    assert run("profile", spec, "--device", "meta", "--wide").exit_code == 0
    assert run("plan", spec, "--device", "meta", "--wide", "--strategy", "all").exit_code == 0


def test_cli_has_no_rich_or_pandas_imports():
    import ast

    import ckplan.cli as cli
    for path in sorted(Path(cli.__file__).parent.glob("*.py")):
        tree = ast.parse(path.read_text())
        names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert not names & {"rich", "pandas"}, path.name


def test_plan_world_sizes_table_is_per_rank(tiny_gpt_spec, tmp_path):
    spec = tiny_gpt_spec(tmp_path, n_layer=4)
    r = run("plan", spec, "--device", "meta", "--world-size", "1,2,4", "-f", "json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["command"] == "plan-world-sizes" and [row["world_size"] for row in doc["rows"]] == [1, 2, 4]
    fixed = [row["persistent_bytes"] for row in doc["rows"]]
    assert fixed[0] > fixed[1] > fixed[2]  # FSDP shards parameters, gradients and optimizer state
    bad = run("plan", spec, "--device", "meta", "--world-size", "two")
    assert bad.exit_code == 2 and "--world-size 'two'" in bad.output
    # a budget only 4 ranks meet: the table's plan column stays narrow, the reason is under it
    lowest = {row["world_size"]: row["min_peak_bytes"] for row in doc["rows"]}
    r = run("plan", spec, "--device", "meta", "--world-size", "1,2,4", "--budget", str(lowest[4]), "--wide")
    assert r.exit_code == 0, r.output
    below = [line for line in r.stdout.splitlines() if line.startswith("no plan at 1, 2 ranks; at 2: budget")]
    assert len(below) == 1 and "is below the smallest feasible peak" in below[0], r.stdout
    assert max(len(line) for line in r.stdout.splitlines() if line.startswith("│")) < 200


def test_bench_nproc_two_fsdp_ranks_predicted_equals_measured(configs, tmp_path):
    from ckplan.distributed import fsdp_runs_on_cpu
    if not fsdp_runs_on_cpu():
        pytest.skip(f"FSDP2 on CPU ranks needs torch 2.9 (this is {torch.__version__}; ckplan refuses it)")
    spec = configs / "gpt-tiny-dist.yaml"  # even shards (tests/test_distributed.py checks them to the byte)
    # A real process: the ranks are forked from it (CliRunner's captured streams do not survive that).
    r = subprocess.run([sys.executable, "-m", "ckplan", "bench", str(spec), "--device", "cpu", "--nproc", "2",
                        "--compare", "none,every-k", "--steps", "1", "--out-dir", str(tmp_path / "out"),
                        "-f", "json"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["command"] == "bench-distributed" and doc["world_size"] == 2
    # gloo's worker threads decide what is live at a rank's peak on a loaded machine: at most one
    # more unit's unsharded parameters than FSDP2's order of frees (docs/distributed.md, Limits).
    from ckplan import api
    from ckplan.spec import build_model
    unit = sum(p.numel() * p.element_size() for p in build_model(api.load(spec), "cpu").blocks[0].parameters())
    for row in doc["rows"]:
        assert row["status"] == "ok", (row, doc["notes"])
        pred, diff = row["predicted_peak_bytes"], row["measured_peak_bytes"] - row["predicted_peak_bytes"]
        assert -0.02 * pred <= diff <= 0.02 * pred + unit, (row["strategy"], pred, diff, unit)
    assert (tmp_path / "out" / "bench-gpt-tiny-dist-cpu-fsdp2.json").is_file()


def test_spec_parallel_field_plans_per_rank(tiny_gpt_spec, tmp_path):
    spec = tiny_gpt_spec(tmp_path, n_layer=4)
    plain = json.loads(run("plan", spec, "--device", "meta", "-f", "json").stdout)
    spec.write_text(spec.read_text() + "parallel: {world_size: 4, kind: ddp}\n")
    ddp = json.loads(run("plan", spec, "--device", "meta", "-f", "json").stdout)
    # DDP replicates everything and adds gradient buckets: one rank needs more than one process.
    assert ddp["persistent_bytes"] > plain["persistent_bytes"]
    assert any("DDP on 4 ranks" in n for n in ddp["notes"])
    fsdp = json.loads(run("plan", spec, "--device", "meta", "--parallel", "fsdp", "-f", "json").stdout)
    assert fsdp["persistent_bytes"] < plain["persistent_bytes"]
    # --world-size replaces the spec's world size, not its kind: still DDP, the same per rank at 2
    # ranks as at 4 (it replicates); it planned FSDP when --world-size was given
    two = json.loads(run("plan", spec, "--device", "meta", "--world-size", "2", "-f", "json").stdout)
    assert two["parallel"] == "ddp" and two["persistent_bytes"] == ddp["persistent_bytes"]
    spec.write_text(spec.read_text().replace("world_size: 4, ", ""))  # kind only: one process by default
    table = json.loads(run("plan", spec, "--device", "meta", "--world-size", "2,4", "-f", "json").stdout)
    assert {r["kind"] for r in table["rows"]} == {"ddp"}, table["rows"]


def test_meta_target_picks_the_device_a_meta_profile_stands_for(tiny_gpt_spec, tmp_path):
    """`--target cuda` on meta: CUDA's attention kernels and multi-tensor optimizer, and a note of
    what a fake-tensor profile cannot see there; refused off meta and with a saved profile."""
    spec = tiny_gpt_spec(tmp_path, n_embd=64, n_head=2)
    docs = {}
    for target in ("cpu", "cuda"):
        r = run("profile", spec, "--device", "meta", "--target", target, "--optimizer", "adamw", "-f", "json")
        assert r.exit_code == 0, r.output
        docs[target] = json.loads(r.stdout)
    cuda_notes = " ".join(docs["cuda"]["notes"])
    assert "as cuda's scaled_dot_product_attention" in cuda_notes and "cuBLAS workspaces" in cuda_notes
    assert "cuBLAS" not in " ".join(docs["cpu"]["notes"])
    # foreach AdamW on CUDA makes whole-list temporaries; per-tensor on the CPU
    assert docs["cuda"]["totals"]["optimizer_tmp_bytes"] > docs["cpu"]["totals"]["optimizer_tmp_bytes"]
    r = run("profile", spec, "--device", "cpu", "--target", "cuda")
    assert r.exit_code == 2 and "--target cuda is for --device meta" in r.output
    saved = tmp_path / "p.json"
    assert run("profile", spec, "--device", "meta", "-o", saved, "-f", "json").exit_code == 0
    r = run("plan", "--profile", saved, "--target", "cuda")
    assert r.exit_code == 2 and "target='cuda'" in r.output
    r = run("plan", spec, "--device", "meta", "--target", "cuda", "-f", "json")
    assert r.exit_code == 0, r.output


def test_bench_plan_for_another_chain_fails_before_any_profile(tiny_gpt_spec, tmp_path, monkeypatch):
    import ckplan.api

    def no_profile(*a, **k):
        raise AssertionError("profiled before the plan file was checked")
    monkeypatch.setattr(ckplan.api, "profile_model", no_profile)
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"n_layers": 1000, "checkpoints": [[0, 2]]}))
    r = run("bench", tiny_gpt_spec(tmp_path), "--plan", plan, "--device", "cpu", "--out-dir", tmp_path / "out")
    assert r.exit_code == 2, r.output
    assert "the plan is for 1000 layers but the chain has 3" in r.output
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("over,needle", [
    (("-b", "99999999999999999999"), "larger than any machine's memory"),
    (("--seq-len", "150000000"), "the sequence length, is 150000000, above the 32 positions the model takes"),
    (("--seq-len", "99999999999"), "use a sequence length of at most 32 (--seq-len 32"),
])
def test_a_batch_the_model_or_machine_cannot_take_exits_2_in_one_line(tiny_gpt_spec, tmp_path, over, needle):
    r = run("profile", tiny_gpt_spec(tmp_path), "--device", "cpu", "--no-options", *over)
    assert r.exit_code == 2, r.output
    errors = [line for line in r.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and needle in errors[0] and "frame #" not in r.output


def test_an_unexpected_error_is_one_line_without_pytorchs_stack_dump(tiny_gpt_spec, tmp_path, monkeypatch):
    import ckplan.api

    def boom(*a, **k):
        raise RuntimeError("shape overflow\nException raised from f at x.cpp:79 (most recent call first):\n"
                           "frame #0: c10::Error::Error() + 0x9d")
    monkeypatch.setattr(ckplan.api, "profile", boom)
    r = run("profile", tiny_gpt_spec(tmp_path), "--device", "meta")
    assert r.exit_code == 1
    assert r.output.strip().endswith("Error: RuntimeError: shape overflow ... (run with --debug for the traceback)")


def test_a_model_error_points_to_debug_on_the_command_line_only(write_spec, tmp_path, monkeypatch):
    (tmp_path / "raises_in_forward.py").write_text(
        "import torch.nn as nn\n"
        "class M(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__(); self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))\n"
        "    def forward(self, x):\n"
        "        raise ValueError('broken model')\n"
        "def make():\n    return M()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = write_spec(tmp_path, "model: {target: 'raises_in_forward:make'}\ninput: {batch_size: 2, shape: [4]}\n"
                                "chain: layers\n")
    r = run("profile", spec, "--device", "cpu", "--no-options")
    assert r.exit_code == 1
    assert "broken model. Tip: check that the spec's input" in " ".join(r.output.split())
    assert r.output.rstrip().endswith("own error (run with --debug for the traceback)")
    from ckplan import api
    from ckplan.errors import ModelRunError
    with pytest.raises(ModelRunError) as e:
        api.profile(api.load(spec), device="cpu", repeats=1, warmup=0)
    assert "--debug" not in str(e.value) and isinstance(e.value.__cause__, ValueError)


def test_sweep_points_above_the_limit_exit_2_before_any_profile(tiny_gpt_spec, tmp_path, monkeypatch):
    import ckplan.api

    def no_profile(*a, **k):
        raise AssertionError("profiled before --points was checked")
    monkeypatch.setattr(ckplan.api, "profile", no_profile)
    r = run("plan", tiny_gpt_spec(tmp_path), "--sweep", "--points", "200000", "--out-dir", tmp_path / "o")
    assert r.exit_code == 2, r.output
    assert "points 200000 is not a number of budgets from 2 to 10000" in r.output


def test_plan_output_never_replaces_its_own_input(tiny_gpt_spec, tmp_path):
    spec = tiny_gpt_spec(tmp_path)
    prof = tmp_path / "p.json"
    assert run("profile", spec, "--device", "meta", "-o", prof, "-f", "json").exit_code == 0
    before = prof.read_bytes()
    (tmp_path / "link.json").symlink_to(prof)
    for out in (prof, tmp_path / "link.json", tmp_path / "." / "p.json"):
        r = run("plan", "--profile", prof, "-o", out)
        assert r.exit_code == 2 and "is the file --profile reads" in r.output, r.output
    r = run("profile", spec, "--device", "meta", "-o", spec)
    assert r.exit_code == 2 and "is the file SPEC reads" in r.output
    assert prof.read_bytes() == before and spec.read_text().lstrip().startswith("model:")


def test_a_second_bench_into_one_folder_says_what_it_replaces(tiny_gpt_spec, tmp_path):
    args = ("bench", tiny_gpt_spec(tmp_path), "--device", "cpu", "--compare", "none", "--steps", "1",
            "--no-options", "--out-dir", tmp_path / "out")
    first = run(*args)
    assert first.exit_code == 0 and "replaced" not in first.output, first.output
    second = run(*args)
    assert second.exit_code == 0
    assert "note: replaced bench-tiny-gpt-cpu.csv, bench-tiny-gpt-cpu.json, bench-tiny-gpt-cpu.png, " \
           "frontier-tiny-gpt-cpu.png in " in second.output.replace("\n", "")


def test_a_spec_name_with_control_characters_is_printed_escaped(write_spec, tmp_path):
    spec = write_spec(tmp_path, 'name: "evil\\x1b]0;title\\x07\\x1b[2J"\nmodel: {builtin: mlp, args: {in_features: 4, '
                                'depth: 2, width: 4}}\ninput: {batch_size: 2, shape: [4]}\nchain: layers\n')
    for args in (("profile", spec, "--device", "meta", "--no-options"), ("plan", spec, "--device", "meta"),
                 ("plan", spec, "--device", "meta", "--budget", "1KB")):  # an error line naming the model
        r = run(*args)
        assert "\x1b" not in r.output and "\x07" not in r.output, args
    assert "evil\\x1b]0;title\\x07\\x1b[2J" in run("plan", spec, "--device", "meta").output


@pytest.mark.parametrize("command", ["profile", "plan"])
def test_device_meta_help_says_a_target_still_runs(command, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")  # one line per option
    r = run(command, "--help")
    line = next(x for x in r.output.splitlines() if x.strip("│ ").startswith("--device"))
    assert "meta (fake tensors: no memory allocated; the model's code still runs on meta: a spec's " \
           "`target:` is imported and called, so run only specs you trust)" in " ".join(line.split())


def test_the_fast_exit_keeps_the_code_the_output_the_handlers_and_the_threads():
    # ckplan ends without the interpreter's teardown (cli.exits.exit_now); what a normal exit
    # does that a user can see must still happen: the exit code, buffered output, exit handlers
    # (compiler worker pools, temporary folders) and other threads' work, and it must end with
    # an idle thread pool alive (after --compile-scope model the process stayed alive without it)
    code = (
        "import atexit, sys, threading, time\n"
        "from ckplan.cli.exits import exit_now\n"
        "atexit.register(lambda: print('handler ran'))\n"
        "threading.Thread(target=lambda: (time.sleep(0.2), print('thread done'))).start()\n"
        # an idle pool's workers (TorchInductor compiles on one) wait for the pool's exit hook
        "from concurrent.futures import ThreadPoolExecutor\n"
        "pool = ThreadPoolExecutor(2); pool.submit(time.sleep, 0.1).result()\n"
        "sys.stdout.write('unflushed ')\n"
        "exit_now(3)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 3, r.stderr
    assert r.stdout.split() == ["unflushed", "thread", "done", "handler", "ran"]
