"""Op-level choices inside one block: which intermediate results a selective recompute keeps.

A selective policy (:func:`revckpt.checkpoint.parse_policy`) keeps the outputs of the aten
operations it names and recomputes every other operation of the block during backward.
:func:`op_costs` runs a block's forward under a dispatch mode and a saved-tensor hook and
prices each aten operation (overload packet); :func:`op_choices` turns that into a few nested
keep-sets, from plain checkpoint towards store, for the scheduler to choose one per block.

For a keep-set ``K``, with ``O(K)`` the storages of the outputs of every call of an operation
in ``K`` that the forward allocated (parameters, buffers and the block's arguments are alive
anyway) and ``y`` the block output's storage::

    kept_bytes(K)  = sum over s in O(K) - {y} of bytes(s)  +  replay state (the RNG, if the
                     block draws random numbers)
    recompute_s(K) = sum of the forward times of the calls of the operations not in K

The outputs an operation produces are what later operations save for backward (torch's
selective checkpoint keeps a kept operation's *output*), so the storages autograd saves are
attributed to the operation that allocated them. ``recompute_s`` is an upper bound: the
recompute stops after the last tensor backward needs.

Operations a policy must not keep are left out of the choices: random ones (a kept one would
not draw again in the recompute and later dropout masks would differ), and those whose outputs
are modified in place later in the forward (torch's cache refuses a kept tensor that changed).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..checkpoint import POLICY_PRESETS, parse_policy, policy_text
from ..errors import InvalidArgumentError, InvalidInputTypeError, RevckptError
from .op_record import RecordedForward, _Call, _key, record_forward

__all__ = ["OpChoice", "OpCost", "op_choices", "op_costs"]

RANDOM = "draws random numbers"
MUTATED = "its output changes in place after it returns (an in-place op, or one later on)"
NOT_A_TOKEN = "not an aten operation a policy spec can name"

# A prefix of the ranking is merged into the next one when that adds less than this fraction
# of its bytes (the next keeps nearly as little and recomputes less).
_MERGE_FRACTION = 0.05
# The groups of POLICY_PRESETS a spec names whole (disjoint), e.g. "matmul".
_GROUPS = {name: ops for name, ops in POLICY_PRESETS.items() if "+" not in name}


@dataclass(frozen=True)
class OpCost:
    """One aten operation (overload packet) of a block's forward.

    ``op``: its packet name (a policy token); ``calls``: how often the forward calls it;
    ``forward_s``: its calls' summed time (median over repeats); ``kept_bytes``: what a policy
    keeping it keeps (its outputs' storages that the forward allocated, the block output
    excepted); ``saved_bytes``: the bytes of the storages it allocated that autograd saves for
    backward (the block output included): ``0`` means keeping it saves no recompute of saved
    tensors; ``keeps_output``: one of its outputs is (a view of) the block output;
    ``excluded``: why a policy must not keep it (``None``: it may).
    """

    op: str
    calls: int
    forward_s: float
    kept_bytes: int
    saved_bytes: int
    keeps_output: bool
    excluded: str | None


@dataclass(frozen=True)
class OpChoice:
    """One keep-set of a block: ``spec`` (canonical, valid for ``Strategy("selective", spec)``
    and ``checkpoint(..., strategy=f"selective:{spec}")``), the estimated ``kept_bytes``
    (beyond the block's input and output, replay state included) and ``recompute_s`` (the
    forward time of the operations it does not keep), and ``keeps_output``: whether it keeps
    the block output (the scheduler's ``SelectiveCost.output_kept``)."""

    spec: str
    kept_bytes: int
    recompute_s: float
    keeps_output: bool

    @property
    def strategy(self) -> str:
        """The strategy's text form, ``"selective:<spec>"``."""
        return f"selective:{self.spec}"


# op_costs' arguments of the wrong type, each with what to pass instead
_ARGUMENT_TYPES = (
    ("block", nn.Module, "op_costs(block, x) needs an nn.Module block, got {}"),
    (
        "x",
        torch.Tensor,
        "op_costs(block, x): x must be the block's input tensor, got {}; "
        "pass other arguments as kwargs={{...}}",
    ),
    (
        "kwargs",
        (dict, type(None)),
        "kwargs must be a dict of the block's keyword arguments, got {}",
    ),
)


def _check_block(block: Any, x: Any, kwargs: dict[str, Any] | None, repeats: int) -> None:
    given = {"block": block, "x": x, "kwargs": kwargs}
    for name, expected, message in _ARGUMENT_TYPES:
        if not isinstance(given[name], expected):
            raise InvalidInputTypeError(message.format(type(given[name]).__name__))
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise InvalidArgumentError(f"repeats={repeats!r}: pass an int >= 1 (timed forwards)")


def _token_ok(packet: Any) -> bool:
    try:
        return parse_policy(packet.__name__) == {packet}
    except RevckptError:
        return False


@dataclass(frozen=True)
class _Analysis:
    costs: list[OpCost]
    storages: dict[str, frozenset[int]]  # op name -> the storages keeping it keeps
    sizes: dict[int, int]
    packets: dict[str, Any]
    replay_bytes: int
    store_bytes: int  # what a stored forward keeps beyond its arguments and output


def _analyse(
    block: nn.Module, x: torch.Tensor, kwargs: dict[str, Any] | None, repeats: int
) -> _Analysis:
    _check_block(block, x, kwargs, repeats)
    forward = record_forward(block, x, dict(kwargs or {}), repeats)
    out = forward.output
    allocated = {k for call in forward.calls for k in call.new}
    sizes: dict[int, int] = {}
    by_op: dict[str, list[_Call]] = defaultdict(list)
    packets: dict[str, Any] = {}
    for call in forward.calls:
        name = call.packet.__name__
        by_op[name].append(call)
        packets.setdefault(name, call.packet)
        for t in call.outputs:
            sizes.setdefault(_key(t), t.untyped_storage().nbytes())
    costs, storages = [], {}
    for name, calls in by_op.items():
        storages[name] = frozenset(
            k for c in calls for t in c.outputs if (k := _key(t)) in allocated and k != out
        )
        costs.append(_op_cost(name, calls, packets[name], storages[name], sizes, forward))
    store = sum(sizes[k] for k in forward.saved & allocated if k != out)
    return _Analysis(costs, storages, sizes, packets, forward.replay_bytes, store)


def _op_cost(
    name: str,
    calls: list[_Call],
    packet: Any,
    kept: frozenset[int],
    sizes: dict[int, int],
    forward: RecordedForward,
) -> OpCost:
    """The :class:`OpCost` of the operation ``name`` (its ``calls``, keeping ``kept``)."""
    excluded: str | None = None
    if any(c.drew for c in calls):
        excluded = RANDOM
    elif not _token_ok(packet):
        excluded = RANDOM if _random_packet(packet) else NOT_A_TOKEN
    elif any(c.mutated() for c in calls):
        excluded = MUTATED
    out = forward.output
    return OpCost(
        op=name,
        calls=len(calls),
        forward_s=statistics.median(t.get(packet, 0.0) for t in forward.timings),
        kept_bytes=sum(sizes[k] for k in kept),
        saved_bytes=sum(sizes[k] for c in calls for k in c.new if k in forward.saved),
        keeps_output=any(_key(t) == out for c in calls for t in c.outputs),
        excluded=excluded,
    )


def _random_packet(packet: Any) -> bool:
    return any(
        torch.Tag.nondeterministic_seeded in getattr(packet, o).tags for o in packet.overloads()
    )


def op_costs(
    block: nn.Module,
    x: torch.Tensor,
    *,
    kwargs: dict[str, Any] | None = None,
    repeats: int = 3,
) -> list[OpCost]:
    """What keeping each aten operation of ``block(x, **kwargs)`` would cost and save.

    Runs the forward ``repeats`` times (with autograd, as in training; the first run also
    records outputs and saved tensors) and returns one :class:`OpCost` per operation packet, in
    the order of their first call. The block's buffers (BatchNorm statistics) and the global
    RNG are left as they were.
    """
    return _analyse(block, x, kwargs, repeats).costs


def _ranking(costs: list[OpCost]) -> list[OpCost]:
    """The operations worth keeping, most recompute seconds per byte kept first (ties: fewer
    bytes, then name)."""
    useful = [c for c in costs if c.saved_bytes > 0 and c.excluded is None]

    def key(c: OpCost) -> tuple[float, int, str]:
        per_byte = c.forward_s / c.kept_bytes if c.kept_bytes else float("inf")
        return (-per_byte, c.kept_bytes, c.op)

    return sorted(useful, key=key)


def _widened(names: set[str], packets: dict[str, Any]) -> frozenset[Any]:
    """The keep-set's packets, plus the rest of each group of which it keeps every member the
    block calls (the others never run here), so that specs read ``"matmul"``, not ``"addmm"``."""
    keep = {packets[n] for n in names}
    called = set(packets.values())
    for group in _GROUPS.values():
        if keep & group and (called & group) <= keep:
            keep |= group
    return frozenset(keep)


def _spread(items: list[Any], most: int) -> list[Any]:
    """At most ``most`` of ``items``, evenly spread, the first and the last included."""
    if len(items) <= most:
        return items
    if most == 1:
        return [items[-1]]
    picks = sorted({round(i * (len(items) - 1) / (most - 1)) for i in range(most)})
    return [items[i] for i in picks]


def op_choices(
    block: nn.Module,
    x: torch.Tensor,
    *,
    kwargs: dict[str, Any] | None = None,
    max_choices: int = 4,
    repeats: int = 3,
) -> list[OpChoice]:
    """A few nested keep-sets for ``block(x, **kwargs)``, in increasing estimated bytes.

    The operations that allocate something autograd saves (and that a policy may keep, see
    the module docstring) are ranked by recompute seconds per byte kept, most first (matrix
    multiplies and attention before norms, activations and pointwise work); each prefix of the
    ranking is a keep-set. A prefix is merged into the next when that adds less than 5% of its
    bytes. The empty set (plain checkpoint) is left out, and so is the full set when it covers
    every operation whose outputs autograd saves, and any set keeping as many bytes as a stored
    forward (store keeps that without recomputing anything). At most
    ``max_choices`` remain, spread over the range (the smallest and the largest kept).
    ``repeats``: timed forwards (:func:`op_costs`).
    """
    if isinstance(max_choices, bool) or not isinstance(max_choices, int) or max_choices < 1:
        raise InvalidArgumentError(f"max_choices={max_choices!r}: pass an int >= 1")
    analysis = _analyse(block, x, kwargs, repeats)
    ranked = _ranking(analysis.costs)
    total_s = sum(c.forward_s for c in analysis.costs)
    prefixes: list[tuple[set[str], int]] = []
    kept: set[int] = set()
    for i, cost in enumerate(ranked):
        kept |= analysis.storages[cost.op]
        prefixes.append(({c.op for c in ranked[: i + 1]}, sum(analysis.sizes[k] for k in kept)))
    merged: list[tuple[set[str], int]] = []
    anchor = -1
    for names, size in prefixes:
        if merged and size <= anchor * (1 + _MERGE_FRACTION):
            merged[-1] = (names, size)
        else:
            merged.append((names, size))
            anchor = size
    if merged and all(c.excluded is None for c in analysis.costs if c.saved_bytes > 0):
        merged.pop()  # keeps whatever autograd saves: store does that without recomputing
    by_name = {c.op: c for c in analysis.costs}
    choices = [
        OpChoice(
            spec=policy_text(_widened(names, analysis.packets)),
            kept_bytes=size + analysis.replay_bytes,
            recompute_s=max(0.0, total_s - sum(by_name[n].forward_s for n in names)),
            keeps_output=any(by_name[n].keeps_output for n in names),
        )
        for names, size in merged
    ]
    # a keep-set holding as much as store (outputs nothing saves) is worse than store
    choices = [c for c in choices if c.kept_bytes < analysis.store_bytes]
    return _spread(choices, max_choices)
