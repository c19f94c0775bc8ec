"""Reversible stacks: plain autograd, per-block checkpoint, revckpt and the peers, side by side.

Every variant runs the same weights and the same math, the 2-stream additive coupling
``y1 = x1 + F(x2); y2 = x2 + G(y1)`` with ``F, G = Linear(w, h) -> ReLU -> Linear(h, w)``
(the configuration of the project's peer measurements: batch 256, stream width 512, hidden
1024, float32, one CPU thread). Outputs are checked equal to plain autograd before timing.
Reported per depth (8, 32, 128):

* held after forward: live tensor bytes after the forward (``revckpt.MemoryMeter``);
* peak: highest live tensor bytes over a forward+backward step in steady state (parameter
  gradients already allocated, as from the second training step on);
* time ratio: forward+backward time over plain autograd's. Every variant runs once per round,
  in an order rotated each round, and is divided by plain's time of the same round (median of
  the rounds, ``revckpt.time_ratios``). Matrix-multiply speed on a CPU depends on where the
  allocator happens to place the buffers, which is fixed for a process and differs between
  processes by a few percent, so each depth is measured in ``--processes`` fresh processes
  (default 3) and the table gives the median over them with each process's value.
* head-to-head: revckpt against the fastest peer of that process, interleaved directly;
* the cost of the default invertibility check (``check_inverse="auto"``: 64 sampled elements
  of each half of the stack input, compared with their rebuilt values once per backward):
  revckpt as shipped against ``check_inverse=None``, interleaved directly.

Peers that are not installed are skipped with a note (``pip install -e ".[bench]"`` and
``pip install --no-deps memcnn==1.5.2``). memcnn frees block inputs by resizing their storage
to zero, which the CPU meter sees only at the end of a measured block: its *held* figure is
exact, its *peak* figure is an upper bound.

Run ``python benchmarks/bench_reversible.py`` (``--quick`` for a smoke run); prints a table and
writes ``benchmarks/results/bench_reversible.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.utils.checkpoint as tcp
from _common import environment, ratio_cell, reversible_peers, write_json  # benchmarks/_common.py
from torch import nn

from revckpt import MemoryMeter, time_ratio, time_ratios
from revckpt.layers import ReversibleBlock, ReversibleSequential

Forward = Callable[[torch.Tensor], torch.Tensor]
HEAD_TO_HEAD = "head-to-head: revckpt / fastest peer (interleaved)"
UNCHECKED = "revckpt, check_inverse=None (no invertibility check)"
CHECK_COST = "default invertibility check: revckpt / check_inverse=None (interleaved)"


def branch(width: int, hidden: int) -> nn.Module:
    return nn.Sequential(nn.Linear(width, hidden), nn.ReLU(), nn.Linear(hidden, width))


def plain(blocks: list[ReversibleBlock]) -> Forward:
    def run(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=1)
        for block in blocks:
            x1, x2 = block(x1, x2)
        return torch.cat([x1, x2], dim=1)

    return run


def torch_checkpoint(blocks: list[ReversibleBlock]) -> Forward:
    def run(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=1)
        for block in blocks:
            x1, x2 = tcp.checkpoint(block, x1, x2, use_reentrant=False)
        return torch.cat([x1, x2], dim=1)

    return run


def peers(blocks: list[ReversibleBlock]) -> tuple[dict[str, Forward], list[str]]:
    return reversible_peers(blocks, split_dim=1)


def bench_depth(
    depth: int, batch: int, width: int, hidden: int, repeats: int
) -> tuple[list[dict[str, Any]], list[str]]:
    torch.manual_seed(0)
    blocks = [ReversibleBlock(branch(width, hidden), branch(width, hidden)) for _ in range(depth)]
    params = [p for b in blocks for p in b.parameters()]
    x0 = torch.randn(batch, 2 * width)
    variants: dict[str, Forward] = {
        "plain autograd": plain(blocks),
        "torch checkpoint per block": torch_checkpoint(blocks),
        "revckpt ReversibleSequential": ReversibleSequential(*blocks, split_dim=1),
        UNCHECKED: ReversibleSequential(*blocks, split_dim=1, check_inverse=None),
    }
    found, notes = peers(blocks)
    variants.update(found)

    def fresh() -> torch.Tensor:
        return x0.clone().requires_grad_(True)  # memcnn frees its input's storage

    def step(forward: Forward) -> Callable[[], None]:
        def go() -> None:
            forward(fresh()).sum().backward()

        return go

    with torch.no_grad():
        reference = variants["plain autograd"](x0)
    rows = []
    for name, forward in variants.items():
        out = forward(fresh())
        max_diff = (out.detach() - reference).abs().max().item()
        out.sum().backward()  # gradients allocated: steady state from here on
        del out
        x = fresh()
        with MemoryMeter("cpu") as fwd:
            y = forward(x)
        held = fwd.end_bytes
        y.sum().backward()
        del y, x
        with MemoryMeter("cpu") as both:
            step(forward)()
        rows.append(
            {
                "depth": depth,
                "variant": name,
                "held_after_forward_bytes": held,
                "peak_bytes": both.peak_bytes,
                "max_abs_diff_vs_plain": max_diff,
            }
        )
        print(f"  depth {depth}: {name} measured", file=sys.stderr)
    # One round-robin for every variant: all ratios divide by the same plain runs.
    ratios = time_ratios(
        {name: step(forward) for name, forward in variants.items()},
        baseline="plain autograd",
        repeats=repeats,
        warmup=1,
    )
    for row in rows:
        r = ratios[row["variant"]]
        row.update(time_ratio=r.ratio, time_ratio_q25=r.q25, time_ratio_q75=r.q75)

    def head_to_head(variant: str, other: str, **extra: Any) -> dict[str, Any]:
        r = time_ratio(
            step(variants["revckpt ReversibleSequential"]),
            step(variants[other]),
            repeats=repeats,
            warmup=1,
        )
        ratio = {"time_ratio": r.ratio, "time_ratio_q25": r.q25, "time_ratio_q75": r.q75}
        return {"depth": depth, "variant": variant, **extra, **ratio}

    rows.append(head_to_head(CHECK_COST, UNCHECKED))
    peer_rows = [r for r in rows if r["variant"] in found]
    if peer_rows:
        best = min(peer_rows, key=lambda r: r["time_ratio"])["variant"]
        rows.append(head_to_head(HEAD_TO_HEAD, best, fastest_peer=best))
    for p in params:
        p.grad = None
    return rows, notes


def aggregate(runs: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Rows of several processes: memory from the first (it is deterministic), time as the
    median over processes of each process's median ratio, with every process's value kept."""
    rows = []
    for i, first in enumerate(runs[0]):
        same = [run[i] for run in runs]
        assert all(r["variant"] == first["variant"] for r in same), "processes disagree on rows"
        per_process = [r["time_ratio"] for r in same]
        row = {k: v for k, v in first.items() if not k.startswith("time_ratio")}
        if "fastest_peer" in first:
            row["fastest_peer"] = [r["fastest_peer"] for r in same]
        row.update(
            time_ratio=statistics.median(per_process),
            time_ratio_per_process=per_process,
            time_ratio_iqr_per_process=[[r["time_ratio_q25"], r["time_ratio_q75"]] for r in same],
        )
        rows.append(row)
    return rows


