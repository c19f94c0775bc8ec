import pytest
import torch
from torch import nn

from revckpt.replay import ForwardState, devices_of, freeze_running_stats, is_replaying


def test_rng_state_dropped_when_unused_and_kept_when_used():
    x = torch.randn(4)
    state = ForwardState.capture(x)
    _ = x * 2
    state.forward_finished()
    assert state.retained_bytes == 0 and state.rng_devices == ()

    state = ForwardState.capture(x)
    first = torch.rand(3)
    state.forward_finished()
    assert state.rng_devices == (torch.device("cpu"),)
    after = torch.rand(3)
    with state.replay():
        assert is_replaying()
        assert torch.equal(torch.rand(3), first)
    assert not is_replaying()
    assert not torch.equal(after, first)


def test_replay_restores_caller_rng_exactly():
    state = ForwardState.capture()
    torch.rand(5)
    state.forward_finished()
    before = torch.get_rng_state()
    with state.replay():
        torch.rand(100)
    assert torch.equal(before, torch.get_rng_state())


def test_no_rng_capture_when_disabled():
    state = ForwardState.capture(preserve_rng_state=False)
    torch.rand(3)
    state.forward_finished()
    assert state.retained_bytes == 0


def test_autocast_state_replayed_and_outer_autocast_disabled():
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = ForwardState.capture()
        inside.forward_finished()  # releases the RNG lock a capture takes
    outside = ForwardState.capture()
    outside.forward_finished()
    a = torch.randn(4, 4)
    with inside.replay():
        assert (a @ a).dtype == torch.bfloat16
    with torch.autocast("cpu", dtype=torch.bfloat16), outside.replay():
        assert (a @ a).dtype == torch.float32


def test_freeze_running_stats_keeps_outputs_and_buffers():
    bn = nn.BatchNorm1d(3).train()
    x = torch.randn(8, 3)
    y1 = bn(x)
    buffers = [b.clone() for b in bn.buffers()]
    with freeze_running_stats():
        y2 = bn(x)
    assert torch.equal(y1, y2)
    for a, b in zip(buffers, bn.buffers(), strict=True):
        assert torch.equal(a, b)
    assert bn.running_mean is not None and int(bn.num_batches_tracked) == 1


def test_freeze_running_stats_restores_buffers_after_an_error():
    bn = nn.BatchNorm1d(3).train()
    original = bn.running_mean
    with pytest.raises(RuntimeError), freeze_running_stats():
        bn(torch.randn(8, 5))  # wrong width
    assert bn.running_mean is original


def test_eval_mode_buffers_not_swapped():
    bn = nn.BatchNorm1d(3).eval()
    seen = []
    bn.register_forward_pre_hook(lambda m, i: seen.append(m.running_mean))
    with freeze_running_stats():
        bn(torch.randn(4, 3))
    assert seen[0] is bn.running_mean  # eval mode reads the real statistics, no copies
    bn.train()
    with freeze_running_stats():
        bn(torch.randn(4, 3))
    assert seen[1] is not bn.running_mean  # training mode updates a throwaway copy


def test_devices_of():
    lin = nn.Linear(2, 2)
    assert devices_of(lin, (torch.randn(1), {"a": torch.randn(1)}), 3) == [torch.device("cpu")]
    assert devices_of(torch.empty(1, device="meta")) == []


def test_nested_freezes_restore_the_real_buffers():
    bn = nn.BatchNorm1d(3).train()
    real = [bn.running_mean, bn.running_var, bn.num_batches_tracked]
    with freeze_running_stats():
        bn(torch.randn(4, 3))
        with freeze_running_stats():
            bn(torch.randn(4, 3))
        bn(torch.randn(4, 3))
    assert [bn.running_mean, bn.running_var, bn.num_batches_tracked] == real
    assert all(
        a is b
        for a, b in zip(
            real, [bn.running_mean, bn.running_var, bn.num_batches_tracked], strict=True
        )
    )
    assert int(bn.num_batches_tracked) == 0


def test_nested_checkpoint_through_create_graph_keeps_real_buffers():
    import revckpt

    block = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Tanh()).double()
    real = block[1].running_mean
    x = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)

    def penalty(x):
        h = revckpt.checkpoint(block, x)
        (g,) = torch.autograd.grad(h.pow(2).sum(), x, create_graph=True)
        return g

    revckpt.checkpoint(penalty, x).sum().backward()
    assert block[1].running_mean is real


def test_devices_of_walks_nested_arguments_and_other_pytrees():
    from collections import namedtuple

    pair = namedtuple("pair", "a b")
    t = torch.randn(2)
    meta = torch.empty(2, device="meta")
    found = devices_of(((t, [meta, {"k": (t,)}]), {"mask": pair(meta, t)}, 3, "s", None))
    assert found == [torch.device("cpu")]
    assert devices_of((meta,), {}) == []
    assert devices_of(nn.Linear(2, 2)) == []  # no accelerator started: modules are on the CPU


def test_generator_states_compare_as_torch_equal_does():
    """The eight-bytes-at-a-time comparison of generator states agrees with torch.equal on a
    real state, a changed byte, and uint8 tensors it cannot view as int64 (an odd offset, a
    2-D shape, an odd size), where it falls back."""
    from revckpt.replay import _same_state

    state = torch.get_rng_state()
    changed = state.clone()
    changed[4000] ^= 1
    cases = [
        (state, state.clone()),
        (state, changed),
        (torch.zeros(17, dtype=torch.uint8)[1:], torch.zeros(16, dtype=torch.uint8)),
        (torch.zeros(8, 1, dtype=torch.uint8), torch.zeros(8, 1, dtype=torch.uint8)),
        (torch.zeros(5, dtype=torch.uint8), torch.ones(5, dtype=torch.uint8)),
    ]
    for a, b in cases:
        assert _same_state(a, b) == torch.equal(a, b)
