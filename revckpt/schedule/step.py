"""What a whole training step does outside the chain of blocks, for the cost model.

A user's step runs more than the blocks: the embedding before them, the head, the loss and
their backward after them, and it allocates the parameter gradients. :class:`StepCosts` holds
those figures, measured in situ by :func:`revckpt.fit` around the user's own step with every
block stored (see :mod:`revckpt.inplace.trace`); with them,
:func:`~revckpt.schedule.evaluate` predicts the peak of the **whole step**::

    peak = max(before, held + chain, held + kept + head, after + late)

``chain``: the chain's own peak (the cost model of :mod:`~revckpt.schedule.costs`, its
backward with ``backward_held`` in place of the chain output and loss); ``kept``: what the
plan keeps at the end of the chain's forward; ``late``: what the plan keeps from each
segment's backward to the end of the step (replay state and, when the step creates them,
the parameter gradients).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import InvalidArgumentError

__all__ = ["StepCosts"]


@dataclass(frozen=True)
class StepCosts:
    """Bytes of the step outside the chain, relative to what was alive when the step began.

    ``before_peak``: the peak before the first block starts (embedding, masks, rotary tables).
    ``held``: what is alive outside the chain from the first block's start to the end of the
    chain's backward (everything the step made before the chain, less the chain input, which
    the chain's cost model counts). ``head``: the peak after the last block's forward and
    before the chain's backward, above what the chain keeps (the chain output, the head, the
    loss, their backward, the head's parameter gradients). ``backward_held``: what is alive
    outside the chain during its backward (the head's gradients, the loss, outputs the caller
    holds), in place of the chain output and the loss of the chain-only model. ``after``: the
    peak after the chain's backward, above what the chain keeps to the end of the step
    (``late``). ``chained``: every block's input is the output of the block before it, so a
    checkpoint segment may span several blocks (its recompute re-runs them in order), at most
    ``max_span`` (``None``: any number). ``chain_share``: the chain's share of the stored
    step's wall time (its forward and its backward, read at the same marks in the metered
    step), which turns the chain's predicted seconds into a share of the whole step (1.0: the
    chain is the step)."""

    before_peak: int
    held: int
    head: int
    backward_held: int
    after: int
    chained: bool = True
    max_span: int | None = None
    chain_share: float = 1.0

    def __post_init__(self) -> None:
        if not 0.0 < self.chain_share <= 1.0:
            raise InvalidArgumentError(
                f"chain_share={self.chain_share!r}: the chain's share of the step's time is in "
                "(0, 1]"
            )
