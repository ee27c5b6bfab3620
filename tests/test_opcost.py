"""Per-op costs: FLOPs and bytes of hand-worked ops, views kept without work, fake tensors priced as real."""
from __future__ import annotations

import torch

from ckplan.device_model import ATTENTION, MATMUL, VECTOR, VIEW, OpCost
from ckplan.profiling.opcost import OpCounter


def _count(fn, *args):
    c = OpCounter()
    with c:
        fn(*args)
    return c


def test_a_linear_layer_is_one_matmul_with_its_bytes():
    B, i, o = 8, 16, 32
    lin = torch.nn.Linear(i, o)
    x = torch.randn(B, i)
    c = _count(lin, x)
    mm = [op for op in c.ops if op.kind == MATMUL]
    assert [op.kind for op in c.ops] == [VIEW, MATMUL]  # linear: t() of the weight, then addmm
    assert len(mm) == 1
    assert mm[0].flops == 2 * B * i * o
    # addmm reads the bias, the input and the weight and writes the output, fp32
    assert mm[0].nbytes == 4 * (o + B * i + i * o + B * o)
    assert mm[0].dtype == "float32"


def test_elementwise_ops_count_one_operation_per_element_written():
    x = torch.randn(4, 5)
    c = _count(lambda t: torch.relu(t) * 2, x)
    assert [op.kind for op in c.ops] == [VECTOR, VECTOR]
    assert all(op.flops == 20 for op in c.ops)
    assert c.ops[0].nbytes == 2 * 20 * 4  # reads x, writes relu(x)


def test_views_launch_nothing_but_are_dispatched():
    # four views the host dispatches; detach is bookkeeping (checkpoint hooks, the profiler's own)
    x = torch.randn(4, 6)
    c = _count(lambda t: t.view(6, 4).t().unsqueeze(0).expand(3, 4, 6).detach(), x)
    assert c.ops == [OpCost(VIEW, "", 0, 0)] * 4


def test_an_attention_kernel_is_its_own_kind():
    q = torch.randn(2, 3, 16, 8)
    c = _count(torch.nn.functional.scaled_dot_product_attention, q, q, q)
    att = [op for op in c.ops if op.kind == ATTENTION]
    assert len(att) == 1 and att[0].flops == 4 * 2 * 3 * 16 * 16 * 8  # QK^T and PV, 2 FLOPs per MAC
    assert not [op for op in c.ops if op.kind == MATMUL]


def test_a_broadcast_input_counts_its_storage():
    x = torch.randn(1, 1000).expand(100, 1000)
    y = torch.randn(100, 1000)
    c = _count(torch.add, x, y)
    assert c.ops[0].nbytes == 4 * (1000 + 100_000 + 100_000)


def test_meta_counts_equal_cpu_counts():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))

    def step(device):
        m = net.to(device)
        m.zero_grad(set_to_none=True)  # a first backward: no gradient to accumulate into
        x = torch.randn(16, 32, device=device)
        c = OpCounter()
        with c:
            m(x).square().mean().backward()
        return c.ops

    cpu = step("cpu")
    meta = step("meta")
    assert cpu == meta
    assert sum(op.flops for op in cpu if op.kind == MATMUL) == 3 * 2 * 16 * (32 * 64 + 64 * 8) - 2 * 16 * 32 * 64


def test_bf16_matmuls_say_so():
    a = torch.randn(8, 8, dtype=torch.bfloat16)
    c = _count(torch.mm, a, a)
    assert c.ops[0].dtype == "bfloat16" and c.ops[0].flops == 2 * 8 * 8 * 8
