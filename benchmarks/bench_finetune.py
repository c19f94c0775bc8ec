"""Fine-tuning a pretrained GPT: loss, activation memory and step time of each variant (issue 17).

A small nanoGPT-style GPT (``_finetune_model.py``) is pretrained on task 1, a synthetic language
of sparse Markov chains (``_finetune_data.py``), and cached under
``benchmarks/results/finetune_cache/``. It is then fine-tuned on task 2, the same language with
half of the tokens' transitions re-drawn, by each variant (``_finetune_variants.py``):

1. fine-tuning: the same steps and batches at each learning rate of a sweep (AdamW); the
   held-out loss of task 2 at the best one, and how far each variant's untrained output is from
   the pretrained model's (0: it keeps the starting point). Per-layer checkpointing is not
   trained (exact recompute): its parameters after a few steps are compared with full FT's;
2. activation memory of one training step (``revckpt.MemoryMeter``, above the parameters,
   gradients and AdamW state, which a warm-up step allocates first), at the cost depths;
3. time per training step, interleaved rounds (``revckpt.time_ratios``), one CPU thread.

The reversible variants plug in as more entries of the variant table
(``_finetune_variants.reversible_variants``). Run ``python benchmarks/bench_finetune.py``
(``--quick`` for a smoke run); it prints a table per part and writes
``benchmarks/results/bench_finetune.json``.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from _common import environment, ratio_cell, write_json  # benchmarks/_common.py
from _finetune_cost import cost_model, memory_rows, time_rows
from _finetune_data import Batch, Language
from _finetune_drift import drift_rows, drift_table
from _finetune_model import GPT
from _finetune_split import split_rows, split_table
from _finetune_train import CACHE_DIR, HELDOUT_SEED, finetune, heldout_loss, pretrain, tasks
from _finetune_variants import (
    SAME_LOSS_AS_BASELINE,
    Variant,
    cost_variants,
    finetune_variants,
    full_finetune,
    instantiate,
    per_layer_checkpoint,
)

import revckpt

OUT = Path(__file__).parent / "results" / "bench_finetune.json"


def start_point(make: Variant, pretrained: GPT, heldout: Sequence[Batch]) -> dict[str, Any]:
    """The untrained variant: its held-out loss, and its largest logit difference from the
    pretrained model's on the first held-out batch."""
    model, params = instantiate(make, pretrained)
    with torch.no_grad():
        ref = pretrained.eval()(heldout[0][0])
        diff = model.eval()(heldout[0][0]) - ref
    return {
        "trainable_params": sum(p.numel() for p in params),
        "start_heldout_loss": heldout_loss(model, heldout),
        "start_max_abs_logit_diff": diff.abs().max().item(),
        "start_relative_logit_diff": (diff.norm() / ref.norm()).item(),
    }


def next_lr(lr: float, up: bool) -> float:
    """The neighbour of ``lr`` on the 1-3-10 grid: 1e-3 -> 3e-3 -> 1e-2 upwards."""
    mantissa = lr / 10 ** math.floor(math.log10(lr))
    step = (3.0 if mantissa < 2 else 10 / 3) if up else (1 / 3 if mantissa > 2 else 0.3)
    return float(f"{lr * step:.0e}")


def lr_sweep(
    train: Callable[[float], dict[str, Any]], lrs: Sequence[float], extend: int = 2
) -> list[dict[str, Any]]:
    """``train(lr)`` at every rate of ``lrs``; then, while the best held-out loss is at an end of
    the rates tried (and at most ``extend`` times), at the next rate beyond that end. The runs
    in increasing learning rate."""
    runs = {lr: train(lr) for lr in lrs}
    for _ in range(extend):
        tried = sorted(runs)
        best = min(tried, key=lambda lr: runs[lr]["final_heldout_loss"])
        if len(tried) < 2 or best not in (tried[0], tried[-1]):
            break
        lr = next_lr(best, up=best == tried[-1])
        runs[lr] = train(lr)
    return [runs[lr] for lr in sorted(runs)]


