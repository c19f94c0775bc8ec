"""Approximate recompute: what each codec keeps, what it costs the gradients, and how fast.

For each chain (a pre-norm GELU MLP, the same MLP with ReLU and no norm, and a small pre-norm
transformer) and each configuration (codec format x scaling x rounding, and bf16 recompute),
every block input is kept through the configuration (``checkpoint_sequential(blocks, L, x,
strategy=Approx(...))``) and compared with float64 autograd of the same weights:

* kept per boundary: bytes held after forward per block input (``revckpt.MemoryMeter``: all
  live bytes minus the output, over ``L`` boundaries), and as a fraction of float32;
* error: ``||g - g64|| / ||g64||`` over all parameter gradients, and their cosine;
* bound, estimate: :func:`revckpt.approx.bounds.estimate_error` (first-order hard bound,
  random-sign estimate), relative; ``-`` where they do not apply (low-precision recompute);
* time: forward+backward over the exact per-block checkpoint (``Approx(store=None)``), all
  configurations in one rotated round-robin (``revckpt.time_ratios``), one CPU thread.

Run ``python benchmarks/bench_approx.py`` (``--quick`` for a smoke run); prints a table and
writes ``benchmarks/results/bench_approx.json``.
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _common import environment, write_json  # benchmarks/_common.py
from torch import nn

from revckpt import MemoryMeter, checkpoint_sequential, time_ratios
from revckpt.approx import Approx
from revckpt.approx.bounds import estimate_error
from revckpt.models import ResidualMLPBlock, transformer_chain


def configs(width: int) -> dict[str, Approx]:
    block = 64 if width % 64 == 0 else width
    out = {"exact (store=None)": Approx(store=None), "bf16": Approx(store="bf16")}
    for fmt in ("e4m3", "e5m2"):
        out[f"{fmt} tensor"] = Approx(store=fmt, scaling="tensor")
        out[f"{fmt} row"] = Approx(store=fmt, scaling="row")
        out[f"{fmt} block {block}"] = Approx(store=fmt, scaling="block", block_size=block)
    out["e4m3 row stochastic"] = Approx(store="e4m3", rounding="stochastic")
    out["bf16 recompute"] = Approx(store=None, recompute_dtype=torch.bfloat16)
    out["bf16 store + bf16 recompute"] = Approx(store="bf16", recompute_dtype=torch.bfloat16)
    return out


def chains(quick: bool) -> dict[str, tuple[nn.Sequential, torch.Tensor]]:
    torch.manual_seed(0)
    width, hidden, batch = (32, 64, 8) if quick else (128, 512, 32)
    dim, heads, seq, tbatch = (32, 4, 8, 2) if quick else (64, 4, 32, 4)
    depth = 2 if quick else 4
    gelu = nn.Sequential(
        *(ResidualMLPBlock(width, hidden, activation=nn.GELU, norm="layer") for _ in range(depth))
    )
    relu = nn.Sequential(*(ResidualMLPBlock(width, hidden) for _ in range(depth)))
    return {
        f"MLP pre-norm GELU ({depth}x{width}/{hidden}, batch {batch})": (
            gelu,
            torch.randn(batch, width),
        ),
        f"MLP ReLU, no norm ({depth}x{width}/{hidden}, batch {batch})": (
            relu,
            torch.randn(batch, width),
        ),
        f"transformer ({depth}x{dim}, {heads} heads, {tbatch}x{seq} tokens)": (
            transformer_chain(depth, dim, heads),
            torch.randn(tbatch, seq, dim),
        ),
    }


def grads(chain: nn.Sequential, x: torch.Tensor, approx: Approx | None) -> torch.Tensor:
    for p in chain.parameters():
        p.grad = None
    y = checkpoint_sequential(chain, len(chain), x, strategy=approx) if approx else chain(x)
    y.sum().backward()
    return torch.cat([p.grad.flatten().double() for p in chain.parameters()])


def kept_per_boundary(chain: nn.Sequential, x: torch.Tensor, approx: Approx) -> float:
    """Bytes the forward keeps alive per block input. The input is created inside the meter
    and dropped by the caller, so an exactly kept input counts and a compressed one does not."""
    with MemoryMeter("cpu") as meter:
        xx = x.clone()
        y = checkpoint_sequential(chain, len(chain), xx, strategy=approx)
        del xx
    held = meter.end_bytes - y.numel() * y.element_size()
    del y
    return held / len(chain)


def bench_chain(
    name: str, chain: nn.Sequential, x: torch.Tensor, repeats: int, iterations: int
) -> list[dict[str, Any]]:
    reference = grads(copy.deepcopy(chain).double(), x.double(), None)
    fp32_boundary = x.numel() * 4
    width = x.shape[-1]
    rows = []
    steps: dict[str, Callable[[], None]] = {}
    for label, approx in configs(width).items():
        g = grads(chain, x, approx)
        err = float((g - reference).norm() / reference.norm())
        cos = float(torch.nn.functional.cosine_similarity(g, reference, dim=0))
        kept = kept_per_boundary(chain, x, approx)
        bound = estimate = None
        if approx.codec is not None and approx.recompute_dtype is None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                est = estimate_error(chain, x, approx, power_iterations=iterations, probes=8)
            bound, estimate = est.total("bound"), est.total("estimate")
        rows.append(
            {
                "chain": name,
                "config": label,
                "kept_bytes_per_boundary": kept,
                "kept_fraction_of_fp32": kept / fp32_boundary,
                "grad_rel_error_vs_fp64": err,
                "grad_cosine_vs_fp64": cos,
                "bound_rel": bound,
                "estimate_rel": estimate,
            }
        )

        def step(approx: Approx = approx) -> None:
            checkpoint_sequential(chain, len(chain), x, strategy=approx).sum().backward()

        steps[label] = step
        print(f"  {name}: {label}", file=sys.stderr)
    ratios = time_ratios(steps, baseline="exact (store=None)", repeats=repeats, warmup=1)
    for row in rows:
        r = ratios[row["config"]]
        row.update(time_ratio=r.ratio, time_ratio_q25=r.q25, time_ratio_q75=r.q75)
    for p in chain.parameters():
        p.grad = None
    return rows


def _num(v: float | None, fmt: str = ".2e") -> str:
    if v is None:
        return "-"
    return "inf" if math.isinf(v) else format(v, fmt)


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| chain | config | kept / boundary (of fp32) | grad error vs fp64 | cosine | bound | "
        "estimate | time vs exact ckpt (IQR) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['chain']} | {r['config']} | {r['kept_bytes_per_boundary'] / 1e3:.1f} kB "
            f"({r['kept_fraction_of_fp32']:.3f}) | {_num(r['grad_rel_error_vs_fp64'])} | "
            f"{r['grad_cosine_vs_fp64']:.6f} | {_num(r['bound_rel'])} | "
            f"{_num(r['estimate_rel'])} | {r['time_ratio']:.3f} "
            f"({r['time_ratio_q25']:.2f}-{r['time_ratio_q75']:.2f}) |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke test")
    parser.add_argument("--repeats", type=int, default=None, help="interleaved timing rounds")
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "bench_approx.json"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    repeats = args.repeats or (3 if args.quick else 9)
    iterations = 4 if args.quick else 8
    rows: list[dict[str, Any]] = []
    for name, (chain, x) in chains(args.quick).items():
        rows += bench_chain(name, chain, x, repeats, iterations)
    result = {
        "benchmark": "bench_approx",
        "command": "python benchmarks/bench_approx.py" + (" --quick" if args.quick else ""),
        "config": {"repeats": repeats, "power_iterations": iterations, "threads": 1},
        "environment": environment(),
        "rows": rows,
    }
    print(table(rows))
    write_json(result, args.out)
    return result


if __name__ == "__main__":
    main()
