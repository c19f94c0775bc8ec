"""Codecs that keep a tensor in bf16 or fp8 (e4m3 / e5m2), with explicit scaling and rounding.

A :class:`Codec` encodes a floating tensor ``x`` into a low-precision payload ``q`` and a
float32 scale per group of elements (one group per tensor, per row, or per block of
``block_size`` consecutive elements of a row), and decodes it back::

    s = 2 ** clamp(floor(log2(fmax / amax(group))), -m, m)   (a power of two: scaling is exact)
    q = round(clamp(x * s, -fmax, fmax))                     (to the format: nearest or stochastic)
    x_hat = clamp(q / s, -xmax, xmax)                        (in the source dtype)

The scaling runs in float64 for float64 input and in float32 otherwise, the exponent included
(from :func:`torch.frexp`, integer arithmetic: exact, no logarithm); ``2**-m`` is the smallest
normal number of that dtype (``m = 126`` or ``1022``), so both ``s`` and ``1 / s`` are normal
numbers there (the clamp binds only for groups below ``fmax * 2**-m``, e.g. float32 subnormals,
and leaves them a coarser but honest ``eta / s``). ``xmax`` is the largest finite value of the
source dtype: rounding may carry ``q`` up to the next power of two (float16 ``65504 * 2**-8 =
255.875`` rounds to 256 in e4m3, and ``256 / 2**-8 = 65536`` is inf in float16), and the clamp
brings it back. Every clamp moves towards ``x`` (which lies in the range), so none adds error.
A clamp that cannot bind is skipped, bitwise the same: the one after scaling (``amax * s <=
fmax`` exactly), bf16's where ``max |x| <= fmax`` (the check reads that maximum anyway, on the
CPU), decode's where ``fmax / min(s) <= xmax`` (and bf16 into float32 or float64).

Every element obeys the per-element bound (:meth:`Codec.error_bound`)::

    |x_hat - x| <= k * (u * |x| + eta / s)

with ``u`` the format's unit roundoff (``2**-p`` for ``p`` significand bits), ``eta`` the
absolute error bound of its subnormal range (half the smallest subnormal), and ``k = 1`` for
round-to-nearest, ``k = 2`` for stochastic rounding (which moves by less than one ulp).

========  ===========  ========  ============  ===========
format    torch dtype  fmax      u             eta
========  ===========  ========  ============  ===========
bf16      bfloat16     3.39e38   2**-8         2**-134
e4m3      float8_e4m3fn 448      2**-4         2**-10
e5m2      float8_e5m2  57344     2**-3         2**-17
========  ===========  ========  ============  ===========

Why explicit: ``x.to(torch.float8_e4m3fn)`` turns ``inf`` into 448 and every value beyond 448
into 448 without a word. Here non-finite input raises :class:`NonFiniteInputError` (an
:class:`~revckpt.InvalidArgumentError`): at encode on the CPU, at decode on an accelerator, where
encode keeps its check on the device and never synchronises with the host (``defer_checks``;
:mod:`revckpt.approx._checks` says how), scaling puts every group inside the range, and the clamp
before the cast is a guard the scaling makes inactive. bf16 has (almost) the range of float32 and
needs no scale (``scaling=None``): it takes every value of float32's range, and the few above its
own ``fmax`` (``3.3895e38 < |x| <= 3.4028e38``) saturate to ``fmax``, within ``u * |x|`` because
``|x| < fmax / (1 - u) = 2**128``. float64 input beyond float32's range raises
:class:`~revckpt.InvalidArgumentError` there (use a scale); fp8 always needs one. Stochastic
rounding draws from a generator of its own (seeded, one per device), so it does not move the
global random stream that dropout and replay rely on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from ..errors import InvalidArgumentError
from ._checks import (
    NonFiniteInputError,
    check_type,
    mark_scales,
    mark_unscaled,
    raise_if_invalid,
    raise_if_marked,
)
from ._rounding import generator as _generator
from ._rounding import stochastic_round
from ._scaling import power_of_two_scales as _power_of_two_scales
from ._scaling import work_dtype as _work_dtype
from .number_formats import FORMATS, FormatSpec, widen

__all__ = ["FORMATS", "Codec", "Encoded", "FormatSpec", "NonFiniteInputError"]

Scaling = Literal["tensor", "row", "block"]
Rounding = Literal["nearest", "stochastic"]


@dataclass(frozen=True)
class Encoded:
    """A compressed tensor: the payload (shape of the original), the float32 scales (shape
    ``(groups, 1)`` over the flattened rows, or ``None``) and what is needed to decode."""

    payload: torch.Tensor
    scales: torch.Tensor | None
    dtype: torch.dtype
    codec: Codec

    @property
    def nbytes(self) -> int:
        """Bytes held: payload plus scales."""
        n = self.payload.numel() * self.payload.element_size()
        if self.scales is not None:
            n += self.scales.numel() * self.scales.element_size()
        return n

    def decode(self) -> torch.Tensor:
        """The tensor back in its original dtype (scales applied)."""
        return self.codec.decode(self)


@dataclass(frozen=True)
class Codec:
    """Compress a floating tensor to ``format`` with ``scaling`` and ``rounding``.

    Args:
        format: ``"bf16"``, ``"e4m3"`` or ``"e5m2"``.
        scaling: ``"tensor"`` (one scale), ``"row"`` (one per row of the last dimension),
            ``"block"`` (one per ``block_size`` consecutive elements of a row) or ``None``
            (bf16 only; takes ``|x| <= 3.4028e38``, float32's range: larger float64 values
            raise :class:`~revckpt.InvalidArgumentError`, use a scale for them).
        block_size: elements per scale for ``"block"`` scaling; must divide the row length.
        rounding: ``"nearest"`` (ties to even) or ``"stochastic"`` (unbiased: rounds up with
            probability equal to the distance from the lower neighbour, in ulps).
        defer_checks: where non-finite input (and float64 input beyond float32's range without
            a scale) raises: ``False``, at :meth:`encode` (one host read of a flag per encode,
            which on an accelerator waits for the device); ``True``, at :meth:`decode` (encode
            only marks the payload, on the device, so the forward never synchronises); ``None``
            (default), at encode on the CPU, where the read costs nothing, at decode elsewhere.
    """

    format: str = "e4m3"
    scaling: Scaling | None = "row"
    block_size: int = 128
    rounding: Rounding = "nearest"
    defer_checks: bool | None = None

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise InvalidArgumentError(
                f"unknown format {self.format!r}; use one of {sorted(FORMATS)} "
                "(bf16 halves the bytes, e4m3 / e5m2 quarter them)"
            )
        if self.scaling not in ("tensor", "row", "block", None):
            raise InvalidArgumentError(
                f"unknown scaling {self.scaling!r}; use 'tensor', 'row', 'block' or None (bf16)"
            )
        if self.scaling is None and self.format != "bf16":
            raise InvalidArgumentError(
                f"{self.format} needs a scale (its largest value is {self.spec.fmax:g}): use "
                "scaling='row' (default), 'block' or 'tensor'"
            )
        if self.scaling == "block" and (
            isinstance(self.block_size, bool)
            or not isinstance(self.block_size, int)
            or self.block_size < 1
        ):
            raise InvalidArgumentError(
                f"block_size={self.block_size!r}: pass a positive int, e.g. 128"
            )
        if self.rounding not in ("nearest", "stochastic"):
            raise InvalidArgumentError(
                f"unknown rounding {self.rounding!r}; use 'nearest' or 'stochastic'"
            )
        if self.defer_checks not in (None, True, False):
            raise InvalidArgumentError(
                f"defer_checks={self.defer_checks!r}: pass True (check at decode), False "
                "(check at encode) or None (at encode on the CPU, at decode elsewhere)"
            )

    @property
    def spec(self) -> FormatSpec:
        """The format's constants (dtype, largest value, unit roundoff)."""
        return FORMATS[self.format]

    @property
    def unit_roundoff(self) -> float:
        """``u`` of the format (round-to-nearest, normal range)."""
        return self.spec.unit_roundoff

    @property
    def k(self) -> int:
        """Rounding factor of the bound: 1 for nearest, 2 for stochastic."""
        return 1 if self.rounding == "nearest" else 2

    def bytes_per_element(self, row_length: int, numel: int | None = None) -> float:
        """Bytes kept per element, scales included: ``itemsize + 4 / group_size``."""
        size = self.spec.itemsize
        if self.scaling == "row":
            return size + 4 / row_length
        if self.scaling == "block":
            return size + 4 / self.block_size
        if self.scaling == "tensor":
            return size + 4 / (numel or row_length)
        return float(size)

    # -- encoding --------------------------------------------------------------------------

    def defers_checks(self, device: torch.device) -> bool:
        """Whether :meth:`encode` on ``device`` leaves its input checks to :meth:`decode`:
        ``defer_checks`` if set, else everywhere but the CPU (where a check costs no
        synchronisation)."""
        return self.defer_checks if self.defer_checks is not None else device.type != "cpu"

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` as a 2-D ``(groups, group_size)`` view: the unit that shares a scale."""
        if x.numel() == 0:
            return x.reshape(0, 1)
        flat = x.reshape(1, -1) if x.dim() == 0 else x.reshape(-1, x.shape[-1])
        if self.scaling == "tensor":
            return flat.reshape(1, -1)
        if self.scaling == "block":
            n = flat.shape[1]
            if n % self.block_size:
                divisors = [d for d in range(min(n, self.block_size), 0, -1) if n % d == 0][:3]
                raise InvalidArgumentError(
                    f"block_size={self.block_size} does not divide the row length {n} of a "
                    f"tensor of shape {tuple(x.shape)}; choose a block_size that divides it "
                    f"(e.g. {', '.join(map(str, divisors))}), use scaling='row', or pad the "
                    "last dimension to a multiple of the block size"
                )
            return flat.reshape(-1, self.block_size)
        return flat

    def _amax(self, x: torch.Tensor) -> torch.Tensor:
        """``max |x|`` per group, shape ``(groups, 1)`` (of the whole tensor, shape ``()``,
        without a scale); nan or inf where the group holds nan or inf. ``x`` is not empty."""
        if self.scaling is None:  # one pass, no temporary (abs would make one); nan propagates
            lo, hi = torch.aminmax(x)
            return torch.maximum(-lo, hi)
        return self._rows(x).abs().amax(dim=1, keepdim=True)

    def check(self, x: torch.Tensor) -> None:
        """Raise if ``x`` cannot be encoded: not a tensor, not floating point, not finite
        (:class:`NonFiniteInputError`), or, without a scale, beyond float32's range. Always
        checks now (one host read of a flag), whatever ``defer_checks`` says."""
        check_type(x)
        if x.numel():
            with torch.no_grad():
                x = x.detach()
                raise_if_invalid(self, x, self._amax(x))

    def scales(self, x: torch.Tensor) -> torch.Tensor | None:
        """The scale of each group, shape ``(groups, 1)``, in the dtype the scaling runs in
        (float64 for float64 input, float32 otherwise)::

            s = 2 ** e,   e = clamp(floor(log2(fmax / amax)), -m, m),   2**-m = finfo.tiny

        so ``amax * s <= fmax`` and both ``s`` and ``1 / s`` are normal; ``s = 1`` for zeros.
        ``e`` comes exactly from the exponents and significands of ``amax`` and ``fmax``
        (:func:`torch.frexp`) and ``s`` from its bits: no logarithm, no rounding, in the
        scaling dtype on the input's device."""
        if self.scaling is None:
            return None
        x = x.detach()
        if x.numel() == 0:
            return self._rows(x).to(_work_dtype(x.dtype))
        return _power_of_two_scales(self._amax(x), self.spec.fmax, _work_dtype(x.dtype))

    def encode(self, x: torch.Tensor) -> Encoded:
        """Compress ``x``. Raises on non-floating input at once; on non-finite input (and,
        without a scale, float64 beyond float32's range) at once where :meth:`defers_checks`
        is false (the CPU by default), else at :meth:`decode`: the check stays on the device
        (no host synchronisation here) and marks the payload (nan scales, or nan and inf
        elements without a scale) so that decode finds it."""
        check_type(x)
        with torch.no_grad():
            x = x.detach()
            spec = self.spec
            if x.numel() == 0:
                return Encoded(
                    torch.empty(x.shape, dtype=spec.dtype, device=x.device), None, x.dtype, self
                )
            deferred = self.defers_checks(x.device)
            work = _work_dtype(x.dtype)
            scales = None
            if self.scaling is not None:
                amax = self._amax(x)
                if not deferred:
                    raise_if_invalid(self, x, amax)
                scales = _power_of_two_scales(amax, spec.fmax, work)
                if deferred:
                    scales = mark_scales(scales, amax)
                # no clamp: amax * s <= fmax exactly, so every scaled element is in range
                t = (self._rows(x.to(work)) * scales).reshape(x.shape)
            else:
                t = x.to(work)
                top = None if deferred else raise_if_invalid(self, x, self._amax(x))
                if top is None or top > spec.fmax:  # saturates bf16 within u * |x|
                    t = t.clamp(-spec.fmax, spec.fmax)
            if self.rounding == "stochastic":
                t = self._stochastic(t)
            if deferred and self.scaling is None:
                t = mark_unscaled(x, t)
            payload = t.to(spec.dtype)
        return Encoded(payload=payload, scales=scales, dtype=x.dtype, codec=self)

    def _stochastic(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (within range) rounded stochastically to the format
        (:func:`~revckpt.approx._rounding.stochastic_round`), from this device's generator."""
        return stochastic_round(t, self.spec, _generator(t.device))

    def decode(self, encoded: Encoded) -> torch.Tensor:
        """``x_hat = clamp(q / s, -xmax, xmax)`` in the original dtype, ``xmax`` its largest
        finite value (``q`` rounded up past it, e.g. float16 65504 -> 65536, comes back to it).
        Raises here what a deferred :meth:`encode` would have raised
        (:class:`NonFiniteInputError`, or the range error without a scale): one host read of
        a flag (with a scale, always: the scales are few; without one, where encode defers)."""
        payload, scales = encoded.payload, encoded.scales
        xmax = torch.finfo(encoded.dtype).max
        if scales is not None:
            # scales are few: read their mark always (a payload moved off the device included),
            # and with it the largest magnitude decode can give, fmax / min(s)
            smallest = float(scales.amin()) if scales.numel() else 1.0
            if not math.isfinite(smallest):  # nan: a marked scale
                raise_if_marked(self, encoded)
            clamp = self.spec.fmax / smallest > xmax
        else:
            if payload.numel() and self.defers_checks(payload.device):
                raise_if_marked(self, encoded)
            clamp = self.spec.fmax > xmax  # bf16 into float16
        t = widen(payload, _work_dtype(encoded.dtype))
        if scales is not None:
            t = (self._rows(t) / scales).reshape(payload.shape)
        if clamp:
            t = t.clamp(-xmax, xmax)
        return t.to(encoded.dtype)

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        """``decode(encode(x))``."""
        return self.decode(self.encode(x))

    def error_bound(self, x: torch.Tensor) -> torch.Tensor:
        """Per-element bound ``k * (u * |x| + eta / s)`` on ``|decode(encode(x)) - x|``
        (float64, shape of ``x``; 0 where ``x`` is 0, which every rounding keeps exact, and
        for ``x`` in the codec's own format: its scales are powers of two that keep every
        element in range, exact in the format)."""
        self.check(x)
        spec = self.spec
        a = x.detach().double().abs()
        if x.dtype == spec.dtype:
            return torch.zeros_like(a)
        scales = self.scales(x)
        if scales is None:
            floor = torch.full_like(a, spec.eta)
        else:
            floor = (spec.eta / self._rows(torch.ones_like(a)).mul(scales.double())).reshape(
                a.shape
            )
        # zero is representable and every rounding mode keeps it: no error there
        return torch.where(a == 0, 0.0, self.k * (spec.unit_roundoff * a + floor))

    def __str__(self) -> str:
        scaling = "" if self.scaling is None else f", {self.scaling}"
        if self.scaling == "block":
            scaling += f" {self.block_size}"
        rounding = "" if self.rounding == "nearest" else ", stochastic"
        return f"{self.format}{scaling}{rounding}"
