"""revckpt.checkpoint under torch.compile (inductor on CPU): the compiler plans the recompute."""

import copy

import pytest
import torch
from helpers import Chain

from revckpt.models import mlp_chain


def test_compiled_checkpoint_matches_compiled_plain():
    torch.manual_seed(0)
    chain = mlp_chain(2, 8, 16, norm="batch")
    plain = copy.deepcopy(chain)
    x = torch.randn(6, 8)
    torch.compile(Chain(chain, "per-block"))(x).sum().backward()
    torch.compile(plain)(x).sum().backward()
    for a, b in zip(chain.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)
    for a, b in zip(chain.buffers(), plain.buffers(), strict=True):
        assert torch.equal(a, b)  # BatchNorm statistics updated once, as without checkpoint


def _strategies():
    """name -> (factory of (module, forward fn)) for the strategies beyond plain checkpoint."""
    import revckpt
    from revckpt.approx import Approx
    from revckpt.layers import ReversibleSequential, ReversibleUnit, reversible_mlp_block
    from revckpt.models import ResidualMLPBlock
    from revckpt.schedule import Segment, apply, make_plan, profile

    def reversible():
        torch.manual_seed(0)
        m = ReversibleSequential(*[reversible_mlp_block(8, 16) for _ in range(3)])
        return m, m

    def approx():
        torch.manual_seed(0)
        m = mlp_chain(3, 16, 32, norm="layer")
        return m, lambda x: revckpt.checkpoint_sequential(m, 3, x, strategy=Approx(store="e4m3"))

    def selective():
        torch.manual_seed(0)
        m = mlp_chain(3, 16, 32, norm="layer")
        return m, lambda x: revckpt.checkpoint_sequential(m, 3, x, strategy="selective:matmul")

    def offloaded():
        torch.manual_seed(0)
        m = mlp_chain(3, 16, 32, norm="layer")
        return m, lambda x: revckpt.checkpoint_sequential(m, 3, x, strategy="offload")

    def compressed():
        torch.manual_seed(0)
        m = mlp_chain(3, 128, 256, norm="layer")  # saved tensors above compress's min_numel
        return m, lambda x: revckpt.checkpoint_sequential(m, 3, x, strategy="compress:bf16")

    def scheduled():
        torch.manual_seed(0)
        chain = torch.nn.Sequential(
            ResidualMLPBlock(16, 32, norm="layer", activation=torch.nn.GELU),
            ReversibleUnit(reversible_mlp_block(8, 16)),
            ReversibleUnit(reversible_mlp_block(8, 16)),
            ResidualMLPBlock(16, 32, norm="layer", activation=torch.nn.GELU),
        )
        prof = profile(chain, torch.randn(6, 16), repeats=1, codecs=("bf16",), policies=())
        segments = [Segment(0, 1, "approx:bf16"), Segment(1, 3, "reversible")]
        plan = make_plan(prof, [*segments, Segment(3, 4, "checkpoint")])
        model = apply(chain, plan)
        return model, model

    return {
        "reversible": reversible,
        "approx e4m3": approx,
        "selective matmul": selective,
        "offload": offloaded,
        "compress bf16": compressed,
        "scheduled": scheduled,
    }


def _retained_and_peak(fn, x):
    """Bytes the forward keeps for backward (its output excluded), and the peak of forward and
    backward, from the CPU allocator's events: the only CPU meter that sees compiled code."""
    from revckpt import MemoryMeter

    with MemoryMeter("cpu", method="allocator") as fwd:
        y = fn(x)
    retained = fwd.end_bytes - y.numel() * y.element_size()
    del y
    with MemoryMeter("cpu", method="allocator") as step:
        fn(x).sum().backward()
    return retained, step.peak_bytes


