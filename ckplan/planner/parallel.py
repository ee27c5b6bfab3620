"""What one rank holds under data parallelism: FSDP2 (``fully_shard``) or DDP. Pure Python.

The profile is made on one process (or on meta) at one rank's micro-batch; this module turns
its chain into the chain *one rank* runs, and the unchanged simulator and strategies then plan
it. The budget is per rank. Every chain layer is one FSDP unit (``fully_shard(layer)`` for each
layer, then ``fully_shard(model)`` for the rest, the *root*): that is what users do.

Notation, bytes per rank: ``P[i]`` the unsharded parameters of chain layer i padded as FSDP2
pads them (dim 0 to a multiple of the world size W), ``R`` the same for the root (pre and post
stages: embeddings, final norm, head), ``G[i]`` the layer's full parameter gradients.

FSDP2 (read from torch 2.13, ``torch/distributed/fsdp/_fully_shard/``, checked against the
measured peaks of ``ckplan.distributed``):

* persistent: ``(sum P + R) / W`` sharded parameters, the optimizer state scaled the same way,
  buffers and the rank's batch. Sharded gradients ``P[i] / W`` (the reduce-scatter output)
  appear at the end of layer i's backward and live until ``zero_grad``.
* forward of layer i: its all-gather output (a flat buffer of ``P[i]``) and the unsharded
  parameters copied out of it (``P[i]``); the flat buffer is kept until the next unit's
  all-gather (implicit forward prefetch): ``fwd_tmp += 2 P[i]``.
* backward of a stored layer i: the unsharded parameters ``P[i]``, the all-gather prefetched
  for the layer before (``P[i-1]``) and the reduce-scatter input of the layer after
  (``P[i+1]``), kept until the next reduce-scatter (``reduce_scatter_max_input_buffers`` = 1):
  ``bwd_tmp += P[i] + P[i-1] + P[i+1]``.
* the backward of a top-level checkpoint [s, t) (a recompute, then the backward of its layers):
  FSDP2's post-forward hook reshards nothing while a backward runs, so every unit forwarded there
  stays unsharded until its own post-backward reshard; the last layer's pre-backward hook (on the
  checkpoint's output) unshards it before the recompute and prefetches layer t-2. So all of
  ``P[s..t-1]`` are held through that backward, each until its layer's backward ends
  (``Layer.held_bytes``; FSDP2's hooks traced on 2 gloo ranks: at B(j) exactly ``P[s..j]`` are
  unsharded, plus the prefetch of ``P[s-1]`` at B(s)). Above them a held layer's backward has
  ``bwd_tmp + P[i+1]`` (``held_bwd_tmp_bytes``); a forward there has ``fwd_tmp`` beside the
  reduce-scatter input of the layer that ran its backward last (``retained_bytes``: ``P[t]``
  during the recompute of [s, t), ``held_fwd_tmp_bytes`` leaves it out) and, when that forward
  unshards its unit (any layer but the last of the checkpoint whose recompute runs it), the
  all-gather buffer ``P[i]`` (``gather_bytes``; FSDP2 frees it when that layer's forward ends);
  the first layer's backward has the prefetch of the layer before beside it (``P[s-1]``; for a
  single-layer checkpoint, from before its recompute: its recompute then holds ``P[i] + P[i-1]
  + P[i+1]`` above its transient, as its backward does). The simulator replays these; the DP
  plans inner plans and the top level on their own costs (``planner.held``).
* the root is not resharded after forward (``reshard_after_forward`` is False for the root):
  ``R`` stays live from the pre stage to the end of backward (``pre.retained += R``); its flat
  buffer is a transient of the pre stage (``pre.fwd_tmp += R``). The post stage's gradients
  stay unsharded until the root's reduce-scatter at the very end; the pre stage's backward
  also holds layer 0's reduce-scatter input (``pre.bwd_tmp += P[0]``), and the post stage
  the prefetched last layer (``post.fwd_tmp``, ``post.bwd_tmp += P[n-1]``).
* optimizer step: on the shards: persistent + sharded gradients + the single-process
  temporaries scaled by the shard ratio.
* FSDP2's ``MixedPrecisionPolicy(param_dtype, reduce_dtype=fp32)`` (``param_dtype_ratio`` 0.5,
  the profile made in the param dtype: ``ckplan.param_dtype``): the all-gather buffers, the
  unsharded parameters and the prefetch are ``G[i] = P[i] / 2``, the root's ``R / 2``; the
  shards, the optimizer state (the profile's, measured on the param dtype, doubled), the
  reduce-scatter inputs and the sharded gradients stay fp32. With ``reduce_dtype`` the param
  dtype (``reduce_dtype_ratio`` 0.5: the policy without a reduce_dtype) the reduce-scatter
  inputs are ``P[i] / 2`` and ``R / 2`` too; its output is cast to fp32, the sharded gradient.

DDP: parameters, gradients and optimizer state are replicated, and the reducer's buckets
(``bucket_cap_mb`` 25, ``gradient_as_bucket_view`` False) are a second copy of every gradient,
allocated once when the model is wrapped: ``persistent += sum G``.

Checked on 2 gloo ranks (``tests/test_distributed.py``, ``ckplan.distributed``): the predicted
per-rank peak equals the measured one to the byte for none, every-k (one-layer to whole-chain
checkpoints), sqrtn and dp (at the per-rank smallest peak and half-way up) on small GPTs, with
SGD and AdamW, FSDP2 and DDP (the tests allow 1%); gpt2-small on 2 ranks: ``reports/cpu/dist``.
PyTorch's ``FSDPMemTracker`` agrees on the same step.

Known limitations:

* In a checkpoint's backward every unit of it is counted as held from its start, while FSDP2
  unshards each when the recompute reaches it: the first forwards of a long checkpoint's
  recompute are over-counted by the units not yet reached (their activations are fewer than at
  the checkpoint's last layers, so that is not where a plan peaks on real models); forwards of a
  nested checkpoint's recompute (the units are unsharded already) and the first forward of a
  checkpoint inside a recompute are counted with the all-gather buffer and beside the next
  layer's reduce-scatter input, on the safe side.
* The bench makes FSDP2's default backward prefetch explicit (each layer prefetches the one
  before); the model assumes that prefetch.
* Uneven shards (dim 0 not divisible by W): every rank is modelled as rank 0, which holds the
  largest, padded shard; the last ranks hold less (measured on 3 ranks: ranks 0-1 exact,
  rank 2 0.6-1.0% lower). The per-rank budget is for the largest rank.
* NCCL/gloo internal buffers and the CUDA caching allocator are outside the model; ``accum``
  must be 1; without a model at hand (``per_rank_chain_from_profile``) FSDP2's padding of dim 0
  to the world size is ignored (exact when dim 0 divides by the world size).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

from ..device_model import DeviceModel, allreduce_ms, gather_ms
from ..errors import ChainError, InfeasibleBudgetError, UsageError
from .calibrate import chain_from_profile
from .chain import Chain
from .solve import min_peak
from .strategies import plan_chain

if TYPE_CHECKING:
    from ..records import Profile

KINDS = ("fsdp", "ddp")


def _shard(nbytes: int, world_size: int) -> int:
    return -(-nbytes // world_size)


def _with_buffers(fwd_tmp: int, bwd_tmp: int, xbar: int, own: int, flat: int, prefetch: int,
                  retained: int, gathered_before: int) -> tuple[int, int]:
    """A unit's transients at the top level with its FSDP buffers on top: ``own`` unsharded
    parameter bytes, the flat all-gather buffer (``flat``: 0 on one rank), the next unit's
    prefetch, the reduce-scatter input ``retained`` from the unit after, and the flat buffer
    ``gathered_before`` still live at this unit's all-gather. (A forward during backward is a
    held layer's: ``Layer.held_*``.)"""
    fwd = max(fwd_tmp + (1 + flat) * own,  # first forward: unsharded + flat buffer
              gathered_before + own - xbar)
    return max(0, fwd), max(0, bwd_tmp + own + prefetch + retained)


