"""What a checkpoint segment of ``k`` blocks costs, measured, against what the time model says.

The time model prices a segment of ``k`` blocks as its first block's one-block checkpoint
overhead plus, for each further block, what a block measured adding inside a segment of up to
four (``chained_s``, ``revckpt/schedule/probe.py``): the price per block falls or rises with
``k`` only through that one figure. This benchmark times whole steps of each
``bench_schedule`` chain with every block checkpointed in segments of ``k`` blocks (the
``every-k`` baselines) against the store-all step, interleaved (``revckpt.time_ratios``, one
thread, ``keep_freed_memory()``), and puts each next to the plan's predicted overhead from one
profile of the chain.

Run ``python benchmarks/bench_segment_length.py`` (about 2 minutes; ``--quick``: small models,
few rounds); prints a table and writes ``benchmarks/results/bench_segment_length.json``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
from _common import environment, write_json  # benchmarks/_common.py
from bench_schedule import models

import revckpt
from revckpt.schedule import apply, baseline, profile

OUT = Path(__file__).parent / "results" / "bench_segment_length.json"


def lengths(n: int) -> list[int]:
    """Segment lengths to time on ``n`` blocks: 1 to 4, then a few longer ones up to ``n``."""
    picked = [k for k in (1, 2, 3, 4, 6, 8, 12, 24, 48) if k <= n]
    return picked if n in picked else [*picked, n]


def measure(chain: torch.nn.Sequential, x: torch.Tensor, repeats: int) -> dict[str, Any]:
    prof = profile(chain, x)
    n = len(prof.blocks)
    plans = {k: baseline(prof, f"every-{k}") for k in lengths(n)}

    def step(module: torch.nn.Module) -> Any:
        def run() -> None:
            module(x.detach().requires_grad_(x.is_floating_point())).sum().backward()

        return run

    fns = {"store": step(chain)}
    fns.update({f"every-{k}": step(apply(chain, plan)) for k, plan in plans.items()})
    ratios = revckpt.time_ratios(fns, baseline="store", repeats=repeats)
    rows = []
    for k, plan in plans.items():
        r = ratios[f"every-{k}"]
        rows.append(
            {
                "blocks_per_segment": k,
                "measured_overhead": r.ratio - 1.0,
                "measured_iqr": [r.q25 - 1.0, r.q75 - 1.0],
                "predicted_overhead": plan.predicted_overhead,
            }
        )
    return {"blocks": n, "profile_cost_steps": prof.cost_in_steps, "rows": rows}


def table(result: dict[str, Any]) -> str:
    lines = [
        "| model | blocks per segment | measured overhead (IQR) | predicted | "
        "measured / per-block's measured |",
        "|---|---|---|---|---|",
    ]
    for name, r in result["models"].items():
        per_block = r["rows"][0]["measured_overhead"]
        for row in r["rows"]:
            lo, hi = row["measured_iqr"]
            rel = row["measured_overhead"] / per_block if per_block > 0 else float("nan")
            lines.append(
                f"| {name} | {row['blocks_per_segment']} | +{row['measured_overhead']:.3f} "
                f"(+{lo:.3f}..+{hi:.3f}) | +{row['predicted_overhead']:.3f} | {rel:.3f} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small models, few rounds")
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds (21)")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    repeats = args.repeats or (2 if args.quick else 21)
    torch.set_num_threads(1)
    revckpt.measure.keep_freed_memory()
    shown = sys.argv[1:] if argv is None else argv
    result: dict[str, Any] = {
        "benchmark": "bench_segment_length",
        "command": " ".join(["python", "benchmarks/bench_segment_length.py", *shown]),
        "environment": environment(),
        "threads": 1,
        "repeats": repeats,
        "models": {},
    }
    for name, (chain, x) in models(args.quick).items():
        result["models"][name] = measure(chain, x, repeats)
    print(table(result))
    write_json(result, args.out)
    return result


if __name__ == "__main__":
    main()
