"""verify: the plan returned fits both budgets by measurement and no measured plan within the
error budget beats it on both measured peak and measured time. Timings on this machine are
noisy, so the choice is tested as a pure function of constructed measurements, and the
end-to-end runs assert only what holds whatever the timings are."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from revckpt import InfeasibleBudgetError, InvalidArgumentError, InvalidInputTypeError
from revckpt.models import gpt_like, mlp_chain
from revckpt.report import PlanMeasurement
from revckpt.schedule import Segment, Verified, baseline, make_plan, profile, solve, verify
from revckpt.schedule.verify import _fastest_that_fits, _note

FLOOR = 2e-7  # a float32 round-off floor, as store-all measures it


def row(name, peak, time, error=FLOOR):
    return PlanMeasurement(
        name=name,
        strategies=("checkpoint",),
        measured_peak_bytes=peak,
        measured_retained_bytes=0,
        predicted_peak_bytes=peak,
        memory_budget_bytes=None,
        time_ratio=time,
        time_ratio_iqr=(time, time),
        predicted_overhead=0.0,
        gradient_error=error,
        predicted_error=0.0,
    )


def pick(rows, budget, error_budget=0.0, **options):
    return _fastest_that_fits(
        rows, memory_budget=budget, error_budget=error_budget, error_floor=FLOOR, **options
    )


def test_the_fastest_row_that_fits_both_budgets_wins():
    rows = [
        row("store-all", 1000, 1.0),
        row("solved", 300, 1.16, error=1e-3),
        row("approx bf16", 156, 1.14, error=2e-3),
        row("approx e4m3", 100, 1.05, error=3e-2),  # over the error budget
        row("sqrt", 400, 1.10),  # over the memory budget
    ]
    assert pick(rows, 350, 1e-2).name == "approx bf16"
    assert pick(rows, 350, 1e-1).name == "approx e4m3"
    assert pick(rows, 1000, 1e-2).name == "store-all"
    assert pick(rows, 350, 5e-4) is None  # exact rows are all over the memory budget


def test_exact_rows_fit_a_zero_error_budget_at_the_float32_floor():
    rows = [row("per-block", 100, 1.3, error=FLOOR), row("bf16", 100, 1.1, error=1e-3)]
    assert pick(rows, 100, 0.0).name == "per-block"
    assert pick([row("off", 100, 1.0, error=3 * FLOOR)], 100, 0.0) is None


def test_a_row_without_a_measured_error_or_time_never_wins():
    rows = [row("no error", 100, 1.0, error=math.nan), row("no time", 100, math.nan)]
    assert pick([*rows, row("measured", 100, 2.0)], 100, 1.0).name == "measured"
    assert pick(rows, 100, 1.0) is None


def test_ties_go_to_the_smaller_peak_then_to_the_preferred_row():
    rows = [row("a", 200, 1.2), row("b", 100, 1.2), row("c", 100, 1.2)]
    assert pick(rows, 200).name == "b"
    assert pick(rows, 200, prefer="c").name == "c"


@given(
    st.lists(
        st.tuples(
            st.integers(1, 20),  # peak
            st.sampled_from([1.0, 1.1, 1.2, 1.3, 1.5]),  # time (coarse: ties happen)
            st.sampled_from([FLOOR, 1e-3, 5e-3, 2e-2]),  # gradient error
        ),
        min_size=1,
        max_size=8,
    ),
    st.integers(1, 20),
)
def test_no_row_within_the_error_budget_dominates_the_winner(specs, budget):
    rows = [row(f"p{i}", *spec) for i, spec in enumerate(specs)]
    best = pick(rows, budget, 1e-2)
    fitting = [r for r in rows if r.measured_peak_bytes <= budget and r.gradient_error < 1e-2]
    assert (best is None) == (not fitting)
    if best is None:
        return
    for r in rows:
        if r.gradient_error > 1e-2:
            continue
        at_most = (
            r.measured_peak_bytes <= best.measured_peak_bytes and r.time_ratio <= best.time_ratio
        )
        assert not at_most or (r.measured_peak_bytes, r.time_ratio) == (
            best.measured_peak_bytes,
            best.time_ratio,
        )


def test_the_note_says_what_happened():
    solved, faster = row("optimal", 300, 1.36), row("checkpoint per block", 290, 1.31)
    note = _note(solved, faster, True, 5, 7, 400, 0.0, FLOOR)
    assert note == (
        "checkpoint per block measured 1.31x against the solved plan's 1.36x at no more "
        "memory; returning it"
    )
    assert "more memory but within the budget" in _note(
        solved, row("sqrt", 350, 1.2), True, 5, 7, 400, 0.0, FLOOR
    )
    assert "over the budget" in _note(row("optimal", 500, 1.0), faster, True, 5, 7, 400, 0, FLOOR)
    over = row("optimal", 300, 1.0, error=0.1)
    assert "over the error budget of 0.01" in _note(over, faster, True, 5, 7, 400, 1e-2, FLOOR)
    assert _note(solved, solved, False, 5, 7, 400, 0.0, FLOOR).startswith(
        "the solved plan was the fastest of the 5 of 7 measured plans"
    )


# -- end to end ----------------------------------------------------------------------------


def gpt():
    chain = gpt_like(4, 32, 2)
    x = torch.randn(2, 16, 32)
    return chain, x, profile(chain, x, repeats=1)


def mlp():
    chain = mlp_chain(4, 32)
    x = torch.randn(64, 32)
    return chain, x, profile(chain, x, repeats=1)


def check(v, budget, error_budget):
    """What holds whatever the timings: the winner is a measured row that fits both budgets
    by measurement, the fastest of those that do; replaced, solved and note agree."""
    assert isinstance(v, Verified)
    rep = v.report
    assert v.measured in rep.rows and rep.chosen == (v.plan.name if v.replaced else v.solved.name)
    assert v.measured.measured_peak_bytes <= budget
    assert v.measured.within_error(error_budget, floor=rep.error_floor)
    fitting = [
        r
        for r in rep.rows
        if r.measured_peak_bytes <= budget and r.within_error(error_budget, floor=rep.error_floor)
    ]
    assert v.measured.time_ratio == min(r.time_ratio for r in fitting)
    assert v.measured.name in rep.pareto()
    if v.replaced:
        assert v.plan.name == ("store" if v.measured.name == "store-all" else v.measured.name)
        assert v.plan.segments != v.solved.segments and "returning it" in v.note
        assert v.plan.memory_budget_bytes == budget
    else:
        assert v.plan is v.solved and v.note.startswith("the solved plan")


@pytest.mark.parametrize(("model", "fraction"), [(gpt, 0.5), (mlp, 0.75)])
def test_the_plan_returned_fits_by_measurement_and_is_the_fastest_that_does(model, fraction):
    chain, x, prof = model()
    plan = solve(prof, memory_budget=fraction, error_budget=1e-2)
    v = verify(chain, x, plan, prof, repeats=2)
    check(v, plan.memory_budget_bytes, 1e-2)
    assert len(v.report.rows) >= 3  # store-all, the plan and at least one recipe


def test_a_plan_over_its_budget_by_measurement_is_replaced():
    chain, x, prof = gpt()
    n = len(prof.blocks)
    stored = make_plan(prof, [Segment(0, n, "store")], name="store everything")
    budget = baseline(prof, "per-block").predicted_peak_bytes
    v = verify(chain, x, stored, prof, memory_budget=budget, repeats=2)
    assert v.replaced and v.solved is stored
    assert v.report.row("store everything").measured_peak_bytes > budget
    assert v.note.startswith("the solved plan measured") and "over the budget" in v.note
    check(v, budget, 0.0)


def test_a_plan_over_the_error_budget_by_measurement_is_replaced():
    chain, x, prof = mlp()
    n = len(prof.blocks)
    e4m3 = make_plan(prof, [Segment(i, i + 1, "approx:e4m3") for i in range(n)], name="e4m3")
    budget = max(e4m3.predicted_peak_bytes, baseline(prof, "per-block").predicted_peak_bytes)
    v = verify(chain, x, e4m3, prof, memory_budget=budget, error_budget=1e-5, repeats=2)
    assert v.replaced and "over the error budget" in v.note
    assert v.report.over_error_budget("e4m3") and "e4m3" not in v.report.pareto()
    assert not any(s.startswith("approx") for s in v.plan.strategies)
    check(v, budget, 1e-5)


def test_plans_passed_as_also_are_measured_and_named_as_given():
    chain, x, prof = mlp()
    plan = solve(prof, memory_budget=0.75)
    mine = make_plan(prof, [Segment(0, len(prof.blocks), "checkpoint")], name="one segment")
    v = verify(chain, x, plan, prof, also=[mine], repeats=2)
    assert "one segment" in v.report.names
    check(v, plan.memory_budget_bytes, 0.0)


def test_no_measured_plan_within_the_budget_raises_naming_the_least_peak():
    chain, x, prof = mlp()
    plan = solve(prof, memory_budget=0.75)
    with pytest.raises(InfeasibleBudgetError, match="least measured peak") as err:
        verify(chain, x, plan, prof, memory_budget=1, repeats=1)
    assert err.value.smallest_budget_bytes > 1


def test_bad_arguments_say_what_to_pass():
    chain, x, prof = mlp()
    plan = solve(prof, memory_budget=0.75)
    with pytest.raises(InvalidInputTypeError, match=r"plan must be a schedule\.Plan"):
        verify(chain, x, "plan", prof)
    with pytest.raises(InvalidArgumentError, match="the plan covers 4 blocks"):
        verify(chain[:2], x, plan, profile(chain[:2], x, repeats=1))
    with pytest.raises(InvalidArgumentError, match="error_budget=-1"):
        verify(chain, x, plan, prof, error_budget=-1)
