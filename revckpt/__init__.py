"""revckpt: train deeper and wider PyTorch models in the same memory, and know what it cost.

Strategies that trade compute for activation memory, chosen by ``strategy=`` of one
:func:`checkpoint` and one :func:`checkpoint_sequential` (exact, selective, approximate
recompute from compressed inputs (``revckpt.approx``), host offload (``revckpt.offload``),
compressed saved tensors), reversible blocks (``revckpt.layers``), and a scheduler that mixes
them under a memory and an error budget (``revckpt.schedule``); with the measurement tools to
prove what they save (:class:`MemoryMeter`, :func:`time_ratios`, :func:`gradient_error`,
``revckpt.report``).
"""

# importable from here, outside __all__ (the redundant aliases say so)
from . import approx as approx
from . import errors as errors
from . import inplace as inplace
from . import layers as layers
from . import measure as measure
from . import offload as offload
from . import replay as replay
from . import testing as testing
from .checkpoint import POLICY_PRESETS as POLICY_PRESETS
from .checkpoint import checkpoint, checkpoint_sequential
from .checkpoint import segment_bounds as segment_bounds
from .errors import *  # noqa: F403  (the error types: revckpt.errors.__all__, added below)
from .inplace import convert, fit, make_reversible, restore
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

# What a user needs for the three main jobs (checkpoint a model or a function: fit, convert,
# restore, checkpoint, checkpoint_sequential; make a stack reversible: revckpt.layers, or a
# pretrained model's layers keeping its output: make_reversible; fit a budget: fit), the
# strategies as values, the error types and the measurement tools. The subpackages (layers,
# approx, offload, measure, replay, testing, inplace, schedule) and the names not listed
# (POLICY_PRESETS, segment_bounds) stay importable from here. The error types are listed
# once, in revckpt.errors.__all__.
__all__ = [
    "GradientError",
    "MemoryMeter",
    "MemoryStats",
    "Strategy",
    "TimeRatio",
    "checkpoint",
    "checkpoint_sequential",
    "convert",
    "fit",
    "gradient_error",
    "make_reversible",
    "peak_memory",
    "restore",
    "time_ratio",
    "time_ratios",
]
__all__ += errors.__all__
