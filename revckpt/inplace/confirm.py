"""A solved plan confirmed in a measured step: solved again with the cost model's shortfall
taken off the budget while it measures over, and an infeasible budget answered with the
smallest one a plan met; a plan with approximate segments whose measured gradient error is over
the error budget solved again for a smaller predicted error (:func:`_within_error`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from ..errors import InfeasibleBudgetError
from ..schedule.budget import human_bytes, parse_budget
from ..schedule.plan import Plan

Phases = Callable[[Plan], dict[str, dict[str, int]]]


def _within_budget(
    checked: Callable[[Any], tuple[Plan, int]],
    memory_budget: Any,
    store_peak: int,
    phases: Phases | None = None,
) -> Plan:
    """The plan solved for the budget, confirmed by one metered step (``checked`` returns the
    plan, its prediction raised to what the step measured, and by how much the cost model was
    short). A plan that measured over the budget is solved again with the largest shortfall
    seen taken off the budget. An infeasible budget is answered with the least-peak plan
    where its measured step is within the budget, else with the smallest budget a plan met
    in a measured step. ``store_peak``: the store-all step's measured peak, of which
    a fractional budget is a fraction (and the plan's ``store_all_peak_bytes``); a budget it
    meets gets the store-all plan even where the cost model predicts that above it.
    ``phases``: what each phase of the step holds under a plan
    (:func:`~revckpt.schedule.costs.peak_phases`), to say where the smallest plan peaks."""
    budget = parse_budget(memory_budget, store_peak)
    target, worst, tried = budget, 0, []
    for _ in range(8):
        try:
            plan, short = checked(target)
        except InfeasibleBudgetError as err:
            if budget >= store_peak:  # storing every block measured within it: the model
                plan, _ = checked(1.0)  # read high (it may, by a few hundred bytes): store all
                return dataclasses.replace(
                    plan,
                    predicted_peak_bytes=store_peak,
                    memory_budget_bytes=budget,
                    store_all_peak_bytes=store_peak,
                )
            smallest, gap = checked(err.smallest_budget_bytes)
            measured = smallest.predicted_peak_bytes + min(gap, 0)
            if measured <= budget:  # measured within it: it fits
                # (a retry's lowered target can fall below the least peak while the
                # least-peak plan itself meets the budget, as when fit is called again at
                # the smallest budget an earlier fit named, and times pick another plan; or
                # the cost model read it high: an FPN's stages, whose outputs leave the
                # chain too, read 484,104 bytes and measured 426,760 under a 460,116 budget)
                return dataclasses.replace(
                    smallest,
                    predicted_peak_bytes=measured,
                    memory_budget_bytes=budget,
                    store_all_peak_bytes=store_peak,
                )
            # the solver's smallest budget, or what its plan measured: not a lower peak that
            # a plan the times chose measured (here or in the retries), which a fit at that
            # budget may not find again; the least-peak plan it finds there
            least = max(err.smallest_budget_bytes, smallest.predicted_peak_bytes)
            if gap < 0:  # the model read that plan high: what it measured is the least
                least = measured
                smallest = dataclasses.replace(smallest, predicted_peak_bytes=measured)
            where = _where(phases(smallest)) if phases is not None else ""
            infeasible = _infeasible(err, budget, least, store_peak, where)
            # the least-peak plan, measured within that smallest budget: a fit at it with
            # plan= installs it without profiling again
            infeasible.plan = dataclasses.replace(
                smallest, memory_budget_bytes=least, store_all_peak_bytes=store_peak
            )
            raise infeasible from None
        if plan.predicted_peak_bytes <= budget:
            return dataclasses.replace(
                plan, memory_budget_bytes=budget, store_all_peak_bytes=store_peak
            )
        tried.append(plan.predicted_peak_bytes)
        worst = max(worst, short)  # (0 at least: a plan read high lowers nothing)
        target = min(target - 1, budget - worst)
    raise InfeasibleBudgetError(  # pragma: no cover - eight plans each short of the model
        f"no plan met {budget:,} bytes in a measured step (the cost model was up to {worst:,} "
        f"bytes short of these plans); raise the budget to {min(tried):,} bytes",
        smallest_budget_bytes=min(tried),
    )


def _infeasible(
    err: InfeasibleBudgetError, budget: int, smallest: int, store_peak: int, where: str = ""
) -> InfeasibleBudgetError:
    cures = "; or ".join(err.fixes)
    infeasible = InfeasibleBudgetError(
        f"no plan fits a memory budget of {human_bytes(budget)} ({budget:,} bytes) for the "
        f"whole training step: the smallest budget a plan fits is {human_bytes(smallest)} "
        f"({smallest:,} bytes, {smallest / store_peak:.1%} of the step with every block "
        f"stored, as measured on the example){where}. Raise the budget to at least that "
        "(fit(..., memory_budget=err.smallest_budget_bytes, plan=err.plan) installs the plan "
        "measured there without profiling again), or use a smaller batch"
        + (f"; or lower that smallest budget: {cures}" if cures else ""),
        smallest_budget_bytes=smallest,
    )
    infeasible.fixes = err.fixes
    return infeasible


def _where(phases: dict[str, dict[str, int]]) -> str:
    """Where the smallest plan peaks, by the cost model: in the blocks (one block's working set
    on top of what the plan keeps), or outside them, which no block strategy lowers."""
    name, parts = max(phases.items(), key=lambda item: sum(item[1].values()))
    if parts.get("held", 0) < 0:  # the chain's input came with the example (made before the
        # step: not held by it), and the blocks' part counts it: the two said as their sum
        first = "blocks" if name == "blocks" else "kept"
        parts = {**parts, first: parts[first] + parts["held"], "held": 0}
    b = {k: human_bytes(v) for k, v in parts.items()}
    if name == "blocks":
        return (
            f"; by the cost model, that plan peaks inside the blocks: {b['held']} the step holds "
            "outside them (in their backward, the model's output and the loss's tensors among "
            f"it) and {b['blocks']} of theirs (what the plan keeps, and one block's forward, or "
            "its re-run and backward, on top)"
        )
    if name == "before":
        said = (
            f"before the blocks run ({b['before']}: the embedding and what the model computes "
            "ahead of them)"
        )
    elif name == "head":
        said = (
            f"between the blocks' forward and their backward: {b['held']} the step holds "
            f"outside the blocks, {b['kept']} the plan keeps for their backward and "
            f"{b['head']} of the head's own (its output, the logits, the loss and their "
            "backward)"
        )
    else:
        said = (
            f"after the blocks' backward: {b['after']} (the parameter gradients and what the "
            f"step holds to its end) and {b['late']} the plan keeps to then"
        )
    return (
        f"; by the cost model, that plan peaks {said}, which no block strategy lowers (a "
        "smaller batch or sequence does"
        + (", or a loss computed in chunks)" if name == "head" else ")")
    )


_TIGHTER = 3  # solves for a smaller predicted error before the exact strategies alone
_REFINE = 3  # solves between a least-peak plan within the error budget and one over it


def _within_error(
    within: Callable[[float], Plan],
    error_budget: float,
    modelled: Callable[[Plan], float] | None = None,
) -> Plan:
    """The plan ``within(e)`` solves and confirms for the predicted error budget ``e``, first
    at ``error_budget``. Its ``predicted_error`` is at least what its step measured (the check
    step of an approx plan measures it): where that is over ``error_budget`` (the error model
    reads some blocks low: ReLU kinks a codec's rounding moves), it is solved again for a
    predicted error below that plan's modelled one (``modelled(plan)``; default: the budget
    searched at) in the ratio measured, up to :data:`_TIGHTER` times, then with the exact
    strategies alone (error 0). An infeasible budget raises as it would; after a tightening
    the least-peak plans between the last predicted error budget searched and the smallest one
    whose plan measured over are searched too (:func:`_least_within`: a tightening can step
    past plans of a smaller peak that measure within ``error_budget``), its message says why
    the plans had to be exact or nearly so, and the least-peak plan it hands back was measured
    within ``error_budget`` too."""
    target, seen, over_at = error_budget, 0.0, error_budget

    def tighter(plan: Plan) -> float:
        model = target if modelled is None else min(target, modelled(plan))
        return model * min(0.9, error_budget / plan.predicted_error)

    for attempt in range(_TIGHTER + 2):
        last = attempt == _TIGHTER + 1
        if last:
            target = 0.0
        try:
            plan = within(target)
        except InfeasibleBudgetError as err:
            over = err.plan is not None and err.plan.predicted_error > _slack(error_budget)
            if over and not last:  # its least-peak plan measured over: tighter there too
                seen, over_at = max(seen, err.plan.predicted_error), target
                target = tighter(err.plan)
                continue
            if not seen:
                raise
            found = _least_within(within, error_budget, target, over_at, err)
            if isinstance(found, InfeasibleBudgetError):
                raise _said(found, error_budget, seen) from None
            return _as_asked(found, error_budget)
        if plan.predicted_error <= _slack(error_budget):
            return _as_asked(plan, error_budget)
        seen, over_at = max(seen, plan.predicted_error), target
        target = tighter(plan)
    raise AssertionError("unreachable: the exact strategies measure no error")  # pragma: no cover


def _least_within(
    within: Callable[[float], Plan],
    error_budget: float,
    low: float,
    high: float,
    err: InfeasibleBudgetError,
) -> Plan | InfeasibleBudgetError:
    """Between the predicted error budgets ``low`` (whose least-peak plan, ``err.plan``,
    measured within ``error_budget``) and ``high`` (whose plans measured over it), the plan
    ``within`` confirms at a budget between them where one measures within ``error_budget``,
    else the infeasible error whose least-peak plan is the smallest measured within it, by
    :data:`_REFINE` bisections. A larger predicted error budget admits plans of a smaller
    peak; without this search the smallest budget named was that of the tightest plans tried
    (a 6-layer Llama with e4m3: 10.6 MB named where a 9.33 MB plan measured within)."""
    best = err
    for _ in range(_REFINE):
        middle = (low + high) / 2
        try:
            plan = within(middle)
        except InfeasibleBudgetError as found:
            if found.plan is None or found.plan.predicted_error > _slack(error_budget):
                high = middle
                continue
            low = middle
            if found.smallest_budget_bytes < best.smallest_budget_bytes:
                best = found
            continue
        if plan.predicted_error <= _slack(error_budget):
            return plan
        high = middle
    return best


def _as_asked(plan: Any, error_budget: float) -> Any:
    """``plan`` with the caller's error budget: one solved again for a tighter one said that
    one (a user who asked for 1e-2 read ``budget 0.00792`` in the plan)."""
    return dataclasses.replace(plan, error_budget=error_budget) if isinstance(plan, Plan) else plan


def _slack(error_budget: float) -> float:
    return error_budget * (1 + 1e-9)


def _said(err: InfeasibleBudgetError, error_budget: float, seen: float) -> InfeasibleBudgetError:
    """``err`` with why the plans searched were held below the error budget, and without the
    cures that name an error budget (those of the search held below it, not the caller's)."""
    text = str(err)
    marker = "; or lower that smallest budget: "
    kept = tuple(f for f in err.fixes if "error_budget" not in f and "error budget" not in f)
    if marker in text:
        text = text[: text.index(marker)] + (marker + "; or ".join(kept) if kept else "")
    said = InfeasibleBudgetError(
        f"{text} (plans the error model put within error_budget={error_budget:g} measured a "
        f"gradient error of up to {seen:.3g} in fit's check step, so the plans searched here "
        "had a smaller predicted error)",
        smallest_budget_bytes=err.smallest_budget_bytes,
    )
    said.fixes, said.plan = kept, _as_asked(err.plan, error_budget)
    return said
