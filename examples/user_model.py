"""An example of "your own model" for ``revckpt plan``.

Run from the repository root::

    revckpt plan examples.user_model:build --budget 0.3 --measure

``build()`` returns ``(blocks, example_input)``: the blocks run one after the other, each taking
and returning one tensor (keyword tensors such as masks may be returned as a third element, a
dict, and then reach every block).
"""

import torch
from torch import nn


class Block(nn.Module):
    """A pre-norm residual block with self-attention and an MLP (the user's own code)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=attn_mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


def build(depth: int = 6, dim: int = 64, heads: int = 4, batch: int = 4, seq: int = 64):
    torch.manual_seed(0)
    blocks = nn.Sequential(*(Block(dim, heads) for _ in range(depth)))
    x = torch.randn(batch, seq, dim)
    causal = torch.ones(seq, seq, dtype=torch.bool).triu(1)  # True = masked (nn.MultiheadAttention)
    return blocks, x, {"attn_mask": causal}
