"""Ready reversible blocks and helpers to enter and leave two streams.

Each ready block takes ``coupling=`` (``"additive"``, the default, ``"affine"`` or a
:class:`~revckpt.layers.Coupling` instance) and sizes its branches for it
(:meth:`~revckpt.layers.Coupling.branch_size`: an affine coupling needs a branch twice the
stream's width, log-scale and shift). With ``c`` the coupling's ``combine`` (``c(x, h) = x + h``
for ``"additive"``):

* :func:`reversible_transformer_block` — pre-norm transformer block as a coupling:
  ``y1 = c(x1, Attn(LN(x2)))``, ``y2 = c(x2, MLP(LN(y1)))`` (attention through
  ``F.scaled_dot_product_attention``; keyword ``attn_mask`` reaches the attention branch);
* :func:`reversible_mlp_block` — ``y1 = c(x1, MLP(x2))``, ``y2 = c(x2, MLP(y1))``;
* :func:`revnet_conv_block` — RevNet-style convolutional block on channels split in two:
  ``F, G = BN -> ReLU -> conv3x3 -> BN -> ReLU -> conv3x3`` on ``C/2`` channels;
* :class:`EnterStreams` (``"duplicate"``: ``(x, x)``; ``"split"``: halves along a dim) and
  :class:`LeaveStreams` (``"average"``: ``(y1 + y2) / 2``; ``"concat"``).
"""

from __future__ import annotations

import inspect
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from .._deprecation import warn_deprecated
from ..errors import InvalidArgumentError
from .coupling import Coupling, _split_dim, make_coupling
from .sequential import ReversibleBlock

__all__ = [
    "AttentionBranch",
    "ConvBranch",
    "EnterStreams",
    "LeaveStreams",
    "MLPBranch",
    "reversible_mlp_block",
    "reversible_transformer_block",
    "revnet_conv_block",
]


