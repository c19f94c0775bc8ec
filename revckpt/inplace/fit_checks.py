"""What :func:`revckpt.fit` checks beside the plan it solves: a saved plan (``plan=``) against
the model it is loaded into (its lossy segments against the error budget and ``strategies=``,
its whole step measured once, every rank taking the same decision), and a model already
compiled (planned as the eager module it wraps)."""

from __future__ import annotations

import contextlib
import math
import os
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ..errors import Float16RangeError, InvalidArgumentError, PlanWarning, SideOutputError
from ..schedule.plan import Plan
from ..schedule.plan_checks import dtype_named
from ..strategy import kind_of
from .blocks import Blocks, model_digest
from .step import measure_step

__all__ = [
    "agreed_largest",
    "as_trained",
    "caller_level",
    "check_saved_strategies",
    "load_plan",
    "lossy",
    "planned_names",
    "saved_step_peak",
    "uncompiled",
    "without_approx",
    "without_nodes",
]


@contextlib.contextmanager
def uncompiled(model: nn.Module) -> Iterator[nn.Module]:
    """The module to plan, run eagerly while ``fit`` measures it (a compiled step cannot be
    metered: fit refused the example as one the model cannot run): ``torch.compile(model)``'s
    module itself, or one compiled in place (``model.compile()``, ``block.compile()``) with
    its compiled calls set aside meanwhile; a compiled module inside the model is refused,
    saying so. The plan installed, the compiled model runs it (compiled again)."""
    model = getattr(model, "_orig_mod", model) if _is_optimized(model) else model
    nested = [name for name, m in model.named_modules() if name and _is_optimized(m)]
    if nested:
        raise InvalidArgumentError(
            f"fit measures the training step eagerly, and {nested[0]} is a torch.compile'd "
            "module inside the model (DDP(torch.compile(model)), say): fit the uncompiled "
            "model, then compile it (or compile the model in place, model.compile(), which "
            "fit sets aside while it measures)"
        )
    # modules compiled in place (model.compile(), or block.compile() per block)
    aside = [(m, m._compiled_call_impl) for m in model.modules() if _compiled_in_place(m)]
    for m, _ in aside:
        m._compiled_call_impl = None
    try:
        yield model
    finally:
        for m, compiled in aside:
            m._compiled_call_impl = compiled


def _compiled_in_place(module: nn.Module) -> bool:
    return module.__dict__.get("_compiled_call_impl") is not None


def _is_optimized(model: nn.Module) -> bool:
    optimized = getattr(getattr(torch, "_dynamo", None), "eval_frame", None)
    kind = getattr(optimized, "OptimizedModule", None)
    return kind is not None and isinstance(model, kind)


@contextlib.contextmanager
def as_trained(saved: Plan, found: list[tuple[str, nn.Module]], model: nn.Module) -> Iterator[None]:
    """Steps within run as training runs the saved plan, modes left as found. A model in eval
    mode (as ``from_pretrained`` returns it; planned blocks run plainly there) runs as
    ``model.train()`` will train it, dropout on; a model in train mode as it is (dropout
    modules the user put in eval mode stay so); under the autocast the plan was made under
    (:func:`~revckpt.inplace.step.measure_step` turns its cast cache off)."""
    idle = all(not block.training for _, block in found)
    modes = [(m, m.training) for m in (model.modules() if idle else (b for _, b in found))]
    dtype = None if saved.autocast is None else dtype_named(saved.autocast)
    device = next((p.device.type for p in model.parameters()), "cpu")
    under = dtype is not None and not torch.is_autocast_enabled(device)
    context = torch.autocast(device, dtype=dtype) if under else contextlib.nullcontext()
    try:
        for m, _ in modes:
            m.training = True
        with context:
            yield
    finally:
        for m, training in modes:
            m.training = training


def saved_step_peak(
    saved: Plan,
    found: list[tuple[str, nn.Module]],
    model: nn.Module,
    example: Any,
    loss_fn: Any,
) -> int:
    """The peak of one step with the saved plan installed, as training runs it
    (:func:`as_trained`)."""
    with as_trained(saved, found, model):
        return measure_step(model, example, loss_fn)


def lossy(plan: Plan) -> list[str]:
    """The plan's strategies that change the gradients (approx, compress)."""
    return sorted({s for s in plan.strategies if kind_of(s) in ("approx", "compress")})


