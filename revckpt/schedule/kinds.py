"""One cost entry per strategy kind: what a segment run with it keeps, its working peaks, its
extra time and its error (the formulas of :mod:`revckpt.schedule.costs`' module docstring).

:data:`KINDS` maps a kind (:class:`revckpt.Strategy`'s ``kind``) to its :class:`Kind`; the
cost model, the solver and the profiler ask the registry rather than parse strategy text. A
new strategy is one entry here (and its runner and its measurements).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import InvalidArgumentError
from ..strategy import argument_of, kind_of
from .kind_errors import _approx_error, _compress_error, _no_error

if TYPE_CHECKING:
    from .cost_records import BlockCost, Segment

__all__ = ["KINDS", "Kind", "Work", "approximate"]

STORE, CHECKPOINT, REVERSIBLE, OFFLOAD = "store", "checkpoint", "reversible", "offload"
APPROX, SELECTIVE, COMPRESS = "approx", "selective", "compress"  # kinds with an argument

Work = tuple[int, int, int]  # kept bytes, forward peak and backward peak above P


def _new_grads(b: BlockCost) -> int:
    """The parameter-gradient bytes the block's backward creates and leaves alive."""
    return b.param_bytes if b.grads_new else 0


def _grads_after(part: Sequence[BlockCost]) -> list[int]:
    """Per block of a segment, the new gradients of the blocks after it in the segment (alive
    during its backward)."""
    after, total = [], 0
    for b in reversed(part):
        after.append(total)
        total += _new_grads(b)
    return after[::-1]


def _store_work(part: Sequence[BlockCost], out: int) -> Work:
    fwd = bwd = acc = 0
    for b in part:
        fwd = max(fwd, acc + b.input_bytes + b.forward_peak_bytes)
        acc += _stored(b)
    kept = acc
    for b, grads in zip(reversed(part), reversed(_grads_after(part)), strict=True):
        bwd = max(bwd, acc + out + b.output_bytes + b.backward_peak_bytes + grads)
        acc -= _stored(b)  # acc = sum over [j, i] above
    return kept, fwd, bwd


def _stored(b: BlockCost) -> int:
    """What a stored block keeps: its saved tensors, and its input if it stays alive."""
    return (b.input_bytes if b.input_kept else 0) + b.saved_bytes


def _selective_work(b: BlockCost, policy: str, out: int) -> Work:
    s = b.selective[policy]
    kept = b.input_bytes + s.kept_bytes
    fwd = b.input_bytes + s.forward_peak_bytes
    return kept, fwd, kept + out + b.output_bytes + s.backward_peak_bytes


def _reversible_work(part: Sequence[BlockCost], first: bool, last: bool, out: int) -> Work:
    held = part[0].input_bytes if first else 0  # the caller's chain input, if ours
    # the stack keeps its output x_k for its whole backward (it rebuilds from it); the chain's
    # own output is O, counted already
    kept_output = 0 if last else part[-1].output_bytes
    fwd = bwd = 0
    for i, (b, grads) in enumerate(zip(part, _grads_after(part), strict=True)):
        current = b.input_bytes if (i > 0 or not first) else 0
        fwd = max(fwd, held + current + b.forward_peak_nograd_bytes)
        if b.reversible_peak_bytes is not None:  # tr, measured: rebuild and backward
            bwd = max(
                bwd, held + kept_output + out + b.output_bytes + b.reversible_peak_bytes + grads
            )
            continue
        bwd = max(  # an upper bound when tr was not measured
            bwd,
            held
            + grads
            + kept_output
            + out
            + 2 * b.output_bytes
            + b.input_bytes
            # its node returns the block's parameter gradients at once
            + max(b.saved_bytes + b.capture_peak, b.forward_peak_bytes + b.param_bytes),
        )
    return held, fwd, bwd


