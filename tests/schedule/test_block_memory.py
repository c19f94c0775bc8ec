"""Which operations hold a block's output (``SelectiveCost.output_kept``): known by the storage,
not by an address a freed temporary handed on; and figures read from a run that measured
something else are those of a run of their own."""

import pytest
import torch
from torch import nn

from revckpt.approx import Approx
from revckpt.checkpoint import checkpoint
from revckpt.models import gpt_like, revnet_like
from revckpt.schedule import profile
from revckpt.schedule.block_memory import _output_ops, memory_costs
from revckpt.schedule.block_runs import _forward_alone, _metered_step, _Runs
from revckpt.schedule.ops import op_costs

aten = torch.ops.aten


class _FreesTemporaries(nn.Module):
    """Allocates and frees temporaries of the output's size, then writes the output into a
    fresh tensor: the allocator hands the output a freed temporary's storage address."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(4):
            t = torch.sin(x)
            del t
        return torch.cos(x)


class _InPlaceAfterMatmul(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = torch.exp(x)  # a temporary freed before the output is allocated
        del t
        y = x @ self.w
        return y.relu_().t()  # in place, then a view: the storage mm allocated


def test_the_output_op_is_the_one_that_wrote_it_after_temporaries_were_freed():
    x = torch.randn(64, 64)
    for _ in range(20):
        assert _output_ops(_FreesTemporaries(), x, {}) == {aten.cos}


def test_in_place_and_view_operations_on_the_output_storage_count():
    x = torch.randn(4, 8)
    ops = _output_ops(_InPlaceAfterMatmul(), x, {})
    assert aten.mm in ops and aten.relu_ in ops and aten.exp not in ops
    assert ops <= {aten.mm, aten.relu_, aten.t, aten.transpose}


def test_a_gpt_block_output_is_the_residual_add_every_call():
    torch.manual_seed(0)
    block = gpt_like(2, 64, 4)[0]
    x = torch.randn(2, 16, 64)
    answers = [_output_ops(block, x, {}) for _ in range(8)]
    assert answers == [frozenset({aten.add})] * 8
    # the op-level costs agree (they keep every output alive: no address is reused)
    assert {c.op for c in op_costs(block, x) if c.keeps_output} == {"add"}


def test_selective_output_kept_of_a_gpt_chain_is_the_policy_keeping_add():
    torch.manual_seed(0)
    chain, x = gpt_like(3, 64, 4), torch.randn(2, 16, 64)
    policies = ("matmul", "attention", "matmul+attention", "gelu", "add", "matmul+add")
    want = {"matmul": False, "attention": False, "matmul+attention": False, "gelu": False}
    want |= {"add": True, "matmul+add": True}
    for _ in range(2):  # the same answer on a second profile
        prof = profile(chain, x, repeats=1, codecs=(), policies=policies)
        for b in prof.blocks:
            assert {p: c.output_kept for p, c in b.selective.items()} == want


def _fields(block, x, **options):
    """memory_costs' fields of ``block`` on a fresh leaf of ``x``, with the gradients existing."""
    for p in block.parameters():
        p.grad = torch.zeros_like(p)
    leaf = x.detach().clone().requires_grad_()
    torch.manual_seed(0)
    return memory_costs(block, leaf, ("bf16", "e4m3"), ("matmul+attention",), "cpu", {}, **options)


@pytest.mark.parametrize(
    "make",
    [
        lambda: (gpt_like(1, 32, 2, dropout=0.1)[0], torch.randn(2, 16, 32)),  # draws at random
        lambda: (revnet_like((1,), (8,))[1], torch.randn(4, 8, 8, 8)),  # a reversible unit
    ],
    ids=["gpt-dropout", "revnet-unit"],
)
def test_the_stored_forward_read_from_the_metered_step_is_its_own_run(make):
    # memory_costs(output=...) reads the stored forward's figures from its metered
    # `accumulate` step instead of a forward of their own: every figure is the same
    torch.manual_seed(0)
    block, x = make()
    with torch.no_grad():
        y = block(x)
    alone, given = _fields(block, x), _fields(block, x, output=y)
    assert given.fields == alone.fields
    assert given.fields["saved_bytes"] > 0 and given.fields["forward_peak_bytes"] > 0


