"""Codec errors run on every ``error_stride``-th block of a group and interpolated between
(revckpt.schedule.error_samples): which blocks run, that the run blocks' figures are those of
a profile running every block, and that the others' are close to what their own runs read."""

import pytest
import torch
from torch import nn

import revckpt
from revckpt import InvalidArgumentError
from revckpt.models import gpt_like
from revckpt.schedule import profile
from revckpt.schedule.cost_records import ApproxCost
from revckpt.schedule.error_samples import Unestimated, interpolated, neighbours, sampled
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
    # a neighbour whose input the codec did not move (exact in bf16): the other's ratio, not
    # an average with its 0
    still = {"approx": {"bf16": _cost(0.0, 0.0, 0.0, 1.0)}}
    got = interpolated(still, hi, 0.25, {"bf16": 0.008})["approx"]["bf16"]
    assert got.param_grad_error == pytest.approx(0.08)
    assert got.input_grad_error == pytest.approx(0.06)
    # neither moved: 0 where the block's own input does not move either, else it must run
    got = interpolated(still, still, 0.5, {"bf16": 0.0})["approx"]["bf16"]
    assert got.param_grad_error == 0.0
    with pytest.raises(Unestimated):
        interpolated(still, still, 0.5, {"bf16": 0.008})


def _errors(prof):
    return [
        {c: (a.param_grad_error, a.input_grad_error, a.perturbation) for c, a in b.approx.items()}
        for b in prof.blocks
    ]


def _counted(monkeypatch, chain):
    """The indices of the blocks whose error runs are made, in order."""
    runs = []
    original = _ProfilingJob._errors

    def counted(self, block, *args):
        runs.append(next(i for i, b in enumerate(chain) if b is block))
        return original(self, block, *args)

    monkeypatch.setattr(_ProfilingJob, "_errors", counted)
    return runs


def test_sampled_errors_match_a_profile_that_runs_every_block(monkeypatch):
    torch.manual_seed(0)
    chain, x = gpt_like(9, 16, 2), torch.randn(2, 8, 16)
    runs = _counted(monkeypatch, chain)
    every = profile(chain, x, repeats=1)  # the default runs every block
    assert runs == list(range(9))
    runs.clear()
    strided = profile(chain, x, repeats=1, error_stride=4)
    assert runs == [0, 4, 8]
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


@pytest.mark.parametrize("stride", [0, -1, 1.5, True, "4", None])
def test_a_bad_error_stride_is_named(stride):
    chain = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(InvalidArgumentError, match="error_stride"):
        profile(chain, torch.randn(2, 4), error_stride=stride)
    with pytest.raises(InvalidArgumentError, match="error_stride"):
        revckpt.fit(_Stack(), torch.randn(2, 8), memory_budget=0.9, error_stride=stride)
    converted = _Stack()
    revckpt.make_reversible(converted, blocks="layers", width=8)
    with pytest.raises(InvalidArgumentError, match="error_stride"):  # no codec errors there
        revckpt.fit(converted, torch.randn(2, 8), memory_budget=0.9, error_stride=stride)


def test_an_integral_error_stride_of_another_type_is_taken():
    np = pytest.importorskip("numpy")
    chain = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    profile(chain, torch.randn(2, 4), repeats=1, error_stride=np.int64(2))


class _Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Residual(8) for _ in range(3)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.sum()


class _Residual(nn.Module):
    """``x + fc2(gelu(fc1(x)))``; with ``rounds`` set, its output rounded to bf16's values
    (fake quantisation: the next block's input is exact in bf16, the codec does not move it).
    ``rounds`` is not in its repr: every block is of one group."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)
        self.rounds = False

    def forward(self, x):
        y = x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))
        return y + (y.bfloat16().float() - y).detach() if self.rounds else y


def test_a_neighbour_the_codec_leaves_alone_lends_no_ratio(monkeypatch):
    # the chain's input is exact in bf16 (the embedding output of a bf16 checkpoint, integer
    # pixels): block 0's bf16 perturbation and error are 0, and blocks 1-3 take block 4's
    # ratio (an average with block 0's 0 read them 0.25-0.6 of their own runs)
    torch.manual_seed(0)
    chain = nn.Sequential(*[_Residual() for _ in range(9)])
    x = torch.randint(0, 256, (8, 16)).float() / 64
    every = profile(chain, x, repeats=1, codecs=("bf16",))
    strided = profile(chain, x, repeats=1, codecs=("bf16",), error_stride=4)
    assert every.blocks[0].approx["bf16"].perturbation == 0.0
    for i in (1, 2, 3):
        want = every.blocks[i].approx["bf16"].param_grad_error
        got = strided.blocks[i].approx["bf16"].param_grad_error
        assert got == pytest.approx(want, rel=0.5), i


def test_a_block_between_neighbours_the_codec_leaves_alone_runs(monkeypatch):
    # blocks 0 and 4 get inputs exact in bf16, blocks 1-3 do not: no ratio to interpolate,
    # so blocks 1-3 run (an average of the neighbours' errors read them 0: a plan through
    # them looked free); blocks 5-7 take block 8's
    torch.manual_seed(0)
    chain = nn.Sequential(*[_Residual() for _ in range(9)])
    chain[3].rounds = True
    x = torch.randint(0, 256, (8, 16)).float() / 64
    runs = _counted(monkeypatch, chain)
    every = profile(chain, x, repeats=1, codecs=("bf16",))
    runs.clear()
    strided = profile(chain, x, repeats=1, codecs=("bf16",), error_stride=4)
    assert [strided.blocks[i].approx["bf16"].perturbation for i in (0, 4)] == [0.0, 0.0]
    assert runs == [0, 4, 8, 1, 2, 3]
    for i in (1, 2, 3):
        want = every.blocks[i].approx["bf16"].param_grad_error
        assert want > 0
        assert strided.blocks[i].approx["bf16"].param_grad_error == want