@pytest.mark.parametrize(
    "name",
    ["reversible", "approx e4m3", "selective matmul", "offload", "compress bf16", "scheduled"],
)
def test_compiled_strategy_matches_eager_and_keeps_no_more(name):
    module, eager = _strategies()[name]()
    compiled = torch.compile(eager)
    x = torch.randn(*((64, 128) if name == "compress bf16" else (6, 16)), requires_grad=True)
    grads, memory = {}, {}
    for label, fn in (("eager", eager), ("compiled", compiled)):
        for p in module.parameters():
            p.grad = None
        fn(x).sum().backward()  # also compiles, on the first call
        grads[label] = [p.grad.clone() for p in module.parameters()]
        memory[label] = _retained_and_peak(fn, x)
    for a, b in zip(grads["eager"], grads["compiled"], strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    # no silent fallback to storing activations: the compiled step keeps what eager keeps
    assert memory["compiled"][0] <= memory["eager"][0], memory
    explanation = torch._dynamo.explain(eager)(x)
    print(
        f"\n{name}: {explanation.graph_break_count} graph breaks under torch.compile; "
        f"retained, peak bytes: {memory}"
    )


def test_the_compiled_memory_check_fails_for_a_compiled_step_that_stores_everything():
    """The measurement behind the check above sees compiled code: a compiled store-all step
    keeps more than an eager checkpointed one, and a compiled checkpointed one does not."""
    import revckpt

    torch.manual_seed(0)
    chain = mlp_chain(3, 16, 32, norm="layer")
    x = torch.randn(6, 16, requires_grad=True)

    def ckpt(x):
        return revckpt.checkpoint_sequential(chain, 3, x)

    eager, _ = _retained_and_peak(ckpt, x)
    compiled_ckpt, _ = _retained_and_peak(torch.compile(ckpt), x)
    compiled_store, _ = _retained_and_peak(torch.compile(chain), x)
    print(
        f"\nretained: eager checkpoint {eager}, compiled checkpoint {compiled_ckpt}, "
        f"compiled store-all {compiled_store}"
    )
    assert compiled_ckpt <= eager < compiled_store


def test_compiled_codec_still_refuses_non_finite_boundaries():
    """Compiled, the codec's finiteness check still runs (eagerly, at a graph break) and
    raises rather than saturating inf to the format's largest value."""
    import revckpt
    from revckpt import InvalidArgumentError
    from revckpt.approx import Approx

    torch.manual_seed(0)
    m = mlp_chain(2, 16, 32)
    step = torch.compile(
        lambda x: revckpt.checkpoint_sequential(m, 2, x, strategy=Approx(store="e4m3"))
    )
    x = torch.randn(4, 16, requires_grad=True)
    step(x).sum().backward()
    bad = x.detach().clone()
    bad[0, 0] = float("inf")
    with pytest.raises(InvalidArgumentError, match="non-finite"):
        step(bad.requires_grad_()).sum().backward()


class _Box:
    value: object = None


_BOX = _Box()
_LINEAR = torch.nn.Linear(8, 8)


def _block_with_a_side_effect(h):
    _BOX.value = {"calls": 1}  # module globals: Dynamo traces a closure's cells another way
    return torch.relu(_LINEAR(h))


def test_compiled_selective_checkpoint_survives_a_graph_break_inside_the_block():
    # A block with a side effect (here an attribute set; in the wild the `kernels` package's
    # wrapped forwards of Hugging Face layers) breaks the graph inside the checkpoint. The
    # policy's keep-set, made in the traced code, is alive there and Dynamo must rebuild it:
    # as a frozenset it raised "frozenset not in co_names" (torch 2.13).
    import revckpt

    block = _block_with_a_side_effect
    x = torch.randn(4, 8, requires_grad=True)
    _LINEAR.zero_grad(set_to_none=True)
    compiled = torch.compile(lambda h: revckpt.checkpoint(block, h, strategy="selective:matmul"))
    compiled(x).sum().backward()
    got = [x.grad, *(p.grad for p in _LINEAR.parameters())]
    x2 = x.detach().requires_grad_()
    _LINEAR.zero_grad(set_to_none=True)
    block(x2).sum().backward()
    for a, b in zip(got, [x2.grad, *(p.grad for p in _LINEAR.parameters())], strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("strategy", ["selective:matmul", "approx:bf16", "offload"])
def test_compiled_checkpoint_warns_nothing_about_revckpt_caches(strategy):
    """Dynamo skips a functools cache and warns at every traced call of one (with a stack
    trace): the strategy-text, autocast and accelerator caches stay out of traced code."""
    import warnings

    import revckpt

    torch._dynamo.reset()
    block = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())
    x = torch.randn(2, 8, requires_grad=True)

    @torch.compile(backend="eager")
    def step(x):
        return revckpt.checkpoint(block, x, strategy=strategy).sum()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step(x).backward()
    cached = [str(w.message) for w in caught if "lru_cache" in str(w.message)]
    assert cached == []
    assert x.grad is not None


class _Tanh(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x))


