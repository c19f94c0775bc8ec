"""``revckpt demo``: every strategy measured on a built-in GPT-like model, a report written."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from .._numbers import mib
from ..errors import RevckptError
from .terminal import _CPU_SCOPE, _Progress
from .usage import _add_command, _positive_int, _UsageError

DEMO_SIZES = {
    # depth, dim, heads, batch, sequence
    "tiny": (2, 32, 2, 2, 16),  # seconds: a smoke test
    # about 20 s on 2 CPU cores
    "cpu": (12, 128, 4, 4, 128),
    # a GPU-sized model
    "gpu": (24, 1024, 16, 8, 1024),
}


def _add_demo(sub: Any) -> None:
    """The ``demo`` subcommand and its options."""
    demo = _add_command(
        sub,
        "demo",
        _demo,
        summary="measure every strategy on a built-in GPT-like model",
        description="Measure store, checkpoint (per block, sqrt), approx (bf16, e4m3), reversible "
        "and the scheduler's plan on a built-in GPT-like model: peak and retained memory, time "
        "against store-all, gradient error against float64. Writes report.json, plan.json and two "
        "PNG plots to --out.",
    )
    demo.add_argument("--out", default="revckpt-demo", help="output folder (default: %(default)s)")
    demo.add_argument(
        "--budget",
        default=None,
        help="the scheduler's memory budget: bytes, '2GiB', or a fraction of the store-all "
        "peak (default: 0.3; 0.7 for --size tiny, whose two blocks cannot go lower)",
    )
    demo.add_argument("--error-budget", type=float, default=1e-2, help="default: %(default)s")
    demo.add_argument("--device", default="cpu", help="cpu or cuda (default: %(default)s)")
    demo.add_argument(
        "--size", choices=sorted(DEMO_SIZES), help="model size (default: cpu, or gpu on CUDA)"
    )
    demo.add_argument("--repeats", type=_positive_int, default=5, help="timing rounds (default: 5)")
    demo.add_argument(
        "--threads",
        type=_positive_int,
        default=1,
        help="CPU threads for torch (default: %(default)s)",
    )
    demo.add_argument("--no-progress", action="store_true", help="no progress bar")


def _demo(args: argparse.Namespace) -> int:
    import torch

    from .. import schedule
    from ..models import gpt_like

    device = _demo_device(args.device)
    size = args.size or ("gpu" if device.type == "cuda" else "cpu")
    if args.budget is None:
        args.budget = "0.7" if size == "tiny" else "0.3"
    _demo_check_budgets(args)
    depth, dim, heads, batch, seq = DEMO_SIZES[size]
    out = _demo_folder(args.out)
    torch.manual_seed(0)
    if device.type == "cpu":
        _quiet_cpu(args.threads)
    progress = _Progress(6, enabled=not args.no_progress and sys.stderr.isatty())

    progress.step(f"building a GPT-like model ({depth} blocks, dim {dim})")
    chain = gpt_like(depth, dim, heads).to(device)
    x = torch.randn(batch, seq, dim, device=device)

    progress.step("profiling every block")
    prof = schedule.profile(chain, x, repeats=args.repeats)
    budget = schedule.parse_budget(
        args.budget, schedule.baseline(prof, "store").predicted_peak_bytes
    )
    progress.step(f"solving for {mib(budget, 1)}, error <= {args.error_budget:g}")
    verified = _demo_verify(args, chain, x, prof, budget, progress)
    rep = _demo_report(verified)

    progress.step("measuring a reversible GPT-like model of the same size")
    rev = _demo_reversible(args, (depth, dim, heads), x, len(prof.blocks))

    progress.step("writing the report")
    model = {"depth": depth, "dim": dim, "heads": heads, "input": [batch, seq, dim]}
    data = _demo_data(args, rep, rev, verified, model=model, device=device, budget=budget)
    plots = _demo_write(out, data, rep, verified.plan)
    progress.finish()

    print(_demo_table(rep, rev, device.type))
    print()
    print(f"verify: {verified.note}.")
    print()
    print(verified.plan.table())
    print()
    written = ["report.json", "plan.json", *(p.name for p in plots)]
    print(f"wrote {', '.join(written)} to {out.resolve()}")
    return 0


def _demo_check_budgets(args: argparse.Namespace) -> None:
    """``--budget``'s syntax and ``--error-budget``, checked before the model is profiled."""
    import math

    from ..errors import RevckptError
    from ..schedule.budget import UNKNOWN_PEAK, parse_budget

    try:
        parse_budget(args.budget, UNKNOWN_PEAK)
    except RevckptError as err:
        raise _UsageError(f"--budget {args.budget}: {err}") from err
    if not (math.isfinite(args.error_budget) and args.error_budget >= 0):
        raise _UsageError(f"--error-budget {args.error_budget}: pass a number >= 0 (e.g. 1e-2)")


