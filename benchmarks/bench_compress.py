"""Compressed saved activations (``revckpt.approx.compress_saved``) against storing and against
per-block checkpointing, on a whole training step of a chain.

For the GPT-like chain of ``bench_schedule.py`` (24 blocks, width 64, 4 heads, batch 4 x 128
tokens; ``--quick``: 4 blocks, width 32) every block runs

* stored (plain autograd), the baseline;
* checkpointed, one ``revckpt.checkpoint`` per block;
* under ``compress_saved(block, h, store=...)`` for bf16, e4m3 and e5m2.

Per variant: the whole step's peak and the bytes held after the forward
(``revckpt.MemoryMeter`` around forward and backward, the output's gradient made beforehand),
the time of the step against the stored one (``revckpt.time_ratios``: interleaved, rotated
rounds, median and IQR; one CPU thread), and the relative error of all parameter gradients
together against a float64 copy of the chain run plainly (``revckpt.measure.gradient_error``,
its seeded random projection of the output as the loss).

Run ``python benchmarks/bench_compress.py`` (``--quick``: small chain, few rounds); prints a
table and writes ``benchmarks/results/bench_compress.json``.
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _common import environment, ratio_cell, write_json  # benchmarks/_common.py
from torch import nn

import revckpt
from revckpt import MemoryMeter, time_ratios
from revckpt.approx import compress_saved
from revckpt.measure import gradient_error as measure_gradient_error
from revckpt.measure import keep_freed_memory
from revckpt.models import gpt_like

OUT = Path(__file__).parent / "results" / "bench_compress.json"
FORMATS = ("bf16", "e4m3", "e5m2")


def variants() -> dict[str, Callable[[nn.Module, torch.Tensor], torch.Tensor]]:
    """Each variant as the call that runs one block on its input."""
    found: dict[str, Callable[[nn.Module, torch.Tensor], torch.Tensor]] = {
        "store": lambda block, h: block(h),
        "checkpoint per block": lambda block, h: revckpt.checkpoint(block, h),
    }
    for fmt in FORMATS:
        found[f"compress {fmt}"] = lambda block, h, fmt=fmt: compress_saved(block, h, store=fmt)
    return found


def run(
    chain: nn.Sequential,
    x: torch.Tensor,
    grad: torch.Tensor,
    call: Callable[[nn.Module, torch.Tensor], torch.Tensor],
    meter: MemoryMeter | None = None,
) -> int:
    """One training step (forward, then backward with ``grad``); with ``meter``, returns the
    bytes held when the forward ends (else 0)."""
    h = x.detach().requires_grad_(True)
    for block in chain:
        h = call(block, h)
    held = meter.live_bytes if meter is not None else 0
    h.backward(grad)
    return held


class _Chain(nn.Module):
    """The chain run block by block through ``call`` (for ``revckpt.measure.gradient_error``)."""

    def __init__(self, chain: nn.Sequential, call: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.chain, self.call = chain, call

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h.to(next(self.chain.parameters()).dtype)  # the float64 reference takes float64
        for block in self.chain:
            h = self.call(block, h)
        return h


def gradient_error(
    chain: nn.Sequential, x: torch.Tensor, call: Callable[..., torch.Tensor]
) -> float:
    """``||g - g64|| / ||g64||`` over every parameter gradient of ``chain`` run through
    ``call``, against a float64 copy run plainly (``revckpt.measure.gradient_error``)."""
    reference = _Chain(copy.deepcopy(chain).double(), variants()["store"])
    err = measure_gradient_error(_Chain(chain, call), reference, x)
    chain.zero_grad(set_to_none=True)
    return err.overall.rel_l2


def measure(chain: nn.Sequential, x: torch.Tensor, repeats: int) -> list[dict[str, Any]]:
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
    calls = variants()
    rows = []
    for name, call in calls.items():
        run(chain, x, grad, call)  # warm: the step's kernels and the allocator's pools
        with MemoryMeter("cpu") as meter:
            held = run(chain, x, grad, call, meter)
        rows.append(
            {
                "variant": name,
                "peak_bytes": meter.peak_bytes,
                "held_after_forward_bytes": held,
                "gradient_error": gradient_error(chain, x, call),
            }
        )
    steps = {name: (lambda call=call: run(chain, x, grad, call)) for name, call in calls.items()}
    ratios = time_ratios(steps, baseline="store", repeats=repeats, warmup=1)
    store = rows[0]
    for row in rows:
        r = ratios[row["variant"]]
        row.update(
            time_ratio=r.ratio,
            time_ratio_q25=r.q25,
            time_ratio_q75=r.q75,
            peak_fraction=row["peak_bytes"] / store["peak_bytes"],
            held_fraction=row["held_after_forward_bytes"] / store["held_after_forward_bytes"],
        )
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| variant | step peak (of store) | held after forward (of store) | time vs store (IQR) "
        "| gradient error |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['variant']} | {r['peak_bytes'] / 2**20:.1f} MiB ({r['peak_fraction']:.3f}) | "
            f"{r['held_after_forward_bytes'] / 2**20:.1f} MiB ({r['held_fraction']:.3f}) | "
            f"{ratio_cell(r)} | {r['gradient_error']:.1e} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small chain, few rounds")
    parser.add_argument("--repeats", type=int, default=None, help="timing rounds (21)")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    keep_freed_memory()
    torch.manual_seed(0)
    if args.quick:
        chain, x, shape = gpt_like(4, 32, 2), torch.randn(2, 16, 32), "gpt_like(4, 32, 2)"
    else:
        chain, x, shape = gpt_like(24, 64, 4), torch.randn(4, 128, 64), "gpt_like(24, 64, 4)"
    repeats = args.repeats or (3 if args.quick else 21)
    rows = measure(chain, x, repeats)
    result = {
        "benchmark": "bench_compress",
        "command": "python benchmarks/bench_compress.py" + (" --quick" if args.quick else ""),
        "environment": environment(),
        "model": shape,
        "input_shape": list(x.shape),
        "threads": 1,
        "repeats": repeats,
        "rows": rows,
    }
    print(table(rows))
    write_json(result, args.out)
    return result


if __name__ == "__main__":
    main()
