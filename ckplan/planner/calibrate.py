"""From a measured profile to the planner's cost model (:class:`Chain`).

``chain_from_profile`` reads a :class:`ckplan.records.Profile` and *calibrates* the transients
so that simulating the plan without checkpointing reproduces every measured window peak: a
transient is the measured peak minus what the simulator itself holds at that point, so the
model and the simulator cannot disagree about the baseline.

Selective options (``StageRecord.options``, measured with every chain layer under one option) become
``Layer.options``, their transients calibrated the same way on the plan that stores every layer
with that option; an option that another way to run the layer beats on both kept bytes and
recompute time (``store``, ``full`` or another option) is dropped.

Times: a chain layer's ``fwd_ms`` in the Chain is its forward window, what it redoes inside a
multi-layer checkpoint, and ``tail_ms`` what a checkpoint ending at it does not redo (window -
the profile's ``recompute_ms``, timed with the layer alone in a checkpoint; see ``_layer_ms``).
"""
from __future__ import annotations

import math
from dataclasses import replace

from ..errors import SpecError
from ..records import Profile, StageRecord
from .baselines import none_peak, plan_none
from .chain import STORE, Chain, Layer, Option, Post, Pre
from .simulate import trace


def chain_from_profile(profile: Profile, keep: tuple[str, ...] = ()) -> Chain:
    """Build the cost model of ``profile``, transients calibrated on the measured windows.

    Options another choice of the layer beats are dropped, except those named in ``keep`` (a plan
    made elsewhere, on meta say, that uses them: they were measured, so it can be scored)."""
    rows = profile.chain_layers
    if not rows:
        raise SpecError(f"profile of {profile.model!r} has no chain layers",
                        tip="check the chain path with `ckplan profile --chain`")
    t = profile.totals
    accum = profile.accum > 1
    persistent = t.param_bytes + t.buffer_bytes + t.input_bytes + t.optimizer_bytes + t.runtime_bytes
    if accum:
        # Gradients outlive the micro-batch: they are part of the fixed memory, not of a stage.
        persistent += t.grad_bytes
    opt_peak = (t.param_bytes + t.buffer_bytes + t.input_bytes + t.optimizer_bytes + t.grad_bytes
                + t.optimizer_tmp_bytes + t.runtime_bytes)

    def grad(r: StageRecord) -> int:
        # accumulating, a gradient is added to .grad in its stage's backward; a sum of shares of
        # a gradient is held until its first user's backward (StageRecord.shared_grad_bytes)
        return (0 if accum else r.grad_bytes) + r.shared_grad_bytes

    pre_r, post_r = profile.pre, profile.post
    layers = tuple(Layer(r.name, fwd, bwd, r.output_bytes, _kept_bytes(r), 0, 0, grad(r),
                         r.fwd_flops, r.bwd_flops, r.cast_bytes, tail_ms=tail,
                         unsaved_cast_bytes=r.unsaved_cast_bytes,
                         x_kept=r.output_kept is not False, in_place=r.output_in_place,
                         copies_input=r.changes_input,
                         x_kept_next=r.output_saved_after is not False,
                         unsaved_kept_bytes=r.unsaved_kept_bytes or 0,
                         kept_after_bytes=r.kept_after_backward_bytes or 0,
                         recompute_kept_bytes=r.recompute_kept_bytes or 0,
                         recompute_chain_kept_bytes=r.recompute_chain_kept_bytes or 0)
                   for r, (fwd, bwd, tail) in ((r, _layer_ms(r)) for r in rows))
    chain = Chain(
        layers=layers,
        pre=Pre(_kept_bytes(pre_r), 0, 0, grad(pre_r), pre_r.fwd_ms, pre_r.bwd_ms,
                x_kept=pre_r.output_kept is not False, cast_bytes=pre_r.unsaved_cast_bytes),
        post=Post(post_r.saved_bytes, 0, 0, grad(post_r), post_r.fwd_ms, post_r.bwd_ms,
                  loss_bytes=post_r.output_bytes),
        x_in_bytes=pre_r.output_bytes,
        delta_in_bytes=pre_r.output_bytes if profile.input_requires_grad else 0,
        persistent_bytes=persistent,
        opt_step_peak_bytes=opt_peak,
        name=profile.model,
        param_bytes=t.param_bytes,
        total_grad_bytes=t.grad_bytes,
        optimizer_bytes=t.optimizer_bytes,
        optimizer_scalar_bytes=t.optimizer_scalar_bytes,
        optimizer=profile.optimizer,
        grads_in_persistent=accum,
        shared_grads_done=tuple((r.index, r.shared_grad_done_bytes) for r in profile.layers
                                if r.shared_grad_done_bytes),
        opt_ms=(t.optimizer_ms or 0.0) / profile.accum,
        side_inputs=profile.side_inputs,
        breaks=profile.chain_breaks,
        d2h_bytes_per_ms=profile.host_bw[0] / 1e3,
        h2d_bytes_per_ms=profile.host_bw[1] / 1e3,
    )
    return on_time_grid(with_options(calibrate(chain, profile), profile, keep))


