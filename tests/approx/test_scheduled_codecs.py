"""A scheduled chain builds the codecs of its approx segments once, when it is built."""

import torch
from torch import nn

import revckpt
from revckpt.approx import Codec
from revckpt.schedule.costs import Segment
from revckpt.schedule.plan import Plan, Scheduled, apply


def _plan(strategies: tuple[str, ...]) -> Plan:
    segments = tuple(Segment(i, i + 1, s) for i, s in enumerate(strategies))
    return Plan(segments, 0, 0.0, 0.0, None, 0.0, 1, 1.0, name="mixed")


def _chain(n: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(n)))


def test_forward_builds_no_codec(monkeypatch):
    strategies = ("approx:e4m3", "store", "approx:bf16", "checkpoint")
    chain = _chain(len(strategies))
    scheduled = apply(chain, _plan(strategies))
    assert isinstance(scheduled, Scheduled)
    built = []
    original = Codec.__post_init__

    def counting(self):
        built.append(self)
        original(self)

    monkeypatch.setattr(Codec, "__post_init__", counting)
    x = torch.randn(4, 8, requires_grad=True)
    for _ in range(2):
        scheduled(x).sum().backward()
    assert built == []


def test_prebuilt_codecs_give_the_gradients_of_the_strategy_text():
    strategies = ("approx:e4m3", "approx:e5m2", "store")
    chain = _chain(len(strategies))
    x = torch.randn(4, 8, requires_grad=True)
    scheduled = apply(chain, _plan(strategies))
    scheduled(x).sum().backward()
    got = [p.grad.clone() for p in chain.parameters()] + [x.grad.clone()]
    for p in (*chain.parameters(), x):
        p.grad = None
    h = x
    for block, store in zip(chain, ("e4m3", "e5m2", None), strict=True):
        h = (
            block(h)
            if store is None
            else revckpt.checkpoint(block, h, strategy=revckpt.approx.Approx(store=store))
        )
    h.sum().backward()
    want = [p.grad for p in chain.parameters()] + [x.grad]
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
