"""The solver is exact: it equals brute force (L <= 7) and an independent MILP (L <= 32)."""

import dataclasses
import math
import random
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import brute_force, milp_optimum

from revckpt import InvalidArgumentError
from revckpt.schedule import (
    ApproxCost,
    BlockCost,
    OffloadCost,
    Plan,
    Profile,
    Segment,
    SelectiveCost,
    baseline,
    evaluate,
    parse_budget,
    solve,
)
from revckpt.schedule.costs import chain_totals, peak_phases, strategy_names
from revckpt.schedule.programme import quantise, solve_segments
from revckpt.schedule.step import StepCosts


def make_chain(n, seed):
    """A chain of ``n`` blocks with random (but plausible) costs."""
    rng = random.Random(seed)
    width = rng.randint(20, 200)
    blocks = []

    def measured(value):
        return value if rng.random() < 0.5 else None

    selective = rng.random() < 0.3  # some chains also offer selective recompute
    offload = rng.random() < 0.4  # and host offload (moving all, or nothing, of each input)
    for _ in range(n):
        x = rng.randint(width // 2, width)
        saved = rng.randint(0, 6 * width)
        fwd = rng.uniform(0.1, 5.0)
        blocks.append(
            BlockCost(
                forward_s=fwd,
                backward_s=2 * fwd,
                input_bytes=x,
                output_bytes=x,
                saved_bytes=saved,
                forward_peak_bytes=saved + x + rng.randint(0, width),
                forward_peak_nograd_bytes=x + rng.randint(0, width),
                backward_peak_bytes=x + rng.randint(0, 2 * width),
                invertible=rng.random() < 0.5,
                approx={"e4m3": ApproxCost(x // 4 + 1, param_grad_error=rng.uniform(1e-4, 5e-2))},
                param_bytes=rng.randint(0, width),
                output_saved=rng.random() < 0.3,
                # measured transients on some blocks, the bounds on the others
                checkpoint_peak_bytes=measured(saved + x + rng.randint(0, width)),
                reversible_peak_bytes=measured(x + rng.randint(0, 2 * width)),
                strategy_overhead_s=(
                    {"checkpoint": fwd * rng.uniform(1.0, 1.5), "offload": fwd * rng.uniform(1, 2)}
                    if rng.random() < 0.5
                    else {}
                ),
                offload=(
                    OffloadCost(rng.choice([0, 0, x]), rng.uniform(0.0, fwd)) if offload else None
                ),
                **(
                    {
                        "selective": {
                            "matmul": SelectiveCost(
                                kept_bytes=rng.randint(0, saved),
                                forward_peak_bytes=saved + rng.randint(0, width),
                                backward_peak_bytes=x + rng.randint(0, width),
                                output_kept=rng.random() < 0.3,
                            )
                        }
                    }
                    if selective and rng.random() < 0.7
                    else {}
                ),
            )
        )
    return blocks


def saved_outputs(blocks):
    return frozenset(i for i, b in enumerate(blocks) if b.output_saved)


def selective_kept(blocks):
    return frozenset(
        (i, "selective:" + p)
        for i, b in enumerate(blocks)
        for p, s in b.selective.items()
        if s.output_kept
    )


def block_costs(max_len=7):
    return st.builds(make_chain, st.integers(1, max_len), st.integers(0, 2**32))


def _instance(blocks, fraction, error_budget, slots):
    _, store_peak = chain_totals(blocks)
    budget = max(1, int(fraction * store_peak))
    return quantise(
        blocks,
        budget_bytes=budget,
        error_budget=error_budget,
        strategies=strategy_names(blocks),
        slots=slots,
        error_slots=8,
    )


@settings(max_examples=200)
@given(
    blocks=block_costs(),
    fraction=st.floats(0.05, 1.0),
    error_budget=st.sampled_from([0.0, 0.02, 0.1]),
    slots=st.sampled_from([20, 100]),
)
def test_dynamic_programme_equals_brute_force(blocks, fraction, error_budget, slots):
    inst = _instance(blocks, fraction, error_budget, slots)
    result = solve_segments(inst)
    expected = brute_force(inst, saved_outputs(blocks), selective_kept(blocks))
    if expected is None:
        assert result is None
    else:
        assert result is not None
        assert result[1] == pytest.approx(expected, abs=1e-9)


@settings(max_examples=60)
@given(blocks=block_costs(), fraction=st.floats(0.05, 1.0), slots=st.sampled_from([20, 100]))
def test_an_unbounded_error_budget_has_no_error_dimension(blocks, fraction, slots):
    """The least-peak searches for an infeasible budget's cures ask an infinite error
    budget: one error column then (not ``error_slots + 1`` columns every candidate fills with
    0), approx segments allowed, and the programme still equals the brute force."""
    inst = _instance(blocks, fraction, math.inf, slots)
    assert inst.error_budget == 0
    approx = [c for c in inst.candidates if c[2].startswith("approx:")]
    assert approx and all(c[5] == 0 for c in approx)
    result = solve_segments(inst)
    expected = brute_force(inst, saved_outputs(blocks), selective_kept(blocks))
    assert (result is None) == (expected is None)
    if result is not None:
        assert result[1] == pytest.approx(expected, abs=1e-9)


@settings(max_examples=50)
@given(
    blocks=block_costs(max_len=12),
    fraction=st.floats(0.05, 1.0),
    error_budget=st.sampled_from([0.0, 0.05]),
)
def test_dynamic_programme_equals_milp(blocks, fraction, error_budget):
    inst = _instance(blocks, fraction, error_budget, 50)
    result = solve_segments(inst)
    expected = milp_optimum(inst, saved_outputs(blocks), selective_kept(blocks))
    assert (result is None) == (expected is None)
    if result is not None:
        assert result[1] == pytest.approx(expected, rel=1e-7, abs=1e-7)


@pytest.mark.parametrize("error_budget", [0.0, 0.05])
@pytest.mark.parametrize("seed", [1])
def test_dynamic_programme_equals_milp_at_32_blocks(error_budget, seed):
    chain = make_chain(32, seed)
    for fraction in (0.2, 0.5):
        inst = _instance(chain, fraction, error_budget, 60)
        result = solve_segments(inst)
        expected = milp_optimum(inst, saved_outputs(chain), selective_kept(chain))
        assert (result is None) == (expected is None)
        if result is not None:
            assert result[1] == pytest.approx(expected, rel=1e-7, abs=1e-7)


@settings(max_examples=40)
@given(blocks=block_costs(), fraction=st.floats(0.1, 1.0))
def test_byte_exact_when_one_slot_is_one_byte(blocks, fraction):
    """With slot = 1 byte nothing is rounded: the plan's predicted peak (an event-by-event
    simulation in bytes) is within the budget, and the decomposition matches it."""
    _, store_peak = chain_totals(blocks)
    budget = max(1, int(fraction * store_peak))
    try:
        plan = solve(blocks, memory_budget=budget, slots=budget)
    except InvalidArgumentError:
        return
    assert plan.predicted_peak_bytes <= budget
    assert evaluate(blocks, plan.segments).peak_bytes == plan.predicted_peak_bytes


def test_optimal_never_worse_than_baselines():
    chain = make_chain(16, 3)
    for name in ("per-block", "sqrt", "every-4", "store"):
        base = baseline(chain, name)
        budget = base.predicted_peak_bytes
        plan = solve(chain, memory_budget=budget, slots=budget)  # one slot per byte
        assert plan.predicted_peak_bytes <= base.predicted_peak_bytes
        assert plan.predicted_overhead <= base.predicted_overhead + 1e-12
    greedy = baseline(chain, "greedy", memory_budget=0.5)
    plan = solve(chain, memory_budget=0.5, strategies=["store", "checkpoint"], slots=4000)
    assert plan.predicted_overhead <= greedy.predicted_overhead + 1e-12


def test_plan_json_round_trip_and_table(tmp_path):
    chain = make_chain(5, 4)
    plan = solve(chain, memory_budget=0.7, error_budget=0.05)
    again = Plan.from_json(plan.to_json(tmp_path / "plan.json"))
    assert again == plan
    assert Plan.from_json(tmp_path / "plan.json") == plan
    assert "| blocks | strategy |" in plan.table()
    assert len(plan.strategies) == 5


def test_parse_budget():
    assert parse_budget("2GiB", 1) == 2 * 2**30
    assert parse_budget("512 MiB", 1) == 512 * 2**20
    assert parse_budget("8GB", 1) == 8 * 10**9
    assert parse_budget("1.5e9", 1) == 1_500_000_000
    assert parse_budget(0.25, 1000) == 250
    assert parse_budget(12345, 1) == 12345
    assert parse_budget("30%", 1000) == 300
    assert parse_budget("0.3", 1000) == 300
    for bad in ("2 gigs", "GiB", "-1MiB", 1.5, 0, -3, True, None, "1.5", "8", "120%"):
        with pytest.raises(InvalidArgumentError):
            parse_budget(bad, 1000)


@pytest.mark.parametrize(
    "bad",
    [
        "1e400",
        "1e400 GiB",
        "1e308 TiB",
        "1e400%",
        "inf",
        "nan",
        "-1 MiB",
        "0",
        "0%",
        "0 GiB",
        "1e-400",
        0,
        -3,
        0.0,
        -0.5,
        float("inf"),
        float("nan"),
        1e400,
    ],
)
def test_parse_budget_names_the_value_and_the_forms_it_accepts(bad):
    """Unparseable, infinite, nan, negative or zero budgets raise InvalidArgumentError (never
    OverflowError) whose message shows the value and the accepted forms."""
    with pytest.raises(InvalidArgumentError) as info:
        parse_budget(bad, 1000)
    message = str(info.value)
    assert repr(bad) in message or str(bad) in message, message
    assert "'2GiB'" in message and "'30%'" in message, message


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("error_budget", [0.0, 0.05])
def test_infeasible_budget_names_the_smallest_budget_that_works(seed, error_budget):
    blocks = make_chain(10, seed)
    with pytest.raises(InvalidArgumentError, match=r"smallest budget a plan fits") as info:
        solve(blocks, memory_budget=1, error_budget=error_budget)
    named = info.value.smallest_budget_bytes
    plan = solve(blocks, memory_budget=named, error_budget=error_budget)  # the advice works
    assert plan.predicted_peak_bytes <= named
    with pytest.raises(InvalidArgumentError):  # and it is the smallest, to 2%
        solve(blocks, memory_budget=int(named * 0.98), error_budget=error_budget)


def test_allowing_approx_never_raises_the_smallest_budget_of_a_profiled_resnet():
    """The chain of the report (a profiled ResNet of 7 blocks, BatchNorm and dropout): with
    approx allowed the smallest budget named was 630,152 bytes, without 624,968, and a solve
    with approx at 624,968 succeeded."""
    import torch
    from torch import nn
    from torch.nn import functional as F

    from revckpt.schedule import profile

    class Res(nn.Module):
        def __init__(self, c: int) -> None:
            super().__init__()
            self.c1, self.b1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
            self.c2, self.b2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
            self.drop = nn.Dropout(0.1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.drop(F.relu(self.b1(self.c1(x))))
            return F.relu(x + self.b2(self.c2(h)))

    class Down(nn.Module):
        def __init__(self, ci: int, co: int) -> None:
            super().__init__()
            self.c, self.b = nn.Conv2d(ci, co, 3, stride=2, padding=1), nn.BatchNorm2d(co)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.relu(self.b(self.c(x)))

    torch.manual_seed(0)
    head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))
    chain = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), Res(8), Res(8), Down(8, 16), Res(16), Res(16), head
    )
    prof = profile(chain, torch.randn(8, 3, 16, 16), codecs=("bf16", "e4m3"), repeats=1)
    named = []
    for error_budget in (0.0, 0.05):
        with pytest.raises(InvalidArgumentError) as info:
            solve(prof, memory_budget=1000, error_budget=error_budget)
        named.append(info.value.smallest_budget_bytes)
    assert named[1] <= named[0], named


