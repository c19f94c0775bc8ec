"""Memory budgets: bytes from what a user writes (``2GiB``, ``"30%"``, ``0.3``, ``12345``)."""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np

from ..errors import InvalidArgumentError

__all__ = ["UNKNOWN_PEAK", "human_bytes", "parse_budget"]

_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}

_FORMS = (
    "pass bytes as an int (2000000000), a number and a unit ('2GiB', '512 MiB', '8GB', "
    "'1.5e9' bytes), a percentage of the store-all peak ('30%') or a fraction of it in (0, 1] "
    "(0.3 or '0.3')"
)
# the store-all peak to pass to parse_budget to check a budget's syntax before the peak is
# known (no step reaches it): a fraction is then checked, and its error does not show the peak
UNKNOWN_PEAK = 1 << 62
_NUMBER = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z%]*)\s*")


def parse_budget(budget: Any, store_all_peak: int) -> int:
    """A memory budget in bytes from an int (bytes), a string (``"2GiB"``, ``"500 MB"``,
    ``"1.5e9"`` bytes; ``"30%"``, or a number up to 1 such as ``"0.3"``, a fraction) or a float
    in ``(0, 1]`` (a fraction of the store-everything peak). Anything else (zero, negative,
    infinite or not a number, unreadable) raises :class:`~revckpt.InvalidArgumentError`."""
    if isinstance(budget, bool):
        raise InvalidArgumentError(f"memory_budget={budget!r} is not a budget; {_FORMS}")
    if isinstance(budget, (int, np.integer)):
        if budget <= 0:
            raise InvalidArgumentError(
                f"memory_budget={budget}: a byte budget must be positive; {_FORMS}"
            )
        return int(budget)
    if isinstance(budget, (float, np.floating)):
        return _fraction(float(budget), repr(float(budget)), store_all_peak)
    if isinstance(budget, str):
        return _parse_text(budget, store_all_peak)
    raise InvalidArgumentError(
        f"memory_budget={budget!r} ({type(budget).__name__}) is not a budget; {_FORMS}"
    )


def _fraction(value: float, written: str, store_all_peak: int) -> int:
    if not (math.isfinite(value) and 0 < value <= 1):
        peak = "" if store_all_peak == UNKNOWN_PEAK else f" ({store_all_peak:,} bytes)"
        raise InvalidArgumentError(
            f"memory_budget={written}: a fraction of the store-everything peak{peak} must be "
            f"in (0, 1]; {_FORMS}"
        )
    return max(1, math.floor(value * store_all_peak))


def _parse_text(text: str, store_all_peak: int) -> int:
    m = _NUMBER.fullmatch(text)
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in (*_UNITS, "", "%"):
        raise InvalidArgumentError(f"cannot read the memory budget {text!r}; {_FORMS}")
    number = float(m.group(1))
    if unit == "%":
        return _fraction(number / 100, repr(text), store_all_peak)
    if unit == "" and number <= 1:
        return _fraction(number, repr(text), store_all_peak)
    if unit == "" and number < 1024:
        raise InvalidArgumentError(
            f"memory budget {text!r}: a number without a unit above 1 is read as bytes, "
            f"and {text.strip()} bytes is surely not meant; write a unit ('{text.strip()}"
            "GiB'), a percentage ('30%') or a fraction of the store-all peak ('0.3')"
        )
    value = number * _UNITS.get(unit, 1)
    if not math.isfinite(value):
        raise InvalidArgumentError(
            f"memory budget {text!r} is too large to be a number of bytes; {_FORMS}"
        )
    if value < 1:
        raise InvalidArgumentError(f"memory budget {text!r} is less than one byte; {_FORMS}")
    return int(value)


def human_bytes(n: int) -> str:
    """``n`` bytes in GiB, MiB or KiB with two decimals (bytes below 1 KiB)."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"
