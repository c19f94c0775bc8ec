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
    outside = ForwardState.capture()
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


def test_eval_mode_untouched():
    bn = nn.BatchNorm1d(3).eval()
    with freeze_running_stats():
        bn(torch.randn(4, 3))
    assert int(bn.num_batches_tracked) == 0


def test_devices_of():
    lin = nn.Linear(2, 2)
    assert devices_of(lin, (torch.randn(1), {"a": torch.randn(1)}), 3) == [torch.device("cpu")]
    assert devices_of(torch.empty(1, device="meta")) == []
