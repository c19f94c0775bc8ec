"""Measure plans on a model: peak memory, time against store-all, gradient error against float64.

:func:`report` runs each :class:`~revckpt.schedule.Plan` on the chain it was solved for and
measures, side by side:

* **peak** — :func:`measure_peak`: the peak live bytes of one training step (forward, then
  backward from a full output gradient), counted from a fresh copy of the input, with the
  parameter gradients already allocated (steady state, as from the second step on). This is
  the quantity the cost model of :mod:`revckpt.schedule.costs` predicts, so
  ``measured / predicted`` tests the prediction.
* **time** — :func:`~revckpt.time_ratios`: every plan and store-all interleaved in rotated
  rounds; the ratio is the median of per-round ``t_plan / t_store``.
* **gradient error** — the overall relative L2 error of all parameter and input gradients
  against a float64 copy of the chain run with plain autograd
  (:func:`~revckpt.gradient_error`). Store-all in float32 gives the round-off floor.

:class:`Report` prints a Markdown table, writes JSON, and plots measured memory against
measured overhead with the Pareto front and the chosen plan marked (matplotlib, installed with
``pip install "revckpt[report]"``).
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ._numbers import mib
from ._report_plots import plot_errors, plot_memory_time
from ._step_memory import StepMemory, measure_peak, measure_step
from .errors import InvalidArgumentError, InvalidInputTypeError
from .measure import gradient_error, time_ratios
from .measure.state import cut_from_graph, preserved
from .schedule import Plan, apply

__all__ = ["PlanMeasurement", "Report", "StepMemory", "measure_peak", "measure_step", "report"]

STORE_ALL = "store-all"


class _BlocksInOrder(nn.Module):
    """Blocks under their original names, run one after the other (store-all)."""

    def __init__(self, named: Sequence[tuple[str, nn.Module]], dtype: torch.dtype | None = None):
        super().__init__()
        for name, block in named:
            self.add_module(name, block)
        self._order = [name for name, _ in named]
        self._dtype = dtype

    def forward(self, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        if self._dtype is not None:
            x = x.to(self._dtype) if x.is_floating_point() else x
            kwargs = {
                k: v.to(self._dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                for k, v in kwargs.items()
            }
        for name in self._order:
            x = self._modules[name](x, **kwargs)
        return x


@dataclass(frozen=True)
class PlanMeasurement:
    """One row of a :class:`Report`: what a plan was predicted to cost and what it measured."""

    #: The row's label in the table (``"store-all"``, ``"per-block"``, ``"scheduler"``, ...).
    name: str
    #: One strategy per block of the chain, in order.
    strategies: tuple[str, ...]
    #: Peak live bytes of the whole training step, from :class:`~revckpt.measure.MemoryMeter`.
    measured_peak_bytes: int
    #: Bytes alive between forward and backward apart from the input and the output (what the
    #: plan keeps for backward).
    measured_retained_bytes: int
    #: The plan's predicted peak (store-all's measured peak for store-all run plainly).
    predicted_peak_bytes: int
    #: The memory budget the plan was solved for, in bytes; ``None``: no budget.
    memory_budget_bytes: int | None
    #: Median step time over store-all's, interleaved rounds (1 = as fast).
    time_ratio: float
    #: The interquartile range of ``time_ratio``.
    time_ratio_iqr: tuple[float, float]
    #: The plan's predicted extra time, as a fraction of store-all's step.
    predicted_overhead: float
    #: Overall relative L2 gradient error against float64 (``nan``: not measured).
    gradient_error: float
    #: The relative gradient error the plan predicts (0 for exact strategies).
    predicted_error: float

    @property
    def peak_ratio(self) -> float:
        """Measured over predicted peak."""
        return self.measured_peak_bytes / self.predicted_peak_bytes

    @property
    def within_budget(self) -> bool | None:
        """Whether the measured peak fits the plan's budget (``None``: no budget)."""
        if self.memory_budget_bytes is None:
            return None
        return self.measured_peak_bytes <= self.memory_budget_bytes

    def within_error(self, error_budget: float, *, floor: float = 0.0) -> bool:
        """Whether the measured gradient error is within ``error_budget`` of the float32
        round-off ``floor`` (store-all's measured error, which exact strategies share to the
        last bits): ``gradient_error <= error_budget + 2 * floor``. ``False`` when the error
        was not measured (``nan``)."""
        return self.gradient_error <= error_budget + 2 * floor


