"""``revckpt.fit`` on whole models nobody here wrote: the test zoo's seven models (``tests/zoo.py``:
Hugging Face GPT-2, Llama, Qwen2 and BERT from tiny configs, a nanoGPT-style GPT,
``nn.TransformerEncoder`` with a padding mask, a small ResNet with BatchNorm).

For each model, at batch 8 x 64 tokens (ResNet: 16 images of 32 x 32), the rows are

* ``store-all``: the model as it is;
* ``per-layer checkpoint``: Hugging Face's own ``gradient_checkpointing_enable`` (non-reentrant)
  on the Hugging Face models, ``revckpt.convert(model, "checkpoint")`` on every model;
* ``fit 50%``, ``fit 25%``, ``fit 10%``: ``revckpt.fit(model, batch, memory_budget=...)``; where
  a budget is infeasible, the :class:`~revckpt.InfeasibleBudgetError`'s smallest budget is
  reported and the model is fitted at that smallest budget instead;
* ``fit 25%, error 1e-2``: the same with ``error_budget=1e-2`` (approx boundaries allowed).

Columns: the measured peak of the whole training step (forward, loss, backward) with
``MemoryMeter("cpu")`` around it, parameter gradients ``None`` before the step; the plan's
predicted peak and measured / predicted (store-all: the plans' predicted store-all peak); time
of a step against store-all (every row's step run once per round in one rotated round-robin,
``revckpt.time_ratios``, median and interquartile range, one thread); the time the plan
predicted (1 + ``Plan.predicted_overhead``, of the whole step); the wall time of
``fit`` in plain training steps (fit seconds / median store-all step seconds) and in steps as
a user's loop runs them (the plain step, an AdamW step and ``zero_grad()``; its time against
the plain step's from ``revckpt.time_ratio``, A/B interleaved); the gradient
error against store-all's gradients (relative Frobenius norm over all parameters). On the
Hugging Face models a last row times the two per-layer checkpoints head to head
(``revckpt.time_ratio``, A/B interleaved).

A fit that raises (other than an infeasible budget) is listed with its error instead of
ending the run. The global RNG is seeded before every fit (with an error budget, the plan was
seen to depend on it).

Run ``python benchmarks/bench_models.py`` (a few minutes on 2 CPU cores; ``--quick`` for a smoke
run on small batches); prints a Markdown table and writes
``benchmarks/results/bench_models.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _common import environment, ratio_cell, write_json  # benchmarks/_common.py
from torch import nn

import revckpt
from revckpt import InfeasibleBudgetError, MemoryMeter, RevckptError, time_ratio, time_ratios

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "tests") not in sys.path:
    sys.path.append(str(ROOT / "tests"))  # the model zoo, tests/zoo.py
import zoo  # noqa: E402

NAMES = ("gpt2", "llama", "qwen2", "bert", "nanogpt", "encoder", "resnet")
SIZES = {name: (8, 64) for name in NAMES} | {"resnet": (16, 32)}
QUICK_SIZES = {name: (4, 32) for name in NAMES} | {"resnet": (4, 16)}
QUICK_NAMES = ("gpt2", "nanogpt", "encoder", "resnet")
HF_ROW = "per-layer checkpoint (HF gradient_checkpointing_enable)"
CONVERT_ROW = "per-layer checkpoint (revckpt.convert)"
# (row name, memory budget, error budget)
FITS = (
    ("fit 50%", "50%", 0.0),
    ("fit 25%", "25%", 0.0),
    ("fit 10%", "10%", 0.0),
    ("fit 25%, error 1e-2", "25%", 1e-2),
)


def _run_step(model: nn.Module, example: Any, loss_fn: Any) -> Callable[[], None]:
    params = list(model.parameters())

    def step() -> None:
        for p in params:
            p.grad = None  # as after optimizer.zero_grad(): the step creates the gradients
        zoo.step(model, example, loss_fn)

    return step


def _user_step(model: nn.Module, step: Callable[[], None]) -> Callable[[], None]:
    """``step`` (forward, loss, backward) followed by an AdamW step and ``zero_grad()``, as a
    user's training loop runs it."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def user() -> None:
        step()
        opt.step()
        opt.zero_grad()

    return user


