"""Device models: the roofline's arithmetic on hand-worked ops, device profiles round-trip, bad
profiles are refused with the field named."""
from __future__ import annotations

import json

import pytest

from ckplan.device_model import (
    ATTENTION,
    BUILTIN,
    MATMUL,
    VECTOR,
    VIEW,
    DeviceModel,
    OpCost,
    allreduce_ms,
    device_from_dict,
    gather_ms,
    load_device,
    ops_ms,
    save_device,
)
from ckplan.errors import SpecError


def _dev(**kw) -> DeviceModel:
    base = dict(name="toy", kind="cuda", matmul_flops={"float32": 1e12, "bfloat16": 4e12},
                vector_flops={"float32": 1e11}, memory_bw=1e11, dispatch_ms=0.01,
                matmul_eff=0.5, memory_eff=0.5)
    base.update(kw)
    return DeviceModel(**base)


def test_a_big_matmul_is_priced_by_its_flops():
    d = _dev()
    # 2 GFLOP at 1 TFLOP/s x 0.5 = 4 ms; its 4 MB at 100 GB/s x 0.5 = 0.08 ms
    assert d.op_ms(MATMUL, "float32", 2e9, 4e6) == pytest.approx(4.0)
    # bf16 runs at the bf16 matrix rate: a quarter of the time
    assert d.op_ms(MATMUL, "bfloat16", 2e9, 4e6) == pytest.approx(1.0)


def test_an_elementwise_op_is_priced_by_its_bytes():
    d = _dev()
    # 1e6 elements: 1e6 FLOPs at 1e11 = 0.01 ms; 8 MB at 50 GB/s effective = 0.16 ms
    assert d.op_ms(VECTOR, "float32", 1e6, 8e6) == pytest.approx(0.16)


def test_a_tiny_op_costs_one_dispatch():
    d = _dev(dispatch_ms=0.02)
    assert d.op_ms(VECTOR, "float32", 10, 40) == pytest.approx(0.02)
    assert ops_ms(d, [OpCost(VECTOR, "float32", 10, 40)] * 5) == pytest.approx(0.1)


def test_sac_adds_its_dispatch_per_op():
    d = _dev(dispatch_ms=0.02, sac_dispatch_ms=0.05)
    ops = [OpCost(VECTOR, "float32", 10, 40)] * 4
    assert ops_ms(d, ops, sac=True) - ops_ms(d, ops) == pytest.approx(0.2)


def test_a_view_costs_the_host_its_own_dispatch_and_the_device_nothing():
    d = _dev(dispatch_ms=0.02, view_ms=0.005)
    view = OpCost(VIEW, "", 0, 0)
    assert d.op_ms(VIEW, "", 0, 0) == 0.0
    assert ops_ms(d, [view] * 10) == pytest.approx(0.05)
    # beside a 4 ms matmul the host's 2 dispatch + 10 views hide: the device sets the time
    big = OpCost(MATMUL, "float32", int(2e9), 0)
    assert ops_ms(d, [big] + [view] * 10) == pytest.approx(4.0)
    # under a policy every op pays SAC's cost, views included
    assert ops_ms(_dev(view_ms=0.005, sac_dispatch_ms=0.05), [view] * 10, sac=True) == pytest.approx(0.55)


def test_replayed_ops_pay_the_policy_without_running():
    # a recompute replays 6 forward ops through the policy; 2 of them run again (tiny), 4 come
    # from its cache: the host pays 2 dispatches and 6 policy calls
    d = _dev(dispatch_ms=0.02, sac_dispatch_ms=0.05)
    tiny = OpCost(VECTOR, "float32", 10, 40)
    assert ops_ms(d, [tiny] * 2, sac_ops=6) == pytest.approx(2 * 0.02 + 6 * 0.05)
    assert ops_ms(d, [tiny] * 2, sac_ops=6, host_extra_ms=0.1) == pytest.approx(0.44)


def test_an_attention_kernel_runs_at_its_own_share_of_the_matrix_rate():
    d = _dev(attention_eff=0.25)
    # 1 GFLOP at 1 TFLOP/s: 2 ms at matmul_eff 0.5, 4 ms at attention_eff 0.25
    assert d.op_ms(MATMUL, "float32", 1e9, 0) == pytest.approx(2.0)
    assert d.op_ms(ATTENTION, "float32", 1e9, 0) == pytest.approx(4.0)
    assert d.op_ms(ATTENTION, "bfloat16", 1e9, 0) == pytest.approx(1.0)  # at the bf16 matrix rate


def test_an_unknown_dtype_takes_the_fp32_rate():
    d = _dev()
    assert d.op_ms(MATMUL, "float64", 2e9, 0) == d.op_ms(MATMUL, "float32", 2e9, 0)


