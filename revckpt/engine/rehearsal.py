"""Blocks run ahead of time as a recomputing strategy's first call of each, and that call's
recompute, would run them.

What revckpt learns about a block on its first captured forward and first recompute (its
modules' layout, whether its forward draws random numbers, which buffers it writes, which
normalisation layers its recompute calls: :func:`revckpt.replay.learnt`) costs time on those
calls: measured, a transformer block's first checkpointed call cost about 1.1x its later
calls' extra time, most of it the global module hooks that find the normalisation layers a
first recompute calls. A profiler timing one recomputed call per block times that learning
unless it was done before: :class:`Rehearsal` does it, in a forward the caller runs itself
with grad (a profiler's stored step: no forward of its own) and one replay of each block
right after it (a forward with grad, nothing kept).

It learns in a forward with grad, because a block may take another path without grad (a
normalisation layer or a buffer written only with grad: learnt from a no-grad pass, the
layer's statistics would then be updated twice per step, or the buffer's recompute would
raise). A buffer the captured forward registers is absent in its replay, as in any first
recompute (:mod:`revckpt._module_state`). A forward or replay that raises teaches nothing.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..replay import ForwardState, learnt
from .autograd import forward_as_plain

__all__ = ["Rehearsal"]


class Rehearsal:
    """The blocks of a step the caller runs, each captured where revckpt has not learnt it
    yet and replayed once right after its forward (:meth:`forward`), as a recompute would run
    it before the block's backward (so before anything the backward changes: an optimizer
    step fused into it, a buffer a gradient hook writes). Its forwards update running
    statistics and buffers as the caller's forwards do anyway; the replays leave them as they
    are."""

    def __init__(self, kwargs: dict[str, Any]) -> None:
        self._kwargs = kwargs

    def forward(self, block: nn.Module, x: torch.Tensor, label: str) -> _Captured:
        """The context to run ``block``'s forward on ``x`` in, with grad as the caller's step
        runs it: it captures before its body, and after it records what the forward left and
        replays it (nothing when the body raised), so a clock inside times the forward
        alone."""
        return _Captured(self._kwargs, block, x, label)


class _Captured:
    __slots__ = ("_block", "_kwargs", "_label", "_state", "_x")

    def __init__(self, kwargs: dict[str, Any], block: nn.Module, x: torch.Tensor, label: str):
        self._kwargs, self._block, self._x, self._label = kwargs, block, x, label
        self._state: ForwardState | None = None

    def __enter__(self) -> None:
        if not learnt(self._block):
            self._state = ForwardState.capture(
                (self._x,), self._kwargs, self._block, modules=(self._block,)
            )

    def __exit__(self, *exc: Any) -> None:
        state = self._state
        if state is None:
            return
        self._state = None
        state.forward_finished(completed=exc[0] is None)
        if exc[0] is not None:
            return
        x = self._x.detach().requires_grad_(self._x.is_floating_point())
        with state.replay(label=self._label), forward_as_plain():
            self._block(x, **self._kwargs)
