"""The outputs a selective policy keeps, guarded against in-place changes torch does not see.

torch's selective checkpoint caches the outputs its policy keeps and, when a recompute reads
one, compares its version counter with the one it cached: a change in place through the tensor
or a view of it raises there (revckpt names the operation: :class:`~.frame.FrameCall`). A
change through an alias with a version counter of its own goes unseen, and the recompute reads
the changed value: a bias-free ``nn.Linear`` on a 3-D input computes ``mm`` and returns
``_unsafe_view`` of it, so ``y = lin(x); y.add_(1)`` inside a block kept by ``"matmul"`` gave
wrong gradients silently (torch's own selective checkpoint too).

:func:`guard` wraps the forward's policy: at every operation that writes into a tensor (its
schema marks the argument written), the kept outputs whose memory it overlaps get their version
counter bumped (``torch.autograd.graph.increment_version``), so that torch's check raises where
the recompute reads them, and only there, as for a change through the tensor itself. Writes into
tensors nothing kept overlaps cost a lookup of the operation's schema (cached per operation).
A change made after the block returned, through an output of the block that is such an alias
(the block ends with that ``Linear``, and its caller adds into the output in place), is caught
by :func:`watch`: such outputs are held as views (their memory is the kept output's, held
anyway) with their versions, and :func:`bump_if_changed`, at the start of the recompute, bumps
the kept output under any that changed. Under ``torch.compile`` (fake tensors) nothing is
checked.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

__all__ = ["bump_if_changed", "guard", "watch"]

_PLAIN = (torch.Tensor, torch.nn.Parameter)


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


def _extent(t: torch.Tensor) -> tuple[int, int, int]:
    """``t``'s memory: its storage's address and the byte range its elements span."""
    size = t.element_size()
    start = t.storage_offset() * size
    span = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    return t.untyped_storage().data_ptr(), start, start + span * size


def _overlaps(a: tuple[int, int, int], b: tuple[int, int, int]) -> bool:
    return a[0] == b[0] and a[1] < b[2] and b[1] < a[2]


def _kept(storage: Any) -> Iterator[torch.Tensor]:
    """The tensors torch's selective cache holds (its values: per operation, a list or a dict of
    entries, each a tree of wrappers whose ``val`` is the kept output)."""
    for entries in storage.values():
        for entry in entries.values() if isinstance(entries, dict) else entries:
            for leaf in tree_leaves(entry):
                val = getattr(leaf, "val", None)
                if type(val) in _PLAIN and val.numel():
                    yield val


def _written_tensors(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    out = []
    for i, name in _written(func):
        value = args[i] if i < len(args) else kwargs.get(name)
        out.extend(t for t in tree_leaves(value) if type(t) in _PLAIN and t.numel())
    return out


def guard(mode: Any) -> None:
    """Wrap ``mode``'s policy (torch's caching dispatch mode of a selective checkpoint's
    forward) so that a write into the memory of an output it kept bumps that output's version
    (see the module docstring). A mode without the attributes this reads is left as it is."""
    policy = getattr(mode, "policy_fn", None)
    storage = getattr(mode, "storage", None)
    if not callable(policy) or not isinstance(storage, dict):
        return
    mode.policy_fn = _guarded(policy, storage)


def _guarded(policy: Callable[..., Any], storage: dict[Any, Any]) -> Callable[..., Any]:
    def policy_fn(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        if _written(func) and not getattr(ctx, "is_recompute", False):
            _bump_overwritten(func, args, kwargs, storage)
        return policy(ctx, func, *args, **kwargs)

    return policy_fn


def _bump_overwritten(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], storage: dict[Any, Any]
) -> None:
    if torch.compiler.is_compiling():
        return
    written = [_extent(t) for t in _written_tensors(func, args, kwargs)]
    if not written:
        return
    _bump(storage, written)


def _bump(storage: Any, written: list[tuple[int, int, int]]) -> None:
    """Bump the version of every kept output whose memory overlaps one of ``written``."""
    for val in _kept(storage):
        mine = _extent(val)
        if any(_overlaps(mine, w) for w in written):
            torch.autograd.graph.increment_version(val)


Watched = list[tuple[torch.Tensor, int]]


def watch(mode: Any, out: Any) -> Watched:
    """The outputs of a selective block (``out``, any structure) whose memory overlaps an output
    ``mode`` (the forward's caching mode) kept, as views, with their versions."""
    storage = getattr(mode, "storage", None)
    if not isinstance(storage, dict) or torch.compiler.is_compiling():
        return []
    outs = [t for t in tree_leaves(out) if type(t) in _PLAIN and t.numel()]
    if not outs:
        return []
    kept = [_extent(v) for v in _kept(storage)]
    return [(t.view_as(t), t._version) for t in outs if any(_overlaps(_extent(t), k) for k in kept)]


def bump_if_changed(mode: Any, watched: Watched) -> None:
    """Before a recompute reads ``mode``'s cache: bump the kept outputs under every watched
    output changed since the forward (see :func:`watch`)."""
    changed = [_extent(t) for t, version in watched if t._version != version]
    if changed:
        _bump(mode.storage, changed)
