"""Mixed precision and gradient accumulation: predicted peaks match measured ones, gradients agree.

Under autocast every weight's low-precision copy stays in autocast's cache until the forward ends,
also for layers run inside a checkpoint: the profile measures those copies per layer
(``cast_bytes``) and the simulator holds them, so bf16/fp16 plans are predicted within 1% and dp
never goes over its budget.
"""
import pytest

from ckplan import api


@pytest.mark.slow
@pytest.mark.parametrize("precision,accum", [("fp32", 2), ("bf16", 1), ("bf16", 3), ("fp16", 1)])
def test_precision_and_accumulation_predictions(tiny_gpt_spec, tmp_path, precision, accum):
    spec = api.load(tiny_gpt_spec(tmp_path, n_layer=6, n_embd=64, dropout=0.1), batch_size=8, seq_len=32,
                    precision=precision, accum=accum, optimizer="sgd")
    res = api.bench(spec, strategies=["none", "every-k", "sqrtn", "dp"], k=2, device="cpu", steps=1, warmup=1)
    for r in res.rows:
        assert r.status == "ok", (r.strategy, r.status, r.message)
        assert r.peak_error < 0.01, (precision, accum, r.strategy, r.predicted_peak_bytes, r.measured_peak_bytes)
        assert r.fwd_bwd_peak_error < 0.01, (precision, accum, r.strategy)
        # Held for backward when the forward ends: autocast's copies of checkpointed layers are gone.
        held_err = abs(r.measured_activation_bytes - r.predicted_activation_bytes) / r.measured_activation_bytes
        assert held_err < 0.01, (precision, accum, r.strategy, r.predicted_activation_bytes,
                                 r.measured_activation_bytes)
        # bf16 recomputes in bf16 too: gradients equal up to fp32 accumulation order.
        assert r.max_grad_diff < (1e-5 if precision == "fp32" else 1e-3)
    dp = next(r for r in res.rows if r.strategy == "dp")
    assert dp.measured_peak_bytes <= res.budget_bytes, (precision, dp.measured_peak_bytes, res.budget_bytes)


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_plans_with_options_under_autocast(tiny_gpt_spec, tmp_path, precision):
    # A layer stored with a SAC option keeps only what its policy keeps; autocast's weight copies
    # it does not keep stay in autocast's cache until the forward ends (OptionRecord.cast_bytes).
    # Without them these plans were predicted 1.3-1.8% low.
    import json

    from ckplan.planner.plan import Checkpoint, Plan, Store
    plans = {
        "top": Plan("top", 6, tuple(Store(i, ("sac-compute", "sac-linear", "sac-attn")[i % 3]) for i in range(6))),
        "one": Plan("one", 6, tuple(Store(i, "sac-compute" if i == 2 else "store") for i in range(6))),
        "mixed": Plan("mixed", 6, (Store(0, "sac-compute"), Checkpoint(1, 3, (Store(1, "sac-linear"), Store(2))),
                                   Store(3, "sac-attn"), Checkpoint(4, 6, (Store(4), Store(5, "sac-compute"))))),
    }
    spec = api.load(tiny_gpt_spec(tmp_path, n_layer=6, n_embd=64, dropout=0.1), batch_size=8, seq_len=32,
                    precision=precision, optimizer="sgd")
    for name, plan in plans.items():
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(plan.to_dict()))
        res = api.bench(spec, strategies=["none"], device="cpu", steps=1, warmup=1, options=True, plan_path=path)
        r = res.rows[-1]
        assert r.status == "ok", (name, r.message)
        err = (r.predicted_peak_bytes - r.measured_peak_bytes) / r.measured_peak_bytes
        assert -1e-4 < err < 0.005, (name, r.predicted_peak_bytes, r.measured_peak_bytes)
        assert r.max_grad_diff < 1e-3
