"""Approximate recompute: memory kept, exactness without compression, autograd citizenship."""

import pytest
import torch
from helpers import bitwise_equal, train_step, twin
from torch import nn

import revckpt
from revckpt import (
    InvalidArgumentError,
    InvalidInputTypeError,
    MemoryMeter,
    ReplayError,
    RevckptError,
)
from revckpt.approx import Approx
from revckpt.layers import ReversibleSequential, reversible_mlp_block
from revckpt.models import ResidualMLPBlock, mlp_chain


def _held(store, x, block):
    xx = x.detach().clone().requires_grad_()
    with MemoryMeter("cpu") as meter:
        y = revckpt.checkpoint(block, xx, strategy=Approx(store=store))
    return meter.end_bytes - y.numel() * y.element_size(), y, xx


def test_retained_bytes_half_for_bf16_quarter_for_fp8():
    block = ResidualMLPBlock(512, 1024)
    x = torch.randn(64, 512)
    fp32 = x.numel() * 4
    held = {s: _held(s, x * 1, block)[0] for s in ("bf16", "e4m3", "e5m2")}
    assert held["bf16"] == fp32 // 2
    scales = 64 * 4  # one float32 scale per row
    assert held["e4m3"] == fp32 // 4 + scales and held["e5m2"] == fp32 // 4 + scales


def test_input_is_not_kept_when_compressed():
    block = ResidualMLPBlock(64, 128)
    held, _, _ = _held("e4m3", torch.randn(16, 64), block)
    # the caller's x is its own; what the node keeps is only the encoding
    assert held == 16 * 64 + 16 * 4


def test_no_compression_is_bitwise_plain_checkpoint():
    chain = mlp_chain(4, 32, 64, dropout=0.2, norm="batch")
    other = twin(chain)
    x = torch.randn(16, 32, requires_grad=True)

    def run_plain(m, xx):
        return revckpt.checkpoint_sequential(m, 4, xx)

    def run_approx(m, xx):
        return revckpt.checkpoint_sequential(m, 4, xx, strategy=Approx(store=None))

    out_a, grads_a, dx_a = train_step(chain, x, run_plain)
    out_b, grads_b, dx_b = train_step(other, x, run_approx)
    assert torch.equal(out_a, out_b) and torch.equal(dx_a, dx_b)
    assert bitwise_equal(grads_a, grads_b)
    assert bitwise_equal(list(chain.buffers()), list(other.buffers()))


def test_single_block_no_compression_matches_revckpt_checkpoint():
    block = ResidualMLPBlock(32, 64, dropout=0.3)
    other = twin(block)
    x = torch.randn(8, 32, requires_grad=True)
    a = train_step(block, x, lambda m, xx: revckpt.checkpoint(m, xx))
    b = train_step(other, x, lambda m, xx: revckpt.checkpoint(m, xx, strategy=Approx(store=None)))
    assert torch.equal(a[0], b[0]) and bitwise_equal(a[1], b[1]) and torch.equal(a[2], b[2])


@pytest.mark.parametrize("store", ["bf16", "e4m3", "e5m2"])
def test_forward_exact_gradients_close(store):
    chain = mlp_chain(3, 32, 64)  # ReLU: activation flips add to the first-order error
    other = twin(chain)
    x = torch.randn(16, 32, requires_grad=True)
    out_a, grads_a, dx_a = train_step(chain, x)
    out_b, grads_b, dx_b = train_step(
        other,
        x,
        lambda m, xx: revckpt.checkpoint_sequential(m, 3, xx, strategy=Approx(store=store)),
    )
    assert torch.equal(out_a, out_b)  # only backward sees the approximation
    a, b = torch.cat([g.flatten() for g in grads_a]), torch.cat([g.flatten() for g in grads_b])
    tol = {"bf16": 3e-2, "e4m3": 2e-1, "e5m2": 3e-1}[store]
    assert 0 < ((a - b).norm() / a.norm()).item() < tol
    assert ((dx_a - dx_b).norm() / dx_a.norm()).item() < 2 * tol  # input grad: flips add up


def test_bf16_recompute_runs_under_autocast_and_first_forward_stays_exact():
    block = ResidualMLPBlock(32, 64)
    x = torch.randn(8, 32, requires_grad=True)
    seen = []
    block.fc1.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    y = revckpt.checkpoint(block, x, strategy=Approx(store=None, recompute_dtype=torch.bfloat16))
    assert y.dtype == torch.float32 and seen == [torch.float32]
    y.sum().backward()
    assert seen == [torch.float32, torch.bfloat16]
    assert block.fc1.weight.grad.dtype == torch.float32
    ref = twin(block)
    ref.zero_grad()
    ref(x.detach()).sum().backward()
    rel = (block.fc1.weight.grad - ref.fc1.weight.grad).norm() / ref.fc1.weight.grad.norm()
    assert 0 < rel < 3e-2


