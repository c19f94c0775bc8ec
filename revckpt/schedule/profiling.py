"""One profiling job of :func:`~revckpt.schedule.profile`: the chain's identical blocks grouped,
each group metered once, the chain timed in a few mixed rounds, the codec errors measured per
block."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

from ..engine.rehearsal import Rehearsal
from ..engine.rerun import any_changed, input_versions
from ..layers import ReversibleUnit
from ..strategy import Strategy
from .block_errors import error_fields, perturbations
from .block_memory import memory_costs
from .block_profile import one_block_strategies
from .block_runs import changes_its_input, check_output
from .block_time import block_times, codec_seconds, derived_codecs
from .compiled import compiled_costs
from .costs import CHECKPOINT, SELECTIVE, STORE, BlockCost, Segment
from .error_samples import sampled_errors
from .ops import op_choices
from .probe import InChain, probe_chain, timed_step
from .sensitivities import Sensitivities, StepRecord, projection

DEFAULT_POLICIES = ("matmul+attention",)
AUTO = "auto"  # policies chosen per block from its operations (op_choices)
Progress = Callable[[int, int], None]


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
class _ProfilingJob:
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
    error_stride: int = 1  # codec errors run on every error_stride-th block of a group

    def run(self, *, offload: bool, progress: Progress | None) -> list[BlockCost]:
        chain, kw = self.chain, self.kwargs
        floating = self.x.is_floating_point()
        codecs = self.codecs if floating else ()
        compress = self.compress if floating else ()
        params = [p for b in chain for p in b.parameters() if p.requires_grad]
        inputs = _inputs(chain, self.x, kw)
        keys = [same_costs_key(b, h, kw) for b, h in zip(chain, inputs, strict=True)]
        groups = [keys.index(k) for k in keys]  # a group: its first block's index
        reps = sorted(set(groups))
        priced = bool(codecs or compress)
        errors_needed = [i for i, h in enumerate(inputs) if priced and h.is_floating_point()]
        tick = _Ticker(progress, len(reps) + 1 + len(errors_needed))
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
                output=inputs[g + 1] if g + 1 < len(inputs) else None,  # the next block's input
            )
            tick()
        if self.compiled:
            return self._compiled(memory, groups, tick)
        options = [one_block_strategies(memory[g].fields, offload) for g in groups]
        # after the metering, which ran every distinct block forward and backward: the kernels
        # of every shape are then warm (the stored step's times are all some groups get)
        record = StepRecord(self.x.device)
        stored, weights = self._stored_step(params, record, priced)
        grad = record.cotangents[len(chain) - 1]
        if weights is not None:  # the inputs of the step the error model's figures come from
            inputs = weights.inputs
        del record  # what nothing prices (every block's output gradient) goes
        probed = probe_chain(
            chain,
            self.x,
            grad,
            kw,
            groups,
            options,
            rounds=self.rounds,
            stored=stored,
            inputs=inputs,
        )
        tick()
        roundtrips: dict[int, dict[str, list[float]]] = {g: {} for g in reps}  # timed

        def run(i: int) -> dict[str, Any]:
            g = groups[i]
            return self._errors(chain[i], inputs[i], weights, i, memory[g], roundtrips[g])

        def moved(i: int, codecs: list[str]) -> dict[str, float]:
            return perturbations(inputs[i], codecs, roundtrips[groups[i]])

        errors = sampled_errors(errors_needed, groups, self.error_stride, run, moved, tick)
        for i, fields in errors.items():
            fields["grad_norms"] = weights.norms(i)
        costs = []
        for g in reps:
            times = self._times(g, memory[g], inputs[g], options[g], probed, roundtrips[g])
            memory[g].fields.update(times)
        for i in range(len(chain)):
            fields = {**memory[groups[i]].fields, **errors.get(i, {})}
            split_dim = chain[i].split_dim if isinstance(chain[i], ReversibleUnit) else None
            costs.append(BlockCost(**fields, split_dim=split_dim))  # not in a group's key
        return costs

    def _stored_step(
        self, params: list[nn.Parameter], record: StepRecord, priced: bool
    ) -> tuple[list[tuple[float, float]], Sensitivities | None]:
        """The chain's step with every block stored, timed (the probe's stored step), its
        output's gradient the error model's :func:`~.sensitivities.projection`, recording
        what the error model needs (``record``); its times and, where errors are ``priced``,
        the error model's :class:`~.sensitivities.Sensitivities`. Each block revckpt has not
        learnt yet (the metered ones have been) is rehearsed as a recomputed block's first
        call (:class:`~revckpt.engine.rehearsal.Rehearsal`: its forward here captured, then
        replayed once right after it): the strategy steps after it time one recomputed call
        per block, which was otherwise each block's first in a process's first profile of a
        chain, and read one-block checkpointing about 1.1x high. Costs a forward of each such
        block."""
        stored = [Segment(i, i + 1, STORE) for i in range(len(self.chain))]
        rehearsal = Rehearsal(self.kwargs)
        with record.watching(params):
            times = timed_step(
                self.chain,
                stored,
                self.x,
                projection,
                self.kwargs,
                record=record,
                rehearsal=rehearsal,
            )
        return times, record.sensitivities(self.chain) if priced else None

    def _compiled(self, memory: dict[int, Any], groups: list[int], tick: Any) -> list[BlockCost]:
        """Every block's costs compiled: each group's eager fields (sizes, random states), its
        bytes and times replaced by the compiled ones; nothing reversible (see ``compiled``)."""
        fields = {}
        for g in sorted(set(groups)):
            f = dict(memory[g].fields, invertible=False, reversible_peak_bytes=None)
            options = [CHECKPOINT, *(str(Strategy(SELECTIVE, p)) for p in f["selective"])]
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
        self,
        block: nn.Module,
        x: torch.Tensor,
        weights: Any,
        i: int,
        memory: Any,
        roundtrips: dict[str, list[float]],
    ) -> dict[str, Any]:
        """The error fields of block ``i`` (input ``x``): per codec for approx and compress;
        each codec's round trip timed into ``roundtrips``."""
        fields = memory.fields
        args = (weights.cotangents[i], self.kwargs, weights.exact[i], roundtrips)
        return error_fields(block, x, fields["approx"], fields["compress"], *args)

    def _times(
        self,
        g: int,
        memory: Any,
        x: torch.Tensor,
        options: list[str],
        probed: InChain,
        roundtrips: dict[str, list[float]],
    ) -> dict[str, Any]:
        """The time fields of group ``g``: in-chain where measured, else the block alone; its
        codecs' times from the round trips its blocks' error runs timed (``roundtrips``),
        else timed here."""
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
        if memory.fields["approx"]:
            codecs = list(memory.fields["approx"])
            if all(roundtrips.get(c) for c in codecs):
                codec_s = {c: statistics.median(roundtrips[c]) for c in codecs}
            else:
                codec_s = codec_seconds(x, codecs)
            overhead = derived_codecs(overhead, codec_s, next(iter(memory.fields["approx"])))
        chained = probed.chained_s[g]
        if chained is None:  # no saving assumed: as its own node
            chained = overhead.get(CHECKPOINT, f)
        return {
            "forward_s": f,
            "backward_s": b,
            "strategy_overhead_s": overhead,
            "chained_s": chained,
            "stacked_s": probed.stacked_s[g],
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
    """Every block's input in the chain (detached); raises for a block that changes its input
    in place (:func:`~.block_runs.changes_its_input`), before any other run of the blocks: on
    copies of the input and keyword tensors, so the caller's are unchanged whatever the blocks
    do."""
    inputs, h = [], x.detach().clone()
    kwargs = tree_map_only(torch.Tensor, lambda t: t.detach().clone(), kwargs)
    with torch.no_grad():
        for i, block in enumerate(chain):
            inputs.append(h)
            versions = input_versions((h,), kwargs)
            h = check_output(block, block(h, **kwargs)).detach()
            if any_changed(versions):
                raise changes_its_input(str(i), block)
    return inputs
