"""What ``revckpt.fit`` costs as a model gets deeper: the test zoo's Hugging Face GPT-2 and
Llama (``tests/zoo.py``, width 64, 4 heads) with 4, 12 and 24 decoder layers, batch 8 x 64.

``fit`` profiles each *group* of identical blocks once (its memory metering, its per-block
timing), but traces, meters and checks the *whole* step, and with an error budget runs each
block's codec errors: a part of its cost is per group, a part per step, a part per block. On the
4-layer models of ``bench_models.py`` one block is a quarter of the model, so the per-group part
weighs most there; this benchmark shows the cost at the depths people train.

For each model and depth, two fits of a fresh model each at ``memory_budget="50%"``, exact
(``error_budget=0``) and with ``error_budget=1e-2`` (where a budget is infeasible, the fit at
the error's smallest budget is timed as well and both are reported). Each fit's wall time is
given in the model's plain training steps (forward, loss, backward; median of the plain steps
timed just before and just after the fit, the plan then undone) and in a user's steps (the same
plus an AdamW step and ``zero_grad()``, timed alternately with the plain ones); one thread.
After the fit, one step with ``MemoryMeter("cpu")`` around it: measured over predicted peak and
whether it is within the budget.

Run ``python benchmarks/bench_fit_depth.py`` (about five minutes on 2 CPU cores; ``--quick``
for a smoke run); prints a Markdown table and writes ``benchmarks/results/bench_fit_depth.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _common import environment, write_json  # benchmarks/_common.py
from torch import nn

import revckpt
from revckpt import InfeasibleBudgetError, MemoryMeter

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "tests") not in sys.path:
    sys.path.append(str(ROOT / "tests"))  # the model zoo, tests/zoo.py
import zoo  # noqa: E402

MODELS = ("gpt2", "llama")
DEPTHS = (4, 12, 24)
ERRORS = (0.0, 1e-2)


def _steps(model: nn.Module, example: Any) -> tuple[Callable[[], None], Callable[[], None]]:
    """The plain training step and a user's (plus an AdamW step and ``zero_grad()``)."""
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-5)

    def plain() -> None:
        for p in params:
            p.grad = None
        zoo.step(model, example, None)

    def user() -> None:
        zoo.step(model, example, None)
        opt.step()
        opt.zero_grad()

    return plain, user


def _timed(plain: Callable[[], None], user: Callable[[], None], rounds: int) -> tuple[list, list]:
    """``rounds`` plain and user steps, alternating: their seconds."""
    a, b = [], []
    for _ in range(rounds):
        for step, into in ((plain, a), (user, b)):
            start = time.perf_counter()
            step()
            into.append(time.perf_counter() - start)
    return a, b


def _fit_once(name: str, layers: int, example: Any, error: float, rounds: int) -> dict[str, Any]:
    model = zoo.deeper(name, layers)()
    plain, user = _steps(model, example)
    for _ in range(2):
        plain()
    before = _timed(plain, user, rounds)
    torch.manual_seed(0)  # with an error budget, fit's plan depends on the global RNG state
    out: dict[str, Any] = {"error_budget": error, "infeasible": False}
    start = time.perf_counter()
    try:
        plan = revckpt.fit(model, example, memory_budget="50%", error_budget=error)
    except InfeasibleBudgetError as err:
        out.update(infeasible=True, infeasible_fit_seconds=time.perf_counter() - start)
        torch.manual_seed(0)
        start = time.perf_counter()
        plan = revckpt.fit(
            model, example, memory_budget=err.smallest_budget_bytes, error_budget=error
        )
    fit_seconds = time.perf_counter() - start
    with MemoryMeter("cpu") as meter:
        plain()
    revckpt.restore(model)  # the steps after the fit are plain ones too
    after = _timed(plain, user, rounds)
    step = statistics.median(before[0] + after[0])
    user_step = statistics.median(before[1] + after[1])
    out.update(
        fit_seconds=fit_seconds,
        plain_step_seconds=step,
        user_step_seconds=user_step,
        fit_steps=fit_seconds / step,
        fit_user_steps=fit_seconds / user_step,
        predicted_overhead=plan.predicted_overhead,
        measured_over_predicted=meter.peak_bytes / plan.predicted_peak_bytes,
        within_budget=meter.peak_bytes <= plan.memory_budget_bytes,
        strategies=sorted(set(plan.strategies)),
    )
    if out["infeasible"]:
        out["infeasible_fit_steps"] = out["infeasible_fit_seconds"] / step
    return out


def table(result: dict[str, Any]) -> str:
    lines = [
        "| model | layers | plain step ms | exact fit, steps (user steps) | with error 1e-2, steps "
        "(user steps) | measured / predicted peak | within budget |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        cells = {}
        for error in ERRORS:
            fits = [f for f in row["fits"] if f["error_budget"] == error]
            cells[error] = ", ".join(
                f"{f['fit_steps']:.1f} ({f['fit_user_steps']:.1f})"
                + (f" + {f['infeasible_fit_steps']:.1f} infeasible" if f["infeasible"] else "")
                for f in fits
            )
        ratios = [f["measured_over_predicted"] for f in row["fits"]]
        step_ms = statistics.median(f["plain_step_seconds"] for f in row["fits"]) * 1e3
        lines.append(
            f"| {row['model']} | {row['layers']} | {step_ms:.0f} | {cells[0.0]} | {cells[1e-2]} | "
            f"{min(ratios):.3f}-{max(ratios):.3f} | "
            f"{'yes' if all(f['within_budget'] for f in row['fits']) else 'NO'} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="GPT-2 at 2 and 4 layers, one fit")
    parser.add_argument("--fits", type=int, default=2, help="fits per model, depth and error")
    parser.add_argument("--rounds", type=int, default=5, help="plain steps before and after")
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "bench_fit_depth.json"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=UserWarning)
    models, depths = (("gpt2",), (2, 4)) if args.quick else (MODELS, DEPTHS)
    fits = 1 if args.quick else args.fits
    batch, seq = (2, 16) if args.quick else (8, 64)
    rows = []
    for name in models:
        example = zoo.CASES[name].make_example(batch, seq)
        for layers in depths:
            found = [
                _fit_once(name, layers, example, error, args.rounds)
                for _ in range(fits)
                for error in ERRORS
            ]
            rows.append({"model": name, "layers": layers, "fits": found})
            print(f"{name} x {layers}: done", flush=True)
    result = {
        "benchmark": "bench_fit_depth",
        "command": "python benchmarks/bench_fit_depth.py" + (" --quick" if args.quick else ""),
        "date": time.strftime("%Y-%m-%d"),
        "environment": environment(),
        "threads": torch.get_num_threads(),
        "batch": [batch, seq],
        "rows": rows,
    }
    print(table(result))
    write_json(result, args.out)
    return result


if __name__ == "__main__":
    main()
