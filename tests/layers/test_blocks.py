"""Ready blocks (revckpt/layers/blocks.py) with every coupling they accept."""

import copy

import pytest
import torch
from reversible_reference import GatedCoupling, assert_grads_match, plain_forward, step

from revckpt import InvalidArgumentError
from revckpt.layers import (
    AdditiveCoupling,
    AffineCoupling,
    AttentionBranch,
    ConvBranch,
    Coupling,
    EnterStreams,
    LeaveStreams,
    MLPBranch,
    ReversibleSequential,
    reversible_mlp_block,
    reversible_transformer_block,
    revnet_conv_block,
)


class HalfCoupling(Coupling):
    """A custom coupling on a branch of the stream's width: ``y = x + h / 2``."""

    def combine(self, x, h):
        return x + 0.5 * h

    def separate(self, y, h):
        return y - 0.5 * h


# every coupling option, given the dim along which the block's branches produce features
COUPLINGS = {
    "additive": lambda dim: "additive",
    "affine": lambda dim: "affine",
    "affine-instance": lambda dim: AffineCoupling(clamp=1.0, split_dim=dim),
    "custom-gated": GatedCoupling,
    "custom-same-width": lambda dim: HalfCoupling(),
}

# name: (make(coupling, **options), input shape, split dim, options for the gradient check)
BLOCKS = {
    "mlp": (
        lambda c, **o: reversible_mlp_block(3, 6, coupling=c, **o),
        (4, 6),
        -1,
        {"norm": "batch", "dropout": 0.3},
    ),
    "mlp-layernorm": (
        lambda c, **o: reversible_mlp_block(3, 6, norm="layer", coupling=c, **o),
        (4, 6),
        -1,
        {},
    ),
    "transformer": (
        lambda c, **o: reversible_transformer_block(4, 2, mlp_ratio=2, coupling=c, **o),
        (2, 3, 8),
        -1,
        {"dropout": 0.2, "causal": True},
    ),
    "revnet-conv": (lambda c, **o: revnet_conv_block(4, coupling=c, **o), (2, 4, 3, 3), 1, {}),
}

CASES = [(block, coupling) for block in BLOCKS for coupling in COUPLINGS]


def _make(block, coupling, **options):
    make, shape, dim, _ = BLOCKS[block]
    return make(COUPLINGS[coupling](dim), **options).double(), shape, dim


@pytest.mark.parametrize("block,coupling", CASES)
def test_forward_shape_and_reconstruction_float64(block, coupling):
    torch.manual_seed(0)
    rev_block, shape, dim = _make(block, coupling)
    x1, x2 = torch.randn(shape, dtype=torch.float64).chunk(2, dim=dim)
    y1, y2 = rev_block(x1, x2)
    assert y1.shape == x1.shape and y2.shape == x2.shape
    assert not torch.equal(y1, x1) and not torch.equal(y2, x2)
    r1, r2 = rev_block.inverse(y1, y2)
    torch.testing.assert_close((r1, r2), (x1, x2), rtol=1e-12, atol=1e-12)
    rev = ReversibleSequential(rev_block, split_dim=dim)
    assert rev(torch.cat([x1, x2], dim=dim)).shape == shape


@pytest.mark.parametrize("block,coupling", CASES)
def test_stack_gradients_match_the_blocks_run_plainly_float64(block, coupling):
    torch.manual_seed(0)
    options = BLOCKS[block][3]
    blocks = [_make(block, coupling, **options)[0] for _ in range(2)]
    _, shape, dim = _make(block, coupling)
    rev = ReversibleSequential(*blocks, split_dim=dim)
    ref = copy.deepcopy(rev)
    x = torch.randn(shape, dtype=torch.float64)
    y_rev, g_rev = step(lambda m, x, **k: m(x), rev, x, None)
    y_ref, g_ref = step(plain_forward, ref, x, None)  # every activation stored
    assert torch.equal(y_rev, y_ref)
    assert_grads_match(g_rev, g_ref, 1e-10)
    assert g_rev[-1].abs().sum() > 0
    for (name, a), b in zip(rev.named_buffers(), ref.buffers(), strict=True):
        assert torch.equal(a, b), name  # BatchNorm statistics updated once, as plainly


