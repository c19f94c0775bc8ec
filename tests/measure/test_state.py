"""``measure.state.preserved``: a model run inside it is left as it was."""

import torch
from torch import nn

from revckpt.measure.state import preserved


def test_a_lazy_module_made_inside_keeps_its_sizes():
    """A lazy module's first forward makes it another class with its sizes set: those stay
    (put back, ``in_features`` read 0 beside a 3-wide weight)."""
    model = nn.Sequential(nn.LazyLinear(4), nn.ReLU())
    with preserved(model):
        model(torch.randn(2, 3)).sum().backward()
    assert type(model[0]) is nn.Linear and model[0].in_features == 3
    assert model[0].weight.grad is None


def test_attributes_and_buffer_tables_come_back_grads_too():
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    model[0].calls = 2
    ema = torch.zeros(3)
    model[1].register_buffer("ema", ema)
    stats = model[1].running_mean.clone()
    with preserved(model):
        model(torch.randn(4, 3)).sum().backward()
        model[0].calls += 1
        model[0].made = "here"
        model[1].ema = ema + 1  # rebound
        model[1].register_buffer("extra", torch.ones(1))
    assert model[0].calls == 2 and not hasattr(model[0], "made")
    assert model[1].ema is ema and torch.equal(ema, torch.zeros(3))
    assert "extra" not in model[1]._buffers
    assert torch.equal(model[1].running_mean, stats)
    assert all(p.grad is None for p in model.parameters())
