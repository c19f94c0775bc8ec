"""How much an approx codec perturbs the gradients, measured per block.

:func:`sensitivities` runs the chain once with a seeded random projection loss: every block's
output cotangent and the squared norms of every block's parameter gradients (the weights of
the chain's error model, :func:`revckpt.schedule.costs.segment_cost`). :func:`error_fields`
runs one block with its input exact and through each codec, with that cotangent and the same
random draws, and compares the gradients. It works in float32 (float64 for a float64 block):
a codec's error (``2^-9`` for bf16, more for fp8) is orders of magnitude above float32's
round-off, so a wider reference would show nothing more, at twice the cost.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase

from .._numbers import relative
from ..approx import Approx, compress_saved
from ..measure.timing import wall_time
from .block_runs import check_output
from .cost_records import ApproxCost, CompressCost, GradNorms

__all__ = [
    "CodecErrors",
    "Exact",
    "Sensitivities",
    "StepRecord",
    "chain_sensitivities",
    "error_fields",
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
    inputs: list[torch.Tensor] = dataclasses.field(default_factory=list)
    outputs: list[torch.Tensor] = dataclasses.field(default_factory=list)
    states: list[Any] = dataclasses.field(default_factory=list)
    cotangents: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)
    input_grad: torch.Tensor | None = None
    param_grads: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)

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
        return _assembled(cotangents, per_block, first_grad, inputs_grad, self, self.states)


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
    return _assembled(cotangents, per_block_grads, first_grad, inputs_grad, ran, states)


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
        if g_in is None or any(g is None for g in g_par):
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


@dataclass(frozen=True)
class CodecErrors:
    """Per codec, measured on one block: relative errors of its parameter gradients and of its
    input gradient, how far the codec moves its input (relative), and how much a perturbation
    of its input grows through it (relative output change over relative input change)."""

    parameters: dict[str, float]
    input_gradient: dict[str, float]
    perturbation: dict[str, float]
    amplification: dict[str, float]


@dataclass
class _Runner:
    """A block in the working precision, run on an input with the chain's cotangent and its
    random draws (see :func:`error_fields`)."""

    model: nn.Module
    params: list[torch.Tensor]
    kwargs: dict[str, Any]
    work: torch.dtype
    cotangent: torch.Tensor | None
    exact: Exact | None  # set when the exact figures can be reused
    seed: int

    @classmethod
    def of(
        cls,
        block: nn.Module,
        x: torch.Tensor,
        cotangent: torch.Tensor | None,
        kwargs: dict[str, Any],
        exact: Exact | None,
    ) -> _Runner:
        work = torch.float64 if x.dtype == torch.float64 else torch.float32
        model = block
        if any(p.dtype != work for p in block.parameters()):
            model = copy.deepcopy(block).to(work)
            for m in model.modules():
                if isinstance(m, _NormBase) and m.training:
                    m.track_running_stats = False  # batch statistics, as in training
        kw = {
            k: v.to(work) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
            for k, v in kwargs.items()
        }
        reuse = exact is not None and model is block and x.dtype == work
        params = [p for p in model.parameters() if p.requires_grad]
        seed = int(torch.randint(0, 2**31 - 1, ()))
        return cls(model, params, kw, work, cotangent, exact if reuse else None, seed)

    def grads(
        self, z: torch.Tensor, wrap: Callable[..., Any] | None = None
    ) -> tuple[torch.Tensor, ...]:
        """Input and parameter gradients, output and input (flattened) of the block on ``z``
        (run through ``wrap(model, h, **kwargs)`` if given, ``h`` a non-leaf copy of ``z``)."""
        leaf = z.detach().to(self.work).requires_grad_(True)
        devices = [z.device] if z.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            if self.exact is not None:  # the chain's draws, as in the exact run
                torch.set_rng_state(self.exact.rng[0])
                for state in self.exact.rng[1]:
                    torch.cuda.set_rng_state(state, z.device)
            else:
                torch.manual_seed(self.seed)  # the same dropout masks for every run
            if wrap is None:
                y = self.model(leaf, **self.kwargs)
            else:  # an activation, as inside a model (a leaf is never compressed)
                y = wrap(self.model, leaf.clone(), **self.kwargs)
        ct = torch.ones_like(y) if self.cotangent is None else self.cotangent.detach().to(self.work)
        got = torch.autograd.grad(y, [leaf, *self.params], ct, allow_unused=True)
        flat = [g.reshape(-1) for g in got[1:] if g is not None]
        par = torch.cat(flat) if flat else torch.zeros(0, dtype=y.dtype)
        return got[0].reshape(-1), par, y.detach().reshape(-1), leaf.detach().reshape(-1)

    def exact_figures(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.exact is not None:
            e = self.exact
            return e.input_grad, e.param_grad, e.output, x.detach().reshape(-1)
        return self.grads(x)


def error_fields(
    block: nn.Module,
    x: torch.Tensor,
    approx: Mapping[str, ApproxCost],
    compress: Mapping[str, CompressCost],
    cotangent: torch.Tensor | None,
    kwargs: dict[str, Any],
    exact: Exact | None = None,
    roundtrips: dict[str, list[float]] | None = None,
) -> dict[str, Any]:
    """A block's :class:`~revckpt.schedule.BlockCost` fields ``approx`` and ``compress``, the
    records it was priced with, with their errors measured: per codec of ``approx`` with its
    input compressed (:class:`~revckpt.schedule.ApproxCost`'s ``param_grad_error``,
    ``input_grad_error``, ``perturbation`` and ``amplification``; see :class:`CodecErrors`),
    per codec of ``compress`` with its saved tensors compressed
    (:class:`~revckpt.schedule.CompressCost`'s ``param_grad_error``, ``input_grad_error``);
    neither field where it has no codec. Measured with the chain's cotangent, in float32
    (float64 for a float64 block; see the module docstring): a direct measurement, not a
    linearisation, it sees ReLU kinks and saturation too. ``exact``: the block's exact
    gradients from :func:`sensitivities`, which spare the exact run when the block works in
    its own precision (the codec runs then replay the chain's random draws). ``roundtrips``:
    where given, each approx codec's round trip of ``x`` is timed and its seconds appended
    there, per codec (the profile's codec times, without round trips of their own)."""
    out: dict[str, Any] = {}
    if not approx and not compress:
        return out
    run = _Runner.of(block, x, cotangent, kwargs, exact)
    if approx:
        m = codec_errors(run, x, list(approx), roundtrips)
        out["approx"] = {
            c: dataclasses.replace(
                a,
                param_grad_error=m.parameters[c],
                input_grad_error=m.input_gradient[c],
                perturbation=m.perturbation[c],
                amplification=m.amplification[c],
            )
            for c, a in approx.items()
        }
    if compress:
        params, inputs = compress_errors(run, x, list(compress))
        out["compress"] = {
            c: dataclasses.replace(k, param_grad_error=params[c], input_grad_error=inputs[c])
            for c, k in compress.items()
        }
    return out


class _Against:
    """Relative errors ``||got - ref|| / ||ref||`` against one reference tensor, its norm made
    once for every codec compared with it. In the tensors' own precision, the working one
    (float32's round-off is orders of magnitude below a codec's error: see the module
    docstring), without float64 copies of every tensor compared; in float64 where float32
    would overflow or lose the small elements (:func:`_norm`)."""

    def __init__(self, ref: torch.Tensor) -> None:
        self.ref = ref
        self.norm = _norm(ref)

    def __call__(self, got: torch.Tensor) -> float:
        diff = _norm(got - self.ref)
        if math.isinf(diff):  # the difference of two finite tensors can overflow
            diff = _norm(got.double() - self.ref.double())
        return relative(diff, self.norm)


def _norm(t: torch.Tensor) -> float:
    """``||t||``: in ``t``'s precision (16-bit in float32) where that is exact to 1e-6, else
    in float64. Squares overflow above ``sqrt(max)`` and lose the elements below
    ``sqrt(tiny)``; those hold at most ``n * tiny`` of the squared norm, a millionth of it
    once the norm is ``1e3 * sqrt(n * tiny)`` or more."""
    if t.dtype in (torch.float16, torch.bfloat16):
        t = t.float()
    norm = float(torch.linalg.vector_norm(t))
    floor = 1e3 * math.sqrt(t.numel() * torch.finfo(t.dtype).tiny)
    if math.isfinite(norm) and norm >= floor:
        return norm
    if norm == 0.0 and not bool(t.any()):  # nothing differs (and nothing underflowed)
        return 0.0
    return math.sqrt(float(t.double().pow(2).sum()))


def codec_errors(
    run: _Runner,
    x: torch.Tensor,
    codecs: Sequence[str],
    roundtrips: dict[str, list[float]] | None = None,
) -> CodecErrors:
    """Measured, per codec (see :class:`CodecErrors` and :func:`error_fields`)."""
    exact_in, exact_par, exact_y, exact_x = map(_Against, run.exact_figures(x))
    errors = CodecErrors({}, {}, {}, {})
    made: list[torch.Tensor] = []
    for name in codecs:
        codec = Approx(store=name).codec
        assert codec is not None
        seconds = wall_time(lambda codec=codec: made.append(codec.roundtrip(x)))
        if roundtrips is not None:
            roundtrips.setdefault(name, []).append(seconds)
        got_in, got_par, got_y, got_x = run.grads(made.pop())
        errors.parameters[name] = exact_par(got_par)
        errors.input_gradient[name] = exact_in(got_in)
        moved = exact_x(got_x)
        errors.perturbation[name] = moved
        errors.amplification[name] = exact_y(got_y) / moved if moved > 0 else 1.0
    return errors


def compress_errors(
    run: _Runner, x: torch.Tensor, codecs: Sequence[str]
) -> tuple[dict[str, float], dict[str, float]]:
    """Per codec, the relative errors of the block's parameter and input gradients when its
    saved tensors are compressed (:func:`revckpt.approx.compress_saved`), one run per codec."""
    exact_in, exact_par = map(_Against, run.exact_figures(x)[:2])
    params, inputs = {}, {}
    for name in codecs:
        wrap = functools.partial(compress_saved, store=name)
        got_in, got_par, _, _ = run.grads(x, wrap)
        params[name] = exact_par(got_par)
        inputs[name] = exact_in(got_in)
    return params, inputs