def _recompute_work(part: Sequence[BlockCost], strategy: str, first: bool, out: int) -> Work:
    """A checkpoint or approx segment: its forward records nothing; its backward re-runs it."""
    if strategy == CHECKPOINT:
        kept, held = part[0].input_bytes, 0
    else:
        kept = held = part[0].approx[argument_of(strategy)].kept_bytes
        if first or part[0].input_held:  # the input stays alive next to its compressed copy
            kept += part[0].input_bytes
            held += part[0].input_bytes
    fwd = 0
    if strategy != CHECKPOINT:  # compressing the input, next to it
        encode = part[0].approx[argument_of(strategy)].encode_peak_bytes
        fwd = part[0].input_bytes + (held if encode is None else encode)
    for i, b in enumerate(part):
        alive = kept if strategy == CHECKPOINT else held
        current = b.input_bytes if (i > 0 or strategy != CHECKPOINT) else 0
        fwd = max(fwd, alive + current + b.forward_peak_nograd_bytes)
    grad_out = part[-1].output_bytes
    last = part[-1]
    measured_last = strategy == CHECKPOINT and last.checkpoint_peak_bytes is not None
    bwd = acc = 0
    for i, b in enumerate(part):  # the recompute in backward
        if i == len(part) - 1 and measured_last:
            # tk: the last block's recompute and backward measured together (the recompute
            # stops after the last tensor its backward needs)
            assert last.checkpoint_peak_bytes is not None
            bwd = max(bwd, acc + b.input_bytes + out + grad_out + last.checkpoint_peak_bytes)
        else:
            bwd = max(bwd, held + acc + b.input_bytes + b.forward_peak_bytes + out + grad_out)
        acc += b.input_bytes + b.saved_bytes
    if strategy == CHECKPOINT:
        grads_after = _grads_after(part)
        for i in reversed(range(len(part))):  # its backward
            b = part[i]
            if not (i == len(part) - 1 and measured_last):
                bwd = max(bwd, acc + out + b.output_bytes + b.backward_peak_bytes + grads_after[i])
            acc -= b.input_bytes + b.saved_bytes
        return kept, fwd, bwd
    # one node: the recomputed segment output stays alive and it returns the segment's
    # parameter gradients at its end, so those made so far are kept
    captured = 0
    for i in reversed(range(len(part))):
        b = part[i]
        inner = b.output_bytes if i < len(part) - 1 else 0  # g_i, unless it is g_k
        recomputed = grad_out  # the segment output, rebuilt, alive until the node returns
        # tc is measured with the output's gradient held, as the node holds g_k; an inner
        # block's gradient is freed once used, for which tb + p bounds it too
        tc = (
            b.capture_peak
            if inner == 0
            else min(b.capture_peak, b.backward_peak_bytes + b.param_bytes)
        )
        bwd = max(bwd, held + acc + out + grad_out + recomputed + inner + tc + captured)
        captured += b.param_bytes
        acc -= b.input_bytes + b.saved_bytes
    return kept, fwd, bwd


def _offload_work(part: Sequence[BlockCost], first: bool, out: int) -> Work:
    """An offload segment (see the module docstring): per block ``d_i`` stays on the device,
    ``m_i`` moves; ``first``: the segment starts the chain, whose input the caller holds."""
    kept = 0  # D_i
    fwd = bwd = 0
    moved_before = 0  # m_{i-1}, being prefetched during block i's backward
    for i, (b, grads) in enumerate(zip(part, _grads_after(part), strict=True)):
        assert b.offload is not None
        d = b.offload.kept_bytes
        g = b.output_bytes
        prefetch = moved_before if i > 0 else 0
        # the caller's chain input stays on the device whatever is moved: its copy comes back
        # next to it
        back = b.input_bytes + (b.input_bytes - d if first and i == 0 else 0)
        fwd = max(fwd, kept + b.input_bytes + b.forward_peak_nograd_bytes)
        bwd = max(
            bwd,
            kept + back + b.forward_peak_bytes + out + g + prefetch + grads,
            kept + back + b.saved_bytes + out + 2 * g + b.capture_peak + prefetch + grads,
        )
        kept += b.input_bytes if (first and i == 0) else d
        moved_before = b.input_bytes - d
    return kept, fwd, bwd


def _reversible_time(part: Sequence[BlockCost], strategy: str) -> float:
    """``r_j + sum_{i > j} s_i``: the first block's one-block stack (``r``, what a stack
    costs of its own included), then what each further block measured adding inside a longer
    stack (``s_i``, ``stacked_s``; ``r_i`` if not measured). On the RevNet-like model a block
    costs about 1.4 times as much as a stack of its own as inside one of eight."""
    own = [b.strategy_overhead_s.get(REVERSIBLE, b.forward_s) for b in part]
    rest = zip(part[1:], own[1:], strict=True)
    return own[0] + sum(o if b.stacked_s is None else b.stacked_s for b, o in rest)


