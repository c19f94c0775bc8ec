"""The error model's weights, from one backward of the chain: its *sensitivities*.

:func:`sensitivities` runs the chain once with a seeded random projection loss ``<w, y>``
(:func:`projection`): every block's output cotangent, the squared norms of every block's
parameter gradients (the weights of the chain's error model,
:func:`revckpt.schedule.costs.segment_cost`) and each block's exact gradients and random
state, which :mod:`.block_errors` compares the codecs' runs with. A step that runs anyway
gives them without a run of its own: the profile's stored step, recorded as it runs
(:class:`StepRecord`), or a traced step's graph (:func:`chain_sensitivities`,
:func:`step_sensitivities`).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .block_runs import check_output
from .cost_records import GradNorms

__all__ = [
    "Exact",
    "Sensitivities",
    "StepRecord",
    "chain_sensitivities",
    "projection",
    "rng_state",
    "sensitivities",
    "step_sensitivities",
]


@dataclass(frozen=True)
class Exact:
    """One block's exact gradients in the chain (flattened): of its input and of its
    parameters, its output, and the generator states its forward started from."""

    input_grad: torch.Tensor
    param_grad: torch.Tensor
    output: torch.Tensor
    rng: tuple[torch.Tensor, list[torch.Tensor]]


@dataclass(frozen=True)
class Sensitivities:
    """For a seeded random projection loss ``<w, y>`` of the chain output: the gradient with
    respect to every block's output (the cotangent block ``j`` sees in the chain), the squared
    norm of every block's parameter gradients, that of the chain input's gradient, and per
    block its :class:`Exact` gradients (``None`` where it has none) and its input."""

    cotangents: list[torch.Tensor | None]
    grad_sq: list[float]
    input_sq: float
    exact: list[Exact | None]
    inputs: list[torch.Tensor]  # every block's input (detached)

    def norms(self, i: int) -> GradNorms:
        """Block ``i``'s weights in the chain's error model (:class:`GradNorms`)."""
        return GradNorms(
            own_sq=self.grad_sq[i],
            upstream_sq=self.input_sq + sum(self.grad_sq[:i]),
            chain_sq=self.input_sq + sum(self.grad_sq),
        )


def rng_state(device: torch.device) -> tuple[torch.Tensor, list[torch.Tensor]]:
    cuda = [torch.cuda.get_rng_state(device)] if device.type == "cuda" else []
    return torch.get_rng_state(), cuda


def sensitivities(
    chain: Sequence[nn.Module], x: torch.Tensor, kwargs: dict[str, Any]
) -> Sensitivities:
    """:class:`Sensitivities` of the chain on ``x``: one forward and backward."""
    leaf = x.detach().requires_grad_(x.is_floating_point())
    h = leaf
    outs, states = [], []
    for block in chain:
        states.append(rng_state(x.device))
        h = block(h, **kwargs)
        check_output(block, h)
        outs.append(h)
    return chain_sensitivities(leaf, outs, chain, states)


def projection(y: torch.Tensor) -> torch.Tensor:
    """The seeded random ``w`` of the projection loss ``<w, y>`` of a chain output ``y``: the
    gradient its backward starts from."""
    gen = torch.Generator().manual_seed(0)
    return torch.randn(y.shape, generator=gen).to(
        y.device, y.dtype if y.is_floating_point() else None
    )


def chain_sensitivities(
    first: torch.Tensor,
    outs: Sequence[torch.Tensor],
    chain: Sequence[nn.Module],
    states: list[Any],
) -> Sensitivities:
    """:class:`Sensitivities` of a chain that has run forward, its graph alive: ``first`` its
    input, ``outs`` every block's output (each the next block's input), ``states`` the
    generator states each block's forward started from. One backward of the seeded projection
    ``<w, y>`` of the last output (:func:`sensitivities`, or the graph of a traced step)."""
    h = outs[-1]
    inputs = [first.detach()] + [o.detach() for o in outs[:-1]]
    loss = (h * projection(h)).sum() if h.requires_grad else None
    return _gradients(loss, first, list(outs), chain, inputs, states)


@dataclass
class StepRecord:
    """What a stored step of the chain leaves for the error model, recorded as it runs
    (:func:`~revckpt.schedule.probe.timed_step` with ``record=``, its output's gradient the
    :func:`projection`, inside :meth:`watching` the parameters): per block its input and
    output (detached), the generator states its forward started from and its output's
    gradient; the chain input's gradient; each parameter's gradient in the step (as a tensor
    hook receives it: not ``.grad``, which the step adds it to, and which hooks of the
    model's may take away). :meth:`sensitivities` then gives what :func:`sensitivities`
    does, without a run of its own."""

    device: torch.device
    inputs: list[torch.Tensor] = field(default_factory=list)
    outputs: list[torch.Tensor] = field(default_factory=list)
    states: list[Any] = field(default_factory=list)
    cotangents: dict[int, torch.Tensor] = field(default_factory=dict)
    input_grad: torch.Tensor | None = None
    param_grads: dict[int, torch.Tensor] = field(default_factory=dict)

    def entered(self, h: torch.Tensor) -> None:
        """A block's forward starts on ``h``."""
        self.inputs.append(h.detach())
        self.states.append(rng_state(self.device))

    def left(self, block: nn.Module, y: Any) -> None:
        """A block's forward returned ``y``."""
        check_output(block, y)
        self.outputs.append(y.detach())

    @contextlib.contextmanager
    def watching(self, params: Sequence[torch.Tensor]) -> Iterator[None]:
        """Record each of ``params``' gradient in the backwards run inside (a parameter
        whose hook never runs took no part)."""

        def keep(key: int) -> Callable[[torch.Tensor], None]:
            def hook(g: torch.Tensor) -> None:
                self.param_grads[key] = g

            return hook

        handles = [p.register_hook(keep(id(p))) for p in {id(p): p for p in params}.values()]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def sensitivities(self, chain: Sequence[nn.Module]) -> Sensitivities:
        """The :class:`Sensitivities` of the recorded step (:meth:`watching` ``chain``'s
        parameters)."""
        n = len(chain)
        grads = self.param_grads
        per_block = [[grads.get(id(p)) for p in b.parameters() if p.requires_grad] for b in chain]
        cotangents = [self.cotangents.get(i) for i in range(n)]
        first_grad = self.input_grad
        inputs_grad = [first_grad, *cotangents[:-1]]
        states = _unless_shared(chain, self.states)
        return _assembled(cotangents, per_block, first_grad, inputs_grad, self, states)


def step_sensitivities(
    loss: torch.Tensor,
    inputs: Sequence[torch.Tensor],
    outputs: Sequence[torch.Tensor],
    blocks: Sequence[nn.Module],
) -> Sensitivities:
    """:class:`Sensitivities` of blocks a model ran, from its own step's ``loss`` (its graph
    through the blocks' ``inputs`` and ``outputs`` still alive): one backward. For blocks that
    do not form a chain (code between them, outputs used twice), where :func:`sensitivities`
    cannot run them one after the other. The cotangents are those of the model's loss; no
    :class:`Exact` gradients (a block's input gradient there is not its own alone)."""
    first = inputs[0]
    detached = [t.detach() for t in inputs]
    return _gradients(loss, first, list(outputs), blocks, detached, None)


def _gradients(
    loss: torch.Tensor | None,
    first: torch.Tensor,
    outs: list[torch.Tensor],
    blocks: Sequence[nn.Module],
    inputs: list[torch.Tensor],
    states: list[Any] | None,
) -> Sensitivities:
    """The :class:`Sensitivities` of one backward of ``loss`` through ``blocks``, whose first
    input is ``first`` and outputs ``outs``; :class:`Exact` gradients where ``states`` (the
    generator states of the blocks' forwards, ``outs`` chained) are given."""
    n = len(blocks)
    per_block = [[p for p in b.parameters() if p.requires_grad] for b in blocks]
    flat = [p for ps in per_block for p in ps]
    head = [first] if first.requires_grad else []
    wrt = head + [o for o in outs if o.requires_grad] + flat
    if loss is None or not loss.requires_grad or not wrt:
        return Sensitivities([None] * n, [0.0] * n, 0.0, [None] * n, inputs)
    grads = torch.autograd.grad(loss, wrt, allow_unused=True)
    by_id = {id(t): g for t, g in zip(wrt, grads, strict=True)}
    cotangents = [by_id.get(id(o)) for o in outs]
    first_grad = by_id.get(id(first))
    per_block_grads = [[by_id[id(p)] for p in ps] for ps in per_block]
    inputs_grad = [first_grad, *cotangents[:-1]]
    ran = _Ran(inputs, [o.detach() for o in outs])
    if states is not None:
        states = _unless_shared(blocks, states)
    return _assembled(cotangents, per_block_grads, first_grad, inputs_grad, ran, states)


def _unless_shared(blocks: Sequence[nn.Module], states: list[Any]) -> list[Any]:
    """``states`` with ``None`` for every block that shares a parameter with another: a tied
    weight's gradient in the chain is the sum over every block using it, not the block's own,
    so it has no :class:`Exact` gradients (its error run makes its own exact run)."""
    users = Counter(id(p) for b in blocks for p in b.parameters())
    return [
        None if any(users[id(p)] > 1 for p in b.parameters()) else state
        for b, state in zip(blocks, states, strict=True)
    ]


@dataclass(frozen=True)
class _Ran:
    inputs: list[torch.Tensor]
    outputs: list[torch.Tensor]


def _sq(g: torch.Tensor | None) -> float:
    return 0.0 if g is None else float(g.double().pow(2).sum())


def _assembled(
    cotangents: list[torch.Tensor | None],
    param_grads: list[list[torch.Tensor | None]],
    first_grad: torch.Tensor | None,
    inputs_grad: list[torch.Tensor | None],
    ran: _Ran | StepRecord,
    states: list[Any] | None,
) -> Sensitivities:
    """:class:`Sensitivities` from one backward's gradients: of each block's output, of each
    block's parameters, of the chain input and of each block's input; ``ran``: the blocks'
    inputs and outputs; :class:`Exact` gradients where ``states`` are given."""
    exact: list[Exact | None] = [None] * len(param_grads)
    for i, g_par in enumerate(param_grads if states is not None else []):
        g_in = inputs_grad[i]
        if g_in is None or states[i] is None or any(g is None for g in g_par):
            continue
        out = ran.outputs[i].reshape(-1)
        par = torch.cat([g.reshape(-1) for g in g_par]) if g_par else out.new_zeros(0)
        exact[i] = Exact(g_in.reshape(-1), par, out, states[i])
    return Sensitivities(
        [None if c is None else c.detach() for c in cotangents],
        [sum(_sq(g) for g in gs) for gs in param_grads],
        _sq(first_grad),
        exact,
        list(ran.inputs),
    )
