"""The cost model the scheduler optimises: memory peak, recompute time and gradient error of a
chain plan, from per-block measurements.

A **plan** cuts the chain of ``L`` blocks into segments ``[j, k)``, each run with one strategy:

============  ======================================  ==========================  ===========
strategy      kept between forward and backward       extra time in backward      error
============  ======================================  ==========================  ===========
store         every block's input and saved tensors   none                        0
checkpoint    the segment input ``x_j``               re-run the segment forward  0
approx:<c>    ``x_j`` compressed by codec ``c``       re-run the segment forward  ``e_j(c)``
reversible    nothing (the output is the next         re-run each block forward   0
              segment's input, or the caller's)       once (inverse + reforward)
selective:<p> one block: its input and the outputs    re-run the other ops of     0
              of the ops policy ``p`` keeps (matmul,  the block (norms,
              attention; ``revckpt.POLICY_PRESETS``)  activations, softmax)
offload       on the device, nothing: every block's   copy each input back (one   0
              input in host memory                    block ahead) and re-run
                                                      each block forward once
============  ======================================  ==========================  ===========

Per block ``i`` the model uses (all measured by :func:`revckpt.schedule.profile`): forward and
backward time ``f_i``, ``b_i``, and the extra time ``o_i(s)`` of a step of the block alone run
with strategy ``s`` (see :func:`_segment_time`); input and output bytes ``x_i``, ``x_{i+1}``;
bytes saved for backward apart from the input ``s_i``; the forward transient ``tf_i`` (peak
live bytes during the block's forward above those alive before it and its input, with autograd
recording) and ``tn_i`` (the same without recording, as in a recompute-later forward); the
backward transients, each the peak above the level when the backward starts, metered together
with the forward so that saved tensors freed during the backward count as freed: ``tb_i``
(gradients accumulated into ``.grad``), ``tc_i`` (gradients returned and kept, and the output's
gradient held throughout, as inside one approx or offload node), ``tk_i`` (the block
checkpointed: its recompute and backward) and
``tr_i`` (an invertible block run reversibly). The chain input counts as held by the caller
for the whole step (a leaf that requires grad is), so an approx or reversible first segment
does not free it.

Memory is simulated event by event. Let ``P`` be the bytes kept by the segments before the
current one and ``O`` the chain's output (held by the caller from the end of the forward).
Forward, block ``i`` of a segment peaks at ``P + K_before_i + x_i + t_i`` (``t = tf`` when the
block stores, ``tn`` otherwise). Backward walks the segments from the last; with ``g_i`` the
gradient of block ``i``'s output (``x_{i+1}`` bytes), block ``i`` peaks at

* store: ``P + A_i + O + g_i + tb_i`` with ``A_i = sum_{i' in [j, i]} (x_i' + s_i')``, the
  stored activations of the segment up to ``i``;
* checkpoint: while re-running block ``i < k-1``, ``P + A_{i-1} + x_i + tf_i + O + g_k``; the
  last block's recompute and backward together, ``P + A_{k-2} + x_{k-1} + O + g_k + tk_{k-1}``
  (the recompute stops after the last tensor the backward needs); then block ``i``'s backward
  as for store;
* approx:<c>: ``c_j`` (the compressed input; plus ``x_0`` when ``j = 0``) is held throughout;
  compressing it peaks at ``P + x_j + te_j(c)`` (``te``: the codec's temporaries and result,
  measured); the recompute as for checkpoint with ``tf``; the backward of block ``i`` at
  ``P + c_j + A_i + O + 2 g_k + [i < k-1] g_i + tc_i + sum_{i' in (i, k)} p_i'`` (an inner
  block's gradient is freed once used: ``min(tc_i, tb_i + p_i)`` bounds it there): one node,
  so the rebuilt segment output (``g_k`` bytes) stays alive and the parameter gradients made
  so far are kept until it returns them;
* selective:<p> (one block ``j``): keeps ``x_j + c_j(p)`` (the outputs the policy keeps);
  forward ``P + x_j + tf_j(p)``, backward ``P + x_j + c_j(p) + O + g_j + ts_j(p)`` (its
  recompute and backward measured together, as ``tk``);
* reversible: forward ``P + x_i + tn_i``; backward of block ``i``:
  ``P + x_k + O + g_{i+1} + tr_i`` (the stack keeps its output ``x_k`` while it rebuilds from
  it; not counted twice when ``k = L``, where it is ``O``; plus ``x_0`` throughout when
  ``j = 0``). Without ``tr`` measured, the bound
  ``P + O + 2 x_{i+1} + x_i + max(s_i + tc_i, tf_i + p_i)``;
* offload: every block is its own node whose input goes to host memory
  (:mod:`revckpt.offload`); ``d_i``, the bytes of that input still on the device (measured:
  ``x_i`` minus what was moved; all of it where host and device are the same memory), and
  ``m_i = x_i - d_i``. With ``D_i = sum_{i' in [j, i)} d_i'`` (plus ``x_0`` held by the
  caller when ``j = 0``), forward ``P + D_i + x_i + tn_i``; backward of block ``i``, its input
  back on the device and the input of block ``i - 1`` being prefetched
  (``f_i = m_{i-1}`` for ``i > j``, else 0): the recompute at ``P + D_i + x_i + tf_i + O + g_i
  + f_i``, the backward at ``P + D_i + x_i + s_i + O + 2 g_i + tc_i + f_i`` (one node, as an
  approx segment of one block). Kept: ``D_k``.

``O`` counts, in backward, the scalar loss and its gradient too (``loss_bytes`` of the last
block). A recomputed segment whose forward draws random numbers (dropout) also keeps their
generator state for its replay, ``r`` bytes, measured per block and strategy
(``BlockCost.replay``, :class:`ReplayCost`'s ``kept_bytes``): one state per node, so once per
checkpoint or approx segment (the largest block's) and per block of a reversible or offload
segment (each block, or each branch, its own node; these count in their forward from the start,
an upper bound). Of ``r``, the copies of module state a node keeps for its recompute (buffers
the forward writes, eval-mode normalisation statistics: ``module_bytes``) are one per block, so
a checkpoint or approx segment counts every block's. ``r`` is kept from the forward and alive
through the segment's backward; ``l`` bytes of it (``late_bytes``, measured: today approx,
offload and reversible nodes hold theirs as long as the step's graph lives) stay alive to the
end of the step, so they are alive in the backward of every earlier segment too.

Every segment's peak is ``P + W`` with ``W`` independent of what comes before it, so without
``l`` the peak of a plan is ``max_p (P_p + W_p)``: this decomposition is what makes an exact
dynamic programme possible (:mod:`revckpt.schedule.solver`). With it, it is
``max_p max(P_p + W_p, P_p + L_p + Wb_p)`` (``Wb_p``: the backward part of ``W_p``;
``L_p = sum_{q > p} l_q``), which :func:`evaluate` computes exactly and the solver checks
every plan against. A reversible segment may not be followed by an approx segment (the
reversible output would be kept in full next to its compressed copy).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import InvalidArgumentError, RevckptError
from ..strategy import Strategy, argument_of, kind_of
from .cost_records import BlockCost, Segment, SegmentCost
from .step import StepCosts

__all__ = [
    "SELECTIVE_PREFIX",
    "BlockCost",
    "Evaluation",
    "Segment",
    "SegmentCost",
    "allowed_after",
    "chain_totals",
    "evaluate",
    "follow_limit",
    "peak_phases",
    "segment_cost",
    "strategy_names",
]

from .kinds import (  # the kinds' names; their costs: .kinds.KINDS
    APPROX,
    CHECKPOINT,
    COMPRESS,
    KINDS,
    OFFLOAD,
    REVERSIBLE,
    SELECTIVE,
    STORE,
    _new_grads,
)

# the text forms' prefixes, kept for code that imports them; read a text form with
# revckpt.strategy.kind_of and argument_of, write one with str(Strategy(kind, arg))
APPROX_PREFIX = "approx:"
SELECTIVE_PREFIX = "selective:"


def strategy_names(blocks: Sequence[BlockCost]) -> list[str]:
    """Every strategy some block supports: store, checkpoint, reversible (if any block is
    invertible), offload (if profiled), ``approx:<codec>`` for every codec profiled and
    ``selective:<policy>`` for every selective-recompute policy profiled."""
    names = [STORE, CHECKPOINT]
    if any(b.invertible for b in blocks):
        names.append(REVERSIBLE)
    if any(b.offload is not None for b in blocks):
        names.append(OFFLOAD)
    codecs = sorted({c for b in blocks for c in b.approx})
    names += [str(Strategy(APPROX, c)) for c in codecs]
    policies = sorted({p for b in blocks for p in b.selective})
    names += [str(Strategy(SELECTIVE, p)) for p in policies]
    compressed = sorted({c for b in blocks for c in b.compress})
    names += [str(Strategy(COMPRESS, c)) for c in compressed]
    return names


NO_LIMIT, NO_APPROX, NO_APPROX_OR_REVERSIBLE = 0, 1, 2


def follow_limit(blocks: Sequence[BlockCost], seg: Segment) -> int:
    """What may follow ``seg``. After a reversible segment neither approx (its output would be
    kept in full next to the compressed copy) nor another reversible segment (the first stack
    keeps the boundary alive: one merged segment is never worse). After a store segment whose
    last block saves its own output for backward (e.g. it ends with a ReLU), or a selective
    segment whose policy keeps the block's output (a block ending in a matmul), neither approx
    nor reversible: that output stays alive, so compressing or dropping it saves nothing.
    Offload and compress follow the rules of approx (moving a boundary that stays alive saves
    nothing; compress keeps a compressed copy of its input next to it: before session 33 that
    copy was not priced, 1.02-1.07x the predicted peak). A compress segment whose block saves
    its output keeps a compressed copy of it, not the output: anything may follow."""
    last = blocks[seg.stop - 1]
    if seg.strategy == REVERSIBLE:
        return NO_APPROX_OR_REVERSIBLE
    if kind_of(seg.strategy) == STORE and last.output_saved:
        return NO_APPROX_OR_REVERSIBLE
    if kind_of(seg.strategy) == SELECTIVE:
        kept = last.selective.get(argument_of(seg.strategy))
        if kept is not None and kept.output_kept:
            return NO_APPROX_OR_REVERSIBLE
    return NO_LIMIT


def allowed_after(limit: int, strategy: str) -> bool:
    if strategy == OFFLOAD or kind_of(strategy) in (APPROX, COMPRESS):
        return limit == NO_LIMIT
    if strategy == REVERSIBLE:
        return limit != NO_APPROX_OR_REVERSIBLE
    return True


def _check_strategy(blocks: Sequence[BlockCost], seg: Segment) -> None:
    if not 0 <= seg.start < seg.stop <= len(blocks):
        raise InvalidArgumentError(
            f"segment [{seg.start}, {seg.stop}) does not fit a chain of {len(blocks)} blocks"
        )
    try:
        kind = kind_of(seg.strategy)
    except (RevckptError, TypeError):  # not a text form (TypeError: unhashable)
        raise InvalidArgumentError(
            f"unknown strategy {seg.strategy!r}; use 'store', 'checkpoint', 'reversible', "
            "'offload', 'approx:<codec>', 'selective:<policy>' or 'compress:<codec>'"
        ) from None
    if KINDS[kind].one_block and seg.stop != seg.start + 1:
        raise InvalidArgumentError(
            f"a {kind} segment covers one block, got [{seg.start}, {seg.stop}); split it"
        )
    KINDS[kind].check(blocks, seg, argument_of(seg.strategy))


def segment_cost(
    blocks: Sequence[BlockCost], seg: Segment, step: StepCosts | None = None
) -> SegmentCost:
    """Kept bytes, working peak, recompute time and error of one segment (see module doc);
    ``step``: the whole step's costs outside the chain (:class:`StepCosts`), whose
    ``backward_held`` replaces the chain output and loss in backward."""
    _check_strategy(blocks, seg)
    out = _backward_held(blocks, step)
    j, k, strategy = seg.start, seg.stop, seg.strategy
    part = blocks[j:k]
    kind = KINDS[kind_of(strategy)]
    arg = argument_of(strategy)
    kept, fwd, bwd = kind.work(part, arg, j == 0, k == len(blocks), out)
    time = kind.time(part, strategy)
    error = kind.error(part, arg)
    rng = _replay_bytes(part, strategy, late=False)
    if strategy in (REVERSIBLE, OFFLOAD):  # one state per block, kept as its forward ends
        fwd += rng
    return SegmentCost(
        kept + rng,
        max(fwd, bwd + rng),
        time,
        error,
        backward_work=bwd + rng,
        late=_replay_bytes(part, strategy, late=True) + sum(_new_grads(b) for b in part),
    )


def _backward_held(blocks: Sequence[BlockCost], step: StepCosts | None) -> int:
    if step is not None:
        return step.backward_held
    return blocks[-1].output_bytes + blocks[-1].loss_bytes


def _replay_bytes(part: Sequence[BlockCost], strategy: str, *, late: bool) -> int:
    """``r`` (or ``l`` with ``late``) of a segment: one replay state per recomputed node, so
    the sum over the blocks of reversible and offload segments (a node per block, or per
    branch); for one node over the whole segment, the largest block's generator states and
    every block's copies of module state (``ReplayCost.module_bytes``)."""
    per_block = [_replay_of(b, strategy, late) for b in part]
    if strategy == REVERSIBLE and not late:  # and the stack's invertibility-check samples
        return sum(per_block) + part[0].reversible_check_bytes
    if strategy in (REVERSIBLE, OFFLOAD):
        return sum(per_block)
    copies = [min(f, _module_of(b, strategy)) for b, f in zip(part, per_block, strict=True)]
    return max(f - c for f, c in zip(per_block, copies, strict=True)) + sum(copies)


