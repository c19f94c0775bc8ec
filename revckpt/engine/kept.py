"""The outputs a selective policy keeps, guarded against in-place changes torch does not see.

torch's selective checkpoint caches the outputs its policy keeps and, when a recompute reads
one, compares its version counter with the one it cached: a change in place through the tensor
or a view of it raises there (revckpt names the operation: :class:`~.frame.FrameCall`). A
change through an alias with a version counter of its own went unseen, and the recompute read
the changed value: a bias-free ``nn.Linear`` on a 3-D input computes ``mm`` and returns
``_unsafe_view`` of it, so ``y = lin(x); y.add_(1)`` inside a block kept by ``"matmul"`` gave
wrong gradients silently (torch's own selective checkpoint too).

:func:`guard` wraps the forward's policy, which torch calls for every operation. It indexes the
memory of each output the policy keeps by storage address (from the operation's output, where
torch hands it to the policy), notes the operations that read a kept output's memory, and at an
operation that writes into it (its schema marks the argument written) bumps the kept output's
version counter (``torch.autograd.graph.increment_version``), so that torch's check raises where
the recompute reads it, and only there, as for a change through the tensor itself. Two kinds of
write are let through, because the recompute then computes exactly what the forward did:

* writes of metadata only (``unsqueeze_``, ``t_``, ``as_strided_``, ...);
* the first write into a kept output that nothing has read yet, by an operation that gives the
  same result when applied again (``masked_fill_``, ``fill_``, ``relu_``, ``clamp_``, ...): the
  recompute reads the written value and writes it once more. Attention scores masked in place
  (``scores = q @ k.transpose(-1, -2); scores.masked_fill_(mask, -inf)``, as in Hugging Face's
  XLM and Flaubert) stay exact and run.

An operation's output that aliases a kept output (the block ends with such a ``Linear`` and its
caller adds into the output in place) is held by :func:`watch` as a view (its memory is the kept
output's, held anyway) with its version; :func:`bump_if_changed`, at the start of the
recompute, bumps the kept output under any that changed. Under ``torch.compile`` (fake tensors)
nothing is checked; sparse and nested tensors are not looked at.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

__all__ = ["KeptGuard", "Watched", "bump_if_changed", "guard", "watch"]

_PLAIN = (torch.Tensor, torch.nn.Parameter)
_aten = torch.ops.aten
# writes that change no element: the recompute makes the same metadata change again
_METADATA_ONLY = {
    _aten.as_strided_, _aten.resize_, _aten.squeeze_, _aten.unsqueeze_, _aten.t_,
    _aten.transpose_, _aten.swapdims_, _aten.swapaxes_, _aten.detach_, _aten.set_,
}  # fmt: skip
# f(f(x)) == f(x) elementwise, given the same other operands
_IDEMPOTENT = {
    _aten.masked_fill_, _aten.fill_, _aten.zero_, _aten.relu_, _aten.clamp_,
    _aten.clamp_min_, _aten.clamp_max_, _aten.hardtanh_, _aten.threshold_, _aten.index_fill_,
}  # fmt: skip
# operations that make an alias without reading an element
_NOT_READS = {_aten._unsafe_view, _aten.alias, _aten.detach}

Extent = tuple[int, int, int]  # storage address, first byte, end byte


@functools.lru_cache(maxsize=4096)
def _written(func: Any) -> tuple[tuple[int, str], ...]:
    """The (position, name) of each argument ``func`` writes into; none for most operations."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return ()
    return tuple(
        (i, a.name)
        for i, a in enumerate(schema.arguments)
        if a.alias_info is not None and a.alias_info.is_write
    )


@functools.lru_cache(maxsize=4096)
def _reads(func: Any) -> bool:
    """Whether ``func`` may read the elements of its tensor arguments (a view does not)."""
    packet = getattr(func, "overloadpacket", None)
    return packet not in _NOT_READS and not getattr(func, "is_view", False)


def _strided(t: Any) -> bool:
    return type(t) in _PLAIN and t.layout == torch.strided and not t.is_nested and t.numel() > 0


def _extent(t: torch.Tensor) -> Extent:
    """``t``'s memory: its storage's address and the byte range its elements span."""
    size = t.element_size()
    start = t.storage_offset() * size
    span = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    return t.untyped_storage().data_ptr(), start, start + span * size


def _overlaps(a: Extent, b: Extent) -> bool:
    return a[0] == b[0] and a[1] < b[2] and b[1] < a[2]


@dataclass
class _Entry:
    """One kept output's memory, and what the forward has done with it since."""

    extent: Extent
    read: bool = False
    written: bool = False  # by an idempotent first write


