"""Where a selective-checkpoint step's time goes: step times of no checkpointing, a checkpoint per
layer, torch's SAC policy per layer (the ``sac-policy`` peer) and ckplan's plans with ``sac-linear``
or ``sac-compute`` on every layer, timed round by round; then, for one step of each, the kernels
and ops the step ran, counted, so that what a policy recomputes in the backward shows as the extra
calls over ``none``, and the host time per op under the policy.

    python scripts/sac_probe.py [--spec configs/gpt2-small.yaml] [--batch-size 8] [--rounds 5]

Prints a plain-text report; ``--device cpu`` is a dry run at a small batch.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections import Counter

import torch

from ckplan import api
from ckplan.execute import apply_plan
from ckplan.peers import sac_policy
from ckplan.planner import chain_from_profile
from ckplan.planner.plan import Checkpoint, Plan, Store
from ckplan.spec import build_model, make_batch, to_loss
from ckplan.training import forward_loss


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _variants(model, n: int):
    """(label, context manager factory) of each variant."""
    def plan(name, items):
        return lambda: apply_plan(model, Plan(name, n, tuple(items)))
    return [
        ("none", contextlib.nullcontext),
        ("ckpt-per-layer", plan("ckpt", [Checkpoint(i, i + 1, (Store(i),)) for i in range(n)])),
        ("sac-policy", lambda: sac_policy(model)),
        ("plan sac-compute", plan("sac-compute", [Store(i, "sac-compute") for i in range(n)])),
        ("plan sac-linear", plan("sac-linear", [Store(i, "sac-linear") for i in range(n)])),
    ]


def _step(model, batch, device: str) -> float:
    _sync(device)
    t0 = time.perf_counter()
    model.zero_grad(set_to_none=True)
    forward_loss(model, *batch, to_loss, "fp32", device).backward()
    _sync(device)
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", default="configs/gpt2-small.yaml")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the script")
    a = ap.parse_args()
    spec = api.load(a.spec, batch_size=a.batch_size, seq_len=a.seq_len)
    model, batch = build_model(spec, a.device), make_batch(spec, a.device)
    n = chain_from_profile(api.profile(spec, device="meta")).n_layers
    variants = _variants(model, n)
    times: dict[str, list[float]] = {label: [] for label, _ in variants}
    for r in range(a.rounds + 1):  # round 0 warms up
        for label, ctx in variants:
            with ctx():
                ms = _step(model, batch, a.device)
            if r:
                times[label].append(ms)
    base = statistics.median(times["none"])
    print(f"{spec.name}: batch {a.batch_size}, {n} chain layers, {a.device}, torch {torch.__version__}")
    for label, ts in times.items():
        med = statistics.median(ts)
        print(f"{label:18s} median {med:8.2f} ms  {med / base:6.3f}x  ({' '.join(f'{t:.1f}' for t in ts)})")

    activities = [torch.profiler.ProfilerActivity.CPU]
    if a.device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    counts: dict[str, Counter] = {}
    host_ms: dict[str, float] = {}
    for label, ctx in variants:
        with ctx(), torch.profiler.profile(activities=activities) as prof:
            _step(model, batch, a.device)
        events = prof.key_averages()
        kernels = [e for e in events if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
        ops = [e for e in events if e.key.startswith("aten::")]
        counts[label] = Counter({e.key: e.count for e in (kernels or ops)})
        host_ms[label] = sum(e.self_cpu_time_total for e in events) / 1e3
    print("\ncalls per step over none (CUDA kernels on a GPU, aten ops on a CPU); + more, - fewer:")
    names = sorted(set().union(*counts.values()))
    for label in times:
        if label == "none":
            continue
        diff = {k: counts[label][k] - counts["none"][k] for k in names if counts[label][k] != counts["none"][k]}
        top = sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:12]
        total = sum(counts[label].values())
        print(f"{label}: {total} calls ({total - sum(counts['none'].values()):+d}); profiler host time "
              f"{host_ms[label]:.1f} ms (none {host_ms['none']:.1f} ms)")
        for k, d in top:
            print(f"    {d:+5d}  {k[:90]}")


if __name__ == "__main__":
    main()
