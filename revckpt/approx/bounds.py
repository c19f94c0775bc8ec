"""How far approximate recompute moves the parameter gradients: a bound and an estimate.

Setting: a chain ``y = f_{B-1}(... f_0(x))`` with parameters ``theta_k`` and a cotangent ``dy``
on its output (``dy = 1`` everywhere for ``loss = y.sum()``). Every block input ``x_k`` is kept
through a codec, and block ``k``'s backward recomputes its activations from
``x_hat_k = x_k + dx_k``. The parameter gradients are then a function of the boundaries::

    G(x_hat_0, ..., x_hat_{B-1}) = (grad theta_0, ..., grad theta_{B-1})

(block ``k``'s VJP uses activations from ``x_hat_k`` and the cotangent coming from above, which
already carries the error of the blocks above). To first order in the boundary errors::

    dG = J dx,      J = dG / d(x_0, ..., x_{B-1}) at the exact boundaries

**Hard bound** (per parameter tensor ``p``, rows ``J_p`` of ``J``)::

    ||dG_p|| <= ||J_p||_2 * ||b||_2,      b = k * (u * |x| + eta / s)

where ``b`` stacks the codec's per-element bounds (:meth:`Codec.error_bound`) of every boundary,
so ``||dx|| <= ||b||`` holds exactly, and ``||J_p||_2`` comes from power iteration on
``J_p^T J_p`` (one JVP and one VJP of ``G`` per iteration, vectorised over the parameters).
It is worst case in the direction and the size of every element's error, so it is loose
(typically 10-1000x); it neglects second-order terms (the codec error squared), which is what
"first order" means here, and power iteration approaches ``||J_p||_2`` from below (raise
``power_iterations`` to tighten). It is
for tests and reports.

First order needs the perturbation to be small where it meets the blocks' nonlinearities:

* every row's codec bound must be at most half the row (``FIRST_ORDER_LIMIT``); otherwise
  the codec can lose the row (tensor scaling over rows six decades apart flushes the small
  ones to zero) and the bound is reported as ``inf`` with a warning;
* the nonlinearity must be smooth at the scale of the perturbation. Pre-norm blocks (LayerNorm
  before the MLP or attention, as in transformers) rescale each row first, so a relative
  compression error stays relative; an un-normalised GELU fed rows of magnitude 1e3 behaves
  like a ReLU kink, and ReLU itself crosses kinks (``NonSmoothWarning``). There the measured
  error can exceed the bound: measure it (``revckpt.testing.assert_error_within_bound``).

**Cheap estimate**: the codec's actual per-element errors ``|dx|`` with random signs ``r``::

    est_p = sqrt(mean_r ||J_p (|dx| * r)||^2) = ||J_p diag(|dx|)||_F

from a few random-sign JVPs (``probes``), all boundaries at once. It is the error one expects if
the rounding errors of different elements are independent, which holds for well-conditioned
blocks. It fails (documented in ``docs/approx.md``) where errors correlate, e.g. a saturated
softmax or a ReLU whose pre-activations sit at zero, where the first-order picture itself breaks.
``linearised`` is ``||J_p dx||`` with the actual signed errors: the first-order prediction itself.

Requirements: blocks take and return one tensor, are deterministic (no dropout: use ``eval()``
or ``p=0``) and do not update buffers (BatchNorm in eval mode), because ``G`` is evaluated many
times under ``torch.func`` transforms. Compute runs in float64 on a copy of the blocks.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.func import vjp, vmap
from torch.nn.attention import SDPBackend, sdpa_kernel

from .._numbers import relative as _relative
from ..errors import InvalidArgumentError
from ._linearise import (
    INPUT,
    Linearised,
    checked_chain,
    codec_of,
    linearise,
    random_sign_tangents,
    squared_norms,
    worst_row_ratio,
)
from .formats import Codec
from .recompute import Approx

__all__ = [
    "FIRST_ORDER_LIMIT",
    "SECOND_ORDER_LIMIT",
    "ErrorEstimate",
    "NonSmoothWarning",
    "TotalEstimate",
    "estimate_error",
    "estimate_totals",
]

# A row whose codec error bound exceeds this fraction of the row is not a small perturbation:
# the codec may lose it (e.g. tensor scaling over rows six decades apart flushes the small rows
# to zero), and no first-order argument bounds what follows.
FIRST_ORDER_LIMIT = 0.5

_NON_SMOOTH = (
    nn.ReLU,
    nn.ReLU6,
    nn.LeakyReLU,
    nn.PReLU,
    nn.Hardtanh,
    nn.Hardswish,
    nn.Hardsigmoid,
    nn.Hardshrink,
    nn.Softshrink,
    nn.Threshold,
    nn.MaxPool1d,
    nn.MaxPool2d,
    nn.MaxPool3d,
)


class NonSmoothWarning(UserWarning):
    """The blocks contain piecewise-linear pieces the first-order analysis does not cover."""


@dataclass(frozen=True)
class ErrorEstimate:
    """Per-parameter gradient error of an approximate recompute, absolute (L2 norms). Keys of
    the maps are ``"<block index>.<parameter name>"``."""

    #: The codec the block inputs were kept through.
    codec: str
    #: The first-order hard bound (infinite where :attr:`first_order` does not hold).
    bound: dict[str, float]
    #: The random-sign estimate.
    estimate: dict[str, float]
    #: The first-order prediction with the actual codec errors of this input.
    linearised: dict[str, float]
    #: The norm of the exact gradient, to make any of the others relative.
    grad_norm: dict[str, float]
    #: The L2 norm, over every kept block input, of the codec's elementwise error bound.
    boundary_bound_norm: float
    #: The largest codec error bound of one row relative to that row (see :attr:`first_order`).
    worst_row_bound: float

    @property
    def first_order(self) -> bool:
        """Whether every row's codec bound is small against the row (``<= 1/2`` relative), the
        condition for the first-order bound; when not, ``bound`` is infinite."""
        return self.worst_row_bound <= FIRST_ORDER_LIMIT

    def relative(self, which: str = "estimate") -> dict[str, float]:
        """``which`` (``"bound"``, ``"estimate"`` or ``"linearised"``) over ``grad_norm``."""
        values = getattr(self, which)
        return {k: _relative(v, self.grad_norm[k]) for k, v in values.items()}

    def total(self, which: str = "estimate") -> float:
        """Relative error of all parameter gradients together: ``sqrt(sum_p e_p^2) / ||G||``
        (for the bound this is again a bound, since ``||dG||^2 = sum_p ||dG_p||^2``)."""
        values = getattr(self, which)
        norm = math.sqrt(sum(v * v for v in self.grad_norm.values()))
        err = math.sqrt(sum(v * v for v in values.values()))
        return _relative(err, norm)

    def table(self) -> str:
        """Markdown: relative bound, estimate and linearised error per parameter."""
        kinds = ("bound", "estimate", "linearised")
        rel = {k: self.relative(k) for k in kinds}
        rows = [(name, [rel[k][name] for k in kinds], "") for name in self.bound]
        rows.append(("all", [self.total(k) for k in kinds], ""))
        title = f"gradient error of approximate recompute ({self.codec}), relative to ||grad||"
        return _parameter_table(title, kinds, rows)

    def __str__(self) -> str:
        return self.table()


@dataclass(frozen=True)
class TotalEstimate:
    """Random-sign estimates of relative gradient errors: ``parameters``, of all parameter
    gradients together (``sqrt(sum_p e_p^2) / ||G||``); ``input``, of the gradient with respect
    to the chain input (what flows on to the layers before it)."""

    parameters: float
    input: float


def estimate_totals(
    blocks: Sequence[nn.Module] | nn.Sequential,
    x: torch.Tensor,
    codecs: Sequence[Codec | Approx | str],
    *,
    cotangent: torch.Tensor | None = None,
    probes: int = 4,
    seed: int = 0,
) -> dict[str, TotalEstimate]:
    """The random-sign estimate alone, for several codecs at once: one linearisation, every
    codec's probes in one vectorised JVP, no power iteration; for the parameter gradients
    together (``ErrorEstimate.total("estimate")``) and for the input gradient. A string names a
    format with the default options (``Approx(store=name)``); keys are the strings given, or
    ``str(codec)``."""
    chain = checked_chain(blocks, "estimate_totals")
    if probes < 1:
        raise InvalidArgumentError(f"probes={probes}: must be >= 1")
    resolved = [
        (c, codec_of(Approx(store=c))) if isinstance(c, str) else (str(c), codec_of(c))
        for c in codecs
    ]
    if not resolved:
        return {}
    with sdpa_kernel(SDPBackend.MATH), _deterministic("estimate_totals"):
        lin = linearise(chain, x, cotangent, with_input=True)
        gen = torch.Generator().manual_seed(seed)
        tangents = tuple(
            torch.cat(
                [
                    random_sign_tangents(codec.roundtrip(z).double() - z.double(), probes, gen)
                    for _, codec in resolved
                ]
            )
            for z in lin.xs
        )
        probed = vmap(lin.push)(tangents)
    param_norm = math.sqrt(sum(v * v for n, v in lin.grad_norm.items() if n != INPUT))
    totals = {}
    for i, (key, _) in enumerate(resolved):
        sq = [
            float(t[i * probes : (i + 1) * probes].reshape(probes, -1).pow(2).sum(1).mean())
            for t in probed
        ]
        params_sq, input_sq = sum(sq[:-1]), sq[-1]
        totals[key] = TotalEstimate(
            parameters=_relative(math.sqrt(params_sq), param_norm),
            input=_relative(math.sqrt(input_sq), lin.grad_norm[INPUT]),
        )
    return totals


def estimate_error(
    blocks: Sequence[nn.Module] | nn.Sequential,
    x: torch.Tensor,
    codec: Codec | Approx,
    *,
    cotangent: torch.Tensor | None = None,
    probes: int = 8,
    power_iterations: int = 12,
    seed: int = 0,
) -> ErrorEstimate:
    """Bound and estimate the parameter-gradient error of keeping every block input of the
    chain ``blocks`` through ``codec`` (as ``checkpoint_sequential(blocks, len(blocks), x,
    strategy=Approx(...))`` does), for input ``x`` and output cotangent ``cotangent``
    (default: ones, i.e. ``loss = y.sum()``). See the module docstring for the formulas."""
    codec = codec_of(codec)
    chain = checked_chain(blocks, "estimate_error")
    if probes < 1 or power_iterations < 1:
        raise InvalidArgumentError(
            f"probes={probes}, power_iterations={power_iterations}: both must be >= 1"
        )
    # Forward-mode AD through attention needs the math kernel (the fused CPU kernels have no
    # JVP); the values are the same up to rounding.
    with sdpa_kernel(SDPBackend.MATH), _deterministic("estimate_error"):
        lin = linearise(chain, x, cotangent)
        _warn_if_non_smooth(chain, lin.kinks)
        bounds = [codec.error_bound(z) for z in lin.xs]
        dx = [(codec.roundtrip(z).double() - z.double()) for z in lin.xs]
        gen = torch.Generator().manual_seed(seed)
        lin_dx = lin.push(tuple(dx))
        linearised = {n: float(t.norm()) for n, t in zip(lin.names, lin_dx, strict=True)}
        if not lin.kinks:  # (kinks warned about already)
            _warn_if_not_first_order(lin, dx, lin_dx)
        estimate = _random_sign_estimate(lin, dx, probes, gen)
        norms = _jacobian_norms(lin, power_iterations, gen)
        # ||J_p|| >= ||J_p dx|| / ||dx||: power iteration approaches ||J_p|| from below, and
        # at 12 iterations can stay under what the actual errors already show
        dx_norm = math.sqrt(sum(float(d.pow(2).sum()) for d in dx))
        if dx_norm > 0:
            shown = torch.tensor([linearised[n] / dx_norm for n in lin.names], dtype=norms.dtype)
            norms = torch.maximum(norms, shown)
    boundary_bound_norm = math.sqrt(sum(float(b.pow(2).sum()) for b in bounds))
    worst_row = max(worst_row_ratio(z, b) for z, b in zip(lin.xs, bounds, strict=True))
    return ErrorEstimate(
        bound=_first_order_bound(lin.names, norms, boundary_bound_norm, worst_row, codec),
        estimate=estimate,
        linearised=linearised,
        grad_norm=lin.grad_norm,
        boundary_bound_norm=boundary_bound_norm,
        worst_row_bound=worst_row,
        codec=str(codec),
    )


@contextlib.contextmanager
def _deterministic(caller: str) -> Iterator[None]:
    """Name what torch.func's vmap refuses: a random operation in the blocks (dropout in
    training mode), whose Jacobian is not one linear map."""
    try:
        yield
    except RuntimeError as e:
        if "random operation" not in str(e):
            raise
        raise InvalidArgumentError(
            f"{caller}: the blocks draw random numbers (dropout in training mode?), and the "
            "bound is of one deterministic function: call it on the blocks in eval mode "
            "(blocks.eval()), or with dropout p=0"
        ) from e


def _parameter_table(
    title: str, columns: Sequence[str], rows: Iterable[tuple[str, Sequence[float], str]]
) -> str:
    """Markdown under ``title``: a row per ``(parameter, values, note)``, the values (errors)
    in ``.2e`` under ``columns``, the note after the row (also for
    :meth:`revckpt.testing.ErrorCheck.table`)."""
    lines = [
        title,
        "| " + " | ".join(["parameter", *columns]) + " |",
        "|" + "---|" * (len(columns) + 1),
    ]
    for name, values, note in rows:
        lines.append("| " + " | ".join([name, *(f"{v:.2e}" for v in values)]) + " |" + note)
    return "\n".join(lines)


def _warn_if_non_smooth(chain: Sequence[nn.Module], ops: Iterable[str]) -> None:
    """Warn for the kinked modules of ``chain`` and the kinked operations ``ops`` its forward
    ran (functional calls, and modules not on the list: adaptive max pooling, SELU...)."""
    kinks = sorted(
        {type(m).__name__ for b in chain for m in b.modules() if isinstance(m, _NON_SMOOTH)}
    )
    ran = ", ".join(f"aten.{op}" for op in sorted(ops))
    if kinks or ran:
        what = " and run ".join(filter(None, (", ".join(kinks), ran)))
        warnings.warn(
            f"the blocks contain {what}: a compressed input can move "
            "pre-activations across the kink, which the first-order bound and estimate do not "
            "see (e.g. ReLU bias gradients have zero first-order sensitivity). Treat both as "
            "indicative and measure with revckpt.testing.assert_error_within_bound, or use a "
            "smooth activation (GELU, SiLU)",
            NonSmoothWarning,
            stacklevel=3,
        )


#: the second-order part of the gradient change, against the first-order part, above which
#: the first-order bound and estimate are reported not to hold
SECOND_ORDER_LIMIT = 0.5


def _warn_if_not_first_order(
    lin: Linearised, dx: list[torch.Tensor], lin_dx: tuple[torch.Tensor, ...]
) -> None:
    """Warn where the gradients at the decoded boundaries move by more than first order says
    (a smooth activation fed rows large enough to act as a kink: SiLU or GELU on rows of
    magnitude 1e2-1e3; a stationary point): one more evaluation of ``G``."""
    exact = lin.grads(lin.zs)
    moved = lin.grads(tuple(z + d for z, d in zip(lin.zs, dx, strict=True)))
    first = math.sqrt(sum(float(t.pow(2).sum()) for t in lin_dx))
    rest = math.sqrt(
        sum(float((m - e - t).pow(2).sum()) for m, e, t in zip(moved, exact, lin_dx, strict=True))
    )
    scale = math.sqrt(sum(float(e.pow(2).sum()) for e in exact))
    if rest > SECOND_ORDER_LIMIT * first and rest > 1e-12 * scale:
        warnings.warn(
            f"the gradients at the decoded boundaries moved by {rest:.3g} more than first "
            f"order predicts ({first:.3g}): the blocks are not smooth at the scale of the "
            "codec's error here (an activation fed large rows acts as a kink, or inputs sit "
            "at a stationary point), so the first-order bound and estimate do not hold. "
            "Measure the error (revckpt.testing.assert_error_within_bound), normalise the "
            "blocks' inputs (pre-norm), or use a wider format",
            NonSmoothWarning,
            stacklevel=3,
        )


def _random_sign_estimate(
    lin: Linearised, dx: list[torch.Tensor], probes: int, gen: torch.Generator
) -> dict[str, float]:
    """``||J_p diag(|dx|)||_F`` per parameter from ``probes`` random-sign JVPs in one vmap."""
    tangents = tuple(random_sign_tangents(d, probes, gen) for d in dx)
    probed = vmap(lin.push)(tangents)
    return {
        n: float(t.reshape(probes, -1).pow(2).sum(1).mean().sqrt())
        for n, t in zip(lin.names, probed, strict=True)
    }


def _jacobian_norms(lin: Linearised, iterations: int, gen: torch.Generator) -> torch.Tensor:
    """``||J_p||_2`` per parameter ``p`` (from below) by power iteration on ``J_p^T J_p``, one
    vector per parameter, vectorised."""
    _, pull = vjp(lin.grads, lin.zs)
    count = len(lin.names)
    v = tuple(torch.randn((count, *z.shape), generator=gen, dtype=torch.float64) for z in lin.zs)
    sigma = torch.zeros(count, dtype=torch.float64)
    eye = torch.eye(count, dtype=torch.float64)

    def per_vector(w: torch.Tensor, t: torch.Tensor) -> torch.Tensor:  # w[i] for t's row i
        return w.reshape(-1, *([1] * (t.dim() - 1)))

    for _ in range(iterations):
        vnorm = torch.sqrt(squared_norms(v, count)).clamp_min(1e-300)
        v = tuple(t / per_vector(vnorm, t) for t in v)
        jv = vmap(lin.push)(v)
        # keep, for vector p, only the rows of parameter p
        masked = tuple(t * per_vector(eye[:, j], t) for j, t in enumerate(jv))
        sigma = torch.sqrt(squared_norms(masked, count))
        v = vmap(lambda w: pull(w)[0])(masked)
    # For a unit v, ||J_p v|| <= ||J_p^T J_p v|| / ||J_p v|| <= ||J_p||: both converge to the
    # norm from below; take the better (larger) one.
    back = torch.sqrt(squared_norms(v, count))
    ratio = torch.where(sigma > 0, back / sigma.clamp_min(1e-300), torch.zeros_like(sigma))
    return torch.maximum(sigma, ratio)


def _first_order_bound(
    names: list[str],
    norms: torch.Tensor,
    boundary_bound_norm: float,
    worst_row: float,
    codec: Codec,
) -> dict[str, float]:
    """``||J_p||_2 * ||b||_2`` per parameter; ``inf`` (with a warning) where a boundary row's
    codec bound is too large against the row for first order (0 stays 0)."""
    bound = {n: float(norms[i]) * boundary_bound_norm for i, n in enumerate(names)}
    if worst_row <= FIRST_ORDER_LIMIT:
        return bound
    warnings.warn(
        f"with {codec} a boundary row's error bound is {worst_row:.2g} of the row itself: "
        "the codec can lose that row, so there is no first-order bound (reported as inf). "
        "Use scaling='row' or 'block', or a wider format",
        RuntimeWarning,
        stacklevel=3,
    )
    return {n: (math.inf if grad_bound > 0 else 0.0) for n, grad_bound in bound.items()}