def sweep(
    variants: Sequence[tuple[str, Variant]],
    pretrained: GPT,
    task: Language,
    heldout: Sequence[Batch],
    *,
    steps: int,
    lrs: Sequence[float],
    batch: int,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """Every variant trained over a learning-rate sweep (:func:`lr_sweep`); its row reports the
    best rate's held-out loss, and every run."""
    rows = []
    for name, make in variants:

        def train(lr: float, make: Variant = make, name: str = name) -> dict[str, Any]:
            model, params = instantiate(make, pretrained, seed)
            kw = dict(steps=steps, lr=lr, batch=batch, seed=seed, heldout=heldout)
            try:
                run = finetune(model, params, task, **kw)
            except revckpt.ReconstructionError as err:  # a diverging run: drift, or off the grid
                print(f"  {name} lr {lr:g}: failed: {str(err)[:120]}", flush=True)
                return {"lr": lr, "final_heldout_loss": float("inf"), "failed": str(err)}
            print(f"  {name} lr {lr:g}: held-out {run['final_heldout_loss']:.4f}", flush=True)
            return run

        runs = lr_sweep(train, lrs)
        best = min(range(len(runs)), key=lambda i: runs[i]["final_heldout_loss"])
        rows.append(
            {
                "variant": name,
                **start_point(make, pretrained, heldout),
                "best_lr": runs[best]["lr"],
                "best_lr_at_edge": best in (0, len(runs) - 1),
                "final_heldout_loss": runs[best]["final_heldout_loss"],
                "final_train_loss": runs[best]["final_train_loss"],
                "runs": runs,
            }
        )
    return rows


def checkpoint_matches(
    pretrained: GPT, task: Language, heldout: Sequence[Batch], *, steps: int, lr: float, batch: int
) -> dict[str, Any]:
    """Per-layer checkpointing against full FT after ``steps`` steps from the same start: the
    largest parameter difference (0: the same training run)."""
    trained = []
    for make in (full_finetune, per_layer_checkpoint):
        model, params = instantiate(make, pretrained)
        finetune(model, params, task, steps=steps, lr=lr, batch=batch, seed=0, heldout=heldout)
        trained.append(list(model.parameters()))
    diff = max((a - b).abs().max().item() for a, b in zip(*trained, strict=True))
    return {"variant": SAME_LOSS_AS_BASELINE, "steps": steps, "lr": lr, "max_abs_param_diff": diff}


def cost_rows(args: argparse.Namespace, variants: Sequence[tuple[str, Variant]]) -> tuple:
    """(memory rows, time rows) at every cost depth."""
    memory, times = [], []
    for depth in args.cost_depths:
        base = cost_model(depth, args.width, args.heads, args.context, args.vocab)
        task1, _ = tasks(args.vocab)
        batch = task1.batches(args.cost_batch, args.context, HELDOUT_SEED + 1, 1)[0]
        memory += memory_rows(variants, base, batch)
        times += time_rows(variants, base, batch, repeats=args.repeats)
        print(f"  measured the cost at depth {depth}", flush=True)
    return memory, times


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f}"


def pretrain_table(record: dict[str, Any]) -> str:
    lines = ["| pretraining step | train loss (10-step mean) |", "|---|---|"]
    lines += [f"| {p['step']} | {p['loss']:.3f} |" for p in record["curve"]]
    return "\n".join(lines)


