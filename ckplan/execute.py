"""Apply any Plan (nested checkpoints included) to a model's chain with torch's checkpointing.

How: each chain layer's ``forward`` is replaced by an instance attribute (a small picklable
object; state_dict keys, hooks and the module tree stay as they are; ``remove()`` restores the
originals). The model's own forward still calls every layer itself, with its own arguments.

* ``Store(i)`` layers run as before; with a selective option (``Store(i, "sac-compute")``) the
  layer runs inside one checkpoint with that option's SAC policy (:mod:`ckplan.sac`), in the
  first forward when it is stored at the top level, in its checkpoint's recompute otherwise.
* A top-level ``Checkpoint(s, t)`` spans the model's calls of layers s..t-1 with one
  non-reentrant checkpoint frame (torch.utils.checkpoint's ``_CheckpointFrame`` and
  ``_checkpoint_hook``). Its saved-tensor hook is active only *inside* those layer calls, so the
  tensors the layers save are dropped and the model's own code between two calls saves as usual.
  Each call is recorded: its arguments and keywords with the hidden-state tensors left out (so
  the record keeps no intermediate activation alive; masks, position embeddings and per-layer
  arguments are kept), the RNG state and the autocast state. During backward the frame's
  recompute replays the recorded calls from the segment's saved input, each layer with its own
  arguments, RNG and autocast state, following the checkpoint's ``inner`` plan: nested
  checkpoints are nested frames in the first forward and nested
  ``torch.utils.checkpoint.checkpoint`` calls in the recompute, so a saved tensor of an inner
  checkpoint belongs to the innermost frame and an inner checkpoint's input is saved to its
  parent (torch's rules for nested checkpoints). Memory is what the planner models: a checkpoint
  keeps its input and its last output, nothing per layer.
* The hidden state of layer j+1 is found by identity: the tensor in its arguments (positional
  or keyword, inside tuples, lists and dicts too, as ``torch.utils._pytree`` flattens them) that
  *is* a tensor layer j returned. Several such tensors (a hidden state and a residual stream, a
  dict of them) are all carried; the recorded call is rebuilt around them in the recompute. For
  the first layer of a segment it is the first positional tensor, else ``hidden_states=``, else
  the first tensor in the arguments.

Known limits:

* A model that changes the hidden state between two layers of one segment (``x = layer(x) *
  0.5``, ``h = h + layer(h)``, a skip connection added, or in place) is refused with
  ModelRunError: spanning it would keep every changed tensor. Checkpoints of one layer each
  always work, and ckplan's own plans never span such a boundary: the profile finds them
  (``Profile.chain_breaks``) and every strategy cuts its checkpoints there.
* A Hugging Face key/value cache passed to a checkpointed layer is refused (ModelRunError):
  the recompute would append to it twice. Training wants ``use_cache: false``.
* A checkpoint keeps the tensors its layers receive besides the hidden state (masks, position
  ids) until its backward, as ``torch.utils.checkpoint`` keeps its arguments. When no op of the
  plain step saves them they add their bytes to the plan's peak, which the profile does not
  model (4.5 KiB, a bool sliding-window mask and ``position_ids``, on configs/hf-qwen2-alt.yaml).
* A layer called with an intermediate activation that is not the previous layer's output (a
  skip connection over several layers) runs correctly, but the record keeps that tensor alive
  until backward, which the planner does not model.
* A layer built to change its input in place (``inplace=True``: torchvision's ``ReLU``) gets a
  copy of its hidden-state input when a checkpoint starts at it (its first forward and the start
  of its recompute): changing the tensor a checkpoint saved would make PyTorch refuse the
  backward. Elsewhere it runs in place, as measured (``Layer.in_place`` in the planner).
* Each recorded call holds a copy of the CPU RNG state (5 KB of host memory, plus the device
  RNG states when a GPU is in use) until the segment's backward.
* The recompute calls each layer's original ``forward`` directly: forward (pre-)hooks registered
  on the chain layers themselves run in the first forward only (hooks on their submodules run in
  both, as with torch's checkpoint).
* The frame machinery is a private part of torch (two versions of it, torch 2.5 to 2.14, are
  known). Where it is missing or fails a probe (``spans_layers``), profiles mark every layer a
  chain break, so plans made there use one-layer checkpoints and predict their peaks; a plan with
  multi-layer checkpoints made elsewhere runs each layer of a segment as its own checkpoint, with
  a warning: the math is the same, the memory is that of one-layer checkpoints.
* ``copy.deepcopy`` and pickling (``torch.save(model)``) keep the plan: the copy carries its
  own executor bound to the copy's layers (loading it needs ckplan importable). Call
  ``remove_plan(model)`` first for a plain copy. ``state_dict`` is unchanged by a plan.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import threading
import types
import warnings
import weakref
from typing import Any

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from .chainfind import resolve_chain, tensor_leaves
from .errors import ModelRunError, SpecError
from .planner.plan import STORE, Checkpoint, Item, Plan, Store
from .recompute import running_stats_kept
from .sac import MINCUT, check_option, compiled_only, policy_fn, run_with_option

_ATTR = "_ckplan_executor"

try:  # torch's non-reentrant checkpoint internals (torch 2.4 .. 2.13: two ways to save inputs)
    from torch.utils import checkpoint as _tc
    _CheckpointFrame = _tc._CheckpointFrame
    _checkpoint_hook = _tc._checkpoint_hook
    _metadata_fn = _tc._allowed_determinism_checks_to_fns[_tc._DEFAULT_DETERMINISM_MODE]
    _infer_device_type = _tc._infer_device_type
    _get_device_module = _tc._get_device_module
    _get_autocast_kwargs = _tc._get_autocast_kwargs
    # torch >= 2.12: frame.save_inputs / get_inputs. Older: the frame's input_saver, the output of
    # _NoopSaveInputs.apply(dummy, kwargs, *args), whose recompute gets (kwargs, *args).
    _SAVES_INPUTS = hasattr(_CheckpointFrame, "save_inputs") and hasattr(_CheckpointFrame, "get_inputs")
    _CAN_SPAN = _SAVES_INPUTS or hasattr(_tc, "_NoopSaveInputs")
except (ImportError, AttributeError, KeyError):  # pragma: no cover - depends on the torch version
    _SAVES_INPUTS = _CAN_SPAN = False


_PROBED: bool | None = None  # spans_layers()'s probe: None before it ran


def spans_layers() -> bool:
    """Whether checkpoints can span several layers on this torch: its private frame API is there
    and a probe (two tiny layers in one segment, recomputed in the backward) gives the plain
    gradients. Without it every checkpoint is one layer: the profile marks every layer a chain
    break (so plans and their predicted peaks are one-layer checkpoints) and the executor
    checkpoints each layer of a multi-layer segment on its own, with a warning."""
    global _PROBED
    if not _CAN_SPAN:
        return False
    if _PROBED is None:
        _PROBED = True  # the probe itself runs a spanning segment
        try:
            _PROBED = _probe()
        except Exception:  # a frame API this code does not know: fall back, never crash a step
            _PROBED = False
    return _PROBED


class _ProbeLayer(nn.Module):
    def __init__(self, g: torch.Generator) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4, generator=g))
        self.calls = 0

    def forward(self, h):
        self.calls += 1
        return torch.tanh(h @ self.weight)


class _Probe(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)  # leaves the global RNG alone
        self.layers = nn.ModuleList(_ProbeLayer(g) for _ in range(2))
        self.x = torch.randn(3, 4, generator=g)

    def forward(self):
        h = self.x
        for layer in self.layers:
            h = layer(h)
        return h.square().sum()


def _probe() -> bool:
    model = _Probe()
    with torch.enable_grad():
        model().backward()
        plain = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        plan = Plan("probe", 2, (Checkpoint(0, 2, (Store(0), Store(1))),))
        executor = PlanExecutor(model, list(model.layers), plan, "layers")
        try:
            model().backward()
        finally:
            executor.remove()
    return all(layer.calls == 3 for layer in model.layers) and all(p.grad is not None and torch.equal(p.grad, g)
                                    for p, g in zip(model.parameters(), plain))


def _new_frame(recompute, early_stop: bool, metadata_fn=None):
    """A torch checkpoint frame whose recompute is called with the inputs :func:`_save_inputs`
    saved to it, whichever way this torch saves a frame's inputs."""
    if _SAVES_INPUTS or recompute is None:
        return _CheckpointFrame(recompute, early_stop, None, metadata_fn)
    return _CheckpointFrame(functools.partial(_without_kwargs, recompute), early_stop, None, metadata_fn)


