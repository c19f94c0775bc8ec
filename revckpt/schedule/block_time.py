"""A block's time under each strategy measured on its own: the block on one input, each
strategy's step against the stored step in rotated rounds (:func:`~revckpt.time_ratios`).

This is what :func:`revckpt.fit` uses for the blocks of a whole model, and what the chain
profiler falls back on for a block and strategy its in-chain rounds (:mod:`.probe`) did not
reach. A block alone runs with its weights and input hot in the caches, so these figures are
a little off the same block's time inside a chain; the chain profiler prefers the in-chain
ones.

Approx codecs all re-run the same forward: only the first codec is timed as a step; another
codec costs that plus the difference of the two codecs' encode and decode times
(:func:`codec_seconds`).
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ..approx import Approx, compress_saved
from ..checkpoint import checkpoint
from ..measure.timing import Clock, wall_time
from ..strategy import argument_of, kind_of
from .block_memory import activation
from .costs import APPROX, CHECKPOINT, COMPRESS, OFFLOAD, REVERSIBLE, SELECTIVE, STORE

__all__ = ["BlockTimes", "block_times", "codec_seconds", "derived_codecs"]

BlockTimes = tuple[float, float, dict[str, float]]  # forward s, backward s, extra s per strategy


def codec_seconds(x: torch.Tensor, codecs: Sequence[str], repeats: int = 3) -> dict[str, float]:
    """Per codec, the median seconds of encoding ``x`` and decoding it back."""
    if not x.is_floating_point():
        return {}
    out = {}
    x_ = x.detach()
    for codec_name in codecs:
        codec = Approx(store=codec_name).codec
        assert codec is not None
        run = functools.partial(codec.roundtrip, x_)
        run()  # warm
        out[codec_name] = statistics.median(wall_time(run) for _ in range(repeats))
    return out


def derived_codecs(
    overhead: dict[str, float], codec_s: dict[str, float], timed: str | None
) -> dict[str, float]:
    """``overhead`` with every codec of ``codec_s`` priced from the timed one: its extra time
    plus the difference of the two codecs' own times."""
    key = f"{APPROX}:{timed}"
    if timed is None or key not in overhead:
        return overhead
    out = dict(overhead)
    for codec, secs in codec_s.items():
        if codec != timed:
            out[f"{APPROX}:{codec}"] = max(0.0, overhead[key] + secs - codec_s[timed])
    return out


def _step(run: Callable[[], torch.Tensor], grad_out: torch.Tensor) -> None:
    run().backward(grad_out)


def block_times(
    block: nn.Module,
    leaf: torch.Tensor,
    grad_out: torch.Tensor,
    strategies: Sequence[str],
    kwargs: dict[str, Any],
    repeats: int,
    *,
    reversible: nn.Module | None = None,
    warmup: int = 1,
    clock: Clock = time.perf_counter,
) -> BlockTimes:
    """Forward and backward seconds of ``block`` stored, and each of ``strategies``' extra
    seconds of a step of the block alone (``leaf``: its input; ``grad_out``: its output's
    gradient), from ``repeats`` rotated rounds after ``warmup`` untimed ones (0 where every
    step has just run, as after its memory profile): per strategy the median over rounds of
    its step's time over the stored step's in the same round, less one, times the stored
    step's median time. A selective policy that took ``SLOWER`` times checkpoint's time or
    more in two rounds is not timed again (see :data:`SLOWER`); its ratio is then taken against
    checkpoint's steps in the rounds it ran, times checkpoint's ratio over every round, so
    that it stays above checkpoint's (one round's stored step, read alone, can be an outlier
    that makes a step look cheap)."""

    forwards: list[float] = []  # the stored step's forward, timed inside it

    def stored() -> None:
        out: list[torch.Tensor] = []
        forwards.append(wall_time(lambda: out.append(block(leaf, **kwargs)), clock=clock))
        out.pop().backward(grad_out)

    steps: dict[str, Callable[[], Any]] = {STORE: stored}
    for s in strategies:
        run = _runner(s, block, leaf, kwargs, reversible)
        if run is not None:
            steps[s] = functools.partial(_step, run, grad_out)
    times = _rounds(steps, repeats, warmup, clock)
    fb = statistics.median(times[STORE])
    f = min(statistics.median(forwards[warmup:]), fb)
    leaf.grad = None
    return f, fb - f, {s: max(0.0, (r - 1.0) * fb) for s, r in _ratios(times).items()}


