"""A small pre-norm transformer block (GPT-style), and chains of them.

``h = x + Attn(LN1(x), mask)``, ``y = h + MLP(LN2(h))`` with
``Attn = W_o · SDPA(W_q x, W_k x, W_v x)`` over ``heads`` heads and
``MLP = W_2 · GELU(W_1 ·)`` of hidden size ``mlp_ratio · dim``.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import InvalidArgumentError

__all__ = ["TransformerBlock", "gpt_like", "rev_gpt_like", "transformer_chain"]


class TransformerBlock(nn.Module):
    """Pre-norm transformer block on ``(batch, seq, dim)``; ``forward(x, attn_mask=None)``.

    ``attn_mask`` is passed to ``scaled_dot_product_attention`` (boolean, True = attend, or
    additive float); ``causal=True`` applies a causal mask when no mask is given.
    """

    def __init__(
        self,
        dim: int,
        heads: int,
        *,
        mlp_ratio: int = 4,
        dropout: float = 0.0,
        causal: bool = True,
    ) -> None:
        super().__init__()
        if dim % heads:
            raise InvalidArgumentError(f"dim={dim} is not divisible by heads={heads}")
        self.heads = heads
        self.causal = causal
        self.dropout = dropout
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, mlp_ratio * dim)
        self.fc2 = nn.Linear(mlp_ratio * dim, dim)
        self.drop = nn.Dropout(dropout)

    def attention(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``W_o SDPA(W_q x, W_k x, W_v x)`` over the heads (causal unless a mask is given)."""
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=attn_mask,
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=self.causal and attn_mask is None,
        )
        return self.drop(self.proj(out.transpose(1, 2).reshape(b, s, d)))

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        """``W_2 GELU(W_1 x)``."""
        return self.drop(self.fc2(F.gelu(self.fc1(x))))

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attention(self.ln1(x), attn_mask)
        return x + self.mlp(self.ln2(x))


def transformer_chain(
    depth: int, dim: int, heads: int, *, mlp_ratio: int = 4, dropout: float = 0.0
) -> nn.Sequential:
    """``depth`` transformer blocks in an ``nn.Sequential`` (call blocks one by one to pass masks,
    or use :func:`revckpt.checkpoint_sequential`, which passes keyword tensors to every block)."""
    if depth < 1:
        raise InvalidArgumentError(f"depth={depth}: a chain needs at least one block")
    return nn.Sequential(
        *(TransformerBlock(dim, heads, mlp_ratio=mlp_ratio, dropout=dropout) for _ in range(depth))
    )


def gpt_like(
    depth: int = 8, dim: int = 128, heads: int = 4, *, mlp_ratio: int = 4, dropout: float = 0.0
) -> nn.Sequential:
    """The GPT-like model of the demo and the benchmarks: ``depth`` causal pre-norm transformer
    blocks (:class:`TransformerBlock`) on inputs ``(batch, seq, dim)``; block ``i`` is named
    ``layer{i}``. Token embedding and output head are left out: they are outside the chain a
    scheduler plans."""
    chain = transformer_chain(depth, dim, heads, mlp_ratio=mlp_ratio, dropout=dropout)
    return nn.Sequential(OrderedDict((f"layer{i}", block) for i, block in enumerate(chain)))


def rev_gpt_like(
    depth: int = 8, dim: int = 128, heads: int = 4, *, mlp_ratio: int = 4
) -> nn.Sequential:
    """A reversible counterpart of :func:`gpt_like` of the same depth and width: ``depth``
    :class:`~revckpt.layers.ReversibleUnit` blocks whose two streams (``dim / 2`` each) are
    updated by causal attention (``F``) and an MLP (``G``). A different model (RevViT-style),
    not a drop-in for trained GPT weights; the scheduler can run all of it reversibly."""
    from ..layers import ReversibleUnit, reversible_transformer_block

    if dim % 2 or (dim // 2) % heads:
        raise InvalidArgumentError(
            f"dim={dim} must split into two streams divisible by heads={heads}"
        )
    return nn.Sequential(
        OrderedDict(
            (
                f"layer{i}",
                ReversibleUnit(
                    reversible_transformer_block(dim // 2, heads, mlp_ratio=mlp_ratio, causal=True)
                ),
            )
            for i in range(depth)
        )
    )
