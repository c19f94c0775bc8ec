"""In-chain timing (revckpt.schedule.probe) with a fake clock that only the blocks advance: the
attribution of time to segments, the groups, the ratio fill and the chained cost are checked
exactly, with no real time."""

import pytest
import torch
from torch import nn

from revckpt.schedule import probe
from revckpt.schedule.costs import Segment
from revckpt.schedule.probe import CHAINED, _parts, _segments, probe_chain, timed_step, warm_up


@pytest.fixture(autouse=True)
def _cold_process(monkeypatch):
    """Every test starts as a fresh process would: no strategy warmed up yet."""
    monkeypatch.setattr(probe, "_WARM", set())


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0
        self.scale = 1.0

    def __call__(self) -> float:
        return self.now

    def tick(self, seconds: float) -> None:
        self.now += seconds * self.scale


class _Tick(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, clock, seconds):
        ctx.clock, ctx.seconds = clock, seconds
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        ctx.clock.tick(ctx.seconds)
        return g, None, None


class Ticking(nn.Module):
    """A linear block whose every forward (recomputes included) advances the clock by ``fwd``
    seconds and whose backward by ``bwd``."""

    def __init__(self, clock: FakeClock, fwd: float, bwd: float, width: int = 8) -> None:
        super().__init__()
        self.clock, self.fwd, self.bwd = clock, fwd, bwd
        self.lin = nn.Linear(width, width)

    def extra_repr(self) -> str:
        return f"fwd={self.fwd}, bwd={self.bwd}"

    def forward(self, x):
        self.clock.tick(self.fwd)
        return _Tick.apply(self.lin(x), self.clock, self.bwd)


OPTIONS = ["store", "checkpoint", "approx:bf16"]


def _chain(clock, costs):
    return [Ticking(clock, f, b) for f, b in costs]


def test_timed_step_attributes_forward_and_backward_to_each_segment():
    clock = FakeClock()
    chain = _chain(clock, [(1.0, 2.0), (3.0, 5.0), (7.0, 11.0)])
    x = torch.randn(4, 8)
    segments = [Segment(0, 1, "store"), Segment(1, 3, "checkpoint")]
    times = timed_step(chain, segments, x, torch.ones(4, 8), {}, clock=clock)
    # the checkpoint segment recomputes both of its blocks in its backward
    assert times == [(1.0, 2.0), (10.0, 10.0 + 16.0)]


def test_probe_recovers_each_groups_costs_exactly():
    clock = FakeClock()
    costs = [(1.0, 2.0)] * 6 + [(4.0, 6.0)] * 6  # two groups of identical blocks
    chain = _chain(clock, costs)
    groups = [0] * 6 + [6] * 6
    got = probe_chain(
        chain, torch.randn(4, 8), torch.ones(4, 8), {}, groups, [OPTIONS] * 12, clock=clock
    )
    assert got.forward_s == pytest.approx(tuple(f for f, _ in costs))
    assert got.backward_s == pytest.approx(tuple(b for _, b in costs))
    for (f, _), overhead, chained in zip(costs, got.overhead_s, got.chained_s, strict=True):
        # recomputing strategies re-run the forward once; the fake clock sees nothing else
        assert overhead == pytest.approx({"checkpoint": f, "approx:bf16": f})
        assert chained == pytest.approx(f)
    # the stored step, then checkpoint | approx, then chained; and the warm-up of the three
    # on the cheapest blocks (checkpoint and approx on block 0, chained on blocks 0 and 1)
    assert got.rounds == pytest.approx(3 + 12 / 78)


def test_each_strategy_warms_up_once_per_process_on_its_cheapest_block_untimed():
    clock = FakeClock()
    costs = [(2.0, 2.0)] * 3 + [(1.0, 1.0)] * 2 + [(3.0, 3.0)] * 5
    chain = _chain(clock, costs)
    seconds = [f + b for f, b in costs]
    inputs = [torch.randn(4, 8) for _ in chain]
    options = [OPTIONS] * 10
    options[3] = ["store", "checkpoint"]  # block 3 cannot run approx
    kinds = ["checkpoint", "approx:bf16", CHAINED]
    ran = []
    for b in chain:
        b.register_forward_pre_hook(lambda m, i: ran.append(m))
    # checkpoint on block 3, approx on block 4, the chained segment over blocks 3 and 4
    assert warm_up(chain, inputs, {}, kinds, options, seconds) == pytest.approx(8 / 46)
    # each block's forward and its recompute, under each of the three
    assert sorted(id(m) for m in ran) == sorted([id(chain[3])] * 4 + [id(chain[4])] * 4)
    ran.clear()
    assert warm_up(chain, inputs, {}, kinds, options, seconds) == 0.0  # warm: nothing runs
    assert ran == []
    options = [
        ["store", "checkpoint", "selective:matmul"] if i == 7 else o for i, o in enumerate(options)
    ]
    got = warm_up(chain, inputs, {}, ["checkpoint", "selective:matmul"], options, seconds)
    assert got == pytest.approx(6 / 46)  # the new kind alone, on the one block that runs it
    assert sorted(id(m) for m in ran) == [id(chain[7])] * 2


