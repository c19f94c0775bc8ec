"""Which blocks of a group of identical blocks run their codec errors, and the figures of the
others, interpolated.

A block's codec errors (:mod:`.block_errors`) cost one run of the block forward and backward
per codec: every block of the chain once per default codec was 2.1-2.6 training steps of a
profile, its largest part after the in-chain timing (``benchmarks/bench_profile_cost.py``).
Identical blocks in a row see inputs of the same kind, and their errors move slowly along the
chain: so within a group only every ``stride``-th block and the last run (:func:`sampled`);
a block between two of them gets their figures interpolated by its place in the chain
(:func:`interpolated`). What drives a codec's error most, how far it moves the block's input,
is still measured on every block (a round trip of its input, no run): a parameter or input
gradient error is the interpolated *error per unit of perturbation* times the block's own
perturbation, so a block whose input the codec moves more than its neighbours' (an outlier
feature, a wider range) reads a larger error.

Interpolated against measured, every block run (exploratory, stride 4, one profile each): the
GPT-like model (24 blocks, one group) read a median 1.00 of the measured per-block errors
(0.94-1.06), an HF Llama of 12 layers 1.00 (0.98-1.04), the RevNet-like model's ReLU
convolutions 1.05 (0.59-1.33 for bf16, whose error moves from one such block to the next
by that much; e4m3 0.92-1.13). ``profile(..., error_stride=1)`` runs every block.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["interpolated", "neighbours", "sampled"]


def sampled(groups: Sequence[int], candidates: Sequence[int], stride: int) -> set[int]:
    """The blocks among ``candidates`` whose errors run: within each group (``groups[i]``:
    block ``i``'s), its members in chain order at positions ``0, stride, 2 * stride, ...``
    and its last."""
    members: dict[int, list[int]] = {}
    for i in candidates:
        members.setdefault(groups[i], []).append(i)
    run: set[int] = set()
    for m in members.values():
        run.update(m[::stride])
        run.add(m[-1])
    return run


def neighbours(i: int, groups: Sequence[int], run: set[int]) -> tuple[int, int, float]:
    """The run blocks of ``i``'s group just before and after it, and ``i``'s place between
    them (0 at the first, 1 at the second)."""
    same = [j for j in sorted(run) if groups[j] == groups[i]]
    lo = max(j for j in same if j < i)
    hi = min(j for j in same if j > i)
    return lo, hi, (i - lo) / (hi - lo)


def _lerp(a: float | None, b: float | None, t: float) -> float | None:
    if a is None or b is None:
        return None
    return (1.0 - t) * a + t * b


def _per_perturbation(
    a: float | None, b: float | None, pa: float | None, pb: float | None, t: float, p: float
) -> float | None:
    """An error at perturbation ``p``: the interpolated error per unit of perturbation of
    ``a`` (at ``pa``) and ``b`` (at ``pb``) times ``p``; plain interpolation where either
    moved nothing."""
    if a is None or b is None:
        return None
    if not pa or not pb:
        return _lerp(a, b, t)
    return (1.0 - t) * a / pa * p + t * b / pb * p


def interpolated(
    lo: Mapping[str, Any], hi: Mapping[str, Any], t: float, moved: Mapping[str, float]
) -> dict[str, Any]:
    """The ``approx`` and ``compress`` error fields of a block at ``t`` between two run blocks
    (their fields ``lo`` and ``hi``, as :func:`~.block_errors.error_fields` gives them), the
    codecs moving its input by ``moved`` (:func:`~.block_errors.perturbations`)."""
    out: dict[str, Any] = {}
    if "approx" in lo:
        approx = {}
        for c, a in lo["approx"].items():
            b, p = hi["approx"][c], moved[c]
            pa, pb = a.perturbation, b.perturbation
            approx[c] = dataclasses.replace(
                a,
                param_grad_error=_per_perturbation(
                    a.param_grad_error, b.param_grad_error, pa, pb, t, p
                ),
                input_grad_error=_per_perturbation(
                    a.input_grad_error, b.input_grad_error, pa, pb, t, p
                ),
                perturbation=p,
                amplification=_lerp(a.amplification, b.amplification, t),
            )
        out["approx"] = approx
    if "compress" in lo:
        out["compress"] = {
            c: dataclasses.replace(
                a,
                param_grad_error=_lerp(a.param_grad_error, hi["compress"][c].param_grad_error, t),
                input_grad_error=_lerp(a.input_grad_error, hi["compress"][c].input_grad_error, t),
            )
            for c, a in lo["compress"].items()
        }
    return out