def per_rank_chain(chain: Chain, *, world_size: int, kind: str, layer_param_bytes: Sequence[int],
                   root_param_bytes: int, param_dtype_ratio: float = 1.0,
                   reduce_dtype_ratio: float = 1.0) -> Chain:
    """The chain one rank runs under ``kind`` on ``world_size`` ranks (see the module doc).

    ``chain`` is the single-process chain at one rank's micro-batch; ``layer_param_bytes[i]``
    the (padded) unsharded parameter bytes of chain layer i, ``root_param_bytes`` those of
    everything outside the chain. DDP needs neither (pass the profile's values anyway).
    ``param_dtype_ratio`` and ``reduce_dtype_ratio``: bytes of FSDP2's MixedPrecisionPolicy
    param and reduce dtypes over the fp32 masters' (1: no policy).
    """
    if kind not in KINDS:
        raise UsageError(f"--parallel {kind!r} is not one of {', '.join(KINDS)}")
    if not isinstance(world_size, int) or world_size < 1:
        raise UsageError(f"--world-size {world_size!r} must be a positive integer")
    if len(layer_param_bytes) != chain.n_layers:
        raise ChainError(f"{len(layer_param_bytes)} layer parameter sizes for {chain.n_layers} layers")
    name = f"{chain.name} [{kind} x{world_size}]"
    if kind == "ddp":
        buckets = sum(ly.grad_bytes for ly in chain.layers) + chain.pre.grad_bytes + chain.post.grad_bytes
        if world_size == 1:
            buckets = 0  # DDP on one rank still builds buckets, but there is nothing to average
        return replace(chain, name=name, persistent_bytes=chain.persistent_bytes + buckets,
                       opt_step_peak_bytes=chain.opt_step_peak_bytes + buckets)
    W = world_size
    P = [int(b) for b in layer_param_bytes]
    R = int(root_param_bytes)
    # MixedPrecisionPolicy: all-gathers, unsharded parameters and their gradients in the param
    # dtype (G, Q), shards, reduce-scatter buffers and sharded gradients in the master dtype (P, R)
    G = [int(b * param_dtype_ratio) for b in P]
    Q = int(R * param_dtype_ratio)
    # the reduce-scatter inputs, in the reduce dtype
    S = [int(b * reduce_dtype_ratio) for b in P]
    T = int(R * reduce_dtype_ratio)
    full_params = sum(P) + R
    sharded_params = sum(_shard(b, W) for b in P) + _shard(R, W)
    # Optimizer state follows the local shard; rank 0 holds the largest (padded) one.
    # (the profile's parameters are in the param dtype: the masters are 1 / param_dtype_ratio as
    # large, and so is an optimizer state measured on them)
    unpadded = chain.param_bytes / param_dtype_ratio if chain.param_bytes else full_params
    ratio = (min(1.0, sharded_params / unpadded) if unpadded else 1.0) / param_dtype_ratio
    # Scalar state (step counters) is one per parameter on every rank: not sharded.
    fixed = chain.optimizer_scalar_bytes
    opt_state = int(round((chain.optimizer_bytes - fixed) * ratio)) + fixed
    others = chain.persistent_bytes - chain.param_bytes - chain.optimizer_bytes  # buffers, batch
    persistent = others + sharded_params + opt_state
    grads_full = chain.total_grad_bytes
    sharded_grads = sum(_shard(b, W) for b in P) + _shard(R, W)
    # The optimizer-step peak of one process is params + grads + state + its temporaries.
    opt_tmp = max(0, chain.opt_step_peak_bytes - chain.persistent_bytes - grads_full)
    opt_peak = persistent + sharded_grads + int(round(opt_tmp * ratio))
    n = chain.n_layers
    flat = 1 if W > 1 else 0  # the flat all-gather buffer (none on one rank: _unit_layer)
    layers = [_unit_layer(ly, i, P, W, G, Q, S) for i, ly in enumerate(chain.layers)]
    pre = replace(chain.pre, retained_bytes=chain.pre.retained_bytes + Q,
                  fwd_tmp_bytes=chain.pre.fwd_tmp_bytes + flat * Q,
                  # the last reduce-scatter input (layer 0's) is held until the root's own
                  # reduce-scatter, whose input T holds the root's gradients
                  bwd_tmp_bytes=max(chain.pre.bwd_tmp_bytes + S[0], chain.pre.grad_bytes + T),
                  grad_bytes=0)
    post = replace(chain.post, fwd_tmp_bytes=chain.post.fwd_tmp_bytes + flat * G[n - 1],
                   bwd_tmp_bytes=chain.post.bwd_tmp_bytes + flat * G[n - 1])
    return replace(chain, name=name, layers=tuple(layers), pre=pre, post=post,
                   persistent_bytes=persistent, opt_step_peak_bytes=max(opt_peak, persistent),
                   param_bytes=sharded_params, total_grad_bytes=sharded_grads, optimizer_bytes=opt_state,
                   opt_ms=chain.opt_ms / W)  # each rank steps its shard only


