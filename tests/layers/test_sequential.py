"""ReversibleSequential's reversible backward against plain autograd, and its bad-input errors."""

import copy

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from reversible_reference import assert_grads_match, plain_forward, step
from torch import nn

from revckpt import ModifiedInputError, RevckptError
from revckpt.layers import (
    ReversibleBlock,
    ReversibleSequential,
    reversible_mlp_block,
    reversible_transformer_block,
)


class MaskedMLP(nn.Module):
    """A branch that takes a keyword mask: ``mlp(x) * mask``."""

    def __init__(self, width, hidden, out, *, dropout, norm):
        super().__init__()
        layers = [nn.Linear(width, hidden)]
        if norm == "batch":
            layers.append(nn.BatchNorm1d(hidden))
        elif norm == "layer":
            layers.append(nn.LayerNorm(hidden))
        layers.append(nn.Tanh())
        if dropout:
            layers.append(nn.Dropout(dropout))
        layers.append(nn.Linear(hidden, out))
        self.body = nn.Sequential(*layers)

    def forward(self, x, mask=None):
        y = self.body(x)
        return y if mask is None else y * mask


@st.composite
def stacks(draw, depth=(1, 16), dtype=torch.float64):
    coupling = draw(st.sampled_from(["additive", "affine"]))
    width = draw(st.integers(1, 6))
    hidden = draw(st.integers(1, 12))
    dropout = draw(st.sampled_from([0.0, 0.3]))
    norm = draw(st.sampled_from([None, "layer", "batch"]))
    one_branch = draw(st.booleans())
    out = 2 * width if coupling == "affine" else width
    n = draw(st.integers(*depth))
    seed = draw(st.integers(0, 2**20))
    torch.manual_seed(seed)

    def branch():
        return MaskedMLP(width, hidden, out, dropout=dropout, norm=norm)

    blocks = [
        ReversibleBlock(branch(), None if one_branch else branch(), coupling=coupling)
        for _ in range(n)
    ]
    rev = ReversibleSequential(*blocks, anchor_every=draw(st.sampled_from([None, 1, 3]))).to(dtype)
    batch = draw(st.integers(2, 5))
    x = torch.randn(batch, 2 * width, dtype=dtype)
    mask = None
    if draw(st.booleans()):
        mask = torch.rand(batch, out, dtype=dtype).requires_grad_(draw(st.booleans()))
    return rev, x, mask


@given(case=stacks())
def test_float64_gradients_match_plain_autograd(case):
    rev, x, mask = case
    ref = copy.deepcopy(rev)
    y_rev, g_rev = step(lambda m, x, **k: m(x, **k), rev, x, mask)
    y_ref, g_ref = step(plain_forward, ref, x, mask)
    assert torch.equal(y_rev, y_ref)
    assert_grads_match(g_rev, g_ref, 1e-10)
    for a, b in zip(rev.buffers(), ref.buffers(), strict=True):
        assert torch.equal(a, b)  # BatchNorm statistics updated once, as plain autograd


def test_float32_depth_32_within_1e_5():
    torch.manual_seed(0)
    rev = ReversibleSequential(*[reversible_mlp_block(32, 64) for _ in range(32)])
    ref = copy.deepcopy(rev)
    x = torch.randn(16, 64)
    _, g_rev = step(lambda m, x, **k: m(x), rev, x, None)
    _, g_ref = step(plain_forward, ref, x, None)
    assert_grads_match(g_rev, g_ref, 1e-5)


def test_dropout_and_batchnorm_match_plain():
    torch.manual_seed(0)
    rev = ReversibleSequential(
        *[reversible_mlp_block(8, 16, norm="batch", dropout=0.5) for _ in range(6)]
    ).double()
    ref = copy.deepcopy(rev)
    x = torch.randn(10, 16, dtype=torch.float64)
    y1, g_rev = step(lambda m, x, **k: m(x), rev, x, None)
    y2, g_ref = step(plain_forward, ref, x, None)
    assert torch.equal(y1, y2)
    assert_grads_match(g_rev, g_ref, 1e-12)
    for (name, a), b in zip(rev.named_buffers(), ref.buffers(), strict=True):
        assert torch.equal(a, b), name
    assert int(rev.blocks[0].f.norm.num_batches_tracked) == 1


