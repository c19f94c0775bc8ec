"""What each block costs inside the whole step, under each strategy: in-chain timing steps.

A block timed on its own (:mod:`.block_time`) runs with its weights and input hot in the
caches, over and over; inside the chain it does not, and the two disagree on a CPU.
So the chain profiler times blocks where they run: it runs the chain's whole training step a
few times and times every segment in place, its forward with the clock around it and its
backward between the moments the gradients of its output and of its input are ready (tensor
hooks; the single-threaded CPU engine, or a CUDA synchronisation at each mark, makes these
moments the segment's bounds).

One step stores every block: each block's forward and backward. In a profile it also records
what the error model needs (``record=``: each block's input, output, random state and output
gradient, :class:`~.sensitivities.StepRecord`), so that the error model needs no run of the
chain of its own (it was a step more of every profile). It runs after the memory metering,
which has run every distinct block forward and backward: a block shape's first run in a
process is slow (its kernels are set up then: in two fresh processes, the RevNet-like
model's stem read 2.8x and 8x its later time in a first stored step, and its usual time in
two where each distinct block had run forward and backward once before; exploratory runs), and
the groups no reference block reaches take their times from this step.
Each further step runs a
few strategies and a stored *reference*, each on two stretches of contiguous blocks
(``A B S A B S`` along the chain; once, ``A B S``, where a part would get fewer than two
blocks), every block of a strategy stretch as a segment of its own; the strategy ``chained``
is cut into checkpoint segments of up to four blocks, whose blocks after the first measure
what a block adds *inside* a longer segment (its recompute without a node of its own). The
steps of a round rotate their parts by one (``B S A B S A``), so the reference lands on other
blocks in each and every block runs a strategy in one of them. With the four strategies of a
GPT block (checkpoint, approx, selective, chained) that is three steps in all. A step is one
sample per block.

This machine is shared and its load comes in bursts of tens of milliseconds to seconds, and a
process's first steps run slower than its later ones, unevenly along the chain, so a strategy is
not timed against the stored step as it stands. A strategy block's extra time is its time less that
of its group's reference blocks *in the same step*, and the step's seconds are scaled to the stored
times by a factor per step, fitted with each group's stored time over all the reference blocks
(:class:`~.probe_times.StoredTimes`): every group's times are then in one unit, whichever steps its
reference blocks fell in. The stored step gives the times only of groups that no reference reached,
at the strategy steps' median pace against it; a chain too short for a reference (five blocks or
fewer) times a second stored step after the others. Timed against the stored step alone, 2 of 8
profiles of the 24-block GPT-like model in one process read every plan's overhead about twice the
measured one, one of a 12-layer HF Llama a fifth of it, and the first profile of a process read its
per-block checkpoint 1.1x to 2.5x the measured overhead (its stored step ran cold). Two stretches
per strategy, at two moments of the step, keep a burst over one stretch from setting a strategy's
whole sample (``python benchmarks/bench_profile_spread.py`` compares one stretch and two). What
none of this corrects is load that comes or goes within a stretch. (Re-running a step whose two
reference stretches ran at different paces was tried and dropped: two runs of that benchmark
disagreed on whether it kept profiles closer, and it cost up to a step.) Stretches, not alternating
blocks: on the GPT-like model a block's checkpoint overhead read 5-15% higher from stretches of one
or three blocks than from a run of 24 (two exploratory runs), and the plans the solver makes run a
strategy over stretches of blocks. ``rounds`` repeats the strategy steps, rotated.

A reversible part runs as plans run reversible segments, as stacks: each run of blocks that can
be reversible as a stack of its first block alone (what a stack of one costs, its own call
included) and a stack of the others (what a block adds inside a longer stack). Timed as stacks
of one, as before, the RevNet-like model's reversible plans read 1.11-1.17x their measured time
(``benchmarks/results/bench_schedule_retest_rehearsal3.json``): a block cost about 1.4 times as
much as a stack of its own (3.7 ms against 2.6 on the first stage, a step with eight stacks of
one against one of eight). A strategy that no stretch reached on a group is priced from the
groups it reached (:func:`~.probe_times.filled`).

Before the first timed step, each strategy not yet run in this process runs once untimed
(:func:`warm_up`): a strategy's first run in a process is slow, and the step that times it would
charge that to the strategy. It runs on the cheapest block that can run it (the chained part on
the cheapest two adjacent blocks), from that block's input: what is cold then is the strategy's
code, not the kernels of a shape (the memory metering ran every distinct block in every mode
before). On a prefix of the chain, two blocks per strategy, it cost the RevNet-like model's first
profile 1.01 steps (a per-part timer), its first blocks being its dearest; now 0.13-0.15.

Per group (identical blocks) a strategy's extra time is the median over its samples; a group
no part of the strategy reached gets checkpoint's extra time on it times the strategy's median
ratio to checkpoint's over the groups that ran both, or else the median ratio of extra time to
stored forward time over the groups that were reached (:func:`~.probe_times.filled`).
"""