def _demo_folder(path: str) -> Path:
    """``--out``, created."""
    out = Path(path)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise _UsageError(
            f"--out {path}: cannot create the folder ({err.strerror}); give a folder path"
        ) from err
    return out


def _quiet_cpu(threads: int) -> None:
    """CPU timings that compare strategies rather than the machine's noise."""
    import torch

    # one thread by default: the timings compare strategies, and intra-op threads on small
    # tensors (or a busy machine) make them slow and noisy
    torch.set_num_threads(threads)
    # freed blocks stay in the process (as with CUDA's caching allocator): without it,
    # glibc's page faults make step times depend on the step before (measure/host.py)
    from ..measure import keep_freed_memory

    keep_freed_memory()


def _demo_verify(
    args: argparse.Namespace, chain: Any, x: Any, prof: Any, budget: int, progress: _Progress
) -> Any:
    """The solved plan and the fixed recipes, measured by :func:`~revckpt.schedule.verify`."""
    from ..schedule import Segment, baseline, make_plan, solve, verify

    n = len(prof.blocks)
    plans = [
        dataclasses.replace(baseline(prof, "per-block"), name="checkpoint per block"),
        dataclasses.replace(baseline(prof, "sqrt"), name="checkpoint sqrt"),
        make_plan(prof, [Segment(i, i + 1, "approx:bf16") for i in range(n)], name="approx bf16"),
        make_plan(prof, [Segment(i, i + 1, "approx:e4m3") for i in range(n)], name="approx e4m3"),
    ]
    try:
        solved = solve(prof, memory_budget=budget, error_budget=args.error_budget)
    except RevckptError as err:
        raise _UsageError(f"--budget {args.budget}: {err}") from err

    # the plans shown are measured with the recipes verify tries, in one interleaved run; the
    # scheduler's row is the fastest plan that fits both budgets by measurement
    progress.step("measuring the plans and the recipes (memory, time, gradient error)")
    try:
        return verify(
            chain,
            x,
            dataclasses.replace(solved, name=SCHEDULER),
            prof,
            also=plans,
            repeats=args.repeats,
        )
    except RevckptError as err:
        raise _UsageError(f"--budget {args.budget}: {err}") from err


def _demo_reversible(args: argparse.Namespace, shape: tuple[int, int, int], x: Any, n: int) -> Any:
    """The report of a reversible GPT-like model of the same depth, width and heads."""
    from ..models import rev_gpt_like
    from ..report import report
    from ..schedule import Segment, make_plan, profile

    rev_chain = rev_gpt_like(*shape).to(x.device)
    rev_prof = profile(rev_chain, x, codecs=(), policies=(), repeats=args.repeats)
    rev_plan = make_plan(rev_prof, [Segment(0, n, "reversible")], name="reversible")
    return report(rev_chain, x, [rev_plan], chosen=None, repeats=args.repeats)


def _demo_data(
    args: argparse.Namespace,
    rep: Any,
    rev: Any,
    verified: Any,
    *,
    model: dict[str, Any],
    device: Any,
    budget: int,
) -> dict[str, Any]:
    """``report.json``'s content (format ``revckpt.Demo/1``)."""
    import torch

    rows = [
        {**dataclasses.asdict(r), "over_error_budget": rep.over_error_budget(r.name)}
        for r in rep.rows
    ]
    rev_row = dataclasses.asdict(rev.row("reversible"))
    rev_row["name"] = "reversible (RevGPT variant)"
    rev_row["note"] = (
        "a different model (reversible blocks, same depth and width); peak and time are "
        "relative to that model's own store-all"
    )
    rev_row["fraction_of_own_store_all"] = (
        rev.row("reversible").measured_peak_bytes / rev.store_all_peak_bytes
    )
    return {
        "format": "revckpt.Demo/1",
        "model": model,
        "device": str(device),
        "torch": torch.__version__,
        "budget_bytes": budget,
        "error_budget": args.error_budget,
        "store_all_peak_bytes": rep.store_all_peak_bytes,
        "rows": rows,
        "reversible": rev_row,
        "plan": verified.plan.to_dict(),
        "verify": {
            "note": verified.note,
            "replaced": verified.replaced,
            "solved": verified.solved.to_dict(),
            "pareto": rep.pareto(),
        },
    }


