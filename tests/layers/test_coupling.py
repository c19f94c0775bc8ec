"""Couplings (revckpt/layers/coupling.py): round trips, gradients, errors."""

import copy

import torch
from reversible_reference import assert_grads_match, plain_forward, step
from torch import nn

from revckpt.layers import (
    AffineCoupling,
    Coupling,
    ReversibleBlock,
    ReversibleSequential,
)


def test_inverse_and_custom_coupling():
    class Gated(Coupling):
        def combine(self, x, h):
            return x + torch.sigmoid(h) * 0.5

        def separate(self, y, h):
            return y - torch.sigmoid(h) * 0.5

    torch.manual_seed(0)
    block = ReversibleBlock(nn.Linear(3, 3), nn.Linear(3, 3), coupling=Gated()).double()
    x1, x2 = torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    r1, r2 = block.inverse(*block(x1, x2))
    torch.testing.assert_close((r1, r2), (x1, x2), rtol=1e-12, atol=1e-12)
    rev = ReversibleSequential(block, copy.deepcopy(block))
    ref = copy.deepcopy(rev)
    x = torch.randn(4, 6, dtype=torch.float64)
    assert_grads_match(
        step(lambda m, x, **k: m(x), rev, x, None)[1], step(plain_forward, ref, x, None)[1], 1e-12
    )


def test_affine_scale_bounded():
    c = AffineCoupling(clamp=2.0)
    x = torch.ones(3)
    y = c.combine(x, (torch.tensor([-1e6, 0.0, 1e6]), torch.zeros(3)))
    assert torch.all(y >= torch.exp(torch.tensor(-2.0)) - 1e-6)
    assert torch.all(y <= torch.exp(torch.tensor(2.0)) + 1e-5)
