"""revckpt's scheduler against torch's own memory options, at equal measured memory, on the
built-in GPT-like model (``revckpt.models.gpt_like(24, 64, 4)``, input 4 x 128 x 64; ``--quick``:
``gpt_like(4, 32, 2)``, input 2 x 16 x 32), float32, CPU, one thread, all in one process.

The torch options:

* eager: ``torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)`` around every
  block (*per-layer checkpoint*), and selective activation checkpointing per block
  (``create_selective_checkpoint_contexts``: ``MUST_SAVE`` for ``aten.mm`` / ``addmm`` / ``bmm``
  and the SDPA operations, ``PREFER_RECOMPUTE`` for every other operation);
* compiled: ``torch.compile(model)`` with ``torch._functorch.config.activation_memory_budget``
  in {0.7, 0.5, 0.3, 0.1} (set with ``torch._functorch.config.patch`` around the compilation and
  the first run; ``torch._dynamo.reset()`` before each budget).

For each option: the peak of one whole training step (forward, then backward of ``(y *
w).sum()`` with a fixed ``w`` of ones, the input a fresh leaf, the parameter gradients already
allocated), measured with ``MemoryMeter("cpu", method="allocator")`` (the CPU allocator's own
events: it sees compiled code and the RNG states checkpoints keep), then revckpt's plan solved
for a budget equal to that peak (``schedule.profile`` once, then ``schedule.solve`` twice:
*exact*, with store, checkpoint and selective only, and *+approx*, every strategy with
``error_budget=1e-2``), applied with ``schedule.apply`` and measured the same way: eager against
the eager options; against the compiled options, two plans under ``torch.compile(apply(chain,
plan))``: the eager profile's exact plan, and the exact plan of a second profile measured
compiled (``schedule.profile(..., compiled=True, policies="auto")``: each strategy's bytes and
times as the compiler runs it, where a selective block's recompute is fused into the backward's
kernels and costs almost nothing). The eager profile predicts the eager step as its storage
meter sees it; where the plan measures above the option's peak (compiled code allocates
differently), the budget is lowered by the excess and the chain solved again, up to ``--max-
tries`` times or down to the smallest feasible budget; the row says so. Compiled, each plan
tried is compiled from a fresh Dynamo state, and the group (store-all, the option, the chosen
plans) is then compiled once more side by side, measured and timed; a compiled model is measured
after ``--compiled-warmup`` steps (10: past Dynamo's recompile limit of 8, for code that
recompiles at every step), and the rows count the graphs Dynamo made in those steps.

Time: every variant of a group (its store-all, the torch option, the revckpt plans) once per
round in rotated order (``revckpt.time_ratios``) against the store-all of its mode (eager
store-all; under compile ``torch.compile`` of the plain chain with the default budget 1.0);
then each revckpt plan head to head with its torch option (``revckpt.time_ratio``, A/B
interleaved): revckpt / torch, <= 1.00 means revckpt is no slower. Medians with the
interquartile range. Peaks are given as a fraction of the store-all peak of the same mode.

Run ``python benchmarks/bench_vs_torch.py`` (about 10 minutes on 2 CPU cores with a cold
inductor cache, most of it compiling; ``--quick``: about a minute); prints a Markdown table and
writes ``benchmarks/results/bench_vs_torch.json``.
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _common import environment, ratio_cell, write_json  # benchmarks/_common.py
from torch import nn
from torch._dynamo.utils import counters
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from revckpt import InfeasibleBudgetError, MemoryMeter, time_ratio, time_ratios
from revckpt.measure import keep_freed_memory
from revckpt.models import gpt_like
from revckpt.schedule import Plan, apply, baseline, profile, solve

BUDGETS = (0.7, 0.5, 0.3, 0.1)
TORCH = "torch"  # the variant name of the torch option in each group's rows
EXACT = ("store", "checkpoint", "selective:matmul+attention")
_SAVED_OPS = frozenset(
    getattr(torch.ops.aten, name)
    for name in (
        "mm",
        "addmm",
        "bmm",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
    )
    if hasattr(torch.ops.aten, name)
)


def _policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    if op.overloadpacket in _SAVED_OPS:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


class TorchPerLayer(nn.Module):
    """Every block under ``torch.utils.checkpoint.checkpoint`` (non-reentrant)."""

    def __init__(self, chain: nn.Sequential) -> None:
        super().__init__()
        self.chain = chain

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.chain:
            x = checkpoint(block, x, use_reentrant=False)
        return x


class TorchSelective(nn.Module):
    """Every block under torch's selective checkpoint: matmul and SDPA outputs saved."""

    def __init__(self, chain: nn.Sequential) -> None:
        super().__init__()
        self.chain = chain
        self.context_fn = functools.partial(create_selective_checkpoint_contexts, _policy)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.chain:
            x = checkpoint(block, x, use_reentrant=False, context_fn=self.context_fn)
        return x