def test_the_probe_makes_the_warm_ups_inputs_where_none_are_given():
    clock = FakeClock()
    chain = _chain(clock, [(1.0, 1.0)] * 4 + [(0.5, 0.5)] * 2)
    seen = []
    chain[4].register_forward_pre_hook(lambda m, i: seen.append(i[0].detach().clone()))
    x = torch.randn(4, 8)
    got = probe_chain(chain, x, torch.ones(4, 8), {}, [0] * 4 + [4] * 2, [OPTIONS] * 6, clock=clock)
    with torch.no_grad():
        expected = x
        for b in chain[:4]:
            expected = b(expected)
    # block 4 (the cheapest) ran its warm-up from its input in the chain: checkpoint and approx
    # on it, chained over blocks 4 and 5, 4 of the step's 10 seconds; a stored step, two
    # strategy steps
    assert got.rounds == pytest.approx(3.4)
    assert torch.equal(seen[1], expected)  # after the stored step's forward: the warm-up's


def test_a_group_no_part_reached_gets_the_ratio_of_the_others():
    clock = FakeClock()
    costs = [(1.0, 1.0)] * 9 + [(10.0, 1.0)]  # the last block is its own group
    chain = _chain(clock, costs)
    groups = [0] * 9 + [9]
    got = probe_chain(
        chain,
        torch.randn(4, 8),
        torch.ones(4, 8),
        {},
        groups,
        [OPTIONS] * 10,
        parts=3,
        clock=clock,
    )
    # block 9 (a group of its own) runs approx and store only: its checkpoint overhead is the
    # other group's ratio to the forward
    assert got.overhead_s[9] == pytest.approx({"checkpoint": 10.0, "approx:bf16": 10.0})


def test_parts_cover_the_chain():
    kinds = ["store", "checkpoint", CHAINED]
    parts = _parts(7, kinds)
    assert [(a, b) for a, b, _ in parts] == [(0, 3), (3, 5), (5, 7)]  # sizes differ by one
    assert [p[2] for p in parts] == kinds
    segs = _segments(_parts(10, ["store", CHAINED]), [OPTIONS] * 10)
    assert [(s.start, s.stop, s.strategy) for s in segs] == [
        *((i, i + 1, "store") for i in range(5)),
        (5, 9, "checkpoint"),
        (9, 10, "checkpoint"),
    ]


def test_a_block_that_cannot_run_a_parts_strategy_is_checkpointed():
    segs = _segments([(0, 2, "reversible")], [["store", "checkpoint"], [*OPTIONS, "reversible"]])
    assert [s.strategy for s in segs] == ["checkpoint", "reversible"]


@pytest.mark.parametrize("pace", [0.6, 1.7])
def test_a_step_the_machine_runs_slower_or_faster_is_timed_at_the_stored_steps_pace(
    monkeypatch, pace
):
    """Load on the machine that slows (or a quiet spell that speeds) a whole strategy step is
    read off the step's stored reference part and taken out: the costs are exact."""
    clock = FakeClock()
    costs = [(1.0, 2.0)] * 6 + [(4.0, 6.0)] * 6
    chain = _chain(clock, costs)
    timed = probe.timed_step

    def at_pace(chain_, segments, *args, **kw):
        clock.scale = 1.0 if all(s.strategy == "store" for s in segments) else pace
        return timed(chain_, segments, *args, **kw)

    monkeypatch.setattr(probe, "timed_step", at_pace)
    groups = [0] * 6 + [6] * 6
    got = probe_chain(
        chain, torch.randn(4, 8), torch.ones(4, 8), {}, groups, [OPTIONS] * 12, clock=clock
    )
    # the stored times come from the strategy steps' own reference blocks: in their seconds
    assert got.forward_s == pytest.approx(tuple(f * pace for f, _ in costs))
    for f, overhead, chained in zip(got.forward_s, got.overhead_s, got.chained_s, strict=True):
        assert overhead == pytest.approx({"checkpoint": f, "approx:bf16": f})
        assert chained == pytest.approx(f)


