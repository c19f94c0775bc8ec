"""Measure what the scheduler needs about each block of a chain.

:func:`profile` runs the chain block by block on example inputs and records, per block (see
:class:`~revckpt.schedule.costs.BlockCost`): forward and backward time (median of ``repeats``)
and each strategy's extra time over storing (:func:`~revckpt.time_ratios`); the bytes its
forward saves for backward apart from its input, its input and output bytes, whether it saves
its own output; the transient peaks of its forward (recording and not) and of its backward in
every mode a plan can run it in (all from :class:`~revckpt.MemoryMeter`); per recomputing
strategy, the bytes of forward-time state its forward keeps for the replay beyond what the cost
model counts (the generator states of a block that draws random numbers: dropout) and what of
them is still alive after its backward; the bytes of a scalar loss and its gradient; whether it
is invertible (a :class:`~revckpt.layers.ReversibleUnit`); per selective policy what it keeps;
and per codec the compressed size of its input and, measured in float64 with the chain's
cotangent, the relative errors of its parameter and input gradients when that input goes
through the codec. One backward of the whole chain gives every block's gradient norm (the
weights of the errors). Backward is measured in steady state: parameter gradients already
exist, so their accumulation allocates only temporaries, as from the second training step on.
The model's gradients, buffers (BatchNorm statistics) and RNG state are left as they were.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.modules.batchnorm import _NormBase
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..approx import Approx
from ..approx import checkpoint as approx_checkpoint
from ..checkpoint import POLICY_PRESETS, checkpoint
from ..errors import InvalidArgumentError, InvalidInputTypeError
from ..layers import ReversibleSequential, ReversibleUnit
from ..measure import MemoryMeter, TensorError, time_ratios
from ..measure.state import preserved
from ..measure.timing import wall_time
from ..offload import checkpoint as offload_checkpoint
from ..offload import record as offload_record
from ..strategy import Strategy, argument_of, kind_of
from .costs import (
    APPROX,
    CHECKPOINT,
    OFFLOAD,
    REVERSIBLE,
    SELECTIVE,
    STORE,
    BlockCost,
)
from .step import StepCosts

__all__ = ["Profile", "profile"]

DEFAULT_CODECS = ("bf16", "e4m3", "e5m2")
DEFAULT_POLICIES = ("matmul+attention",)
# metered modes that are not strategies: the block stored, its gradients accumulated into
# .grad or returned
_PLAIN_MODES = ("accumulate", "capture")


def _signature(x: torch.Tensor) -> tuple[tuple[int, ...], str, str]:
    return tuple(x.shape), str(x.dtype), x.device.type


@dataclass(frozen=True)
class Profile:
    """Per-block costs of a chain, the block names, and the example input's signature;
    ``step``: for a profile made in situ (:func:`revckpt.fit`), the whole training step's
    costs outside the chain, which the predictions then include."""

    blocks: tuple[BlockCost, ...]
    names: tuple[str, ...]
    input_signature: tuple[tuple[int, ...], str, str] | None
    step: StepCosts | None = None

    def table(self) -> str:
        """Markdown: per block times, bytes, transient peaks, invertibility, codec errors."""
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
    return statistics.median(wall_time(fn) for _ in range(repeats))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def profile(
    blocks: nn.Sequential | Sequence[nn.Module],
    x: torch.Tensor,
    *,
    codecs: Sequence[str] = DEFAULT_CODECS,
    policies: Sequence[str] = DEFAULT_POLICIES,
    repeats: int = 5,
    device: str | torch.device | None = None,
    offload: bool | None = None,
    **kwargs: Any,
) -> Profile:
    """Profile the chain ``blocks`` on input ``x`` (keyword arguments reach every block).

    ``codecs``: the approx formats to price (``()`` for none). ``policies``: the selective
    recompute presets to price (names in :data:`revckpt.POLICY_PRESETS`; ``()`` for none).
    ``repeats``: timing repeats (median). ``device``: where memory is metered (default:
    ``x``'s device). ``offload``: price host offload (:mod:`revckpt.offload`): how many of each
    block input's bytes leave the device and the time of the copies; default ``None``, on
    when ``x`` is on a CUDA device (on the CPU the host is the device: offload saves nothing
    there, and is priced so only when asked).
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
    if offload is None:
        offload = x.device.type == "cuda"
    elif not isinstance(offload, bool):
        raise InvalidArgumentError(f"offload={offload!r}: pass True, False or None (auto)")
    unknown = [p for p in policies if p not in POLICY_PRESETS]
    if unknown:
        raise InvalidArgumentError(
            f"unknown selective-recompute policies {unknown}; choose from {sorted(POLICY_PRESETS)}"
        )
    names = (
        tuple(n for n, _ in blocks.named_children())
        if isinstance(blocks, nn.Sequential)
        else tuple(str(i) for i in range(len(chain)))
    )
    meter_device = device if device is not None else x.device
    rng_devices = [x.device] if x.device.type == "cuda" else []
    # leave the model as it was: gradients, running statistics, RNG
    with torch.random.fork_rng(devices=rng_devices), torch.enable_grad(), preserved(chain):
        costs = _profile_chain(
            chain, x, codecs, policies, repeats, meter_device, kwargs, offload=offload
        )
    return Profile(tuple(costs), names, _signature(x))


def _profile_chain(
    chain: Sequence[nn.Module],
    x: torch.Tensor,
    codecs: Sequence[str],
    policies: Sequence[str],
    repeats: int,
    meter_device: Any,
    kwargs: dict[str, Any],
    *,
    offload: bool,
) -> list[BlockCost]:
    params = [p for b in chain for p in b.parameters() if p.requires_grad]
    costs = []
    current = x.detach()
    cotangents, grad_sq, input_sq = _sensitivities(chain, x, kwargs)
    for p in params:  # steady state: gradients exist
        p.grad = torch.zeros_like(p)
    # the chain input's gradient flows on to what comes before the chain: it counts among the
    # gradients an approx segment can perturb (U_0 = ||dL/dx||^2)
    upstream = input_sq
    total = input_sq + sum(grad_sq)
    for block, ct, sq in zip(chain, cotangents, grad_sq, strict=True):
        cost = _profile_block(
            block, current, codecs, policies, repeats, meter_device, kwargs, ct, offload=offload
        )
        costs.append(
            dataclasses.replace(cost, grad_sq=sq, upstream_grad_sq=upstream, chain_grad_sq=total)
        )
        upstream += sq
        with torch.no_grad():
            current = block(current, **kwargs).detach()
    return costs


def _sensitivities(
    chain: Sequence[nn.Module], x: torch.Tensor, kwargs: dict[str, Any]
) -> tuple[list[torch.Tensor | None], list[float], float]:
    """For a seeded random projection loss ``<w, y>`` of the chain output: the gradient with
    respect to every block's output (the cotangent block ``j`` sees in the chain), the squared
    norm of every block's parameter gradients, and that of the chain input's gradient."""
    leaf = x.detach().requires_grad_(x.is_floating_point())
    h = leaf
    outs = []
    for block in chain:
        h = block(h, **kwargs)
        if not isinstance(h, torch.Tensor):
            raise InvalidInputTypeError(
                "the scheduler handles chains of blocks returning one tensor; "
                f"{type(block).__name__} returned {type(h).__name__}"
            )
        outs.append(h)
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(h.shape, generator=gen).to(h.device, h.dtype if h.is_floating_point() else None)
    per_block = [[p for p in b.parameters() if p.requires_grad] for b in chain]
    flat = [p for ps in per_block for p in ps]
    inputs = [leaf] if leaf.requires_grad else []
    wrt = inputs + [o for o in outs[:-1] if o.requires_grad] + flat
    if not h.requires_grad or not wrt:
        return [None] * len(chain), [0.0] * len(chain), 0.0
    grads = torch.autograd.grad((h * w).sum(), wrt, allow_unused=True)
    by_id = {id(t): g for t, g in zip(wrt, grads, strict=True)}

    def sq(g: torch.Tensor | None) -> float:
        return 0.0 if g is None else float(g.double().pow(2).sum())

    cotangents = [by_id.get(id(o)) for o in outs[:-1]] + [w]
    grad_sq = [sum(sq(by_id[id(p)]) for p in ps) for ps in per_block]
    input_sq = sq(by_id.get(id(leaf))) if leaf.requires_grad else 0.0
    return [None if c is None else c.detach() for c in cotangents], grad_sq, input_sq


@dataclass(frozen=True)
class CodecErrors:
    """Per codec, measured on one block: relative errors of its parameter gradients and of its
    input gradient, how far the codec moves its input (relative), and how much a perturbation
    of its input grows through it (relative output change over relative input change)."""

    parameters: dict[str, float]
    input_gradient: dict[str, float]
    perturbation: dict[str, float]
    amplification: dict[str, float]


def _codec_errors(
    block: nn.Module,
    x: torch.Tensor,
    codecs: Sequence[str],
    cotangent: torch.Tensor | None,
    kwargs: dict[str, Any],
) -> CodecErrors:
    """Measured, per codec (see :class:`CodecErrors`), in float64 so that only the codec's
    error is seen, with the chain's cotangent. A direct measurement, not a linearisation: it
    sees ReLU kinks and saturation too."""
    block64 = copy.deepcopy(block).double()
    for m in block64.modules():
        if isinstance(m, _NormBase) and m.training:
            m.track_running_stats = False  # batch statistics, as in training, no updates
    params = [p for p in block64.parameters() if p.requires_grad]
    kw = {
        k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
        for k, v in kwargs.items()
    }
    seed = int(torch.randint(0, 2**31 - 1, ()))

    def grads(z: torch.Tensor) -> tuple[torch.Tensor, ...]:
        leaf = z.detach().double().requires_grad_(True)
        devices = [z.device] if z.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)  # the same dropout masks for every codec
            y = block64(leaf, **kw)
        ct = torch.ones_like(y) if cotangent is None else cotangent.detach().double()
        got = torch.autograd.grad(y, [leaf, *params], ct, allow_unused=True)
        flat = [g.reshape(-1) for g in got[1:] if g is not None]
        par = torch.cat(flat) if flat else torch.zeros(0, dtype=y.dtype)
        return got[0].reshape(-1), par, y.detach().reshape(-1), leaf.detach().reshape(-1)

    errors = CodecErrors({}, {}, {}, {})
    with sdpa_kernel(SDPBackend.MATH):
        exact_in, exact_par, exact_y, exact_x = grads(x)
        for fmt in codecs:
            codec = Approx(store=fmt).codec
            assert codec is not None
            got_in, got_par, got_y, got_x = grads(codec.roundtrip(x))
            errors.parameters[fmt] = _relative(got_par, exact_par)
            errors.input_gradient[fmt] = _relative(got_in, exact_in)
            moved = _relative(got_x, exact_x)
            errors.perturbation[fmt] = moved
            errors.amplification[fmt] = _relative(got_y, exact_y) / moved if moved > 0 else 1.0
    return errors


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return TensorError.between(a, b).rel_l2