class Plain(nn.Module):
    """The chain as it is, in a module of its own: compiled store-all gets its own Dynamo cache
    entry, apart from ``torch.compile(chain)`` compiled under a budget."""

    def __init__(self, chain: nn.Sequential) -> None:
        super().__init__()
        self.chain = chain

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.chain:
            x = block(x)
        return x


def model(quick: bool) -> tuple[nn.Sequential, torch.Tensor]:
    torch.manual_seed(0)
    if quick:
        return gpt_like(4, 32, 2), torch.randn(2, 16, 32)
    return gpt_like(24, 64, 4), torch.randn(4, 128, 64)


class Bench:
    """The chain, its input, and one training step of any model of it, metered or timed."""

    def __init__(self, chain: nn.Sequential, x: torch.Tensor) -> None:
        self.chain = chain
        self.x = x
        self.weight = torch.ones_like(x)  # the chain keeps the input's shape
        for p in chain.parameters():
            p.grad = torch.zeros_like(p)  # steady state: gradients exist before the step

    def step(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[], None]:
        def run() -> None:
            leaf = self.x.detach().clone().requires_grad_()
            y = fn(leaf)
            (y * self.weight).sum().backward()

        return run

    def peak(
        self,
        fn: Callable[[torch.Tensor], torch.Tensor],
        method: str = "allocator",
        warmup: int = 1,
    ) -> int:
        """Peak bytes of one step, after ``warmup`` steps (the first compiles compiled code)."""
        run = self.step(fn)
        for _ in range(warmup):
            run()
        with MemoryMeter("cpu", method=method) as meter:
            run()
        return meter.peak_bytes


def _compile_counts() -> tuple[int, int]:
    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


def _key(plan: Plan) -> tuple:
    return tuple((s.start, s.stop, s.strategy) for s in plan.segments)


def plan_cell(plan: Plan) -> str:
    """``checkpoint 0-5, store 6-23``: runs of blocks with one strategy."""
    runs: list[list[Any]] = []
    for i, s in enumerate(plan.strategies):
        if runs and runs[-1][0] == s:
            runs[-1][2] = i
        else:
            runs.append([s, i, i])
    return ", ".join(f"{s} {a}" if a == b else f"{s} {a}-{b}" for s, a, b in runs)


def _error(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:400]


def fit_to(
    prof: Any,
    target: int,
    *,
    strategies: tuple[str, ...] | None,
    error_budget: float,
    peak_of: Callable[[Plan], int],
    max_tries: int,
) -> dict[str, Any]:
    """revckpt's plan at budget ``target``, lowered until its measured peak is <= ``target``.

    After a plan measures ``m > target``, the next budget is its predicted peak minus the
    excess ``m - target`` (at least 1 byte below the prediction, so the plan changes); a budget
    below the smallest feasible one is replaced by that smallest, which is then the last try.
    """
    budget, tries = target, []
    plan = peak = None
    for _ in range(max_tries):
        smallest = False
        try:
            plan = solve(
                prof, memory_budget=budget, error_budget=error_budget, strategies=strategies
            )
        except InfeasibleBudgetError as exc:
            budget, smallest = exc.smallest_budget_bytes, True
            plan = solve(
                prof, memory_budget=budget, error_budget=error_budget, strategies=strategies
            )
        peak = peak_of(plan)
        tries.append({"budget_bytes": budget, "measured_peak_bytes": peak, "smallest": smallest})
        if peak <= target or smallest:
            break
        budget = min(plan.predicted_peak_bytes - 1, plan.predicted_peak_bytes - (peak - target))
    assert plan is not None and peak is not None
    first = tries[0]
    if first["smallest"]:
        note = f"budget infeasible; solved at the smallest, {first['budget_bytes'] / 2**20:.2f} MiB"
    elif len(tries) > 1:
        note = f"budget lowered {len(tries) - 1}x to {tries[-1]['budget_bytes'] / 2**20:.2f} MiB"
        if tries[-1]["smallest"]:
            note += " (the smallest feasible)"
    else:
        note = ""
    if peak > target:
        note += ("; " if note else "") + "measures above the option's peak"
    return {"plan": plan, "peak": peak, "budget": budget, "tries": tries, "note": note}


