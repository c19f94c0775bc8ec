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
    with Rehearsal({}).forward(block, x, "the block"):
        out = block(x)
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


class _CountsCalls(nn.Module):
    """Makes a call counter on its first call, which raises; later calls scale by it."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls = getattr(self, "calls", 0) + 1
        if self.calls == 1:
            raise RuntimeError("first call: out of memory (simulated)")
        return torch.tanh(self.linear(x) * self.calls)


def test_an_attribute_a_failed_forward_made_is_there_for_the_next_calls_recompute():
    """The failed call made ``calls``; the next forward found it (1) and counted to 2. Its
    recompute must start from 1 too, not without the attribute (found by review: the next
    forward took it for one it made itself, and the recompute computed with 1)."""
    torch.manual_seed(0)
    block, plain = _CountsCalls(), _CountsCalls()
    plain.load_state_dict(block.state_dict())
    x = torch.randn(3, 4)
    with pytest.raises(RuntimeError, match="simulated"):
        checkpoint(block, x.detach().requires_grad_())
    with pytest.raises(RuntimeError, match="simulated"):
        plain(x)
    for _ in range(2):
        assert torch.equal(_checkpointed_step(block, x), _plain_step(plain, x))
        _same_state(block, plain)
        assert block.calls == plain.calls


class _RegistersWithGrad(nn.Module):
    """Registers a running buffer on its first call with grad, then updates it each call with
    grad, and adds it to its output; has another buffer from the start."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 6)
        self.register_buffer("scale", torch.ones(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear(x) * self.scale
        if torch.is_grad_enabled():
            if "track" not in self._buffers:
                self.register_buffer("track", torch.zeros(6))
            with torch.no_grad():
                self.track.mul_(0.5).add_(h.mean(0))
            h = h * self.track
        return h


@pytest.mark.parametrize("first", ["checkpoint", "rehearse"])
def test_a_buffer_the_first_captured_forward_registers_is_absent_in_its_recompute(first):
    """The recompute starts as the forward did, without the buffer (else it would update the
    real one a second time and compute with it), and the next calls copy it (before: the
    rehearsal recorded the block as not writing it, and the next recompute raised)."""
    torch.manual_seed(0)
    block, plain = _RegistersWithGrad(), _RegistersWithGrad()
    plain.load_state_dict(block.state_dict())
    x = torch.randn(8, 6)
    if first == "checkpoint":
        assert torch.equal(_checkpointed_step(block, x), _plain_step(plain, x))
    else:
        rehearse(block, x.detach().requires_grad_())
        plain(x.detach().requires_grad_())
    for _ in range(2):
        _same_state(block, plain)
        assert torch.equal(_checkpointed_step(block, x), _plain_step(plain, x))
    _same_state(block, plain)


def test_a_profile_of_a_model_whose_backward_steps_its_optimizer_runs():
    """Optimizer steps fused into backward (``register_post_accumulate_grad_hook``) change
    parameters during the stored step's backward: each block's rehearsal replays right after
    its forward, as a recompute runs before its block's backward (replayed after the step,
    they raised ModifiedParameterError; found by review)."""
    from revckpt.models import gpt_like
    from revckpt.schedule import profile

    torch.manual_seed(0)
    model = gpt_like(depth=3, dim=16, heads=2)
    optimisers = {p: torch.optim.SGD([p], lr=1e-3) for p in model.parameters()}

    def step(p: torch.Tensor) -> None:
        optimisers[p].step()
        optimisers[p].zero_grad()

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(step)
    prof = profile(model, torch.randn(2, 8, 16), codecs=(), policies=(), repeats=1)
    assert len(prof.blocks) == 3 and all(learnt(b) for b in model)
