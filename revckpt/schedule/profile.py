"""Measure what the scheduler needs about each block of a chain.

:func:`profile` runs the chain block by block on example inputs and records, per block (see
:class:`~revckpt.schedule.costs.BlockCost`): forward and backward time (median of ``repeats``),
the bytes its forward saves for backward apart from its input, its input and output bytes, the
transient peaks of its forward (recording and not) and of its backward (all from
:class:`~revckpt.MemoryMeter`), whether it is invertible (a
:class:`~revckpt.layers.ReversibleUnit`), and per codec the compressed size of its input and
the estimated relative gradient error of compressing it (``revckpt.approx.estimate_error`` on
the block alone). Backward is measured in steady state: parameter gradients already exist, so
their accumulation allocates only temporaries, as from the second training step on.
"""

from __future__ import annotations

import functools
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..approx import Approx
from ..approx import checkpoint as approx_checkpoint
from ..approx.bounds import estimate_totals
from ..checkpoint import checkpoint
from ..errors import InvalidArgumentError, InvalidInputTypeError
from ..layers import ReversibleSequential, ReversibleUnit
from ..measure import MemoryMeter, time_ratios
from .costs import APPROX_PREFIX, CHECKPOINT, REVERSIBLE, STORE, BlockCost

__all__ = ["Profile", "profile"]

DEFAULT_CODECS = ("bf16", "e4m3", "e5m2")


def _signature(x: torch.Tensor) -> tuple[tuple[int, ...], str, str]:
    return tuple(x.shape), str(x.dtype), x.device.type


