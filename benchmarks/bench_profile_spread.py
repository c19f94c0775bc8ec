"""How far apart separate profiles of one model predict the same plans, and how each reads
against the plans' measured overhead: ``bench_schedule``'s two profiles, as many times as
asked, and variants of the in-chain timing side by side.

For each model of ``bench_schedule`` (GPT-like, RevNet-like, HF Llama), ``--profiles`` K
profiles per variant are made in one process, the variants alternating (the order flips
each time), then ``bench_schedule``'s plans (solved from the first profile) are measured
once with :func:`revckpt.report` (interleaved rounds, median). Per variant and profile:
the plans predicted within 15% (or 0.03 of a step) of their measured overhead, the Spearman
rank correlation over the plans at 10-90% of store-all, and the median ratio of predicted to
measured overhead; per variant, how far apart two profiles predict a plan (the worst plan
of each pair of profiles: the median and the worst pair).

Variants (``--variants``): ``default``, the timing as it ships; ``one-stretch``, each
strategy and the stored reference on one stretch of the chain per step instead of two.

Run ``python benchmarks/bench_profile_spread.py``; prints a table and writes
``benchmarks/results/bench_profile_spread.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import bench_schedule as bs  # benchmarks/bench_schedule.py
import torch
from _common import environment, write_json  # benchmarks/_common.py

from revckpt.measure import keep_freed_memory
from revckpt.report import report
from revckpt.schedule import baseline, evaluate, probe, profile

VARIANTS = {"default": {}, "one-stretch": {"_STRETCHES": 1}}


@contextlib.contextmanager
def variant(name: str) -> Iterator[None]:
    """The in-chain timing of ``name`` (module settings of revckpt.schedule.probe)."""
    old = {k: getattr(probe, k) for k in VARIANTS[name]}
    for k, v in VARIANTS[name].items():
        setattr(probe, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(probe, k, v)


def _predicted(prof: Any, plan: Any) -> float:
    return evaluate(prof.blocks, plan.segments).overhead_s / sum(
        b.forward_s + b.backward_s for b in prof.blocks
    )


def _summary(rows: list[list[float]], plans: list[Any], meas: dict, frac: dict) -> dict:
    within, spearman, bias = [], [], []
    spanning = [i for i, p in enumerate(plans) if 0.1 <= frac[p.name] <= 0.9]
    for row in rows:
        within.append(
            sum(
                abs(v - meas[p.name]) <= max(0.15 * abs(meas[p.name]), 0.03)
                for v, p in zip(row, plans, strict=True)
            )
        )
        spearman.append(
            bs._spearman([meas[plans[i].name] for i in spanning], [row[i] for i in spanning])
        )
        big = [v / meas[p.name] for v, p in zip(row, plans, strict=True) if meas[p.name] > 0.05]
        bias.append(statistics.median(big) if big else float("nan"))
    apart = [
        max(abs(a - b) / a for a, b in zip(ra, rb, strict=True) if a > 0)
        for k, ra in enumerate(rows)
        for rb in rows[k + 1 :]
    ]
    return {
        "within_15pct": within,
        "spearman_10_to_90pct": spearman,
        "predicted_over_measured": bias,
        "apart_median": statistics.median(apart) if apart else 0.0,
        "apart_worst": max(apart) if apart else 0.0,
        "predicted": rows,
    }


def run_model(name: str, chain: Any, x: torch.Tensor, args: argparse.Namespace) -> dict:
    profiles: dict[str, list[Any]] = {v: [] for v in args.variants}
    for k in range(args.profiles):
        order = args.variants if k % 2 == 0 else args.variants[::-1]
        for v in order:
            with variant(v):
                profiles[v].append(profile(chain, x))
    first = profiles[args.variants[0]][0]
    store_peak = baseline(first, "store").predicted_peak_bytes
    plans, records = bs.plans_for(first, store_peak, 0.01)
    rep = report(chain, x, plans, repeats=args.repeats, chosen=None, errors=False)
    rows = {r.name: r for r in rep.rows}
    meas = {p.name: rows[p.name].time_ratio - 1 for p in plans}
    frac = {p.name: rows[p.name].measured_peak_bytes / rep.store_all_peak_bytes for p in plans}
    labels = bs._labels(records)
    return {
        "model": name,
        "plans": [labels.get(p.name, p.name) for p in plans],
        "measured_overhead": [meas[p.name] for p in plans],
        "variants": {
            v: {
                **_summary([[_predicted(pr, p) for p in plans] for pr in profs], plans, meas, frac),
                "cost_in_steps": [pr.cost_in_steps for pr in profs],
            }
            for v, profs in profiles.items()
        },
    }


def table(result: dict[str, Any]) -> str:
    lines = [
        "| model | variant | plans within 15% per profile | Spearman per profile | "
        "predicted / measured per profile | profiles apart: median / worst pair | cost (steps) |",
        "|---|---|---|---|---|---|---|",
    ]
    for m in result["models"]:
        n = len(m["plans"])
        for v, r in m["variants"].items():
            lines.append(
                f"| {m['model']} | {v} | {' '.join(str(w) for w in r['within_15pct'])} of {n} | "
                f"{' '.join(f'{s:.2f}' for s in r['spearman_10_to_90pct'])} | "
                f"{' '.join(f'{b:.2f}' for b in r['predicted_over_measured'])} | "
                f"{r['apart_median']:.1%} / {r['apart_worst']:.1%} | "
                f"{statistics.median(r['cost_in_steps']):.1f} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny models (a smoke test)")
    parser.add_argument("--profiles", type=int, default=6, help="profiles per variant")
    parser.add_argument("--repeats", type=int, default=15, help="timing rounds of the plans")
    parser.add_argument(
        "--variants", nargs="+", default=["default", "one-stretch"], choices=list(VARIANTS)
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(__file__).parent / "results" / "bench_profile_spread.json",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    kept = keep_freed_memory()
    result = {
        "benchmark": "bench_profile_spread",
        "command": "python benchmarks/bench_profile_spread.py "
        + " ".join(["--profiles", str(args.profiles), "--variants", *args.variants])
        + (" --quick" if args.quick else ""),
        "environment": environment(),
        "keep_freed_memory": kept,
        "models": [run_model(n, c, x, args) for n, (c, x) in bs.models(args.quick).items()],
    }
    print(table(result))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_json(result, args.out)
    return result


if __name__ == "__main__":
    main()