def _demo_write(out: Path, data: dict[str, Any], rep: Any, chosen: Any) -> list[Path]:
    """``report.json``, ``plan.json`` and the plots (when matplotlib is there) in ``out``."""
    from ..report import _finite

    (out / "report.json").write_text(json.dumps(_finite(data), indent=2) + "\n")
    chosen.to_json(out / "plan.json")
    plots = []
    try:
        plots.append(rep.plot(out / "memory_vs_overhead.png", title="GPT-like: memory vs time"))
        plots.append(rep.plot_errors(out / "gradient_error.png", title="gradient error per plan"))
    except RevckptError as err:  # matplotlib missing
        print(f"note: no plots: {err}", file=sys.stderr)
    return plots


SCHEDULER = "scheduler"
REPLACED = "solved plan (replaced)"


def _demo_report(verified: Any) -> Any:
    """The demo's rows: what :func:`~revckpt.schedule.verify` measured, with the
    ``"scheduler"`` row the plan it returned (a copy of that plan's row when it replaced the
    solved plan, which is then shown as ``"solved plan (replaced)"``)."""
    rep = verified.report
    rows = [r for r in rep.rows if r.name != SCHEDULER]
    if verified.replaced:
        rows.append(dataclasses.replace(rep.row(SCHEDULER), name=REPLACED))
    budget = verified.solved.memory_budget_bytes
    rows.append(
        dataclasses.replace(
            verified.measured,
            name=SCHEDULER,
            strategies=tuple(verified.plan.strategies),
            memory_budget_bytes=budget,
        )
    )
    return dataclasses.replace(rep, rows=tuple(rows), chosen=SCHEDULER)


def _demo_device(name: str) -> Any:
    import torch

    try:
        device = torch.device(name)
    except RuntimeError as err:
        raise _UsageError(f"--device {name}: not a device; use --device cpu or cuda") from err
    if device.type not in ("cpu", "cuda"):
        raise _UsageError(f"--device {name}: the demo runs on cpu or cuda; use one of them")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise _UsageError("--device cuda: CUDA is not available here; use --device cpu")
    return device


def _demo_table(rep: Any, rev: Any, device_type: str) -> str:
    base = rep.store_all_peak_bytes
    lines = [
        "| strategy | peak MiB | % of store-all | retained MiB | time vs store-all | "
        "gradient error vs float64 |",
        "|---|---|---|---|---|---|",
    ]
    for r in rep.rows:
        mark = " *" if r.name == rep.chosen else ""
        mark += " (over the error budget)" if rep.over_error_budget(r.name) else ""
        lines.append(
            f"| {r.name}{mark} | {mib(r.measured_peak_bytes, unit=False)} | "
            f"{r.measured_peak_bytes / base:.1%} | {mib(r.measured_retained_bytes, unit=False)} | "
            f"{r.time_ratio:.2f} | {r.gradient_error:.1e} |"
        )
    r = rev.row("reversible")
    lines.append(
        f"| reversible (RevGPT variant) | {mib(r.measured_peak_bytes, unit=False)} | "
        f"{r.measured_peak_bytes / rev.store_all_peak_bytes:.1%} of its own | "
        f"{mib(r.measured_retained_bytes, unit=False)} | {r.time_ratio:.2f} | "
        f"{r.gradient_error:.1e} |"
    )
    over = (
        f" Over the error budget: a measured gradient error above {rep.error_budget:g} (plus "
        "twice store-all's float32 round-off); such plans are never chosen and not compared."
        if rep.error_budget is not None
        else ""
    )
    lines.append(
        "\n* the scheduler's plan: the solved plan, or the fastest measured plan that fits both "
        "budgets if one beat it (revckpt.schedule.verify). Peak: one training step "
        "(MemoryMeter); retained: kept between forward and backward; time: median of "
        "interleaved rounds against store-all." + over + " The RevGPT variant is another "
        "model, relative to its own store-all." + (_CPU_SCOPE if device_type == "cpu" else "")
    )
    return "\n".join(lines)
