"""Reconstruction drift of reversible stacks: how far rebuilt block inputs move from the originals.

For additive MLP blocks (the bench_reversible configuration, narrower), runs the forward keeping
every block input, then rebuilds the inputs from the output block by block, as the reversible
backward does, and reports the relative L2 error ``||x_hat - x|| / ||x||`` of the first block's
input (the end of the walk, where drift is largest), with and without ``anchor_every``.

Run ``python benchmarks/drift_reversible.py``; prints a table and writes
``benchmarks/results/drift_reversible.json``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
from _common import environment, write_json  # benchmarks/_common.py

from revckpt.layers import reversible_mlp_block


def drift(
    depth: int, dtype: torch.dtype, anchor_every: int | None, width: int = 128, batch: int = 64
) -> float:
    torch.manual_seed(0)
    blocks = [reversible_mlp_block(width, 2 * width).to(dtype) for _ in range(depth)]
    x1 = torch.randn(batch, width, dtype=dtype)
    x2 = torch.randn(batch, width, dtype=dtype)
    inputs = []
    with torch.no_grad():
        for b in blocks:
            inputs.append((x1, x2))
            x1, x2 = b(x1, x2)
        worst = 0.0
        for i in reversed(range(depth)):
            x1, x2 = blocks[i].inverse(x1, x2)
            e1, e2 = inputs[i]
            err = (torch.cat([x1, x2]).double() - torch.cat([e1, e2]).double()).norm()
            worst = max(worst, (err / torch.cat([e1, e2]).double().norm()).item())
            if anchor_every is not None and i % anchor_every == 0:
                x1, x2 = e1, e2  # restart from the stored anchor
    return worst


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "drift_reversible.json"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for depth in (8, 32, 128):
            for anchor in (None, 8):
                rows.append(
                    {
                        "dtype": str(dtype).removeprefix("torch."),
                        "depth": depth,
                        "anchor_every": anchor,
                        "max_relative_drift": drift(depth, dtype, anchor),
                    }
                )
    print("| dtype | depth | anchor_every | max relative drift of rebuilt inputs |")
    print("|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['dtype']} | {r['depth']} | {r['anchor_every'] or '-'} | "
            f"{r['max_relative_drift']:.2e} |"
        )
    result = {
        "benchmark": "drift_reversible",
        "command": "python benchmarks/drift_reversible.py",
        "environment": environment(),
        "rows": rows,
    }
    write_json(result, args.out)
    return result


if __name__ == "__main__":
    main()
