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
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .errors import GradientMismatchError, InvalidArgumentError
from .measure.gradients import GradientError, Inputs, TensorError, gradient_error
from .models.mlp import Norm, mlp_chain

if TYPE_CHECKING:
    from hypothesis.strategies import SearchStrategy

__all__ = ["StackSpec", "assert_gradients_close", "block_stacks", "stack_specs"]


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
    depth: tuple[int, int] = (1, 8),
    width: tuple[int, int] = (2, 16),
    batch: tuple[int, int] = (2, 8),
    dtypes: Sequence[torch.dtype] = (torch.float64,),
    dropout: Sequence[float] = (0.0, 0.3),
    norms: Sequence[Norm] = (None, "layer", "batch"),
) -> SearchStrategy[StackSpec]:
    """Hypothesis strategy of :class:`StackSpec`: ranges are inclusive ``(low, high)``."""
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