def _ratios(times: dict[str, list[float]]) -> dict[str, float]:
    """Per strategy but store, its time over the stored step's (see :func:`block_times`)."""
    base = times[STORE]
    ratios = {s: _ratio(t, base) for s, t in times.items() if s != STORE}
    for s, t in times.items():
        if len(t) < len(base):  # timed no more, slower than checkpoint: priced against it
            ratios[s] = _ratio(t, times[CHECKPOINT]) * ratios[CHECKPOINT]
    return ratios


def _ratio(times: list[float], base: list[float]) -> float:
    """The median over the rounds ``times`` has (the first ``len(times)``) of its time over
    ``base``'s in the same round."""
    return statistics.median(c / max(b, 1e-12) for c, b in zip(times, base, strict=False))


# A selective step that takes this many times the checkpoint step's time in each of _DECIDED
# rounds is timed no more: a selective block keeps its input and more where a checkpointed one
# keeps its input alone, so where it is also slower it is dominated (the solver prefers
# checkpoint on that block), and more rounds would only refine the time of a choice the plans
# do not make
SLOWER = 1.15
_DECIDED = 2  # rounds that must each find a selective step SLOWER before it is timed no more


def _slower(times: list[float], checkpoint: list[float]) -> bool:
    """Whether each of the last :data:`_DECIDED` rounds timed the step :data:`SLOWER` than
    checkpoint's (on one round's evidence, ordinary noise drops a step as fast as checkpoint,
    or faster, and prices it high)."""
    pairs = list(zip(times, checkpoint, strict=False))[-_DECIDED:]
    return len(pairs) == _DECIDED and all(t >= SLOWER * c for t, c in pairs)


def _rounds(
    steps: dict[str, Callable[[], Any]], repeats: int, warmup: int, clock: Clock
) -> dict[str, list[float]]:
    """Each step's seconds per round: ``repeats`` rounds of every step once, the order
    rotated by one per round (as :func:`revckpt.time_ratios`), after ``warmup`` untimed
    ones; a selective step :data:`SLOWER` than checkpoint's in each of :data:`_DECIDED`
    rounds runs in no later one (its list then stops there)."""
    for _ in range(warmup):
        for run in steps.values():
            run()
    times: dict[str, list[float]] = {name: [] for name in steps}
    active = list(steps)
    for i in range(repeats):
        shift = i % len(active)
        for name in active[shift:] + active[:shift]:
            times[name].append(wall_time(steps[name], clock=clock))
        if CHECKPOINT in times and i + 1 >= _DECIDED:
            ckpt = times[CHECKPOINT]
            active = [n for n in active if kind_of(n) != SELECTIVE or not _slower(times[n], ckpt)]
    return times


def _runner(
    strategy: str,
    block: nn.Module,
    leaf: torch.Tensor,
    kwargs: dict[str, Any],
    reversible: nn.Module | None,
) -> Callable[[], torch.Tensor] | None:
    kind = kind_of(strategy)
    if kind == CHECKPOINT:
        return functools.partial(checkpoint, block, leaf, **kwargs)
    if kind == SELECTIVE:
        return functools.partial(checkpoint, block, leaf, strategy=strategy, **kwargs)
    if kind == APPROX and leaf.is_floating_point():
        return functools.partial(checkpoint, block, leaf, strategy=strategy, **kwargs)
    if kind == COMPRESS and leaf.is_floating_point():
        return functools.partial(compress_saved, block, leaf, store=argument_of(strategy), **kwargs)
    if kind == REVERSIBLE and reversible is not None:
        return functools.partial(reversible, leaf, **kwargs)
    if kind == OFFLOAD:  # a view: an activation, as inside a chain (a leaf would stay in place)
        return lambda: checkpoint(block, activation(leaf), strategy=OFFLOAD, **kwargs)
    return None