def test_each_strategy_runs_on_two_stretches_beside_two_stored_ones(monkeypatch):
    """A burst of load over one stretch of a step leaves the strategy's other stretch: each
    strategy step lays its strategies and the stored reference along the chain twice."""
    clock = FakeClock()
    chain = _chain(clock, [(1.0, 2.0)] * 12)
    seen = []
    timed = probe.timed_step

    def record(chain_, segments, *args, **kw):
        seen.append([(s.stop - s.start, s.strategy) for s in segments])
        return timed(chain_, segments, *args, **kw)

    monkeypatch.setattr(probe, "timed_step", record)
    probe_chain(
        chain, torch.randn(4, 8), torch.ones(4, 8), {}, [0] * 12, [OPTIONS] * 12, clock=clock
    )
    stretch = [(1, "checkpoint")] * 2 + [(1, "approx:bf16")] * 2 + [(1, "store")] * 2
    assert seen[1] == stretch * 2  # seen[0]: the stored step
    # the second step puts its reference on other blocks; chained: one segment per stretch
    assert seen[2] == [*[(1, "store")] * 3, (3, "checkpoint")] * 2


@pytest.mark.parametrize("n", [3, 5, 6, 7, 12, 13, 24, 28])
def test_every_block_runs_a_strategy_in_some_step_and_short_chains_keep_a_chained_span(
    monkeypatch, n
):
    """The reference moves between the steps of a round, so no block (and no group) is only
    ever stored; stretches too short for a multi-block chained segment are not doubled."""
    clock = FakeClock()
    chain = _chain(clock, [(1.0, 2.0)] * n)
    seen = []
    timed = probe.timed_step

    def record(chain_, segments, *args, **kw):
        seen.append(list(segments))
        return timed(chain_, segments, *args, **kw)

    monkeypatch.setattr(probe, "timed_step", record)
    got = probe_chain(
        chain, torch.randn(4, 8), torch.ones(4, 8), {}, list(range(n)), [OPTIONS] * n, clock=clock
    )
    strategy_steps = seen[1:]
    for i in range(n):
        assert any(
            s.strategy != "store" for step in strategy_steps for s in step if s.start <= i < s.stop
        )
    assert any(s.stop - s.start > 1 for step in strategy_steps for s in step)
    assert all(c is not None for c in got.chained_s)


def test_a_reference_that_reads_no_time_is_no_reference(monkeypatch):
    """A clock coarser than the blocks reads 0 s for some stored blocks: the pace falls back to
    1 instead of dividing by zero."""
    clock = FakeClock()
    costs = [(1.0, 2.0)] * 12
    chain = _chain(clock, costs)
    timed = probe.timed_step

    def frozen_on_strategy_steps(chain_, segments, *args, **kw):
        clock.scale = 1.0 if all(s.strategy == "store" for s in segments) else 0.0
        return timed(chain_, segments, *args, **kw)

    monkeypatch.setattr(probe, "timed_step", frozen_on_strategy_steps)
    got = probe_chain(
        chain, torch.randn(4, 8), torch.ones(4, 8), {}, [0] * 12, [OPTIONS] * 12, clock=clock
    )
    for overhead in got.overhead_s:  # nothing measured beyond the stored times: no extra
        assert overhead == {"checkpoint": 0.0, "approx:bf16": 0.0}


class ColdClock(FakeClock):
    """A fake clock under which the first ``cold`` forwards of the chain's first step (its
    stored step) take 1.5 times as long: a process's first step, slow unevenly."""

    def __init__(self, cold: int) -> None:
        super().__init__()
        self.cold, self.ticks, self.steps = cold, 0, 0

    def tick(self, seconds: float) -> None:
        self.ticks += 1
        slow = self.steps == 1 and self.ticks <= self.cold
        self.now += seconds * (1.5 if slow else 1.0)


