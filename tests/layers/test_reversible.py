import copy

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from revckpt import MemoryMeter, ReconstructionError, RevckptError
from revckpt.layers import (
    AdditiveCoupling,
    AffineCoupling,
    Coupling,
    ReconstructionWarning,
    ReversibleBlock,
    ReversibleSequential,
    reversible_mlp_block,
    reversible_transformer_block,
    revnet_conv_block,
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


def plain_forward(rev, x, **kwargs):
    """The same math with plain autograd: every block called directly."""
    x1, x2 = x.chunk(2, dim=-1)
    for block in rev.blocks:
        x1, x2 = block(x1, x2, **kwargs)
    return torch.cat([x1, x2], dim=-1)


def step(model_fn, model, x, mask, seed=99):
    x = x.detach().clone().requires_grad_()
    kw = {}
    if mask is not None:
        kw["mask"] = mask.detach().clone().requires_grad_(mask.requires_grad)
    torch.manual_seed(seed)
    y = model_fn(model, x, **kw)
    # drawn in float64 and rounded: the same direction whatever the model's dtype
    w = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    w = w.to(y.dtype)
    (y * w).sum().backward()
    grads = [p.grad for p in model.parameters()] + [x.grad]
    if mask is not None and mask.requires_grad:
        grads.append(kw["mask"].grad)
    return y.detach(), grads


def assert_grads_match(got, want, rtol):
    flat_got = torch.cat([g.flatten().double() for g in got])
    flat_want = torch.cat([g.flatten().double() for g in want])
    scale = flat_want.norm()
    assert (flat_got - flat_want).norm() <= rtol * scale
    for g, w in zip(got, want, strict=True):
        # per tensor: relative, except for gradients that are zero up to round-off (a bias
        # right before BatchNorm)
        assert (g.double() - w.double()).norm() <= rtol * w.double().norm() + 1e-3 * rtol * scale


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


def test_no_grad_and_eval_keep_nothing():
    rev = ReversibleSequential(*[reversible_mlp_block(8, 16) for _ in range(8)])
    x = torch.randn(4, 16)
    with torch.no_grad(), MemoryMeter("cpu") as m:
        y = rev(x)
    assert m.end_bytes == y.numel() * 4


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


# --- memory ----------------------------------------------------------------------------------


def _step_peak(depth):
    torch.manual_seed(0)
    rev = ReversibleSequential(*[reversible_mlp_block(64, 128) for _ in range(depth)])
    x = torch.randn(64, 128, requires_grad=True)
    rev(x).sum().backward()  # gradients exist: measure the steady state, as in training
    with MemoryMeter("cpu") as fwd:
        y = rev(x)
    held = fwd.end_bytes
    y.sum().backward()
    del y
    with MemoryMeter("cpu") as both:
        rev(x).sum().backward()
    return held, both.peak_bytes, x


def test_memory_flat_in_depth_and_only_the_output_held():
    held8, peak8, x = _step_peak(8)
    held128, peak128, _ = _step_peak(128)
    # the output, and the default invertibility check's 64-element samples of the two halves
    # of the stack input: nothing that grows with depth
    assert held8 == held128 == x.numel() * 4 + 2 * 64 * 4
    assert abs(peak128 - peak8) <= 0.10 * peak8


# --- drift control ---------------------------------------------------------------------------


def _deep_bf16(anchor_every):
    torch.manual_seed(0)
    blocks = [reversible_mlp_block(16, 32) for _ in range(64)]
    return ReversibleSequential(*blocks, anchor_every=anchor_every).bfloat16()


def test_check_inverse_warns_or_raises_with_the_fix():
    rev = _deep_bf16(None)
    rev.check_inverse, rev.on_drift = 1e-6, "warn"
    x = torch.randn(8, 32).bfloat16()
    with pytest.warns(ReconstructionWarning, match="anchor_every"):
        rev(x).float().sum().backward()
    assert max(d for d in rev.last_drift if d is not None) > 1e-6
    rev.on_drift = "raise"
    with pytest.raises(ReconstructionError, match=r"check_inverse=1e-06.*anchor_every"):
        rev(x).float().sum().backward()


def test_anchors_bound_bf16_error_near_plain_bf16():
    torch.manual_seed(0)
    x = torch.randn(8, 32)
    exact = copy.deepcopy(_deep_bf16(None)).double()
    _, g_exact = step(plain_forward, exact, x.double(), None)

    def err(model_fn, model):
        _, g = step(model_fn, model, x.bfloat16(), None)
        a = torch.cat([t.flatten().double() for t in g])
        b = torch.cat([t.flatten() for t in g_exact])
        return ((a - b).norm() / b.norm()).item()

    plain = err(plain_forward, _deep_bf16(None))
    anchored = err(lambda m, x, **k: m(x), _deep_bf16(4))
    unanchored = err(lambda m, x, **k: m(x), _deep_bf16(None))
    print(
        f"bf16, depth 64, gradient error vs float64: plain backprop {plain:.3e}, reversible "
        f"anchor_every=4 {anchored:.3e}, reversible without anchors {unanchored:.3e}"
    )
    assert anchored <= 1.5 * plain
    assert unanchored > 1.5 * plain  # without anchors, bf16 drift does show in the gradients


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


def test_inverse_and_custom_coupling():
    class Gated(Coupling):
        def combine(self, x, h):
            return x + torch.sigmoid(h) * 0.5

        def separate(self, y, h):
            return y - torch.sigmoid(h) * 0.5

    torch.manual_seed(0)
    block = ReversibleBlock(nn.Linear(3, 3), nn.Linear(3, 3), coupling=Gated()).double()
    x1, x2 = torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    r1, r2 = block.inverse(*block(x1, x2))
    torch.testing.assert_close((r1, r2), (x1, x2), rtol=1e-12, atol=1e-12)
    rev = ReversibleSequential(block, copy.deepcopy(block))
    ref = copy.deepcopy(rev)
    x = torch.randn(4, 6, dtype=torch.float64)
    assert_grads_match(
        step(lambda m, x, **k: m(x), rev, x, None)[1], step(plain_forward, ref, x, None)[1], 1e-12
    )


def test_affine_scale_bounded():
    c = AffineCoupling(clamp=2.0)
    x = torch.ones(3)
    y = c.combine(x, (torch.tensor([-1e6, 0.0, 1e6]), torch.zeros(3)))
    assert torch.all(y >= torch.exp(torch.tensor(-2.0)) - 1e-6)
    assert torch.all(y <= torch.exp(torch.tensor(2.0)) + 1e-5)


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


# --- in-place safety and silent-drop guards ----------------------------------------------------


def test_tensors_captured_by_hooks_are_never_overwritten():
    torch.manual_seed(0)
    rev = ReversibleSequential(*[reversible_mlp_block(4, 8) for _ in range(4)]).double()
    outputs, inputs = [], []
    rev.blocks[1].f.register_forward_hook(lambda m, i, o: outputs.append((o.detach(), o.clone())))
    rev.blocks[1].f.register_forward_pre_hook(
        lambda m, i: inputs.append((i[0].detach(), i[0].clone()))
    )

    x = torch.randn(3, 8, dtype=torch.float64)
    rev(x).sum().backward()
    assert len(outputs) == 2 and len(inputs) == 2  # forward and the backward's recompute
    for held, copy_ in outputs + inputs:
        assert torch.equal(held, copy_)


def test_coupling_subclass_does_not_take_the_additive_shortcuts():
    class Scaled(AdditiveCoupling):
        def combine(self, x, h):
            return x + 0.5 * h

        def separate(self, y, h):
            return y - 0.5 * h

    torch.manual_seed(0)
    blocks = [
        ReversibleBlock(nn.Linear(3, 3), nn.Linear(3, 3), coupling=Scaled()) for _ in range(2)
    ]
    rev = ReversibleSequential(*blocks).double()
    ref = copy.deepcopy(rev)
    x = torch.randn(4, 6, dtype=torch.float64)
    y1, g1 = step(lambda m, x, **k: m(x), rev, x, None)
    y2, g2 = step(plain_forward, ref, x, None)
    assert torch.equal(y1, y2)
    assert_grads_match(g1, g2, 1e-12)


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


def test_rebuilt_input_released_when_the_walk_ends():
    # A layer before the stack runs its backward after the stack's: the input the stack rebuilt
    # must be gone by then, not held through the graph while the output is alive.
    torch.manual_seed(0)
    first = nn.Linear(64, 64)
    stack = ReversibleSequential(*[reversible_mlp_block(32, 64) for _ in range(2)])
    x = torch.randn(64, 64)
    for p in [*first.parameters(), *stack.parameters()]:
        p.grad = torch.zeros_like(p)
    with MemoryMeter("cpu") as m:
        y = stack(first(x))
        y.backward(torch.ones_like(y))
        held = m.live_bytes
    # what may stay alive after backward: the output only (the gradients accumulated in place)
    assert held == y.numel() * y.element_size()


# --- tensors the stack does not own (issue 13, hole 5) ---------------------------------------


class _ReturnsBuffer(nn.Module):
    """A branch whose output is a buffer it holds (a learned-free constant offset)."""

    def __init__(self, width):
        super().__init__()
        self.register_buffer("offset", torch.linspace(-1, 1, width))

    def forward(self, x):
        return self.offset.expand_as(x) if x.dim() > 1 else self.offset


class _CachesOutput(nn.Module):
    """A branch that keeps its last output on itself (as attention maps are kept for plots)."""

    def __init__(self, width):
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.last = None

    def forward(self, x):
        self.last = torch.tanh(self.lin(x))
        return self.last


class _ReturnsKeyword(nn.Module):
    def forward(self, x, bias):
        return bias


def _twice(stack, x, **kwargs):
    first = stack(x, **kwargs).detach().clone()
    second = stack(x, **kwargs).detach().clone()
    return first, second


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
def test_a_branch_output_that_is_a_buffer_is_not_written(grad):
    torch.manual_seed(0)
    branch = _ReturnsBuffer(4)
    before = branch.offset.clone()
    lin = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    stack = ReversibleSequential(ReversibleBlock(lin, branch), ReversibleBlock(branch, lin))
    x = torch.randn(8, requires_grad=grad)  # 1-D: the branch returns the buffer itself
    first, second = _twice(stack, x)
    assert torch.equal(branch.offset, before)
    assert torch.equal(first, second)


def test_an_output_the_branch_caches_is_not_written():
    torch.manual_seed(0)
    f, g = _CachesOutput(4), _CachesOutput(4)
    stack = ReversibleSequential(ReversibleBlock(f, g))
    x = torch.randn(3, 8, requires_grad=True)
    stack(x)
    assert torch.equal(f.last, torch.tanh(f.lin(x[:, 4:])).detach())


def test_a_keyword_tensor_returned_as_is_is_not_written():
    stack = ReversibleSequential(ReversibleBlock(_ReturnsKeyword(), _ReturnsKeyword()))
    x = torch.randn(3, 8, requires_grad=True)
    bias = torch.ones(3, 4)
    first, second = _twice(stack, x, bias=bias)
    assert torch.equal(bias, torch.ones(3, 4))
    assert torch.equal(first, second)


# --- the default invertibility check -------------------------------------------------------


class _NotAFunctionOfItsInput(nn.Module):
    """A branch that reads state outside itself (a global table changed after the forward)."""

    def __init__(self, width):
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.table = {"scale": 1.0}  # a dict: replay re-establishes plain attributes only

    def forward(self, x):
        return torch.tanh(self.lin(x)) * self.table["scale"]


def test_default_check_catches_a_branch_whose_recompute_differs():
    torch.manual_seed(0)
    f = _NotAFunctionOfItsInput(4)
    stack = ReversibleSequential(*[ReversibleBlock(f, nn.Linear(4, 4)) for _ in range(3)])
    x = torch.randn(5, 8, requires_grad=True)
    y = stack(x)
    f.table["scale"] = 3.0
    try:
        with pytest.raises(ReconstructionError, match=r"check_inverse='auto'.*Fix the branch"):
            y.sum().backward()
    finally:
        f.table["scale"] = 1.0
    y = ReversibleSequential(*stack.blocks, check_inverse=None)(x)  # the check can be skipped
    y.sum().backward()


def test_default_check_is_quiet_on_a_deep_invertible_stack():
    torch.manual_seed(0)
    stack = ReversibleSequential(*[reversible_mlp_block(16, 32) for _ in range(48)])
    x = torch.randn(8, 32, requires_grad=True)
    stack(x).sum().backward()  # round-off drift is far below the default tolerance
    assert stack.last_drift[0] is not None and stack.last_drift[0] < 1e-4
    assert all(d is None for d in stack.last_drift[1:])  # only block 0's input is sampled


def test_a_scalar_input_is_refused_by_name():
    stack = ReversibleSequential(reversible_mlp_block(2, 4))
    with pytest.raises(RevckptError, match="0-dimensional"):
        stack(torch.tensor(1.0))
