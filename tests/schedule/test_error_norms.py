"""The codec errors' norms: in float32 where that is exact, never wrong at the extremes."""

import math

import pytest
import torch
from torch import nn

from revckpt import InvalidInputTypeError
from revckpt.schedule import profile
from revckpt.schedule.block_errors import _Against


def _reference(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.double() - ref.double()).norm() / ref.double().norm())


@pytest.mark.parametrize("magnitude", [1e-30, 1e-21, 1.0, 1e15])
def test_relative_errors_hold_at_every_magnitude(magnitude):
    """Squares of float32 elements below 1e-19 lose digits and below 1e-23 vanish: tiny
    gradients read an error of 0 in float32 alone."""
    gen = torch.Generator().manual_seed(0)
    ref = torch.randn(4096, generator=gen) * magnitude
    got = ref * (1 + 1e-3 * torch.randn(4096, generator=gen))
    assert _Against(ref)(got) == pytest.approx(_reference(got, ref), rel=1e-5)


def test_a_difference_that_overflows_float32_is_taken_in_float64():
    ref = torch.full((4,), 3e38)
    assert _Against(ref)(-ref) == pytest.approx(2.0)
    assert _Against(ref)(ref) == 0.0
    assert math.isnan(_Against(ref)(torch.full((4,), math.nan)))


class _TupleWithGrad(nn.Module):
    """A tensor under no_grad, a tuple with grad on."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, h):
        y = self.lin(h)
        return (y, y) if torch.is_grad_enabled() else y


def test_a_block_returning_a_tuple_in_training_is_named():
    chain = nn.Sequential(nn.Linear(8, 8), _TupleWithGrad())
    for codecs in ((), ("bf16",)):
        with pytest.raises(InvalidInputTypeError, match="_TupleWithGrad returned tuple"):
            profile(chain, torch.randn(2, 8), repeats=1, codecs=codecs)
