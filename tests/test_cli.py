"""The command line: JSON envelopes (key sets pinned), exit codes, one-line errors."""
import json

import pytest
from conftest import CONFIGS, tiny_gpt_spec, write_spec
from typer.testing import CliRunner

from ckplan.cli import app

runner = CliRunner()


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def test_profile_json_envelope(tmp_path):
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


def test_profile_saved_json_feeds_plan(tmp_path):
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


def test_csv_output(tmp_path):
    r = run("profile", tiny_gpt_spec(tmp_path), "--device", "meta", "--format", "csv")
    assert r.exit_code == 0
    lines = r.stdout.strip().splitlines()
    assert lines[0].startswith("index,name,type") and len(lines) == 1 + 5  # pre, 3 layers, post


@pytest.mark.parametrize("budget", ["12 parsecs", "-5GB", "0", "abc%", "0%"])
def test_bad_budgets_exit_2(tmp_path, budget):
    r = run("plan", tiny_gpt_spec(tmp_path), "--device", "meta", "--budget", budget)
    assert r.exit_code == 2
    assert "Error:" in r.output and "12GiB" in r.output and "Traceback" not in r.output


def test_infeasible_budget_exit_3(tmp_path):
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
def test_bad_specs_exit_2(tmp_path, text, needle):
    r = run("profile", write_spec(tmp_path, text), "--device", "cpu")
    assert r.exit_code == 2, r.output
    assert needle in r.output and "Traceback" not in r.output


def test_missing_file_exit_2():
    r = run("profile", "no/such/spec.yaml")
    assert r.exit_code == 2 and "does not exist" in r.output


def test_model_that_raises_exit_1(tmp_path, monkeypatch):
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


def test_cuda_without_gpu_exit_2(tmp_path):
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    r = run("profile", tiny_gpt_spec(tmp_path), "--device", "cuda")
    assert r.exit_code == 2 and "no CUDA GPU" in r.output


def test_seed_article_arithmetic_on_mlp100():
    # 100 layers that keep ~1 GB each: every-10 needs about 10 boundaries + one 10-layer segment
    # being recomputed, i.e. ~20 GB of activations, not the article's 10 GB.
    r = run("plan", CONFIGS / "mlp-100.yaml", "--device", "meta", "--batch-size", "244141",
            "--strategy", "all", "--k", "10", "--budget", "25GB", "--format", "json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    rows = {x["strategy"]: x for x in doc["strategies"]}
    persistent = doc["persistent_bytes"]
    act = rows["every-k"]["predicted_peak_bytes"] - persistent
    assert 19e9 <= act <= 22e9
    assert rows["dp"]["predicted_recompute_ms"] <= rows["every-k"]["predicted_recompute_ms"] + 1e-9


def test_plan_json_round_trips_into_bench(tmp_path):
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


def test_bad_plan_file_exit_2(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"n_layers": 3, "checkpoints": [[0, 2], [1, 3]]}')
    r = run("bench", tiny_gpt_spec(tmp_path), "--device", "cpu", "--compare", "none", "--plan", bad)
    assert r.exit_code == 2 and "overlap" in r.output
