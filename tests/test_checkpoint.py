import copy
import functools
import itertools

import pytest
import torch
import torch.utils.checkpoint as tcp
from helpers import bitwise_equal, train_step, twin
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import revckpt
from revckpt import (
    CheckpointMismatchError,
    InvalidArgumentError,
    InvalidInputTypeError,
    MemoryMeter,
    RevckptError,
    Strategy,
    checkpoint,
    checkpoint_sequential,
    segment_bounds,
)
from revckpt.models import mlp_chain, transformer_chain
from revckpt.testing import stack_specs


def seq(segments, **opts):
    return lambda m, x, **kw: checkpoint_sequential(m, segments, x, **opts, **kw)


# --- exactness -------------------------------------------------------------------------------


@given(
    spec=stack_specs(depth=(1, 8), dtypes=(torch.float64, torch.float32)),
    segments=st.sampled_from(["per-block", "sqrt", 1, 2]),
)
def test_gradients_bitwise_equal_plain(spec, segments):
    model = spec.build()
    x = spec.make_input()
    segs = (
        spec.depth
        if segments == "per-block"
        else min(segments, spec.depth)
        if isinstance(segments, int)
        else segments
    )
    ref = train_step(twin(model), x)
    got = train_step(model, x, seq(segs))
    assert torch.equal(ref[0], got[0])
    assert bitwise_equal(ref[1], got[1])
    assert torch.equal(ref[2], got[2])


def test_dropout_masks_replayed_bitwise():
    model = mlp_chain(6, 16, 32, dropout=0.5)
    x = torch.randn(8, 16, requires_grad=True)
    ref = train_step(twin(model), x)
    got = train_step(model, x, seq(6))
    assert bitwise_equal(ref[1], got[1]) and torch.equal(ref[2], got[2])


def test_without_rng_preservation_dropout_masks_differ():
    model = mlp_chain(4, 16, 32, dropout=0.5)
    x = torch.randn(8, 16, requires_grad=True)
    ref = train_step(twin(model), x)
    got = train_step(model, x, seq(4, preserve_rng_state=False))
    assert not bitwise_equal(ref[1], got[1])


def test_global_rng_stream_unchanged_by_recompute():
    model = mlp_chain(3, 8, 16, dropout=0.5)
    x = torch.randn(4, 8, requires_grad=True)
    torch.manual_seed(5)
    twin(model)(x).sum().backward()
    plain_next = torch.rand(3)
    torch.manual_seed(5)
    checkpoint_sequential(model, 3, x).sum().backward()
    assert torch.equal(torch.rand(3), plain_next)


def _bn_model():
    torch.manual_seed(0)
    return mlp_chain(4, 8, 16, norm="batch", dropout=0.2)


def test_batchnorm_running_stats_updated_once():
    plain, ours = _bn_model(), _bn_model()
    x = torch.randn(16, 8, requires_grad=True)
    ref = train_step(plain, x)
    got = train_step(ours, x, seq(4))
    assert bitwise_equal(ref[1], got[1])
    for (name, a), (_, b) in zip(plain.named_buffers(), ours.named_buffers(), strict=True):
        assert torch.equal(a, b), name
    assert int(ours[0].norm.num_batches_tracked) == 1


def test_batchnorm_contrast_torch_checkpoint_updates_twice():
    plain, theirs = _bn_model(), _bn_model()
    x = torch.randn(16, 8, requires_grad=True)
    train_step(plain, x)
    train_step(theirs, x, lambda m, x: nn.Sequential(*[_TorchCkpt(b) for b in m])(x))
    assert int(theirs[0].norm.num_batches_tracked) == 2
    assert not torch.equal(plain[0].norm.running_mean, theirs[0].norm.running_mean)


class _TorchCkpt(nn.Module):
    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x):
        return tcp.checkpoint(self.block, x, use_reentrant=False)


def test_batchnorm_momentum_none_and_instancenorm():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.bn = nn.BatchNorm1d(4, momentum=None)
            self.inorm = nn.InstanceNorm1d(4, track_running_stats=True)

        def forward(self, x):
            return self.inorm(self.bn(x))

    plain = nn.Sequential(Block(), Block())
    ours = copy.deepcopy(plain)
    x = torch.randn(6, 4, 5, requires_grad=True)
    ref = train_step(plain, x)
    got = train_step(ours, x, seq(2))
    assert bitwise_equal(ref[1], got[1])
    for a, b in zip(plain.buffers(), ours.buffers(), strict=True):
        assert torch.equal(a, b)


