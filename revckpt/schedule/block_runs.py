"""One block run in every mode a plan can run it in (:class:`_Runs`), and those runs
metered: one forward and backward per mode (:func:`_metered_modes`), compress's forward alone
(:func:`compress_alone`). :mod:`.block_memory` turns them into a block's memory figures."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from .._numbers import tensor_bytes
from ..approx import compress_saved
from ..checkpoint import checkpoint
from ..errors import (
    InvalidArgumentError,
    InvalidInputTypeError,
    ModifiedInputError,
    ModifiedParameterError,
)
from ..layers import ReversibleSequential
from ..measure import MemoryMeter
from ..strategy import argument_of, kind_of
from .costs import APPROX, CHECKPOINT, COMPRESS, OFFLOAD, REVERSIBLE, SELECTIVE

__all__ = ["activation", "changes_its_input", "check_output", "compress_alone", "inner_input"]

# metered modes that are not strategies: the block stored, its gradients accumulated into
# .grad or returned
PLAIN_MODES = ("accumulate", "capture")


@dataclass(frozen=True)
class _Runs:
    """One block run with each strategy, on one input leaf."""

    block: nn.Module
    leaf: torch.Tensor
    wrt: list[torch.Tensor]
    kwargs: dict[str, Any]
    reversible: ReversibleSequential | None
    # the input compress runs on: a copy that is not a leaf, as a block's input inside a model
    # (compress_saved keeps a leaf exact, and compresses an activation it is given)
    inner: torch.Tensor | None = None

    def forward(self, mode: str) -> torch.Tensor:
        block, leaf, kw = self.block, self.leaf, self.kwargs
        kind = None if mode in PLAIN_MODES else kind_of(mode)
        if kind == CHECKPOINT:
            return checkpoint(block, leaf, **kw)
        if kind == SELECTIVE:
            return checkpoint(block, leaf, strategy=mode, **kw)
        if kind == APPROX:
            return checkpoint(block, leaf, strategy=mode, **kw)
        if kind == COMPRESS:
            x = leaf if self.inner is None else self.inner
            return compress_saved(block, x, store=argument_of(mode), **kw)
        if kind == OFFLOAD:
            return checkpoint(block, activation(leaf), strategy=OFFLOAD, **kw)
        if kind == REVERSIBLE:
            assert self.reversible is not None
            return self.reversible(leaf, **kw)
        return block(leaf, **kw)


def check_output(block: nn.Module, y: Any) -> torch.Tensor:
    """``y``, a block's output, if it is one tensor (what the scheduler handles); else raises."""
    if not isinstance(y, torch.Tensor):
        raise InvalidInputTypeError(
            "the scheduler handles chains of blocks returning one tensor; "
            f"{type(block).__name__} returned {type(y).__name__}"
        )
    return y


def changes_its_input(name: str, block: nn.Module) -> InvalidArgumentError:
    """The error for a chain block that changes a tensor it is given in place (an
    ``nn.ReLU(inplace=True)`` of its own): it cannot start a recomputed segment (its recompute
    would start from the changed value), nor be run alone on a leaf to be profiled."""
    return InvalidArgumentError(
        f"block {name} ({type(block).__name__}) changes a tensor it is given in place (e.g. "
        "nn.ReLU(inplace=True) as its first operation), so it cannot start a recomputed "
        "segment and the scheduler cannot profile it on its own; make that operation out of "
        "place (inplace=False), or join it to the block before it "
        "(nn.Sequential(previous, block))"
    )


def _scalar_bytes(like: torch.Tensor) -> int:
    """Bytes of one scalar on ``like``'s device, as its memory meter counts them."""
    with MemoryMeter(like.device) as meter:
        t = like.new_ones(())
    del t
    return meter.end_bytes