def _measured(step: Callable[[], None]) -> int:
    with MemoryMeter("cpu") as meter:
        step()
    return meter.peak_bytes


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _grad_error(model: nn.Module, reference: dict[str, torch.Tensor]) -> float:
    grads = _grads(model)
    if grads.keys() != reference.keys():
        return math.inf
    num = sum(float((grads[n] - g).double().norm() ** 2) for n, g in reference.items())
    den = sum(float(g.double().norm() ** 2) for g in reference.values())
    return (num / den) ** 0.5


def _plan_cell(plan: revckpt.schedule.Plan) -> str:
    """``0-2 checkpoint, 3 store``: runs of one-block segments of one strategy by block index;
    a segment of several blocks in brackets: ``[0-2] checkpoint`` (one recompute for all)."""
    parts: list[list[Any]] = []  # [first, last, strategy, one segment of several blocks]
    for s in plan.segments:
        strategy, several = str(s.strategy), s.stop - s.start > 1
        last = parts[-1] if parts else None
        if last is not None and not several and not last[3] and last[2] == strategy:
            last[1] = s.start
        else:
            parts.append([s.start, s.stop - 1, strategy, several])
    cells = []
    for first, last, strategy, several in parts:
        span = f"{first}" if first == last else f"{first}-{last}"
        cells.append(f"[{span}] {strategy}" if several else f"{span} {strategy}")
    return ", ".join(cells)


def _fit(model: nn.Module, example: Any, case: zoo.Case, budget: str, error: float) -> dict:
    """Fit at ``budget``; where infeasible, at the error's smallest budget. A fit that fails
    otherwise is recorded (``failed``: the error) rather than ending the run."""
    out: dict[str, Any] = {"requested_budget": budget, "infeasible": False}
    torch.manual_seed(0)  # with an error budget, fit's plan depends on the global RNG state
    start = time.perf_counter()
    try:
        try:
            plan = revckpt.fit(
                model, example, memory_budget=budget, error_budget=error, loss_fn=case.loss_fn
            )
        except InfeasibleBudgetError as err:
            out.update(
                infeasible=True,
                smallest_budget_bytes=err.smallest_budget_bytes,
                infeasible_fit_seconds=time.perf_counter() - start,
            )
            torch.manual_seed(0)
            start = time.perf_counter()
            plan = revckpt.fit(
                model,
                example,
                memory_budget=err.smallest_budget_bytes,
                error_budget=error,
                loss_fn=case.loss_fn,
            )
    except RevckptError as err:
        out["failed"] = f"{type(err).__name__}: {err}"
        return out
    out.update(
        fit_seconds=time.perf_counter() - start,
        budget_bytes=plan.memory_budget_bytes,
        predicted_peak_bytes=plan.predicted_peak_bytes,
        store_all_predicted_peak_bytes=plan.store_all_peak_bytes,
        predicted_error=plan.predicted_error,
        predicted_overhead=plan.predicted_overhead,
        segments=[[s.start, s.stop, str(s.strategy)] for s in plan.segments],
        plan_cell=_plan_cell(plan),
    )
    return out