def _module_of(b: BlockCost, strategy: str) -> int:
    replay = b.replay.get(strategy)
    return 0 if replay is None else replay.module_bytes


def _replay_of(b: BlockCost, strategy: str, late: bool) -> int:
    """Block ``b``'s ``r`` (or ``l``) for ``strategy``: 0 where not measured."""
    replay = b.replay.get(strategy)
    figure = None if replay is None else (replay.late_bytes if late else replay.kept_bytes)
    return 0 if figure is None else figure


@dataclass(frozen=True)
class Evaluation:
    """Predicted figures of a plan: peak bytes, extra seconds, summed error, kept bytes."""

    peak_bytes: int
    overhead_s: float
    error: float
    kept_bytes: int


def evaluate(
    blocks: Sequence[BlockCost], segments: Sequence[Segment], *, step: StepCosts | None = None
) -> Evaluation:
    """Predicted peak, recompute overhead and error of a plan (segments in order, covering the
    chain). The peak is ``max_p max(P_p + W_p, P_p + L_p + Wb_p)`` over segments ``p`` (see the
    module docstring); the error ``sqrt(sum_p e_p^2)``. With ``step`` (:class:`StepCosts`),
    the peak of the whole training step around the chain (see :mod:`~revckpt.schedule.step`)."""
    _check_sequence(blocks, segments)
    costs = [segment_cost(blocks, seg, step) for seg in segments]
    peak, prefix = _chain_peak(costs)
    if step is not None:
        late = sum(c.late for c in costs)
        peak = max(step.before_peak, step.held + peak, step.held + prefix + step.head)
        peak = max(peak, step.after + late)
    return Evaluation(
        peak_bytes=peak,
        overhead_s=sum(c.time for c in costs),
        error=math.sqrt(sum(c.error**2 for c in costs)),
        kept_bytes=prefix,
    )


