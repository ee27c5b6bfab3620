"""``ckplan calibrate``: the device model measured on this machine."""
from __future__ import annotations

from rich.console import Console
from rich.table import Table

from ..device_model import DeviceModel
from . import consoles
from .consoles import escape


def device_table(device: DeviceModel, *, console: Console | None = None) -> None:
    out = console or consoles.stdout
    t = Table(title=escape(f"ckplan calibrate: {device.name} ({device.kind})"), title_justify="left")
    t.add_column("field", justify="left")
    t.add_column("value", justify="right")
    for dtype, rate in device.matmul_flops.items():
        t.add_row(f"matmul {dtype}", f"{rate / 1e12:.3g} TFLOP/s")
    t.add_row("memory bandwidth (copy)", f"{device.memory_bw / 1e9:.4g} GB/s")
    t.add_row("attention kernels, share of fp32 matmul", f"{device.attention_eff:.2f}")
    t.add_row("dispatch per op (forward and backward)", f"{device.dispatch_ms * 1e3:.3g} us")
    t.add_row("dispatch per view op", f"{device.view_ms * 1e3:.3g} us")
    t.add_row("SAC policy, more per op", f"{device.sac_dispatch_ms * 1e3:.3g} us")
    t.add_row("checkpoint hook, per saved tensor and call", f"{device.ckpt_hook_ms * 1e3:.3g} us")
    if device.host_bw:
        t.add_row("pinned host link (slower way)", f"{device.host_bw / 1e9:.4g} GB/s")
    if device.runtime_bytes:
        t.add_row("runtime blocks outside tensors (cuBLAS workspaces)", f"{device.runtime_bytes:,} B")
    out.print(t)
    out.print(escape(f"source: {device.source}"))
