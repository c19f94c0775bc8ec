"""The autocast settings of a forward, captured and re-established: part of
:mod:`revckpt.replay`."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["AutocastState", "autocast_device_types", "autocast_dtype"]


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast computes in on ``device_type`` now, or ``None`` where it is off."""
    if not torch.amp.is_autocast_available(device_type):
        return None
    if not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


@functools.cache
def _autocast_types(extra: frozenset[str]) -> tuple[str, ...]:
    types = {"cpu", *extra}
    if torch.cuda.is_available():
        types.add("cuda")
    return tuple(sorted(t for t in types if torch.amp.is_autocast_available(t)))


def autocast_device_types(devices: Iterable[torch.device]) -> tuple[str, ...]:
    extra = [d.type for d in devices if d.type != "cpu"]
    key = frozenset(extra) if extra else _NO_EXTRA
    if torch.compiler.is_compiling():  # traced: Dynamo skips a cache, and warns at it
        return _autocast_types.__wrapped__(key)
    if extra:
        return _autocast_types(key)
    global _CPU_TYPES
    if _CPU_TYPES is None:  # (a capture per block and step asks; the answer is fixed)
        _CPU_TYPES = _autocast_types(_NO_EXTRA)
    return _CPU_TYPES


_CPU_TYPES: tuple[str, ...] | None = None


_NO_EXTRA: frozenset[str] = frozenset()


@functools.lru_cache(maxsize=256)
def _autocast_state(
    device_type: str, enabled: bool, dtype: torch.dtype, cache_enabled: bool
) -> AutocastState:
    return AutocastState(device_type, enabled, dtype, cache_enabled)


@dataclasses.dataclass(frozen=True)
class AutocastState:
    """The autocast settings of one device type at capture time."""

    device_type: str
    enabled: bool
    dtype: torch.dtype
    cache_enabled: bool

    @classmethod
    def capture(cls, device_type: str) -> AutocastState:
        """The autocast settings now in effect for ``device_type`` (one shared instance per
        distinct setting: a capture runs per block and step). The dtype and cache flag are
        read with autocast off too: a block may switch autocast on without naming a dtype,
        and then runs in the one in force."""
        enabled = torch.is_autocast_enabled(device_type)
        dtype = torch.get_autocast_dtype(device_type)
        cache = torch.is_autocast_cache_enabled()
        if torch.compiler.is_compiling():  # traced: Dynamo skips a cache, and warns at it
            return cls(device_type, enabled, dtype, cache)
        return _autocast_state(device_type, enabled, dtype, cache)

    def matches_current(self) -> bool:
        """Whether autocast on this device type is already in this state (so replay need not
        enter a context). Off, the dtype counts too: a block that switches autocast on without
        naming one runs in the dtype in force."""
        return (
            torch.is_autocast_enabled(self.device_type) == self.enabled
            and torch.get_autocast_dtype(self.device_type) == self.dtype
            and torch.is_autocast_cache_enabled() == self.cache_enabled
        )

    def context(self) -> contextlib.AbstractContextManager[Any]:
        """A context that re-establishes these settings (or disables autocast if it was off)."""
        return torch.autocast(
            self.device_type,
            dtype=self.dtype,
            enabled=self.enabled,
            cache_enabled=self.cache_enabled,
        )
