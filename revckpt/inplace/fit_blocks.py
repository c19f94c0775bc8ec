"""Which blocks :func:`revckpt.fit` plans, as the traced step shows: the refusals of the
trace that call for fitting again on other blocks, and the guard on the blocks left out.

* Blocks whose output needs no gradient in the step (frozen, on inputs that need none) keep
  nothing for backward: fit plans the others (``left_out``) and installs the left-out ones
  stored, refused in training once what they return needs a gradient.
* A layer's experts (blocks that do not chain, or that the example ran other than once): the
  layers around them (``blocks``).
* Where the default rule took several classes of blocks (an encoder-decoder's stacks) and the
  step refuses them, or the first class's blocks do not chain: the first class alone
  (``one_class``), with a :class:`~revckpt.PlanWarning` naming the blocks left out.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from ..errors import InvalidArgumentError, InvalidInputTypeError, PlanWarning
from .blocks import Blocks, enclosing_blocks, find_blocks
from .fit_checks import caller_level
from .install import Planned, install
from .runners import runner_for
from .trace import CallCountError, OffGraphError, Recorder, trace

__all__ = ["guard_left_out", "traced_or_again"]


def guard_left_out(left: list[tuple[str, nn.Module]]) -> None:
    """The blocks left out of the plan, stored, refused if their output comes to need a
    gradient (their activations are not in the plan's budget)."""
    for fqn, block in left:
        install(block, Planned(fqn, "store", runner_for("store"), off_graph=True))


def traced_or_again(
    model: nn.Module,
    example: Any,
    o: Any,
    found: list[tuple[str, nn.Module]],
    slot: Callable[[Recorder | None], None],
    priced: bool,
    seed: int | None,
) -> Any:
    """The traced step, or the options to fit again with where other blocks are to be
    planned: those on the backward's path (``left_out``: the frozen ones off it); a layer's
    experts' layers (``blocks``); one class of blocks (``one_class``) where the default rule
    took several and the step refuses one of them (a tower run before the one listed first,
    layers called with no hidden state, interleaved lists)."""
    several = (
        o.blocks is None
        and o.plan is None
        and not o.one_class
        and len({type(b) for _, b in found}) > 1
    )
    try:
        traced = trace(
            model, example, o.loss_fn, found, slot, gradients=priced, reference_seed=seed,
            on_graph=o.plan is None,
        )  # fmt: skip
    except OffGraphError as err:
        if not err.on_graph:
            raise
        return {"left_out": o.left_out | ({fqn for fqn, _ in found} - set(err.on_graph))}
    except CallCountError as err:
        # experts the example routed no token to (or several times): the layers, if any;
        # blocks of a class other than the first run in a loop: the first class; else
        # (LayerDrop, a block of the first class run twice) the caller's to fix
        outer = enclosing_blocks(model, found) if o.blocks is None else None
        if outer is not None:
            return {"blocks": _named(outer)}
        if several and err.shared and not set(err.shared) & _first_class(model):
            return _first_class_only(model, found, err)
        raise
    except (InvalidArgumentError, InvalidInputTypeError) as err:
        if several:
            return _first_class_only(model, found, err)
        raise
    if several and _parallel(model, found, traced):  # experts among them: as one class
        return {"one_class": True}  # (their layers are planned: nothing is left out)
    outer = _around_parallel(model, found, traced.links) if o.blocks is None else None
    return {"blocks": _named(outer)} if outer is not None else traced


def _first_class_only(
    model: nn.Module, found: list[tuple[str, nn.Module]], err: Exception
) -> dict[str, Any]:
    """Fit again on the default rule's first class of blocks, saying which were left out and
    why (the step refused the blocks of several classes)."""
    first = _first_class(model)
    left = [fqn for fqn, _ in found if fqn not in first]
    warnings.warn(
        f"revckpt.fit: planning {len(first)} blocks of one class and not {', '.join(left[:3])}"
        f"{', ...' if len(left) > 3 else ''}, whose step refused a plan over both ({err}); "
        "name the blocks with blocks=... to plan others",
        PlanWarning,
        stacklevel=caller_level(),
    )
    return {"one_class": True}


def _parallel(model: nn.Module, found: list[tuple[str, nn.Module]], traced: Any) -> bool:
    """Whether most blocks of the default rule's first class do not chain (a layer's experts),
    among blocks of several classes (a dense stack beside them would outvote them)."""
    first = _first_class(model)
    names = [c.fqn for c in traced.calls]
    pairs = [
        link
        for a, b, link in zip(names, names[1:], traced.links, strict=False)
        if a in first and b in first
    ]
    return bool(pairs) and 2 * sum(pairs) < len(pairs)


def _first_class(model: nn.Module) -> set[str]:
    """The names of the default rule's first class of blocks."""
    return {fqn for fqn, _ in find_blocks(model, one_class=True)}


def _named(blocks: list[tuple[str, nn.Module]]) -> Blocks:
    names = {fqn for fqn, _ in blocks}
    return lambda _m, fqn: fqn in names


def _around_parallel(
    model: nn.Module, found: list[tuple[str, nn.Module]], links: Sequence[bool]
) -> list[tuple[str, nn.Module]] | None:
    """The repeated blocks around ``found`` where most found blocks' inputs were not made from
    the one before's output (``links``, per pair of calls; parallel branches, as a hand-written
    mixture of experts' experts: each gets the tokens routed to it, a number the plan cannot
    hold to; only the first expert of each layer is made from the layer before), or
    ``None``."""
    if not links or 2 * sum(links) >= len(links):
        return None
    return enclosing_blocks(model, found)