def test_bf16_autocast_matches_plain_under_autocast():
    model = mlp_chain(4, 16, 32, norm="layer", dropout=0.1)
    x = torch.randn(8, 16, requires_grad=True)

    def under_autocast(run):
        def go(m, x):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return (run(m, x) if run else m(x)).float()

        return go

    ref = train_step(twin(model), x, under_autocast(None))
    got = train_step(model, x, under_autocast(seq(4)))
    assert bitwise_equal(ref[1], got[1]) and torch.equal(ref[2], got[2])


def test_bf16_input_under_autocast():
    model = mlp_chain(3, 16, 32)
    x = torch.randn(8, 16).bfloat16().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = checkpoint_sequential(model, 3, x)
    y.float().sum().backward()
    assert x.grad is not None and x.grad.dtype == torch.bfloat16


def test_keyword_tensors_reach_every_block_and_get_gradients():
    torch.manual_seed(0)
    model = transformer_chain(3, 16, 2, dropout=0.1)
    x = torch.randn(2, 5, 16, requires_grad=True)
    bias = torch.randn(5, 5, requires_grad=True)

    def plain(m, x, attn_mask):
        for block in m:
            x = block(x, attn_mask=attn_mask)
        return x

    def run(fn):
        b = bias.detach().clone().requires_grad_()
        out = train_step(fn[0], x, fn[1], attn_mask=b)
        return out, b.grad

    (ref, ref_bias) = run((twin(model), plain))
    (got, got_bias) = run((model, seq(3)))
    assert bitwise_equal(ref[1], got[1])
    assert torch.equal(ref_bias, got_bias)


def test_every_segment_is_checkpointed_including_the_last():
    model = mlp_chain(4, 64, 256)
    x = torch.randn(32, 64)
    with MemoryMeter("cpu") as m:
        y = checkpoint_sequential(model, 1, x)
    # one segment: nothing kept but the output (the input existed before)
    assert m.end_bytes == y.numel() * 4


def test_rng_state_kept_only_when_used():
    x = torch.randn(8, 16)
    for dropout, extra in [(0.0, 0), (0.5, torch.get_rng_state().numel())]:
        model = mlp_chain(2, 16, 32, dropout=dropout)
        with MemoryMeter("cpu") as m:
            y = checkpoint(model, x)
        assert m.end_bytes == y.numel() * 4 + extra


def test_no_grad_forward_saves_nothing():
    model = mlp_chain(4, 16, 32)
    x = torch.randn(8, 16, requires_grad=True)
    with torch.no_grad(), MemoryMeter("cpu") as m:
        y = checkpoint_sequential(model, 4, x)
    assert m.end_bytes == y.numel() * 4


def test_retain_graph_second_backward_and_autograd_grad():
    model = mlp_chain(3, 8, 16, dropout=0.3)
    x = torch.randn(4, 8, requires_grad=True)
    torch.manual_seed(1)
    y = checkpoint_sequential(model, 3, x)
    (g1,) = torch.autograd.grad(y.sum(), x, retain_graph=True)
    (g2,) = torch.autograd.grad(y.sum(), x)
    assert torch.equal(g1, g2)
    torch.manual_seed(1)
    (g0,) = torch.autograd.grad(twin(model)(x).sum(), x)
    assert torch.equal(g0, g1)


def test_input_without_grad_and_gradient_accumulation():
    model = mlp_chain(3, 8, 16)
    ref = twin(model)
    x = torch.randn(4, 8)
    for _ in range(2):
        checkpoint_sequential(model, 3, x).sum().backward()
        ref(x).sum().backward()
    assert bitwise_equal([p.grad for p in model.parameters()], [p.grad for p in ref.parameters()])


def test_checkpoint_function_form_with_bound_method_and_kwargs():
    block = transformer_chain(1, 16, 2)[0]
    x = torch.randn(2, 4, 16, requires_grad=True)
    y = checkpoint(block.forward, x, attn_mask=None)
    y.sum().backward()
    assert x.grad is not None


# --- determinism check -------------------------------------------------------------------------


