"""What the chain profiler's timed steps say (:mod:`.probe`): each step's pace and each
group's stored times fitted over the reference blocks (:class:`StoredTimes`), each strategy's
extra seconds per block (measured, or priced from the groups that were: :func:`filled`), and
what a block adds inside a longer checkpoint segment or reversible stack."""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Callable, Sequence

import numpy as np

from .costs import CHECKPOINT, STORE, Segment

__all__ = [
    "StoredTimes",
    "Timed",
    "by_group",
    "chained_extras",
    "fit_steps",
    "overheads",
    "ratios",
    "strategy_order",
]

Timed = list[tuple[list[Segment], list[tuple[float, float]]]]  # steps: segments, times


class StoredTimes:
    """Each group's stored forward and backward seconds, and each strategy's extra seconds.

    The stored step can run cold (the first of a process: its blocks read up to 1.5x what the
    same blocks stored read a step later, unevenly along the chain), so the stored times come
    from the strategy steps' reference blocks where a group has any. Each strategy step runs
    at its own pace, so a reference block's time is taken as its step's factor times its
    group's time, both fitted over all reference blocks (:func:`fit_steps`): every group's
    times are then in one unit, the steps' mean. Groups that share no step with the others,
    and groups no reference reached, are tied in through the stored step (their pace against
    it). A strategy block's extra time is taken against its group's reference
    blocks in the same step where there are any (else its group's time at that step's
    factor), divided by the step's factor: the machine's load and the process's warm-up then
    cancel within the step."""

    def __init__(self, groups: Sequence[int], stored: list[tuple[float, float]], ran: Timed):
        self.groups = groups
        ref = [f + b for f, b in stored]
        cells = [  # (step, block, forward, backward) of every timed reference block
            (k, seg.start, f, b)
            for k, (segments, times) in enumerate(ran)
            for seg, (f, b) in zip(segments, times, strict=True)
            if seg.strategy == STORE and f > 0 and b > 0
        ]
        self.factor = fit_steps([(k, groups[i], f + b) for k, i, f, b in cells], len(ran))
        # each connected set of groups is tied to the stored step at the median pace
        paces: dict[int, list[float]] = defaultdict(list)
        for k, i, f, b in cells:
            if ref[i] > 0:
                paces[self.factor[k][1]].append((f + b) / self.factor[k][0] / ref[i])
        pace_of = {c: statistics.median(v) for c, v in paces.items()}
        pace = statistics.median(pace_of.values()) if pace_of else 1.0
        for k, (factor, c) in list(self.factor.items()):
            self.factor[k] = (factor * pace_of.get(c, pace) / pace, c)
        mine: dict[int, list[tuple[float, float]]] = defaultdict(list)
        for k, i, f, b in cells:
            mine[groups[i]].append((f / self.factor[k][0], b / self.factor[k][0]))
        fwd = by_group(groups, [f for f, _ in stored])
        bwd = by_group(groups, [b for _, b in stored])
        self.fwd = {
            g: statistics.median(f for f, _ in mine[g]) if g in mine else fwd[g] * pace for g in fwd
        }
        self.bwd = {
            g: statistics.median(b for _, b in mine[g]) if g in mine else bwd[g] * pace for g in bwd
        }

    def extras(
        self, ran: Timed
    ) -> tuple[dict[tuple[int, str], list[float]], list[tuple[Segment, float]]]:
        """Per ``(group, strategy)`` the extra seconds of each one-block segment, and each
        multi-block segment with its extra seconds, in the units of the stored times."""
        groups = self.groups
        samples: dict[tuple[int, str], list[float]] = defaultdict(list)
        spans: list[tuple[Segment, float]] = []
        pooled = {g: self.fwd[g] + self.bwd[g] for g in self.fwd}
        for k, (segments, times) in enumerate(ran):
            here: dict[int, list[float]] = defaultdict(list)
            for seg, (f, b) in zip(segments, times, strict=True):
                if seg.strategy == STORE and f > 0 and b > 0:
                    here[groups[seg.start]].append(f + b)
            scale = self.factor.get(k, (1.0, None))[0]
            own = {
                g: statistics.median(here[g]) if g in here else pooled[g] * scale for g in pooled
            }
            for seg, (f, b) in zip(segments, times, strict=True):
                if seg.strategy == STORE:
                    continue
                extra = (f + b - sum(own[groups[i]] for i in range(seg.start, seg.stop))) / scale
                if seg.stop - seg.start == 1:
                    samples[(groups[seg.start], seg.strategy)].append(extra)
                else:
                    spans.append((seg, extra))
        return samples, spans


def fit_steps(cells: list[tuple[int, int, float]], steps: int) -> dict[int, tuple[float, int]]:
    """Per step that has reference blocks, its factor and its component, from ``cells``
    ``(step, group, seconds)`` with ``seconds = factor[step] * time[group]``, by least squares
    of the logarithms. Steps linked by a group they share form a component (named by its first
    step); within one the factors' geometric mean is 1, and factors of different components are
    not comparable (the caller ties them together)."""
    comp = list(range(steps))

    def root(k: int) -> int:
        while comp[k] != k:
            k = comp[k]
        return k

    first: dict[int, int] = {}
    for k, g, _ in cells:
        a, b = root(k), root(first.setdefault(g, k))
        comp[max(a, b)] = min(a, b)
    steps_seen = sorted({k for k, _, _ in cells})
    groups_seen = sorted({g for _, g, _ in cells})
    col = {k: j for j, k in enumerate(steps_seen)}
    col.update({("g", g): len(steps_seen) + j for j, g in enumerate(groups_seen)})
    design = np.zeros((len(cells), len(col)))
    for r, (k, g, _) in enumerate(cells):
        design[r, col[k]] = design[r, col[("g", g)]] = 1.0
    logs = np.log([t for _, _, t in cells])
    fitted = np.linalg.lstsq(design, logs, rcond=None)[0] if cells else []
    factor = {k: float(fitted[col[k]]) for k in steps_seen}
    for c in {root(k) for k in factor}:  # each component's log factors centred on 0
        members = [k for k in factor if root(k) == c]
        mean = sum(factor[k] for k in members) / len(members)
        for k in members:
            factor[k] -= mean
    factor = {k: math.exp(v) for k, v in factor.items()}
    return {k: (f, root(k)) for k, f in factor.items()}


