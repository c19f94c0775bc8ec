"""Keep freed host memory in the process, so that CPU step times do not include page faults.

PyTorch's CPU tensors come from the C library's ``malloc``. glibc serves large blocks with
``mmap`` and hands them back to the operating system when they are freed (and trims the top of
its heap), so the next training step page-faults the same memory in again: a step's time then
grows with the memory it touches fresh, and depends on what the step before it left behind.
On the GPT-like benchmark model that made a plan checkpointing a third of the blocks measure
+0.08 of a step instead of +0.13, against a prediction of +0.13 (``python
benchmarks/bench_allocator.py``): the time model assumes freed memory is reused. CUDA's
caching allocator keeps freed blocks, so there the question does not arise.

:func:`keep_freed_memory` asks glibc (``mallopt``) to serve blocks up to its 32 MiB limit
from the heap and not to trim it, as ``GLIBC_TUNABLES=glibc.malloc.mmap_threshold=...:
glibc.malloc.trim_threshold=...`` does for a new process: memory freed by one step is reused
by the next, at the cost of the process keeping its peak. It changes the whole process, from
then on; call it once, before training, when CPU step times must be steady.
"""

from __future__ import annotations

import ctypes
import ctypes.util

__all__ = ["keep_freed_memory"]

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_MAX = 32 * 2**20  # glibc's upper limit for M_MMAP_THRESHOLD on 64-bit systems


def keep_freed_memory() -> bool:
    """Make glibc keep freed memory in the process (see the module docstring). Returns
    ``True`` when it took effect, ``False`` where the C library is not glibc (nothing is
    changed there)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    trim = mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)
    mmap = mallopt(_M_MMAP_THRESHOLD, _MMAP_MAX)
    return bool(trim) and bool(mmap)