def _unit_layer(ly, i: int, P: list[int], W: int, G: list[int], Q: int, S: list[int]):
    """Chain layer ``i`` as one FSDP2 unit on ``W`` ranks (``P``: every unit's unsharded fp32
    parameter bytes; ``G``, ``Q``: the units' and the root's in the all-gather's dtype; ``S``:
    the units' reduce-scatter inputs, in the reduce dtype)."""
    n = len(P)
    # On one rank FSDP2 copies the shard into the unsharded parameters without a collective:
    # no flat all-gather buffer, and a prefetch allocates nothing until the copy.
    flat = 1 if W > 1 else 0
    prefetch = flat * G[i - 1] if i > 0 else 0  # layer 0 needs none: the root stays unsharded
    retained = S[i + 1] if i < n - 1 else 0  # reduce-scatter input of the layer after
    gathered_before = flat * (G[i - 1] if i > 0 else Q)  # flat buffer before, at i's all-gather
    around = (G[i], flat, prefetch, retained, gathered_before)
    fwd, bwd = _with_buffers(ly.fwd_tmp_bytes, ly.bwd_tmp_bytes, ly.xbar_bytes, *around)
    # (the early stop's shorter recompute is not modelled per rank: the whole forward)
    # a checkpoint's first forward: the measured no-save peak, with the same buffers on top
    nosave = None if ly.nosave_peak_bytes is None else ly.nosave_peak_bytes + fwd - ly.fwd_tmp_bytes
    # a layer stored with a selective option runs the same unit: its forward, and its
    # backward (which starts with the option's recompute), hold the same buffers
    options = []
    for o in ly.options:
        o_fwd, o_bwd = _with_buffers(o.fwd_tmp_bytes, o.bwd_tmp_bytes, o.xbar_bytes, *around)
        options.append(replace(o, fwd_tmp_bytes=o_fwd, bwd_tmp_bytes=o_bwd,
                               held_fwd_tmp_bytes=o.fwd_tmp_bytes,
                               held_bwd_tmp_bytes=o.bwd_tmp_bytes + retained))
    # inside a top-level checkpoint's backward the unit stays unsharded (held) until its own
    # backward ends: its backward there has only the reduce-scatter input of the layer after
    # on top, a forward there that of the last layer backwarded (the simulator adds it) and,
    # when that forward unshards the unit, the all-gather buffer
    return replace(ly, fwd_tmp_bytes=fwd, bwd_tmp_bytes=bwd,
                   grad_bytes=_shard(P[i], W) if ly.grad_bytes else 0,
                   early_xbar_bytes=None, early_fwd_tmp_bytes=None,
                   nosave_peak_bytes=nosave, options=tuple(options),
                   held_bytes=G[i], held_fwd_tmp_bytes=ly.fwd_tmp_bytes,
                   held_bwd_tmp_bytes=ly.bwd_tmp_bytes + retained,
                   gather_bytes=flat * G[i], retained_bytes=S[i])