def _offload_time(part: Sequence[BlockCost], strategy: str) -> float:
    """``sum_i o_i - sum_{i < k-1} h_i`` (``h_i``, the measured copy back of block ``i``'s
    input, overlapped with block ``i + 1``'s backward when prefetched; the copy out,
    overlapped with the next forward, is not credited)."""
    own = [b.strategy_overhead_s.get(OFFLOAD, b.forward_s) for b in part]
    prefetched = zip(own[:-1], part[:-1], strict=True)
    return sum(max(0.0, o - _fetch_s(b)) for o, b in prefetched) + own[-1]


def _fetch_s(b: BlockCost) -> float:
    return 0.0 if b.offload is None else b.offload.fetch_s


def _recompute_time(part: Sequence[BlockCost], strategy: str) -> float:
    """Checkpoint / approx: ``o_j + sum_{i > j} c_i`` (one call, one compression of the
    segment input, every block recomputed; ``c_i``, ``chained_s``: what block ``i`` measured
    adding inside a longer checkpoint segment, ``f_i`` if not measured)."""
    head = part[0].strategy_overhead_s.get(strategy, part[0].forward_s)
    return head + sum(b.forward_s if b.chained_s is None else b.chained_s for b in part[1:])


def _own_time(part: Sequence[BlockCost], strategy: str) -> float:
    """A one-block segment (selective, compress): the block's measured extra time."""
    return part[0].strategy_overhead_s.get(strategy, part[0].forward_s)


def _compress_work(part: Sequence[BlockCost], codec: str | None, first: bool, out: int) -> Work:
    """Stored, with the block's saved tensors compressed, its input among them where it saves
    it (``c.kept_bytes`` counts that copy: profiled on an input that is not a leaf, as inside a
    model). The input itself stays alive only where the caller holds it (``first``) or code
    outside the blocks saves it (``input_held``); a block before that keeps its output is not
    followed by compress (:func:`~revckpt.schedule.costs.allowed_after`)."""
    assert codec is not None
    b = part[0]
    c = b.compress[codec]
    alive = (first or b.input_held) and not c.input_exact  # (exact: in c.kept_bytes)
    kept = (b.input_bytes if alive else 0) + c.kept_bytes
    fwd = b.input_bytes + c.forward_peak_bytes
    bwd = kept + out + b.output_bytes + c.backward_peak_bytes
    return kept, fwd, bwd


def _no_time(part: Sequence[BlockCost], strategy: str) -> float:
    return 0.0


def _bad_blocks(
    blocks: Sequence[BlockCost], seg: Segment, ok: Callable[[BlockCost], bool]
) -> list[int]:
    return [i for i in range(seg.start, seg.stop) if not ok(blocks[i])]


def _check_reversible(blocks: Sequence[BlockCost], seg: Segment, arg: str | None) -> None:
    bad = _bad_blocks(blocks, seg, lambda b: b.invertible)
    if bad:
        raise InvalidArgumentError(
            f"blocks {bad} are not invertible, so segment [{seg.start}, {seg.stop}) cannot "
            "be reversible; mark only reversible-coupling blocks as invertible"
        )
    dims = {blocks[i].split_dim for i in range(seg.start, seg.stop)}
    if len(dims) > 1:
        raise InvalidArgumentError(
            f"the units of segment [{seg.start}, {seg.stop}) split their inputs along different "
            f"dims {sorted(dims, key=str)}, so they cannot run as one reversible stack; cut the "
            "segment where split_dim changes"
        )


def _check_offload(blocks: Sequence[BlockCost], seg: Segment, arg: str | None) -> None:
    bad = _bad_blocks(blocks, seg, lambda b: b.offload is not None)
    if bad:
        raise InvalidArgumentError(
            f"offload was not profiled for blocks {bad}; profile with "
            "schedule.profile(..., offload=True)"
        )


