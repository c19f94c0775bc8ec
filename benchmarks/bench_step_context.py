"""Does a block cost the same under a strategy whatever the rest of the step does? The time
model assumes it: a plan's overhead is the sum of its blocks' extra times, each measured by
``profile`` inside mixed steps (stretches of strategies beside stored reference blocks,
``revckpt/schedule/probe.py``). This benchmark times whole steps of the chain, every block
its own segment, in three layouts, interleaved (one thread, ``keep_freed_memory()``):

* ``store``: every block stored (the store-all step);
* ``checkpoint``: every block checkpointed (the per-block plan);
* ``alternating``: runs of ``--run`` blocks checkpointed and stored in turn, as the
  profile's mixed steps and most plans lay them out.

and reads, per model:

* the profile's checkpoint extra, summed over the blocks, over their stored forward
  (``Profile``: what the time model adds for the per-block plan);
* each whole step's extra over the store-all step, per checkpointed block's forward;
* how the same blocks' spans change with the rest of the step: the stored blocks of the
  alternating step against themselves in the store-all step, and its checkpointed blocks
  against themselves in the all-checkpoint step.

Run ``python benchmarks/bench_step_context.py`` (``--quick``: small models, few rounds);
prints a table and writes ``benchmarks/results/bench_step_context.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
from _common import environment, write_json  # benchmarks/_common.py
from bench_schedule import models

import revckpt
from revckpt.schedule import Segment, profile
from revckpt.schedule.probe import timed_step

OUT = Path(__file__).parent / "results" / "bench_step_context.json"
SKIP = 3  # untimed rounds first


def _layouts(n: int, run: int) -> dict[str, list[str]]:
    checkpointed = [(i // run) % 2 == 0 for i in range(n)]
    return {
        "store": ["store"] * n,
        "checkpoint": ["checkpoint"] * n,
        "alternating": ["checkpoint" if c else "store" for c in checkpointed],
    }


def _spans(steps: list[list[tuple[float, float]]], blocks: list[int]) -> float:
    """Median over the steps of the summed forward and backward spans of ``blocks``."""
    return statistics.median(sum(t[i][0] + t[i][1] for i in blocks) for t in steps)


def _over(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


def measure(chain: torch.nn.Sequential, x: torch.Tensor, rounds: int, run: int) -> dict[str, Any]:
    n = len(chain)
    prof = profile(chain, x)
    fwd = [b.forward_s for b in prof.blocks]
    extra = [b.strategy_overhead_s["checkpoint"] for b in prof.blocks]
    grad = torch.ones_like(chain(x))
    layouts = _layouts(n, run)
    segments = {k: [Segment(i, i + 1, s) for i, s in enumerate(v)] for k, v in layouts.items()}
    steps: dict[str, list[list[tuple[float, float]]]] = {k: [] for k in layouts}
    for r in range(rounds + SKIP):
        order = list(layouts)
        order = order[r % len(order) :] + order[: r % len(order)]  # rotated
        for k in order:
            times = timed_step(chain, segments[k], x, grad, {})
            if r >= SKIP:
                steps[k].append(times)
    every = list(range(n))
    ck = [i for i, s in enumerate(layouts["alternating"]) if s == "checkpoint"]
    st = [i for i in every if i not in ck]
    store, full, alt = (_spans(steps[k], every) for k in ("store", "checkpoint", "alternating"))
    f_all, f_ck = sum(fwd), sum(fwd[i] for i in ck)
    return {
        "blocks": n,
        "run": run,
        "profile_extra_over_forward": sum(extra) / f_all,
        "profile_extra_over_forward_alternating_blocks": sum(extra[i] for i in ck) / f_ck,
        "checkpoint_step_extra_over_forward": (full - store) / f_all,
        "alternating_step_extra_over_forward": (alt - store) / f_ck,
        "stored_blocks_alternating_over_store_all": _over(
            _spans(steps["alternating"], st), _spans(steps["store"], st)
        ),
        "checkpointed_blocks_alternating_over_all_checkpoint": _over(
            _spans(steps["alternating"], ck), _spans(steps["checkpoint"], ck)
        ),
        "profile_predicted_overhead_per_block": sum(extra)
        / sum(b.forward_s + b.backward_s for b in prof.blocks),
        "measured_overhead_per_block": (full - store) / store,
    }


def _cell(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def table(result: dict[str, Any]) -> str:
    lines = [
        "| model | profile: checkpoint extra / forward | all-checkpoint step | alternating step "
        "| stored blocks, alternating / store-all | checkpointed blocks, alternating / "
        "all-checkpoint | per-block plan: predicted / measured overhead |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in result["models"].items():
        lines.append(
            f"| {name} | {r['profile_extra_over_forward']:.2f} "
            f"| {r['checkpoint_step_extra_over_forward']:.2f} "
            f"| {r['alternating_step_extra_over_forward']:.2f} "
            f"| {_cell(r['stored_blocks_alternating_over_store_all'])} "
            f"| {_cell(r['checkpointed_blocks_alternating_over_all_checkpoint'])} "
            f"| +{r['profile_predicted_overhead_per_block']:.3f} / "
            f"+{r['measured_overhead_per_block']:.3f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small models, few rounds")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (15)")
    parser.add_argument(
        "--run", type=int, default=None, help="blocks per alternating run (3; --quick: 1)"
    )
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    rounds = args.rounds or (2 if args.quick else 15)
    run = args.run or (1 if args.quick else 3)
    torch.set_num_threads(1)
    revckpt.measure.keep_freed_memory()
    result: dict[str, Any] = {
        "benchmark": "bench_step_context",
        "command": " ".join(["python", "benchmarks/bench_step_context.py", *sys.argv[1:]])
        if argv is None
        else " ".join(["python", "benchmarks/bench_step_context.py", *argv]),
        "environment": environment(),
        "threads": 1,
        "rounds": rounds,
        "models": {},
    }
    for name, (chain, x) in models(args.quick).items():
        result["models"][name] = measure(chain, x, rounds, run)
    print(table(result))
    write_json(result, args.out)
    return result


if __name__ == "__main__":
    main()
