"""Deprecated spellings: one warning, in one place, that names the call to use instead.

An old spelling keeps working for one release and emits a :class:`FutureWarning` (shown to
users by default, unlike :class:`DeprecationWarning`) naming its replacement. Calls made from
inside revckpt itself do not warn: the user did not write them.
"""

from __future__ import annotations

import sys
import warnings

import torch

__all__ = ["warn_deprecated"]


def _caller_is_revckpt(depth: int) -> bool:
    frame = sys._getframe(depth + 1)
    name = frame.f_globals.get("__name__", "")
    return name == "revckpt" or name.startswith("revckpt.")


def warn_deprecated(old: str, new: str, *, depth: int = 1) -> None:
    """Warn that ``old`` is deprecated in favour of ``new``, at the caller ``depth`` frames up
    from the deprecated function (1: its direct caller), unless that caller is revckpt's own
    code. Silent while ``torch.compile`` traces (the eager run warns)."""
    if torch.compiler.is_compiling() or _caller_is_revckpt(depth + 1):
        return
    warnings.warn(
        f"{old} is deprecated and will be removed in the next release; use {new}",
        FutureWarning,
        stacklevel=depth + 2,
    )