def time_cell(row: dict[str, Any]) -> str:
    values = row.get("time_ratio_per_process")
    if values is None or len(values) == 1:
        return ratio_cell(row)
    return f"{row['time_ratio']:.3f} [" + ", ".join(f"{v:.3f}" for v in values) + "]"


def table(rows: list[dict[str, Any]]) -> str:
    multi = any(len(r.get("time_ratio_per_process", ())) > 1 for r in rows)
    time_head = (
        "time vs plain: median of processes [each process's median]"
        if multi
        else "time vs plain (IQR)"
    )
    lines = [
        f"| depth | variant | held after forward MB | peak fwd+bwd MB | {time_head} |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        if "held_after_forward_bytes" not in r:
            lines.append(f"| {r['depth']} | {r['variant']} | | | {time_cell(r)} |")
            continue
        lines.append(
            f"| {r['depth']} | {r['variant']} | {r['held_after_forward_bytes'] / 1e6:.2f} | "
            f"{r['peak_bytes'] / 1e6:.2f} | {time_cell(r)} |"
        )
    return "\n".join(lines)


def run_worker(args: argparse.Namespace, depth: int, out: Path) -> list[dict[str, Any]]:
    """One depth measured in a fresh process (its own heap layout and allocator state)."""
    cmd = [sys.executable, __file__, "--worker", "--depths", str(depth), "--out", str(out)]
    cmd += ["--repeats", str(args.repeats)] if args.repeats else []
    cmd += ["--quick"] if args.quick else []
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())["rows"]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke test")
    parser.add_argument("--depths", type=int, nargs="+", default=None)
    parser.add_argument("--repeats", type=int, default=None, help="interleaved timing rounds")
    parser.add_argument(
        "--processes",
        type=int,
        default=3,
        help="fresh processes per depth; time ratios are the median over them (default 3)",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(__file__).parent / "results" / "bench_reversible.json",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.quick:
        batch, width, hidden = 8, 16, 32
        depths, repeats = args.depths or [2, 4], args.repeats or 3
    else:
        batch, width, hidden = 256, 512, 1024
        depths, repeats = args.depths or [8, 32, 128], args.repeats or 11
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    processes = 1 if args.worker else args.processes
    for depth in depths:
        if processes == 1:
            r, notes = bench_depth(depth, batch, width, hidden, repeats)
            rows += r
            continue
        with tempfile.TemporaryDirectory() as tmp:
            runs = []
            for k in range(processes):
                print(f"depth {depth}: process {k + 1} of {processes}", file=sys.stderr)
                runs.append(run_worker(args, depth, Path(tmp) / f"{k}.json"))
        rows += aggregate(runs)
        notes = peers([])[1]
    command = "python benchmarks/bench_reversible.py" + (" --quick" if args.quick else "")
    result = {
        "benchmark": "bench_reversible",
        "command": command,
        "config": {
            "batch": batch,
            "stream_width": width,
            "hidden": hidden,
            "depths": depths,
            "repeats": repeats,
            "processes": processes,
            "threads": 1,
            "dtype": "float32",
        },
        "environment": environment(),
        "notes": notes,
        "rows": rows,
    }
    if args.worker:
        write_json(result, args.out)
        return result
    print(table(rows))
    for note in notes:
        print("note:", note)
    write_json(result, args.out)
    return result


if __name__ == "__main__":
    main()
