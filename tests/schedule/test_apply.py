"""profile -> solve -> apply on real modules: same gradients, same state_dict, clear errors."""

import copy

import pytest
import torch
from torch import nn

from revckpt import InvalidArgumentError, MemoryMeter
from revckpt.layers import ReversibleUnit, reversible_mlp_block
from revckpt.models import mlp_chain
from revckpt.schedule import Plan, Segment, apply, baseline, profile, solve


def _grads(model, x):
    for p in model.parameters():
        p.grad = None
    model(x).sum().backward()
    return [p.grad.clone() for p in model.parameters()]


def test_profile_measures_every_block():
    chain = mlp_chain(3, 32, 64)
    prof = profile(chain, torch.randn(16, 32), repeats=2, codecs=("bf16", "e4m3", "e5m2"))
    assert len(prof.blocks) == 3 and prof.names == ("0", "1", "2")
    b = prof.blocks[0]
    assert b.input_bytes == 16 * 32 * 4 and b.output_bytes == 16 * 32 * 4
    # the ReLU output (16x64), saved by ReLU and fc2 (fc1 saves the block input, not counted)
    assert b.saved_bytes == 16 * 64 * 4
    assert b.forward_peak_bytes >= b.saved_bytes + b.output_bytes
    assert b.output_bytes <= b.forward_peak_nograd_bytes <= b.forward_peak_bytes
    assert b.forward_s > 0 and b.backward_s > 0
    assert set(b.approx) == {"bf16", "e4m3", "e5m2"}
    assert b.approx["e4m3"].kept_bytes < b.approx["bf16"].kept_bytes < b.input_bytes
    errors = {c: a.param_grad_error for c, a in b.approx.items()}
    assert 0 < errors["bf16"] < errors["e4m3"] < errors["e5m2"]
    assert not b.invertible
    assert "| 0 |" in prof.table()
    assert all(p.grad is None for p in chain.parameters())


def test_applied_plan_shares_parameters_keeps_keys_and_gradients():
    chain = mlp_chain(6, 32, 64)
    x = torch.randn(16, 32)
    prof = profile(chain, x, repeats=1, codecs=())
    plan = solve(prof, memory_budget=baseline(prof, "sqrt").predicted_peak_bytes)
    assert "checkpoint" in plan.strategies
    model = apply(chain, plan)
    assert list(model.state_dict()) == list(chain.state_dict())
    assert all(a is b for a, b in zip(model.parameters(), chain.parameters(), strict=True))
    reference = _grads(copy.deepcopy(chain), x)
    assert all(torch.equal(a, b) for a, b in zip(_grads(model, x), reference, strict=True))


def test_plan_with_reversible_units():
    torch.manual_seed(0)
    chain = nn.Sequential(*(ReversibleUnit(reversible_mlp_block(16, 32)) for _ in range(4)))
    x = torch.randn(256, 32)  # activations outweigh parameter gradients
    prof = profile(chain, x, repeats=1, codecs=())
    assert all(b.invertible for b in prof.blocks)
    # without checkpoint, whose measured time may beat reversible's on this machine
    plan = solve(prof, memory_budget=0.5, strategies=["store", "reversible"])
    assert "reversible" in plan.strategies
    model = apply(chain, plan)
    reference = _grads(copy.deepcopy(chain), x)
    got = _grads(model, x)
    for a, b in zip(got, reference, strict=True):  # float32 round-off of the rebuilt inputs
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * float(b.abs().max()))
    xx = x.clone().requires_grad_()
    with MemoryMeter("cpu") as m:
        y = model(xx)
    rev_only = Plan.from_dict({**plan.to_dict(), "segments": [[0, 4, "reversible"]]})
    with MemoryMeter("cpu") as m_rev:
        y2 = apply(chain, rev_only)(xx)
    # its output, and the default inverse check's 2 x 64 sampled elements of the stack input
    assert y2.numel() * 4 <= m_rev.end_bytes <= y2.numel() * 4 + 2 * 64 * 4
    assert m_rev.end_bytes <= m.end_bytes
    del y, y2


