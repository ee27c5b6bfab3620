"""Where the predicted slowdown comes from, measured: one process, steps interleaved.

    PYTHONPATH=. python scripts/timing_check.py configs/hf-gpt2.yaml -b 1 --seq-len 128 --rounds 7

Profiles the spec on CPU (``--repeats`` timed passes), then times, round by round and interleaved,
three things: forward+backward with no checkpoint (``fb``), the same with every chain layer
checkpointed (every-k k=1, ``fb_k1``) and the optimizer step with zero_grad (``opt``). Prints the
profile's view beside the measurement:

* base: the profile's sum of forward and backward windows vs the measured ``fb``;
* recompute: the profile's sum of chain forwards (what every-k k=1 is predicted to add) vs the
  measured ``fb_k1 - fb`` (paired per round, median), and their ratio (the recompute factor);
* the slowdown the bench reports (whole steps, optimizer included) vs the planner's prediction.

The rounds run with freed memory kept in the process, as the profile and the bench time CPU
steps (``ckplan.measure.KeptFreedMemory``); ``CKPLAN_CPU_MALLOC=system`` times with glibc's
default instead (BERT-large 1 x 512: forward+backward 9.1 s instead of 5.5 s, and every layer
checkpointed ran *faster* than none, page faults dominating).

``--plans N`` profiles N times more and prints the dp plan for a few budgets each time: the plans
must be the same every time (reproducibility).
"""
from __future__ import annotations

import argparse
import statistics

import torch

