"""Measured tensor memory: peak and retained bytes of a block of code.

On CUDA the figures come from the caching allocator's statistics
(``torch.cuda.memory_allocated`` / ``max_memory_allocated``). On CPU, where PyTorch keeps no
statistics, :class:`MemoryMeter` tracks every tensor storage created inside the block: a
``TorchDispatchMode`` sees each operation's outputs, records each *new* storage once with its
exact ``nbytes`` (views and in-place results share their input's storage and are not counted
again), and a weak reference on the storage subtracts it the moment it is freed. So::

    live(t)  = sum of nbytes of storages created inside the block and alive at time t
    peak     = max_t live(t)          (checked after every operation)
    end      = live(exit)

Storages resized outside the dispatcher (``untyped_storage().resize_()``, as FSDP does) are
re-read when the block ends: ``end`` is exact for them, and ``peak`` at least ``end``, but a
storage grown and shrunk again outside the dispatcher inside the block is not in ``peak``
(``method="allocator"`` sees it).

Scope of the CPU figures: tensor storages only (not allocator slack or kernel workspace), and
only storages created inside the block: a tensor created before entry and freed inside is not
subtracted, so measure a forward and its backward inside one meter rather than the backward
alone. Tensors made from Python data or NumPy arrays inside the block (``torch.tensor``,
``torch.from_numpy``) count as allocated there, even when they share the array's memory.

Blind spots of the CPU storage tracker, both from tensors made outside the dispatcher:

* tensors torch makes internally: ``torch.get_rng_state()`` results, so the CPU RNG state
  (5056 bytes) a checkpoint keeps per segment to replay dropout, are not counted;
* compiled code. Dynamo does not compile while a ``TorchDispatchMode`` is active, so a
  ``torch.compile``'d function called in the block runs eagerly there (and, in torch 2.13,
  compiled functions and modules then stay eager after the block, pytorch/pytorch#190286,
  until ``torch._dynamo.reset()``); the backward of a forward compiled outside the block runs
  compiled, its buffers unseen. The meter raises :class:`MeasurementError` when its block ran
  either, rather than report eager or partial figures. It recognises compiled code by the
  Dynamo frame callback in force where an operation is called and by the autograd node
  (``CompiledFunctionBackward``) running it.

``MemoryMeter("cpu", method="allocator")`` has neither blind spot: it reads the CPU allocator's
own allocation events from ``torch.profiler`` (:mod:`revckpt.measure.allocator`), so it counts
every allocation, compiled code's included, and gives its figures after the block only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .._numbers import mib
from ..errors import InvalidArgumentError, MeasurementError
from .allocator import AllocatorEvents
from .storages import _StorageTracker

__all__ = ["MeasurementError", "MemoryMeter", "MemoryStats", "peak_memory"]

METHODS = ("storages", "allocator")


@dataclass(frozen=True)
class MemoryStats:
    """Bytes above the level at entry: ``peak_bytes`` the highest reached, ``end_bytes`` at exit."""

    peak_bytes: int
    end_bytes: int
    device: str
    since_reset_peak_bytes: int | None = None
    method: str = "allocator"

    def __str__(self) -> str:
        scope = " (tensor storages made by operations; RNG states not counted)"
        return (
            f"peak {mib(self.peak_bytes, 3)}, retained {mib(self.end_bytes, 3)} on {self.device}"
            + (scope if self.method == "storages" else "")
        )


def _device(device: str | torch.device | None) -> torch.device:
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise InvalidArgumentError(
            f"MemoryMeter(device={device!r}): not a device; use 'cpu', 'cuda' or 'cuda:N'"
        ) from err
    if dev.type not in ("cpu", "cuda"):
        raise InvalidArgumentError(
            f"MemoryMeter measures 'cpu' or 'cuda' memory, got device {str(dev)!r}"
        )
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InvalidArgumentError(
            "MemoryMeter('cuda'): CUDA is not available in this build or on this machine; "
            "measure with MemoryMeter('cpu')"
        )
    return dev


def _method(device: torch.device, method: str | None) -> str:
    if method is None:
        return "allocator" if device.type == "cuda" else "storages"
    if method not in METHODS:
        raise InvalidArgumentError(
            f"MemoryMeter(method={method!r}): use 'storages' (CPU storage tracking) or "
            "'allocator' (allocator events), or None for the device's default"
        )
    if device.type == "cuda" and method != "allocator":
        raise InvalidArgumentError(
            f"MemoryMeter({str(device)!r}) reads the CUDA allocator's statistics; "
            f"method={method!r} is for CPU only: leave method=None or pass 'allocator'"
        )
    return method


_ACTIVE_CUDA: list[MemoryMeter] = []


class MemoryMeter:
    """Measure the tensor memory a block of code allocates.

    ::

        with MemoryMeter() as m:
            out = model(x)            # forward only
        m.end_bytes                   # activations retained for backward (+ the output)
        m.peak_bytes                  # highest live tensor memory inside the block

    Both figures are relative to the level at entry. ``device`` selects what is measured:
    ``"cpu"``, ``"cuda"`` / ``"cuda:1"`` (allocator statistics; resets the device's peak
    statistics), or ``None`` (CUDA if available, else CPU). ``method`` selects how, on CPU:

    * ``"storages"`` (the default on CPU): exact tracking of the tensor storages operations
      create. Meters may be nested (the inner one measures its own block), and
      :attr:`live_bytes` and :meth:`reset_peak` work inside the block. It does not see
      tensors made outside the dispatcher (``torch.get_rng_state()``, so the RNG states a
      checkpoint keeps; ``copy.deepcopy`` of a tensor or a module's buffers, ``torch.load``,
      ``pickle.loads`` and ``to_sparse``, whose storages are made outside and attached:
      measured at 0 bytes where the allocator sees them) nor compiled code, and raises
      :class:`MeasurementError` when the block runs compiled code (see the module docstring).
    * ``"allocator"`` (the only one on CUDA): every allocation of the device's allocator. On
      CPU it reads ``torch.profiler``'s memory events (:mod:`revckpt.measure.allocator`), so
      it sees compiled code, RNG states and the copies above; it cannot nest in another
      profiler, and has no :attr:`live_bytes` or :meth:`reset_peak` on CPU.

    On CPU neither method counts what other threads allocate during the block (a worker
    thread's 4 MB read 0); on CUDA the allocator's statistics are the device's, every thread's.
    """

    def __init__(
        self, device: str | torch.device | None = None, *, method: str | None = None
    ) -> None:
        self.device = _device(device)
        self.method = _method(self.device, method)
        self._tracker: _StorageTracker | None = None
        self._events: AllocatorEvents | None = None
        self._base = 0
        self._seen = 0
        self._before_reset = 0
        self._reset = False
        self._stats: MemoryStats | None = None

    def __enter__(self) -> MemoryMeter:
        if self._tracker is not None or self._events is not None or self in _ACTIVE_CUDA:
            raise InvalidArgumentError(
                "this MemoryMeter is measuring already (its `with` block has not ended): nest "
                "a new MemoryMeter() for the inner block"
            )
        self._stats = None
        self._before_reset, self._reset = 0, False
        if self.device.type == "cuda":
            self._enter_cuda()
        elif self.method == "allocator":
            self._events = AllocatorEvents()
            self._events.start()
        else:
            self._tracker = _StorageTracker("cpu")
            self._tracker.__enter__()
        return self

    def _enter_cuda(self) -> None:
        torch.cuda.synchronize(self.device)
        # Resetting the peak statistics would hide the peak an enclosing meter has seen so
        # far: fold it into every enclosing meter first.
        current = torch.cuda.max_memory_allocated(self.device)
        for outer in _ACTIVE_CUDA:
            if outer.device == self.device:
                outer._seen = max(outer._seen, current - outer._base)
        torch.cuda.reset_peak_memory_stats(self.device)
        self._base = torch.cuda.memory_allocated(self.device)
        self._seen = 0
        _ACTIVE_CUDA.append(self)

    def __exit__(self, *exc: Any) -> None:
        compiled = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            _ACTIVE_CUDA.remove(self)
            peak = max(self._seen, torch.cuda.max_memory_allocated(self.device) - self._base)
            end = torch.cuda.memory_allocated(self.device) - self._base
        elif self._events is not None:
            peak, end = self._events.stop()
            self._events = None
        else:
            peak, end, compiled = self._exit_storages(exc)
        self._stats = MemoryStats(
            peak_bytes=max(peak, self._before_reset),
            end_bytes=end,
            device=str(self.device),
            since_reset_peak_bytes=peak if self._reset else None,
            method=self.method,
        )
        if compiled is not None and exc[0] is None:
            raise MeasurementError(compiled)

    def _exit_storages(self, exc: Any) -> tuple[int, int, str | None]:
        tracker, self._tracker = self._tracker, None
        assert tracker is not None
        if not tracker.leave(exc):
            raise MeasurementError(
                "MemoryMeter('cpu') exited on another thread than the one that entered it "
                "(torch's dispatch modes are per thread): its tracker stays on that thread's "
                "mode stack. Enter and exit a meter on one thread"
            )
        with tracker.lock:
            tracker.resync()
            tracker.refs.clear()  # dropping the weak references cancels their callbacks
        return tracker.peak, tracker.live, tracker.compiled

    def _active(self, what: str) -> None:
        if self.method == "allocator" and self.device.type == "cpu":
            raise InvalidArgumentError(
                f"MemoryMeter.{what} does not exist with method='allocator' on CPU: the "
                "profiler's events are read when the block ends; use method='storages'"
            )
        if self._stats is not None or (self._tracker is None and self not in _ACTIVE_CUDA):
            raise InvalidArgumentError(f"MemoryMeter.{what} works inside the `with` block only")

    @property
    def live_bytes(self) -> int:
        """Live tensor memory now, above the level at entry (inside the block only)."""
        self._active("live_bytes")
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device) - self._base
        assert self._tracker is not None
        return self._tracker.live

    @property
    def phase_peak_bytes(self) -> int:
        """Highest live memory since the last :meth:`reset_peak` (or the entry), read inside
        the block: the peak of the phase so far, above the level at entry."""
        self._active("phase_peak_bytes")
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) - self._base
        assert self._tracker is not None
        return self._tracker.peak

    def reset_peak(self) -> None:
        """Start a new phase: :attr:`since_reset_peak_bytes` is then the highest live memory
        from now to the end of the block (still above the level at entry); ``peak_bytes``
        stays the peak of the whole block. For example, the peak of a backward alone while the
        forward's tensors are tracked (and their frees seen) by the same meter."""
        self._active("reset_peak")
        self._reset = True
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            current = torch.cuda.max_memory_allocated(self.device) - self._base
            self._before_reset = max(self._before_reset, self._seen, current)
            for outer in _ACTIVE_CUDA:
                if outer is not self and outer.device == self.device:
                    outer._seen = max(outer._seen, current + self._base - outer._base)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._seen = 0
        else:
            assert self._tracker is not None
            with self._tracker.lock:
                self._before_reset = max(self._before_reset, self._tracker.peak)
                self._tracker.peak = self._tracker.live

    @property
    def since_reset_peak_bytes(self) -> int:
        """Highest live memory since the last :meth:`reset_peak` (after the block)."""
        since = self.stats.since_reset_peak_bytes
        if since is None:
            raise InvalidArgumentError(
                "since_reset_peak_bytes needs a call to reset_peak() inside the `with` block"
            )
        return since

    @property
    def stats(self) -> MemoryStats:
        """Peak and end bytes as a :class:`MemoryStats` (after the block)."""
        if self._stats is None:
            raise InvalidArgumentError(
                "MemoryMeter figures exist after the `with` block has finished; read them there"
            )
        return self._stats

    @property
    def peak_bytes(self) -> int:
        """Highest live tensor memory inside the block, above the level at entry."""
        return self.stats.peak_bytes

    @property
    def end_bytes(self) -> int:
        """Live tensor memory at exit above the level at entry (what the block left alive)."""
        return self.stats.end_bytes


def peak_memory(
    fn: Callable[..., Any],
    *args: Any,
    meter_device: str | torch.device | None = None,
    **kwargs: Any,
) -> MemoryStats:
    """Run ``fn(*args, **kwargs)`` under ``MemoryMeter(meter_device)``; return its
    :class:`MemoryStats` (``device=`` and other keywords go to ``fn``).

    The result of ``fn`` is dropped before the figures are taken, so ``end_bytes`` is what ``fn``
    left alive elsewhere (gradients in ``.grad``, caches). To keep the result, use the meter.
    """
    meter = MemoryMeter(meter_device)
    with meter:
        fn(*args, **kwargs)
    return meter.stats
