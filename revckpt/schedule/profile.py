"""Measure what the scheduler needs about each block of a chain.

:func:`profile` gives, per block, every figure of :class:`~revckpt.schedule.costs.BlockCost`:

* memory (:mod:`.block_memory`): the bytes its forward saves, its input and output bytes,
  whether it saves its own output, the transient peaks of its forward and backward in every
  mode a plan can run it in, the replay state each recomputing strategy keeps, what each
  selective policy keeps, the compressed size of its input per codec, what offload moves;
* time (:mod:`.probe`): its stored forward and backward and each strategy's extra time,
  measured *inside the chain's step* in a few mixed rounds, and what it adds inside a longer
  checkpoint segment; what the rounds did not reach is timed on the block alone
  (:mod:`.block_time`);
* error (:mod:`.block_errors`): per codec, the relative errors of its parameter and input
  gradients when its input goes through the codec, with the chain's cotangent, and the
  weights of the chain's error model.

Identical blocks (same class, structure, parameter shapes, input shape: a *group*) are
metered once and time their strategies together; only the codec errors are per block (they
depend on each block's input and weights). Backward is measured in steady state: parameter
gradients already exist, as from the second training step on. The model's gradients,
buffers (BatchNorm statistics) and RNG state are left as they were.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..checkpoint import canonical_policy
from ..errors import InvalidArgumentError, InvalidInputTypeError
from ..measure.state import preserved
from ..strategy import Strategy
from .block_errors import codec_errors, compress_errors, sensitivities
from .block_memory import memory_costs
from .block_time import block_times, codec_seconds, derived_codecs
from .compiled import compiled_costs
from .costs import (
    APPROX,
    CHECKPOINT,
    COMPRESS,
    OFFLOAD,
    REVERSIBLE,
    SELECTIVE,
    STORE,
    BlockCost,
)
from .ops import op_choices
from .probe import InChain, probe_chain
from .step import StepCosts

__all__ = ["Profile", "profile", "profile_block"]

DEFAULT_CODECS = ("bf16", "e4m3")
DEFAULT_POLICIES = ("matmul+attention",)
AUTO = "auto"  # policies chosen per block from its operations (op_choices)
Progress = Callable[[int, int], None]


def _signature(x: torch.Tensor) -> tuple[tuple[int, ...], str, str]:
    return tuple(x.shape), str(x.dtype), x.device.type


@dataclass(frozen=True)
class Profile:
    """Per-block costs of a chain, the block names, and the example input's signature;
    ``step``: for a profile made in situ (:func:`revckpt.fit`), the whole training step's
    costs outside the chain, which the predictions then include; ``threads``: the intra-op
    threads it was timed with (``torch.get_num_threads()``: its times hold for that count);
    ``seconds``: what profiling took; ``compiled``: its costs are those of the blocks run
    under ``torch.compile`` (``profile(..., compiled=True)``)."""

    blocks: tuple[BlockCost, ...]
    names: tuple[str, ...]
    input_signature: tuple[tuple[int, ...], str, str] | None
    step: StepCosts | None = None
    threads: int | None = None
    seconds: float | None = None
    compiled: bool = False

    @property
    def cost_in_steps(self) -> float | None:
        """What profiling took, in training steps of the stored chain (``seconds`` over the
        measured forward+backward time of every block)."""
        base = sum(b.forward_s + b.backward_s for b in self.blocks)
        if self.seconds is None or base <= 0:
            return None
        return self.seconds / base

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


def profile(
    blocks: nn.Sequential | Sequence[nn.Module],
    x: torch.Tensor,
    *,
    codecs: Sequence[str] = DEFAULT_CODECS,
    policies: Sequence[str] | str = DEFAULT_POLICIES,
    compress: Sequence[str] = (),
    repeats: int = 5,
    rounds: int = 1,
    device: str | torch.device | None = None,
    offload: bool | None = None,
    compiled: bool = False,
    progress: Progress | None = None,
    **kwargs: Any,
) -> Profile:
    """Profile the chain ``blocks`` on input ``x`` (keyword arguments reach every block).

    ``codecs``: the approx formats to price (``()`` for none). ``policies``: the selective
    recompute policies to price: specs (:func:`revckpt.checkpoint.parse_policy`: presets of
    :data:`revckpt.POLICY_PRESETS`, or groups and aten operations joined by ``"+"``; ``()``
    for none), or ``"auto"``: per group of identical blocks, the nested keep-sets
    :func:`~revckpt.schedule.ops.op_choices` proposes from the block's own operations (what
    each keeps against what recomputing it costs), the solver then choosing one per block.
    ``compress``: the formats to price for compressed saved activations
    (:func:`revckpt.approx.compress_saved`; default none: each costs one more run of every
    block to measure its error, and on a CPU its codec time makes it slower than recomputing).
    ``repeats``: timing rounds of a block timed on its own (what the in-chain rounds did not
    reach). ``rounds``: how many times the in-chain timing steps run (each round adds two
    steps, rotated; more rounds average out a noisy machine, see :mod:`.probe`).
    ``device``: where memory is metered (default: ``x``'s device). ``offload``: price
    host offload (:mod:`revckpt.offload`): how many of each block input's bytes leave the
    device and the time of the copies; default ``None``, on when ``x`` is on a CUDA device (on
    the CPU the host is the device: offload saves nothing there, and is priced so only when
    asked). ``compiled``: price the strategies as they run under ``torch.compile`` (each
    group's block compiled per strategy, its bytes metered with the allocator meter and its
    times measured compiled, :mod:`.compiled`): store, checkpoint and the selective
    ``policies`` only, for a plan the caller runs as ``torch.compile(apply(blocks, plan))``.
    ``progress(done, total)``: called as the work advances (a progress bar).
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
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise InvalidArgumentError(f"rounds={rounds!r}: pass an int >= 1")
    if offload is None:
        offload = x.device.type == "cuda"
    elif not isinstance(offload, bool):
        raise InvalidArgumentError(f"offload={offload!r}: pass True, False or None (auto)")
    if not isinstance(compiled, bool):
        raise InvalidArgumentError(f"compiled={compiled!r}: pass True or False")
    if compiled and (offload or compress):
        raise InvalidArgumentError(
            "compiled=True prices store, checkpoint and selective only: drop offload and "
            "compress, or profile eagerly"
        )
    auto = isinstance(policies, str) and policies == AUTO
    if not auto:
        if isinstance(policies, str):
            raise InvalidInputTypeError(
                f"policies={policies!r}: pass a list of policies (e.g. ['matmul+attention']) or "
                f"{AUTO!r}"
            )
        policies = tuple(canonical_policy(p) for p in policies)  # raises on a bad spec
    names = (
        tuple(n for n, _ in blocks.named_children())
        if isinstance(blocks, nn.Sequential)
        else tuple(str(i) for i in range(len(chain)))
    )
    started = time.perf_counter()
    job = _Chain(
        chain,
        x,
        () if compiled else tuple(codecs),
        AUTO if auto else tuple(policies),
        tuple(compress),
        repeats,
        rounds,
        device or x.device,
        kwargs,
        compiled,
    )
    rng_devices = [x.device] if x.device.type == "cuda" else []
    # leave the model as it was: gradients, running statistics, RNG
    with torch.random.fork_rng(devices=rng_devices), torch.enable_grad(), preserved(chain):
        costs = job.run(offload=offload, progress=progress)
    return Profile(
        tuple(costs),
        names,
        _signature(x),
        threads=torch.get_num_threads(),
        seconds=time.perf_counter() - started,
        compiled=compiled,
    )


def _describe(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return ("T", tuple(obj.shape), str(obj.dtype), obj.device.type, obj.requires_grad)
    if isinstance(obj, (tuple, list)):
        return tuple(_describe(o) for o in obj)
    if isinstance(obj, dict):
        return tuple((k, _describe(v)) for k, v in obj.items())
    return obj if obj is None or isinstance(obj, (bool, int, float, str)) else id(obj)


def same_costs_key(block: nn.Module, x: torch.Tensor, kwargs: dict[str, Any]) -> Any:
    """Blocks with equal keys cost the same bytes and, up to noise, the same time: the same
    class and structure, parameter and buffer shapes, mode and input shapes."""
    params = tuple(
        (n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in block.named_parameters()
    )
    buffers = tuple((n, tuple(b.shape), str(b.dtype)) for n, b in block.named_buffers())
    return (
        type(block),
        repr(block),
        params,
        buffers,
        block.training,
        _describe(x),
        _describe(kwargs),
    )


@dataclass
class _Chain:
    """One profiling job (see :func:`profile`)."""

    chain: list[nn.Module]
    x: torch.Tensor
    codecs: tuple[str, ...]
    policies: tuple[str, ...] | str  # or AUTO
    compress: tuple[str, ...]
    repeats: int
    rounds: int
    device: Any
    kwargs: dict[str, Any]
    compiled: bool = False

    def run(self, *, offload: bool, progress: Progress | None) -> list[BlockCost]:
        chain, kw = self.chain, self.kwargs
        floating = self.x.is_floating_point()
        codecs = self.codecs if floating else ()
        compress = self.compress if floating else ()
        weights = sensitivities(chain, self.x, kw) if codecs or compress else None
        inputs = _inputs(chain, self.x, kw) if weights is None else weights.inputs
        keys = [same_costs_key(b, h, kw) for b, h in zip(chain, inputs, strict=True)]
        groups = [keys.index(k) for k in keys]  # a group: its first block's index
        reps = sorted(set(groups))
        errors_needed = [i for i, h in enumerate(inputs) if weights and h.is_floating_point()]
        tick = _Ticker(progress, len(reps) + 1 + len(errors_needed))
        params = [p for b in chain for p in b.parameters() if p.requires_grad]
        for p in params:  # steady state: gradients exist
            p.grad = torch.zeros_like(p)
        memory = {}
        for g in reps:
            leaf = inputs[g].requires_grad_(inputs[g].is_floating_point())
            memory[g] = memory_costs(
                chain[g],
                leaf,
                codecs,
                self._policies(chain[g], inputs[g]),
                self.device,
                kw,
                compress=compress,
                offload=offload,
            )
            tick()
        if self.compiled:
            return self._compiled(memory, groups, tick)
        options = [self._options(memory[g].fields, inputs[g], offload) for g in groups]
        grad = memory[groups[-1]].grad_out
        probed = probe_chain(
            chain, self.x, grad, kw, groups, options, rounds=self.rounds, warm=weights is not None
        )
        tick()
        costs = []
        times = {g: self._times(g, memory[g], inputs[g], options[g], probed) for g in reps}
        for i, block in enumerate(chain):
            g = groups[i]
            fields = dict(memory[g].fields)
            fields.update(times[g])
            if weights is not None and i in errors_needed:
                fields.update(self._errors(block, inputs[i], weights, i, fields))
                tick()
            costs.append(BlockCost(**fields))
        return costs

    def _compiled(self, memory: dict[int, Any], groups: list[int], tick: Any) -> list[BlockCost]:
        """Every block's costs compiled: each group's eager fields (sizes, random states), its
        bytes and times replaced by the compiled ones; nothing reversible (see ``compiled``)."""
        fields = {}
        for g in sorted(set(groups)):
            f = dict(memory[g].fields, invertible=False, reversible_peak_bytes=None)
            options = [CHECKPOINT, *(str(Strategy(SELECTIVE, p)) for p in f["selective_bytes"])]
            runs = memory[g].runs
            f.update(
                compiled_costs(
                    self.chain[g],
                    runs.leaf,
                    memory[g].grad_out,
                    options,
                    self.kwargs,
                    repeats=self.repeats,
                    device=self.device,
                )
            )
            fields[g] = f
        tick()
        return [BlockCost(**fields[g]) for g in groups]

    def _policies(self, block: nn.Module, x: torch.Tensor) -> tuple[str, ...]:
        if self.policies != AUTO:
            return tuple(self.policies)
        found = [c.spec for c in op_choices(block, x, kwargs=self.kwargs, max_choices=3)]
        return tuple(dict.fromkeys([*found, *DEFAULT_POLICIES]))

    def _errors(
        self, block: nn.Module, x: torch.Tensor, weights: Any, i: int, fields: dict[str, Any]
    ) -> dict[str, Any]:
        """The error fields of block ``i`` (input ``x``): per codec for approx and compress,
        and the weights of the chain's error model."""
        args = (weights.cotangents[i], self.kwargs, weights.exact[i])
        measured = codec_errors(block, x, list(fields["approx_bytes"]), *args)
        out: dict[str, Any] = {
            "approx_error": measured.parameters,
            "approx_input_error": measured.input_gradient,
            "approx_perturbation": measured.perturbation,
            "approx_amplification": measured.amplification,
            "grad_sq": weights.grad_sq[i],
            "upstream_grad_sq": weights.input_sq + sum(weights.grad_sq[:i]),
            "chain_grad_sq": weights.input_sq + sum(weights.grad_sq),
        }
        if fields["compress_bytes"]:
            r, q = compress_errors(block, x, list(fields["compress_bytes"]), *args)
            out.update(compress_error=r, compress_input_error=q)
        return out

    def _options(self, fields: dict[str, Any], x: torch.Tensor, offload: bool) -> list[str]:
        """The one-block strategies a block can run with, store first."""
        opts = [STORE, CHECKPOINT]
        if fields["approx_bytes"]:
            opts.append(str(Strategy(APPROX, next(iter(fields["approx_bytes"])))))
        opts += [str(Strategy(SELECTIVE, p)) for p in fields["selective_bytes"]]
        opts += [str(Strategy(COMPRESS, c)) for c in fields["compress_bytes"]]
        if fields["invertible"]:
            opts.append(REVERSIBLE)
        if offload:
            opts.append(OFFLOAD)
        return opts

    def _times(
        self, g: int, memory: Any, x: torch.Tensor, options: list[str], probed: InChain
    ) -> dict[str, Any]:
        """The time fields of group ``g``: in-chain where measured, else the block alone."""
        f, b = probed.forward_s[g], probed.backward_s[g]
        overhead = dict(probed.overhead_s[g])
        missing = [s for s in options if s != STORE and s not in overhead]
        if missing or math.isnan(f):  # nan: never stored in the rounds
            leaf = memory.runs.leaf
            reversible = memory.runs.reversible
            alone = block_times(
                self.chain[g],
                leaf,
                memory.grad_out,
                missing,
                self.kwargs,
                self.repeats,
                reversible=reversible,
            )
            if math.isnan(f):
                f, b = alone[0], alone[1]
            for s in missing:
                if s in alone[2]:
                    overhead[s] = alone[2][s]
        if memory.fields["approx_bytes"]:
            codec_s = codec_seconds(x, list(memory.fields["approx_bytes"]))
            overhead = derived_codecs(overhead, codec_s, next(iter(memory.fields["approx_bytes"])))
        chained = probed.chained_s[g]
        if chained is None:  # no saving assumed: as its own node
            chained = overhead.get(CHECKPOINT, f)
        return {
            "forward_s": f,
            "backward_s": b,
            "strategy_overhead_s": overhead,
            "chained_s": chained,
        }


class _Ticker:
    def __init__(self, progress: Progress | None, total: int) -> None:
        self.progress, self.total, self.done = progress, total, 0
        if progress is not None:
            progress(0, total)

    def __call__(self) -> None:
        self.done += 1
        if self.progress is not None:
            self.progress(min(self.done, self.total), self.total)


def _inputs(
    chain: Sequence[nn.Module], x: torch.Tensor, kwargs: dict[str, Any]
) -> list[torch.Tensor]:
    """Every block's input in the chain (detached)."""
    inputs, h = [], x.detach()
    with torch.no_grad():
        for block in chain:
            inputs.append(h)
            h = block(h, **kwargs)
            if not isinstance(h, torch.Tensor):
                raise InvalidInputTypeError(
                    "the scheduler handles chains of blocks returning one tensor; "
                    f"{type(block).__name__} returned {type(h).__name__}"
                )
            h = h.detach()
    return inputs


def profile_block(
    block: nn.Module,
    x: torch.Tensor,
    *,
    codecs: Sequence[str],
    policies: Sequence[str],
    repeats: int,
    device: Any,
    kwargs: dict[str, Any],
    cotangent: torch.Tensor | None = None,
    compress: Sequence[str] = (),
    offload: bool = False,
    grads_new: bool = False,
) -> BlockCost:
    """Every figure of one block on input ``x``, its times measured on the block alone (what
    :func:`revckpt.fit` does for a model's blocks, each on its own arguments)."""
    leaf = x.detach().requires_grad_(x.is_floating_point())
    memory = memory_costs(
        block,
        leaf,
        codecs,
        policies,
        device,
        kwargs,
        compress=compress,
        offload=offload,
        grads_new=grads_new,
    )
    fields = dict(memory.fields)
    strategies = [CHECKPOINT, *(str(Strategy(SELECTIVE, p)) for p in policies)]
    strategies += [str(Strategy(COMPRESS, c)) for c in fields["compress_bytes"]]
    codecs_priced = list(fields["approx_bytes"])
    if codecs_priced:
        strategies.append(str(Strategy(APPROX, codecs_priced[0])))
    if fields["invertible"]:
        strategies.append(REVERSIBLE)
    if offload:
        strategies.append(OFFLOAD)
    f, b, overhead = block_times(
        block,
        leaf,
        memory.grad_out,
        strategies,
        kwargs,
        repeats,
        reversible=memory.runs.reversible,
    )
    if codecs_priced:
        overhead = derived_codecs(overhead, codec_seconds(x, codecs_priced), codecs_priced[0])
        measured = codec_errors(block, x, codecs_priced, cotangent, kwargs)
        fields.update(
            approx_error=measured.parameters,
            approx_input_error=measured.input_gradient,
            approx_perturbation=measured.perturbation,
            approx_amplification=measured.amplification,
        )
    if fields["compress_bytes"]:
        r, q = compress_errors(block, x, list(fields["compress_bytes"]), cotangent, kwargs)
        fields.update(compress_error=r, compress_input_error=q)
    fields.update(
        forward_s=f,
        backward_s=b,
        strategy_overhead_s=overhead,
        chained_s=overhead.get(CHECKPOINT, f),
    )
    return BlockCost(**fields)
