"""Measure without side effects: put a model's gradients and buffers back afterwards."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
from torch import nn

__all__ = ["preserved"]


@contextlib.contextmanager
def preserved(modules: nn.Module | Iterable[nn.Module], *, grads: bool = True) -> Iterator[None]:
    """Within this context the modules may be run forward and backward freely: on exit every
    buffer (BatchNorm running statistics, counters) gets its value back, and, with ``grads``,
    every trainable parameter its ``.grad`` (the same tensor object, or ``None``)."""
    mods = [modules] if isinstance(modules, nn.Module) else list(modules)
    seen: set[int] = set()
    params, buffers = [], []
    for m in mods:
        for p in m.parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                params.append(p)
        for b in m.buffers():
            if id(b) not in seen:
                seen.add(id(b))
                buffers.append((b, b.detach().clone()))
    saved_grads = [p.grad for p in params]
    try:
        yield
    finally:
        if grads:
            for p, g in zip(params, saved_grads, strict=True):
                p.grad = g
        with torch.no_grad():
            for b, value in buffers:
                b.copy_(value)
