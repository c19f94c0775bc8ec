"""The number formats a :class:`~revckpt.approx.formats.Codec` keeps a tensor in: bf16, and fp8
e4m3 / e5m2, each with its dtype, significand bits, largest finite value and smallest normal
exponent (:class:`FormatSpec`), by name in :data:`FORMATS`."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

__all__ = ["FORMATS", "FormatSpec", "widen"]


@dataclass(frozen=True)
class FormatSpec:
    """The number format: dtype, significand bits ``p`` (with the implicit bit), largest finite
    value ``fmax`` and smallest normal exponent ``emin``."""

    name: str
    dtype: torch.dtype
    significand_bits: int
    fmax: float
    emin: int

    @property
    def unit_roundoff(self) -> float:
        """``u = 2**-p``: the relative error bound of round-to-nearest in the normal range."""
        return 2.0**-self.significand_bits

    @property
    def eta(self) -> float:
        """Half the smallest subnormal, ``2**(emin - p)``: the absolute error bound of
        round-to-nearest below the normal range."""
        return 2.0 ** (self.emin - self.significand_bits)

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()


FORMATS: dict[str, FormatSpec] = {
    "bf16": FormatSpec("bf16", torch.bfloat16, 8, torch.finfo(torch.bfloat16).max, -126),
    "e4m3": FormatSpec("e4m3", torch.float8_e4m3fn, 4, 448.0, -6),
    "e5m2": FormatSpec("e5m2", torch.float8_e5m2, 3, 57344.0, -14),
}


# one-byte formats whose cast to float32 is slow on the CPU: e4m3 (e5m2, float16's top byte,
# casts about as fast as the lookup: 75 against 93 us for 131k elements, one thread)
_LOOKED_UP = (torch.float8_e4m3fn,)


@functools.lru_cache(maxsize=16)
def _byte_values(dtype: torch.dtype, wide: torch.dtype) -> torch.Tensor:
    """The 256 values of a one-byte format in ``wide``, by bit pattern (torch's own cast), on
    the CPU whatever the default device."""
    return torch.arange(256, dtype=torch.uint8, device="cpu").view(dtype).to(wide)


_CHUNK = 1 << 20  # elements looked up at a time: the int32 indices stay below 4 MiB


def widen(payload: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``payload.to(dtype)`` (``dtype`` wider), a new tensor, bitwise the same. On the CPU a
    contiguous e4m3 payload is looked up in a table of its 256 values, a chunk at a time:
    torch's e4m3 to float32 cast runs there about 4.2x slower than the lookup (398 against 95
    us for 131k elements, one thread)."""
    cpu = payload.device.type == "cpu"
    if not cpu or payload.dtype not in _LOOKED_UP or not payload.is_contiguous():
        return payload.to(dtype)  # (a strided payload keeps its strides, as the cast does)
    table = _byte_values(payload.dtype, dtype)
    bits = payload.view(torch.uint8).reshape(-1)
    out = torch.empty(bits.shape, dtype=dtype, device=payload.device)
    for a in range(0, bits.numel(), _CHUNK):
        torch.index_select(table, 0, bits[a : a + _CHUNK].int(), out=out[a : a + _CHUNK])
    return out.reshape(payload.shape)
