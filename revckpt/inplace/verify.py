"""Never dominated, for whole models: :func:`fit_verified` measures the plan :func:`revckpt.fit`
found in the user's own training step next to the whole-model recipes the in-situ profile
prices, and installs the fastest that fits both budgets by measurement.

The recipes: store-all, every block checkpointed, every block ``selective:<policy>`` for each
policy profiled and every block ``approx:<codec>`` for each codec profiled (those only with
``error_budget > 0``), each made with :func:`revckpt.schedule.make_plan` from the profile and
measured only when its prediction fits both budgets. Each is installed on the model itself, in
turn, and measured in the step ``fit`` plans for (``example`` and ``loss_fn``):

* **peak**: fit's own metered step (:func:`~revckpt.inplace.step.measure_step`, gradients
  ``None`` before it), the one that checks fit's plan;
* **time**: rotated rounds, as :func:`~revckpt.time_ratios` runs them, each plan divided by
  store-all's time of the same round. Installing a plan sets an attribute on each block (no
  copy, no allocation), so it happens before each timed step, outside the clock; deep copies
  of the model, one per plan, would hold the parameters once per plan and time cold copies;
* **gradient error** (plans with an approx segment only; exact strategies give store-all's
  gradients bitwise): the relative L2 error of the planned blocks' parameter gradients against
  the store-all step's, both run from the same seed: the error budget's figure, which fit's own
  check step measures too (the head's and embedding's gradients, exact under approx, are not
  in it).

The choice is :func:`revckpt.schedule.verify._fastest_that_fits` (the one chain verification
makes): no measured plan that fits both budgets beats the winner on both measured peak and
measured time.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from torch import nn

from ..errors import InfeasibleBudgetError, InvalidArgumentError, SideOutputError
from ..measure.timing import _summary, wall_time
from ..report import PlanMeasurement, Report
from ..schedule.budget import human_bytes
from ..schedule.costs import Segment, strategy_names
from ..schedule.plan import Plan
from ..schedule.solver import baseline, make_plan
from ..schedule.verify import STORE_ALL, Verified, _fastest_that_fits, _key
from ..strategy import argument_of, kind_of
from .fit import Fitted, _agreed, _fit, model_digest, restore
from .plan_install import apply_plan
from .step import (
    Gradients,
    LossFn,
    Reference,
    error_parameters,
    gradient_copies,
    left_as_found,
    measure_step,
    run_step,
    seed_step,
)

__all__ = ["fit_verified"]

logger = logging.getLogger(__name__)

_VERIFIED = " (verified)"


def fit_verified(
    model: nn.Module,
    example: Any,
    *,
    memory_budget: int | float | str,
    rounds: int = 7,
    warmup: int = 1,
    seed: int = 0,
    **options: Any,
) -> Verified:
    """:func:`revckpt.fit` with ``verify=True``, returning what the verification measured.

    Fits the model (``options``: the other keyword arguments of ``fit``), measures its plan
    next to the recipes (see the module docstring), installs the fastest that fits both
    budgets by measurement and returns a :class:`~revckpt.schedule.Verified`: ``plan``, the
    plan installed (named ``"<name> (verified)"``: ``"optimal (verified)"`` when fit's plan
    won, ``"checkpoint every block (verified)"`` when that recipe did; it saves with
    :meth:`~revckpt.schedule.Plan.to_json` and applies with ``fit(..., plan=...)``);
    ``solved``, fit's plan; ``report``, every plan measured (a :class:`~revckpt.Report`, store-all
    first, ``chosen`` the winner's row; its ``measured_retained_bytes`` are 0, the in-situ step
    being metered for its peak only); ``measured``, the winner's row; ``replaced``; ``note``,
    one line saying what happened, also logged at INFO level to the ``revckpt.inplace.verify``
    logger (``logging.basicConfig(level=logging.INFO)`` shows it). It is the record chain
    verification (:func:`revckpt.schedule.verify`) returns; a function of its own, not a field
    of the plan, because a :class:`~revckpt.schedule.Plan` is what saves to JSON and applies
    again, and the measurements of one machine's run are neither.

    Cost, beyond the fit itself: per plan measured (fit's, store-all and every recipe
    predicted to fit) one metered step and ``warmup + rounds`` timed ones (9 steps by
    default), one more step per plan with an approx segment and one store-all step as their
    reference. The metered step runs slower than a plain one: on the 4-block GPTs of
    ``tests/zoo.py`` (batch 8 x 64, CPU) three plans took about 40 plain steps of wall time.
    With ``plan=`` (a saved plan), the step is also traced and profiled as when solving (the
    recipes need the profile), and the saved plan is measured even when predicted over the
    budget.

    Raises :class:`~revckpt.InfeasibleBudgetError` when no measured plan fits both budgets
    (in practice only for a saved plan: fit's own plan fitted in its measured check step),
    naming the least measured peak. The model is restored on any error.
    """
    if "verify" in options:
        raise InvalidArgumentError("fit_verified always verifies: leave verify= out")
    for name, value, least in (("rounds", rounds, 1), ("warmup", warmup, 0)):
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise InvalidArgumentError(
                f"{name}={value!r}: pass an int >= {least} (default rounds=7, warmup=1)"
            )
    fitted = _fit(model, example, memory_budget=memory_budget, profiled=True, **options)
    try:
        loss_fn = options.get("loss_fn")
        found = _agreed(_verified(model, example, loss_fn, fitted, rounds, warmup, seed))
        apply_plan(found.plan, fitted.found, fitted.keys, fitted.sites)
    except BaseException:
        restore(model)
        raise
    logger.info("revckpt.fit: %s", found.note)
    return found


def _candidates(fitted: Fitted) -> dict[str, Plan]:
    """Store-all, fit's plan and the recipes predicted to fit both budgets, by name, each once
    (a recipe that runs as fit's plan, or fit's plan that runs as store-all, is left out)."""
    prof = fitted.profile
    assert prof is not None
    n = len(prof.blocks)
    wanted: list[tuple[str, str]] = []
    if "checkpoint" in fitted.strategies:
        wanted.append(("checkpoint every block", "checkpoint"))
    for strategy in strategy_names(prof.blocks):
        if strategy not in fitted.strategies:  # (fit left it out: a side output the loss uses)
            continue
        kind, arg = kind_of(strategy), argument_of(strategy)
        if kind == "selective" and all(arg in b.selective for b in prof.blocks):
            wanted.append((f"selective {arg}", strategy))
        elif kind == "approx" and all(arg in b.approx for b in prof.blocks):
            wanted.append((f"approx {arg}", strategy))
    recipes = {STORE_ALL: baseline(prof, "store")}
    for name, strategy in wanted:
        try:
            plan = make_plan(prof, [Segment(i, i + 1, strategy) for i in range(n)], name=name)
        except InvalidArgumentError:
            continue  # a rule of the cost model forbids it on this model: not a recipe here
        fits = plan.predicted_peak_bytes <= fitted.budget
        if fits and plan.predicted_error <= fitted.error_budget * (1 + 1e-9):
            recipes[name] = plan
    solved, name = fitted.plan, fitted.plan.name
    while name in recipes:
        name += " (fit)"
    ordered = {STORE_ALL: recipes.pop(STORE_ALL), name: solved, **recipes}
    plans: dict[str, Plan] = {}
    for name, plan in ordered.items():
        if all(_key(plan) != _key(other) for other in plans.values()):
            plans[name] = plan
    return plans


def _verified(
    model: nn.Module,
    example: Any,
    loss_fn: LossFn,
    fitted: Fitted,
    rounds: int,
    warmup: int,
    seed: int,
) -> Verified:
    plans = _agreed(_candidates(fitted))  # every rank measures the same plans, in one order
    in_step = _InStep(model, example, loss_fn, plans, fitted)
    peaks, times, errors = in_step.peaks(), in_step.times(rounds, warmup), in_step.errors(seed)
    budget, error_budget = fitted.budget, fitted.error_budget
    rows = [_row(name, plan, peaks, times, errors, budget) for name, plan in plans.items()]
    solved = fitted.plan
    solved_row = next(r for r in rows if _key(plans[r.name]) == _key(solved))
    best = _fastest_that_fits(
        rows, memory_budget=budget, error_budget=error_budget, prefer=solved_row.name
    )
    if best is None:
        raise _none_fits(rows, budget, error_budget)
    replaced = _key(plans[best.name]) != _key(solved)
    plan = _winner(model, fitted, plans[best.name] if replaced else solved, best, replaced)
    report = Report(
        rows=tuple(rows),
        store_all_peak_bytes=peaks[STORE_ALL],
        input_shape=fitted.shapes[0],
        chosen=best.name,
        error_budget=error_budget,
    )
    note = _note(solved_row, best, replaced, rows, budget, error_budget)
    return Verified(plan, solved, report, best, replaced, note)


def _row(
    name: str,
    plan: Plan,
    peaks: dict[str, int],
    times: dict[str, list[float]],
    errors: dict[str, float],
    budget: int,
) -> PlanMeasurement:
    """The measured row of plan ``name``, its time against store-all's of the same rounds."""
    ratio = _summary(times[name], times[STORE_ALL])
    return PlanMeasurement(
        name=name,
        strategies=tuple(plan.strategies),
        measured_peak_bytes=peaks[name],
        measured_retained_bytes=0,
        predicted_peak_bytes=plan.predicted_peak_bytes,
        memory_budget_bytes=budget,
        time_ratio=ratio.ratio,
        time_ratio_iqr=(ratio.q25, ratio.q75),
        predicted_overhead=plan.predicted_overhead,
        gradient_error=errors[name],
        predicted_error=plan.predicted_error,
    )


def _none_fits(
    rows: list[PlanMeasurement], budget: int, error_budget: float
) -> InfeasibleBudgetError:
    """The error for no measured plan fitting both budgets: naming the error budget where
    plans measured within the memory budget and only their gradient errors were over it, else
    the least measured peak of the plans within the error budget."""
    within_error = [r for r in rows if r.within_error(error_budget)]
    least = min(within_error or rows, key=lambda r: r.measured_peak_bytes)
    over = [r for r in rows if r.measured_peak_bytes <= budget and not r.within_error(error_budget)]
    if over:
        closest = min(over, key=lambda r: r.gradient_error)
        return InfeasibleBudgetError(
            f"no plan measured in the training step fits the memory budget of "
            f"{human_bytes(budget)} ({budget:,} bytes) within the error budget "
            f"{error_budget:g}: {len(over)} measured within the memory budget, but over the "
            f"error budget (the least, {closest.name!r}, measured a gradient error of "
            f"{closest.gradient_error:.3g} where {closest.predicted_error:.3g} was predicted). "
            f"Raise error_budget to at least {closest.gradient_error:.3g}, or memory_budget to "
            f"{human_bytes(least.measured_peak_bytes)} ({least.measured_peak_bytes:,} bytes), "
            f"{least.name!r}'s measured peak",
            smallest_budget_bytes=least.measured_peak_bytes,
        )
    return InfeasibleBudgetError(
        f"no plan measured in the training step fits the memory budget of "
        f"{human_bytes(budget)} ({budget:,} bytes) within the error budget "
        f"{error_budget:g}: the least measured peak was {least.name!r}'s "
        f"{human_bytes(least.measured_peak_bytes)} ({least.measured_peak_bytes:,} bytes); "
        "raise memory_budget to at least that",
        smallest_budget_bytes=least.measured_peak_bytes,
    )


def _winner(
    model: nn.Module, fitted: Fitted, winner: Plan, best: PlanMeasurement, replaced: bool
) -> Plan:
    """The plan to install: the winner named ``"<name> (verified)"``, its prediction raised
    to what it measured, made for this model and budget."""
    name = best.name if replaced else fitted.plan.name.removesuffix(_VERIFIED)
    return dataclasses.replace(
        winner,
        name=name + _VERIFIED,
        predicted_peak_bytes=max(winner.predicted_peak_bytes, best.measured_peak_bytes),
        memory_budget_bytes=fitted.budget,
        error_budget=fitted.error_budget,
        store_all_peak_bytes=fitted.store_peak,
        block_shapes=fitted.shapes,
        block_dtypes=fitted.dtypes,
        block_keys=tuple(fitted.keys) if fitted.shapes else winner.block_keys,
        block_tensors=(
            tuple(tuple(sorted(s, key=str)) for s in fitted.sites)
            if fitted.sites
            else winner.block_tensors
        ),
        block_tensor_shapes=fitted.site_shapes if fitted.sites else winner.block_tensor_shapes,
        autocast=fitted.autocast,
        model_digest=model_digest(model),
        left_out=fitted.plan.left_out,
    )


@dataclasses.dataclass(frozen=True)
class _InStep:
    """The plans to measure in the user's training step (``example`` and ``loss_fn``), each
    installed on the model itself by name (an attribute set on each block: no copy, no
    allocation)."""

    model: nn.Module
    example: Any
    loss_fn: LossFn
    plans: dict[str, Plan]
    fitted: Fitted

    def install(self, name: str) -> None:
        apply_plan(self.plans[name], self.fitted.found, self.fitted.keys, self.fitted.sites)

    def step(self) -> None:
        """One training step of the model as installed."""
        run_step(self.model, self.example, self.loss_fn)

    def peaks(self) -> dict[str, int]:
        """The metered step's peak per plan. A recipe whose step raises
        :class:`~revckpt.SideOutputError` (approx on every block, where the loss uses a block's
        side output and fit's own plan, exact, never ran approx to find out) is left out of
        :attr:`plans`."""
        peaks = {}
        for name in list(self.plans):
            self.install(name)
            try:
                peaks[name] = measure_step(self.model, self.example, self.loss_fn)
            except SideOutputError:
                if name == STORE_ALL or _key(self.plans[name]) == _key(self.fitted.plan):
                    raise
                del self.plans[name]
        return peaks

    def times(self, rounds: int, warmup: int) -> dict[str, list[float]]:
        """Seconds of the step per plan and round: ``warmup`` untimed rounds, then ``rounds``
        rounds in an order rotated by one each round; each plan installed, and the gradients
        set to ``None``, before its step, outside the clock."""
        names = list(self.plans)
        params = [p for p in self.model.parameters() if p.requires_grad]
        times: dict[str, list[float]] = {name: [] for name in names}
        with left_as_found(self.model, self.example):
            for i in range(warmup + rounds):
                shift = i % len(names)
                for name in names[shift:] + names[:shift]:
                    self.install(name)
                    for p in params:
                        p.grad = None
                    seconds = wall_time(self.step)
                    if i >= warmup:
                        times[name].append(seconds)
        return times

    def errors(self, seed: int) -> dict[str, float]:
        """The relative L2 error of the planned blocks' parameter gradients against
        store-all's, from the same seed, of every plan with an approx segment; 0 for the
        others (exact)."""
        plans = self.plans
        approx = [n for n, p in plans.items() if any(kind_of(s) == "approx" for s in p.strategies)]
        errors = dict.fromkeys(plans, 0.0)
        if not approx:
            return errors
        params = error_parameters(self.model, self.fitted.found)

        def gradients(name: str) -> Gradients:
            self.install(name)
            for p in params:
                p.grad = None
            seed_step(self.model, seed)
            self.step()
            return gradient_copies(params)

        with left_as_found(self.model, self.example):
            reference = Reference(seed, params, gradients(STORE_ALL))
            for name in approx:
                errors[name] = reference.error_of(gradients(name))
        return errors


def _note(
    solved: PlanMeasurement,
    best: PlanMeasurement,
    replaced: bool,
    rows: list[PlanMeasurement],
    budget: int,
    error_budget: float,
) -> str:
    at = (
        f"{best.time_ratio:.2f}x store-all's time, {human_bytes(best.measured_peak_bytes)} of a "
        f"{human_bytes(budget)} budget"
    )
    if not replaced:
        fitting = sum(
            r.measured_peak_bytes <= budget and r.within_error(error_budget) for r in rows
        )
        return (
            f"verified: {solved.name!r} was the fastest of the {fitting} of {len(rows)} plans "
            f"measured that fit both budgets ({at})"
        )
    if solved.measured_peak_bytes > budget:
        why = f"which measured {human_bytes(solved.measured_peak_bytes)}, over the budget"
    elif not solved.within_error(error_budget):
        why = (
            f"which measured a gradient error of {solved.gradient_error:.2g}, over the error "
            f"budget {error_budget:g}"
        )
    else:
        why = f"which measured {solved.time_ratio:.2f}x store-all's time"
    return f"verified: {best.name!r} replaces {solved.name!r}, {why}; it measured {at}"
