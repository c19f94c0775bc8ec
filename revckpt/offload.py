"""Host offload: a checkpoint whose kept block input lives in host memory, not on the device.

``revckpt.checkpoint(fn, x, strategy="offload")`` runs ``fn(x)`` keeping none of its
activations, like a plain checkpoint, and moves ``x`` itself to host memory; backward copies it
back and re-runs ``fn``::

    forward:   y = fn(x);  x -> host (pinned buffer, copy on a side stream)
    backward:  x' = host -> device;  y' = fn(x');  dx, dtheta = VJP of y' with the incoming dy

``revckpt.checkpoint_sequential(blocks, segments, x, strategy="offload")`` offloads every
segment's input and, in backward, starts copying
segment ``p - 1``'s input back while segment ``p`` runs its backward (prefetch one segment
ahead, on the side stream), so the copies overlap compute. Device memory held between forward
and backward for an offloaded boundary: **zero** bytes; host memory: the boundary. While
segment ``p`` runs its backward the device holds its own input and the prefetched input of
segment ``p - 1``. Extra time: one forward of each segment, plus a device-to-host and a
host-to-device copy of each boundary (overlapped with compute on CUDA). Gradients are bitwise
those of :func:`revckpt.checkpoint` (the values copied back are the values copied out), but for
tensors used by several operations of one node (keyword tensors that require grad, parameters
tied across a segment's blocks): equal to round-off (the node sums the contributions of their
uses before autograd adds them to the rest).

**Only activations move.** The tensors autograd keeps for the offloaded node are its positional
tensor arguments (the block input) and its keyword tensors. Keyword tensors (masks, positions,
typically shared by every block and held by the caller), parameters (``nn.Parameter``) and
other leaf tensors (a data batch, a tensor that requires grad: the caller holds them, so
moving them would free nothing) stay where they are: never copied. Activations made inside the
model (non-leaf tensors) move. ``torch.autograd.graph.save_on_cpu`` and torch's
``offload_wrapper``, by contrast, move every tensor autograd saves, weights included.
:func:`record` counts what moved and what stayed.

On a machine without an accelerator host memory *is* device memory: tensors already on the
host are kept as they are (no copy) and offloading saves nothing over a checkpoint; the
scheduler measures this (``schedule.profile(..., offload=True)``). :func:`force_copies` makes
the copies anyway (to see what would move, or to test the copy path).

A tensor kept for backward must not change in place before the backward: like autograd,
offload raises :class:`~revckpt.errors.ModifiedInputError` in backward when a tensor kept in
place changed, or when the tensor a host copy was made from is still alive and changed. A
tensor changed and then dropped is not seen (its copy, made when the block ran, is used). The
node is differentiable once (``create_graph=True`` through it raises), as an approx node is.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from . import _host_copies
from ._deprecation import warn_deprecated
from ._host_copies import FORCED as _FORCED  # noqa: F401  (tests and tools append to it)
from ._host_copies import LOCK, RECORDERS, HostHooks
from .checkpoint import segment_bounds
from .engine.autograd import grad_transform_active, label_of, refuse_grad_transform
from .engine.chain import as_chain, run_nodes
from .engine.node import EXACT, run_node
from .errors import InvalidArgumentError, InvalidInputTypeError

__all__ = [
    "Offload",
    "OffloadStats",
    "checkpoint",
    "checkpoint_sequential",
    "force_copies",
    "record",
]


@contextmanager
def force_copies(*, simulate_device: bool = False) -> Iterator[None]:
    """Inside the block, offload copies tensors that are already in host memory too: on a
    machine without an accelerator, to see with :func:`record` what would move on one, or to
    test the copy and prefetch path. It saves no memory there (host memory is device memory).

    ``simulate_device=True`` keeps the host copies as NumPy arrays, outside torch's allocator,
    so that :class:`~revckpt.MemoryMeter` counts what a device would hold (a copy back
    allocates, a copy out releases): a preview of device memory on a machine without a
    device. The RAM used is the same; only the accounting differs. Process-wide while active
    (blocks in several threads may overlap: copies are forced until the last one ends).
    """
    if not isinstance(simulate_device, bool):
        raise InvalidArgumentError(
            f"simulate_device= must be True or False, got {simulate_device!r}"
        )
    entry = [simulate_device]  # a list: told apart by identity when removed
    forced = _host_copies.FORCED  # read where the copies read it
    with LOCK:
        forced.append(entry)
    try:
        yield
    finally:
        with LOCK:
            del forced[next(i for i, e in enumerate(forced) if e is entry)]


@dataclass(eq=False)  # recorders are told apart by identity
class OffloadStats:
    """What :func:`record` saw, counted once per block that moved or kept a tensor (a mask
    passed to 8 blocks counts 8 times)."""

    #: Tensors copied to host memory in forward.
    to_host_tensors: int = 0
    #: Their bytes.
    to_host_bytes: int = 0
    #: Tensors copied back to the device in backward.
    to_device_tensors: int = 0
    #: Their bytes.
    to_device_bytes: int = 0
    #: Copies back that were ready before the backward needed them.
    prefetched: int = 0
    #: Tensors kept in place, per reason: ``"parameter"``, ``"leaf tensor"``,
    #: ``"keyword argument"``, ``"already on the host"``.
    kept_in_place: dict[str, int] = field(default_factory=dict)
    #: Their bytes, per reason.
    kept_in_place_bytes: dict[str, int] = field(default_factory=dict)

    def _kept(self, reason: str, nbytes: int) -> None:
        self.kept_in_place[reason] = self.kept_in_place.get(reason, 0) + 1
        self.kept_in_place_bytes[reason] = self.kept_in_place_bytes.get(reason, 0) + nbytes


# Process-wide, not per thread: on CUDA the backward (and so the copies back) runs on
# autograd's device threads, not the thread that entered ``record()``.


@contextmanager
def record() -> Iterator[OffloadStats]:
    """Count what offloading moves inside the block (forward and backward)::

        with revckpt.offload.record() as stats:
            loss = model(x).sum(); loss.backward()
        assert stats.to_host_bytes == ...   # the boundaries, never a parameter

    Recorders are process-wide: offloading in other threads meanwhile is counted too.
    """
    stats = OffloadStats()
    with LOCK:
        RECORDERS.append(stats)
    try:
        yield stats
    finally:
        with LOCK:
            RECORDERS.remove(stats)


@dataclass(frozen=True)
class Offload:
    """The offload strategy's options, for ``revckpt.checkpoint(..., strategy=Offload(...))`` and
    ``revckpt.checkpoint_sequential(..., strategy=Offload(...))`` (``strategy="offload"`` is
    ``Offload()``).

    Args:
        pin_memory: keep the host copies in pinned memory on CUDA (``False``: pageable memory,
            less pinned RAM, slower and synchronous copies).
        prefetch: in :func:`revckpt.checkpoint_sequential`, copy segment ``p - 1``'s input back
            while segment ``p`` runs its backward (``False``: each copy back starts when its
            segment's backward does). A single checkpointed block has nothing to prefetch.
    """

    pin_memory: bool = True
    prefetch: bool = True

    def __post_init__(self) -> None:
        for name in ("pin_memory", "prefetch"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise InvalidArgumentError(f"{name}= must be True or False, got {value!r}")


def _checkpoint(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    config: Offload,
    preserve_rng_state: bool,
) -> Any:
    """``fn(*args, **kwargs)`` as one recompute node whose kept positional tensors live in host
    memory: what ``revckpt.checkpoint(fn, *args, strategy=config)`` runs (``fn`` checked)."""
    if not torch.is_grad_enabled() and grad_transform_active():
        return fn(*args, **kwargs)  # nothing to keep, and torch refuses the hooks there
    refuse_grad_transform(label_of(fn), "offload")
    hooks = HostHooks(kwargs.values(), pin_memory=config.pin_memory, prefetch=False)
    with hooks.hooks():
        return run_node(
            fn,
            args,
            kwargs,
            keep=EXACT,
            preserve_rng_state=preserve_rng_state,
            label=f"offloaded {label_of(fn)}",
        )


def _run_sequential(
    chain: list[Callable[..., Any]],
    bounds: list[tuple[int, int]],
    input: torch.Tensor,
    kwargs: dict[str, Any],
    *,
    config: Offload,
    preserve_rng_state: bool,
    source: object = None,
) -> torch.Tensor:
    """A checked chain run in segments ``bounds``, each segment's input kept in host memory:
    what ``revckpt.checkpoint_sequential(..., strategy=config)`` runs (``source``: as in
    :func:`~revckpt.engine.chain.run_nodes`)."""
    plain = not torch.is_grad_enabled() and grad_transform_active()
    if not plain:
        refuse_grad_transform(f"a chain of {len(chain)} offloaded blocks", "offload")
    hooks = HostHooks(kwargs.values(), pin_memory=config.pin_memory, prefetch=config.prefetch)
    with contextlib.nullcontext() if plain else hooks.hooks():
        return run_nodes(
            chain,
            bounds,
            input,
            kwargs,
            keep=EXACT,
            preserve_rng_state=preserve_rng_state,
            source=source,
        )


def checkpoint(
    fn: Callable[..., Any],
    *args: Any,
    pin_memory: bool = True,
    preserve_rng_state: bool = True,
    **kwargs: Any,
) -> Any:
    """Deprecated: ``revckpt.checkpoint(fn, *args, strategy=Offload(pin_memory=...))``.

    Runs ``fn(*args, **kwargs)`` keeping only its positional tensor arguments, in host memory.
    Device memory held until backward: none for the offloaded arguments (see the module
    docstring for what stays in place). Host memory: their bytes, in a pinned buffer on CUDA
    (``pin_memory=False`` for pageable memory). Extra work: one forward of ``fn`` in backward,
    one copy out and one back. RNG, autocast and BatchNorm statistics are replayed as for every
    recompute (:mod:`revckpt.replay`).
    """
    warn_deprecated(
        "revckpt.offload.checkpoint(fn, *args, pin_memory=...)",
        "revckpt.checkpoint(fn, *args, strategy=revckpt.offload.Offload(pin_memory=...))",
    )
    if not callable(fn):
        raise InvalidInputTypeError(
            f"offload.checkpoint(fn, *args): fn must be callable, got {type(fn).__name__}"
        )
    config = Offload(pin_memory=pin_memory)
    return _checkpoint(fn, args, kwargs, config=config, preserve_rng_state=preserve_rng_state)


def checkpoint_sequential(
    blocks: nn.Sequential | Sequence[Callable[..., Any]],
    segments: int | str | Sequence[int],
    input: torch.Tensor,
    *,
    pin_memory: bool = True,
    prefetch: bool = True,
    preserve_rng_state: bool = True,
    **kwargs: Any,
) -> torch.Tensor:
    """Deprecated: ``revckpt.checkpoint_sequential(blocks, segments, input,
    strategy=Offload(pin_memory=..., prefetch=...))``.

    Runs a chain of blocks in segments, each segment's input kept in host memory (see
    :class:`Offload` for the options). ``**kwargs`` reach every block and stay on the device.
    """
    warn_deprecated(
        "revckpt.offload.checkpoint_sequential(blocks, segments, input, pin_memory=..., "
        "prefetch=...)",
        "revckpt.checkpoint_sequential(blocks, segments, input, "
        "strategy=revckpt.offload.Offload(pin_memory=..., prefetch=...))",
    )
    chain = as_chain(blocks, input, what="offload.checkpoint_sequential")
    config = Offload(pin_memory=pin_memory, prefetch=prefetch)
    bounds = segment_bounds(len(chain), segments)
    return _run_sequential(
        chain,
        bounds,
        input,
        kwargs,
        config=config,
        preserve_rng_state=preserve_rng_state,
        source=blocks,
    )
