"""The input checks of the codecs (:mod:`revckpt.approx.formats`), now or deferred.

Checked now (:meth:`Codec.defers_checks` false; the CPU by default), a codec reads one value on
the host per encode: ``isfinite(amax).all()`` of the group maxima it computes anyway (without
a scale, ``max |x|`` itself, from one ``aminmax`` pass: it also gives float64's range and
whether bf16 needs its clamp). Deferred
(elsewhere by default), encode keeps the check on the device and leaves a mark in what it
returns, which no valid payload carries:

* with a scale, the scale of every group that holds inf or nan is nan (valid scales are finite
  powers of two);
* without one (bf16), inf and nan elements become nan and float64 values beyond float32's
  range become inf (the clamp to ``fmax`` puts every other value below it).

:meth:`Codec.decode` reads the mark (one host read, in backward) and raises what encode would
have raised. The mark lives in the payload and the scales themselves, so it survives every
caller that keeps only those (``save_for_backward``) and rebuilds the :class:`Encoded`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from ..errors import InvalidArgumentError, InvalidInputTypeError

if TYPE_CHECKING:
    from .formats import Codec, Encoded

UNSCALED_LIMIT = torch.finfo(torch.float32).max  # the largest |x| bf16 takes without a scale


class NonFiniteInputError(InvalidArgumentError):
    """A tensor sent to a codec holds inf or nan (a cast would saturate it silently)."""


def check_type(x: object) -> None:
    """Raise unless ``x`` is a floating-point tensor (a codec's first check: no tensor data
    read)."""
    if not isinstance(x, torch.Tensor):
        raise InvalidInputTypeError(
            f"a codec encodes tensors, got {type(x).__name__}; pass a floating-point tensor"
        )
    if not x.is_floating_point():
        raise InvalidInputTypeError(
            f"cannot compress a {x.dtype} tensor: codecs take floating-point tensors; keep "
            "integer and boolean tensors (indices, masks) exact"
        )


def raise_if_invalid(codec: Codec, x: torch.Tensor, amax: torch.Tensor) -> float | None:
    """The checks now, on the non-empty ``x``: one host read, of ``amax`` (the group maxima,
    :meth:`Codec._amax`: nan or inf where a group holds nan or inf), and the counts when it
    fails. Returns ``max |x|`` where ``amax`` is one value (without a scale, or one scale for
    the tensor), else ``None``. (``isfinite(x).all()`` on ``x`` itself reads it too, but on the
    CPU it runs about 18x slower than the one-pass ``aminmax`` that gives the maximum.)"""
    top = float(amax) if amax.numel() == 1 else None
    finite = math.isfinite(top) if top is not None else bool(torch.isfinite(amax).all())
    if not finite:
        bad = int((~torch.isfinite(x)).sum())
        raise NonFiniteInputError(
            f"{bad} non-finite value(s) (inf or nan) in a tensor of shape {tuple(x.shape)} "
            f"sent to the {codec.format} codec; a cast would silently turn inf into "
            f"{codec.spec.fmax:g}. Find where the model overflows (e.g. with "
            "torch.autograd.detect_anomaly) or keep this boundary exact (store=None)"
        )
    unscaled64 = codec.scaling is None and x.dtype == torch.float64
    if top is not None and unscaled64 and top > UNSCALED_LIMIT:
        raise InvalidArgumentError(
            f"values up to {top:.3g} exceed what {codec.format} holds without a scale "
            + _UNSCALED_ADVICE.format(codec=codec, limit=UNSCALED_LIMIT)
        )
    return top


_UNSCALED_ADVICE = (
    "(|x| <= {limit:.5g}, float32's range; {codec.format}'s largest value is "
    "{codec.spec.fmax:.5g}). Use scaling='row' (or 'block', 'tensor'): the scale brings "
    "float64 values of any size into range"
)


def mark_scales(scales: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """The deferred check of a scaled codec: nan for the scale of every group that holds inf
    or nan (a valid scale is a finite power of two), on the device."""
    return torch.where(torch.isfinite(amax), scales, math.nan)


def mark_unscaled(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The deferred check without a scale, on ``t`` (``x`` clamped and rounded, about to be
    cast to bf16): nan where ``x`` holds inf or nan, inf where float64 ``x`` lies beyond
    float32's range; the clamp put every other value at or below bf16's ``fmax``."""
    t = torch.where(torch.isfinite(x), t, math.nan)
    if x.dtype == torch.float64:
        t = torch.where(x.abs() > UNSCALED_LIMIT, math.inf, t)
    return t


def raise_if_marked(codec: Codec, encoded: Encoded) -> None:
    """The deferred check, at decode: raise what :meth:`Codec.encode` did not (one host read
    of a flag)."""
    where = encoded.scales if encoded.scales is not None else encoded.payload
    if bool(torch.isfinite(where).all()):
        return
    shape = tuple(encoded.payload.shape)
    deferral = (
        f" (Found at decode: on {encoded.payload.device.type} the codec checks its input "
        "there, not at encode, to spare a host synchronisation per encode; "
        "Codec(defer_checks=False) checks at encode.)"
    )
    if encoded.scales is None and not bool(torch.isnan(where).any()):
        raise InvalidArgumentError(
            f"a float64 tensor of shape {shape} held values beyond what {codec.format} holds "
            "without a scale "
            + _UNSCALED_ADVICE.format(codec=codec, limit=UNSCALED_LIMIT)
            + deferral
        )
    bad = int((~torch.isfinite(where)).sum())
    what = "element(s)" if encoded.scales is None else f"of {where.numel()} scale group(s)"
    raise NonFiniteInputError(
        f"a tensor of shape {shape} sent to the {codec.format} codec held non-finite values "
        f"(inf or nan) in {bad} {what}; a cast would silently have turned inf into "
        f"{codec.spec.fmax:g}. Find where the model overflows (e.g. with "
        "torch.autograd.detect_anomaly) or keep this boundary exact (store=None)" + deferral
    )
