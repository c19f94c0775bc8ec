"""The scheduler against the usual recipes, all measured, on the built-in GPT-like and RevNet-like
models at memory budgets of 75, 50, 25, 10 and 5% of the store-everything peak.

For each model: ``revckpt.schedule.profile`` once, then for each budget the plans

* ``uniform``: equal checkpoint segments (``every-k``) with the fewest segments that fit;
* ``sqrt``: ``round(sqrt(L))`` equal segments; ``per-block``: every block checkpointed
  (both fixed: they fit a budget or not);
* ``greedy``: from store-all, checkpoint the block that lowers the predicted peak most per
  second of recompute until the budget fits;
* ``optimal``: ``schedule.solve`` with store and checkpoint only (exact, no error);
* ``optimal+``: ``schedule.solve`` with every strategy (reversible, approx) and an error budget
  of ``--error-budget``.

Every distinct plan is then measured with ``revckpt.report.report`` in one run: peak bytes of
a training step (``MemoryMeter``), step time over store-all's (rotated round-robin, median of
per-round ratios, one thread) and the gradient error against a float64 copy. A second table
puts each baseline next to the exact optimum solved for the baseline's own predicted peak
(equal memory, exactly): the optimum's overhead is never higher by prediction; the measured
times show what the noise of this machine does to that.

A third table is the time model's record: every measured plan's predicted overhead (from
the profile the plans were solved on, and from a second, separate profile of the same model)
against its measured overhead, the relative error, whether it is within 15% (or 0.03 of a
step), the Spearman rank correlation of predicted and measured overheads over all plans, and
what each profile cost in training steps (its wall time over the stored chain's step). The
third model is a Hugging Face Llama decoder stack (random weights, ``transformers``): its
decoder layers as a chain, each with the model's rotary tables fixed.

On a CPU the benchmark first calls ``revckpt.measure.keep_freed_memory()`` (glibc keeps freed
blocks in the process, as CUDA's caching allocator does; see ``benchmarks/bench_allocator.py``
for what glibc's default of handing them back does to step times); ``--glibc-defaults`` leaves
malloc alone.

``--retest`` measures every plan a second time and scores that measurement as a prediction of
the first: the ceiling the measurement's own noise sets for the time model's figures.

Run ``python benchmarks/bench_schedule.py`` (about 5 minutes on 2 CPU cores); prints the tables
and writes ``benchmarks/results/bench_schedule.json`` and one PNG plot per model.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import sys
from pathlib import Path
from typing import Any

import torch
from _common import environment, write_json  # benchmarks/_common.py

from revckpt import RevckptError
from revckpt.measure import keep_freed_memory
from revckpt.models import gpt_like, revnet_like
from revckpt.report import report
from revckpt.schedule import Plan, baseline, evaluate, profile, solve

BUDGETS = (0.9, 0.75, 0.6, 0.5, 0.4, 0.3, 0.25, 0.2, 0.15, 0.1, 0.05)


class LlamaUnit(torch.nn.Module):
    """One decoder layer of a Hugging Face Llama as a one-input block: the rotary tables of
    the example's positions fixed (causal attention: no mask)."""

    def __init__(self, layer: torch.nn.Module, rotary: tuple[torch.Tensor, torch.Tensor]):
        super().__init__()
        self.layer = layer
        self.register_buffer("cos", rotary[0], persistent=False)
        self.register_buffer("sin", rotary[1], persistent=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        out = self.layer(h, position_embeddings=(self.cos, self.sin), attention_mask=None)
        return out[0] if isinstance(out, tuple) else out


def llama_chain(
    layers: int, dim: int, heads: int, batch: int, seq: int
) -> tuple[torch.nn.Sequential, torch.Tensor] | None:
    """A random-weight Llama's decoder layers as a chain, and a hidden-state input."""
    try:
        import transformers
    except ImportError:
        return None
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=dim,
        intermediate_size=4 * dim,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=seq,
        attn_implementation="sdpa",
    )
    model = transformers.LlamaModel(config)
    x = torch.randn(batch, seq, dim)
    positions = torch.arange(seq).unsqueeze(0)
    with torch.no_grad():
        rotary = model.rotary_emb(x, positions)
    units = [LlamaUnit(layer, rotary) for layer in model.layers]
    return torch.nn.Sequential(*units), x


