"""CPU memory from the allocator's own events, for ``MemoryMeter("cpu", method="allocator")``.

``torch.profiler`` with ``profile_memory=True`` records every allocation and free of the CPU
allocator, however the memory was asked for: by an operation through the dispatcher, by
compiled (inductor) code, which allocates its buffers directly, or by torch itself
(``torch.get_rng_state()``, the RNG states a checkpoint keeps). With ``a_k`` the signed size of
event ``k`` in time order, counting the allocations made inside the block and the frees of
those allocations only::

    live_j = sum_{k <= j} a_k        peak = max(0, max_j live_j)        end = live_last

So, as for the storage tracker, a tensor allocated before the block and freed inside it is not
subtracted. The figures exist after the block; profiling slows the block down, and torch may
log a line about blocks "of unknown size allocated before the profiling started" (those frees).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

from ..errors import InvalidArgumentError

__all__ = ["AllocatorEvents", "peak_and_end"]

Event = tuple[int, int, int]
"""One allocator event: (time in ns, address, signed bytes; negative for a free)."""


def peak_and_end(events: Iterable[Event]) -> tuple[int, int]:
    """``(peak, end)`` bytes of allocator events, counting the frees of in-block allocations."""
    live = peak = 0
    held: dict[int, int] = {}
    for _, ptr, nbytes in sorted(events, key=lambda e: e[0]):
        if nbytes > 0:
            held[ptr] = nbytes
            live += nbytes
            peak = max(peak, live)
        elif ptr in held:
            live -= held.pop(ptr)
    return peak, live


def _cpu_events(prof: profile) -> list[Event]:
    events: list[Event] = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        ev = stack.pop()
        stack.extend(ev.children)
        if ev.tag == _EventType.Allocation and ev.extra_fields.device.type == "cpu":
            events.append((ev.start_time_ns, ev.extra_fields.ptr, ev.extra_fields.alloc_size))
    return events


class AllocatorEvents:
    """Records the CPU allocator's events between :meth:`start` and :meth:`stop`."""

    def __init__(self) -> None:
        self._prof: profile | None = None

    def start(self) -> None:
        if torch._C._autograd._profiler_enabled():
            raise InvalidArgumentError(
                "MemoryMeter('cpu', method='allocator') reads torch.profiler's memory events, "
                "and a profiler is already running (another such meter, or a "
                "torch.profiler.profile of yours); measure outside it, or use "
                "method='storages' inside it"
            )
        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._prof.__enter__()

    def stop(self) -> tuple[int, int]:
        """End the recording; ``(peak, end)`` bytes of the block."""
        assert self._prof is not None
        self._prof.__exit__(None, None, None)
        events, self._prof = _cpu_events(self._prof), None
        return peak_and_end(events)
