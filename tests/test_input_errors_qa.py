"""Input handling found by the QA pass (/tmp/qa/findings.md): each bad input is one `Error:` line
with the right exit code, said before the long work, and plans are never applied to another model."""
import json

import pytest
import torch.nn as nn
from typer.testing import CliRunner

import ckplan
from ckplan.cli import app
from ckplan.errors import SpecError

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


def test_apply_plan_refuses_a_plan_file_made_for_another_chain(tmp_path):
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

        def forward(self, x):
            for m in self.layers:
                x = m(x)
            return x

    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(_plan_doc(chain="blocks")))
    with pytest.raises(SpecError, match="chain 'blocks'"):
        ckplan.apply_plan(Net(), str(plan))
    plan.write_text(json.dumps(_plan_doc(chain="layers")))  # the same chain still applies
    ckplan.apply_plan(Net(), plan).remove()


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


def test_plan_world_sizes_exit_3_when_no_world_size_fits(mlp_spec):
    r = run("plan", mlp_spec, "--device", "meta", "--world-size", "2,4", "--budget", "1KB")
    assert r.exit_code == 3, r.output
    assert "no world size fits" in one_line(r)


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
