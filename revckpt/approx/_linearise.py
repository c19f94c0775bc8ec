"""The chain as a function of its kept boundaries, for :mod:`revckpt.approx.bounds`.

``G(z_0, ..., z_{B-1})`` is the chain's parameter gradients with block ``k``'s backward
recomputed from ``z_k``, evaluated on float64 copies of the blocks under ``torch.func``; its
JVPs at the exact boundaries (:meth:`Linearised.push`) carry boundary errors to first order.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.func import functional_call, jvp, vjp
from torch.nn.modules.batchnorm import _NormBase
from torch.utils._python_dispatch import TorchDispatchMode

from ..errors import InvalidArgumentError, InvalidInputTypeError
from ..replay import freeze_running_stats
from .formats import Codec
from .recompute import Approx

INPUT = "<input>"  # the name of the chain input's gradient, last with ``with_input``


def codec_of(codec: Codec | Approx) -> Codec:
    """The codec an estimate covers: ``codec`` itself, or that of an :class:`Approx` that only
    compresses (no low-precision recompute)."""
    if isinstance(codec, Approx):
        if codec.recompute_dtype is not None:
            raise InvalidArgumentError(
                f"estimate_error covers the error of a compressed boundary; {codec} also "
                "recomputes in low precision, which it does not model. Measure that case: "
                "revckpt.testing.assert_error_within_bound reports the measured error for it "
                "(with no bound), or compare gradients with revckpt.gradient_error"
            )
        if codec.codec is None:
            raise InvalidArgumentError(
                "Approx(store=None) compresses nothing: its gradient error is zero"
            )
        return codec.codec
    if not isinstance(codec, Codec):
        raise InvalidInputTypeError(
            f"estimate_error needs a revckpt.approx.Codec or Approx, got {type(codec).__name__}"
        )
    return codec


def checked_chain(blocks: Sequence[nn.Module] | nn.Sequential, caller: str) -> list[nn.Module]:
    """``blocks`` as a list, which must be a non-empty chain of modules."""
    chain = list(blocks)
    if not chain or not all(isinstance(b, nn.Module) for b in chain):
        raise InvalidInputTypeError(
            f"{caller} needs a non-empty chain of nn.Modules (an nn.Sequential or a list)"
        )
    return chain


def chain_gradients(
    blocks: Sequence[nn.Module],
    params: list[dict[str, torch.Tensor]],
    buffers: list[dict[str, torch.Tensor]],
    cotangent: torch.Tensor,
    with_input: bool = False,
) -> Callable[[tuple[torch.Tensor, ...]], tuple[torch.Tensor, ...]]:
    """``G(z_0, ..., z_{B-1})``: the chain's parameter gradients with block ``k``'s backward
    recomputed from ``z_k`` (flat tuple, blocks in order; with ``with_input``, the gradient
    with respect to ``z_0`` last)."""

    def grads(zs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        ct = cotangent
        per_block: list[tuple[torch.Tensor, ...]] = [()] * len(blocks)
        for k in reversed(range(len(blocks))):

            def f(z: torch.Tensor, p: dict[str, torch.Tensor], k: int = k) -> torch.Tensor:
                return functional_call(blocks[k], (p, buffers[k]), (z,))

            _, pullback = vjp(f, zs[k], params[k])
            dz, dp = pullback(ct)
            per_block[k] = tuple(dp[name] for name in params[k])
            ct = dz
        flat = tuple(g for block in per_block for g in block)
        return (*flat, ct) if with_input else flat

    return grads


def worst_row_ratio(x: torch.Tensor, bound: torch.Tensor) -> float:
    """``max_r ||b_r|| / ||x_r||`` over the rows of the last dimension (zero rows: 0)."""
    rows_x = x.detach().double().reshape(-1, x.shape[-1] if x.dim() else 1).norm(dim=1)
    rows_b = bound.reshape(rows_x.shape[0], -1).norm(dim=1)
    ratio = torch.where(rows_b == 0, 0.0, rows_b / rows_x.clamp_min(1e-300))
    return float(ratio.max()) if ratio.numel() else 0.0


@dataclass(frozen=True)
class Linearised:
    """A chain linearised at its exact boundaries: ``xs``, the boundaries in working precision;
    ``names``, ``"<block>.<parameter>"`` per gradient (and ``INPUT`` last with ``with_input``);
    ``grads``, ``G`` on float64 copies of the blocks; ``zs``, the float64 boundaries;
    ``grad_norm``, ``||G_p||`` per name."""

    xs: list[torch.Tensor]
    names: list[str]
    grads: Callable[[tuple[torch.Tensor, ...]], tuple[torch.Tensor, ...]]
    zs: tuple[torch.Tensor, ...]
    grad_norm: dict[str, float]
    #: The non-smooth operations the chain's forward ran (:data:`KINKED_OPS`; ``elu`` where its
    #: two slopes at 0 differ, as SELU's and an ELU's with ``alpha != 1`` do).
    kinks: frozenset[str] = frozenset()

    def push(self, v: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """``J v``: the first-order change of every gradient for boundary changes ``v``
        (contiguous, as :attr:`zs` are: torch's JVP of group_norm fails on channels_last)."""
        return jvp(self.grads, (self.zs,), (tuple(t.contiguous() for t in v),))[1]


def linearise(
    chain: Sequence[nn.Module],
    x: torch.Tensor,
    cotangent: torch.Tensor | None,
    with_input: bool = False,
) -> Linearised:
    """Run the chain on ``x`` (statistics untouched) and linearise it there; ``cotangent`` on
    its output, ones by default (``loss = y.sum()``)."""
    norms = [m for b in chain for m in b.modules() if isinstance(m, _NormBase)]
    kinks = _KinkedOps()
    with torch.no_grad(), freeze_running_stats(norms), kinks:  # statistics stay as they are
        xs = [x.detach()]
        for block in chain[:-1]:
            xs.append(block(xs[-1]).detach())
        out = chain[-1](xs[-1])
    blocks64 = [copy.deepcopy(b).double() for b in chain]
    for m in (m for b in blocks64 for m in b.modules()):
        if isinstance(m, _NormBase) and m.training:
            m.track_running_stats = False  # batch statistics, as in training, without updates
    params = [{n: p.detach() for n, p in b.named_parameters() if p.requires_grad} for b in blocks64]
    buffers = [{n: t.detach().clone() for n, t in b.named_buffers()} for b in blocks64]
    names = [f"{k}.{n}" for k, p in enumerate(params) for n in p]
    if with_input:
        names.append(INPUT)
    ct = (torch.ones_like(out) if cotangent is None else cotangent).detach().double()
    grads_fn = chain_gradients(blocks64, params, buffers, ct, with_input)
    zs = tuple(z.double().contiguous() for z in xs)
    exact = grads_fn(zs)
    grad_norm = {n: float(g.norm()) for n, g in zip(names, exact, strict=True)}
    return Linearised(xs, names, grads_fn, zs, grad_norm, frozenset(kinks.found))


#: Operations whose derivative jumps (kinks, selections, steps): a compressed input can move
#: their arguments across the jump, which no first-order analysis sees.
KINKED_OPS = frozenset(
    {
        *("relu", "relu_", "threshold", "threshold_", "leaky_relu", "leaky_relu_", "prelu"),
        *("_prelu_kernel", "rrelu_with_noise", "rrelu_with_noise_", "hardtanh", "hardtanh_"),
        *("hardswish", "hardswish_", "hardsigmoid", "hardsigmoid_", "hardshrink", "softshrink"),
        *("clamp", "clamp_", "clamp_min", "clamp_min_", "clamp_max", "clamp_max_", "clip"),
        *("max_pool1d", "max_pool2d", "max_pool3d", "max_pool1d_with_indices"),
        *("max_pool2d_with_indices", "max_pool3d_with_indices", "adaptive_max_pool1d"),
        *("adaptive_max_pool2d", "adaptive_max_pool3d", "fractional_max_pool2d"),
        *("fractional_max_pool3d", "max", "min", "maximum", "minimum", "amax", "amin", "fmax"),
        *("fmin", "abs", "abs_", "sign", "sgn", "floor", "ceil", "round", "trunc", "sort"),
        *("topk", "kthvalue", "median", "nanmedian", "mode", "cummax", "cummin", "heaviside"),
        *("argmax", "argmin", "gt", "lt", "ge", "le"),  # selections, masks made of the data
    }
)

# Ops with a kink at a bound they are given: (argument position, whether it is a lower bound);
# counted where the bound acts on some element
_LOW, _HIGH = (1, True), (2, False)
_BOUNDED = {n: (_LOW, _HIGH) for n in ("clamp", "clamp_", "clip", "hardtanh", "hardtanh_")}
_BOUNDED |= {n: (_LOW,) for n in ("clamp_min", "clamp_min_", "threshold", "threshold_")}
_BOUNDED |= {n: ((1, False),) for n in ("clamp_max", "clamp_max_")}


class _KinkedOps(TorchDispatchMode):
    """Records which :data:`KINKED_OPS` a forward runs (and ``elu`` with a kink at 0)."""

    def __init__(self) -> None:
        super().__init__()
        self.found: set[str] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name not in self.found and _kinked(name, args, kwargs):
            self.found.add(name)
        return func(*args, **kwargs)


def _kinked(name: str, args: Any, kwargs: Any) -> bool:
    """Whether the op ``name`` runs a kink a compressed input can cross: on a floating-point
    tensor (index arithmetic on integers has none), for a bounded op one that acts on some
    element (``F.normalize``'s ``clamp_min(norm, 1e-12)``, Mamba2's ``clamp(softplus(dt),
    0, inf)`` never do)."""
    x = next((a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()), None)
    if x is None or not x.numel():
        return False
    if name in ("elu", "elu_"):
        return _elu_kink(args, kwargs)
    if name not in KINKED_OPS:
        return False
    if name not in _BOUNDED:
        return True
    x = x.detach()
    for i, low in _BOUNDED[name]:
        bound = args[i] if len(args) > i else None
        if bound is not None and bool((x <= bound if low else x >= bound).any()):
            return True
    return False


def _elu_kink(args: Any, kwargs: Any) -> bool:
    """``aten.elu(x, alpha, scale, input_scale)``: slope ``alpha * scale * input_scale`` left
    of 0, ``scale`` right of it: a kink unless ``alpha * input_scale == 1``."""
    alpha, _, input_scale = (*args[1:4], *(None,) * 3)[:3]
    alpha = kwargs.get("alpha", 1.0 if alpha is None else alpha)
    input_scale = kwargs.get("input_scale", 1.0 if input_scale is None else input_scale)
    return not math.isclose(float(alpha) * float(input_scale), 1.0)


def random_sign_tangents(d: torch.Tensor, probes: int, gen: torch.Generator) -> torch.Tensor:
    """``probes`` copies of ``|d|`` with independent random signs, shape ``(probes, *d.shape)``."""
    sign = torch.randint(0, 2, (probes, *d.shape), generator=gen).double().mul_(2).sub_(1)
    return sign * d.abs()


def squared_norms(vs: Sequence[torch.Tensor], count: int) -> torch.Tensor:
    """``sum_k ||v_k[i]||^2`` for each of the ``count`` leading rows ``i`` of every ``v_k``."""
    return sum(t.reshape(count, -1).pow(2).sum(1) for t in vs)  # type: ignore[return-value]
