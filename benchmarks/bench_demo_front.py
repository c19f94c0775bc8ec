"""Is the demo's plan on the measured Pareto front? Run ``revckpt demo`` several times (each in
its own process, as a user would) and check, in every run's ``report.json``, that no row
within the error budget measured no more memory *and* no more time than the scheduler's row,
better on one of them.

Run ``python benchmarks/bench_demo_front.py`` (5 runs of the CPU demo, about 2 minutes on 2 CPU
cores); prints one line per run and writes ``benchmarks/results/bench_demo_front.json``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from _common import environment, write_json  # benchmarks/_common.py


def dominating(report: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The scheduler's row and the names of the rows within the error budget that beat it on
    both measured axes (no worse on either, better on one)."""
    rows = report["rows"]
    floor = next(r for r in rows if r["name"] == "store-all")["gradient_error"]
    allowed = report["error_budget"] + 2 * floor  # exact rows measure float32 round-off
    chosen = next(r for r in rows if r["name"] == "scheduler")
    found = []
    for r in rows:
        if r is chosen or r["gradient_error"] > allowed:
            continue
        no_worse = (
            r["measured_peak_bytes"] <= chosen["measured_peak_bytes"]
            and r["time_ratio"] <= chosen["time_ratio"]
        )
        better = (
            r["measured_peak_bytes"] < chosen["measured_peak_bytes"]
            or r["time_ratio"] < chosen["time_ratio"]
        )
        if no_worse and better:
            found.append(r["name"])
    return chosen, found


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--size", default=None, help="demo size (default: the CPU demo)")
    parser.add_argument("--budget", default=None, help="demo budget (default: the demo's)")
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "bench_demo_front.json"
    )
    args = parser.parse_args(argv)
    runs = []
    for i in range(args.runs):
        with tempfile.TemporaryDirectory() as folder:
            command = [sys.executable, "-m", "revckpt", "demo", "--out", folder, "--no-progress"]
            if args.size:
                command += ["--size", args.size]
            if args.budget:
                command += ["--budget", args.budget]
            subprocess.run(command, check=True, capture_output=True, text=True)
            report = json.loads((Path(folder) / "report.json").read_text())
        chosen, beaten_by = dominating(report)
        run = {
            "run": i + 1,
            "scheduler_memory_fraction": chosen["measured_peak_bytes"]
            / report["store_all_peak_bytes"],
            "scheduler_time_ratio": chosen["time_ratio"],
            "dominated_by": beaten_by,
            "verify_note": report.get("verify", {}).get("note", ""),
        }
        runs.append(run)
        print(
            f"run {run['run']}: scheduler {run['scheduler_memory_fraction']:.1%} of store-all "
            f"at {run['scheduler_time_ratio']:.3f}x; "
            + (f"beaten on both axes by {beaten_by}" if beaten_by else "on the measured front")
        )
    on_front = sum(not r["dominated_by"] for r in runs)
    print(f"on the measured Pareto front in {on_front} of {len(runs)} runs")
    result = {
        "benchmark": "bench_demo_front",
        "command": "python benchmarks/bench_demo_front.py",
        "environment": environment(),
        "runs": runs,
        "on_front": on_front,
    }
    write_json(result, args.out)
    return result


if __name__ == "__main__":
    main()