class _Drifting(nn.Module):
    """A block whose forward depends on a counter it changes, kept where replay cannot see it
    (in a dict; plain attributes are re-established by replay): the recompute differs."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.state = {"scale": 1.0}

    def forward(self, x):
        self.state["scale"] += 1.0
        return torch.relu(self.lin(x) * self.state["scale"])


def test_values_check_catches_changed_values_that_metadata_misses():
    x = torch.randn(3, 4, requires_grad=True)
    checkpoint(_Drifting(), x).sum().backward()  # metadata check: passes silently
    y = checkpoint(_Drifting(), x, determinism_check="values")
    with pytest.raises(
        CheckpointMismatchError, match=r"aten\.mul.*differ.*determinism_check='none'"
    ):
        y.sum().backward()


def test_torch_checkpoint_misses_value_change():
    x = torch.randn(3, 4, requires_grad=True)
    tcp.checkpoint(_Drifting(), x, use_reentrant=False).sum().backward()  # no error: the contrast


@pytest.mark.parametrize("policy", [None, "matmul"])
def test_values_check_passes_on_deterministic_blocks(policy):
    model = mlp_chain(4, 8, 16, dropout=0.3, norm="batch")
    ref = twin(model)
    x = torch.randn(6, 8, requires_grad=True)
    got = train_step(
        model, x, seq(2, strategy=policy and f"selective:{policy}", determinism_check="values")
    )
    assert bitwise_equal(train_step(ref, x)[1], got[1])


# --- selective recompute -----------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["matmul", "attention", "matmul+attention"])
def test_policy_presets_exact_and_between_plain_and_full(policy):
    torch.manual_seed(0)
    model = transformer_chain(2, 32, 4)
    x = torch.randn(4, 16, 32, requires_grad=True)
    ref = train_step(twin(model), x)
    got = train_step(model, x, seq(2, strategy=revckpt.policy.Selective(policy)))
    assert bitwise_equal(ref[1], got[1])

    def retained(run):
        with MemoryMeter("cpu") as m:
            y = run(model, x)
        del y
        return m.end_bytes

    plain = retained(lambda m, x: m(x))
    full = retained(seq(2))
    sel = retained(seq(2, strategy=revckpt.policy.Selective(policy)))
    assert full < sel < plain


def test_policy_function_keeps_more_than_full_recompute():
    model = mlp_chain(3, 32, 64)
    x = torch.randn(16, 32, requires_grad=True)
    with MemoryMeter("cpu") as m_sel:
        y = checkpoint_sequential(
            model,
            3,
            x,
            strategy=revckpt.policy.Selective(lambda op: op != torch.ops.aten.add.Tensor),
        )
    y.sum().backward()
    with MemoryMeter("cpu") as m_full:
        z = checkpoint_sequential(model, 3, x)
    z.sum().backward()
    assert m_sel.end_bytes > m_full.end_bytes


def test_policy_errors():
    x = torch.randn(2, 4, requires_grad=True)
    with pytest.raises(InvalidArgumentError, match=r"unknown checkpoint policy 'fast'.*matmul"):
        checkpoint(nn.Linear(4, 4), x, strategy="selective:fast")
    with pytest.raises(InvalidInputTypeError, match="preset name"):
        checkpoint(nn.Linear(4, 4), x, strategy=revckpt.policy.Selective(3))


_TOKENS = ["matmul", "attention", "addmm", "native_layer_norm", "gelu", "_softmax", "mul", "mm"]


@given(tokens=st.lists(st.sampled_from(_TOKENS), min_size=1, max_size=6), data=st.data())
def test_policy_spec_canonical_text_round_trips(tokens, data):
    from revckpt.checkpoint import canonical_policy, parse_policy, policy_text

    spec = "+".join(tokens)
    again = "+".join(data.draw(st.permutations(tokens + tokens[:1])))  # shuffled, duplicated
    text = canonical_policy(spec)
    assert (
        canonical_policy(again) == text == canonical_policy(text) == policy_text(parse_policy(spec))
    )
    assert parse_policy(text) == parse_policy(spec)
    assert Strategy("selective", again) == Strategy("selective", spec)
    assert str(Strategy.parse(f"selective:{again}")) == f"selective:{text}"


def test_policy_spec_groups_ops_and_presets():
    from revckpt.checkpoint import canonical_policy, parse_policy

    aten = torch.ops.aten
    for name, ops in revckpt.POLICY_PRESETS.items():  # every preset is its own canonical text
        assert parse_policy(name) == ops and canonical_policy(name) == name
    assert canonical_policy("attention+matmul") == "matmul+attention"
    assert parse_policy("matmul+gelu") == revckpt.POLICY_PRESETS["matmul"] | {aten.gelu}
    assert canonical_policy("gelu+mm+matmul") == "matmul+gelu"  # mm is in the matmul group
    assert canonical_policy("native_layer_norm+addmm") == "addmm+native_layer_norm"
    assert Strategy("selective", "gelu+matmul") == Strategy.parse("selective:matmul+gelu")


def test_policy_spec_keeps_the_ops_it_names():
    torch.manual_seed(0)
    model = transformer_chain(1, 32, 4)
    x = torch.randn(2, 8, 32, requires_grad=True)
    ref = train_step(twin(model), x)

    def kept(policy):
        with MemoryMeter("cpu") as m:
            y = checkpoint(model, x, strategy=revckpt.policy.Selective(policy))
        return m.end_bytes - y.numel() * y.element_size()

    gelu = kept("gelu")
    assert gelu == 2 * 8 * 4 * 32 * 4  # the one GELU output
    assert kept("matmul+gelu") == kept("matmul") + gelu
    assert kept("gelu+matmul") == kept(
        lambda op: op.overloadpacket in revckpt.POLICY_PRESETS["matmul"] | {torch.ops.aten.gelu}
    )
    got = train_step(
        model, x, lambda m, z: checkpoint(m, z, strategy="selective:addmm+native_layer_norm")
    )
    assert bitwise_equal(ref[1], got[1]) and torch.equal(ref[2], got[2])


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            "matmul+fast",
            r"unknown checkpoint policy 'fast' in 'matmul\+fast'.*'matmul', 'attention'",
        ),
        ("matmul+", r"'matmul\+' has an empty token"),
        ("aten.addmm", r"'aten\.addmm': name an aten operation by its packet alone \('addmm'"),
        ("addmm.default", r"'addmm\.default': name an aten operation by its packet"),
        ("all", r"'all' is not a policy token.*Strategy\('store'\)"),
        ("gelu+native_dropout", r"'native_dropout' in .* is a random operation.*leave it out"),
        ("bernoulli", r"'bernoulli' is a random operation"),
    ],
)
def test_policy_spec_errors_name_the_token(spec, message):
    from revckpt.checkpoint import parse_policy

    with pytest.raises(InvalidArgumentError, match=message):
        parse_policy(spec)
    with pytest.raises(InvalidArgumentError, match=message):
        Strategy("selective", spec)
    with pytest.raises(InvalidArgumentError, match=message):
        checkpoint(
            nn.Linear(4, 4),
            torch.randn(2, 4, requires_grad=True),
            strategy=revckpt.policy.Selective(spec),
        )


def test_policy_text_errors():
    from revckpt.checkpoint import policy_text

    with pytest.raises(InvalidArgumentError, match=r"empty keep-set is plain checkpoint"):
        policy_text([])
    with pytest.raises(InvalidInputTypeError, match=r"aten operation packets"):
        policy_text(["addmm"])


# --- segments --------------------------------------------------------------------------------


def test_segment_bounds():
    assert segment_bounds(5, 2) == [(0, 3), (3, 5)]
    assert segment_bounds(64, "sqrt") == [(i, i + 8) for i in range(0, 64, 8)]
    assert segment_bounds(8, [3, 5]) == [(0, 3), (3, 5), (5, 8)]
    assert segment_bounds(8, [0, 3, 8]) == [(0, 3), (3, 8)]
    assert segment_bounds(3, 3) == [(0, 1), (1, 2), (2, 3)]


@pytest.mark.parametrize(
    "segments, match",
    [
        (0, r"segments=0 does not fit a chain of 4 blocks; pass an int between 1 and 4"),
        (-1, r"between 1 and 4"),
        (5, r"segments=5 does not fit a chain of 4 blocks"),
        ("half", r"pass an int, 'sqrt' or a list"),
        ([3, 2], r"strictly increasing"),
        ([2, 2], r"strictly increasing"),
        ([7], r"strictly increasing"),
        (2.5, r"must be an int"),
        ([1.5], r"must be ints"),
    ],
)
def test_bad_segments(segments, match):
    with pytest.raises(RevckptError, match=match):
        checkpoint_sequential(mlp_chain(4, 4, 4), segments, torch.randn(2, 4))


@pytest.mark.parametrize(
    "blocks, match",
    [
        ([], r"empty chain; pass at least one block"),
        (nn.Sequential(), r"empty chain"),
        ([nn.Linear(4, 4), 3], r"block 1 of the chain is a int, not a callable"),
        (nn.Linear(4, 4), r"got a single Linear; wrap it as nn.Sequential"),
        ("abc", r"needs a chain of blocks"),
        (5, r"needs a chain of blocks"),
    ],
)
def test_bad_blocks(blocks, match):
    with pytest.raises(RevckptError, match=match):
        checkpoint_sequential(blocks, 1, torch.randn(2, 4))


def test_bad_input_and_options():
    chain = mlp_chain(2, 4, 4)
    with pytest.raises(InvalidInputTypeError, match=r"input must be a torch.Tensor, got list"):
        checkpoint_sequential(chain, 1, [1.0, 2.0])
    with pytest.raises(InvalidArgumentError, match=r"determinism_check='exact'.*'values'"):
        checkpoint_sequential(chain, 1, torch.randn(2, 4), determinism_check="exact")
    with pytest.raises(InvalidInputTypeError, match=r"needs a callable block"):
        checkpoint("not a function", torch.randn(2))
    assert issubclass(InvalidArgumentError, ValueError)
    assert issubclass(InvalidInputTypeError, TypeError)


def test_public_names():
    assert revckpt.checkpoint is checkpoint
    assert set(revckpt.POLICY_PRESETS) == {"matmul", "attention", "matmul+attention"}


def test_nested_checkpoints_exact_and_statistics_once():
    torch.manual_seed(0)
    inner = mlp_chain(4, 8, 16, dropout=0.2, norm="batch").double()
    ref = twin(inner)
    x = torch.randn(6, 8, dtype=torch.float64, requires_grad=True)
    got = train_step(inner, x, lambda m, x: checkpoint(lambda z: checkpoint_sequential(m, 2, z), x))
    want = train_step(ref, x)
    assert bitwise_equal(want[1], got[1]) and torch.equal(want[2], got[2])
    for a, b in zip(ref.buffers(), inner.buffers(), strict=True):
        assert torch.equal(a, b)


def test_double_backward():
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4)).double()
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)

    def second_order(run):
        (g,) = torch.autograd.grad(run(x).pow(2).sum(), x, create_graph=True)
        (gg,) = torch.autograd.grad(g.sum(), x)
        return gg

    assert torch.equal(
        second_order(lambda x: checkpoint_sequential(model, 3, x)), second_order(model)
    )


@given(length=st.integers(1, 200), data=st.data())
def test_segment_bounds_partition_the_chain(length, data):
    segments = data.draw(st.one_of(st.integers(1, length), st.just("sqrt")))
    bounds = segment_bounds(length, segments)
    assert bounds[0][0] == 0 and bounds[-1][1] == length
    assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
    sizes = [stop - start for start, stop in bounds]
    assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1
    if isinstance(segments, int):
        assert len(bounds) == segments


class _Rolling(nn.Module):
    """A block whose forward reorders values by a counter replay cannot see (in a dict): sums
    stay equal, values do not."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.state = {"shift": 0}

    def forward(self, x):
        self.state["shift"] += 1
        return torch.tanh(torch.roll(self.lin(x), self.state["shift"], 0))


