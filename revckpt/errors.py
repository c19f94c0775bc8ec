"""Errors raised by revckpt.

Every error the library raises derives from :class:`RevckptError`, and every message says what
was wrong and what to do instead. Subclasses also derive from the matching built-in exception
(``ValueError``, ``TypeError``, ``RuntimeError``, ``AssertionError``) so that code written against
the built-ins keeps working.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "CheckpointMismatchError",
    "DoubleBackwardError",
    "Float16RangeError",
    "GradientMismatchError",
    "InfeasibleBudgetError",
    "InvalidArgumentError",
    "InvalidInputTypeError",
    "MeasurementError",
    "ModifiedInputError",
    "ModifiedParameterError",
    "PlanWarning",
    "ReconstructionError",
    "ReplayError",
    "RevckptError",
    "SideOutputError",
]


class RevckptError(Exception):
    """Base class of every error raised by revckpt."""


class InvalidArgumentError(RevckptError, ValueError):
    """An argument has a value revckpt cannot work with (a size, a count, an option name)."""


class InfeasibleBudgetError(InvalidArgumentError):
    """No plan fits the memory budget; ``smallest_budget_bytes`` is the smallest that does.

    ``plan``: where :func:`revckpt.fit` raises it after solving (its message then says so),
    the plan of least peak it found and measured at that smallest budget (a
    :class:`revckpt.schedule.Plan`); ``None`` elsewhere (:func:`revckpt.schedule.solve`,
    ``fit(..., verify=True)`` where no recipe it measured fits, a reversible stack's fit).
    ``revckpt.fit(model, batch,
    memory_budget=err.smallest_budget_bytes, plan=err.plan)`` installs it without profiling
    the model again."""

    # the ways to lower that smallest budget which the message suggests, one a string (the
    # solver sets them where it found any)
    fixes: tuple[str, ...] = ()
    plan: Any = None

    def __init__(self, message: str, *, smallest_budget_bytes: int) -> None:
        super().__init__(message)
        self.smallest_budget_bytes = smallest_budget_bytes


class InvalidInputTypeError(RevckptError, TypeError):
    """An argument has the wrong type (a block that is not callable, an input that is no tensor)."""


class MeasurementError(RevckptError, RuntimeError):
    """A meter's block ran code the meter cannot see (compiled code under the CPU storage
    tracker): its figures would be wrong, so it says so instead of returning them."""


class CheckpointMismatchError(RevckptError, RuntimeError):
    """A recomputed forward produced different values than the first forward."""


class ModifiedInputError(RevckptError, RuntimeError):
    """A tensor kept for backward was modified in place after the forward used it."""


class ModifiedParameterError(ModifiedInputError):
    """A parameter or buffer a recompute needs changed in place between the forward and its
    backward (an optimizer step, ``load_state_dict``, an update under ``no_grad``)."""


class ReplayError(RevckptError, RuntimeError):
    """A recompute cannot run as the forward ran: a buffer the forward updated and no copy of
    its old value, random numbers drawn by another thread meanwhile, a module flag changed."""


class Float16RangeError(ReplayError):
    """A float16 recompute from a block's rounded (approx) input reached inf or nan where its
    forward was finite: values near float16's largest (65504) rounded past it."""


class SideOutputError(RevckptError, RuntimeError):
    """A gradient reached a tensor that a block computed in a forward keeping nothing for
    backward (approx, offload, a reversible stack): a side output the loss uses, such as a
    mixture-of-experts layer's router logits."""


class DoubleBackwardError(RevckptError, RuntimeError):
    """``create_graph=True`` (double backward) reached a node that is differentiable once."""


class ReconstructionError(RevckptError, RuntimeError):
    """A reversible block's input cannot be rebuilt: it drifted past the ``check_inverse``
    tolerance, or a stream of an exact stack left the grid (beyond its range, or not finite:
    a diverging run, usually)."""


class GradientMismatchError(RevckptError, AssertionError):
    """Gradients of a candidate differ from the reference by more than the tolerance."""


class PlanWarning(UserWarning):
    """A plan runs off the conditions its predictions were made for (another intra-op thread
    count than it was profiled with: its time predictions do not hold), or where it does not
    apply (a planned block in eval mode with gradients on: a backward there saves nothing)."""