def _priced(field: str, what: str, option: str) -> Callable[..., None]:
    """A check that the segment's first block was profiled for the argument: ``field``, the
    ``BlockCost`` mapping keyed by it; ``what``, how the message names it (``{arg}``);
    ``option``, the ``profile`` option that prices it."""

    def check(blocks: Sequence[BlockCost], seg: Segment, arg: str | None) -> None:
        priced = getattr(blocks[seg.start], field)
        if arg not in priced:
            raise InvalidArgumentError(
                f"{what.format(arg=arg)} was not profiled for block {seg.start}; profile it "
                f"(schedule.profile(..., {option}=[...])) or choose one of {sorted(priced)}"
            )

    return check


_check_approx = _priced("approx", "codec {arg!r}", "codecs")
_check_selective = _priced("selective", "policy {arg!r}", "policies")
_check_compress = _priced("compress", "compress:{arg}", "compress")


def _no_check(blocks: Sequence[BlockCost], seg: Segment, arg: str | None) -> None:
    return None


WorkFn = Callable[["Sequence[BlockCost]", "str | None", bool, bool, int], Work]


@dataclass(frozen=True)
class Kind:
    """The costs of one strategy kind. ``work(part, arg, first, last, out)``: kept bytes and
    forward and backward peaks above the bytes kept before (``first``/``last``: the segment
    starts/ends the chain; ``out``: what the caller holds in backward); ``time(part,
    strategy)``: extra seconds; ``error(part, arg)``: relative gradient error; ``check``:
    raises if the profile cannot price it for these blocks; ``one_block``: its segments are
    one block long; ``recomputes``: it re-runs forwards (a replay state is kept);
    ``approximate``: its gradients carry an error (priced against the error budget);
    ``runs_on(block, arg)``: whether a block can be run with it (for a segment, its first block,
    or with ``last_ok`` its last one, decides); ``joins(first, block)``: whether ``block`` may
    run in one segment that ``first`` starts."""

    work: WorkFn
    time: Callable[[Sequence[BlockCost], str], float]
    error: Callable[[Sequence[BlockCost], str | None], float] = _no_error
    check: Callable[[Sequence[BlockCost], Segment, str | None], None] = _no_check
    one_block: bool = False
    recomputes: bool = True
    approximate: bool = False
    runs_on: Callable[[BlockCost, str | None], bool] = lambda b, arg: True
    last_ok: bool = False  # a segment may end wherever its last block can run it
    joins: Callable[[BlockCost, BlockCost], bool] = lambda first, block: True


KINDS: dict[str, Kind] = {
    STORE: Kind(
        lambda part, arg, first, last, out: _store_work(part, out),
        _no_time,
        recomputes=False,
    ),
    CHECKPOINT: Kind(
        lambda part, arg, first, last, out: _recompute_work(part, CHECKPOINT, first, out),
        _recompute_time,
    ),
    APPROX: Kind(
        lambda part, arg, first, last, out: _recompute_work(part, f"{APPROX}:{arg}", first, out),
        _recompute_time,
        _approx_error,
        _check_approx,
        approximate=True,
        runs_on=lambda b, arg: arg in b.approx,
    ),
    SELECTIVE: Kind(
        lambda part, arg, first, last, out: _selective_work(part[0], arg, out),
        _own_time,
        check=_check_selective,
        one_block=True,
        runs_on=lambda b, arg: arg in b.selective,
    ),
    REVERSIBLE: Kind(
        lambda part, arg, first, last, out: _reversible_work(part, first, last, out),
        _reversible_time,
        check=_check_reversible,
        runs_on=lambda b, arg: b.invertible,
        last_ok=True,
        joins=lambda first, block: first.split_dim == block.split_dim,  # one stack's units
    ),
    OFFLOAD: Kind(
        lambda part, arg, first, last, out: _offload_work(part, first, out),
        _offload_time,
        check=_check_offload,
        runs_on=lambda b, arg: b.offload is not None,
        last_ok=True,
    ),
    COMPRESS: Kind(
        lambda part, arg, first, last, out: _compress_work(part, arg, first, out),
        _own_time,
        _compress_error,
        _check_compress,
        one_block=True,
        recomputes=False,
        approximate=True,
        runs_on=lambda b, arg: arg in b.compress,
    ),
}


def approximate(strategy: str) -> bool:
    """Whether ``strategy`` (a text form) changes the gradients (approx, compress)."""
    return KINDS[kind_of(strategy)].approximate