class _FeatureBatchNorm(nn.BatchNorm1d):
    """BatchNorm over the last (feature) dimension of ``(..., features)``: statistics over every
    other dimension, as ``nn.BatchNorm1d`` computes them for ``(batch, features)`` (it reads a
    3-D input as ``(batch, channels, length)``, which would normalise the tokens)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() <= 2:
            return super().forward(x)
        return super().forward(x.reshape(-1, x.shape[-1])).view(x.shape)


class MLPBranch(nn.Module):
    """``W2 · drop(act(W1 · norm(x)))`` on ``(..., dim)``; ``norm`` is ``None``, ``"layer"``
    or ``"batch"`` (BatchNorm of the ``dim`` features, its statistics over every other
    dimension: batch and tokens of a ``(batch, tokens, dim)`` input). Maps width ``dim`` to
    ``out_dim`` (default ``dim``)."""

    def __init__(
        self,
        dim: int,
        hidden: int,
        *,
        out_dim: int | None = None,
        norm: Literal["layer", "batch"] | None = None,
        dropout: float = 0.0,
        activation: type[nn.Module] = nn.GELU,
    ) -> None:
        super().__init__()
        if norm not in (None, "layer", "batch"):
            raise InvalidArgumentError(f"norm={norm!r}: use None, 'layer' or 'batch'")
        self.norm = {None: nn.Identity, "layer": nn.LayerNorm, "batch": _FeatureBatchNorm}[norm](
            *(() if norm is None else (dim,))
        )
        self.fc1 = nn.Linear(dim, hidden)
        self.act = activation()
        self.drop = nn.Dropout(dropout)
        self.fc2 = nn.Linear(hidden, dim if out_dim is None else out_dim)

    def forward(self, x: torch.Tensor, **_: object) -> torch.Tensor:
        return self.fc2(self.drop(self.act(self.fc1(self.norm(x)))))


class AttentionBranch(nn.Module):
    """``W_o · SDPA(W_q, W_k, W_v · LN(x), mask)`` on ``(batch, seq, dim)``; ``W_o`` maps to
    ``out_dim`` (default ``dim``)."""

    def __init__(
        self,
        dim: int,
        heads: int,
        *,
        out_dim: int | None = None,
        dropout: float = 0.0,
        causal: bool = False,
    ) -> None:
        super().__init__()
        if dim % heads:
            raise InvalidArgumentError(f"dim={dim} is not divisible by heads={heads}")
        self.heads, self.dropout, self.causal = heads, dropout, causal
        self.norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim if out_dim is None else out_dim)

    def forward(
        self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, **_: object
    ) -> torch.Tensor:
        b, s, d = x.shape
        qkv = self.qkv(self.norm(x)).view(b, s, 3, self.heads, d // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=attn_mask,
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=self.causal and attn_mask is None,
        )
        return self.proj(out.transpose(1, 2).reshape(b, s, d))


class ConvBranch(nn.Module):
    """``conv3x3(relu(bn(conv3x3(relu(bn(x))))))`` on ``channels`` channels (RevNet); the
    last convolution maps to ``out_channels`` (default ``channels``)."""

    def __init__(self, channels: int, *, out_channels: int | None = None) -> None:
        super().__init__()
        out = channels if out_channels is None else out_channels
        self.body = nn.Sequential(
            nn.BatchNorm2d(channels),
            nn.ReLU(),
            nn.Conv2d(channels, channels, 3, padding=1, bias=False),
            nn.BatchNorm2d(channels),
            nn.ReLU(),
            nn.Conv2d(channels, out, 3, padding=1, bias=False),
        )

    def forward(self, x: torch.Tensor, **_: object) -> torch.Tensor:
        return self.body(x)


def _coupled(coupling: str | Coupling, size: int, *, split_dim: int) -> tuple[Coupling, int]:
    """The block's coupling (a named one splits its branch output along ``split_dim``) and the
    size along ``split_dim`` its branches must produce for streams of size ``size``."""
    made = make_coupling(coupling, split_dim=split_dim)
    params = inspect.signature(made.branch_size).parameters
    if "split_dim" not in params and "dim" in params:  # a custom coupling written before 0.2
        warn_deprecated(
            f"{type(made).__name__}.branch_size(size, *, dim)",
            f"{type(made).__name__}.branch_size(size, *, split_dim)",
            depth=2,
        )
        return made, made.branch_size(size, dim=split_dim)
    return made, made.branch_size(size, split_dim=split_dim)


def reversible_transformer_block(
    dim: int,
    heads: int,
    *,
    mlp_ratio: int = 4,
    dropout: float = 0.0,
    causal: bool = False,
    coupling: str | Coupling = "additive",
) -> ReversibleBlock:
    """Reversible pre-norm transformer block on ``(batch, seq, dim)`` streams; ``coupling``
    (``"additive"``, ``"affine"`` or a :class:`~revckpt.layers.Coupling`) couples along the
    last dim."""
    made, out = _coupled(coupling, dim, split_dim=-1)
    return ReversibleBlock(
        AttentionBranch(dim, heads, out_dim=out, dropout=dropout, causal=causal),
        MLPBranch(dim, mlp_ratio * dim, out_dim=out, norm="layer", dropout=dropout),
        coupling=made,
    )


def reversible_mlp_block(
    dim: int,
    hidden: int,
    *,
    norm: Literal["layer", "batch"] | None = None,
    dropout: float = 0.0,
    coupling: str | Coupling = "additive",
) -> ReversibleBlock:
    """Reversible MLP block; each stream has width ``dim`` (the last dim); ``coupling``
    (``"additive"``, ``"affine"`` or a :class:`~revckpt.layers.Coupling`) couples along it."""
    made, out = _coupled(coupling, dim, split_dim=-1)
    return ReversibleBlock(
        MLPBranch(dim, hidden, out_dim=out, norm=norm, dropout=dropout),
        MLPBranch(dim, hidden, out_dim=out, norm=norm, dropout=dropout),
        coupling=made,
    )


def revnet_conv_block(channels: int, *, coupling: str | Coupling = "additive") -> ReversibleBlock:
    """RevNet block for inputs of ``channels`` channels, split in two along dim 1
    (use ``ReversibleSequential(..., split_dim=1)``); ``coupling`` couples along the channels
    (``"affine"`` means ``AffineCoupling(split_dim=1)``). Keeps resolution and channels;
    downsampling is not invertible and belongs between reversible stacks."""
    if channels % 2:
        raise InvalidArgumentError(
            f"channels={channels} is odd; a RevNet block splits channels into two equal halves"
        )
    made, out = _coupled(coupling, channels // 2, split_dim=1)
    return ReversibleBlock(
        ConvBranch(channels // 2, out_channels=out),
        ConvBranch(channels // 2, out_channels=out),
        coupling=made,
    )


class EnterStreams(nn.Module):
    """``x -> (x, x)`` (``"duplicate"``) or the halves of ``x`` along ``split_dim``
    (``"split"``). ``dim=``: deprecated spelling of ``split_dim=``."""

    def __init__(
        self,
        mode: Literal["duplicate", "split"] = "duplicate",
        *,
        split_dim: int = -1,
        dim: int | None = None,
    ):
        super().__init__()
        split_dim = _split_dim(split_dim, dim, "EnterStreams(mode, dim=...)", -1, depth=2)
        self.mode, self.split_dim = _mode(mode, ("duplicate", "split")), split_dim

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.mode == "duplicate":
            return x, x
        d = self.split_dim
        has_dim = -x.dim() <= d < x.dim()
        if not has_dim or x.shape[d] % 2:
            raise InvalidArgumentError(
                f"cannot split shape {tuple(x.shape)} in two along dim {d}: "
                f"{'odd size' if has_dim else 'no such dim'}; use mode='duplicate', pad, or "
                "pass the split_dim to split along"
            )
        a, b = x.chunk(2, dim=d)
        return a, b


class LeaveStreams(nn.Module):
    """``(y1, y2) -> (y1 + y2) / 2`` (``"average"``) or their concatenation along
    ``split_dim`` (``"concat"``). ``dim=``: deprecated spelling of ``split_dim=``."""

    def __init__(
        self,
        mode: Literal["average", "concat"] = "average",
        *,
        split_dim: int = -1,
        dim: int | None = None,
    ):
        super().__init__()
        split_dim = _split_dim(split_dim, dim, "LeaveStreams(mode, dim=...)", -1, depth=2)
        self.mode, self.split_dim = _mode(mode, ("average", "concat")), split_dim

    def forward(self, streams: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        y1, y2 = streams
        return (y1 + y2) / 2 if self.mode == "average" else torch.cat([y1, y2], dim=self.split_dim)


def _mode(mode: str, allowed: tuple[str, str]) -> str:
    """``mode`` if it is one of the two ``allowed``; an error that names them otherwise."""
    if mode not in allowed:
        raise InvalidArgumentError(f"mode={mode!r}: use {allowed[0]!r} or {allowed[1]!r}")
    return mode