def test_tuple_streams_and_keyword_tensor_gradients():
    torch.manual_seed(0)
    rev = ReversibleSequential(*[reversible_transformer_block(16, 2) for _ in range(3)])
    x1, x2 = torch.randn(2, 5, 16, requires_grad=True), torch.randn(2, 5, 16, requires_grad=True)
    bias = torch.randn(5, 5, requires_grad=True)
    y1, y2 = rev((x1, x2), attn_mask=bias)
    (y1.sum() + 2 * y2.sum()).backward()
    ref = copy.deepcopy(rev)
    r1, r2 = x1.detach().requires_grad_(), x2.detach().requires_grad_()
    rb = bias.detach().requires_grad_()
    a, b = r1, r2
    for block in ref.blocks:
        a, b = block(a, b, attn_mask=rb)
    (a.sum() + 2 * b.sum()).backward()
    for got, want in [(x1.grad, r1.grad), (x2.grad, r2.grad), (bias.grad, rb.grad)]:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("used", [0, 1])
def test_a_stream_the_loss_does_not_use_leaves_its_branch_without_grad(used):
    # plain autograd leaves .grad None on parameters the loss does not reach; zeros would be
    # moved by AdamW's weight decay (the last block's g when only the first stream is used)
    torch.manual_seed(0)
    rev = ReversibleSequential(*[reversible_mlp_block(4, 8) for _ in range(3)]).double()
    ref = copy.deepcopy(rev)
    x1 = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    x2 = torch.randn(3, 4, dtype=torch.float64)
    rev((x1, x2))[used].sum().backward()
    leaf = x1.detach().requires_grad_()
    a, b = leaf, x2
    for block in ref.blocks:
        a, b = block(a, b)
    (a, b)[used].sum().backward()
    nones = 0
    for (name, got), want in zip(rev.named_parameters(), ref.parameters(), strict=True):
        assert (got.grad is None) == (want.grad is None), name
        nones += got.grad is None
        if got.grad is not None:
            torch.testing.assert_close(got.grad, want.grad, rtol=1e-10, atol=1e-12)
    assert nones == (4 if used == 0 else 0)  # g of the last block: two linear layers
    torch.testing.assert_close(x1.grad, leaf.grad, rtol=1e-10, atol=1e-12)


def test_autograd_grad_inputs_without_grad_and_second_backward():
    torch.manual_seed(0)
    rev = ReversibleSequential(*[reversible_mlp_block(4, 8, dropout=0.2) for _ in range(4)])
    x = torch.randn(3, 8)  # does not require grad
    y = rev(x)
    params = list(rev.parameters())
    first = torch.autograd.grad(y.sum(), params, retain_graph=True)
    second = torch.autograd.grad(y.sum(), params)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    assert all(p.grad is None for p in params)  # autograd.grad does not touch .grad


def test_gradient_accumulation_and_hooks():
    torch.manual_seed(0)
    rev = ReversibleSequential(*[reversible_mlp_block(4, 8) for _ in range(2)])
    seen = []
    rev.blocks[0].f.fc1.weight.register_hook(lambda g: seen.append(g.norm()))
    x = torch.randn(3, 8)
    rev(x).sum().backward()
    once = rev.blocks[0].f.fc1.weight.grad.clone()
    rev(x).sum().backward()
    torch.testing.assert_close(rev.blocks[0].f.fc1.weight.grad, 2 * once)
    assert len(seen) == 2


def test_bf16_input_under_autocast_matches_plain_autocast():
    torch.manual_seed(0)
    rev = ReversibleSequential(*[reversible_mlp_block(8, 16) for _ in range(4)])
    ref = copy.deepcopy(rev)

    def under_autocast(fn):
        def run(m, x, **k):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return fn(m, x).float()

        return run

    x = torch.randn(4, 16).bfloat16()
    y1, g1 = step(under_autocast(lambda m, x: m(x)), rev, x, None)
    y2, g2 = step(under_autocast(plain_forward), ref, x, None)
    assert torch.equal(y1, y2)
    assert g1[-1].dtype == torch.bfloat16
    # bf16 rounding of the rebuilt streams: the same gradients up to bf16 drift
    assert_grads_match(g1, g2, 2e-2)


def test_callers_tensors_untouched():
    rev = ReversibleSequential(*[reversible_mlp_block(4, 8) for _ in range(3)])
    x = torch.randn(3, 8, requires_grad=True)
    before = x.detach().clone()
    version = x._version
    rev(x).sum().backward()
    assert torch.equal(x.detach(), before) and x._version == version


# --- bad input -------------------------------------------------------------------------------