from __future__ import annotations

import contextlib
import functools
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..engine.rehearsal import Rehearsal
from ..measure.timing import Clock
from .costs import CHECKPOINT, REVERSIBLE, STORE, Segment
from .plan import run_segment, segment_runs
from .probe_times import StoredTimes, Timed, chained_extras, overheads, strategy_order
from .sensitivities import StepRecord

__all__ = ["CHAINED", "InChain", "probe_chain", "timed_step", "warm_up"]


@dataclass(frozen=True)
class InChain:
    """Per block (the figures of its group): stored forward and backward seconds, the extra
    seconds of each strategy run on the block as a segment of its own, and the extra seconds
    it adds inside a longer checkpoint segment and inside a longer reversible stack, not
    first in either (``None``: not measured); ``rounds``: whole steps run (a warm-up on part
    of the chain counts as its share of a step)."""

    forward_s: tuple[float, ...]
    backward_s: tuple[float, ...]
    overhead_s: tuple[dict[str, float], ...]
    chained_s: tuple[float | None, ...]
    stacked_s: tuple[float | None, ...]
    rounds: float


def _now(clock: Clock, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return clock()


def timed_step(
    chain: Sequence[nn.Module],
    segments: Sequence[Segment],
    x: torch.Tensor,
    grad: torch.Tensor | Callable[[torch.Tensor], torch.Tensor],
    kwargs: dict[str, Any],
    *,
    clock: Clock = time.perf_counter,
    record: StepRecord | None = None,
    rehearsal: Rehearsal | None = None,
) -> list[tuple[float, float]]:
    """One training step of ``chain`` run as ``segments``; per segment its forward and
    backward seconds on ``clock``. ``grad``: the output's gradient, or what makes it from
    the output. ``record``: a stored step (one block per segment) also records, outside the
    clock's spans, what the error model needs (:class:`~.sensitivities.StepRecord`);
    ``rehearsal``: a stored step's forwards are also captured, outside the clock's spans,
    as first calls of a recomputing strategy and replayed
    (:class:`~revckpt.engine.rehearsal.Rehearsal`)."""
    runs = segment_runs(chain, segments)
    stored = all(s.strategy == STORE and s.stop == s.start + 1 for s in segments)
    assert stored or (record is None and rehearsal is None)
    leaf = x.detach().requires_grad_(x.is_floating_point())
    n = len(runs)
    marks: list[float | None] = [None] * (n + 1)  # when each boundary's gradient is ready

    def mark(b: int) -> Callable[[torch.Tensor], None]:
        def hook(g: torch.Tensor) -> None:
            marks[b] = _now(clock, x.device)
            if record is not None:
                record.cotangents[b - 1] = g

        return hook

    forward = []
    h = leaf
    for p, (strategy, run) in enumerate(runs):
        if record is not None:
            record.entered(h)
        learning = _PLAIN if rehearsal is None else rehearsal.forward(run[0], h, f"blocks[{p}]")
        with learning:
            start = _now(clock, x.device)
            h = run_segment(strategy, run, h, kwargs)
            forward.append(_now(clock, x.device) - start)
        if record is not None:
            record.left(run[0], h)
        if p < n - 1 and h.requires_grad:
            h.register_hook(mark(p + 1))
    out_grad = grad if isinstance(grad, torch.Tensor) else grad(h)
    if record is not None:
        record.cotangents[n - 1] = out_grad
    marks[n] = _now(clock, x.device)
    h.backward(out_grad)
    marks[0] = _now(clock, x.device)
    if record is not None:
        record.input_grad = leaf.grad
    # a boundary without a gradient (nothing before it needs one) gets the next mark's time:
    # its segment's backward time then falls to the segment before it
    for b in range(1, n):
        if marks[b] is None:
            marks[b] = marks[b + 1]
    done = [m for m in marks if m is not None]
    assert len(done) == n + 1
    return [(forward[p], max(0.0, done[p] - done[p + 1])) for p in range(n)]


_PLAIN = contextlib.nullcontext()


def _parts(n: int, strategies: Sequence[str]) -> list[tuple[int, int, str]]:
    """``n`` blocks cut into contiguous parts ``(start, stop, strategy)``, one per strategy, of
    sizes that differ by one at most (every part has a block where ``n >= len(strategies)``;
    else the first ``n`` parts have one each)."""
    k = len(strategies)
    bounds = [-(-p * n // k) for p in range(k + 1)]
    return [
        (bounds[p], bounds[p + 1], s) for p, s in enumerate(strategies) if bounds[p] < bounds[p + 1]
    ]


def _step_layout(n: int, kinds: Sequence[str], shift: int) -> list[str]:
    """The parts of one strategy step along ``n`` blocks: ``kinds`` and the stored reference,
    rotated by ``shift`` (so the steps of a round put the reference on different blocks and
    every block runs a strategy in one of them), laid ``_STRETCHES`` times where that leaves
    each part two blocks or more (a chained part then holds a multi-block segment), else once;
    no reference where even once it would leave a part one block."""
    if n < 2 * (len(kinds) + 1):  # too short to spare two blocks for a reference
        return list(kinds)
    parts = [*kinds, STORE]
    shift %= len(parts)
    parts = parts[shift:] + parts[:shift]
    times = _STRETCHES if n >= 2 * _STRETCHES * len(parts) else 1
    return parts * times


_SPAN = 4  # blocks per checkpoint segment of the chained part
_STRETCHES = 2  # times each step's parts are laid along the chain


def _segments(
    parts: list[tuple[int, int, str]],
    options: Sequence[Sequence[str]],
    stack_keys: Sequence[Any] | None = None,
) -> list[Segment]:
    """The segments of one strategy step; ``stack_keys[i]``: what adjacent blocks must share
    to run in one reversible stack (their ``split_dim``; default: all share)."""
    keys = stack_keys if stack_keys is not None else [None] * (parts[-1][1] if parts else 0)
    segments = []
    for start, stop, strategy in parts:
        if strategy == CHAINED:
            for a in range(start, stop, _SPAN):
                segments.append(Segment(a, min(stop, a + _SPAN), CHECKPOINT))
            continue
        if strategy == REVERSIBLE:
            segments += _stacks(start, stop, options, keys)
            continue
        for i in range(start, stop):  # a block that cannot run it is checkpointed instead
            own = strategy if strategy in options[i] else CHECKPOINT
            segments.append(Segment(i, i + 1, own))
    return segments


def _stacks(
    start: int, stop: int, options: Sequence[Sequence[str]], keys: Sequence[Any]
) -> list[Segment]:
    """A reversible part: each run of blocks that can run reversible and share their stack
    key (``keys``) as a stack of its first block alone (what a stack of one costs) and a
    stack of the others (what a block adds inside a longer stack, as plans run it); a block
    that cannot, checkpointed."""
    segments = []
    i = start
    while i < stop:
        if REVERSIBLE not in options[i]:
            segments.append(Segment(i, i + 1, CHECKPOINT))
            i += 1
            continue
        j = i + 1
        while j < stop and REVERSIBLE in options[j] and keys[j] == keys[i]:
            j += 1
        segments.append(Segment(i, i + 1, REVERSIBLE))
        if j > i + 1:
            segments.append(Segment(i + 1, j, REVERSIBLE))
        i = j
    return segments


CHAINED = "chained"  # the part of multi-block checkpoint segments


def probe_chain(
    chain: Sequence[nn.Module],
    x: torch.Tensor,
    grad: torch.Tensor,
    kwargs: dict[str, Any],
    groups: Sequence[int],
    options: Sequence[Sequence[str]],
    *,
    parts: int | None = None,
    rounds: int = 1,
    warm: bool = True,
    stored: list[tuple[float, float]] | None = None,
    inputs: Sequence[torch.Tensor] | None = None,
    clock: Clock = time.perf_counter,
) -> InChain:
    """Time the chain's step stored, then every strategy on contiguous parts, ``parts`` per
    step with the stored reference part (default: as few as make two steps, at least
    thirds), ``rounds`` times with the parts rotated (see the module docstring).
    ``groups[i]``: block ``i``'s group (identical blocks share one, named by its first block's
    index); ``options[i]``: the
    one-block strategies it can run with, ``"store"`` first; ``grad``: the chain output's
    gradient; ``warm``: the caches and allocator are warm (a stored step ran just before), or
    one untimed stored step runs first; ``stored``: the stored step's times, timed by the
    caller (:func:`timed_step`, every block a segment of its own), then none is run here;
    ``inputs``: every block's input, for the warm-up (:func:`warm_up`; default: a no-grad
    forward of the chain makes them where a strategy needs one)."""
    n = len(chain)
    stored_segments = [Segment(i, i + 1, STORE) for i in range(n)]
    stored_steps = 0 if stored is not None else 1 if warm else 2
    if stored is None:
        if not warm:
            timed_step(chain, stored_segments, x, grad, kwargs, clock=clock)
        stored = timed_step(chain, stored_segments, x, grad, kwargs, clock=clock)
    strategies = sorted({s for o in options for s in o if s != STORE}, key=strategy_order(options))
    kinds = [*strategies, CHAINED] if n > 1 else strategies
    if parts is None:  # two strategy steps: two kinds each for up to four kinds, three for six
        parts = max(2, -(-len(kinds) // 2)) + 1
    per = max(1, parts - 1)  # kinds per step, beside the stored reference part
    steps = [kinds[a : a + per] for a in range(0, len(kinds), per)]
    if inputs is None and any((x.device.type, k) not in _WARM for k in kinds):
        inputs = _block_inputs(chain, x, kwargs)
    seconds = [f + b for f, b in stored]
    warmed = warm_up(chain, inputs, kwargs, kinds, options, seconds) if inputs else 0.0
    run = functools.partial(timed_step, chain, x=x, grad=grad, kwargs=kwargs, clock=clock)
    keys = [getattr(block, "split_dim", None) for block in chain]  # units of one stack share it
    ran = _rounds(run, steps, rounds, n, options, keys)
    again = not any(seg.strategy == STORE for segments, _ in ran for seg in segments)
    if again:  # too short for a reference: a stored step after the others, warmer than the first
        ran.append((stored_segments, run(stored_segments)))
    times = StoredTimes(groups, stored, ran)
    samples, spans = times.extras(ran)
    extra = {key: max(0.0, statistics.median(v)) for key, v in samples.items()}
    overhead = overheads(groups, options, extra, times.fwd)
    chained = chained_extras(spans, groups, overhead, times.fwd, CHECKPOINT)
    stacked = chained_extras(spans, groups, overhead, times.fwd, REVERSIBLE)
    return InChain(
        forward_s=tuple(times.fwd[g] for g in groups),
        backward_s=tuple(times.bwd[g] for g in groups),
        overhead_s=tuple(overhead),
        chained_s=tuple(chained[i] for i in range(n)),
        stacked_s=tuple(stacked[i] for i in range(n)),
        rounds=stored_steps + rounds * len(steps) + again + warmed,
    )


# (device type, kind) run untimed in this process: the first run of a strategy in a process
# is slow (its code paths, torch's and revckpt's, run cold): over 10 fresh processes, the
# first step checkpointing half of a 24-block GPT-like chain (after two stored steps) read
# that half's extra time over storing a median 1.12x what the six steps after it read
# (0.69-1.76x). Without a warm-up, the first of two profiles in one process read every
# greedy plan 19% higher than the second did (benchmarks/results/bench_schedule.json of
# 2026-12-01, GPT-like)
_WARM: set[tuple[str, str]] = set()


def warm_up(
    chain: Sequence[nn.Module],
    inputs: Sequence[torch.Tensor],
    kwargs: dict[str, Any],
    kinds: Sequence[str],
    options: Sequence[Sequence[str]],
    seconds: Sequence[float],
) -> float:
    """Run each of ``kinds`` not yet run in this process once, untimed: on the block with the
    fewest ``seconds`` (its stored step's) among those that can run it (``options``), the
    chained part as one checkpoint segment over the cheapest two adjacent blocks, forward from
    the block's input (``inputs[i]``), then backward from its output. Returns the fraction of
    a step it ran (the blocks' seconds over the chain's)."""
    todo = [k for k in kinds if (inputs[0].device.type, k) not in _WARM]
    if not todo:
        return 0.0
    n, ran = len(chain), 0.0
    for kind in todo:
        if kind == CHAINED:
            if n < 2:
                continue
            i = min(range(n - 1), key=lambda i: seconds[i] + seconds[i + 1])
            segment = Segment(i, i + 2, CHECKPOINT)
        else:
            able = [i for i in range(n) if kind in options[i]]
            if not able:
                continue
            i = min(able, key=lambda i: seconds[i])
            segment = Segment(i, i + 1, kind)
        ((strategy, run),) = segment_runs(chain, [segment])
        x = inputs[i]
        h = run_segment(strategy, run, x.detach().requires_grad_(x.is_floating_point()), kwargs)
        if h.requires_grad:
            torch.autograd.backward(h, torch.ones_like(h))
        ran += sum(seconds[segment.start : segment.stop])
    _WARM.update((inputs[0].device.type, k) for k in todo)
    return ran / max(sum(seconds), 1e-12)


def _block_inputs(
    chain: Sequence[nn.Module], x: torch.Tensor, kwargs: dict[str, Any]
) -> list[torch.Tensor]:
    """Every block's input, from a forward of the chain without grad."""
    inputs, h = [], x.detach()
    with torch.no_grad():
        for block in chain:
            inputs.append(h)
            h = block(h, **kwargs)
    return inputs


def _rounds(
    run: Callable[..., list[tuple[float, float]]],
    steps: list[list[str]],
    rounds: int,
    n: int,
    options: Sequence[Sequence[str]],
    stack_keys: Sequence[Any],
) -> Timed:
    """The strategy steps, ``rounds`` times with their kinds rotated (``run(segments)`` times
    one step): each step's segments and their (forward, backward) seconds."""
    ran: Timed = []
    for r in range(rounds):
        for j, kinds_of_step in enumerate(steps):
            rotated = (
                kinds_of_step[r % len(kinds_of_step) :] + kinds_of_step[: r % len(kinds_of_step)]
            )
            parts = _parts(n, _step_layout(n, rotated, j + r))
            segments = _segments(parts, options, stack_keys)
            ran.append((segments, run(segments)))
    return ran