def _wrapped_step(
    wrap: Callable[..., torch.Tensor],
    options: dict[str, Any],
    block: nn.Module,
    leaf: torch.Tensor,
    grad_out: torch.Tensor,
    kwargs: dict[str, Any],
) -> None:
    """One step of ``block`` run through ``wrap`` (a checkpoint function) with ``options``."""
    wrap(block, leaf, **options, **kwargs).backward(grad_out)


class _LastWriter(TorchDispatchMode):
    """Records, per output storage, the aten operation that produced it."""

    def __init__(self) -> None:
        super().__init__()
        self.producer: dict[int, Any] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                key = t.untyped_storage()._cdata
                self.producer.setdefault(key, func.overloadpacket)
        return out


def _output_op(block: nn.Module, x: torch.Tensor, kwargs: dict[str, Any]) -> Any:
    """The aten operation whose result holds the block's output (its storage)."""
    with torch.no_grad(), _LastWriter() as mode:
        y = block(x, **kwargs)
    return mode.producer.get(y.untyped_storage()._cdata)


def _saved_storages(
    block: nn.Module, x: torch.Tensor, kwargs: dict[str, Any]
) -> tuple[set[int], int]:
    """The storages the block's forward on ``x`` saves for backward, and its output's."""
    packed: set[int] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        packed.add(t.untyped_storage()._cdata)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = block(x, **kwargs)
    return packed, y.untyped_storage()._cdata


