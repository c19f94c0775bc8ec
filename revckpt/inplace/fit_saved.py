"""A saved plan applied by :func:`revckpt.fit` (``plan=``): installed as it is, checked by
one metered step against the memory budget, a lossy one's gradient error measured against the
step with every block stored (run checkpointed: the same gradients, bitwise), and the blocks
the plan left out guarded."""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn

from ..errors import InvalidArgumentError
from ..schedule.budget import parse_budget
from ..schedule.plan import Plan
from .fit_blocks import guard_left_out
from .fit_checks import agreed_largest, as_trained, lossy, saved_step_peak
from .install import Planned, install
from .plan_install import apply_plan
from .runners import runner_for
from .step import Reference, error_parameters, measured_gradients

__all__ = ["ERROR_SEED", "install_saved", "seedable"]

#: the generator state the store-all and plan steps compared for the error run from
ERROR_SEED = 0


def seedable(model: nn.Module, found: list[tuple[str, nn.Module]]) -> bool:
    """Whether the parameters the error is measured on (:func:`error_parameters`) exist, all
    on the CPU or CUDA devices: the generators two steps are seeded alike on
    (:func:`~revckpt.inplace.step.seed_step`), so that an approx plan's error is measured
    against the same dropout masks. Elsewhere (MPS, XPU) the plan's error is the model's."""
    params = error_parameters(model, found)
    return bool(params) and all(p.device.type in ("cpu", "cuda") for p in params)


def install_saved(
    saved: Plan,
    found: list[tuple[str, nn.Module]],
    memory_budget: Any,
    o: Any,
    model: nn.Module,
    example: Any,
) -> tuple[Plan, list[Any], int]:
    """A saved plan installed as it is, when its prediction fits the budget, and one metered
    step on ``example`` the budget (a model with the same parameters but more attention
    heads, or a larger batch, does not), and for a lossy plan the error budget (``o``: fit's
    options). Returns the plan (its predictions raised to what was measured), where each
    block's hidden state is, and the budget in bytes."""
    budget = parse_budget(memory_budget, saved.store_all_peak_bytes)
    if saved.predicted_peak_bytes > budget:
        raise InvalidArgumentError(
            f"the saved plan's whole step peaks at {saved.predicted_peak_bytes:,} bytes, "
            f"above memory_budget={memory_budget!r} ({budget:,} bytes); make a plan for "
            "this budget with revckpt.fit(model, example, memory_budget=...), or "
            "measure it against the simple recipes with verify=True"
        )
    keys: list[Any] = list(saved.block_keys) or [None] * len(found)  # older plans: by the rule
    # (off the CPU and CUDA devices, the plan's predicted error stands, as fit's own does)
    checked = bool(lossy(saved)) and seedable(model, found)
    reference = _reference(saved, found, model, example, o.loss_fn) if checked else None
    apply_plan(saved, found, keys, [frozenset(s) for s in saved.block_tensors])
    guard_left_out([(fqn, m) for fqn, m in model.named_modules() if fqn in set(saved.left_out)])
    measured = int(agreed_largest(saved_step_peak(saved, found, model, example, o.loss_fn)))
    if measured > budget:
        raise InvalidArgumentError(
            f"the saved plan, installed, peaked at {measured:,} bytes in a step on this "
            f"example, above memory_budget={memory_budget!r} ({budget:,} bytes; it predicted "
            f"{saved.predicted_peak_bytes:,}): it was made for a model of other settings "
            "(attention heads, an intermediate size the parameters do not show), a smaller "
            "batch, or other module settings (dropout on where it was off). Make a plan for "
            "this model and batch with revckpt.fit(model, example, memory_budget=...)"
        )
    if measured > saved.predicted_peak_bytes:  # as a fit's own: never below its check
        saved = dataclasses.replace(saved, predicted_peak_bytes=measured)
    if reference is not None:
        error = agreed_largest(_saved_error(saved, found, model, example, o.loss_fn, reference))
        if not error <= o.error_budget * (1 + 1e-9):  # nan reads as over
            raise InvalidArgumentError(
                f"the saved plan, installed, measured a gradient error of {error:.3g} (the "
                "planned blocks' parameter gradients, or the model's where they have none, "
                "against the step with every block stored) "
                f"in a step on this example, above error_budget={o.error_budget!r} (it "
                f"predicted {saved.predicted_error:.3g}). Pass a larger error_budget, or make a "
                "plan for this budget with revckpt.fit(model, example, memory_budget=..., "
                "error_budget=...)"
            )
        if error > saved.predicted_error:
            saved = dataclasses.replace(saved, predicted_error=error)
    return saved, keys, budget


def _reference(
    saved: Plan, found: list[tuple[str, nn.Module]], model: nn.Module, example: Any, loss_fn: Any
) -> Reference:
    """The store-all step's gradients of the planned blocks' parameters, to measure a saved
    lossy plan's error against: run with every block checkpointed (bitwise the same
    gradients, without store-all's peak, which the budget may not hold)."""
    params = error_parameters(model, found)
    for fqn, block in found:
        install(block, Planned(fqn, "checkpoint", runner_for("checkpoint")))
    with as_trained(saved, found, model):
        _, grads = measured_gradients(model, example, loss_fn, seed=ERROR_SEED, params=params)
    return Reference(ERROR_SEED, params, grads)


def _saved_error(
    saved: Plan,
    found: list[tuple[str, nn.Module]],
    model: nn.Module,
    example: Any,
    loss_fn: Any,
    reference: Reference,
) -> float:
    """The installed saved plan's gradient error against ``reference``, from its seed."""
    with as_trained(saved, found, model):
        _, grads = measured_gradients(
            model, example, loss_fn, seed=reference.seed, params=reference.params
        )
    return reference.error_of(grads)
