"""revckpt.report: the scheduler's predicted peak against the measured one on the built-in
models, and the Report's table, JSON and plot."""

import contextlib
import dataclasses
import json
import re

import pytest
import torch
from torch import nn

from revckpt import InvalidArgumentError
from revckpt.models import gpt_like, mlp_chain, revnet_like
from revckpt.report import measure_peak, report
from revckpt.schedule import Segment, apply, baseline, make_plan, profile, solve


def _plans(prof):
    n = len(prof.blocks)
    plans = [baseline(prof, name) for name in ("per-block", "sqrt", "every-2")]
    # a stored and checkpointed mix whatever the solver picks (its picks follow the timings)
    plans.append(make_plan(prof, [Segment(0, n // 2, "store"), Segment(n // 2, n, "checkpoint")]))
    for fraction in (0.75, 0.5, 0.3):
        for error_budget in (0.0, 0.02):
            with contextlib.suppress(InvalidArgumentError):  # below what any plan reaches
                plans.append(solve(prof, memory_budget=fraction, error_budget=error_budget))
    return plans


@pytest.mark.parametrize(
    "make",
    [
        lambda: (gpt_like(6, 32, 2), torch.randn(2, 32, 32)),
        lambda: (revnet_like((2, 2), (8, 16)), torch.randn(4, 3, 16, 16)),
        lambda: (mlp_chain(6, 64, 256), torch.randn(64, 64)),
    ],
    ids=["gpt", "revnet", "mlp"],
)
def test_measured_peak_within_five_percent_of_prediction_and_budget(make):
    torch.manual_seed(0)
    chain, x = make()
    prof = profile(chain, x, repeats=1)
    plans = _plans(prof)
    for plan in plans:
        peak = measure_peak(apply(chain, plan), x)
        ratio = peak / plan.predicted_peak_bytes
        assert 0.95 <= ratio <= 1.05, (plan.name, plan.strategies, ratio)
        if plan.memory_budget_bytes is not None:
            assert peak <= 1.05 * plan.memory_budget_bytes, (plan.strategies, peak)


def test_revnet_plans_use_reversible_units_and_fit():
    torch.manual_seed(0)
    chain, x = revnet_like((3,), (16,)), torch.randn(4, 3, 16, 16)
    prof = profile(chain, x, repeats=1, codecs=())
    assert [b.invertible for b in prof.blocks] == [False, True, True, True, False]
    exact_only = _smallest_budget(prof, ["store", "checkpoint"])
    budget = int(0.97 * exact_only)  # below anything store and checkpoint reach
    plan = solve(prof, memory_budget=budget)
    assert "reversible" in plan.strategies
    peak = measure_peak(apply(chain, plan), x)
    assert abs(peak / plan.predicted_peak_bytes - 1) <= 0.05 and peak <= budget


def _smallest_budget(prof, strategies):
    """The smallest budget solve accepts with ``strategies`` (from its infeasibility error)."""
    with pytest.raises(InvalidArgumentError, match="smallest budget a plan fits") as info:
        solve(prof, memory_budget=1, strategies=strategies)
    found = re.search(r"fits is [^(]*\(([\d,]+) bytes", str(info.value))
    assert found is not None
    return int(found.group(1).replace(",", ""))


def test_measure_peak_restores_gradients():
    chain, x = mlp_chain(2, 16, 32), torch.randn(8, 16)
    assert all(p.grad is None for p in chain.parameters())
    measure_peak(chain, x)
    assert all(p.grad is None for p in chain.parameters())
    g = torch.ones_like(chain[0].fc1.weight)
    chain[0].fc1.weight.grad = g
    measure_peak(chain, x)
    assert chain[0].fc1.weight.grad is g


def test_report_table_json_plot(tmp_path):
    pytest.importorskip("matplotlib")
    torch.manual_seed(0)
    chain, x = mlp_chain(4, 32, 128, norm="layer"), torch.randn(32, 32)
    prof = profile(chain, x, repeats=1, codecs=("e4m3",))
    n = len(chain)
    plans = [
        solve(prof, memory_budget=0.6, error_budget=0.05),
        baseline(prof, "per-block"),
        baseline(prof, "sqrt"),
        make_plan(prof, [Segment(i, i + 1, "approx:e4m3") for i in range(n)], name="e4m3"),
    ]
    rep = report(chain, x, plans, repeats=2)
    assert rep.names == ["store-all", "optimal", "per-block", "sqrt", "e4m3"]
    assert rep.chosen == "optimal"
    store = rep.row("store-all")
    assert store.time_ratio == 1.0
    assert store.gradient_error < 1e-5  # float32 round-off against float64
    assert rep.row("per-block").measured_peak_bytes < store.measured_peak_bytes
    assert rep.row("per-block").gradient_error < 1e-5  # exact strategy
    fp8 = rep.row("e4m3")
    assert fp8.gradient_error > 1e-3  # fp8 boundaries: a visible error ...
    assert 0.5 < fp8.predicted_error / fp8.gradient_error < 2  # ... that was predicted
    assert fp8.measured_retained_bytes < rep.row("per-block").measured_retained_bytes
    assert "| optimal (chosen) |" in rep.table()
    # the predicted column is a time ratio as the measured one beside it (store-all: 1.000)
    header, _, first = rep.table().splitlines()[:3]
    assert "| predicted time |" in header and first.split(" | ")[8] == "1.000"
    data = json.loads(rep.to_json(tmp_path / "r.json"))
    assert data["format"] == "revckpt.Report/1"
    assert [r["name"] for r in data["rows"]] == rep.names
    assert json.loads((tmp_path / "r.json").read_text()) == data
    assert set(rep.pareto()) <= set(rep.names) and rep.pareto()
    for png in (rep.plot(tmp_path / "front.png"), rep.plot_errors(tmp_path / "errors.png")):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert png.stat().st_size > 10_000


def test_report_bad_input():
    chain, x = mlp_chain(2, 8, 16), torch.randn(4, 8)
    prof = profile(chain, x, repeats=1, codecs=())
    plan = baseline(prof, "per-block")
    with pytest.raises(InvalidArgumentError, match="at least one plan"):
        report(chain, x, [])
    with pytest.raises(InvalidArgumentError, match="distinct"):
        report(chain, x, [plan, plan])
    with pytest.raises(InvalidArgumentError, match="distinct"):
        report(chain, x, [dataclasses.replace(plan, name="store-all")])
    with pytest.raises(InvalidArgumentError, match="non-empty"):
        report([], x, [plan])


def _segment_plans(prof, n):
    from revckpt.schedule import Segment
    from revckpt.schedule.solver import _plan

    plans = []
    for codec in ("bf16", "e4m3", "e5m2"):
        s = "approx:" + codec
        for name, segs in (
            ("every", [Segment(i, i + 1, s) for i in range(n)]),
            ("first-half", [Segment(0, n // 2, s), Segment(n // 2, n, "store")]),
            ("second-half", [Segment(0, n // 2, "store"), Segment(n // 2, n, s)]),
        ):
            plans.append(
                _plan(prof, prof.blocks, segs, name=f"{name}-{codec}", budget=None, error_budget=1)
            )
    return plans


@pytest.mark.parametrize(
    ("make", "low", "high"),
    [
        (lambda: (gpt_like(8, 32, 2), torch.randn(4, 32, 32)), 0.8, 1.25),
        # ReLU kinks in the RevNet branches: long compressed segments are underestimated
        (lambda: (revnet_like((3, 3), (8, 16)), torch.randn(8, 3, 16, 16)), 0.4, 2.0),
    ],
    ids=["gpt", "revnet"],
)
def test_predicted_gradient_error_of_approx_plans_matches_measured(make, low, high, capsys):
    torch.manual_seed(0)
    chain, x = make()
    prof = profile(chain, x, repeats=1, policies=(), codecs=("bf16", "e4m3", "e5m2"))
    rep = report(chain, x, _segment_plans(prof, len(chain)), repeats=1)
    ratios = {
        r.name: r.predicted_error / r.gradient_error for r in rep.rows if r.name != "store-all"
    }
    with capsys.disabled():
        print(f"\npredicted/measured error: {min(ratios.values()):.2f}-{max(ratios.values()):.2f}")
    for name, ratio in ratios.items():
        assert low <= ratio <= high, (name, ratio)


def test_measurements_leave_batchnorm_statistics_alone():
    torch.manual_seed(0)
    chain, x = revnet_like((1,), (8,)), torch.randn(4, 3, 8, 8)
    before = {k: v.clone() for k, v in chain.state_dict().items()}
    prof = profile(chain, x, repeats=1, codecs=())
    report(chain, x, [baseline(prof, "per-block")], repeats=1)
    measure_peak(chain, x)
    for k, v in chain.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_report_with_an_embedding_first_block():
    torch.manual_seed(0)
    chain = torch.nn.Sequential(torch.nn.Embedding(50, 16), *mlp_chain(2, 16, 32))
    tokens = torch.randint(0, 50, (4, 8))
    prof = profile(chain, tokens, repeats=1, codecs=())
    rep = report(chain, tokens, [baseline(prof, "per-block")], repeats=1)
    assert rep.row("per-block").gradient_error < 1e-5


@pytest.mark.parametrize(
    "make",
    [
        lambda: (gpt_like(6, 32, 2), torch.randn(2, 32, 32)),
        lambda: (revnet_like((2, 2), (8, 16)), torch.randn(4, 3, 16, 16)),
    ],
    ids=["gpt", "revnet"],
)
def test_offload_plans_within_five_percent(make):
    """Offload segments on the CPU (the host is the device: the boundaries stay, measured as
    such by profile), alone and between other strategies."""
    torch.manual_seed(0)
    chain, x = make()
    n = len(chain)
    prof = profile(chain, x, repeats=1, codecs=("e4m3",), policies=(), offload=True)
    assert [b.offload.kept_bytes for b in prof.blocks] == [b.input_bytes for b in prof.blocks]
    plans = [
        make_plan(prof, [Segment(0, n, "offload")]),
        make_plan(prof, [Segment(0, 2, "store"), Segment(2, n, "offload")]),
        make_plan(prof, [Segment(0, 3, "offload"), Segment(3, n, "checkpoint")]),
        make_plan(
            prof,
            [Segment(0, 1, "checkpoint"), Segment(1, 3, "approx:e4m3"), Segment(3, n, "offload")],
        ),
    ]
    for plan in plans:
        ratio = measure_peak(apply(chain, plan), x) / plan.predicted_peak_bytes
        assert 0.95 <= ratio <= 1.05, (plan.strategies, ratio)


def test_measure_peak_leaves_the_rng_and_the_callers_keyword_tensors_alone_under_no_grad():
    from revckpt.report import measure_peak

    class Biased(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.drop = nn.Dropout(0.5)

        def forward(self, x, bias):
            return self.drop(self.lin(x)) + bias

    model, x = Biased(), torch.randn(4, 8)
    prompt, w = torch.zeros(8, requires_grad=True), torch.ones(8, requires_grad=True)
    state = torch.get_rng_state()
    peak = measure_peak(model, x, kwargs={"bias": prompt})
    assert torch.equal(torch.get_rng_state(), state)
    assert prompt.grad is None
    with torch.no_grad():
        assert measure_peak(model, x, kwargs={"bias": prompt}) == peak
    measure_peak(model, x, kwargs={"bias": w * 2})  # through the caller's graph: cut
    assert w.grad is None


def test_measure_peak_of_a_step_that_trains_nothing_is_refused():
    from revckpt.report import measure_peak

    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 4)).requires_grad_(False)
    with pytest.raises(InvalidArgumentError, match="does not require grad"):
        measure_peak(model, torch.tensor([[1, 2]]))
