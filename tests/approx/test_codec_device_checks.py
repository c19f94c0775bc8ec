"""Codec checks that stay on the device, and scales computed without float64.

* ``defer_checks=True`` (the default off the CPU): encode reads nothing back to the host, and
  decode raises what encode would have raised.
* The exponent of every scale comes from ``frexp`` in the scaling dtype: the payload and the
  scales are bit for bit those of the float64 ``log2`` computation it replaced (kept below as
  the reference), over random tensors with every kind of extreme.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_codec_properties import CODECS, DTYPES, extreme_tensors
from torch.utils._python_dispatch import TorchDispatchMode

from revckpt import InvalidArgumentError
from revckpt.approx import Codec, Encoded, NonFiniteInputError
from revckpt.approx.formats import _generator, _work_dtype


def _reference_scales(codec: Codec, x: torch.Tensor) -> torch.Tensor | None:
    """The scales as computed before: ``log2`` in float64, stepped to the exact floor."""
    if codec.scaling is None:
        return None
    rows = codec._rows(x.detach())
    amax = rows.abs().amax(dim=1, keepdim=True).double() if rows.numel() else rows.double()
    fmax, work = codec.spec.fmax, _work_dtype(x.dtype)
    m = -math.log2(torch.finfo(work).tiny)
    safe = torch.where(amax > 0, amax, 1.0)
    exp = torch.floor(math.log2(fmax) - torch.log2(safe)).clamp(-m, m)
    exp = exp - (safe * torch.exp2(exp) > fmax).double()
    exp = exp + ((exp < m) & (safe * torch.exp2(exp + 1) <= fmax)).double()
    return torch.exp2(torch.where(amax > 0, exp, 0.0)).to(work)


def _reference_encode(codec: Codec, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Payload and scales as encode computed them before (finite, non-empty input)."""
    spec = codec.spec
    scales = _reference_scales(codec, x)
    t = x.to(_work_dtype(x.dtype))
    if scales is not None:
        t = (codec._rows(t) * scales).reshape(x.shape)
    t = t.clamp(-spec.fmax, spec.fmax)
    if codec.rounding == "stochastic":
        t = codec._stochastic(t)
    return t.to(spec.dtype), scales


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _assert_same_bits_as_before(codec: Codec, x: torch.Tensor) -> None:
    if codec.scaling is None and x.dtype == torch.float64:
        x = x.clamp(-torch.finfo(torch.float32).max, torch.finfo(torch.float32).max)
    gen = _generator(x.device)
    state = gen.get_state()
    payload, scales = _reference_encode(codec, x)
    for defer in (False, True):
        gen.set_state(state)  # stochastic rounding: the same draws for both
        enc = Codec(
            codec.format, codec.scaling, codec.block_size, codec.rounding, defer_checks=defer
        ).encode(x)
        assert enc.payload.dtype == payload.dtype
        assert torch.equal(_bits(enc.payload), _bits(payload)), f"{codec}, defer={defer}"
        if scales is None:
            assert enc.scales is None
        else:
            assert enc.scales.dtype == scales.dtype
            assert torch.equal(_bits(enc.scales), _bits(scales)), f"{codec}, defer={defer}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@settings(max_examples=40, derandomize=True, deadline=None)
@given(data=st.data())
def test_encoded_bits_equal_the_float64_computation(dtype, data):
    x = data.draw(extreme_tensors(dtype))
    if data.draw(st.booleans()):  # a single element, or a row of one
        x = x.flatten()[:1].reshape(data.draw(st.sampled_from([(), (1,), (1, 1)])))
    for codec in CODECS:
        if codec.scaling == "block" and x.shape[-1:] != () and x.shape[-1] % codec.block_size:
            continue
        if codec.scaling == "block" and x.dim() == 0:
            continue
        _assert_same_bits_as_before(codec, x)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_scales_bitwise_at_every_binade(dtype):
    """Every power of two of the dtype's range and its neighbours, as a group maximum."""
    fi = torch.finfo(dtype)
    lo, hi = int(math.log2(fi.smallest_normal * fi.eps)), int(math.log2(fi.max))
    powers = torch.exp2(torch.arange(lo, hi + 1, dtype=torch.float64))
    values = torch.cat([powers, powers * (1 + fi.eps), powers * (1 - fi.eps / 2), powers * 1.75])
    x = values.clamp(-fi.max, fi.max).to(dtype)
    x = torch.cat([x, torch.tensor([0.0, fi.max, fi.smallest_normal], dtype=dtype)])
    rows = x.reshape(-1, 1)  # one group per value
    for fmt in ("bf16", "e4m3", "e5m2"):
        codec = Codec(fmt, "row")
        assert torch.equal(_bits(codec.scales(rows)), _bits(_reference_scales(codec, rows)))