def test_strategies_that_cannot_cover_the_chain():
    blocks = make_chain(6, 3)
    with pytest.raises(InvalidArgumentError, match="choose at least one"):
        solve(blocks, memory_budget=1.0, strategies=[])
    if not all(b.invertible for b in blocks):
        with pytest.raises(InvalidArgumentError, match="cannot run with strategies"):
            solve(blocks, memory_budget=1.0, strategies=["reversible"])


def test_bad_input():
    with pytest.raises(InvalidArgumentError, match="no blocks"):
        solve([], memory_budget=100)
    blocks = [BlockCost(1.0, 2.0, 10, 10, 10, 30, 15, 20)]
    with pytest.raises(InvalidArgumentError, match="not available"):
        solve(blocks, memory_budget=1.0, strategies=["reversible"])
    with pytest.raises(InvalidArgumentError, match="cannot read the memory budget"):
        solve(blocks, memory_budget="lots")
    with pytest.raises(InvalidArgumentError, match="not invertible"):
        evaluate(blocks, [Segment(0, 1, "reversible")])
    assert math.isfinite(solve(blocks, memory_budget=1.0).predicted_overhead)


@pytest.mark.parametrize("error_budget", [0.0, 1e-4])
def test_only_approx_strategies_over_the_error_budget_name_the_error_that_works(error_budget):
    # the cause is the error budget, not the memory: the message names the error a plan of
    # these strategies has, and that error budget then plans
    blocks = make_chain(6, 1)
    with pytest.raises(InvalidArgumentError, match="keeps the predicted gradient error") as info:
        solve(blocks, memory_budget=1.0, error_budget=error_budget, strategies=["approx:e4m3"])
    message = str(info.value)
    assert "fits even twice" not in message and "'store', 'checkpoint'" in message
    named = float(message.split("Pass error_budget=")[1].split()[0])
    assert named > error_budget
    plan = solve(blocks, memory_budget=1.0, error_budget=named, strategies=["approx:e4m3"])
    assert set(plan.strategies) == {"approx:e4m3"} and plan.predicted_error <= named


