"""Exact chain optimisation: the cheapest plan under a memory budget and an error budget.

The problem (see :mod:`revckpt.schedule.costs`): choose segments ``[j, k)`` and a strategy for
each, covering the chain, to minimise the total recompute time subject to

    peak <= budget,       sum_p e_p^2 <= error_budget^2,

where the peak is ``max_p (P_p + W_p)`` (``P_p``, the bytes kept by the segments before ``p``;
``W_p``, the working peak of segment ``p``; plus the replay state later segments keep to the
end of the step in the backward of earlier ones). :mod:`~revckpt.schedule.programme` solves
it exactly for bytes and squared errors counted in slots. :func:`solve` never trusts a
rounding: every plan it returns is checked against the exact figures of
:func:`~revckpt.schedule.evaluate`. It solves the instance rounded up (its plans fit); if that
has none, the instance rounded down (a relaxation: if it has none, no plan fits; if its optimum
fits, that is optimal); if that optimum does not fit, both again on the finest grid the
tables allow (one slot per common divisor of every byte figure, where nothing rounds, when
that is affordable). So a budget that a plan meets exactly is accepted. An infeasible budget
is answered with the smallest budget that works, from the same programme minimising the peak
instead of the time, and with what would lower it.
"""

from __future__ import annotations

import contextlib
import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import InfeasibleBudgetError, InvalidArgumentError, InvalidInputTypeError
from ..strategy import Strategy, argument_of, kind_of
from .baselines import _blocks_of, _plan, _step_of, baseline, make_plan
from .budget import human_bytes, parse_budget
from .costs import (
    APPROX,
    OFFLOAD,
    STORE,
    BlockCost,
    Segment,
    chain_totals,
    evaluate,
    segment_cost,
    strategy_names,
)
from .kinds import KINDS, approximate
from .plan import Plan
from .programme import Candidate, Rounding, candidates, min_peak_segments, quantise, solve_segments
from .step import StepCosts

__all__ = ["baseline", "make_plan", "parse_budget", "solve"]

_MAX_CELLS = 1 << 22  # table cells of the finest grid: (L + 1) x 3 x slots x error slots


def _can_run(block: BlockCost, strategies: Sequence[str]) -> bool:
    """Whether some segment with one of ``strategies`` can contain ``block``."""
    for s in strategies:
        kind = kind_of(s)
        if kind == APPROX or KINDS[kind].runs_on(block, argument_of(s)):
            return True  # approx: inside a segment whose first block has the codec
    return False


def _chosen(blocks: Sequence[BlockCost], strategies: Sequence[str] | None) -> list[str]:
    """The strategies asked for, checked against what the profile supports."""
    available = strategy_names(blocks)
    if isinstance(strategies, str):
        raise InvalidInputTypeError(
            f"strategies={strategies!r}: pass a list of names, e.g. [{strategies!r}]"
        )
    chosen = [str(Strategy.parse(s)) for s in strategies] if strategies is not None else available
    unknown = [s for s in chosen if s not in available]
    if unknown:
        hint = (
            " (offload is priced by profile(..., offload=True), by default only when the input "
            "is on a CUDA device: on a CPU the host is the device and it saves nothing)"
            if OFFLOAD in unknown
            else " (compress is priced on the blocks that can keep their saved tensors "
            "compressed: not one that saves an inf or nan, as a -inf mask's log_softmax does)"
            if any(s.startswith("compress:") for s in unknown)
            else ""
        )
        raise InvalidArgumentError(
            f"strategies {unknown} are not available for this profile; choose from "
            f"{available}{hint}"
        )
    if not chosen:
        raise InvalidArgumentError(f"strategies=[]: choose at least one of {available}")
    uncovered = [i for i, b in enumerate(blocks) if not _can_run(b, chosen)]
    if uncovered:
        raise InvalidArgumentError(
            f"blocks {uncovered[:8]} cannot run with strategies {chosen} (reversible needs "
            "invertible blocks; approx, selective and offload need a profiled codec, policy or "
            "offload=True); add 'checkpoint' or 'store'"
        )
    return chosen


