"""Chain layers' forwards replaced for a block and restored after it.

The peers (``sac-policy``, ``offload-all``), the offload hooks and the option passes each run every
chain layer's forward wrapped: the wrapper is set as an instance attribute over the class's
``forward`` (or over one already there, which comes back on exit), so the model's own code still
calls every layer itself.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from torch import nn

_NONE = object()  # the layer had no forward of its own


@contextmanager
def forwards_replaced(layers: list[nn.Module], wrap: Callable[[int, Callable], Callable]) -> Iterator[None]:
    """Layer ``i``'s forward is ``wrap(i, forward)`` until the block ends."""
    had = [layer.__dict__.get("forward", _NONE) for layer in layers]
    for i, layer in enumerate(layers):
        own = layer.__dict__.get("forward")
        fwd = own if own is not None else functools.partial(type(layer).forward, layer)
        layer.forward = wrap(i, fwd)
    try:
        yield
    finally:
        for layer, own in zip(layers, had):
            if own is _NONE:
                layer.__dict__.pop("forward", None)
            else:
                layer.forward = own
