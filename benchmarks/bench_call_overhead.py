"""Per-call cost of revckpt's checkpoint against torch.utils.checkpoint, on blocks small enough
that the Python bookkeeping of a checkpoint shows.

Every row times the same work twice, interleaved in one process, one CPU thread: revckpt's
checkpoint and torch's non-reentrant checkpoint (``use_reentrant=False``) of the same block on
the same input, and reports the median time ratio revckpt / torch with its interquartile range
(below 1: revckpt costs less). Rows:

* a tiny block (``Linear(64, 64)`` + GELU, input 32x64), forward + backward;
* one ``gpt_like`` block (dim 64, 4 heads, input 4x128x64), forward + backward;
* a 24-block ``gpt_like`` chain, every block checkpointed (``checkpoint_sequential(m, 24, x)``
  against torch's checkpoint per block), forward + backward, and forward alone;
* selective recompute keeping matrix multiplies and attention
  (``strategy="selective:matmul+attention"`` against torch's selective-checkpoint contexts
  with the same keep-set), on one block and on the chain, forward + backward.

Run ``python benchmarks/bench_call_overhead.py`` (``--quick`` for a small smoke run); it prints
a table and writes ``benchmarks/results/bench_call_overhead.json``. ``--before PATH`` adds the
ratios of an earlier run (the same script run against another revckpt checkout) as a column.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.utils.checkpoint as tcp
from _common import environment, ratio_cell, write_json  # benchmarks/_common.py
from torch import nn

import revckpt
from revckpt import checkpoint_sequential, time_ratio
from revckpt.models import gpt_like

_KEEP = revckpt.POLICY_PRESETS["matmul+attention"]


def _torch_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> tcp.CheckpointPolicy:
    if op.overloadpacket in _KEEP:
        return tcp.CheckpointPolicy.MUST_SAVE
    return tcp.CheckpointPolicy.PREFER_RECOMPUTE


_TORCH_SAC = functools.partial(tcp.create_selective_checkpoint_contexts, _torch_policy)

Block = Callable[[nn.Module, torch.Tensor], torch.Tensor]


def _strategy(policy: str | None) -> str | None:
    return None if policy is None else f"selective:{policy}"


def ours(policy: str | None = None) -> Block:
    strategy = _strategy(policy)
    return lambda block, x: revckpt.checkpoint(block, x, strategy=strategy)


def theirs(selective: bool = False) -> Block:
    options = {"context_fn": _TORCH_SAC} if selective else {}
    return lambda block, x: tcp.checkpoint(block, x, use_reentrant=False, **options)


def block_step(run: Block, block: nn.Module, x: torch.Tensor, calls: int) -> Callable[[], None]:
    def go() -> None:
        for _ in range(calls):
            run(block, x).sum().backward()
        block.zero_grad(set_to_none=True)

    return go


def chain_ours(chain: nn.Sequential, policy: str | None = None) -> Callable[[torch.Tensor], Any]:
    strategy = _strategy(policy)
    return lambda x: checkpoint_sequential(chain, len(chain), x, strategy=strategy)


def chain_theirs(chain: nn.Sequential, selective: bool = False) -> Callable[[torch.Tensor], Any]:
    run = theirs(selective)

    def go(x: torch.Tensor) -> torch.Tensor:
        for block in chain:
            x = run(block, x)
        return x

    return go


def chain_step(
    run: Callable[[torch.Tensor], Any], chain: nn.Sequential, x: torch.Tensor, backward: bool
) -> Callable[[], None]:
    def go() -> None:
        y = run(x)
        if backward:
            y.sum().backward()
            chain.zero_grad(set_to_none=True)

    return go


def cases(quick: bool) -> list[tuple[str, Callable[[], None], Callable[[], None]]]:
    """(name, revckpt step, torch step) for every row."""
    torch.manual_seed(0)
    dim, heads, seq, batch, depth = (32, 2, 16, 2, 4) if quick else (64, 4, 128, 4, 24)
    tiny = nn.Sequential(nn.Linear(64, 64), nn.GELU())
    tiny_x = torch.randn(32, 64, requires_grad=True)
    block = gpt_like(1, dim, heads)[0]
    chain = gpt_like(depth, dim, heads)
    x = torch.randn(batch, seq, dim, requires_grad=True)
    tiny_calls, block_calls = (5, 1) if quick else (20, 2)
    shape = f"{batch}x{seq}x{dim}"
    return [
        (
            f"tiny block (Linear 64 + GELU, 32x64) x{tiny_calls}, fwd+bwd",
            block_step(ours(), tiny, tiny_x, tiny_calls),
            block_step(theirs(), tiny, tiny_x, tiny_calls),
        ),
        (
            f"gpt_like block ({shape}) x{block_calls}, fwd+bwd",
            block_step(ours(), block, x, block_calls),
            block_step(theirs(), block, x, block_calls),
        ),
        (
            f"gpt_like chain {depth} blocks, per-block, fwd+bwd",
            chain_step(chain_ours(chain), chain, x, backward=True),
            chain_step(chain_theirs(chain), chain, x, backward=True),
        ),
        (
            f"gpt_like chain {depth} blocks, per-block, fwd only",
            chain_step(chain_ours(chain), chain, x, backward=False),
            chain_step(chain_theirs(chain), chain, x, backward=False),
        ),
        (
            f"selective matmul+attention, gpt_like block x{block_calls}, fwd+bwd",
            block_step(ours("matmul+attention"), block, x, block_calls),
            block_step(theirs(selective=True), block, x, block_calls),
        ),
        (
            f"selective matmul+attention, chain {depth} blocks, fwd+bwd",
            chain_step(chain_ours(chain, "matmul+attention"), chain, x, backward=True),
            chain_step(chain_theirs(chain, selective=True), chain, x, backward=True),
        ),
    ]


def table(rows: list[dict[str, Any]], before: dict[str, dict[str, Any]] | None) -> str:
    head = "| case | revckpt / torch (IQR) |"
    rule = "|---|---|"
    if before is not None:
        head = "| case | before: revckpt / torch (IQR) | after: revckpt / torch (IQR) |"
        rule = "|---|---|---|"
    lines = [head, rule]
    for r in rows:
        cells = [r["case"]]
        if before is not None:
            cells.append(ratio_cell(before[r["case"]]) if r["case"] in before else "-")
        cells.append(ratio_cell(r))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke test")
    parser.add_argument("--repeats", type=int, default=None, help="interleaved timing rounds")
    parser.add_argument(
        "--before", type=Path, default=None, help="JSON of an earlier run, shown as a column"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(__file__).parent / "results" / "bench_call_overhead.json",
        help="where to write the JSON results",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    repeats = args.repeats or (3 if args.quick else 31)
    rows = []
    for name, candidate, baseline in cases(args.quick):
        ratio = time_ratio(candidate, baseline, repeats=repeats, warmup=2)
        rows.append(
            {
                "case": name,
                "time_ratio": ratio.ratio,
                "time_ratio_q25": ratio.q25,
                "time_ratio_q75": ratio.q75,
            }
        )
        print(f"  measured {name}", file=sys.stderr)
    before = None
    if args.before is not None:
        before = {r["case"]: r for r in json.loads(args.before.read_text())["rows"]}
    result = {
        "benchmark": "bench_call_overhead",
        "command": "python benchmarks/bench_call_overhead.py" + (" --quick" if args.quick else ""),
        "config": {"repeats": repeats, "threads": 1, "quick": args.quick},
        "environment": environment(),
        "rows": rows,
    }
    if before is not None:
        result["before"] = list(before.values())
    print(table(rows, before))
    write_json(result, args.out)
    return result


if __name__ == "__main__":
    main()