@dataclass(frozen=True)
class _Problem:
    """A chain, the strategies a plan may use and the error budget: what :func:`solve`
    searches, at any budget and resolution."""

    blocks: Sequence[BlockCost]
    strategies: tuple[str, ...]  # those asked for that the error budget allows
    error_budget: float
    error_slots: int
    found: tuple[Candidate, ...]
    asked: tuple[str, ...]
    step: StepCosts | None = None
    # per strategy, its candidate segments: shared by the problems one solve searches (those
    # of an infeasible budget's cures differ only in strategies and error budget)
    pool: dict[str, list[Candidate]] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def of(
        cls,
        blocks: Sequence[BlockCost],
        chosen: Sequence[str],
        error_budget: float,
        es: int,
        step: StepCosts | None = None,
        pool: dict[str, list[Candidate]] | None = None,
    ) -> _Problem:
        usable = tuple(s for s in chosen if error_budget > 0 or not approximate(s))
        pool = {} if pool is None else pool
        for s in usable:
            if s not in pool:
                pool[s] = candidates(blocks, [s], step)
        found = tuple(c for s in usable for c in pool[s])  # as candidates(blocks, usable, step)
        return cls(blocks, usable, error_budget, es, found, tuple(chosen), step, pool)

    def like(self, chosen: Sequence[str], error_budget: float) -> _Problem:
        """The same chain with other strategies and error budget (its candidates shared)."""
        return _Problem.of(
            self.blocks, chosen, error_budget, self.error_slots, self.step, self.pool
        )

    def evaluate(self, segments: Sequence[Segment]) -> Any:
        return evaluate(self.blocks, segments, step=self.step)

    def run(self, budget: int, slots: int, rounding: Rounding, *, peak: bool = False) -> Any:
        inst = quantise(
            self.blocks,
            budget_bytes=budget,
            error_budget=self.error_budget,
            strategies=self.strategies,
            slots=slots,
            error_slots=self.error_slots,
            rounding=rounding,
            found=self.found,
            step=self.step,
        )
        if peak:
            return min_peak_segments(inst)
        result = solve_segments(inst)
        return None if result is None else result[0]

    def fits(self, segments: Sequence[Segment] | None, budget: int) -> bool:
        """Whether a plan was found and fits ``budget`` and the error budget, exactly."""
        if segments is None:
            return False
        return self.evaluate(segments).peak_bytes <= budget and self.within_error(segments)

    def within_error(self, segments: Sequence[Segment]) -> bool:
        return self.evaluate(segments).error <= self.error_budget * (1 + 1e-9)

    def grids(self, budget: int, slots: int) -> list[tuple[int, int]]:
        """``(budget bytes, slots)`` to solve at: the given resolution, then the finest one
        the tables allow: slots of the largest common divisor of every byte figure (nothing
        rounds there; a plan's peak is a multiple of it) when that is affordable."""
        costs = [c.cost for c in self.found]
        figures = [v for c in costs for v in (c.kept, c.work, c.backward_work, c.late)]
        figures += [
            r.late_bytes for b in self.blocks for r in b.replay.values() if r.late_bytes is not None
        ]
        if self.step is not None:
            figures += [self.step.held, self.step.head]
        step = math.gcd(*figures) or 1
        cols = self.error_slots + 1 if 0 < self.error_budget < math.inf else 1
        cap = _MAX_CELLS // (3 * (len(self.blocks) + 1) * cols)
        exact = budget // step
        fine = (exact * step, exact) if exact <= cap else (budget, cap)
        return [(budget, slots)] + ([fine] if fine[1] > slots else [])


def _search(problem: _Problem, budget: int, slots: int) -> list[Segment] | None:
    """The best plan that fits ``budget`` exactly (see the module docstring), or ``None``."""
    for grid_budget, resolution in problem.grids(budget, slots):
        for rounding in ("up", "down"):
            segments = problem.run(grid_budget, resolution, rounding)
            if problem.fits(segments, budget):
                return segments
            if segments is None and rounding == "down":
                return None  # not even the relaxation has a plan
    return None


def _least_peak(problem: _Problem, store_peak: int, slots: int) -> tuple[int, list[Segment]]:
    """The plan of least exact peak the programme finds, and that peak: searched up to twice
    the store-all peak at ``slots``, then up to the peak found on the finest grid."""
    segments = _lowest_peak(problem, 2 * store_peak, slots)
    if segments is None:
        raise _no_plan(problem, store_peak)
    peak = problem.evaluate(segments).peak_bytes
    finer = _lowest_peak(problem, *problem.grids(peak, slots)[-1])
    finer_peak = peak if finer is None else problem.evaluate(finer).peak_bytes
    return (finer_peak, finer) if finer is not None and finer_peak < peak else (peak, segments)


def _no_plan(problem: _Problem, store_peak: int) -> InvalidArgumentError:
    """Why no plan exists at any budget: the error budget, when only approximate strategies
    are allowed (each block then pays an error), else the strategies themselves."""
    asked = list(problem.asked)
    approx = [s for s in problem.asked if approximate(s)]
    if approx and all(approximate(s) for s in problem.asked):
        least, best = min((_uniform_error(problem, s), s) for s in approx)
        return InvalidArgumentError(
            f"no plan with strategies {asked} keeps the predicted gradient error within "
            f"error_budget={problem.error_budget:g}: every block must then be approximate, and "
            f"with every block {best!r} the predicted error is {least:.3g}. Pass "
            f"error_budget={least * 1.001:.3g} or more, or allow an exact strategy ('store', "
            "'checkpoint')"
        )
    return InvalidArgumentError(
        f"no plan with strategies {asked} fits even twice the store-all peak "
        f"({2 * store_peak:,} bytes); allow 'store' or 'checkpoint'"
    )