def test_revnet_conv_block_split_channels():
    torch.manual_seed(0)
    rev = ReversibleSequential(*[revnet_conv_block(8) for _ in range(2)], split_dim=1).double()
    ref = copy.deepcopy(rev)
    x = torch.randn(2, 8, 6, 6, dtype=torch.float64)

    def plain(m, x, **k):
        a, b = x.chunk(2, dim=1)
        for block in m.blocks:
            a, b = block(a, b)
        return torch.cat([a, b], dim=1)

    assert_grads_match(
        step(lambda m, x, **k: m(x), rev, x, None)[1], step(plain, ref, x, None)[1], 1e-10
    )


def test_branches_are_sized_for_the_coupling():
    widths = {}
    for coupling in COUPLINGS:
        mlp = reversible_mlp_block(3, 6, coupling=COUPLINGS[coupling](-1))
        attn = reversible_transformer_block(4, 2, coupling=COUPLINGS[coupling](-1))
        conv = revnet_conv_block(4, coupling=COUPLINGS[coupling](1))
        widths[coupling] = (
            mlp.f.fc2.out_features,
            mlp.g.fc2.out_features,
            attn.f.proj.out_features,
            attn.g.fc2.out_features,
            conv.f.body[-1].out_channels,
            conv.g.body[-1].out_channels,
        )
    same = (3, 3, 4, 4, 2, 2)
    assert widths["additive"] == widths["custom-same-width"] == same
    assert widths["affine"] == widths["affine-instance"] == widths["custom-gated"]
    assert widths["affine"] == tuple(2 * w for w in same)
    assert type(revnet_conv_block(4).coupling) is AdditiveCoupling
    assert revnet_conv_block(4, coupling="affine").coupling.split_dim == 1
    custom = HalfCoupling()
    assert reversible_mlp_block(3, 6, coupling=custom).coupling is custom


def test_branch_output_widths():
    x = torch.randn(2, 3, 4)
    assert MLPBranch(4, 8)(x).shape == (2, 3, 4)
    assert MLPBranch(4, 8, out_dim=6)(x).shape == (2, 3, 6)
    assert AttentionBranch(4, 2)(x).shape == (2, 3, 4)
    assert AttentionBranch(4, 2, out_dim=8)(x).shape == (2, 3, 8)
    img = torch.randn(2, 3, 5, 5)
    assert ConvBranch(3)(img).shape == (2, 3, 5, 5)
    assert ConvBranch(3, out_channels=6)(img).shape == (2, 6, 5, 5)


def _batch_norm_of_features(x, weight, bias, eps):
    """The reference: each feature normalised by its mean and (biased) variance over every
    other dimension, then scaled and shifted."""
    dims = tuple(range(x.dim() - 1))
    mean, var = x.mean(dims, keepdim=True), x.var(dims, unbiased=False, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps) * weight + bias


