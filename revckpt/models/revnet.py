"""A small RevNet-like image model as a chain of blocks: a stem, stages of reversible units
separated by downsampling blocks, and a classifier head.

``stem = conv3x3(3 -> c_0) -> BN -> ReLU``; stage ``s`` has ``units[s]``
:class:`~revckpt.layers.ReversibleUnit` blocks (RevNet residual functions on ``c_s / 2``
channels each side, split along the channel dimension); between stages
``down = conv3x3 stride 2 (c_s -> c_{s+1}) -> BN -> ReLU``; ``head = global average pool ->
linear``. The units are invertible (the scheduler may run them reversibly); the stem,
downsampling blocks and head are not.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch
from torch import nn

from ..errors import InvalidArgumentError
from ..layers import ReversibleUnit, revnet_conv_block

__all__ = ["ClassifierHead", "revnet_like"]


def _conv_bn_relu(cin: int, cout: int, stride: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU(),
    )


class ClassifierHead(nn.Module):
    """``linear(mean over H, W)`` on ``(N, C, H, W)``."""

    def __init__(self, channels: int, classes: int) -> None:
        super().__init__()
        self.fc = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.mean(dim=(2, 3)))


def revnet_like(
    units: Sequence[int] = (3, 3, 3),
    channels: Sequence[int] = (32, 64, 128),
    *,
    in_channels: int = 3,
    classes: int = 10,
) -> nn.Sequential:
    """The chain ``stem, units..., down, units..., ..., head`` in an ``nn.Sequential`` (inputs
    ``(N, in_channels, H, W)``, ``H`` and ``W`` divisible by ``2 ** (len(units) - 1)``)."""
    if len(units) != len(channels) or not units:
        raise InvalidArgumentError(
            f"units {list(units)} and channels {list(channels)} need one entry per stage"
        )
    if any(u < 0 for u in units) or any(c < 2 or c % 2 for c in channels):
        raise InvalidArgumentError(
            "units must be >= 0 and channels even (each reversible unit splits them in two)"
        )
    blocks: list[tuple[str, nn.Module]] = [("stem", _conv_bn_relu(in_channels, channels[0], 1))]
    for s, (n, c) in enumerate(zip(units, channels, strict=True)):
        if s > 0:
            blocks.append((f"down{s}", _conv_bn_relu(channels[s - 1], c, 2)))
        for u in range(n):
            blocks.append((f"stage{s}_unit{u}", ReversibleUnit(revnet_conv_block(c), split_dim=1)))
    blocks.append(("head", ClassifierHead(channels[-1], classes)))
    return nn.Sequential(OrderedDict(blocks))
