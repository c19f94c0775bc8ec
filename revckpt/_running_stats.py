"""Normalisation layers' running statistics left untouched by a recompute: a forward run a
second time must not update them twice. Part of :mod:`revckpt.replay`, which re-exports
:func:`freeze_running_stats`."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase
from torch.utils._python_dispatch import _disable_current_modes

__all__ = ["freeze_called", "freeze_running_stats", "swapped_statistics"]

_RUNNING_STAT_BUFFERS = ("running_mean", "running_var", "num_batches_tracked")


def _swap_in_copies(module: nn.Module) -> dict[str, torch.Tensor | None]:
    originals = {n: module._buffers[n] for n in _RUNNING_STAT_BUFFERS if n in module._buffers}
    # The copies are bookkeeping, not part of the block: hide them from dispatch modes
    # (selective-checkpoint caches, value checks, memory meters) and from autograd.
    with _disable_current_modes(), torch.no_grad():
        for name, buf in originals.items():
            if buf is not None:
                module._buffers[name] = buf.clone()
    return originals


@contextlib.contextmanager
def swapped_statistics(modules: Iterable[nn.Module]) -> Iterator[None]:
    swapped = {}
    try:
        for m in modules:
            if (
                isinstance(m, _NormBase)
                and m.training
                and m.track_running_stats
                and m not in swapped
            ):
                swapped[m] = _swap_in_copies(m)
        yield
    finally:
        for m, originals in swapped.items():
            m._buffers.update(originals)


class _Frozen(threading.local):
    depth: int = 0


_frozen = _Frozen()


@contextlib.contextmanager
def freeze_running_stats(modules: Iterable[nn.Module] | None = None) -> Iterator[None]:
    """Within this context, normalisation modules in training mode do not change their statistics.

    Every ``torch.nn`` BatchNorm / SyncBatchNorm / InstanceNorm module with
    ``track_running_stats=True`` that is called in training mode on this thread gets throwaway
    copies of ``running_mean``, ``running_var`` and ``num_batches_tracked`` for the duration of its
    call; its output (which uses batch statistics in training mode) and the tensors it saves for
    backward are unchanged. The real buffers are restored when the call returns or raises.
    Nested uses share one table per thread (the hooks are installed by the outermost only), so a
    recompute inside a recompute restores the real buffers too.

    ``modules``: when given, exactly these modules are frozen for the whole context (their
    buffers swapped on entry, restored on exit) and no global hook is installed, which keeps
    module calls on PyTorch's fast path; pass every normalisation module the code can call.

    .. note:: Normalisation layers written from scratch (buffers updated by hand with
       ``F.batch_norm``) are not recognised; derive them from
       ``torch.nn.modules.batchnorm._NormBase``, check :func:`revckpt.replay.is_replaying` in
       their forward, or keep such blocks out of recompute.
    """
    if modules is not None:
        with swapped_statistics(modules):
            yield
        return
    with freeze_called(None):
        yield


@contextlib.contextmanager
def freeze_called(ran: list[nn.Module] | None) -> Iterator[bool]:
    """:func:`freeze_running_stats` for whatever normalisation module runs (global module
    hooks). ``ran``: gets every normalisation module called on this thread meanwhile (in any
    mode). Yields whether this context installed the hooks (``False`` inside another one,
    whose hooks do the work: then ``ran`` stays empty)."""
    state = _frozen
    if state.depth > 0:
        state.depth += 1
        try:
            yield False
        finally:
            state.depth -= 1
        return
    owner = threading.get_ident()
    swapped: dict[nn.Module, dict[str, torch.Tensor | None]] = {}

    def before(module: nn.Module, args: Any) -> None:
        if threading.get_ident() != owner or not isinstance(module, _NormBase):
            return
        if ran is not None:
            ran.append(module)
        if module.training and module.track_running_stats and module not in swapped:
            swapped[module] = _swap_in_copies(module)

    def restore(module: nn.Module) -> None:
        originals = swapped.pop(module, None)
        if originals is not None:
            module._buffers.update(originals)

    def after(module: nn.Module, args: Any, output: Any) -> None:
        if threading.get_ident() == owner:
            restore(module)

    pre = nn.modules.module.register_module_forward_pre_hook(before)
    post = nn.modules.module.register_module_forward_hook(after, always_call=True)
    state.depth = 1
    try:
        yield True
    finally:
        state.depth = 0
        pre.remove()
        post.remove()
        for module in list(swapped):
            restore(module)
