"""Codec errors run on some blocks of a group of identical blocks and interpolated for the
others: an opt-in approximation (``profile(..., error_stride=k)``, ``fit(..., error_stride=k)``;
the default, ``1``, runs every block).

A block's codec errors (:mod:`.block_errors`) cost one run of the block forward and backward
per codec: every block of the chain once per default codec is 2.1-2.6 training steps of a
profile, its largest part after the in-chain timing (``benchmarks/bench_profile_cost.py``).
With ``error_stride=k`` only every ``k``-th block of a group and its last run
(:func:`sampled`); a block between two of them gets their *error per unit of input
perturbation*, interpolated by its place in the chain, times its own perturbation (a round
trip of its input through the codec, measured on every block), and their amplification
interpolated (:func:`interpolated`). A block whose neighbours' inputs the codec does not move
takes the ratio of the one that it moves; where neither does and its own input moves, no
ratio exists and the block runs.

Where it holds and where it does not (``error_stride=4`` against ``1``, exploratory, one
profile each): per-block errors read a median 1.00 of their own runs on the random-weight
GPT-like model (0.94-1.06) and a 12-layer HF Llama (0.98-1.04), 1.05 on the RevNet-like
model (0.59-1.33: its bf16 error moves that much between neighbouring ReLU blocks). A group
is identical in structure, not in weights: a session-23 review read plans' errors 5 to 25
times too low where one block's weights were 10x its neighbours' or the weights grew 1.3x per
block (small residual MLPs and an HF GPT-2 with one layer scaled: a plan predicted at 1.2e-3
measured 1.7), so ``solve`` kept plans over their error budget that every-block errors
reject. Trained models differ from layer to layer: leave the default unless the blocks'
errors are known to move slowly along the chain.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..errors import InvalidArgumentError

__all__ = [
    "Unestimated",
    "checked_stride",
    "interpolated",
    "neighbours",
    "sampled",
    "sampled_errors",
]


def checked_stride(value: object) -> int:
    """``error_stride`` as an int >= 1; else an :class:`~revckpt.InvalidArgumentError`."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 1:
        return int(value)
    raise InvalidArgumentError(
        f"error_stride={value!r}: pass an int >= 1 (1, the default, measures every block's errors)"
    )


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


class Unestimated(Exception):
    """No neighbour's error per unit of perturbation applies: the block must run."""


def _per_perturbation(
    a: float | None, b: float | None, pa: float | None, pb: float | None, t: float, p: float
) -> float | None:
    """An error at perturbation ``p``: the interpolated error per unit of perturbation of
    ``a`` (at ``pa``) and ``b`` (at ``pb``) times ``p``; where one neighbour's input did not
    move, the other's ratio; where neither did, ``0`` if ``p`` is ``0`` (the codec leaves the
    input as it is), else :class:`Unestimated`."""
    if a is None or b is None:
        return None
    if pa and pb:
        return (1.0 - t) * a / pa * p + t * b / pb * p
    if pa or pb:
        return (a / pa if pa else b / pb) * p  # type: ignore[operator]
    if not p:
        return 0.0
    raise Unestimated


def interpolated(
    lo: Mapping[str, Any], hi: Mapping[str, Any], t: float, moved: Mapping[str, float]
) -> dict[str, Any]:
    """The ``approx`` and ``compress`` error fields of a block at ``t`` between two run blocks
    (their fields ``lo`` and ``hi``, as :func:`~.block_errors.error_fields` gives them), the
    codecs moving its input by ``moved`` (:func:`~.block_errors.perturbations`). Raises
    :class:`Unestimated` where the block must run instead."""
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


def sampled_errors(
    needed: Sequence[int],
    groups: Sequence[int],
    stride: int,
    run: Callable[[int], dict[str, Any]],
    moved: Callable[[int, list[str]], dict[str, float]],
    tick: Callable[[], None] | None = None,
) -> dict[int, dict[str, Any]]:
    """The error fields of the ``needed`` blocks: ``run(i)`` (block ``i``'s measured
    ``approx`` and ``compress`` fields) on those :func:`sampled` picks, every block with
    ``stride=1``; for the others :func:`interpolated` with ``moved(i, codecs)`` (how far each
    codec moves block ``i``'s input), or ``run(i)`` where no neighbour's ratio applies.
    ``tick()`` after each block of the first pass (a progress bar)."""
    run_on = sampled(groups, needed, stride)
    errors: dict[int, dict[str, Any]] = {}
    for i in needed:
        if i in run_on:
            errors[i] = run(i)
        if tick is not None:
            tick()
    for i in sorted(set(needed) - run_on):
        lo, hi, t = neighbours(i, groups, run_on)
        try:
            errors[i] = interpolated(
                errors[lo], errors[hi], t, moved(i, list(errors[lo].get("approx", {})))
            )
        except Unestimated:  # no neighbour's ratio applies: the block runs
            errors[i] = run(i)
    return errors
