"""The command line's answers to bad input: each bad input is one `Error:` line with the right
exit code, said before the long work (a plan made for another chain, files of another kind,
numbers a profile cannot hold, options a mode would ignore, spec values that cannot work), and
one failure is said once."""
import json

import pytest
from typer.testing import CliRunner

from ckplan import api, api_plan, report
from ckplan.cli import app
from ckplan.errors import ChainError, PlannerBugError, UsageError

runner = CliRunner()

MLP = """
model: {builtin: mlp, args: {in_features: 8, depth: 3, width: 8, activation: relu}}
input: {batch_size: 4, shape: [8], dtype: float32}
chain: layers
train: {optimizer: sgd, precision: fp32, accum: 1}
"""


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def one_line(r) -> str:
    return " ".join(r.output.split())


@pytest.fixture
def mlp_spec(write_spec, tmp_path):
    return write_spec(tmp_path, MLP, "mlp3.yaml")


@pytest.fixture
def never_built(write_spec, tmp_path, monkeypatch):
    """A spec whose model must not be built: the error has to come before any work."""
    (tmp_path / "never_built_qa.py").write_text("def make():\n    raise SystemExit('the model was built')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return write_spec(tmp_path, "model: {target: 'never_built_qa:make'}\ninput: {batch_size: 2, shape: [4]}\n"
                                "chain: layers\n")


def _plan_doc(chain="layers", model="mlp3", n=3, command="plan"):
    return {"schema_version": 1, "command": command, "model": model, "chain": chain, "n_layers": n,
            "plan": {"format": "ckplan.plan/1", "strategy": "every-k", "n_layers": n, "params": {},
                     "checkpoints": [[0, 1]]}}


# ---- item 1: a plan made for another chain is refused; another model name is a note --------------

def test_bench_refuses_a_plan_made_for_another_chain(never_built, tmp_path):
    plan = tmp_path / "plan-gpt.json"
    plan.write_text(json.dumps(_plan_doc(chain="blocks", model="tiny-gpt")))
    r = run("bench", never_built, "--device", "cpu", "--compare", "none", "--plan", plan, "--out-dir", tmp_path / "o")
    assert r.exit_code == 2, r.output
    text = one_line(r)
    assert "chain 'blocks'" in text and "chain is 'layers'" in text and "Tip:" in text
    assert "the model was built" not in text


def test_bench_plan_for_a_renamed_spec_runs_with_a_note(mlp_spec, tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(_plan_doc(model="old-name")))
    r = run("bench", mlp_spec, "--device", "cpu", "--compare", "none", "--plan", plan, "--steps", "1",
            "--warmup", "0", "--no-options", "--out-dir", tmp_path / "o")
    assert r.exit_code == 0, r.output
    assert "made for model 'old-name', this spec is 'mlp3'" in one_line(r)


# ---- item 2: an infeasible --budget exits 3 from bench and the per-rank table too -----------------

def test_bench_exits_3_when_the_budget_is_infeasible_after_writing(mlp_spec, tmp_path):
    out = tmp_path / "o"
    r = run("bench", mlp_spec, "--device", "cpu", "--compare", "none,dp", "--budget", "1KB", "--steps", "1",
            "--warmup", "0", "--no-options", "--out-dir", out)
    assert r.exit_code == 3, r.output
    assert "--budget 1KB: dp could not be planned" in one_line(r)
    assert (out / "bench-mlp3-cpu.json").is_file()


def test_an_infeasible_budget_is_a_users_error_not_a_crash(mlp_spec):
    r = run("plan", mlp_spec, "--device", "meta", "--budget", "1KB")
    assert r.exit_code == 3, r.output
    assert "below the smallest feasible peak" in one_line(r) and "--debug" not in r.output


def test_plan_world_sizes_exit_3_when_no_world_size_fits(mlp_spec):
    r = run("plan", mlp_spec, "--device", "meta", "--world-size", "2,4", "--budget", "1KB")
    assert r.exit_code == 3, r.output
    assert "no world size fits" in one_line(r)


# ---- the planner's own errors: one line and their exit code, never a traceback ---------------------

