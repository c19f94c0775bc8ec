"""How much an approx codec perturbs the gradients, measured per block.

:func:`error_fields` runs one block with its input exact and through each codec, with the
chain's cotangent and the same random draws (:mod:`.sensitivities`), and compares the
gradients. It works in float32 (float64 for a float64 block): a codec's error (``2^-9`` for
bf16, more for fp8) is orders of magnitude above float32's round-off, so a wider reference
would show nothing more, at twice the cost.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase

from .._numbers import relative
from ..approx import Approx, compress_saved
from ..measure.timing import wall_time
from .cost_records import ApproxCost, CompressCost
from .sensitivities import Exact

__all__ = ["CodecErrors", "error_fields", "perturbations"]


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
        work: torch.dtype | None = None,
    ) -> _Runner:
        if work is None:
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
            else:  # the same dropout masks for every run
                _seed(z.device, self.seed)
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


def _seed(device: torch.device, seed: int) -> None:
    """Seed the generators a run on ``device`` draws from: the CPU's, and on CUDA the
    device's (``torch.manual_seed`` also queues a seed for every lazy device module,
    formatting a stack trace each time); on other devices every generator, as
    ``torch.manual_seed`` does."""
    if device.type == "cpu":
        torch.default_generator.manual_seed(seed)
    elif device.type == "cuda":
        torch.default_generator.manual_seed(seed)
        torch.cuda.default_generators[device.index].manual_seed(seed)
    else:
        torch.manual_seed(seed)


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
        state = (*block.parameters(), *block.buffers())
        if run.work != x.dtype and all(t.dtype == x.dtype for t in state if t.is_floating_point()):
            # measured on a wider copy of a 16-bit block (one with wider weights, as Hugging
            # Face keeps some in float32, saves wider tensors: compressed, not checked here)
            native = _Runner.of(block, x, cotangent, kwargs, None, work=x.dtype)
            for name in _changing_nothing(native, x, list(compress)):
                params[name] = inputs[name] = 0.0
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
    for name in codecs:
        got_in, got_par, got_y, got_x = run.grads(_roundtrip(name, x, roundtrips))
        errors.parameters[name] = exact_par(got_par)
        errors.input_gradient[name] = exact_in(got_in)
        moved = exact_x(got_x)
        errors.perturbation[name] = moved
        errors.amplification[name] = exact_y(got_y) / moved if moved > 0 else 1.0
    return errors


def _roundtrip(
    name: str, x: torch.Tensor, roundtrips: dict[str, list[float]] | None
) -> torch.Tensor:
    """``x`` through codec ``name`` and back; its seconds appended to ``roundtrips[name]``."""
    codec = Approx(store=name).codec
    assert codec is not None
    made: list[torch.Tensor] = []
    seconds = wall_time(lambda: made.append(codec.roundtrip(x)))
    if roundtrips is not None:
        roundtrips.setdefault(name, []).append(seconds)
    return made.pop()


def perturbations(
    x: torch.Tensor, codecs: Sequence[str], roundtrips: dict[str, list[float]] | None = None
) -> dict[str, float]:
    """Per codec, how far it moves ``x`` (relative), in the working precision: the
    ``perturbation`` :func:`codec_errors` measures, without running the block."""
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    exact = _Against(x.detach().to(work).reshape(-1))
    return {c: exact(_roundtrip(c, x, roundtrips).detach().to(work).reshape(-1)) for c in codecs}


def _changing_nothing(native: _Runner, x: torch.Tensor, codecs: Sequence[str]) -> list[str]:
    """The codecs whose compression leaves the gradients of a 16-bit block bitwise as they
    are in its own dtype (bf16 on a bfloat16 block: its saved tensors are bf16 already), where
    the wider copy the errors are measured on reads the codec's rounding of its float32
    tensors (8.6e-4 for a bfloat16 Llama's compress:bf16, whose gradients are exact)."""
    plain = native.grads(x)[:2]
    same = []
    for name in codecs:
        got = native.grads(x, functools.partial(compress_saved, store=name))[:2]
        if all(torch.equal(a, b) for a, b in zip(plain, got, strict=True)):
            same.append(name)
    return same


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
