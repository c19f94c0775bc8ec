"""Reversible building blocks: couplings, reversible blocks and stacks."""

from .coupling import AdditiveCoupling, AffineCoupling, Coupling, make_coupling
from .sequential import ReconstructionWarning, ReversibleBlock, ReversibleSequential

__all__ = [
    "AdditiveCoupling",
    "AffineCoupling",
    "Coupling",
    "ReconstructionWarning",
    "ReversibleBlock",
    "ReversibleSequential",
    "make_coupling",
]