def test_bad_input_messages():
    with pytest.raises(RevckptError, match=r"size 5 is odd\); pad that dimension"):
        ReversibleSequential(reversible_mlp_block(2, 4))(torch.randn(3, 5))
    wrong = ReversibleBlock(nn.Linear(4, 3), nn.Linear(4, 4))
    with pytest.raises(RevckptError, match=r"branch f returned \(2, 3\).*keeps the shape"):
        ReversibleSequential(wrong)(torch.randn(2, 8))
    with pytest.raises(RevckptError, match=r"block 1 is a Linear, not a coupling block"):
        ReversibleSequential(reversible_mlp_block(2, 4), nn.Linear(4, 4))
    with pytest.raises(RevckptError, match=r"must be an nn.Module"):
        ReversibleBlock(lambda x: x)
    with pytest.raises(RevckptError, match=r"coupling='mult' is not a coupling"):
        ReversibleBlock(nn.Linear(2, 2), coupling="mult")
    with pytest.raises(RevckptError, match=r"anchor_every=0"):
        ReversibleSequential(reversible_mlp_block(2, 4), anchor_every=0)
    with pytest.raises(RevckptError, match=r"check_inverse=-1"):
        ReversibleSequential(reversible_mlp_block(2, 4), check_inverse=-1)
    with pytest.raises(RevckptError, match=r"affine coupling needs"):
        ReversibleSequential(ReversibleBlock(nn.Linear(2, 2), coupling="affine"))(torch.randn(3, 4))


def test_unregistered_parameter_or_nested_keyword_raises_instead_of_dropping_gradients():
    class Tied(nn.Module):
        def __init__(self, other):
            super().__init__()
            self.other = [other]  # not registered: its parameters are invisible

        def forward(self, x):
            return self.other[0](x)

    rev = ReversibleSequential(ReversibleBlock(Tied(nn.Linear(3, 3)), nn.Linear(3, 3)))
    with pytest.raises(RevckptError, match="not one of its registered parameters"):
        rev(torch.randn(2, 6)).sum().backward()

    class WithExtra(nn.Module):
        def forward(self, x, extra=()):
            return x * 2

    rev = ReversibleSequential(ReversibleBlock(WithExtra(), WithExtra()))
    with pytest.raises(RevckptError, match="pass each such tensor as its own keyword"):
        rev(torch.randn(2, 6), extra=[torch.ones(3, requires_grad=True)])


def test_a_scalar_input_is_refused_by_name():
    stack = ReversibleSequential(reversible_mlp_block(2, 4))
    with pytest.raises(RevckptError, match="0-dimensional"):
        stack(torch.tensor(1.0))


def test_a_keyword_tensor_changed_in_place_after_the_forward_raises():
    # The branches' recomputes read the changed mask: gradients 3.4e-3 off in float64, with
    # a drift under the default tolerance, silently.
    class Branch(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x, mask=None):
            return self.lin((x @ x.transpose(-1, -2) + mask).softmax(-1) @ x)

    torch.manual_seed(0)
    stack = ReversibleSequential(*(ReversibleBlock(Branch(), Branch()) for _ in range(2))).double()
    x = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True)
    mask = torch.randn(5, 5, dtype=torch.float64)
    y = stack(x, mask=mask)
    mask.mul_(1.01)
    with pytest.raises(ModifiedInputError, match="keyword tensor given to a reversible stack"):
        y.sum().backward()
    stack(x, mask=mask.clone()).sum().backward()  # unchanged: fine


def test_a_torch_func_transform_is_refused_clearly():
    stack = ReversibleSequential(*(reversible_mlp_block(4, 8) for _ in range(2)))
    x = torch.randn(3, 2, 8)
    with pytest.raises(RevckptError, match=r"cannot run inside a torch\.func transform") as e:
        torch.func.vmap(stack)(x)  # torch's raw setup_context error before
    assert "for each of stack.blocks" in str(e.value)  # not "call the block plainly"

    def looped(x):  # the way out the message gives runs, as plain autograd
        x1, x2 = x.chunk(2, dim=-1)
        for block in stack.blocks:
            x1, x2 = block(x1, x2)
        return torch.cat([x1, x2], dim=-1)

    torch.testing.assert_close(torch.func.vmap(looped)(x), stack(x))


def test_the_stack_output_changed_in_place_is_refused_clearly():
    """y = stack(x); y.mul_(2): autograd's raw version error from inside the rebuild."""
    torch.manual_seed(0)
    stack = ReversibleSequential(*[reversible_mlp_block(4, 8) for _ in range(2)])
    x = torch.randn(3, 8, requires_grad=True)
    y = stack(x)
    y.mul_(2)
    with pytest.raises(ModifiedInputError, match="output of a reversible stack was changed"):
        y.sum().backward()
