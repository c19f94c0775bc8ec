"""Codecs: the per-element bound holds, bytes are as stated, bad input raises."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from revckpt import InvalidArgumentError, InvalidInputTypeError
from revckpt.approx import FORMATS, Codec
from revckpt.approx.formats import NonFiniteInputError

CODECS = [
    Codec("bf16", None),
    Codec("bf16", "row"),
    *(Codec(f, s) for f in ("e4m3", "e5m2") for s in ("tensor", "row")),
    Codec("e4m3", "block", block_size=16),
    Codec("e5m2", "block", block_size=16),
    Codec("e4m3", "row", rounding="stochastic"),
    Codec("e5m2", "tensor", rounding="stochastic"),
    Codec("bf16", None, rounding="stochastic"),
]


@st.composite
def scaled_tensors(draw):
    rows = draw(st.integers(1, 6))
    cols = draw(st.sampled_from([16, 32, 48]))
    seed = draw(st.integers(0, 2**16))
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=gen)
    decades = draw(st.floats(-3, 3))
    row_scales = torch.logspace(-3, 3, rows) if rows > 1 else torch.tensor([10.0**decades])
    x = x * row_scales[:, None]
    if draw(st.booleans()):  # an outlier channel
        x[:, draw(st.integers(0, cols - 1))] *= 1000.0
    if draw(st.booleans()):  # exact zeros and tiny values (subnormal range of fp8 after scaling)
        x[0, :4] = 0.0
        x[-1, 4:8] *= 1e-9
    return x


@pytest.mark.parametrize("codec", CODECS, ids=str)
@settings(max_examples=15)
@given(x=scaled_tensors())
def test_roundtrip_within_per_element_bound(codec, x):
    x_hat = codec.roundtrip(x)
    assert x_hat.dtype == x.dtype and x_hat.shape == x.shape
    err = (x_hat.double() - x.double()).abs()
    assert bool((err <= codec.error_bound(x)).all())


def test_relative_error_matches_anchors():
    x = torch.randn(256, 512)
    rel = {
        c.format: ((c.roundtrip(x) - x).norm() / x.norm()).item()
        for c in (Codec("bf16", None), Codec("e4m3", "row"), Codec("e5m2", "row"))
    }
    # ANCHORS.md: bf16 1.7e-3, e4m3 2.6e-2, e5m2 5.3e-2 for N(0, 1).
    assert 1.2e-3 < rel["bf16"] < 2.4e-3
    assert 1.8e-2 < rel["e4m3"] < 3.6e-2
    assert 3.8e-2 < rel["e5m2"] < 7.0e-2


def test_bytes_per_element_and_nbytes():
    x = torch.randn(64, 256)
    for codec in CODECS:
        enc = codec.encode(x)
        assert enc.nbytes == pytest.approx(codec.bytes_per_element(256, x.numel()) * x.numel())
    assert Codec("bf16", None).encode(x).nbytes == x.numel() * 2
    assert Codec("e4m3", "row").encode(x).nbytes == x.numel() + 64 * 4


def test_unit_roundoff_and_eta():
    assert FORMATS["bf16"].unit_roundoff == 2**-8 and FORMATS["bf16"].eta == 2**-134
    assert FORMATS["e4m3"].unit_roundoff == 2**-4 and FORMATS["e4m3"].eta == 2**-10
    assert FORMATS["e5m2"].unit_roundoff == 2**-3 and FORMATS["e5m2"].eta == 2**-17
    for spec in FORMATS.values():  # eta is half the smallest subnormal of the dtype
        fi = torch.finfo(spec.dtype)
        assert spec.eta == fi.tiny * fi.eps / 2
        assert spec.fmax == fi.max


def test_scales_are_powers_of_two_and_fill_the_range():
    x = torch.randn(8, 32) * torch.logspace(-6, 6, 8)[:, None]
    codec = Codec("e4m3", "row")
    s = codec.scales(x)
    assert torch.equal(torch.exp2(torch.log2(s).round()), s)
    amax = (x.abs().amax(1, keepdim=True) * s).squeeze()
    assert bool((amax <= 448).all()) and bool((amax > 448 / 2).all())


def test_stochastic_rounding_is_unbiased_and_leaves_global_rng_alone():
    x = torch.full((20000,), 1.0 + 1 / 32)  # a quarter of the way between 1 and 1.125 in e4m3
    codec = Codec("e4m3", "tensor", rounding="stochastic")
    state = torch.get_rng_state()
    x_hat = codec.roundtrip(x)
    assert torch.equal(state, torch.get_rng_state())
    assert set(x_hat.unique().tolist()) == {1.0, 1.125}
    assert abs(x_hat.mean().item() - x[0].item()) < 2e-3
    nearest = Codec("e4m3", "tensor").roundtrip(x)
    assert nearest.unique().numel() == 1


def test_zero_and_empty_tensors():
    for codec in CODECS:
        assert torch.equal(codec.roundtrip(torch.zeros(3, 16)), torch.zeros(3, 16))
        assert codec.roundtrip(torch.zeros(0, 16)).shape == (0, 16)


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_non_finite_raises_instead_of_saturating(value):
    x = torch.randn(4, 16)
    x[1, 3] = value
    for fmt in ("e4m3", "e5m2", "bf16"):
        with pytest.raises(NonFiniteInputError, match="non-finite"):
            Codec(fmt, "row").encode(x)
    assert issubclass(NonFiniteInputError, InvalidArgumentError)


def test_bad_codec_options():
    with pytest.raises(InvalidArgumentError, match="unknown format 'fp4'"):
        Codec("fp4")
    with pytest.raises(InvalidArgumentError, match="unknown scaling 'col'"):
        Codec("e4m3", "col")
    with pytest.raises(InvalidArgumentError, match="needs a scale"):
        Codec("e4m3", None)
    with pytest.raises(InvalidArgumentError, match="unknown rounding"):
        Codec("e4m3", rounding="up")
    with pytest.raises(InvalidArgumentError, match="block_size"):
        Codec("e4m3", "block", block_size=0)


def test_integer_tensor_raises():
    with pytest.raises(InvalidInputTypeError, match="floating-point"):
        Codec("e4m3").encode(torch.arange(16))


def test_block_size_must_divide_row():
    with pytest.raises(
        InvalidArgumentError, match=r"does not divide the row length 100.*e\.g\. 100"
    ):
        Codec("e4m3", "block", block_size=128).encode(torch.randn(2, 100))


def test_float64_beyond_float32_range_is_not_saturated():
    x = torch.tensor([[1e300, 1.0], [3.0, -2e200]], dtype=torch.float64)
    for codec in (Codec("e4m3", "row"), Codec("e5m2", "tensor"), Codec("bf16", "row")):
        x_hat = codec.roundtrip(x)
        assert bool(((x_hat - x).abs() <= codec.error_bound(x)).all())
    for method in (Codec("bf16", None).encode, Codec("bf16", None).error_bound):
        with pytest.raises(InvalidArgumentError, match=r"without a scale.*scaling='row'") as err:
            method(x)
        assert not isinstance(err.value, NonFiniteInputError)


@pytest.mark.parametrize(
    ("codec", "value", "dtype"),
    [
        (Codec("e4m3", "row"), 65504.0, torch.float16),  # 255.875 -> 256, * 2**8 = 65536
        (Codec("e5m2", "row"), 65504.0, torch.float16),
        (Codec("bf16", None), 65504.0, torch.float16),  # 65536 in bf16
        (Codec("e4m3", "row"), 3.4e38, torch.float32),  # q / s = 2**128
        (Codec("bf16", "row"), 3.4e38, torch.float32),
        (Codec("bf16", None), 3.4e38, torch.float32),  # above bf16's max: saturates
        (Codec("e4m3", "row"), 3.3e38, torch.bfloat16),
        (Codec("e4m3", "row"), torch.finfo(torch.float64).max, torch.float64),
    ],
    ids=str,
)
def test_values_at_the_top_of_the_range_decode_finite(codec, value, dtype):
    x = torch.tensor([[value, -value, 1.0, 0.0]], dtype=dtype)
    x_hat = codec.roundtrip(x)
    assert bool(torch.isfinite(x_hat).all())
    assert bool(((x_hat.double() - x.double()).abs() <= codec.error_bound(x)).all())


@pytest.mark.parametrize("value", [1e-300, 1e-306, 1e-310, 5e-324])
@pytest.mark.parametrize("fmt", ["e4m3", "bf16"])
def test_tiny_float64_groups_keep_normal_scales(fmt, value):
    x = torch.tensor([[value, value / 3, 0.0]], dtype=torch.float64)
    codec = Codec(fmt, "row")
    s = codec.scales(x)
    fi = torch.finfo(torch.float64)
    assert fi.tiny <= float(s) <= 1 / fi.tiny
    x_hat = codec.roundtrip(x)
    assert bool(((x_hat - x).abs() <= codec.error_bound(x)).all())
    if value >= 1e-306:  # a normal group keeps its digits
        assert x_hat[0, 0] != 0


def test_zero_size_last_dimension():
    for codec in CODECS:
        assert codec.roundtrip(torch.zeros(4, 0)).shape == (4, 0)


@pytest.mark.parametrize("scaling", [None, "row", "tensor", "block"])
def test_a_codec_on_its_own_format_changes_nothing_and_bounds_it_by_zero(scaling):
    """A tensor already in the codec's format (a bfloat16 model's activation under bf16)
    comes back bitwise: scaling by a power of two up to the format's largest value is exact
    in the format itself. Its bound was ``k * (u * |x| + eta)``, an error for nothing."""
    codec = Codec("bf16", scaling, block_size=8)
    x = (torch.randn(6, 16) * torch.logspace(-3, 3, 16)).to(codec.spec.dtype)
    assert torch.equal(codec.roundtrip(x).view(torch.uint8), x.view(torch.uint8))
    assert torch.equal(codec.error_bound(x), torch.zeros(x.shape, dtype=torch.float64))
    wider = x.float() * (1 + 2**-12)  # not in the format: its bound is not 0
    assert bool((codec.error_bound(wider) > 0).all())
