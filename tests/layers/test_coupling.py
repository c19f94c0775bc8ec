"""Couplings (revckpt/layers/coupling.py): round trips, gradients, errors."""

import copy
import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from reversible_reference import GatedCoupling, assert_grads_match, plain_forward, step
from torch import nn

from revckpt import InvalidArgumentError
from revckpt.layers import (
    AdditiveCoupling,
    AffineCoupling,
    Coupling,
    ReversibleBlock,
    ReversibleSequential,
    make_coupling,
)


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


# --- couplings to test -----------------------------------------------------------------------


COUPLINGS = {
    "additive": lambda: make_coupling("additive"),
    "affine": lambda: make_coupling("affine"),
    "affine-clamp-0.5": lambda: AffineCoupling(clamp=0.5),
    "custom-gated": GatedCoupling,
}


def _h(coupling, x, gen):
    """A branch output of the width ``coupling`` asks for (features along the last dim)."""
    shape = list(x.shape)
    shape[-1] = coupling.branch_size(shape[-1], split_dim=-1)
    return 3 * torch.randn(shape, dtype=x.dtype, generator=gen)


# --- round trip --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", COUPLINGS)
def test_round_trip_float64(name):
    coupling = COUPLINGS[name]()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 5, 6, dtype=torch.float64, generator=gen)
    h = _h(coupling, x, gen)
    coupling.check(x, h, branch="f")
    y = coupling.combine(x, h)
    assert y.shape == x.shape and not torch.equal(y, x)
    torch.testing.assert_close(coupling.separate(y, h), x, rtol=1e-14, atol=1e-14)


def test_affine_tuple_and_tensor_forms_agree():
    c = AffineCoupling(split_dim=1)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 4, dtype=torch.float64, generator=gen)
    h = torch.randn(2, 6, 4, dtype=torch.float64, generator=gen)
    a, t = h.chunk(2, dim=1)
    c.check(x, h, branch="f")
    c.check(x, (a, t), branch="f")
    assert torch.equal(c.combine(x, h), c.combine(x, (a, t)))
    assert torch.equal(c.combine(x, h), x * torch.exp(2 * torch.tanh(a / 2)) + t)
    assert torch.equal(c.separate(c.combine(x, h), h), c.separate(c.combine(x, h), [a, t]))


def test_couplings_do_not_modify_their_arguments():
    for name, make in COUPLINGS.items():
        coupling = make()
        x = torch.randn(3, 4, dtype=torch.float64)
        h = _h(coupling, x, torch.Generator().manual_seed(1))
        before = (x.clone(), h.clone(), x._version, h._version)
        coupling.separate(coupling.combine(x, h), h)
        assert torch.equal(x, before[0]) and torch.equal(h, before[1]), name
        assert (x._version, h._version) == before[2:], name


finite = {"allow_nan": False, "allow_infinity": False, "allow_subnormal": False}


@st.composite
def streams(draw, max_dims=3):
    """A float64 stream ``x``, a dimension of it, and values over many orders of magnitude."""
    shape = draw(hnp.array_shapes(min_dims=1, max_dims=max_dims, max_side=4))
    values = st.floats(-1e6, 1e6, **finite)
    x = torch.from_numpy(draw(hnp.arrays(np.float64, shape, elements=values)))
    dim = draw(st.integers(-len(shape), len(shape) - 1))
    return x, dim


U = torch.finfo(torch.float64).eps / 2  # unit roundoff


@given(case=streams(), data=st.data())
def test_additive_round_trip_within_its_documented_bound(case, data):
    x, _ = case
    values = st.floats(-1e6, 1e6, **finite)
    h = torch.from_numpy(data.draw(hnp.arrays(np.float64, tuple(x.shape), elements=values)))
    c = AdditiveCoupling()
    c.check(x, h, branch="f")
    x_hat = c.separate(c.combine(x, h), h)
    assert torch.all((x_hat - x).abs() <= 2 * U * (1 + 4 * U) * (x.abs() + h.abs()))


@given(case=streams(), data=st.data(), clamp=st.floats(0.1, 8.0), as_tuple=st.booleans())
def test_affine_round_trip_within_its_documented_bound(case, data, clamp, as_tuple):
    x, dim = case
    c = AffineCoupling(clamp=clamp, split_dim=dim)
    shape = list(x.shape)
    shape[dim] = c.branch_size(shape[dim], split_dim=dim)
    # log-scales far past the clamp, shifts over many orders of magnitude
    h = torch.from_numpy(
        data.draw(hnp.arrays(np.float64, shape, elements=st.floats(-1e4, 1e4, **finite)))
    )
    a, t = h.chunk(2, dim=dim)
    h = (a, t) if as_tuple else h
    c.check(x, h, branch="g")
    s = torch.exp(clamp * torch.tanh(a / clamp))
    assert torch.all(s >= math.exp(-clamp) * (1 - 4 * U)) and torch.all(
        s <= math.exp(clamp) * (1 + 4 * U)
    )
    x_hat = c.separate(c.combine(x, h), h)
    assert torch.all((x_hat - x).abs() <= 4 * U * (1 + 8 * U) * (x.abs() + t.abs() / s))


