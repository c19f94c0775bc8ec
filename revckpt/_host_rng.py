"""The host's global random generators, Python's ``random`` and NumPy's legacy global one:
what a block drawing from them (stochastic depth written with ``random.random()``, a random
scale from ``np.random.choice``) needs replayed for its recompute to compute what its forward
did. torch's generators are :mod:`revckpt._devices`'."""

from __future__ import annotations

import random
import sys
from typing import Any

__all__ = ["HostRng"]


class HostRng:
    """The state of ``random`` and, where NumPy is imported, of ``numpy.random``'s global
    generator, as taken at one moment."""

    __slots__ = ("numpy", "python")

    def __init__(self) -> None:
        self.python = random.getstate()
        np = sys.modules.get("numpy")
        self.numpy: Any = np.random.get_state(legacy=False) if np is not None else None

    def same(self, other: HostRng) -> bool:
        """Whether no number was drawn between ``self`` and ``other`` (taken later)."""
        if self.python != other.python:
            return False
        if self.numpy is None or other.numpy is None:
            return self.numpy is other.numpy
        a, b = self.numpy, other.numpy
        return (
            a["bit_generator"] == b["bit_generator"]
            and a["state"]["pos"] == b["state"]["pos"]
            and a["has_gauss"] == b["has_gauss"]
            and bool((a["state"]["key"] == b["state"]["key"]).all())
        )

    def restore(self) -> None:
        """Set both generators to this state."""
        random.setstate(self.python)
        np = sys.modules.get("numpy")
        if np is not None and self.numpy is not None:
            np.random.set_state(self.numpy)
