"""Ready blocks (revckpt/layers/blocks.py) with every coupling they accept."""

import copy

import torch
from reversible_reference import assert_grads_match, step

from revckpt.layers import (
    ReversibleSequential,
    revnet_conv_block,
)


def test_revnet_conv_block_split_channels():
    torch.manual_seed(0)
    rev = ReversibleSequential(*[revnet_conv_block(8) for _ in range(2)], split_dim=1).double()
    ref = copy.deepcopy(rev)
    x = torch.randn(2, 8, 6, 6, dtype=torch.float64)

    def plain(m, x, **k):
        a, b = x.chunk(2, dim=1)
        for block in m.blocks:
            a, b = block(a, b)
        return torch.cat([a, b], dim=1)

    assert_grads_match(
        step(lambda m, x, **k: m(x), rev, x, None)[1], step(plain, ref, x, None)[1], 1e-10
    )
