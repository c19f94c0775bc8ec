"""The small numeric helpers every part of revckpt shares: one relative error, one bytes
formatter, one way to count a tensor's bytes. Imports nothing else of revckpt."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = ["mib", "relative", "relative_error", "storage_bytes", "tensor_bytes"]


def relative(diff: float, norm: float) -> float:
    """``diff / norm`` for an error and the size it is relative to: 0 when ``diff`` is 0
    (``0 / 0`` included: nothing differs), ``inf`` for a nonzero error relative to 0, ``nan``
    when ``diff`` is nan."""
    if math.isnan(diff):
        return math.nan
    if diff == 0:
        return 0.0
    return diff / norm if norm > 0 else math.inf


def relative_error(
    got: torch.Tensor | Sequence[torch.Tensor], ref: torch.Tensor | Sequence[torch.Tensor]
) -> float:
    """``||got - ref|| / ||ref||`` over one tensor or a list of tensors taken together (the
    norm of all their elements), in float64; see :func:`relative` for zeros."""
    gots = [got] if isinstance(got, torch.Tensor) else list(got)
    refs = [ref] if isinstance(ref, torch.Tensor) else list(ref)
    diff = math.sqrt(
        sum(float((g.double() - r.double()).pow(2).sum()) for g, r in zip(gots, refs, strict=True))
    )
    norm = math.sqrt(sum(float(r.double().pow(2).sum()) for r in refs))
    return relative(diff, norm)


def mib(n: float, digits: int = 2, *, unit: bool = True) -> str:
    """``n`` bytes as mebibytes: ``"12.34 MiB"`` (``unit=False``: ``"12.34"``, for a table
    whose column names the unit)."""
    return f"{n / 2**20:.{digits}f}" + (" MiB" if unit else "")


def tensor_bytes(t: torch.Tensor) -> int:
    """The bytes of ``t``'s elements (``numel * element_size``), whatever storage holds them."""
    return t.numel() * t.element_size()


def storage_bytes(t: torch.Tensor) -> int:
    """The bytes of the storage ``t`` views (all of it: a view of a larger tensor counts the
    whole), what keeping ``t`` alive keeps allocated."""
    return t.untyped_storage().nbytes()