@pytest.mark.parametrize("error,code,needle", [
    (PlannerBugError("dp (banded) plan peaks at 9 > budget 8"), 1, "please report it"),
    (ChainError("layer 1 (fc): negative time"), 2, "layer 1 (fc): negative time"),
])
def test_planner_errors_are_one_line_without_a_traceback(saved_profile, monkeypatch, error, code, needle):
    def raising(*args, **kwargs):
        raise error
    monkeypatch.setattr(api_plan, "plan_chain", raising)
    r = run("plan", "--profile", saved_profile, "--budget", "90%")
    assert r.exit_code == code, r.output
    assert r.output.count("Error:") == 1 and needle in one_line(r) and "Traceback" not in r.output
    assert type(r.exception) is SystemExit  # handled by the CLI, not escaped


# ---- bench's files: a failed write comes after the table, with its own exit code ----------------

@pytest.mark.parametrize("error,code,needle", [
    (OSError(28, "No space left on device"), 1, "the results above were not written to"),
    (report.ReportsInterrupted("previous", [], signum=15), 143, "interrupted while writing reports"),
])
def test_a_bench_whose_files_fail_keeps_its_table(mlp_spec, tmp_path, monkeypatch, error, code, needle):
    def failing(*args, **kwargs):
        raise error
    monkeypatch.setattr(report, "write_bench", failing)
    r = run("bench", mlp_spec, "--device", "cpu", "--compare", "none", "--steps", "1", "--warmup", "0",
            "--no-options", "--out-dir", tmp_path / "o")
    assert r.exit_code == code, r.output
    assert "none" in r.stdout and needle in one_line(r) and "wrote" not in r.output


# ---- item 3: -o X.csv for plan is refused before the profile ------------------------------------

def test_plan_csv_output_is_refused_before_the_model_is_built(never_built, tmp_path):
    r = run("plan", never_built, "--device", "cpu", "-o", tmp_path / "plan.csv")
    assert r.exit_code == 2, r.output
    assert "writes JSON, not CSV" in one_line(r) and "the model was built" not in r.output


# ---- item 4 and 8: a binary spec, a folder as spec ---------------------------------------------

def test_non_utf8_spec_exit_2(tmp_path):
    spec = tmp_path / "binary.yaml"
    spec.write_bytes(b"\xff\xfe garbage\x00\x01")
    r = run("profile", spec, "--device", "meta")
    assert r.exit_code == 2, r.output
    assert "not a UTF-8 text file" in one_line(r) and "UnicodeDecodeError" not in r.output


def test_folder_as_spec_says_folder(tmp_path):
    (tmp_path / "adir.yaml").mkdir()
    r = run("profile", tmp_path / "adir.yaml", "--device", "meta")
    assert r.exit_code == 2, r.output
    assert "is a folder" in one_line(r) and "does not exist" not in r.output


# ---- item 5: integers beyond 2**62 in a profile JSON --------------------------------------------

@pytest.fixture
def saved_profile(mlp_spec, tmp_path):
    saved = tmp_path / "prof.json"
    assert run("profile", mlp_spec, "--device", "meta", "-o", saved, "-f", "json").exit_code == 0
    return saved


@pytest.mark.parametrize("value,every_row", [(10**30, False), (2**63, False), (2**62, True)])
def test_huge_profile_integers_exit_2(saved_profile, tmp_path, value, every_row):
    doc = json.loads(saved_profile.read_text())
    for row in doc["layers"][1:] if every_row else doc["layers"][1:2]:
        row["saved_bytes"] = value
    bad = tmp_path / "huge.json"
    bad.write_text(json.dumps(doc))
    r = run("plan", "--profile", bad, "--budget", "90%")
    assert r.exit_code == 2, r.output
    text = one_line(r)
    assert "saved_bytes" in text and "2**62" in text and "OverflowError" not in text


# ---- item 6 and 7: wrong files for --plan / --profile -------------------------------------------

def test_plan_that_is_not_an_object_names_the_real_option(mlp_spec, tmp_path):
    bad = tmp_path / "listplan.json"
    bad.write_text("[1, 2, 3]")
    r = run("bench", mlp_spec, "--device", "cpu", "--plan", bad, "--out-dir", tmp_path / "o")
    assert r.exit_code == 2, r.output
    assert "-o plan.json" in one_line(r) and "--out " not in r.output


