"""profile(): what it records, and that it leaves the model as it found it."""

import pytest
import torch
from torch import nn

from revckpt import InvalidArgumentError, InvalidInputTypeError
from revckpt.approx import Approx, estimate_error
from revckpt.models import gpt_like, mlp_chain, revnet_like
from revckpt.schedule import Segment, evaluate, profile


def _state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_profile_leaves_statistics_gradients_and_rng_alone():
    torch.manual_seed(0)
    chain, x = revnet_like((2,), (8,)), torch.randn(4, 3, 8, 8)
    before = _state(chain)
    rng = torch.random.get_rng_state()
    prof = profile(chain, x, repeats=2)
    after = chain.state_dict()
    for k, v in before.items():
        assert torch.equal(v, after[k]), k
    assert all(p.grad is None for p in chain.parameters())
    assert torch.equal(rng, torch.random.get_rng_state())
    assert len(prof.blocks) == len(chain)


class _Stateful(nn.Module):
    """A forward that rebinds a buffer (an EMA written as ``self.ema = ...``), registers one
    on its first call with grad, and counts its calls in a plain attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.register_buffer("ema", torch.zeros(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear(x)
        self.ema = 0.9 * self.ema + 0.1 * h.detach().mean(0)
        if torch.is_grad_enabled() and "seen" not in self._buffers:
            self.register_buffer("seen", torch.ones(()))
        self.calls = getattr(self, "calls", 0) + 1
        return torch.tanh(h)


def test_profile_leaves_rebound_and_registered_buffers_and_attributes_alone():
    """Found by session 27's review (older than it): a rebound buffer kept the profile's
    updates (its old tensor got the old value back, the module held a new one), a buffer and
    an attribute the profile's forwards made stayed; training after a profile then differed
    from training without one."""
    torch.manual_seed(0)
    chain = nn.Sequential(*(_Stateful() for _ in range(4)))
    chain[1].calls = 7
    buffers = [dict(b._buffers) for b in chain]
    values = [{k: v.clone() for k, v in b._buffers.items()} for b in chain]
    profile(chain, torch.randn(4, 8), codecs=(), policies=(), repeats=1)
    for block, table, before in zip(chain, buffers, values, strict=True):
        assert block._buffers.keys() == table.keys()
        for k, v in table.items():
            assert block._buffers[k] is v and torch.equal(v, before[k]), k
    assert chain[1].calls == 7
    assert not any(hasattr(b, "calls") for i, b in enumerate(chain) if i != 1)


class _Foreign(nn.Module):
    """Calls a normalisation layer it holds in a plain list (not registered: not in its
    ``state_dict``), as a shared or teacher module is often held."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.shared = [norm]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared[0](self.linear(x))


def test_profile_leaves_a_module_held_in_a_plain_list_alone():
    """Its running statistics moved with every forward of the profile (found by session 27's
    review, older than it)."""
    torch.manual_seed(0)
    norm = nn.BatchNorm1d(8)
    chain = nn.Sequential(*(_Foreign(norm) for _ in range(3)))
    before = {k: v.clone() for k, v in norm.state_dict().items()}
    profile(chain, torch.randn(4, 8), codecs=(), policies=(), repeats=1)
    for k, v in norm.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert all(p.grad is None for p in norm.parameters())


def test_estimate_error_leaves_batchnorm_statistics_alone():
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.GELU())
    before = _state(block)
    estimate_error([block], torch.randn(16, 8), Approx(store="e4m3"), probes=2)
    for k, v in before.items():
        assert torch.equal(v, block.state_dict()[k]), k