def models(quick: bool) -> dict[str, tuple[torch.nn.Sequential, torch.Tensor]]:
    torch.manual_seed(0)
    if quick:
        found = {
            "GPT-like": (gpt_like(4, 32, 2), torch.randn(2, 16, 32)),
            "RevNet-like": (revnet_like((2, 2), (8, 16)), torch.randn(2, 3, 16, 16)),
        }
        llama = llama_chain(2, 32, 2, 2, 16)
    else:
        found = {
            # 24 blocks, dim 64, 4 heads, batch 4 x 128 tokens
            "GPT-like": (gpt_like(24, 64, 4), torch.randn(4, 128, 64)),
            # stem, 3 stages of 8 reversible units (16/32/64 channels), 2 downsamplings, head
            "RevNet-like": (revnet_like((8, 8, 8), (16, 32, 64)), torch.randn(8, 3, 32, 32)),
        }
        # 12 decoder layers, dim 64, 4 heads, batch 4 x 128 tokens
        llama = llama_chain(12, 64, 4, 4, 128)
    if llama is not None:
        found["HF Llama"] = llama
    return found


def _named(plan: Plan, name: str) -> Plan:
    return dataclasses.replace(plan, name=name)


def _uniform(prof: Any, budget: int) -> Plan | None:
    n = len(prof.blocks)
    for k in range(n, 0, -1):  # fewest segments first
        plan = baseline(prof, f"every-{k}")
        if plan.predicted_peak_bytes <= budget:
            return plan
    return None


def plans_for(prof: Any, store_peak: int, error_budget: float) -> tuple[list[Plan], list[dict]]:
    """Distinct plans to measure, and one record per (budget, method)."""
    distinct: dict[tuple, Plan] = {}
    records = []

    def add(plan: Plan | None, budget_frac: float | None, method: str, note: str = "") -> None:
        key = None
        if plan is not None:
            key = tuple((s.start, s.stop, s.strategy) for s in plan.segments)
            if key not in distinct:
                distinct[key] = _named(plan, f"p{len(distinct)}")
        records.append(
            {
                "budget_fraction": budget_frac,
                "method": method,
                "plan": distinct[key].name if key is not None else None,
                "note": note,
            }
        )

    fixed = {name: baseline(prof, name) for name in ("per-block", "sqrt")}
    for frac in BUDGETS:
        budget = int(frac * store_peak)
        for name, plan in fixed.items():
            fits = plan.predicted_peak_bytes <= budget
            add(plan if fits else None, frac, name, "" if fits else "does not fit")
        uniform = _uniform(prof, budget)
        add(uniform, frac, "uniform", "" if uniform else "no every-k fits")
        try:
            add(baseline(prof, "greedy", memory_budget=budget), frac, "greedy")
        except RevckptError:
            add(None, frac, "greedy", "cannot reach the budget")
        for method, strategies, eb in (
            ("optimal", ["store", "checkpoint"], 0.0),
            ("optimal+", None, error_budget),
        ):
            try:
                plan = solve(prof, memory_budget=budget, error_budget=eb, strategies=strategies)
                add(plan, frac, method)
            except RevckptError:
                add(None, frac, method, "infeasible")
    # equal memory: the exact optimum at each baseline's own predicted peak (the fixed ones,
    # and uniform and greedy at the 50% budget)
    half = int(0.5 * store_peak)
    others = {"uniform at 50%": _uniform(prof, half)}
    with contextlib.suppress(RevckptError):  # greedy may not reach it
        others["greedy at 50%"] = baseline(prof, "greedy", memory_budget=half)
    for name, plan in [*fixed.items(), *((n, p) for n, p in others.items() if p is not None)]:
        # a budget a plan meets exactly is accepted (the solver checks exact figures)
        at_peak = plan.predicted_peak_bytes
        opt = solve(prof, memory_budget=at_peak, strategies=["store", "checkpoint"])
        add(plan, None, name)
        add(opt, None, f"optimal at {name} peak")
    return list(distinct.values()), records