# --- gradients through a reversible stack ----------------------------------------------------


class TwoHeads(nn.Module):
    """A branch that returns ``(log_scale, shift)``: the affine coupling's tuple form."""

    def __init__(self, width):
        super().__init__()
        self.a, self.t = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x):
        return torch.tanh(self.a(x)), self.t(x)


def _branch(coupling, width, tuple_branch):
    if tuple_branch:
        return TwoHeads(width)
    return nn.Sequential(
        nn.Linear(width, 7), nn.Tanh(), nn.Linear(7, coupling.branch_size(width, split_dim=-1))
    )


@pytest.mark.parametrize("one_branch", [False, True], ids=["f-and-g", "f-only"])
@pytest.mark.parametrize(
    "name,tuple_branch",
    [(name, False) for name in COUPLINGS] + [("affine", True)],
    ids=[*COUPLINGS, "affine-tuple-branch"],
)
def test_stack_gradients_match_plain_autograd_float64(name, tuple_branch, one_branch):
    torch.manual_seed(0)
    width = 3
    blocks = []
    for _ in range(3):
        coupling = COUPLINGS[name]()
        f = _branch(coupling, width, tuple_branch)
        g = None if one_branch else _branch(coupling, width, tuple_branch)
        blocks.append(ReversibleBlock(f, g, coupling=coupling))
    rev = ReversibleSequential(*blocks).double()
    ref = copy.deepcopy(rev)
    x = torch.randn(5, 2 * width, dtype=torch.float64)
    y_rev, g_rev = step(lambda m, x, **k: m(x), rev, x, None)
    y_ref, g_ref = step(plain_forward, ref, x, None)
    assert torch.equal(y_rev, y_ref)
    assert_grads_match(g_rev, g_ref, 1e-12)
    assert all(g.abs().sum() > 0 for g in g_rev)  # every parameter and the input got a gradient


# --- bad input -------------------------------------------------------------------------------


def test_additive_check_names_the_shape_it_needs():
    c, x = AdditiveCoupling(), torch.zeros(2, 3)
    with pytest.raises(InvalidArgumentError, match=r"returned \(2, 6\) .*shape \(2, 3\).*keeps"):
        c.check(x, torch.zeros(2, 6), branch="f")
    with pytest.raises(InvalidArgumentError, match=r"branch g returned tuple"):
        c.check(x, (x, x), branch="g")
    c.check(x, torch.ones(2, 3), branch="f")


@pytest.mark.parametrize(
    "h,got",
    [
        (torch.zeros(2, 3), r"\[\(2, 3\)\]"),
        (torch.zeros(2, 5), r"\[\(2, 5\)\]"),
        (torch.zeros(4, 3), r"\[\(4, 3\)\]"),
        ((torch.zeros(2, 3),), r"\[\(2, 3\)\]"),
        ((torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3)), r"\[\(2, 3\), \(2, 3\), "),
        ((torch.zeros(2, 3), torch.zeros(3, 2)), r"\[\(2, 3\), \(3, 2\)\]"),
        ((torch.zeros(2, 3), 1.0), r"\[\(2, 3\)\]"),
        (None, r"\['NoneType'\]"),
    ],
    ids=["same-width", "odd", "wrong-dim", "1-tuple", "3-tuple", "tuple-shapes", "number", "None"],
)
def test_affine_check_names_what_it_got_and_needs(h, got):
    with pytest.raises(InvalidArgumentError, match=got + r".*\(log_scale, shift\).*twice"):
        AffineCoupling().check(torch.zeros(2, 3), h, branch="f")


def test_affine_check_a_dim_the_stream_lacks():
    with pytest.raises(InvalidArgumentError, match=r"dim=2.*shape \(2, 3\); pass a dim"):
        AffineCoupling(split_dim=2).check(torch.zeros(2, 3), torch.zeros(2, 3, 2), branch="f")
    with pytest.raises(InvalidArgumentError, match=r"dim=-1.*shape \(\)"):
        AffineCoupling().check(torch.tensor(1.0), torch.zeros(2), branch="f")