def test_autograd_grad_and_inputs_without_grad_and_kwargs():
    class Masked(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(16, 16)

        def forward(self, x, *, scale):
            return self.lin(x) * scale

    block = Masked()
    x = torch.randn(4, 16)  # does not require grad
    scale = torch.rand(4, 1, requires_grad=True)
    y = revckpt.checkpoint(block, x, strategy=Approx(store="e4m3"), scale=scale)
    gw, gs = torch.autograd.grad(y.sum(), (block.lin.weight, scale))
    ref_w, ref_s = torch.autograd.grad(block(x, scale=scale).sum(), (block.lin.weight, scale))
    assert (gw - ref_w).norm() < 0.1 * ref_w.norm()
    assert (gs - ref_s).norm() < 0.1 * ref_s.norm()
    assert block.lin.weight.grad is None


def test_retain_graph_and_accumulation():
    block = ResidualMLPBlock(16, 32)
    x = torch.randn(4, 16, requires_grad=True)
    y = revckpt.checkpoint(block, x, strategy=Approx(store="bf16"))
    y.sum().backward(retain_graph=True)
    first = block.fc1.weight.grad.clone()
    y.sum().backward()
    assert torch.allclose(block.fc1.weight.grad, 2 * first)


def test_no_grad_forward_keeps_nothing():
    block = ResidualMLPBlock(64, 128)
    x = torch.randn(16, 64)
    with torch.no_grad(), MemoryMeter("cpu") as meter:
        y = revckpt.checkpoint(block, x, strategy=Approx(store="e4m3"))
    assert meter.end_bytes == y.numel() * 4


def test_integer_arguments_kept_exact():
    emb = nn.Embedding(10, 8)

    def fn(ids, h):
        return emb.weight[ids] + h

    class F(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = emb

        def forward(self, ids, h):
            return fn(ids, h)

    ids = torch.tensor([1, 2, 3])
    h = torch.randn(3, 8, requires_grad=True)
    revckpt.checkpoint(F(), ids, h, strategy=Approx(store="e4m3")).sum().backward()
    assert emb.weight.grad is not None and h.grad is not None


def test_unregistered_tensor_raises_with_fix():
    w = torch.randn(8, 8, requires_grad=True)

    def fn(x):
        return x @ w

    y = revckpt.checkpoint(fn, torch.randn(2, 8, requires_grad=True), strategy=Approx(store="bf16"))
    with pytest.raises(InvalidArgumentError, match=r"register it in an nn\.Module"):
        y.sum().backward()


def test_nothing_to_differentiate_runs_plainly():
    frozen = nn.Linear(8, 8).requires_grad_(False)
    y = revckpt.checkpoint(frozen, torch.randn(2, 8), strategy=Approx(store="e4m3"))
    assert not y.requires_grad  # no node, nothing kept
    w = torch.randn(8, 8, requires_grad=True)
    z = revckpt.checkpoint(lambda x: x @ w, torch.randn(2, 8), strategy=Approx(store="e4m3"))
    z.sum().backward()  # a closure over a leaf: plain autograd, exact gradient
    assert w.grad is not None


def test_parameter_hooks_fire_once_through_segments():
    chain = mlp_chain(4, 16, 32)
    calls = []
    chain[1].fc1.weight.register_hook(lambda g: calls.append(1))
    x = torch.randn(4, 16, requires_grad=True)
    revckpt.checkpoint_sequential(chain, 2, x, strategy=Approx(store="e4m3")).sum().backward()
    assert calls == [1] and chain[1].fc1.weight.grad is not None


def test_segments_of_a_module_chain_are_built_once_and_follow_its_blocks():
    from revckpt.engine.chain import _SEGMENTS

    chain, x = mlp_chain(4, 16, 32), torch.randn(4, 16, requires_grad=True)
    calls = []
    chain[1].fc1.weight.register_hook(lambda g: calls.append(1))

    def step(blocks):
        y = revckpt.checkpoint_sequential(blocks, 2, x, strategy=Approx(store=None))
        y.sum().backward()
        return y

    step(chain)
    built = dict(_SEGMENTS[chain])
    assert sorted(built) == [(0, 2), (2, 4)]
    step(chain)
    assert all(_SEGMENTS[chain][k] is v for k, v in built.items())  # reused
    assert calls == [1, 1]  # the hook fires once per step through the reused segment
    chain[3] = ResidualMLPBlock(16, 32)  # a block replaced: its segment is rebuilt
    y = step(chain)
    assert _SEGMENTS[chain][(0, 2)] is built[(0, 2)]
    assert _SEGMENTS[chain][(2, 4)] is not built[(2, 4)]
    assert _SEGMENTS[chain][(2, 4)].blocks[1] is chain[3]
    assert torch.equal(y, chain(x))
    as_list = list(chain)
    assert torch.equal(step(as_list), y)  # a list of blocks: built per call, same result


def test_keyword_tensor_changed_in_place_after_forward_raises():
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x, *, scale):
            return self.lin(x) * scale

    scale = torch.rand(2, 1)
    y = revckpt.checkpoint(
        Scaled(), torch.randn(2, 8, requires_grad=True), strategy=Approx(), scale=scale
    )
    scale.mul_(2)
    with pytest.raises(revckpt.ModifiedInputError, match="Scaled: a tensor it was given"):
        y.sum().backward()  # (torch's bare "modified by an inplace operation" before)


@pytest.mark.parametrize("strategy", ["checkpoint", "selective:matmul", "compress:bf16"])
def test_a_tensor_changed_in_place_after_forward_raises_with_every_strategy(strategy):
    """A keyword tensor (and, for compress, the input it keeps exactly) changed in place after
    the forward: checkpoint and selective recomputed from the changed value, compress used
    it, and the weight's gradient was off by 2.0 (relative) with no error, where plain
    autograd raises."""

    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x, *, scale):
            return torch.tanh(self.lin(x)) * scale

    for change in ("scale", "input") if strategy.startswith("compress") else ("scale",):
        x, scale = torch.randn(4, 8), torch.rand(8)
        y = revckpt.checkpoint(Scaled(), x, strategy=strategy, scale=scale)
        (scale if change == "scale" else x).mul_(3)
        with pytest.raises(revckpt.ModifiedInputError, match="changed in place after"):
            y.sum().backward()


