"""Host offload: a checkpoint whose kept block input lives in host memory, not on the device.

``offload.checkpoint(fn, x)`` runs ``fn(x)`` keeping none of its activations, like
:func:`revckpt.checkpoint`, and moves ``x`` itself to host memory; backward copies it back and
re-runs ``fn``::

    forward:   y = fn(x);  x -> host (pinned buffer, copy on a side stream)
    backward:  x' = host -> device;  y' = fn(x');  dx, dtheta = VJP of y' with the incoming dy

:func:`checkpoint_sequential` offloads every segment's input and, in backward, starts copying
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

import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .approx.recompute import Approx, run_approx
from .checkpoint import _approx_sequential, _as_blocks, segment_bounds
from .errors import InvalidArgumentError, InvalidInputTypeError, ModifiedInputError

__all__ = ["OffloadStats", "checkpoint", "checkpoint_sequential", "force_copies", "record"]

_EXACT = Approx(store=None)

# The force_copies blocks in force, process-wide (entered and left in any order by any thread):
# while one is, host tensors are copied too (host == device then, so copying saves nothing,
# but the path is otherwise the one an accelerator takes); the latest says whether to simulate.
_FORCED: list[list[bool]] = []


def _copying() -> bool:
    return bool(_FORCED)


def _simulating() -> bool:
    forced = _FORCED[-1:]
    return bool(forced) and forced[0][0]


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
    with _lock:
        _FORCED.append(entry)
    try:
        yield
    finally:
        with _lock:
            del _FORCED[next(i for i, e in enumerate(_FORCED) if e is entry)]


@dataclass(eq=False)  # recorders are told apart by identity
class OffloadStats:
    """What :func:`record` saw: tensors and bytes moved to host memory and back, prefetches
    that were ready before the backward needed them, and the tensors kept in place, per
    reason (``"parameter"``, ``"leaf tensor"``, ``"keyword argument"``,
    ``"already on the host"``): counts and bytes, once per block that kept them (a mask passed
    to 8 blocks counts 8 times)."""

    to_host_tensors: int = 0
    to_host_bytes: int = 0
    to_device_tensors: int = 0
    to_device_bytes: int = 0
    prefetched: int = 0
    kept_in_place: dict[str, int] = field(default_factory=dict)
    kept_in_place_bytes: dict[str, int] = field(default_factory=dict)

    def _kept(self, reason: str, nbytes: int) -> None:
        self.kept_in_place[reason] = self.kept_in_place.get(reason, 0) + 1
        self.kept_in_place_bytes[reason] = self.kept_in_place_bytes.get(reason, 0) + nbytes


# Process-wide, not per thread: on CUDA the backward (and so the copies back) runs on
# autograd's device threads, not the thread that entered ``record()``.
_recorders: list[OffloadStats] = []
_lock = threading.Lock()


@contextmanager
def record() -> Iterator[OffloadStats]:
    """Count what offloading moves inside the block (forward and backward)::

        with revckpt.offload.record() as stats:
            loss = model(x).sum(); loss.backward()
        assert stats.to_host_bytes == ...   # the boundaries, never a parameter

    Recorders are process-wide: offloading in other threads meanwhile is counted too.
    """
    stats = OffloadStats()
    with _lock:
        _recorders.append(stats)
    try:
        yield stats
    finally:
        with _lock:
            _recorders.remove(stats)


def _count(field: str, amount: int = 1) -> None:
    if not _recorders:  # nothing to count into (and no lock to take inside a compiled graph)
        return
    with _lock:
        for stats in _recorders:
            setattr(stats, field, getattr(stats, field) + amount)


def _kept(reason: str, t: torch.Tensor) -> None:
    if not _recorders:
        return
    nbytes = t.numel() * t.element_size()
    with _lock:
        for stats in _recorders:
            stats._kept(reason, nbytes)


def _check_version(t: torch.Tensor, version: int) -> None:
    if t._version != version:
        raise ModifiedInputError(
            f"a tensor of shape {tuple(t.shape)} kept for the backward of an offloaded block "
            f"was modified in place after the block ran (version {version} then, "
            f"{t._version} now), so its gradients would be wrong; clone it before modifying "
            "it (x = x.clone()), or modify a copy"
        )


class _InPlace:
    """A tensor kept where it is, with its version when the block ran (checked in backward:
    saved-tensor hooks bypass autograd's own check)."""

    __slots__ = ("tensor", "version")

    def __init__(self, t: torch.Tensor) -> None:
        self.tensor = t
        self.version = t._version


_side_streams: dict[tuple[str, int], Any] = {}


def _side_stream(device: torch.device) -> Any:
    key = (device.type, device.index if device.index is not None else 0)
    with _lock:
        stream = _side_streams.get(key)
        if stream is None:
            stream = _side_streams[key] = torch.cuda.Stream(device=device)
    return stream


def _host_copy(t: torch.Tensor) -> Any:
    """A host copy of a host tensor (the copy path forced on a machine without accelerator):
    a tensor, or its bytes in a NumPy array when simulating a device (see force_copies)."""
    if _simulating():
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().copy()
        return raw, t.dtype, tuple(t.shape)
    return t.detach().clone(memory_format=torch.preserve_format)


def _device_copy(host: Any, device: torch.device) -> torch.Tensor:
    """Its copy back (same path)."""
    if isinstance(host, tuple):
        raw, dtype, shape = host
        return torch.from_numpy(raw.copy()).view(dtype).reshape(shape)
    return host.clone(memory_format=torch.preserve_format)


class _Offloaded:
    """One tensor in host memory, its copy back (when prefetched), and the tensor offloaded
    just before it in the same chain (the one to prefetch when this one is taken).

    CUDA: the copy out runs on a side stream after the compute stream's work so far;
    ``record_stream`` stops the allocator from handing the device memory to a later
    allocation before the copy is done, and the compute stream waits for the *previous*
    tensor's copy out before it goes on, so the forward runs at most one copy ahead (device
    memory released but not yet reusable: one boundary at most). The copy back is allocated
    from the compute stream's pool (no second pool grows), made on the side stream once the
    compute stream's work so far is done, and waited for by the compute stream when taken.
    """

    __slots__ = (
        "__weakref__",
        "copied",
        "device",
        "host",
        "nbytes",
        "on_device",
        "pin",
        "prefetch",
        "previous",
        "ready",
        "source",
        "version",
    )

    def __init__(
        self, t: torch.Tensor, pin: bool, prefetch: bool, previous: _Offloaded | None
    ) -> None:
        self.device = t.device
        self.pin = pin
        self.prefetch = prefetch
        self.previous = weakref.ref(previous) if previous is not None else None
        self.on_device: torch.Tensor | None = None
        self.ready: Any = None
        self.copied: Any = None
        self.nbytes = t.numel() * t.element_size()
        self.source = weakref.ref(t)  # to check, if it is still alive, that it did not change
        self.version = t._version
        if t.device.type == "cuda":
            current = torch.cuda.current_stream(t.device)
            if previous is not None and previous.copied is not None:
                current.wait_event(previous.copied)  # at most one copy out in flight
            self.host = torch.empty_like(t, device="cpu", pin_memory=pin)
            side = _side_stream(t.device)
            side.wait_stream(current)  # t is written
            with torch.cuda.stream(side):
                self.host.copy_(t.detach(), non_blocking=pin)
                self.copied = torch.cuda.Event()
                self.copied.record(side)
            t.record_stream(side)  # its memory is not reused before the copy is done
        else:
            self.host = _host_copy(t)
        _count("to_host_tensors")
        _count("to_host_bytes", self.nbytes)

    def fetch(self) -> None:
        """Start the copy back to the device (on the side stream on CUDA); no-op if started."""
        if self.on_device is not None:
            return
        if self.device.type == "cuda":
            current = torch.cuda.current_stream(self.device)
            side = _side_stream(self.device)
            on_device = torch.empty_like(self.host, device=self.device)  # compute stream's pool
            side.wait_stream(current)  # the memory's earlier users on the compute stream
            with torch.cuda.stream(side):
                on_device.copy_(self.host, non_blocking=self.pin)
                self.ready = torch.cuda.Event()
                self.ready.record(side)
            on_device.record_stream(side)
            self.on_device = on_device
        else:
            self.on_device = _device_copy(self.host, self.device)
        _count("to_device_tensors")
        _count("to_device_bytes", self.nbytes)

    def take(self) -> torch.Tensor:
        """The tensor on its device, for the backward that needs it now; then prefetch the
        one offloaded before it. The host copy stays (a second backward may need it)."""
        source = self.source()
        if source is not None:
            _check_version(source, self.version)
        if self.on_device is None:
            self.fetch()
        else:
            _count("prefetched")
        t = self.on_device
        assert t is not None
        self.on_device = None
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).wait_event(self.ready)
            self.ready = None
        previous = self.previous() if self.previous is not None else None
        if self.prefetch and previous is not None:
            previous.fetch()
        return t


