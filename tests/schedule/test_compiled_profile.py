"""profile(..., compiled=True): each strategy priced as torch.compile runs it. The plan it gives
is checked under torch.compile against the allocator meter (memory) and plain autograd in
float64 (gradients); run eagerly, it warns."""

import copy
import warnings
from collections import OrderedDict

import pytest
import torch

from revckpt import InvalidArgumentError, PlanWarning
from revckpt.measure import MemoryMeter, gradient_error
from revckpt.models import gpt_like
from revckpt.schedule import Plan, Segment, apply, make_plan, profile, solve
from revckpt.schedule import plan as plan_module
from revckpt.schedule.costs import strategy_names


def _step_peak(model, x, grad):
    """Peak bytes of one compiled training step after two warm steps (the first compiles)."""
    for _ in range(2):
        model(x.clone().requires_grad_()).backward(grad)
    with MemoryMeter("cpu", method="allocator") as meter:
        model(x.clone().requires_grad_()).backward(grad)
    return meter.peak_bytes


@pytest.fixture(scope="module")
def chain():
    torch.manual_seed(0)
    blocks, x = gpt_like(3, 64, 4), torch.randn(2, 64, 64)
    for p in blocks.parameters():
        p.grad = torch.zeros_like(p)
    torch._dynamo.reset()
    policies = ("matmul+attention", "matmul")
    return blocks, x, profile(blocks, x, repeats=3, compiled=True, policies=policies)


def test_compiled_profile_prices_store_checkpoint_selective(chain):
    _, _, prof = chain
    assert prof.compiled
    assert set(strategy_names(prof.blocks)) == {
        "store",
        "checkpoint",
        "selective:matmul+attention",
        "selective:matmul",
    }
    for b in prof.blocks:
        assert not b.invertible and not b.approx and not b.compress
        # a compiled selective block keeps less than a stored one (what, the partitioner
        # decides: recomputing attention may keep its inputs, so "matmul" is not always less)
        for policy in ("matmul", "matmul+attention"):
            assert 0 < b.selective[policy].kept_bytes < b.saved_bytes
        assert b.forward_s > 0 and b.backward_s >= 0  # (a measured difference: may read 0)
        assert set(b.strategy_overhead_s) == {
            "checkpoint",
            "selective:matmul+attention",
            "selective:matmul",
        }


@pytest.mark.parametrize("strategy", ["store", "selective:matmul+attention"])
def test_compiled_plan_holds_under_compile(chain, strategy):
    """Every block with one strategy, in one-block segments: the compiled step measures as
    the compiled profile predicts (the allocator sees a little more than the blocks measured
    alone: fusions across blocks change what is kept). Checkpoint segments are not in this
    contract: compiled as one graph, the backward may run several segments' recomputes
    before the tensors of the blocks after them are freed (docs/schedule.md, known
    limits)."""
    blocks, x, prof = chain
    grad = torch.randn_like(x)
    plan = make_plan(prof, [Segment(i, i + 1, strategy) for i in range(len(blocks))])
    assert plan.compiled
    torch._dynamo.reset()
    measured = _step_peak(torch.compile(apply(blocks, plan)), x, grad)
    assert 0.95 * plan.predicted_peak_bytes <= measured <= 1.06 * plan.predicted_peak_bytes


class Float64(torch.nn.Sequential):
    """The chain in float64, on float32 inputs (same parameter names)."""

    def forward(self, x):
        return super().forward(x.double())


def test_compiled_plan_gradients_match_float64(chain):
    blocks, x, prof = chain
    plan = solve(prof, memory_budget=0.6)
    assert any(s != "store" for s in plan.strategies)
    torch._dynamo.reset()
    model = apply(blocks, plan)
    model.compile()  # in place: the parameter names stay those of the chain
    exact = Float64(OrderedDict(copy.deepcopy(blocks).named_children())).double()
    err = gradient_error(model, exact, x.detach().requires_grad_())
    assert err.overall.rel_l2 < 1e-4


def test_compiled_plan_run_eagerly_warns(chain):
    blocks, x, prof = chain
    plan = solve(prof, memory_budget=0.6)
    plan_module._warn_eager_run.cache_clear()  # once per process: start from none
    with pytest.warns(PlanWarning, match="compiled profile"):
        apply(blocks, plan)(x.clone().requires_grad_()).sum().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process
        apply(blocks, plan)(x.clone().requires_grad_()).sum().backward()
    assert Plan.from_json(plan.to_json()).compiled


def test_compiled_profile_refuses_what_it_does_not_price(chain):
    blocks, x, _ = chain
    with pytest.raises(InvalidArgumentError, match="compiled=True prices store"):
        profile(blocks, x, compiled=True, compress=["bf16"])
    with pytest.raises(InvalidArgumentError, match="compiled=True prices store"):
        profile(blocks, x, compiled=True, offload=True)
    with pytest.raises(InvalidArgumentError, match="compiled="):
        profile(blocks, x, compiled="yes")
