"""Time ratios measured side by side.

Absolute times on a shared machine drift by tens of percent between runs; the ratio of two
candidates run alternately does not, because both see the same drift. :func:`time_ratio` warms
both up, then runs ``candidate, baseline, candidate, baseline, ...`` (the order flipped every
round so neither always runs second), and reports the median of the per-round ratios::

    ratio_i = t_candidate(i) / t_baseline(i)          ratio = median_i ratio_i

with the interquartile range of the ``ratio_i`` as its spread. :func:`time_ratios` does the same
for many candidates at once: every round runs each of them once, in an order rotated from round
to round, and each is divided by the baseline's time of the same round.

Every function takes the clock as a keyword, ``clock=time.perf_counter`` by default: any
callable returning seconds as a float. Tests pass a fake clock that the timed functions advance
by scripted amounts, so the arithmetic is checked exactly and no test depends on real time.
"""

from __future__ import annotations

import operator
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import InvalidArgumentError

__all__ = ["Clock", "TimeRatio", "time_ratio", "time_ratios", "wall_time"]

Clock = Callable[[], float]
"""A clock: returns the current time in seconds (``time.perf_counter``, or a fake in tests)."""


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


def wall_time(fn: Callable[[], Any], *, clock: Clock = time.perf_counter) -> float:
    """Seconds one call of ``fn()`` takes on ``clock``, CUDA work synchronised before and after."""
    _sync()
    start = clock()
    fn()
    _sync()
    return clock() - start


def _summary(cand: list[float], base: list[float]) -> TimeRatio:
    if min(base) <= 0:
        raise InvalidArgumentError(
            f"the baseline took {min(base):g} s in a round, so no ratio exists; time more work "
            "per call (e.g. several steps in one callable) or pass a clock that advances"
        )
    ratios = [c / b for c, b in zip(cand, base, strict=True)]
    n = len(ratios)
    q = statistics.quantiles(ratios, n=4, method="inclusive") if n > 1 else [ratios[0]] * 3
    return TimeRatio(
        ratio=statistics.median(ratios),
        q25=q[0],
        q75=q[2],
        candidate_seconds=statistics.median(cand),
        baseline_seconds=statistics.median(base),
        repeats=n,
    )


def _whole(n: Any) -> bool:
    """An integer (``3``, ``numpy.int64(3)``, ``torch.tensor(3)``: anything with
    ``__index__``), not a bool."""
    if isinstance(n, bool):
        return False
    try:
        operator.index(n)
    except TypeError:
        return False
    return True


def _check_rounds(repeats: int, warmup: int) -> None:
    whole = all(_whole(n) for n in (repeats, warmup))
    if not whole or repeats < 1 or warmup < 0:
        raise InvalidArgumentError(
            f"time_ratio needs whole numbers repeats >= 1 and warmup >= 0, got "
            f"repeats={repeats!r}, warmup={warmup!r}; use e.g. repeats=15, warmup=2"
        )


def time_ratio(
    candidate: Callable[[], Any],
    baseline: Callable[[], Any],
    *,
    repeats: int = 15,
    warmup: int = 2,
    clock: Clock = time.perf_counter,
) -> TimeRatio:
    """Median ratio ``time(candidate) / time(baseline)`` over ``repeats`` interleaved rounds.

    Both callables take no arguments (close over the model and data, e.g. a forward+backward
    step). CUDA work is synchronised before and after each call. ``warmup`` untimed rounds run
    first; even rounds run the candidate first, odd rounds the baseline. ``clock`` returns
    seconds (see the module docstring).
    """
    _check_rounds(repeats, warmup)
    for _ in range(warmup):
        candidate()
        baseline()
    cand, base = [], []
    for i in range(repeats):
        if i % 2 == 0:
            c = wall_time(candidate, clock=clock)
            b = wall_time(baseline, clock=clock)
        else:
            b = wall_time(baseline, clock=clock)
            c = wall_time(candidate, clock=clock)
        cand.append(c)
        base.append(b)
    return _summary(cand, base)


def time_ratios(
    fns: Mapping[str, Callable[[], Any]],
    *,
    baseline: str,
    repeats: int = 15,
    warmup: int = 2,
    clock: Clock = time.perf_counter,
) -> dict[str, TimeRatio]:
    """:func:`time_ratio` of every callable in ``fns`` against ``fns[baseline]``, in one run.

    Each of ``repeats`` rounds runs every callable once; the order is rotated by one position
    per round, so none always runs first or right after the same neighbour. With ``t_k(i)`` the
    time of callable ``k`` in round ``i``::

        ratio_k = median_i t_k(i) / t_baseline(i)

    All candidates are thus compared with the same baseline runs, which is what a table of
    "time against plain" needs when two candidates are also compared with each other. The
    baseline's own entry is 1. Returns the ratios in the order of ``fns``. ``warmup`` untimed
    rounds run first, in the order of ``fns``; ``clock`` as in :func:`time_ratio`.
    """
    _check_rounds(repeats, warmup)
    if baseline not in fns:
        raise InvalidArgumentError(
            f"baseline {baseline!r} is not one of the timed callables {sorted(fns)}; pass the "
            "key of the callable to divide by"
        )
    names = list(fns)
    for _ in range(warmup):
        for name in names:
            fns[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(repeats):
        shift = i % len(names)
        for name in names[shift:] + names[:shift]:
            times[name].append(wall_time(fns[name], clock=clock))
    return {name: _summary(times[name], times[baseline]) for name in names}