@dataclass(frozen=True)
class Profile:
    """Per-block costs of a chain, the block names, and the example input's signature."""

    blocks: tuple[BlockCost, ...]
    names: tuple[str, ...]
    input_signature: tuple[tuple[int, ...], str, str]

    def table(self) -> str:
        lines = [
            "| block | fwd ms | bwd ms | input MB | saved MB | fwd peak MB | bwd peak MB | "
            "invertible | approx error (est.) |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for name, b in zip(self.names, self.blocks, strict=True):
            errs = ", ".join(f"{c} {e:.1e}" for c, e in b.approx_error.items())
            lines.append(
                f"| {name} | {b.forward_s * 1e3:.2f} | {b.backward_s * 1e3:.2f} | "
                f"{b.input_bytes / 2**20:.2f} | {b.saved_bytes / 2**20:.2f} | "
                f"{b.forward_peak_bytes / 2**20:.2f} | {b.backward_peak_bytes / 2**20:.2f} | "
                f"{'yes' if b.invertible else 'no'} | {errs} |"
            )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def _median_time(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def profile(
    blocks: nn.Sequential | Sequence[nn.Module],
    x: torch.Tensor,
    *,
    codecs: Sequence[str] = DEFAULT_CODECS,
    repeats: int = 5,
    device: str | torch.device | None = None,
    **kwargs: Any,
) -> Profile:
    """Profile the chain ``blocks`` on input ``x`` (keyword arguments reach every block).

    ``codecs``: the approx formats to price (``()`` for none). ``repeats``: timing repeats
    (median). ``device``: where memory is metered (default: ``x``'s device).
    """
    chain = list(blocks)
    if not chain:
        raise InvalidArgumentError("profile needs a non-empty chain of blocks")
    if not all(isinstance(b, nn.Module) for b in chain):
        raise InvalidInputTypeError("profile needs nn.Module blocks (an nn.Sequential or a list)")
    if not isinstance(x, torch.Tensor):
        raise InvalidInputTypeError(f"profile(blocks, x): x must be a tensor, got {type(x)}")
    if repeats < 1:
        raise InvalidArgumentError(f"repeats={repeats}: pass at least 1")
    names = (
        tuple(n for n, _ in blocks.named_children())
        if isinstance(blocks, nn.Sequential)
        else tuple(str(i) for i in range(len(chain)))
    )
    meter_device = device if device is not None else x.device
    params = [p for b in chain for p in b.parameters() if p.requires_grad]
    grads = [p.grad for p in params]
    buffers = [(b, b.detach().clone()) for blk in chain for b in blk.buffers()]
    rng = torch.random.get_rng_state()
    costs = []
    current = x.detach()
    try:
        for p in params:  # steady state: gradients exist
            p.grad = torch.zeros_like(p)
        for block in chain:
            costs.append(_profile_block(block, current, codecs, repeats, meter_device, kwargs))
            with torch.no_grad():
                current = block(current, **kwargs).detach()
    finally:  # leave the model as it was: gradients, running statistics, RNG
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
        torch.random.set_rng_state(rng)
    return Profile(tuple(costs), names, _signature(x))


def _approx_step(
    block: nn.Module,
    leaf: torch.Tensor,
    grad_out: torch.Tensor,
    fmt: str,
    kwargs: dict[str, Any],
) -> None:
    approx_checkpoint(block, leaf, store=fmt, **kwargs).backward(grad_out)


def _saves_own_output(block: nn.Module, x: torch.Tensor, kwargs: dict[str, Any]) -> bool:
    """Whether the block's forward saves its own output for backward (e.g. a final ReLU)."""
    packed: set[int] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        packed.add(t.untyped_storage()._cdata)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = block(x, **kwargs)
    return y.untyped_storage()._cdata in packed


def _profile_block(
    block: nn.Module,
    x: torch.Tensor,
    codecs: Sequence[str],
    repeats: int,
    device: Any,
    kwargs: dict[str, Any],
) -> BlockCost:
    leaf = x.detach().requires_grad_(x.is_floating_point())
    with MemoryMeter(device) as fwd:
        y = block(leaf, **kwargs)
    if not isinstance(y, torch.Tensor):
        raise InvalidInputTypeError(
            f"the scheduler handles chains of blocks returning one tensor; {type(block).__name__} "
            f"returned {type(y).__name__}"
        )
    out_bytes = _nbytes(y)
    saved = max(0, fwd.end_bytes - out_bytes)
    output_saved = _saves_own_output(block, leaf, kwargs)
    grad_out = torch.randn_like(y)
    del y
    params = [p for p in block.parameters() if p.requires_grad]
    wrt = ([leaf] if leaf.requires_grad else []) + params
    # Backward transients, metered together with their forward so that saved tensors freed
    # during the backward count as freed: the peak above the level when backward starts
    # (saved tensors, the output, its gradient alive). ``tb`` accumulates into ``.grad`` (the
    # steady state), ``tc`` returns the gradients (kept, as inside one approx/reversible node).
    # ``tk``: the same for the block checkpointed (its recompute and backward together).
    transients = []
    # ``tr``: the same for an invertible block run reversibly (nothing stored; the input is
    # rebuilt from the output in backward).
    modes = ["accumulate", "capture", "checkpoint"]
    if isinstance(block, ReversibleUnit):
        modes.append("reversible")
        reversible = ReversibleSequential(block.block, split_dim=block.split_dim)
    for mode in modes:
        leaf.grad = None
        with MemoryMeter(device) as meter:
            if mode == "checkpoint":
                y = checkpoint(block, leaf, **kwargs)
            elif mode == "reversible":
                y = reversible(leaf, **kwargs)
            else:
                y = block(leaf, **kwargs)
            g = grad_out.clone()
            start = meter.live_bytes
            meter.reset_peak()
            if not wrt:
                pass
            elif mode == "capture":
                grads = torch.autograd.grad(y, wrt, g, allow_unused=True)
                del grads
            else:
                y.backward(g)
            del y, g
        transients.append(max(0, meter.since_reset_peak_bytes - start))
    leaf.grad = None
    with torch.no_grad(), MemoryMeter(device) as nograd:
        z = block(leaf.detach(), **kwargs)
    del z

    def forward() -> None:
        block(leaf, **kwargs)

    def step() -> None:
        block(leaf, **kwargs).backward(grad_out)

    forward()
    f = _median_time(forward, repeats)
    # each strategy's step against the stored step, in rotated rounds (time_ratios)
    steps: dict[str, Callable[[], Any]] = {STORE: step}
    if wrt:
        steps[CHECKPOINT] = lambda: checkpoint(block, leaf, **kwargs).backward(grad_out)
        if isinstance(block, ReversibleUnit):
            steps[REVERSIBLE] = lambda: reversible(leaf, **kwargs).backward(grad_out)
        if x.is_floating_point():
            for fmt in codecs:
                steps[APPROX_PREFIX + fmt] = functools.partial(
                    _approx_step, block, leaf, grad_out, fmt, kwargs
                )
    ratios = time_ratios(steps, baseline=STORE, repeats=repeats, warmup=1)
    fb = ratios[STORE].baseline_seconds
    overhead = {s: max(0.0, (r.ratio - 1.0) * fb) for s, r in ratios.items() if s != STORE}
    leaf.grad = None
    approx_bytes: dict[str, int] = {}
    approx_error: dict[str, float] = {}
    if x.is_floating_point() and codecs:
        for fmt in codecs:
            codec = Approx(store=fmt).codec
            assert codec is not None
            approx_bytes[fmt] = codec.encode(x).nbytes
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # kinks: the estimate is what the plan reports
            approx_error = estimate_totals([block], x, list(codecs), probes=4)
    return BlockCost(
        forward_s=f,
        backward_s=max(fb - f, 0.0),
        input_bytes=_nbytes(x),
        output_bytes=out_bytes,
        saved_bytes=saved,
        forward_peak_bytes=fwd.peak_bytes,
        forward_peak_nograd_bytes=nograd.peak_bytes,
        backward_peak_bytes=transients[0],
        backward_capture_peak_bytes=transients[1],
        checkpoint_peak_bytes=transients[2],
        reversible_peak_bytes=transients[3] if len(transients) > 3 else None,
        output_saved=output_saved,
        strategy_overhead_s=overhead,
        invertible=isinstance(block, ReversibleUnit),
        param_bytes=sum(_nbytes(p) for p in params),
        approx_bytes=approx_bytes,
        approx_error=approx_error,
    )