def run_model(name: str, batch: int, seq: int, args: argparse.Namespace) -> dict[str, Any]:
    case = zoo.CASES[name]
    example = case.make_example(batch, seq)
    rows: list[dict[str, Any]] = []  # measured and timed
    failed: list[dict[str, Any]] = []  # fits that raised
    steps: dict[str, Callable[[], None]] = {}
    models: list[nn.Module] = []

    def add(variant: str, model: nn.Module, extra: dict[str, Any]) -> None:
        step = _run_step(model, example, case.loss_fn)
        peak = _measured(step)
        row = {"variant": variant, "measured_peak_bytes": peak, **extra}
        rows.append(row)
        steps[variant] = step
        models.append(model)

    plain = case.make_model()
    add("store-all", plain, {})
    reference = _grads(plain)
    if name in zoo.HF_CASES:
        hf = case.make_model()
        hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        add(HF_ROW, hf, {})
    converted = case.make_model()
    n_blocks = len(revckpt.convert(converted, "checkpoint"))
    add(CONVERT_ROW, converted, {})
    for variant, budget, error in FITS:
        model = case.make_model()
        fitted = _fit(model, example, case, budget, error)
        if fitted["infeasible"]:
            variant += " -> smallest"
        if "failed" in fitted:
            failed.append({"variant": variant, **fitted})
            print(f"{name}, {variant}: {fitted['failed']}")
        else:
            add(variant, model, fitted)
    for row, model in zip(rows, models, strict=True):
        row["gradient_error"] = _grad_error(model, reference)
    ratios = time_ratios(steps, baseline="store-all", repeats=args.repeats, warmup=args.warmup)
    head_to_head = None
    if HF_ROW in steps:  # the two per-layer checkpoints against each other, A/B interleaved
        r = time_ratio(steps[CONVERT_ROW], steps[HF_ROW], repeats=args.repeats, warmup=args.warmup)
        head_to_head = {
            "variant": "head-to-head: revckpt.convert / HF gradient checkpointing",
            "time_ratio": r.ratio,
            "time_ratio_q25": r.q25,
            "time_ratio_q75": r.q75,
        }
    plain_seconds = ratios["store-all"].baseline_seconds
    # a training step as a user's loop runs it (the plain step, an AdamW step, zero_grad()),
    # timed against the plain step: fit's cost in those steps too
    user = time_ratio(
        _user_step(plain, steps["store-all"]),
        steps["store-all"],
        repeats=args.repeats,
        warmup=args.warmup,
    )
    user_seconds = plain_seconds * user.ratio
    store_peak = rows[0]["measured_peak_bytes"]
    predicted_store = next(
        (
            r["store_all_predicted_peak_bytes"]
            for r in rows
            if "store_all_predicted_peak_bytes" in r
        ),
        None,
    )
    rows[0]["predicted_peak_bytes"] = predicted_store
    for row in rows:
        r = ratios[row["variant"]]
        row.update(
            time_ratio=r.ratio,
            time_ratio_q25=r.q25,
            time_ratio_q75=r.q75,
            step_seconds=r.candidate_seconds,
            fraction_of_store_all=row["measured_peak_bytes"] / store_peak,
        )
        if row.get("predicted_peak_bytes") is not None:
            row["measured_over_predicted"] = (
                row["measured_peak_bytes"] / row["predicted_peak_bytes"]
            )
        if "budget_bytes" in row:
            row["within_budget"] = row["measured_peak_bytes"] <= row["budget_bytes"]
        if "fit_seconds" in row:
            row["fit_steps"] = row["fit_seconds"] / plain_seconds
            row["fit_user_steps"] = row["fit_seconds"] / user_seconds
    return {
        "model": name,
        "size": [batch, seq],
        "blocks": n_blocks,
        "parameters": sum(p.numel() for p in plain.parameters()),
        "store_all_measured_peak_bytes": store_peak,
        "store_all_step_seconds": plain_seconds,
        "user_step_ratio": user.ratio,  # the user's step (with AdamW) over the plain step
        "rows": rows,
        "failed": failed,
        "head_to_head": head_to_head,
    }


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.2f}"


