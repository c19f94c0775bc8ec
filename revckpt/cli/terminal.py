"""What the ``revckpt`` command writes to the terminal besides its tables: one-line progress
bars on stderr, and the note on what CPU memory figures leave out."""

from __future__ import annotations

import sys
import time
from typing import Any

_OPEN_LINE = [False]  # a progress bar left the cursor mid-line on stderr

_CPU_SCOPE = (
    " On CPU MemoryMeter counts the tensor storages operations make: the RNG states "
    "checkpoints keep for their recompute (5056 bytes each) are not counted."
)


class _Progress:
    """A one-line progress bar on stderr: ``[#####-----] 3/6 profiling``."""

    def __init__(self, total: int, *, enabled: bool = True, width: int = 24) -> None:
        self.total, self.done, self.width = total, 0, width
        self.enabled = enabled
        self.start = time.perf_counter()

    def step(self, label: str) -> None:
        if not self.enabled:
            return
        filled = self.width * self.done // self.total
        bar = "#" * filled + "-" * (self.width - filled)
        elapsed = time.perf_counter() - self.start
        sys.stderr.write(f"\r[{bar}] {self.done}/{self.total} {label:<52} {elapsed:5.0f} s")
        sys.stderr.flush()
        _OPEN_LINE[0] = True
        self.done += 1

    def finish(self) -> None:
        if self.enabled:
            elapsed = time.perf_counter() - self.start
            bar = "#" * self.width
            sys.stderr.write(f"\r[{bar}] {self.total}/{self.total} {'done':<52} {elapsed:5.0f} s\n")
            sys.stderr.flush()
            _OPEN_LINE[0] = False


def _progress_bar(enabled: bool, width: int = 24) -> Any:
    """``fit``'s ``progress(done, total)``: ``[#####     ] 3/12 blocks`` on stderr."""
    if not enabled:
        return None

    def progress(done: int, total: int) -> None:
        if total <= 0:
            return
        filled = width * min(done, total) // total
        sys.stderr.write(f"\r[{'#' * filled}{' ' * (width - filled)}] {done}/{total} blocks")
        sys.stderr.flush()
        _OPEN_LINE[0] = True

    return progress


def _end_progress_line() -> None:
    if _OPEN_LINE[0]:
        sys.stderr.write("\n")
        sys.stderr.flush()
        _OPEN_LINE[0] = False
