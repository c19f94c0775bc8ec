"""What ``MemoryMeter("cpu")``'s storage tracker costs: a training step of each built-in chain
of ``bench_schedule.py`` (GPT-like, RevNet-like, and the Hugging Face Llama stack when
``transformers`` is installed) timed plainly and under the meter, and what
``revckpt.schedule.profile`` costs in training steps (``Profile.cost_in_steps``, as
``bench_schedule.py`` reports it), whose memory figures come from that meter.

``--baseline PATH`` also loads another version of the tracker module (``storages.py`` of a
checkout, e.g. ``git worktree add /tmp/meter_base HEAD`` and
``--baseline /tmp/meter_base/revckpt/measure/storages.py``) and runs it side by side with the
current one in the same process: each round times every variant once, in rotated order (one
thread, median of per-round ratios to the plain step, with the interquartile range), and
profiles the chain once per tracker; the two trackers' profiles must give the same bytes.

Run ``python benchmarks/bench_meter.py [--baseline PATH]`` (about a minute on 2 CPU cores);
prints a table and writes ``benchmarks/results/bench_meter.json``.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from _common import environment, write_json  # benchmarks/_common.py
from bench_schedule import models as schedule_models

from revckpt.measure import MemoryMeter, keep_freed_memory
from revckpt.measure import memory as memory_module
from revckpt.schedule import profile

CURRENT = memory_module._StorageTracker


def load_tracker(path: Path) -> type:
    """The ``_StorageTracker`` class of another copy of ``revckpt/measure/storages.py``."""
    spec = importlib.util.spec_from_file_location("_baseline_storages", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module._StorageTracker


def _step(chain: Any, leaf: torch.Tensor, grad: torch.Tensor, tracker: type | None) -> float:
    leaf.grad = None
    start = time.perf_counter()
    if tracker is None:
        chain(leaf).backward(grad)
    else:
        memory_module._StorageTracker = tracker
        try:
            with MemoryMeter("cpu"):
                chain(leaf).backward(grad)
        finally:
            memory_module._StorageTracker = CURRENT
    return time.perf_counter() - start


def _summary(values: list[float]) -> dict[str, Any]:
    q = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else values * 3
    return {"median": statistics.median(values), "iqr": [q[0], q[2]], "values": values}


def _profile_bytes(prof: Any) -> list[Any]:
    """Every byte figure of a profile, to check that two trackers measured the same."""
    return [{k: v for k, v in vars(b).items() if "bytes" in k} for b in prof.blocks]


def step_overhead(
    chain: Any, x: torch.Tensor, trackers: dict[str, type], rounds: int
) -> dict[str, Any]:
    """Per tracker, the meter's step time over the plain step's (per-round ratios)."""
    leaf = x.detach().requires_grad_()
    grad = torch.randn_like(chain(leaf))
    variants: dict[str, type | None] = {"plain": None, **trackers}
    names = list(variants)
    for name in names:  # warm-up
        _step(chain, leaf, grad, variants[name])
    times: dict[str, list[float]] = {k: [] for k in names}
    for r in range(rounds):
        for k in names[r % len(names) :] + names[: r % len(names)]:
            times[k].append(_step(chain, leaf, grad, variants[k]))
    out: dict[str, Any] = {"plain_step_s": _summary(times["plain"])}
    for k in trackers:
        ratios = [t / p - 1 for t, p in zip(times[k], times["plain"], strict=True)]
        out[k] = {"overhead": _summary(ratios), "step_s": _summary(times[k])}
    return out


def profile_cost(
    chain: Any, x: torch.Tensor, trackers: dict[str, type], rounds: int
) -> dict[str, Any]:
    """Per tracker, ``profile(chain, x).cost_in_steps`` (bench_schedule's defaults), rounds
    alternating; and whether every tracker's profile has the same bytes as the first's."""
    costs: dict[str, list[float]] = {k: [] for k in trackers}
    figures: dict[str, Any] = {}
    names = list(trackers)
    for r in range(rounds):
        for k in names[r % len(names) :] + names[: r % len(names)]:
            memory_module._StorageTracker = trackers[k]
            try:
                prof = profile(chain, x, repeats=5, rounds=1)
            finally:
                memory_module._StorageTracker = CURRENT
            costs[k].append(prof.cost_in_steps)
            figures.setdefault(k, _profile_bytes(prof))
    same = all(figures[k] == figures[names[0]] for k in names)
    return {"cost_in_steps": {k: _summary(v) for k, v in costs.items()}, "same_bytes": same}


def _table(rows: list[dict[str, Any]], trackers: list[str]) -> str:
    lines = [
        "| model | tracker | plain step ms | meter overhead (IQR) | profile cost, steps (IQR) |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        for k in trackers:
            o = row["step"][k]["overhead"]
            c = row["profile"]["cost_in_steps"][k]
            lines.append(
                f"| {row['model']} | {k} | {row['step']['plain_step_s']['median'] * 1e3:.1f} | "
                f"{o['median']:+.3f} ({o['iqr'][0]:+.3f}..{o['iqr'][1]:+.3f}) | "
                f"{c['median']:.2f} ({c['iqr'][0]:.2f}..{c['iqr'][1]:.2f}) |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny models (a smoke test)")
    parser.add_argument("--rounds", type=int, default=15, help="step timing rounds")
    parser.add_argument("--profile-rounds", type=int, default=3, help="profiles per tracker")
    parser.add_argument("--baseline", type=Path, help="another storages.py to compare with")
    parser.add_argument("--models", nargs="*", help="only these models (names as printed)")
    parser.add_argument(
        "--glibc-defaults",
        action="store_true",
        help="leave glibc's malloc as it is (by default keep_freed_memory(), as bench_schedule)",
    )
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "bench_meter.json"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    kept = False if args.glibc_defaults else keep_freed_memory()  # as bench_schedule.py
    trackers = {"current": CURRENT}
    if args.baseline is not None:
        trackers = {"baseline": load_tracker(args.baseline), "current": CURRENT}
    rows = []
    for name, (chain, x) in schedule_models(args.quick).items():
        if args.models and name not in args.models:
            continue
        step = step_overhead(chain, x, trackers, args.rounds)
        prof = profile_cost(chain, x, trackers, args.profile_rounds)
        rows.append({"model": name, "input_shape": list(x.shape), "step": step, "profile": prof})
        print(_table(rows[-1:], list(trackers)), flush=True)
    print(_table(rows, list(trackers)))
    result = {
        "benchmark": "bench_meter",
        "command": "python benchmarks/bench_meter.py"
        + (f" --baseline {args.baseline}" if args.baseline else ""),
        "environment": environment(),
        "threads": torch.get_num_threads(),
        "keep_freed_memory": kept,
        "rounds": args.rounds,
        "profile_rounds": args.profile_rounds,
        "rows": rows,
    }
    write_json(result, args.out)
    return result


if __name__ == "__main__":
    main()