def _without_kwargs(recompute, _kwargs, *inputs):
    return recompute(*inputs)


def _save_inputs(frame, inputs) -> None:
    """Save ``inputs`` to ``frame`` as torch's own checkpoint does (through the saved-tensor hooks
    active now: a parent checkpoint's, when nested)."""
    if _SAVES_INPUTS:
        frame.save_inputs(*inputs)
    else:
        dummy = torch.empty((0,), requires_grad=True)
        frame.input_saver = _tc._NoopSaveInputs.apply(dummy, None, *inputs)


def _early_stop() -> bool:
    flag = getattr(_tc, "_enable_checkpoint_early_stop", None)
    return True if flag is None else flag


def _flat(args: tuple, kwargs: dict) -> tuple[list, Any]:
    """The leaves of a call's arguments (tensors inside tuples, lists and dicts included, as
    ``torch.utils._pytree`` flattens them) and how to rebuild them: a slot is a leaf index."""
    return tree_flatten((tuple(args), dict(kwargs)))


def _rebuild(leaves: list, spec) -> tuple[tuple, dict]:
    a, k = tree_unflatten(leaves, spec)
    return tuple(a), dict(k)


class _Call:
    """One layer call inside a checkpointed segment, as the first forward made it.

    ``slots`` (leaf indices of the flattened arguments, :func:`_flat`) held the tensors carried
    from the previous layer; they are blanked here so the record never keeps an intermediate
    activation alive. ``leaves`` says which tensor of the previous layer's output went into each
    slot.
    """

    __slots__ = ("autocast", "cpu_rng", "device_rng", "device_type", "devices", "flat", "leaves",
                 "sac", "slots", "spec")

    def __init__(self, args: tuple, kwargs: dict, links: list[tuple[int, int]]):
        flat, self.spec = _flat(args, kwargs)
        for slot, _ in links:
            flat[slot] = None
        self.flat = flat
        self.slots = tuple(s for s, _ in links)
        self.leaves = tuple(li for _, li in links)
        # RNG and autocast as torch.utils.checkpoint stashes them, but per layer call.
        self.device_type = _infer_device_type(args, kwargs)
        self.cpu_rng = torch.get_rng_state()
        if getattr(_get_device_module(self.device_type), "_initialized", False):
            self.devices, self.device_rng = _tc.get_device_states(args, kwargs)
        else:
            self.devices, self.device_rng = [], []
        self.autocast = _get_autocast_kwargs(self.device_type)
        self.sac = None  # a selective option's recompute context, filled by its parent's recompute

    def replay(self, forward, inputs: list[torch.Tensor]):
        flat = list(self.flat)
        for slot, value in zip(self.slots, inputs):
            flat[slot] = value
        a, k = _rebuild(flat, self.spec)
        torch.set_rng_state(self.cpu_rng)
        if self.devices:
            _tc.set_device_states(self.devices, self.device_rng, device_type=self.device_type)
        dev_kw, cpu_kw = self.autocast
        dev_ctx = (torch.amp.autocast(device_type=self.device_type, **dev_kw)
                   if dev_kw is not None else contextlib.nullcontext())
        with dev_ctx, torch.amp.autocast("cpu", **cpu_kw):
            return forward(*a, **k)


