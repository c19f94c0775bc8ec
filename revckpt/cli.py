"""The ``revckpt`` command: ``demo``, ``plan`` and ``bench``.

``revckpt demo`` measures every strategy on a built-in GPT-like model and writes a report;
``revckpt plan MODULE:FACTORY --budget 2GiB`` plans for your own model (a whole model with
:func:`revckpt.fit` when the factory returns ``(model, example[, loss_fn])``, a chain of blocks
with :func:`revckpt.schedule.profile` and ``solve`` when it returns ``(blocks, example_input[,
kwargs])``); ``revckpt bench`` runs the benchmark scripts of a source checkout. Bad input ends
with one line on stderr that says what to do, and exit status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

from .errors import RevckptError

__all__ = ["main"]

EXIT_USAGE = 2


class _UsageError(Exception):
    """Bad command-line input: reported on one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        if message.startswith("unrecognized arguments") and any(
            unit in message.split(":", 1)[1].split() for unit in _UNIT_WORDS
        ):
            message += "; quote values that contain spaces, e.g. --budget '2 GiB'"
        raise _UsageError(f"{message} (see '{self.prog} --help')")


_UNIT_WORDS = ("B", "KB", "MB", "GB", "TB", "KiB", "MiB", "GiB", "TiB", "%")


def _positive_int(text: str) -> int:
    """An argparse type: an integer of at least 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number of at least 1, got {text!r}")
    return value


_OPEN_LINE = [False]  # a progress bar left the cursor mid-line on stderr


class _Progress:
    """A one-line progress bar on stderr: ``[#####-----] 3/6 profiling``."""

    def __init__(self, total: int, *, enabled: bool = True, width: int = 24) -> None:
        self.total, self.done, self.width = total, 0, width
        self.enabled = enabled
        self.start = time.perf_counter()

    def step(self, label: str) -> None:
        if not self.enabled:
            return
        filled = self.width * self.done // self.total
        bar = "#" * filled + "-" * (self.width - filled)
        elapsed = time.perf_counter() - self.start
        sys.stderr.write(f"\r[{bar}] {self.done}/{self.total} {label:<52} {elapsed:5.0f} s")
        sys.stderr.flush()
        _OPEN_LINE[0] = True
        self.done += 1

    def finish(self) -> None:
        if self.enabled:
            elapsed = time.perf_counter() - self.start
            bar = "#" * self.width
            sys.stderr.write(f"\r[{bar}] {self.total}/{self.total} {'done':<52} {elapsed:5.0f} s\n")
            sys.stderr.flush()
            _OPEN_LINE[0] = False


# -- demo ----------------------------------------------------------------------------------

DEMO_SIZES = {
    # depth, dim, heads, batch, sequence
    "tiny": (2, 32, 2, 2, 16),  # seconds: a smoke test
    # about 20 s on 2 CPU cores
    "cpu": (12, 128, 4, 4, 128),
    # a GPU-sized model
    "gpu": (24, 1024, 16, 8, 1024),
}


def _demo(args: argparse.Namespace) -> int:
    import torch

    from .models import gpt_like, rev_gpt_like
    from .report import report
    from .schedule import Segment, baseline, make_plan, parse_budget, profile, solve, verify

    device = _demo_device(args.device)
    parse_budget(args.budget, 1)  # its syntax, checked before the model is profiled
    size = args.size or ("gpu" if device.type == "cuda" else "cpu")
    depth, dim, heads, batch, seq = DEMO_SIZES[size]
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise _UsageError(
            f"--out {args.out}: cannot create the folder ({err.strerror}); give a folder path"
        ) from err
    torch.manual_seed(0)
    if device.type == "cpu":
        # one thread by default: the timings compare strategies, and intra-op threads on small
        # tensors (or a busy machine) make them slow and noisy
        torch.set_num_threads(args.threads)
        # freed blocks stay in the process (as with CUDA's caching allocator): without it,
        # glibc's page faults make step times depend on the step before (measure/host.py)
        from .measure import keep_freed_memory

        keep_freed_memory()
    progress = _Progress(6, enabled=not args.no_progress and sys.stderr.isatty())

    progress.step(f"building a GPT-like model ({depth} blocks, dim {dim})")
    chain = gpt_like(depth, dim, heads).to(device)
    x = torch.randn(batch, seq, dim, device=device)

    progress.step("profiling every block")
    prof = profile(chain, x, repeats=args.repeats)
    store_peak = baseline(prof, "store").predicted_peak_bytes
    budget = parse_budget(args.budget, store_peak)

    progress.step(f"solving for {budget / 2**20:.1f} MiB, error <= {args.error_budget:g}")
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
        verified = verify(
            chain,
            x,
            dataclasses.replace(solved, name=SCHEDULER),
            prof,
            also=plans,
            repeats=args.repeats,
        )
    except RevckptError as err:
        raise _UsageError(f"--budget {args.budget}: {err}") from err
    rep = _demo_report(verified)
    chosen = verified.plan

    progress.step("measuring a reversible GPT-like model of the same size")
    rev_chain = rev_gpt_like(depth, dim, heads).to(device)
    rev_prof = profile(rev_chain, x, codecs=(), policies=(), repeats=args.repeats)
    rev_plan = make_plan(rev_prof, [Segment(0, n, "reversible")], name="reversible")
    rev = report(rev_chain, x, [rev_plan], chosen=None, repeats=args.repeats)

    progress.step("writing the report")
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
    data = {
        "format": "revckpt.Demo/1",
        "model": {"depth": depth, "dim": dim, "heads": heads, "input": [batch, seq, dim]},
        "device": str(device),
        "torch": torch.__version__,
        "budget_bytes": budget,
        "error_budget": args.error_budget,
        "store_all_peak_bytes": rep.store_all_peak_bytes,
        "rows": rows,
        "reversible": rev_row,
        "plan": chosen.to_dict(),
        "verify": {
            "note": verified.note,
            "replaced": verified.replaced,
            "solved": verified.solved.to_dict(),
            "pareto": rep.pareto(),
        },
    }
    (out / "report.json").write_text(json.dumps(_finite(data), indent=2) + "\n")
    chosen.to_json(out / "plan.json")
    plots = []
    try:
        plots.append(rep.plot(out / "memory_vs_overhead.png", title="GPT-like: memory vs time"))
        plots.append(rep.plot_errors(out / "gradient_error.png", title="gradient error per plan"))
    except RevckptError as err:  # matplotlib missing
        print(f"note: no plots: {err}", file=sys.stderr)
    progress.finish()

    print(_demo_table(rep, rev, device.type))
    print()
    print(f"verify: {verified.note}.")
    print()
    print(chosen.table())
    print()
    written = ["report.json", "plan.json", *(p.name for p in plots)]
    print(f"wrote {', '.join(written)} to {out.resolve()}")
    return 0


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


def _finite(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _finite(u) for k, u in v.items()}
    if isinstance(v, (list, tuple)):
        return [_finite(u) for u in v]
    return v


_CPU_SCOPE = (
    " On CPU MemoryMeter counts the tensor storages operations make: the RNG states "
    "checkpoints keep for their recompute (5056 bytes each) are not counted."
)


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
            f"| {r.name}{mark} | {r.measured_peak_bytes / 2**20:.2f} | "
            f"{r.measured_peak_bytes / base:.1%} | {r.measured_retained_bytes / 2**20:.2f} | "
            f"{r.time_ratio:.2f} | {r.gradient_error:.1e} |"
        )
    r = rev.row("reversible")
    lines.append(
        f"| reversible (RevGPT variant) | {r.measured_peak_bytes / 2**20:.2f} | "
        f"{r.measured_peak_bytes / rev.store_all_peak_bytes:.1%} of its own | "
        f"{r.measured_retained_bytes / 2**20:.2f} | {r.time_ratio:.2f} | "
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


# -- plan ----------------------------------------------------------------------------------


def _load_factory(spec: str) -> Any:
    module_name, colon, attr = spec.rpartition(":")
    problem = _spec_problem(module_name, colon, attr)
    if problem:
        raise _UsageError(
            f"{spec!r} is not MODULE:FACTORY ({problem}); write e.g. examples.user_model:build "
            "or ./model.py:build (a function returning (model, example) or (blocks, "
            "example_input))"
        )
    module = _import(module_name)
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise _UsageError(
            f"module {module_name!r} has no function {attr!r}; define {attr}() returning "
            "(model, example[, loss_fn]) or (blocks, example_input[, kwargs])"
        )
    return factory


def _spec_problem(module_name: str, colon: str, attr: str) -> str | None:
    if not colon:
        return "there is no ':' between the module and the function"
    if not module_name:
        return "the module before ':' is missing"
    if not attr:
        return "the function after ':' is missing"
    if not attr.isidentifier():
        return f"{attr!r} after ':' is not a function name"
    return None


def _import(name: str) -> Any:
    """A module by dotted name (from the current directory or PYTHONPATH) or a .py file."""
    if name.endswith(".py") or "/" in name or os.sep in name:
        return _import_file(Path(name))
    if not all(part.isidentifier() for part in name.split(".")):
        raise _UsageError(
            f"{name!r} is neither a module name nor a .py file; give a dotted module name "
            "(examples.user_model) or the path of a .py file (./model.py)"
        )
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # modules of the directory you run it from
    try:
        return importlib.import_module(name)
    except (ImportError, SyntaxError) as err:
        raise _UsageError(
            f"cannot import module {name!r} ({type(err).__name__}: {err}); run from the "
            "directory that contains it or put it on PYTHONPATH"
        ) from err


def _import_file(path: Path) -> Any:
    spec = importlib.util.spec_from_file_location(path.stem, path) if path.is_file() else None
    if spec is None or spec.loader is None:
        raise _UsageError(
            f"no Python file {str(path)!r}; give the path of the .py file that defines the "
            "factory, e.g. ./model.py:build"
        )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    sys.path.insert(0, str(path.resolve().parent))  # its own imports, as when run as a script
    try:
        spec.loader.exec_module(module)
    except (ImportError, SyntaxError) as err:
        raise _UsageError(f"cannot import {str(path)!r} ({type(err).__name__}: {err})") from err
    return module


def _profile_options(strategies: Sequence[str] | None, offload: bool) -> dict[str, Any]:
    """What ``profile`` needs to price the strategies asked for (checked before profiling,
    which takes a while): only the codecs and policies named, offload when named or asked."""
    from .approx import FORMATS
    from .checkpoint import POLICY_PRESETS
    from .strategy import Strategy

    if strategies is None:
        return {"offload": True} if offload else {}
    codecs, policies = [], []
    for name in strategies:
        try:
            strategy = Strategy.parse(name)
        except RevckptError:
            raise _UsageError(
                f"unknown strategy {name!r}; use store, checkpoint, reversible, offload, "
                f"approx:<{'|'.join(sorted(FORMATS))}> or "
                f"selective:<{'|'.join(sorted(POLICY_PRESETS))}>"
            ) from None
        if strategy.kind == "approx":
            codecs.append(strategy.arg)
        elif strategy.kind == "selective":
            policies.append(strategy.arg)
    return {
        "codecs": tuple(codecs),
        "policies": tuple(policies),
        "offload": True if offload or "offload" in strategies else None,
    }


_RETURNS = "(model, example[, loss_fn]) or (blocks, example_input[, kwargs])"


def _plan(args: argparse.Namespace) -> int:
    from .schedule import parse_budget

    # the budget's syntax and the strategies' names, checked before the factory's module is
    # imported and the model profiled (a fraction is read against a dummy store-all peak,
    # which an error about it does not show)
    dummy = 1 << 62
    try:
        parse_budget(args.budget, dummy)
    except RevckptError as err:
        raise _UsageError(str(err).replace(f" ({dummy:,} bytes)", "")) from err
    strategies = _strategy_names(args.strategies)
    _profile_options(strategies, False)
    if args.out and not Path(args.out).resolve().parent.is_dir():
        raise _UsageError(f"--out {args.out}: its folder does not exist; create it first")
    factory = _load_factory(args.factory)
    try:
        result = factory()
    except TypeError as err:
        if "argument" not in str(err):
            raise
        raise _UsageError(
            f"{args.factory}() cannot be called without arguments ({err}); give every "
            "argument a default"
        ) from err
    if not (isinstance(result, tuple) and len(result) in (2, 3)):
        raise _UsageError(f"{args.factory} returned {type(result).__name__}; return {_RETURNS}")
    if _is_chain(result, args):
        return _plan_chain(args, result, strategies)
    return _plan_model(args, result, strategies)


def _strategy_names(given: Sequence[str] | None) -> list[str] | None:
    """``--strategies store,checkpoint`` or ``--strategies store checkpoint``."""
    if given is None:
        return None
    names = [name.strip() for item in given for name in item.split(",") if name.strip()]
    if not names:
        raise _UsageError("--strategies: name at least one, e.g. --strategies store,checkpoint")
    return names


def _is_chain(result: tuple[Any, ...], args: argparse.Namespace) -> bool:
    """Whether the factory returned a chain of blocks (the older form of ``revckpt plan``)
    rather than a whole model: a list of modules, a dict of keyword tensors for the blocks, or
    an ``nn.Sequential`` and its input tensor with nothing that asks for a whole model (a loss
    function, ``--blocks``)."""
    import torch
    from torch import nn

    first = result[0]
    if isinstance(first, (list, tuple)):
        return True
    if len(result) == 3:
        return isinstance(result[2], Mapping)
    return (
        isinstance(first, nn.Sequential)
        and isinstance(result[1], torch.Tensor)
        and args.blocks is None
    )


def _progress_bar(enabled: bool, width: int = 24) -> Any:
    """``fit``'s ``progress(done, total)``: ``[#####     ] 3/12 blocks`` on stderr."""
    if not enabled:
        return None

    def progress(done: int, total: int) -> None:
        if total <= 0:
            return
        filled = width * min(done, total) // total
        sys.stderr.write(f"\r[{'#' * filled}{' ' * (width - filled)}] {done}/{total} blocks")
        sys.stderr.flush()
        _OPEN_LINE[0] = True

    return progress


def _end_progress_line() -> None:
    if _OPEN_LINE[0]:
        sys.stderr.write("\n")
        sys.stderr.flush()
        _OPEN_LINE[0] = False


def _plan_model(
    args: argparse.Namespace, result: tuple[Any, ...], strategies: list[str] | None
) -> int:
    """A whole model: :func:`revckpt.fit` finds its blocks, traces the step, profiles the blocks
    where they are and solves for the whole step; the plan is written as JSON for ``fit(...,
    plan=path)``."""
    from torch import nn

    from .inplace import fit

    model, example = result[0], result[1]
    loss_fn = result[2] if len(result) == 3 else None
    if not isinstance(model, nn.Module):
        raise _UsageError(
            f"{args.factory} returned {type(model).__name__} where the model goes; return "
            f"{_RETURNS}, the model an nn.Module"
        )
    if len(result) == 3 and not callable(loss_fn):
        raise _UsageError(
            f"{args.factory} returned {type(loss_fn).__name__} as its third element; return a "
            "loss function (model output -> scalar loss) with a model, or a dict of keyword "
            "tensors with blocks"
        )
    for flag, given, hint in (
        ("--measure", args.measure, "fit already checks the plan in one metered training step"),
        ("--offload", args.offload, "revckpt.fit does not price offload; leave --offload out"),
    ):
        if given:
            raise _UsageError(
                f"{flag} is for a factory that returns (blocks, example_input[, kwargs]), and "
                f"{args.factory} returned a whole model ({type(model).__name__}); {hint}"
            )
    out = Path(args.out or "plan.json")
    start = time.perf_counter()
    progress = _progress_bar(not args.no_progress and sys.stderr.isatty())
    plan = fit(
        model,
        example,
        memory_budget=args.budget,
        error_budget=args.error_budget,
        loss_fn=loss_fn,
        strategies=strategies,
        blocks=args.blocks,
        repeats=args.repeats or 3,
        progress=progress,
    )
    _end_progress_line()
    names = plan.block_names
    print(
        f"planned {len(names)} blocks of {type(model).__name__} "
        f"({names[0]} .. {names[-1]})"
        + (f" in {time.perf_counter() - start:.1f} s" if args.verbose else "")
    )
    print(plan.table())
    plan.to_json(out)
    print(f"wrote {out.resolve()}")
    print(
        f"apply it with revckpt.fit(model, example, memory_budget={args.budget!r}, "
        f"plan={str(out)!r})"
    )
    return 0


def _plan_chain(
    args: argparse.Namespace, result: tuple[Any, ...], strategies: list[str] | None
) -> int:
    """A chain of blocks (one tensor in, one out): profiled with
    :func:`revckpt.schedule.profile`, solved with :func:`revckpt.schedule.solve`."""
    import torch
    from torch import nn

    from .report import measure_peak
    from .schedule import apply, baseline, parse_budget, profile, solve

    blocks, x = result[0], result[1]
    kwargs = dict(result[2]) if len(result) == 3 else {}
    if args.blocks is not None:
        raise _UsageError(
            f"--blocks picks the blocks inside a whole model, and {args.factory} returned the "
            "blocks themselves; leave --blocks out, or return (model, example[, loss_fn])"
        )
    if not (
        isinstance(blocks, (nn.Sequential, list, tuple))
        and all(isinstance(b, nn.Module) for b in blocks)
    ):
        raise _UsageError(
            f"{args.factory} returned blocks that are not all modules; return the chain as an "
            "nn.Sequential or a list of modules (one tensor in, one out), e.g. "
            "nn.Sequential(*model.layers)"
        )
    if not isinstance(x, torch.Tensor):
        raise _UsageError(
            f"{args.factory} returned an example input of type {type(x).__name__}; return a "
            "tensor (the chain's input)"
        )
    options = _profile_options(strategies, args.offload)
    prof = profile(blocks, x, repeats=args.repeats or 5, **options, **kwargs)
    print(prof.table() if args.verbose else f"profiled {len(prof.blocks)} blocks")
    store_peak = baseline(prof, "store").predicted_peak_bytes
    budget = parse_budget(args.budget, store_peak)
    plan = solve(prof, memory_budget=budget, error_budget=args.error_budget, strategies=strategies)
    print(plan.table())
    if args.out:
        plan.to_json(args.out)
        print(f"wrote {Path(args.out).resolve()}")
    if args.measure:
        peak = measure_peak(apply(blocks, plan), x, kwargs=kwargs)
        verdict = "within" if peak <= budget else "OVER"
        print(
            f"measured peak {peak / 2**20:.2f} MiB: {verdict} the budget of "
            f"{budget / 2**20:.2f} MiB ({peak / plan.predicted_peak_bytes:.3f} of predicted)"
            + (_CPU_SCOPE if x.device.type == "cpu" else "")
        )
        if peak > budget:
            return 1
    return 0


# -- bench ---------------------------------------------------------------------------------


def _benchmarks_dir() -> Path:
    here = Path(__file__).resolve().parent.parent / "benchmarks"
    if not here.is_dir():
        raise _UsageError(
            "the benchmark scripts live in a source checkout (benchmarks/): clone the "
            "repository and install it with pip install -e ."
        )
    return here


BENCHES = ("bench_checkpoint", "bench_reversible", "bench_approx", "bench_solver", "bench_schedule")


def _bench(args: argparse.Namespace) -> int:
    folder = _benchmarks_dir()
    names = args.only or list(BENCHES)
    unknown = [n for n in names if n not in BENCHES]
    if unknown:
        raise _UsageError(f"unknown benchmark {unknown}; choose from {list(BENCHES)}")
    for peer, hint in (
        ("revlib", "pip install -e '.[bench]'"),
        ("revtorch", "pip install -e '.[bench]'"),
        ("memcnn", "pip install --no-deps memcnn==1.5.2"),
    ):
        if importlib.util.find_spec(peer) is None:
            print(f"note: {peer} is not installed: its rows are skipped ({hint})")
    failed = []
    scratch = Path(tempfile.mkdtemp(prefix="revckpt-bench-")) if args.quick else None
    for name in names:
        cmd = [sys.executable, str(folder / f"{name}.py")]
        if args.quick:  # reduced sizes, written outside benchmarks/results
            cmd += ["--lengths", "32"] if name == "bench_solver" else ["--quick"]
            assert scratch is not None
            cmd += ["--out", str(scratch / f"{name}.json")]
        print(f"\n$ {' '.join(cmd[1:])}", flush=True)
        if subprocess.run(cmd, check=False).returncode != 0:
            failed.append(name)
    if scratch is not None:
        print(f"\nquick results in {scratch} (benchmarks/results/ untouched)")
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


# -- entry point ---------------------------------------------------------------------------


def _parser() -> _Parser:
    parser = _Parser(
        prog="revckpt",
        description="Train deeper and wider models in the same memory, and see what it costs.",
    )
    from . import __version__

    parser.add_argument("--version", action="version", version=f"revckpt {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    demo = sub.add_parser(
        "demo",
        help="measure every strategy on a built-in GPT-like model",
        description=(
            "Measure store, checkpoint (per block, sqrt), approx (bf16, e4m3), reversible and "
            "the scheduler's plan on a built-in GPT-like model: peak and retained memory, time "
            "against store-all, gradient error against float64. Writes report.json, plan.json "
            "and two PNG plots to --out."
        ),
    )
    demo.add_argument("--out", default="revckpt-demo", help="output folder (default: %(default)s)")
    demo.add_argument(
        "--budget",
        default="0.3",
        help="the scheduler's memory budget: bytes, '2GiB', or a fraction of the store-all "
        "peak (default: %(default)s)",
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
    demo.set_defaults(run=_demo)

    plan = sub.add_parser(
        "plan",
        help="plan for your own model under a memory budget",
        description=(
            "Import FACTORY from MODULE (MODULE:FACTORY, e.g. ./model.py:make or "
            "examples.user_model:build) and call it. When it returns (model, example) or "
            "(model, example, loss_fn), plan the whole training step with revckpt.fit (the "
            "model's repeated blocks, or --blocks) and write the plan as JSON to --out "
            "(default plan.json), to apply with revckpt.fit(model, example, "
            "memory_budget=..., plan='plan.json'). When it returns (blocks, example_input) or "
            "(blocks, example_input, kwargs), with blocks a list of modules or an "
            "nn.Sequential, profile that chain and print the cheapest plan that fits."
        ),
    )
    plan.add_argument(
        "factory",
        metavar="MODULE:FACTORY",
        help="a function returning (model, example[, loss_fn]) or (blocks, "
        "example_input[, kwargs]), e.g. ./model.py:make or examples.user_model:build",
    )
    plan.add_argument(
        "--budget",
        required=True,
        help="memory budget: '2GiB', '512MiB', '30%%', or a fraction of the store-all peak "
        "like 0.3",
    )
    plan.add_argument(
        "--error-budget",
        type=float,
        default=0.0,
        help="largest relative gradient error allowed (default: 0, exact strategies only; "
        "e.g. 1e-2 lets the solver compress boundaries to bf16 or fp8)",
    )
    plan.add_argument(
        "--strategies",
        nargs="+",
        metavar="S",
        help="restrict to these strategies, comma- or space-separated (store, checkpoint, "
        "reversible, offload, approx:<codec>, selective:<policy>); only these are profiled",
    )
    plan.add_argument(
        "--blocks",
        metavar="PATH",
        help="a whole model's blocks: the attribute path of their container, e.g. "
        "model.layers (default: the model's repeated blocks)",
    )
    plan.add_argument(
        "--offload",
        action="store_true",
        help="blocks only: price host offload even when the model is not on a CUDA device "
        "(on a CPU it saves nothing: host memory is device memory); on CUDA it is priced by "
        "default",
    )
    plan.add_argument(
        "--out",
        help="write the plan as JSON to this file (default for a whole model: plan.json; for "
        "blocks: not written)",
    )
    plan.add_argument(
        "--measure", action="store_true", help="blocks only: apply the plan and measure its peak"
    )
    plan.add_argument(
        "--repeats",
        type=_positive_int,
        default=None,
        help="timing rounds (default: 3 for a whole model, 5 for blocks)",
    )
    plan.add_argument("--no-progress", action="store_true", help="no progress bar")
    plan.add_argument(
        "-v", "--verbose", action="store_true", help="print the profile table (blocks) or the time"
    )
    plan.set_defaults(run=_plan)

    bench = sub.add_parser(
        "bench",
        help="run the benchmark suite (source checkout)",
        description="Run the scripts in benchmarks/; peers that are not installed are skipped.",
    )
    bench.add_argument(
        "--quick",
        action="store_true",
        help="reduced sizes, results written to a temporary folder (a smoke run)",
    )
    bench.add_argument("--only", nargs="+", metavar="NAME", help=f"any of {', '.join(BENCHES)}")
    bench.set_defaults(run=_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``revckpt`` command; returns the exit status."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
        if getattr(args, "run", None) is None:
            parser.print_help()
            return EXIT_USAGE
        return int(args.run(args))
    except (_UsageError, RevckptError) as err:
        if _OPEN_LINE[0]:
            sys.stderr.write("\n")
            _OPEN_LINE[0] = False
        print(f"revckpt: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("revckpt: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
