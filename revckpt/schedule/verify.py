"""Never dominated: measure a plan against the simple recipes its profile prices, and keep the
fastest that fits by measurement.

The cost model ranks plans by *predicted* time, and between plans whose predictions differ by
a few percent the measured order can flip: a solved plan can then be beaten on both memory and
time by a one-line recipe (every block in bf16, say). :func:`verify` measures the plan, store-all
and every recipe the profile prices that is predicted to fit both budgets, in one
:func:`~revckpt.report.report` run (timings interleaved, so every plan meets the same machine
noise), and returns the fastest plan that fits both budgets *by measurement*:

    winner = argmin_{r : peak_r <= budget, err_r <= error_budget + 2 floor} (time_r, peak_r)

(``floor``: store-all's measured gradient error, the float32 round-off every exact strategy
shares). No measured plan within the error budget beats the winner on both measured peak and
measured time: one with no more peak fits the budget too, so it is not faster, and at equal
time not smaller.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..errors import InfeasibleBudgetError, InvalidArgumentError, InvalidInputTypeError
from ..strategy import argument_of, kind_of
from .budget import human_bytes, parse_budget
from .costs import APPROX, COMPRESS, OFFLOAD, REVERSIBLE, SELECTIVE, STORE, Segment, strategy_names
from .plan import Plan
from .solver import baseline, make_plan

if TYPE_CHECKING:  # revckpt.report imports revckpt.schedule: imported where used at run time
    from ..report import PlanMeasurement, Report

__all__ = ["Verified", "verify"]

STORE_ALL = "store-all"  # the report's plain chain, measured first


@dataclass(frozen=True)
class Verified:
    """What :func:`verify` found.

    ``plan``: the plan to use (``solved`` itself unless ``replaced``); ``solved``: the plan
    given; ``report``: every plan measured, with ``chosen`` the row of ``plan`` and the error
    budget set (:meth:`~revckpt.report.Report.pareto` leaves out plans over it); ``measured``:
    that row (for an all-store plan possibly the ``"store-all"`` row, the same plan run plainly,
    when it measured faster); ``replaced``: whether a measured plan beat ``solved``; ``note``:
    one sentence saying what happened."""

    plan: Plan
    solved: Plan
    report: Report
    measured: PlanMeasurement
    replaced: bool
    note: str


def verify(
    blocks: nn.Sequential | Sequence[nn.Module],
    x: torch.Tensor,
    plan: Plan,
    prof: Any,
    *,
    memory_budget: int | float | str | None = None,
    error_budget: float | None = None,
    also: Sequence[Plan] = (),
    repeats: int = 9,
    warmup: int = 1,
    kwargs: Mapping[str, Any] | None = None,
    seed: int = 0,
) -> Verified:
    """Measure ``plan`` (solved for ``blocks`` on inputs like ``x``, from the profile ``prof``)
    against the simple recipes ``prof`` prices, and return the fastest that fits by measurement.

    The recipes: checkpoint per block, every 2, 3 and 4 blocks and sqrt(L) segments; every
    block ``approx:<codec>`` for each codec profiled, ``selective:<policy>`` for each policy
    profiled on every block; the whole chain ``reversible`` (all blocks invertible) or
    ``offload`` (priced); store-all (always measured, as the report's first row). Those whose
    predicted peak exceeds the memory budget or whose predicted error exceeds the error budget
    are not measured, nor those that repeat a plan already measured. ``also``: more plans to
    measure in the same run (shown in the report, and chosen like the recipes when they fit).

    Everything is measured in one :func:`~revckpt.report.report` run with gradient errors:
    per plan (the recipes that fit, ``plan``, ``also`` and store-all) two metered training
    steps, ``warmup + repeats`` timed ones (interleaved), and one float32 and one float64 step
    for the gradient error.

    Args:
        memory_budget: bytes, a string such as ``"2GiB"`` or a fraction of the store-all peak
            (default: ``plan.memory_budget_bytes``, or its predicted peak when it has none).
        error_budget: the largest relative gradient error (default: ``plan.error_budget``); a
            plan fits it when its measured error is at most ``error_budget`` plus twice
            store-all's (see :meth:`~revckpt.report.PlanMeasurement.within_error`).
        repeats, warmup, seed: as in :func:`~revckpt.report.report`.
        kwargs: keyword arguments of every block (as given to ``profile``).

    Raises :class:`~revckpt.InfeasibleBudgetError` when no measured plan fits both budgets
    (the measured peak of every one is over the memory budget), naming the least measured peak.
    """
    from ..report import report  # revckpt.report imports revckpt.schedule

    _check(plan, prof, also)
    budget = _memory_budget(plan, memory_budget)
    errors = _error_budget(plan, error_budget)
    measured, by_name = _to_measure(plan, also, prof, budget, errors)
    timing = {"repeats": repeats, "warmup": warmup, "seed": seed}
    rep = report(blocks, x, measured, kwargs=kwargs, chosen=plan.name, errors=True, **timing)
    return _verdict(rep, plan, by_name, budget, errors)


def _verdict(
    rep: Report, solved: Plan, by_name: dict[str, Plan], budget: int, errors: float
) -> Verified:
    """The fastest plan of ``rep`` that fits both budgets by measurement, and the note."""
    rep = dataclasses.replace(rep, error_budget=errors)
    floor = rep.error_floor
    best = _fastest_that_fits(
        rep.rows, memory_budget=budget, error_budget=errors, error_floor=floor, prefer=solved.name
    )
    if best is None:
        raise _nothing_fits(rep, solved.name, budget, errors)
    winner = by_name[best.name]
    replaced = _key(winner) != _key(solved)
    fitting = sum(
        r.measured_peak_bytes <= budget and r.within_error(errors, floor=floor) for r in rep.rows
    )
    note = _note(
        rep.row(solved.name), best, replaced, fitting, len(rep.rows), budget, errors, floor
    )
    chosen = winner if replaced else solved
    return Verified(
        plan=chosen,
        solved=solved,
        report=dataclasses.replace(rep, chosen=best.name if replaced else solved.name),
        measured=best,
        replaced=replaced,
        note=note,
    )


def _check(plan: Plan, prof: Any, also: Sequence[Plan]) -> None:
    """:func:`verify`'s plans checked against each other and the profile."""
    if not isinstance(plan, Plan):
        raise InvalidInputTypeError(
            f"verify(blocks, x, plan, prof): plan must be a schedule.Plan, got "
            f"{type(plan).__name__}; solve one with schedule.solve(prof, memory_budget=...)"
        )
    costs = list(getattr(prof, "blocks", ()))
    if len(costs) != plan.length:
        raise InvalidArgumentError(
            f"the plan covers {plan.length} blocks but the profile has {len(costs)}; pass the "
            "Profile the plan was solved from (schedule.profile(blocks, x))"
        )
    if not all(isinstance(p, Plan) for p in also):
        raise InvalidInputTypeError("verify(..., also=[...]): pass schedule.Plan objects")


def _to_measure(
    solved: Plan, also: Sequence[Plan], prof: Any, budget: int, errors: float
) -> tuple[list[Plan], dict[str, Plan]]:
    """The plans to measure (``solved``, ``also`` and the recipes predicted to fit both
    budgets, each once under a name of its own) with both budgets set, and every plan by the
    name its report row has (store-all's as ``"store-all"``)."""

    def budgeted(p: Plan) -> Plan:
        return dataclasses.replace(p, memory_budget_bytes=budget, error_budget=errors)

    measured = [budgeted(solved), *(budgeted(p) for p in also)]
    seen = {_key(p) for p in measured}
    names = {p.name for p in measured}
    for candidate in _recipes(prof):
        fits = candidate.predicted_peak_bytes <= budget
        fits = fits and candidate.predicted_error <= errors * (1 + 1e-9)
        if not fits or _key(candidate) in seen:
            continue
        name = candidate.name
        while name in names:
            name += " (verify)"
        measured.append(budgeted(dataclasses.replace(candidate, name=name)))
        seen.add(_key(candidate))
        names.add(name)
    by_name = {p.name: p for p in measured}
    by_name[STORE_ALL] = budgeted(dataclasses.replace(baseline(prof, "store"), name="store"))
    return measured, by_name


def _fastest_that_fits(
    rows: Iterable[PlanMeasurement],
    *,
    memory_budget: int,
    error_budget: float,
    error_floor: float = 0.0,
    prefer: str | None = None,
) -> PlanMeasurement | None:
    """The row of least measured time among those whose measured peak fits ``memory_budget``
    and whose measured gradient error fits ``error_budget`` (above ``error_floor``, see
    :meth:`~revckpt.report.PlanMeasurement.within_error`); ties go to the smaller measured
    peak, then to the row named ``prefer``. ``None`` when no row fits."""
    fits = [
        r
        for r in rows
        if r.measured_peak_bytes <= memory_budget
        and r.within_error(error_budget, floor=error_floor)
        and math.isfinite(r.time_ratio)
    ]
    return min(
        fits, key=lambda r: (r.time_ratio, r.measured_peak_bytes, r.name != prefer), default=None
    )


def _memory_budget(plan: Plan, memory_budget: int | float | str | None) -> int:
    if memory_budget is None:
        if plan.memory_budget_bytes is not None:
            return plan.memory_budget_bytes
        return plan.predicted_peak_bytes
    return parse_budget(memory_budget, plan.store_all_peak_bytes)


def _error_budget(plan: Plan, error_budget: float | None) -> float:
    if error_budget is None:
        return plan.error_budget
    if isinstance(error_budget, bool) or not isinstance(error_budget, (int, float)):
        raise InvalidInputTypeError(f"error_budget={error_budget!r}: pass a number >= 0")
    if not (error_budget >= 0 and math.isfinite(error_budget)):
        raise InvalidArgumentError(f"error_budget={error_budget!r}: pass a finite number >= 0")
    return float(error_budget)


def _key(plan: Plan) -> tuple[tuple[int, int, str], ...]:
    """What a plan runs: its segments, with neighbouring store segments merged (how stored
    blocks are grouped changes nothing)."""
    out: list[tuple[int, int, str]] = []
    for seg in plan.segments:
        if seg.strategy == STORE and out and out[-1][2] == STORE:
            out[-1] = (out[-1][0], seg.stop, STORE)
        else:
            out.append((seg.start, seg.stop, seg.strategy))
    return tuple(out)


def _recipes(prof: Any) -> list[Plan]:
    """Every simple plan the profile prices (see :func:`verify`), named for a table."""
    costs = list(prof.blocks)
    n = len(costs)
    plans = [
        dataclasses.replace(baseline(prof, "per-block"), name="checkpoint per block"),
        dataclasses.replace(baseline(prof, "sqrt"), name="checkpoint sqrt"),
    ]
    plans += [
        dataclasses.replace(baseline(prof, f"every-{k}"), name=f"checkpoint every {k}")
        for k in (2, 3, 4)
        if k < n
    ]
    wanted: list[tuple[str, list[Segment]]] = []
    for strategy in strategy_names(costs):
        kind, arg = kind_of(strategy), argument_of(strategy)
        if kind == APPROX:
            wanted.append((f"approx {arg}", [Segment(i, i + 1, strategy) for i in range(n)]))
        elif kind == SELECTIVE and all(arg in b.selective for b in costs):
            wanted.append((f"selective {arg}", [Segment(i, i + 1, strategy) for i in range(n)]))
        elif kind == COMPRESS and all(arg in b.compress for b in costs):
            wanted.append((f"compress {arg}", [Segment(i, i + 1, strategy) for i in range(n)]))
        elif kind == REVERSIBLE and all(b.invertible for b in costs):
            wanted.append(("reversible", [Segment(0, n, strategy)]))
        elif kind == OFFLOAD and all(b.offload is not None for b in costs):
            wanted.append(("offload", [Segment(0, n, strategy)]))
    for name, segments in wanted:
        try:
            plans.append(make_plan(prof, segments, name=name))
        except InvalidArgumentError:
            continue  # a rule of the cost model forbids it on this chain: not a recipe here
    return plans


def _times(row: PlanMeasurement) -> str:
    return f"{row.time_ratio:.2f}x"


def _note(
    solved: PlanMeasurement,
    best: PlanMeasurement,
    replaced: bool,
    fitting: int,
    total: int,
    budget: int,
    errors: float,
    floor: float,
) -> str:
    if not replaced:
        if best.name != solved.name:
            return (
                f"the solved plan runs as {best.name!r} (all store), the fastest of the "
                f"{fitting} of {total} measured plans that fit both budgets"
            )
        return (
            f"the solved plan was the fastest of the {fitting} of {total} measured plans that "
            f"fit both budgets ({_times(solved)} of store-all's time)"
        )
    if solved.measured_peak_bytes > budget:
        why = (
            f"the solved plan measured {human_bytes(solved.measured_peak_bytes)}, over the "
            f"budget of {human_bytes(budget)}"
        )
    elif not solved.within_error(errors, floor=floor):
        why = (
            f"the solved plan measured a gradient error of {solved.gradient_error:.2g}, over "
            f"the error budget of {errors:g}"
        )
    else:
        memory = (
            "no more memory"
            if best.measured_peak_bytes <= solved.measured_peak_bytes
            else f"more memory but within the budget of {human_bytes(budget)}"
        )
        return (
            f"{best.name} measured {_times(best)} against the solved plan's {_times(solved)} "
            f"at {memory}; returning it"
        )
    return f"{why}; {best.name} fits both at {_times(best)}, the fastest that does; returning it"


def _nothing_fits(rep: Report, solved: str, budget: int, errors: float) -> InfeasibleBudgetError:
    floor = rep.error_floor
    exact = [r for r in rep.rows if r.within_error(errors, floor=floor)] or list(rep.rows)
    least = min(exact, key=lambda r: r.measured_peak_bytes)
    got = rep.row(solved).measured_peak_bytes
    return InfeasibleBudgetError(
        f"no measured plan fits the memory budget of {human_bytes(budget)} ({budget:,} bytes) "
        f"within the error budget {errors:g}: the solved plan {solved!r} measured "
        f"{human_bytes(got)} ({got:,} bytes), the least measured peak was {least.name!r}'s "
        f"{human_bytes(least.measured_peak_bytes)} ({least.measured_peak_bytes:,} bytes). "
        "Solve again with a budget lower by the difference, or pass memory_budget of at least "
        "that least peak",
        smallest_budget_bytes=least.measured_peak_bytes,
    )
