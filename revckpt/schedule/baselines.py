"""Plans that are chosen rather than solved: :func:`make_plan` (segments you give) and
:func:`baseline` (store, per-block, sqrt, every-k, greedy), with the cost model's predictions."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from ..checkpoint import segment_bounds
from ..errors import InvalidArgumentError
from .budget import parse_budget
from .costs import CHECKPOINT, STORE, BlockCost, Segment, chain_totals, evaluate
from .plan import Plan
from .step import StepCosts

__all__ = ["baseline", "make_plan"]


def _blocks_of(profile: Any) -> list[BlockCost]:
    blocks = list(getattr(profile, "blocks", profile))
    if not blocks:
        raise InvalidArgumentError(
            "the profile has no blocks; profile a non-empty chain (schedule.profile(blocks, x))"
        )
    if not all(isinstance(b, BlockCost) for b in blocks):
        raise InvalidArgumentError(
            "solve takes a Profile (from revckpt.schedule.profile) or a list of BlockCost"
        )
    return blocks


def _plan(
    profile: Any,
    blocks: Sequence[BlockCost],
    segments: Sequence[Segment],
    *,
    name: str,
    budget: int | None,
    error_budget: float,
) -> Plan:
    step = _step_of(profile)
    base, store_peak = chain_totals(blocks, step)
    ev = evaluate(blocks, segments, step=step)
    return Plan(
        segments=tuple(segments),
        predicted_peak_bytes=ev.peak_bytes,
        predicted_overhead=ev.overhead_s / base if base > 0 else 0.0,
        predicted_error=ev.error,
        memory_budget_bytes=budget,
        error_budget=error_budget,
        store_all_peak_bytes=store_peak,
        base_time_s=base,
        name=name,
        block_names=tuple(getattr(profile, "names", ())),
        input_signature=getattr(profile, "input_signature", None),
        threads=getattr(profile, "threads", None),
        compiled=getattr(profile, "compiled", False),
        blocks_digest=getattr(profile, "blocks_digest", None),
    )


def _step_of(profile: Any) -> StepCosts | None:
    """The whole step's costs outside the chain, for a profile made in situ."""
    return getattr(profile, "step", None)


def make_plan(profile: Any, segments: Sequence[Segment], *, name: str = "custom") -> Plan:
    """A plan you choose (segments in order, covering the chain), with the cost model's
    predictions, e.g. ``make_plan(prof, [Segment(0, 4, "approx:e4m3"), Segment(4, 8,
    "checkpoint")])``; raises :class:`~revckpt.InvalidArgumentError` for segments that do not
    cover the chain or break a rule of the cost model."""
    blocks = _blocks_of(profile)
    segs = list(segments)
    if not all(isinstance(s, Segment) for s in segs):
        raise InvalidArgumentError(
            "make_plan takes revckpt.schedule.Segment(start, stop, strategy) objects"
        )
    return _plan(profile, blocks, segs, name=name, budget=None, error_budget=0.0)


def baseline(profile: Any, name: str, *, memory_budget: Any = None) -> Plan:
    """A reference plan: ``"store"`` (nothing recomputed), ``"per-block"`` (every block
    checkpointed), ``"sqrt"`` (``round(sqrt(L))`` equal segments), ``"every-k"`` (segments of
    ``k`` blocks), or ``"greedy"`` (from store-all, checkpoint one block at a time, the one that
    lowers the predicted peak most per second of recompute, until ``memory_budget`` fits)."""
    blocks = _blocks_of(profile)
    n = len(blocks)
    step = _step_of(profile)
    _, store_peak = chain_totals(blocks, step)
    budget = None if memory_budget is None else parse_budget(memory_budget, store_peak)

    def every(k: int) -> list[Segment]:
        return [Segment(j, min(j + k, n), CHECKPOINT) for j in range(0, n, k)]

    if name == "store":
        segments = [Segment(i, i + 1, STORE) for i in range(n)]
    elif name == "per-block":
        segments = every(1)
    elif name == "sqrt":
        # the segments of checkpoint_sequential(..., "sqrt"): lengths differ by at most one
        segments = [Segment(a, b, CHECKPOINT) for a, b in segment_bounds(n, "sqrt")]
    elif name.startswith("every-") and name[6:].isdigit() and int(name[6:]) >= 1:
        segments = every(int(name[6:]))
    elif name == "greedy":
        if budget is None:
            raise InvalidArgumentError("the greedy baseline needs memory_budget")
        segments = _greedy(blocks, step, budget)
    else:
        raise InvalidArgumentError(
            f"unknown baseline {name!r}; use 'store', 'per-block', 'sqrt', 'every-<k>' or 'greedy'"
        )
    return _plan(profile, blocks, segments, name=name, budget=budget, error_budget=0.0)


def _runs(strategy: Sequence[str]) -> list[Segment]:
    """Per-block strategies as segments: each store or checkpoint block its own segment."""
    return [Segment(i, i + 1, s) for i, s in enumerate(strategy)]


def _greedy(blocks: Sequence[BlockCost], step: StepCosts | None, budget: int) -> list[Segment]:
    """From store-all, checkpoint one block at a time, the one that lowers the predicted peak
    most per second of recompute, until ``budget`` fits."""
    n = len(blocks)
    strategy = [STORE] * n
    while True:
        current = evaluate(blocks, _runs(strategy), step=step)
        if current.peak_bytes <= budget:
            break
        best, best_score = None, -math.inf
        for i in range(n):
            if strategy[i] != STORE:
                continue
            trial = strategy.copy()
            trial[i] = CHECKPOINT
            ev = evaluate(blocks, _runs(trial), step=step)
            gain = current.peak_bytes - ev.peak_bytes
            score = gain / max(ev.overhead_s - current.overhead_s, 1e-12)
            if gain > 0 and score > best_score:
                best, best_score = i, score
        if best is None:
            raise InvalidArgumentError(
                f"the greedy baseline cannot reach {budget:,} bytes with per-block checkpoints"
            )
        strategy[best] = CHECKPOINT
    return _runs(strategy)