@pytest.mark.parametrize("command,needle", [("profile", "this file is a ckplan profile"),
                                            ("plan-world-sizes", "per-rank table")])
def test_other_ckplan_document_as_plan(mlp_spec, tmp_path, command, needle):
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"schema_version": 1, "command": command, "model": "mlp3", "rows": []}))
    r = run("bench", mlp_spec, "--device", "cpu", "--plan", other, "--out-dir", tmp_path / "o")
    assert r.exit_code == 2, r.output
    text = one_line(r)
    assert needle in text and "not a plan" in text and "Tip:" in text and "n_layers" not in text


def test_plan_as_profile_says_so(tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(_plan_doc()))
    r = run("plan", "--profile", plan)
    assert r.exit_code == 2, r.output
    assert "this file is a ckplan plan (command: plan), not a profile" in one_line(r)


# ---- item 12: a fraction of a byte -------------------------------------------------------------

def test_budget_under_one_byte(mlp_spec):
    r = run("plan", mlp_spec, "--device", "meta", "--budget", "0.5")
    assert r.exit_code == 2, r.output
    text = one_line(r)
    assert "under one byte" in text and "0.5GB" in text and "more than 0 bytes" not in text


def test_duplicate_yaml_key_is_refused(write_spec, tmp_path):
    # plain YAML keeps the last `input:` silently: an edit to the first one would do nothing
    spec = write_spec(tmp_path, MLP + "input: {batch_size: 2, shape: [8], dtype: float32}\n", "dup.yaml")
    r = run("profile", spec, "--device", "meta")
    assert r.exit_code == 2
    assert "key 'input' is given twice" in one_line(r)


@pytest.mark.parametrize("field, value", [("batch_size", "true"), ("shape", "[true]")])
def test_a_bool_is_not_a_count(write_spec, tmp_path, field, value):
    text = MLP.replace("batch_size: 4", f"batch_size: {value}") if field == "batch_size" \
        else MLP.replace("shape: [8]", f"shape: {value}")
    spec = write_spec(tmp_path, text, "boolean.yaml")
    r = run("profile", spec, "--device", "meta")
    assert r.exit_code == 2
    assert f"{field} must be a number" in one_line(r)


# ---- item 10: options that several world sizes (or one process) would ignore ---------------------

def test_plan_world_sizes_refuse_export(saved_profile):
    r = run("plan", "--profile", saved_profile, "--world-size", "2,4", "--export", "hf")
    assert r.exit_code == 2, r.output
    text = one_line(r)
    assert "--export hf with several --world-size values (2,4)" in text
    assert "Tip: give one world size to export its plan, e.g. --world-size 4 --export hf" in text


def test_plan_world_sizes_refuse_output_before_writing(saved_profile, tmp_path):
    out = tmp_path / "ws.json"
    r = run("plan", "--profile", saved_profile, "--world-size", "2,4", "-o", out)
    assert r.exit_code == 2, r.output
    text = one_line(r)
    assert "with several --world-size values (2,4): -o writes a plan file" in text
    assert "--world-size 4 -o" in text and "--format json" in text
    assert not out.exists()


def test_plan_one_world_size_output_is_a_plan_bench_reads(saved_profile, tmp_path):
    out = tmp_path / "rank.json"
    r = run("plan", "--profile", saved_profile, "--world-size", "4", "--parallel", "ddp", "-o", out)
    assert r.exit_code == 0, r.output
    plan, doc = api.read_plan(out)
    assert doc["command"] == "plan" and plan.n_layers == 3


def test_plan_parallel_without_world_size_is_refused(saved_profile):
    r = run("plan", "--profile", saved_profile, "--parallel", "ddp")
    assert r.exit_code == 2, r.output
    text = one_line(r)
    assert "--parallel ddp needs several ranks" in text and "--world-size" in text


