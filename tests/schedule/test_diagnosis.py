"""An infeasible budget is answered with the smallest budget that works and with the cures that
would lower it, each one checked: no cure is named that would not help."""

import re

import pytest
import torch
from torch import nn

from revckpt import InvalidArgumentError
from revckpt.layers import ReversibleUnit, reversible_mlp_block
from revckpt.models import mlp_chain, rev_gpt_like
from revckpt.schedule import profile, solve


def _bytes_after(message, marker):
    found = re.search(re.escape(marker) + r"[^(]*\(([\d,]+) bytes", message)
    assert found is not None, message
    return int(found.group(1).replace(",", ""))


def _refusal(prof, **options):
    with pytest.raises(InvalidArgumentError, match="no plan fits") as info:
        solve(prof, memory_budget=0.02, **options)
    return str(info.value)


@pytest.fixture(
    scope="module",
    params=[
        lambda: (rev_gpt_like(4, 32, 2), torch.randn(2, 16, 32)),
        lambda: (
            nn.Sequential(*(ReversibleUnit(reversible_mlp_block(16, 32)) for _ in range(4))),
            torch.randn(64, 32),
        ),
    ],
    ids=["rev-gpt", "rev-mlp"],
)
def reversible_chain(request):
    torch.manual_seed(0)
    chain, x = request.param()
    return profile(chain, x, repeats=1, codecs=("e4m3",))


def test_without_reversible_the_cure_named_is_a_reversible_segment(reversible_chain):
    message = _refusal(reversible_chain, strategies=["store", "checkpoint"])
    assert "allow ['reversible']" in message
    assert "make blocks reversible" not in message  # they are
    smallest = _bytes_after(message, "smallest budget a plan fits is")
    cured = _bytes_after(message, "a plan then fits")
    assert cured < smallest
    plan = solve(reversible_chain, memory_budget=cured)  # the cure works
    assert "reversible" in plan.strategies and plan.predicted_peak_bytes <= cured


@pytest.mark.parametrize("error_budget", [0.0, 0.05])
def test_all_reversible_names_only_what_helps(reversible_chain, error_budget):
    """Reversible units keep nothing: approx boundaries or a larger error budget would not
    lower the smallest budget, so neither is named; the smallest budget is, and it works."""
    message = _refusal(reversible_chain, error_budget=error_budget)
    for wrong in ("approx boundaries", "error budget above 0", "larger error budget", "allow ["):
        assert wrong not in message, message
    smallest = _bytes_after(message, "smallest budget a plan fits is")
    plan = solve(reversible_chain, memory_budget=smallest, error_budget=error_budget)
    assert plan.predicted_peak_bytes <= smallest
    with pytest.raises(InvalidArgumentError):
        solve(reversible_chain, memory_budget=int(smallest * 0.99), error_budget=error_budget)


def test_plain_blocks_name_approx_and_reversible_blocks_and_the_approx_cure_works():
    torch.manual_seed(0)
    prof = profile(mlp_chain(8, 128, 32), torch.randn(64, 128), repeats=1, codecs=("e4m3",))
    message = _refusal(prof)
    assert "make blocks reversible (revckpt.layers.ReversibleUnit" in message
    assert "allow approx boundaries" in message
    cured = _bytes_after(message, "allow approx boundaries")
    error = float(re.search(r"error_budget=([0-9.e+-]+)\)", message).group(1))
    plan = solve(prof, memory_budget=cured, error_budget=error)
    assert plan.predicted_peak_bytes <= cured and plan.predicted_error <= error


def test_an_error_budget_that_already_allows_approx_names_the_strategies_not_the_budget():
    torch.manual_seed(0)
    prof = profile(mlp_chain(8, 128, 32), torch.randn(64, 128), repeats=1, codecs=("e4m3",))
    message = _refusal(prof, error_budget=1.0, strategies=["store", "checkpoint"])
    assert "pass error_budget" not in message, message  # 1.0 is more than the plan needs
    assert "allow ['approx:e4m3']: a plan with them fits" in message, message
    cured = _bytes_after(message, "allow ['approx:e4m3']")
    plan = solve(prof, memory_budget=cured, error_budget=1.0)  # the cure works
    assert "approx:e4m3" in plan.strategies and plan.predicted_peak_bytes <= cured


def test_strategies_given_with_approx_name_the_error_budget_that_rules_it_out():
    # strategies=["store", "approx:e4m3"] and an error budget below e4m3's: the cure is the
    # error budget (the message named only strategies left out), and it works
    torch.manual_seed(0)
    prof = profile(mlp_chain(8, 128, 32), torch.randn(64, 128), repeats=1, codecs=("e4m3",))
    message = _refusal(prof, error_budget=1e-6, strategies=["store", "approx:e4m3"])
    assert "raise error_budget to" in message, message
    cured = _bytes_after(message, "with the strategies given, a plan")
    error = float(re.search(r"raise error_budget to ([0-9.e+-]+):", message).group(1))
    plan = solve(prof, memory_budget=cured, error_budget=error, strategies=["store", "approx:e4m3"])
    assert plan.predicted_peak_bytes <= cured and "approx:e4m3" in plan.strategies