@pytest.mark.parametrize(
    "shape", [(6, 4), (2, 5, 4), (3, 4, 4)], ids=["2d", "3d", "3d-as-many-tokens-as-features"]
)
def test_mlp_branch_batch_norm_normalises_the_features(shape):
    torch.manual_seed(0)
    branch = MLPBranch(4, 8, norm="batch").double()
    with torch.no_grad():  # weights away from the identity, so they count in the check
        branch.norm.weight.uniform_(0.5, 2.0)
        branch.norm.bias.uniform_(-1.0, 1.0)
    x = torch.randn(shape, dtype=torch.float64) * 3 + torch.arange(4.0, dtype=torch.float64)
    norm = branch.norm
    want = _batch_norm_of_features(x, norm.weight, norm.bias, norm.eps)
    torch.testing.assert_close(norm(x), want, rtol=1e-10, atol=1e-10)
    # the running statistics are per feature, the variance unbiased over the batch and tokens
    flat = x.reshape(-1, 4)
    m = norm.momentum
    torch.testing.assert_close(norm.running_mean, m * flat.mean(0), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(norm.running_var, (1 - m) + m * flat.var(0), rtol=1e-10, atol=0)
    branch.eval()
    frozen = (x - norm.running_mean) / torch.sqrt(norm.running_var + norm.eps)
    torch.testing.assert_close(norm(x), frozen * norm.weight + norm.bias, rtol=1e-10, atol=1e-10)
    assert branch(x).shape == shape


def test_mlp_block_with_batch_norm_on_tokens_matches_plain_float64():
    torch.manual_seed(0)
    rev = ReversibleSequential(reversible_mlp_block(4, 8, norm="batch")).double()
    ref = copy.deepcopy(rev)
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    y_rev, g_rev = step(lambda m, x, **k: m(x), rev, x, None)
    y_ref, g_ref = step(plain_forward, ref, x, None)
    torch.testing.assert_close(y_rev, y_ref, rtol=1e-12, atol=1e-12)
    assert_grads_match(g_rev, g_ref, 1e-10)
    assert rev.blocks[0].f.norm.running_mean.shape == (4,)


# --- entering and leaving the two streams -----------------------------------------------------


def test_enter_and_leave_streams():
    x = torch.randn(2, 6, 4)
    a, b = EnterStreams("split", split_dim=1)(x)
    assert torch.equal(a, x[:, :3]) and torch.equal(b, x[:, 3:])
    assert torch.equal(LeaveStreams("concat", split_dim=1)((a, b)), x)
    a, b = EnterStreams()(x)
    assert a is x and b is x
    assert torch.equal(LeaveStreams()((x, 3 * x)), 2 * x)


def test_enter_and_leave_streams_around_a_stack_match_plain_float64():
    torch.manual_seed(0)
    enter, leave = EnterStreams("duplicate"), LeaveStreams("average")
    rev = ReversibleSequential(*[reversible_mlp_block(3, 6, coupling="affine") for _ in range(2)])
    rev = rev.double()
    ref = copy.deepcopy(rev)
    x = torch.randn(4, 3, dtype=torch.float64)

    def plain(m, x, **k):
        a, b = enter(x)
        for block in m.blocks:
            a, b = block(a, b)
        return leave((a, b))

    y_rev, g_rev = step(lambda m, x, **k: leave(m(enter(x))), rev, x, None)
    y_ref, g_ref = step(plain, ref, x, None)
    assert torch.equal(y_rev, y_ref)
    assert_grads_match(g_rev, g_ref, 1e-12)


# --- bad input -------------------------------------------------------------------------------


def test_bad_block_options():
    with pytest.raises(InvalidArgumentError, match=r"channels=5 is odd"):
        revnet_conv_block(5)
    with pytest.raises(
        InvalidArgumentError, match=r"AffineCoupling\(split_dim=-1\).*AffineCoupling\(split_dim=1\)"
    ):
        revnet_conv_block(4, coupling=AffineCoupling())
    with pytest.raises(InvalidArgumentError, match=r"GatedCoupling splits h along -1, not 1"):
        revnet_conv_block(4, coupling=GatedCoupling())
    with pytest.raises(InvalidArgumentError, match=r"AffineCoupling\(split_dim=1\).*along dim -1"):
        reversible_mlp_block(3, 6, coupling=AffineCoupling(split_dim=1))
    for make in (
        lambda: reversible_mlp_block(3, 6, coupling="mult"),
        lambda: reversible_transformer_block(4, 2, coupling="mult"),
        lambda: revnet_conv_block(4, coupling="mult"),
    ):
        with pytest.raises(InvalidArgumentError, match=r"coupling='mult' is not a coupling"):
            make()
    with pytest.raises(InvalidArgumentError, match=r"dim=6 is not divisible by heads=4"):
        reversible_transformer_block(6, 4)
    with pytest.raises(InvalidArgumentError, match=r"norm='group': use None, 'layer' or 'batch'"):
        reversible_mlp_block(3, 6, norm="group")


def test_bad_stream_modes_and_splits():
    with pytest.raises(InvalidArgumentError, match=r"mode='copy': use 'duplicate' or 'split'"):
        EnterStreams("copy")
    with pytest.raises(InvalidArgumentError, match=r"mode='sum': use 'average' or 'concat'"):
        LeaveStreams("sum")
    with pytest.raises(InvalidArgumentError, match=r"shape \(2, 5\) in two along dim -1: odd"):
        EnterStreams("split")(torch.zeros(2, 5))
    with pytest.raises(InvalidArgumentError, match=r"along dim 2: no such dim"):
        EnterStreams("split", split_dim=2)(torch.zeros(2, 4))
    with pytest.raises(InvalidArgumentError, match=r"shape \(\) in two along dim -1: no such"):
        EnterStreams("split")(torch.tensor(1.0))