def test_blocks_that_save_their_own_output_are_flagged():
    torch.manual_seed(0)
    chain = nn.Sequential(
        nn.Sequential(nn.Linear(8, 8), nn.ReLU()),  # ReLU saves its result: the output
        nn.Sequential(nn.Linear(8, 8), nn.GELU()),  # GELU saves its input
        gpt_like(1, 8, 2)[0],
    )
    x = torch.randn(2, 4, 8)
    prof = profile(chain, x, repeats=1, codecs=("e4m3",))
    assert [b.output_saved for b in prof.blocks] == [True, False, False]
    # compressing the ReLU's output after storing that block would save nothing: refused
    with pytest.raises(InvalidArgumentError, match="saves its output"):
        evaluate(prof.blocks, [Segment(0, 1, "store"), Segment(1, 3, "approx:e4m3")])
    evaluate(prof.blocks, [Segment(0, 1, "checkpoint"), Segment(1, 3, "approx:e4m3")])
    evaluate(prof.blocks, [Segment(0, 2, "store"), Segment(2, 3, "approx:e4m3")])


def test_measured_transients_recorded():
    torch.manual_seed(0)
    chain, x = revnet_like((1,), (8,)), torch.randn(2, 3, 8, 8)
    prof = profile(chain, x, repeats=1, codecs=())
    stem, unit, head = prof.blocks
    for b in prof.blocks:
        assert b.checkpoint_peak_bytes is not None and b.backward_capture_peak_bytes is not None
    assert unit.invertible and unit.reversible_peak_bytes is not None
    assert stem.reversible_peak_bytes is None and head.reversible_peak_bytes is None


def test_offload_is_priced_when_asked_and_measures_what_moves(monkeypatch):
    from revckpt import _host_copies
    from revckpt.schedule import make_plan
    from revckpt.schedule.costs import strategy_names

    torch.manual_seed(0)
    chain = mlp_chain(3, 16, 32)
    x = torch.randn(8, 16)
    cpu = profile(chain, x, repeats=1, codecs=(), policies=())
    assert "offload" not in strategy_names(cpu.blocks)  # auto: off on the CPU
    asked = profile(chain, x, repeats=1, codecs=(), policies=(), offload=True)
    assert "offload" in strategy_names(asked.blocks)
    # the host is the device here: nothing moves, the boundary stays (and costs as much)
    assert all(b.offload.kept_bytes == b.input_bytes for b in asked.blocks)
    assert all("offload" in b.strategy_overhead_s for b in asked.blocks)
    # nothing moves, so an offloaded chain keeps every boundary, as per-block checkpoint does
    offloaded = make_plan(asked, [Segment(0, 3, "offload")])
    assert offloaded.predicted_peak_bytes >= sum(b.input_bytes for b in asked.blocks)
    # where the copies happen (forced here: the path CUDA takes), every input byte moves
    monkeypatch.setattr(_host_copies, "FORCED", [[False]])
    moved = profile(chain, x, repeats=1, codecs=(), policies=(), offload=True)
    assert all(b.offload.kept_bytes == 0 for b in moved.blocks)
    with pytest.raises(InvalidArgumentError, match="offload"):
        profile(chain, x, repeats=1, offload="yes")


def test_threads_are_part_of_the_profile_and_the_plans_validity():
    import warnings

    from revckpt import PlanWarning
    from revckpt.models import mlp_chain
    from revckpt.schedule import apply, baseline, profile

    chain, x = mlp_chain(3, 16, 32), torch.randn(8, 16)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        prof = profile(chain, x, repeats=1, codecs=(), policies=())
        plan = baseline(prof, "per-block")
        assert prof.threads == plan.threads == 1
        assert prof.seconds > 0 and prof.cost_in_steps > 0
        assert type(plan).from_json(plan.to_json()).threads == 1
        model = apply(chain, plan)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            model(x).sum().backward()  # same count: silent
        torch.set_num_threads(2)
        with pytest.warns(PlanWarning, match="measured with 1 intra-op thread"):
            model(x).sum().backward()
    finally:
        torch.set_num_threads(before)


