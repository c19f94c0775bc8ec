"""Reversible building blocks: couplings, reversible blocks and stacks, ready blocks."""

from .blocks import (
    AttentionBranch,
    ConvBranch,
    EnterStreams,
    LeaveStreams,
    MLPBranch,
    reversible_mlp_block,
    reversible_transformer_block,
    revnet_conv_block,
)
from .convert import ReversibleStack, convert_to_reversible
from .coupling import AdditiveCoupling, AffineCoupling, Coupling, ScaledCoupling, make_coupling
from .grid import GridCoupling, on_grid
from .sequential import (
    ReconstructionWarning,
    ReversibleBlock,
    ReversibleSequential,
    ReversibleUnit,
)

__all__ = [
    "AdditiveCoupling",
    "AffineCoupling",
    "AttentionBranch",
    "ConvBranch",
    "Coupling",
    "EnterStreams",
    "GridCoupling",
    "LeaveStreams",
    "MLPBranch",
    "ReconstructionWarning",
    "ReversibleBlock",
    "ReversibleSequential",
    "ReversibleStack",
    "ReversibleUnit",
    "ScaledCoupling",
    "convert_to_reversible",
    "make_coupling",
    "on_grid",
    "reversible_mlp_block",
    "reversible_transformer_block",
    "revnet_conv_block",
]
