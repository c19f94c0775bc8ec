"""Low-precision paths: compressed checkpoint boundaries and bf16 recompute, with error bounds.

* :mod:`~revckpt.approx.formats`: :class:`Codec` (bf16, fp8 e4m3 / e5m2; tensor, row or block
  scaling; nearest or stochastic rounding) with its per-element error bound.
* :mod:`~revckpt.approx.recompute`: the :class:`Approx` configuration taken by
  ``revckpt.checkpoint(..., strategy=Approx(...))``, ``revckpt.checkpoint_sequential(...,
  strategy=Approx(...))`` and ``ReversibleSequential(approx=...)``; :func:`checkpoint` is its
  deprecated spelling.
* :mod:`~revckpt.approx.bounds`: :func:`estimate_error`, a first-order hard bound and a cheap
  random-probe estimate of the parameter-gradient error; :func:`estimate_totals`, the estimate
  alone for several codecs at once.
* :mod:`~revckpt.approx.saved`: :func:`compress_saved`, a block's saved tensors kept in bf16 or
  fp8 with no recompute, and :func:`compress_saved_error`, its gradient error measured in
  float64.
"""

from .bounds import (
    FIRST_ORDER_LIMIT,
    SECOND_ORDER_LIMIT,
    ErrorEstimate,
    NonSmoothWarning,
    TotalEstimate,
    estimate_error,
    estimate_totals,
)
from .formats import FORMATS, Codec, Encoded, NonFiniteInputError
from .recompute import Approx, checkpoint
from .saved import RelativeErrors, compress_saved, compress_saved_error

__all__ = [
    "FIRST_ORDER_LIMIT",
    "FORMATS",
    "SECOND_ORDER_LIMIT",
    "Approx",
    "Codec",
    "Encoded",
    "ErrorEstimate",
    "NonFiniteInputError",
    "NonSmoothWarning",
    "RelativeErrors",
    "TotalEstimate",
    "checkpoint",
    "compress_saved",
    "compress_saved_error",
    "estimate_error",
    "estimate_totals",
]
