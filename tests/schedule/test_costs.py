"""revckpt.schedule.costs: the cost model's identities, on a profiled chain (what a plan's
predictions are made of: kept bytes, recompute time, error, peak)."""

import math

import pytest
import torch

from revckpt import InvalidArgumentError
from revckpt.models import mlp_chain
from revckpt.schedule import Segment, profile
from revckpt.schedule.costs import BlockCost, chain_totals, evaluate, segment_cost


@pytest.fixture(scope="module")
def blocks():
    torch.manual_seed(0)
    chain, x = mlp_chain(4, 16, 64), torch.randn(32, 16)
    return profile(chain, x, repeats=1, policies=()).blocks


def test_store_all_costs_nothing_and_is_the_chain_total(blocks):
    ev = evaluate(blocks, [Segment(0, 4, "store")])
    base, store_peak = chain_totals(blocks)
    assert ev.overhead_s == 0 and ev.error == 0
    assert ev.peak_bytes == store_peak
    assert base == pytest.approx(sum(b.forward_s + b.backward_s for b in blocks))


def test_one_block_checkpoints_cost_their_own_overheads(blocks):
    ev = evaluate(blocks, [Segment(i, i + 1, "checkpoint") for i in range(4)])
    assert ev.overhead_s == pytest.approx(sum(b.strategy_overhead_s["checkpoint"] for b in blocks))
    assert ev.error == 0


def test_a_longer_segment_costs_its_head_and_the_chained_blocks(blocks):
    cost = segment_cost(blocks, Segment(1, 4, "checkpoint"))
    head = blocks[1].strategy_overhead_s["checkpoint"]
    assert cost.time == pytest.approx(head + sum(b.chained_s for b in blocks[2:]))


def test_a_checkpoint_segment_keeps_its_input_only(blocks):
    for j, k in [(1, 2), (1, 3), (2, 4)]:
        assert segment_cost(blocks, Segment(j, k, "checkpoint")).kept == blocks[j].input_bytes


def test_checkpointing_keeps_less_than_storing(blocks):
    stored = segment_cost(blocks, Segment(1, 3, "store")).kept
    checkpointed = segment_cost(blocks, Segment(1, 3, "checkpoint")).kept
    assert checkpointed < stored
    assert stored >= sum(b.saved_bytes for b in blocks[1:3])


def test_approx_errors_add_in_quadrature(blocks):
    codec = next(c for c, a in blocks[0].approx.items() if a.param_grad_error is not None)
    strategy = f"approx:{codec}"
    one = [segment_cost(blocks, Segment(i, i + 1, strategy)).error for i in (1, 2)]
    ev = evaluate(
        blocks,
        [
            Segment(0, 1, "store"),
            Segment(1, 2, strategy),
            Segment(2, 3, strategy),
            Segment(3, 4, "store"),
        ],
    )
    assert all(e > 0 for e in one)
    assert ev.error == pytest.approx(math.sqrt(sum(e * e for e in one)))


def test_segments_must_cover_the_chain_in_order(blocks):
    with pytest.raises(InvalidArgumentError):
        evaluate(blocks, [Segment(0, 2, "store")])
    with pytest.raises(InvalidArgumentError):
        evaluate(blocks, [Segment(0, 2, "store"), Segment(1, 4, "store")])


def test_a_reversible_stack_costs_its_first_block_alone_and_the_others_inside():
    from dataclasses import replace

    from reference import timed_block

    def block(head: float, inside: float | None) -> BlockCost:
        overhead = {"reversible": head}
        return timed_block(
            1.0, 2.0, invertible=True, strategy_overhead_s=overhead, stacked_s=inside
        )

    part = [block(5.0, 2.0), block(6.0, 3.0), block(7.0, None)]
    # the first block's stack of one, then inside: measured, else its stack of one
    assert segment_cost(part, Segment(0, 3, "reversible")).time == pytest.approx(5 + 3 + 7)
    assert segment_cost([replace(part[0], stacked_s=None)], Segment(0, 1, "reversible")).time == 5
