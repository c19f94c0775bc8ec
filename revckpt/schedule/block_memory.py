"""What a block keeps for backward and the transient peaks of its forward and backward, in
every mode a plan can run it in, metered by :class:`~revckpt.MemoryMeter` (see
:class:`~revckpt.schedule.costs.BlockCost` for what each figure means; the runs and the metered
steps are in :mod:`.block_runs`).

:func:`memory_costs` gives every memory field of a block's ``BlockCost``; the helpers below it
answer one question each (does the forward save its input, its own output; which operations'
outputs hold the output; what a selective policy keeps; what offload moves).
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import SAC_IGNORED_OPS

from .._module_state import copy_bytes
from .._numbers import tensor_bytes
from ..approx import Approx, NonFiniteInputError
from ..checkpoint import checkpoint, parse_policy
from ..layers import ReversibleSequential, ReversibleUnit
from ..measure import MemoryMeter
from ..measure.timing import wall_time
from ..offload import record as offload_record
from ..strategy import Strategy
from .block_runs import (
    PLAIN_MODES,
    _Metered,
    _metered_modes,
    _Runs,
    activation,
    check_output,
    compress_alone,
    inner_input,
)
from .cost_records import ApproxCost, CompressCost, OffloadCost, ReplayCost, SelectiveCost
from .costs import APPROX, CHECKPOINT, COMPRESS, OFFLOAD, REVERSIBLE, SELECTIVE

__all__ = ["activation", "memory_costs", "saves_input"]


def _storage_key(t: torch.Tensor) -> int | None:
    """The address of ``t``'s storage (shared by its views), or None for a tensor without one
    (sparse, nested)."""
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def _tensor_keys(tree: Any) -> list[int]:
    keys = (_storage_key(t) for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor))
    return [k for k in keys if k is not None]


class _StorageWriters(TorchDispatchMode):
    """Per storage of the forward, the aten operations (packets) whose outputs hold it: the one
    that allocated it, then every view, in-place or ``out=`` operation returning it.

    A storage is known by its address, which a storage freed during the forward hands on to
    a later one: keeping the first operation seen at an address named a freed temporary's
    producer (the output's answer followed the allocator's reuse). Every tensor a call takes
    is alive during the call, so an output holding none of its inputs' storages holds one the
    call allocated: whatever was recorded at that address belonged to a dead storage and is
    replaced. An output holding an input's storage adds its operation to that storage's. This
    keeps no tensor alive (keeping every output would raise the forward's memory to the sum of
    its intermediates). Operations a selective policy never sees (``SAC_IGNORED_OPS``:
    ``detach``, shape queries) are not recorded."""

    def __init__(self) -> None:
        super().__init__()
        self.writers: dict[int, set[Any]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = set(_tensor_keys((args, kwargs)))
        for key in _tensor_keys(out):
            if key not in inputs:  # allocated by this call
                self.writers[key] = set()
            if func not in SAC_IGNORED_OPS:
                self.writers.setdefault(key, set()).add(func.overloadpacket)
        return out


def _output_ops(block: nn.Module, x: torch.Tensor, kwargs: dict[str, Any]) -> frozenset[Any]:
    """The aten operations (packets) whose outputs hold the block's output storage: a selective
    policy keeping any of them keeps the output (torch's selective checkpoint keeps a kept
    operation's outputs, so their storage, until backward)."""
    with torch.no_grad(), _StorageWriters() as mode:
        y = block(x, **kwargs)
    return _ops_holding(mode, y)


def _ops_holding(mode: Any, y: torch.Tensor) -> frozenset[Any]:
    """The operations ``mode`` (a :class:`_StorageWriters`, else none) saw writing ``y``'s
    storage."""
    key = _storage_key(y)
    if not isinstance(mode, _StorageWriters) or key is None:
        return frozenset()
    return frozenset(mode.writers.get(key, ()))


def _saved_storages(
    block: nn.Module, x: torch.Tensor, kwargs: dict[str, Any]
) -> tuple[set[int], int]:
    """The storages the block's forward on ``x`` saves for backward, and its output's."""
    packed: set[int] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.layout == torch.strided:  # (a sparse tensor has no storage: not the input's)
            packed.add(t.untyped_storage()._cdata)
        return t.detach()  # no reference cycle through a saved output's grad_fn (a leak)

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


def _check_bytes(x: torch.Tensor, unit: ReversibleUnit) -> int:
    """What a reversible stack starting with this block keeps for its default invertibility
    check: up to 64 elements of each half of its input."""
    return sum(min(64, h.numel()) * h.element_size() for h in x.chunk(2, dim=unit.split_dim))


def _loss_bytes(like: torch.Tensor, device: Any) -> int:
    """Bytes of a scalar loss and its gradient on the metered device, as the allocator gives
    them (a scalar takes a whole allocator block on CUDA)."""
    with MemoryMeter(device) as meter:
        loss = like.sum()
        grad = torch.ones_like(loss)
    del loss, grad
    return meter.end_bytes


def _offload_costs(
    block: nn.Module, leaf: torch.Tensor, kwargs: dict[str, Any], repeats: int
) -> OffloadCost:
    """Bytes of the block input that stay on the device when it is offloaded (measured: its
    bytes minus what :mod:`revckpt.offload` moved), and the median time of copying what moved
    back to the device (saved when the copy is prefetched)."""
    with offload_record() as stats:
        y = checkpoint(block, activation(leaf), strategy=OFFLOAD, **kwargs)
    del y
    kept = max(0, tensor_bytes(leaf) - stats.to_host_bytes)
    if stats.to_host_bytes == 0:
        return OffloadCost(kept, 0.0)
    pinned = leaf.device.type == "cuda"
    host = leaf.detach().to("cpu").pin_memory() if pinned else leaf.detach().clone()
    fetch = statistics.median(
        wall_time(lambda: host.to(leaf.device, non_blocking=pinned)) for _ in range(repeats)
    )
    return OffloadCost(kept, fetch)


def compressed_sizes(
    x: torch.Tensor, codecs: Sequence[str], device: Any = None
) -> tuple[dict[str, int], dict[str, int]]:
    """Per codec, the bytes of ``x`` compressed and the peak live bytes of compressing it
    (temporaries included; none for an input that is not floating)."""
    if not x.is_floating_point():
        return {}, {}
    sizes, peaks = {}, {}
    for codec_name in codecs:
        codec = Approx(store=codec_name).codec
        assert codec is not None
        with MemoryMeter(device if device is not None else x.device) as meter:
            encoded = codec.encode(x)
        sizes[codec_name], peaks[codec_name] = encoded.nbytes, max(meter.peak_bytes, encoded.nbytes)
        del encoded
    return sizes, peaks


@dataclass(frozen=True)
class BlockMemory:
    """The memory fields of a block's ``BlockCost`` (``fields``), and what the timing needs of
    the run that measured them: the output's gradient used and the block's runner."""

    fields: dict[str, Any]
    grad_out: torch.Tensor
    runs: _Runs


def memory_costs(
    block: nn.Module,
    leaf: torch.Tensor,
    codecs: Sequence[str],
    policies: Sequence[str],
    device: Any,
    kwargs: dict[str, Any],
    *,
    compress: Sequence[str] = (),
    offload: bool = False,
    grads_new: bool = False,
    output: torch.Tensor | None = None,
    capture: bool = True,
) -> BlockMemory:
    """Every memory figure of ``block`` on the input ``leaf`` (a leaf requiring grad if
    floating): bytes kept, transient peaks per mode, replay state, what policies keep.
    ``output``: the block's output on ``leaf`` where the caller has it (any copy of it: only
    its size and layout are used); the stored forward's figures then come from the metered
    ``accumulate`` step instead of a forward of their own. ``capture=False`` leaves out the
    step with the gradients returned (``backward_capture_peak_bytes``, which only approx,
    offload and reversible segments read) where the caller plans none of them."""
    stored: tuple[int, int] | None = None  # what the stored forward keeps, its peak
    if output is None:
        output, stored = _stored_forward(block, leaf, kwargs, device)
    out_bytes = tensor_bytes(output)
    grad_out = torch.randn_like(output)
    del output
    params = [p for p in block.parameters() if p.requires_grad]
    wrt = ([leaf] if leaf.requires_grad else []) + params
    approx_bytes, encode_peaks = compressed_sizes(leaf.detach(), codecs, device)
    reversible = _reversible(block)
    capture = capture or bool(codecs) or offload or reversible is not None
    modes = _Modes.of(
        leaf, policies, approx_bytes, compress, reversible is not None, offload, capture
    )
    inner = inner_input(leaf) if modes.compress else None
    runs = _Runs(block, leaf, wrt, kwargs, reversible, inner)
    accounted = {modes.approx[codec]: n for codec, n in approx_bytes.items()}
    alone = {}
    for c, mode in modes.compress.items():  # the forward alone: what it keeps, its peak
        try:
            alone[c] = compress_alone(runs, mode, device, out_bytes)
        except NonFiniteInputError:
            continue  # it saves an inf or nan (a -inf mask's log_softmax): not for compress
        # the metered step runs on runs.inner, made before its meter: without the input
        accounted[mode] = alone[c][0] - (tensor_bytes(leaf) if alone[c][2] else 0)
    if len(alone) < len(modes.compress):  # priced without what cannot run
        modes = _Modes.of(
            leaf, policies, approx_bytes, list(alone), reversible is not None,
            offload, capture,
        )  # fmt: skip
    metered = _metered_modes(
        runs, modes.all, grad_out, accounted, device, backward=bool(wrt), grads_new=grads_new
    )
    leaf.grad = None
    saved, forward_peak = metered.forward["accumulate"] if stored is None else stored
    fields = {
        "input_bytes": tensor_bytes(leaf),
        "output_bytes": out_bytes,
        "saved_bytes": saved,
        "forward_peak_bytes": forward_peak,
        **_alone_fields(runs, modes, metered, device, offload),
        **modes.transient_fields(metered, copy_bytes(block)),
        "param_bytes": sum(tensor_bytes(p) for p in params),
        "approx": {c: ApproxCost(n, encode_peaks[c]) for c, n in approx_bytes.items()},
        "compress": {
            c: CompressCost(kept, peak, metered.transient[modes.compress[c]], input_exact=exact)
            for c, (kept, peak, exact) in alone.items()
        },
        "loss_bytes": _loss_bytes(grad_out, device),
        "reversible_check_bytes": _check_bytes(leaf, block) if reversible is not None else 0,
        "grads_new": grads_new,
    }
    return BlockMemory(fields, grad_out, runs)


def _stored_forward(
    block: nn.Module, leaf: torch.Tensor, kwargs: dict[str, Any], device: Any
) -> tuple[torch.Tensor, tuple[int, int]]:
    """The block's stored forward on ``leaf``, metered: its output (detached), and the bytes
    it keeps besides the output and its peak."""
    with MemoryMeter(device) as fwd:
        y = check_output(block, block(leaf, **kwargs))
    return y.detach(), (max(0, fwd.end_bytes - tensor_bytes(y)), fwd.peak_bytes)


@dataclass(frozen=True)
class _Modes:
    """The modes metered for a block, in the order they are metered (``all``), and the text
    form of each by what it runs with: per selective policy, per codec, per compress format."""

    all: list[str]
    selective: dict[str, str]
    approx: dict[str, str]
    compress: dict[str, str]

    @classmethod
    def of(
        cls,
        leaf: torch.Tensor,
        policies: Sequence[str],
        codecs: Sequence[str],
        compress: Sequence[str],
        reversible: bool,
        offload: bool,
        capture: bool = True,
    ) -> _Modes:
        """Per plain mode (``capture`` where asked), checkpoint, every selective policy and
        codec, compress (for a floating input), reversible and offload where they apply."""
        selective = {p: str(Strategy(SELECTIVE, p)) for p in policies}
        approx = {codec: str(Strategy(APPROX, codec)) for codec in codecs}
        floating = leaf.is_floating_point()
        formats = {c: str(Strategy(COMPRESS, c)) for c in compress} if floating else {}
        modes = [
            *(m for m in PLAIN_MODES if capture or m != "capture"),
            CHECKPOINT,
            *selective.values(),
            *approx.values(),
            *formats.values(),
        ]
        if reversible:
            modes.append(REVERSIBLE)
        if offload:
            modes.append(OFFLOAD)
        return cls(modes, selective, approx, formats)

    def transient_fields(self, metered: _Metered, copies: int) -> dict[str, Any]:
        """The fields of the metered steps: backward transients per mode, replay state (per
        recomputing mode, what it keeps and what outlives its backward, in metering order;
        ``copies``: the block's copies of module state, :func:`copy_bytes`, part of it)."""
        transients = metered.transient
        return {
            "backward_peak_bytes": transients["accumulate"],
            "backward_capture_peak_bytes": transients.get("capture"),
            "checkpoint_peak_bytes": transients["checkpoint"],
            "reversible_peak_bytes": transients.get("reversible"),
            "replay": {
                m: ReplayCost(metered.rng.get(m), metered.late.get(m), copies)
                for m in dict.fromkeys([*metered.late, *metered.rng])
            },
        }


def _alone_fields(
    runs: _Runs, modes: _Modes, metered: _Metered, device: Any, offload: bool
) -> dict[str, Any]:
    """The fields measured by running the block on its own, outside the metered steps: the
    no-grad forward's peak, what it saves, offload's figures; and each selective policy's
    from its metered step (:func:`_selective`)."""
    block, leaf, kwargs = runs.block, runs.leaf, runs.kwargs
    # which operations hold the output (for the selective policies), seen in the same run
    writers = _StorageWriters() if modes.selective else contextlib.nullcontext()
    try:
        with torch.no_grad(), writers, MemoryMeter(device) as nograd:
            z = block(leaf.detach(), **kwargs)
    except RuntimeError:
        # a block that differentiates inside its forward (torch.autograd.grad on its input:
        # a physics-informed or energy model) runs with autograd on only, as a checkpointed
        # forward runs it: measured so (its graph's bytes too: above, never below)
        writers = _StorageWriters() if modes.selective else contextlib.nullcontext()
        with torch.enable_grad(), writers, MemoryMeter(device) as nograd:
            z = block(leaf.detach(), **kwargs)
    output_ops = _ops_holding(writers, z)
    del z
    moved = _offload_costs(block, leaf, kwargs, 3) if offload else None
    return {
        "forward_peak_nograd_bytes": nograd.peak_bytes,
        "selective": _selective(modes.selective, metered, output_ops),
        "output_saved": _saves_own_output(block, leaf, kwargs),
        "invertible": isinstance(block, ReversibleUnit),
        "offload": moved,
    }


def _reversible(block: nn.Module) -> ReversibleSequential | None:
    """For a reversible unit, a stack of it alone, without the invertibility check (its
    samples are kept once per stack, not per block: ``reversible_check_bytes``)."""
    if not isinstance(block, ReversibleUnit):
        return None
    return ReversibleSequential(block.block, split_dim=block.split_dim, check_inverse=None)


def _selective(
    policies: dict[str, str], metered: _Metered, output_ops: frozenset[Any]
) -> dict[str, SelectiveCost]:
    """Per policy (``policies``: its mode by policy), from its metered step: what its forward
    keeps (its replay state included) and its peak, its backward transient; whether it keeps
    the output (``output_ops``: the operations whose outputs hold it)."""
    costs = {}
    for policy, mode in policies.items():
        if mode not in metered.forward:
            continue  # the block cannot run with it (see _metered_modes)
        kept, peak = metered.forward[mode]
        # a policy that keeps an operation whose output holds the block output keeps it
        kept_output = not output_ops.isdisjoint(parse_policy(policy))
        costs[policy] = SelectiveCost(kept, peak, metered.transient[mode], kept_output)
    return costs