class _Deepened(nn.Module):
    """A block whose keyword ``depth`` changes what it saves (one more tanh per step)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, depth=0):
        h = self.lin(x)
        for _ in range(depth):
            h = torch.tanh(h)
        return h


def test_block_keywords_go_in_kwargs_and_the_old_spelling_warns():
    import warnings

    chain, x = nn.Sequential(_Deepened(), _Deepened()), torch.randn(4, 8)
    options = {"repeats": 1, "codecs": (), "policies": ()}
    plain = profile(chain, x, **options)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        new = profile(chain, x, kwargs={"depth": 3}, **options)
    with pytest.warns(FutureWarning, match=r"kwargs=\{'depth': \.\.\.\}") as caught:
        old = profile(chain, x, depth=3, **options)
    assert caught[0].filename == __file__  # warned at the caller
    saved = [[b.saved_bytes for b in p.blocks] for p in (plain, new, old)]
    assert saved[1] == saved[2] and saved[1] != saved[0]
    with pytest.raises(InvalidArgumentError, match="kwargs= only"), pytest.warns(FutureWarning):
        profile(chain, x, kwargs={"depth": 3}, depth=3, **options)


class _Shifted(nn.Module):
    """A block with a keyword tensor that may require grad."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, *, bias):
        return torch.tanh(self.lin(x) + bias)


def test_profile_and_verify_leave_the_callers_gradients_alone():
    """A keyword tensor (and the input) that require grad keep their .grad: same object, same
    values (the metered steps used to accumulate into it)."""
    from revckpt.schedule import solve, verify

    torch.manual_seed(0)
    chain = [_Shifted() for _ in range(3)]
    x = torch.randn(4, 8, requires_grad=True)
    bias = torch.randn(8, requires_grad=True)
    bias.grad = before = torch.ones(8)
    prof = profile(chain, x, kwargs={"bias": bias}, repeats=1)
    assert bias.grad is before and torch.equal(before, torch.ones(8)) and x.grad is None
    plan = solve(prof, memory_budget="95%")
    verify(chain, x, plan, prof, kwargs={"bias": bias}, repeats=1, warmup=0)
    assert bias.grad is before and torch.equal(before, torch.ones(8)) and x.grad is None


def test_a_keyword_tensor_made_by_the_callers_graph_is_left_to_it():
    """A non-leaf keyword tensor that requires grad: the measuring steps used to backpropagate
    into the caller's graph (then fail: 'backward through the graph a second time') and fill
    its leaf's .grad. They stop at the keyword now; the caller's graph still works after."""
    from revckpt.schedule import solve, verify

    torch.manual_seed(0)
    chain = [_Shifted() for _ in range(3)]
    x = torch.randn(4, 8)
    leaf = torch.randn(8, requires_grad=True)
    bias = leaf * 2.0
    prof = profile(chain, x, kwargs={"bias": bias}, repeats=1)
    plan = solve(prof, memory_budget="95%")
    verify(chain, x, plan, prof, kwargs={"bias": bias}, repeats=1, warmup=0)
    assert leaf.grad is None
    bias.sum().backward()  # the caller's own backward through its graph
    assert torch.equal(leaf.grad, torch.full((8,), 2.0))
    leaf.grad = None
    pair = (leaf * 2.0, leaf * 3.0)  # inside a tuple: a clear error, the caller's graph intact
    with pytest.raises(InvalidInputTypeError, match="inside a tuple"):
        profile([_Paired() for _ in range(2)], x, kwargs={"bias": pair}, repeats=1)
    assert leaf.grad is None
    sum(pair).sum().backward()
    assert torch.equal(leaf.grad, torch.full((8,), 5.0))


class _Paired(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, *, bias):
        return self.lin(x) + bias[0] * bias[1]


def test_a_block_that_changes_its_input_in_place_is_named_and_the_input_left_alone():
    chain = [nn.Linear(8, 8), nn.ReLU(inplace=True), nn.Linear(8, 8)]
    x = torch.randn(4, 8)
    before = x.clone()
    said = r"block 1 \(ReLU\) changes a tensor it is given in place"
    with pytest.raises(InvalidArgumentError, match=said):
        profile(chain, x, repeats=1)
    assert torch.equal(x, before)
    with pytest.raises(InvalidArgumentError, match=r"block 0 \(ReLU\)"):
        profile([nn.ReLU(inplace=True), nn.Linear(8, 8)], x, repeats=1)
    assert torch.equal(x, before)  # the chain's input too