def test_a_whole_step_profile_prices_the_overhead_against_the_whole_step():
    # fit's profiles carry the chain's share of the step's time: the same seconds of
    # recompute are a smaller share of a step that does more than the chain
    blocks = tuple(make_chain(6, 2))
    names = tuple(f"b{i}" for i in range(6))
    step = StepCosts(before_peak=0, held=0, head=0, backward_held=0, after=0)
    whole = solve(Profile(blocks, names, None, step=step), memory_budget=0.6)
    half = dataclasses.replace(step, chain_share=0.5)
    shared = solve(Profile(blocks, names, None, step=half), memory_budget=0.6)
    assert shared.segments == whole.segments and whole.predicted_overhead > 0
    assert shared.predicted_overhead == pytest.approx(whole.predicted_overhead / 2)
    assert shared.predicted_peak_bytes == whole.predicted_peak_bytes
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(InvalidArgumentError, match="chain_share"):
            dataclasses.replace(step, chain_share=bad)


@pytest.mark.parametrize("seed", range(6))
def test_the_largest_phase_of_a_plan_is_its_predicted_peak(seed):
    rng = random.Random(seed)
    blocks = make_chain(8, seed)
    step = StepCosts(*(rng.randint(0, 4 * blocks[0].input_bytes) for _ in range(5)))
    for budget in (1.0, 0.6, 0.3):
        try:
            plan = solve(Profile(tuple(blocks), names_of(8), None, step=step), memory_budget=budget)
        except InvalidArgumentError:
            continue
        phases = peak_phases(blocks, plan.segments, step)
        assert set(phases) == {"before", "blocks", "head", "after"}
        peak = max(sum(parts.values()) for parts in phases.values())
        assert peak == evaluate(blocks, plan.segments, step=step).peak_bytes