def table(result: dict[str, Any]) -> str:
    out = [
        "| model | variant | measured peak MiB (of store-all) | predicted MiB | "
        "measured/predicted | time vs store-all (IQR) | predicted time | fit time (steps / "
        "user steps) | "
        "grad error | plan |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m in result["models"]:
        for r in m["rows"]:
            variant = r["variant"]
            if r.get("infeasible"):
                smallest = r["smallest_budget_bytes"]
                share = smallest / m["store_all_measured_peak_bytes"]
                variant = (
                    f"{variant} ({r['requested_budget']} infeasible; smallest "
                    f"{smallest / 2**20:.2f} MiB = {share:.1%})"
                )
            ratio = r.get("measured_over_predicted")
            over = "-" if ratio is None else f"{ratio:.3f}" + ("" if ratio <= 1 else " (ABOVE)")
            if r.get("within_budget") is False:
                over += " OVER BUDGET"
            fit = "-"
            if "fit_steps" in r:
                user = r.get("fit_user_steps")  # not in results written before it
                fit = f"{r['fit_steps']:.1f} / " + ("-" if user is None else f"{user:.1f}")
            err = r["gradient_error"]
            err_cell = "0" if err == 0 else f"{err:.1e}"
            overhead = r.get("predicted_overhead")
            predicted = "-" if overhead is None else f"{1 + overhead:.3f}"
            out.append(
                f"| {m['model']} | {variant} | {_mib(r['measured_peak_bytes'])} "
                f"({r['fraction_of_store_all']:.1%}) | {_mib(r.get('predicted_peak_bytes'))} | "
                f"{over} | {ratio_cell(r)} | {predicted} | {fit} | {err_cell} | "
                f"{r.get('plan_cell', '')} |"
            )
        for r in m["failed"]:
            smallest = r.get("smallest_budget_bytes")
            note = "" if smallest is None else f"{r['requested_budget']} infeasible; smallest "
            note += "" if smallest is None else f"{smallest / 2**20:.2f} MiB; "
            out.append(
                f"| {m['model']} | {r['variant']} ({note}fit at it FAILED) | | | | | | | | "
                f"{r['failed'][:90]} |"
            )
        if m["head_to_head"] is not None:
            h = m["head_to_head"]
            out.append(f"| {m['model']} | {h['variant']} | | | | {ratio_cell(h)} | | | | |")
    return "\n".join(out)


def time_model(result: dict[str, Any]) -> str:
    """How the fitted plans' predicted overheads compare with the measured ones: within 15%
    (or 0.03 of a step) of the measured overhead, and the median and worst relative error."""
    pairs = [
        (r["predicted_overhead"], r["time_ratio"] - 1)
        for m in result["models"]
        for r in m["rows"]
        if r.get("predicted_overhead") is not None and r["time_ratio"] > 1
    ]
    if not pairs:
        return "time model: no fitted plan with an overhead"
    errors = sorted(abs(p - t) / t for p, t in pairs)
    within = sum(abs(p - t) <= max(0.15 * t, 0.03) for p, t in pairs)
    return (
        f"time model: predicted overhead within 15% (or 0.03) of the measured for {within} of "
        f"{len(pairs)} fitted plans; relative error median {statistics.median(errors):.1%}, "
        f"worst {errors[-1]:.1%}"
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small batches, four models")
    parser.add_argument("--models", nargs="+", choices=NAMES, help="default: all seven")
    parser.add_argument("--repeats", type=int, default=21, help="timing rounds")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "bench_models.json"
    )
    parser.add_argument("--table-from", type=Path, help="print the tables of a saved JSON")
    args = parser.parse_args(argv)
    if args.table_from is not None:
        saved = json.loads(args.table_from.read_text())
        print(table(saved) + "\n\n" + time_model(saved))
        return saved
    torch.set_num_threads(1)
    names = args.models or (QUICK_NAMES if args.quick else NAMES)
    try:
        import transformers  # noqa: F401
    except ImportError:
        skipped = [n for n in names if n in zoo.HF_CASES]
        names = [n for n in names if n not in zoo.HF_CASES]
        print(f"transformers not installed: skipped {skipped}")
    sizes = QUICK_SIZES if args.quick else SIZES
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)  # gradient_checkpointing_enable
    started = time.perf_counter()
    models = []
    for name in names:
        models.append(run_model(name, *sizes[name], args))
        print(f"{name}: done ({time.perf_counter() - started:.0f} s)", flush=True)
    result = {
        "benchmark": "bench_models",
        "command": "python benchmarks/bench_models.py" + (" --quick" if args.quick else ""),
        "date": time.strftime("%Y-%m-%d"),
        "environment": environment(),
        "threads": torch.get_num_threads(),
        "repeats": args.repeats,
        "models": models,
    }
    print(table(result) + "\n\n" + time_model(result))
    write_json(result, args.out)
    return result


if __name__ == "__main__":
    main()
