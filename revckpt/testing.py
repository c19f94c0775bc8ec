"""Assertions and hypothesis strategies for users' own test suites.

::

    from revckpt.testing import assert_gradients_close

    def test_my_checkpointed_model_is_exact():
        model = MyModel().double()
        x = torch.randn(8, 64, dtype=torch.float64)
        assert_gradients_close(checkpointed(model), model, x, rtol=1e-12)

The hypothesis strategies (:func:`stack_specs`, :func:`block_stacks`) need the ``test`` extra
(``pip install revckpt[test]``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .errors import GradientMismatchError, InvalidArgumentError
from .measure.gradients import GradientError, Inputs, TensorError, gradient_error
from .measure.state import preserved
from .models.mlp import Norm, mlp_chain

if TYPE_CHECKING:
    from hypothesis.strategies import SearchStrategy

__all__ = [
    "ErrorCheck",
    "StackSpec",
    "assert_error_within_bound",
    "assert_gradients_close",
    "block_stacks",
    "stack_specs",
]

#: How many times the exact float32 path's own error :func:`assert_error_within_bound` allows
#: the approximate path: the two round differently (a gradient that is zero mathematically,
#: rounding alone in float32, measured up to 1.9x the exact path's error over 300 seeds).
_ROUNDING_PATHS = 3.0


def assert_gradients_close(
    candidate: nn.Module,
    reference: nn.Module | None,
    inputs: Inputs,
    *,
    rtol: float = 1e-5,
    atol: float = 0.0,
    kwargs: Mapping[str, Any] | None = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    seed: int = 0,
) -> GradientError:
    """Assert that every gradient of ``candidate`` matches ``reference`` in the L2 sense.

    For every parameter and every input that requires grad, with ``g`` the candidate's gradient
    and ``r`` the reference's::

        ||g - r||_2 <= atol + rtol * ||r||_2

    A NaN or infinite gradient on either side always fails.

    ``reference=None`` compares against a float64 copy of ``candidate`` (see
    :func:`revckpt.measure.gradient_error`, which also explains ``loss_fn`` and ``seed``). On
    failure raises :class:`~revckpt.GradientMismatchError` (an ``AssertionError``) that lists the
    worst tensors with their errors; on success returns the measured :class:`GradientError`.
    """
    if rtol < 0 or atol < 0:
        raise InvalidArgumentError(f"rtol and atol must be >= 0, got rtol={rtol}, atol={atol}")
    report = gradient_error(candidate, reference, inputs, kwargs=kwargs, loss_fn=loss_fn, seed=seed)

    def excess(e: TensorError) -> float:
        if not math.isfinite(e.diff_norm):
            return math.inf  # NaN or inf in either gradient always fails
        allowed = atol + rtol * e.ref_norm
        if e.diff_norm <= allowed:
            return 0.0
        return e.diff_norm / allowed if allowed > 0 else float("inf")

    failing = sorted(
        ((n, e) for n, e in report.per_tensor.items() if excess(e) > 0),
        key=lambda ne: -excess(ne[1]),
    )
    if failing:
        lines = [
            f"{len(failing)} of {len(report.per_tensor)} gradients differ by more than "
            f"atol + rtol*||ref|| (rtol={rtol:g}, atol={atol:g}); worst first:"
        ]
        for name, e in failing[:5]:
            lines.append(
                f"  {name}: ||g-r|| = {e.diff_norm:.3e} vs allowed {atol + rtol * e.ref_norm:.3e} "
                f"(rel_l2 {e.rel_l2:.3e}, 1-cos {e.one_minus_cos:.3e}, "
                f"max_abs_rel {e.max_abs_rel:.3e})"
            )
        if len(failing) > 5:
            lines.append(f"  ... and {len(failing) - 5} more")
        lines.append(f"overall rel_l2 {report.overall.rel_l2:.3e}")
        if reference is not None:
            lines.extend(_weight_differences(candidate, reference))
        raise GradientMismatchError("\n".join(lines))
    return report


def _weight_differences(candidate: nn.Module, reference: nn.Module) -> list[str]:
    """A hint when the two models do not even hold the same weights (a common test mistake)."""
    ref = dict(reference.named_parameters())
    differing = []
    for name, p in candidate.named_parameters():
        r = ref.get(name)
        if r is None or r.shape != p.shape:
            continue
        eps = (
            max(torch.finfo(p.dtype).eps, torch.finfo(r.dtype).eps)
            if (p.is_floating_point() and r.is_floating_point())
            else 0.0
        )
        if not torch.allclose(p.detach().double(), r.detach().double(), rtol=eps, atol=0.0):
            differing.append(name)
    if not differing:
        return []
    return [
        f"note: {len(differing)} parameters hold different values in candidate and reference "
        f"(e.g. {differing[0]!r}); build both from the same weights (copy.deepcopy, "
        "load_state_dict, or the same torch.manual_seed before each constructor)"
    ]


@dataclass(frozen=True)
class StackSpec:
    """A residual MLP stack and its input, described by plain values (printable, shrinkable)."""

    depth: int
    width: int
    hidden: int
    batch: int
    dtype: torch.dtype
    dropout: float
    norm: Norm
    seed: int

    def build(self) -> nn.Sequential:
        """The stack, with weights drawn from ``seed``, in ``dtype``, in training mode."""
        cuda = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
        with torch.random.fork_rng(devices=cuda):
            torch.manual_seed(self.seed)
            model = mlp_chain(
                self.depth, self.width, self.hidden, dropout=self.dropout, norm=self.norm
            )
        return model.to(self.dtype).train()

    def make_input(self, *, requires_grad: bool = True) -> torch.Tensor:
        """A random input for the stack (seeded by the spec)."""
        gen = torch.Generator().manual_seed(self.seed + 1)
        x = torch.randn(self.batch, self.width, generator=gen, dtype=torch.float64)
        return x.to(self.dtype).requires_grad_(requires_grad)


def _hypothesis_strategies() -> Any:
    try:
        from hypothesis import strategies as st
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(
            "revckpt.testing strategies need hypothesis: pip install 'revckpt[test]'"
        ) from err
    return st


def stack_specs(
    *,
    depth: tuple[int, int] = (2, 8),
    width: tuple[int, int] = (2, 16),
    batch: tuple[int, int] = (2, 8),
    dtypes: Sequence[torch.dtype] = (torch.float64,),
    dropout: Sequence[float] = (0.0, 0.3),
    norms: Sequence[Norm] = (None, "layer", "batch"),
) -> SearchStrategy[StackSpec]:
    """Hypothesis strategy of :class:`StackSpec`: ranges are inclusive ``(low, high)``. Stacks
    have two blocks or more by default: ``convert`` and ``fit`` plan repeated blocks, and a
    single one is refused ("no repeated blocks"); ``depth=(1, ...)`` draws single blocks too,
    for ``revckpt.checkpoint_sequential``."""
    st = _hypothesis_strategies()
    for name, (lo, hi) in {"depth": depth, "width": width, "batch": batch}.items():
        if not 1 <= lo <= hi:
            raise InvalidArgumentError(f"{name}=({lo}, {hi}) must satisfy 1 <= low <= high")
    if "batch" in norms and batch[0] < 2:
        raise InvalidArgumentError("BatchNorm needs batch >= 2; use batch=(2, ...)")

    @st.composite
    def specs(draw: Any) -> StackSpec:
        w = draw(st.integers(*width))
        return StackSpec(
            depth=draw(st.integers(*depth)),
            width=w,
            hidden=draw(st.integers(1, 4 * w)),
            batch=draw(st.integers(*batch)),
            dtype=draw(st.sampled_from(list(dtypes))),
            dropout=draw(st.sampled_from(list(dropout))),
            norm=draw(st.sampled_from(list(norms))),
            seed=draw(st.integers(0, 2**31 - 1)),
        )

    return specs()


def block_stacks(**ranges: Any) -> SearchStrategy[tuple[nn.Sequential, torch.Tensor]]:
    """Hypothesis strategy of ``(model, input)`` pairs from :func:`stack_specs` ``(**ranges)``."""
    return stack_specs(**ranges).map(lambda s: (s.build(), s.make_input()))


@dataclass(frozen=True)
class ErrorCheck:
    """What :func:`assert_error_within_bound` measured, per parameter (absolute L2 norms,
    computed in float64)."""

    #: The approximate path's gradient error against float64.
    measured: dict[str, float]
    #: The exact float32 path's error against float64 (the rounding the approximation comes
    #: on top of).
    exact: dict[str, float]
    #: The first-order bound of :func:`revckpt.approx.bounds.estimate_error`.
    bound: dict[str, float]
    #: Its random-sign estimate.
    estimate: dict[str, float]
    #: The norm of the float64 gradient.
    grad_norm: dict[str, float]
    #: The approximation checked, as text (``str`` of the :class:`~revckpt.approx.Approx`).
    config: str
    #: The largest codec error bound of one row relative to that row.
    worst_row_bound: float = 0.0
    #: A few units of the gradients' dtype, ``ulps * eps * ||G_64||``: the round-off of the
    #: comparison itself.
    roundoff: dict[str, float] = field(default_factory=dict)

    @property
    def allowed(self) -> dict[str, float]:
        """Per parameter: the bound, 3 times the exact float32 path's own
        error, and the round-off."""
        return {
            n: self.bound[n] + _ROUNDING_PATHS * self.exact[n] + self.roundoff.get(n, 0.0)
            for n in self.bound
        }

    @property
    def violations(self) -> list[str]:
        """Parameters whose measured error exceeds what is allowed."""
        allowed = self.allowed
        return [n for n, m in self.measured.items() if not m <= allowed[n]]

    def table(self) -> str:
        """Markdown: measured error, bound, estimate and float32 error per parameter."""
        from .approx.bounds import _parameter_table

        violations, rows = self.violations, []
        for n, m in self.measured.items():
            g = self.grad_norm[n] or 1.0
            flag = "  <-- above bound" if n in violations else ""
            rows.append(
                (n, [m / g, self.bound[n] / g, self.estimate[n] / g, self.exact[n] / g], flag)
            )
        title = f"gradient error of {self.config} against float64, relative to ||grad||"
        return _parameter_table(title, ("measured", "bound", "estimate", "exact fp32"), rows)

    def __str__(self) -> str:
        return self.table()


def _chain_grads(blocks: nn.Sequential, x: torch.Tensor, ct: torch.Tensor, **kw: Any) -> list[Any]:
    from .checkpoint import checkpoint_sequential

    for p in blocks.parameters():
        p.grad = None
    y = checkpoint_sequential(blocks, len(blocks), x, **kw) if kw else blocks(x)
    y.backward(ct.to(y.dtype))
    return [
        torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()  # unused: zero
        for p in blocks.parameters()
        if p.requires_grad
    ]


def _as_approx(approx: Any) -> Any:
    from .approx import Approx, Codec

    if isinstance(approx, Codec):
        return Approx(
            store=approx.format,
            scaling=approx.scaling,
            block_size=approx.block_size,
            rounding=approx.rounding,
        )
    if not isinstance(approx, Approx):
        raise InvalidArgumentError(
            f"approx must be a revckpt.approx.Approx or Codec, got {type(approx).__name__}"
        )
    return approx


def assert_error_within_bound(
    blocks: nn.Sequential | Sequence[nn.Module],
    x: torch.Tensor,
    approx: Any,
    *,
    cotangent: torch.Tensor | None = None,
    probes: int = 8,
    power_iterations: int = 12,
    roundoff_ulps: float = 4.0,
) -> ErrorCheck:
    """Run the chain exactly and with every block input kept through ``approx`` (a
    :class:`revckpt.approx.Approx` or :class:`~revckpt.approx.Codec`), measure each parameter
    gradient's error against float64, and assert it is within the hard bound::

        ||G_approx - G_64|| <= bound + 3 ||G_exact32 - G_64|| + roundoff_ulps * eps * ||G_64||

    (the bound covers the compression; the second term is the float32 rounding of the exact
    path, three times, for the approximate path's own float32 rounding,
    which differs from it: where a gradient is zero mathematically, a bias before a train-mode
    BatchNorm, its float32 value is rounding alone, and the approximate path's measured up to
    1.9x the exact path's over 300 seeds); the third, with
    ``eps`` that of the gradients' dtype, allows for the two paths rounding differently, which
    matters where the bound itself is at round-off level, ~1e-7 relative in float32). The
    norms are taken in float64. A
    low-precision recompute (``recompute_dtype``) has no bound (``inf``): the check then
    reports the measured error only; ``store=None`` must be exact up to float32 rounding. Raises
    :class:`~revckpt.GradientMismatchError` with the per-parameter table when a parameter is
    above; returns the :class:`ErrorCheck` (print it for the table) otherwise. The blocks must
    be deterministic (see :mod:`revckpt.approx.bounds`); they are left as they were (gradients,
    BatchNorm statistics), and so is ``x`` (taken detached: a non-leaf's graph is not run). A
    parameter the chain does not use counts as a zero gradient; blocks sharing a parameter, an
    integer or empty ``x`` are refused.
    """
    if not roundoff_ulps >= 0:
        raise InvalidArgumentError(
            f"roundoff_ulps={roundoff_ulps}: pass a number >= 0 (units in the last place of "
            "the gradients' dtype, e.g. the default 4)"
        )
    approx = _as_approx(approx)
    chain = blocks if isinstance(blocks, nn.Sequential) else nn.Sequential(*blocks)
    _check_bound_inputs(chain, x)
    x = x.detach()  # the check's own leaf: the caller's graph and gradients are left alone
    with preserved(chain):  # statistics, gradients (x's too) as they were
        return _checked_within_bound(
            chain, x, approx, cotangent, probes, power_iterations, roundoff_ulps
        )


def _check_bound_inputs(chain: nn.Sequential, x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or not x.numel():
        what = (
            f"a {type(x).__name__}"
            if not isinstance(x, torch.Tensor)
            else ("an empty tensor" if x.is_floating_point() else f"a {x.dtype} tensor")
        )
        raise InvalidArgumentError(
            f"assert_error_within_bound: the chain's input is {what}; the codec keeps "
            "floating-point block inputs, so pass a non-empty floating-point one (start the "
            "chain after an embedding of token ids)"
        )
    dtypes = {p.dtype for p in chain.parameters() if p.is_floating_point()}
    if len(dtypes) == 1 and x.dtype not in dtypes:
        raise InvalidArgumentError(
            f"assert_error_within_bound: the chain's input is {x.dtype} and its parameters "
            f"{dtypes.pop()}: pass the input in the parameters' dtype (the check makes its own "
            "float64 copy)"
        )
    owner: dict[int, int] = {}
    for k, block in enumerate(chain):
        for name, p in block.named_parameters():
            if not p.requires_grad:
                continue  # not checked: a frozen table the blocks share is fine
            first = owner.setdefault(id(p), k)
            if first != k:
                raise InvalidArgumentError(
                    f"assert_error_within_bound: blocks {first} and {k} share the parameter "
                    f"{name!r}; the bound is taken block by block over each block's own "
                    "parameters: check a chain whose blocks own theirs"
                )


def _checked_within_bound(
    chain: nn.Sequential,
    x: torch.Tensor,
    approx: Any,
    cotangent: torch.Tensor | None,
    probes: int,
    power_iterations: int,
    roundoff_ulps: float,
) -> ErrorCheck:
    with torch.no_grad():
        out = chain(x)
    ct = torch.ones_like(out) if cotangent is None else cotangent
    names = [
        f"{k}.{n}" for k, b in enumerate(chain) for n, p in b.named_parameters() if p.requires_grad
    ]
    bound, estimate, worst_row = _bounds(chain, x, approx, ct, names, probes, power_iterations)
    check = ErrorCheck(
        **_measured(chain, x, approx, ct, names, roundoff_ulps),
        bound=bound,
        estimate=estimate,
        config=str(approx),
        worst_row_bound=worst_row,
    )
    if check.violations:
        raise GradientMismatchError(
            f"gradient error above the first-order bound for {check.violations}:\n"
            f"{check.table()}\nThe bound assumes smooth blocks (no ReLU kinks crossed, no "
            "saturated softmax); see docs/approx.md"
        )
    return check


def _bounds(
    chain: nn.Sequential,
    x: torch.Tensor,
    approx: Any,
    ct: torch.Tensor,
    names: list[str],
    probes: int,
    power_iterations: int,
) -> tuple[dict[str, float], dict[str, float], float]:
    """Per parameter, the bound and the estimate of ``approx``'s gradient error, and the
    worst row bound (:func:`revckpt.approx.bounds.estimate_error`)."""
    from .approx.bounds import estimate_error

    if approx.recompute_dtype is not None or approx.codec is None:
        # not modelled (a low-precision recompute) or nothing compressed: measured only
        bound = dict.fromkeys(names, math.inf if approx.recompute_dtype is not None else 0.0)
        return bound, dict.fromkeys(names, math.nan), 0.0
    est = estimate_error(
        chain, x, approx, cotangent=ct, probes=probes, power_iterations=power_iterations
    )
    return est.bound, est.estimate, est.worst_row_bound


def _measured(
    chain: nn.Sequential,
    x: torch.Tensor,
    approx: Any,
    ct: torch.Tensor,
    names: list[str],
    roundoff_ulps: float,
) -> dict[str, dict[str, float]]:
    """The measured fields of an :class:`ErrorCheck`: the errors of the float32 gradients,
    exact and through ``approx``, against float64, the gradients' norms and the round-off
    allowed."""
    import copy

    exact32 = _chain_grads(chain, x, ct)
    approx32 = _chain_grads(chain, x, ct, strategy=approx)
    chain64 = copy.deepcopy(chain).double()
    exact64 = _chain_grads(chain64, x.double(), ct.double())
    for p in chain.parameters():
        p.grad = None

    def dist(a: list[Any], b: list[Any]) -> dict[str, float]:
        return {n: float((u.double() - v).norm()) for n, u, v in zip(names, a, b, strict=True)}

    grad_norm = {n: float(g.norm()) for n, g in zip(names, exact64, strict=True)}
    ulp = {n: roundoff_ulps * torch.finfo(g.dtype).eps for n, g in zip(names, exact32, strict=True)}
    return {
        "measured": dist(approx32, exact64),
        "exact": dist(exact32, exact64),
        "grad_norm": grad_norm,
        "roundoff": {n: ulp[n] * grad_norm[n] for n in names},
    }
