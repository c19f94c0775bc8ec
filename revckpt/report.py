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

from .errors import InvalidArgumentError, InvalidInputTypeError
from .measure import MemoryMeter, gradient_error, time_ratios
from .measure.state import preserved
from .schedule import Plan, apply

__all__ = ["PlanMeasurement", "Report", "StepMemory", "measure_peak", "measure_step", "report"]

STORE_ALL = "store-all"


@dataclass(frozen=True)
class StepMemory:
    """One training step: ``peak_bytes`` (see :func:`measure_peak`) and ``retained_bytes``, the
    bytes alive between forward and backward apart from the input and the output (what the
    strategy keeps for backward)."""

    peak_bytes: int
    retained_bytes: int


def measure_step(
    model: nn.Module,
    x: torch.Tensor,
    *,
    kwargs: Mapping[str, Any] | None = None,
    device: str | torch.device | None = None,
) -> StepMemory:
    """Peak and retained bytes of one training step of ``model`` on ``x``.

    One warm-up step runs first; the measured step then counts the input copy, the activations,
    the output (held until the step ends, as a loss head that saves its input holds it), its
    gradient (a full tensor made during backward, as a real loss produces) and the input
    gradient, and not the parameters nor their gradients (allocated before the meter starts).
    The chain input counts from the start: a leaf that requires grad stays alive to the end of
    the step. The parameters' ``.grad`` and the buffers (BatchNorm statistics) are restored
    afterwards.
    """
    kw = dict(kwargs or {})
    params = [p for p in model.parameters() if p.requires_grad]
    retained: list[int] = []
    weight: list[torch.Tensor] = []
    meter: MemoryMeter | None = None

    def step() -> None:
        leaf = x.detach().clone().requires_grad_(x.is_floating_point())
        y = model(leaf, **kw)
        if not isinstance(y, torch.Tensor):
            raise InvalidInputTypeError(
                f"measure_step needs a model returning one tensor, got {type(y).__name__}"
            )
        if meter is not None:
            retained.append(meter.live_bytes - _nbytes(y) - _nbytes(leaf))
        if not weight:  # allocated in the warm-up step, outside the meter
            weight.append(torch.ones_like(y))
        # a loss whose gradient with respect to y is a full tensor made (and freed) by the
        # engine, as a real loss head's is; y stays alive (a head saves its input)
        (y * weight[0]).sum().backward()

    with preserved(model):
        for p in params:
            p.grad = torch.zeros_like(p)
        step()
        meter = MemoryMeter(device if device is not None else x.device)
        with meter:
            step()
    return StepMemory(peak_bytes=meter.peak_bytes, retained_bytes=max(0, retained[0]))


def measure_peak(
    model: nn.Module,
    x: torch.Tensor,
    *,
    kwargs: Mapping[str, Any] | None = None,
    device: str | torch.device | None = None,
) -> int:
    """Peak live bytes of one training step (see :func:`measure_step`): what the scheduler's
    cost model predicts as ``Plan.predicted_peak_bytes``."""
    return measure_step(model, x, kwargs=kwargs, device=device).peak_bytes


def _nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