def test_selective_figures_from_the_metered_step_are_those_of_a_forward_alone():
    torch.manual_seed(0)
    block, x = gpt_like(1, 32, 2)[0], torch.randn(2, 16, 32)
    got = _fields(block, x).fields["selective"]["matmul+attention"]
    leaf = x.detach().clone().requires_grad_()
    out_bytes = x.numel() * x.element_size()
    run = lambda: checkpoint(block, leaf, strategy="selective:matmul+attention")  # noqa: E731
    assert (got.kept_bytes, got.forward_peak_bytes) == _forward_alone(run, "cpu", out_bytes)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_approx_replay_figures_without_its_backward_when_nothing_more_is_kept(dropout):
    torch.manual_seed(0)
    block, x = gpt_like(1, 32, 2, dropout=dropout)[0], torch.randn(2, 16, 32)
    leaf = x.detach().clone().requires_grad_()
    wrt = [leaf, *block.parameters()]
    runs = _Runs(block, leaf, wrt, {}, None)
    grad_out, mode = torch.randn_like(x), "approx:bf16"
    accounted = Approx(store="bf16").codec.encode(x).nbytes
    steps = [
        _metered_step(runs, mode, grad_out, accounted, "cpu", True, False, lean)
        for lean in (False, True)
    ]
    full, lean = steps
    assert (lean.kept, lean.forward_peak) == (full.kept, full.forward_peak)
    # the replay figures (kept, and what of it outlives the backward) are the same either way
    late = [max(0, min(s.left, s.kept)) for s in steps]
    assert late[0] == late[1] and max(0, lean.kept) == max(0, full.kept)
    if dropout:  # the generator state is kept: the backward runs, and the state outlives it
        assert full.kept > 0 and lean.transient is not None and late[1] > 0
    else:
        assert full.kept <= 0 and lean.transient is None


def test_the_capture_step_is_left_out_only_where_no_segment_reads_it():
    # capture=False (fit, planning no offload or reversible segment) leaves out the step with
    # the gradients returned; every other figure is the same. Codecs (approx segments read
    # it) or a reversible unit measure it all the same.
    torch.manual_seed(0)
    block, x = gpt_like(1, 32, 2)[0], torch.randn(2, 16, 32)

    def fields(codecs, **options):
        for p in block.parameters():
            p.grad = torch.zeros_like(p)
        leaf = x.detach().clone().requires_grad_()
        torch.manual_seed(0)
        return memory_costs(block, leaf, codecs, ("matmul",), "cpu", {}, **options).fields

    full, lean = fields(()), fields((), capture=False)
    assert full["backward_capture_peak_bytes"] > 0 and lean["backward_capture_peak_bytes"] is None
    assert {k: v for k, v in lean.items() if k != "backward_capture_peak_bytes"} == {
        k: v for k, v in full.items() if k != "backward_capture_peak_bytes"
    }
    assert fields(("bf16",), capture=False)["backward_capture_peak_bytes"] > 0
    unit, u = revnet_like((1,), (8,))[1], torch.randn(4, 8, 8, 8)
    leaf = u.detach().clone().requires_grad_()
    got = memory_costs(unit, leaf, (), (), "cpu", {}, capture=False).fields
    assert got["backward_capture_peak_bytes"] > 0


@pytest.mark.parametrize(
    "make",
    [
        lambda: (gpt_like(1, 32, 2)[0], torch.randn(2, 16, 32)),
        lambda: (gpt_like(1, 32, 2, dropout=0.1)[0], torch.randn(2, 16, 32)),  # draws at random
        lambda: (revnet_like((1,), (8,))[1], torch.randn(4, 8, 8, 8)),  # a reversible unit
        lambda: (revnet_like((1,), (8,))[0], torch.randn(4, 3, 8, 8)),  # convolution, BatchNorm
        lambda: (nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.2), nn.GELU()), torch.randn(8, 16)),
    ],
    ids=["gpt", "gpt-dropout", "revnet-unit", "revnet-stem", "mlp-dropout"],
)
@pytest.mark.parametrize("codec", ["bf16", "e4m3"])
def test_an_approx_step_keeps_replay_state_exactly_where_checkpoint_does(make, codec):
    # memory_costs leaves out an approx mode's metered step where checkpoint's keeps no replay
    # state (block_runs._metered_modes): both run the same forward, approx with its input
    # encoded besides (accounted). Where checkpoint keeps some, approx's is metered
    torch.manual_seed(0)
    block, x = make()
    leaf = x.detach().clone().requires_grad_()
    runs = _Runs(block, leaf, [leaf, *block.parameters()], {}, None)
    grad_out = torch.randn_like(block(x))
    accounted = Approx(store=codec).codec.encode(x).nbytes
    ckpt = _metered_step(runs, "checkpoint", grad_out, 0, "cpu", True, False)
    approx = _metered_step(runs, f"approx:{codec}", grad_out, accounted, "cpu", True, False)
    assert (ckpt.kept > 0) == (approx.kept > 0)
    with torch.no_grad():
        y = block(x)
    replay = _fields(block, x, output=y).fields["replay"][f"approx:{codec}"]
    assert replay.kept_bytes == max(0, approx.kept)