class _Frame:
    """An open checkpoint of the first forward: torch's frame and its saved-tensor hook."""

    __slots__ = ("frame", "hook", "item")

    def __init__(self, item: Checkpoint, frame, hook):
        self.item, self.frame, self.hook = item, frame, hook


class _Segment:
    """The state of one top-level checkpoint while the model's forward runs through it."""

    def __init__(self, top: Checkpoint):
        self.top = top
        self.calls: dict[int, _Call] = {}
        self.open: list[_Frame] = []  # the frames enclosing the current layer, outermost first
        self.last = -1  # the last layer called
        self.prev: list[tuple[weakref.ref, int]] = []  # the last output's tensors (weak) and versions

    def link(self, args: tuple, kwargs: dict) -> tuple[list[tuple[int, int]], list[torch.Tensor]] | None:
        """Where the previous layer's output went in this call (leaf indices of :func:`_flat`);
        None if it is not there unchanged."""
        links, inputs = [], []
        prev = [(ref(), ver) for ref, ver in self.prev]
        for slot, value in enumerate(_flat(args, kwargs)[0]):
            if not isinstance(value, torch.Tensor):
                continue
            for li, (t, ver) in enumerate(prev):
                if t is value or _alias(t, value):
                    if t._version != ver:  # changed in place between the two layers
                        return None
                    links.append((slot, li))
                    inputs.append(value)
                    break
        return (links, inputs) if links else None

    def close(self) -> None:
        for f in self.open:
            f.frame.forward_completed = True
        self.open.clear()


