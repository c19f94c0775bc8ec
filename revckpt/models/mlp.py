"""Residual MLP blocks: ``y = x + W2 · drop(act(W1 · norm(x) + b1)) + b2``."""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from ..errors import InvalidArgumentError

__all__ = ["ResidualMLPBlock", "mlp_chain"]

Norm = Literal["layer", "batch"] | None


class ResidualMLPBlock(nn.Module):
    """``y = x + fc2(dropout(act(fc1(norm(x)))))`` on inputs of shape ``(..., width)``.

    ``norm`` is ``None``, ``"layer"`` (LayerNorm) or ``"batch"`` (BatchNorm1d over the last
    dimension, for 2-D inputs ``(batch, width)``). Keyword arguments of ``forward`` are accepted
    and ignored, so the block fits chains that pass masks to every block.
    """

    def __init__(
        self,
        width: int,
        hidden: int | None = None,
        *,
        dropout: float = 0.0,
        norm: Norm = None,
        activation: type[nn.Module] = nn.ReLU,
    ) -> None:
        super().__init__()
        hidden = hidden or 4 * width
        if norm is None:
            self.norm: nn.Module = nn.Identity()
        elif norm == "layer":
            self.norm = nn.LayerNorm(width)
        elif norm == "batch":
            self.norm = nn.BatchNorm1d(width)
        else:
            raise InvalidArgumentError(f"norm={norm!r}: use None, 'layer' or 'batch'")
        self.fc1 = nn.Linear(width, hidden)
        self.act = activation()
        self.drop = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor, **_: object) -> torch.Tensor:
        return x + self.fc2(self.drop(self.act(self.fc1(self.norm(x)))))


def mlp_chain(
    depth: int,
    width: int,
    hidden: int | None = None,
    *,
    dropout: float = 0.0,
    norm: Norm = None,
) -> nn.Sequential:
    """``depth`` residual MLP blocks in an ``nn.Sequential``."""
    if depth < 1:
        raise InvalidArgumentError(f"depth={depth}: a chain needs at least one block")
    return nn.Sequential(
        *(ResidualMLPBlock(width, hidden, dropout=dropout, norm=norm) for _ in range(depth))
    )