def _spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation (average ranks for ties)."""

    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(v):
            j = i
            while j + 1 < len(v) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    ra, rb = ranks(a), ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb, strict=True))
    var = math.sqrt(sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb))
    return cov / var if var > 0 else float("nan")


def time_model(
    rep: Any, plans: list[Plan], second: Any, base: int, labels: dict[str, str]
) -> dict[str, Any]:
    """Predicted (two profiles) against measured overhead of every measured plan."""
    rows = {r.name: r for r in rep.rows}
    records = []
    for plan in plans:
        r = rows[plan.name]
        measured = r.time_ratio - 1.0
        other = evaluate(second.blocks, plan.segments)
        pred2 = other.overhead_s / sum(b.forward_s + b.backward_s for b in second.blocks)
        miss = abs(plan.predicted_overhead - measured)
        records.append(
            {
                "plan": plan.name,
                "made_by": labels.get(plan.name, ""),
                "strategies": sorted(set(plan.strategies)),
                "memory_fraction": r.measured_peak_bytes / base,
                "measured_overhead": measured,
                "measured_iqr": [r.time_ratio_iqr[0] - 1.0, r.time_ratio_iqr[1] - 1.0],
                "predicted_overhead": plan.predicted_overhead,
                "second_profile_overhead": pred2,
                "relative_error": miss / measured if measured > 0 else None,
                "within_15pct_or_0.03": miss <= max(0.15 * abs(measured), 0.03),
                "profiles_apart": (
                    abs(pred2 - plan.predicted_overhead) / plan.predicted_overhead
                    if plan.predicted_overhead > 0
                    else 0.0
                ),
            }
        )
    meas = [r["measured_overhead"] for r in records]
    pred = [r["predicted_overhead"] for r in records]
    errs = sorted(r["relative_error"] for r in records if r["relative_error"] is not None)
    spanning = [r for r in records if 0.1 <= r["memory_fraction"] <= 0.9]
    return {
        "plans": records,
        "spearman": _spearman(meas, pred),
        "plans_10_to_90pct": len(spanning),
        "spearman_10_to_90pct": (
            _spearman(
                [r["measured_overhead"] for r in spanning],
                [r["predicted_overhead"] for r in spanning],
            )
            if len(spanning) > 2
            else None
        ),
        "median_relative_error": errs[len(errs) // 2] if errs else None,
        "worst_relative_error": errs[-1] if errs else None,
        "within": sum(r["within_15pct_or_0.03"] for r in records),
        "profiles_apart_worst": max(r["profiles_apart"] for r in records),
    }


def retest(first: Any, again: Any, plans: list[Plan], base: int) -> dict[str, Any]:
    """The measurement's own noise: every plan measured a second time, the same way, after
    the first (and its gradient-error pass), scored as if the second measurement were the
    first's prediction, with the time model's figures. Not a bound on a time model: two
    independent measurements differ by about sqrt(2) times what one differs from the truth."""
    one = {r.name: r for r in first.rows}
    two = {r.name: r for r in again.rows}
    records = []
    for plan in plans:
        measured, repeat = one[plan.name].time_ratio - 1.0, two[plan.name].time_ratio - 1.0
        miss = abs(repeat - measured)
        records.append(
            {
                "plan": plan.name,
                "memory_fraction": one[plan.name].measured_peak_bytes / base,
                "measured_overhead": measured,
                "remeasured_overhead": repeat,
                "relative_error": miss / measured if measured > 0 else None,
                "within_15pct_or_0.03": miss <= max(0.15 * abs(measured), 0.03),
            }
        )
    spanning = [r for r in records if 0.1 <= r["memory_fraction"] <= 0.9]
    errs = sorted(r["relative_error"] for r in records if r["relative_error"] is not None)

    def rho(rs: list[dict]) -> float | None:
        if len(rs) < 3:
            return None
        return _spearman(
            [r["measured_overhead"] for r in rs], [r["remeasured_overhead"] for r in rs]
        )

    return {
        "plans": records,
        "within": sum(r["within_15pct_or_0.03"] for r in records),
        "spearman": rho(records),
        "spearman_10_to_90pct": rho(spanning),
        "plans_10_to_90pct": len(spanning),
        "median_relative_error": errs[len(errs) // 2] if errs else None,
        "worst_relative_error": errs[-1] if errs else None,
    }


def _labels(records: list[dict]) -> dict[str, str]:
    """Per plan, the first method (and budget) that produced it."""
    labels: dict[str, str] = {}
    for r in records:
        if r["plan"] and r["plan"] not in labels:
            frac = r["budget_fraction"]
            labels[r["plan"]] = r["method"] + ("" if frac is None else f" at {frac:.0%}")
    return labels


def run_model(name: str, chain: Any, x: torch.Tensor, args: argparse.Namespace) -> dict:
    prof = profile(chain, x, repeats=args.profile_repeats, rounds=args.profile_rounds)
    second = profile(chain, x, repeats=args.profile_repeats, rounds=args.profile_rounds)
    store_peak = baseline(prof, "store").predicted_peak_bytes
    plans, records = plans_for(prof, store_peak, args.error_budget)
    rep = report(chain, x, plans, repeats=args.repeats, chosen=None)
    again = (
        report(chain, x, plans, repeats=args.repeats, chosen=None, errors=False)
        if args.retest
        else None
    )
    rows = {r.name: r for r in rep.rows}
    base = rep.store_all_peak_bytes
    out_records = []
    for rec in records:
        r = rows.get(rec["plan"]) if rec["plan"] else None
        entry = dict(rec)
        if r is not None:
            entry.update(
                strategies=sorted(set(r.strategies)),
                measured_peak_bytes=r.measured_peak_bytes,
                predicted_peak_bytes=r.predicted_peak_bytes,
                measured_over_predicted=r.peak_ratio,
                memory_saved=1 - r.measured_peak_bytes / base,
                time_ratio=r.time_ratio,
                predicted_overhead=r.predicted_overhead,
                gradient_error=r.gradient_error,
                predicted_error=r.predicted_error,
                within_budget_plus_5pct=(
                    None
                    if rec["budget_fraction"] is None
                    else r.measured_peak_bytes <= 1.05 * rec["budget_fraction"] * store_peak
                ),
            )
        out_records.append(entry)
    pairs = [r for r in out_records if r["budget_fraction"] is None]
    equal_memory = [
        {
            "baseline": base_rec["method"],
            "baseline_peak_bytes": base_rec["measured_peak_bytes"],
            "optimal_peak_bytes": opt_rec["measured_peak_bytes"],
            "baseline_time_ratio": base_rec["time_ratio"],
            "optimal_time_ratio": opt_rec["time_ratio"],
            "baseline_predicted_overhead": base_rec["predicted_overhead"],
            "optimal_predicted_overhead": opt_rec["predicted_overhead"],
        }
        for base_rec, opt_rec in zip(pairs[::2], pairs[1::2], strict=True)
    ]
    fixed = {r["method"]: r for r in pairs}
    sqrt_over_per_block = (
        fixed["sqrt"]["measured_peak_bytes"] / fixed["per-block"]["measured_peak_bytes"]
    )
    plot = args.out.parent / f"bench_schedule_{name.split('-')[0].lower().replace(' ', '_')}.png"
    rep.plot(plot, title=f"{name}: measured memory vs time, every plan of bench_schedule")
    worst = max(abs(r.peak_ratio - 1) for r in rep.rows)
    return {
        "model": name,
        "profile_cost_steps": [prof.cost_in_steps, second.cost_in_steps],
        "profile_threads": prof.threads,
        "time_model": time_model(rep, plans, second, base, _labels(records)),
        "retest": None if again is None else retest(rep, again, plans, base),
        "input_shape": list(x.shape),
        "blocks": len(prof.blocks),
        "store_all_measured_peak_bytes": base,
        "store_all_predicted_peak_bytes": store_peak,
        "worst_prediction_error": worst,
        "store_all_gradient_error": rows["store-all"].gradient_error,
        "plans": {r.name: list(r.strategies) for r in rep.rows},
        "records": out_records,
        "equal_memory": equal_memory,
        "sqrt_peak_over_per_block_peak": sqrt_over_per_block,
        "plot": plot.name,  # next to the JSON
    }


def _cell(v: Any, fmt: str) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, fmt)


def tables(result: dict) -> str:
    out = []
    for m in result["models"]:
        out.append(
            f"\n{m['model']} ({m['blocks']} blocks, input {m['input_shape']}): store-all "
            f"{m['store_all_measured_peak_bytes'] / 2**20:.2f} MiB measured; worst "
            f"|measured/predicted - 1| over all plans {m['worst_prediction_error']:.2%}; float32 "
            f"store-all gradient error {m['store_all_gradient_error']:.1e}"
        )
        out.append(
            "| budget | method | plan | memory saved | measured/predicted | within budget+5% | "
            "time vs store-all | gradient error (predicted) | strategies |"
        )
        out.append("|---|---|---|---|---|---|---|---|---|")
        for r in m["records"]:
            if r["budget_fraction"] is None:
                continue
            if r["plan"] is None:
                out.append(
                    f"| {r['budget_fraction']:.0%} | {r['method']} | - | {r['note']} | | | | | |"
                )
                continue
            out.append(
                f"| {r['budget_fraction']:.0%} | {r['method']} | {r['plan']} | "
                f"{r['memory_saved']:.1%} | {r['measured_over_predicted']:.3f} | "
                f"{'yes' if r['within_budget_plus_5pct'] else 'NO'} | {r['time_ratio']:.3f} | "
                f"{_cell(r['gradient_error'], '.1e')} ({r['predicted_error']:.1e}) | "
                f"{', '.join(r['strategies'])} |"
            )
        out.append(
            f"\nsqrt vs per-block (both recompute every block once): sqrt's measured peak is "
            f"{m['sqrt_peak_over_per_block_peak']:.2f}x per-block's"
        )
        out.append("\nequal memory: each baseline next to the exact optimum at its peak")
        out.append(
            "| baseline | peak MiB | time vs store-all | optimal: peak MiB | time vs store-all "
            "| predicted overhead baseline / optimal |"
        )
        out.append("|---|---|---|---|---|---|")
        for e in m["equal_memory"]:
            out.append(
                f"| {e['baseline']} | {e['baseline_peak_bytes'] / 2**20:.2f} | "
                f"{e['baseline_time_ratio']:.3f} | {e['optimal_peak_bytes'] / 2**20:.2f} | "
                f"{e['optimal_time_ratio']:.3f} | {e['baseline_predicted_overhead']:.3f} / "
                f"{e['optimal_predicted_overhead']:.3f} |"
            )
        tm = m["time_model"]
        out.append(
            f"\ntime model: profiling cost {m['profile_cost_steps'][0]:.1f} and "
            f"{m['profile_cost_steps'][1]:.1f} training steps; Spearman {tm['spearman']:.3f} over "
            f"{len(tm['plans'])} plans ({tm['spearman_10_to_90pct'] or float('nan'):.3f} over the "
            f"{tm['plans_10_to_90pct']} at 10-90% of store-all); relative error median "
            f"{tm['median_relative_error']:.1%}, worst {tm['worst_relative_error']:.1%}; "
            f"{tm['within']}/{len(tm['plans'])} within 15% (or 0.03); the two profiles' "
            f"predictions at most {tm['profiles_apart_worst']:.1%} apart"
        )
        rt = m.get("retest")
        if rt is not None:
            out.append(
                f"retest (every plan measured again, the second measurement scored as the "
                f"first's prediction): {rt['within']}/{len(rt['plans'])} within 15% (or 0.03); "
                f"Spearman {_cell(rt['spearman'], '.3f')} "
                f"({_cell(rt['spearman_10_to_90pct'], '.3f')} over the "
                f"{rt['plans_10_to_90pct']} at 10-90%); relative error median "
                f"{_cell(rt['median_relative_error'], '.1%')}, worst "
                f"{_cell(rt['worst_relative_error'], '.1%')}"
            )
        out.append(
            "| plan | memory | measured overhead (IQR) | predicted | second profile | error |"
        )
        out.append("|---|---|---|---|---|---|")
        for r in tm["plans"]:
            err = "-" if r["relative_error"] is None else f"{r['relative_error']:.1%}"
            mark = "" if r["within_15pct_or_0.03"] else " (out)"
            out.append(
                f"| {r['plan']} ({r['made_by']}) | {r['memory_fraction']:.1%} | "
                f"{r['measured_overhead']:+.3f} "
                f"({r['measured_iqr'][0]:+.3f}..{r['measured_iqr'][1]:+.3f}) | "
                f"{r['predicted_overhead']:+.3f} | {r['second_profile_overhead']:+.3f} | "
                f"{err}{mark} |"
            )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny models (a smoke test)")
    parser.add_argument("--repeats", type=int, default=9, help="timing rounds")
    parser.add_argument("--profile-repeats", type=int, default=5)
    parser.add_argument(
        "--profile-rounds", type=int, default=1, help="profile(..., rounds=): in-chain steps"
    )
    parser.add_argument("--error-budget", type=float, default=0.01)
    parser.add_argument(
        "--retest",
        action="store_true",
        help="measure every plan a second time and score the second measurement as a "
        "prediction of the first: the ceiling the measurement's own noise sets",
    )
    parser.add_argument(
        "--glibc-defaults",
        action="store_true",
        help="leave glibc's malloc as it is (by default revckpt.measure.keep_freed_memory() "
        "runs first: freed blocks stay in the process, as with CUDA's caching allocator)",
    )
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "bench_schedule.json"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    kept = False if args.glibc_defaults else keep_freed_memory()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "benchmark": "bench_schedule",
        "command": " ".join(["python benchmarks/bench_schedule.py", *(argv or sys.argv[1:])]),
        "repeats": args.repeats,
        "environment": environment(),
        "keep_freed_memory": kept,
        "profile_rounds": args.profile_rounds,
        "budgets": list(BUDGETS),
        "error_budget": args.error_budget,
        "models": [run_model(n, c, x, args) for n, (c, x) in models(args.quick).items()],
    }
    print(tables(result))
    write_json(result, args.out)
    return result


if __name__ == "__main__":
    main()
