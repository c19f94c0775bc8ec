"""The profile's first step: the stored chain timed and recorded for the error model at once."""

import torch
from torch import nn

from revckpt.models import gpt_like
from revckpt.schedule import Segment, profile
from revckpt.schedule.probe import timed_step
from revckpt.schedule.sensitivities import StepRecord, projection, sensitivities


class _Stem(nn.Module):
    """A class token joined to the projected input: at batch 1 the engine hands the token a
    slice of the output's gradient as its own."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.cls = nn.Parameter(torch.randn(1, 1, d))
        self.proj = nn.Linear(d, d)

    def forward(self, h):
        return torch.cat([self.cls.expand(h.shape[0], -1, -1), self.proj(h)], dim=1)


class _Skip(nn.Module):
    def __init__(self, unused: nn.Module) -> None:
        super().__init__()
        self.unused = unused

    def forward(self, h):
        return h * 2.0


def _chain():
    torch.manual_seed(0)
    chain = nn.Sequential(_Stem(16), *gpt_like(3, 16, 2, dropout=0.1))
    chain.append(_Skip(nn.Linear(16, 16)))  # a parameter the step leaves without a gradient
    chain = chain.double()
    # a hook handing each gradient on and freeing .grad (optimizer-in-backward, offload)
    handed = chain[1].ln1.weight
    handed.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
    return chain, torch.randn(1, 5, 16, dtype=torch.float64)


def test_a_recorded_stored_step_gives_what_sensitivities_give():
    chain, x = _chain()
    torch.manual_seed(1)
    want = sensitivities(chain, x, {})
    params = [p for p in chain.parameters() if p.requires_grad]
    for p in params:  # as in a profile: gradients exist (steady state)
        p.grad = torch.zeros_like(p)
    torch.manual_seed(1)  # the same dropout draws
    record = StepRecord(x.device)
    segments = [Segment(i, i + 1, "store") for i in range(len(chain))]
    with record.watching(params):
        times = timed_step(chain, segments, x, projection, {}, record=record)
    for p in params:  # what later steps do to .grad reaches nothing recorded
        if p.grad is not None:
            p.grad.add_(1.0)
    got = record.sensitivities(chain)
    assert len(times) == len(chain)
    for a, b in zip(got.inputs, want.inputs, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(got.cotangents, want.cotangents, strict=True):
        assert torch.equal(a, b)
    assert got.grad_sq == want.grad_sq
    assert got.grad_sq[1] > 0  # the block whose hook frees .grad
    assert got.input_sq == want.input_sq
    assert want.exact[-1] is None  # its unused parameter has no gradient
    for a, b in zip(got.exact, want.exact, strict=True):
        assert (a is None) == (b is None)
        if a is None:
            continue
        for field in ("input_grad", "param_grad", "output"):
            assert torch.equal(getattr(a, field), getattr(b, field)), field
        assert torch.equal(a.rng[0], b.rng[0])


def test_the_errors_profiled_at_batch_one_are_those_at_batch_two_in_kind():
    """The class token's gradient at batch 1 is a slice of the stem output's: the profile's
    later steps once wrote into the recorded figures through it (errors 0.2 and 0.6 at batch
    1 against 2e-3 at batch 2)."""
    torch.manual_seed(0)
    chain = nn.Sequential(_Stem(16), *gpt_like(3, 16, 2))
    worst = {}
    for batch in (1, 2):
        torch.manual_seed(1)
        prof = profile(chain, torch.randn(batch, 6, 16), repeats=1, codecs=("bf16",))
        worst[batch] = max(
            max(b.approx["bf16"].param_grad_error, b.approx["bf16"].input_grad_error)
            for b in prof.blocks
        )
    assert worst[1] < 0.02 and worst[2] < 0.02, worst


def test_profile_runs_the_stored_chain_once(monkeypatch):
    """The stored step the probe times is the one the error model records (it was a run of
    its own before, a step more of profiling)."""
    from revckpt.schedule import probe

    torch.manual_seed(0)
    chain, x = gpt_like(8, 16, 2), torch.randn(2, 5, 16)  # long enough for references
    stored_steps = []
    timed = probe.timed_step

    def counted(chain_, segments, *args, **kwargs):
        if all(s.strategy == "store" for s in segments):
            stored_steps.append(kwargs.get("record"))
        return timed(chain_, segments, *args, **kwargs)

    monkeypatch.setattr(probe, "timed_step", counted)
    import revckpt.schedule.profiling as profiling

    monkeypatch.setattr(profiling, "timed_step", counted)
    prof = profile(chain, x, repeats=1)
    assert len(stored_steps) == 1 and stored_steps[0] is not None
    assert all(b.approx["bf16"].param_grad_error is not None for b in prof.blocks)


def test_the_codecs_are_timed_on_the_round_trips_their_errors_need(monkeypatch):
    """Each block's input goes through each codec once, for its errors; those round trips,
    timed, price the codecs (they were timed again, four times per group, before)."""
    from revckpt.approx.formats import Codec

    torch.manual_seed(0)
    chain, x = gpt_like(8, 16, 2), torch.randn(2, 5, 16)
    calls = []
    roundtrip = Codec.roundtrip

    def counted(self, t):
        calls.append(self)
        return roundtrip(self, t)

    monkeypatch.setattr(Codec, "roundtrip", counted)
    prof = profile(chain, x, repeats=1, codecs=("bf16", "e4m3"))
    assert len(calls) == 2 * len(chain)
    for b in prof.blocks:  # e4m3 priced from bf16's in-chain time and the two round trips
        assert b.strategy_overhead_s["approx:e4m3"] > 0


class _Tied(nn.Module):
    def __init__(self, lin: nn.Linear) -> None:
        super().__init__()
        self.lin = lin

    def forward(self, h):
        return h + torch.tanh(self.lin(h))


def test_blocks_sharing_a_weight_compare_with_their_own_gradients():
    """A tied weight's gradient in the chain is the sum over the blocks using it: compared
    with one block's own codec run, it read an error of 0.6-0.8 for bf16."""
    torch.manual_seed(0)
    lin = nn.Linear(16, 16)
    chain = nn.Sequential(_Tied(lin), nn.Linear(16, 16), _Tied(lin))
    prof = profile(chain, torch.randn(4, 16), repeats=1, codecs=("bf16",))
    errors = [b.approx["bf16"].param_grad_error for b in prof.blocks]
    assert max(errors) < 0.02, errors