def test_a_cold_stored_step_leaves_the_costs_exact(monkeypatch):
    """The stored times come from the strategy steps' reference blocks, and each strategy
    block is timed against its group's reference blocks in the same step: a stored step that
    ran slow over most of its blocks moves nothing."""
    clock = ColdClock(cold=9)
    costs = [(1.0, 2.0)] * 12
    chain = _chain(clock, costs)
    timed = probe.timed_step

    def counted(chain_, segments, *args, **kw):
        clock.steps += 1
        clock.ticks = 0
        return timed(chain_, segments, *args, **kw)

    monkeypatch.setattr(probe, "timed_step", counted)
    got = probe_chain(
        chain, torch.randn(4, 8), torch.ones(4, 8), {}, [0] * 12, [OPTIONS] * 12, clock=clock
    )
    assert got.forward_s == pytest.approx((1.0,) * 12)
    assert got.backward_s == pytest.approx((2.0,) * 12)
    for overhead, chained in zip(got.overhead_s, got.chained_s, strict=True):
        assert overhead == pytest.approx({"checkpoint": 1.0, "approx:bf16": 1.0})
        assert chained == pytest.approx(1.0)


def test_groups_timed_in_steps_of_different_paces_share_one_unit(monkeypatch):
    """Two groups whose reference blocks fall in different strategy steps, the steps run at
    different paces: the fit of one factor per step puts every group's times in one unit, so
    each group's figures keep their true ratios (found by a review: before, the slower
    step's group read twice its time and its overheads five times its forward)."""
    clock = FakeClock()
    # blocks 4, 5, 10, 11 are the reference in the first strategy step, 0-2 and 6-8 in the second
    groups = [0, 0, 0, 3, 3, 3, 0, 0, 0, 3, 3, 3]
    costs = [(1.0, 2.0) if g == 0 else (4.0, 6.0) for g in groups]
    chain = _chain(clock, costs)
    timed, calls = probe.timed_step, []

    def paced(chain_, segments, *args, **kw):
        calls.append(1)
        clock.scale = {2: 2.0}.get(len(calls), 1.0)  # the first strategy step at half speed
        return timed(chain_, segments, *args, **kw)

    monkeypatch.setattr(probe, "timed_step", paced)
    got = probe_chain(
        chain, torch.randn(4, 8), torch.ones(4, 8), {}, groups, [OPTIONS] * 12, clock=clock
    )
    assert got.forward_s[3] / got.forward_s[0] == pytest.approx(4.0)
    assert got.backward_s[3] / got.backward_s[0] == pytest.approx(3.0)
    for f, overhead, chained in zip(got.forward_s, got.overhead_s, got.chained_s, strict=True):
        assert overhead == pytest.approx({"checkpoint": f, "approx:bf16": f})
        assert chained == pytest.approx(f)


def test_a_reversible_part_runs_a_stack_of_one_and_a_stack_of_the_rest():
    """What a stack of one block costs (its own call included), and what a block adds inside
    a longer stack, as plans run reversible segments; a block that cannot is checkpointed."""
    rev = [*OPTIONS, "reversible"]
    options = [rev, rev, rev, OPTIONS, rev, rev, OPTIONS, rev]
    segs = _segments([(0, 8, "reversible")], options)
    assert [(s.start, s.stop, s.strategy) for s in segs] == [
        (0, 1, "reversible"),
        (1, 3, "reversible"),
        (3, 4, "checkpoint"),
        (4, 5, "reversible"),
        (5, 6, "reversible"),  # a rest of one block: a stack of one again
        (6, 7, "checkpoint"),
        (7, 8, "reversible"),
    ]


class _Branch(nn.Module):
    """A branch whose every call (forward, rebuild or recompute) advances the clock."""

    def __init__(self, clock: FakeClock, seconds: float, width: int) -> None:
        super().__init__()
        self.clock, self.seconds = clock, seconds
        self.lin = nn.Linear(width, width)

    def forward(self, x):
        self.clock.tick(self.seconds)
        return self.lin(x)


