"""The planner's cost model: a chain of layers between a fixed *pre* and a fixed *post* stage.

Per layer we keep rotor's quantities (Beaumont et al. 2019/2021, "Optimal checkpointing for
heterogeneous chains"): forward/backward time, the output size ``x``, the bytes kept when the layer
is stored ``xbar`` (it includes ``x``), transient peaks during forward and backward, plus the
parameter-gradient bytes that appear at the end of the layer's backward. Everything before the
chain (embeddings, stem) is the *pre* stage and everything after (head, loss) the *post* stage;
both are always stored. ``persistent_bytes`` (parameters, buffers, the batch, optimizer state) is
live for the whole step.

``chain_from_profile`` reads a :class:`ckplan.records.Profile` and *calibrates* the transients
so that simulating the plan without checkpointing reproduces every measured window peak: a
transient is the measured peak minus what the simulator itself holds at that point, so the
model and the simulator cannot disagree about the baseline.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from ..errors import SpecError
from ..records import Profile


@dataclass(frozen=True)
class Layer:
    """One chain layer (rotor's stage)."""

    name: str
    fwd_ms: float
    bwd_ms: float
    x_bytes: int  # output, what a checkpoint boundary keeps
    xbar_bytes: int  # kept when the layer is stored; includes x_bytes
    fwd_tmp_bytes: int  # forward peak above live bytes + xbar
    bwd_tmp_bytes: int  # backward peak above live bytes at its start
    grad_bytes: int  # parameter gradients allocated at the end of its backward
    fwd_flops: int = 0
    bwd_flops: int = 0


@dataclass(frozen=True)
class Pre:
    """Everything before the chain; its ``retained_bytes`` include the chain input."""

    retained_bytes: int
    fwd_tmp_bytes: int = 0
    bwd_tmp_bytes: int = 0
    grad_bytes: int = 0
    fwd_ms: float = 0.0
    bwd_ms: float = 0.0


@dataclass(frozen=True)
class Post:
    """Everything after the chain, ending in the scalar loss (its output counts as 0 bytes)."""

    xbar_bytes: int
    fwd_tmp_bytes: int = 0
    bwd_tmp_bytes: int = 0
    grad_bytes: int = 0
    fwd_ms: float = 0.0
    bwd_ms: float = 0.0


@dataclass(frozen=True)
class Chain:
    layers: tuple[Layer, ...]
    pre: Pre
    post: Post
    x_in_bytes: int  # the chain input (held by pre)
    delta_in_bytes: int  # gradient of the chain input, made by B(0); 0 when it needs none
    persistent_bytes: int  # params + buffers + batch + optimizer state (+ all grads when accum > 1)
    opt_step_peak_bytes: int  # absolute peak of optimizer.step()
    name: str = ""
    # Breakdown of the fixed memory, only for messages; 0 when unknown.
    param_bytes: int = 0
    total_grad_bytes: int = 0
    optimizer_bytes: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))
        if not self.layers:
            raise ValueError("a chain needs at least one layer")
        for i, ly in enumerate(self.layers):
            sizes = (ly.x_bytes, ly.xbar_bytes, ly.fwd_tmp_bytes, ly.bwd_tmp_bytes, ly.grad_bytes)
            if any(not isinstance(v, int) or v < 0 for v in sizes):
                raise ValueError(f"layer {i} ({ly.name}): sizes must be non-negative ints, got {sizes}")
            if ly.xbar_bytes < ly.x_bytes:
                raise ValueError(f"layer {i} ({ly.name}): xbar {ly.xbar_bytes} < x {ly.x_bytes}")
            if ly.fwd_ms < 0 or ly.bwd_ms < 0:
                raise ValueError(f"layer {i} ({ly.name}): negative time")
        fixed = (self.pre.retained_bytes, self.pre.fwd_tmp_bytes, self.pre.bwd_tmp_bytes,
                 self.pre.grad_bytes, self.post.xbar_bytes, self.post.fwd_tmp_bytes,
                 self.post.bwd_tmp_bytes, self.post.grad_bytes, self.x_in_bytes,
                 self.delta_in_bytes, self.persistent_bytes, self.opt_step_peak_bytes)
        if any(not isinstance(v, int) or v < 0 for v in fixed):
            raise ValueError(f"pre/post/fixed sizes must be non-negative ints, got {fixed}")

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    @property
    def base_step_ms(self) -> float:
        """One forward and one backward of everything: the step time without checkpointing."""
        return (self.pre.fwd_ms + self.pre.bwd_ms + self.post.fwd_ms + self.post.bwd_ms
                + sum(ly.fwd_ms + ly.bwd_ms for ly in self.layers))


