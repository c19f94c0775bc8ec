"""How long the exact scheduler takes: ``revckpt.schedule.solve`` on chains of 32 to 128 blocks.

Profiles are synthetic (seeded random per-block times and byte counts of the shapes a real
profile has, a third of the blocks invertible, three codecs), so the figure is the solver's own
cost, independent of any model. For each length: median wall time of 3 solves at 1000 memory
slots, without and with an error budget (32 error slots), at a budget of 30% of the
store-everything peak (or the per-block checkpoint peak, if that is higher); and once at a
budget of one byte, which no plan meets (the error names the smallest budget that works).

Run ``python benchmarks/bench_solver.py``; prints a table and writes
``benchmarks/results/bench_solver.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import time
from pathlib import Path
from typing import Any

from _common import environment, write_json  # benchmarks/_common.py

from revckpt import RevckptError
from revckpt.schedule import ApproxCost, BlockCost, baseline, solve


def synthetic_chain(n: int, seed: int) -> list[BlockCost]:
    rng = random.Random(seed)
    blocks = []
    for _ in range(n):
        x = rng.randint(1, 4) * 2**20
        saved = rng.randint(2, 12) * x // 2
        fwd = rng.uniform(1e-3, 5e-3)
        blocks.append(
            BlockCost(
                forward_s=fwd,
                backward_s=2 * fwd,
                input_bytes=x,
                output_bytes=x,
                saved_bytes=saved,
                forward_peak_bytes=saved + 2 * x,
                forward_peak_nograd_bytes=2 * x,
                backward_peak_bytes=3 * x,
                invertible=rng.random() < 1 / 3,
                param_bytes=x,
                approx={
                    "bf16": ApproxCost(x // 2, param_grad_error=rng.uniform(1e-4, 1e-3)),
                    "e4m3": ApproxCost(x // 4 + 4096, param_grad_error=rng.uniform(5e-3, 2e-2)),
                    "e5m2": ApproxCost(x // 4 + 4096, param_grad_error=rng.uniform(1e-2, 4e-2)),
                },
            )
        )
    return blocks


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[32, 64, 128])
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "bench_solver.json"
    )
    args = parser.parse_args(argv)
    rows = []
    for n in args.lengths:
        chain = synthetic_chain(n, seed=n)
        # 30% of store-all, or the per-block checkpoint peak when a short chain cannot go lower
        budget = max(
            int(0.3 * baseline(chain, "store").predicted_peak_bytes),
            baseline(chain, "per-block").predicted_peak_bytes,
        )
        for error_budget in (0.0, 0.05):
            times = []
            for _ in range(3):
                start = time.perf_counter()
                plan = solve(chain, memory_budget=budget, error_budget=error_budget, slots=1000)
                times.append(time.perf_counter() - start)
            # an infeasible budget: the answer names the smallest budget that works (a second
            # programme), timed once
            start = time.perf_counter()
            with contextlib.suppress(RevckptError):
                solve(chain, memory_budget=1, error_budget=error_budget, slots=1000)
            infeasible = time.perf_counter() - start
            rows.append(
                {
                    "blocks": n,
                    "slots": 1000,
                    "error_budget": error_budget,
                    "seconds_median": statistics.median(times),
                    "infeasible_seconds": infeasible,
                    "predicted_overhead": plan.predicted_overhead,
                    "strategies": sorted(set(plan.strategies)),
                }
            )
    lines = [
        "| blocks | slots | error budget | solve s (median of 3) | infeasible budget s | "
        "plan overhead | strategies |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['blocks']} | {r['slots']} | {r['error_budget']:g} | "
            f"{r['seconds_median']:.2f} | {r['infeasible_seconds']:.2f} | "
            f"{r['predicted_overhead']:.3f} | "
            f"{', '.join(r['strategies'])} |"
        )
    print("\n".join(lines))
    result = {
        "benchmark": "bench_solver",
        "command": "python benchmarks/bench_solver.py",
        "environment": environment(),
        "rows": rows,
    }
    write_json(result, args.out)
    return result


if __name__ == "__main__":
    main()