def test_values_check_catches_reordered_values():
    x = torch.randn(5, 4, requires_grad=True)
    y = checkpoint(_Rolling(), x, determinism_check="values")
    with pytest.raises(CheckpointMismatchError, match=r"aten\.roll"):
        y.sum().backward()


def test_values_check_needs_rng_preservation_and_numpy_segments_work():
    import numpy as np

    with pytest.raises(InvalidArgumentError, match="preserve_rng_state=True"):
        checkpoint(
            nn.Linear(2, 2), torch.randn(1, 2), determinism_check="values", preserve_rng_state=False
        )
    assert segment_bounds(4, np.int64(2)) == [(0, 2), (2, 4)]


# --- per-call caches: each invalidated when the block changes ---------------------------------


def _step_matches_plain(block_a: nn.Module, block_b: nn.Module, x: torch.Tensor) -> None:
    """One seeded forward + backward of ``block_a`` plainly and ``block_b`` checkpointed (twins):
    the same output, gradients and buffers."""
    torch.manual_seed(7)
    xa = x.detach().requires_grad_(True)
    ya = block_a(xa)
    ya.sum().backward()
    torch.manual_seed(7)
    xb = x.detach().requires_grad_(True)
    yb = checkpoint(block_b, xb)
    yb.sum().backward()
    assert torch.equal(ya, yb)
    assert torch.equal(xa.grad, xb.grad)
    for (name, p), (_, q) in zip(
        block_a.named_parameters(), block_b.named_parameters(), strict=True
    ):
        assert torch.equal(p.grad, q.grad), name
    for (name, a), (_, b) in zip(block_a.named_buffers(), block_b.named_buffers(), strict=True):
        assert torch.equal(a, b), name