def unit_param_bytes(profile: Profile) -> tuple[tuple[int, ...], int]:
    """(parameter bytes of every chain layer, of everything else) from a profile's rows.

    No padding: exact when every parameter's dim 0 divides by the world size (Llama and GPT
    widths do); ``ckplan.distributed.fsdp_unit_bytes`` gives FSDP2's padded sizes from a model.
    """
    layers = tuple(r.param_bytes for r in profile.chain_layers)
    return layers, profile.pre.param_bytes + profile.post.param_bytes


def param_dtype_ratio(profile: Profile, kind: str) -> float:
    """Bytes of a parameter in FSDP2's MixedPrecisionPolicy dtype over its fp32 master's: 0.5
    for a profile made in bf16/fp16 (``Profile.param_dtype``), else 1."""
    if profile.param_dtype is None:
        return 1.0
    if kind != "fsdp":
        raise UsageError(f"the profile ran in FSDP2's MixedPrecisionPolicy ({profile.param_dtype} parameters), "
                         f"which {kind} does not have", tip="plan it with --parallel fsdp")
    return 0.5


def reduce_dtype_ratio(profile: Profile) -> float:
    """Bytes of the policy's reduce dtype over the fp32 masters': 0.5 when it reduces in the
    param dtype (``Profile.reduce_dtype`` bf16/fp16), else 1."""
    return 0.5 if profile.param_dtype is not None and profile.reduce_dtype in ("bf16", "fp16") else 1.0


