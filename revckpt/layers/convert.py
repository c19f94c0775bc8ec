"""Swap-in: turn residual stacks of an existing model into reversible stacks.

A residual layer ``x -> x + F(x) -> (.) + G(.)`` (a pre-norm transformer layer: ``F`` = norm +
attention, ``G`` = norm + MLP) becomes a reversible block ``y1 = x1 + F(x2)``,
``y2 = x2 + G(y1)`` built from the *same* branch modules, sharing their parameters. The stack
enters two streams by duplicating its input and leaves them by averaging.

.. warning:: This changes the architecture: the converted stack computes a different function
   from the original with the same weights (each branch sees the other stream, not the running
   sum). Convert before training from scratch, or fine-tune after converting; do not expect a
   converted pretrained model to give the same outputs. ``tests/layers/test_convert.py`` measures
   how far outputs move on a small transformer at initialisation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import nn

from ..errors import InvalidArgumentError, InvalidInputTypeError
from .blocks import EnterStreams, LeaveStreams
from .coupling import _split_dim
from .sequential import ReversibleBlock, ReversibleSequential

__all__ = ["ReversibleStack", "convert_to_reversible"]

Branches = tuple[str, str] | Callable[[nn.Module], tuple[nn.Module, nn.Module]]


class ReversibleStack(nn.Module):
    """``leave(ReversibleSequential(enter(x)))``: a reversible stack with one tensor in and out."""

    def __init__(
        self,
        rev: ReversibleSequential,
        *,
        enter: Literal["duplicate", "split"] = "duplicate",
        leave: Literal["average", "concat"] = "average",
        split_dim: int = -1,
        dim: int | None = None,
    ) -> None:
        super().__init__()
        split_dim = _split_dim(split_dim, dim, "ReversibleStack(rev, dim=...)", -1, depth=2)
        self.enter = EnterStreams(enter, split_dim=split_dim)
        self.rev = rev
        self.leave = LeaveStreams(leave, split_dim=split_dim)

    def forward(self, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        return self.leave(self.rev(self.enter(x), **kwargs))


def _branches_of(layer: nn.Module, branches: Branches, fqn: str) -> tuple[nn.Module, nn.Module]:
    if callable(branches):
        pair = branches(layer)
    else:
        missing = [n for n in branches if not isinstance(getattr(layer, n, None), nn.Module)]
        if missing:
            raise InvalidArgumentError(
                f"layer {fqn!r} ({type(layer).__name__}) has no submodule named {missing[0]!r}; "
                "pass branches=(name_f, name_g) naming its two residual branches, or a function "
                "layer -> (f, g)"
            )
        pair = tuple(getattr(layer, n) for n in branches)
    if (
        not isinstance(pair, tuple)
        or len(pair) != 2
        or not all(isinstance(m, nn.Module) for m in pair)
    ):
        raise InvalidInputTypeError(
            f"branches({type(layer).__name__}) must return two nn.Modules (f, g), got {pair!r}"
        )
    return pair


def _convert_stack(
    stack: nn.Sequential, fqn: str, branches: Branches, options: dict[str, Any]
) -> ReversibleStack:
    if len(stack) == 0:
        raise InvalidArgumentError(f"{fqn or 'the module'} is an empty stack: nothing to convert")
    blocks = [
        ReversibleBlock(*_branches_of(layer, branches, f"{fqn}.{i}" if fqn else str(i)))
        for i, layer in enumerate(stack)
    ]
    enter = options.pop("enter", "duplicate")
    leave = options.pop("leave", "average")
    split_dim = options.get("split_dim", -1)
    return ReversibleStack(
        ReversibleSequential(*blocks, **options), enter=enter, leave=leave, split_dim=split_dim
    )


def convert_to_reversible(
    module: nn.Module,
    *,
    branches: Branches,
    module_filter_fn: Callable[[nn.Module, str], bool] | None = None,
    enter: Literal["duplicate", "split"] = "duplicate",
    leave: Literal["average", "concat"] = "average",
    **options: Any,
) -> nn.Module:
    """Replace residual ``nn.Sequential`` stacks with reversible stacks sharing their branches.

    Args:
        module: an ``nn.Sequential`` of residual layers (converted and returned), or a model whose
            ``nn.Sequential`` children are converted in place (the model is returned).
        branches: the two residual branches of each layer: names of its submodules, e.g.
            ``("attn", "mlp")``, or a function ``layer -> (f, g)`` (e.g. to put each layer's
            norm in front: ``lambda l: (nn.Sequential(l.ln1, l.attn), nn.Sequential(l.ln2,
            l.mlp))``).
        module_filter_fn: ``(stack, fqn) -> bool`` choosing which ``nn.Sequential`` stacks to
            convert (default: every one reached from ``module``; the walk does not enter
            converted stacks).
        enter, leave: how the stack's tensor enters and leaves the two streams (see
            :class:`~revckpt.layers.EnterStreams`, :class:`~revckpt.layers.LeaveStreams`).
        **options: passed to :class:`~revckpt.layers.ReversibleSequential` (``anchor_every``,
            ``check_inverse``, ...).

    A stack held in an ``nn.ModuleList`` is iterated by the model's own forward and cannot be
    replaced by one module: wrap it as ``nn.Sequential`` first (or convert it and call the
    result yourself).
    """
    if not isinstance(module, nn.Module):
        raise InvalidInputTypeError(f"module must be an nn.Module, got {type(module).__name__}")
    opts = dict(options, enter=enter, leave=leave)
    if isinstance(module, nn.Sequential) and (
        module_filter_fn is None or module_filter_fn(module, "")
    ):
        return _convert_stack(module, "", branches, dict(opts))
    converted = 0

    def walk(parent: nn.Module, prefix: str) -> None:
        nonlocal converted
        for name, child in list(parent.named_children()):
            fqn = f"{prefix}.{name}" if prefix else name
            if isinstance(child, nn.Sequential) and (
                module_filter_fn is None or module_filter_fn(child, fqn)
            ):
                setattr(parent, name, _convert_stack(child, fqn, branches, dict(opts)))
                converted += 1
            else:
                walk(child, fqn)

    walk(module, "")
    if converted == 0:
        raise InvalidArgumentError(
            f"no nn.Sequential stack to convert in {type(module).__name__}"
            + (" (module_filter_fn rejected them all)" if module_filter_fn else "")
            + "; residual layers must sit in an nn.Sequential (wrap an nn.ModuleList as "
            "nn.Sequential(*layers))"
        )
    return module
