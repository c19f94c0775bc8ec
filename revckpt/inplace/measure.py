"""Profile a model's blocks in situ: each block on the arguments the model really gave it.

Each traced call becomes a one-input unit (:class:`InSitu`: the block with its other arguments
fixed, returning its hidden state), which the chain profiler measures as it measures any
block (:mod:`revckpt.schedule.profile`), with the parameter gradients created by the step
(``grads_new``). Blocks of one class called on arguments of the same shapes cost the same
bytes and, up to noise, the same time: such a block is measured once and its costs reused;
only the codec errors (which depend on each block's input, weights and place in the chain)
are measured per block.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ..measure.state import preserved
from ..schedule.block_errors import error_fields, perturbations
from ..schedule.block_memory import saves_input
from ..schedule.block_profile import profile_block
from ..schedule.costs import BlockCost
from ..schedule.error_samples import checked_stride, sampled_errors
from ..schedule.profile import Profile
from ..schedule.sensitivities import sensitivities
from .calls import Key, hidden_of, replaced, run_with
from .trace import Call, Trace

__all__ = ["InSitu", "profile_in_situ"]


class InSitu(nn.Module):
    """A traced block call as a unit of one input: ``unit(h)`` runs the block with ``h`` as its
    hidden state and the rest of the arguments it was called with, and returns its hidden
    state."""

    def __init__(self, call: Call) -> None:
        super().__init__()
        self.block = call.block
        self.fqn = call.fqn
        self._key: Key = call.key
        args, kwargs = replaced(call.args, call.kwargs, call.key, None)
        # other arguments made with a graph (T5's position bias, a U-Net's skip tensor) become
        # leaves: the traced step's graph is gone, and the block's backward still computes
        # their gradients, as in the model. They are the unit's keyword arguments too
        # (``extras``): a strategy's node differentiates its keyword tensors, not the tensors a
        # module holds
        self._leaves: list[torch.Tensor] = []
        self._args, self._kwargs = self._detached(args), self._detached(kwargs)

    def _detached(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor) and obj.requires_grad:
            leaf = obj.detach().requires_grad_()
            self._leaves.append(leaf)
            return leaf
        if isinstance(obj, (tuple, list)):
            return type(obj)(self._detached(o) for o in obj)
        if isinstance(obj, dict):
            return {k: self._detached(v) for k, v in obj.items()}
        return obj

    @property
    def revckpt_label(self) -> str:
        """How messages name it: the block it runs (fit's profile of it)."""
        return f"{type(self.block).__name__} ({self.fqn})"

    @property
    def extras(self) -> dict[str, torch.Tensor]:
        """The other arguments made with a graph, as keyword arguments of :meth:`forward`."""
        return {f"extra{i}": leaf for i, leaf in enumerate(self._leaves)}

    def forward(self, h: torch.Tensor, **extras: torch.Tensor) -> torch.Tensor:
        for leaf in self._leaves:  # each profiled step makes their gradients anew
            leaf.grad = None
        args, kwargs = self._args, self._kwargs
        if extras:  # in place of the leaves they stand for
            given = {id(leaf): extras[name] for name, leaf in self.extras.items()}

            def swap(t: torch.Tensor) -> torch.Tensor:
                return given.get(id(t), t)

            args, kwargs = _mapped(args, swap), _mapped(kwargs, swap)
        out = run_with(self.block, args, kwargs, self._key, h)
        return hidden_of(out, f"block {self.fqn}")

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
        """``.to(dtype)`` converts the arguments it holds too (the error model's float32 copy
        of a bfloat16 block: a bf16 additive mask given positionally reached float32 queries,
        torch's raw error); the leaves are substituted by ``extras`` as they are given."""
        super()._apply(fn, recurse)
        leaves = {id(leaf) for leaf in self._leaves}

        def convert(t: torch.Tensor) -> torch.Tensor:
            return t if id(t) in leaves else fn(t)

        self._args, self._kwargs = _mapped(self._args, convert), _mapped(self._kwargs, convert)
        return self


def _mapped(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``obj`` with ``fn`` applied to every tensor in it (in tuples, lists and dicts)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, (tuple, list)):
        return type(obj)(_mapped(o, fn) for o in obj)
    if isinstance(obj, dict):
        return {k: _mapped(v, fn) for k, v in obj.items()}
    return obj


def _signature(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return ("T", tuple(obj.shape), str(obj.dtype), obj.device.type, obj.requires_grad)
    if isinstance(obj, (tuple, list)):
        return (type(obj).__name__, tuple(_signature(o) for o in obj))
    if isinstance(obj, dict):
        return ("dict", tuple((k, _signature(v)) for k, v in obj.items()))
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    return ("obj", type(obj).__qualname__, id(obj))


def _same_costs_key(call: Call) -> Any:
    params = tuple(
        (n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in call.block.named_parameters()
    )
    return (
        type(call.block),
        repr(call.block),
        params,
        call.key,
        _signature(call.args),
        _signature(call.kwargs),
        call.block.training,
    )


def block_errors(
    unit: nn.Module, x: torch.Tensor, cost: BlockCost, weights: Any, i: int, reuse: bool
) -> dict[str, Any]:
    """Block ``i``'s own codec errors (approx and compress), for the codecs ``cost`` priced;
    ``reuse``: ``x`` is the block's input in the chain ``weights`` ran (its exact gradients
    there spare the exact run)."""
    # the exact run is this block's own, on its traced input: the chain of units the weights
    # come from may differ from the model where code runs between blocks
    cotangent = weights.cotangents[i]
    exact = weights.exact[i] if reuse else None
    return error_fields(unit, x, cost.approx, cost.compress, cotangent, unit.extras, exact)


def profile_in_situ(
    model: nn.Module,
    trace: Trace,
    *,
    codecs: Sequence[str] = (),
    policies: Sequence[str] = ("matmul+attention",),
    compress: Sequence[str] = (),
    repeats: int = 3,
    error_stride: int = 1,
    progress: Callable[[int, int], None] | None = None,
) -> Profile:
    """The :class:`~revckpt.schedule.Profile` of the traced blocks, with the whole step's
    costs outside them (``step``), so that plans solved on it predict the whole step.
    ``error_stride``: as :func:`revckpt.schedule.profile`'s (``k > 1``: the codec errors run on
    every ``k``-th block of a group of blocks of the same costs and its last, interpolated
    between: :mod:`revckpt.schedule.error_samples`)."""
    error_stride = checked_stride(error_stride)
    units = [InSitu(c) for c in trace.calls]
    inputs = [c.input.detach() for c in trace.calls]
    device = inputs[0].device
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.enable_grad(), preserved(model):
        priced = bool(codecs or compress)  # errors to measure: per block
        # the chain of units is the model's, each with parameters of its own
        chain_exact = priced and trace.chained and _own_parameters(units)
        if priced:
            weights = _weights(trace, units, inputs[0])
            if chain_exact:  # each block's input in that chain, on which its exact run was made
                inputs = list(weights.inputs)
        costs: list[BlockCost] = []
        reuse: dict[Any, BlockCost] = {}
        keys = [_same_costs_key(c) for c in trace.calls]
        groups = [keys.index(k) for k in keys]  # a group: its first block's index
        for i, (unit, x) in enumerate(zip(units, inputs, strict=True)):
            key = keys[i]
            if progress is not None:
                progress(i, len(units))
            cost = reuse.get(key)
            if cost is None:
                cost = reuse[key] = profile_block(
                    unit,
                    x,
                    codecs=codecs,
                    policies=policies,
                    compress=compress,
                    repeats=repeats,
                    device=device,
                    kwargs=unit.extras,
                    cotangent=weights.cotangents[i] if priced else None,
                    grads_new=True,
                    output=trace.calls[i].output,  # no stored forward of its own
                    capture=False,  # fit plans no offload or reversible segment
                    exact=weights.exact[i] if chain_exact else None,
                )
            costs.append(cost)  # bytes and times shared; the errors are each block's own
        if priced:

            def run(i: int) -> dict[str, Any]:
                if groups[i] == i:  # its group's profile measured them
                    return _errors_of(costs[i])
                return block_errors(units[i], inputs[i], costs[i], weights, i, chain_exact)

            def moved(i: int, codecs: list[str]) -> dict[str, float]:
                return perturbations(inputs[i], codecs)

            errors = sampled_errors(range(len(units)), groups, error_stride, run, moved)
            costs = [
                _weighted(dataclasses.replace(c, **errors[i]), weights, i)
                for i, c in enumerate(costs)
            ]
        if progress is not None:
            progress(len(units), len(units))
        costs = _with_inputs_kept(trace, units, inputs, costs)
    names = tuple(c.fqn for c in trace.calls)
    step = _step_outside(trace.step, costs)
    return Profile(tuple(costs), names, None, step=step, threads=torch.get_num_threads())


def _with_inputs_kept(
    trace: Trace, units: Sequence[nn.Module], inputs: Sequence[torch.Tensor], costs: list[BlockCost]
) -> list[BlockCost]:
    """``costs`` with whether each block's input stays alive: when the block saves it, the
    block before saves its output, or code outside the blocks saves it (``input_held``); the
    first block's input counts as held, as by the caller of a chain. Blocks of the same costs
    save the same."""
    saves: dict[Any, bool] = {}
    kept = [True]
    held = trace.input_held or (False,) * len(units)
    for i in range(1, len(units)):
        key = _same_costs_key(trace.calls[i])
        if key not in saves:
            saves[key] = saves_input(units[i], inputs[i], {})
        kept.append(saves[key] or costs[i - 1].output_saved or held[i])
    return [
        dataclasses.replace(c, input_kept=k, input_held=h)
        for c, k, h in zip(costs, kept, held, strict=True)
    ]


def _weights(trace: Trace, units: Sequence[nn.Module], x: torch.Tensor) -> Any:
    """The error model's weights: the traced step's (:func:`~revckpt.inplace.trace.trace`
    with ``gradients=True``: the chain's projection from its graph, or the model's own loss
    where the blocks form no chain, as code between blocks must run), else the chain of
    units run on ``x``."""
    if trace.gradients is not None:
        return trace.gradients
    if not trace.chained:
        raise AssertionError("trace(..., gradients=True) for blocks that form no chain")
    return sensitivities(units, x, {})


def _own_parameters(units: Sequence[nn.Module]) -> bool:
    """No parameter belongs to two of ``units`` (a block called twice, tied weights): each
    unit's parameter gradients in the chain are then its own."""
    ids = [id(p) for u in units for p in u.parameters()]
    return len(ids) == len(set(ids))


def _step_outside(step: Any, costs: list[BlockCost]) -> Any:
    """The traced step's costs outside the blocks, corrected for where the chain ends."""
    if not costs[-1].input_kept:
        # the trace marks the chain's end inside the last block's call, where its caller still
        # holds the block's input; it goes right after, so the head runs without it
        x = costs[-1].input_bytes
        step = dataclasses.replace(step, head=step.head + x, backward_held=step.backward_held + x)
    if costs[-1].output_saved:
        # the trace measures what the head leaves alive when the chain output's gradient
        # arrives; it counts that gradient, and the output is still alive there only because
        # the last block saved it (its own backward frees it, counted in its transient)
        step = dataclasses.replace(step, backward_held=step.backward_held - costs[-1].output_bytes)
    return step


def _errors_of(cost: BlockCost) -> dict[str, Any]:
    return {k: v for k, v in (("approx", cost.approx), ("compress", cost.compress)) if v}


def _weighted(cost: BlockCost, weights: Any, i: int) -> BlockCost:
    """Block ``i``'s cost with the weights of the chain's error model."""
    return dataclasses.replace(cost, grad_norms=weights.norms(i))
