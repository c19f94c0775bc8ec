"""A budget that a plan meets exactly is accepted: the solver's rounding to slots never turns
it into "no plan fits"."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_solver import make_chain

from revckpt.models import gpt_like, mlp_chain, rev_gpt_like, revnet_like
from revckpt.schedule import baseline, evaluate, profile, solve

BASELINES = ("per-block", "sqrt", "every-2", "every-3")
MODELS = {
    "gpt": lambda: (gpt_like(6, 32, 2), torch.randn(2, 16, 32)),
    "mlp": lambda: (mlp_chain(6, 32, 64, dropout=0.1), torch.randn(16, 32)),
    "revnet": lambda: (revnet_like((2, 2), (8, 16)), torch.randn(2, 3, 16, 16)),
    "rev-gpt": lambda: (rev_gpt_like(4, 32, 2), torch.randn(2, 16, 32)),
}


@pytest.fixture(scope="module", params=list(MODELS))
def prof(request):
    torch.manual_seed(0)
    chain, x = MODELS[request.param]()
    return profile(chain, x, repeats=1, codecs=("e4m3",))


@pytest.mark.parametrize(
    ("strategies", "error_budget"),
    [(["store", "checkpoint"], 0.0), (None, 0.0), (None, 0.02)],
    ids=["store+checkpoint", "all", "all+approx"],
)
def test_budget_equal_to_a_baselines_exact_peak_is_accepted(prof, strategies, error_budget):
    for name in BASELINES:
        peak = baseline(prof, name).predicted_peak_bytes
        plan = solve(prof, memory_budget=peak, strategies=strategies, error_budget=error_budget)
        assert plan.predicted_peak_bytes <= peak, (name, plan.strategies)
        assert plan.predicted_error <= error_budget * (1 + 1e-9)
        assert evaluate(prof.blocks, plan.segments).peak_bytes == plan.predicted_peak_bytes


@settings(max_examples=60, deadline=None)
@given(n=st.integers(2, 10), seed=st.integers(0, 2**32), which=st.sampled_from(BASELINES))
def test_budget_equal_to_a_plans_peak_is_accepted_on_random_chains(n, seed, which):
    blocks = make_chain(n, seed)
    peak = baseline(blocks, which).predicted_peak_bytes
    plan = solve(blocks, memory_budget=peak, strategies=["store", "checkpoint"], slots=50)
    assert plan.predicted_peak_bytes <= peak
