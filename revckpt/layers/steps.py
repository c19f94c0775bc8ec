"""A stack's half steps, built once per layout, and one forward call driven block by block.

:class:`HalfSteps` lists the half steps of a stack of :class:`~revckpt.layers.ReversibleBlock`
in forward order (which stream each one updates from which, where the anchors are), and
:class:`StackRun` applies them for one forward call with the graph: ``block(i)`` runs block
``i``'s half steps, ``finish()`` seeds the backward walk with the stack's output. A
:class:`~revckpt.layers.ReversibleSequential` runs every block in one call; a model converted
in place (:func:`revckpt.make_reversible`) runs block ``i`` when the model's own loop calls
its layer ``i``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..engine.autograd import refuse_forward_ad
from .rebuild import FORWARD_AD_WAY_OUT, HalfStep, HalfStepNode, OutputNode, StackCall, Targets

__all__ = ["HalfSteps", "StackRun"]


class HalfSteps:
    """The half steps of a stack's blocks, in forward order, per block the indices of its
    steps, and which stream is the first and which the second output: built once, valid
    while the stack has the same blocks, branches, couplings and ``anchor_every``."""

    __slots__ = ("anchor_every", "blocks", "by_block", "first_anchor", "ids", "steps")

    def __init__(
        self, blocks: tuple[nn.Module, ...], anchor_every: int | None, first_anchor: int = 0
    ) -> None:
        self.blocks = blocks
        self.anchor_every = anchor_every
        self.first_anchor = first_anchor
        self.steps: list[HalfStep] = []
        self.by_block: list[range] = []
        ids = (0, 1)  # which stream is the block's first and second input
        for i, block in enumerate(blocks):
            start = len(self.steps)
            anchored = (
                anchor_every is not None
                and i >= first_anchor
                and (i - first_anchor) % anchor_every == 0
            )
            first, second = ids
            self.steps.append(
                HalfStep(
                    block, "f", i, first, second, 2 if anchored else 0, block.f, block.coupling
                )
            )
            if block.g is None:
                ids = (second, first)
            else:
                self.steps.append(
                    HalfStep(
                        block,
                        "g",
                        i,
                        second,
                        first,
                        1 if anchored else 0,
                        block.g,
                        block.g_coupling,
                    )
                )
                if block.swap:
                    ids = (second, first)
            self.by_block.append(range(start, len(self.steps)))
        self.ids = ids

    def current(
        self, blocks: tuple[nn.Module, ...], anchor_every: int | None, first_anchor: int = 0
    ) -> bool:
        return (
            blocks == self.blocks
            and anchor_every == self.anchor_every
            and first_anchor == self.first_anchor
            and all(step.current() for step in self.steps)
        )


class StackRun:
    """One forward call of a stack with the graph. ``streams``: the current value of each
    stream (the block inputs at first); ``targets``: per half step, its branch's trainable
    parameters and normalisation layers (looked up for this call)."""

    def __init__(
        self,
        plan: HalfSteps,
        call: StackCall,
        targets: list[Targets],
        x1: torch.Tensor,
        x2: torch.Tensor,
        kw_tensors: list[torch.Tensor],
    ) -> None:
        self.plan, self.call, self.targets = plan, call, targets
        branches = (m for step in plan.steps for m in step.branch.modules())  # read lazily
        refuse_forward_ad(
            "a reversible stack", "reversible", (x1, x2, *kw_tensors), branches,
            way_out=FORWARD_AD_WAY_OUT,
        )  # fmt: skip
        self.streams = [x1, x2]
        self.kw_tensors = kw_tensors
        # Every half step joins the graph (even one whose inputs and registered parameters
        # need no gradient), so that its backward runs and can check what its branch used.
        self.token = torch.empty(0, requires_grad=True)

    def block(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Run block ``i``'s half steps; its outputs ``(y1, y2)`` in the block's order."""
        streams, steps = self.streams, self.plan.steps
        for s in self.plan.by_block[i]:
            step, found = steps[s], self.targets[s]
            a, u = streams[step.target], streams[step.other]
            streams[step.target] = HalfStepNode.apply(
                self.call, step, found, a, u, self.token, *found[0], *self.kw_tensors
            )
        nxt = self._ids_after(i)
        return streams[nxt[0]], streams[nxt[1]]

    def _ids_after(self, i: int) -> tuple[int, int]:
        """Which streams block ``i + 1`` takes as its first and second input."""
        if i + 1 < len(self.plan.by_block):
            first = self.plan.steps[self.plan.by_block[i + 1][0]]
            return first.target, first.other
        return self.plan.ids

    def finish(self, dim: int | None) -> Any:
        """The stack's output through the node that keeps it and seeds the backward walk:
        a tuple ``(y1, y2)`` (``dim=None``) or the two concatenated along ``dim``."""
        first, second = self.plan.ids
        return OutputNode.apply(
            self.call, self.plan.ids, dim, self.streams[first], self.streams[second]
        )
