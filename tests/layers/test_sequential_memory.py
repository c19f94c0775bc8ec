"""What a ReversibleSequential keeps between forward and backward, and its backward peak."""

import torch
from torch import nn

from revckpt import MemoryMeter
from revckpt.layers import (
    ReversibleSequential,
    reversible_mlp_block,
)


def test_no_grad_and_eval_keep_nothing():
    rev = ReversibleSequential(*[reversible_mlp_block(8, 16) for _ in range(8)])
    x = torch.randn(4, 16)
    with torch.no_grad(), MemoryMeter("cpu") as m:
        y = rev(x)
    assert m.end_bytes == y.numel() * 4


def _step_peak(depth):
    torch.manual_seed(0)
    rev = ReversibleSequential(*[reversible_mlp_block(64, 128) for _ in range(depth)])
    x = torch.randn(64, 128, requires_grad=True)
    rev(x).sum().backward()  # gradients exist: measure the steady state, as in training
    with MemoryMeter("cpu") as fwd:
        y = rev(x)
    held = fwd.end_bytes
    y.sum().backward()
    del y
    with MemoryMeter("cpu") as both:
        rev(x).sum().backward()
    return held, both.peak_bytes, x


def test_memory_flat_in_depth_and_only_the_output_held():
    held8, peak8, x = _step_peak(8)
    held128, peak128, _ = _step_peak(128)
    # the output, and the default invertibility check's 64-element samples of the two halves
    # of the stack input: nothing that grows with depth
    assert held8 == held128 == x.numel() * 4 + 2 * 64 * 4
    assert abs(peak128 - peak8) <= 0.10 * peak8


def test_rebuilt_input_released_when_the_walk_ends():
    # A layer before the stack runs its backward after the stack's: the input the stack rebuilt
    # must be gone by then, not held through the graph while the output is alive.
    torch.manual_seed(0)
    first = nn.Linear(64, 64)
    stack = ReversibleSequential(*[reversible_mlp_block(32, 64) for _ in range(2)])
    x = torch.randn(64, 64)
    for p in [*first.parameters(), *stack.parameters()]:
        p.grad = torch.zeros_like(p)
    with MemoryMeter("cpu") as m:
        y = stack(first(x))
        y.backward(torch.ones_like(y))
        held = m.live_bytes
    # what may stay alive after backward: the output only (the gradients accumulated in place)
    assert held == y.numel() * y.element_size()
