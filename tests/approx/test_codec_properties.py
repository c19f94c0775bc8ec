"""Every codec, every source dtype, the whole finite range: decode is finite and within
``Codec.error_bound`` (normal values, subnormals, exactly +-max, zeros, rows decades apart)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from revckpt import InvalidArgumentError
from revckpt.approx import Codec

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
BLOCK = 8
CODECS = [
    *(
        Codec("bf16", s, block_size=BLOCK, rounding=r)
        for s in (None, "tensor", "row", "block")
        for r in ("nearest", "stochastic")
    ),
    *(
        Codec(f, s, block_size=BLOCK, rounding=r)
        for f in ("e4m3", "e5m2")
        for s in ("tensor", "row", "block")
        for r in ("nearest", "stochastic")
    ),
]
KINDS = ("normal", "wide", "subnormal", "max", "near_max", "zero", "smallest")


def _row(kind: str, n: int, dtype: torch.dtype, centre: float, gen: torch.Generator):
    """One row of ``kind`` in float64, every value finite in ``dtype`` (before the cast)."""
    fi = torch.finfo(dtype)
    lo, hi = math.log2(fi.smallest_normal), math.log2(fi.max)
    sign = torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0).double()
    u = torch.rand(n, generator=gen, dtype=torch.float64)
    if kind == "normal":  # one magnitude, +-2 binades around a point of the range
        e = lo + centre * (hi - lo) + 4 * u - 2
        return sign * torch.exp2(e.clamp(lo, hi))
    if kind == "wide":  # every element its own magnitude, anywhere in the normal range
        return sign * torch.exp2(lo + (hi - lo) * u)
    if kind == "subnormal":
        return sign * u * fi.smallest_normal
    if kind == "max":
        return sign * fi.max
    if kind == "near_max":  # the last ~3% below max: rounds up to the next power of two
        return sign * fi.max * (1 - u * 2**-5)
    if kind == "smallest":  # the smallest subnormal
        return sign * fi.smallest_normal * fi.eps
    return torch.zeros(n, dtype=torch.float64)


@st.composite
def extreme_tensors(draw, dtype: torch.dtype) -> torch.Tensor:
    """Rows of different kinds (a row of subnormals next to a row at max), some sprinkled
    with exact zeros, +-max and subnormals."""
    rows = draw(st.integers(1, 4))
    cols = draw(st.sampled_from([BLOCK, 2 * BLOCK]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    kinds = draw(st.lists(st.sampled_from(KINDS), min_size=rows, max_size=rows))
    centres = draw(st.lists(st.floats(0, 1), min_size=rows, max_size=rows))
    x = torch.stack([_row(k, cols, dtype, c, gen) for k, c in zip(kinds, centres, strict=True)])
    if draw(st.booleans()):
        fi = torch.finfo(dtype)
        specials = torch.tensor([0.0, fi.max, -fi.max, fi.smallest_normal * fi.eps], dtype=x.dtype)
        pick = torch.randint(0, 4, x.shape, generator=gen)
        x = torch.where(torch.rand(x.shape, generator=gen) < 0.25, specials[pick], x)
    fmax = torch.finfo(dtype).max
    return x.clamp(-fmax, fmax).to(dtype)


def _assert_within_bound(codec: Codec, x: torch.Tensor) -> None:
    if codec.scaling is None and float(x.abs().amax()) > torch.finfo(torch.float32).max:
        # bf16 without a scale covers float32's range; beyond it, it says so up front
        with pytest.raises(InvalidArgumentError, match="scaling='row'"):
            codec.encode(x)
        x = x.clamp(-torch.finfo(torch.float32).max, torch.finfo(torch.float32).max)
    x_hat = codec.roundtrip(x)
    assert x_hat.dtype == x.dtype and x_hat.shape == x.shape
    assert bool(torch.isfinite(x_hat).all()), f"{codec}: {x[~torch.isfinite(x_hat)].tolist()}"
    err = (x_hat.double() - x.double()).abs()
    bad = err > codec.error_bound(x)
    assert not bool(bad.any()), f"{codec}: x={x[bad].tolist()} x_hat={x_hat[bad].tolist()}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@settings(max_examples=50, derandomize=True, deadline=None)
@given(data=st.data())
def test_every_codec_decodes_finite_and_within_bound(dtype, data):
    x = data.draw(extreme_tensors(dtype))
    for codec in CODECS:
        _assert_within_bound(codec, x)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("codec", CODECS, ids=str)
def test_extremes_of_the_range(codec, dtype):
    """The edges, explicitly: +-max, near max, the smallest normal and subnormal, zero, and a
    subnormal row next to a row at max."""
    fi = torch.finfo(dtype)
    tiny, sub = fi.smallest_normal, fi.smallest_normal * fi.eps
    edges = [fi.max, -fi.max, fi.max * (1 - 2**-6), tiny, sub, -sub, 0.0, 1.0]
    rows = [
        edges,
        [v / 3 for v in edges[:3]] + [tiny * 0.75, sub * 3, 2.0, -0.5, 0.0],
        [sub * k for k in range(1, 9)],
        [fi.max] * 8,
    ]
    x = torch.tensor(rows, dtype=torch.float64).clamp(-fi.max, fi.max).to(dtype)
    _assert_within_bound(codec, x)
    _assert_within_bound(codec, x[2:3])  # a row of subnormals on its own


def _formula_roundtrip(codec: Codec, x: torch.Tensor) -> torch.Tensor:
    """The module docstring's formula with both clamps applied, round to nearest: what the
    codec skips where a clamp cannot bind must not change a bit."""
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    spec, xmax = codec.spec, torch.finfo(x.dtype).max
    scales = codec.scales(x)
    t = x.to(work)
    if scales is not None:
        t = (codec._rows(t) * scales).reshape(x.shape)
    q = t.clamp(-spec.fmax, spec.fmax).to(spec.dtype).to(work)
    if scales is not None:
        q = (codec._rows(q) / scales).reshape(x.shape)
    return q.clamp(-xmax, xmax).to(x.dtype)


NEAREST = [c for c in CODECS if c.rounding == "nearest"]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@settings(max_examples=50, derandomize=True, deadline=None)
@given(data=st.data())
def test_the_round_trip_is_the_formula_bitwise(dtype, data):
    x = data.draw(extreme_tensors(dtype))
    for codec in NEAREST:
        if codec.scaling is None and dtype == torch.float64:
            x = x.clamp(-torch.finfo(torch.float32).max, torch.finfo(torch.float32).max)
        got, want = codec.roundtrip(x), _formula_roundtrip(codec, x)
        assert torch.equal(got, want), f"{codec} {dtype}: {x[got != want].tolist()}"


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "bf16"])
@pytest.mark.parametrize("wide", [torch.float32, torch.float64])
def test_widening_a_payload_is_the_cast_bitwise(fmt, wide):
    """Every bit pattern of the format (nan and inf included) widens to the cast's bits."""
    from revckpt.approx.number_formats import FORMATS, widen

    dtype = FORMATS[fmt].dtype
    ints = {1: torch.uint8, 2: torch.int16}[FORMATS[fmt].itemsize]
    lo, hi = torch.iinfo(ints).min, torch.iinfo(ints).max
    every = torch.arange(lo, hi + 1, dtype=torch.int64).to(ints).view(dtype).reshape(-1, 16)
    as_int = {torch.float32: torch.int32, torch.float64: torch.int64}[wide]
    for payload in (every, every.t(), every[:, ::3], every[0, 0]):
        got = widen(payload, wide)
        assert got.shape == payload.shape and got.dtype == wide
        assert torch.equal(got.view(as_int), payload.to(wide).view(as_int))