def test_positional_mask_with_inf_gets_a_keyword_hint():
    def fn(x, mask):
        return x + mask

    mask = torch.zeros(2, 8, requires_grad=True)  # an argument that requires grad is compressed
    with torch.no_grad():
        mask[0, 0] = float("-inf")
    with pytest.raises(InvalidArgumentError, match="belongs in a keyword argument"):
        revckpt.checkpoint(
            fn, torch.randn(2, 8, requires_grad=True), mask, strategy=Approx(store="e4m3")
        )


def test_a_positional_mask_without_grad_is_kept_exactly():
    """A further positional argument without grad (a mask with a bias, finfo.min where masked,
    as Hugging Face layers get it under eager attention) is kept exactly, as a keyword one is:
    one fp8 scale per row set by finfo.min decoded every bias value in the row to 0."""

    class _Scores(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(16, 16)

        def forward(self, x, mask):
            return (self.lin(x) @ self.lin(x).transpose(-1, -2) + mask).softmax(-1) @ x

    torch.manual_seed(0)
    fn = _Scores().double()
    lin = fn.lin

    bias = -torch.rand(64, 64, dtype=torch.float64)
    above = torch.ones(64, 64, dtype=torch.bool).triu(1)
    mask = bias.masked_fill(above, torch.finfo(bias.dtype).min)
    x = torch.randn(64, 16, dtype=torch.float64, requires_grad=True)
    params = [x, *lin.parameters()]

    def grads(*args, **kwargs):
        y = revckpt.checkpoint(fn, *args, strategy=Approx(store="e4m3"), **kwargs)
        return torch.autograd.grad(y.sum(), params)

    by_keyword = grads(x, mask=mask)
    assert all(torch.equal(a, b) for a, b in zip(grads(x, mask), by_keyword, strict=True))


def test_complex_input_rejected():
    with pytest.raises(InvalidInputTypeError, match="complex"):
        revckpt.checkpoint(
            lambda z: z * 2,
            torch.randn(2, 4, dtype=torch.cfloat, requires_grad=True),
            strategy=Approx(),
        )


def test_bad_input():
    block = ResidualMLPBlock(16, 32)
    x = torch.randn(2, 16)
    with pytest.raises(InvalidArgumentError, match="unknown store format 'fp4'"):
        revckpt.checkpoint(block, x, strategy=Approx(store="fp4"))
    with pytest.raises(InvalidArgumentError, match="unknown scaling"):
        revckpt.checkpoint(block, x, strategy=Approx(scaling="col"))
    with pytest.raises(InvalidArgumentError, match="store=None keeps the input exact"):
        Approx(store=None, rounding="stochastic")
    with pytest.raises(InvalidArgumentError, match="recompute_dtype"):
        revckpt.checkpoint(block, x, strategy=Approx(recompute_dtype=torch.int8))
    bad = x.clone()
    bad[0, 0] = float("inf")
    with pytest.raises(InvalidArgumentError, match="non-finite"):
        revckpt.checkpoint(block, bad.requires_grad_(), strategy=Approx(store="e4m3"))
    with pytest.raises(InvalidArgumentError, match="does not divide the row length 16"):
        revckpt.checkpoint(
            block, x.requires_grad_(), strategy=Approx(store="e4m3", scaling="block")
        )
    with pytest.raises(InvalidInputTypeError, match="no tensor argument"):
        revckpt.checkpoint(block, 3.0, strategy=Approx())
    with pytest.raises(InvalidArgumentError, match="drop policy="), pytest.warns(FutureWarning):
        revckpt.checkpoint_sequential(
            mlp_chain(2, 16), 2, x, approx=Approx(), determinism_check="values"
        )
    with pytest.raises(InvalidArgumentError, match="'values' does not apply to the approx"):
        revckpt.checkpoint_sequential(
            mlp_chain(2, 16), 2, x, strategy=Approx(), determinism_check="values"
        )


def test_reversible_bf16_recompute_with_anchors():
    torch.manual_seed(0)
    blocks = [reversible_mlp_block(16, 32) for _ in range(8)]
    exact = ReversibleSequential(*blocks)
    low = ReversibleSequential(
        *[twin(b) for b in blocks],
        approx=Approx(store=None, recompute_dtype=torch.bfloat16),
        anchor_every=4,
    )
    x = torch.randn(8, 32)
    out_a, grads_a, _ = train_step(exact, x)
    out_b, grads_b, _ = train_step(low, x)
    assert torch.equal(out_a, out_b)
    rel = max(((a - b).norm() / a.norm()).item() for a, b in zip(grads_a, grads_b, strict=True))
    assert 0 < rel < 5e-2
    assert low.last_drift[0] is not None and low.last_drift[0] > 0


def test_reversible_rejects_a_store_format():
    with pytest.raises(InvalidArgumentError, match="keeps no block inputs to compress"):
        ReversibleSequential(reversible_mlp_block(8, 16), approx=Approx(store="e4m3"))


class _Tupled(nn.Module):
    """A block returning what Hugging Face layers return: tensors mixed with ``None``, flags
    and nested containers (T5's layer returns its position bias beside the hidden state)."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.bias = nn.Parameter(torch.randn(width))

    def forward(self, x):
        h = torch.tanh(self.lin(x))
        return h, None, {"bias": self.bias * 2, "flag": True, "steps": (3, h.sum())}


def _tupled_grads(strategy, x):
    torch.manual_seed(0)
    block = _Tupled().double()
    xx = x.detach().clone().requires_grad_()
    out = block(xx) if strategy is None else revckpt.checkpoint(block, xx, strategy=strategy)
    h, _, extra = out
    loss = (h**2).sum() + (extra["bias"] * h[0]).sum() + extra["steps"][1] ** 2
    loss.backward()
    return out, [xx.grad, *(p.grad for p in block.parameters())]


@pytest.mark.parametrize("strategy", [Approx(store=None), "offload", Approx(store="bf16")])
def test_a_block_returning_non_tensors_beside_its_tensors(strategy):
    x = torch.randn(4, 8, dtype=torch.float64)
    plain, plain_grads = _tupled_grads(None, x)
    out, grads = _tupled_grads(strategy, x)
    assert out[1] is None and out[2]["flag"] is True and out[2]["steps"][0] == 3
    exact = not (isinstance(strategy, Approx) and strategy.store == "bf16")
    tol = {"rtol": 0, "atol": 0} if exact else {"rtol": 2e-2, "atol": 1e-2}
    torch.testing.assert_close(out[0], plain[0], **tol)
    for g, p in zip(grads, plain_grads, strict=True):
        torch.testing.assert_close(g, p, **tol)


def test_a_block_whose_output_changes_structure_in_backward_is_refused():
    calls = []

    def fn(x):
        calls.append(1)
        return (x * 2, None) if len(calls) == 1 else (x * 2, x * 3)

    y, _ = revckpt.checkpoint(fn, torch.randn(3, requires_grad=True), strategy=Approx())
    with pytest.raises(InvalidArgumentError, match="different structure when re-run"):
        y.sum().backward()


def test_a_block_that_returned_a_tensor_and_returns_a_tuple_in_backward_is_refused():
    calls = []

    def fn(x):
        calls.append(1)
        return x * 2 if len(calls) == 1 else (x * 2,)

    y = revckpt.checkpoint(fn, torch.randn(3, requires_grad=True), strategy=Approx())
    with pytest.raises(InvalidArgumentError, match=r"different structure .*tuple against a"):
        y.sum().backward()


@pytest.mark.parametrize("strategy", ["approx:e4m3", "offload"])
def test_a_tensor_requiring_grad_in_a_positional_list_raises_on_every_call(strategy):
    # The recompute graph is checked for unregistered tensors on a block's first call only:
    # a frozen encoder's output in a list, unfrozen after warm-up, got no gradient.
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x, extra):
            return torch.tanh(self.lin(x)) * extra[0]

    block, encoder = Block(), nn.Linear(8, 8).requires_grad_(False)
    x, ctx = torch.randn(4, 8), torch.randn(4, 8)
    revckpt.checkpoint(block, x, [encoder(ctx)], strategy=strategy).sum().backward()
    encoder.requires_grad_(True)
    with pytest.raises(InvalidInputTypeError, match="positional argument 1 holds tensors"):
        revckpt.checkpoint(block, x, [encoder(ctx)], strategy=strategy)


@pytest.mark.parametrize("strategy", ["approx:bf16", "offload"])
def test_an_output_sharing_memory_changed_in_place_gets_plain_autograds_gradients(strategy):
    # The node's outputs are detached: autograd did not see that a skipped layer's output is
    # its input, or that two outputs are views of one tensor. An in-place change through one
    # then gave gradients 3/4 and 1/2 of plain autograd's, silently. They are views again.
    class Skip(nn.Module):
        def forward(self, x):
            return x

    class TwoViews(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            h = self.lin(x)
            return h, h.view(-1)

    x0 = torch.tensor([[1.0, 2.0, -0.5, 4.0]])  # bf16 keeps these exactly

    def skip_step(run, change, loop):
        x_in = x0.clone().requires_grad_()
        x = x_in * 1.0
        for _ in range(2 if loop else 1):
            h = run(Skip(), x)
            if change:
                h.mul_(2)
            x = x + h if loop else x
        (h * x).sum().backward()
        return x_in.grad

    def node(block, x):
        return revckpt.checkpoint(block, x, strategy=strategy)

    def plain(block, x):
        return block(x)

    for change in (False, True):
        for loop in (False, True):
            assert torch.equal(skip_step(node, change, loop), skip_step(plain, change, loop))
    torch.manual_seed(0)
    block = TwoViews()
    grads = []
    for run in (plain, node):
        block.zero_grad()
        x = x0.clone().requires_grad_()
        h, flat = run(block, x)
        h.mul_(2)
        (flat * torch.arange(4.0)).sum().backward()
        grads.append((x.grad, block.lin.bias.grad))
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("strategy", ["approx:bf16", "offload"])
@pytest.mark.parametrize("first", [True, False])
def test_a_detached_output_stays_detached_beside_the_one_it_shares_memory_with(strategy, first):
    # (y, y.detach()): the detached output was made a view of y again (they share memory),
    # so it required grad and the loss's gradient through it reached the block (weight
    # gradient 3.6 off); (y.detach(), y): y was made a view of the detached one, and the
    # block and everything before it got no gradient. Plain autograd: as returned.
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            y = x + torch.tanh(self.lin(x))
            return (y.detach(), y) if first else (y, y.detach())

    torch.manual_seed(0)
    block = Block().double()
    x0 = torch.randn(4, 8, dtype=torch.float64)
    grads = []
    for run in (block, lambda t: revckpt.checkpoint(block, t, strategy=strategy)):
        block.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_()
        out = run(x * 1.0)
        y, stop = (out[1], out[0]) if first else out
        assert not stop.requires_grad and y.requires_grad
        (y.sum() + stop.square().sum()).backward()
        grads.append((x.grad, block.lin.weight.grad))
    tol = 1e-12 if strategy == "offload" else 1e-2  # bf16 rounding (about 2e-3 here)
    for got, want in zip(grads[1], grads[0], strict=True):
        assert ((got - want).norm() / want.norm()).item() < tol


@pytest.mark.parametrize("strategy", ["approx:bf16", "offload"])
def test_a_view_after_a_detached_alias_is_a_view_of_the_output_with_a_graph(strategy):
    # (h.detach(), h, h.view(-1)): the view was made one of the detached output, the first
    # seen of that memory; changed in place, the gradients were 0.667 off, silently
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            h = self.lin(x)
            return h.detach(), h, h.view(-1)

    torch.manual_seed(0)
    block = Block().double()
    grads = []
    for run in (block, lambda t: revckpt.checkpoint(block, t, strategy=strategy)):
        block.zero_grad(set_to_none=True)
        _, h, flat = run(
            torch.randn(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        )
        flat.mul_(3)
        (h * torch.arange(4.0, dtype=torch.float64)).sum().backward()
        grads.append(block.lin.weight.grad)
    tol = 1e-12 if strategy == "offload" else 1e-2
    assert ((grads[1] - grads[0]).norm() / grads[0].norm()).item() < tol


@pytest.mark.parametrize("strategy", ["approx:bf16", "offload"])
def test_a_reentrant_checkpoint_inside_a_block_is_refused_saying_what_to_do(strategy):
    # torch.autograd.grad, which the node's backward differentiates its re-run with, cannot
    # go through torch's reentrant checkpoint: torch's raw RuntimeError before
    import torch.utils.checkpoint as tcp

    class Block(nn.Module):
        def __init__(self, reentrant: bool) -> None:
            super().__init__()
            self.lin, self.reentrant = nn.Linear(8, 8), reentrant

        def forward(self, x):
            return x + tcp.checkpoint(self.lin, x, use_reentrant=self.reentrant)

    x = torch.randn(4, 8, requires_grad=True)
    out = revckpt.checkpoint(Block(True), x, strategy=strategy)
    with pytest.raises(InvalidArgumentError, match="use_reentrant=False there"):
        out.sum().backward()
    revckpt.checkpoint(Block(False), x, strategy=strategy).sum().backward()  # as it says


@pytest.mark.parametrize("strategy", ["approx:bf16", "offload", "selective:matmul"])
def test_a_torch_func_transform_is_refused_naming_the_strategies_that_run_there(strategy):
    block = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
    x = torch.randn(3, 4, 8)
    run = torch.func.vmap(lambda t: revckpt.checkpoint(block, t, strategy=strategy))
    with pytest.raises(InvalidArgumentError, match=r"cannot run inside a torch\.func transform"):
        run(x)
    for works in ("checkpoint", "compress:bf16"):  # as the message says
        torch.func.vmap(lambda t, s=works: revckpt.checkpoint(block, t, strategy=s))(x)


def _converted_twins(strategy):
    """A float64 chain, a copy converted to ``strategy``, and an input."""
    torch.manual_seed(0)
    plain = nn.Sequential(*(ResidualMLPBlock(16, 32) for _ in range(3))).double()
    model = twin(plain)
    revckpt.convert(model, strategy)
    return plain, model, torch.randn(4, 16, dtype=torch.float64)


@pytest.mark.parametrize("strategy", ["approx:bf16", "offload"])
def test_a_parameter_hook_in_a_converted_block_fires_once_with_its_gradient(strategy):
    # convert runs the block's bound forward with its other arguments bound (not the module):
    # a parameter with a hook was refused ("pass nn.Module blocks"), though the user did.
    plain, model, x = _converted_twins(strategy)
    seen = {"plain": [], "model": []}
    for name, m in (("plain", plain), ("model", model)):
        m[1].fc1.weight.register_hook(lambda g, n=name: seen[n].append(g.clone()))
    for m in (plain, model):
        m(x).pow(2).sum().backward()
    assert len(seen["plain"]) == len(seen["model"]) == 1
    tol = 0 if strategy == "offload" else 1e-2
    assert float((seen["model"][0] - seen["plain"][0]).norm()) <= tol * seen["plain"][0].norm()
    for a, b in zip(plain.parameters(), model.parameters(), strict=True):
        assert float((a.grad - b.grad).norm()) <= tol * float(a.grad.norm()) + 1e-12


@pytest.mark.parametrize("strategy", ["approx:bf16", "offload"])
def test_fast_weights_swapped_in_by_functional_call_get_their_gradient(strategy):
    # MAML-style weights made from the parameters: the recompute's graph check walked past
    # them to the parameters and refused "a tensor ... neither an argument nor a parameter".
    plain, model, x = _converted_twins(strategy)

    def meta_grads(m):
        params = dict(m.named_parameters())
        fast = {n: p - 0.1 * p.detach().sign() for n, p in params.items()}
        loss = torch.func.functional_call(m, fast, (x,)).pow(2).sum()
        return torch.autograd.grad(loss, list(params.values()))

    tol = 0 if strategy == "offload" else 1e-2
    for a, b in zip(meta_grads(plain), meta_grads(model), strict=True):
        assert float((a - b).norm()) <= tol * float(a.norm())


class _Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.b.weight = self.a.weight

    def forward(self, x):
        return x + self.b(torch.tanh(self.a(x)))


@pytest.mark.parametrize("strategy", ["approx:bf16", "offload"])
def test_a_hooked_weight_tied_inside_a_converted_block_gets_its_gradient(strategy):
    # Only one of the two names got the detached alias: "neither an argument nor a parameter".
    torch.manual_seed(0)
    plain = nn.Sequential(_Tied(), _Tied()).double()
    model = twin(plain)
    revckpt.convert(model, strategy)
    x = torch.randn(4, 8, dtype=torch.float64)
    calls = []
    for m in (plain, model):
        m[0].a.weight.register_hook(lambda g: calls.append(g))
        m(x).pow(2).sum().backward()
    assert len(calls) == 2
    tol = 0 if strategy == "offload" else 1e-2
    a, b = plain[0].a.weight.grad, model[0].a.weight.grad
    assert float((a - b).norm()) <= tol * float(a.norm())


@pytest.mark.parametrize("strategy", ["checkpoint", "offload", "compress:bf16"])
def test_a_grad_transform_is_refused_for_the_strategies_that_run_under_vmap(strategy):
    """torch.func.grad (per-sample gradients: vmap(grad)) over a checkpointed block: torch's
    raw 'saved tensor hooks' error from inside revckpt's frame, naming nothing."""
    block = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
    params = dict(block.named_parameters())
    x = torch.randn(3, 8)

    def loss(p, t):
        run = lambda u: torch.func.functional_call(block, p, (u,))  # noqa: E731
        return revckpt.checkpoint(run, t, strategy=strategy).sum()

    with pytest.raises(InvalidArgumentError, match=r"cannot run inside torch\.func\.grad"):
        torch.func.grad(loss)(params, x)
    with pytest.raises(InvalidArgumentError, match=r"cannot run inside torch\.func\.grad"):
        torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(params, x)


class _WithRouter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.router = nn.Linear(8, 8), nn.Linear(8, 2)

    def forward(self, x):
        return x + torch.tanh(self.fc(x)) * self.router(x).softmax(-1)[..., :1]


class _AuxModel(nn.Module):
    """Router logits collected by forward hooks for an auxiliary loss, as Hugging Face's
    output recorders collect a mixture-of-experts layer's (``output_router_logits=True``)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_WithRouter() for _ in range(2))
        self.seen: list[torch.Tensor] = []
        for block in self.blocks:
            block.router.register_forward_hook(lambda m, i, out: self.seen.append(out))

    def forward(self, x):
        self.seen.clear()
        for block in self.blocks:
            x = block(x)
        return x.sum() + sum(logits.pow(2).sum() for logits in self.seen)


@pytest.mark.parametrize("strategy", ["approx:bf16", "offload"])
def test_a_side_output_in_the_loss_is_refused_naming_the_strategies_that_take_it(strategy):
    """The message spoke only of key/value caches and decoding loops (for router logits of
    an auxiliary loss); it names the usual side outputs and the strategies that run them."""
    x = torch.randn(4, 8, requires_grad=True)
    model = _AuxModel()
    revckpt.convert(model, strategy)
    with pytest.raises(RevckptError, match=r"router logits.*'checkpoint' or 'selective"):
        model(x).backward()
    revckpt.restore(model)
    revckpt.convert(model, "checkpoint")  # as the message says
    model(x).backward()


def test_a_float16_recompute_that_leaves_the_range_is_refused():
    """63500 rounds up to e4m3's 65536, decoded clamped to float16's 65504; times 1.01 in the
    recompute it overflows where the forward (64096... then halved) did not: the gradients were
    inf, plain autograd's finite, without a word."""
    first = nn.Linear(4, 4, bias=False)
    second = nn.Linear(4, 4, bias=False)
    with torch.no_grad():
        first.weight.copy_(torch.eye(4) * 1.01)
        second.weight.copy_(torch.eye(4) * 0.5)
    block = nn.Sequential(first, second).half()
    x = torch.tensor([[63500.0, 1.0, 2.0, 3.0]], dtype=torch.float16, requires_grad=True)
    assert torch.isfinite(block(x)).all()
    y = revckpt.checkpoint_sequential([block], 1, x, strategy=Approx(store="e4m3"))
    with pytest.raises(ReplayError, match="float16"):
        y.backward(torch.full_like(y, 1e-3))


class _MaskedScores(nn.Module):
    """Causal scores with a -inf mask: float16 infinities the forward makes itself."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(8, 8)

    def forward(self, x):
        scores = self.q(x) @ x.transpose(-1, -2)
        mask = torch.ones(x.shape[-2], x.shape[-2], dtype=torch.bool).triu(1)
        return scores.masked_fill(mask, float("-inf"))


def test_a_float16_recompute_keeps_the_infinities_its_forward_made():
    """The range check counted every inf: a -inf mask made the recompute raise where plain
    autograd's gradients are finite (a review's repro)."""
    torch.manual_seed(0)
    block = _MaskedScores().half()
    x = torch.randn(2, 4, 8, dtype=torch.float16, requires_grad=True)
    y = revckpt.checkpoint(block, x, strategy="approx:bf16")
    y.softmax(-1).sum().backward()
    assert torch.isfinite(x.grad).all()


class _Unfreezes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.fc.weight.requires_grad_(False)
        self.register_forward_pre_hook(_unfreeze)

    def forward(self, x):
        return torch.tanh(self.fc(x))


def _unfreeze(module: nn.Module, inputs: object) -> None:
    module.fc.weight.requires_grad_(True)


@pytest.mark.parametrize("strategy", ["approx:bf16", "offload"])
def test_a_weight_unfrozen_by_a_hook_during_the_forward_is_refused(strategy):
    """A pre-hook unfreezing a layer: the node had taken the trainable parameters before the
    forward, so the weight's gradient was lost (.grad None; plain autograd sets it)."""
    block = _Unfreezes()
    x = torch.randn(3, 8, requires_grad=True)
    with pytest.raises(InvalidArgumentError, match="started requiring grad during"):
        revckpt.checkpoint(block, x, strategy=strategy)


