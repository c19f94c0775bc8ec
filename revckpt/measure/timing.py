"""Time ratios measured side by side.

Absolute times on a shared machine drift by tens of percent between runs; the ratio of two
candidates run alternately does not, because both see the same drift. :func:`time_ratio` warms
both up, then runs ``candidate, baseline, candidate, baseline, ...`` (the order flipped every
round so neither always runs second), and reports the median of the per-round ratios::

    ratio_i = t_candidate(i) / t_baseline(i)          ratio = median_i ratio_i

with the interquartile range of the ``ratio_i`` as its spread.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import InvalidArgumentError

__all__ = ["TimeRatio", "time_ratio"]


@dataclass(frozen=True)
class TimeRatio:
    """Median of interleaved per-round time ratios ``candidate / baseline``, with its spread."""

    ratio: float
    q25: float
    q75: float
    candidate_seconds: float
    baseline_seconds: float
    repeats: int

    @property
    def spread(self) -> float:
        """Interquartile range of the per-round ratios."""
        return self.q75 - self.q25

    def __str__(self) -> str:
        return f"{self.ratio:.3f}x (IQR {self.q25:.3f}-{self.q75:.3f}, n={self.repeats})"


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _once(fn: Callable[[], Any]) -> float:
    _sync()
    start = time.perf_counter()
    fn()
    _sync()
    return time.perf_counter() - start


def time_ratio(
    candidate: Callable[[], Any],
    baseline: Callable[[], Any],
    *,
    repeats: int = 15,
    warmup: int = 2,
) -> TimeRatio:
    """Median ratio ``time(candidate) / time(baseline)`` over ``repeats`` interleaved rounds.

    Both callables take no arguments (close over the model and data, e.g. a forward+backward
    step). CUDA work is synchronised before and after each call.
    """
    if repeats < 1 or warmup < 0:
        raise InvalidArgumentError(
            f"time_ratio needs repeats >= 1 and warmup >= 0, got repeats={repeats}, "
            f"warmup={warmup}; use e.g. repeats=15, warmup=2"
        )
    for _ in range(warmup):
        candidate()
        baseline()
    ratios, cand, base = [], [], []
    for i in range(repeats):
        if i % 2 == 0:
            c = _once(candidate)
            b = _once(baseline)
        else:
            b = _once(baseline)
            c = _once(candidate)
        cand.append(c)
        base.append(b)
        ratios.append(c / b)
    q = statistics.quantiles(ratios, n=4, method="inclusive") if repeats > 1 else [ratios[0]] * 3
    return TimeRatio(
        ratio=statistics.median(ratios),
        q25=q[0],
        q75=q[2],
        candidate_seconds=statistics.median(cand),
        baseline_seconds=statistics.median(base),
        repeats=repeats,
    )
