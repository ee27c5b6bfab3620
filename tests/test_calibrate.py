"""`ckplan calibrate` measures a usable device model on the machine it runs on."""
from __future__ import annotations

import pytest
import torch

from ckplan.calibrate import calibrate, copy_bandwidth, matmul_rate
from ckplan.device_model import MATMUL, VECTOR, load_device, save_device


def test_a_cpu_calibration_is_a_device_model_that_round_trips(tmp_path):
    seen = []
    d = calibrate("cpu", quick=True, progress=seen.append)
    assert d.kind == "cpu" and "measured by ckplan calibrate" in d.source
    assert d.matmul_flops["float32"] > 1e6 and d.memory_bw > 1e6
    assert d.dispatch_ms > 0 and d.sac_dispatch_ms >= 0 and d.host_bw == 0
    assert d.runtime_bytes == 0  # no CUDA runtime: nothing held outside tensors
    assert d.view_ms >= 0 and 0 < d.attention_eff <= 1
    assert any("matmul" in s for s in seen)
    p = tmp_path / "cpu.json"
    save_device(d, p)
    back = load_device(p)
    assert back.to_dict() == d.to_dict()
    # the model prices what it measured: a big fp32 matmul at about the measured rate
    n = 256
    assert back.op_ms(MATMUL, "float32", 2 * n**3, 0) == pytest.approx(
        max(2 * n**3 / d.matmul_flops["float32"] * 1e3, d.dispatch_ms))
    assert back.op_ms(VECTOR, "float32", 0, 1e9) == pytest.approx(1e9 / d.memory_bw * 1e3)


def test_rates_are_work_over_time(monkeypatch):
    # the rate is the matmul's 2 n^3 FLOPs (the copy's 2 x bytes) per second of the timed milliseconds
    import ckplan.calibrate as cal

    monkeypatch.setattr(cal, "_median_ms", lambda device, fn, repeats: (fn(), 500.0)[1])
    cpu = torch.device("cpu")
    assert matmul_rate(cpu, torch.float32, 128, 3) == pytest.approx(2 * 128**3 / 0.5)
    assert copy_bandwidth(cpu, 2**22, 3) == pytest.approx(2 * 2**22 / 0.5)


def test_a_training_ops_dispatch_is_its_forward_and_backward_over_both(monkeypatch):
    # n ops timed forward and backward, less the same step with none, over the 2 n dispatches
    import ckplan.calibrate as cal

    seen = []

    def timed(device, fn, repeats):
        fn()
        seen.append(len(seen))
        return 900.0 if len(seen) == 1 else 100.0  # ms: the step with 100 ops, then the step with none

    monkeypatch.setattr(cal, "_median_ms", timed)
    cpu = torch.device("cpu")
    assert cal.dispatch_ms(cpu, 100, 3) == pytest.approx(0.8 / 200 * 1e3)
    seen.clear()
    assert cal.view_ms(cpu, 100, 3) == pytest.approx(0.8 / 200 * 1e3)


def test_attention_share_is_its_flops_over_time_and_rate(monkeypatch):
    import ckplan.calibrate as cal

    monkeypatch.setattr(cal, "_median_ms", lambda device, fn, repeats: (fn(), 250.0)[1])
    # forward 4 b h s^2 d, backward twice that: 3 x 4 x 1 x 2 x 64^2 x 16 FLOPs in 0.25 s
    flops = 3 * 4 * 1 * 2 * 64 * 64 * 16
    got = cal.attention_eff(torch.device("cpu"), 1e7, batch=1, heads=2, seq=64, head_dim=16)
    assert got == pytest.approx(flops / 0.25 / 1e7)
    assert cal.attention_eff(torch.device("cpu"), 1.0, batch=1, heads=2, seq=64, head_dim=16) == 1.0  # capped


def test_measured_rates_are_positive_and_finite():
    cpu = torch.device("cpu")
    for r in (matmul_rate(cpu, torch.float32, 128, 3), copy_bandwidth(cpu, 2**22, 3)):
        assert 0 < r < float("inf")


def test_the_cli_writes_a_profile_that_meta_plans_read(tmp_path):
    import json

    from typer.testing import CliRunner

    from ckplan.cli import app

    out = tmp_path / "cpu.json"
    r = CliRunner().invoke(app, ["calibrate", "--device", "cpu", "--quick", "-o", str(out), "-f", "json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["command"] == "calibrate" and doc["kind"] == "cpu" and "schema_version" in doc
    assert load_device(out).to_dict() == {k: v for k, v in doc.items() if k not in ("schema_version", "command")}
    r = CliRunner().invoke(app, ["calibrate", "--device", "meta"])
    assert r.exit_code == 2 and "not meta" in r.output
