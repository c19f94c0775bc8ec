"""revckpt.checkpoint under torch.compile (inductor on CPU): the compiler plans the recompute."""

import copy

import torch
from helpers import Chain

from revckpt.models import mlp_chain


def test_compiled_checkpoint_matches_compiled_plain():
    torch.manual_seed(0)
    chain = mlp_chain(2, 8, 16, norm="batch")
    plain = copy.deepcopy(chain)
    x = torch.randn(6, 8)
    torch.compile(Chain(chain, "per-block"))(x).sum().backward()
    torch.compile(plain)(x).sum().backward()
    for a, b in zip(chain.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)
    for a, b in zip(chain.buffers(), plain.buffers(), strict=True):
        assert torch.equal(a, b)  # BatchNorm statistics updated once, as without checkpoint
