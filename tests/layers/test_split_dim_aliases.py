"""``dim=`` for the dimension a tensor is split along is now ``split_dim=``; the old keyword
works for one release, with a FutureWarning naming the new one, and gives the same result."""

import pytest
import torch

from revckpt import InvalidArgumentError
from revckpt.layers import (
    AffineCoupling,
    Coupling,
    EnterStreams,
    LeaveStreams,
    ReversibleSequential,
    make_coupling,
    reversible_mlp_block,
)
from revckpt.layers.convert import ReversibleStack


def test_affine_coupling_dim_alias():
    with pytest.warns(FutureWarning, match=r"AffineCoupling\(split_dim=\.\.\.\)"):
        old = AffineCoupling(clamp=1.0, dim=1)
    new = AffineCoupling(clamp=1.0, split_dim=1)
    assert repr(old) == repr(new) and old.split_dim == 1
    with pytest.warns(FutureWarning, match=r"AffineCoupling\.split_dim"):
        assert new.dim == 1
    with pytest.raises(InvalidArgumentError, match="split_dim only"), pytest.warns(FutureWarning):
        AffineCoupling(split_dim=0, dim=1)


def test_make_coupling_dim_alias():
    with pytest.warns(FutureWarning, match=r"make_coupling\(coupling, split_dim=\.\.\.\)"):
        old = make_coupling("affine", dim=1)
    assert repr(old) == repr(make_coupling("affine", split_dim=1))


def test_branch_size_dim_alias():
    with pytest.warns(FutureWarning, match=r"branch_size\(size, split_dim=\.\.\.\)"):
        assert AffineCoupling(split_dim=1).branch_size(5, dim=1) == 10
    with pytest.warns(FutureWarning, match=r"branch_size\(size, split_dim=\.\.\.\)"):
        assert Coupling().branch_size(5, dim=-1) == Coupling().branch_size(5, split_dim=-1)


def test_streams_dim_alias():
    x = torch.randn(2, 6, 3)
    with pytest.warns(FutureWarning, match=r"EnterStreams\(mode, split_dim=\.\.\.\)"):
        old = EnterStreams("split", dim=1)
    new = EnterStreams("split", split_dim=1)
    assert all(torch.equal(a, b) for a, b in zip(old(x), new(x), strict=True))
    with pytest.warns(FutureWarning, match=r"LeaveStreams\(mode, split_dim=\.\.\.\)"):
        leave = LeaveStreams("concat", dim=1)
    assert torch.equal(leave(new(x)), LeaveStreams("concat", split_dim=1)(new(x)))


def test_reversible_stack_dim_alias():
    torch.manual_seed(0)
    rev = ReversibleSequential(reversible_mlp_block(3, 8))
    x = torch.randn(4, 6)
    with pytest.warns(FutureWarning, match=r"ReversibleStack\(rev, split_dim=\.\.\.\)"):
        old = ReversibleStack(rev, enter="split", leave="concat", dim=-1)
    new = ReversibleStack(rev, enter="split", leave="concat", split_dim=-1)
    assert torch.equal(old(x), new(x))


def test_custom_coupling_with_the_old_branch_size_keyword():
    class Wide(Coupling):
        def combine(self, x, h):
            return x + h.chunk(2, dim=-1)[0]

        def separate(self, y, h):
            return y - h.chunk(2, dim=-1)[0]

        def branch_size(self, size, *, dim):
            return 2 * size

    with pytest.warns(FutureWarning, match=r"Wide\.branch_size\(size, \*, split_dim\)"):
        block = reversible_mlp_block(4, 8, coupling=Wide())
    assert block.f.fc2.out_features == 8
