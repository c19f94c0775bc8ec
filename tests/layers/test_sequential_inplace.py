"""In-place updates of a ReversibleSequential never write a tensor that someone else holds."""

import copy

import pytest
import torch
from reversible_reference import assert_grads_match, plain_forward, step
from torch import nn

from revckpt.layers import (
    AdditiveCoupling,
    ReversibleBlock,
    ReversibleSequential,
    reversible_mlp_block,
)


def test_tensors_captured_by_hooks_are_never_overwritten():
    torch.manual_seed(0)
    rev = ReversibleSequential(*[reversible_mlp_block(4, 8) for _ in range(4)]).double()
    outputs, inputs = [], []
    rev.blocks[1].f.register_forward_hook(lambda m, i, o: outputs.append((o.detach(), o.clone())))
    rev.blocks[1].f.register_forward_pre_hook(
        lambda m, i: inputs.append((i[0].detach(), i[0].clone()))
    )

    x = torch.randn(3, 8, dtype=torch.float64)
    rev(x).sum().backward()
    assert len(outputs) == 2 and len(inputs) == 2  # forward and the backward's recompute
    for held, copy_ in outputs + inputs:
        assert torch.equal(held, copy_)


def test_coupling_subclass_does_not_take_the_additive_shortcuts():
    class Scaled(AdditiveCoupling):
        def combine(self, x, h):
            return x + 0.5 * h

        def separate(self, y, h):
            return y - 0.5 * h

    torch.manual_seed(0)
    blocks = [
        ReversibleBlock(nn.Linear(3, 3), nn.Linear(3, 3), coupling=Scaled()) for _ in range(2)
    ]
    rev = ReversibleSequential(*blocks).double()
    ref = copy.deepcopy(rev)
    x = torch.randn(4, 6, dtype=torch.float64)
    y1, g1 = step(lambda m, x, **k: m(x), rev, x, None)
    y2, g2 = step(plain_forward, ref, x, None)
    assert torch.equal(y1, y2)
    assert_grads_match(g1, g2, 1e-12)


# --- tensors the stack does not own (issue 13, hole 5) ---------------------------------------


class _ReturnsBuffer(nn.Module):
    """A branch whose output is a buffer it holds (a learned-free constant offset)."""

    def __init__(self, width):
        super().__init__()
        self.register_buffer("offset", torch.linspace(-1, 1, width))

    def forward(self, x):
        return self.offset.expand_as(x) if x.dim() > 1 else self.offset


class _CachesOutput(nn.Module):
    """A branch that keeps its last output on itself (as attention maps are kept for plots)."""

    def __init__(self, width):
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.last = None

    def forward(self, x):
        self.last = torch.tanh(self.lin(x))
        return self.last


class _ReturnsKeyword(nn.Module):
    def forward(self, x, bias):
        return bias


def _twice(stack, x, **kwargs):
    first = stack(x, **kwargs).detach().clone()
    second = stack(x, **kwargs).detach().clone()
    return first, second


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
def test_a_branch_output_that_is_a_buffer_is_not_written(grad):
    torch.manual_seed(0)
    branch = _ReturnsBuffer(4)
    before = branch.offset.clone()
    lin = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    stack = ReversibleSequential(ReversibleBlock(lin, branch), ReversibleBlock(branch, lin))
    x = torch.randn(8, requires_grad=grad)  # 1-D: the branch returns the buffer itself
    first, second = _twice(stack, x)
    assert torch.equal(branch.offset, before)
    assert torch.equal(first, second)


def test_an_output_the_branch_caches_is_not_written():
    torch.manual_seed(0)
    f, g = _CachesOutput(4), _CachesOutput(4)
    stack = ReversibleSequential(ReversibleBlock(f, g))
    x = torch.randn(3, 8, requires_grad=True)
    stack(x)
    assert torch.equal(f.last, torch.tanh(f.lin(x[:, 4:])).detach())


def test_a_keyword_tensor_returned_as_is_is_not_written():
    stack = ReversibleSequential(ReversibleBlock(_ReturnsKeyword(), _ReturnsKeyword()))
    x = torch.randn(3, 8, requires_grad=True)
    bias = torch.ones(3, 4)
    first, second = _twice(stack, x, bias=bias)
    assert torch.equal(bias, torch.ones(3, 4))
    assert torch.equal(first, second)
