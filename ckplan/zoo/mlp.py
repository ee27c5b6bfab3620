"""A deep multilayer perceptron: the simplest chain, with widths that may vary layer to layer.

Layer i is ``nn.Sequential(nn.Linear(w_i, w_{i+1}), activation)``, for i = 0..depth-1. The
widths w_0..w_depth are ``[in_features] + [width] * depth`` by default, or come from
``widths``: a full list of depth+1 entries, or a shorter pattern repeated until it has depth+1
(``[512, 2048]`` gives 512, 2048, 512, 2048, ...). w_0 is the input width, so ``widths[0]`` must
equal ``in_features``; this is checked rather than guessed.

Chain: ``MLP.layers`` (an ``nn.Sequential`` of depth ``nn.Sequential(Linear, activation)``);
each maps (..., w_i) to (..., w_{i+1}). The optional ``out_features`` head is outside the chain.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ._args import ZooArgumentError, check_bool, check_choice, check_int, check_int_list, check_optional_int

_ACTIVATIONS = {"relu": nn.ReLU, "gelu": nn.GELU, "tanh": nn.Tanh}


@dataclass
class MLPConfig:
    in_features: int = 512
    depth: int = 12  # number of Linear+activation layers in the chain
    width: int = 512
    widths: list[int] | None = None  # depth+1 widths, or a pattern repeated to that length
    activation: str = "relu"  # "relu" | "gelu" | "tanh"
    bias: bool = True
    out_features: int | None = None  # a final Linear head outside the chain

    def __post_init__(self):
        m = "mlp"
        check_int(m, "in_features", self.in_features)
        check_int(m, "depth", self.depth)
        check_int(m, "width", self.width)
        if self.widths is not None:
            self.widths = check_int_list(m, "widths", self.widths)
            if len(self.widths) > self.depth + 1:
                raise ZooArgumentError(f"mlp: widths has {len(self.widths)} entries but depth={self.depth} "
                                       f"needs {self.depth + 1} (or a shorter pattern to repeat)")
            if self.widths[0] != self.in_features:
                raise ZooArgumentError(f"mlp: widths[0]={self.widths[0]} is the input width and must equal "
                                       f"in_features={self.in_features}; set in_features={self.widths[0]}")
        check_choice(m, "activation", self.activation, tuple(_ACTIVATIONS))
        check_bool(m, "bias", self.bias)
        check_optional_int(m, "out_features", self.out_features)

    def layer_widths(self) -> list[int]:
        """w_0..w_depth: the input width, then each chain layer's output width."""
        if self.widths is None:
            return [self.in_features] + [self.width] * self.depth
        return [self.widths[i % len(self.widths)] for i in range(self.depth + 1)]


class MLP(nn.Module):
    chain_attr = "layers"

    def __init__(self, config: MLPConfig):
        super().__init__()
        self.config = config
        w = config.layer_widths()
        act = _ACTIVATIONS[config.activation]
        self.in_features = w[0]
        self.layers = nn.Sequential(*(nn.Sequential(nn.Linear(w[i], w[i + 1], bias=config.bias), act())
                                      for i in range(config.depth)))
        self.head = None
        if config.out_features is not None:
            self.head = nn.Linear(w[-1], config.out_features, bias=config.bias)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """The output (..., w_depth or out_features) without labels. With labels: the MSE against a
        float tensor of the output's shape, or the cross-entropy against integer class labels."""
        y = self.layers(x)  # (B, w_depth)
        if self.head is not None:
            y = self.head(y)  # (B, out_features)
        if labels is None:
            return y
        if labels.is_floating_point():
            return F.mse_loss(y, labels)
        return F.cross_entropy(y, labels)


def build_mlp(**kwargs) -> MLP:
    return MLP(MLPConfig(**kwargs))