def test_input_signature_mismatch_raises():
    chain = mlp_chain(2, 16, 32)
    prof = profile(chain, torch.randn(8, 16), repeats=1, codecs=())
    model = apply(chain, solve(prof, memory_budget=1.0))
    with pytest.raises(InvalidArgumentError, match="profiled on inputs of shape"):
        model(torch.randn(16, 16))  # a larger batch: the predictions would not hold
    with pytest.raises(InvalidArgumentError, match="profiled on inputs of shape"):
        model(torch.randn(8, 16).double())
    model(torch.randn(4, 16))  # a smaller (last) batch is fine
    with torch.no_grad():
        model(torch.randn(32, 16))  # so is any input without a backward (evaluation)


def test_a_plan_is_applied_to_the_blocks_it_was_profiled_on_only():
    chain = mlp_chain(3, 16, 32)
    plan = baseline(profile(chain, torch.randn(4, 16), repeats=1, codecs=()), "per-block")
    plan = Plan.from_json(plan.to_json())  # the digest travels with the plan
    wider = mlp_chain(3, 16, 128)  # same count and input, other blocks: other predictions
    with pytest.raises(InvalidArgumentError, match="not those of the chain the plan was"):
        apply(wider, plan)
    with pytest.raises(InvalidArgumentError, match="not those of the chain the plan was"):
        apply(copy.deepcopy(chain).double(), plan)
    apply(copy.deepcopy(chain), plan)(torch.randn(4, 16)).sum().backward()  # a copy is fine
    apply(list(chain), plan)  # and a list of the same blocks
    apply([torch.compile(b) for b in chain], plan)  # and the blocks compiled (_orig_mod.)
    older = Plan.from_dict({**plan.to_dict(), "blocks_digest": None})  # plans made before
    apply(wider, older)


def test_bad_plans_and_inputs():
    chain = mlp_chain(3, 16, 32)
    prof = profile(chain, torch.randn(4, 16), repeats=1, codecs=())
    plan = baseline(prof, "per-block")
    with pytest.raises(InvalidArgumentError, match="covers 3 blocks but the chain has 2"):
        apply(mlp_chain(2, 16, 32), plan)
    bad = Plan.from_dict({**plan.to_dict(), "segments": [[0, 3, "reversible"]]})
    with pytest.raises(InvalidArgumentError, match="not ReversibleUnit"):
        apply(chain, bad)
    with pytest.raises(InvalidArgumentError, match="non-empty chain"):
        profile([], torch.randn(2))
    with pytest.raises(InvalidArgumentError, match="not a revckpt plan"):
        Plan.from_dict({"segments": []})
    assert Segment(0, 1, "store") == Segment(0, 1, "store")


def test_an_applied_plan_walks_its_segments_modules_once_not_every_step(monkeypatch):
    """Each multi-block segment of an applied plan is one recompute node over one container:
    built per call (a list of blocks), its layout was walked again in every step."""
    import revckpt._module_state as module_state
    from revckpt.models import gpt_like
    from revckpt.schedule import Segment, apply, make_plan, profile

    torch.manual_seed(0)
    chain, x = gpt_like(4, 32, 2), torch.randn(2, 16, 32)
    prof = profile(chain, x, codecs=("e4m3",), policies=())
    built = [0]
    real = module_state._Layout

    class Layout(real):
        def __init__(self, root):
            built[0] += 1
            super().__init__(root)

    monkeypatch.setattr(module_state, "_Layout", Layout)
    segments = [Segment(0, 2, "approx:e4m3"), Segment(2, 4, "checkpoint")]
    model = apply(chain, make_plan(prof, segments))
    model(x).pow(2).mean().backward()  # the first step learns
    built[0] = 0
    for _ in range(3):
        model(x).pow(2).mean().backward()
    assert built[0] == 0