def test_a_reversible_stack_is_priced_its_first_block_alone_and_each_block_inside(monkeypatch):
    """A stack's own call costs once per stack (here 5 s of fake time per call): the probe
    prices a stack of one at that plus a block's work and a block inside a longer stack at
    its work alone, and a plan's stack of six is predicted at the time its step takes."""
    from reference import timed_block

    from revckpt.layers import ReversibleBlock, ReversibleSequential, ReversibleUnit
    from revckpt.schedule.costs import evaluate

    clock = FakeClock()
    stack_call = ReversibleSequential.forward

    def costly(self, *args, **kwargs):
        clock.tick(5.0)
        return stack_call(self, *args, **kwargs)

    monkeypatch.setattr(ReversibleSequential, "forward", costly)
    chain = [
        ReversibleUnit(ReversibleBlock(_Branch(clock, 1.0, 4), _Branch(clock, 1.0, 4)))
        for _ in range(18)
    ]
    x = torch.randn(2, 8)
    options = [["store", "checkpoint", "reversible"]] * 18
    got = probe_chain(chain, x, torch.ones(2, 8), {}, [0] * 18, options, clock=clock)
    head, inside = got.overhead_s[0]["reversible"], got.stacked_s[0]
    assert head == pytest.approx(inside + 5.0)
    blocks = [
        timed_block(f, b, invertible=True, strategy_overhead_s=o, stacked_s=s)
        for f, b, o, s in zip(
            got.forward_s, got.backward_s, got.overhead_s, got.stacked_s, strict=True
        )
    ]
    plan = [Segment(0, 6, "reversible"), *(Segment(i, i + 1, "store") for i in range(6, 18))]
    stored = [Segment(i, i + 1, "store") for i in range(18)]
    seconds = []
    for segments in (stored, plan):
        start = clock.now
        timed_step(chain, segments, x, torch.ones(2, 8), {}, clock=clock)
        seconds.append(clock.now - start)
    assert evaluate(blocks, plan).overhead_s == pytest.approx(seconds[1] - seconds[0])


def test_a_stack_in_the_probe_holds_only_blocks_that_share_their_split_dim():
    """``segment_runs`` refuses a reversible segment of units split along different dims:
    the probe's stacks end where the key changes (a chain the profile timed before)."""
    rev = [*OPTIONS, "reversible"]
    segs = _segments([(0, 6, "reversible")], [rev] * 6, [1, 1, 1, -1, -1, 1])
    assert [(s.start, s.stop) for s in segs] == [(0, 1), (1, 3), (3, 4), (4, 5), (5, 6)]


def test_a_chain_of_units_split_along_different_dims_profiles_and_plans():
    from revckpt.layers import ReversibleUnit, reversible_mlp_block
    from revckpt.schedule import apply, profile, solve

    torch.manual_seed(0)
    chain = nn.Sequential(
        *(ReversibleUnit(reversible_mlp_block(8, 16), split_dim=(1, -1)[i % 2]) for i in range(8))
    )
    prof = profile(chain, torch.randn(4, 16), repeats=1, policies=(), codecs=())
    plan = solve(prof, memory_budget=0.5, strategies=["store", "checkpoint"])
    x = torch.randn(4, 16, requires_grad=True)
    apply(chain, plan)(x).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_no_plan_runs_units_split_along_different_dims_as_one_stack():
    """The solver cuts a reversible segment where split_dim changes (it had planned a stack
    over units split along 1 and -1, which ``apply`` refused), and a hand-made one is refused
    with the cut it needs."""
    from revckpt import InvalidArgumentError
    from revckpt.layers import ReversibleUnit, reversible_mlp_block
    from revckpt.schedule import apply, evaluate, profile, solve

    torch.manual_seed(0)
    dims = [1, 1, 1, -1, -1, -1, 1, 1]
    chain = nn.Sequential(*(ReversibleUnit(reversible_mlp_block(8, 16), split_dim=d) for d in dims))
    prof = profile(chain, torch.randn(4, 16), repeats=1, policies=(), codecs=())
    assert [b.split_dim for b in prof.blocks] == dims
    plan = solve(prof, memory_budget=0.52, strategies=["store", "reversible"])
    reversible = [s for s in plan.segments if s.strategy == "reversible"]
    assert reversible
    assert all(len({dims[i] for i in range(s.start, s.stop)}) == 1 for s in reversible)
    x = torch.randn(4, 16, requires_grad=True)
    apply(chain, plan)(x).sum().backward()
    expected = torch.autograd.grad(chain(x).sum(), x)[0]
    torch.testing.assert_close(x.grad, expected)
    with pytest.raises(InvalidArgumentError, match="cut the segment where split_dim changes"):
        evaluate(prof.blocks, [Segment(0, 8, "reversible")])
