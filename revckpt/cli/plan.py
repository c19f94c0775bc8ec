"""``revckpt plan MODULE:FACTORY --budget B``: a whole model planned with :func:`revckpt.fit`, or
a chain of blocks profiled and solved."""

from __future__ import annotations

import argparse
import inspect
import math
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .._numbers import mib
from ..errors import RevckptError
from .factory import _load_factory
from .terminal import _CPU_SCOPE, _end_progress_line, _progress_bar
from .usage import _add_command, _positive_int, _UsageError


def _add_plan(sub: Any) -> None:
    """The ``plan`` subcommand and its options."""
    plan = _add_command(
        sub,
        "plan",
        _plan,
        summary="plan for your own model under a memory budget",
        description="Import FACTORY from MODULE (MODULE:FACTORY, e.g. ./model.py:make or "
        "examples.user_model:build) and call it. When it returns (model, example) or "
        "(model, example, loss_fn), plan the whole training step with revckpt.fit (the "
        "model's repeated blocks, or --blocks) and write the plan as JSON to --out "
        "(default plan.json), to apply with revckpt.fit(model, example, "
        "memory_budget=..., plan='plan.json'). When it returns (blocks, example_input) or "
        "(blocks, example_input, kwargs), with blocks a list of modules or an "
        "nn.Sequential, profile that chain and print the cheapest plan that fits.",
    )
    _add_plan_problem(plan)
    _add_plan_output(plan)


def _add_plan_problem(plan: argparse.ArgumentParser) -> None:
    """What to plan: the factory, the budgets, the strategies, the blocks."""
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


def _add_plan_output(plan: argparse.ArgumentParser) -> None:
    """What to do with the plan, and how to measure."""
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
    plan.add_argument(
        "--threads",
        type=_positive_int,
        default=None,
        help="CPU threads to profile with: the number your training runs with (plans record "
        "it and warn when trained with another; default: torch's, often every core)",
    )
    plan.add_argument("--no-progress", action="store_true", help="no progress bar")
    plan.add_argument(
        "-v", "--verbose", action="store_true", help="print the profile table (blocks) or the time"
    )


def _profile_options(strategies: Sequence[str] | None, offload: bool) -> dict[str, Any]:
    """What ``profile`` needs to price the strategies asked for (checked before profiling,
    which takes a while): only the codecs and policies named, offload when named or asked."""
    from ..approx import FORMATS
    from ..checkpoint import POLICY_PRESETS
    from ..strategy import Strategy

    if strategies is None:
        return {"offload": True} if offload else {}
    codecs, policies, compress = [], [], []
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
        elif strategy.kind == "compress":
            compress.append(strategy.arg)
    return {
        "codecs": tuple(codecs),
        "policies": tuple(policies),
        "compress": tuple(compress),
        "offload": True if offload or "offload" in strategies else None,
    }


_RETURNS = "(model, example[, loss_fn]) or (blocks, example_input[, kwargs])"


def _plan(args: argparse.Namespace) -> int:
    from ..schedule import parse_budget
    from ..schedule.budget import UNKNOWN_PEAK

    # the budget's syntax and the strategies' names, checked before the factory's module is
    # imported and the model profiled (a fraction is checked, not read: no peak yet)
    try:
        parse_budget(args.budget, UNKNOWN_PEAK)
    except RevckptError as err:
        raise _UsageError(str(err)) from err
    if not (math.isfinite(args.error_budget) and args.error_budget >= 0):
        raise _UsageError(f"--error-budget {args.error_budget}: pass a number >= 0 (e.g. 1e-2)")
    strategies = _strategy_names(args.strategies)
    _profile_options(strategies, False)
    if args.out and not Path(args.out).resolve().parent.is_dir():
        raise _UsageError(f"--out {args.out}: its folder does not exist; create it first")
    if args.out and Path(args.out).is_dir():
        raise _UsageError(f"--out {args.out} is a folder: give a file path (e.g. plan.json)")
    factory = _load_factory(args.factory)
    _check_callable_without_arguments(factory, args.factory)
    _steady_cpu(args.threads)
    result = factory()
    if not (isinstance(result, tuple) and len(result) in (2, 3)):
        raise _UsageError(f"{args.factory} returned {type(result).__name__}; return {_RETURNS}")
    if _is_chain(result, args):
        return _plan_chain(args, result, strategies)
    return _plan_model(args, result, strategies)


