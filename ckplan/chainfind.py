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
    best = None
    for name, mod in _containers(model):
        if not all(_callable(m) for m in mod):  # a list of lists (Funnel's blocks): its entries are not layers
            continue
        repeats = Counter(type(m).__name__ for m in mod).most_common(1)[0][1]
        key = (repeats, len(mod), -name.count("."))
        if best is None or key > best[0]:
            best = (key, name, mod)
    if best is None or best[0][0] < 2:
        raise SpecError(f"chain: found no ModuleList/Sequential of repeated layers in {type(model).__name__}",
                        tip="set `chain:` in the spec to the dotted path of the layer container")
    return best[1], best[2], True
