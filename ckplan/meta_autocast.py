"""Autocast on fake (meta) tensors, cast as the target device's autocast casts.

torch's autocast casts only tensors on its own device: a meta tensor is never eligible, so a meta
profile of a bf16 or fp16 step would keep every activation in fp32. ``AutocastOnMeta`` replays it:
a torch-function mode over the forward and the loss that casts each call's arguments as the
target's autocast would (above autograd, as autocast does, so the casts are in the graph and what
the ops save has autocast's dtypes), then runs the call as it is.

Which arguments are cast, and to what, is not transcribed from torch's op lists: it is asked of
torch's own autocast kernels once per function and argument dtypes (``_ask``). The call starts on
fake tensors of the target's device (``cuda`` or ``cpu``; FakeTensorMode, nothing allocated, no
GPU needed) under that device's autocast, every ``_to_copy`` of an argument is recorded, and the
call is stopped at its first other op; the casts the same call makes without autocast (a kernel's
own upcast) are not autocast's. Where autocast gave that first op an output dtype (``sum`` on
CUDA: fp32_set_opt_dtype), the result is cast after the call. C++ composites whose ops autocast
casts one by one (``cross_entropy`` on CUDA) are replayed op by op (``_COMPOSITES``).

As in torch, a float32 leaf that requires grad and is not a view (a parameter) cast to the low
precision is cached until the region ends (the end of the forward and loss): each weight is cast
once per forward. A checkpoint's recompute runs in a region of its own (``Step.recomputing``).

A region where the model turns autocast off on its own device (``torch.autocast(x.device.type,
enabled=False)``) pauses the replay (``on_meta_device``). Known limitations: transformers 5's
``maybe_autocast`` does nothing on meta, so its rotary embeddings' fp32 region is not seen; a
Python function torch sees whole (``F.multi_head_attention_forward``) has its arguments cast, not
what it computes inside.
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_unflatten

LOW = {"bf16": torch.bfloat16, "fp16": torch.float16}
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
# calls autocast never casts for: attribute reads, in-place ops, copies the model asks for
_PLAIN = frozenset({
    "__get__", "__set__", "__getitem__", "__setitem__", "to", "type", "float", "half", "bfloat16", "double",
    "detach", "backward", "register_hook", "requires_grad_", "size", "dim", "stride", "numel", "data_ptr",
    "untyped_storage", "element_size", "is_floating_point", "is_contiguous", "contiguous", "clone", "copy_"})

# what a kernel asks of a tensor (prim.device, sizes, strides) reaches the fake mode as ops too
_METADATA = frozenset({"sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "size", "stride", "dim",
                       "numel", "is_contiguous", "is_strides_like_format", "is_non_overlapping_and_dense"})

# ops that only rearrange an argument: what autocast casts after them is still that argument
_RESHAPES = frozenset({"clone", "_unsafe_view", "_reshape_alias", "contiguous", "expand"})


@dataclass(frozen=True)
class Rule:
    """What autocast does to one call: argument casts (flat leaf index -> dtype) and, per flat
    output leaf, the dtype the result must be cast to (None: as it comes); ``asked``: whether
    torch answered (False: the fake call failed before any cast, the call runs as it is)."""

    casts: tuple[tuple[int, torch.dtype], ...]
    outs: tuple[torch.dtype | None, ...] = ()
    asked: bool = True


_rules: dict[tuple, Rule] = {}
_local = threading.local()


def _name(func) -> str:
    return getattr(func, "__name__", "")


def _eligible(v) -> bool:
    return isinstance(v, torch.Tensor) and v.dtype in _FLOATS


def _signature(v):
    if isinstance(v, torch.Tensor):
        return ("T", v.dtype, v.device.type == "cpu")
    if isinstance(v, (torch.dtype, bool)) or v is None:
        return v
    return type(v).__name__


class _Stop(Exception):
    """Raised at the first op after autocast's casts: what the kernel computes is not needed."""