def _revckpt_label(error_budget: float | None, compiled: bool | None = None) -> str:
    label = "revckpt exact" if error_budget is None else f"revckpt +approx (error {error_budget:g})"
    if compiled is None:
        return label
    return f"{label}, {'compiled' if compiled else 'eager'} profile"


Variant = tuple[str, Any, float | None]
"""A revckpt row: its label, the profile it is solved from, its error budget (None: exact)."""


Prepare = Callable[[], tuple[Any, Any, int, int]]
"""Builds a group's store-all and torch models afresh: ``(store_fn, torch_fn, store_peak,
torch_peak)``, both measured (compiled ones compiled by their first step)."""


def run_group(
    mode: str,
    option: str,
    prepare: Prepare,
    make: Callable[[Plan], Callable[[torch.Tensor], torch.Tensor]],
    bench: Bench,
    variants: list[Variant],
    args: argparse.Namespace,
    searched: dict[tuple, int],
) -> list[dict[str, Any]]:
    """One torch option against revckpt's plans at its peak: rows, measured and timed.

    Compiled, every plan the budget search tries is compiled from a fresh Dynamo state
    (``torch._dynamo.reset()``: many plans in one state would hit Dynamo's recompile limit and
    run eagerly), and ``searched`` keeps its peak for the next groups; then the group is
    compiled once more, the torch option, its store-all and the chosen plans side by side, and
    measured and timed there.
    """
    compiled = mode == "compiled"
    warmup = args.compiled_warmup if compiled else 1
    _, _, _, target = prepare()

    def peak_of(plan: Plan) -> int:
        key = _key(plan)
        if key not in searched:
            if compiled:
                torch._dynamo.reset()
            searched[key] = bench.peak(make(plan), warmup=warmup)
        return searched[key]

    found: dict[str, dict[str, Any]] = {}
    rows: list[dict[str, Any]] = []
    for label, prof, eb in variants:
        try:
            found[label] = fit_to(
                prof,
                target,
                strategies=EXACT if eb is None else None,
                error_budget=0.0 if eb is None else eb,
                peak_of=peak_of,
                max_tries=args.max_tries,
            )
        except Exception as exc:  # a plan that does not run or compile is a result
            rows.append({"mode": mode, "option": option, "variant": label, "error": _error(exc)})
    if compiled:
        torch._dynamo.reset()
    store_fn, torch_fn, store_peak, torch_peak = prepare()
    fns = {"store-all": store_fn, TORCH: torch_fn}
    made: dict[tuple, tuple[Any, int, int, int]] = {}
    for label, f in found.items():
        plan = f["plan"]
        key = _key(plan)
        row: dict[str, Any] = {"mode": mode, "option": option, "variant": label}
        try:
            if key not in made:
                graphs, breaks = _compile_counts()
                fn = make(plan)
                peak = bench.peak(fn, warmup=warmup)
                after = _compile_counts()
                made[key] = (fn, peak, after[0] - graphs, after[1] - breaks)
        except Exception as exc:
            rows.append({**row, "error": _error(exc)})
            continue
        fn, peak, graphs, breaks = made[key]
        fns[label] = fn
        row.update(
            plan=plan_cell(plan),
            strategies=sorted(set(plan.strategies)),
            peak_bytes=peak,
            peak_fraction=peak / store_peak,
            budget_bytes=f["budget"],
            target_bytes=torch_peak,
            predicted_peak_bytes=plan.predicted_peak_bytes,
            predicted_overhead=plan.predicted_overhead,
            predicted_error=plan.predicted_error,
            tries=f["tries"],
            no_more_memory=peak <= torch_peak,
            note=f["note"],
        )
        if compiled:
            # graphs Dynamo made in the warm-up and measured steps (1: no graph break and no
            # recompile)
            row.update(graphs_compiled=graphs, graph_breaks=breaks)
        else:
            row["storages_peak_bytes"] = bench.peak(fn, method="storages")
        rows.append(row)
    steps = {name: bench.step(fn) for name, fn in fns.items()}
    ratios = time_ratios(steps, baseline="store-all", repeats=args.repeats, warmup=args.warmup)
    for row in rows:
        if "error" in row:
            continue
        r = ratios[row["variant"]]
        row.update(time_ratio=r.ratio, time_ratio_q25=r.q25, time_ratio_q75=r.q75)
        h2h = time_ratio(
            steps[row["variant"]], steps[TORCH], repeats=args.repeats, warmup=args.warmup
        )
        row.update(vs_torch=h2h.ratio, vs_torch_q25=h2h.q25, vs_torch_q75=h2h.q75)
    r = ratios[TORCH]
    torch_row = {
        "mode": mode,
        "option": option,
        "variant": TORCH,
        "peak_bytes": torch_peak,
        "peak_fraction": torch_peak / store_peak,
        "first_peak_bytes": target,  # the first measurement, the budget's target
        "store_all_peak_bytes": store_peak,
        "time_ratio": r.ratio,
        "time_ratio_q25": r.q25,
        "time_ratio_q75": r.q75,
    }
    return [torch_row, *rows]