def _uniform_error(problem: _Problem, strategy: str) -> float:
    """The predicted error of every block run with ``strategy`` (approx: one block a
    segment)."""
    n = len(problem.blocks)
    return problem.evaluate([Segment(i, i + 1, strategy) for i in range(n)]).error


def _lowest_peak(problem: _Problem, span: int, slots: int) -> list[Segment] | None:
    """The plan of least exact peak among those the programme fits in ``span`` at this
    resolution, from the relaxation (every plan that fits is in it) and from the instance
    rounded up: rounding moves bytes and errors, so either may hold the lower exact peak
    (with an error budget, the relaxation's least-peak plan can be an approx plan above an
    exact one the rounded-up instance finds)."""
    found = []
    for rounding in ("down", "up"):
        segments = problem.run(span, slots, rounding, peak=True)
        if segments is not None and problem.within_error(segments):
            found.append(segments)
    return min(found, key=lambda segs: problem.evaluate(segs).peak_bytes, default=None)


def _smallest_budget(problem: _Problem, store_peak: int, slots: int) -> tuple[int, list[Segment]]:
    """The smallest budget the solver answers for, and a plan within it: the least peak the
    programme finds (:func:`_least_peak`, which does not depend on the blocks' times), with
    the fastest plan :func:`_search` finds within it, else the least-peak plan itself (at
    exactly that peak, rounding can hide every plan from the search). A solve at the budget
    named thus always finds a plan, whatever times a later profile measures."""
    nbytes, least = _least_peak(problem, store_peak, slots)
    exact = [s for s in problem.strategies if not approximate(s)]
    if exact and len(exact) < len(problem.strategies):
        # an exact plan is within any error budget: allowing approx never raises the least
        # peak (the rounded error slots of the approx programme could hide the exact optimum:
        # a ResNet chain read 630,152 bytes with approx allowed, 624,968 without)
        with contextlib.suppress(InvalidArgumentError):  # no exact plan at all
            peak, plan = _least_peak(problem.like(exact, problem.error_budget), store_peak, slots)
            if peak < nbytes:
                nbytes, least = peak, plan
    found = _search(problem, nbytes, slots)
    return nbytes, least if found is None else found


def _cures(problem: _Problem, smallest: int, store_peak: int, slots: int) -> list[str]:
    """What would lower the smallest budget, each tried: strategies left out, approx
    boundaries (any error) and, where no block is invertible, reversible blocks."""
    cures: list[str] = []
    blocks = problem.blocks
    given = smallest  # the smallest budget with the strategies and error budget given
    available = strategy_names(blocks)
    exact = [s for s in available if not approximate(s)]
    left_out = [s for s in exact if s not in problem.strategies]
    if left_out:
        wider = problem.like(exact, problem.error_budget)
        peak, segments = _least_peak(wider, store_peak, slots)
        used = sorted({s.strategy for s in segments} & set(left_out))
        if peak < smallest and used:
            cures.append(
                f"allow {used} (strategies=None allows every strategy the profile supports): "
                f"a plan then fits {human_bytes(peak)} ({peak:,} bytes)"
            )
            smallest = peak
    restricted = set(problem.strategies) != set(available)
    if restricted and any(approximate(s) for s in problem.strategies):
        # the strategies given, without the error budget's bound (with every strategy
        # allowed, the approx cure below names the error budget)
        unbound = problem.like(problem.strategies, math.inf)
        peak, segments = _least_peak(unbound, store_peak, slots)
        error = unbound.evaluate(segments).error
        needed = _error_budget_for(unbound, segments)
        if peak < given and error > problem.error_budget and needed is not None:
            cures.append(
                f"raise error_budget to {needed:.3g}: with the strategies given, a plan "
                f"with a predicted gradient error of {error:.2g} fits {human_bytes(peak)} "
                f"({peak:,} bytes); the error budget {problem.error_budget:g} rules it out"
            )
    if len(available) > len(exact):
        anything = problem.like(available, math.inf)
        peak, segments = _least_peak(anything, store_peak, slots)
        error = anything.evaluate(segments).error
        used = sorted({s.strategy for s in segments} - set(problem.asked))
        needed = _error_budget_for(anything, segments)
        if peak < smallest and error > problem.error_budget and needed is not None:
            cures.append(
                f"allow approx boundaries: a plan with a predicted gradient error of "
                f"{error:.2g} fits {human_bytes(peak)} ({peak:,} bytes; pass "
                f"error_budget={needed:.3g}"
                + (f" and strategies including {used}" if used else "")
                + ")"
            )
        elif peak < smallest and used:  # the error budget holds: the strategies are the cause
            cures.append(
                f"allow {used}: a plan with them fits {human_bytes(peak)} ({peak:,} bytes) "
                f"with a predicted gradient error of {error:.2g}, within error_budget="
                f"{problem.error_budget:g}"
            )
    if not any(b.invertible for b in blocks) and problem.step is None:
        cures.append(
            "make blocks reversible (revckpt.layers.ReversibleUnit: a reversible segment "
            "keeps nothing for backward)"
        )
    return cures