def _chain_peak(costs: Sequence[SegmentCost]) -> tuple[int, int]:
    """The chain's own peak, ``max_p max(P_p + W_p, P_p + L_p + Wb_p)``, and what the plan
    keeps at the end of its forward (``P`` after the last segment)."""
    peak, prefix, _ = _chain_peak_where(costs)
    return peak, prefix


def _chain_peak_where(costs: Sequence[SegmentCost]) -> tuple[int, int, bool]:
    """:func:`_chain_peak`, and whether the peak is in the blocks' backward."""
    late_after = [sum(c.late for c in costs[p + 1 :]) for p in range(len(costs))]
    prefix, peak, backward = 0, 0, False
    for cost, late in zip(costs, late_after, strict=True):
        forward, back = prefix + cost.work, prefix + late + cost.backward_work
        if max(forward, back) > peak:
            peak, backward = max(forward, back), back >= forward
        prefix += cost.kept
    return peak, prefix, backward


def peak_phases(
    blocks: Sequence[BlockCost], segments: Sequence[Segment], step: StepCosts
) -> dict[str, dict[str, int]]:
    """What each phase of the whole step holds at its predicted peak under a plan, part by
    part (bytes): ``before`` the blocks, ``blocks`` (inside their forward or backward),
    ``head`` (after their forward, before their backward) and ``after`` their backward; the
    largest sum is the plan's predicted peak (:func:`evaluate`). Where the blocks peak in
    their backward, what the step holds for the head's gradient then (``backward_held``: the
    model's output, the logits) counts as held outside them."""
    _check_sequence(blocks, segments)
    costs = [segment_cost(blocks, seg, step) for seg in segments]
    chain, prefix, backward = _chain_peak_where(costs)
    outside = min(step.backward_held, chain) if backward else 0
    return {
        "before": {"before": step.before_peak},
        "blocks": {"held": step.held + outside, "blocks": chain - outside},
        "head": {"held": step.held, "kept": prefix, "head": step.head},
        "after": {"after": step.after, "late": sum(c.late for c in costs)},
    }