def _check_callable_without_arguments(factory: Any, spec: str) -> None:
    """Raise a usage error when ``factory``'s signature needs arguments (one without a
    signature, a builtin, is called as it is)."""
    try:
        signature = inspect.signature(factory)
    except ValueError:
        return
    try:
        signature.bind()
    except TypeError as err:
        raise _UsageError(
            f"{spec}() cannot be called without arguments ({err}); give every argument a default"
        ) from err


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


def _plan_model(
    args: argparse.Namespace, result: tuple[Any, ...], strategies: list[str] | None
) -> int:
    """A whole model: :func:`revckpt.fit` finds its blocks, traces the step, profiles the blocks
    where they are and solves for the whole step; the plan is written as JSON for ``fit(...,
    plan=path)``."""
    from ..inplace import fit

    model, example, loss_fn = _model_result(args, result)
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
    _write(plan, out)
    print(f"wrote {out.resolve()}")
    print(
        f"apply it with revckpt.fit(model, example, memory_budget={args.budget!r}, "
        f"plan={str(out)!r})"
    )
    return 0


def _model_result(args: argparse.Namespace, result: tuple[Any, ...]) -> tuple[Any, Any, Any]:
    """``(model, example, loss_fn)`` from a factory that returned a whole model, checked, with
    the options that are for blocks refused."""
    from torch import nn

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
    return model, example, loss_fn


def _plan_chain(
    args: argparse.Namespace, result: tuple[Any, ...], strategies: list[str] | None
) -> int:
    """A chain of blocks (one tensor in, one out): profiled with
    :func:`revckpt.schedule.profile`, solved with :func:`revckpt.schedule.solve`."""
    import torch
    from torch import nn

    from ..report import measure_peak
    from ..schedule import apply, baseline, parse_budget, profile, solve

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
    prof = profile(blocks, x, repeats=args.repeats or 5, kwargs=kwargs, **options)
    print(prof.table() if args.verbose else f"profiled {len(prof.blocks)} blocks")
    store_peak = baseline(prof, "store").predicted_peak_bytes
    budget = parse_budget(args.budget, store_peak)
    plan = solve(prof, memory_budget=budget, error_budget=args.error_budget, strategies=strategies)
    print(plan.table())
    if args.out:
        _write(plan, Path(args.out))
        print(f"wrote {Path(args.out).resolve()}")
    if args.measure:
        peak = measure_peak(apply(blocks, plan), x, kwargs=kwargs)
        verdict = "within" if peak <= budget else "OVER"
        print(
            f"measured peak {mib(peak)}: {verdict} the budget of "
            f"{mib(budget)} ({peak / plan.predicted_peak_bytes:.3f} of predicted)"
            + (_CPU_SCOPE if x.device.type == "cpu" else "")
        )
        if peak > budget:
            return 1
    return 0


def _write(plan: Any, out: Path) -> None:
    """The plan as JSON at ``out``; a path that cannot be written is a usage error."""
    try:
        plan.to_json(out)
    except OSError as err:
        raise _UsageError(f"--out {out}: cannot write the plan ({err.strerror})") from err


def _steady_cpu(threads: int | None) -> None:
    """Profile with ``threads`` (when given) and freed memory kept in the process, so that
    step times do not depend on the step before (glibc's page faults; measure/host.py)."""
    import torch

    from ..measure import keep_freed_memory

    if threads is not None:
        torch.set_num_threads(threads)
    keep_freed_memory()
