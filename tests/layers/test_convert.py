import copy

import pytest
import torch
from torch import nn

from revckpt import RevckptError
from revckpt.layers import ReversibleStack, convert_to_reversible
from revckpt.layers.blocks import AttentionBranch, MLPBranch


class Layer(nn.Module):
    """A pre-norm residual transformer layer with named branches."""

    def __init__(self, dim):
        super().__init__()
        self.attn = AttentionBranch(dim, 2)  # holds its own LayerNorm
        self.mlp = MLPBranch(dim, 4 * dim, norm="layer")

    def forward(self, x):
        x = x + self.attn(x)
        return x + self.mlp(x)


class Model(nn.Module):
    def __init__(self, dim=16, depth=4):
        super().__init__()
        self.embed = nn.Linear(dim, dim)
        self.layers = nn.Sequential(*[Layer(dim) for _ in range(depth)])
        self.head = nn.Linear(dim, 3)

    def forward(self, x):
        return self.head(self.layers(self.embed(x)))


def test_convert_shares_parameters_and_trains():
    torch.manual_seed(0)
    model = Model()
    before = {id(p) for p in model.layers.parameters()}
    original = copy.deepcopy(model)
    x = torch.randn(2, 5, 16)
    converted = convert_to_reversible(model, branches=("attn", "mlp"))
    assert converted is model and isinstance(model.layers, ReversibleStack)
    assert {id(p) for p in model.layers.parameters()} == before  # same Parameter objects
    out = model(x)
    out.sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    # an architecture change: report how far the output moved (printed in the docs)
    moved = ((out - original(x)).norm() / original(x).norm()).item()
    print(f"relative output change after conversion at init: {moved:.3f}")
    assert moved > 0


def test_convert_a_sequential_directly_with_a_function_and_options():
    torch.manual_seed(0)
    stack = nn.Sequential(*[Layer(8) for _ in range(3)])
    rev = convert_to_reversible(
        stack, branches=lambda layer: (layer.attn, layer.mlp), anchor_every=2
    )
    assert isinstance(rev, ReversibleStack) and rev.rev.anchor_every == 2
    rev(torch.randn(2, 3, 8)).sum().backward()


def test_convert_errors():
    with pytest.raises(RevckptError, match="no submodule named 'attention'"):
        convert_to_reversible(Model(), branches=("attention", "mlp"))
    with pytest.raises(RevckptError, match=r"no nn\.Sequential stack to convert"):
        convert_to_reversible(nn.Linear(2, 2), branches=("a", "b"))
    with pytest.raises(RevckptError, match=r"must return two nn\.Modules"):
        convert_to_reversible(nn.Sequential(Layer(8)), branches=lambda layer: layer.attn)
    with pytest.raises(RevckptError, match="rejected them all"):
        convert_to_reversible(
            Model(), branches=("attn", "mlp"), module_filter_fn=lambda m, fqn: False
        )