def per_rank_chain_from_profile(profile: Profile, world_size: int, kind: str) -> Chain:
    """``per_rank_chain`` of the profile's single-process chain, parameter sizes from its rows."""
    if profile.accum != 1:
        raise UsageError(f"--world-size plans assume train.accum 1, the profile has accum {profile.accum}",
                         tip="profile with train.accum: 1")
    ratio = param_dtype_ratio(profile, kind)
    layers, root = unit_param_bytes(profile)  # in the profile's dtype: the masters' are 1 / ratio as large
    return per_rank_chain(chain_from_profile(profile), world_size=world_size, kind=kind,
                          layer_param_bytes=[round(b / ratio) for b in layers], root_param_bytes=round(root / ratio),
                          param_dtype_ratio=ratio, reduce_dtype_ratio=reduce_dtype_ratio(profile))


@dataclass(frozen=True)
class WorldSizeRow:
    """What one rank needs at one world size (``ckplan plan --world-size 8,16,32,64``)."""

    world_size: int
    kind: str
    strategy: str
    persistent_bytes: int  # sharded params + grads-free fixed memory + optimizer state, per rank
    none_peak_bytes: int  # per-rank peak without checkpointing
    plan_peak_bytes: int | None  # per-rank peak of the strategy's plan (None: infeasible)
    min_peak_bytes: int  # the lowest per-rank peak any plan reaches
    budget_bytes: int | None
    fits: bool | None
    overhead: float | None  # recompute time / step time without checkpointing
    n_checkpoints: int | None
    plan: str
    message: str = ""
    step_ms: float | None = None  # per-rank step with the plan's recompute (None: infeasible)
    comm_ms: float | None = None  # the step's collectives at the device model's bandwidths (None: no model)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def world_size_table(profile: Profile, world_sizes: Sequence[int], kind: str = "fsdp",
                     strategy: str = "dp", budget_bytes: int | None = None, k: int = 2,
                     device: DeviceModel | None = None) -> tuple[WorldSizeRow, ...]:
    """One row per world size: per-rank peak with and without the plan, its overhead and step
    time, and with a ``device`` model the time of the step's collectives (:func:`comm_ms`).

    ``budget_bytes`` is per rank; without it dp plans for the smallest feasible peak.
    """

    rows = []
    for w in world_sizes:
        chain = per_rank_chain_from_profile(profile, int(w), kind)
        none = plan_chain(chain, "none")
        lo = min_peak(chain)
        try:
            res = plan_chain(chain, strategy, budget_bytes, k)
            rows.append(WorldSizeRow(int(w), kind, strategy, chain.persistent_bytes, none.score.peak_bytes,
                                     res.score.peak_bytes, lo, budget_bytes, res.fits, res.score.overhead,
                                     res.plan.n_checkpoints, res.plan.describe(runs=True), step_ms=res.score.step_ms,
                                     comm_ms=comm_ms(profile, int(w), kind, device)))
        except InfeasibleBudgetError as err:
            rows.append(WorldSizeRow(int(w), kind, strategy, chain.persistent_bytes, none.score.peak_bytes,
                                     None, lo, budget_bytes, False, None, None, "", err.message,
                                     comm_ms=comm_ms(profile, int(w), kind, device)))
    return tuple(rows)


# Devices per node: ranks beyond it talk over the network (InfiniBand), within it over the links.
DEVICES_PER_NODE = 8


def comm_ms(profile: Profile, world_size: int, kind: str, device: DeviceModel | None) -> float | None:
    """Milliseconds per step of one rank's collectives on ``device``, none of it hidden behind
    compute: FSDP2 all-gathers every parameter in the forward and again in the backward and
    reduce-scatters the gradients; DDP all-reduces the gradients. None without a device model
    or its bandwidths."""
    if device is None or world_size <= 1:
        return None if device is None else 0.0
    nodes = -(-world_size // DEVICES_PER_NODE)
    if (device.network_bw if nodes > 1 else device.link_bw) <= 0:
        return None
    params = profile.totals.param_bytes  # all-gathered in the profile's dtype
    # reduced in the reduce dtype: fp32, or the policy's param dtype
    grads = round(profile.totals.grad_bytes / param_dtype_ratio(profile, kind) * reduce_dtype_ratio(profile))
    if kind == "ddp":
        return allreduce_ms(device, grads, world_size, nodes=nodes)
    return (2 * gather_ms(device, params, world_size, nodes=nodes)
            + gather_ms(device, grads, world_size, nodes=nodes))

