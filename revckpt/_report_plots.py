"""The plots of a :class:`~revckpt.report.Report` (matplotlib): measured memory against measured
time with the Pareto front, and the gradient error per plan."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from .errors import InvalidArgumentError


def plot_memory_time(rep: Any, path: str | Path, *, title: str | None = None) -> Path:
    """:meth:`Report.plot <revckpt.report.Report.plot>`."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    base = rep.store_all_peak_bytes
    xs = {r.name: 100 * r.measured_peak_bytes / base for r in rep.rows}
    ys = {r.name: r.time_ratio for r in rep.rows}
    _plot_points(ax, rep, xs, ys)
    front = sorted(rep.pareto(), key=lambda n: xs[n])
    ax.step(
        [xs[n] for n in front],
        [ys[n] for n in front],
        where="post",
        color="tab:gray",
        linestyle="--",
        label="Pareto front (measured)",
    )
    if rep.chosen is not None:
        row = rep.row(rep.chosen)
        if row.memory_budget_bytes is not None:
            ax.axvline(
                100 * row.memory_budget_bytes / base,
                color="tab:red",
                linewidth=0.8,
                linestyle=":",
                label=f"budget of {rep.chosen!r}",
            )
    ax.set_xlabel("measured peak activation memory, % of store-all")
    ax.set_ylabel("step time / store-all step time (measured)")
    ax.set_title(title or f"memory vs overhead, input {list(rep.input_shape)}")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return _save(plt, fig, path)


def _plot_points(ax: Any, rep: Any, xs: dict[str, float], ys: dict[str, float]) -> None:
    """One labelled point per plan: the chosen one a red star, those over the error budget
    grey crosses (one legend entry), the others blue dots."""
    over_label = "over the error budget"
    for r in rep.rows:
        chosen = r.name == rep.chosen
        over = rep.over_error_budget(r.name)
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


def plot_errors(rep: Any, path: str | Path, *, title: str | None = None) -> Path:
    """:meth:`Report.plot_errors <revckpt.report.Report.plot_errors>`."""
    plt = _pyplot()
    rows = [r for r in rep.rows if math.isfinite(r.gradient_error)]
    if not rows:
        raise InvalidArgumentError(
            "no gradient errors in this report: measure them with report(..., errors=True)"
        )
    fig, ax = plt.subplots(figsize=(7, 0.45 * len(rows) + 1.5), dpi=120)
    names = [r.name for r in rows]
    values = [max(r.gradient_error, 1e-12) for r in rows]
    colors = ["tab:red" if r.name == rep.chosen else "tab:blue" for r in rows]
    ax.barh(names, values, color=colors)
    ax.set_xscale("log")
    floor = rep.error_floor  # store-all's, 0 when not measured
    if floor > 0:
        ax.axvline(floor, color="tab:gray", linestyle="--", label="float32 store-all")
        ax.legend(fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("relative L2 error of all gradients against float64 (measured)")
    ax.set_title(title or "gradient error per plan")
    ax.grid(True, axis="x", alpha=0.3)
    return _save(plt, fig, path)


def _save(plt: Any, fig: Any, path: str | Path) -> Path:
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
