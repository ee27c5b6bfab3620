"""A plan's items (``Store``, ``Checkpoint``), checking them, and building them from checkpointed
ranges; the plan type and its JSON are ``plan.py``."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

from ..errors import SpecError

STORE = "store"
# A top-level stored layer whose saved tensors (its output aside) go to pinned host memory after
# its forward and come back before its backward (ckplan.execute.offload); no recompute.
OFFLOAD = "offload"
PLAIN = (STORE, OFFLOAD)  # options whose forward and backward run the layer as it is
# ``<selective option>+offload`` (e.g. ``sac-compute+offload``): the layer runs with that option and
# what the option keeps, its output aside, goes to the host as ``offload`` moves a stored layer's
# (ckplan.execute.offload; torch's SAC cache reaches saved-tensor hooks from torch 2.14 on).
OFFLOADED = "+" + OFFLOAD


def is_offloaded(option: str) -> bool:
    """Whether a layer stored with ``option`` goes to host memory: ``offload`` or ``X+offload``."""
    return option == OFFLOAD or option.endswith(OFFLOADED)


def kept_option(option: str) -> str:
    """The option a layer stored with ``option`` runs with: ``store`` for ``store`` and ``offload``,
    ``X`` for ``X`` and ``X+offload``."""
    if option == OFFLOAD:
        return STORE
    return option[: -len(OFFLOADED)] if option.endswith(OFFLOADED) else option
# A plan's params key: {offloaded layer: the layer after whose first forward the step waits for
# its copy to the host and frees its device memory} (planner/transfers.py).
RELEASE = "offload_release"
# {offloaded layer: the layer at the start of whose backward its copy back starts} (default the next
# layer; the last layer has none: it is copied back on demand at its own backward).
FETCH = "offload_fetch"


@dataclass(frozen=True)
class Store:
    """Layer ``layer`` runs forward keeping what it saves for backward: everything (option
    ``store``) or, with a selective option (``Option`` in chain.py, e.g. ``sac-compute``), the
    outputs of some ops only, the rest recomputed at the start of its backward."""

    layer: int
    option: str = STORE


@dataclass(frozen=True)
class Checkpoint:
    """Layers ``start..stop-1`` keep only their boundary in the first forward; ``inner`` is the
    plan of the recompute that runs during backward."""

    start: int
    stop: int
    inner: tuple[Item, ...]


Item = Union[Store, Checkpoint]


_SHARED = 4096  # Store(i) is shared for i below this (frozen); longer chains build their own
_STORES: list[Store] = [Store(i) for i in range(_SHARED)]


def _stores(a: int, b: int) -> list[Store]:
    """``[Store(i) for i in range(a, b)]``, from shared instances where there are some."""
    if b <= _SHARED:
        return _STORES[a:b]
    return _STORES[a:_SHARED] + [Store(i) for i in range(max(a, _SHARED), b)]


def items_from_ranges(n_layers: int, ranges: list[tuple[int, int]]) -> tuple[Item, ...]:
    """Build nested items from a laminar set of checkpointed ranges (any order)."""
    rs = sorted(set(ranges), key=lambda r: (r[0], -r[1]))
    if len(rs) != len(ranges):
        raise SpecError("plan checkpoints list the same range twice")
    for s, t in rs:
        if not 0 <= s < t <= n_layers:
            raise SpecError(f"plan checkpoint [{s}, {t}) is outside the chain [0, {n_layers})")
    # Each open frame: (start, stop, items so far, next uncovered layer).
    frames: list[list[Any]] = [[0, n_layers, [], 0]]

    def close_until(pos: int) -> None:
        """Pop frames that end at or before ``pos``."""
        while len(frames) > 1 and frames[-1][1] <= pos:
            s, t, its, nxt = frames.pop()
            its.extend(_stores(nxt, t))
            parent = frames[-1]
            parent[2].append(Checkpoint(s, t, tuple(its)))
            parent[3] = t

    for s, t in rs:
        close_until(s)
        top = frames[-1]
        if t > top[1]:
            raise SpecError(f"plan checkpoints [{top[0]}, {top[1]}) and [{s}, {t}) overlap "
                            "without nesting")
        top[2].extend(_stores(top[3], s))
        top[3] = s
        frames.append([s, t, [], s])
    close_until(n_layers)
    root = frames[0]
    root[2].extend(_stores(root[3], n_layers))
    return tuple(root[2])


def _validate(items: tuple[Item, ...], n_layers: int) -> None:
    """Items must cover [0, n) in order; each inner covers its checkpoint's range in order."""
    if not isinstance(n_layers, int) or n_layers < 1:
        raise SpecError(f"a plan needs at least one layer, got n_layers={n_layers!r}")
    # Each task: (items, start, stop, owner range for messages or None at top level).
    tasks: list[tuple[tuple[Item, ...], int, int, tuple[int, int] | None]] = [
        (items, 0, n_layers, None)]
    while tasks:
        seq, start, stop, owner = tasks.pop()
        where = "the plan" if owner is None else f"the inner plan of checkpoint [{owner[0]}, {owner[1]})"
        pos = start
        for it in seq:
            if isinstance(it, Store):
                lo, hi = it.layer, it.layer + 1
                if is_offloaded(it.option) and owner is not None:
                    raise SpecError(f"{where} offloads layer {lo}, but only a layer stored at the top "
                                    "level can be offloaded (inside a checkpoint its saved tensors "
                                    "live only during the recompute)",
                                    tip="store it or give it a selective option there")
            elif isinstance(it, Checkpoint):
                lo, hi = it.start, it.stop
                if not hi > lo:
                    raise SpecError(f"checkpoint [{lo}, {hi}) in {where} is empty")
                tasks.append((tuple(it.inner), lo, hi, (lo, hi)))
            else:
                raise SpecError(f"{where} holds {it!r}, which is neither Store nor Checkpoint")
            if lo != pos:
                what = "overlaps the previous item" if lo < pos else f"leaves layers [{pos}, {lo}) uncovered"
                raise SpecError(f"{where} must cover [{start}, {stop}) in order: item at layer {lo} {what}")
            pos = hi
        if pos != stop:
            raise SpecError(f"{where} must cover [{start}, {stop}) exactly; it ends at {pos}")
        if (owner is not None and len(seq) == 1 and isinstance(seq[0], Checkpoint)):
            raise SpecError(f"{where} is a single checkpoint of its whole range, which would only "
                            "rerun the segment", tip="list its inner items directly")