def saves_input(block: nn.Module, x: torch.Tensor, kwargs: dict[str, Any]) -> bool:
    """Whether the block's forward saves its input (or a view of it) for backward: if not,
    a stored block lets its input go once it has run (unless something else keeps it)."""
    leaf = x.detach().requires_grad_(x.is_floating_point())
    return leaf.untyped_storage()._cdata in _saved_storages(block, leaf, kwargs)[0]


def _saves_own_output(block: nn.Module, x: torch.Tensor, kwargs: dict[str, Any]) -> bool:
    """Whether the block's forward saves its own output for backward (e.g. a final ReLU)."""
    packed, output = _saved_storages(block, x, kwargs)
    return output in packed


def _profile_block(
    block: nn.Module,
    x: torch.Tensor,
    codecs: Sequence[str],
    policies: Sequence[str],
    repeats: int,
    device: Any,
    kwargs: dict[str, Any],
    cotangent: torch.Tensor | None = None,
    *,
    offload: bool = False,
    grads_new: bool = False,
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
    approx_bytes = _compressed_sizes(x, codecs)
    # Backward transients, metered together with their forward so that saved tensors freed
    # during the backward count as freed: the peak above the level when backward starts
    # (saved tensors, the output, its gradient alive). ``tb`` accumulates into ``.grad`` (the
    # steady state), ``tc`` returns the gradients (kept, as inside one approx/reversible node).
    # ``tk``: the same for the block checkpointed (its recompute and backward together).
    # ``tr``: the same for an invertible block run reversibly (nothing stored; the input is
    # rebuilt from the output in backward). Every recomputing mode also gives the replay state
    # its forward keeps and what of it outlives its backward.
    selective_modes = {p: str(Strategy(SELECTIVE, p)) for p in policies}  # text forms
    approx_modes = {fmt: str(Strategy(APPROX, fmt)) for fmt in approx_bytes}
    modes = [*_PLAIN_MODES, CHECKPOINT, *selective_modes.values(), *approx_modes.values()]
    reversible = None
    if isinstance(block, ReversibleUnit):
        modes.append(REVERSIBLE)
        # without the invertibility check: its samples are kept once per stack, not per
        # block (``reversible_check_bytes``)
        reversible = ReversibleSequential(
            block.block, split_dim=block.split_dim, check_inverse=None
        )
    if offload:
        modes.append(OFFLOAD)
    runs = _Runs(block, leaf, wrt, kwargs, reversible)
    accounted = {approx_modes[fmt]: n for fmt, n in approx_bytes.items()}
    metered = _metered_modes(
        runs, modes, grad_out, accounted, device, backward=bool(wrt), grads_new=grads_new
    )
    transients = metered.transient
    leaf.grad = None
    selective_bytes, selective_fwd = {}, {}
    output_op = _output_op(block, leaf.detach(), kwargs) if policies else None
    # a policy that keeps the operation producing the output keeps the output itself
    selective_kept = {p: output_op in POLICY_PRESETS[p] for p in policies}
    for policy in policies:  # the forward alone: what the policy keeps, and its peak
        with MemoryMeter(device) as meter:
            y = checkpoint(block, leaf, policy=policy, **kwargs)
        selective_bytes[policy] = max(0, meter.end_bytes - out_bytes)
        selective_fwd[policy] = meter.peak_bytes
        del y
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
            steps[REVERSIBLE] = lambda: runs.forward(REVERSIBLE).backward(grad_out)
        for policy in policies:
            steps[selective_modes[policy]] = functools.partial(
                _wrapped_step, checkpoint, {"policy": policy}, block, leaf, grad_out, kwargs
            )
        if x.is_floating_point():
            for fmt in codecs:
                steps[approx_modes[fmt]] = functools.partial(
                    _wrapped_step, approx_checkpoint, {"store": fmt}, block, leaf, grad_out, kwargs
                )
        if offload:  # a view: an activation, as inside a chain (a leaf would stay in place)
            steps[OFFLOAD] = lambda: offload_checkpoint(
                block, _activation(leaf), **kwargs
            ).backward(grad_out)
    offload_kept, fetch_s = None, 0.0
    if offload:
        offload_kept, fetch_s = _offload_costs(block, leaf, kwargs, repeats)
    ratios = time_ratios(steps, baseline=STORE, repeats=repeats, warmup=1)
    fb = ratios[STORE].baseline_seconds
    overhead = {s: max(0.0, (r.ratio - 1.0) * fb) for s, r in ratios.items() if s != STORE}
    leaf.grad = None
    approx_error: dict[str, float] = {}
    approx_input_error: dict[str, float] = {}
    perturbation: dict[str, float] = {}
    amplification: dict[str, float] = {}
    if approx_bytes:
        measured = _codec_errors(block, x, codecs, cotangent, kwargs)
        approx_error, approx_input_error = measured.parameters, measured.input_gradient
        perturbation, amplification = measured.perturbation, measured.amplification
    return BlockCost(
        forward_s=f,
        backward_s=max(fb - f, 0.0),
        input_bytes=_nbytes(x),
        output_bytes=out_bytes,
        saved_bytes=saved,
        forward_peak_bytes=fwd.peak_bytes,
        forward_peak_nograd_bytes=nograd.peak_bytes,
        backward_peak_bytes=transients["accumulate"],
        backward_capture_peak_bytes=transients["capture"],
        checkpoint_peak_bytes=transients["checkpoint"],
        reversible_peak_bytes=transients.get("reversible"),
        selective_bytes=selective_bytes,
        selective_forward_peak_bytes=selective_fwd,
        selective_backward_peak_bytes={p: transients[selective_modes[p]] for p in policies},
        selective_output_kept=selective_kept,
        output_saved=output_saved,
        strategy_overhead_s=overhead,
        invertible=isinstance(block, ReversibleUnit),
        param_bytes=sum(_nbytes(p) for p in params),
        approx_bytes=approx_bytes,
        approx_error=approx_error,
        approx_input_error=approx_input_error,
        approx_perturbation=perturbation,
        approx_amplification=amplification,
        offload_kept_bytes=offload_kept,
        offload_fetch_s=fetch_s,
        rng_bytes=metered.rng,
        rng_late_bytes=metered.late,
        loss_bytes=_loss_bytes(grad_out, device),
        reversible_check_bytes=_check_bytes(leaf, block) if reversible is not None else 0,
        grads_new=grads_new,
    )


def _check_bytes(x: torch.Tensor, unit: ReversibleUnit) -> int:
    """What a reversible stack starting with this block keeps for its default invertibility
    check: up to 64 elements of each half of its input."""
    return sum(min(64, h.numel()) * h.element_size() for h in x.chunk(2, dim=unit.split_dim))


def _compressed_sizes(x: torch.Tensor, codecs: Sequence[str]) -> dict[str, int]:
    """Per codec, the bytes of ``x`` compressed (none for an input that is not floating)."""
    if not x.is_floating_point():
        return {}
    sizes = {}
    for fmt in codecs:
        codec = Approx(store=fmt).codec
        assert codec is not None
        sizes[fmt] = codec.encode(x).nbytes
    return sizes


def _loss_bytes(like: torch.Tensor, device: Any) -> int:
    """Bytes of a scalar loss and its gradient on the metered device, as the allocator gives
    them (a scalar takes a whole allocator block on CUDA)."""
    with MemoryMeter(device) as meter:
        loss = like.sum()
        grad = torch.ones_like(loss)
    del loss, grad
    return meter.end_bytes


@dataclass(frozen=True)
class _Runs:
    """One block run with each strategy, on one input leaf."""

    block: nn.Module
    leaf: torch.Tensor
    wrt: list[torch.Tensor]
    kwargs: dict[str, Any]
    reversible: ReversibleSequential | None

    def forward(self, mode: str) -> torch.Tensor:
        block, leaf, kw = self.block, self.leaf, self.kwargs
        kind = None if mode in _PLAIN_MODES else kind_of(mode)
        if kind == CHECKPOINT:
            return checkpoint(block, leaf, **kw)
        if kind == SELECTIVE:
            return checkpoint(block, leaf, policy=argument_of(mode), **kw)
        if kind == APPROX:
            return approx_checkpoint(block, leaf, store=argument_of(mode), **kw)
        if kind == OFFLOAD:
            return offload_checkpoint(block, _activation(leaf), **kw)
        if kind == REVERSIBLE:
            assert self.reversible is not None
            return self.reversible(leaf, **kw)
        return block(leaf, **kw)


def _scalar_bytes(like: torch.Tensor) -> int:
    """Bytes of one scalar on ``like``'s device, as its memory meter counts them."""
    with MemoryMeter(like.device) as meter:
        t = like.new_ones(())
    del t
    return meter.end_bytes


class _Seed(torch.autograd.Function):
    """A scalar whose backward hands ``holder``'s one tensor to ``y`` as its gradient, so that
    the gradient is owned by the autograd engine (freed when used), as inside a model."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, holder: list[torch.Tensor]) -> torch.Tensor:
        ctx.holder = holder
        return y.new_zeros(())

    @staticmethod
    def backward(ctx: Any, _: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.holder.pop(), None


@dataclass(frozen=True)
class _Metered:
    """Per mode: the backward transient; per recomputing mode, the bytes its forward keeps
    beyond what the cost model counts for it (the replay state: generator states of a forward
    that draws random numbers) and what of them is still alive after its backward."""

    transient: dict[str, int]
    rng: dict[str, int]
    late: dict[str, int]


def _metered_modes(
    runs: _Runs,
    modes: Sequence[str],
    grad_out: torch.Tensor,
    accounted: dict[str, int],
    device: Any,
    *,
    backward: bool,
    grads_new: bool = False,
) -> _Metered:
    """One metered step per mode: ``capture`` returns the gradients, the others accumulate
    them; ``accounted``: per mode, the bytes its forward keeps that the cost model counts
    (the compressed input of approx). ``grads_new``: the parameter gradients are ``None``
    before each step (created by it, counted in its transients) rather than existing.
    Selective modes count their replay state in what they keep (``selective_bytes``): only
    what outlives their backward is recorded here."""
    metered = _Metered({}, {}, {})
    leaf = runs.leaf
    params = [t for t in runs.wrt if t is not leaf]
    for mode in modes:
        leaf.grad = None
        if grads_new:
            for p in params:
                p.grad = None
        with MemoryMeter(device) as meter:
            y = runs.forward(mode)
            kept = meter.live_bytes - _nbytes(y) - accounted.get(mode, 0)
            # the output's gradient reaches the block as it does in a model: made by the
            # backward, freed once the block's last operation has used it (not held here)
            holder = [grad_out.clone()]
            seed = _Seed.apply(y, holder) if backward else y.new_zeros(())
            # nor is the output held: in a model it is gone by the block's backward unless the
            # block saved it (then it counts in the transient until the backward frees it). A
            # reversible stack rebuilds from its output, which its caller holds (the model
            # counts it), so there it stays.
            out_bytes = _nbytes(y)
            kept_output = [y] if mode == REVERSIBLE else []
            start = meter.live_bytes - (0 if kept_output else out_bytes)
            del y
            meter.reset_peak()
            if backward and mode == "capture":
                grads = torch.autograd.grad(seed, runs.wrt, allow_unused=True)
                del grads
            elif backward:
                seed.backward()
            grads_made = 0 if leaf.grad is None else _nbytes(leaf.grad)
            if grads_new:
                grads_made += sum(_nbytes(p.grad) for p in params if p.grad is not None)
            held = _nbytes(seed) + sum(_nbytes(t) for t in holder) + out_bytes * len(kept_output)
            left = meter.live_bytes - held - grads_made
            del seed, holder, kept_output
        # less the seed's own gradient (a scalar the engine makes first; a model's loss
        # gradient is counted with the loss)
        seed_grad = _scalar_bytes(grad_out) if backward else 0
        metered.transient[mode] = max(0, meter.since_reset_peak_bytes - start - seed_grad)
        if mode in _PLAIN_MODES:
            continue
        if kind_of(mode) != SELECTIVE:
            metered.rng[mode] = max(0, kept)
        if backward:
            metered.late[mode] = max(0, min(left, kept))
    return metered


def _activation(leaf: torch.Tensor) -> torch.Tensor:
    return leaf.view_as(leaf) if leaf.requires_grad else leaf


def _offload_costs(
    block: nn.Module, leaf: torch.Tensor, kwargs: dict[str, Any], repeats: int
) -> tuple[int, float]:
    """Bytes of the block input that stay on the device when it is offloaded (measured: its
    bytes minus what :mod:`revckpt.offload` moved), and the median time of copying what moved
    back to the device (saved when the copy is prefetched)."""
    with offload_record() as stats:
        y = offload_checkpoint(block, _activation(leaf), **kwargs)
    del y
    kept = max(0, _nbytes(leaf) - stats.to_host_bytes)
    if stats.to_host_bytes == 0:
        return kept, 0.0
    pinned = leaf.device.type == "cuda"
    host = leaf.detach().to("cpu").pin_memory() if pinned else leaf.detach().clone()
    fetch = _median_time(lambda: host.to(leaf.device, non_blocking=pinned), repeats)
    return kept, fetch