from ckplan import api
from ckplan.execute import apply_plan, remove_plan
from ckplan.measure import Clock, KeptFreedMemory
from ckplan.planner import chain_from_profile, plan_chain, simulate
from ckplan.spec import build_model, make_batch, to_loss
from ckplan.training import forward_loss, make_optimizer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("spec")
    ap.add_argument("-b", "--batch-size", type=int)
    ap.add_argument("--seq-len", type=int)
    ap.add_argument("--optimizer", help="override the spec's optimizer (sgd, adamw, ...)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--plans", type=int, default=0)
    ap.add_argument("--threads", type=int, help="torch.set_num_threads (1 is steadier on shared cores)")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    overrides = {k: v for k, v in (("batch_size", a.batch_size), ("seq_len", a.seq_len),
                                                ("optimizer", a.optimizer)) if v is not None}
    spec = api.load(a.spec, **overrides)
    torch.manual_seed(0)
    model = build_model(spec, "cpu")
    args, kwargs = make_batch(spec, "cpu")
    prof = api.profile_model(model, args, kwargs, name=spec.name or "model", chain=spec.chain,
                             device=torch.device("cpu"), optimizer=spec.train.optimizer,
                             precision=spec.train.precision, accum=spec.train.accum, lr=spec.train.lr,
                             repeats=a.repeats)
    chain = chain_from_profile(prof)
    n = chain.n_layers
    k1 = plan_chain(chain, "every-k", None, 1).plan
    sum_fwd = sum(ly.alone_ms for ly in chain.layers)  # the recompute the planner predicts for k=1
    sum_windows = sum(r.fwd_ms for r in prof.chain_layers)  # the measured forward windows
    opt = make_optimizer(model.parameters(), spec.train.optimizer, spec.train.lr, "cpu")
    clock = Clock(torch.device("cpu"))

    def fb() -> float:
        t0 = clock.now_ms()
        loss = forward_loss(model, args, kwargs, to_loss, spec.train.precision, "cpu")
        loss.backward()
        return clock.now_ms() - t0

    def opt_step() -> float:
        t0 = clock.now_ms()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return clock.now_ms() - t0

    # Each plan runs twice in a row per round: the first step comes after the other plan's
    # (as in the bench, whose strategies alternate), the second after its own (as in training).
    times: dict[str, list[float]] = {"fb": [], "fb_k1": [], "opt": [], "fb_again": [], "fb_k1_again": []}
    with KeptFreedMemory("cpu"):  # as the bench times (CKPLAN_CPU_MALLOC=system: glibc's default)
        for r in range(a.rounds + 1):  # round 0 warms up
            t_fb = fb()
            t_opt = opt_step()
            t_fb2 = fb()
            opt_step()
            apply_plan(model, k1, chain=prof.chain)
            t_k1 = fb()
            opt_step()
            t_k12 = fb()
            opt_step()
            remove_plan(model)
            if r:
                times["fb"].append(t_fb)
                times["fb_k1"].append(t_k1)
                times["opt"].append(t_opt)
                times["fb_again"].append(t_fb2)
                times["fb_k1_again"].append(t_k12)
    med = {k: statistics.median(v) for k, v in times.items()}
    extra = statistics.median(b - a_ for a_, b in zip(times["fb"], times["fb_k1"]))
    print(f"{prof.model}: {n} layers, batch {prof.batch_size}, profile repeats {a.repeats}, rounds {a.rounds}")
    print(f"  base fwd+bwd  profile {chain.base_step_ms:9.1f} ms   measured {med['fb']:9.1f} ms"
          f"   ratio {med['fb'] / chain.base_step_ms:.3f}")
    print(f"  fwd+bwd, same plan twice in a row: none {med['fb_again']:9.1f} ms   every-k k=1 "
          f"{med['fb_k1_again']:9.1f} ms   (after the other plan: {med['fb']:.1f} / {med['fb_k1']:.1f})")
    again = statistics.median(b - a_ for a_, b in zip(times["fb_again"], times["fb_k1_again"]))
    print(f"  recompute k=1, plans in a row: measured {again:9.1f} ms   factor {again / sum_windows:.3f}")
    print(f"  optimizer step                       measured {med['opt']:9.1f} ms")
    print(f"  recompute k=1 profile {sum_fwd:9.1f} ms   measured {extra:9.1f} ms"
          f"   measured / predicted {extra / sum_fwd:.3f}")
    print(f"  chain forward windows {sum_windows:9.1f} ms   profile's factor {sum_fwd / sum_windows:.3f}"
          f"   measured factor {extra / sum_windows:.3f}")
    pred = simulate(chain, k1).overhead
    meas = (med["fb"] + extra + med["opt"]) / (med["fb"] + med["opt"])
    print(f"  every-k k=1 slowdown: predicted {1 + pred:.3f}   measured {meas:.3f}")
    for i, ly in enumerate(chain.layers[:4]):
        print(f"    layer {i}: fwd {ly.fwd_ms:.2f} (tail {ly.tail_ms:.2f}) bwd {ly.bwd_ms:.2f}")
    if a.plans:
        budgets = _budgets(chain)
        seen: list[list[str]] = [[plan_chain(chain, "dp", b, 1).plan.describe() for b in budgets]]
        for _ in range(a.plans):
            p2 = api.profile_model(model, args, kwargs, name=spec.name or "model", chain=spec.chain,
                                   device=torch.device("cpu"), optimizer=spec.train.optimizer,
                                   precision=spec.train.precision, accum=spec.train.accum,
                                   lr=spec.train.lr, repeats=a.repeats)
            c2 = chain_from_profile(p2)
            seen.append([plan_chain(c2, "dp", b, 1).plan.describe() for b in budgets])
        same = all(s == seen[0] for s in seen)
        print(f"  dp plans over {len(seen)} profiles, {len(budgets)} budgets: "
              f"{'identical' if same else 'DIFFERENT'}")
        if not same:
            for j, b in enumerate(budgets):
                variants = {s[j] for s in seen}
                if len(variants) > 1:
                    print(f"    budget {b}: {len(variants)} plans: " + " | ".join(sorted(variants))[:300])


def _budgets(chain) -> list[int]:
    none = simulate(chain, plan_chain(chain, "none", None, 1).plan).peak_bytes
    k1 = simulate(chain, plan_chain(chain, "every-k", None, 1).plan).peak_bytes
    lo = min(k1, none)
    return [int(lo + f * (none - lo)) for f in (0.1, 0.3, 0.5, 0.7, 0.9)]


if __name__ == "__main__":
    main()