def test_collectives_move_the_ring_share_of_the_bytes():
    d = _dev(link_bw=1e11, network_bw=1e10)
    # ring all-reduce of 1 GB over 4: 2 * 3/4 * 1e9 / 1e11 s = 15 ms
    assert allreduce_ms(d, 10**9, 4) == pytest.approx(15.0)
    assert allreduce_ms(d, 10**9, 4, nodes=2) == pytest.approx(150.0)
    assert gather_ms(d, 10**9, 4) == pytest.approx(7.5)
    assert allreduce_ms(d, 10**9, 1) == 0.0
    assert allreduce_ms(_dev(), 10**9, 8) == 0.0  # bandwidth unknown: no figure


def test_builtin_devices_carry_the_data_sheet_rates():
    h100, h200, a100 = BUILTIN["h100"], BUILTIN["h200"], BUILTIN["a100"]
    assert h100.matmul_flops["bfloat16"] == pytest.approx(989.4e12)
    assert h200.memory_bw == pytest.approx(4.8e12) and h100.memory_bw == pytest.approx(3.35e12)
    assert a100.matmul_flops["float32"] == pytest.approx(19.5e12)
    for d in BUILTIN.values():
        assert d.source and d.kind == "cuda"
    assert load_device("cuda") is BUILTIN["h100"]
    assert load_device("H200") is BUILTIN["h200"]


@pytest.mark.parametrize("name", sorted(BUILTIN))
def test_device_profiles_round_trip(tmp_path, name):
    p = tmp_path / f"{name}.json"
    save_device(BUILTIN[name], p)
    back = load_device(p)
    assert back.to_dict() == BUILTIN[name].to_dict()
    assert back.op_ms(MATMUL, "bfloat16", 1e12, 1e9) == BUILTIN[name].op_ms(MATMUL, "bfloat16", 1e12, 1e9)


@pytest.mark.parametrize("change, field", [
    ({"kind": "tpu"}, "kind"),
    ({"memory_bw": -1}, "memory_bw"),
    ({"memory_bw": 0}, "memory_bw"),
    ({"matmul_eff": 1.5}, "matmul_eff"),
    ({"attention_eff": 0}, "attention_eff"),
    ({"view_ms": -0.001}, "view_ms"),
    ({"matmul_flops": {}}, "matmul_flops"),
    ({"vector_flops": {"float32": "fast"}}, "vector_flops"),
    ({"bandwidth": 1}, "bandwidth"),
    ({"runtime_bytes": -1}, "runtime_bytes"),
    ({"runtime_bytes": 1.5e6}, "runtime_bytes"),
    ({"runtime_bytes": True}, "runtime_bytes"),
    ({"format": "ckplan.device/9"}, "format"),
])
def test_bad_device_profiles_name_the_field(tmp_path, change, field):
    d = BUILTIN["h100"].to_dict()
    d.update(change)
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(d))
    with pytest.raises(SpecError, match=field):
        load_device(p)


def test_builtin_gpus_count_the_cublas_workspaces_torch_makes_by_default():
    """Two threads run matmuls in a training step (the forward's and autograd's backward thread),
    each with torch's default cuBLAS workspace (32 MiB on Hopper, :4096:2:16:8 before) and a 1 MiB
    cuBLASLt one: on an H200 with torch 2.11 a CUDA profile measured 69,206,016 bytes."""
    assert BUILTIN["h200"].runtime_bytes == BUILTIN["h100"].runtime_bytes == 69_206_016
    assert BUILTIN["a100"].runtime_bytes == BUILTIN["l4"].runtime_bytes == 2 * (4096 * 1024 * 2 + 16 * 1024 * 8 + 2**20)
    older = BUILTIN["h100"].to_dict()
    del older["runtime_bytes"]  # a device profile written before the field: nothing counted
    assert device_from_dict(older).runtime_bytes == 0


def test_an_unknown_device_names_the_builtins_and_calibrate():
    with pytest.raises(SpecError, match="h100") as e:
        load_device("tpu-v9")
    assert "ckplan calibrate" in e.value.tip
    with pytest.raises(SpecError, match="lacks"):
        device_from_dict({"name": "x", "kind": "cuda"})


def test_a_busy_device_hides_the_dispatch_and_an_idle_one_shows_it():
    d = _dev(dispatch_ms=0.01, sac_dispatch_ms=0.04)
    big = [OpCost(MATMUL, "float32", int(2e9), 0)] * 3  # 4 ms each: the host keeps up
    assert ops_ms(d, big) == pytest.approx(12.0)
    assert ops_ms(d, big, sac=True) == pytest.approx(12.0)  # SAC's dispatch hides behind the work
    tiny = [OpCost(VECTOR, "float32", 10, 40)] * 100  # nothing to hide behind
    assert ops_ms(d, tiny) == pytest.approx(1.0)
    assert ops_ms(d, tiny, sac=True) == pytest.approx(5.0)
