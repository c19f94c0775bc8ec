"""Measurement: memory (peak and retained bytes), time ratios, gradient errors.

Imports nothing of revckpt but the errors module, so every other part may use it.
"""

from .gradients import GradientError, TensorError, gradient_error
from .host import keep_freed_memory
from .memory import MeasurementError, MemoryMeter, MemoryStats, peak_memory
from .timing import TimeRatio, time_ratio, time_ratios

__all__ = [
    "GradientError",
    "MeasurementError",
    "MemoryMeter",
    "MemoryStats",
    "TensorError",
    "TimeRatio",
    "gradient_error",
    "keep_freed_memory",
    "peak_memory",
    "time_ratio",
    "time_ratios",
]