def test_bench_parallel_without_nproc_is_refused_and_leaves_no_folder(mlp_spec, tmp_path):
    out = tmp_path / "new" / "out"
    r = run("bench", mlp_spec, "--device", "cpu", "--parallel", "ddp", "--out-dir", out)
    assert r.exit_code == 2, r.output
    assert "--parallel ddp needs several ranks: without --nproc N" in one_line(r)
    assert not (tmp_path / "new").exists()


# ---- item 11: spec values that were accepted silently -------------------------------------------

def test_high_on_a_float_input_is_refused(write_spec, tmp_path):
    spec = write_spec(tmp_path, MLP.replace("dtype: float32}", "dtype: float32, high: 5}"), "floathigh.yaml")
    r = run("profile", spec, "--device", "meta", "--no-options")
    assert r.exit_code == 2, r.output
    assert "`high: 5` is set on a float32 input" in one_line(r)


def test_high_above_the_builtin_vocabulary_is_caught_on_meta(tiny_gpt_spec, tmp_path):
    spec = tiny_gpt_spec(tmp_path, vocab_size=50)  # the fixture's input has high: 97
    r = run("profile", spec, "--device", "meta", "--no-options")
    assert r.exit_code == 2, r.output
    text = one_line(r)
    assert "input.high 97 is above the model's vocabulary size 50 (model.args.vocab_size)" in text
    assert "set input.high to at most 50" in text and "IndexError" not in text


def test_high_above_the_hf_vocabulary_is_caught_on_meta(write_spec, tmp_path):
    pytest.importorskip("transformers")
    spec = write_spec(tmp_path, """
model:
  hf: {model_type: gpt2, n_layer: 1, n_head: 2, n_embd: 16, n_positions: 32, vocab_size: 100}
input: {batch_size: 1, shape: [8], dtype: int64, high: 1000, name: input_ids, labels: copy}
chain: transformer.h
""", "hfhigh.yaml")
    r = run("profile", spec, "--device", "meta", "--no-options")
    assert r.exit_code == 2, r.output
    assert "input.high 1000 is above the model's vocabulary size 100 (model.hf.vocab_size)" in one_line(r)


def test_seq_len_on_an_image_input_is_refused(configs):
    r = run("profile", configs / "resnet.yaml", "--device", "meta", "--seq-len", "64")
    assert r.exit_code == 2, r.output
    text = one_line(r)
    assert "the first dimension of a token-id input" in text
    assert "float32 tensor of shape [3, 64, 64] (an image), not a token sequence" in text
    with pytest.raises(UsageError, match="not a token sequence"):
        api.load(configs / "resnet.yaml", seq_len=64)


def test_compare_lists_a_strategy_twice_it_runs_once(mlp_spec, tmp_path):
    r = run("bench", mlp_spec, "--device", "cpu", "--compare", "none,none", "--steps", "1", "--warmup", "0",
            "--no-options", "--out-dir", tmp_path / "o", "-f", "json")
    assert r.exit_code == 0, r.output
    assert "--compare lists none more than once; each strategy runs once" in one_line(r)
    doc = json.loads(r.stdout[r.stdout.index("{"):])
    assert [row["strategy"] for row in doc["rows"]] == ["none"]


# ---- item 14: one failure said once, no empty first line, units, the budget line, no folder ------

SHAPE_MISMATCH = MLP.replace("shape: [8]", "shape: [7]")


def test_meta_and_real_failure_is_one_error(write_spec, tmp_path):
    spec = write_spec(tmp_path, SHAPE_MISMATCH, "mismatch.yaml")
    r = run("profile", spec, "--device", "cpu", "--no-options", "--repeats", "1")
    assert r.exit_code == 1, r.output
    assert "preflight skipped" not in r.output and r.output.count("Error:") == 1
    assert "cannot be multiplied" in one_line(r)


@pytest.mark.parametrize("bad", [("--plan", "nonexist.json"), ("--plan", "corrupt.json"),
                                 ("--memory-limit", "abc")])
def test_bench_early_errors_are_the_first_line_and_leave_no_folder(mlp_spec, tmp_path, monkeypatch, bad):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "corrupt.json").write_text("{x")
    out = tmp_path / "out-new"
    r = run("bench", mlp_spec, "--device", "cpu", "--compare", "none", *bad, "--out-dir", out)
    assert r.exit_code == 2, r.output
    assert r.output.startswith("Error: "), repr(r.output[:80])
    assert not out.exists()


