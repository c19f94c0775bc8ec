"""``engine.rehearsal.Rehearsal``: a block's first recomputed call and recompute run ahead of
time, so that its next recomputed call costs what later ones do, with nothing else changed;
and a forward that raises teaches nothing (``ForwardState.forward_finished(completed=False)``)."""

import sys

import pytest
import torch
from torch import nn

from revckpt import checkpoint
from revckpt.engine.rehearsal import Rehearsal
from revckpt.replay import learnt


class _CountedCalls:
    """Counts the Python calls made while it is active (``sys.setprofile``): deterministic,
    unlike their time."""

    def __enter__(self) -> "_CountedCalls":
        self.calls = 0

        def tracer(frame, event, arg):
            if event in ("call", "c_call"):
                self.calls += 1

        sys.setprofile(tracer)
        return self

    def __exit__(self, *exc) -> None:
        sys.setprofile(None)


def _bn_block() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6), nn.Dropout(0.2), nn.Linear(6, 6))


def _checkpointed_step(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    h = x.detach().requires_grad_()
    checkpoint(block, h).pow(2).sum().backward()
    return h.grad


def _plain_step(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    h = x.detach().requires_grad_()
    block(h).pow(2).sum().backward()
    return h.grad


def rehearse(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A plain forward of ``block`` with grad, rehearsed; its output."""
    rehearsal = Rehearsal({})
    with rehearsal.forward(block, x, "the block"):
        out = block(x)
    rehearsal.recompute()
    return out


def _same_state(a: nn.Module, b: nn.Module) -> None:
    for (k, v), w in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(v, w), k
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None)
        assert p.grad is None or torch.equal(p.grad, q.grad)


def test_rehearse_makes_the_next_recomputed_call_a_steady_one():
    x = torch.randn(8, 6)
    rehearsed, fresh = _bn_block(), _bn_block()
    assert not learnt(rehearsed)
    rehearse(rehearsed, x.requires_grad_())
    assert learnt(rehearsed)
    _checkpointed_step(fresh, x)  # a first call (learns), then steady
    with _CountedCalls() as steady:
        _checkpointed_step(fresh, x)
    with _CountedCalls() as after_rehearsal:
        _checkpointed_step(rehearsed, x)
    with _CountedCalls() as first:
        _checkpointed_step(_bn_block(), x)
    assert after_rehearsal.calls == steady.calls < first.calls


def test_rehearse_is_one_forward_for_the_models_state_and_changes_no_gradient():
    """Its forward updates the running statistics and draws dropout masks as one plain forward
    with grad does; its recompute changes neither; no gradient is made."""
    x = torch.randn(8, 6)
    block, plain = _bn_block(), _bn_block()
    torch.manual_seed(1)
    rehearse(block, x.detach().requires_grad_())
    after_block = torch.rand(3)
    torch.manual_seed(1)
    plain(x.detach().requires_grad_())
    after_plain = torch.rand(3)
    assert torch.equal(after_block, after_plain)  # the same draws
    _same_state(block, plain)  # statistics once; no gradient
    torch.manual_seed(2)
    got = _checkpointed_step(block, x)
    torch.manual_seed(2)
    assert torch.equal(got, _plain_step(plain, x))
    _same_state(block, plain)


class _GradOnly(nn.Module):
    """Takes another path with grad than without: a BatchNorm it does not register (reached
    as a global would be), and a buffer, written only when grad mode is on."""

    def __init__(self, foreign: nn.Module) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 6)
        self.register_buffer("steps", torch.zeros(()))
        self.foreign = [foreign]  # not a submodule

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear(x)
        if torch.is_grad_enabled():
            self.steps.add_(1)
            h = self.foreign[0](h)
        return h


def _grad_only() -> _GradOnly:
    torch.manual_seed(0)
    return _GradOnly(nn.BatchNorm1d(6))


def test_what_a_block_does_only_with_grad_is_learnt_by_rehearse():
    """A no-grad pass would not see the foreign BatchNorm (the recompute then updates it a
    second time) nor the buffer written (the recompute then raises): rehearse runs with grad."""
    x = torch.randn(8, 6)
    block, plain = _grad_only(), _grad_only()
    with torch.no_grad():
        block(x), plain(x)
    rehearse(block, x.detach().requires_grad_())
    plain(x.detach().requires_grad_())
    for _ in range(2):
        got = _checkpointed_step(block, x)
        assert torch.equal(got, _plain_step(plain, x))
        _same_state(block, plain)
        _same_state(block.foreign[0], plain.foreign[0])


class _FailsOnce(nn.Module):
    """Writes buffer ``a``, then raises, on its first call; writes ``a`` and ``b`` on later
    ones."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 6)
        self.register_buffer("a", torch.zeros(6))
        self.register_buffer("b", torch.zeros(6))
        self._failed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.a.add_(1)
        if not self._failed:
            self._failed = True
            raise RuntimeError("out of memory (simulated)")
        self.b.add_(1)
        return self.linear(x) * (self.a + self.b)


@pytest.mark.parametrize("first", ["checkpoint", "rehearse"])
def test_a_forward_that_raises_records_nothing_of_what_the_block_does(first):
    """What a forward did before it raised (one buffer of two written) is not taken for what
    the block does: its next call learns again, and its recompute runs as its forward ran
    (before, that recompute raised ReplayError for the buffer not seen written)."""
    x = torch.randn(4, 6)
    block, plain = _FailsOnce(), _FailsOnce()
    plain.load_state_dict(block.state_dict())
    with pytest.raises(RuntimeError, match="simulated"):
        if first == "checkpoint":
            checkpoint(block, x.detach().requires_grad_())
        else:
            rehearse(block, x.detach().requires_grad_())
    with pytest.raises(RuntimeError, match="simulated"):
        plain(x)
    got = _checkpointed_step(block, x)
    assert torch.equal(got, _plain_step(plain, x))
    _same_state(block, plain)
