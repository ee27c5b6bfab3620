"""A ResNet (He et al. 2016) whose residual blocks form one flat chain across all stages.

The defaults are ResNet-18 (11,689,512 parameters); ``layers=[3, 4, 6, 3],
block="bottleneck"`` is ResNet-50 (25,557,032), both as torchvision counts them. Bottlenecks
put the stride on the 3x3 conv (torchvision's "ResNet v1.5").

Chain: ``ResNet.blocks``, an ``nn.Sequential`` of every residual block of every stage in order.
Each stage's first block halves the spatial size (except the first stage's) and changes the
channel count, so activation sizes and costs differ down the chain, which is the point: a
planner must not assume uniform layers. The stem (conv, BN, ReLU, maxpool) and the head
(avgpool, fc) are outside the chain.

BatchNorm in train mode updates its running statistics (buffers) on every forward, recomputed
forwards included under plain ``torch.utils.checkpoint``; ckplan's own plans (``apply_plan``)
recompute them without the second update (``ckplan.recompute``), so a checkpointed step leaves the
same buffers as a plain one.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from ._args import ZooArgumentError, check_choice, check_int, check_int_list


@dataclass
class ResNetConfig:
    layers: list[int] = field(default_factory=lambda: [2, 2, 2, 2])  # blocks per stage
    widths: list[int] = field(default_factory=lambda: [64, 128, 256, 512])  # base channels per stage
    in_channels: int = 3
    num_classes: int = 1000
    block: str = "basic"  # "basic" | "bottleneck" (bottleneck outputs 4x the stage width)

    def __post_init__(self):
        m = "resnet"
        self.layers = check_int_list(m, "layers", self.layers)
        self.widths = check_int_list(m, "widths", self.widths)
        if len(self.layers) != len(self.widths):
            raise ZooArgumentError(f"resnet: layers has {len(self.layers)} stages but widths has "
                                   f"{len(self.widths)}; give one width per stage")
        check_int(m, "in_channels", self.in_channels)
        check_int(m, "num_classes", self.num_classes)
        check_choice(m, "block", self.block, ("basic", "bottleneck"))


def _shortcut(in_ch: int, out_ch: int, stride: int) -> nn.Module | None:
    """1x1 conv + BN when the identity cannot be added (new size or channel count)."""
    if stride == 1 and in_ch == out_ch:
        return None
    return nn.Sequential(nn.Conv2d(in_ch, out_ch, 1, stride=stride, bias=False), nn.BatchNorm2d(out_ch))


class BasicBlock(nn.Module):
    """Two 3x3 convs with a residual connection."""

    expansion = 1

    def __init__(self, in_ch: int, width: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(in_ch, width, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.downsample = _shortcut(in_ch, width, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)  # (B, C', H', W')
        out = F.relu(self.bn1(self.conv1(x)))  # (B, C', H', W')
        out = self.bn2(self.conv2(out))
        return F.relu(out + identity)


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (strided), 1x1 expand to 4x width, with a residual connection."""

    expansion = 4

    def __init__(self, in_ch: int, width: int, stride: int):
        super().__init__()
        out_ch = width * self.expansion
        self.conv1 = nn.Conv2d(in_ch, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out_ch, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_ch)
        self.downsample = _shortcut(in_ch, out_ch, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)  # (B, 4w, H', W')
        out = F.relu(self.bn1(self.conv1(x)))  # (B, w, H, W)
        out = F.relu(self.bn2(self.conv2(out)))  # (B, w, H', W')
        out = self.bn3(self.conv3(out))  # (B, 4w, H', W')
        return F.relu(out + identity)


class ResNet(nn.Module):
    chain_attr = "blocks"

    def __init__(self, config: ResNetConfig):
        super().__init__()
        self.config = config
        block_cls = Bottleneck if config.block == "bottleneck" else BasicBlock
        stem_ch = config.widths[0]
        self.stem = nn.Sequential(
            nn.Conv2d(config.in_channels, stem_ch, 7, stride=2, padding=3, bias=False),
            nn.BatchNorm2d(stem_ch),
            nn.ReLU(),
            nn.MaxPool2d(3, stride=2, padding=1),
        )
        blocks, in_ch = [], stem_ch
        for stage, (n_blocks, width) in enumerate(zip(config.layers, config.widths)):
            for i in range(n_blocks):
                stride = 2 if (i == 0 and stage > 0) else 1
                blocks.append(block_cls(in_ch, width, stride))
                in_ch = width * block_cls.expansion
        self.blocks = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(in_ch, config.num_classes)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self):
        """torchvision's init: Kaiming (fan_out) convs, unit BatchNorms. A no-op on meta."""
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(module, nn.BatchNorm2d):
                module.reset_parameters()

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, num_classes) for images (B, in_channels, H, W); with integer labels (B,) the
        mean cross-entropy."""
        x = self.stem(x)  # (B, w0, H/4, W/4)
        x = self.blocks(x)  # (B, C_last, H/2^(k+1), W/2^(k+1)) for k stages
        logits = self.fc(torch.flatten(self.pool(x), 1))  # (B, num_classes)
        if labels is None:
            return logits
        return F.cross_entropy(logits, labels)


def build_resnet(**kwargs) -> ResNet:
    return ResNet(ResNetConfig(**kwargs))
