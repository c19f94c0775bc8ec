"""The scheduler's peak prediction on random plans: every strategy, random cuts.

For each built-in chain (``gpt_like``, ``revnet_like``, ``mlp_chain``, with host copies off the
meter as ``tests/test_offload.py`` measures them), one profile with every strategy (store,
checkpoint, offload, reversible where the blocks are invertible, approx e4m3), then ``--plans``
random plans (random cuts, a random strategy per segment, those the cost model refuses
skipped), each measured (``revckpt.report.measure_peak``) and divided by its predicted peak.
A plan is a miss outside [0.95, 1.001] (the tolerance of ``tests/test_offload.py``).

Run ``python benchmarks/random_plan_peaks.py``; prints a table and writes
``benchmarks/results/random_plan_peaks.json``.
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
from pathlib import Path

import torch
from _common import environment, write_json  # benchmarks/_common.py

from revckpt import offload
from revckpt.errors import RevckptError
from revckpt.models import gpt_like, mlp_chain, revnet_like
from revckpt.report import measure_peak
from revckpt.schedule import Segment, apply, make_plan, profile

OUT = Path(__file__).parent / "results" / "random_plan_peaks.json"
CHAINS = {
    "gpt_like(6, 32, 2)": lambda: (gpt_like(6, 32, 2), torch.randn(2, 32, 32)),
    "revnet_like((2, 2), (8, 16))": lambda: (
        revnet_like((2, 2), (8, 16)),
        torch.randn(4, 3, 16, 16),
    ),
    "mlp_chain(6, 64, 256)": lambda: (mlp_chain(6, 64, 256), torch.randn(64, 64)),
}
STRATEGIES = ["store", "checkpoint", "offload", "reversible", "approx:e4m3"]


def ratios(make, plans: int, seed: int) -> list[float]:
    torch.manual_seed(0)
    chain, x = make()
    n = len(chain)
    prof = profile(chain, x, repeats=1, codecs=("e4m3",), policies=(), offload=True)
    rng, found = random.Random(seed), []
    while len(found) < plans:
        cuts = sorted(rng.sample(range(1, n), rng.randint(0, n - 1)))
        bounds = [0, *cuts, n]
        segs = [Segment(a, b, rng.choice(STRATEGIES)) for a, b in itertools.pairwise(bounds)]
        try:
            plan = make_plan(prof, segs)
        except RevckptError:
            continue
        found.append(measure_peak(apply(chain, plan), x) / plan.predicted_peak_bytes)
    return found


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--plans", type=int, default=40)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    with offload.force_copies(simulate_device=True):
        for name, make in CHAINS.items():
            r = ratios(make, args.plans, args.seed)
            misses = sum(not 0.95 <= v <= 1.001 for v in r)
            rows.append(dict(chain=name, plans=len(r), misses=misses, min=min(r), max=max(r),
                             median=statistics.median(r)))  # fmt: skip
    print("| chain | plans | measured / predicted: min, median, max | misses |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['chain']} | {r['plans']} | {r['min']:.4f}, {r['median']:.4f}, "
              f"{r['max']:.4f} | {r['misses']} |")  # fmt: skip
    result = {
        "benchmark": "random_plan_peaks",
        "command": "python benchmarks/random_plan_peaks.py",
        "config": {"plans": args.plans, "seed": args.seed},
        "environment": environment(),
        "rows": rows,
    }
    write_json(result, args.out)
    return result


if __name__ == "__main__":
    main()
