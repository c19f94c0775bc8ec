"""Stochastic rounding to a codec's number format (:mod:`revckpt.approx.formats`), drawing from
a seeded generator of its own per device, so that it does not move the global random stream
dropout and replay rely on."""

from __future__ import annotations

import torch

from .number_formats import FormatSpec

__all__ = ["generator", "stochastic_round"]

_GENERATORS: dict[torch.device, torch.Generator] = {}


def generator(device: torch.device) -> torch.Generator:
    """The stochastic rounding's generator on ``device`` (seeded on first use)."""
    gen = _GENERATORS.get(device)
    if gen is None:
        gen = torch.Generator(device=device)
        gen.manual_seed(0x5EED)
        _GENERATORS[device] = gen
    return gen


def stochastic_round(t: torch.Tensor, spec: FormatSpec, gen: torch.Generator) -> torch.Tensor:
    """Round ``t`` (within range) to one of its two neighbours in ``spec``'s format: with
    ``t = (n + f) * ulp``, ``n`` an integer and ``0 <= f < 1``, to ``(n + [r < f]) * ulp``
    for ``r`` uniform on ``[0, 1)``, drawn from ``gen`` (up with probability ``f``). Every
    step is exact, so a representable ``t`` stays put, and the result is at most ``fmax``
    (which is on the grid)."""
    _, e = torch.frexp(t)  # t = m * 2**e, 0.5 <= |m| < 1, so floor(log2|t|) = e - 1
    ulp_exp = torch.clamp(e - 1, min=spec.emin) - (spec.significand_bits - 1)
    scaled = torch.ldexp(t, -ulp_exp)
    lower = torch.floor(scaled)
    noise = torch.rand(t.shape, generator=gen, device=t.device)
    return torch.ldexp(lower + (noise < scaled - lower).to(t.dtype), ulp_exp)