class _CastsSeen(TorchDispatchMode):
    """Records each ``_to_copy`` of an argument, or of a view or reshaped copy of one (by identity),
    and its dtype, then stops the call at the first other op, keeping the output dtype that op was
    given (``sum(..., dtype=float32)``: autocast's fp32_set_opt_dtype policy)."""

    def __init__(self, index: dict[int, int]):
        super().__init__()
        self.index, self.casts = index, {}
        self.made: list[torch.Tensor] = []
        self.first, self.hint = None, None  # the first op after the casts, and the dtype it was given

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and args and id(args[0]) in self.index:
            dtype = kwargs.get("dtype")
            if dtype is not None and dtype != args[0].dtype:
                self.casts.setdefault(self.index[id(args[0])], dtype)
            return func(*args, **kwargs)
        name = func.__name__.split(".")[0]
        if func.namespace == "prim" or name in _METADATA:  # reads, not ops
            return func(*args, **kwargs)
        if func.is_view or name in _RESHAPES:  # einsum's permutes and reshapes before its bmm
            out = func(*args, **kwargs)
            src = args[0] if args else None
            if isinstance(out, torch.Tensor) and isinstance(src, torch.Tensor) and id(src) in self.index:
                self.index[id(out)] = self.index[id(src)]
                self.made.append(out)  # alive, so its id is not another tensor's
            return out
        dtype = kwargs.get("dtype")
        self.first, self.hint = func, dtype if isinstance(dtype, torch.dtype) else None
        raise _Stop


def _fakes(mode, flat: list, kind: str) -> list:
    """Fake tensors of the flat arguments' shapes, strides and dtypes on ``kind`` (CPU scalars stay
    on the CPU), none requiring grad: the decision to cast does not depend on it, and autograd's
    device guards abort a process without CUDA."""
    out = []
    for v in flat:
        if isinstance(v, torch.Tensor):
            device = torch.device("cpu" if v.device.type == "cpu" else kind)
            meta = torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta")
            v = mode.fake_tensor_converter.from_meta_and_device(mode, meta, device)
        out.append(v)
    return out


@contextlib.contextmanager
def _quiet(kind: str, low: torch.dtype, enabled: bool):
    """No mode of the profile (its trackers and counters must not see a fake call), no grad, and
    the device's autocast on or off, its cache off; all restored after."""
    was = torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind), torch.is_autocast_cache_enabled()
    with _disable_current_modes(), torch._C.DisableTorchFunction(), torch.no_grad():
        torch.set_autocast_enabled(kind, enabled)
        torch.set_autocast_dtype(kind, low)
        torch.set_autocast_cache_enabled(False)
        try:
            yield
        finally:
            torch.set_autocast_enabled(kind, was[0])
            torch.set_autocast_dtype(kind, was[1])
            torch.set_autocast_cache_enabled(was[2])