class _Chain:
    """The saved-tensor hooks of one offloaded call: which tensors move, in what order."""

    def __init__(self, keep: Sequence[Any], *, pin_memory: bool, prefetch: bool) -> None:
        self.keep = {id(t) for t in keep if isinstance(t, torch.Tensor)}
        self.pin_memory = pin_memory
        self.prefetch = prefetch
        self.last: Callable[[], _Offloaded | None] = lambda: None

    def pack(self, t: torch.Tensor) -> Any:
        reason = None
        if id(t) in self.keep:
            reason = "keyword argument"
        elif isinstance(t, nn.Parameter):
            reason = "parameter"
        elif t.is_leaf:
            reason = "leaf tensor"  # held by the caller (data, or for its .grad)
        elif t.device.type == "cpu" and not _copying():
            reason = "already on the host"
        if reason is not None:
            _kept(reason, t)
            return _InPlace(t)
        if t.device.type not in ("cpu", "cuda"):
            raise InvalidArgumentError(
                f"offload supports CUDA and CPU tensors, got one on {t.device}; use "
                "revckpt.checkpoint for this device"
            )
        pin = self.pin_memory and t.device.type == "cuda"
        handle = _Offloaded(t, pin, self.prefetch, self.last())
        self.last = weakref.ref(handle)
        return handle

    @staticmethod
    def unpack(packed: Any) -> torch.Tensor:
        if isinstance(packed, _Offloaded):
            return packed.take()
        _check_version(packed.tensor, packed.version)
        return packed.tensor

    @contextmanager
    def hooks(self) -> Iterator[None]:
        with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
            yield


