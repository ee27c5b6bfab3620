"""PlanExecutor: a plan installed on a model's chain layers, its first forward (segments of
frames over the model's own layer calls) and its recompute (the recorded calls replayed)."""
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
from torch.utils.checkpoint import checkpoint

from ..chainfind import tensor_leaves
from ..errors import ModelRunError, SpecError
from ..planner.plan import OFFLOAD, STORE, Checkpoint, Item, Plan, Store
from ..planner.plan_items import is_offloaded, kept_option
from ..recompute import buffer_changes_noted, recompute_keeping_stats, recompute_state_kept
from ..sac import MINCUT, OFFLOAD_OPTIONS, check_option, compiled_only, run_with_option, sac_contexts
from .calls import (
    _Call,
    _compiled,
    _drop,
    _dropped,
    _entry_links,
    _Frame,
    _refuse_kv_cache,
    _Segment,
    _with_copies,
    in_place_layer,
    input_versions,
    refuse_changed_input,
)
from .frames import _CAN_SPAN, _checkpoint_hook, _early_stop, _metadata_fn, _new_frame, _save_inputs
from .offload import PlanOffload
from .probe import probe

_ATTR = "_ckplan_executor"

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
            _PROBED = probe(PlanExecutor)
        except Exception:  # a frame API this code does not know: fall back, never crash a step
            _PROBED = False
    return _PROBED


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
        # layers that change their input in place: a copy of it where a checkpoint starts at them
        self._copy = frozenset(int(i) for i in plan.params.get("copy_inputs", ()))
        for name in set(self._option) - {STORE, OFFLOAD}:
            check_option(kept_option(name))  # an unknown option fails here, before any layer is touched
            if is_offloaded(name) and not OFFLOAD_OPTIONS:
                raise SpecError(f"the plan stores a layer with {name!r}: what a selective option keeps "
                                f"reaches saved-tensor hooks only from torch 2.14 on (this is {torch.__version__})",
                                tip=f"re-plan with this torch (ckplan then gives such layers "
                                    f"{kept_option(name)!r} or 'offload'), or upgrade torch")
        releases = plan.releases()
        self._offload = PlanOffload(releases, plan.fetches(), len(layers)) if releases else None
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
        if self._offload is None or getattr(self._tls, "replaying", False) or not torch.is_grad_enabled():
            return self._run_layer(i, args, kwargs)
        out = self._run_layer(i, args, kwargs)
        self._offload.forward_done(i, out)
        return out

    def _run_layer(self, i: int, args: tuple, kwargs: dict):
        orig, path = self._orig[i], self._path[i]
        if getattr(self._tls, "replaying", False) or not torch.is_grad_enabled():
            # A compiled layer replayed with its option set by _call_module; otherwise store: as is.
            return run_with_option(orig, getattr(self._tls, "option", STORE), *args, **kwargs)
        if not path and is_offloaded(self._option[i]):  # stored at the top level, offloaded
            assert self._offload is not None
            return self._offload.run(i, orig, args, kwargs, kept_option(self._option[i]))
        if not path:  # stored at the top level, with its option
            return run_with_option(orig, self._option[i], *args, **kwargs)
        if not spans_layers():
            before = input_versions(args, kwargs)
            out = checkpoint(recompute_keeping_stats(orig), *args, use_reentrant=False, preserve_rng_state=True,
                             **kwargs)
            refuse_changed_input(i, before)
            return out
        _refuse_kv_cache(i, args, kwargs)
        tls = self._tls
        seg, (links, inputs) = self._segment_at(i, path, args, kwargs)
        starting = self._open_frames(seg, i, path, inputs)
        seg.calls[i] = _Call(args, kwargs, links)
        before = input_versions(args, kwargs) if starting else []  # the originals: the copies may change
        if starting and self._copies(i):
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
            with hook, buffer_changes_noted(self.layers[i]):
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
        try:
            refuse_changed_input(i, before)
        except ModelRunError:
            tls.seg = None
            seg.close()
            raise
        seg.last = i
        while seg.open and seg.open[-1].item.stop == i + 1:
            seg.open.pop().frame.forward_completed = True
        if seg.open:
            seg.prev = [(weakref.ref(t), t._version) for t in tensor_leaves(out)]
        else:  # the segment is done; keep nothing of it
            tls.seg = None
        return out

    def _segment_at(self, i: int, path: tuple[Checkpoint, ...], args: tuple, kwargs: dict):
        """The segment layer ``i`` runs in (the current one, or a new one when a top-level
        checkpoint starts here) and where its hidden state is in this call's arguments."""
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
            return seg, found
        if seg is not None:
            seg.close()
        seg = tls.seg = _Segment(path[0])
        return seg, _entry_links(args, kwargs)

    def _open_frames(self, seg: _Segment, i: int, path: tuple[Checkpoint, ...], inputs: list[torch.Tensor]):
        """Leave the frames that end before layer ``i`` (the model skipped their last layers) and
        open the checkpoints that start here; a frame's input is saved to its parent frame.
        Returns the checkpoints opened."""
        while seg.open and not (seg.open[-1].item.start <= i < seg.open[-1].item.stop):
            seg.open.pop().frame.forward_completed = True
        starting = path[len(seg.open):]
        for item in starting:
            frame = _new_frame(functools.partial(self._recompute, seg.calls, item.inner), _early_stop(),
                               _metadata_fn)
            with seg.open[-1].hook if seg.open else contextlib.nullcontext():
                _save_inputs(frame, inputs)
            seg.open.append(_Frame(item, frame, _checkpoint_hook(frame)))
        return starting

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
                if at_start and self._copies(j):  # the recompute's saved input
                    inputs = [t.clone() for t in inputs]
                out = calls[j].replay(functools.partial(self._call_module, j), inputs)
            else:
                out = checkpoint(functools.partial(self._recompute, calls, item.inner), *inputs,
                                 use_reentrant=False, preserve_rng_state=False)
        return out

    def _copies(self, i: int) -> bool:
        """Whether a checkpoint starting at layer ``i`` gives it a copy of its input: a layer built
        to change it in place (``inplace=True``), or one the plan names (``params["copy_inputs"]``)."""
        return i in self._copy or in_place_layer(self.layers[i])

    def _option_fill(self, calls: dict[int, _Call], j: int, option: str,
                     inputs: list[torch.Tensor]):
        """In a parent's recompute: run layer ``j`` under its option's SAC forward context, which
        keeps the saved ops' outputs (and nothing else: autograd's saved tensors are dropped,
        the layer's own frame recomputes them in its backward), then save its input to the
        parent as the first forward did. Saving after the run lets the parent stop early."""
        fwd_ctx, rec_ctx = sac_contexts(option)
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
            fwd_ctx, rec_ctx = sac_contexts(self._option[j])
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
            with recompute_state_kept(self.layers[j]):
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

