"""Which operations hold a block's output (``SelectiveCost.output_kept``): known by the storage,
not by an address a freed temporary handed on."""

import torch
from torch import nn

from revckpt.models import gpt_like
from revckpt.schedule import profile
from revckpt.schedule.block_memory import _output_ops
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