def _check(pin_memory: bool, prefetch: bool) -> None:
    for name, value in (("pin_memory", pin_memory), ("prefetch", prefetch)):
        if not isinstance(value, bool):
            raise InvalidArgumentError(f"{name}= must be True or False, got {value!r}")


def checkpoint(
    fn: Callable[..., Any],
    *args: Any,
    pin_memory: bool = True,
    preserve_rng_state: bool = True,
    **kwargs: Any,
) -> Any:
    """Run ``fn(*args, **kwargs)`` keeping only its positional tensor arguments, in host memory.

    Device memory held until backward: none for the offloaded arguments (see the module
    docstring for what stays in place). Host memory: their bytes, in a pinned buffer on CUDA
    (``pin_memory=False`` for pageable memory: less pinned RAM, slower and synchronous copies).
    Extra work: one forward of ``fn`` in backward, one copy out and one back. RNG, autocast and
    BatchNorm statistics are replayed as for every recompute (:mod:`revckpt.replay`).
    """
    if not callable(fn):
        raise InvalidInputTypeError(
            f"offload.checkpoint(fn, *args): fn must be callable, got {type(fn).__name__}"
        )
    _check(pin_memory, True)
    chain = _Chain(kwargs.values(), pin_memory=pin_memory, prefetch=False)
    with chain.hooks():
        return run_approx(
            fn,
            args,
            kwargs,
            config=_EXACT,
            preserve_rng_state=preserve_rng_state,
            label=f"offloaded {getattr(fn, '__qualname__', type(fn).__name__)}",
        )


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
    """Run a chain of blocks in segments, each segment's input kept in host memory.

    ``segments`` as in :func:`revckpt.checkpoint_sequential` (``len(blocks)`` for one block per
    segment, the usual choice: the device then holds no boundary at all). With ``prefetch``,
    backward copies segment ``p - 1``'s input back while segment ``p`` runs its backward, so
    the device holds at most two boundaries at a time during backward; without it each copy
    back starts when its segment's backward does. ``**kwargs`` reach every block and stay on
    the device. Gradients are bitwise those of ``revckpt.checkpoint_sequential`` (keyword
    tensors that require grad: to round-off, see the module docstring).
    """
    chain = _as_blocks(blocks)
    if not isinstance(input, torch.Tensor):
        raise InvalidInputTypeError(
            f"offload.checkpoint_sequential(blocks, segments, input): input must be a "
            f"torch.Tensor, got {type(input).__name__}; pass other arguments as keywords"
        )
    _check(pin_memory, prefetch)
    bounds = segment_bounds(len(chain), segments)
    hooks = _Chain(kwargs.values(), pin_memory=pin_memory, prefetch=prefetch)
    with hooks.hooks():
        return _approx_sequential(chain, bounds, input, kwargs, _EXACT, preserve_rng_state)