class _Looped(torch.nn.Module):
    """The model loops over its blocks itself: a fitted multi-block segment is a Region."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(_Tanh() for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x.square().mean()


@pytest.mark.parametrize(
    "segments", [[[0, 2, "checkpoint"], [2, 4, "store"]], [[0, 4, "checkpoint"]]]
)
def test_a_fitted_multi_block_segment_compiles(segments):
    """A checkpoint segment over blocks the model calls one by one, compiled: inductor's
    backward failed (``wrong number of dimensions3 for op``); the segment now runs eagerly
    inside the compiled model, with compiled plain autograd's gradients."""
    import json

    import revckpt

    torch.manual_seed(0)
    base, x = _Looped(), torch.randn(8, 4, 16)
    model, plain = copy.deepcopy(base), copy.deepcopy(base)
    plan = json.loads(revckpt.fit(copy.deepcopy(base), x, memory_budget=1.0).to_json())
    plan["segments"] = segments
    revckpt.fit(model, x, memory_budget=1.0, plan=json.dumps(plan))
    torch._dynamo.reset()
    torch.compile(model)(x).backward()
    torch.compile(plain)(x).backward()
    for a, b in zip(model.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)


def test_a_converted_hugging_face_model_compiles():
    """``convert(model, "checkpoint")`` on an HF model, compiled: Dynamo failed on every HF
    layer (``Expected CellVariable``: revckpt walked the layer forward's closure cells while
    tracing); the loss and gradients now equal compiled plain autograd's."""
    pytest.importorskip("transformers")
    import zoo

    import revckpt

    torch.manual_seed(0)
    base = zoo.deeper("gpt2", 2)()
    for m in base.modules():  # dropout off: the same function both ways
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    model, plain = copy.deepcopy(base), copy.deepcopy(base)
    revckpt.convert(model, "checkpoint")
    ids = torch.randint(0, zoo.VOCAB, (2, 16))
    torch._dynamo.reset()
    got = torch.compile(model)(input_ids=ids, labels=ids).loss
    want = torch.compile(plain)(input_ids=ids, labels=ids).loss
    got.backward()
    want.backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for a, b in zip(model.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5)


def test_a_converted_model_compiles_as_one_graph_not_one_per_block():
    # The installed forward built the block's bound forward with types.MethodType, which
    # Dynamo cannot trace: the model's forward ran eagerly and each block was compiled apart,
    # recompiled per block (its name is guarded on) until Dynamo's limit of 8, then eager.
    import revckpt
    from revckpt.models import transformer_chain

    torch.manual_seed(0)
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    model = transformer_chain(12, 16, heads=2)
    plain = copy.deepcopy(model)
    revckpt.convert(model, "checkpoint")
    x = torch.randn(2, 8, 16)
    torch.compile(model)(x).sum().backward()
    plain(x).sum().backward()
    assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])
    for a, b in zip(model.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("how", ["torch.compile", "model.compile", "block.compile"])
def test_fit_plans_a_compiled_model(how):
    # a compiled step cannot be metered: fit refused the example ("the model cannot run it")
    import revckpt
    from revckpt.inplace.install import planned
    from revckpt.models import gpt_like

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = gpt_like(4, 32, 4)

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return x.square().mean()

    torch.manual_seed(0)
    torch._dynamo.reset()
    model, x = Net(), torch.randn(4, 32, 32)
    plain = copy.deepcopy(model)
    if how == "torch.compile":
        compiled = torch.compile(model)
    elif how == "model.compile":
        model.compile()
        compiled = model
    else:
        for block in model.blocks:
            block.compile()
        compiled = model
    plan = revckpt.fit(compiled, x, memory_budget="90%", segment_blocks=1)
    assert plan.segments and all(planned(b) is not None for b in model.blocks)
    compiled(x).backward()
    plain(x).backward()
    for a, b in zip(model.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5)


def test_fit_names_a_compiled_module_inside_the_model():
    # DDP(torch.compile(model)): the compiled step cannot be metered, and fit said the model
    # "cannot run the example"
    import revckpt
    from revckpt.models import gpt_like

    torch._dynamo.reset()
    inner = torch.compile(gpt_like(2, 16, 2))
    wrapper = torch.nn.Sequential(inner)
    with pytest.raises(revckpt.InvalidArgumentError, match=r"torch\.compile'd module inside"):
        revckpt.fit(wrapper, torch.randn(2, 8, 16), memory_budget="90%", loss_fn=torch.sum)
