"""revckpt: train deeper and wider PyTorch models in the same memory, and know what it cost.

Strategies that trade compute for activation memory: classic checkpoint segments
(:func:`checkpoint`, :func:`checkpoint_sequential`), reversible blocks (``revckpt.layers``),
approximate recompute (``revckpt.approx``), and a scheduler that mixes them under a memory and
an error budget (``revckpt.schedule``); with the measurement tools to prove what they save
(:class:`MemoryMeter`, :func:`time_ratios`, :func:`gradient_error`, ``revckpt.report``).
"""

from . import inplace, layers, measure, offload, replay, testing
from .checkpoint import POLICY_PRESETS, checkpoint, checkpoint_sequential, segment_bounds
from .errors import (
    CheckpointMismatchError,
    DoubleBackwardError,
    GradientMismatchError,
    InfeasibleBudgetError,
    InvalidArgumentError,
    InvalidInputTypeError,
    MeasurementError,
    ModifiedInputError,
    ModifiedParameterError,
    PlanWarning,
    ReconstructionError,
    ReplayError,
    RevckptError,
)
from .inplace import convert, fit, restore
from .measure import (
    GradientError,
    MemoryMeter,
    MemoryStats,
    TimeRatio,
    gradient_error,
    peak_memory,
    time_ratio,
    time_ratios,
)
from .strategy import Strategy

__version__ = "0.1.0"

__all__ = [
    "POLICY_PRESETS",
    "CheckpointMismatchError",
    "DoubleBackwardError",
    "GradientError",
    "GradientMismatchError",
    "InfeasibleBudgetError",
    "InvalidArgumentError",
    "InvalidInputTypeError",
    "MeasurementError",
    "MemoryMeter",
    "MemoryStats",
    "ModifiedInputError",
    "ModifiedParameterError",
    "PlanWarning",
    "ReconstructionError",
    "ReplayError",
    "RevckptError",
    "Strategy",
    "TimeRatio",
    "checkpoint",
    "checkpoint_sequential",
    "convert",
    "fit",
    "gradient_error",
    "inplace",
    "layers",
    "measure",
    "offload",
    "peak_memory",
    "replay",
    "restore",
    "segment_bounds",
    "testing",
    "time_ratio",
    "time_ratios",
]