def test_infeasible_budget_line_comes_before_the_error(saved_profile):
    r = run("plan", "--profile", saved_profile, "--budget", "1%act")
    assert r.exit_code == 3, r.output
    text = one_line(r)
    assert "budget 1%act = " in text and "with 1% of its activations" in text
    assert text.index("budget 1%act = ") < text.index("Error:")


@pytest.mark.parametrize("extra", [["--world-size", "4"], ["--budget", "1MB"], ["--export", "hf"],
                                   ["--strategy", "chen"]])
def test_plan_sweep_refuses_options_it_would_ignore(saved_profile, tmp_path, extra):
    out = tmp_path / "sweep-out"
    r = run("plan", "--profile", saved_profile, "--sweep", "--out-dir", out, *extra)
    assert r.exit_code == 2, r.output
    assert f"--sweep with {extra[0]}" in one_line(r) and "ignored" in one_line(r)
    assert not out.exists()  # refused before anything was written
    assert run("plan", "--profile", saved_profile, "--sweep", "--out-dir", out).exit_code == 0


def test_a_ckplan_output_given_as_spec_is_named(saved_profile, tmp_path):
    # JSON is YAML: a saved profile given as SPEC was validated as a spec, one long line of
    # "unknown key" errors; now it is named and the tip says where it goes
    r = run("profile", saved_profile, "--device", "meta")
    assert r.exit_code == 2
    msg = one_line(r)
    assert "is a ckplan 'profile' document" in msg and f"ckplan plan --profile {saved_profile}" in msg
    assert "unknown key" not in msg
    plan = tmp_path / "p.json"
    assert run("plan", "--profile", saved_profile, "-o", plan).exit_code == 0
    r = run("bench", plan)
    assert r.exit_code == 2 and "is a ckplan 'plan' document" in one_line(r) and "--plan" in one_line(r)




# ---- --format json: an error is a document too, and never a second one -------------------------

def test_json_format_gives_an_error_document_on_stdout(mlp_spec, tmp_path):
    r = run("plan", mlp_spec, "--device", "meta", "--budget", "1KB", "--format", "json")
    assert r.exit_code == 3
    doc = json.loads(r.stdout)  # stdout alone holds one JSON document; the Error: line is on stderr
    assert doc["schema_version"] == 1 and doc["error"]["exit_code"] == 3
    assert doc["error"]["kind"] == "InfeasibleBudgetError"
    assert doc["error"]["message"].startswith("budget 1000 B is below the smallest feasible peak")
    assert "a budget of at least" in doc["error"]["tip"] and "Error:" in r.stderr
    missing = run("profile", tmp_path / "nope.yaml", "--format", "json")
    assert missing.exit_code == 2 and json.loads(missing.stdout)["error"]["kind"] == "SpecError"
    # Without --format json stdout stays empty: the error is the stderr line only.
    assert run("profile", tmp_path / "nope.yaml").stdout == ""


def test_json_bench_that_exits_3_after_its_document_adds_no_error_document(mlp_spec, tmp_path):
    r = run("bench", mlp_spec, "--device", "cpu", "--compare", "none,dp", "--budget", "1KB", "--steps", "1",
            "--warmup", "0", "--no-options", "--out-dir", tmp_path / "o", "--format", "json")
    assert r.exit_code == 3, r.output
    doc = json.loads(r.stdout)  # one document: the bench's own, with its error row
    assert "error" not in doc and {row["strategy"] for row in doc["rows"]} == {"none", "dp"}