def _seen(func, flat: list, spec, kind: str, low: torch.dtype, autocast: bool) -> _CastsSeen | None:
    """The casts of the arguments ``func`` makes on fakes of them, up to its first other op, under
    the device's autocast or without it; None when the fake call failed before any cast."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)  # outside _quiet: it may import dynamo, which needs modes
    with _quiet(kind, low, autocast):
        leaves = _fakes(mode, flat, kind)
        seen = _CastsSeen({id(v): i for i, v in enumerate(leaves) if _eligible(v)})
        with mode:
            args, kwargs = tree_unflatten(leaves, spec)
            try:
                with seen:
                    func(*args, **kwargs)
            except _Stop:
                pass
            except Exception:
                if not seen.casts:
                    return None
    return seen


def _ask(func, flat: list, spec, kind: str, low: torch.dtype) -> Rule:
    """What the device's autocast does to this call (see the module doc): the casts its kernel makes
    (those seen under autocast that the same call without it does not make: a kernel's own casts,
    as SDPA's math path upcasting bf16, are not autocast's), and where autocast gave the first op an
    output dtype the plain call would not produce (on fake CPU tensors), the cast of the result."""
    on = _seen(func, flat, spec, kind, low, True)
    if on is None:
        return Rule((), (), asked=False)
    off = _seen(func, flat, spec, kind, low, False)
    own = off.casts if off is not None else {}
    casts = {i: d for i, d in on.casts.items() if own.get(i) != d}
    rule = Rule(tuple(sorted(casts.items())))
    # autocast's fp32_set_opt_dtype: the same first op, given an output dtype the plain call is not
    if on.hint not in _FLOATS or off is None or off.first is not on.first or off.hint == on.hint:
        return rule
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with _quiet("cpu", low, False):
        leaves = _fakes(mode, flat, "cpu")
        with mode:
            leaves = [v.to(casts[i]) if i in casts else v for i, v in enumerate(leaves)]
            args, kwargs = tree_unflatten(leaves, spec)
            try:
                outs = tree_flatten(func(*args, **kwargs))[0]
            except Exception:
                return rule
    if not outs or not isinstance(outs[0], torch.Tensor) or outs[0].dtype == on.hint:
        return rule
    return Rule(rule.casts, (on.hint,) + (None,) * (len(outs) - 1))


def rule(func, args: tuple, kwargs: dict, kind: str, low: torch.dtype) -> tuple[Rule, list, object]:
    """The cached rule for this call, with the call's flat leaves and their tree spec."""
    flat, spec = tree_flatten((args, kwargs))
    key = (func, kind, low, tuple(sorted(kwargs)), tuple(_signature(v) for v in flat))
    got = _rules.get(key)
    if got is None:
        got = _rules[key] = _ask(func, flat, spec, kind, low)
    return got, flat, spec