class _Hooks(nn.Module):
    """Records, in each recompute, whether global module hooks are installed."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if revckpt.replay.is_replaying():
            self.seen.append(bool(nn.modules.module._global_forward_pre_hooks))
        return x


def _block(*layers: nn.Module) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(_Hooks(), nn.Linear(6, 6), *layers).double()  # hooks seen first


def test_norms_learned_on_the_first_recompute_then_frozen_without_global_hooks():
    plain = _block(nn.BatchNorm1d(6), nn.Dropout(0.2))
    ours = copy.deepcopy(plain)
    x = torch.randn(8, 6, dtype=torch.float64)
    for _ in range(3):
        _step_matches_plain(plain, ours, x)
    assert ours[0].seen == [True, False, False]  # learned once, then exact
    assert int(ours[2].num_batches_tracked) == 3


def test_a_batchnorm_added_after_learning_is_frozen_too():
    plain = _block(nn.Tanh())
    ours = copy.deepcopy(plain)
    x = torch.randn(8, 6, dtype=torch.float64)
    _step_matches_plain(plain, ours, x)
    _step_matches_plain(plain, ours, x)
    assert ours[0].seen == [True, False]
    for m in (plain, ours):
        m.insert(2, nn.BatchNorm1d(6).double())
    ours[2].load_state_dict(plain[2].state_dict())
    for _ in range(2):
        _step_matches_plain(plain, ours, x)  # running statistics updated once per step
    assert ours[0].seen == [True, False, True, False]  # the new layout is learned again
    assert int(ours[2].num_batches_tracked) == 2


class _CallsOutside(nn.Module):
    """Calls a normalisation layer it does not register (reached through a global)."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6).double()
        self.__dict__["norm"] = norm  # not a submodule

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.lin(x))