def test_a_policy_keeping_an_output_the_block_overwrites_is_not_priced_for_it():
    """nn.Linear then nn.ReLU(inplace=True): 'matmul' keeps the Linear's output, which the ReLU
    overwrites; the block cannot run with it (revckpt.checkpoint raises), so the profile prices
    it only where it can run, and a plan solved on it trains as plain autograd does."""
    from revckpt.schedule import apply, solve

    torch.manual_seed(0)
    chain = nn.Sequential(
        *[nn.Sequential(nn.Linear(32, 32), nn.ReLU(inplace=True)) for _ in range(3)],
        nn.Sequential(nn.Linear(32, 32), nn.Tanh()),
    ).double()
    x = torch.randn(16, 32, dtype=torch.float64)
    prof = profile(chain, x, policies=("matmul",), codecs=(), repeats=1)
    assert [sorted(b.selective) for b in prof.blocks] == [[], [], [], ["matmul"]]
    plan = solve(prof, memory_budget="95%")
    assert all(s.start == 3 for s in plan.segments if s.strategy.startswith("selective"))
    expected = torch.autograd.grad(chain(x).square().sum(), list(chain.parameters()))
    got = torch.autograd.grad(apply(chain, plan)(x).square().sum(), list(chain.parameters()))
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_a_block_that_changes_a_keyword_tensor_in_place_is_named():
    class _Keeps(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x, *, bias):
            return self.lin(x) + bias

    class _Shifts(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x, *, bias):
            bias.add_(1.0)
            return self.lin(x) + bias

    chain = [_Keeps(), _Shifts()]
    bias = torch.zeros(8)
    with pytest.raises(InvalidArgumentError, match=r"block 1 \(_Shifts\) changes a tensor"):
        profile(chain, torch.randn(4, 8), kwargs={"bias": bias}, repeats=1)
    assert torch.equal(bias, torch.zeros(8))  # found on a copy: the caller's is as it was


def test_a_selective_step_slower_than_checkpoint_is_timed_no_more():
    from revckpt.schedule.block_time import SLOWER, _rounds

    now = [0.0]

    def clock():
        return now[0]

    def taking(*seconds):  # per round
        calls = iter(seconds)

        def run():
            now[0] += next(calls)

        return run

    slow = 1.6 * SLOWER
    steps = {
        "store": taking(1.0, 1.0, 1.0),
        "checkpoint": taking(1.5, 1.5, 1.5),
        "selective:slow": taking(slow, slow, slow),
        "selective:once": taking(slow, 1.6, 1.6),  # slower in one round only: timed on
        "selective:ok": taking(1.6, 1.6, 1.6),
    }
    times = _rounds(steps, 3, 0, clock)
    assert times["selective:slow"] == [pytest.approx(slow)] * 2  # two rounds, then no more
    assert len(times["selective:once"]) == len(times["selective:ok"]) == 3
    assert times["store"] == [pytest.approx(1.0)] * 3


def test_block_times_prices_a_selective_policy_from_its_rounds():
    from revckpt.schedule.block_time import block_times

    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))
    leaf = torch.randn(32, 16, requires_grad=True)
    grad = torch.randn(32, 16)
    f, b, extra = block_times(
        block, leaf, grad, ["checkpoint", "selective:matmul"], {}, 3, warmup=0
    )
    assert f > 0 and b > 0
    assert set(extra) == {"checkpoint", "selective:matmul"}
    assert all(v >= 0 for v in extra.values())