class _Seed(torch.autograd.Function):
    """A scalar whose backward hands ``holder``'s one tensor to ``y`` as its gradient, so that
    the gradient is owned by the autograd engine (freed when used), as inside a model."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, holder: list[torch.Tensor]) -> torch.Tensor:
        ctx.holder = holder
        return y.new_zeros(())

    @staticmethod
    def backward(ctx: Any, _: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.holder.pop(), None


@dataclass(frozen=True)
class _Metered:
    """Per mode: the backward transient (not for a mode metered for its replay state alone
    whose forward kept nothing more: see :func:`_metered_modes`), and its forward's figures:
    the bytes it keeps beyond those accounted for (none below 0) and its peak; per recomputing
    mode, the bytes its forward keeps beyond what the cost model counts for it (the replay
    state: generator states of a forward that draws random numbers) and what of them is still
    alive after its backward."""

    transient: dict[str, int]
    rng: dict[str, int]
    late: dict[str, int]
    forward: dict[str, tuple[int, int]]


# modes metered for their replay state alone (``BlockCost.replay``: their transients are not
# figures of the cost model): a forward that keeps nothing beyond the bytes accounted for has
# no replay state, nor any that outlives its backward, so their backward is not run then.
# (Offload's transient is not a figure either; its backward, which copies the input back from
# the host on a side stream, still runs.)
_REPLAY_ONLY = (APPROX,)


def _metered_modes(
    runs: _Runs,
    modes: Sequence[str],
    grad_out: torch.Tensor,
    accounted: dict[str, int],
    device: Any,
    *,
    backward: bool,
    grads_new: bool = False,
) -> _Metered:
    """One metered step per mode: ``capture`` returns the gradients, the others accumulate
    them; ``accounted``: per mode, the bytes its forward keeps that the cost model counts
    (the compressed input of approx). ``grads_new``: the parameter gradients are ``None``
    before each step (created by it, counted in its transients) rather than existing.
    Selective modes count their replay state in what they keep
    (``SelectiveCost.kept_bytes``): only what outlives their backward is recorded here. The
    step of an approx mode whose forward keeps nothing beyond the accounted bytes ends with
    its forward (its replay figures are 0 without a backward; see ``_REPLAY_ONLY``). A
    selective mode whose policy keeps an output the block then changes in place is left out:
    the block cannot run with it (:func:`revckpt.checkpoint` raises)."""
    metered = _Metered({}, {}, {}, {})
    for mode in modes:
        lean = mode not in PLAIN_MODES and kind_of(mode) in _REPLAY_ONLY
        if lean and metered.rng.get(CHECKPOINT) == 0:
            # an approx forward is checkpoint's with the input encoded (accounted): where
            # checkpoint's keeps no replay state, neither does it, and its lean step would
            # end with its forward, giving 0 (see _REPLAY_ONLY)
            metered.rng[mode] = 0
            if backward:
                metered.late[mode] = 0
            continue
        try:
            step = _metered_step(
                runs, mode, grad_out, accounted.get(mode, 0), device, backward, grads_new, lean
            )
        except ModifiedInputError as e:
            changed_weights = isinstance(e, ModifiedParameterError)
            if changed_weights or mode in PLAIN_MODES or kind_of(mode) != SELECTIVE:
                raise
            continue  # the policy keeps an output the block changes in place: not for it
        metered.forward[mode] = (max(0, step.kept), step.forward_peak)
        if step.transient is not None:
            metered.transient[mode] = step.transient
        if mode in PLAIN_MODES:
            continue
        if kind_of(mode) != SELECTIVE:
            metered.rng[mode] = max(0, step.kept)
        if backward:
            metered.late[mode] = max(0, min(step.left, step.kept))
    return metered


@dataclass(frozen=True)
class _Step:
    """One metered step: its backward transient (``None``: not run), the bytes its forward
    keeps beyond those accounted for, what is still alive after its backward (besides the
    gradients), and its forward's peak."""

    transient: int | None
    kept: int
    left: int
    forward_peak: int


