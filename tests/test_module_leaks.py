"""Modules that went through a strategy are freed once the caller drops them: revckpt's caches
(per-module layouts and parameter lists) hold them weakly."""

import gc
import weakref

import pytest
import torch
from torch import nn

import revckpt
from revckpt.layers import ReversibleBlock, ReversibleSequential


def _block():
    return nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.GELU(), nn.Linear(8, 8))


def _branch():
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh())


RUNS = {
    "checkpoint": lambda m, x: revckpt.checkpoint(m, x),
    "selective": lambda m, x: revckpt.checkpoint(m, x, strategy="selective:matmul"),
    "checkpoint_sequential": lambda m, x: revckpt.checkpoint_sequential(m, 2, x),
    "checkpoint_sequential-approx": lambda m, x: revckpt.checkpoint_sequential(
        m, 2, x, strategy=revckpt.approx.Approx(store="bf16")
    ),
    "checkpoint_sequential-offload": lambda m, x: revckpt.checkpoint_sequential(
        m, 2, x, strategy="offload"
    ),
    "approx": lambda m, x: revckpt.checkpoint(m, x, strategy=revckpt.approx.Approx(store="bf16")),
    "offload": lambda m, x: revckpt.checkpoint(m, x, strategy="offload"),
}


@pytest.mark.parametrize("strategy", sorted(RUNS))
def test_a_checkpointed_module_is_freed(strategy):
    model = nn.Sequential(_block(), _block())
    ref = weakref.ref(model)
    RUNS[strategy](model, torch.randn(3, 8, requires_grad=True)).sum().backward()
    del model
    gc.collect()
    assert ref() is None


def test_a_reversible_stack_is_freed():
    stack = ReversibleSequential(*(ReversibleBlock(_branch(), _branch()) for _ in range(2)))
    ref = weakref.ref(stack)
    stack(torch.randn(3, 8, requires_grad=True)).sum().backward()
    del stack
    gc.collect()
    assert ref() is None
