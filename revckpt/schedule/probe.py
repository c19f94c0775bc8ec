"""What each block costs inside the whole step, under each strategy: in-chain timing rounds.

A block timed on its own (:mod:`.block_time`) runs with its weights and input hot in the
caches, over and over; inside the chain it does not, and the two disagree by 10-25% on a CPU.
So the chain profiler times blocks where they run: it runs the whole training step of the
chain a few times, each time with a *mix* of one-block strategies, and times every segment in
place, its forward with the clock around it and its backward between the moments the
gradients of its output and of its input are ready (tensor hooks; the single-threaded CPU
engine, or a CUDA synchronisation at each mark, makes these moments the segment's bounds).

In round ``r`` block ``i`` runs with strategy ``(n_i + r) mod M_i`` of its own list (``n_i``:
its position among the blocks of its group, identical blocks of the chain; ``M_i``: how many
strategies it can run with, store first). Blocks of one group pool their samples, so 24
identical blocks measure four strategies six times each in two rounds; a block of its own
needs ``M_i`` rounds, and what the rounds did not reach is left to :mod:`.block_time`. A last
round cuts the chain into checkpoint segments of two blocks: what the second block of a
segment adds over its stored time, less the first block's one-block checkpoint overhead, is
its cost *inside* a longer segment (``chained``: its recompute, without a node of its own).

Per group the figures are medians over samples: the stored forward and backward, each
strategy's step less the stored step.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..measure.timing import Clock
from .costs import CHECKPOINT, STORE, Segment
from .plan import run_segment, segment_runs

__all__ = ["InChain", "plan_rounds", "probe_chain"]

_MAX_ROUNDS = 4  # mixed rounds at most; what a block of its own misses is timed on its own


@dataclass(frozen=True)
class InChain:
    """Per block (the figures of its group): stored forward and backward seconds, the extra
    seconds of each strategy run on the block alone as a segment (only those measured), and
    the extra seconds it adds inside a longer checkpoint segment (``None``: not measured);
    ``rounds``: whole steps run."""

    forward_s: tuple[float, ...]
    backward_s: tuple[float, ...]
    overhead_s: tuple[dict[str, float], ...]
    chained_s: tuple[float | None, ...]
    rounds: int


def plan_rounds(groups: Sequence[int], options: Sequence[Sequence[str]]) -> int:
    """Mixed rounds so that every group meets each of its strategies about twice (at most
    :data:`_MAX_ROUNDS`, at least 2)."""
    size: dict[int, int] = defaultdict(int)
    for g in groups:
        size[g] += 1
    need = max(math.ceil(2 * len(options[i]) / size[g]) for i, g in enumerate(groups))
    widest = max(len(o) for o in options)
    return max(2, min(need, widest, _MAX_ROUNDS))


def _mixed(groups: Sequence[int], options: Sequence[Sequence[str]], r: int) -> list[Segment]:
    position: dict[int, int] = defaultdict(int)
    segments = []
    for i, g in enumerate(groups):
        choices = options[i]
        segments.append(Segment(i, i + 1, choices[(position[g] + r) % len(choices)]))
        position[g] += 1
    return segments


def _pairs(n: int) -> list[Segment]:
    segs = [Segment(i, min(i + 2, n), CHECKPOINT) for i in range(0, n, 2)]
    return segs


def _now(clock: Clock, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return clock()


def timed_step(
    chain: Sequence[nn.Module],
    segments: Sequence[Segment],
    x: torch.Tensor,
    grad: torch.Tensor,
    kwargs: dict[str, Any],
    *,
    clock: Clock = time.perf_counter,
) -> list[tuple[float, float]]:
    """One training step of ``chain`` run as ``segments``; per segment its forward and
    backward seconds on ``clock``."""
    runs = segment_runs(chain, segments)
    leaf = x.detach().requires_grad_(x.is_floating_point())
    n = len(runs)
    marks: list[float | None] = [None] * (n + 1)  # when each boundary's gradient is ready

    def mark(b: int) -> Callable[[torch.Tensor], None]:
        def hook(_: torch.Tensor) -> None:
            marks[b] = _now(clock, x.device)

        return hook

    forward = []
    h = leaf
    for p, (strategy, run) in enumerate(runs):
        start = _now(clock, x.device)
        h = run_segment(strategy, run, h, kwargs)
        forward.append(_now(clock, x.device) - start)
        if p < n - 1 and h.requires_grad:
            h.register_hook(mark(p + 1))
    marks[n] = _now(clock, x.device)
    h.backward(grad)
    marks[0] = _now(clock, x.device)
    # a boundary without a gradient (nothing before it needs one) gets the next mark's time:
    # its segment's backward time then falls to the segment before it
    for b in range(1, n):
        if marks[b] is None:
            marks[b] = marks[b + 1]
    done = [m for m in marks if m is not None]
    assert len(done) == n + 1
    return [(forward[p], max(0.0, done[p] - done[p + 1])) for p in range(n)]


def probe_chain(
    chain: Sequence[nn.Module],
    x: torch.Tensor,
    grad: torch.Tensor,
    kwargs: dict[str, Any],
    groups: Sequence[int],
    options: Sequence[Sequence[str]],
    *,
    rounds: int | None = None,
    clock: Clock = time.perf_counter,
    progress: Callable[[], None] | None = None,
) -> InChain:
    """Time the chain's step in mixed rounds and one round of two-block checkpoint segments
    (see the module docstring). ``groups[i]``: block ``i``'s group (identical blocks share
    one); ``options[i]``: the one-block strategies it can run with, ``"store"`` first;
    ``grad``: the chain output's gradient."""
    n = len(chain)
    rounds = plan_rounds(groups, options) if rounds is None else rounds
    stored: dict[int, list[tuple[float, float]]] = defaultdict(list)
    steps: dict[tuple[int, str], list[float]] = defaultdict(list)
    for r in range(rounds):
        segments = _mixed(groups, options, r)
        for seg, (f, b) in zip(
            segments, timed_step(chain, segments, x, grad, kwargs, clock=clock), strict=True
        ):
            if seg.strategy == STORE:
                stored[groups[seg.start]].append((f, b))
            else:
                steps[(groups[seg.start], seg.strategy)].append(f + b)
        if progress is not None:
            progress()
    fwd = {g: statistics.median(f for f, _ in s) for g, s in stored.items()}
    bwd = {g: statistics.median(b for _, b in s) for g, s in stored.items()}
    extra: dict[int, dict[str, float]] = defaultdict(dict)
    for (g, s), times in steps.items():
        if g in fwd:
            extra[g][s] = max(0.0, statistics.median(times) - fwd[g] - bwd[g])
    chained: dict[int, list[float]] = defaultdict(list)
    if n > 1:
        pairs = _pairs(n)
        for seg, (f, b) in zip(
            pairs, timed_step(chain, pairs, x, grad, kwargs, clock=clock), strict=True
        ):
            if seg.stop - seg.start != 2:
                continue
            g0, g1 = groups[seg.start], groups[seg.start + 1]
            head = extra[g0].get(CHECKPOINT)
            if head is None or g0 not in fwd or g1 not in fwd:
                continue
            chained[g1].append(f + b - fwd[g0] - bwd[g0] - fwd[g1] - bwd[g1] - head)
        if progress is not None:
            progress()
    return InChain(
        forward_s=tuple(fwd.get(g, math.nan) for g in groups),
        backward_s=tuple(bwd.get(g, math.nan) for g in groups),
        overhead_s=tuple(dict(extra[g]) for g in groups),
        chained_s=tuple(
            max(0.0, statistics.median(chained[g])) if chained[g] else None for g in groups
        ),
        rounds=rounds + (1 if n > 1 else 0),
    )
