"""The model of ``bench_finetune.py``: a small nanoGPT-style GPT, and a minimal LoRA.

``GPT(config)(idx) -> logits``: token + position embedding, an ``nn.ModuleList`` of pre-LN
blocks ``x = x + attn(ln1(x)); x = x + mlp(ln2(x))`` that the model's forward iterates itself
(``for block in self.blocks: x = block(x)``), a final LayerNorm and an LM head (tied to the token
embedding unless ``tie=False``). Causal self-attention through
``F.scaled_dot_product_attention(is_causal=True)``; no dropout unless ``dropout > 0``.

``add_lora(model, rank)`` replaces every attention and MLP ``nn.Linear`` of the blocks by a
:class:`LoRALinear` (``y = W x + b + (alpha / r) B A x``, ``W`` and ``b`` frozen, ``B`` zero
at the start, so the adapted model computes exactly what the pretrained one did).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 64
    context: int = 64
    depth: int = 6
    width: int = 128
    heads: int = 4
    dropout: float = 0.0
    tie: bool = True


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        if config.width % config.heads:
            raise ValueError(f"width {config.width} is not a multiple of heads {config.heads}")
        self.qkv = nn.Linear(config.width, 3 * config.width)
        self.proj = nn.Linear(config.width, config.width)
        self.heads = config.heads
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.width, 4 * config.width)
        self.act = nn.GELU()
        self.proj = nn.Linear(4 * config.width, config.width)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(self.act(self.fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.width)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.width)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """``forward(idx) -> logits``: ``idx`` (batch, time) token ids, logits (batch, time, vocab)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok = nn.Embedding(config.vocab, config.width)
        self.pos = nn.Embedding(config.context, config.width)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.depth))
        self.ln_f = nn.LayerNorm(config.width)
        self.head = nn.Linear(config.width, config.vocab, bias=False)
        if config.tie:
            self.head.weight = self.tok.weight
        self.apply(_init_weights)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):  # nanoGPT's scaled residual projections
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.depth))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.config.context:
            raise ValueError(f"sequence of {t} tokens > context {self.config.context}")
        x = self.drop(self.tok(idx) + self.pos(torch.arange(t, device=idx.device)))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)


class LoRALinear(nn.Module):
    """``base(x) + (alpha / rank) * x A^T B^T`` with ``base`` frozen and ``B`` zero at first."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float) -> None:
        super().__init__()
        self.base = base
        for p in base.parameters():
            p.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.empty(rank, base.in_features))
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank))
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))  # as nn.Linear (and LoRA) do
        self.scale = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.scale * F.linear(F.linear(x, self.lora_a), self.lora_b)


def add_lora(model: GPT, rank: int = 8, alpha: float | None = None) -> list[nn.Parameter]:
    """Freeze ``model`` and put a rank-``rank`` adapter on every attention and MLP linear layer
    of its blocks, in place; returns the adapters' parameters (the only trainable ones).
    ``alpha`` defaults to ``2 * rank`` (scale 2)."""
    model.requires_grad_(False)
    alpha = 2.0 * rank if alpha is None else alpha
    params: list[nn.Parameter] = []
    for block in model.blocks:
        for parent in (block.attn, block.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    lora = LoRALinear(child, rank, alpha)
                    setattr(parent, name, lora)
                    params += [lora.lora_a, lora.lora_b]
    return params