def overheads(
    groups: Sequence[int],
    options: Sequence[Sequence[str]],
    extra: dict[tuple[int, str], float],
    fwd: dict[int, float],
) -> list[dict[str, float]]:
    """Per block, the extra seconds of each of its strategies: measured on its group, else
    from the groups where it was measured (:func:`filled`)."""
    overhead = []
    for i, g in enumerate(groups):
        mine = {s: extra[(g, s)] for s in options[i] if (g, s) in extra}
        for s in options[i]:
            if s != STORE and s not in mine:
                got = filled(extra, fwd, g, s)
                if got is not None:
                    mine[s] = got
        overhead.append(mine)
    return overhead


def filled(
    extra: dict[tuple[int, str], float], fwd: dict[int, float], g: int, s: str
) -> float | None:
    """Strategy ``s``'s extra seconds on group ``g``, which no stretch of ``s`` reached: where
    checkpoint was measured on ``g`` and both were on other groups, checkpoint's extra on
    ``g`` times the median ratio of the two over those groups; else the median ratio of
    ``s``'s extra to the stored forward, times ``g``'s forward (``None``: ``s`` measured
    nowhere). A recompute's cost is not in proportion to the forward alone (small blocks
    pay more per forward second for the calls around it): on the RevNet-like model a
    one-block reversible stack on the first stage, reached by no stretch, measured about 4.7
    ms (a step with four of them against storing), was priced 6.7 ms from its forward and
    4.6 ms from its checkpoint time (docs/schedule.md, *Reversible stacks, timed as plans run
    them*). A checkpoint extra of 0 (a median clamped at 0) prices nothing from it."""
    ckpt = extra.get((g, CHECKPOINT), 0.0)
    pairs = [
        v / extra[(h, CHECKPOINT)]
        for (h, t), v in extra.items()
        if t == s and extra.get((h, CHECKPOINT), 0.0) > 0
    ]
    if ckpt > 0 and s != CHECKPOINT and pairs:  # a checkpoint extra clamped to 0 says nothing
        return ckpt * statistics.median(pairs)
    ratio = ratios(extra, fwd).get(s)
    return None if ratio is None else ratio * fwd[g]


def strategy_order(options: Sequence[Sequence[str]]) -> Callable[[str], int]:
    first: dict[str, int] = {}
    for opts in options:
        for s in opts:
            first.setdefault(s, len(first))
    return lambda s: first[s]


def by_group(groups: Sequence[int], values: Sequence[float]) -> dict[int, float]:
    pooled: dict[int, list[float]] = defaultdict(list)
    for g, v in zip(groups, values, strict=True):
        pooled[g].append(v)
    return {g: statistics.median(v) for g, v in pooled.items()}


def ratios(extra: dict[tuple[int, str], float], fwd: dict[int, float]) -> dict[str, float]:
    """Per strategy, the median ratio of extra time to stored forward time over groups."""
    by: dict[str, list[float]] = defaultdict(list)
    for (g, s), v in extra.items():
        if fwd[g] > 0:
            by[s].append(v / fwd[g])
    return {s: statistics.median(v) for s, v in by.items()}


def chained_extras(
    spans: list[tuple[Segment, float]],
    groups: Sequence[int],
    overhead: list[dict[str, float]],
    fwd: dict[int, float],
    strategy: str,
) -> list[float | None]:
    """Per block, what it adds inside a longer segment of ``strategy`` (checkpoint, or a
    reversible stack): a segment's extra time less its first block's one-block overhead,
    shared by its other blocks in proportion to their forward times; per group the median,
    else the median ratio to the one-block overhead, times the group's (not to the forward:
    on the RevNet-like model, a stack on the first stage, which no stretch reached, was
    priced 4.0 ms a block from its forward, 2.85 ms from its one-block stack's; its eight
    blocks timed as one stack measured 2.6 ms a block: docs/schedule.md, *Reversible stacks,
    timed as plans run them*). Only the spans of ``strategy`` count."""
    samples: dict[int, list[float]] = defaultdict(list)
    for seg, extra in spans:
        if seg.strategy != strategy:
            continue
        head = overhead[seg.start].get(strategy)
        rest = range(seg.start + 1, seg.stop)
        total_f = sum(fwd[groups[i]] for i in rest)
        if head is None or total_f <= 0:
            continue
        for i in rest:
            samples[groups[i]].append((extra - head) * fwd[groups[i]] / total_f)
    per_group = {g: max(0.0, statistics.median(v)) for g, v in samples.items()}
    own = {g: overhead[groups.index(g)].get(strategy) for g in set(groups)}  # its first block's
    ratios = [per_group[g] / own[g] for g in per_group if own[g]]
    ratio = statistics.median(ratios) if ratios else None
    out: list[float | None] = []
    for g in groups:
        if g in per_group:
            out.append(per_group[g])
        else:
            head = own[g]
            out.append(None if ratio is None or head is None else ratio * head)
    return out
