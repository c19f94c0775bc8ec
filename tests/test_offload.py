"""Host offload (revckpt.offload): gradients, what moves (never a parameter), what is freed.

On a machine without an accelerator the host is the device, so offloading keeps tensors in
place. ``copy_path`` forces the copies on the CPU: the same code path as on CUDA apart from
streams and pinning, so what moves, what is freed and what is prefetched are checked here;
``test_cuda_*`` measure device bytes where CUDA exists.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

import revckpt
from revckpt import InvalidArgumentError, InvalidInputTypeError, MemoryMeter, offload
from revckpt import _host_copies as host_copies
from revckpt.models import gpt_like, mlp_chain, revnet_like


@pytest.fixture
def copy_path():
    with offload.force_copies():
        yield


class Block(nn.Module):
    def __init__(self, dim: int = 12, p: float = 0.0) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.drop = nn.Dropout(p)

    def forward(self, x, mask=None):
        h = self.drop(torch.tanh(self.lin(x)))
        if mask is not None:
            h = h * mask
        return x + h


def _chain(n=4, p=0.0):
    torch.manual_seed(0)
    return nn.Sequential(*[Block(p=p) for _ in range(n)]).double()


def _grads(chain, run, x0, **kwargs):
    for q in chain.parameters():
        q.grad = None
    leaf = x0.clone().requires_grad_(True)
    torch.manual_seed(1)
    y = run(chain, leaf * 2, **kwargs)  # a non-leaf chain input, as after an embedding
    (y * torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view_as(y)).sum().backward()
    return [leaf.grad] + [q.grad for q in chain.parameters()]


@pytest.mark.parametrize("segments", [4, 2, [1, 3]])
@pytest.mark.parametrize("forced", [False, True])
def test_gradients_bitwise_equal_to_checkpoint(segments, forced, monkeypatch):
    monkeypatch.setattr(host_copies, "FORCED", [[False]] if forced else [])
    chain = _chain(p=0.2)  # dropout: the recompute replays the forward's masks
    x = torch.randn(5, 12, dtype=torch.float64)
    mask = (torch.rand(5, 12) > 0.3).double()
    want = _grads(
        chain, lambda c, h, **kw: revckpt.checkpoint_sequential(c, segments, h, **kw), x, mask=mask
    )
    got = _grads(
        chain,
        lambda c, h, **kw: revckpt.checkpoint_sequential(c, segments, h, strategy="offload", **kw),
        x,
        mask=mask,
    )
    for a, b in zip(want, got, strict=True):
        assert torch.equal(a, b)
    plain = _grads(
        chain, lambda c, h, **kw: c[3](c[2](c[1](c[0](h, **kw), **kw), **kw), **kw), x, mask=mask
    )
    for a, b in zip(plain, got, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_single_block_checkpoint(copy_path):
    block = Block().double()
    x = torch.randn(3, 12, dtype=torch.float64, requires_grad=True)
    h = x * 1.5
    with offload.record() as stats:
        revckpt.checkpoint(block, h, strategy="offload").sum().backward()
    assert stats.to_host_bytes == h.numel() * 8 and stats.to_device_bytes == h.numel() * 8
    got = [x.grad.clone()] + [q.grad.clone() for q in block.parameters()]
    x.grad = None
    block.zero_grad(set_to_none=True)
    block(x * 1.5).sum().backward()
    want = [x.grad] + [q.grad for q in block.parameters()]
    for a, b in zip(want, got, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


class UsesWeight(nn.Module):
    """A block that receives a parameter as a positional argument (a tied weight)."""

    def forward(self, x, weight):
        return torch.tanh(x @ weight)


def test_parameters_and_keyword_tensors_are_never_copied(copy_path):
    tied = nn.Parameter(torch.randn(12, 12, dtype=torch.float64))
    block = UsesWeight()
    mask = torch.ones(5, 12, dtype=torch.float64)
    leaf = torch.randn(5, 12, dtype=torch.float64, requires_grad=True)
    h = leaf * 2
    with offload.record() as stats:
        y = revckpt.checkpoint(
            block, h, tied, strategy="offload"
        )  # activation + parameter, positional
        y = revckpt.checkpoint_sequential(
            [Block().double()] * 2, 2, y, strategy="offload", mask=mask
        )
        y = revckpt.checkpoint(
            block, leaf, tied, strategy="offload"
        )  # a leaf requiring grad: the caller holds it
        y.sum().backward()
    activations = 2 * h.numel() * 8 + h.numel() * 8  # h, and the two inputs of the chain
    assert stats.to_host_bytes == activations
    assert stats.to_host_tensors == 3
    assert stats.kept_in_place == {
        "parameter": 2,
        "keyword argument": 2,
        "leaf tensor": 1,
    }
    assert stats.kept_in_place_bytes["parameter"] == 2 * tied.numel() * 8
    assert tied.grad is not None and leaf.grad is not None


def test_without_copies_on_the_host_nothing_moves():
    chain = _chain()
    with offload.record() as stats:
        h = torch.randn(5, 12, dtype=torch.float64, requires_grad=True) * 2
        revckpt.checkpoint_sequential(chain, 4, h, strategy="offload").sum().backward()
    assert stats.to_host_bytes == 0 and stats.to_device_bytes == 0
    assert stats.kept_in_place == {"already on the host": 4}


def _block_inputs(chain, run, x):
    """Weak references to every block's input tensor, alive or not after ``run``'s forward."""
    refs = []
    hooks = [
        b.register_forward_pre_hook(lambda _m, args: refs.append(weakref.ref(args[0])))
        for b in chain
    ]
    try:
        y = run(x)
    finally:
        for h in hooks:
            h.remove()
    gc.collect()
    return y, [r() is not None for r in refs]


def test_offloaded_boundaries_are_released_after_the_forward(copy_path):
    """What "zero device bytes" rests on: after the forward nothing holds the original block
    inputs (only their host copies); a checkpoint keeps every one of them."""
    chain = _chain(n=4)
    x = torch.randn(5, 12, dtype=torch.float64, requires_grad=True)
    y, alive = _block_inputs(
        chain, lambda h: revckpt.checkpoint_sequential(chain, 4, h * 2, strategy="offload"), x
    )
    assert alive == [False, False, False, False]
    y.sum().backward()
    _y2, alive2 = _block_inputs(chain, lambda h: revckpt.checkpoint_sequential(chain, 4, h * 2), x)
    assert alive2 == [True, True, True, True]


def test_prefetch_one_segment_ahead(copy_path):
    chain = _chain(n=5)
    x = torch.randn(5, 12, dtype=torch.float64, requires_grad=True)
    for prefetch, expected in ((True, 4), (False, 0)):
        with offload.record() as stats:
            y = revckpt.checkpoint_sequential(
                chain, 5, x * 2, strategy=revckpt.offload.Offload(prefetch=prefetch)
            )
            y.sum().backward()
        assert stats.to_device_tensors == 5
        assert stats.prefetched == expected


def test_prefetch_order_holds_at_most_two_boundaries(copy_path):
    """During a block's backward the device holds its input and the one prefetched before it:
    the copies back are made one ahead of the backward, never more."""
    chain = _chain(n=5)
    order = []
    real_fetch = host_copies._Offloaded.fetch

    def fetch(self):
        order.append(("fetch", id(self)))
        return real_fetch(self)

    taken = []
    real_take = host_copies._Offloaded.take

    def take(self):
        taken.append(id(self))
        in_flight = sum(1 for h in handles if h.on_device is not None)
        assert in_flight <= 1  # at most the prefetched one besides the one being taken
        return real_take(self)

    handles = []
    real_init = host_copies._Offloaded.__init__

    def init(self, *a, **k):
        real_init(self, *a, **k)
        handles.append(self)

    mp = pytest.MonkeyPatch()
    mp.setattr(host_copies._Offloaded, "fetch", fetch)
    mp.setattr(host_copies._Offloaded, "take", take)
    mp.setattr(host_copies._Offloaded, "__init__", init)
    try:
        x = torch.randn(5, 12, dtype=torch.float64, requires_grad=True)
        revckpt.checkpoint_sequential(chain, 5, x * 2, strategy="offload").sum().backward()
    finally:
        mp.undo()
    ids = [id(h) for h in handles]
    assert taken == ids[::-1]  # backward takes the last offloaded first
    fetched = [i for _, i in order]
    assert fetched == ids[::-1]  # each fetched once, in backward order (the first on demand)


def test_a_second_backward_copies_again(copy_path):
    chain = _chain(n=3)
    x = torch.randn(5, 12, dtype=torch.float64, requires_grad=True)
    y = revckpt.checkpoint_sequential(chain, 3, x * 2, strategy="offload")
    y.sum().backward(retain_graph=True)
    first = [q.grad.clone() for q in chain.parameters()]
    y.sum().backward()
    for a, q in zip(first, chain.parameters(), strict=True):
        torch.testing.assert_close(q.grad, 2 * a, rtol=1e-12, atol=0)


def test_bf16_autocast_matches_checkpoint():
    chain = _chain(n=3).float()
    x = torch.randn(5, 12)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = _grads(chain, lambda c, h: revckpt.checkpoint_sequential(c, 3, h), x)
        got = _grads(
            chain, lambda c, h: revckpt.checkpoint_sequential(c, 3, h, strategy="offload"), x
        )
    for a, b in zip(want, got, strict=True):
        assert torch.equal(a, b)


def test_bad_input():
    chain = _chain(n=2)
    x = torch.randn(5, 12, dtype=torch.float64)
    with pytest.raises(InvalidInputTypeError, match="callable"):
        revckpt.checkpoint("not a block", x, strategy="offload")
    with pytest.raises(InvalidInputTypeError, match=r"must be a torch\.Tensor"):
        revckpt.checkpoint_sequential(chain, 2, [x], strategy="offload")
    with pytest.raises(InvalidArgumentError, match="pin_memory"):
        revckpt.checkpoint_sequential(
            chain, 2, x, strategy=revckpt.offload.Offload(pin_memory="yes")
        )
    with pytest.raises(InvalidArgumentError, match="segments"):
        revckpt.checkpoint_sequential(chain, 5, x, strategy="offload")


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cuda
def test_cuda_offloaded_boundaries_hold_no_device_bytes():
    torch.manual_seed(0)
    chain = nn.Sequential(*[Block(dim=256) for _ in range(6)]).cuda()
    x = torch.randn(64, 128, 256, device="cuda", requires_grad=True)
    boundary = x.numel() * 4
    results = {}
    for name, run in (
        ("checkpoint", lambda h: revckpt.checkpoint_sequential(chain, 6, h)),
        ("offload", lambda h: revckpt.checkpoint_sequential(chain, 6, h, strategy="offload")),
    ):
        torch.cuda.synchronize()
        with MemoryMeter("cuda") as meter, offload.record() as stats:
            h = x * 2  # the chain input as an activation, made inside the meter
            y = run(h)
            del h
            torch.cuda.synchronize()
        results[name] = (meter.end_bytes - y.numel() * 4, stats)
        y.sum().backward()
    kept_ckpt, _ = results["checkpoint"]
    kept_off, stats = results["offload"]
    assert kept_ckpt == 6 * boundary  # every boundary on the device
    assert kept_off == 0  # retained device bytes: the output only
    assert stats.to_host_bytes == 6 * boundary  # the boundaries, nothing else


@pytest.fixture
def host_off_the_meter():
    """Host copies as NumPy arrays, which MemoryMeter does not see: on the CPU, the bytes the
    meter counts behave as device bytes do on CUDA (a copy back allocates, a copy out frees)."""
    with offload.force_copies(simulate_device=True):
        yield


def test_offloaded_boundaries_leave_nothing_on_the_meter(host_off_the_meter):
    chain = _chain(n=4)
    x = torch.randn(5, 12, dtype=torch.float64, requires_grad=True)
    for run, boundaries in (
        (lambda h: revckpt.checkpoint_sequential(chain, 4, h), 4),
        (lambda h: revckpt.checkpoint_sequential(chain, 4, h, strategy="offload"), 0),
    ):
        with MemoryMeter("cpu") as meter:
            h = x * 2
            y = run(h)
            del h
        assert meter.end_bytes - y.numel() * 8 == boundaries * x.numel() * 8
        y.sum().backward()


@pytest.mark.parametrize(
    "make",
    [
        lambda: (gpt_like(6, 32, 2), torch.randn(2, 32, 32), True),
        # an offloaded node returns its parameter gradients at once and holds its rebuilt
        # output (as an approx node does): on these blocks that costs more than the
        # boundaries a checkpoint keeps
        lambda: (revnet_like((2, 2), (8, 16)), torch.randn(4, 3, 16, 16), False),
        lambda: (mlp_chain(6, 64, 256), torch.randn(64, 64), False),
    ],
    ids=["gpt", "revnet", "mlp"],
)
def test_offload_plans_with_inputs_moved_off_the_meter(make, host_off_the_meter):
    """The scheduler's model of moved inputs (nothing kept, the copy back next to the caller's
    chain input, the prefetched input during a block's backward), measured in bytes."""
    from revckpt.report import measure_peak
    from revckpt.schedule import Segment, apply, make_plan, profile, solve

    torch.manual_seed(0)
    chain, x, lower = make()
    n = len(chain)
    prof = profile(chain, x, repeats=1, codecs=("e4m3",), policies=(), offload=True)
    assert all(b.offload.kept_bytes == 0 for b in prof.blocks)  # everything moved
    plans = [
        make_plan(prof, [Segment(0, n, "offload")]),
        make_plan(prof, [Segment(0, 2, "store"), Segment(2, n, "offload")]),
        make_plan(prof, [Segment(0, 3, "offload"), Segment(3, n, "checkpoint")]),
        make_plan(
            prof, [Segment(0, 2, "offload"), Segment(2, 4, "offload"), Segment(4, n, "store")]
        ),
        make_plan(
            prof,
            [Segment(0, 1, "checkpoint"), Segment(1, 3, "approx:e4m3"), Segment(3, n, "offload")],
        ),
    ]
    plans.append(solve(prof, memory_budget=plans[0].predicted_peak_bytes, error_budget=0.02))
    per_block = make_plan(prof, [Segment(i, i + 1, "checkpoint") for i in range(n)])
    assert (plans[0].predicted_peak_bytes < per_block.predicted_peak_bytes) == lower
    for plan in plans:
        # x as measure_peak passes it (a leaf requiring grad: block 0's input stays in place
        # instead of moving, so the prediction may be above, never below)
        ratio = measure_peak(apply(chain, plan), x) / plan.predicted_peak_bytes
        assert 0.95 <= ratio <= 1.0 + 1e-3, (plan.strategies, ratio)