@pytest.mark.parametrize("where,needle", [
    ("forward", "Tip: check that the spec's input (shape, dtype, labels) is what the model's forward takes; "
                "one step of the model without ckplan shows its own error (run with --debug for the traceback)"),
    ("init", "Tip: fix the constructor: raises_init_qa.make(**model.args) called in Python shows its own traceback "
             "(run with --debug for the traceback)"),
])
def test_a_model_that_raises_gets_a_tip_on_its_one_line(write_spec, tmp_path, monkeypatch, where, needle):
    (tmp_path / f"raises_{where}_qa.py").write_text(  # a module per case: the first import is cached
        "import torch.nn as nn\n"
        "class M(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__(); self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))\n"
        f"        if {where == 'init'}: raise ValueError('broken in init')\n"
        "    def forward(self, x):\n"
        "        raise ValueError('broken in forward')\n"
        "def make():\n    return M()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = write_spec(tmp_path, f"model: {{target: 'raises_{where}_qa:make'}}\ninput: {{batch_size: 2, shape: [4]}}\n"
                                "chain: layers\n")
    r = run("profile", spec, "--device", "cpu", "--no-options", "--repeats", "1", "--out-dir", tmp_path / "o")
    assert r.exit_code == 1, r.output
    errors = [line for line in r.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and f"broken in {where}" in errors[0] and "Traceback" not in r.output
    assert one_line(r).endswith(needle)


def test_a_constructor_that_reads_values_on_meta_is_one_clear_error(write_spec, tmp_path, monkeypatch):
    # A learned activation that reads its scalar when built (transformers 4's xIELU) cannot be made
    # on fake tensors: exit 1, the reason and the fix, no traceback.
    (tmp_path / "reads_value_qa.py").write_text(
        "import torch\nfrom torch import nn\n"
        "class Net(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.beta = nn.Parameter(torch.tensor(0.5))\n"
        "        self.beta_value = float(self.beta.detach().cpu().item())\n"
        "        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))\n"
        "    def forward(self, x):\n"
        "        for ly in self.layers:\n"
        "            x = ly(x) * self.beta_value\n"
        "        return x.sum()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = write_spec(tmp_path, "model: {target: 'reads_value_qa:Net'}\ninput: {batch_size: 2, shape: [4]}\n"
                                "chain: layers\n")
    r = run("profile", spec, "--device", "meta")
    assert r.exit_code == 1, r.output
    text = one_line(r)
    assert "constructor reads tensor values" in text and "--device cpu" in text and "Traceback" not in r.output
    assert run("profile", spec, "--device", "cpu", "--repeats", "1").exit_code == 0


def test_sigterm_ends_a_bench_with_143_and_one_line(tiny_gpt_spec, tmp_path):
    """As Ctrl-C does (130): a message, exit 128 + 15, no report written."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = tmp_path / "out"
    p = subprocess.Popen([sys.executable, "-m", "ckplan", "bench", str(tiny_gpt_spec(tmp_path)), "--steps", "1",
                          "--out-dir", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         cwd=tmp_path, env=env)
    seen = []
    for line in p.stderr:  # the bench has started its work
        seen.append(line)
        if "profiling" in line:
            p.send_signal(signal.SIGTERM)
            break
    err = "".join(seen) + p.stderr.read()
    assert p.wait(timeout=120) == 143, err
    assert "Error: terminated (SIGTERM); no partial report was written" in err
    assert not out.exists() or not any(out.iterdir())


@pytest.mark.parametrize("argv", [
    ["plan", "--format", "json", "SPEC", "--strategy", "foo"],
    ["plan", "SPEC", "--bogus", "-f", "json"],
    ["bench", "--format=json", "SPEC", "--steps", "0"],
])
def test_an_option_click_refuses_is_a_json_document_too(argv, tmp_path, capfd):
    """Refused while the command line is parsed, before any command runs: still one document on
    stdout with the usage error's exit code, and the Error line on stderr."""
    import typer.main

    spec = tmp_path / "s.yaml"
    spec.write_text("model: {builtin: mlp}\ninput: {batch_size: 2, shape: [4]}\n")
    with pytest.raises(SystemExit) as e:
        typer.main.get_command(app).main([str(spec) if a == "SPEC" else a for a in argv], prog_name="ckplan")
    out, err = capfd.readouterr()
    doc = json.loads(out)
    assert e.value.code == 2 and doc["error"]["exit_code"] == 2 and doc["error"]["kind"] == "UsageError"
    assert doc["schema_version"] == 1 and err.startswith("Error: ")
