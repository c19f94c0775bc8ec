"""Deprecated spellings: one warning, in one place, that names the call to use instead.

An old spelling keeps working for one release and emits a :class:`FutureWarning` (shown to
users by default, unlike :class:`DeprecationWarning`) naming its replacement. revckpt's own
code uses the new spellings only (the test suite runs its library paths with the warning as
an error).
"""

from __future__ import annotations

import warnings

import torch

__all__ = ["warn_deprecated"]


def warn_deprecated(old: str, new: str, *, depth: int = 1) -> None:
    """Warn that ``old`` is deprecated in favour of ``new``, at the caller ``depth`` frames up
    from the deprecated function (1: its direct caller). Silent while ``torch.compile``
    traces (the eager run warns)."""
    if torch.compiler.is_compiling():
        return
    warnings.warn(
        f"{old} is deprecated and will be removed in the next release; use {new}",
        FutureWarning,
        stacklevel=depth + 2,
    )
