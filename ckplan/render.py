"""Human-readable output: rich tables on stdout, the only module that imports rich."""
from __future__ import annotations

from rich.console import Console
from rich.table import Table

from .records import Profile
from .units import format_bytes, format_flops, format_ms

stdout = Console(soft_wrap=False)
stderr = Console(stderr=True)


def profile_table(prof: Profile) -> None:
    est = " (estimated)" if prof.times_estimated else ""
    t = Table(title=f"ckplan profile: {prof.model} | {prof.device} | batch {prof.batch_size} | "
                    f"{prof.precision} | {prof.optimizer}", title_justify="left")
    for col in ("#", "layer", "type", "params", "output", "saved", f"fwd{est}", f"bwd{est}",
                "fwd FLOPs", "fwd tmp", "bwd tmp"):
        t.add_column(col, justify="left" if col in ("layer", "type") else "right")
    for r in prof.layers:
        t.add_row("" if r.role != "chain" else str(r.index), r.name, r.type, format_bytes(r.param_bytes),
                  format_bytes(r.output_bytes), format_bytes(r.saved_bytes), format_ms(r.fwd_ms),
                  format_ms(r.bwd_ms), format_flops(r.fwd_flops), format_bytes(r.fwd_tmp_bytes),
                  format_bytes(r.bwd_tmp_bytes))
    stdout.print(t)
    tt = prof.totals
    s = Table(show_header=False, box=None, title="totals", title_justify="left")
    s.add_column(justify="left")
    s.add_column(justify="right")
    rows = [
        ("parameters", tt.param_bytes), ("buffers", tt.buffer_bytes), ("gradients", tt.grad_bytes),
        (f"optimizer state ({prof.optimizer})", tt.optimizer_bytes),
        ("optimizer step transient", tt.optimizer_tmp_bytes), ("inputs", tt.input_bytes),
        ("activations (saved for backward)", tt.activation_bytes),
        ("predicted peak, no checkpointing", tt.predicted_peak_bytes),
    ]
    if tt.measured_peak_bytes is not None:
        rows.append(("measured peak of the profiled step", tt.measured_peak_bytes))
    for k, v in rows:
        s.add_row(k, format_bytes(v))
    stdout.print(s)
    chosen = "detected" if prof.chain_detected else "from the spec"
    stdout.print(f"chain: [bold]{prof.chain}[/] ({len(prof.chain_layers)} layers, {chosen}); "
                 f"device: {prof.device_name}" + (
                     f", {format_bytes(prof.device_free_bytes)} free of {format_bytes(prof.device_total_bytes)}"
                     if prof.device_free_bytes is not None else ""))
    for note in prof.notes:
        stdout.print(f"note: {note}")


def info(msg: str) -> None:
    stderr.print(msg, highlight=False)