@pytest.mark.parametrize("clamp", [0, -1.0, float("inf"), float("nan"), "2", True, None])
def test_affine_bad_clamp(clamp):
    with pytest.raises(InvalidArgumentError, match=r"clamp=.*positive finite number"):
        AffineCoupling(clamp=clamp)


@pytest.mark.parametrize("dim", [1.0, "1", True, None])
def test_affine_bad_dim(dim):
    with pytest.raises(InvalidArgumentError, match=r"dim=.*int dimension"):
        AffineCoupling(split_dim=dim)


def test_branch_size():
    assert AdditiveCoupling().branch_size(5, split_dim=1) == 5
    assert Coupling().branch_size(5, split_dim=-1) == 5
    assert AffineCoupling().branch_size(5, split_dim=-1) == 10
    assert AffineCoupling(split_dim=1).branch_size(5, split_dim=1) == 10
    with pytest.raises(
        InvalidArgumentError, match=r"AffineCoupling\(split_dim=-1\).*along dim 1; pass "
    ):
        AffineCoupling().branch_size(5, split_dim=1)


def test_make_coupling():
    assert type(make_coupling("additive")) is AdditiveCoupling
    affine = make_coupling("affine", split_dim=1)
    assert type(affine) is AffineCoupling and (affine.split_dim, affine.clamp) == (1, 2.0)
    assert make_coupling("affine").split_dim == -1
    custom = GatedCoupling()
    assert make_coupling(custom, split_dim=1) is custom
    for bad in ["mult", "Affine", None, 3, AdditiveCoupling]:
        with pytest.raises(InvalidArgumentError, match=r"is not a coupling; use 'additive'"):
            make_coupling(bad)


def test_scaled_coupling_round_trip_and_refusals():
    from revckpt.layers import ScaledCoupling

    c = ScaledCoupling(0.25)
    x, h = torch.randn(5, 4, dtype=torch.float64), torch.randn(5, 4, dtype=torch.float64)
    torch.testing.assert_close(c.combine(x, h), 0.25 * x + h, rtol=0, atol=0)
    torch.testing.assert_close(c.separate(c.combine(x, h), h), x, rtol=1e-12, atol=1e-12)
    for bad in (0.0, -1.0, float("inf"), True, "0.5"):
        with pytest.raises(InvalidArgumentError, match="scale"):
            ScaledCoupling(bad)
    with pytest.raises(InvalidArgumentError, match="keeps the shape"):
        c.check(x, h[:, :2], branch="f")


@pytest.mark.parametrize("swap", [False, True])
def test_per_branch_couplings_and_swap_match_plain_autograd(swap):
    """``g_coupling=`` couples g's output with its own coupling; ``swap=True`` returns
    ``(y2, y1)``; a stack of such blocks rebuilds its inputs and gives plain autograd's
    gradients."""
    from revckpt.layers import ScaledCoupling

    torch.manual_seed(0)

    def block():
        f = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
        g = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
        return ReversibleBlock(f, g, coupling=ScaledCoupling(0.5), g_coupling="additive", swap=swap)

    blocks = [block().double() for _ in range(3)]
    x1, x2 = (torch.randn(6, 4, dtype=torch.float64, requires_grad=True) for _ in range(2))
    b = blocks[0]
    y1 = 0.5 * x1 + b.f(x2)
    y2 = x2 + b.g(y1)
    out = b(x1, x2)
    torch.testing.assert_close(out, (y2, y1) if swap else (y1, y2))
    torch.testing.assert_close(b.inverse(*out), (x1, x2), rtol=1e-12, atol=1e-12)
    assert ("swap=True" in repr(b)) == swap and "g_coupling=AdditiveCoupling()" in repr(b)
    rev = ReversibleSequential(*blocks, check_inverse=1e-9, on_drift="raise")
    plain = (x1, x2)
    for blk in blocks:
        plain = blk(*plain)
    got = rev((x1, x2))
    torch.testing.assert_close(got, plain, rtol=0, atol=0)
    loss = lambda pair: (pair[0] * 1.5 + pair[1].sin()).sum()  # noqa: E731
    ref = torch.autograd.grad(loss(plain), [x1, x2, *rev.parameters()])
    mine = torch.autograd.grad(loss(got), [x1, x2, *rev.parameters()])
    for a, r in zip(mine, ref, strict=True):
        torch.testing.assert_close(a, r, rtol=1e-10, atol=1e-12)


def test_g_coupling_and_swap_need_a_g_branch():
    with pytest.raises(InvalidArgumentError, match="need a g branch"):
        ReversibleBlock(nn.Linear(2, 2), swap=True)
    with pytest.raises(InvalidArgumentError, match="need a g branch"):
        ReversibleBlock(nn.Linear(2, 2), g_coupling="additive")
