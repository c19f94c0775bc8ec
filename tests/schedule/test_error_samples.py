"""Codec errors run on every ``error_stride``-th block of a group and interpolated between
(revckpt.schedule.error_samples): which blocks run, that the run blocks' figures are those of
a profile running every block, and that the others' are close to what their own runs read."""

import pytest
import torch
from torch import nn

from revckpt import InvalidArgumentError
from revckpt.models import gpt_like
from revckpt.schedule import profile
from revckpt.schedule.cost_records import ApproxCost
from revckpt.schedule.error_samples import interpolated, neighbours, sampled
from revckpt.schedule.profiling import _ProfilingJob


def test_every_strideth_member_of_a_group_and_its_last_run():
    groups = [0] * 10 + [10] + [11] * 5
    run = sampled(groups, range(16), 4)
    assert run == {0, 4, 8, 9, 10, 11, 15}
    assert sampled(groups, range(16), 1) == set(range(16))
    # a block between two run blocks of its group: their indices and its place between them
    assert neighbours(6, groups, run) == (4, 8, 0.5)
    assert neighbours(13, groups, run) == (11, 15, 0.5)


def _cost(param, inp, moved, amplification):
    return ApproxCost(
        kept_bytes=8,
        param_grad_error=param,
        input_grad_error=inp,
        perturbation=moved,
        amplification=amplification,
    )


def test_an_interpolated_error_scales_with_the_blocks_own_perturbation():
    lo = {"approx": {"bf16": _cost(0.02, 0.01, 0.004, 1.0)}}
    hi = {"approx": {"bf16": _cost(0.04, 0.03, 0.004, 3.0)}}
    got = interpolated(lo, hi, 0.5, {"bf16": 0.008})["approx"]["bf16"]
    # halfway: 0.03 and 0.02 per 0.004 of perturbation, at twice the perturbation
    assert got.param_grad_error == pytest.approx(0.06)
    assert got.input_grad_error == pytest.approx(0.04)
    assert got.perturbation == 0.008
    assert got.amplification == pytest.approx(2.0)
    # a neighbour the codec did not move: plain interpolation
    still = {"approx": {"bf16": _cost(0.0, 0.0, 0.0, 1.0)}}
    got = interpolated(still, hi, 0.25, {"bf16": 0.008})["approx"]["bf16"]
    assert got.param_grad_error == pytest.approx(0.01)


def _errors(prof):
    return [
        {c: (a.param_grad_error, a.input_grad_error, a.perturbation) for c, a in b.approx.items()}
        for b in prof.blocks
    ]


def test_sampled_errors_match_a_profile_that_runs_every_block():
    torch.manual_seed(0)
    chain, x = gpt_like(9, 16, 2), torch.randn(2, 8, 16)
    runs = []
    original = _ProfilingJob._errors

    def counted(self, block, *args):
        runs.append(block)
        return original(self, block, *args)

    every = profile(chain, x, repeats=1, error_stride=1)
    _ProfilingJob._errors = counted
    try:
        strided = profile(chain, x, repeats=1, error_stride=4)
    finally:
        _ProfilingJob._errors = original
    assert [id(b) for b in runs] == [id(chain[i]) for i in (0, 4, 8)]
    full, got = _errors(every), _errors(strided)
    for i in range(9):
        for c, (param, inp, moved) in full[i].items():
            g_param, g_inp, g_moved = got[i][c]
            assert g_moved == moved  # measured on every block, the same way
            if i in (0, 4, 8):  # run: the same figures
                assert (g_param, g_inp) == (param, inp)
            else:  # interpolated: within a quarter of the block's own run
                assert g_param == pytest.approx(param, rel=0.25), (i, c)
                assert g_inp == pytest.approx(inp, rel=0.25), (i, c)
    # each block keeps its own gradient norms (the error model's weights)
    assert [b.grad_norms for b in strided.blocks] == [b.grad_norms for b in every.blocks]


@pytest.mark.parametrize("stride", [0, -1, 1.5, True, "4"])
def test_a_bad_error_stride_is_named(stride):
    chain = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(InvalidArgumentError, match="error_stride"):
        profile(chain, torch.randn(2, 4), error_stride=stride)
