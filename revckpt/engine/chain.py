"""Chains of blocks run in segments, one recompute per segment (the ``checkpoint_sequential``
of checkpoint, approx and offload): the chain's checks and the segment callables."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ..errors import InvalidArgumentError, InvalidInputTypeError
from .node import Keep, run_node

__all__ = ["ModuleSegment", "Segment", "as_chain", "run_nodes"]


class Segment:
    """Runs ``blocks[start:stop]`` in order, passing keyword arguments to each block."""

    __slots__ = ("blocks",)

    def __init__(self, blocks: Sequence[Callable[..., Any]]) -> None:
        self.blocks = blocks

    def __call__(self, x: Any, **kwargs: Any) -> Any:
        for block in self.blocks:
            x = block(x, **kwargs)
        return x


class ModuleSegment(nn.Module):
    """A segment of module blocks as one module (parameter names ``blocks.<i>.<name>``), so a
    recompute can reparametrise it as a whole (parameters with hooks)."""

    def __init__(self, blocks: Sequence[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x: Any, **kwargs: Any) -> Any:
        for block in self.blocks:
            x = block(x, **kwargs)
        return x


def as_chain(blocks: Any, input: Any, *, what: str) -> list[Callable[..., Any]]:
    """The blocks of ``what(blocks, segments, input)`` as a list, checked (a chain of
    callables, ``input`` a tensor)."""
    if isinstance(blocks, nn.Module) and not isinstance(blocks, (nn.Sequential, nn.ModuleList)):
        raise InvalidInputTypeError(
            f"{what} needs a chain of blocks: an nn.Sequential, an nn.ModuleList or a list of "
            f"callables, got a single {type(blocks).__name__}; wrap it as nn.Sequential(...) "
            "or use revckpt.checkpoint(module, x)"
        )
    if isinstance(blocks, (str, bytes, torch.Tensor)) or not hasattr(blocks, "__iter__"):
        raise InvalidInputTypeError(
            f"{what} needs a chain of blocks (nn.Sequential, nn.ModuleList or a list of "
            f"callables), got {type(blocks).__name__}"
        )
    chain = list(blocks)
    if not chain:
        raise InvalidArgumentError(f"{what} got an empty chain; pass at least one block")
    for i, block in enumerate(chain):
        if not callable(block):
            raise InvalidInputTypeError(
                f"block {i} of the chain is a {type(block).__name__}, not a callable; every block "
                "must be an nn.Module or a function taking the previous block's output"
            )
    if not isinstance(input, torch.Tensor):
        raise InvalidInputTypeError(
            f"{what}(blocks, segments, input): input must be a torch.Tensor, got "
            f"{type(input).__name__}; pass other arguments as keywords (they reach every block)"
        )
    return chain


# The segments of a chain given as one module (nn.Sequential, nn.ModuleList), each built once
# per (start, stop) and reused while it holds the same blocks: a wrapper built per call would
# miss every per-module cache downstream (module layouts, whether a forward draws random
# numbers, the check for unregistered leaves). Held through the chain module, weakly keyed (its
# blocks do not refer back to it): dropping the chain drops its segments.
_SEGMENTS: weakref.WeakKeyDictionary[nn.Module, dict[tuple[int, int], ModuleSegment]] = (
    weakref.WeakKeyDictionary()
)


def _segment(
    chain: list[Callable[..., Any]], start: int, stop: int, source: object
) -> Callable[..., Any]:
    """``chain[start:stop]`` as one callable: a :class:`ModuleSegment` when its blocks are all
    modules (the one built for ``source``'s segment before, if its blocks are the same), else
    a :class:`Segment`."""
    part = chain[start:stop]
    if not all(isinstance(b, nn.Module) for b in part):
        return Segment(part)
    if not isinstance(source, nn.Module) or torch.compiler.is_compiling():
        return ModuleSegment(part)
    built = _SEGMENTS.setdefault(source, {})
    segment = built.get((start, stop))
    if segment is None or not _holds(segment, part):  # new, or a block replaced since
        segment = built[(start, stop)] = ModuleSegment(part)
    return segment


def _holds(segment: ModuleSegment, part: list[nn.Module]) -> bool:
    held = list(segment.blocks)
    return len(held) == len(part) and all(a is b for a, b in zip(held, part, strict=True))


def run_nodes(
    chain: list[Callable[..., Any]],
    bounds: list[tuple[int, int]],
    x: torch.Tensor,
    kwargs: dict[str, Any],
    *,
    keep: Keep,
    preserve_rng_state: bool,
    source: object = None,
) -> torch.Tensor:
    """Run each segment ``chain[start:stop]`` of ``bounds`` as one recompute node
    (:func:`~revckpt.engine.node.run_node`) keeping what ``keep`` keeps of its input.
    ``source``: what ``chain`` was made from (:func:`as_chain`'s ``blocks``); a module's
    segments are built once and reused across calls."""
    for start, stop in bounds:
        part = chain[start:stop]
        x = run_node(
            _segment(chain, start, stop, source),
            (x,),
            kwargs,
            keep=keep,
            modules=tuple(b for b in part if isinstance(b, nn.Module)),
            preserve_rng_state=preserve_rng_state,
            label=f"blocks[{start}:{stop}]",
        )
        if stop < len(chain) and not isinstance(x, torch.Tensor):
            raise InvalidInputTypeError(
                f"blocks[{start}:{stop}] returned {type(x).__name__}, but the next block takes "
                "one tensor: every block of a chain but the last must return a tensor"
            )
    return x