def _check_sequence(blocks: Sequence[BlockCost], segments: Sequence[Segment]) -> None:
    if not segments or segments[0].start != 0 or segments[-1].stop != len(blocks):
        raise InvalidArgumentError("a plan's segments must cover the chain from block 0 to the end")
    for a, b in itertools.pairwise(segments):
        if a.stop != b.start:
            raise InvalidArgumentError(
                f"segments [{a.start}, {a.stop}) and [{b.start}, {b.stop}) do not meet"
            )
        if not allowed_after(follow_limit(blocks, a), b.strategy):
            raise InvalidArgumentError(
                f"segment [{a.start}, {a.stop}) ({a.strategy}) cannot be followed by segment "
                f"[{b.start}, {b.stop}) ({b.strategy}): "
                + (
                    "its output would be kept in full next to the compressed copy"
                    if a.strategy == REVERSIBLE
                    else f"block {a.stop - 1} saves its output for backward, so it stays alive "
                    "anyway; checkpoint that block or store the next one"
                )
            )


def chain_totals(blocks: Sequence[BlockCost], step: StepCosts | None = None) -> tuple[float, int]:
    """Forward+backward seconds of the plain chain and its store-everything peak bytes; with
    ``step``, both of the whole step (the chain's seconds over its share of the step's)."""
    plain = evaluate(blocks, [Segment(0, len(blocks), STORE)], step=step)
    base = sum(b.forward_s + b.backward_s for b in blocks)
    if step is not None:
        base /= step.chain_share
    return base, plain.peak_bytes


def slots_of(nbytes: int, slot_bytes: float, *, up: bool = True) -> int:
    """Bytes in slots, rounded up (a plan that fits in slots fits in bytes) or down (a plan
    that fits in bytes fits in slots)."""
    if nbytes <= 0:
        return 0
    return math.ceil(nbytes / slot_bytes - 1e-9) if up else math.floor(nbytes / slot_bytes + 1e-9)