def _drop(t: torch.Tensor) -> None:
    return None


def _dropped(_: None) -> None:  # pragma: no cover - the filled graph is never backwarded
    raise RuntimeError("ckplan: a selective option's cache-filling pass was backwarded")


def _alias(t: torch.Tensor | None, value: torch.Tensor) -> bool:
    """``value`` is a view of ``t`` over exactly the same elements: what a module's pre-forward
    hook hands on when it passes inputs through an autograd function (FSDP2 does)."""
    return (t is not None and value.data_ptr() == t.data_ptr() and value.shape == t.shape
            and value.stride() == t.stride() and value.dtype == t.dtype and value._base is not None
            and value.untyped_storage().data_ptr() == t.untyped_storage().data_ptr())


def _entry_links(args: tuple, kwargs: dict) -> tuple[list[tuple[int, int]], list[torch.Tensor]]:
    """The hidden state of a segment's first layer (a leaf index of :func:`_flat`): args[0],
    else ``hidden_states=``, else the first tensor in the arguments (inside a tuple or dict too).
    (Any choice gives the same math; it decides what the frame saves.)"""
    flat = _flat(args, kwargs)[0]
    hidden = kwargs.get("hidden_states")
    want = (args[0] if args and isinstance(args[0], torch.Tensor) else
            hidden if isinstance(hidden, torch.Tensor) else None)
    for slot, value in enumerate(flat):
        if isinstance(value, torch.Tensor) and (want is None or value is want):
            return [(slot, 0)], [value]
    return [], []


def _in_place(layer: nn.Module) -> bool:
    """A layer built to change its input in place (``nn.ReLU(inplace=True)`` and the like)."""
    return getattr(layer, "inplace", False) is True


def _with_copies(args: tuple, kwargs: dict, links: list[tuple[int, int]]) -> tuple[tuple, dict]:
    """``args``/``kwargs`` with the hidden-state tensors (``links``' slots) copied: inside a
    checkpoint, a layer that changes its input in place would change the tensor the checkpoint
    saved (its input, or an enclosing one's), which PyTorch then refuses to recompute from. The
    copy is what the layer changes and returns, a new output as the planner models one."""
    flat, spec = _flat(args, kwargs)
    for slot, _ in links:
        flat[slot] = flat[slot].clone()
    return _rebuild(flat, spec)


def _compiled(forward) -> bool:
    """Whether ``forward`` is a compiled chain layer's (ckplan.compiled), its options compiled in."""
    return getattr(forward, "with_option", None) is not None


def _refuse_kv_cache(i: int, args: tuple, kwargs: dict) -> None:
    """A Hugging Face key/value cache would be appended to again by the recompute (a wrong-size
    error deep inside attention at best), so say what to change before anything runs."""
    for value in [*args, *kwargs.values()]:
        if any(c.__name__ == "Cache" and c.__module__.startswith("transformers")
               for c in type(value).__mro__):
            raise ModelRunError(
                f"chain layer {i} got a key/value cache ({type(value).__name__}); a checkpointed layer "
                "runs twice and would append to it twice",
                tip="turn the cache off for training: `use_cache: false` in the spec's hf: fields, "
                    "or model.config.use_cache = False")


def _enclosing(items: tuple[Item, ...], outer: tuple[Checkpoint, ...], path: dict[int, tuple]) -> None:
    for it in items:
        if isinstance(it, Store):
            path[it.layer] = outer
        else:
            _enclosing(it.inner, (*outer, it), path)