def names_of(n):
    return tuple(f"b{i}" for i in range(n))


def test_a_solve_at_the_named_smallest_budget_finds_a_plan_where_the_search_finds_none(
    monkeypatch,
):
    """At exactly the smallest budget named, the time search can miss every plan (its byte
    slots round the least-peak plan out, and the relaxation's fastest plan is a few bytes
    over): the least-peak plan, found without the times, is the answer there."""
    from revckpt.schedule import solver

    blocks = make_chain(10, 0)
    with pytest.raises(InvalidArgumentError) as info:
        solve(blocks, memory_budget=1)
    named = info.value.smallest_budget_bytes
    monkeypatch.setattr(solver, "_search", lambda problem, budget, slots: None)
    plan = solve(blocks, memory_budget=named)
    assert plan.predicted_peak_bytes == named


@pytest.mark.parametrize(("n", "seed"), [(10, 29), (16, 7), (24, 1), (24, 36)])
def test_an_approx_cure_followed_finds_its_plan(n, seed):
    # the programme counts each approx segment's squared error in whole slots, rounded up: the
    # error budget a cure names leaves room for that (naming the plan's error plus 0.1%, as
    # before, missed on these chains), and a solve at the cure's peak with it finds a plan
    blocks = make_chain(n, seed)
    with pytest.raises(InvalidArgumentError) as info:
        solve(blocks, memory_budget=1)
    found = re.search(
        r"fits [^(]+\(([0-9,]+) bytes; pass error_budget=([0-9.e-]+)", str(info.value)
    )
    assert found, str(info.value)
    peak, named = int(found.group(1).replace(",", "")), float(found.group(2))
    plan = solve(blocks, memory_budget=peak, error_budget=named)
    assert plan.predicted_peak_bytes <= peak and plan.predicted_error <= named
