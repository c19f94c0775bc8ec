"""Whole models in place: find the blocks, trace the user's step, profile in situ, solve for
the whole step and install the plan on the blocks themselves (see :mod:`.fit`)."""

from .blocks import find_blocks
from .fit import convert, fit, restore

__all__ = ["convert", "find_blocks", "fit", "restore"]