def test_offload_under_no_grad_inside_torch_func_grad_runs_plainly():
    block = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
    x = torch.randn(3, 8)

    def loss(t):
        with torch.no_grad():
            frozen = revckpt.checkpoint(block, t, strategy="offload")
        return (t * frozen).sum()

    torch.func.grad(loss)(x)


class _UsesShared(nn.Module):
    def __init__(self, shared: nn.Module) -> None:
        super().__init__()
        self.shared, self.fc = shared, nn.Linear(8, 8)
        shared.register_forward_hook(_unfreeze_weight)  # after its (frozen) use

    def forward(self, x):
        return torch.tanh(self.fc(self.shared(x)))


def _unfreeze_weight(module: nn.Module, inputs: object, output: object) -> None:
    module.weight.requires_grad_(True)


@pytest.mark.parametrize("strategy", ["approx:bf16", "offload"])
def test_a_weight_used_trainable_before_the_block_is_not_the_blocks(strategy):
    """The unfreeze check walked the graph upstream of the block: a weight used trainable
    before it, frozen for the block and unfrozen after its use there, was refused (a review's
    repro); plain autograd gives it the upstream use's gradient."""
    grads = []
    for run in (None, strategy):
        torch.manual_seed(0)
        shared = nn.Linear(8, 8).double()
        block = _UsesShared(shared).double()
        x = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
        h = shared(x)
        shared.weight.requires_grad_(False)
        y = block(h) if run is None else revckpt.checkpoint(block, h, strategy=run)
        y.square().sum().backward()
        grads.append(shared.weight.grad)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-2, atol=1e-3)


