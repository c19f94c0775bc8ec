"""Reversible adapters against LoRA at matched trainable parameters (issue 17's loss goal).

``bench_finetune.py`` fine-tunes the same pretrained GPT with ``make_reversible``'s adapters
only (rank 8: 22,528 trainable parameters) and with LoRA rank 8 (98,304), and both stay far
from full fine-tuning's loss. This asks whether the gap is the reversible stack's or the
parameter budget's: ``make_reversible(..., trainable="adapters", rank=r)`` for each
``--adapter-ranks`` against LoRA (``_finetune_model.add_lora``) for each ``--lora-ranks``,
where adapter rank 8 has about LoRA rank 2's parameters and adapter rank 32 about LoRA rank
8's on this model (width 128: an adapter pair costs ``4 * 128 * r`` per layer, LoRA on the
four linear layers ``16 * 128 * r``).

Everything else is ``bench_finetune.py``'s fine-tuning part: its cached pretrained model, task
2, the same steps, batches and learning-rate sweep (extended along the 1-3-10 grid while the
best rate is at an end), the held-out loss at the best rate; full fine-tuning is measured too,
for the reference. Run ``python benchmarks/finetune_ranks.py`` (about 8 minutes on one thread;
``--quick``: a smoke run); prints a table and writes ``benchmarks/results/finetune_ranks.json``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch
from _common import environment, write_json  # benchmarks/_common.py
from _finetune_model import GPT
from _finetune_variants import BASELINE, Variant, full_finetune, lora
from bench_finetune import finetune_table, parse, pretrained_and_task, sweep

import revckpt

OUT = Path(__file__).parent / "results" / "finetune_ranks.json"


def adapters(rank: int) -> Variant:
    """``make_reversible`` at its defaults with adapters of ``rank``, only they trainable."""

    def make(model: GPT) -> tuple[torch.nn.Module, list[torch.nn.Parameter]]:
        model.requires_grad_(False)  # the embeddings and head too, as for LoRA
        revckpt.make_reversible(model, blocks="blocks", trainable="adapters", rank=rank)
        return model, [p for p in model.parameters() if p.requires_grad]

    return make


def variants(adapter_ranks: list[int], lora_ranks: list[int]) -> list[tuple[str, Variant]]:
    return [
        (BASELINE, full_finetune),
        *((f"reversible layer_f, adapters r={r}", adapters(r)) for r in adapter_ranks),
        *((f"LoRA r={r}", lora(r)) for r in lora_ranks),
    ]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke test")
    p.add_argument("--adapter-ranks", type=int, nargs="+", default=[8, 32])
    p.add_argument("--lora-ranks", type=int, nargs="+", default=[2, 8])
    p.add_argument("--out", type=Path, default=OUT)
    own = p.parse_args(argv)
    args = parse(["--quick"] if own.quick else [])  # bench_finetune's sizes and sweep
    torch.set_num_threads(1)
    start = time.perf_counter()
    pretrained, task2, heldout = pretrained_and_task(args)
    rows = sweep(
        variants(own.adapter_ranks, own.lora_ranks),
        pretrained,
        task2,
        heldout,
        steps=args.steps,
        lrs=args.lrs,
        batch=args.batch,
    )
    result = {
        "benchmark": "finetune_ranks",
        "command": "python benchmarks/finetune_ranks.py" + (" --quick" if own.quick else ""),
        "config": {
            "depth": args.depth,
            "width": args.width,
            "steps": args.steps,
            "lrs": args.lrs,
            "batch": args.batch,
            "adapter_ranks": own.adapter_ranks,
            "lora_ranks": own.lora_ranks,
            "threads": 1,
        },
        "environment": environment(),
        "finetune": rows,
        "seconds": time.perf_counter() - start,
    }
    print(finetune_table(rows, None))
    write_json(result, own.out)
    return result


if __name__ == "__main__":
    main()
