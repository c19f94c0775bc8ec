"""Reconstruction drift: check_inverse, anchors, and the default invertibility check."""

import copy

import pytest
import torch
from reversible_reference import plain_forward, step
from torch import nn

from revckpt import ReconstructionError
from revckpt.layers import (
    ReconstructionWarning,
    ReversibleBlock,
    ReversibleSequential,
    reversible_mlp_block,
)


def _deep_bf16(anchor_every):
    torch.manual_seed(0)
    blocks = [reversible_mlp_block(16, 32) for _ in range(64)]
    return ReversibleSequential(*blocks, anchor_every=anchor_every).bfloat16()


def test_check_inverse_warns_or_raises_with_the_fix():
    rev = _deep_bf16(None)
    rev.check_inverse, rev.on_drift = 1e-6, "warn"
    x = torch.randn(8, 32).bfloat16()
    with pytest.warns(ReconstructionWarning, match="anchor_every"):
        rev(x).float().sum().backward()
    assert max(d for d in rev.last_drift if d is not None) > 1e-6
    rev.on_drift = "raise"
    with pytest.raises(ReconstructionError, match=r"check_inverse=1e-06.*anchor_every"):
        rev(x).float().sum().backward()


def test_anchors_bound_bf16_error_near_plain_bf16():
    torch.manual_seed(0)
    x = torch.randn(8, 32)
    exact = copy.deepcopy(_deep_bf16(None)).double()
    _, g_exact = step(plain_forward, exact, x.double(), None)

    def err(model_fn, model):
        _, g = step(model_fn, model, x.bfloat16(), None)
        a = torch.cat([t.flatten().double() for t in g])
        b = torch.cat([t.flatten() for t in g_exact])
        return ((a - b).norm() / b.norm()).item()

    plain = err(plain_forward, _deep_bf16(None))
    anchored = err(lambda m, x, **k: m(x), _deep_bf16(4))
    unanchored = err(lambda m, x, **k: m(x), _deep_bf16(None))
    print(
        f"bf16, depth 64, gradient error vs float64: plain backprop {plain:.3e}, reversible "
        f"anchor_every=4 {anchored:.3e}, reversible without anchors {unanchored:.3e}"
    )
    assert anchored <= 1.5 * plain
    assert unanchored > 1.5 * plain  # without anchors, bf16 drift does show in the gradients


# --- the default invertibility check ---------------------------------------------------------


class _NotAFunctionOfItsInput(nn.Module):
    """A branch that reads state outside itself (a global table changed after the forward)."""

    def __init__(self, width):
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.table = {"scale": 1.0}  # a dict: replay re-establishes plain attributes only

    def forward(self, x):
        return torch.tanh(self.lin(x)) * self.table["scale"]


def test_default_check_catches_a_branch_whose_recompute_differs():
    torch.manual_seed(0)
    f = _NotAFunctionOfItsInput(4)
    stack = ReversibleSequential(*[ReversibleBlock(f, nn.Linear(4, 4)) for _ in range(3)])
    x = torch.randn(5, 8, requires_grad=True)
    y = stack(x)
    f.table["scale"] = 3.0
    try:
        with pytest.raises(ReconstructionError, match=r"check_inverse='auto'.*Fix the branch"):
            y.sum().backward()
    finally:
        f.table["scale"] = 1.0
    y = ReversibleSequential(*stack.blocks, check_inverse=None)(x)  # the check can be skipped
    y.sum().backward()


def test_default_check_is_quiet_on_a_deep_invertible_stack():
    torch.manual_seed(0)
    stack = ReversibleSequential(*[reversible_mlp_block(16, 32) for _ in range(48)])
    x = torch.randn(8, 32, requires_grad=True)
    stack(x).sum().backward()  # round-off drift is far below the default tolerance
    assert stack.last_drift[0] is not None and stack.last_drift[0] < 1e-4
    assert all(d is None for d in stack.last_drift[1:])  # only block 0's input is sampled


class _Scaled(nn.Module):
    """A branch whose output is multiplied by a module-external factor: a recompute differs."""

    factor = 1.0

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        return self.lin(u) * _Scaled.factor


def test_an_additive_half_step_keeps_the_default_tolerance_beside_a_scaled_one():
    """bfloat16, a scaled f and an additive g, every input anchored (make_reversible's
    layout): the scaled rebuild's tolerance is widened by its 1 / scale (its rounding alone
    is about 0.4 here), the additive one's is not (a g recompute 16x off read 1.75 and
    passed a tolerance of 8, with gradients 21x off)."""
    from revckpt.layers import ReversibleBlock, ScaledCoupling

    torch.manual_seed(0)
    blocks = [
        ReversibleBlock(
            nn.Sequential(nn.Linear(32, 32), nn.Tanh()),
            _Scaled(32),
            coupling=ScaledCoupling(2**-8),
            g_coupling="additive",
        )
        for _ in range(4)
    ]
    stack = ReversibleSequential(*blocks, anchor_every=1).bfloat16()
    x = torch.randn(8, 64, dtype=torch.bfloat16, requires_grad=True)
    stack(x).float().square().sum().backward()  # rounding alone: trains
    assert max(d for d in stack.last_drift if d is not None) > 0.1
    y = stack(x)
    _Scaled.factor = 16.0
    try:
        with pytest.raises(ReconstructionError, match=r"default tolerance 0\.5"):
            y.float().square().sum().backward()
    finally:
        _Scaled.factor = 1.0