def test_a_normalisation_layer_outside_the_block_keeps_the_global_freeze():
    norm = nn.BatchNorm1d(6).double()
    block = _CallsOutside(norm)
    x = torch.randn(8, 6, dtype=torch.float64, requires_grad=True)
    for step in range(1, 4):
        checkpoint(block, x).sum().backward()
        assert int(norm.num_batches_tracked) == step  # never updated by a recompute


def test_dropout_rate_changed_from_zero_replays_the_new_masks():
    plain = _block(nn.Dropout(0.0))
    ours = copy.deepcopy(plain)
    x = torch.randn(8, 6, dtype=torch.float64)
    _step_matches_plain(plain, ours, x)  # draws nothing
    for m in (plain, ours):
        m[2].p = 0.1
    _step_matches_plain(plain, ours, x)  # draws: the recompute replays the forward's masks
    for m in (plain, ours):
        m.eval()
    _step_matches_plain(plain, ours, x)
    for m in (plain, ours):
        m.train()
    _step_matches_plain(plain, ours, x)


def test_a_submodule_added_between_calls_gets_its_gradient():
    plain = _block(nn.Tanh())
    ours = copy.deepcopy(plain)
    x = torch.randn(8, 6, dtype=torch.float64)
    _step_matches_plain(plain, ours, x)
    torch.manual_seed(1)
    extra = nn.Linear(6, 6).double()
    plain.insert(3, extra)
    ours.insert(3, copy.deepcopy(extra))
    _step_matches_plain(plain, ours, x)
    assert ours[3].weight.grad is not None


def test_torch_entry_point_gives_the_same_results_as_the_frame_engine(monkeypatch):
    from revckpt.engine import frame

    assert frame.FRAME  # the installed torch has the frame the engine drives
    torch.manual_seed(0)
    model = transformer_chain(2, 8, 2, dropout=0.1).double()
    twin_model = copy.deepcopy(model)
    x = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True)
    ref = train_step(model, x, seq(2, strategy="selective:matmul"))
    monkeypatch.setattr(frame, "frame_usable", lambda: False)
    got = train_step(twin_model, x, seq(2, strategy="selective:matmul"))
    assert bitwise_equal(ref[1], got[1])


