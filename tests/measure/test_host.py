"""keep_freed_memory: glibc's mallopt through ctypes; allocation still works afterwards."""

import ctypes.util

import torch

from revckpt.measure import keep_freed_memory


def test_keep_freed_memory_takes_effect_on_glibc_and_allocation_still_works():
    took = keep_freed_memory()
    assert isinstance(took, bool)
    if ctypes.util.find_library("c") and "glibc" in " ".join(__import__("platform").libc_ver()):
        assert took
    big = torch.ones(3 * 2**20)  # 12 MiB, below the 32 MiB heap limit
    del big
    again = torch.zeros(3 * 2**20)
    assert float(again.sum()) == 0.0
    assert keep_freed_memory() == took  # idempotent
