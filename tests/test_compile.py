"""revckpt.checkpoint under torch.compile (inductor on CPU): the compiler plans the recompute."""

import copy

import torch
from torch import nn

from revckpt import checkpoint_sequential
from revckpt.models import mlp_chain


class Checkpointed(nn.Module):
    def __init__(self, chain, policy=None):
        super().__init__()
        self.chain = chain
        self.policy = policy

    def forward(self, x):
        return checkpoint_sequential(self.chain, len(self.chain), x, policy=self.policy)


def test_compiled_checkpoint_matches_compiled_plain():
    torch.manual_seed(0)
    chain = mlp_chain(2, 8, 16, norm="batch")
    plain = copy.deepcopy(chain)
    x = torch.randn(6, 8)
    torch.compile(Checkpointed(chain))(x).sum().backward()
    torch.compile(plain)(x).sum().backward()
    for a, b in zip(chain.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)
    for a, b in zip(chain.buffers(), plain.buffers(), strict=True):
        assert torch.equal(a, b)  # BatchNorm statistics updated once, as without checkpoint
