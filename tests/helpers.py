"""Shared test helpers: run a model plainly and with a strategy, and compare."""

from __future__ import annotations

import copy
import socket
from collections.abc import Callable
from typing import Any

import torch
from torch import nn


def train_step(
    model: nn.Module,
    x: torch.Tensor,
    run: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None,
    *,
    seed: int = 1234,
    **kwargs: Any,
) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor | None]:
    """One forward+backward with a fixed seed; returns output, parameter grads, input grad."""
    x = x.detach().clone().requires_grad_(x.requires_grad)
    torch.manual_seed(seed)
    out = run(model, x, **kwargs) if run is not None else model(x, **kwargs)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=out.dtype)
    (out * w).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    return out.detach(), grads, (x.grad.clone() if x.grad is not None else None)


def twin(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)


def bitwise_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


class Chain(nn.Module):
    """A chain of blocks run plainly (``segments=None``) or with checkpoint segments; the same
    parameter names either way, so the two can be compared by gradient_error."""

    def __init__(self, chain: nn.Module, segments: Any = None, **options: Any) -> None:
        super().__init__()
        self.chain = chain
        self.segments = segments
        self.options = options

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from revckpt import checkpoint_sequential

        if self.segments is None:
            return self.chain(x)
        segments = len(self.chain) if self.segments == "per-block" else self.segments
        return checkpoint_sequential(self.chain, segments, x, **self.options)


def free_port() -> int:
    """A TCP port free on localhost now (for a gloo process group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
