"""A process's first profile against its next two, with and without the stored step's
rehearsal of each block's first recomputed call (``revckpt/engine/rehearsal.py``).

What revckpt learns on a block's first checkpointed call and first recompute (its layout,
its random draws, the buffers it writes, the normalisation layers its recompute calls: global
module hooks) costs time on those calls. The profile's strategy steps time one recomputed
call per block, which in a process's first profile was each block's first, unless the stored
step rehearsed it. Each fresh process (``--processes`` per variant, the variants alternating;
one thread, ``keep_freed_memory()``) profiles every transformer chain of ``bench_schedule.py``
three times and records, per profile, the blocks' checkpoint extra over their stored step and
the profile's cost in its own stored steps. Without the rehearsal is this code with every
block taken as learnt (``revckpt.engine.rehearsal.learnt`` patched in that process), so the
stored step rehearses nothing.

Run ``python benchmarks/bench_first_profile.py`` (``--quick``: small models, one process per
variant); prints a table and writes ``benchmarks/results/bench_first_profile.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
from _common import environment, write_json  # benchmarks/_common.py
from bench_schedule import models

import revckpt
from revckpt.schedule import profile

OUT = Path(__file__).parent / "results" / "bench_first_profile.json"
VARIANTS = ("rehearsed", "not rehearsed")
PROFILES = 3  # per model and process
SKIP = ("RevNet-like",)  # its first-call learning is two layout walks: nothing to see


def _one_process(variant: str, quick: bool) -> dict[str, Any]:
    """In this process: every model profiled ``PROFILES`` times; per profile the checkpoint
    extra over the stored step and the cost in steps."""
    if variant == "not rehearsed":
        import revckpt.engine.rehearsal as rehearsal

        rehearsal.learnt = lambda block: True  # type: ignore[assignment]  # rehearse nothing
    out: dict[str, Any] = {}
    for name, (chain, x) in models(quick).items():
        if name in SKIP:
            continue
        ratios, steps = [], []
        for _ in range(PROFILES):
            prof = profile(chain, x)
            extra = sum(b.strategy_overhead_s["checkpoint"] for b in prof.blocks)
            ratios.append(extra / sum(b.forward_s + b.backward_s for b in prof.blocks))
            steps.append(prof.cost_in_steps)
        out[name] = {"checkpoint_overhead": ratios, "cost_steps": steps}
    return out


def _fresh(variant: str, quick: bool) -> dict[str, Any]:
    argv = [sys.executable, __file__, "--variant", variant] + (["--quick"] if quick else [])
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"a process of variant {variant!r} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per variant and model: the first profile's checkpoint overhead over the mean of the next
    two (median over processes, and how many above 1), and the first and later profiles'
    median cost in steps."""
    out: dict[str, Any] = {}
    for variant in VARIANTS:
        mine = [r["models"] for r in runs if r["variant"] == variant]
        per_model = {}
        for name in mine[0] if mine else ():
            rows = [m[name] for m in mine]
            first = [
                r["checkpoint_overhead"][0] / statistics.mean(r["checkpoint_overhead"][1:])
                for r in rows
            ]
            per_model[name] = {
                "first_over_next": statistics.median(first),
                "above_one": sum(f > 1 for f in first),
                "processes": len(first),
                "first_cost_steps": statistics.median(r["cost_steps"][0] for r in rows),
                "later_cost_steps": statistics.median(s for r in rows for s in r["cost_steps"][1:]),
            }
        out[variant] = per_model
    return out


def table(result: dict[str, Any]) -> str:
    lines = [
        "| variant | model | first profile's checkpoint overhead / next two's (median) | "
        "above 1 | cost, first / later profiles (steps) |",
        "|---|---|---|---|---|",
    ]
    for variant, per_model in result["summary"].items():
        for name, r in per_model.items():
            lines.append(
                f"| {variant} | {name} | {r['first_over_next']:.3f} | "
                f"{r['above_one']} of {r['processes']} | "
                f"{r['first_cost_steps']:.2f} / {r['later_cost_steps']:.2f} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small models, one process each")
    parser.add_argument("--processes", type=int, default=None, help="per variant (8)")
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # one process
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    revckpt.measure.keep_freed_memory()
    if args.variant is not None:  # one process's profiles, as JSON, last line
        print(json.dumps(_one_process(args.variant, args.quick)))
        return {}
    processes = args.processes or (1 if args.quick else 8)
    runs = [
        {"variant": v, "models": _fresh(v, args.quick)} for _ in range(processes) for v in VARIANTS
    ]
    result = {
        "benchmark": "bench_first_profile",
        "command": "python benchmarks/bench_first_profile.py"
        + (" --quick" if args.quick else "")
        + (f" --processes {processes}" if args.processes else ""),
        "environment": environment(),
        "threads": 1,
        "runs": runs,
    }
    result["summary"] = summary(runs)
    print(table(result))
    write_json(result, args.out)
    return result


if __name__ == "__main__":
    main()