@pytest.mark.parametrize(
    "segments",
    [
        # an offloaded block's node holds its output's gradient while its parameter gradients
        # are made (the transient is measured so)
        [(0, 3, "store"), (3, 4, "offload"), (4, 5, "reversible"), (5, 7, "store")],
        [(0, 3, "store"), (3, 4, "approx:e4m3"), (4, 5, "reversible"), (5, 7, "store")],
        # compressing the head's input, next to everything stored: the codec's temporaries
        [(0, 6, "store"), (6, 7, "approx:e4m3")],
    ],
    ids=["offload-node", "approx-node", "approx-encode"],
)
def test_node_and_encode_peaks_are_predicted(segments, host_off_the_meter):
    from revckpt.report import measure_peak
    from revckpt.schedule import Segment, apply, make_plan, profile

    torch.manual_seed(0)
    chain, x = revnet_like((2, 2), (8, 16)), torch.randn(4, 3, 16, 16)
    prof = profile(chain, x, repeats=1, codecs=("e4m3",), policies=(), offload=True)
    plan = make_plan(prof, [Segment(*s) for s in segments])
    ratio = measure_peak(apply(chain, plan), x) / plan.predicted_peak_bytes
    assert 0.99 <= ratio <= 1.0 + 1e-3, ratio


@pytest.mark.parametrize("forced", [False, True])
def test_an_input_modified_in_place_after_the_block_raises(forced, monkeypatch):
    """Saved-tensor hooks bypass autograd's version check; offload makes its own, for tensors
    kept in place and for copied tensors whose source is still alive."""
    monkeypatch.setattr(host_copies, "FORCED", [[False]] if forced else [])
    lin = nn.Linear(8, 8)
    x = torch.randn(3, 8, requires_grad=True)
    h = x * 1
    y = revckpt.checkpoint(lin, h, strategy="offload")
    h.add_(1)
    with pytest.raises(revckpt.ModifiedInputError, match="modified in place"):
        y.pow(2).sum().backward()
    # unchanged: fine, and the same gradients as a plain run
    h = x * 1
    revckpt.checkpoint(lin, h, strategy="offload").pow(2).sum().backward()


