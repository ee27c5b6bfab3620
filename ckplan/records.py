"""Plain, frozen records passed between ckplan's stages (measure -> plan -> report). No torch
here: the planner and the report read them without PyTorch. Sizes ``int`` bytes, durations
``float`` milliseconds, work ``int`` FLOPs."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

SCHEMA_VERSION = 1

PRE, CHAIN, POST = "pre", "chain", "post"


@dataclass(frozen=True)
class OptionRecord:
    """A chain layer measured with one selective option (ckplan.sac): every chain layer of the
    step ran under that option's policy, so peaks are those of the step with all layers so.

    ``saved_bytes`` are the storages the layer's forward window allocated that are alive when
    the forward ends (the SAC cache of kept op outputs, and the output; the checkpoint's own hooks
    hide them from ``saved_tensors_hooks``, so they are counted as live bytes). ``recompute_ms``
    is the forward the option redoes in the layer's backward (the policy's unsaved ops), measured
    by clock (on meta: priced from ``recompute_flops``)."""

    name: str  # the policy: sac-compute | sac-linear | sac-attn
    saved_bytes: int  # kept for backward with the option, the output included
    recompute_ms: float
    recompute_flops: int  # backward FLOPs with the option minus without (the forward redone)
    bwd_ms: float  # the backward window with the option, recompute included
    fwd_peak_bytes: int  # as StageRecord's, in the step with every chain layer under the option
    bwd_peak_bytes: int
    cast_bytes: int = 0  # autocast's weight copies its forward made and did not keep: live to the forward's end

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class SideInput:
    """Tensors the chain layers receive besides the hidden state, made before the chain (attention
    masks, ``position_ids``, ALiBi biases) and freed when the forward ends in a step without
    checkpoints (no op saves them). A checkpoint, or a layer stored with a selective option (SAC
    runs it in a checkpoint), keeps the arguments of its layers until its backward, so these
    bytes then stay. ``layers``: the chain layers (0-based) that receive them."""

    bytes: int
    layers: tuple[int, ...]
    # The chain layer that makes them, for one made inside the chain and given to layers after the
    # next one (T5's position bias, from its first block); -1: made before the chain. A
    # checkpoint over that layer makes them again in its recompute.
    made_by: int = -1
    # Their gradient, when they require grad (T5's position bias comes from a parameter), summed
    # by the autograd engine from the backward of the last layer reading them until their maker's
    # backward consumes it. ``bytes`` may then be 0: one saved by its maker, or outside the chain
    # layers (in that stage's saved bytes), is listed for its gradient only.
    grad_bytes: int = 0
    # The layers among ``layers`` whose own ops save them, when nothing else does (rotary ``(cos,
    # sin)`` that only a hybrid model's attention layers multiply in): kept until the backward of
    # the first of them, not only to the forward's end; ``bytes`` is then their size.
    saved_by: tuple[int, ...] = ()
    # For one made by a chain layer: the layers after the next one that receive them other than
    # in the previous layer's output (T5 relays its bias through every block's output; a model
    # may keep it in a variable): a checkpoint over the maker records those calls, keeping them.
    unrelayed: tuple[int, ...] = ()
    # What the engine holds of their gradient beyond ``grad_bytes`` before it is summed: the first
    # layer's gradient a slice of a larger one (Zamba2 concatenates them to the hidden state), kept
    # whole from the start of layer ``partial_span[0]``'s backward to the end of ``partial_span[1]``'s.
    partial_bytes: int = 0
    partial_span: tuple[int, ...] = ()
    # The layer whose backward hands them their first gradient, when not the last in ``layers``
    # (a layer that receives them and does not use them sends none back); -1: the last.
    grad_from: int = -1

    def to_dict(self) -> dict[str, Any]:
        """Its fields, those at their defaults left out."""
        d: dict[str, Any] = {"bytes": self.bytes, "layers": list(self.layers)}
        for f in dataclasses.fields(self)[2:]:
            value = getattr(self, f.name)
            if value != f.default:
                d[f.name] = list(value) if isinstance(value, tuple) else value
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SideInput:
        return cls(int(d["bytes"]), tuple(int(i) for i in d["layers"]), int(d.get("made_by", -1)),
                   int(d.get("grad_bytes", 0)), tuple(int(i) for i in d.get("saved_by", ())),
                   tuple(int(i) for i in d.get("unrelayed", ())), int(d.get("partial_bytes", 0)),
                   tuple(int(i) for i in d.get("partial_span", ())), int(d.get("grad_from", -1)))


@dataclass(frozen=True)
class StageRecord:
    """One row of a profile: what comes before the chain, one chain layer, or what comes after.

    Windows: a stage's forward window runs from its first op to the first op of the next stage;
    its backward window from the moment the gradient of its output exists to the moment the
    gradient of its input exists (see ckplan.profiler). ``*_peak_bytes`` are measured live bytes
    relative to the start of the step (parameters, buffers, inputs and optimizer state excluded).
    """

    index: int  # -1 for pre, 0..n-1 for chain layers, n for post
    name: str  # module path of a chain layer, or "(pre)" / "(post)"
    type: str  # class name of the chain layer; "pre" / "post" otherwise
    role: str  # PRE | CHAIN | POST
    param_bytes: int  # parameters owned by this stage (each storage counted once, in its last stage)
    grad_bytes: int  # parameter-gradient bytes first allocated in this stage's backward
    output_bytes: int  # the tensors handed to the next stage (all of them): what a checkpoint at this boundary keeps
    saved_bytes: int  # saved-for-backward storages this stage allocated (rotor's xbar), params excluded
    fwd_ms: float
    bwd_ms: float
    fwd_flops: int
    bwd_flops: int
    fwd_tmp_bytes: int  # peak during the forward window above live bytes at its end
    bwd_tmp_bytes: int  # peak during the backward window above live bytes at its start
    fwd_peak_bytes: int  # peak live bytes during the forward window, relative to the step's start
    bwd_peak_bytes: int  # peak live bytes during the backward window, relative to the step's start
    # Bytes of autocast's low-precision weight copies first made in this stage's forward window;
    # autocast's cache holds them until the forward ends, whatever the plan; 0 in fp32. A stored
    # (not checkpointed) stage's saved_bytes already contains the copies its matmuls saved.
    cast_bytes: int = 0
    # Selective options measured for a chain layer (empty for pre/post, or when not measured).
    options: tuple[OptionRecord, ...] = ()

    def option(self, name: str) -> OptionRecord | None:
        return next((o for o in self.options if o.name == name), None)
    # A chain layer's forward as recomputed in the backward of a checkpoint (measured: the chain's
    # forward windows times the factor a step with every layer checkpointed showed; see
    # ckplan.profiler); None on meta, for pre/post and in a profile without it: fwd_ms is used.
    recompute_ms: float | None = None
    # Whether the plain forward keeps ``output_bytes`` until the backward: some op saved it (this
    # stage or the next; for pre, also when the chain input is the batch itself). False: nothing
    # saved it (a Linear's output read only by a ReLU, which saves its own output), so
    # ``saved_bytes`` leaves it out and only a checkpoint starting at the next layer keeps it.
    # None: not measured (a profile without it, compiled or meta passes' own rules): taken as kept.
    output_kept: bool | None = None
    # The stage returned its input's storage changed in place (ReLU(inplace=True)): its output
    # is counted where that storage was made, and a checkpoint starting at it gets a copy.
    output_in_place: bool = False
    # A chain layer whose forward changes an argument in place (``x.mul_(0.5)``): a checkpoint
    # starting at it gives it a copy too (``Plan.params["copy_inputs"]``).
    changes_input: bool = False
    # For a chain layer whose output is kept (``output_kept``) and is its own: whether an op after
    # the layer (the next stage, or the model's code before it) saved it too. False: only its own
    # ops did (a block ending with a ReLU, read next by a pooling that saves nothing), so a
    # checkpoint ending at it, which saves nothing inside, lets PyTorch free it once the next stage
    # has read it. None: not measured (a profile without it, compiled passes) or not kept: saved after.
    output_saved_after: bool | None = None
    # PyTorch's non-reentrant checkpoint stops a recompute once the last tensor its first forward
    # saved is back (early stop), so the last layer of a recompute runs only up to its last saved
    # tensor: ``early_peak_bytes`` is the forward window's peak up to that op (relative to the
    # step's start, as ``fwd_peak_bytes``), ``early_kept_bytes`` the storages this layer made and
    # saved itself (what that recompute leaves; its output is not among them when only the next
    # layer saves it). None: not measured (a profile without it, compiled passes): the whole forward.
    early_peak_bytes: int | None = None
    early_kept_bytes: int | None = None
    # A chain layer's backward runs the backward of its last ops that saved nothing (a residual
    # add, a mixture of experts' sum over its top-k copies) before it first needs a saved tensor,
    # which is when a checkpoint ending at the layer recomputes: the bytes that backward holds
    # then above its start (the output's gradient made; GPT-OSS's expanded top-k gradient, twice
    # the hidden state) stay live through that recompute. None: not measured (a profile without
    # it, compiled or meta passes): 0.
    backward_lead_bytes: int | None = None
    # A chain layer's forward window's peak above its start when no op saves anything (its
    # output included): a checkpoint's first forward, measured. Rotor's model takes it as the
    # output plus the plain forward's transient, which is short where the layer's code holds
    # tensors it also saved (GPT-OSS's experts: 1.1 MB more). None: not measured (a profile
    # without it, compiled passes): rotor's.
    nosave_peak_bytes: int | None = None
    # What the layer's forward leaves alive when no op saves anything (the no-save pass), beyond
    # its output: tensors a custom autograd Function keeps as ``ctx`` attributes (not through
    # ``save_for_backward``), a cache on the module. A checkpoint's first forward keeps them too
    # (its graph node holds them until the step's graph is freed). None: not measured: 0.
    unsaved_kept_bytes: int | None = None
    # What the layer's forward made that is still alive when the whole backward is over (the
    # graph alive): the part of its saved or ctx-held tensors its own backward does not free.
    # None: not measured: 0.
    kept_after_backward_bytes: int | None = None
    # What the layer's recompute (the layer alone in a checkpoint) made that is still alive when
    # the backward is over: a tensor of its forward kept on the module holds the recompute's, and
    # the recompute's graph behind it, until the layer's next forward. None: not measured: 0.
    recompute_kept_bytes: int | None = None
    # The same with the whole chain in one checkpoint: what the layer's recompute leaves when a
    # later layer of its checkpoint keeps the recompute's graph (it reaches back through this
    # layer). Measured only when some layer's recompute_kept_bytes is not 0. None: 0.
    recompute_chain_kept_bytes: int | None = None
    # Gradients of a tensor an earlier stage's forward also used, whose shares autograd sums
    # before they go on: that sum appears in this stage's backward and is held until the backward
    # of the first user, where its bytes count in ``shared_grad_done_bytes``. An autocast copy
    # several stages read (a block the layers share, in bf16), and with gradient accumulation a
    # parameter several stages use (an embedding tied to the head in post; without accumulation
    # the sum becomes ``.grad``, in ``grad_bytes``). 0 in a profile without it.
    shared_grad_bytes: int = 0
    shared_grad_done_bytes: int = 0
    # Of cast_bytes, the copies no op saved (a bias, a weight whose input needs no gradient):
    # autocast's cache holds them until the forward ends, also when the stage is stored. 0 in a
    # profile without it.
    unsaved_cast_bytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["options"] = [o.to_dict() for o in self.options]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StageRecord:
        d = dict(d)
        d["options"] = tuple(OptionRecord(**o) for o in d.get("options", ()))
        return cls(**d)


@dataclass(frozen=True)
class Totals:
    param_bytes: int  # every parameter, trainable or not
    buffer_bytes: int
    trainable_bytes: int  # parameters that get a gradient
    grad_bytes: int  # gradients of trainable parameters
    optimizer_bytes: int  # optimizer state (Adam moments, momentum buffers)
    optimizer_tmp_bytes: int  # transient extra during optimizer.step()
    input_bytes: int  # the batch (inputs and labels)
    activation_bytes: int  # sum of saved_bytes over all rows
    predicted_peak_bytes: int  # one training step without checkpointing (README: memory model)
    measured_peak_bytes: int | None  # forward+backward peak seen (plus params, buffers, inputs, optimizer state)
    # One optimizer.step(), timed on stand-ins (ckplan.training.optimizer_step_ms); on meta priced by
    # the target's device model; None on meta without one, and in a profile without it (then 0 in the predicted
    # step time).
    optimizer_ms: float | None = None
    # Scalar optimizer state (AdamW's step counters, 0-dim, one per parameter), counted in
    # optimizer_bytes: it is not sharded with the parameters (planner.parallel). 0 in a profile without it.
    optimizer_scalar_bytes: int = 0
    # Device memory the runtime holds outside any tensor while training, part of every step's peak:
    # on CUDA the caching allocator's blocks that no parameter, buffer, gradient or input owns once
    # a step has run (cuBLAS/cuBLASLt workspaces, one per handle and stream: 64 MiB on an H200 with
    # torch 2.11). 0 on CPU and meta, and in a profile without it.
    runtime_bytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Profile:
    """Per-stage costs of one training step of one model at one batch, the planner's input."""

    model: str  # a short name: spec file stem or class name
    device: str  # "cpu", "cuda", "meta"
    device_name: str  # e.g. "NVIDIA H100 80GB HBM3" or the CPU's name
    chain: str  # dotted path of the checkpointable ModuleList/Sequential
    chain_detected: bool  # True when ckplan chose the chain itself
    batch_size: int
    precision: str  # fp32 | bf16 | fp16
    optimizer: str  # adamw | sgd-momentum | sgd
    accum: int  # gradient-accumulation micro-batches per optimizer step
    input_requires_grad: bool  # the chain's input needs a gradient (pre has parameters)
    times_estimated: bool  # True on meta: times come from FLOPs, not clocks
    layers: tuple[StageRecord, ...]  # pre, chain layers in order, post
    totals: Totals
    device_total_bytes: int | None = None  # NVML / CUDA total memory when known
    device_free_bytes: int | None = None
    notes: tuple[str, ...] = ()
    spec: dict[str, Any] = field(default_factory=dict)  # the resolved spec, to rebuild the model
    # The chain layers were profiled compiled (ckplan.compiled): plans are for compiled layers.
    compiled: bool = False
    # Tensors passed to chain layers that a checkpoint keeps alive (SideInput); () in a profile without them.
    side_inputs: tuple[SideInput, ...] = ()
    # Chain layers b that did not receive layer b-1's output as an argument (the model changed it
    # between the calls): no checkpoint can span layers b-1 and b; () in a profile without them.
    chain_breaks: tuple[int, ...] = ()
    # aten ops whose FLOPs torch's counter could not count (ckplan's formula counted them, or
    # nothing did; the notes say which): FLOPs are estimates, sizes and CPU/CUDA times measured.
    flops_estimated: tuple[str, ...] = ()
    # Pinned host copy bandwidths, bytes/s (device -> host, host -> device), for activation offload;
    # 0: none (a CPU, meta without a GPU target, a profile without them).
    host_bw: tuple[float, float] = (0.0, 0.0)
    # FSDP2's MixedPrecisionPolicy param dtype (bf16, fp16) the step ran in (ckplan.param_dtype):
    # its parameters and gradients are in it; per rank the shards, optimizer state and the
    # reduce-scatter are fp32 (planner.parallel). None: parameters in their own dtype.
    param_dtype: str | None = None
    # That policy's reduce dtype (fp32, or the param dtype): the reduce-scatter's buffers per rank.
    # None: fp32 (or no policy).
    reduce_dtype: str | None = None
    schema_version: int = SCHEMA_VERSION

    @property
    def chain_layers(self) -> tuple[StageRecord, ...]:
        return tuple(r for r in self.layers if r.role == CHAIN)

    @property
    def option_names(self) -> tuple[str, ...]:
        """The selective options measured for the chain layers, in the order measured."""
        return tuple(dict.fromkeys(o.name for r in self.chain_layers for o in r.options))

    @property
    def pre(self) -> StageRecord:
        return self.layers[0]

    @property
    def post(self) -> StageRecord:
        return self.layers[-1]

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["layers"] = [r.to_dict() for r in self.layers]
        d["notes"] = list(self.notes)
        d["side_inputs"] = [si.to_dict() for si in self.side_inputs]
        d["chain_breaks"] = list(self.chain_breaks)
        d["flops_estimated"] = list(self.flops_estimated)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Profile:
        d = dict(d)
        d.pop("command", None)
        version = d.get("schema_version", SCHEMA_VERSION)
        if version != SCHEMA_VERSION:
            raise ValueError(f"profile schema_version {version} is not {SCHEMA_VERSION}")
        names = {f.name for f in dataclasses.fields(cls)}
        d = {k: v for k, v in d.items() if k in names}
        d["layers"] = tuple(StageRecord.from_dict(r) for r in d["layers"])
        d["totals"] = Totals(**d["totals"])
        d["notes"] = tuple(d.get("notes", ()))
        d["side_inputs"] = tuple(SideInput.from_dict(si) for si in d.get("side_inputs", ()))
        d["chain_breaks"] = tuple(int(b) for b in d.get("chain_breaks", ()))
        d["flops_estimated"] = tuple(str(op) for op in d.get("flops_estimated", ()))
        d["host_bw"] = tuple(float(v) for v in d.get("host_bw", (0.0, 0.0)))
        return cls(**d)
