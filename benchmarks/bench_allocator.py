"""How a CPU step's time depends on what the allocator does: the same plans timed interleaved
with each other (one step of each per round) and in steady state (three steps of a plan in a
row, the last one timed), on the built-in GPT-like model.

PyTorch's CPU tensors come from glibc ``malloc``, which returns large freed blocks to the
operating system; the next step page-faults them in again. A plan that keeps less memory than
store-all then pays fewer page faults, which hides part of its recompute. Run it twice to see
the allocator's share::

    python benchmarks/bench_allocator.py
    GLIBC_TUNABLES=glibc.malloc.mmap_threshold=4294967295:glibc.malloc.trim_threshold=4294967295 \\
        python benchmarks/bench_allocator.py --out benchmarks/results/bench_allocator_tuned.json

(the second keeps freed memory in the process, as CUDA's caching allocator does; so does
``--keep-freed-memory``, which calls ``revckpt.measure.keep_freed_memory()``). Prints a table
and writes ``benchmarks/results/bench_allocator.json``; about 30 s on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from _common import environment, write_json  # benchmarks/_common.py

from revckpt.measure import keep_freed_memory
from revckpt.models import gpt_like
from revckpt.schedule import Segment, apply, make_plan, profile


def _plans(prof: Any, n: int) -> dict[str, Any]:
    def some(ck: set[int], name: str) -> Any:
        segs = [Segment(i, i + 1, "checkpoint" if i in ck else "store") for i in range(n)]
        return make_plan(prof, segs, name=name)

    third = set(range(n // 3, 2 * n // 3))
    return {
        "a third checkpointed (contiguous)": some(third, "third"),
        "every 4th block checkpointed": some(set(range(0, n, 4)), "every-4th"),
        "every block checkpointed": some(set(range(n)), "per-block"),
    }


def measure(models: dict[str, Any], x: torch.Tensor, rounds: int, burst: int) -> dict[str, Any]:
    """Per model, the median over rounds of the last of ``burst`` consecutive steps, and the
    median per-round ratio to store-all's."""
    leaf = x.detach().requires_grad_()
    grad = torch.randn_like(x)
    names = list(models)
    times: dict[str, list[float]] = {k: [] for k in names}
    for r in range(rounds):
        for k in names[r % len(names) :] + names[: r % len(names)]:
            for _ in range(burst):
                leaf.grad = None
                start = time.perf_counter()
                models[k](leaf).backward(grad)
                took = time.perf_counter() - start
            times[k].append(took)
    base = times["store-all"]
    out = {}
    for k in names:
        ratios = [t / b for t, b in zip(times[k], base, strict=True)]
        q = statistics.quantiles(ratios, n=4, method="inclusive")
        out[k] = {"overhead": statistics.median(ratios) - 1, "iqr": [q[0] - 1, q[2] - 1]}
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny model (a smoke test)")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument(
        "--keep-freed-memory",
        action="store_true",
        help="revckpt.measure.keep_freed_memory() first (glibc keeps freed blocks)",
    )
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "bench_allocator.json"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    kept = keep_freed_memory() if args.keep_freed_memory else False
    n, dim, heads, shape = (4, 32, 2, (2, 16, 32)) if args.quick else (24, 64, 4, (4, 128, 64))
    chain, x = gpt_like(n, dim, heads), torch.randn(*shape)
    prof = profile(chain, x, codecs=(), policies=())
    plans = _plans(prof, n)
    models: dict[str, Any] = {"store-all": chain}
    models.update({name: apply(chain, plan) for name, plan in plans.items()})
    interleaved = measure(models, x, args.rounds, burst=1)
    steady = measure(models, x, args.rounds, burst=3)
    rows = [
        {
            "plan": name,
            "predicted_overhead": plan.predicted_overhead,
            "interleaved": interleaved[name],
            "steady": steady[name],
        }
        for name, plan in plans.items()
    ]
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    print(
        f"GPT-like, {n} blocks, input {list(shape)}; GLIBC_TUNABLES={tunables or '(unset)'}; "
        f"keep_freed_memory: {kept}"
    )
    print("| plan | predicted | interleaved (IQR) | steady state (IQR) |")
    print("|---|---|---|---|")
    for r in rows:
        i, s = r["interleaved"], r["steady"]
        print(
            f"| {r['plan']} | {r['predicted_overhead']:+.3f} | {i['overhead']:+.3f} "
            f"({i['iqr'][0]:+.3f}..{i['iqr'][1]:+.3f}) | {s['overhead']:+.3f} "
            f"({s['iqr'][0]:+.3f}..{s['iqr'][1]:+.3f}) |"
        )
    result = {
        "benchmark": "bench_allocator",
        "command": "python benchmarks/bench_allocator.py",
        "environment": environment(),
        "glibc_tunables": tunables,
        "keep_freed_memory": kept,
        "model": {"blocks": n, "dim": dim, "heads": heads, "input": list(shape)},
        "rows": rows,
    }
    write_json(result, args.out)
    return result


if __name__ == "__main__":
    main()