def offload_releases(n_layers: int, items: tuple[Item, ...], params: dict[str, Any]) -> dict[int, int]:
    """Each top-level offloaded layer's release point: ``params[RELEASE]`` where it names one (JSON
    keys may be strings), else the next layer (the last layer: itself)."""
    return _offload_points(n_layers, items, params, RELEASE)


def offload_fetches(n_layers: int, items: tuple[Item, ...], params: dict[str, Any]) -> dict[int, int]:
    """Each top-level offloaded layer's fetch point but the last layer's: ``params[FETCH]`` where it
    names one, else the next layer."""
    return _offload_points(n_layers, items, params, FETCH)


def _offload_points(n_layers: int, items: tuple[Item, ...], params: dict[str, Any], key: str) -> dict[int, int]:
    given = params.get(key) or {}
    what = "release points" if key == RELEASE else "fetch points"
    if not isinstance(given, dict):
        raise SpecError(f"plan params {key!r} must map offloaded layers to {what}, got {given!r}",
                        tip=f'give an object such as {{"0": 3}} (layer 0 at layer 3), or drop {key!r}')
    out: dict[int, int] = {}
    last = n_layers - 1
    for it in items:
        if not (isinstance(it, Store) and is_offloaded(it.option)) or (key == FETCH and it.layer == last):
            continue
        i = it.layer
        r = given.get(i, given.get(str(i), min(i + 1, last)))
        if isinstance(r, bool) or not isinstance(r, int) or not (i < r <= last or (key == RELEASE and r == i == last)):
            where = ("its copy to the host can be waited for after the forward" if key == RELEASE else
                     "its copy back can start at the backward")
            raise SpecError(f"plan params {key!r} gives layer {i} the point {r!r}: {where} of a later layer, "
                            f"{i + 1} to {last}", tip="drop the entry (the next layer is the default) or re-plan")
        out[i] = r
    return out
