"""The memory of one training step of a model: its peak, and what it keeps between forward and
backward. Re-exported by :mod:`revckpt.report`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ._numbers import storage_bytes
from .errors import InvalidArgumentError, InvalidInputTypeError
from .measure import MemoryMeter
from .measure.state import cut_from_graph, preserved

__all__ = ["StepMemory", "measure_peak", "measure_step"]


@dataclass(frozen=True)
class StepMemory:
    """One training step: ``peak_bytes`` (see :func:`measure_peak`) and ``retained_bytes``, the
    bytes alive between forward and backward apart from the input and the output (what the
    strategy keeps for backward)."""

    peak_bytes: int
    retained_bytes: int


def measure_step(
    model: nn.Module,
    x: torch.Tensor,
    *,
    kwargs: Mapping[str, Any] | None = None,
    device: str | torch.device | None = None,
) -> StepMemory:
    """Peak and retained bytes of one training step of ``model`` on ``x``.

    One warm-up step runs first; the measured step then counts the input copy, the activations,
    the output (held until the step ends, as a loss head that saves its input holds it), its
    gradient (a full tensor made during backward, as a real loss produces) and the input
    gradient, and not the parameters nor their gradients (allocated before the meter starts).
    The chain input counts from the start: a leaf that requires grad stays alive to the end of
    the step. The parameters' ``.grad``, the buffers (BatchNorm statistics) and the random
    number generators' states are restored afterwards; tensors among ``kwargs`` that require
    grad are cut from the caller's graph (their ``.grad`` stays as it was). Runs with gradients
    on, also when called under ``torch.no_grad()``.
    """
    kw = cut_from_graph(dict(kwargs or {}))
    params = [p for p in model.parameters() if p.requires_grad]
    retained: list[int] = []
    weight: list[torch.Tensor] = []
    meter: MemoryMeter | None = None

    def step() -> None:
        leaf = x.detach().clone().requires_grad_(x.is_floating_point())
        y = model(leaf, **kw)
        if not isinstance(y, torch.Tensor):
            raise InvalidInputTypeError(
                f"measure_step needs a model returning one tensor, got {type(y).__name__}"
            )
        if not y.requires_grad:
            raise InvalidArgumentError(
                "measure_step: the model's output does not require grad (every parameter "
                "frozen and an integer input?), so there is no training step to measure"
            )
        if meter is not None:
            retained.append(meter.live_bytes - storage_bytes(y) - storage_bytes(leaf))
        if not weight:  # allocated in the warm-up step, outside the meter
            weight.append(torch.ones_like(y))
        # a loss whose gradient with respect to y is a full tensor made (and freed) by the
        # engine, as a real loss head's is; y stays alive (a head saves its input)
        (y * weight[0]).sum().backward()

    cuda = [x.device.index or 0] if x.is_cuda else []
    with (
        torch.random.fork_rng(devices=cuda),
        torch.inference_mode(False),
        torch.enable_grad(),
        preserved(model),
    ):
        for p in params:
            p.grad = torch.zeros_like(p)
        step()
        meter = MemoryMeter(device if device is not None else x.device)
        with meter:
            step()
    return StepMemory(peak_bytes=meter.peak_bytes, retained_bytes=max(0, retained[0]))


def measure_peak(
    model: nn.Module,
    x: torch.Tensor,
    *,
    kwargs: Mapping[str, Any] | None = None,
    device: str | torch.device | None = None,
) -> int:
    """Peak live bytes of one training step (see :func:`measure_step`): what the scheduler's
    cost model predicts as ``Plan.predicted_peak_bytes``."""
    return measure_step(model, x, kwargs=kwargs, device=device).peak_bytes
