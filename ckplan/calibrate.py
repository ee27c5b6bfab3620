"""``ckplan calibrate``: measure this machine's device model (``ckplan.device_model``) once.

Each field is timed on the device with the op it prices: the matrix rate per dtype from square
matmuls, the memory bandwidth from a large copy (it reads and writes every byte), an attention
kernel's share of the fp32 matrix rate from ``scaled_dot_product_attention`` at a training shape,
the dispatch cost from a chain of tiny ops run forward and backward as a training step runs them
(each launches one kernel, records its autograd node, and waits for nothing), a view's from a
chain of views run the same way, what a selective-checkpoint policy adds per op from a chain run
under one, and on CUDA the host link from pinned copies each way and the runtime's own blocks (the
cuBLAS workspaces a training step's two threads make, left once every tensor is gone). The rates measured are what
eager PyTorch reaches, so the matmul and memory efficiencies are 1.
"""
from __future__ import annotations

import gc
import platform
from collections.abc import Callable
from datetime import date

import torch
from torch.utils.checkpoint import checkpoint

from .device_model import DeviceModel
from .measure import Clock, device_info
from .sac import SAC_KWARGS, context_fn


def _median_ms(device: torch.device, fn: Callable[[], object], repeats: int) -> float:
    """Median milliseconds of ``fn`` over ``repeats`` runs after one warm-up, the device waited for."""
    return Clock(device).median_ms(fn, repeats)


def _per_s(count: float, ms: float) -> float:
    """``count`` (FLOPs, bytes) done in ``ms`` milliseconds as a rate per second, the device model's unit."""
    return count * 1e3 / ms


def matmul_rate(device: torch.device, dtype: torch.dtype, n: int, repeats: int = 5) -> float:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    return _per_s(2 * n**3, _median_ms(device, lambda: torch.mm(a, b), repeats))


