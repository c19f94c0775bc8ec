"""The power-of-two scales of a codec (:mod:`revckpt.approx.formats`): the dtype scaling runs
in, and each group's scale built exactly from exponents and bits, on the device."""

from __future__ import annotations

import math

import torch

__all__ = ["power_of_two_scales", "work_dtype"]

_BITS = {  # scaling dtype: (same-size int dtype, stored significand bits, exponent bias)
    torch.float32: (torch.int32, 23, 127),
    torch.float64: (torch.int64, 52, 1023),
}


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype scaling runs in: float64 for float64 input (it may exceed float32's range),
    float32 otherwise (it holds every float16 and bfloat16 value)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def power_of_two_scales(amax: torch.Tensor, fmax: float, work: torch.dtype) -> torch.Tensor:
    """``2 ** clamp(floor(log2(fmax / amax)), -m, m)`` per group, exactly, in ``work``; 1 where
    ``amax`` is 0 (or nan). With ``amax = a * 2**ea`` and ``fmax = f * 2**ef`` (``0.5 <= a, f <
    1``), ``fmax / amax = (f / a) * 2**(ef - ea)`` and ``f / a`` lies in ``[1, 2)`` when
    ``a <= f``, in ``(1/2, 1)`` otherwise: the floor is ``ef - ea - [a > f]``, integer
    arithmetic. The power of two is built from its bits (``2**-m`` is normal, so ``e + bias``
    is a valid biased exponent): every step exact, on the device, no host synchronisation."""
    int_dtype, significand, bias = _BITS[work]
    m = bias - 1
    a, ea = torch.frexp(amax.to(work))
    f, ef = math.frexp(fmax)
    e = (ef - ea) - (a > f).to(ea.dtype)
    e = torch.where(amax > 0, e, 0).clamp(-m, m)
    return ((e.to(int_dtype) + bias) << significand).view(work)
