"""Tensors moved to host memory and back: the saved-tensor hooks of an offloaded recompute
node (:mod:`revckpt.offload`), the copies (side stream and pinned buffers on CUDA, plain or
NumPy copies on the host when copies are forced) and the counts :func:`revckpt.offload.record`
reports."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from ._numbers import tensor_bytes
from .errors import InvalidArgumentError, ModifiedInputError

__all__ = ["FORCED", "LOCK", "RECORDERS", "HostHooks"]


# The force_copies blocks in force, process-wide (entered and left in any order by any thread):
# while one is, host tensors are copied too (host == device then, so copying saves nothing,
# but the path is otherwise the one an accelerator takes); the latest says whether to simulate.
FORCED: list[list[bool]] = []


def _copying() -> bool:
    return bool(FORCED)


def _simulating() -> bool:
    forced = FORCED[-1:]
    return bool(forced) and forced[0][0]


# Process-wide, not per thread: on CUDA the backward (and so the copies back) runs on
# autograd's device threads, not the thread that entered ``record()``. The entries are
# revckpt.offload.OffloadStats.
RECORDERS: list[Any] = []
LOCK = threading.Lock()


def _count(field: str, amount: int = 1) -> None:
    if not RECORDERS:  # nothing to count into (and no lock to take inside a compiled graph)
        return
    with LOCK:
        for stats in RECORDERS:
            setattr(stats, field, getattr(stats, field) + amount)


def _kept(reason: str, t: torch.Tensor) -> None:
    if not RECORDERS:
        return
    nbytes = tensor_bytes(t)
    with LOCK:
        for stats in RECORDERS:
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
        # detached: a saved output held with its own grad_fn is a reference cycle through
        # autograd that Python's collector cannot see (a graph dropped without backward
        # would leak); the version counter is shared
        self.tensor = t.detach()
        self.version = t._version


_side_streams: dict[tuple[str, int], Any] = {}


def _side_stream(device: torch.device) -> Any:
    key = (device.type, device.index if device.index is not None else 0)
    with LOCK:
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
        self.nbytes = tensor_bytes(t)
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


class HostHooks:
    """The saved-tensor hooks of one offloaded call (or chain of segments): which tensors move
    to host memory, in what order (the last one offloaded is prefetched when the next is taken)."""

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
