"""Input handling from the second QA pass (reports/qa/findings-session11.md, items 10, 11 and 14):
options that would be ignored are refused (exit 2) before any work, spec values that cannot work
are named at load or build time (on the meta device too), and one failure is said once."""
import json
import re

import pytest
from test_input_errors_qa import MLP, one_line, run

from ckplan import api
from ckplan.errors import UsageError


@pytest.fixture
def mlp_spec(write_spec, tmp_path):
    return write_spec(tmp_path, MLP, "mlp3.yaml")


@pytest.fixture
def saved_profile(mlp_spec, tmp_path):
    saved = tmp_path / "prof.json"
    assert run("profile", mlp_spec, "--device", "meta", "-o", saved, "-f", "json").exit_code == 0
    return saved


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


def test_distributed_default_budget_note_in_units(tiny_gpt_spec, tmp_path, monkeypatch):
    from ckplan import distributed
    spec = api.load(tiny_gpt_spec(tmp_path, n_layer=2))
    prof = api.profile(spec, device="meta")
    monkeypatch.setattr(distributed, "_launch", lambda job, nproc: "")  # no ranks: the notes are the test
    monkeypatch.setattr(distributed, "_collect", lambda job, nproc, failure: ())
    res = distributed.bench_distributed(spec, nproc=2, strategies=["none", "dp"], profile=prof, device="cpu")
    note = next(n for n in res.notes if n.startswith("no budget"))
    assert re.search(r"\d{4,}", note) is None, note
    assert "iB" in note and "halfway between the smallest feasible peak (" in note


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


def test_layers_called_through_forward_are_named(tmp_path):
    # SqueezeBERT's encoder calls `layer.forward(x)`: no module hook fires, so no container works;
    # the message says why instead of asking for another `chain:`
    import torch.nn as nn

    from ckplan.errors import ModelRunError

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

        def forward(self, x):
            for layer in self.layers:
                x = layer.forward(x)
            return x.pow(2).mean()

    import torch
    with pytest.raises(ModelRunError, match=r"layer\.forward\(x\)") as err:
        api.profile_model(Net(), (torch.randn(4, 8),), {}, name="fwd", chain="layers", device="cpu",
                          optimizer="sgd", repeats=1, warmup=0)
    assert "instead of `layer.forward" in err.value.tip


def test_distributed_bench_profiles_options_when_asked(tiny_gpt_spec, tmp_path, monkeypatch):
    """``bench --nproc`` (``api.bench_distributed``) passes ``--options`` on to its profile, as the
    one-process bench does, and hands the ranks' launcher the loaded spec and that profile."""
    spec = api.load(tiny_gpt_spec(tmp_path, n_layer=2))
    seen = []
    monkeypatch.setattr(api, "_bench_distributed", lambda spec, **kw: seen.append(kw["profile"]))
    api.bench_distributed(spec, nproc=2, strategies=["none"], device="cpu", options=True)
    api.bench_distributed(spec, nproc=2, strategies=["none"], device="cpu")
    with_options, without = seen
    assert any(r.options for r in with_options.chain_layers)
    assert not any(r.options for r in without.chain_layers)