def test_the_recompute_reenters_the_forwards_device_context():
    from revckpt.engine.frame import device_context

    assert device_context() is None
    with torch.device("cpu"):
        mode = device_context()
    assert mode is not None and mode.device == torch.device("cpu")


@pytest.mark.parametrize("p", [0.0, 0.5])
def test_only_a_block_that_drew_random_numbers_recomputes_past_its_last_saved_tensor(p):
    tail = _Hooks()
    block = nn.Sequential(nn.Linear(6, 6), nn.Dropout(p), tail).double()
    x = torch.randn(8, 6, dtype=torch.float64, requires_grad=True)
    checkpoint(block, x).sum().backward()
    assert len(tail.seen) == (1 if p else 0)  # to the end: replay checks the draws matched


@pytest.mark.parametrize("strategy", ["checkpoint", "approx:bf16", "offload"])
def test_messages_name_a_converted_block_by_its_class(strategy):
    # The installed forward is a functools.partial: messages named the block "partial".
    class Blk(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            x.add_(torch.tanh(self.lin(x * 1.0)))
            return x

    model = nn.Sequential(nn.Linear(8, 8), Blk(), Blk())
    revckpt.convert(model, strategy, module_filter_fn=lambda m, n: isinstance(m, Blk))
    with pytest.raises(revckpt.ModifiedInputError, match=r"^(offloaded )?Blk "):
        model(torch.randn(2, 8)).sum().backward()


@pytest.mark.parametrize("strategy", ["approx:bf16", "offload"])
def test_messages_name_a_block_checkpointed_as_hugging_face_does_by_its_class(strategy):
    # Hugging Face checkpoints partial(layer.__call__, ...): messages read
    # "Module._wrapped_call_impl"
    class Blk(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x, *, scale):
            x.add_(torch.tanh(self.lin(x * scale)))
            return x

    block = Blk()
    fn = functools.partial(block.__call__, scale=1.0)
    with pytest.raises(revckpt.ModifiedInputError, match=r"^(offloaded )?Blk "):
        checkpoint(fn, torch.randn(2, 8), strategy=strategy).sum().backward()


class _LazyBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.LazyLinear(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


@pytest.mark.parametrize("strategy", ["checkpoint", "approx:bf16", "offload"])
def test_a_lazy_module_not_initialised_yet_is_refused_with_the_way_out(strategy: str) -> None:
    """Its first call shapes and draws its parameters: checkpointing it raised a ReplayError
    about dropout masks, convert and fit torch's raw ValueError from the block search."""
    x = torch.randn(4, 16, requires_grad=True)
    with pytest.raises(revckpt.InvalidArgumentError, match="not initialised yet"):
        revckpt.checkpoint(_LazyBlock(), x * 1, strategy=strategy)
    model = nn.Sequential(_LazyBlock(), _LazyBlock())
    with pytest.raises(revckpt.InvalidArgumentError, match="not initialised yet"):
        revckpt.convert(model, strategy)
    with torch.no_grad():
        model(x)  # the way out the messages name
    plain = copy.deepcopy(model)
    revckpt.convert(model, strategy)
    model(x).sum().backward()
    plain(x).sum().backward()
    tolerance = 2e-2 if strategy.startswith("approx") else 0.0  # bf16 boundaries
    for a, b in zip(model.parameters(), plain.parameters(), strict=True):
        assert float((a.grad - b.grad).norm()) <= tolerance * float(b.grad.norm())


def test_lazy_modules_outside_the_blocks_or_drawing_nothing_are_left_alone():
    """A review: the refusal scanned the whole model (a lazy head outside the blocks) and
    refused lazy modules that draw nothing (LazyBatchNorm1d without affine parameters)."""

    def build() -> nn.Module:
        torch.manual_seed(0)
        lazy = [nn.Sequential(nn.Linear(16, 16), nn.LazyBatchNorm1d(affine=False)) for _ in "ab"]
        return nn.Sequential(*lazy, nn.LazyLinear(4))

    model, plain = build(), build()  # (a module not yet initialised cannot be deep-copied)
    revckpt.convert(model, "checkpoint", module_filter_fn=lambda m, fqn: fqn in ("0", "1"))
    x = torch.randn(8, 16)
    for m in (model, plain):
        torch.manual_seed(1)  # the head's first call draws its weights
        m(x).sum().backward()
    for a, b in zip(model.parameters(), plain.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)