def _kept_bytes(r: StageRecord) -> int:
    """What a stored stage keeps (``xbar``; pre's ``retained``): its saved bytes, which hold its
    output when some op saved it (``output_kept``; for pre, a chain input that is the batch is in
    the persistent bytes instead). Not measured (a profile without it, compiled layers): taken as kept,
    at least the output (rotor's model)."""
    if r.output_kept is None:
        return max(r.saved_bytes, r.output_bytes)
    return r.saved_bytes


def time_grid_ms(chain: Chain) -> float:
    """The grid ``on_time_grid`` puts a chain's times on: a power of two small enough that any sum
    the tables form (a layer recomputed at most once per nesting level, so at most ``n`` times the
    chain's forward and option times) stays below 2^52 grid steps, where float64 adds exactly."""
    total = sum(ly.fwd_ms + ly.bwd_ms + sum(o.recompute_ms for o in ly.options) for ly in chain.layers)
    reach = 4.0 * max(total, 1e-12) * max(1, chain.n_layers)
    return 2.0 ** (math.ceil(math.log2(reach)) - 52)


def on_time_grid(chain: Chain) -> Chain:
    """The chain with every layer's times rounded to the binary grid of :func:`time_grid_ms`
    (relative changes of about 2^-50 of the chain's time).

    Sums of such values are exact in float64, so plans that cost the same (identical blocks: a
    full checkpoint on layer 4 or on layer 8) cost *exactly* the same in every table, whatever
    order the sums run in, and the DP's tie rules, not rounding noise, choose among them. Before,
    scaling every time of a profile by one factor (the same problem) moved the dp plan's
    checkpoints between equivalent layers; profiles of the same model did the same."""
    q = time_grid_ms(chain)

    def grid(ms: float) -> float:
        return round(ms / q) * q

    def layer(ly):
        fwd = grid(ly.fwd_ms)
        return replace(ly, fwd_ms=fwd, bwd_ms=grid(ly.bwd_ms), tail_ms=min(fwd, grid(ly.tail_ms)),
                       options=tuple(replace(o, recompute_ms=grid(o.recompute_ms)) for o in ly.options))
    return replace(chain, layers=tuple(layer(ly) for ly in chain.layers))


