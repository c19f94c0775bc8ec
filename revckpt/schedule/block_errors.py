"""How much an approx codec perturbs the gradients, measured per block.

:func:`sensitivities` runs the chain once with a seeded random projection loss: every block's
output cotangent and the squared norms of every block's parameter gradients (the weights of
the chain's error model, :func:`revckpt.schedule.costs.segment_cost`). :func:`codec_errors`
runs one block with its input exact and through each codec, with that cotangent and the same
random draws, and compares the gradients. It works in float32 (float64 for a float64 block):
a codec's error (``2^-9`` for bf16, more for fp8) is orders of magnitude above float32's
round-off, so a wider reference would show nothing more, at twice the cost.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase

from ..approx import Approx
from ..errors import InvalidInputTypeError
from ..measure import TensorError

__all__ = ["CodecErrors", "codec_errors", "sensitivities"]


def sensitivities(
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


def codec_errors(
    block: nn.Module,
    x: torch.Tensor,
    codecs: Sequence[str],
    cotangent: torch.Tensor | None,
    kwargs: dict[str, Any],
) -> CodecErrors:
    """Measured, per codec (see :class:`CodecErrors`), with the chain's cotangent, in float32
    (float64 for a float64 block; see the module docstring). A direct measurement, not a
    linearisation: it sees ReLU kinks and saturation too."""
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    model = block
    if any(p.dtype != work for p in block.parameters()):
        model = copy.deepcopy(block).to(work)
        for m in model.modules():
            if isinstance(m, _NormBase) and m.training:
                m.track_running_stats = False  # batch statistics, as in training, no updates
    params = [p for p in model.parameters() if p.requires_grad]
    kw = {
        k: v.to(work) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
        for k, v in kwargs.items()
    }
    seed = int(torch.randint(0, 2**31 - 1, ()))

    def grads(z: torch.Tensor) -> tuple[torch.Tensor, ...]:
        leaf = z.detach().to(work).requires_grad_(True)
        devices = [z.device] if z.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)  # the same dropout masks for every codec
            y = model(leaf, **kw)
        ct = torch.ones_like(y) if cotangent is None else cotangent.detach().to(work)
        got = torch.autograd.grad(y, [leaf, *params], ct, allow_unused=True)
        flat = [g.reshape(-1) for g in got[1:] if g is not None]
        par = torch.cat(flat) if flat else torch.zeros(0, dtype=y.dtype)
        return got[0].reshape(-1), par, y.detach().reshape(-1), leaf.detach().reshape(-1)

    errors = CodecErrors({}, {}, {}, {})
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
