"""Where an offloading step's time goes on a GPU: pinned host allocations, step times of no
checkpointing, a plan offloading every layer but the last, and the offload-all peer, and the
PyTorch profiler's top host-side calls of one offloading step; on CUDA also the same plan with its
copies queued behind the forward (release points from the GPU's own profile).

    python scripts/offload_probe.py [--spec configs/gpt2-small.yaml] [--batch-size 8] [--steps 5]

Prints a plain-text report (CUDA only).
"""
from __future__ import annotations

import argparse
import time

import torch

from ckplan import api
from ckplan.execute import apply_plan
from ckplan.peers import offload_all
from ckplan.planner import chain_from_profile, simulate, with_releases
from ckplan.planner.plan import OFFLOAD, RELEASE, STORE, Plan, Store
from ckplan.spec import build_model, make_batch, to_loss
from ckplan.training import forward_loss


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def pinned_allocations(n: int, nbytes: int, rounds: int = 3) -> None:
    for r in range(rounds):
        t0 = time.perf_counter()
        held = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(n)]
        ms = (time.perf_counter() - t0) * 1e3
        print(f"pinned alloc round {r}: {n} x {nbytes / 2**20:.0f} MiB in {ms:.1f} ms")
        del held


def step_times(model, batch, steps: int, label: str, device: str) -> None:
    times = []
    for _ in range(steps + 1):
        _sync(device)
        t0 = time.perf_counter()
        model.zero_grad(set_to_none=True)
        forward_loss(model, *batch, to_loss, "fp32", device).backward()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    print(f"{label}: steps ms {' '.join(f'{t:.1f}' for t in times)} (first is a warm-up)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", default="configs/gpt2-small.yaml")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--seq-len", type=int, default=None)
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the script (nothing is offloaded)")
    a = ap.parse_args()
    spec = api.load(a.spec, batch_size=a.batch_size, seq_len=a.seq_len)
    model, batch = build_model(spec, a.device), make_batch(spec, a.device)
    n = chain_from_profile(api.profile(spec, device="meta")).n_layers
    if a.device == "cuda":
        pinned_allocations(n - 1, 256 * 2**20)
    step_times(model, batch, a.steps, "none", a.device)
    plan = Plan("offload", n, tuple(Store(i, OFFLOAD if i < n - 1 else STORE) for i in range(n)))
    with apply_plan(model, plan):
        step_times(model, batch, a.steps, "plan offload (all but the last layer)", a.device)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if a.device == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof:
            model.zero_grad(set_to_none=True)
            forward_loss(model, *batch, to_loss, "fp32", a.device).backward()
            _sync(a.device)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=40))
    if a.device == "cuda":  # the same plan, its copies queued behind the forward where this GPU's profile says
        chain = chain_from_profile(api.profile(spec, device=a.device))
        queued = with_releases(chain, plan)
        print(f"release points from this GPU's profile: {queued.params.get(RELEASE)}; predicted "
              f"{simulate(chain, plan).overhead:+.1%} (next-layer releases), {simulate(chain, queued).overhead:+.1%} (queued)")
        with apply_plan(model, queued):
            step_times(model, batch, a.steps, "plan offload, copies queued", a.device)
    with offload_all(model):
        step_times(model, batch, a.steps, "offload-all", a.device)


if __name__ == "__main__":
    main()
