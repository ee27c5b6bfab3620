"""Mixed precision and accumulation stay accurate; the API's infeasible error; every shipped config."""
import subprocess
import sys

import pytest
import torch
from conftest import CONFIGS, tiny_gpt_spec

import ckplan
from ckplan import api
from ckplan.errors import InfeasibleBudgetError
from ckplan.planner import chain_from_profile, plan_chain, simulate


@pytest.mark.parametrize("precision,accum", [("fp32", 2), ("bf16", 1), ("bf16", 3)])
def test_precision_and_accumulation_predictions(tmp_path, precision, accum):
    spec = api.load(tiny_gpt_spec(tmp_path, n_layer=4, n_embd=64, dropout=0.1), batch_size=8, seq_len=32,
                    precision=precision, accum=accum, optimizer="sgd")
    res = api.bench(spec, strategies=["none", "every-k", "sqrtn"], k=1, device="cpu", steps=1, warmup=1)
    for r in res.rows:
        assert r.status == "ok"
        assert r.peak_error < 0.05, (precision, accum, r.strategy, r.predicted_peak_bytes, r.measured_peak_bytes)
        # bf16 recomputes in bf16 too: gradients equal up to fp32 accumulation order.
        assert r.max_grad_diff < (1e-5 if precision == "fp32" else 1e-3)


def test_api_infeasible_budget_is_a_dedicated_exception():
    from ckplan.zoo import build_builtin
    model = build_builtin("mlp", dict(in_features=16, depth=4, width=16))
    with pytest.raises(InfeasibleBudgetError) as e:
        ckplan.plan_model(model, torch.randn(8, 16), budget="1KB")
    assert e.value.exit_code == 3 and e.value.min_peak_bytes > e.value.budget_bytes == 1000
    assert "smallest feasible peak" in str(e.value)


def test_python_dash_m():
    r = subprocess.run([sys.executable, "-m", "ckplan", "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "profile" in r.stdout and "bench" in r.stdout


SHIPPED = ["gpt2-small", "bert-large", "mlp-100", "resnet", "llama-7b", "hf-gpt2", "hf-bert"]


@pytest.mark.parametrize("name", SHIPPED)
def test_dp_never_worse_than_baselines_on_shipped_configs(name):
    if name.startswith("hf-"):
        pytest.importorskip("transformers")
        # Hugging Face models read tensor values (.item()) in forward: profile them for real, small.
        prof = api.profile(api.load(CONFIGS / f"{name}.yaml", batch_size=1, seq_len=32), device="cpu",
                           repeats=1, warmup=0)
    else:
        prof = api.profile(api.load(CONFIGS / f"{name}.yaml"), device="meta")
    chain = chain_from_profile(prof)
    for strategy, k in (("every-k", 1), ("every-k", 2), ("sqrtn", 2), ("chen", 2)):
        base = plan_chain(chain, strategy, None, k)
        dp = plan_chain(chain, "dp", base.score.peak_bytes, k)
        assert dp.fits and simulate(chain, dp.plan).peak_bytes <= base.score.peak_bytes
        assert dp.score.recompute_ms <= base.score.recompute_ms * (1 + 1e-9), (name, strategy)


@pytest.mark.slow
def test_llama_70b_plans_on_meta():
    # At batch 1 the weights and their gradients (514 GiB) are the peak whatever the plan, and
    # AdamW's step (1 TiB) more so: batch 8 and SGD make activations (~1.9 TiB) the decider.
    prof = api.profile(api.load(CONFIGS / "llama-70b.yaml", optimizer="sgd", batch_size=8), device="meta")
    assert len(prof.chain_layers) == 80
    chain = chain_from_profile(prof)
    res = plan_chain(chain, "dp", None)
    assert res.score.peak_bytes < prof.totals.predicted_peak_bytes
    half = plan_chain(chain, "dp", (res.score.peak_bytes + prof.totals.predicted_peak_bytes) // 2)
    assert half.fits and half.score.recompute_ms < res.score.recompute_ms
