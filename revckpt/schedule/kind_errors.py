"""The gradient-error entries of the strategy kinds (:mod:`revckpt.schedule.kinds`): the
estimated relative error of the chain's gradients when a segment's input (approx) or a
block's saved tensors (compress) go through a codec, and none for the exact kinds."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .cost_records import BlockCost

    _Figures = tuple[float | None, float | None, float | None, float | None]

__all__: list[str] = []


def _approx_error(part: Sequence[BlockCost], codec: str | None) -> float:
    """Estimated relative error of all the chain's gradients when the segment's input is
    compressed by ``codec``, from per-block measurements (:func:`revckpt.schedule.profile`):
    ``r_i``, ``q_i``, the relative errors of block ``i``'s parameter and input gradients when
    its input goes through the codec; ``d_i``, how far the codec moves that input; ``A_i``,
    how much a perturbation of its input grows through it; ``N_i^2``, the squared norm of its
    parameter gradients in the chain, ``U_j = sum_{i<j} N_i^2`` and ``N^2`` their total. The
    compressed ``x_j`` moves block ``i``'s input by ``m_i = d_j prod_{j<=l<i} A_l``, scaling
    its errors by ``s_i = m_i / d_i`` (first order), so::

        e^2 = (sum_{i in [j, k)} (r_i s_i N_i)^2 + U_j sum_{i in [j, k)} (q_i s_i)^2) / N^2

    (the input-gradient error reaches every earlier block with its relative size). Without
    the chain norms: ``r_j``. Segments combine by root-sum-square (independent rounding):
    :func:`evaluate` adds ``e^2``."""
    assert codec is not None
    head, norms = part[0], part[0].grad_norms
    r0, q0, d_j, _ = _approx_figures(head, codec)
    r0 = 0.0 if r0 is None else r0
    if norms is None:
        return r0
    if norms.chain_sq <= 0:  # no gradient in the chain itself: what flows out of it
        return max(r0, 0.0 if q0 is None else q0)
    own = upstream = 0.0
    moved = d_j
    for b in part:
        r, q, d, amp = _approx_figures(b, codec)
        n2 = None if b.grad_norms is None else b.grad_norms.own_sq
        if None in (r, q, d, amp, n2, moved):
            return r0
        assert r is not None and q is not None and d is not None and amp is not None
        assert n2 is not None and moved is not None and d_j is not None
        scale = moved / d if d > 0 else 1.0
        own += (r * scale) ** 2 * n2
        upstream += (q * scale) ** 2
        moved *= amp
    return math.sqrt(own + norms.upstream_sq * upstream) / math.sqrt(norms.chain_sq)


def _approx_figures(b: BlockCost, codec: str) -> _Figures:
    """``r``, ``q``, ``d``, ``A`` of block ``b`` for ``codec`` (``None``: not measured)."""
    a = b.approx.get(codec)
    if a is None:
        return None, None, None, None
    return a.param_grad_error, a.input_grad_error, a.perturbation, a.amplification


def _compress_error(part: Sequence[BlockCost], codec: str | None) -> float:
    """One block whose saved tensors go through ``codec``: ``r``, ``q``, the measured relative
    errors of its parameter and input gradients, weigh as in :func:`_approx_error` with
    ``s = 1`` (its input is exact): ``e^2 = ((r N_i)^2 + U_i q^2) / N^2``; without the chain
    norms, ``r``."""
    assert codec is not None
    b, norms = part[0], part[0].grad_norms
    c = b.compress.get(codec)
    r = 0.0 if c is None or c.param_grad_error is None else c.param_grad_error
    q = 0.0 if c is None or c.input_grad_error is None else c.input_grad_error
    if norms is None:
        return r
    if norms.chain_sq <= 0:
        return max(r, q)
    return math.sqrt(r**2 * norms.own_sq + q**2 * norms.upstream_sq) / math.sqrt(norms.chain_sq)


def _no_error(part: Sequence[BlockCost], arg: str | None) -> float:
    return 0.0