def _error_budget_for(problem: _Problem, segments: Sequence[Segment]) -> float | None:
    """The least error budget (to the three significant digits a message gives, rounded up)
    at which the programme, counting each approx segment's squared error in whole slots of
    ``budget^2 / error_slots`` rounded up, has room for ``segments``' errors; ``None`` where
    they are more segments than slots (no error budget holds them)."""
    costs = [segment_cost(problem.blocks, seg, problem.step) for seg in segments]
    squares = [c.error**2 for c in costs if c.error > 0]
    n = problem.error_slots
    if not squares or len(squares) >= n:
        return None if squares else 0.0

    def room(budget: float) -> bool:
        return sum(math.ceil(e * n / budget**2 - 1e-12) for e in squares) <= n

    low, high = math.sqrt(sum(squares)), math.sqrt(sum(squares) * n / (n - len(squares)))
    for _ in range(60):  # room(high) holds: k slots more than the sum at most
        mid = (low + high) / 2
        low, high = (low, mid) if room(mid) else (mid, high)
    unit = 10 ** (math.floor(math.log10(high * 1.001)) - 2)
    return math.ceil(high * 1.001 / unit) * unit


def _infeasible(
    problem: _Problem, budget: int, smallest: int, store_peak: int, slots: int
) -> InfeasibleBudgetError:
    cures = _cures(problem, smallest, store_peak, slots)
    err = InfeasibleBudgetError(
        f"no plan fits a memory budget of {human_bytes(budget)} ({budget:,} bytes) with "
        f"strategies {list(problem.strategies)} and error budget {problem.error_budget:g}: "
        f"the smallest budget a plan fits is {human_bytes(smallest)} ({smallest:,} bytes, "
        f"{smallest / store_peak:.1%} of store-all). Raise the budget to at least that, or "
        "use a smaller batch"
        + ("; or lower that smallest budget: " + "; or ".join(cures) if cures else ""),
        smallest_budget_bytes=smallest,
    )
    err.fixes = tuple(cures)
    return err


def solve(
    profile: Any,
    *,
    memory_budget: int | float | str,
    error_budget: float = 0.0,
    strategies: Sequence[str] | None = None,
    slots: int = 1000,
    error_slots: int = 32,
) -> Plan:
    """The plan of least predicted recompute time whose predicted peak fits ``memory_budget``
    and whose total error ``sqrt(sum_p e_p^2)`` fits ``error_budget``.

    Args:
        profile: a :class:`~revckpt.schedule.Profile` (or a list of ``BlockCost``).
        memory_budget: bytes (int), a string such as ``"2GiB"``, or a fraction (float in
            ``(0, 1]``) of the store-everything peak.
        error_budget: the largest total relative gradient error of approx segments (0: no
            approx).
        strategies: subset of ``"store"``, ``"checkpoint"``, ``"reversible"``, ``"offload"``,
            ``"approx:<codec>"``, ``"selective:<policy>"`` (default: all the profile supports).
        slots, error_slots: resolution of the exact programme (see the module docstring).

    Raises :class:`~revckpt.InvalidArgumentError` when no plan fits, naming the smallest
    budget that does and what would lower it.
    """
    blocks = _blocks_of(profile)
    step = _step_of(profile)
    _, store_peak = chain_totals(blocks, step)
    budget = parse_budget(memory_budget, store_peak)
    if not error_budget >= 0 or not math.isfinite(error_budget):
        raise InvalidArgumentError(f"error_budget={error_budget!r}: pass a number >= 0")
    for name, value in (("slots", slots), ("error_slots", error_slots)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise InvalidArgumentError(f"{name}={value!r}: pass an int >= 1")
    chosen = _chosen(blocks, strategies)
    if STORE in chosen and store_peak <= budget:  # nothing to recompute: optimal, no rounding
        segments = [Segment(0, len(blocks), STORE)]
    else:
        problem = _Problem.of(blocks, chosen, error_budget, error_slots, step)
        segments = _search(problem, budget, slots)
        if segments is None:
            smallest, segments = _smallest_budget(problem, store_peak, slots)
            if not problem.fits(segments, budget):
                raise _infeasible(problem, budget, smallest, store_peak, slots)
    return _plan(
        profile, blocks, segments, name="optimal", budget=budget, error_budget=error_budget
    )