def copy_bandwidth(device: torch.device, nbytes: int, repeats: int = 5) -> float:
    x = torch.empty(nbytes // 4, device=device, dtype=torch.float32).fill_(1.0)
    y = torch.empty_like(x)
    return _per_s(2 * x.numel() * 4, _median_ms(device, lambda: y.copy_(x), repeats))


def _tiny_ops(x: torch.Tensor, n: int) -> torch.Tensor:
    for _ in range(n):
        x = x + 1
    return x


def _scaled(x: torch.Tensor, n: int) -> torch.Tensor:
    for _ in range(n):
        x = x * 1.0001  # its backward is one kernel too
    return x


def _views(x: torch.Tensor, n: int) -> torch.Tensor:
    for i in range(n):
        x = x.view(2, 4) if i % 2 == 0 else x.view(8)
    return x


def _fwd_bwd_op_ms(device: torch.device, chain: Callable[[torch.Tensor, int], torch.Tensor], n: int,
                   repeats: int) -> float:
    """Host milliseconds per op of ``chain``'s ``n`` ops in a training step: recorded by autograd in
    the forward and run again by its engine in the backward (``2 n`` dispatches), less the one
    reduction and backward call around them."""
    x = torch.ones(8, device=device, requires_grad=True)

    def step(k: int) -> None:
        chain(x, k).sum().backward()

    return max(0.0, (_median_ms(device, lambda: step(n), repeats) - _median_ms(device, lambda: step(0), repeats))
               / (2 * n))


def dispatch_ms(device: torch.device, n: int = 400, repeats: int = 5) -> float:
    """Host milliseconds of one op that launches a kernel, as a training step pays it."""
    return _fwd_bwd_op_ms(device, _scaled, n, repeats)


def view_ms(device: torch.device, n: int = 400, repeats: int = 5) -> float:
    """Host milliseconds of one view op (no kernel), as a training step pays it."""
    return _fwd_bwd_op_ms(device, _views, n, repeats)


def attention_eff(device: torch.device, fp32_rate: float, *, batch: int, heads: int = 12, seq: int = 512,
                  head_dim: int = 64, repeats: int = 5) -> float:
    """The share of the fp32 matrix rate ``fp32_rate`` that ``scaled_dot_product_attention``
    reaches forward and backward (``4 b h s^2 d`` FLOPs forward, twice that backward: the
    kernels PyTorch picks for fp32, which on a GPU do not use the tensor cores). The device model
    applies the same share to the other dtypes' matrix rates."""
    q, k, v = (torch.randn(batch, heads, seq, head_dim, device=device, requires_grad=True) for _ in range(3))

    def step() -> None:
        torch.nn.functional.scaled_dot_product_attention(q, k, v).sum().backward()

    flops = 3 * 4 * batch * heads * seq * seq * head_dim
    return min(1.0, _per_s(flops, _median_ms(device, step, repeats)) / fp32_rate)


def _saving_ops(x: torch.Tensor, n: int) -> torch.Tensor:
    for _ in range(n):
        x = torch.sin(x)  # saves its input: one saved tensor per op
    return x


def checkpoint_hook_ms(device: torch.device, n: int = 200, repeats: int = 5) -> float:
    """Host time of one call of a non-reentrant checkpoint's saved-tensor hooks: ``n`` ops that
    each save a tensor, forward and backward inside a checkpoint, less the same plainly and less
    their recompute (one forward), over the ``3 n`` hook calls (pack, pack again in the recompute,
    unpack)."""
    x = torch.ones(8, device=device, requires_grad=True)

    def plain():
        _saving_ops(x, n).sum().backward()

    def ckpt():
        checkpoint(_saving_ops, x, n, use_reentrant=False).sum().backward()

    extra = (_median_ms(device, ckpt, repeats) - _median_ms(device, plain, repeats)
             - _median_ms(device, lambda: _saving_ops(x, n), repeats))
    return max(0.0, extra / (3 * n))


def checkpoint_host_ms(device: torch.device, n: int = 100, repeats: int = 5) -> tuple[float, float]:
    """(one call of a checkpoint's saved-tensor hooks, the rest of one checkpoint beyond its
    recompute and its hooks: its frame, the RNG state kept and restored, the recompute's set-up),
    host milliseconds: the second from ``n`` checkpoints of one op that saves one tensor, forward
    and backward, less the same ops plainly, less their recompute and less their ``3 n`` hook calls."""
    hook = checkpoint_hook_ms(device, n, repeats)
    x = torch.ones(8, device=device, requires_grad=True)

    def chain(ckpt: bool) -> None:
        y = x
        for _ in range(n):
            y = checkpoint(torch.sin, y, use_reentrant=False) if ckpt else torch.sin(y)
        y.sum().backward()

    extra = (_median_ms(device, lambda: chain(True), repeats) - _median_ms(device, lambda: chain(False), repeats)
             - _median_ms(device, lambda: _saving_ops(x, n), repeats))
    return hook, max(0.0, extra / n - 3 * hook)


def sac_dispatch_ms(device: torch.device, n: int = 200, repeats: int = 5) -> float:
    """What one op costs more in a forward under ckplan's ``sac-compute`` policy than plainly
    inside a checkpoint (both forwards keep what they save; the difference is the policy)."""
    x = torch.ones(8, device=device, requires_grad=True)

    def plain():
        return checkpoint(_tiny_ops, x, n, use_reentrant=False)

    def sac():
        return checkpoint(_tiny_ops, x, n, use_reentrant=False, context_fn=context_fn("sac-compute"), **SAC_KWARGS)

    return max(0.0, (_median_ms(device, sac, repeats) - _median_ms(device, plain, repeats)) / n)


def host_bandwidths(device: torch.device, nbytes: int, repeats: int = 5) -> tuple[float, float]:
    """Bytes/s of a pinned copy device -> host and host -> device; (0, 0) off CUDA."""
    if device.type != "cuda":
        return 0.0, 0.0
    host = torch.empty(nbytes // 4, dtype=torch.float32, pin_memory=True)
    dev = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    up_ms = _median_ms(device, lambda: dev.copy_(host, non_blocking=True), repeats)
    down_ms = _median_ms(device, lambda: host.copy_(dev, non_blocking=True), repeats)
    return _per_s(nbytes, down_ms), _per_s(nbytes, up_ms)


def host_bandwidth(device: torch.device, nbytes: int, repeats: int = 5) -> float:
    """Bytes/s of a pinned host copy, the slower way; 0 off CUDA."""
    down, up = host_bandwidths(device, nbytes, repeats)
    return min(down, up)


def runtime_bytes(device: torch.device) -> int:
    """Bytes the CUDA caching allocator holds once no tensor is left, after a matmul forward (this
    thread) and its backward (autograd's thread): the cuBLAS and cuBLASLt workspaces a training step
    makes, as ``torch.cuda.max_memory_allocated`` counts them (0 on other devices)."""
    if device.type != "cuda":
        return 0
    w = torch.randn(256, 256, device=device, requires_grad=True)
    (torch.randn(256, 256, device=device) @ w).sum().backward()
    del w
    gc.collect()
    torch.cuda.synchronize(device)
    return int(torch.cuda.memory_allocated(device))


def device_name(device: torch.device) -> str:
    """The GPU's name, or the CPU's model name (as the profile's header shows it)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    name = device_info(device).name
    return name if name and name != "cpu" else platform.processor() or platform.machine() or "cpu"


def calibrate(device: str | torch.device = "cpu", *, quick: bool = False,
              progress: Callable[[str], None] = lambda s: None) -> DeviceModel:
    """Measure ``device`` and return its :class:`DeviceModel` (``quick``: smaller sizes, fewer
    repeats, for a first look or a test)."""
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    n = (1024 if quick else 8192) if cuda else (256 if quick else 1024)
    nbytes = (64 if quick else 1024) * 2**20 if cuda else (16 if quick else 128) * 2**20
    repeats = 3 if quick else 7
    dtypes = [torch.float32, torch.bfloat16] + ([torch.float16] if cuda else [])
    rates = {}
    for dt in dtypes:
        progress(f"matmul {n}x{n} {dt}")
        rates[str(dt).replace("torch.", "")] = matmul_rate(dev, dt, n, repeats)
    progress("memory bandwidth")
    bw = copy_bandwidth(dev, nbytes, repeats)
    progress("attention")
    attn = attention_eff(dev, rates["float32"], batch=(1 if quick else 8) if cuda else 1, seq=256 if quick else 512,
                         repeats=repeats)
    progress("dispatch")
    disp = dispatch_ms(dev, 100 if quick else 400, repeats)
    views = view_ms(dev, 100 if quick else 400, repeats)
    progress("selective-checkpoint dispatch")
    sac = sac_dispatch_ms(dev, 50 if quick else 200, repeats)
    progress("checkpoint hooks")
    hook = checkpoint_hook_ms(dev, 50 if quick else 200, repeats)
    host = host_bandwidth(dev, nbytes, repeats)
    runtime = runtime_bytes(dev)
    return DeviceModel(
        name=device_name(dev), kind="cuda" if cuda else "cpu", matmul_flops=rates,
        vector_flops={"float32": rates["float32"]}, memory_bw=bw, dispatch_ms=disp, matmul_eff=1.0,
        attention_eff=attn, memory_eff=1.0, sac_dispatch_ms=sac, view_ms=views, ckpt_hook_ms=hook, host_bw=host,
        runtime_bytes=runtime,
        source=f"measured by ckplan calibrate on {device_name(dev)}, torch {torch.__version__}, {date.today()}",
        extra={"matmul_n": n, "copy_bytes": nbytes, "quick": quick})