def finetune_table(rows: list[dict[str, Any]], check: dict[str, Any] | None) -> str:
    lines = [
        "| variant | trainable params | start held-out loss | start logits: relative diff "
        "(max abs) | best lr | held-out loss (best lr) | held-out loss per lr |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        per_lr = ", ".join(f"{run['lr']:g}: {run['final_heldout_loss']:.3f}" for run in r["runs"])
        edge = " (edge)" if r["best_lr_at_edge"] else ""
        lines.append(
            f"| {r['variant']} | {r['trainable_params']:,} | {r['start_heldout_loss']:.4f} | "
            f"{r['start_relative_logit_diff']:.2e} ({r['start_max_abs_logit_diff']:.3g}) | "
            f"{r['best_lr']:g}{edge} | "
            f"{r['final_heldout_loss']:.4f} | {per_lr} |"
        )
    if check is None:
        return "\n".join(lines)
    lines.append(
        f"\n{check['variant']}: not trained in the sweep (exact recompute); after "
        f"{check['steps']} steps at lr {check['lr']:g} its parameters differ from full FT's by "
        f"at most {check['max_abs_param_diff']:.3g}"
    )
    return "\n".join(lines)


def memory_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| depth | variant | step peak MiB (of full FT) | fwd+bwd peak MiB | retained after "
        "forward MiB | params MiB | grads MiB | AdamW state MiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    base = {r["depth"]: r for r in rows if r["variant"] == rows[0]["variant"]}
    for r in rows:
        share = r["step_peak_bytes"] / base[r["depth"]]["step_peak_bytes"]
        lines.append(
            f"| {r['depth']} | {r['variant']} | {_mib(r['step_peak_bytes'])} ({share:.1%}) | "
            f"{_mib(r['fwd_bwd_peak_bytes'])} | {_mib(r['retained_after_forward_bytes'])} | "
            f"{_mib(r['parameter_bytes'])} | {_mib(r['gradient_bytes'])} | "
            f"{_mib(r['optimizer_state_bytes'])} |"
        )
    return "\n".join(lines)


def time_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| depth | variant | step time / full FT (IQR) | median step ms |",
        "|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['depth']} | {r['variant']} | {ratio_cell(r)} | "
            f"{1e3 * r['step_seconds_median']:.1f} |"
        )
    return "\n".join(lines)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke test")
    p.add_argument("--depth", type=int, default=None, help="layers of the fine-tuned model")
    p.add_argument("--width", type=int, default=None)
    p.add_argument("--pretrain-steps", type=int, default=None)
    p.add_argument("--steps", type=int, default=None, help="fine-tuning steps per run")
    p.add_argument("--lrs", type=float, nargs="+", default=None, help="learning-rate sweep")
    p.add_argument("--cost-depths", type=int, nargs="+", default=None)
    p.add_argument("--repeats", type=int, default=None, help="interleaved timing rounds")
    p.add_argument("--drift-depths", type=int, nargs="+", default=None)
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--cache-dir", type=Path, default=CACHE_DIR, help="pretrained models")
    p.add_argument("--out", type=Path, default=OUT, help="where to write the JSON results")
    args = p.parse_args(argv)
    quick = dict(depth=2, width=64, pretrain_steps=150, steps=30, cost_depths=[2, 4], repeats=3)
    quick["drift_depths"] = [2, 4]
    full = dict(depth=6, width=128, pretrain_steps=200, steps=100, cost_depths=[12, 24])
    full["drift_depths"] = [12, 24, 48]
    full["repeats"] = 15
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.lrs = args.lrs or ([1e-3, 3e-3] if args.quick else [3e-4, 1e-3, 3e-3, 1e-2])
    args.heads, args.context, args.vocab = 4, 64, 64
    args.batch, args.cost_batch = (8, 4) if args.quick else (16, 8)
    return args


def pretrained_and_task(args: argparse.Namespace) -> tuple[GPT, Language, list[Batch]]:
    """The pretrained model (cached), task 2 and its held-out batches."""
    pretrained = pretrain(
        args.depth, args.width, args.pretrain_steps, 0, heads=args.heads, context=args.context,
        vocab=args.vocab, cache_dir=args.cache_dir,
    )  # fmt: skip
    _, task2 = tasks(args.vocab)
    return pretrained, task2, task2.batches(args.batch, args.context, HELDOUT_SEED, 4)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    torch.set_num_threads(1)
    start = time.perf_counter()
    pretrained, task2, heldout = pretrained_and_task(args)
    kw = dict(steps=args.steps, lrs=args.lrs, batch=args.batch)
    rows = sweep(finetune_variants(args.lora_rank), pretrained, task2, heldout, **kw)
    check = checkpoint_matches(
        pretrained, task2, heldout, steps=3, lr=args.lrs[0], batch=args.batch
    )
    memory, times = cost_rows(args, cost_variants(args.lora_rank))
    drift = drift_rows(args.drift_depths, args.width, args.cost_batch)
    split = split_rows(pretrained, heldout[0][0], (2**-3, 2**-4, 2**-8))
    config = {k: v for k, v in vars(args).items() if k not in ("out", "cache_dir")}
    result = {
        "benchmark": "bench_finetune",
        "command": "python benchmarks/bench_finetune.py" + (" --quick" if args.quick else ""),
        "config": {**config, "threads": 1, "task2_floor": task2.floor(context=args.context)},
        "environment": environment(),
        "pretraining": pretrained.pretrain_record,
        "finetune": rows,
        "checkpoint_check": check,
        "memory": memory,
        "time": times,
        "drift": drift,
        "attention_f_mlp_g": split,
        "seconds": time.perf_counter() - start,
    }
    print(pretrain_table(pretrained.pretrain_record), end="\n\n")
    print(finetune_table(rows, check), end="\n\n")
    print(memory_table(memory), end="\n\n")
    print(time_table(times), end="\n\n")
    print(drift_table(drift), end="\n\n")
    print(split_table(split))
    write_json(result, args.out)
    return result


if __name__ == "__main__":
    main()
