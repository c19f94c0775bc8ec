"""The exact coupling (revckpt.layers.grid): split then rebuild gives the input back bit for bit,
for every scale it takes; a stack of them rebuilds without drift and its gradients equal plain
autograd of the same blocks bitwise."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from revckpt import InvalidArgumentError, ReconstructionError
from revckpt.layers import ReversibleBlock, ReversibleSequential
from revckpt.layers.grid import GRID_BITS, GridCoupling, on_grid


@given(
    k=st.sampled_from([None, 0, 1, 3, 8, 9, 12, 16]),
    magnitude=st.floats(1e-6, 1e5),
    seed=st.integers(0, 2**16),
)
def test_split_then_rebuild_is_the_identity(k, magnitude, seed):
    gen = torch.Generator().manual_seed(seed)
    x = on_grid(torch.randn(64, generator=gen, dtype=torch.float64) * magnitude)
    h = torch.randn(64, generator=gen, dtype=torch.float64) * magnitude
    coupling = GridCoupling(0.0 if k is None else 2.0**-k)
    y, lost = coupling.split(x, h)
    assert torch.equal(y, on_grid(y))  # the output is on the grid too
    back = coupling.rebuild(y, h, lost)
    assert torch.equal(back, torch.zeros_like(x) if k is None else x)
    if k:
        assert lost is not None and lost.element_size() == (1 if k <= 8 else 2)
    # combine gives the same value, with the gradients of scale * x + h
    xl, hl = x.clone().requires_grad_(), h.clone().requires_grad_()
    out = coupling.combine(xl, hl)
    assert torch.equal(out.detach(), y)
    out.sum().backward()
    assert torch.equal(xl.grad, torch.full_like(x, coupling.scale))
    assert torch.equal(hl.grad, torch.ones_like(h))


def test_bad_scales_and_streams_are_refused():
    for scale in (0.3, 2.0**-17, 2.0, -0.125):
        with pytest.raises(InvalidArgumentError, match="power of two"):
            GridCoupling(scale)
    # a diverging run, usually: what a training loop catches for a reversible rebuild
    with pytest.raises(ReconstructionError, match=r"grid.s range.*diverging run"):
        on_grid(torch.tensor([2.0 ** (53 - GRID_BITS)]))
    for bad in (float("nan"), float("inf")):  # the model's doing, not the grid's: said so
        with pytest.raises(ReconstructionError, match=r"not finite.*the model computed it"):
            on_grid(torch.tensor([1.0, bad]))
    with pytest.raises(InvalidArgumentError, match="float64"):
        GridCoupling(0.5).check(torch.zeros(3), torch.zeros(3), branch="f")


def _mlp(width: int) -> nn.Module:
    return nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_deep_exact_stack_rebuilds_without_drift(dtype):
    """Twelve blocks at scale 1/8, branches in float32 or bfloat16 (their outputs cast back to
    the float64 streams): every rebuilt input exact, gradients bitwise plain autograd's."""
    torch.manual_seed(0)

    class Cast(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = _mlp(16).to(dtype)

        def forward(self, u: torch.Tensor) -> torch.Tensor:
            return self.body(u.to(dtype)).to(u.dtype)

    blocks = [
        ReversibleBlock(
            Cast(), Cast(), coupling=GridCoupling(0.125), g_coupling=GridCoupling(1.0), swap=True
        )
        for _ in range(12)
    ]
    stack = ReversibleSequential(*blocks, anchor_every=None, check_inverse=1e-30)
    x1 = on_grid(torch.randn(4, 16)).requires_grad_()
    x2 = on_grid(torch.randn(4, 16)).requires_grad_()
    y1, y2 = stack((x1, x2))
    (y1.pow(2).sum() + y2.sum()).backward()
    assert stack.last_drift[0] == 0.0
    reversible = [p.grad.clone() for p in stack.parameters()] + [x1.grad.clone(), x2.grad]
    for p in stack.parameters():
        p.grad = None
    x1.grad = x2.grad = None
    a, b = x1, x2
    for block in blocks:  # plain autograd: the blocks' own forward, everything stored
        a, b = block(a, b)
    assert torch.equal(a, y1) and torch.equal(b, y2)
    (a.pow(2).sum() + b.sum()).backward()
    plain = [p.grad for p in stack.parameters()] + [x1.grad, x2.grad]
    for got, want in zip(reversible, plain, strict=True):
        assert torch.equal(got, want)