def _layer_ms(r: StageRecord) -> tuple[float, float, float]:
    """(fwd_ms, bwd_ms, tail_ms) of a chain layer for the planner.

    The profile's ``recompute_ms`` is timed with the layer alone in a checkpoint, where PyTorch's
    non-reentrant checkpoint stops the recompute once the last saved tensor is back: the
    layer's final ops are skipped (on GPT-2 blocks the c_proj matmul, whose input is saved
    before it runs: 0.74x the forward window). Inside a multi-layer checkpoint only the last
    layer is cut short; the others run their whole forward. So ``fwd_ms`` is the forward window
    (what an inner layer redoes) and ``tail_ms`` the part a checkpoint ending at the layer skips,
    window - recompute (a checkpoint around the layer alone costs ``recompute_ms``). Where the
    recompute was slower than the window, ``fwd_ms`` is the recompute and the difference moves
    to ``bwd_ms``, so one step without checkpointing (fwd + bwd of every stage) still costs what
    was measured. Without a recompute timing (meta): the window and no tail."""
    if r.recompute_ms is None:
        return r.fwd_ms, r.bwd_ms, 0.0
    fwd = max(r.fwd_ms, r.recompute_ms)
    return fwd, max(0.0, r.bwd_ms + r.fwd_ms - fwd), fwd - r.recompute_ms


def calibrate(chain: Chain, profile: Profile) -> Chain:
    """Set every transient to (measured window peak) - (what the simulator holds there).

    Transients do not change the live bytes of the plan without checkpointing, so one trace of
    that plan with the transients at zero gives every base at once. A measured peak below the
    simulator's base (the model overestimates there) gives a zero transient.
    """
    base = replace(chain, pre=replace(chain.pre, fwd_tmp_bytes=0, bwd_tmp_bytes=0),
                   post=replace(chain.post, fwd_tmp_bytes=0, bwd_tmp_bytes=0),
                   layers=tuple(replace(ly, fwd_tmp_bytes=0, bwd_tmp_bytes=0) for ly in chain.layers))
    live: dict[tuple[str, int | None], int] = {}
    for ev in trace(base, plan_none(chain.n_layers)):
        if ev.op in ("F", "B"):
            live[(ev.op, ev.stage)] = ev.live_bytes
    n = chain.n_layers
    p = chain.persistent_bytes

    def tmp(op: str, stage: int, measured: int) -> int:
        return max(0, p + measured - live[(op, stage)])

    def early(i: int, ly: Layer, r: StageRecord, fwd_tmp: int) -> tuple[int | None, int | None]:
        """(early_xbar, early_fwd_tmp): what the layer keeps when a recompute stops at its last
        saved tensor, and the peak up to there above it, on the simulator's scale (the forward
        starts at live - xbar)."""
        if r.early_peak_bytes is None or r.early_kept_bytes is None or ly.in_place:
            return None, None
        ex = min(r.early_kept_bytes, ly.xbar_bytes)
        et = max(0, p + r.early_peak_bytes - (live[("F", i)] - ly.xbar_bytes) - ex)
        return ex, min(et, ly.xbar_bytes + fwd_tmp - ex)

    rows = profile.chain_layers
    layers = []
    for i, (ly, r) in enumerate(zip(base.layers, rows)):
        ft = tmp("F", i, r.fwd_peak_bytes)
        ex, et = early(i, ly, r, ft)
        layers.append(replace(ly, fwd_tmp_bytes=ft, bwd_tmp_bytes=tmp("B", i, r.bwd_peak_bytes),
                              early_xbar_bytes=ex, early_fwd_tmp_bytes=et,
                              lead_bytes=r.backward_lead_bytes or 0,
                              nosave_peak_bytes=r.nosave_peak_bytes))
    pre = replace(base.pre, fwd_tmp_bytes=tmp("F", -1, profile.pre.fwd_peak_bytes),
                  bwd_tmp_bytes=tmp("B", -1, profile.pre.bwd_peak_bytes))
    post = replace(base.post, fwd_tmp_bytes=tmp("F", n, profile.post.fwd_peak_bytes),
                   bwd_tmp_bytes=tmp("B", n, profile.post.bwd_peak_bytes))
    return replace(base, layers=tuple(layers), pre=pre, post=post)


