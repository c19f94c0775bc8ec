"""Classic checkpointing: plain autograd vs torch.utils.checkpoint vs revckpt, side by side.

For an MLP chain and a small transformer-like chain, every variant runs the same weights on the
same input and reports

* retained bytes: live tensor memory after the forward (activations kept for backward, plus
  the output), from ``revckpt.MemoryMeter``;
* peak bytes: highest live tensor memory over forward + backward (parameter gradients included);
* time ratio: forward+backward time over plain autograd's, interleaved A/B runs, median and
  interquartile range, one CPU thread.

Run ``python benchmarks/bench_checkpoint.py`` (``--quick`` for a small smoke run); it prints a
table and writes ``benchmarks/results/bench_checkpoint.json``.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.utils.checkpoint as tcp
from _common import environment, ratio_cell, write_json  # benchmarks/_common.py
from torch import nn

from revckpt import MemoryMeter, checkpoint_sequential, time_ratio
from revckpt.models import mlp_chain, transformer_chain

Run = Callable[[nn.Sequential, torch.Tensor], torch.Tensor]


def torch_per_block(m: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    for block in m:
        x = tcp.checkpoint(block, x, use_reentrant=False)
    return x


def torch_sqrt(m: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    segments = max(1, round(math.sqrt(len(m))))
    return tcp.checkpoint_sequential(m, segments, x, use_reentrant=False)


def ours(segments: Any, **opts: Any) -> Run:
    def run(m: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
        segs = len(m) if segments == "per-block" else segments
        return checkpoint_sequential(m, segs, x, **opts)

    return run


def variants(depth: int, selective: str) -> dict[str, Run]:
    every = 4 if depth >= 8 else 2
    return {
        "plain": lambda m, x: m(x),  # its time ratio (plain vs plain) shows the noise floor
        "torch per-block": torch_per_block,
        "torch sqrt (last segment stored)": torch_sqrt,
        "revckpt per-block": ours("per-block"),
        "revckpt sqrt": ours("sqrt"),
        f"revckpt every-{every}": ours(depth // every),
        f"revckpt per-block + policy={selective}": ours(
            "per-block", strategy=f"selective:{selective}"
        ),
    }


def measure(model: nn.Sequential, x: torch.Tensor, run: Run) -> tuple[int, int]:
    with MemoryMeter("cpu") as fwd:
        y = run(model, x)
    retained = fwd.end_bytes
    y.sum().backward()
    del y
    model.zero_grad(set_to_none=True)

    def step() -> None:
        run(model, x).sum().backward()
        model.zero_grad(set_to_none=True)

    with MemoryMeter("cpu") as both:
        step()
    return retained, both.peak_bytes


def bench_chain(
    name: str, model: nn.Sequential, x: torch.Tensor, selective: str, repeats: int
) -> list[dict[str, Any]]:
    runs = variants(len(model), selective)

    def step(run: Run) -> Callable[[], None]:
        def go() -> None:
            run(model, x).sum().backward()
            model.zero_grad(set_to_none=True)

        return go

    rows = []
    plain_step = step(runs["plain"])
    for label, run in runs.items():
        retained, peak = measure(model, x, run)
        ratio = time_ratio(step(run), plain_step, repeats=repeats, warmup=1)
        rows.append(
            {
                "chain": name,
                "variant": label,
                "retained_bytes": retained,
                "peak_bytes": peak,
                "time_ratio": ratio.ratio,
                "time_ratio_q25": ratio.q25,
                "time_ratio_q75": ratio.q75,
            }
        )
        print(f"  measured {name} / {label}", file=sys.stderr)
    head = time_ratio(
        step(runs["revckpt per-block"]), step(runs["torch per-block"]), repeats=repeats, warmup=1
    )
    rows.append(
        {
            "chain": name,
            "variant": "head-to-head: revckpt per-block / torch per-block",
            "time_ratio": head.ratio,
            "time_ratio_q25": head.q25,
            "time_ratio_q75": head.q75,
        }
    )
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| chain | variant | retained MiB | vs plain | peak MiB | vs plain | time ratio (IQR) |",
        "|---|---|---|---|---|---|---|",
    ]
    plain = {r["chain"]: r for r in rows if r["variant"] == "plain"}
    for r in rows:
        p = plain[r["chain"]]
        if "retained_bytes" not in r:
            lines.append(f"| {r['chain']} | {r['variant']} | | | | | {ratio_cell(r)} |")
            continue
        lines.append(
            f"| {r['chain']} | {r['variant']} | {r['retained_bytes'] / 2**20:.2f} | "
            f"{r['retained_bytes'] / p['retained_bytes']:.3f} | {r['peak_bytes'] / 2**20:.2f} | "
            f"{r['peak_bytes'] / p['peak_bytes']:.3f} | {ratio_cell(r)} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke test")
    parser.add_argument("--repeats", type=int, default=None, help="interleaved timing rounds")
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(__file__).parent / "results" / "bench_checkpoint.json",
        help="where to write the JSON results",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    if args.quick:
        mlp = dict(depth=4, width=32, hidden=64, batch=16)
        tf = dict(depth=2, dim=32, heads=2, seq=16, batch=2)
        repeats = args.repeats or 3
    else:
        mlp = dict(depth=32, width=128, hidden=512, batch=1024)
        tf = dict(depth=8, dim=256, heads=4, seq=256, batch=4)
        repeats = args.repeats or 9
    rows = bench_chain(
        f"MLP {mlp['depth']}x{mlp['width']}/{mlp['hidden']}",
        mlp_chain(mlp["depth"], mlp["width"], mlp["hidden"]),
        torch.randn(mlp["batch"], mlp["width"], requires_grad=True),
        "matmul",
        repeats,
    )
    rows += bench_chain(
        f"transformer {tf['depth']}x{tf['dim']} seq {tf['seq']}",
        transformer_chain(tf["depth"], tf["dim"], tf["heads"]),
        torch.randn(tf["batch"], tf["seq"], tf["dim"], requires_grad=True),
        "matmul+attention",
        repeats,
    )
    result = {
        "benchmark": "bench_checkpoint",
        "command": "python benchmarks/bench_checkpoint.py" + (" --quick" if args.quick else ""),
        "config": {"mlp": mlp, "transformer": tf, "repeats": repeats, "threads": 1},
        "environment": environment(),
        "rows": rows,
    }
    print(table(rows))
    write_json(result, args.out)
    return result


if __name__ == "__main__":
    main()
