"""``make_reversible(..., scale="auto", example=...)``: the largest scale that keeps the
model's output at conversion within a stated tolerance of the original's.

At conversion each layer's input moves by ``scale`` times the residual update of the layer
before (the adapters start at zero), so the output's relative change is linear in the scale
(``benchmarks/finetune_start.py``: it halves with each halving, from 2^-3 to 2^-10, on six
architectures). How large it is depends on the model: how large its layers' updates are against
its hidden state. So the start is measured once on the user's batch at ``2^-8`` and the scale
``2^-k`` read off the line, then measured again at that scale (halved while still above the
tolerance, down to the grid's ``2^-16``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .._numbers import relative_error
from ..errors import InvalidArgumentError
from ..layers.grid import MAX_SHIFT
from .step import split_example

__all__ = ["REFERENCE_SHIFT", "measure_start", "output_of", "shift_for"]

REFERENCE_SHIFT = 8  # the scale 2^-8 the start is first measured at


def output_of(out: Any) -> torch.Tensor:
    """The tensor a model's output is judged by: itself, its ``logits`` or
    ``last_hidden_state`` (Hugging Face outputs), or the first tensor of a tuple or dict that is
    not a scalar (a loss), else the first."""
    if isinstance(out, torch.Tensor):
        return out
    for name in ("logits", "last_hidden_state"):
        value = getattr(out, name, None)
        if isinstance(value, torch.Tensor):
            return value
    values: Any = ()
    if isinstance(out, dict):
        values = out.values()
    elif isinstance(out, (tuple, list)):
        values = out
    floats = [v for v in values if isinstance(v, torch.Tensor) and v.is_floating_point()]
    # a 0-dimensional one is a loss (a Hugging Face tuple with labels: (loss, logits, ...)),
    # which moves far less than the logits: the first that is not, if any
    for value in sorted(floats, key=lambda v: v.dim() == 0):
        return value
    raise InvalidArgumentError(
        f"scale='auto' compares the model's output before and after conversion, and it "
        f"returned {type(out).__name__} with no floating-point tensor (logits, "
        "last_hidden_state, or a tensor first in a tuple); pass a scale (e.g. 2**-8)"
    )


def run_output(model: nn.Module, example: Any) -> torch.Tensor:
    """The model's output on ``example`` in eval mode without gradients (float64), every
    module's mode put back afterwards."""
    args, kwargs = split_example(example)
    modes = [(m, m.training) for m in model.modules()]
    try:
        model.eval()
        with torch.no_grad():
            return output_of(model(*args, **kwargs)).detach().double()
    finally:
        for m, training in modes:
            m.training = training


def relative_change(before: torch.Tensor, after: torch.Tensor) -> float:
    """:func:`revckpt._numbers.relative_error` of ``after``, a ``nan`` (an output that became
    non-finite) counted as infinite: past any tolerance."""
    change = relative_error(after, before)
    return math.inf if math.isnan(change) else change


def shift_for(start: float, tolerance: float) -> int:
    """The smallest ``k`` (at least 1, at most the grid's 16) whose scale ``2^-k`` keeps a
    start measured as ``start`` at ``2^-8`` within ``tolerance``, the start linear in the
    scale."""
    if start <= 0:
        return 1
    if not math.isfinite(start):  # the output became non-finite: the smallest scale first
        return MAX_SHIFT
    k = math.ceil(REFERENCE_SHIFT + math.log2(start / tolerance))
    return min(MAX_SHIFT, max(1, k))


def measure_start(
    convert: Callable[[float], None],
    undo: Callable[[], None],
    model: nn.Module,
    example: Any,
    tolerance: float,
) -> tuple[float, float]:
    """Convert ``model`` (``convert(scale)``) at the largest ``2^-k`` whose output on
    ``example`` moves by at most ``tolerance`` (relative), ``undo()`` between tries; returns
    the scale and the measured change. Raises, leaving the model unconverted, when even
    ``2^-16`` moves it further."""
    if not (isinstance(tolerance, (int, float)) and 0 < tolerance < 1):
        raise InvalidArgumentError(
            f"start_tolerance={tolerance!r}: pass the largest relative change of the output "
            "at conversion you accept, in (0, 1) (e.g. 1e-3)"
        )
    before = run_output(model, example)
    if not bool(torch.isfinite(before).all()):
        raise InvalidArgumentError(
            "make_reversible(scale='auto'): the model's own output on example= is not finite "
            "(nan or inf: a fully masked row, an overflow), so no change of it can be measured; "
            "pass an example on which the model's output is finite"
        )
    convert(2.0**-REFERENCE_SHIFT)
    try:
        k, start = _search(convert, undo, model, example, before, tolerance)
    except BaseException:
        undo()  # the model is left unconverted
        raise
    if start > tolerance:
        undo()
        raise InvalidArgumentError(
            f"make_reversible(scale='auto'): the output moves by {start:.3g} (relative) at "
            f"conversion even at scale 2^-{k}, above start_tolerance={tolerance:g}; pass a "
            "larger tolerance, or a scale yourself with exact=False for scales below 2^-16"
        )
    return 2.0**-k, start


def _search(
    convert: Callable[[float], None],
    undo: Callable[[], None],
    model: nn.Module,
    example: Any,
    before: torch.Tensor,
    tolerance: float,
) -> tuple[int, float]:
    """:func:`measure_start`'s search from the model converted at ``2^-8``: the shift ``k``
    it ends converted at and the change measured there."""
    start = relative_change(before, run_output(model, example))
    k = shift_for(start, tolerance)
    if k != REFERENCE_SHIFT:
        undo()
        convert(2.0**-k)
        start = relative_change(before, run_output(model, example))
    while start > tolerance and k < MAX_SHIFT:  # a line is a model: halve while above it
        k += 1
        undo()
        convert(2.0**-k)
        start = relative_change(before, run_output(model, example))
    return k, start