class _HostReads(TorchDispatchMode):
    """Counts ``aten._local_scalar_dense``: what ``.item()``, ``bool()``, ``float()`` and
    ``int()`` of a tensor call, the read that waits for an accelerator."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.reads += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("codec", CODECS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_deferred_encode_reads_nothing_back(codec, dtype):
    x = torch.randn(4, 16, dtype=dtype)
    x[0, 0] = math.inf  # even when there is something to report
    deferred = Codec(codec.format, codec.scaling, 8, codec.rounding, defer_checks=True)
    with _HostReads() as mode:
        deferred.encode(x)
    assert mode.reads == 0
    eager = Codec(codec.format, codec.scaling, 8, codec.rounding, defer_checks=False)
    with _HostReads() as mode:  # the check the deferred path leaves out
        eager.encode(x.nan_to_num(posinf=1.0))
    assert mode.reads >= 1


def test_checks_are_deferred_off_the_cpu_by_default():
    codec = Codec("e4m3")
    assert not codec.defers_checks(torch.device("cpu"))
    assert codec.defers_checks(torch.device("meta"))
    assert codec.defers_checks(torch.device("cuda"))
    assert Codec("e4m3", defer_checks=True).defers_checks(torch.device("cpu"))
    assert not Codec("e4m3", defer_checks=False).defers_checks(torch.device("cuda"))
    with pytest.raises(InvalidArgumentError, match="defer_checks='yes'"):
        Codec("e4m3", defer_checks="yes")


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("codec", CODECS, ids=str)
def test_deferred_non_finite_raises_at_decode(codec, value):
    x = torch.randn(4, 16)
    x[1, 3] = value
    deferred = Codec(codec.format, codec.scaling, 8, codec.rounding, defer_checks=True)
    enc = deferred.encode(x)
    # as recompute keeps it: only the payload and the scales survive to backward
    rebuilt = Encoded(enc.payload, enc.scales, enc.dtype, deferred)
    encodeds = [enc, rebuilt]
    if codec.scaling is not None:  # scales are read at every decode: a payload moved to the CPU
        encodeds.append(Encoded(enc.payload, enc.scales, enc.dtype, codec))
    for encoded in encodeds:
        with pytest.raises(NonFiniteInputError, match=r"non-finite.*Found at decode") as err:
            encoded.decode()
        assert isinstance(err.value, InvalidArgumentError)


def test_deferred_float64_beyond_float32_range_raises_at_decode():
    x = torch.tensor([[1e300, 1.0], [3.0, -2e200]], dtype=torch.float64)
    codec = Codec("bf16", None, defer_checks=True)
    enc = codec.encode(x)
    with pytest.raises(InvalidArgumentError, match=r"without a scale.*scaling='row'") as err:
        codec.decode(enc)
    assert not isinstance(err.value, NonFiniteInputError)
    nan = x.clone()
    nan[0, 1] = math.nan  # both: the non-finite value is what it reports
    with pytest.raises(NonFiniteInputError):
        codec.roundtrip(nan)


@pytest.mark.parametrize("codec", CODECS, ids=str)
def test_deferred_valid_input_decodes_as_eager(codec):
    x = torch.randn(3, 16, dtype=torch.float64) * torch.logspace(-30, 30, 3)[:, None].double()
    kwargs = {"block_size": 8, "rounding": "nearest"}
    eager = Codec(codec.format, codec.scaling, defer_checks=False, **kwargs).roundtrip(x)
    deferred = Codec(codec.format, codec.scaling, defer_checks=True, **kwargs).roundtrip(x)
    assert torch.equal(eager, deferred)