def run(args: argparse.Namespace) -> dict[str, Any]:
    chain, x = model(args.quick)
    bench = Bench(chain, x)
    start = time.perf_counter()
    prof = profile(chain, x, repeats=args.profile_repeats)
    profile_s = time.perf_counter() - start
    eager: list[Variant] = [(_revckpt_label(eb), prof, eb) for eb in (None, args.error_budget)]
    compiled_s = None
    if args.budgets:
        start = time.perf_counter()
        cprof = profile(chain, x, repeats=args.profile_repeats, compiled=True, policies="auto")
        compiled_s = time.perf_counter() - start
        under_compile: list[Variant] = [
            (_revckpt_label(None, False), prof, None),
            (_revckpt_label(None, True), cprof, None),
        ]
    store_peak = bench.peak(chain)
    rows: list[dict[str, Any]] = [
        {
            "mode": "eager",
            "option": "-",
            "variant": "store-all",
            "peak_bytes": store_peak,
            "storages_peak_bytes": bench.peak(chain, method="storages"),
            "predicted_peak_bytes": baseline(prof, "store").predicted_peak_bytes,
            "peak_fraction": 1.0,
        }
    ]

    # eager: torch's per-layer and selective checkpoints
    searched: dict[tuple, int] = {}
    for option, wrapper in (
        ("torch per-layer checkpoint", TorchPerLayer),
        ("torch selective checkpoint (mm, SDPA saved)", TorchSelective),
    ):
        torch_model = wrapper(chain)
        peak = bench.peak(torch_model)
        rows += run_group(
            "eager",
            option,
            lambda m=torch_model, p=peak: (chain, m, store_peak, p),
            lambda plan: apply(chain, plan),
            bench,
            eager,
            args,
            searched,
        )

    # compiled: torch.compile(chain) under activation_memory_budget b
    compiled_searched: dict[tuple, int] = {}
    compiled_rows: list[dict[str, Any]] = []
    for b in args.budgets:

        def prepare(b: float = b) -> tuple[Any, Any, int, int]:
            torch._dynamo.reset()
            plain = torch.compile(Plain(chain))
            plain_peak = bench.peak(plain, warmup=args.compiled_warmup)
            compiled = torch.compile(chain)
            with torch._functorch.config.patch(activation_memory_budget=b):
                peak = bench.peak(compiled, warmup=args.compiled_warmup)  # compiled here
            return plain, compiled, plain_peak, peak

        compiled_rows += run_group(
            "compiled",
            f"torch.compile, activation_memory_budget={b:g}",
            prepare,
            lambda plan: torch.compile(apply(chain, plan)),
            bench,
            under_compile,
            args,
            compiled_searched,
        )
    torch._dynamo.reset()
    torch_rows = [r for r in compiled_rows if r["variant"] == TORCH]
    budget_peaks = {
        f"{b:g}": r["peak_bytes"] for b, r in zip(args.budgets, torch_rows, strict=True)
    }
    store_peaks = [r["store_all_peak_bytes"] for r in torch_rows]
    compiled_store_peak = store_peaks[0] if store_peaks else None
    if compiled_store_peak is not None:
        rows.append(
            {
                "mode": "compiled",
                "option": "-",
                "variant": "store-all (torch.compile, default budget 1.0)",
                "peak_bytes": compiled_store_peak,
                "peak_fraction": 1.0,
                "peak_fraction_of_eager_store_all": compiled_store_peak / store_peak,
                "note": f"{compiled_store_peak / store_peak:.1%} of eager store-all's peak",
            }
        )
    rows += compiled_rows
    # the budget changes what the compiler saves: its peaks differ (among themselves, or from
    # the default budget's); None: nothing compiled
    distinct = set(budget_peaks.values()) | {compiled_store_peak}
    return {
        "benchmark": "bench_vs_torch",
        "command": "python benchmarks/bench_vs_torch.py" + (" --quick" if args.quick else ""),
        "environment": environment(),
        "model": "gpt_like(4, 32, 2)" if args.quick else "gpt_like(24, 64, 4)",
        "input_shape": list(x.shape),
        "blocks": len(chain),
        "meter": 'MemoryMeter("cpu", method="allocator")',
        "repeats": args.repeats,
        "error_budget": args.error_budget,
        "profile_seconds": profile_s,
        "compiled_profile_seconds": compiled_s,
        "store_all_peak_bytes": store_peak,
        "compiled_store_all_peak_bytes": compiled_store_peak,
        "compiled_store_all_peaks_per_group_bytes": store_peaks,
        "compiled_budget_peaks_bytes": budget_peaks,
        "budget_takes_effect": len(distinct) > 1 if budget_peaks else None,
        "rows": rows,
    }


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.2f}"