@dataclass(frozen=True)
class Report:
    """Measured figures of several plans of one chain, with store-all first."""

    #: One measurement per plan, store-all first.
    rows: tuple[PlanMeasurement, ...]
    #: Store-all's measured whole-step peak, what the memory column is a fraction of.
    store_all_peak_bytes: int
    #: The shape of the chain's input the plans were measured on.
    input_shape: tuple[int, ...]
    #: The name of the plan chosen (by :func:`revckpt.schedule.verify` or ``fit``), if any.
    chosen: str | None = None
    #: The largest relative gradient error a plan may have; plans measured over it
    #: (:meth:`over_error_budget`) are marked in the table and the plot and are left out of
    #: the Pareto front. ``None``: no budget.
    error_budget: float | None = None

    def row(self, name: str) -> PlanMeasurement:
        """The measurement of the plan named ``name``."""
        for r in self.rows:
            if r.name == name:
                return r
        raise InvalidArgumentError(f"no plan named {name!r}; the report has {self.names}")

    @property
    def names(self) -> list[str]:
        """Plan names, store-all first."""
        return [r.name for r in self.rows]

    @property
    def error_floor(self) -> float:
        """Store-all's measured gradient error: the float32 round-off of the model, which
        every exact strategy shares (0 when not measured)."""
        plain = next((r for r in self.rows if r.name == STORE_ALL), None)
        if plain is None or not math.isfinite(plain.gradient_error):
            return 0.0
        return plain.gradient_error

    def over_error_budget(self, name: str) -> bool:
        """Whether the plan named ``name`` measured a gradient error over the report's
        ``error_budget`` (see :meth:`PlanMeasurement.within_error`; an error not measured
        counts as over); ``False`` when the report has no error budget."""
        row = self.row(name)
        if self.error_budget is None:
            return False
        return not row.within_error(self.error_budget, floor=self.error_floor)

    def table(self) -> str:
        """Markdown: measured and predicted peak, time ratio, gradient error per plan. Both
        time columns are ratios to the store-all step (the predicted one is
        ``1 + predicted_overhead``); a retained size not measured reads ``-``."""
        lines = [
            "| plan | measured peak MiB | % of store-all | retained MiB | predicted MiB | "
            "measured/predicted | budget MiB | time vs store-all | predicted time | "
            "gradient error | predicted error |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in self.rows:
            budget = (
                "-" if r.memory_budget_bytes is None else mib(r.memory_budget_bytes, unit=False)
            )
            mark = " (chosen)" if r.name == self.chosen else ""
            mark += " (over the error budget)" if self.over_error_budget(r.name) else ""
            cells = [
                f"{r.name}{mark}",
                mib(r.measured_peak_bytes, unit=False),
                f"{r.measured_peak_bytes / self.store_all_peak_bytes:.1%}",
                # 0: not measured (fit_verified meters whole steps only)
                mib(r.measured_retained_bytes, unit=False) if r.measured_retained_bytes else "-",
                mib(r.predicted_peak_bytes, unit=False),
                f"{r.peak_ratio:.3f}",
                budget,
                f"{r.time_ratio:.3f}",
                f"{1 + r.predicted_overhead:.3f}",
                f"{r.gradient_error:.1e}",
                f"{r.predicted_error:.1e}",
            ]
            lines.append("| " + " | ".join(cells) + " |")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def to_dict(self) -> dict[str, Any]:
        """The report as plain data (format ``revckpt.Report/1``)."""
        return {
            "format": "revckpt.Report/1",
            "store_all_peak_bytes": self.store_all_peak_bytes,
            "input_shape": list(self.input_shape),
            "chosen": self.chosen,
            "error_budget": self.error_budget,
            "rows": [
                {**asdict(r), "peak_ratio": r.peak_ratio, "within_budget": r.within_budget}
                for r in self.rows
            ],
        }

    def to_json(self, path: str | Path | None = None) -> str:
        """The report as JSON text (``nan`` written as ``null``); also written to ``path``."""
        text = json.dumps(_finite(self.to_dict()), indent=2)
        if path is not None:
            Path(path).write_text(text + "\n")
        return text

    def pareto(self) -> list[str]:
        """Names of the plans no other plan beats on both measured peak and measured time (at
        least as good on both, better on one). With an ``error_budget``, the plans measured
        over it are left out: they are not on the front and beat no other plan."""
        rows = [r for r in self.rows if not self.over_error_budget(r.name)]
        front = []
        for r in rows:
            dominated = any(
                o.measured_peak_bytes <= r.measured_peak_bytes
                and o.time_ratio <= r.time_ratio
                and (o.measured_peak_bytes, o.time_ratio) != (r.measured_peak_bytes, r.time_ratio)
                for o in rows
            )
            if not dominated:
                front.append(r.name)
        return front

    def plot(self, path: str | Path, *, title: str | None = None) -> Path:
        """Measured peak (% of store-all) against measured time ratio, one point per plan, the
        Pareto front as a step line, the chosen plan as a star and its budget as a vertical
        line; plans over the report's ``error_budget`` as grey crosses. Written as PNG (or any
        format matplotlib infers from ``path``)."""
        return plot_memory_time(self, path, title=title)

    def plot_errors(self, path: str | Path, *, title: str | None = None) -> Path:
        """Measured gradient error against float64 per plan (log scale), with store-all's
        (the float32 round-off floor of the model) as a dashed line; PNG or any format
        matplotlib infers from ``path``."""
        return plot_errors(self, path, title=title)


def _named(blocks: nn.Sequential | Sequence[nn.Module]) -> list[tuple[str, nn.Module]]:
    if isinstance(blocks, nn.Sequential):
        return list(blocks.named_children())
    named = [(str(i), b) for i, b in enumerate(blocks)]
    if not all(isinstance(b, nn.Module) for _, b in named):
        raise InvalidInputTypeError("report needs nn.Module blocks (an nn.Sequential or a list)")
    return named


def report(
    blocks: nn.Sequential | Sequence[nn.Module],
    x: torch.Tensor,
    plans: Sequence[Plan],
    *,
    kwargs: Mapping[str, Any] | None = None,
    chosen: str | None = "optimal",
    repeats: int = 9,
    warmup: int = 1,
    errors: bool = True,
    seed: int = 0,
) -> Report:
    """Measure ``plans`` (solved for ``blocks`` on inputs like ``x``) and store-all.

    ``chosen``: the plan to mark (default the one named ``"optimal"``, if any). ``repeats``,
    ``warmup``: timing rounds (see :func:`~revckpt.time_ratios`). ``errors=False`` skips the
    float64 gradient comparison (``gradient_error`` is then ``nan``). Plan names must be
    distinct; ``"store-all"`` is reserved for the plain chain measured first.
    """
    named = _named(blocks)
    names = _check_plans(named, plans)
    kw = cut_from_graph(kwargs or {})
    plain = _BlocksInOrder(named)
    models: dict[str, nn.Module] = {STORE_ALL: plain}
    for p in plans:
        models[p.name] = apply(blocks, p)
    # the caller's keyword tensors that require grad get no gradients from these steps
    callers = [v for v in kw.values() if isinstance(v, torch.Tensor)]
    with preserved(plain, tensors=callers):
        steps = {name: measure_step(m, x, kwargs=kw) for name, m in models.items()}
        ratios = time_ratios(
            _steppers(models, x, kw),
            baseline=STORE_ALL,
            repeats=repeats,
            warmup=warmup,
        )
        if errors:
            errs = _gradient_errors(named, models, x, kw, seed)
        else:
            errs = dict.fromkeys(models, math.nan)
    store_all = PlanMeasurement(
        name=STORE_ALL,
        strategies=("store",) * len(named),
        measured_peak_bytes=steps[STORE_ALL].peak_bytes,
        measured_retained_bytes=steps[STORE_ALL].retained_bytes,
        predicted_peak_bytes=plans[0].store_all_peak_bytes,
        memory_budget_bytes=None,
        time_ratio=ratios[STORE_ALL].ratio,
        time_ratio_iqr=(ratios[STORE_ALL].q25, ratios[STORE_ALL].q75),
        predicted_overhead=0.0,
        gradient_error=errs[STORE_ALL],
        predicted_error=0.0,
    )
    rows = [store_all, *(_measured(p, steps[p.name], ratios[p.name], errs[p.name]) for p in plans)]
    return Report(
        rows=tuple(rows),
        store_all_peak_bytes=steps[STORE_ALL].peak_bytes,
        input_shape=tuple(x.shape),
        chosen=chosen if chosen in names else None,
    )


def _check_plans(named: list[tuple[str, nn.Module]], plans: Sequence[Plan]) -> list[str]:
    """The plans' names, after checking that there are blocks and distinct, named plans."""
    if not named:
        raise InvalidArgumentError("report needs a non-empty chain of blocks")
    if not plans:
        raise InvalidArgumentError("report needs at least one plan (from schedule.solve/baseline)")
    if not all(isinstance(p, Plan) for p in plans):
        raise InvalidInputTypeError("report(blocks, x, plans): plans must be schedule.Plan objects")
    names = [p.name for p in plans]
    if len(set(names)) != len(names) or STORE_ALL in names:
        raise InvalidArgumentError(
            f"plan names must be distinct and not {STORE_ALL!r}, got {names}; rename with "
            "dataclasses.replace(plan, name=...)"
        )
    return names


def _steppers(models: dict[str, nn.Module], x: torch.Tensor, kw: dict[str, Any]) -> dict[str, Any]:
    """One timed training step per model: forward on one leaf view of ``x``, backward from a
    full output gradient (made once, shared)."""
    leaf = x.detach().requires_grad_(x.is_floating_point())
    grad: list[torch.Tensor] = []

    def stepper(model: nn.Module) -> Any:
        def step() -> None:
            leaf.grad = None
            y = model(leaf, **kw)
            if not grad:
                grad.append(torch.ones_like(y))
            y.backward(grad[0])

        return step

    return {name: stepper(m) for name, m in models.items()}


def _gradient_errors(
    named: list[tuple[str, nn.Module]],
    models: dict[str, nn.Module],
    x: torch.Tensor,
    kw: dict[str, Any],
    seed: int,
) -> dict[str, float]:
    """Each model's overall relative gradient error against a float64 copy of the blocks."""
    reference = _BlocksInOrder([(n, copy.deepcopy(b)) for n, b in named], dtype=torch.float64).to(
        torch.float64
    )
    errs = {}
    for name, m in models.items():
        inputs = x.detach().requires_grad_(x.is_floating_point())
        errs[name] = gradient_error(m, reference, inputs, kwargs=kw, seed=seed).overall.rel_l2
    return errs


def _measured(p: Plan, step: StepMemory, ratio: Any, error: float) -> PlanMeasurement:
    """The row of plan ``p``: its measurements beside its predictions."""
    return PlanMeasurement(
        name=p.name,
        strategies=tuple(p.strategies),
        measured_peak_bytes=step.peak_bytes,
        measured_retained_bytes=step.retained_bytes,
        predicted_peak_bytes=p.predicted_peak_bytes,
        memory_budget_bytes=p.memory_budget_bytes,
        time_ratio=ratio.ratio,
        time_ratio_iqr=(ratio.q25, ratio.q75),
        predicted_overhead=p.predicted_overhead,
        gradient_error=error,
        predicted_error=p.predicted_error,
    )


def _finite(v: Any) -> Any:
    """``v`` with every non-finite float (at any depth of dicts, lists and tuples) ``None``,
    as JSON writes ``null``."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _finite(u) for k, u in v.items()}
    if isinstance(v, (list, tuple)):
        return [_finite(u) for u in v]
    return v