def agreed_largest(measured: float) -> float:
    """Under ``torch.distributed``, the largest of the ranks' figures (a peak, a gradient
    error; nan the largest): every rank then takes the same decision on a saved plan (one
    refusing while another trains would hang both)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return measured
    figures: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(figures, measured)
    return max(figures, key=lambda v: math.inf if math.isnan(v) else v)


def check_saved_strategies(saved: Plan, chosen: tuple[str, ...], o: Any) -> None:
    """A saved plan's lossy segments need an error budget its predicted error fits, and with
    ``strategies=`` every segment one of them."""
    changed = lossy(saved)
    if changed and not saved.predicted_error <= o.error_budget:
        raise InvalidArgumentError(
            f"the saved plan uses {changed} (lossy: predicted gradient error "
            f"{saved.predicted_error:.3g}), above error_budget={o.error_budget!r}; pass "
            "error_budget= at least that to use it, or make an exact plan with "
            "revckpt.fit(model, example, memory_budget=...)"
        )
    if o.strategies is not None:
        outside = sorted(set(saved.strategies) - set(chosen) - {"store"})
        if outside:
            raise InvalidArgumentError(
                f"the saved plan uses {outside}, which strategies={list(chosen)} leaves out; "
                "pass those too, or make a plan with these strategies"
            )


def without_approx(chosen: list[str]) -> list[str]:
    """``chosen`` without the approx codecs, for a float16 model whose check step raised
    :class:`~revckpt.Float16RangeError` (a recompute from a rounded input overflowed). Warns;
    raises it again where nothing else is left."""
    kept = [s for s in chosen if kind_of(s) != "approx"]
    if not kept or kept == chosen:
        raise Float16RangeError(
            "the float16 recompute of a block from its rounded input overflowed, and no "
            f"strategy but approx is allowed ({chosen}): allow 'checkpoint' (strategies=None), "
            "or compute in bfloat16 or float32"
        )
    warnings.warn(
        "revckpt.fit: a block's float16 recompute from its rounded (approx) input overflowed "
        "where its forward was finite (values near 65504): planned without approx",
        PlanWarning,
        stacklevel=caller_level(),
    )
    return kept


def without_nodes(chosen: list[str]) -> list[str]:
    """``chosen`` without the strategies that keep nothing of a block's first forward (approx,
    offload, reversible), for a model whose loss uses a block's side output (a
    mixture-of-experts layer's router logits): its check step raised
    :class:`~revckpt.SideOutputError` under one of them. Warns; raises it again where
    nothing else is left."""
    kept = [s for s in chosen if kind_of(s) not in ("approx", "offload", "reversible")]
    left = sorted(set(chosen) - set(kept))
    if not left or not kept:
        raise SideOutputError(
            f"the model's loss uses a side output of a planned block (router logits, "
            f"attention weights), which {left or chosen} cannot differentiate; allow "
            "'checkpoint' or 'selective:...' (strategies=None)"
        )
    warnings.warn(
        f"revckpt.fit: the model's loss uses a side output of a planned block (a "
        f"mixture-of-experts layer's router logits, attention weights), which {left} keep "
        "nothing of: planned without them",
        PlanWarning,
        stacklevel=caller_level(),
    )
    return kept


def caller_level() -> int:
    """The ``stacklevel`` of the first frame outside revckpt from the caller of
    :func:`warnings.warn` (fit's paths to a warning are of several depths)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
    frame, level = sys._getframe(2), 2
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(root):
        frame, level = frame.f_back, level + 1
    return level


def planned_names(plan: Any, model: nn.Module) -> Blocks:
    """The blocks a saved plan names, where the model has every one of them (fit picked them,
    perhaps not by the default rule: the layers around a layer's experts); else ``None``."""
    if plan is None:
        return None
    if not isinstance(plan, Plan):
        plan = Plan.from_json(plan)
    names = set(plan.block_names)
    present = {fqn for fqn, _ in model.named_modules()}
    if not names or not names <= present:
        return None
    return lambda _m, fqn: fqn in names


def load_plan(plan: Any, model: nn.Module, found: list[tuple[str, nn.Module]]) -> Plan:
    if not isinstance(plan, Plan):
        plan = Plan.from_json(plan)
    names = tuple(fqn for fqn, _ in found)
    if plan.model_digest is None or plan.block_names != names:
        raise InvalidArgumentError(
            f"the plan covers blocks {list(plan.block_names)[:3]}... but this model's blocks "
            f"are {list(names)[:3]}...: it was made for another model; make one for this "
            "model with revckpt.fit(model, example, memory_budget=...)"
        )
    if plan.model_digest != model_digest(model):
        raise InvalidArgumentError(
            "the plan was made for a model with other parameters (their names, shapes or "
            "dtypes differ); make one for this model with revckpt.fit(model, example, "
            "memory_budget=...)"
        )
    return plan