class _DataMasked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(8, 8)

    def forward(self, x):
        scores = self.q(x) @ x.transpose(-1, -2)
        return scores.masked_fill(scores < 0, float("-inf"))


@pytest.mark.parametrize("seed", range(4))
def test_a_float16_mask_made_of_the_data_moves_without_a_range_error(seed):
    """A mask that depends on the values moves with the rounded input (a kink): the range
    check counted its infinities and raised in 11 of 20 seeds (a review's repro); the
    gradients are finite, as plain autograd's."""
    torch.manual_seed(seed)
    block = _DataMasked().half()
    x = torch.randn(2, 4, 8, dtype=torch.float16, requires_grad=True)
    y = revckpt.checkpoint(block, x, strategy=Approx(store="e4m3"))
    y.softmax(-1).nan_to_num().sum().backward()
    assert torch.isfinite(x.grad).all()


def test_a_float16_backward_that_overflows_goes_as_in_plain_autograd():
    """A GradScaler's scaled loss can overflow a float16 backward: plain autograd returns inf
    (the scaler then skips the step), and so must the approx block, not raise."""
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)).half()
    with torch.no_grad():
        for p in block.parameters():
            p.mul_(100)
    grads = []
    for strategy in (None, Approx(store="bf16")):
        x = torch.randn(4, 8, dtype=torch.float16, requires_grad=True)
        y = block(x) if strategy is None else revckpt.checkpoint(block, x, strategy=strategy)
        y.backward(torch.full_like(y, 60000.0))
        grads.append(bool(torch.isfinite(x.grad).all()))
    assert grads == [False, False]


@pytest.mark.parametrize(
    ("dtype", "recompute"),
    [
        (torch.bfloat16, torch.float16),
        (torch.float16, torch.bfloat16),
        (torch.float64, torch.bfloat16),
    ],
)
def test_a_recompute_dtype_the_blocks_dtype_cannot_take_is_refused_in_the_forward(dtype, recompute):
    """autocast casts float32 only: a 16-bit block of the other format re-ran with mixed
    dtypes (torch's raw 'mixed dtype' error in backward), a float64 one unchanged, silently."""
    block = nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16), nn.Linear(16, 16)).to(dtype)
    x = torch.randn(4, 16, dtype=dtype, requires_grad=True)
    approx = Approx(store=None, recompute_dtype=recompute)
    with pytest.raises(InvalidArgumentError, match="recompute_dtype"):
        revckpt.checkpoint(block, x * 1, strategy=approx)
    if dtype != torch.float64:  # its own dtype runs
        own = Approx(store=None, recompute_dtype=dtype)
        revckpt.checkpoint(block, x * 1, strategy=own).sum().backward()
