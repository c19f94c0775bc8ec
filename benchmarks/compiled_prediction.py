"""How well a compiled profile predicts the compiled step's peak, on a model revckpt did not
write: a random-weight HF Llama's decoder layers as a chain (``bench_schedule.llama_chain(4,
64, 4, 2, 64)``), ``schedule.profile(..., compiled=True)``, plans solved at 90 / 70 / 50% of
store-all, each run as ``torch.compile(apply(chain, plan))`` and metered with
``MemoryMeter("cpu", method="allocator")`` after two warm steps.

Run ``python benchmarks/compiled_prediction.py``; prints a table and writes
``benchmarks/results/compiled_prediction.json``. ``--quick``: a smoke run (a 2-layer, dim-32
Llama, one budget, one profiling repeat; seconds), its figures not the ones the docs cite.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
from _common import environment, write_json  # benchmarks/_common.py
from bench_schedule import llama_chain

from revckpt.measure import MemoryMeter
from revckpt.schedule import apply, profile, solve


def measured_peak(model: Any, x: torch.Tensor, grad: torch.Tensor) -> int:
    for _ in range(2):
        model(x.clone().requires_grad_()).backward(grad)
    with MemoryMeter("cpu", method="allocator") as meter:
        model(x.clone().requires_grad_()).backward(grad)
    return meter.peak_bytes


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "compiled_prediction.json"
    )
    parser.add_argument(
        "--quick", action="store_true", help="a tiny Llama, one budget (a smoke test)"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    size = (2, 32, 2, 2, 16) if args.quick else (4, 64, 4, 2, 64)
    made = llama_chain(*size)
    if made is None:
        raise SystemExit("transformers is not installed (pip install -e '.[bench]')")
    chain, x = made
    prof = profile(chain, x, compiled=True, repeats=1 if args.quick else 3)
    grad = torch.randn_like(x)
    rows = []
    for fraction in (0.8,) if args.quick else (0.9, 0.7, 0.5):
        plan = solve(prof, memory_budget=fraction)
        torch._dynamo.reset()
        peak = measured_peak(torch.compile(apply(chain, plan)), x, grad)
        rows.append(
            {
                "budget": fraction,
                "strategies": list(plan.strategies),
                "predicted_peak_bytes": plan.predicted_peak_bytes,
                "measured_peak_bytes": peak,
                "measured_over_predicted": peak / plan.predicted_peak_bytes,
            }
        )
    result = {
        "benchmark": "compiled_prediction",
        "command": "python benchmarks/compiled_prediction.py" + (" --quick" if args.quick else ""),
        "environment": environment(),
        "model": f"HF Llama decoder layers, llama_chain{size}, random weights",
        "rows": rows,
    }
    print("| budget | plan | measured / predicted peak |\n|---|---|---|")
    for r in rows:
        ratio = r["measured_over_predicted"]
        print(f"| {r['budget']:.0%} | {', '.join(r['strategies'])} | {ratio:.3f} |")
    write_json(result, args.out)
    return result


if __name__ == "__main__":
    main()