def chain_from_profile(profile: Profile) -> Chain:
    """Build the cost model of ``profile``, transients calibrated on the measured windows."""
    rows = profile.chain_layers
    if not rows:
        raise SpecError(f"profile of {profile.model!r} has no chain layers",
                        tip="check the chain path with `ckplan profile --chain`")
    t = profile.totals
    accum = profile.accum > 1
    persistent = t.param_bytes + t.buffer_bytes + t.input_bytes + t.optimizer_bytes
    if accum:
        # Gradients outlive the micro-batch: they are part of the fixed memory, not of a stage.
        persistent += t.grad_bytes
    opt_peak = (t.param_bytes + t.buffer_bytes + t.input_bytes + t.optimizer_bytes + t.grad_bytes
                + t.optimizer_tmp_bytes)

    def grad(r) -> int:
        return 0 if accum else r.grad_bytes

    pre_r, post_r = profile.pre, profile.post
    layers = tuple(Layer(r.name, r.fwd_ms, r.bwd_ms, r.output_bytes,
                         max(r.saved_bytes, r.output_bytes), 0, 0, grad(r), r.fwd_flops, r.bwd_flops)
                   for r in rows)
    chain = Chain(
        layers=layers,
        pre=Pre(max(pre_r.saved_bytes, pre_r.output_bytes), 0, 0, grad(pre_r), pre_r.fwd_ms, pre_r.bwd_ms),
        post=Post(max(post_r.saved_bytes, post_r.output_bytes), 0, 0, grad(post_r),
                  post_r.fwd_ms, post_r.bwd_ms),
        x_in_bytes=pre_r.output_bytes,
        delta_in_bytes=pre_r.output_bytes if profile.input_requires_grad else 0,
        persistent_bytes=persistent,
        opt_step_peak_bytes=opt_peak,
        name=profile.model,
        param_bytes=t.param_bytes,
        total_grad_bytes=t.grad_bytes,
        optimizer_bytes=t.optimizer_bytes,
    )
    return calibrate(chain, profile)


def calibrate(chain: Chain, profile: Profile) -> Chain:
    """Set every transient to (measured window peak) - (what the simulator holds there).

    Transients do not change the live bytes of the plan without checkpointing, so one trace of
    that plan with the transients at zero gives every base at once. A measured peak below the
    simulator's base (the model overestimates there) gives a zero transient.
    """
    from .simulate import trace  # simulate imports this module's types
    from .strategies import plan_none

    base = replace(chain, pre=replace(chain.pre, fwd_tmp_bytes=0, bwd_tmp_bytes=0),
                   post=replace(chain.post, fwd_tmp_bytes=0, bwd_tmp_bytes=0),
                   layers=tuple(replace(ly, fwd_tmp_bytes=0, bwd_tmp_bytes=0) for ly in chain.layers))
    live: dict[tuple[str, int], int] = {}
    for ev in trace(base, plan_none(chain.n_layers)):
        if ev.op in ("F", "B"):
            live[(ev.op, ev.stage)] = ev.live_bytes
    n = chain.n_layers
    p = chain.persistent_bytes

    def tmp(op: str, stage: int, measured: int) -> int:
        return max(0, p + measured - live[(op, stage)])

    rows = profile.chain_layers
    layers = tuple(replace(ly, fwd_tmp_bytes=tmp("F", i, r.fwd_peak_bytes),
                           bwd_tmp_bytes=tmp("B", i, r.bwd_peak_bytes))
                   for i, (ly, r) in enumerate(zip(base.layers, rows)))
    pre = replace(base.pre, fwd_tmp_bytes=tmp("F", -1, profile.pre.fwd_peak_bytes),
                  bwd_tmp_bytes=tmp("B", -1, profile.pre.bwd_peak_bytes))
    post = replace(base.post, fwd_tmp_bytes=tmp("F", n, profile.post.fwd_peak_bytes),
                   bwd_tmp_bytes=tmp("B", n, profile.post.bwd_peak_bytes))
    return replace(base, layers=layers, pre=pre, post=post)


def predicted_peak_none(profile: Profile) -> int:
    """Peak of one training step without checkpointing, as the planner predicts it.

    Equals ``max(persistent + largest measured window peak, optimizer-step peak)`` whenever the
    profile is self-consistent (no window measured below the model's live bytes); it is the
    simulated peak of the ``none`` plan, so the profile and plan commands always agree.
    """
    from .simulate import simulate
    from .strategies import plan_none

    chain = chain_from_profile(profile)
    return simulate(chain, plan_none(chain.n_layers)).peak_bytes