def test_a_selective_step_timed_no_more_stays_priced_above_checkpoint():
    # its one round's stored step was slow (an outlier): read against it alone, selective's
    # step looked cheaper than checkpoint's three-round median, and fit chose it for a plan
    # predicted at half its measured overhead (HF GPT-2 of tests/zoo.py)
    from revckpt.schedule.block_time import _ratios

    times = {
        "store": [6.5, 4.4, 4.3],
        "checkpoint": [6.6, 7.8, 8.4],
        "selective:matmul+attention": [8.6],  # 1.30x checkpoint's step in its round
    }
    ratios = _ratios(times)
    assert ratios["checkpoint"] == pytest.approx(7.8 / 4.4)
    assert ratios["selective:matmul+attention"] == pytest.approx(8.6 / 6.6 * 7.8 / 4.4)
    assert ratios["selective:matmul+attention"] > ratios["checkpoint"]


def test_codec_error_runs_draw_the_exact_runs_dropout_masks():
    # without the chain's recorded draws (exact=None) every run is seeded alike: a block with
    # dropout then reads the codec's error, not that of other masks (about 1 if they differed)
    from revckpt.schedule.block_errors import error_fields
    from revckpt.schedule.cost_records import ApproxCost

    torch.manual_seed(0)
    block = nn.Sequential(nn.Dropout(0.5), nn.Linear(32, 32), nn.Dropout(0.5))
    x = torch.randn(16, 32)
    got = error_fields(block, x, {"bf16": ApproxCost(1, 1)}, {}, None, {})["approx"]["bf16"]
    assert 0 < got.param_grad_error < 1e-2 and got.input_grad_error < 1e-2


def test_a_first_profile_times_no_first_call_learning(monkeypatch):
    """The in-chain timing steps time each block's recomputed call once; what revckpt learns on
    a block's first call (its layout, the normalisation layers it calls: global module hooks)
    must not fall in them, or a process's first profile reads one-block checkpointing high
    (1.1x, the second profile of a process not): it is learnt before, with grad
    (``profiling._rehearse``)."""
    import revckpt._module_state as module_state
    import revckpt.replay as replay
    from revckpt.schedule import probe

    monkeypatch.setattr(probe, "_WARM", set())  # a fresh process
    timing = [False]
    learnt = {"layouts": 0, "norm hooks": 0}
    real_step, real_layout = probe.timed_step, module_state._Layout
    real_hooks = replay.freeze_called

    def step(*args, **kwargs):
        timing[0] = kwargs.get("record") is None  # the strategy steps, not the recorded one
        try:
            return real_step(*args, **kwargs)
        finally:
            timing[0] = False

    class Layout(real_layout):
        def __init__(self, root):
            learnt["layouts"] += timing[0]
            super().__init__(root)

    def hooks(ran):
        learnt["norm hooks"] += timing[0]
        return real_hooks(ran)

    monkeypatch.setattr(probe, "timed_step", step)
    monkeypatch.setattr(module_state, "_Layout", Layout)
    monkeypatch.setattr(replay, "freeze_called", hooks)
    torch.manual_seed(0)
    chain = nn.Sequential(*(nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)) for _ in range(12)))
    profile(chain, torch.randn(16, 8), codecs=())
    assert learnt == {"layouts": 0, "norm hooks": 0}
    assert all(replay.learnt(b) for b in chain)


def test_profile_refuses_what_is_not_a_chain_clearly():
    # one block: a raw TypeError (not iterable); codecs="bf16": read letter by letter
    x = torch.randn(2, 8)
    with pytest.raises(InvalidInputTypeError, match=r"got one Linear: pass \[block\]"):
        profile(nn.Linear(8, 8), x)
    with pytest.raises(InvalidInputTypeError, match=r"codecs='bf16': pass a list"):
        profile(mlp_chain(2, 8, 16), x, codecs="bf16")


def test_a_chain_holding_one_block_twice_is_named_per_place_and_solves():
    # named_children() named it once: solve said "block_names has 1 names but the segments
    # cover 4 blocks", an argument the caller never passed
    from revckpt.schedule import solve

    block = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))
    prof = profile(nn.Sequential(*[block] * 3), torch.randn(4, 8), repeats=1)
    assert prof.names == ("0", "1", "2")
    assert solve(prof, memory_budget=1.0).length == 3
