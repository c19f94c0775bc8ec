"""The quantised chain problem and its exact dynamic programmes.

Bytes are counted in slots of ``budget / slots`` bytes and errors in slots of
``error_budget^2 / error_slots`` (errors of independent roundings add in quadrature, so the
resource is ``e^2``). Rounded **up** (and with ``L_p``, the replay state later segments keep to
the end of the step, bounded in every backward), a plan feasible in slots fits in bytes and
errors; rounded **down** (and ``L_p`` left out), every plan that fits is feasible in slots: a
relaxation, whose answers :func:`revckpt.schedule.solve` checks against the exact figures.

The programme over a quantised instance (exact for it)::

    T[k, P', e', f'] = min over j < k, strategy s allowed after f, with P + W(j,k,s) <= B:
                       T[j, P, e, f] + time(j, k, s)
    P' = P + K(j,k,s),  e' = e + E(j,k,s)^2,  f' = follow_limit(j, k, s)

(``f``, what may follow the last segment: :func:`~revckpt.schedule.costs.follow_limit`.) Each
transition is a vectorised ``numpy`` update over all ``(P, e)`` at once: ``O(L^2 S)`` array
operations for ``L`` blocks and ``S`` strategies. :func:`min_peak_segments` runs the same
programme minimising the peak instead of the time.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from ..strategy import argument_of, kind_of
from .costs import (
    CHECKPOINT,
    BlockCost,
    Segment,
    SegmentCost,
    _replay_of,
    allowed_after,
    follow_limit,
    segment_cost,
    slots_of,
)
from .kinds import KINDS, STORE
from .step import StepCosts

__all__ = [
    "Candidate",
    "Instance",
    "candidates",
    "min_peak_segments",
    "quantise",
    "solve_segments",
]

Rounding = Literal["up", "down"]


@dataclass(frozen=True)
class Candidate:
    """A segment the programme may choose: ``segment``, its ``cost``
    (:func:`~revckpt.schedule.costs.segment_cost`) and ``limit``, what may follow it
    (:func:`~revckpt.schedule.costs.follow_limit`)."""

    segment: Segment
    cost: SegmentCost
    limit: int


@dataclass(frozen=True)
class Instance:
    """The quantised problem: per candidate segment ``(j, k, strategy)`` its kept and working
    slots, error slots and time; ``budget`` slots; ``error_budget`` slots."""

    length: int
    strategies: tuple[str, ...]
    candidates: tuple[tuple[int, int, str, int, int, int, float], ...]  # j, k, s, K, W, E, T
    budget: int
    error_budget: int
    limits: tuple[int, ...] = ()  # per candidate: what may follow it (costs.follow_limit)
    tail: int = 0  # slots the step needs above what the chain keeps once its forward ends


def _possible(
    blocks: Sequence[BlockCost], j: int, k: int, s: str, step: StepCosts | None = None
) -> bool:
    """Whether segment ``[j, k)`` may run with ``s``; once not, no longer segment from ``j``
    may either. In a whole step (``step``) the blocks are called by the model's own code, one
    at a time: a segment of several blocks is a checkpoint segment of chained blocks."""
    if step is not None and k > j + 1:
        if not (s == CHECKPOINT and step.chained):
            return False
        if step.max_span is not None and k - j > step.max_span:
            return False
    kind = KINDS[kind_of(s)]
    # a store segment of n blocks is n store segments of one: the programme uses those
    if (kind.one_block or s == STORE) and k > j + 1:
        return False
    if not kind.joins(blocks[j], blocks[k - 1]):
        return False
    return kind.runs_on(blocks[k - 1] if kind.last_ok else blocks[j], argument_of(s))


def candidates(
    blocks: Sequence[BlockCost], strategies: Sequence[str], step: StepCosts | None = None
) -> list[Candidate]:
    """Every segment a plan with ``strategies`` may use, with its cost."""
    found = []
    n = len(blocks)
    for s in strategies:
        for j in range(n):
            for k in range(j + 1, n + 1):
                if not _possible(blocks, j, k, s, step):
                    break
                seg = Segment(j, k, s)
                cost = segment_cost(blocks, seg, step)
                found.append(Candidate(seg, cost, follow_limit(blocks, seg)))
    return found


def late_bounds(blocks: Sequence[BlockCost], strategies: Sequence[str]) -> list[int]:
    """Per position ``k``: the most bytes segments from ``k`` on can keep to the end of the
    step (``L`` of any plan): each block's largest replay state over ``strategies``, and the
    parameter gradients its backward creates."""
    bounds = [0] * (len(blocks) + 1)
    for i in reversed(range(len(blocks))):
        b = blocks[i]
        late = max((_replay_of(b, s, True) for s in strategies), default=0)
        bounds[i] = bounds[i + 1] + late + (b.param_bytes if b.grads_new else 0)
    return bounds


def quantise(
    blocks: Sequence[BlockCost],
    *,
    budget_bytes: int,
    error_budget: float,
    strategies: Sequence[str],
    slots: int,
    error_slots: int,
    rounding: Rounding = "up",
    found: Sequence[Candidate] | None = None,
    step: StepCosts | None = None,
) -> Instance:
    """The instance at ``slots`` slots of ``budget_bytes / slots`` bytes, rounded ``"up"``
    (its plans fit) or ``"down"`` (a relaxation; see the module docstring). ``found``: the
    :func:`candidates`, if already computed. With ``step``, ``budget_bytes`` is the whole
    step's: the chain gets what the step holds outside it (``step.held``) less, and its kept
    bytes at the end of the forward must leave room for the head (``step.head``)."""
    up = rounding == "up"
    if step is not None:
        budget_bytes -= step.held
    if budget_bytes <= 0:
        return Instance(len(blocks), tuple(strategies), (), 0, 0, (), 1)  # nothing fits
    slot = budget_bytes / slots
    # an infinite error budget (what the least-peak searches for a cure ask) bounds nothing:
    # no error dimension then, rather than error slots every candidate fills with 0
    bounded = 0 < error_budget < math.inf
    err_slot = error_budget**2 / error_slots if bounded else 0.0
    bounds = late_bounds(blocks, strategies) if up else [0] * (len(blocks) + 1)
    cands, limits = [], []
    for c in candidates(blocks, strategies) if found is None else found:
        (j, k, s), cost = (c.segment.start, c.segment.stop, c.segment.strategy), c.cost
        if cost.error > 0 and error_budget <= 0:
            continue  # no error budget: approx is not allowed
        e = _error_slots(cost.error**2 / err_slot, up) if cost.error > 0 and bounded else 0
        work = max(cost.work, cost.backward_work + bounds[k])
        kept_slots, work_slots = slots_of(cost.kept, slot, up=up), slots_of(work, slot, up=up)
        cands.append((j, k, s, kept_slots, work_slots, e, cost.time))
        limits.append(c.limit)
    return Instance(
        length=len(blocks),
        strategies=tuple(strategies),
        candidates=tuple(cands),
        limits=tuple(limits),
        budget=slots,
        error_budget=error_slots if bounded else 0,
        tail=0 if step is None else slots_of(step.head, slot, up=up),
    )


def _error_slots(value: float, up: bool) -> int:
    return math.ceil(value - 1e-12) if up else math.floor(value + 1e-12)


def _table(inst: Instance, fill: float) -> np.ndarray:
    """One table of a position and a follow state, indexed by (kept slots, error slots)."""
    return np.full((inst.budget + 1, inst.error_budget + 1), fill)


def _transitions(inst: Instance, reached: list[set[int]]) -> Iterator[tuple[int, int, int]]:
    """``(j, candidate index, follow state f)`` for every candidate segment starting at ``j``
    and every state ``f`` reached at ``j`` that allows it, positions in order (so ``reached[j]``
    is complete when ``j`` comes)."""
    by_start: dict[int, list[int]] = {}
    for idx, c in enumerate(inst.candidates):
        by_start.setdefault(c[0], []).append(idx)
    for j in range(inst.length):
        for idx in by_start.get(j, ()):
            strategy = inst.candidates[idx][2]
            for f in sorted(reached[j]):
                if allowed_after(f, strategy):
                    yield j, idx, f


def _backtrack(
    inst: Instance, parent: list[dict[int, np.ndarray]], flag: int, p: int, e: int
) -> list[Segment]:
    """The segments of the best plan ending in follow state ``flag`` with ``p`` kept slots
    and ``e`` error slots."""
    segments = []
    k = inst.length
    while k > 0:
        idx, f = divmod(int(parent[k][flag][p, e]), 3)
        j, _, s, kept, _, err, _ = inst.candidates[idx]
        segments.append(Segment(j, k, s))
        k, flag, p, e = j, f, p - kept, e - err
    segments.reverse()
    return segments


def _run(inst: Instance, *, peak: bool) -> tuple[list[Segment], float] | None:
    """The programme minimising the total time (``peak=False``) or the quantised peak, and
    the best plan's value; ``None`` if no plan fits."""
    n, budget, ne = inst.length, inst.budget, inst.error_budget
    # per position, a table per follow state reached there, made when first reached (most
    # positions reach one of the three); a parent cell is read only where its value is finite,
    # which its transition wrote, so parents start unset
    best: list[dict[int, np.ndarray]] = [{} for _ in range(n + 1)]
    parent: list[dict[int, np.ndarray]] = [{} for _ in range(n + 1)]
    best[0][0] = _table(inst, np.inf)
    best[0][0][0, 0] = 0.0
    reached: list[set[int]] = [{0}] + [set() for _ in range(n)]
    for j, idx, f in _transitions(inst, reached):
        _, k, _, kept, work, err, time = inst.candidates[idx]
        rows = budget - max(work, kept if peak else 0) + 1  # P in [0, rows)
        cols = ne - err + 1
        if rows <= 0 or cols <= 0:
            continue
        here = best[j][f][:rows, :cols]
        if peak:
            cand = np.maximum(here, (np.arange(rows, dtype=float) + work)[:, None])
        else:
            cand = here + time
        flag = inst.limits[idx] if inst.limits else 0
        if flag not in best[k]:
            best[k][flag] = _table(inst, np.inf)
            parent[k][flag] = np.empty(best[k][flag].shape, dtype=np.int64)
        target = best[k][flag][kept : kept + rows, err:]
        cand = cand[: target.shape[0]]  # P' = P + K within the table
        better = cand < target
        if not better.any():
            continue
        target[better] = cand[better]
        reached[k].add(flag)
        parent[k][flag][kept : kept + rows, err:][better] = idx * 3 + f
    level = np.arange(budget + 1, dtype=float)[:, None]  # kept slots at the chain's end
    ends = []  # per follow state reached at the end, in order: its best cell and value
    for flag in sorted(best[n]):
        final = best[n][flag]
        if peak:  # the head runs on top of what the chain keeps
            final = np.maximum(final, level + inst.tail)
            final[max(0, budget - inst.tail + 1) :, :] = np.inf
        else:
            final = np.where(level + inst.tail <= budget, final, np.inf)
        cell = np.unravel_index(int(np.argmin(final)), final.shape)
        ends.append((float(final[cell]), flag, cell))
    ends = [end for end in ends if math.isfinite(end[0])]
    if not ends:
        return None
    value, flag, (p, e) = min(ends, key=lambda end: end[0])  # the first state of least value
    return _backtrack(inst, parent, flag, int(p), int(e)), value


def solve_segments(inst: Instance) -> tuple[list[Segment], float] | None:
    """The optimal segments of a quantised instance and their time, or ``None`` if none fits."""
    return _run(inst, peak=False)


def min_peak_segments(inst: Instance) -> list[Segment] | None:
    """The segments of the plan of least quantised peak within the instance's budgets."""
    found = _run(inst, peak=True)
    return None if found is None else found[0]