class _PlannedForward:
    """The ``forward`` installed on a chain layer. A plain object (not a closure) so that
    ``copy.deepcopy`` rebinds it to the copy's executor and ``pickle`` can store it."""

    def __init__(self, executor: PlanExecutor, index: int):
        self.executor, self.index = executor, index

    def __call__(self, *args, **kwargs):
        return self.executor._run(self.index, args, kwargs)

    @property
    def __signature__(self) -> inspect.Signature:  # what inspect.signature(layer.forward) shows
        return inspect.signature(self.executor._orig[self.index])

    def __repr__(self) -> str:
        return f"<ckplan planned forward of layer {self.index}>"


class PlanExecutor:
    """The installed plan; ``remove()`` (or leaving the ``with`` block) restores the layers."""

    def __init__(self, model: nn.Module, layers: list[nn.Module], plan: Plan, chain_path: str):
        if plan.n_layers != len(layers):
            raise SpecError(f"the plan is for {plan.n_layers} layers but chain {chain_path!r} has {len(layers)}",
                            tip="make the plan for this model (same spec, same chain)")
        self.model, self.layers, self.plan, self.chain_path = model, layers, plan, chain_path
        self._had_forward = [("forward" in layer.__dict__, layer.__dict__.get("forward")) for layer in layers]
        self._path: dict[int, tuple[Checkpoint, ...]] = {}  # checkpoints enclosing each layer
        _enclosing(plan.items, (), self._path)
        self._option = plan.options()
        for name in set(self._option) - {STORE}:
            check_option(name)  # an unknown option fails here, before any layer is touched
        self._init_transient()
        for i, name in enumerate(self._option):
            if name in MINCUT and not _compiled(self._orig[i]):
                raise compiled_only(name)
        if any(c.stop - c.start > 1 for c in self._checkpoints()) and not spans_layers():
            warnings.warn(f"torch {torch.__version__}'s checkpoint frames cannot span several layers: "
                          "ckplan checkpoints each layer of a multi-layer segment on its own (same "
                          "gradients; more memory than this plan predicts: plan on this torch, whose "
                          "plans use one-layer checkpoints)", RuntimeWarning, stacklevel=3)
        for i, layer in enumerate(layers):
            layer.forward = _PlannedForward(self, i)
        setattr(model, _ATTR, self)

    def _init_transient(self) -> None:
        self._tls = threading.local()
        self._orig = [fwd if had else types.MethodType(type(layer).forward, layer)
                      for layer, (had, fwd) in zip(self.layers, self._had_forward)]

    def _checkpoints(self):
        return (it for it, _ in self.plan.walk() if isinstance(it, Checkpoint))

    # ---- copy and pickle: the copy carries its own executor, bound to its own layers --------
    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        del state["_tls"], state["_orig"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_transient()

    # ---- the first forward ----------------------------------------------------------------
    def _run(self, i: int, args: tuple, kwargs: dict):
        orig, path = self._orig[i], self._path[i]
        if getattr(self._tls, "replaying", False) or not torch.is_grad_enabled():
            # A compiled layer replayed with its option set by _call_module; otherwise store: as is.
            return run_with_option(orig, getattr(self._tls, "option", STORE), *args, **kwargs)
        if not path:  # stored at the top level, with its option
            return run_with_option(orig, self._option[i], *args, **kwargs)
        if not spans_layers():
            return checkpoint(orig, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)
        _refuse_kv_cache(i, args, kwargs)
        tls = self._tls
        seg: _Segment | None = getattr(tls, "seg", None)
        if seg is not None and seg.top is path[0] and i > seg.last:
            found = seg.link(args, kwargs)
            if found is None:
                tls.seg = None
                seg.close()
                raise ModelRunError(
                    f"layer {i} of {self.chain_path!r} did not receive the output of layer {seg.last} "
                    "unchanged (the model changes the hidden state between layers), so a multi-layer "
                    "checkpoint cannot span it",
                    tip="re-plan with ckplan from a profile of this model (its plans are cut at such "
                        "layers), or use checkpoints of one layer each (--strategy every-k --k 1)")
        else:
            if seg is not None:
                seg.close()
            seg = tls.seg = _Segment(path[0])
            found = _entry_links(args, kwargs)
        links, inputs = found
        # Leave the frames that end before layer i (the model skipped their last layers) and
        # open the checkpoints that start here; a frame's input is saved to its parent frame.
        while seg.open and not (seg.open[-1].item.start <= i < seg.open[-1].item.stop):
            seg.open.pop().frame.forward_completed = True
        starting = path[len(seg.open):]
        for item in starting:
            frame = _new_frame(functools.partial(self._recompute, seg.calls, item.inner), _early_stop(),
                               _metadata_fn)
            with seg.open[-1].hook if seg.open else contextlib.nullcontext():
                _save_inputs(frame, inputs)
            seg.open.append(_Frame(item, frame, _checkpoint_hook(frame)))
        seg.calls[i] = _Call(args, kwargs, links)
        if starting and _in_place(self.layers[i]):
            args, kwargs = _with_copies(args, kwargs, links)
        hook, own = seg.open[-1].hook, None
        if self._option[i] != STORE and not _compiled(orig):
            # Stored with a selective option inside a checkpoint: its own frame, as a nested
            # checkpoint of one layer (its input saved to the parent), whose recompute runs the
            # option's SAC recompute from the cache its parent's recompute fills (_replay).
            own = _new_frame(functools.partial(self._option_recompute, seg.calls, i), _early_stop(), _metadata_fn)
            with hook:
                _save_inputs(own, inputs)
            hook = _checkpoint_hook(own)
        try:
            with hook:
                # Without a frame of its own: stored, or a compiled layer with its option compiled in.
                if own is not None:
                    out = orig(*args, **kwargs)
                else:
                    out = run_with_option(orig, self._option[i], *args, **kwargs)
        except BaseException:
            tls.seg = None
            seg.close()
            raise
        finally:
            if own is not None:
                own.forward_completed = True
        seg.last = i
        while seg.open and seg.open[-1].item.stop == i + 1:
            seg.open.pop().frame.forward_completed = True
        if seg.open:
            seg.prev = [(weakref.ref(t), t._version) for t in tensor_leaves(out)]
        else:  # the segment is done; keep nothing of it
            tls.seg = None
        return out

    # ---- the recompute (called by torch during backward) ------------------------------------
    def _recompute(self, calls: dict[int, _Call], items: tuple[Item, ...], *inputs: torch.Tensor):
        recorded = list(calls.values())
        devices = sorted({d for c in recorded for d in c.devices})
        device_type = recorded[0].device_type if recorded else None
        with torch.random.fork_rng(devices=devices, device_type=device_type):
            return self._replay(calls, items, list(inputs))

    def _replay(self, calls: dict[int, _Call], items: tuple[Item, ...], inputs: list[torch.Tensor]):
        """Run ``items`` from the recorded calls; ``inputs`` fill the slots of the first call."""
        out, first = None, True
        for item in items:
            lo, hi = (item.layer, item.layer + 1) if isinstance(item, Store) else (item.start, item.stop)
            j = next((j for j in range(lo, hi) if j in calls), None)
            if j is None:  # the model did not call these layers in the first forward
                continue
            at_start = first
            if not first:
                leaves = tensor_leaves(out)
                inputs = [leaves[li] for li in calls[j].leaves]
            first = False
            if isinstance(item, Store) and item.option != STORE and _compiled(self._orig[j]):
                # A compiled layer: its option is compiled in (ckplan.compiled), and what its
                # compiled forward saves is what the option keeps through the parent's backward.
                out = calls[j].replay(functools.partial(self._call_module, j, _ckplan_option=item.option), inputs)
            elif isinstance(item, Store) and item.option != STORE:
                out = self._option_fill(calls, j, item.option, inputs)
            elif isinstance(item, Store):
                if at_start and _in_place(self.layers[j]):  # the recompute's saved input
                    inputs = [t.clone() for t in inputs]
                out = calls[j].replay(functools.partial(self._call_module, j), inputs)
            else:
                out = checkpoint(functools.partial(self._recompute, calls, item.inner), *inputs,
                                 use_reentrant=False, preserve_rng_state=False)
        return out

    def _option_fill(self, calls: dict[int, _Call], j: int, option: str,
                     inputs: list[torch.Tensor]):
        """In a parent's recompute: run layer ``j`` under its option's SAC forward context, which
        keeps the saved ops' outputs (and nothing else: autograd's saved tensors are dropped,
        the layer's own frame recomputes them in its backward), then save its input to the
        parent as the first forward did. Saving after the run lets the parent stop early."""
        fwd_ctx, rec_ctx = create_selective_checkpoint_contexts(policy_fn(option))
        with torch.autograd.graph.saved_tensors_hooks(_drop, _dropped), fwd_ctx:
            out = calls[j].replay(functools.partial(self._call_module, j), inputs)
        calls[j].sac = rec_ctx
        _save_inputs(_new_frame(None, False), inputs)
        return out

    def _option_recompute(self, calls: dict[int, _Call], j: int, *inputs: torch.Tensor):
        """The recompute of a layer stored with a selective option inside a checkpoint."""
        call = calls[j]
        rec_ctx, call.sac = call.sac, None
        if rec_ctx is None:  # no cache (a second backward): fill it now, then recompute
            fwd_ctx, rec_ctx = create_selective_checkpoint_contexts(policy_fn(self._option[j]))
            with torch.random.fork_rng(devices=call.devices, device_type=call.device_type), \
                    torch.autograd.graph.saved_tensors_hooks(_drop, _dropped), fwd_ctx:
                call.replay(functools.partial(self._call_module, j), list(inputs))
        with torch.random.fork_rng(devices=call.devices, device_type=call.device_type), rec_ctx:
            return call.replay(functools.partial(self._call_module, j), list(inputs))

    def _call_module(self, j: int, *args, _ckplan_option: str = STORE, **kwargs):
        """Recompute layer ``j`` through its module call, so its hooks run as in the first forward
        (FSDP2 all-gathers the layer's parameters in its pre-forward hook), its forward unplanned
        (a compiled layer stored with a selective ``_ckplan_option``: its compiled forward with it;
        the keyword is named so as not to take a keyword of the layer's own)."""
        tls = self._tls
        outer, outer_option = getattr(tls, "replaying", False), getattr(tls, "option", STORE)
        tls.replaying, tls.option = True, _ckplan_option
        try:
            with running_stats_kept(self.layers[j]):
                return self.layers[j](*args, **kwargs)
        finally:
            tls.replaying, tls.option = outer, outer_option

    def remove(self) -> None:
        seg = getattr(self._tls, "seg", None)
        if seg is not None:
            seg.close()
        self._tls.seg = None
        for layer, (had, fwd) in zip(self.layers, self._had_forward):
            if had:
                layer.forward = fwd
            else:
                layer.__dict__.pop("forward", None)
        if getattr(self.model, _ATTR, None) is self:
            delattr(self.model, _ATTR)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.remove()


def apply_plan(model: nn.Module, plan: Plan | dict | str, *, chain: str | None = None) -> PlanExecutor:
    """Checkpoint ``model``'s chain as ``plan`` says (a Plan, its dict, or a plan.json path).

    Returns the executor; call ``.remove()`` (or use it as a context manager) to undo. Applying a
    new plan replaces the previous one.
    """
    plan = _as_plan(plan)
    old = getattr(model, _ATTR, None)
    if old is not None:
        old.remove()
    path, container, _ = resolve_chain(model, chain)
    return PlanExecutor(model, list(container), plan, path)


def remove_plan(model: nn.Module) -> None:
    old = getattr(model, _ATTR, None)
    if old is not None:
        old.remove()


def _as_plan(plan) -> Plan:
    if isinstance(plan, Plan):
        return plan
    if isinstance(plan, dict):
        return Plan.from_dict(plan.get("plan", plan))
    return load_plan(plan)


def load_plan(path) -> Plan:
    """Read a plan written by ``ckplan plan -o plan.json`` (or a bare Plan.to_dict())."""
    import json
    from pathlib import Path
    p = Path(path)
    if not p.is_file():
        raise SpecError(f"plan file {str(p)!r} does not exist",
                        tip="write one with: ckplan plan SPEC --budget 12GB -o plan.json")
    try:
        doc = json.loads(p.read_text())
    except ValueError as e:
        raise SpecError(f"{p}: not JSON ({e})") from None
    return Plan.from_dict(doc.get("plan", doc) if isinstance(doc, dict) else doc)