def _metered_step(
    runs: _Runs,
    mode: str,
    grad_out: torch.Tensor,
    accounted: int,
    device: Any,
    backward: bool,
    grads_new: bool,
    lean: bool = False,
) -> _Step:
    """The forward and backward of ``mode``, metered (see :func:`_metered_modes`); ``lean``:
    the forward alone when it keeps nothing beyond ``accounted``."""
    leaf = runs.leaf
    params = [t for t in runs.wrt if t is not leaf]
    leaf.grad = None
    if grads_new:
        for p in params:
            p.grad = None
    with MemoryMeter(device) as meter:
        y = check_output(runs.block, runs.forward(mode))
        kept = meter.live_bytes - tensor_bytes(y) - accounted
        forward_peak = meter.phase_peak_bytes
        if lean and kept <= 0:
            del y
            return _Step(None, kept, 0, forward_peak)
        # the output's gradient reaches the block as it does in a model: made by the
        # backward, freed once the block's last operation has used it (not held here)
        holder = [grad_out.clone()]
        seed = _Seed.apply(y, holder) if backward else y.new_zeros(())
        # nor is the output held: in a model it is gone by the block's backward unless the
        # block saved it (then it counts in the transient until the backward frees it). A
        # reversible stack rebuilds from its output, which its caller holds (the model
        # counts it), so there it stays.
        out_bytes = tensor_bytes(y)
        kept_output = [y] if mode == REVERSIBLE else []
        start = meter.live_bytes - (0 if kept_output else out_bytes)
        del y
        meter.reset_peak()
        if backward and mode == "capture":
            # as inside one approx or offload node, which holds the gradient of its output
            # until it returns: the gradient stays alive for the whole backward
            node_held = holder[0]
            grads = torch.autograd.grad(seed, runs.wrt, allow_unused=True)
            del grads, node_held
        elif backward:
            seed.backward()
        held = tensor_bytes(seed) + sum(tensor_bytes(t) for t in holder)
        left = meter.live_bytes - held - out_bytes * len(kept_output) - _grads_made(runs, grads_new)
        del seed, holder, kept_output
    # less the seed's own gradient (a scalar the engine makes first; a model's loss
    # gradient is counted with the loss)
    seed_grad = _scalar_bytes(grad_out) if backward else 0
    transient = max(0, meter.since_reset_peak_bytes - start - seed_grad)
    return _Step(transient, kept, left, forward_peak)


def _grads_made(runs: _Runs, grads_new: bool) -> int:
    """The bytes of the gradients a metered step made: the input's, and with ``grads_new``
    the parameters'."""
    leaf = runs.leaf
    made = 0 if leaf.grad is None else tensor_bytes(leaf.grad)
    if grads_new:
        made += sum(tensor_bytes(t.grad) for t in runs.wrt if t is not leaf and t.grad is not None)
    return made


class _Inner(torch.autograd.Function):
    """A copy of a block's input that is not a leaf (made before any meter starts); its
    backward hands the gradient through as it is (no copy)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return g


def inner_input(leaf: torch.Tensor) -> torch.Tensor | None:
    """What compress runs on for ``leaf`` (:attr:`_Runs.inner`): ``None`` for an input that
    needs no gradient (compress keeps it exact anyway)."""
    return _Inner.apply(leaf) if leaf.requires_grad and leaf.is_floating_point() else None


def compress_alone(runs: _Runs, mode: str, device: Any, out_bytes: int) -> tuple[int, int, bool]:
    """One metered forward of ``mode`` (compress) on a fresh non-leaf copy of the input, as a
    block's input inside a model: the bytes it keeps besides its output (the input's
    compressed copy included, or the input itself where it is kept exact: below
    ``min_numel``), its peak above its input, and whether it keeps the input exact."""
    leaf = runs.leaf
    if runs.inner is None:  # an input without grad: kept exact where saved, as the caller's
        kept, peak = _forward_alone(lambda: runs.forward(mode), device, out_bytes)
        return kept, peak, False
    block, store = runs.block, argument_of(mode)
    with MemoryMeter(device) as meter:
        x = inner_input(leaf)
        alive = StorageWeakRef(x.untyped_storage())
        y = compress_saved(block, x, store=store, **runs.kwargs)
        del x
    kept, exact = max(0, meter.end_bytes - out_bytes), not alive.expired()
    del y
    return kept, max(0, meter.peak_bytes - tensor_bytes(leaf)), exact


def activation(leaf: torch.Tensor) -> torch.Tensor:
    return leaf.view_as(leaf) if leaf.requires_grad else leaf


def _forward_alone(forward: Callable[[], Any], device: Any, out_bytes: int) -> tuple[int, int]:
    """One metered forward: the bytes it keeps besides its output, and its peak."""
    with MemoryMeter(device) as meter:
        y = forward()
    kept = max(0, meter.end_bytes - out_bytes)
    del y
    return kept, meter.peak_bytes