class AutocastOnMeta(TorchFunctionMode):
    """One autocast region on meta tensors, for target device ``kind`` (cpu or cuda) and
    ``precision`` (bf16 or fp16). The functions torch could not be asked about on fake tensors
    (they ran in their arguments' precision) are collected for ``take_unasked``."""

    def __init__(self, kind: str, precision: str):
        super().__init__()
        self.kind, self.low = kind, LOW[precision]
        self.cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._depth = 0  # entered again inside a call it replays (``_COMPOSITES``)

    def __enter__(self):
        self._depth += 1
        return super().__enter__()

    def __exit__(self, *exc):
        self._depth -= 1
        if not self._depth:
            self.cache = {}  # autocast's cache of weight copies ends with its region
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _name(func)
        if getattr(_local, "off", 0) or name in _PLAIN or (name.endswith("_") and not name.startswith("__")):
            return func(*args, **kwargs)
        leaves = tree_flatten((args, kwargs))[0]
        if not any(_eligible(v) for v in leaves):
            return func(*args, **kwargs)
        replay = _COMPOSITES.get(func)
        if replay is not None and not rule(func, args, kwargs, self.kind, self.low)[0].casts:
            with self:  # the composite's own ops, each under autocast as the device runs them
                out = replay(*args, **kwargs)
            if out is not NotImplemented:
                return out
        got, flat, spec = rule(func, args, kwargs, self.kind, self.low)
        if not got.asked:
            _unasked().add(name)
        if got.casts:
            flat = list(flat)
            for i, dtype in got.casts:
                flat[i] = self._cast(flat[i], dtype)
            args, kwargs = tree_unflatten(flat, spec)
        out = func(*args, **kwargs)
        if got.outs:
            outs, out_spec = tree_flatten(out)
            outs = [o.to(d) if d is not None and isinstance(o, torch.Tensor) and o.dtype != d else o
                    for o, d in zip(outs, got.outs)]
            out = tree_unflatten(outs, out_spec)
        return out

    def _cast(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``t`` as ``dtype``; a parameter's low-precision copy once per region, as autocast caches it."""
        if t.dtype == dtype:
            return t
        if not autocast_caches(t, dtype, self.low):
            return t.to(dtype)
        hit = self.cache.get(id(t))
        if hit is None or hit[0] is not t:
            hit = self.cache[id(t)] = (t, t.to(dtype))
        return hit[1]


def autocast_caches(t: object, dtype: object, low: torch.dtype | None) -> bool:
    """Whether autocast keeps its copy of ``t`` as ``dtype`` in its cache until the region ends
    (ATen's ``cached_cast``): an fp32 leaf that requires grad (a parameter itself, not a view of
    one such as ``weight.T``) copied to the region's low precision. Other copies are ordinary
    tensors, freed when nothing holds them."""
    return (isinstance(t, torch.Tensor) and dtype == low and t.dtype == torch.float32 and t.requires_grad
            and t.is_leaf and not t._is_view())


def _cross_entropy(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
                   reduction="mean", label_smoothing=0.0):
    """aten's ``cross_entropy_loss`` for class indices without label smoothing, op by op: where the
    device's autocast has no policy for it (CUDA), its ``log_softmax`` keeps the input's dtype and
    ``nll_loss`` (fp32) casts the log-probabilities, a copy the loss keeps for its backward."""
    if (target.is_floating_point() or label_smoothing or size_average is not None or reduce is not None
            or input.dim() < 1):
        return NotImplemented
    logp = torch.log_softmax(input, 1 if input.dim() >= 2 else 0, dtype=input.dtype)
    return F.nll_loss(logp, target, weight, ignore_index=ignore_index, reduction=reduction)


# C++ composites whose ops autocast casts one by one (what the decomposition casts is not an
# argument, so ``rule`` cannot see it): replayed op by op where autocast has no policy for the
# composite itself (on the CPU ``cross_entropy_loss`` is on the fp32 list and casts its input).
_COMPOSITES = {F.cross_entropy: _cross_entropy}


@contextlib.contextmanager
def targeting(kind: str | None):
    """Meta forwards in this block replay ``kind``'s autocast (``region``); None: no replay."""
    was = getattr(_local, "kind", None)
    _local.kind = kind
    try:
        yield
    finally:
        _local.kind = was


def target_kind() -> str | None:
    """The device whose autocast meta forwards replay here (``targeting``), or None."""
    return getattr(_local, "kind", None)


def region(precision: str) -> AutocastOnMeta | contextlib.nullcontext:
    """An autocast region for a meta forward: the replay of the target's autocast inside
    ``targeting``, nothing outside it (or in fp32)."""
    kind = target_kind()
    if precision == "fp32" or kind is None:
        return contextlib.nullcontext()
    return AutocastOnMeta(kind, precision)


def on_meta_device():
    """``torch.autocast(device_type="meta", ...)`` made to run while a meta step runs (it raises:
    meta has no autocast dtype). Models pass their inputs' device type (transformers 4's rotary
    embeddings turn autocast off so, ``with torch.autocast(x.device.type, enabled=False)``); as on
    the device, ``enabled=False`` pauses the replay of the target's autocast in the block, and
    ``enabled=True`` changes nothing. Returns the undo."""
    orig = torch.autocast

    class autocast(orig):  # type: ignore[valid-type,misc]
        def __init__(self, device_type: str, *args, **kwargs):
            self._meta = device_type == "meta"
            if self._meta:
                self._off = not kwargs.get("enabled", args[1] if len(args) > 1 else True)
            else:
                super().__init__(device_type, *args, **kwargs)

        def __enter__(self):
            if not self._meta:
                return super().__enter__()
            _local.off = getattr(_local, "off", 0) + self._off
            return self

        def __exit__(self, *exc):
            if not self._meta:
                return super().__exit__(*exc)
            _local.off -= self._off
            return None

    owners = [(torch, "autocast"), (torch.amp, "autocast")]
    saved = [(owner, name, getattr(owner, name)) for owner, name in owners]
    for owner, name in owners:
        setattr(owner, name, autocast)

    def undo() -> None:
        for owner, name, was in saved:
            setattr(owner, name, was)
    return undo


def _unasked() -> set[str]:
    if not hasattr(_local, "unasked"):
        _local.unasked = set()
    return _local.unasked


def take_unasked() -> set[str]:
    """The functions this thread's regions could not ask torch about since the last call."""
    got = set(_unasked())
    _unasked().clear()
    return got
