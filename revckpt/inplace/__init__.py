"""Whole models in place: find the blocks, trace the user's step, profile in situ, solve for
the whole step and install the plan on the blocks themselves (see :mod:`.fit`)."""

from .blocks import find_blocks
from .fit import convert, fit, restore
from .reversible import make_reversible, reversible_layers

__all__ = ["convert", "find_blocks", "fit", "make_reversible", "restore", "reversible_layers"]