def test_force_copies_is_scoped():
    assert not host_copies._copying()
    with offload.force_copies():
        assert host_copies._copying() and not host_copies._simulating()
        with offload.force_copies(simulate_device=True):
            assert host_copies._simulating()
        assert host_copies._copying() and not host_copies._simulating()
    assert not host_copies._copying()
    with (
        pytest.raises(InvalidArgumentError, match="simulate_device"),
        offload.force_copies(simulate_device="yes"),
    ):
        pass


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
def test_simulated_device_round_trips_every_dtype_bitwise(dtype, host_off_the_meter):
    torch.manual_seed(0)
    block = Block().to(dtype)
    x = torch.randn(4, 3, 12).to(dtype).requires_grad_(True)
    want = torch.autograd.grad(revckpt.checkpoint(block, x * 1).sum(), [x, *block.parameters()])
    got = torch.autograd.grad(
        revckpt.checkpoint(block, x * 1, strategy="offload").sum(), [x, *block.parameters()]
    )
    for a, b in zip(want, got, strict=True):
        assert torch.equal(a, b)


def test_force_copies_in_overlapping_threads_ends_with_the_last():
    """Blocks entered and left in any order (two threads): copies stay forced until the last
    one ends, and nothing stays forced afterwards."""
    first, second = offload.force_copies(), offload.force_copies(simulate_device=True)
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)  # the first thread leaves before the second
    assert host_copies._copying() and host_copies._simulating()
    second.__exit__(None, None, None)
    assert not host_copies._copying() and not host_copies._simulating()


@pytest.mark.parametrize("segments", [2, 6])
def test_keyword_tensor_gradients_equal_checkpoint_to_round_off(segments):
    """A keyword tensor used by several operations of one node: its gradient is the sum of the
    uses' contributions, added to the rest by autograd; plain autograd adds each in turn. The
    same additions in another order: equal to round-off, not bitwise (docs/offload.md)."""

    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(16, 16)

        def forward(self, x, scale):
            return torch.tanh(self.lin(x) * scale) + scale

    torch.manual_seed(0)
    blocks = nn.ModuleList([Scaled() for _ in range(6)]).double()
    x = torch.randn(5, 16, dtype=torch.float64, requires_grad=True)

    def grad(run):
        scale = torch.linspace(0.5, 1.5, 16, dtype=torch.float64).requires_grad_(True)
        run(scale).pow(2).sum().backward()
        return scale.grad

    expected = grad(lambda s: revckpt.checkpoint_sequential(blocks, segments, x, scale=s))
    with offload.force_copies():
        got = grad(
            lambda s: revckpt.checkpoint_sequential(
                blocks, segments, x, strategy="offload", scale=s
            )
        )
    torch.testing.assert_close(got, expected, rtol=1e-13, atol=0)
