"""ckplan's built-in models, in plain PyTorch.

Each model keeps its repeated layers in ONE attribute, the chain: every entry is called exactly
once, in order, with the hidden state as its only positional argument, and returns the new
hidden state. The attribute's name is the class attribute ``chain_attr``:

=========  =========================================  ======================================
name       chain                                      forward
=========  =========================================  ======================================
gpt        ``blocks`` (ModuleList of Block)           ``(input_ids, labels=None)``
bert       ``layers`` (ModuleList of EncoderLayer)    ``(input_ids, labels=None)``
mlp        ``layers`` (Sequential of Linear+act)      ``(x, labels=None)``
resnet     ``blocks`` (Sequential of residual blocks) ``(x, labels=None)``
=========  =========================================  ======================================

Each forward returns the model's output without labels and a scalar mean loss with them.
Builders run under ``with torch.device("meta"):`` (no values are read at build or forward time).

    model = build_builtin("gpt", {"n_layer": 2, "n_embd": 64, "n_head": 4})
"""
from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable
from typing import Any

import torch.nn as nn

from ._args import ZooArgumentError
from .bert import Bert, BertConfig, build_bert
from .gpt import GPT, GPTConfig, build_gpt
from .mlp import MLP, MLPConfig, build_mlp
from .resnet import ResNet, ResNetConfig, build_resnet

ZOO: dict[str, Callable[..., nn.Module]] = {
    "gpt": build_gpt,
    "bert": build_bert,
    "mlp": build_mlp,
    "resnet": build_resnet,
}

# Each builder is Model(Config(**kwargs)): the config dataclass declares the arguments.
_CONFIGS: dict[str, type] = {
    "gpt": GPTConfig,
    "bert": BertConfig,
    "mlp": MLPConfig,
    "resnet": ResNetConfig,
}


def zoo_args(name: str) -> dict[str, Any]:
    """The arguments model ``name`` accepts, with their defaults, in declaration order."""
    if name not in _CONFIGS:
        raise KeyError(name)
    out = {}
    for f in dataclasses.fields(_CONFIGS[name]):
        if f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
        else:
            out[f.name] = f.default
    return out


def build_builtin(name: str, args: dict[str, Any] | None = None) -> nn.Module:
    """Build zoo model ``name`` with ``args`` overriding its defaults (see :func:`zoo_args`).

    Raises KeyError(name) for an unknown model and TypeError (a :class:`ZooArgumentError` for
    bad values) naming the argument and listing the accepted ones.
    """
    if name not in ZOO:
        raise KeyError(name)
    args = dict(args or {})
    accepted = zoo_args(name)
    listing = f"accepted arguments: {', '.join(accepted)}"
    unknown = [k for k in args if k not in accepted]
    if unknown:
        parts = []
        for key in unknown:
            close = difflib.get_close_matches(str(key), list(accepted), n=1)
            parts.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise TypeError(f"{name}: unknown argument{'s' if len(unknown) > 1 else ''} "
                        f"{', '.join(parts)}; {listing}")
    try:
        return ZOO[name](**args)
    except ZooArgumentError as e:  # raised by the config's checks, before any module is built
        raise ZooArgumentError(f"{e}; {listing}") from None


__all__ = [
    "GPT",
    "MLP",
    "ZOO",
    "Bert",
    "BertConfig",
    "GPTConfig",
    "MLPConfig",
    "ResNet",
    "ResNetConfig",
    "ZooArgumentError",
    "build_builtin",
    "zoo_args",
]
