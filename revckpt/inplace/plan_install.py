"""A :class:`~revckpt.schedule.Plan` installed on the blocks of a model, each block given its
segment's runner, and what the plan's check recorded of its hidden state (where it is among
the arguments, its largest shape, dtype and autocast, the tensors the traced call had)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from ..schedule.plan import Plan
from ..schedule.plan_checks import dtype_named
from .install import Planned, install
from .runners import runner_for, segment_runners

__all__ = ["apply_plan"]


def apply_plan(
    plan: Plan,
    found: list[tuple[str, nn.Module]],
    keys: Sequence[Any],
    sites: Sequence[frozenset[Any]] = (),
) -> None:
    """Install ``plan`` on the blocks ``found`` (``keys``: where their hidden states are;
    ``sites``: which of their arguments held tensors in the traced step, if traced)."""
    shapes = plan.block_shapes or (None,) * len(found)
    tensors = list(sites) or [None] * len(found)
    limits: list[dict[Any, tuple[int, ...]] | None] = [None] * len(found)
    if plan.block_tensor_shapes:  # (none in a plan saved before they were recorded)
        limits = [
            dict(zip(names, shapes, strict=True))
            for names, shapes in zip(plan.block_tensors, plan.block_tensor_shapes, strict=True)
        ]
    warned: set[Any] = set()  # one warning per argument for the blocks of this plan
    dtypes = [dtype_named(d) for d in plan.block_dtypes] or [None] * len(found)
    autocast = None if plan.autocast is None else dtype_named(plan.autocast)
    for seg in plan.segments:
        labels = tuple(fqn for fqn, _ in found[seg.start : seg.stop])
        if seg.strategy == "checkpoint":
            runners = segment_runners(labels)
        else:
            runners = [runner_for(seg.strategy)] * len(labels)
        for i, run in zip(range(seg.start, seg.stop), runners, strict=True):
            fqn, block = found[i]
            info = Planned(
                fqn,
                seg.strategy,
                run,
                key=keys[i],
                limit=shapes[i],
                dtype=dtypes[i],
                autocast=autocast,
                threads=plan.threads,
                tensors=tensors[i],
                warned=warned,
                arg_limits=limits[i],
            )
            install(block, info)
