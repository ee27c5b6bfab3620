"""Find the chain: the ModuleList/Sequential whose entries are the checkpointable layers."""
from __future__ import annotations

from collections import Counter

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten

from .errors import SpecError


def first_tensor(obj):
    """The hidden state in a layer's arguments or output: its first tensor (HF layers return tuples)."""
    for leaf in tree_flatten(obj)[0]:
        if isinstance(leaf, torch.Tensor):
            return leaf
    return None


def tensor_leaves(obj) -> list[torch.Tensor]:
    """Every tensor in a layer's output, in pytree order (HF layers return tensors or tuples)."""
    return [leaf for leaf in tree_flatten(obj)[0] if isinstance(leaf, torch.Tensor)]


def _containers(model: nn.Module):
    for name, mod in model.named_modules():
        if isinstance(mod, (nn.ModuleList, nn.Sequential)) and len(mod) >= 2:
            yield name, mod


def _callable(module: nn.Module) -> bool:
    """Whether a module has a forward of its own (a ModuleList has none: it is not called)."""
    return type(module).forward is not nn.Module.forward


def resolve_chain(model: nn.Module, path: str | None) -> tuple[str, nn.Module, bool]:
    """Return (dotted path, container, detected). ``path`` None means: detect it.

    Detection picks the container with the most entries of one repeated class (ties: the most
    entries, then the shallowest path), e.g. ``transformer.h`` in GPT-2 or ``bert.encoder.layer``.
    """
    if path is not None:
        mod = model
        for part in path.split("."):
            nxt = getattr(mod, part, None) if not part.isdigit() else (
                mod[int(part)] if isinstance(mod, (nn.ModuleList, nn.Sequential)) and int(part) < len(mod) else None)
            if nxt is None:
                options = ", ".join(n for n, _ in _containers(model)) or "none found"
                raise SpecError(f"chain: {type(model).__name__} has no submodule {path!r} (no {part!r} in it)",
                                tip=f"ModuleList/Sequential candidates: {options}")
            mod = nxt
        if not isinstance(mod, (nn.ModuleList, nn.Sequential)) or len(mod) < 1:
            raise SpecError(f"chain: {path!r} is a {type(mod).__name__}, not a ModuleList or Sequential",
                            tip="name the container that holds the repeated layers")
        return path, mod, False
    ranked = _ranked(model)
    if not ranked:
        loose = _loose_repeats(model)
        raise SpecError(f"chain: found no ModuleList/Sequential of repeated layers in {type(model).__name__}",
                        tip="set `chain:` in the spec to the dotted path of the layer container" + (
                            f"; these modules repeat a layer class but are not containers: {loose} (put their "
                            "layers in an nn.Sequential or nn.ModuleList in your target)" if loose else ""))
    _, name, mod = ranked[0]
    return name, mod, True


def _ranked(model: nn.Module) -> list[tuple[tuple[int, int, int], str, nn.Module]]:
    """Containers of at least two layers of one class, best first: the most entries of one
    repeated class, then the most entries, then the shallowest path, then the first found."""
    found = []
    for order, (name, mod) in enumerate(_containers(model)):
        if not all(_callable(m) for m in mod):  # a list of lists (Funnel's blocks): its entries are not layers
            continue
        repeats = Counter(type(m).__name__ for m in mod).most_common(1)[0][1]
        if repeats >= 2:
            found.append(((repeats, len(mod), -name.count("."), -order), name, mod))
    found.sort(key=lambda t: t[0], reverse=True)
    return [(key[:3], name, mod) for key, name, mod in found]


def other_chains(model: nn.Module, chosen: str, limit: int = 4) -> str | None:
    """A note naming the containers detection passed over (``name (n layers)``), or None."""
    inside = chosen + "."  # containers within the chain's layers (a layer's experts) are no alternative
    rest = [f"{name} ({len(mod)} layers)" for _, name, mod in _ranked(model)
            if name != chosen and not name.startswith(inside)]
    if not rest:
        return None
    more = f" and {len(rest) - limit} more" if len(rest) > limit else ""
    return (f"chain {chosen!r} was detected; other containers of repeated layers: {', '.join(rest[:limit])}{more} "
            "(set `chain:` to plan one of them)")


def _loose_repeats(model: nn.Module, limit: int = 3) -> str:
    """Modules (not containers) whose direct children repeat one class: timm's RegNet stages."""
    out = []
    for name, mod in model.named_modules():
        if isinstance(mod, (nn.ModuleList, nn.Sequential)):
            continue
        # children that are blocks themselves (not leaves such as an attention's q, k, v Linears)
        kids = Counter(type(m).__name__ for m in mod.children() if next(m.children(), None) is not None)
        if kids and kids.most_common(1)[0][1] >= 2:
            cls, n = kids.most_common(1)[0]
            out.append((-n, name.count("."), f"{name or type(model).__name__} ({n} x {cls})"))
    return ", ".join(text for *_, text in sorted(out)[:limit])  # the longest runs first, then the shallowest