class _Chain(nn.Module):
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
    """One row of a :class:`Report`. Bytes are bytes; ``time_ratio`` is against store-all (1 =
    as fast); ``gradient_error`` is the overall relative L2 error against float64 (``nan`` when
    not measured); ``predicted_*`` come from the plan (``None`` for store-all run plainly)."""

    name: str
    strategies: tuple[str, ...]
    measured_peak_bytes: int
    measured_retained_bytes: int
    predicted_peak_bytes: int
    memory_budget_bytes: int | None
    time_ratio: float
    time_ratio_iqr: tuple[float, float]
    predicted_overhead: float
    gradient_error: float
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
    """Measured figures of several plans of one chain, with store-all first.

    ``error_budget`` (optional): the largest relative gradient error a plan may have; plans
    measured over it (:meth:`over_error_budget`) are marked in the table and the plot and are
    left out of the Pareto front."""

    rows: tuple[PlanMeasurement, ...]
    store_all_peak_bytes: int
    input_shape: tuple[int, ...]
    chosen: str | None = None
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
        """Markdown: measured and predicted peak, time ratio, gradient error per plan."""
        lines = [
            "| plan | measured peak MiB | % of store-all | retained MiB | predicted MiB | "
            "measured/predicted | budget MiB | time vs store-all | predicted overhead | "
            "gradient error | predicted error |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in self.rows:
            budget = (
                "-" if r.memory_budget_bytes is None else f"{r.memory_budget_bytes / 2**20:.2f}"
            )
            mark = " (chosen)" if r.name == self.chosen else ""
            mark += " (over the error budget)" if self.over_error_budget(r.name) else ""
            lines.append(
                f"| {r.name}{mark} | {r.measured_peak_bytes / 2**20:.2f} | "
                f"{r.measured_peak_bytes / self.store_all_peak_bytes:.1%} | "
                f"{r.measured_retained_bytes / 2**20:.2f} | "
                f"{r.predicted_peak_bytes / 2**20:.2f} | {r.peak_ratio:.3f} | {budget} | "
                f"{r.time_ratio:.3f} | {1 + r.predicted_overhead:.3f} | "
                f"{r.gradient_error:.1e} | {r.predicted_error:.1e} |"
            )
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

        def clean(v: Any) -> Any:
            if isinstance(v, float) and not math.isfinite(v):
                return None
            if isinstance(v, dict):
                return {k: clean(u) for k, u in v.items()}
            if isinstance(v, (list, tuple)):
                return [clean(u) for u in v]
            return v

        text = json.dumps(clean(self.to_dict()), indent=2)
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
        plt = _pyplot()
        fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
        base = self.store_all_peak_bytes
        xs = {r.name: 100 * r.measured_peak_bytes / base for r in self.rows}
        ys = {r.name: r.time_ratio for r in self.rows}
        over_label = "over the error budget"
        for r in self.rows:
            chosen = r.name == self.chosen
            over = self.over_error_budget(r.name)
            ax.scatter(
                xs[r.name],
                ys[r.name],
                marker="*" if chosen else ("x" if over else "o"),
                s=220 if chosen else 40,
                color="tab:red" if chosen else ("tab:gray" if over else "tab:blue"),
                zorder=3,
                label=over_label if over and not chosen else None,
            )
            if over and not chosen:
                over_label = None  # one legend entry
            ax.annotate(
                r.name,
                (xs[r.name], ys[r.name]),
                textcoords="offset points",
                xytext=(5, 4),
                fontsize=8,
            )
        front = sorted(self.pareto(), key=lambda n: xs[n])
        ax.step(
            [xs[n] for n in front],
            [ys[n] for n in front],
            where="post",
            color="tab:gray",
            linestyle="--",
            label="Pareto front (measured)",
        )
        if self.chosen is not None:
            row = self.row(self.chosen)
            if row.memory_budget_bytes is not None:
                ax.axvline(
                    100 * row.memory_budget_bytes / base,
                    color="tab:red",
                    linewidth=0.8,
                    linestyle=":",
                    label=f"budget of {self.chosen!r}",
                )
        ax.set_xlabel("measured peak activation memory, % of store-all")
        ax.set_ylabel("step time / store-all step time (measured)")
        ax.set_title(title or f"memory vs overhead, input {list(self.input_shape)}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        out = Path(path)
        fig.savefig(out)
        plt.close(fig)
        return out

    def plot_errors(self, path: str | Path, *, title: str | None = None) -> Path:
        """Measured gradient error against float64 per plan (log scale), with store-all's
        (the float32 round-off floor of the model) as a dashed line; PNG or any format
        matplotlib infers from ``path``."""
        plt = _pyplot()
        rows = [r for r in self.rows if math.isfinite(r.gradient_error)]
        if not rows:
            raise InvalidArgumentError(
                "no gradient errors in this report: measure them with report(..., errors=True)"
            )
        fig, ax = plt.subplots(figsize=(7, 0.45 * len(rows) + 1.5), dpi=120)
        names = [r.name for r in rows]
        values = [max(r.gradient_error, 1e-12) for r in rows]
        colors = ["tab:red" if r.name == self.chosen else "tab:blue" for r in rows]
        ax.barh(names, values, color=colors)
        ax.set_xscale("log")
        floor = next((r.gradient_error for r in rows if r.name == STORE_ALL), None)
        if floor is not None and floor > 0:
            ax.axvline(floor, color="tab:gray", linestyle="--", label="float32 store-all")
            ax.legend(fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("relative L2 error of all gradients against float64 (measured)")
        ax.set_title(title or "gradient error per plan")
        ax.grid(True, axis="x", alpha=0.3)
        fig.tight_layout()
        out = Path(path)
        fig.savefig(out)
        plt.close(fig)
        return out


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise InvalidArgumentError(
            "plotting needs matplotlib: pip install 'revckpt[report]' (or pip install matplotlib)"
        ) from exc
    return plt


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
    kw = dict(kwargs or {})
    plain = _Chain(named)
    models: dict[str, nn.Module] = {STORE_ALL: plain}
    for p in plans:
        models[p.name] = apply(blocks, p)
    reference = _Chain([(n, copy.deepcopy(b)) for n, b in named], dtype=torch.float64).to(
        torch.float64
    )
    leaf = x.detach().requires_grad_(x.is_floating_point())
    grad = None

    def stepper(model: nn.Module) -> Any:
        def step() -> None:
            nonlocal grad
            leaf.grad = None
            y = model(leaf, **kw)
            if grad is None:
                grad = torch.ones_like(y)
            y.backward(grad)

        return step

    with preserved(plain):
        steps = {name: measure_step(m, x, kwargs=kw) for name, m in models.items()}
        ratios = time_ratios(
            {name: stepper(m) for name, m in models.items()},
            baseline=STORE_ALL,
            repeats=repeats,
            warmup=warmup,
        )
    errs: dict[str, float] = {}
    for name, m in models.items():
        if errors:
            inputs = x.detach().requires_grad_(x.is_floating_point())
            got = gradient_error(m, reference, inputs, kwargs=kw, seed=seed)
            errs[name] = got.overall.rel_l2
        else:
            errs[name] = math.nan
    first = plans[0]
    rows = [
        PlanMeasurement(
            name=STORE_ALL,
            strategies=("store",) * len(named),
            measured_peak_bytes=steps[STORE_ALL].peak_bytes,
            measured_retained_bytes=steps[STORE_ALL].retained_bytes,
            predicted_peak_bytes=first.store_all_peak_bytes,
            memory_budget_bytes=None,
            time_ratio=ratios[STORE_ALL].ratio,
            time_ratio_iqr=(ratios[STORE_ALL].q25, ratios[STORE_ALL].q75),
            predicted_overhead=0.0,
            gradient_error=errs[STORE_ALL],
            predicted_error=0.0,
        )
    ]
    for p in plans:
        rows.append(
            PlanMeasurement(
                name=p.name,
                strategies=tuple(p.strategies),
                measured_peak_bytes=steps[p.name].peak_bytes,
                measured_retained_bytes=steps[p.name].retained_bytes,
                predicted_peak_bytes=p.predicted_peak_bytes,
                memory_budget_bytes=p.memory_budget_bytes,
                time_ratio=ratios[p.name].ratio,
                time_ratio_iqr=(ratios[p.name].q25, ratios[p.name].q75),
                predicted_overhead=p.predicted_overhead,
                gradient_error=errs[p.name],
                predicted_error=p.predicted_error,
            )
        )
    return Report(
        rows=tuple(rows),
        store_all_peak_bytes=steps[STORE_ALL].peak_bytes,
        input_shape=tuple(x.shape),
        chosen=chosen if chosen in names else None,
    )
