""":func:`revckpt.fit` on a model that holds a reversible stack (:func:`revckpt.make_reversible`).

The stack's layers compute one function whichever way its backward gets what it needs
(:data:`~revckpt.inplace._reversible_stack.MODES`): ``"store"`` (plain autograd, no extra
compute), ``"checkpoint"`` (each layer's two input streams kept, its forward re-run in
backward) or ``"reversible"`` (each layer's input rebuilt from its output; only anchors kept).
The three give the same gradients (the rebuild to round-off, see ``check_inverse``), so the
choice is a planning one: ``fit`` measures the user's whole step in each mode the strategies
allow (its peak, :func:`~revckpt.inplace.step.measure_step`), keeps those within the budget
and, when more than one fits, times them against ``"store"`` in rotated rounds and installs
the fastest; ``"store"`` needs no timing when it fits (nothing is recomputed). The plan it
returns covers the converted layers as one segment, with the measured peak and overhead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from ..errors import InfeasibleBudgetError, InvalidArgumentError
from ..measure.timing import wall_time
from ..schedule.budget import UNKNOWN_PEAK, human_bytes, parse_budget
from ..schedule.costs import Segment
from ..schedule.plan import Plan
from ..schedule.plan_checks import dtype_name
from ..strategy import StrategyLike
from ._reversible_stack import MODES, ReversibleLayers
from .blocks import Blocks, model_digest
from .step import LossFn, left_as_found, measure_step, run_step

__all__ = ["fit_converted", "fit_stack"]


def _modes(strategies: Sequence[StrategyLike] | None) -> list[str]:
    """The stack modes ``strategies`` allows (default: all three), ``"store"`` first."""
    if strategies is None:
        return ["store", "checkpoint", "reversible"]
    names = [str(s) for s in strategies]
    other = [s for s in names if s not in MODES]
    if other:
        raise InvalidArgumentError(
            f"strategies={names!r}: a reversible stack (revckpt.make_reversible) runs as a "
            f"whole, as one of {', '.join(MODES)}; {other[0]!r} is not one of them (or undo "
            "the conversion with revckpt.restore(model) to plan its layers one by one)"
        )
    return [m for m in ("store", "checkpoint", "reversible") if m in names]


def fit_converted(
    model: nn.Module,
    converted: ReversibleLayers,
    example: Any,
    *,
    memory_budget: int | float | str,
    strategies: Sequence[StrategyLike] | None,
    blocks: Blocks,
    plan: Any,
    loss_fn: LossFn,
    repeats: int,
) -> Plan:
    """:func:`revckpt.fit` on a model holding a reversible stack: :func:`fit_stack`, after
    the checks, the plan with the model's digest."""
    if blocks is not None or plan is not None:
        raise InvalidArgumentError(
            "fit on a model holding a reversible stack (revckpt.make_reversible) plans the "
            "stack as a whole: blocks= and plan= do not apply; leave them out"
        )
    parse_budget(memory_budget, UNKNOWN_PEAK)  # its syntax, before any step runs
    found = fit_stack(model, converted, example, memory_budget=memory_budget,
                      loss_fn=loss_fn, strategies=strategies, repeats=repeats)  # fmt: skip
    return dataclasses.replace(found, model_digest=model_digest(model))


def fit_stack(
    model: nn.Module,
    converted: ReversibleLayers,
    example: Any,
    *,
    memory_budget: int | float | str,
    loss_fn: LossFn,
    strategies: Sequence[StrategyLike] | None,
    repeats: int,
) -> Plan:
    """Install the fastest stack mode whose measured step fits ``memory_budget`` (see the
    module docstring); the plan says which, with what it measured."""
    modes = _modes(strategies)
    peaks = {}
    with _mode_kept(converted):
        for mode in dict.fromkeys(["store", *modes]):  # store: the budget's 100%
            converted.mode = mode
            peaks[mode] = measure_step(model, example, loss_fn)
    budget = parse_budget(memory_budget, peaks["store"])
    fits = [m for m in modes if peaks[m] <= budget]
    if not fits:
        measured = ", ".join(f"{m} {human_bytes(peaks[m])} ({peaks[m]:,} bytes)" for m in modes)
        fewer = ", or fewer anchors (make_reversible with a larger anchor_every or scale)"
        if converted.exact:  # no anchors to drop (k bits per element and layer instead)
            fewer = ""
        raise InfeasibleBudgetError(
            f"memory_budget={memory_budget!r} ({human_bytes(budget)}, {budget:,} bytes): the "
            f"reversible stack's step measured {measured}, none within it; raise the budget to "
            f"{min(peaks[m] for m in modes):,} bytes or use a smaller batch{fewer}",
            smallest_budget_bytes=min(peaks[m] for m in modes),
        )
    if "store" in fits:  # nothing recomputed: the fastest
        chosen, ratios = "store", {"store": 1.0}
    else:
        ratios = _ratios(model, converted, example, loss_fn, fits, repeats)
        chosen = min(fits, key=ratios.__getitem__)
    converted.mode = chosen
    converted.limit = converted.shape  # the example's: a larger batch is refused in training
    converted.limit_dtype = converted.hidden_dtype  # and a wider dtype
    converted.limit_autocast = converted.hidden_autocast  # or no autocast where it ran under one
    under = converted.hidden_autocast
    names = tuple(fqn for fqn, _ in converted.layers)
    dtype = converted.hidden_dtype
    return Plan(
        segments=(Segment(0, len(names), chosen),),
        predicted_peak_bytes=peaks[chosen],
        # a mode that recomputes timed faster than store-all is the machine's noise: none
        predicted_overhead=max(0.0, ratios[chosen] - 1),
        predicted_error=0.0,
        memory_budget_bytes=budget,
        error_budget=0.0,
        store_all_peak_bytes=peaks["store"],
        base_time_s=0.0,
        name=f"reversible stack: {chosen} (measured)",
        block_names=names,
        block_dtypes=() if dtype is None else (dtype_name(dtype),) * len(names),
        autocast=None if under is None else dtype_name(under),
        threads=torch.get_num_threads(),
    )


@contextlib.contextmanager
def _mode_kept(converted: ReversibleLayers) -> Iterator[None]:
    """The stack's mode and batch limit as found, the limit lifted meanwhile (a new example
    may be larger than the last fit's)."""
    kept = (converted.mode, converted.limit, converted.limit_dtype, converted.limit_autocast)
    converted.limit = None
    try:
        yield
    finally:
        (converted.mode, converted.limit, converted.limit_dtype, converted.limit_autocast) = kept


def _ratios(
    model: nn.Module,
    converted: ReversibleLayers,
    example: Any,
    loss_fn: LossFn,
    modes: list[str],
    repeats: int,
) -> dict[str, float]:
    """Each mode's step time over ``"store"``'s: one untimed round, then ``repeats`` rounds
    in an order rotated by one each round, the median per mode of its time over store's in
    the same round; gradients ``None`` before each step, the model left as it was."""
    names = list(dict.fromkeys(["store", *modes]))
    params = [p for p in model.parameters() if p.requires_grad]
    rounds: list[dict[str, float]] = []
    with left_as_found(model, example), _mode_kept(converted):
        for i in range(1 + max(1, repeats)):
            shift = i % len(names)
            seconds = {}
            for mode in names[shift:] + names[:shift]:
                converted.mode = mode
                for p in params:
                    p.grad = None
                seconds[mode] = wall_time(lambda: run_step(model, example, loss_fn))
            if i:
                rounds.append(seconds)
    return {m: statistics.median(r[m] / r["store"] for r in rounds) for m in names}