def predicted_peak_none(profile: Profile) -> int:
    """Peak of one training step without checkpointing, as the planner predicts it.

    Equals ``max(persistent + largest measured window peak, optimizer-step peak)`` whenever the
    profile is self-consistent (no window measured below the model's live bytes); it is the
    simulated peak of the ``none`` plan, so the profile and plan commands always agree.
    """
    chain = chain_from_profile(profile)
    return none_peak(chain)


def with_options(chain: Chain, profile: Profile, keep: tuple[str, ...] = ()) -> Chain:
    """``chain`` with each layer's measured selective options, calibrated, dominated ones dropped
    (except those named in ``keep``).

    Option P's transients: (peak measured with every layer under P) - (what the simulator holds
    at that op in the plan storing every layer with P), as :func:`calibrate` does for ``store``.
    """
    rows = profile.chain_layers
    names = profile.option_names
    if not names:
        return chain
    options: list[list[Option]] = [[] for _ in rows]
    p = chain.persistent_bytes
    for name in names:
        have = [r.option(name) for r in rows]
        base = replace(chain, layers=tuple(
            replace(ly, options=(Option(name, max(o.saved_bytes, ly.x_bytes), o.recompute_ms, 0, 0,
                                        o.recompute_flops, cast_bytes=o.cast_bytes),) if o is not None else ())
            for ly, o in zip(chain.layers, have)))
        per = [name if o is not None else STORE for o in have]
        live: dict[tuple[str, int | None], int] = {}
        for ev in trace(base, plan_none(chain.n_layers).with_options(per)):
            if ev.op in ("F", "B"):
                live[(ev.op, ev.stage)] = ev.live_bytes
        for i, (ly, o) in enumerate(zip(base.layers, have)):
            if o is None:
                continue
            opt = ly.options[0]
            options[i].append(replace(opt, fwd_tmp_bytes=max(0, p + o.fwd_peak_bytes - live[("F", i)]),
                                      bwd_tmp_bytes=max(0, p + o.bwd_peak_bytes - live[("B", i)])))
    return replace(chain, layers=tuple(replace(ly, options=_kept(undominated(ly, opts), opts, keep))
                                       for ly, opts in zip(chain.layers, options)))


def _kept(best: tuple[Option, ...], measured: list[Option], keep: tuple[str, ...]) -> tuple[Option, ...]:
    """The undominated options, and the measured ones named in ``keep``, in measured order."""
    names = {o.name for o in best} | set(keep)
    return tuple(o for o in measured if o.name in names)


# Two ways to store a layer closer than this are one choice (the earlier stays), so that timing
# noise does not decide between them run to run: kept bytes within TIE_BYTES of each other and
# recompute times within TIE_FWD of the layer's forward (gpt2-small compiled: sac-compute and
# sac-linear keep the same bytes, their recomputes 29 and 37 ms beside a 250 ms forward).
TIE_BYTES = 0.01
TIE_FWD = 0.05


def undominated(layer: Layer, options: list[Option]) -> tuple[Option, ...]:
    """The options no other choice of the layer beats on (kept bytes, recompute ms): ``store``
    (xbar, 0), ``full`` (x, alone_ms) or another option; on a tie, or a near-tie (TIE_BYTES,
    TIE_FWD), the earlier choice stays."""
    choices = [(layer.xbar_bytes, 0.0), (layer.x_bytes, layer.alone_ms)] + \
        [(o.xbar_bytes, o.recompute_ms) for o in options]

    def near(c: tuple[int, float], mine: tuple[int, float]) -> bool:
        return abs(c[0] - mine[0]) <= TIE_BYTES * mine[0] and abs(c[1] - mine[1]) <= TIE_FWD * layer.fwd_ms

    kept = []
    for j, o in enumerate(options, start=2):
        mine = choices[j]
        beaten = any(k < j if near(c, mine) else (c[0] <= mine[0] and c[1] <= mine[1])
                     for k, c in enumerate(choices) if k != j)
        if not beaten:
            kept.append(o)
    return tuple(kept)
