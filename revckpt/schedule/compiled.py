"""A block's costs as it runs under ``torch.compile``: what :func:`revckpt.schedule.profile`
measures with ``compiled=True``.

Compiled, a strategy costs something else than eager. The compiler's partitioner plans the
recompute of a checkpointed or selective region itself and fuses it into the backward's
kernels, so recomputing the cheap operations (norms, activations, softmax) of a block whose
matrix multiplies and attention are kept costs almost nothing, where eager it costs a forward;
and what the compiled forward keeps for backward is the partitioner's choice, not autograd's
saved tensors. Priced eagerly, the solver would pay for recomputes that are free and predict
bytes the compiled step does not keep.

So each strategy of a group's block (store, checkpoint, and each selective policy) is compiled
on its own, in a small module that runs it as a plan does (:func:`revckpt.checkpoint` under
the compiler is torch's own checkpoint region, with the policy), and measured with the
allocator meter (``MemoryMeter(method="allocator")`` on CPU, the allocator's statistics on
CUDA: both see compiled code). Per strategy, with the block's input held and its output's
gradient made before:

* a forward alone: its peak (``tf``, ``tn`` or the selective forward peak) and what it leaves
  alive apart from the output (the bytes kept: ``s``, or the selective policy's);
* a whole step, forward then backward: its peak above the level the forward left, output
  included (the backward transient ``tb``, ``tk`` or the selective backward peak). Where
  the forward's own peak is the step's, this is an upper bound;
* the step's time against the stored step's, interleaved (:func:`~revckpt.time_ratios`): the
  strategy's extra seconds; the stored forward's time alone gives ``forward_s``.

The strategies other than these (approx, compressed, reversible, offload) are not priced
compiled: they run eagerly in parts, and their compiled costs are not measured here.
"""

from __future__ import annotations

import functools
import statistics
from typing import Any

import torch
from torch import nn

from ..checkpoint import checkpoint
from ..measure import MemoryMeter, time_ratios
from ..measure.timing import wall_time
from ..strategy import argument_of, kind_of
from .cost_records import SelectiveCost
from .costs import CHECKPOINT, SELECTIVE, STORE

__all__ = ["compiled_costs"]


class _Run(nn.Module):
    """One block run with one strategy, as a plan's segment of one block runs it."""

    def __init__(self, block: nn.Module, strategy: str) -> None:
        super().__init__()
        self.block = block
        self.kind = kind_of(strategy)
        self.strategy = strategy if self.kind == SELECTIVE else None  # None: exact

    def forward(self, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        if self.kind == STORE:
            return self.block(x, **kwargs)
        return checkpoint(self.block, x, strategy=self.strategy, **kwargs)


def _meter(device: Any) -> MemoryMeter:
    return MemoryMeter(device, method="allocator")


def _forward_bytes(
    run: Any, leaf: torch.Tensor, kwargs: dict[str, Any], device: Any
) -> tuple[int, int, int]:
    """The forward's peak, what it leaves alive apart from its output, and the output."""
    with _meter(device) as meter:
        y = run(leaf, **kwargs)
        out = y.untyped_storage().nbytes()
    del y
    return meter.peak_bytes, max(0, meter.end_bytes - out), out


def _step_peak(
    run: Any, leaf: torch.Tensor, grad: torch.Tensor, kwargs: dict[str, Any], device: Any
) -> int:
    with _meter(device) as meter:
        run(leaf, **kwargs).backward(grad)
    leaf.grad = None
    return meter.peak_bytes


def compiled_costs(
    block: nn.Module,
    leaf: torch.Tensor,
    grad: torch.Tensor,
    strategies: list[str],
    kwargs: dict[str, Any],
    *,
    repeats: int,
    device: Any,
) -> dict[str, Any]:
    """The :class:`~revckpt.schedule.BlockCost` fields of ``block`` compiled: its bytes,
    transients and times under store, checkpoint and each selective strategy of
    ``strategies`` (``leaf``: its input, requiring grad; ``grad``: its output's gradient)."""
    wanted = [STORE, *(s for s in strategies if kind_of(s) in (CHECKPOINT, SELECTIVE))]
    runs = {s: torch.compile(_Run(block, s), dynamic=False) for s in dict.fromkeys(wanted)}
    limit = max(torch._dynamo.config.recompile_limit, 8 + len(runs))
    fields: dict[str, Any] = {"selective": {}}
    with torch._dynamo.config.patch(recompile_limit=limit):
        for s, run in runs.items():
            for _ in range(2):  # compile forward and backward, then warm
                run(leaf, **kwargs).backward(grad)
            leaf.grad = None
            peak, kept, out = _forward_bytes(run, leaf, kwargs, device)
            backward = max(0, _step_peak(run, leaf, grad, kwargs, device) - kept - out)
            _record(fields, s, peak, kept, backward)
        fields.update(_times(runs, leaf, grad, kwargs, repeats))
    return fields


def _record(fields: dict[str, Any], strategy: str, peak: int, kept: int, backward: int) -> None:
    """File one strategy's bytes under the fields the cost model reads (see ``costs``)."""
    kind = kind_of(strategy)
    if kind == STORE:
        fields.update(saved_bytes=kept, forward_peak_bytes=peak, backward_peak_bytes=backward)
        fields.update(output_saved=False, backward_capture_peak_bytes=None)
    elif kind == CHECKPOINT:
        fields.update(forward_peak_nograd_bytes=peak, checkpoint_peak_bytes=backward)
    else:
        fields["selective"][argument_of(strategy)] = SelectiveCost(kept, peak, backward, False)


def _times(
    runs: dict[str, Any],
    leaf: torch.Tensor,
    grad: torch.Tensor,
    kwargs: dict[str, Any],
    repeats: int,
) -> dict[str, Any]:
    """Forward and backward seconds stored, and each strategy's extra seconds of a step."""

    def forward() -> None:
        runs[STORE](leaf, **kwargs)

    f = statistics.median(wall_time(forward) for _ in range(repeats))

    def step(run: Any) -> None:
        run(leaf, **kwargs).backward(grad)

    steps = {s: functools.partial(step, run) for s, run in runs.items()}
    ratios = time_ratios(steps, baseline=STORE, repeats=repeats, warmup=1)
    leaf.grad = None
    fb = ratios[STORE].baseline_seconds
    overhead = {s: max(0.0, (r.ratio - 1.0) * fb) for s, r in ratios.items() if s != STORE}
    return {
        "forward_s": f,
        "backward_s": max(fb - f, 0.0),
        "strategy_overhead_s": overhead,
        "chained_s": overhead.get(CHECKPOINT, f),
    }