def _h2h(row: dict[str, Any]) -> str:
    if "vs_torch" not in row:
        return ""
    return f"{row['vs_torch']:.3f} ({row['vs_torch_q25']:.2f}-{row['vs_torch_q75']:.2f})"


def table(result: dict[str, Any]) -> str:
    effect = {True: "yes", False: "NO", None: "not compiled"}[result["budget_takes_effect"]]
    budget_peaks = ", ".join(
        f"{b}: {_mib(p)}" for b, p in result["compiled_budget_peaks_bytes"].items()
    )
    out = [
        f"{result['model']}, input {result['input_shape']}, peaks from {result['meter']}: "
        f"store-all {_mib(result['store_all_peak_bytes'])} MiB eager, "
        f"{_mib(result['compiled_store_all_peak_bytes'])} MiB compiled; "
        f"activation_memory_budget takes effect: {effect} ({budget_peaks or '-'} MiB)",
        "",
        "| mode | option | variant | peak MiB (of store-all) | time vs store-all (IQR) | "
        "revckpt / torch time (IQR) | no more memory | plan / note |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        if "error" in r:
            out.append(
                f"| {r['mode']} | {r['option']} | {r['variant']} | - | - | - | - | {r['error']} |"
            )
            continue
        time_cell = ratio_cell(r) if "time_ratio" in r else "1.000"
        fits = "" if "no_more_memory" not in r else ("yes" if r["no_more_memory"] else "NO")
        note = "; ".join(x for x in (r.get("plan", ""), r.get("note", "")) if x)
        out.append(
            f"| {r['mode']} | {r['option']} | {r['variant']} | {_mib(r['peak_bytes'])} "
            f"({r['peak_fraction']:.1%}) | {time_cell} | {_h2h(r)} | {fits} | {note} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a 4-block model (a smoke test)")
    parser.add_argument("--repeats", type=int, default=21, help="timing rounds")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--profile-repeats", type=int, default=5)
    parser.add_argument("--error-budget", type=float, default=1e-2)
    parser.add_argument(
        "--budgets",
        type=float,
        nargs="*",
        default=list(BUDGETS),
        help="activation_memory_budget values to compile (none: eager only)",
    )
    parser.add_argument(
        "--compiled-warmup",
        type=int,
        default=10,
        help="steps before a compiled model is measured (past Dynamo's recompile limit, 8)",
    )
    parser.add_argument("--max-tries", type=int, default=5, help="budget lowerings per row")
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "bench_vs_torch.json"
    )
    parser.add_argument(
        "--glibc-defaults",
        action="store_true",
        help="leave glibc's malloc as it is (by default revckpt.measure.keep_freed_memory() "
        "runs first, as in bench_schedule: the same allocator for every option)",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    kept = False if args.glibc_defaults else keep_freed_memory()
    start = time.perf_counter()
    result = run(args)
    result["keep_freed_memory"] = kept
    result["seconds"] = time.perf_counter() - start
    print(table(result))
    print(f"\n{result['seconds']:.0f} s")
    write_json(result, args.out)
    return result


if __name__ == "__main__":
    main()