class KeptGuard:
    """The wrapped policy of one selective forward (see the module docstring)."""

    def __init__(self, policy: Callable[..., Any], storage: dict[Any, Any]) -> None:
        self.policy = policy
        self.storage = storage
        self.by_storage: dict[int, list[_Entry]] = {}
        self.indexed = True  # torch hands the policy the operation's output (else: scans)

    def __call__(self, ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        verdict = self.policy(ctx, func, *args, **kwargs)
        if getattr(ctx, "is_recompute", False) or torch.compiler.is_compiling():
            return verdict
        if self.by_storage or not self.indexed:
            self._see(func, args, kwargs)
        if verdict in _SAVED:
            self._index(ctx)
        return verdict

    def _index(self, ctx: Any) -> None:
        if not hasattr(ctx, "op_output"):
            self.indexed = False  # an older torch: every write scans the cache
            return
        for t in tree_leaves(ctx.op_output):
            if _strided(t):
                e = _Entry(_extent(t))
                self.by_storage.setdefault(e.extent[0], []).append(e)

    def entries(self, t: torch.Tensor) -> list[_Entry]:
        """The kept outputs whose memory ``t``'s overlaps."""
        found = self.by_storage.get(t.untyped_storage().data_ptr())
        if not found:
            return []
        mine = _extent(t)
        return [e for e in found if _overlaps(e.extent, mine)]

    def _see(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        written = _written_tensors(func, args, kwargs)
        if written and func.overloadpacket not in _METADATA_ONLY:
            if not self.indexed:
                self.bump([_extent(t) for t in written])
                return
            for t in written:
                for e in self.entries(t):
                    self._write(e, func)
        if _reads(func):
            mine = {id(t) for t in written}
            for t in tree_leaves((args, kwargs)):
                if _strided(t) and id(t) not in mine:
                    for e in self.entries(t):
                        e.read = True

    def _write(self, e: _Entry, func: Any) -> None:
        if not e.read and not e.written and func.overloadpacket in _IDEMPOTENT:
            e.written = True  # the recompute reads the written value and writes it again
            return
        self.bump([e.extent])

    def bump(self, written: list[Extent]) -> None:
        """Bump the version of every kept output whose memory overlaps one of ``written``."""
        for val in _kept(self.storage):
            mine = _extent(val)
            if any(_overlaps(mine, w) for w in written):
                torch.autograd.graph.increment_version(val)


_SAVED = {
    torch.utils.checkpoint.CheckpointPolicy.MUST_SAVE,
    torch.utils.checkpoint.CheckpointPolicy.PREFER_SAVE,
    True,
}


def _kept(storage: Any) -> Iterator[torch.Tensor]:
    """The tensors torch's selective cache holds (its values: per operation, a list or a dict of
    entries, each a tree of wrappers whose ``val`` is the kept output)."""
    for entries in storage.values():
        for entry in entries.values() if isinstance(entries, dict) else entries:
            for leaf in tree_leaves(entry):
                val = getattr(leaf, "val", None)
                if _strided(val):
                    yield val


def _written_tensors(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    out = []
    for i, name in _written(func):
        value = args[i] if i < len(args) else kwargs.get(name)
        out.extend(t for t in tree_leaves(value) if _strided(t))
    return out


def guard(mode: Any) -> KeptGuard | None:
    """Wrap ``mode``'s policy (torch's caching dispatch mode of a selective checkpoint's
    forward) in a :class:`KeptGuard` (see the module docstring); ``None`` for a mode without the
    attributes this reads, left as it is."""
    policy = getattr(mode, "policy_fn", None)
    storage = getattr(mode, "storage", None)
    if not callable(policy) or not isinstance(storage, dict):
        return None
    mode.policy_fn = KeptGuard(policy, storage)
    return mode.policy_fn


Watched = list[tuple[torch.Tensor, int]]


def watch(kept: KeptGuard | None, out: Any) -> Watched:
    """The outputs of a selective block (``out``, any structure) whose memory overlaps an output
    its policy kept, as views, with their versions."""
    if kept is None or not kept.by_storage or torch.compiler.is_compiling():
        return []
    outs = [t for t in tree_leaves(out) if _strided(t)]
    return [(t.view_as(t), t._version) for t in outs if kept.entries(t)]


def bump_if_changed(kept: KeptGuard | None, watched: Watched) -> None:
    """Before a recompute reads the cache: bump the kept outputs under every watched output
    changed since the forward (see :func:`watch`)."""
    changed = [_extent(t) for t, version in watched if t._version != version]
    if kept is not None and changed:
        kept.bump(changed)
