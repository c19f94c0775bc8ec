"""revckpt.fit / convert / restore on whole models nobody here wrote (tests/zoo.py): the budget
holds for the user's whole step, gradients are the plain model's, nothing about the model
changes but its memory."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import importlib
import itertools
import json
import logging
import math
import types
import warnings

import pytest
import torch
import torch.nn.functional as F
import zoo
from torch import nn

import revckpt
from revckpt import InvalidArgumentError, MemoryMeter
from revckpt.inplace.install import planned
from revckpt.inplace.verify import fit_verified
from revckpt.schedule import Plan, Segment, Verified

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

NAMES = ["gpt2", "llama", "qwen2", "bert", "nanogpt", "encoder", "resnet"]
# the size planned for: activations large enough against the parameters that half the
# store-all step is reachable with exact strategies
PLANNED = {name: (8, 64) for name in NAMES} | {"resnet": (16, 32)}
SMALLER = {name: ((8, 48), (4, 64), (2, 16)) for name in NAMES} | {
    "resnet": ((16, 24), (8, 32), (4, 16))
}
# how far the cost model's prediction may sit above the measured step (never below it)
ABOVE = 0.01


def _case(name: str) -> zoo.Case:
    if name in zoo.HF_CASES:
        pytest.importorskip("transformers")
    return zoo.CASES[name]


def _measured_step(model: nn.Module, example, loss_fn) -> int:
    for p in model.parameters():
        p.grad = None  # as after optimizer.zero_grad(): the step creates the gradients
    with MemoryMeter("cpu") as meter:
        zoo.step(model, example, loss_fn)
    return meter.peak_bytes


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@functools.cache
def _reference(name: str) -> tuple[int, dict[str, torch.Tensor], int]:
    """The plain model's step: peak, gradients, and the per-layer checkpointing peak."""
    case = _case(name)
    example = case.make_example(*PLANNED[name])
    plain = case.make_model()
    peak = _measured_step(plain, example, case.loss_fn)
    grads = _grads(plain)
    per_layer = case.make_model()
    revckpt.convert(per_layer, "checkpoint")
    per_layer_peak = _measured_step(per_layer, example, case.loss_fn)
    return peak, grads, per_layer_peak


def _fit(name: str, budget):
    case = _case(name)
    model = case.make_model()
    example = case.make_example(*PLANNED[name])
    try:
        plan = revckpt.fit(model, example, memory_budget=budget, loss_fn=case.loss_fn)
    except revckpt.InfeasibleBudgetError as err:
        assert budget != "50%", str(err)
        assert "smallest budget" in str(err)
        assert err.smallest_budget_bytes <= _reference(name)[2]
        return None, model, example
    return plan, model, example


@pytest.mark.parametrize("budget", ["50%", "25%", "smallest"])
@pytest.mark.parametrize("name", NAMES)
def test_fit_holds_for_the_whole_step(name: str, budget: str) -> None:
    case = _case(name)
    plain_peak, plain_grads, per_layer_peak = _reference(name)
    if budget == "smallest":
        with pytest.raises(revckpt.InfeasibleBudgetError) as info:
            revckpt.fit(
                case.make_model(),
                case.make_example(*PLANNED[name]),
                memory_budget=1,
                loss_fn=case.loss_fn,
            )
        smallest = info.value.smallest_budget_bytes
        # never above per-layer checkpointing's measured whole step
        assert smallest <= per_layer_peak
        budget = smallest
    plan, model, example = _fit(name, budget)
    if plan is None:
        return  # infeasible at 25%: checked in _fit
    keys = list(case.make_model().state_dict())
    types_before = [type(m) for m in case.make_model().modules()]
    peak = _measured_step(model, example, case.loss_fn)
    assert plan.store_all_peak_bytes >= plain_peak * 0.99
    assert peak <= plan.memory_budget_bytes, plan.table()
    assert peak <= plan.predicted_peak_bytes, plan.table()
    assert peak >= plan.predicted_peak_bytes * (1 - ABOVE), (peak, plan.table())
    grads = _grads(model)
    assert grads.keys() == plain_grads.keys()
    for n, g in grads.items():
        assert torch.equal(g, plain_grads[n]), n
    assert list(model.state_dict()) == keys
    assert [type(m) for m in model.modules()] == types_before
    for batch, seq in SMALLER[name]:
        smaller = _measured_step(model, case.make_example(batch, seq), case.loss_fn)
        assert smaller <= plan.memory_budget_bytes
    assert revckpt.restore(model) == len(plan.block_names)
    assert not any("forward" in m.__dict__ for m in model.modules())
    assert revckpt.restore(model) == 0


@pytest.mark.parametrize("name", ["gpt2", "nanogpt", "resnet"])
def test_fit_with_an_error_budget(name: str) -> None:
    case = _case(name)
    _, plain_grads, _ = _reference(name)
    model = case.make_model()
    example = case.make_example(*PLANNED[name])
    budget = 0.6 if name == "resnet" else 0.45
    plan = revckpt.fit(
        model, example, memory_budget=budget, error_budget=1e-2, loss_fn=case.loss_fn
    )
    # approx is priced (it does not lower these models' smallest budget, 36-37% of store-all:
    # whether the plan uses it is the time model's call)
    assert plan.predicted_error <= 1e-2
    peak = _measured_step(model, example, case.loss_fn)
    assert peak <= plan.memory_budget_bytes
    num = sum(
        float((p.grad - plain_grads[n]).double().norm() ** 2) for n, p in model.named_parameters()
    )
    den = sum(float(g.double().norm() ** 2) for g in plain_grads.values())
    assert (num / den) ** 0.5 <= 1e-2


def test_a_checkpoint_segment_spans_blocks_the_model_loops_over() -> None:
    case = _case("nanogpt")
    example = case.make_example(*PLANNED["nanogpt"])
    _, plain_grads, _ = _reference("nanogpt")
    model = case.make_model()
    plan = revckpt.fit(model, example, memory_budget=1.0, loss_fn=case.loss_fn)
    two = dataclasses.replace(plan, segments=(Segment(0, 3, "checkpoint"), Segment(3, 4, "store")))
    applied = revckpt.fit(model, example, memory_budget=1.0, loss_fn=case.loss_fn, plan=two)
    assert applied.segments == two.segments
    _measured_step(model, example, case.loss_fn)
    for n, g in _grads(model).items():
        assert torch.equal(g, plain_grads[n]), n


def test_a_checkpoint_segment_refuses_tensors_changed_in_place_that_its_recompute_reads() -> None:
    """A forward hook editing a block's output in place inside a segment (steering), or the
    segment's input changed after the forward: the recompute read the unchanged or changed
    values, gradients 0.30 and 1.1 off, silently."""
    case = _case("nanogpt")
    example = case.make_example(*PLANNED["nanogpt"])
    model = case.make_model()
    plan = revckpt.fit(model, example, memory_budget=1.0, loss_fn=case.loss_fn)
    two = dataclasses.replace(plan, segments=(Segment(0, 3, "checkpoint"), Segment(3, 4, "store")))
    revckpt.fit(model, example, memory_budget=1.0, loss_fn=case.loss_fn, plan=two)
    first = model.get_submodule(plan.block_names[0])
    handle = first.register_forward_hook(lambda m, args, out: out.mul_(0.5))
    with pytest.raises(revckpt.ReplayError, match="changing it in place"):
        zoo.step(model, example, case.loss_fn)
    handle.remove()
    seen = []
    handle = first.register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    loss = case.loss_fn(model(*example) if isinstance(example, tuple) else model(example))
    handle.remove()
    with torch.no_grad():
        seen[0].mul_(2.0)  # the segment's input, after the forward
    with pytest.raises(revckpt.ModifiedInputError, match="changed in place after its forward"):
        loss.backward()


def test_a_saved_plan_applies_to_its_model_only(tmp_path) -> None:
    case = _case("nanogpt")
    example = case.make_example(4, 32)
    model = case.make_model()
    plan = revckpt.fit(model, example, memory_budget=0.7, loss_fn=case.loss_fn)
    path = tmp_path / "plan.json"
    plan.to_json(path)
    again = case.make_model()
    loaded = revckpt.fit(again, example, memory_budget=0.7, loss_fn=case.loss_fn, plan=path)
    assert loaded.segments == plan.segments
    other = _case("encoder").make_model()
    with pytest.raises(revckpt.InvalidArgumentError, match="another model"):
        revckpt.fit(other, example, memory_budget=0.7, plan=path)


def _gpt2(heads: int) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=4, n_embd=64, n_head=heads, n_positions=64, vocab_size=256,
                        bos_token_id=0, eos_token_id=0, use_cache=False)  # fmt: skip
    return GPT2LMHeadModel(config)


def test_a_saved_plan_is_measured_on_the_model_it_is_loaded_into(tmp_path) -> None:
    # 16 heads instead of 4: the same parameters (the digest agreed), and the plan's step
    # measured 1.20x its budget, silently
    pytest.importorskip("transformers")
    ids = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(1))
    batch = dict(input_ids=ids, labels=ids)
    path = tmp_path / "plan.json"
    revckpt.fit(_gpt2(4), batch, memory_budget="70%").to_json(path)
    revckpt.fit(_gpt2(4), batch, memory_budget="70%", plan=path)  # its own model: accepted
    eval_mode = _gpt2(4).eval()  # as from_pretrained returns it: measured in train mode
    assert revckpt.fit(eval_mode, batch, memory_budget="70%", plan=path).segments
    assert not eval_mode.training
    model = _gpt2(16)
    with pytest.raises(InvalidArgumentError, match=r"other settings .attention heads"):
        revckpt.fit(model, batch, memory_budget="70%", plan=path)
    assert all(planned(m) is None for m in model.modules())  # left as it was


class _DropBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln, self.fc1, self.fc2 = nn.LayerNorm(32), nn.Linear(32, 128), nn.Linear(128, 32)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.drop(torch.relu(self.fc1(self.ln(x)))))


class _DropNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_DropBlock() for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


@pytest.mark.parametrize("autocast", [False, True])
def test_a_saved_plan_is_measured_as_its_model_trains(autocast: bool) -> None:
    # dropout turned off by the user (its modules in eval mode): the check step put the whole
    # model in train mode and refused the model's own plan; a plan made under autocast was
    # refused when fit(plan=) ran outside it (training runs under it)
    torch.manual_seed(0)
    model = _DropNet().train()
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.eval()
    x = torch.randn(8, 64, 32)
    context = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with context:
        plan = revckpt.fit(model, x, memory_budget="60%")
    revckpt.restore(model)
    assert revckpt.fit(model, x, memory_budget="60%", plan=plan.to_json()).segments
    assert all(not m.training for m in model.modules() if isinstance(m, nn.Dropout))
    if autocast:
        return
    # a copy in eval mode (as from_pretrained returns it) trains after model.train(), dropout
    # on: measured so, above the budget (only the blocks' own flag set, it passed at 1.00x)
    copy_ = _DropNet().eval()
    copy_.load_state_dict(model.state_dict())
    with pytest.raises(InvalidArgumentError, match="dropout on where it was off"):
        revckpt.fit(copy_, x, memory_budget=plan.predicted_peak_bytes, plan=plan.to_json())
    assert not any(m.training for m in copy_.modules())


@pytest.mark.parametrize("order", ["before", "after"])
def test_hugging_face_gradient_checkpointing_leaves_planned_blocks_to_the_plan(order) -> None:
    # HF's wrapper sits on the layer class's forward, which the installed forward called: a
    # converted layer ran three forwards per step (HF's checkpoint around revckpt's)
    pytest.importorskip("transformers")
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    model = _gpt2(4).train()  # dropout 0.1: HF's checkpoint re-runs the layer in backward
    if order == "before":
        model.gradient_checkpointing_enable()
    revckpt.convert(model, "checkpoint")
    if order == "after":
        model.gradient_checkpointing_enable()
    runs = []
    for layer in model.transformer.h:
        layer.mlp.register_forward_pre_hook(lambda *_: runs.append(1))  # at entry
    model(input_ids=ids, labels=ids).loss.backward()
    assert len(runs) == 2 * len(model.transformer.h)  # forward and one recompute


class _FPNStage(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout)
        self.c2, self.b2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout)
        self.down = nn.Conv2d(cin, cout, 1, stride, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.b2(self.c2(F.relu(self.b1(self.c1(x))))) + self.down(x))


class _FPN(nn.Module):
    """Every stage's output feeds the next stage and a lateral conv: the outputs leave the
    chain, and the cost model reads the plans high."""

    def __init__(self, c: int = 8) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, 1, 1)
        widths = (c, 2 * c, 4 * c, 4 * c)
        self.stages = nn.ModuleList(
            _FPNStage(a, b, 1 if i == 0 else 2)
            for i, (a, b) in enumerate(zip((c, c, 2 * c, 4 * c), widths, strict=True))
        )
        self.lat = nn.ModuleList(nn.Conv2d(w, c, 1) for w in widths)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, feats = self.stem(x), []
        for stage in self.stages:
            x = stage(x)
            feats.append(x)
        return sum(lat(f).square().mean() for lat, f in zip(self.lat, feats, strict=True))


def test_a_budget_the_least_peak_plan_meets_by_measurement_is_met() -> None:
    # the model read the least-peak plan at 484,104 bytes, the step measured 426,760, and a
    # 460,116-byte budget (90%) was refused as infeasible (the check only raised predictions)
    torch.manual_seed(0)
    model, x = _FPN(), torch.randn(4, 3, 16, 16)
    plan = revckpt.fit(model, x, memory_budget="90%", loss_fn=_itself)
    peak = _measured_step(model, x, _itself)
    assert peak <= plan.memory_budget_bytes and peak <= plan.predicted_peak_bytes


class _TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from revckpt.models import gpt_like

        self.emb, self.blocks = nn.Embedding(256, 64), gpt_like(4, 64, 4)
        self.ln, self.head = nn.LayerNorm(64), nn.Linear(64, 256)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.ln(self.blocks(self.emb(ids))))
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def test_a_fit_under_autocast_holds_for_a_loop_that_enters_autocast_per_step() -> None:
    # fit's steps, inside the caller's one autocast context, found the weights cast already;
    # a loop entering autocast per step casts them in each step: 1.13x the budget at 50%
    torch.manual_seed(0)
    model = _TinyLM().train()
    ids = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(1))
    # checkpoint only: which plan the time model picks varies with the machine's load, and a
    # selective block's cast weights, which the loop's cache keeps to the forward's end, were
    # measured at 1.03x the budget (the gap docs/models.md gives, 1.013-1.067x, left for
    # planning: the metering would have to keep autocast's cache as that loop does)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plan = revckpt.fit(model, ids, memory_budget="50%", strategies=["store", "checkpoint"])
    for p in model.parameters():
        p.grad = None
    with MemoryMeter("cpu") as meter:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(ids)
        loss.backward()
    assert meter.peak_bytes <= plan.memory_budget_bytes, (meter.peak_bytes, plan.table())


def test_a_saved_lossy_plan_needs_an_error_budget(tmp_path) -> None:
    case = _case("nanogpt")
    example = case.make_example(4, 32)
    plan = revckpt.fit(case.make_model(), example, memory_budget=0.7, loss_fn=case.loss_fn)
    lossy = dataclasses.replace(
        plan,
        segments=tuple(dataclasses.replace(s, strategy="approx:bf16") for s in plan.segments),
        predicted_error=1e-3,
    )
    fit = functools.partial(
        revckpt.fit, case.make_model(), example, memory_budget=0.7, loss_fn=case.loss_fn
    )
    with pytest.raises(InvalidArgumentError, match=r"lossy.*error_budget=0"):
        fit(plan=lossy)  # exact strategies only, as without plan=
    with pytest.raises(InvalidArgumentError, match="leaves out"):
        fit(plan=lossy, error_budget=1e-2, strategies=["checkpoint"])
    assert fit(plan=lossy, error_budget=1e-2).strategies == lossy.strategies
    with pytest.raises(InvalidArgumentError, match="leaves out"):  # measured, not installed
        fit(plan=lossy, error_budget=1e-2, strategies=["checkpoint"], verify=True)


def test_a_larger_batch_names_the_planned_shape() -> None:
    case = _case("nanogpt")
    model = case.make_model()
    revckpt.fit(model, case.make_example(4, 32), memory_budget=0.7, loss_fn=case.loss_fn)
    with pytest.raises(revckpt.InvalidArgumentError, match=r"\[4, 32, 64\]"):
        zoo.step(model, case.make_example(8, 32), case.loss_fn)
    model.eval()  # eval mode and no_grad run plainly, any size
    with torch.no_grad():
        model(*case.make_example(8, 32))


def test_a_wider_dtype_after_the_fit_is_refused_as_a_larger_batch_is() -> None:
    """``model.double()`` after a float32 fit doubles every tensor the plan keeps: the memory
    plan no longer holds, and training says so (it ran on silently before). A narrower dtype
    keeps less and runs; the dtypes travel with a saved plan, and a plan saved without them
    (before they were recorded) still loads and runs."""
    case = _case("nanogpt")
    model = case.make_model()
    example = case.make_example(4, 32)
    plan = revckpt.fit(model, example, memory_budget=0.7, loss_fn=case.loss_fn)
    assert set(plan.block_dtypes) == {"float32"} and len(plan.block_dtypes) == plan.length
    assert Plan.from_json(plan.to_json()).block_dtypes == plan.block_dtypes
    model.double()
    with pytest.raises(InvalidArgumentError, match=r"planned for torch\.float32 hidden states"):
        zoo.step(model, example, case.loss_fn)
    model.bfloat16()
    zoo.step(model, example, case.loss_fn)
    old = Plan.from_dict({k: v for k, v in plan.to_dict().items() if k != "block_dtypes"})
    assert old.block_dtypes == ()
    again = case.make_model()
    revckpt.fit(again, example, memory_budget=0.7, loss_fn=case.loss_fn, plan=old)
    zoo.step(again, example, case.loss_fn)


def test_an_input_in_another_dtype_than_the_model_is_named_as_the_cause() -> None:
    """A float64 input to a float32 fitted model: the plain model raises torch's dtype
    mismatch; the plan's refusal said to fit again after changing the model's dtype, which
    the user had not changed. It now names the parameters' dtype."""
    torch.manual_seed(0)
    model = nn.Sequential(*[_Residual(8) for _ in range(3)])
    revckpt.fit(model, torch.randn(4, 8), memory_budget=1.0, loss_fn=lambda out: out.sum())
    with pytest.raises(InvalidArgumentError, match=r"its parameters are torch\.float32"):
        model(torch.randn(4, 8, dtype=torch.float64)).sum().backward()


def test_frozen_blocks_before_a_trainable_embedding_are_planned() -> None:
    """Prompt tuning: the blocks frozen, the embedding trained. The backward still runs
    through every block and keeps their activations, so fit plans them (it said the model
    had no repeated blocks); with nothing trainable at all it says so."""
    case = _case("nanogpt")
    model = case.make_model()
    model.transformer.h.requires_grad_(False)
    example = case.make_example()
    plan = revckpt.fit(model, example, memory_budget="60%", loss_fn=case.loss_fn)
    assert plan.length == len(model.transformer.h)
    assert _measured_step(model, example, case.loss_fn) <= plan.memory_budget_bytes
    model.requires_grad_(False)
    with pytest.raises(InvalidArgumentError, match="does not require grad"):
        revckpt.fit(model, example, memory_budget="60%", loss_fn=case.loss_fn)


def test_a_plan_made_under_autocast_is_refused_without_it() -> None:
    """Fitted under bfloat16 autocast and trained without it, the blocks keep float32
    activations with the same hidden-state dtype: it ran past the budget silently (the
    review's nanoGPT: 5.87 MB against 4.09). Under the same autocast it runs; a plan made
    without autocast runs under it (narrower); the autocast travels with a saved plan."""
    case = _case("nanogpt")
    example = case.make_example(4, 32)
    model = case.make_model()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plan = revckpt.fit(model, example, memory_budget=0.8, loss_fn=case.loss_fn)
        zoo.step(model, example, case.loss_fn)
    assert plan.autocast == "bfloat16"
    assert Plan.from_json(plan.to_json()).autocast == "bfloat16"
    with pytest.raises(InvalidArgumentError, match=r"planned under torch\.autocast in torch\.bfl"):
        zoo.step(model, example, case.loss_fn)
    with torch.no_grad():
        model(*example)  # not training: runs plainly
    plain = case.make_model()
    assert revckpt.fit(plain, example, memory_budget=0.8, loss_fn=case.loss_fn).autocast is None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        zoo.step(plain, example, case.loss_fn)
    with pytest.raises(InvalidArgumentError, match="autocast='float99'"):
        Plan.from_json(json.dumps({**plan.to_dict(), "autocast": "float99"}))


def test_an_approx_plan_is_refused_under_another_autocast() -> None:
    """Its gradient error was measured without autocast: under bf16 autocast (fit first,
    then Trainer(bf16=True)) an approx:bf16 plan measured 3.5x its reported error, over the
    error budget, silently. An exact plan made without autocast still runs under it."""
    case = _case("nanogpt")
    example = case.make_example(4, 32)
    model = case.make_model()
    plan = revckpt.fit(
        model, example, memory_budget=1.0, loss_fn=case.loss_fn, error_budget=1.0,
        strategies=["approx:bf16"],
    )  # fmt: skip
    assert {s.strategy for s in plan.segments} == {"approx:bf16"}
    zoo.step(model, example, case.loss_fn)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(InvalidArgumentError, match=r"approx:bf16\) was planned without"):
            zoo.step(model, example, case.loss_fn)
        plan = revckpt.fit(
            model, example, memory_budget=1.0, loss_fn=case.loss_fn, error_budget=1.0,
            strategies=["approx:bf16"],
        )  # fmt: skip
        zoo.step(model, example, case.loss_fn)  # fitted under it: runs
    with pytest.raises(InvalidArgumentError, match=r"planned under torch\.autocast"):
        zoo.step(model, example, case.loss_fn)


class _Float32Inside(nn.Module):
    """Float32 weights, a bfloat16 stream between blocks, computed on in float32."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(32, 128), nn.Linear(128, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        return (h + self.fc2(F.gelu(self.fc1(h)))).to(x.dtype)


def test_a_plan_made_under_autocast_is_refused_without_it_for_float32_weights_on_a_16_bit_stream():
    """A review: the check skipped every block whose hidden state is not float32, and a block
    that computes in float32 on a bfloat16 stream kept wider activations without autocast
    than planned under it (1.61x the budget, silently)."""
    torch.manual_seed(0)
    model = nn.Sequential(*(_Float32Inside() for _ in range(4)))
    x = torch.randn(8, 16, 32, dtype=torch.bfloat16)

    def loss_fn(y: torch.Tensor) -> torch.Tensor:
        return y.float().square().mean()

    with torch.autocast("cpu", dtype=torch.bfloat16):
        revckpt.fit(model, x, memory_budget=0.8, loss_fn=loss_fn)
    with pytest.raises(InvalidArgumentError, match=r"planned under torch\.autocast"):
        loss_fn(model(x)).backward()


class _NearOverflow(nn.Module):
    """Each block adds about 100 to every channel: an outlier channel at 64600 stays below
    float16's 65504 through four blocks, and rounded up by e4m3 overflows a recompute."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        with torch.no_grad():
            self.fc2.bias.fill_(100.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(F.layer_norm(x, x.shape[-1:]))))


def test_fit_plans_around_a_float16_recompute_that_overflows() -> None:
    """fit(error_budget=) on a float16 model with activations near 65504: its profile or
    check step raised a ReplayError advising a per-block strategy fit has no option for.
    The blocks whose approx recompute overflows are planned without approx."""
    torch.manual_seed(0)
    model = nn.Sequential(*(_NearOverflow() for _ in range(4))).half()
    x = torch.randn(128, 32).half() * 10
    x[:, 3] = 64600.0

    def loss_fn(y: torch.Tensor) -> torch.Tensor:
        return (y - y.mean(-1, keepdim=True)).float().div(64).square().mean()

    reference = copy.deepcopy(model)
    strategies = ["store", "checkpoint", "approx:e4m3"]
    with pytest.warns(revckpt.PlanWarning, match="overflows") as said:
        plan = revckpt.fit(model, x, memory_budget=0.6, error_budget=5e-2, loss_fn=loss_fn,
                           strategies=strategies)  # fmt: skip
    assert {w.filename for w in said} == {__file__}
    assert not any(s.startswith("approx") for s in plan.strategies), plan
    revckpt.restore(model)
    with pytest.raises(InvalidArgumentError, match="no block can run"):
        revckpt.fit(model, x, memory_budget=0.6, error_budget=5e-2, loss_fn=loss_fn,
                    strategies=["approx:e4m3"])  # fmt: skip
    loss_fn(model(x)).backward()
    loss_fn(reference(x)).backward()
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)


class _AutocastOff(nn.Module):
    """Blocks the model calls with autocast switched off, whatever its caller runs under."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)) for _ in range(4)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", enabled=False):
            for block in self.blocks:
                x = x + block(x)
        return x.sum()


def test_the_autocast_recorded_is_the_one_the_blocks_ran_under() -> None:
    """A fit under autocast of a model that calls its blocks with autocast off plans them
    off: training under or without the outer autocast runs (the blocks see it off)."""
    model = _AutocastOff()
    x = torch.randn(8, 64, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plan = revckpt.fit(model, (x,), memory_budget=1.0, loss_fn=lambda out: out)
        model(x).backward()
    assert plan.autocast is None
    model(x).backward()


class _Scaled(nn.Module):
    """A block called as ``block(scale, h)``: a float32 table first, the hidden state second."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(64, 256), nn.Linear(256, 64)

    def forward(self, scale: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(F.gelu(self.up(h))) * scale.to(h.dtype)


class _ScaledModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Scaled() for _ in range(4))
        self.scale = torch.ones(1, 1, 64)  # a plain attribute: stays float32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(self.scale, x)
        return x.sum()


def test_a_saved_plan_checks_no_dtype_on_an_argument_it_did_not_trace() -> None:
    """A saved plan's blocks found their hidden state by a rule (the first floating positional
    tensor, here a float32 table): no dtype was checked on it, so a bfloat16 model was not
    refused for its float32 table (the review of the dtype check found it refused). Plans now
    keep where the trace found it (``block_keys``); the bfloat16 model still trains."""
    torch.manual_seed(0)
    model = _ScaledModel().bfloat16()
    plain = copy.deepcopy(model)
    x = torch.randn(8, 64, 64).bfloat16()
    plan = revckpt.fit(model, (x,), memory_budget=0.6, loss_fn=lambda out: out, segment_blocks=1)
    again = copy.deepcopy(plain)
    revckpt.fit(again, (x,), memory_budget=0.6, loss_fn=lambda out: out, plan=plan.to_json())
    again(x).backward()
    plain(x).backward()
    for a, b in zip(again.parameters(), plain.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)


def test_a_saved_plan_finds_the_hidden_state_where_the_trace_found_it(tmp_path) -> None:
    """A block taking ``(scale, h)``: the rule (the first floating positional tensor) took the
    table for the hidden state, and the saved plan refused the very batch it was made on
    ("planned for hidden states of shape [8, 64, 64] ... got [1, 1, 64]"). The plan keeps
    where the trace found it."""
    torch.manual_seed(0)
    model = _ScaledModel()
    plain = copy.deepcopy(model)
    x = torch.randn(8, 64, 64)
    plan = revckpt.fit(model, (x,), memory_budget=0.6, loss_fn=lambda out: out, segment_blocks=1)
    assert plan.block_keys == (1, 1, 1, 1)
    path = tmp_path / "plan.json"
    plan.to_json(path)
    again = copy.deepcopy(plain)
    revckpt.fit(again, (x,), memory_budget=0.6, loss_fn=lambda out: out, plan=path)
    again(x).backward()
    plain(x).backward()
    for a, b in zip(again.parameters(), plain.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)
    assert planned(again.blocks[0]).limit == (8, 64, 64)
    older = {**plan.to_dict(), "block_keys": []}  # a plan saved before: found by the rule
    assert revckpt.schedule.Plan.from_dict(older).block_keys == ()


def test_hf_cache_in_training_is_off_as_with_hf_checkpointing() -> None:
    pytest.importorskip("transformers")
    case = _case("gpt2")
    example = case.make_example(4, 32)
    plain = case.make_model()
    zoo.step(plain, example, None)
    reference = _grads(plain)
    model = case.make_model()
    model.config.use_cache = True  # the transformers default
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        revckpt.convert(model, "checkpoint")
        zoo.step(model, example, None)
    assert any("cache" in str(w.message) for w in caught)
    for n, g in _grads(model).items():
        assert torch.equal(g, reference[n]), n


@pytest.mark.parametrize(
    "strategy", ["checkpoint", "selective:matmul+attention", "offload", "approx:bf16"]
)
def test_convert_applies_one_strategy_in_place(strategy: str) -> None:
    case = _case("nanogpt")
    example = case.make_example(4, 32)
    plain = case.make_model()
    zoo.step(plain, example, case.loss_fn)
    reference = _grads(plain)
    model = case.make_model()
    converted = revckpt.convert(model, strategy, every=2)
    assert converted == ["transformer.h.0", "transformer.h.2"]
    zoo.step(model, example, case.loss_fn)
    for n, g in _grads(model).items():
        if strategy.startswith("approx"):
            assert torch.allclose(g, reference[n], rtol=0.1, atol=1e-3), n
        else:
            assert torch.equal(g, reference[n]), n
    revckpt.restore(model)
    assert all(type(m).forward is m.forward.__func__ for m in model.modules())


class _StaticForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))  # unused by the forward: found as a block

    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(x)


@pytest.mark.parametrize("strategy", ["checkpoint", "offload"])
def test_a_block_with_a_static_forward_converts(strategy: str) -> None:
    # the class's forward was called with the block as its first argument (raw TypeError)
    model = nn.Sequential(*[_StaticForward() for _ in range(4)]).double()
    x = torch.randn(2, 8, dtype=torch.float64, requires_grad=True)
    want = torch.autograd.grad(model(x).sum(), x)[0]
    assert revckpt.convert(model, strategy)
    got = torch.autograd.grad(model(x).sum(), x)[0]
    assert torch.equal(got, want)


def test_a_backward_in_eval_mode_is_said_to_save_nothing(monkeypatch) -> None:
    """Planned blocks run plainly in eval mode (as HF's checkpointing does): with gradients
    on, that is said (PlanWarning, one message from one place: once under Python's default
    filter), since a loop calling model.eval() to switch dropout off would get none of the
    saving; under no_grad or in train mode nothing is said."""
    from revckpt.inplace import install as installed

    monkeypatch.setattr(installed, "__warningregistry__", {}, raising=False)
    case = _case("nanogpt")
    example = case.make_example(2, 16)
    model = case.make_model()
    revckpt.convert(model, "checkpoint")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        zoo.step(model, example, case.loss_fn)  # train mode: planned, silent
        model.eval()
        with torch.no_grad():
            model(*example) if isinstance(example, tuple) else model(example)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")  # Python's own: once per place
        zoo.step(model, example, case.loss_fn)
        zoo.step(model, example, case.loss_fn)
    said = [w for w in seen if issubclass(w.category, revckpt.PlanWarning)]
    assert len(said) == 1 and "none of the plan's saving" in str(said[0].message)


def test_fit_refuses_a_model_in_eval_mode() -> None:
    """from_pretrained returns a model in eval mode, where planned blocks run plainly: fit
    says so and what to do, rather than that the example never ran the blocks."""
    case = _case("gpt2")
    model = case.make_model().eval()
    with pytest.raises(revckpt.InvalidArgumentError, match=r"eval mode.*model\.train\(\)"):
        revckpt.fit(model, case.make_example(2, 16), memory_budget="50%")
    assert not any(planned(m) for m in model.modules())


def test_the_least_peak_plan_that_measures_within_the_budget_is_taken() -> None:
    """fit called at the smallest budget an earlier fit named can profile other times and
    solve another plan first, whose measured step is a few bytes over; the retry's lowered
    target then has no plan, but the least-peak plan itself measures within the budget: it
    is taken, not refused (seen: 128 bytes, the bottleneck ResNet of this file, under load)."""
    from revckpt.inplace.confirm import _within_budget
    from revckpt.schedule import Plan

    def plan(name: str, peak: int) -> Plan:
        return Plan(segments=(Segment(0, 1, "checkpoint"),), predicted_peak_bytes=peak,
                    predicted_overhead=0.1, predicted_error=0.0, memory_budget_bytes=None,
                    error_budget=0.0, store_all_peak_bytes=4000, base_time_s=1.0,
                    name=name)  # fmt: skip

    calls: list[int] = []

    def checked(target: int) -> tuple[Plan, int]:
        calls.append(target)
        if len(calls) == 1:  # another plan first: it measured 128 bytes over its prediction
            return plan("faster", 1128), 128
        if target < 1000:
            raise revckpt.InfeasibleBudgetError("none", smallest_budget_bytes=1000)
        return plan("least peak", 1000), 0  # measured as predicted

    got = _within_budget(checked, 1000, 4000)
    assert got.name == "least peak" and got.memory_budget_bytes == 1000
    assert calls == [1000, 872, 1000]


def test_the_smallest_budget_named_is_the_solvers_not_a_lower_plan_times_chose() -> None:
    """At the solver's smallest budget, the plan found can peak a few bytes lower (it was the
    faster one in this profile); a later fit at that lower peak may profile other times and
    find only the least-peak plan, above it. The budget named is the solver's, which a later
    solve always meets."""
    from revckpt.inplace.confirm import _within_budget
    from revckpt.schedule import Plan

    def checked(target: int) -> tuple[Plan, int]:
        if target < 1128:
            raise revckpt.InfeasibleBudgetError("none", smallest_budget_bytes=1128)
        return Plan(segments=(Segment(0, 1, "checkpoint"),), predicted_peak_bytes=1000,
                    predicted_overhead=0.1, predicted_error=0.0, memory_budget_bytes=None,
                    error_budget=0.0, store_all_peak_bytes=4000, base_time_s=1.0,
                    name="faster"), 0  # fmt: skip

    with pytest.raises(revckpt.InfeasibleBudgetError) as info:
        _within_budget(checked, 500, 4000)
    assert info.value.smallest_budget_bytes == 1128


def test_the_smallest_budget_named_is_met_by_a_fit_at_it() -> None:
    """A retry's plan can measure a lower peak than the least-peak plan; naming it, a fit at
    that budget solves to a faster plan over it and ends infeasible, naming another. Plans:
    (name, predicted peak, measured peak, seconds); ``checked`` takes the fastest whose
    prediction fits, as solve does."""
    from revckpt.inplace.confirm import _within_budget
    from revckpt.schedule import Plan

    plans = [("A", 1000, 1200, 3.0), ("B", 1050, 1100, 2.0), ("C", 1090, 1400, 1.0)]

    def checked(target: int) -> tuple[Plan, int]:
        fits = [p for p in plans if p[1] <= target]
        if not fits:
            raise revckpt.InfeasibleBudgetError("none", smallest_budget_bytes=1000)
        name, model, measured, secs = min(fits, key=lambda p: p[3])
        return Plan(segments=(Segment(0, 1, "checkpoint"),),
                    predicted_peak_bytes=max(model, measured), predicted_overhead=secs,
                    predicted_error=0.0, memory_budget_bytes=None, error_budget=0.0,
                    store_all_peak_bytes=4000, base_time_s=1.0,
                    name=name), max(0, measured - model)  # fmt: skip

    with pytest.raises(revckpt.InfeasibleBudgetError) as info:
        _within_budget(checked, 1080, 4000)
    named = info.value.smallest_budget_bytes
    assert named == 1200
    assert _within_budget(checked, named, 4000).name == "A"


def test_approx_checkpoint_takes_bound_methods_and_partials() -> None:
    torch.manual_seed(0)
    layer = nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    layer(x).square().sum().backward()
    ref = layer.weight.grad.clone()
    for fn in (layer.forward, functools.partial(type(layer).forward, layer)):
        layer.weight.grad = None
        y = revckpt.checkpoint(fn, x, strategy=revckpt.approx.Approx(store="bf16"))
        y.square().sum().backward()
        assert torch.allclose(layer.weight.grad, ref, rtol=1e-2, atol=1e-2)
        assert not torch.equal(layer.weight.grad, torch.zeros_like(ref))


class _Flat(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.ReLU()

    def forward(self, x):
        return self.b(self.a(x)).sum()


class _Residual(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


def test_blocks_inline_with_other_modules_are_found() -> None:
    """Repeated blocks written inline in one nn.Sequential between a stem and a head (as a
    hand-written CNN or MLP often is) are found as the run of consecutive same-class
    children; a run of one is not a repeat; fit's plan over them keeps the gradients."""
    from revckpt.inplace import find_blocks

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), *[_Residual(8) for _ in range(4)], nn.Linear(8, 1))
    assert [fqn for fqn, _ in find_blocks(model)] == ["1", "2", "3", "4"]
    lone = nn.Sequential(nn.Linear(3, 8), _Residual(8), nn.ReLU(), _Residual(8))
    with pytest.raises(revckpt.InvalidArgumentError, match="no repeated blocks"):
        find_blocks(lone)
    x = torch.randn(16, 3)
    model(x).sum().backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    revckpt.fit(model, x, memory_budget=0.8, loss_fn=lambda out: out.sum())
    model(x).sum().backward()
    for g, w in zip((p.grad for p in model.parameters()), want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7)


def test_a_budget_of_the_store_all_step_is_met_by_storing_everything() -> None:
    """memory_budget="100%" is the store-all step as measured: on small chains the cost
    model reads it a few hundred bytes high, and fit installs the store-all plan anyway
    (it was refused as infeasible, new-user trial)."""
    from revckpt.inplace.step import measure_step

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(3)], nn.ReLU())
    x = torch.randn(4, 16)
    plan = revckpt.fit(model, x, memory_budget="100%", loss_fn=lambda out: out.sum())
    assert set(plan.strategies) == {"store"}
    assert plan.predicted_peak_bytes == plan.store_all_peak_bytes == plan.memory_budget_bytes
    assert measure_step(model, x, lambda out: out.sum()) <= plan.memory_budget_bytes


def test_an_example_that_requires_grad_is_left_as_it_was() -> None:
    """An example input that requires grad (a leaf the caller differentiates): fit meters
    the step with hooks on it and removes them, so the caller's own backward afterwards works
    (the hook called a closed meter: 'works inside the with block only') and the input's
    gradient is plain autograd's."""
    torch.manual_seed(0)
    model = nn.Sequential(*[_Residual(8) for _ in range(3)])
    x = torch.randn(4, 8, requires_grad=True)
    want = torch.autograd.grad(model(x).sum(), x)[0]
    revckpt.fit(model, x, memory_budget=1.0, loss_fn=lambda out: out.sum())
    assert not x._backward_hooks
    x.grad = None
    model(x).sum().backward()
    torch.testing.assert_close(x.grad, want)


@pytest.mark.parametrize("as_dict", [False, True])
def test_fit_leaves_the_examples_gradient_as_it_was(as_dict: bool) -> None:
    """A leaf of the example that requires grad (a trainable prompt, ``inputs_embeds``): the
    steps fit runs do not accumulate into its ``.grad`` (the next ``opt.step()`` would use
    them); one it had is the same tensor with the same values after, one it had not is still
    ``None``."""

    class Keyword(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(_Residual(8) for _ in range(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for b in self.blocks:
                x = b(x)
            return x

    torch.manual_seed(0)
    for had in (False, True):
        model = Keyword()
        x = torch.randn(4, 8, requires_grad=True)
        before = torch.randn(4, 8) if had else None
        x.grad = None if before is None else before.clone()
        held = x.grad
        example = {"x": x} if as_dict else x
        revckpt.fit(model, example, memory_budget=1.0, loss_fn=lambda out: out.sum())
        assert x.grad is held
        if had:
            torch.testing.assert_close(x.grad, before, rtol=0, atol=0)


@pytest.mark.parametrize("repeats", [0, -1, 1.5, True])
def test_bad_repeats_is_refused(repeats) -> None:
    """``repeats=0`` raised ``StatisticsError`` from deep inside, ``1.5`` a bare ``TypeError``."""
    model = nn.Sequential(*[_Residual(8) for _ in range(3)])
    with pytest.raises(InvalidArgumentError, match="repeats="):
        revckpt.fit(model, torch.randn(4, 8), memory_budget=1.0, repeats=repeats,
                    loss_fn=lambda out: out.sum())  # fmt: skip


def test_an_example_with_a_graph_is_refused_before_any_step() -> None:
    """``inputs_embeds`` computed from a parameter outside the model: fit's second step
    raised "backward through the graph a second time", after the first had added to that
    parameter's gradient."""
    torch.manual_seed(0)
    model = nn.Sequential(*[_Residual(8) for _ in range(3)])
    prompt = nn.Parameter(torch.randn(4, 8))
    with pytest.raises(InvalidArgumentError, match="requires grad and was computed"):
        revckpt.fit(model, prompt * 2, memory_budget=1.0, loss_fn=lambda out: out.sum())
    assert prompt.grad is None


def test_an_error_of_loss_fn_is_told_as_its_own() -> None:
    """A ``loss_fn`` that does not fit the output: fit said the model could not run the
    example."""
    model = nn.Sequential(*[_Residual(8) for _ in range(3)])
    with pytest.raises(InvalidArgumentError, match=r"loss_fn\(output\) raised IndexError"):
        revckpt.fit(
            model, torch.randn(4, 8), memory_budget=1.0, loss_fn=lambda out: out["logits"].sum()
        )


def test_a_tokenizers_batch_encoding_is_a_batch() -> None:
    """What a Hugging Face tokenizer returns (``BatchEncoding``, a ``UserDict``, not a dict)
    was refused as no batch at all."""
    transformers = pytest.importorskip("transformers")
    case = _case("gpt2")
    model = case.make_model()
    example = transformers.BatchEncoding(case.make_example())
    plan = revckpt.fit(model, example, memory_budget="60%", loss_fn=case.loss_fn)
    assert _measured_step(model, dict(example), case.loss_fn) <= plan.memory_budget_bytes


def test_bad_input_is_one_clear_error() -> None:
    case = _case("nanogpt")
    model, example = case.make_model(), case.make_example(2, 16)
    with pytest.raises(revckpt.InvalidArgumentError, match=r"no repeated blocks.*blocks="):
        revckpt.fit(_Flat(), torch.randn(2, 4), memory_budget=0.5)
    # convert's option is module_filter_fn (it said blocks=, which convert has not)
    with pytest.raises(revckpt.InvalidArgumentError, match=r"with module_filter_fn='attr"):
        revckpt.convert(_Flat(), "checkpoint")
    with pytest.raises(revckpt.InvalidArgumentError, match="has no submodule 'layers'"):
        revckpt.fit(model, example, memory_budget=0.5, blocks="transformer.layers")
    for bad in ("transformer.layers", "transformer.h.0", lambda m, fqn: False):
        with pytest.raises(revckpt.InvalidArgumentError, match=r"^module_filter_fn="):
            revckpt.convert(model, "checkpoint", module_filter_fn=bad)
    with pytest.raises(revckpt.InvalidArgumentError, match="cannot run the example"):
        revckpt.fit(model, torch.randn(3), memory_budget=0.5, loss_fn=case.loss_fn)
    with pytest.raises(revckpt.InvalidArgumentError, match="not a floating-point scalar"):
        revckpt.fit(model, example, memory_budget=0.5, loss_fn=lambda out: out[0])
    with pytest.raises(revckpt.InvalidArgumentError, match="pass loss_fn"):
        revckpt.fit(model, example, memory_budget=0.5)
    with pytest.raises(revckpt.InvalidArgumentError, match="memory budget"):
        revckpt.fit(model, example, memory_budget="eight gigs")
    with pytest.raises(revckpt.InvalidArgumentError, match=r"must be in \(0, 1\]; pass"):
        revckpt.fit(model, example, memory_budget="150%")
    with pytest.raises(revckpt.InvalidArgumentError, match="does not price 'offload'"):
        revckpt.fit(model, example, memory_budget=0.5, strategies=["offload"])
    with pytest.raises(revckpt.InvalidArgumentError, match=r"allows exact strategies only"):
        revckpt.fit(model, example, memory_budget=0.5, strategies=["store", "approx:bf16"])
    with pytest.raises(revckpt.InvalidInputTypeError, match=r"needs an nn\.Module"):
        revckpt.fit("model", example, memory_budget=0.5)  # a raw AttributeError before
    with pytest.raises(revckpt.InvalidInputTypeError, match="progress=5"):
        revckpt.fit(model, example, memory_budget=0.5, loss_fn=case.loss_fn, progress=5)
    assert not any("forward" in m.__dict__ for m in model.modules())  # nothing left behind
    plan = revckpt.fit(model, example, memory_budget=1.0, loss_fn=case.loss_fn)
    with pytest.raises(revckpt.InvalidArgumentError, match="above memory_budget"):
        revckpt.fit(model, example, memory_budget="1KiB", loss_fn=case.loss_fn, plan=plan)


def test_a_planned_model_deep_copies_as_a_planned_model() -> None:
    import copy

    case = _case("nanogpt")
    model = case.make_model()
    revckpt.convert(model, "checkpoint")
    clone = copy.deepcopy(model)
    block = clone.transformer.h[0]
    assert planned(block) is not None and block.forward.block is block


def test_a_fitted_model_saved_and_loaded_keeps_its_plan() -> None:
    """``torch.save(model)`` then ``torch.load``: the plan was dropped silently (the planned
    forward, a bound method, pickled as the class's), and the step measured 327,948 bytes
    against a budget of 295,153 it had met; now it loads planned, with the same peak and
    gradients."""
    import io

    case = _case("nanogpt")
    model = case.make_model()
    example = case.make_example()
    plan = revckpt.fit(model, example, memory_budget="60%", loss_fn=case.loss_fn)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert [planned(b) is not None for b in loaded.transformer.h] == [
        planned(b) is not None for b in model.transformer.h
    ]
    peaks, grads = [], []
    for m in (model, loaded):
        torch.manual_seed(0)
        peaks.append(_measured_step(m, example, case.loss_fn))
        grads.append([p.grad for p in m.parameters() if p.grad is not None])
    assert peaks[0] == peaks[1] <= plan.memory_budget_bytes
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_converted_model_compiles() -> None:
    case = _case("nanogpt")
    example = case.make_example(2, 16)
    plain = case.make_model()
    zoo.step(plain, example, case.loss_fn)
    model = case.make_model()
    revckpt.convert(model, "checkpoint")
    zoo.step(torch.compile(model), example, case.loss_fn)
    for n, p in model.named_parameters():  # compiled kernels: equal to round-off
        assert torch.allclose(p.grad, _grads(plain)[n], atol=1e-6), n


def test_segment_blocks_bounds_a_checkpoint_segment() -> None:
    case = _case("nanogpt")
    example = case.make_example(8, 64)
    model = case.make_model()
    plan = revckpt.fit(
        model,
        example,
        memory_budget=0.5,
        loss_fn=case.loss_fn,
        strategies=["checkpoint"],
        segment_blocks=1,
    )
    assert all(s.stop - s.start == 1 for s in plan.segments), plan.table()
    with pytest.raises(revckpt.InvalidArgumentError, match="segment_blocks=0"):
        revckpt.fit(model, example, memory_budget=0.5, segment_blocks=0)


def test_convert_replaces_what_was_installed() -> None:
    case = _case("nanogpt")
    model = case.make_model()
    revckpt.convert(model, "checkpoint")
    assert revckpt.convert(model, "checkpoint", every=2) == ["transformer.h.0", "transformer.h.2"]
    installed = [fqn for fqn, m in model.named_modules() if "forward" in m.__dict__]
    assert installed == ["transformer.h.0", "transformer.h.2"]


@pytest.mark.parametrize("name", ["encoder", "bert"])
def test_an_error_budget_never_raises_the_smallest_budget(name: str) -> None:
    case = _case(name)
    example = case.make_example(*PLANNED[name])
    smallest = {}
    for error_budget in (0.0, 1e-2):
        with pytest.raises(revckpt.InfeasibleBudgetError) as info:
            revckpt.fit(
                case.make_model(),
                example,
                memory_budget="10%",
                error_budget=error_budget,
                loss_fn=case.loss_fn,
            )
        smallest[error_budget] = info.value.smallest_budget_bytes
    assert smallest[1e-2] <= smallest[0.0]
    model = case.make_model()  # and fit at the smallest budget it named works
    plan = revckpt.fit(
        model, example, memory_budget=smallest[1e-2], error_budget=1e-2, loss_fn=case.loss_fn
    )
    assert _measured_step(model, example, case.loss_fn) <= plan.memory_budget_bytes


def _itself(out: torch.Tensor) -> torch.Tensor:
    return out


class _Biased(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.f = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.f(x) + bias)


class _GluedNet(nn.Module):
    """Blocks that take a second argument with a graph (as T5's position bias or a U-Net's
    skip tensor) and operations between the blocks that save tensors of their own."""

    def __init__(self, d: int = 32, n: int = 4) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(d))
        self.h = nn.ModuleList(_Biased(d) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = self.bias * 2  # not a leaf: it carries a graph into every block
        for blk in self.h:
            x = torch.sigmoid(blk(x, b))  # the sigmoid between blocks saves its output
        return x.square().mean()


def test_blocks_taking_tensors_with_a_graph_and_glue_between_them() -> None:
    torch.manual_seed(0)
    plain = _GluedNet()
    model = _GluedNet()
    model.load_state_dict(plain.state_dict())
    x = torch.randn(8, 64, 32)
    plain_peak = _measured_step(plain, x, _itself)
    reference = _grads(plain)
    plan = revckpt.fit(model, x, memory_budget=1.0)
    assert plan.store_all_peak_bytes == plain_peak  # the measured store-all step
    plan = revckpt.fit(model, x, memory_budget=plan.store_all_peak_bytes * 3 // 4)
    peak = _measured_step(model, x, _itself)
    assert peak <= plan.memory_budget_bytes and peak <= plan.predicted_peak_bytes
    for n, g in _grads(model).items():
        assert torch.equal(g, reference[n]), n


@pytest.mark.parametrize("strategy", ["offload", "approx:bf16"])
def test_hidden_state_strategies_differentiate_the_blocks_other_arguments(strategy: str) -> None:
    # approx and offload keep the hidden state only: the block's other arguments that carry a
    # graph (here a bias made from a parameter) still get their gradients
    torch.manual_seed(0)
    x = torch.randn(4, 16, 32, dtype=torch.float64)
    plain = _GluedNet().double()
    plain(x).backward()
    reference = _grads(plain)
    model = _GluedNet().double()
    model.load_state_dict(plain.state_dict())
    assert len(revckpt.convert(model, strategy)) == 4
    model(x).backward()
    for n, g in _grads(model).items():
        err = float((g - reference[n]).norm() / reference[n].norm())
        assert err == 0.0 if strategy == "offload" else 0 < err < 1e-2, (n, err)


class _Widening(nn.Module):
    """Blocks of growing width with a projection between each two: no chain of blocks."""

    def __init__(self, widths: tuple[int, ...] = (16, 32, 48, 64)) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d)) for d in widths
        )
        self.glue = nn.ModuleList(nn.Linear(a, b) for a, b in itertools.pairwise(widths))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            x = x + block(x)
            if i < len(self.glue):
                x = self.glue[i](x)
        return x.square().mean()


@pytest.mark.parametrize("name", ["widening", "glued"])
def test_an_error_budget_plans_blocks_that_form_no_chain(name: str) -> None:
    # the error model's weights come from the model's own step where the blocks cannot run one
    # after the other (widths change between them; a bias with a graph goes into each)
    torch.manual_seed(0)
    make = _Widening if name == "widening" else _GluedNet
    x = torch.randn(8, 64, 16 if name == "widening" else 32)
    plain = make()
    reference = _grads(plain) if plain(x).backward() is None else {}
    model = make()
    model.load_state_dict(plain.state_dict())
    plan = revckpt.fit(
        model,
        x,
        memory_budget=0.8 if name == "widening" else 0.9,  # glued: its inputs stay held
        error_budget=1e-2,
        strategies=["approx:bf16"],
        loss_fn=_itself,
        blocks="blocks" if name == "widening" else None,
    )
    assert set(plan.strategies) == {"approx:bf16"}
    assert 0 < plan.predicted_error <= 1e-2
    peak = _measured_step(model, x, _itself)
    assert peak <= plan.memory_budget_bytes
    num = sum(float((g - reference[n]).double().norm() ** 2) for n, g in _grads(model).items())
    den = sum(float(g.double().norm() ** 2) for g in reference.values())
    assert 0 < (num / den) ** 0.5 <= 1e-2


def test_approx_is_priced_with_an_input_that_code_between_blocks_saves() -> None:
    # the sigmoid between blocks saves each block's input: approx keeps its compressed copy
    # beside it, and an error budget must not raise the smallest budget the exact plans meet
    torch.manual_seed(0)
    model, x = _GluedNet(), torch.randn(8, 64, 32)
    smallest = {}
    for error_budget in (0.0, 1e-2):
        with pytest.raises(revckpt.InfeasibleBudgetError) as info:
            revckpt.fit(model, x, memory_budget=0.3, error_budget=error_budget)
        smallest[error_budget] = info.value.smallest_budget_bytes
    assert smallest[1e-2] <= smallest[0.0]
    plan = revckpt.fit(model, x, memory_budget=0.95, error_budget=1e-2, strategies=["approx:bf16"])
    assert plan.strategies == ["approx:bf16"] * 4
    assert _measured_step(model, x, _itself) == plan.predicted_peak_bytes


# --- two more block styles: a bottleneck ResNet (max-pool stem, in-place ReLU, ``out +=``) and
# a GPT with hand-written masked attention, a mask buffer and dropout ------------------------


class Bottleneck(nn.Module):
    def __init__(self, cin: int, mid: int, stride: int = 1) -> None:
        super().__init__()
        cout = mid * 4
        self.c1, self.b1 = nn.Conv2d(cin, mid, 1, bias=False), nn.BatchNorm2d(mid)
        self.c2, self.b2 = nn.Conv2d(mid, mid, 3, stride, 1, bias=False), nn.BatchNorm2d(mid)
        self.c3, self.b3 = nn.Conv2d(mid, cout, 1, bias=False), nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x if self.down is None else self.down(x)
        out = self.relu(self.b1(self.c1(x)))
        out = self.relu(self.b2(self.c2(out)))
        out = self.b3(self.c3(out))
        out += shortcut
        return self.relu(out)


class RN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 16, 7, 2, 3, bias=False),
            nn.BatchNorm2d(16),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(3, 2, 1),
        )
        cin = 16
        for i, (mid, n) in enumerate([(8, 3), (16, 4), (32, 3)]):
            first = Bottleneck(cin, mid, 1 if i == 0 else 2)
            rest = [Bottleneck(mid * 4, mid) for _ in range(n - 1)]
            setattr(self, f"layer{i + 1}", nn.Sequential(first, *rest))
            cin = mid * 4
        self.fc = nn.Linear(cin, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer3(self.layer2(self.layer1(self.stem(x))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class Attn(nn.Module):
    def __init__(self, d: int, heads: int, seq: int) -> None:
        super().__init__()
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.heads, self.drop = heads, nn.Dropout(0.1)
        self.register_buffer("mask", torch.tril(torch.ones(seq, seq)).view(1, 1, seq, seq))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (
            u.view(b, t, self.heads, c // self.heads).transpose(1, 2)
            for u in self.qkv(x).split(c, 2)
        )
        att = (q @ k.transpose(-2, -1)) / math.sqrt(c // self.heads)
        att = att.masked_fill(self.mask[:, :, :t, :t] == 0, float("-inf")).softmax(-1)
        return self.proj((self.drop(att) @ v).transpose(1, 2).contiguous().view(b, t, c))


class Blk(nn.Module):
    def __init__(self, d: int, heads: int, seq: int) -> None:
        super().__init__()
        self.l1, self.a, self.l2 = nn.LayerNorm(d), Attn(d, heads, seq), nn.LayerNorm(d)
        self.m = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d), nn.Dropout(0.1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.a(self.l1(x))
        return x + self.m(self.l2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int = 128, d: int = 64, heads: int = 4, seq: int = 64) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Blk(d, heads, seq) for _ in range(4))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


@pytest.mark.parametrize("name", ["bottleneck-resnet", "gpt-manual-attention"])
def test_fit_on_other_block_styles(name: str) -> None:
    budget = "50%"
    if name == "bottleneck-resnet":
        make, example, loss_fn = RN, (torch.randn(8, 3, 48, 48),), (lambda o: o.square().mean())
        # its smallest budget is 56% of store-all; a fit at exactly the smallest budget
        # another fit named can miss it by 128 bytes (which of two plans 128 bytes apart the
        # solver's byte slots let it find there depends on their times): a budget above it
        budget = "60%"
    else:
        tokens = torch.randint(0, 128, (8, 64), generator=torch.Generator().manual_seed(0))
        make, example, loss_fn = GPT, (tokens, tokens.roll(1, 1)), _itself

    def step(model: nn.Module) -> int:
        for p in model.parameters():
            p.grad = None
        torch.manual_seed(1)  # the same dropout masks in both models
        with MemoryMeter("cpu") as meter:
            loss_fn(model(*example)).backward()
        return meter.peak_bytes

    torch.manual_seed(0)
    plain = make()
    torch.manual_seed(0)
    model = make()
    step(plain)
    reference = _grads(plain)
    try:
        plan = revckpt.fit(model, example, memory_budget=budget, loss_fn=loss_fn)
    except revckpt.InfeasibleBudgetError as err:
        plan = revckpt.fit(model, example, memory_budget=err.smallest_budget_bytes, loss_fn=loss_fn)
    peak = step(model)
    assert peak <= plan.memory_budget_bytes and peak <= plan.predicted_peak_bytes
    assert peak >= plan.predicted_peak_bytes * (1 - ABOVE), plan.table()
    for n, g in _grads(model).items():
        assert torch.equal(g, reference[n]), n


# --- verify: fit's plan measured in the user's step next to the whole-model recipes ---------
# No assertion here depends on which plan measured faster: the choice itself is a pure
# function tested in tests/schedule; these check what holds whatever the timings.


def _installed(model: nn.Module) -> list[str]:
    return [planned(b).strategy for b in zoo.blocks(model, _case("nanogpt"))]


def _undominated(found: Verified, budget: int, error_budget: float = 0.0) -> None:
    """The winner fits both budgets by measurement and no row that does beats it on both."""
    best = found.measured
    assert found.report.chosen == best.name
    fitting = [
        r
        for r in found.report.rows
        if r.measured_peak_bytes <= budget and r.within_error(error_budget)
    ]
    assert best in fitting
    for r in fitting:
        better = (
            r.measured_peak_bytes <= best.measured_peak_bytes and r.time_ratio <= best.time_ratio
        )
        assert not better or (r.measured_peak_bytes, r.time_ratio) == (
            best.measured_peak_bytes,
            best.time_ratio,
        ), found.report.table()


def test_verify_installs_an_undominated_plan_that_fits_by_measurement(caplog) -> None:
    case = _case("nanogpt")
    example = case.make_example(*PLANNED["nanogpt"])
    _, plain_grads, _ = _reference("nanogpt")
    model = case.make_model()
    found = fit_verified(model, example, memory_budget=0.5, loss_fn=case.loss_fn, rounds=3)
    plan = found.plan
    budget = plan.memory_budget_bytes
    names = found.report.names
    assert names[:2] == ["store-all", found.solved.name] and "checkpoint every block" in names
    assert plan.name == (found.measured.name if found.replaced else "optimal") + " (verified)"
    assert found.replaced == (plan.segments != found.solved.segments)
    assert found.note.startswith("verified: ")
    _undominated(found, budget)
    assert _installed(model) == plan.strategies
    peak = _measured_step(model, example, case.loss_fn)
    assert peak <= budget and peak <= plan.predicted_peak_bytes
    for n, g in _grads(model).items():
        assert torch.equal(g, plain_grads[n]), n
    # the verified plan saves and applies like any plan
    again = case.make_model()
    loaded = revckpt.fit(
        again, example, memory_budget=0.5, loss_fn=case.loss_fn, plan=plan.to_json()
    )
    assert loaded.segments == plan.segments and _installed(again) == plan.strategies
    # fit(verify=True) returns the Plan and logs the note
    with caplog.at_level(logging.INFO, logger="revckpt.inplace.verify"):
        verified = revckpt.fit(again, example, memory_budget=0.5, loss_fn=case.loss_fn, verify=True)
    assert isinstance(verified, revckpt.schedule.Plan) and verified.name.endswith(" (verified)")
    assert _installed(again) == verified.strategies
    assert any(m.startswith("revckpt.fit: verified: ") for m in caplog.messages)


def _hand_made(model: nn.Module, example, loss_fn, last: str) -> revckpt.schedule.Plan:
    """Every block stored but one (``last``: the strategy of block 0)."""
    plan = revckpt.fit(model, example, memory_budget=1.0, loss_fn=loss_fn)
    segments = (Segment(0, 1, last), Segment(1, plan.length, "store"))
    return dataclasses.replace(plan, segments=segments, name="hand-made")


def test_a_saved_lossy_plans_gradient_error_is_measured_not_taken_from_its_json() -> None:
    """A hand-made or edited plan with approx segments and predicted_error 0 was installed
    under error_budget=1e-7, reporting 0, while its gradients were 3.8e-4 off."""
    case = _case("nanogpt")
    example = case.make_example(*PLANNED["nanogpt"])
    model = case.make_model()
    hand_made = _hand_made(model, example, case.loss_fn, "approx:bf16")
    assert hand_made.predicted_error == 0.0
    with pytest.raises(revckpt.InvalidArgumentError, match="measured a gradient error of"):
        revckpt.fit(model, example, memory_budget=1.0, error_budget=1e-7, loss_fn=case.loss_fn,
                    plan=hand_made)  # fmt: skip
    assert all(planned(b) is None for b in model.transformer.h)  # left as it was
    plan = revckpt.fit(
        model, example, memory_budget=1.0, error_budget=1e-1, loss_fn=case.loss_fn, plan=hand_made
    )
    assert 0.0 < plan.predicted_error <= 1e-1


@pytest.mark.parametrize("over", ["memory", "error"])
def test_verify_replaces_a_saved_plan_over_a_budget_by_measurement(over: str) -> None:
    case = _case("nanogpt")
    example = case.make_example(*PLANNED["nanogpt"])
    model = case.make_model()
    # over the memory budget: one block checkpointed keeps most of store-all's peak; over the
    # error budget (0): one block in bf16, under a budget store-all fits
    last, budget = ("checkpoint", 0.6) if over == "memory" else ("approx:bf16", 1.0)
    hand_made = _hand_made(model, example, case.loss_fn, last)
    if over == "memory":
        with pytest.raises(revckpt.InvalidArgumentError, match="verify=True"):
            revckpt.fit(model, example, memory_budget=budget, loss_fn=case.loss_fn, plan=hand_made)
    found = fit_verified(
        model, example, memory_budget=budget, loss_fn=case.loss_fn, plan=hand_made, rounds=3
    )
    row = found.report.row("hand-made")
    limit = found.plan.memory_budget_bytes
    if over == "memory":
        assert row.measured_peak_bytes > limit, found.report.table()
    else:
        assert row.gradient_error > 0 and "store-all" in found.report.names
    assert found.solved.name == "hand-made" and found.replaced, found.report.table()
    assert found.measured.name != "hand-made" and found.measured.gradient_error == 0
    assert found.plan.name == found.measured.name + " (verified)"
    assert found.plan.segments != hand_made.segments and "over the" in found.note
    _undominated(found, limit)
    assert _installed(model) == found.plan.strategies
    assert _measured_step(model, example, case.loss_fn) <= limit


def test_verify_keeps_a_saved_plan_only_when_it_measured_fastest() -> None:
    case = _case("nanogpt")
    example = case.make_example(*PLANNED["nanogpt"])
    model = case.make_model()
    hand_made = _hand_made(model, example, case.loss_fn, "checkpoint")
    found = fit_verified(
        model, example, memory_budget=1.0, loss_fn=case.loss_fn, plan=hand_made, rounds=3
    )
    # a generous budget: store-all and every block checkpointed fit, and are measured
    assert {"store-all", "hand-made", "checkpoint every block"} <= set(found.report.names)
    assert found.replaced == (found.measured.name != "hand-made")
    kept = found.plan.segments == hand_made.segments
    assert kept != found.replaced and _installed(model) == found.plan.strategies
    _undominated(found, found.plan.memory_budget_bytes)


def test_verify_bad_input_is_one_clear_error() -> None:
    case = _case("nanogpt")
    model = case.make_model()
    example = case.make_example(4, 32)
    with pytest.raises(revckpt.InvalidArgumentError, match="rounds=0"):
        fit_verified(model, example, memory_budget=0.5, rounds=0)
    with pytest.raises(revckpt.InvalidArgumentError, match="always verifies"):
        fit_verified(model, example, memory_budget=0.5, verify=True)


def test_fit_and_convert_price_and_run_compress() -> None:
    case = _case("nanogpt")
    model = case.make_model()
    example = case.make_example(*PLANNED["nanogpt"])
    plain = _measured_step(model, example, case.loss_fn)
    plan = revckpt.fit(
        model,
        example,
        memory_budget=0.8,
        error_budget=1e-2,
        loss_fn=case.loss_fn,
        strategies=["store", "checkpoint", "compress:bf16"],
    )
    assert set(plan.strategies) <= {"store", "checkpoint", "compress:bf16"}
    assert plan.predicted_error <= 1e-2
    assert _measured_step(model, example, case.loss_fn) <= plan.memory_budget_bytes
    revckpt.restore(model)
    revckpt.convert(model, "compress:bf16")
    assert _measured_step(model, example, case.loss_fn) < plain  # saved tensors halved
    revckpt.restore(model)


class _Recomputing(nn.Module):
    """Runs its blocks through torch's checkpoint: each block runs again in the backward."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
        return x.pow(2).mean()


class _FailsInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        raise RuntimeError("this backward is broken")


class _BrokenBackward(_Recomputing):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return _FailsInBackward.apply(x).pow(2).mean()


def test_the_trace_runs_the_forward_once_and_keeps_no_graph() -> None:
    # the trace sees the calls in a forward alone, then meters the whole step: blocks a
    # backward runs again, and a backward that fails, are still told apart from the forward
    x = torch.randn(4, 8)
    with pytest.raises(revckpt.InvalidArgumentError, match="exactly once per step"):
        revckpt.fit(_Recomputing(), x, memory_budget=0.5, blocks="layers")
    with pytest.raises(revckpt.InvalidArgumentError, match=r"cannot run the example.*broken"):
        revckpt.fit(_BrokenBackward(), x, memory_budget=0.5, blocks="layers")
    from revckpt.inplace.blocks import find_blocks
    from revckpt.inplace.fit import _recorder_slot
    from revckpt.inplace.install import Planned, install
    from revckpt.inplace.runners import runner_for
    from revckpt.inplace.trace import trace

    case = _case("gpt2")
    model, example = case.make_model(), case.make_example(2, 16)
    found = find_blocks(model, None)
    for fqn, block in found:
        install(block, Planned(fqn, "store", runner_for("store")))
    traced = trace(model, example, None, found, _recorder_slot(found))
    revckpt.restore(model)
    tensors = [
        t
        for c in traced.calls
        for t in torch.utils._pytree.tree_leaves((c.args, c.kwargs, c.output))
        if isinstance(t, torch.Tensor)
    ]
    assert tensors and all(t.grad_fn is None for t in tensors)  # no activation held by them
    assert traced.chained and all(c.input.requires_grad for c in traced.calls)
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("from_trace", [False, True])
def test_the_error_profile_reuses_the_chains_exact_gradients(from_trace: bool) -> None:
    # on a model whose blocks form a chain, each block's exact gradients come from the one
    # backward of the chain (the sensitivities): a block after the first two of its group
    # (the first is profiled, the second tells whether the group saves its input) runs once
    # there and once per codec, and its errors are those of its own exact run. As fit traces
    # (gradients=True), the sensitivities come from the traced forward's graph: the chain does
    # not run again, and the errors are the same
    from revckpt.inplace.blocks import find_blocks
    from revckpt.inplace.fit import _recorder_slot
    from revckpt.inplace.install import Planned, install
    from revckpt.inplace.measure import InSitu, profile_in_situ
    from revckpt.inplace.runners import runner_for
    from revckpt.inplace.trace import trace
    from revckpt.schedule.block_errors import error_fields
    from revckpt.schedule.sensitivities import sensitivities

    case = _case("nanogpt")
    model, example = case.make_model(), case.make_example(2, 16)
    found = find_blocks(model, None)
    for fqn, block in found:
        install(block, Planned(fqn, "store", runner_for("store")))
    traced = trace(model, example, case.loss_fn, found, _recorder_slot(found), gradients=from_trace)
    assert (traced.gradients is not None) == from_trace
    runs = [0] * len(found)
    hooks = [
        block.register_forward_pre_hook(lambda *_, i=i: runs.__setitem__(i, runs[i] + 1))
        for i, (_, block) in enumerate(found)
    ]
    codecs = ("bf16", "e4m3")
    try:
        # every block's errors run (error_stride=1), as this test compares each with its own
        profile = profile_in_situ(model, traced, codecs=codecs, policies=(), error_stride=1)
    finally:
        for h in hooks:
            h.remove()
        revckpt.restore(model)
    assert traced.chained and len(found) >= 3
    assert runs[2:] == [(not from_trace) + len(codecs)] * (len(found) - 2)
    units = [InSitu(c) for c in traced.calls]
    weights = sensitivities(units, traced.calls[0].input.detach(), {})
    for i in range(1, len(units)):
        cost = profile.blocks[i]
        own = error_fields(units[i], weights.inputs[i], cost.approx, {}, weights.cotangents[i], {})[
            "approx"
        ]
        for c in codecs:
            assert cost.approx[c].param_grad_error == pytest.approx(
                own[c].param_grad_error, rel=1e-4
            )
            assert cost.approx[c].input_grad_error == pytest.approx(
                own[c].input_grad_error, rel=1e-4
            )


class _SharedBody(nn.Module):
    """Two layers, each called twice (shared weights): one block, two calls."""

    def __init__(self, unused: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(3 if unused else 2))
        self.unused = unused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        calls = self.layers[:2] if self.unused else [*self.layers, *self.layers]
        for layer in calls:
            x = x + torch.tanh(layer(x))
        return x


class _TwoBodies(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = _SharedBody(), _SharedBody()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x)).pow(2).mean()


def test_blocks_called_twice_or_never_are_refused_with_the_cure_that_works() -> None:
    x = torch.randn(64, 16)
    with pytest.raises(revckpt.InvalidArgumentError, match="called at several places") as info:
        revckpt.fit(_TwoBodies(), x, memory_budget=0.6, blocks="a.layers")
    assert "a.layers.0 2 times" in str(info.value) and "fqn in" in str(info.value)
    model = _TwoBodies()  # the cure named: their parents, which run once
    plan = revckpt.fit(model, x, memory_budget=0.6, blocks=lambda m, fqn: fqn in ("a", "b"))
    assert len(plan.strategies) == 2
    with pytest.raises(revckpt.InvalidArgumentError, match=r"never ran layers\.2"):
        revckpt.fit(_SharedBody(unused=True), x, memory_budget=0.6, blocks="layers",
                    loss_fn=lambda out: out.pow(2).mean())  # fmt: skip


def test_the_chains_share_of_the_step_is_read_at_the_metered_steps_marks() -> None:
    from revckpt.inplace.trace import _chain_share

    # forward 1 -> 5 in the blocks, their backward 6 -> 9, of a 10 s step
    times = {"start": 0.0, "chain_start": 1.0, "chain_end": 5.0, "head_done": 6.0}
    assert _chain_share({**times, "chain_done": 9.0, "end": 10.0}) == pytest.approx(0.7)
    # nothing before the chain to backpropagate into: its backward ends with the step
    assert _chain_share({**times, "chain_done": 11.0, "end": 10.0}) == pytest.approx(0.8)
    case = _case("gpt2")  # and fit's profile carries it: a step with a head outside the blocks
    model, example = case.make_model(), case.make_example(2, 16)
    from revckpt.inplace.fit import _fit

    fitted = _fit(model, example, memory_budget=1.0, loss_fn=case.loss_fn, repeats=1)
    assert fitted.profile is not None and 0 < fitted.profile.step.chain_share < 1


@pytest.mark.parametrize(
    ("name", "where"), [("bert", "the head's own"), ("gpt2", "inside the blocks")]
)
def test_an_infeasible_budget_says_where_the_smallest_plan_peaks(name: str, where: str) -> None:
    # BERT's smallest plan peaks at its head (the logits and the loss), GPT-2's inside the
    # blocks (one block's re-run and backward): the message says which, with the bytes
    case = _case(name)
    example = case.make_example(*PLANNED[name])
    with pytest.raises(revckpt.InfeasibleBudgetError) as info:
        revckpt.fit(case.make_model(), example, memory_budget="20%", loss_fn=case.loss_fn)
    message = str(info.value)
    assert "by the cost model, that plan peaks" in message and where in message, message
    if name == "bert":
        assert "no block strategy lowers" in message and "a loss computed in chunks" in message


def test_a_chain_whose_input_needs_no_gradient_gets_its_weights_from_its_own_run() -> None:
    # the blocks take the data itself: the traced graph has no gradient for the chain input,
    # which the error model's weights count, so the profile runs the chain for them
    from revckpt.inplace.blocks import find_blocks
    from revckpt.inplace.fit import _recorder_slot
    from revckpt.inplace.install import Planned, install
    from revckpt.inplace.runners import runner_for
    from revckpt.inplace.trace import trace

    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(4)))
    x = torch.randn(32, 16)
    loss_fn = lambda out: out.pow(2).mean()  # noqa: E731
    found = find_blocks(model, None)
    for fqn, block in found:
        install(block, Planned(fqn, "store", runner_for("store")))
    try:
        traced = trace(model, x, loss_fn, found, _recorder_slot(found), gradients=True)
    finally:
        revckpt.restore(model)
    assert traced.chained and traced.gradients is None
    plan = revckpt.fit(model, x, memory_budget=0.9, error_budget=1e-2, loss_fn=loss_fn)
    assert plan.predicted_error <= 1e-2


def _relu_mlp(first_in_place: bool) -> nn.Sequential:
    """Six repeated blocks; each ends with (or, ``first_in_place``, starts with) an in-place
    ReLU."""

    def block() -> nn.Module:
        if first_in_place:
            return nn.Sequential(nn.ReLU(inplace=True), nn.Linear(64, 64))
        return nn.Sequential(nn.Linear(64, 64), nn.ReLU(inplace=True))

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), *[block() for _ in range(6)], nn.Linear(64, 1))


def test_a_block_that_changes_its_input_in_place_is_named():
    model = _relu_mlp(first_in_place=True)
    with pytest.raises(InvalidArgumentError, match=r"block 1 \(Sequential\) changes a tensor"):
        revckpt.fit(model, torch.randn(32, 64), memory_budget="90%", loss_fn=_mean)


def test_a_default_policy_no_block_can_run_with_is_left_out():
    """Linear then ReLU(inplace=True): the default 'matmul+attention' policy would keep the
    Linear's output, which the ReLU overwrites; fit plans without it and trains exactly."""
    model = _relu_mlp(first_in_place=False).double()
    x = torch.randn(512, 64, dtype=torch.float64)
    reference = copy.deepcopy(model)
    plan = revckpt.fit(model, x, memory_budget="80%", loss_fn=_mean)
    assert not any(s.startswith("selective") for s in plan.strategies)
    _mean(model(x)).backward()
    _mean(reference(x)).backward()
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-12)


def _mean(y: torch.Tensor) -> torch.Tensor:
    return y.square().mean()


def test_the_infeasible_message_names_no_negative_bytes():
    """The chain's input here is the example itself (made before the step): the step holds
    nothing outside the blocks, and the message used to say it held -64 KiB."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.Tanh()) for _ in range(6)])
    with pytest.raises(revckpt.InfeasibleBudgetError) as caught:
        revckpt.fit(model, torch.randn(64, 256), memory_budget="20%", loss_fn=_mean)
    assert "peaks inside the blocks: 0 B the step holds outside them" in str(caught.value)
    assert "-" not in str(caught.value).split("by the cost model")[1].split("(what")[0]


def test_fit_runs_the_codec_errors_of_every_error_stride_th_block(monkeypatch) -> None:
    """With an error budget, fit's profile runs the codec errors of every ``error_stride``-th
    block of a group and its last (``revckpt.schedule.error_samples``), the others
    interpolated; ``error_stride=1`` runs every block."""
    fit_module = importlib.import_module("revckpt.inplace.fit")
    measure = importlib.import_module("revckpt.inplace.measure")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 16), *[_Residual(16) for _ in range(9)], nn.Linear(16, 1))
    x = torch.randn(32, 3)
    ran = []
    original = measure.block_errors
    monkeypatch.setattr(
        measure, "block_errors", lambda unit, *a: ran.append(a[-2]) or original(unit, *a)
    )

    def errors(stride):
        ran.clear()
        fitted = fit_module._fit(model, x, memory_budget=0.8, error_budget=1e-2,
                                 loss_fn=lambda out: out.sum(), error_stride=stride)  # fmt: skip
        revckpt.restore(model)
        got = [(b.approx["bf16"].param_grad_error, b.approx["bf16"].perturbation)
               for b in fitted.profile.blocks]  # fmt: skip
        return got, list(ran)

    every, ran_every = errors(1)
    strided, ran_strided = errors(4)
    # the first block's errors come with its group's profile; then every block / 4 and 8
    assert ran_every == list(range(1, 9))
    assert ran_strided == [4, 8]
    for i, ((param, moved), (got, got_moved)) in enumerate(zip(every, strided, strict=True)):
        assert got_moved == moved
        assert got == (param if i in (0, 4, 8) else pytest.approx(param, rel=0.25)), i
    with pytest.raises(revckpt.InvalidArgumentError, match="error_stride"):
        revckpt.fit(model, x, memory_budget=0.8, loss_fn=lambda out: out.sum(), error_stride=0)


def _measured_row(name, peak, error, predicted):
    from revckpt.report import PlanMeasurement

    return PlanMeasurement(
        name=name,
        strategies=("approx:bf16",) if predicted else ("checkpoint",),
        measured_peak_bytes=peak,
        measured_retained_bytes=0,
        predicted_peak_bytes=peak,
        memory_budget_bytes=None,
        time_ratio=1.2,
        time_ratio_iqr=(1.2, 1.2),
        predicted_overhead=0.2,
        gradient_error=error,
        predicted_error=predicted,
    )


def test_verification_that_refuses_on_the_error_budget_says_so() -> None:
    from revckpt.inplace.verify import _none_fits

    rows = [
        _measured_row("store-all", 4000, 0.0, 0.0),
        _measured_row("checkpoint every block", 2000, 0.0, 0.0),
        _measured_row("optimal", 1500, 0.0116, 0.0067),  # a ReLU block read low (HF OPT)
    ]
    err = _none_fits(rows, 1750, 0.01)
    # the plan within the memory budget failed on its error: the message says that, and the
    # smallest budget an exact plan measured
    assert "over the error budget" in str(err) and "0.0116" in str(err) and "0.0067" in str(err)
    assert "Raise error_budget to at least 0.0116" in str(err)
    assert "plan=" not in str(err)
    assert err.smallest_budget_bytes == 2000
    err = _none_fits(rows, 1000, 0.01)  # nothing within the memory budget: the least peak
    assert "over the error budget" not in str(err)
    assert err.smallest_budget_bytes == 2000 and "'checkpoint every block'" in str(err)


def test_an_infeasible_fit_hands_back_the_plan_it_measured_at_the_smallest_budget(
    monkeypatch,
) -> None:
    # fit at the smallest budget named, with plan=err.plan, installs the least-peak plan the
    # failed fit measured there, without profiling the model again
    case = _case("gpt2")
    model, example = case.make_model(), case.make_example(*PLANNED["gpt2"])
    with pytest.raises(revckpt.InfeasibleBudgetError) as info:
        revckpt.fit(model, example, memory_budget="5%", loss_fn=case.loss_fn)
    err = info.value
    assert "plan=err.plan" in str(err)
    assert isinstance(err.plan, revckpt.schedule.Plan)
    assert err.plan.predicted_peak_bytes <= err.smallest_budget_bytes
    assert planned(model.transformer.h[0]) is None  # the failed fit left the model plain
    fit_module = importlib.import_module("revckpt.inplace.fit")

    def no_profile(*args, **kwargs):
        raise AssertionError("profiled again")

    monkeypatch.setattr(fit_module, "profile_in_situ", no_profile)
    plan = revckpt.fit(
        model, example, memory_budget=err.smallest_budget_bytes, plan=err.plan, loss_fn=case.loss_fn
    )
    assert plan.segments == err.plan.segments
    assert _measured_step(model, example, case.loss_fn) <= err.smallest_budget_bytes


def _opt() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """An HF OPT (ReLU feed-forward; 4 layers, width 64, random weights) and a batch: the error
    model reads an approx:bf16 block of it low (benchmarks/bench_error_hf.py)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.OPTConfig(
        vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, ffn_dim=128,
        max_position_embeddings=32, word_embed_proj_dim=64, dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, layerdrop=0.0, use_cache=False,
    )  # fmt: skip
    model = transformers.OPTForCausalLM(config).train()
    ids = torch.randint(0, 256, (4, 32))
    return model, {"input_ids": ids, "labels": ids}


def test_an_approx_plan_measured_over_the_error_budget_is_solved_again_within_it() -> None:
    # OPT's ReLU blocks: the error model put approx:bf16 on one block at 6.7e-3, which measured
    # 1.2e-2 in the check step; fit plans again for a smaller predicted error, and what it
    # installs measures within the budget (in the planned blocks' gradients: the budget's figure)
    model, batch = _opt()
    plain = copy.deepcopy(model)
    options = dict(error_budget=1e-2, loss_fn=lambda out: out.loss)
    try:
        plan = revckpt.fit(model, batch, memory_budget=0.65, **options)
    except revckpt.InfeasibleBudgetError as err:
        plan = revckpt.fit(model, batch, memory_budget=err.smallest_budget_bytes, **options)
    assert plan.predicted_error <= 1e-2
    for m in (model, plain):
        for p in m.parameters():
            p.grad = None
        m(**batch).loss.backward()
    layers = [n for n, _ in plain.named_parameters() if ".layers." in n]
    got, want = dict(model.named_parameters()), dict(plain.named_parameters())
    num = sum(float((got[n].grad - want[n].grad).double().norm() ** 2) for n in layers)
    den = sum(float(want[n].grad.double().norm() ** 2) for n in layers)
    assert math.sqrt(num / den) <= plan.predicted_error * (1 + 1e-6) + 1e-12


def test_a_fit_held_to_the_error_budget_says_why_where_no_plan_is_left() -> None:
    # with store and approx:bf16 alone, no approx plan of OPT measures within 1e-2 at this
    # budget: the infeasible budget's message says the plans' measured errors held them down,
    # and the plan it hands back measured within the error budget
    model, batch = _opt()
    with pytest.raises(revckpt.InfeasibleBudgetError) as info:
        revckpt.fit(model, batch, memory_budget=0.65, error_budget=1e-2,
                    strategies=["store", "approx:bf16"], loss_fn=lambda out: out.loss)  # fmt: skip
    err = info.value
    assert "measured a gradient error of up to" in str(err), str(err)
    # the cures of the search held below the budget name error budgets the caller never set
    assert "raise error_budget" not in str(err) and "approx boundaries:" not in str(err)
    assert not any("error" in fix for fix in err.fixes)
    assert err.plan is not None and err.plan.predicted_error <= 1e-2
    assert err.plan.error_budget == 1e-2  # the caller's, not the tighter one searched at


def test_within_error_solves_again_for_a_smaller_predicted_error() -> None:
    from revckpt.inplace.confirm import _within_error

    def plans(*errors: float):
        asked: list[float] = []
        queue = list(errors)

        def within(error_budget: float) -> types.SimpleNamespace:
            asked.append(error_budget)
            return types.SimpleNamespace(predicted_error=queue.pop(0))

        return within, asked

    within, asked = plans(2e-2, 5e-3)  # measured twice the budget, then within it
    assert _within_error(within, 1e-2).predicted_error == 5e-3
    assert asked == pytest.approx([1e-2, 5e-3])
    within, asked = plans(1.1e-2, 1.05e-2, 1.2e-2, 1.01e-2, 0.0)  # never within: exact at last
    assert _within_error(within, 1e-2).predicted_error == 0.0
    assert asked[-1] == 0.0 and len(asked) == 5
    assert all(b < a for a, b in itertools.pairwise(asked[:-1]))  # each tighter (by 0.9 at least)
    within, asked = plans(0.0)  # an exact plan: as it is
    assert _within_error(within, 1e-2).predicted_error == 0.0 and asked == [1e-2]
    # the error model put the first plan at 6e-3, measured 2e-2: below what the model said of
    # it, in the ratio measured, so that the next solve leaves that plan out
    within, asked = plans(2e-2, 1e-3)
    assert _within_error(within, 1e-2, modelled=lambda plan: 6e-3).predicted_error == 1e-3
    assert asked == pytest.approx([1e-2, 3e-3])


def test_an_infeasible_budget_after_a_tightening_names_the_least_peak_measured_within() -> None:
    # the error model reads plans of a predicted error above 6e-3 three times low (kinks): the
    # least-peak plan at 1e-2 measures 3e-2, the tightening to 3.3e-3 steps past plans of a
    # smaller peak that measure within 1e-2; the budget named is one of those, not 3.3e-3's
    from revckpt.inplace.confirm import _within_error

    asked: list[float] = []

    def within(error_budget: float) -> types.SimpleNamespace:
        asked.append(error_budget)
        measured = error_budget * (3 if error_budget > 6e-3 else 1)
        peak = round(100_000 - 5_000_000 * error_budget)  # a larger error budget: a lower peak
        err = revckpt.InfeasibleBudgetError("no plan fits", smallest_budget_bytes=peak)
        err.plan = types.SimpleNamespace(predicted_error=measured, predicted_peak_bytes=peak)
        raise err

    with pytest.raises(revckpt.InfeasibleBudgetError) as info:
        _within_error(within, 1e-2)
    tightened = round(100_000 - 5_000_000 * 1e-2 / 3)
    named = info.value.smallest_budget_bytes
    assert named < tightened, (named, tightened, asked)
    assert info.value.plan.predicted_error <= 1e-2
    assert named == min(
        round(100_000 - 5_000_000 * e) for e in asked if e * (3 if e > 6e-3 else 1) <= 1e-2
    )
    assert "measured a gradient error of up to 0.03" in str(info.value)

    # a plan between them that fits the memory budget is returned
    def fits_between(error_budget: float) -> types.SimpleNamespace:
        measured = error_budget * (3 if error_budget > 6e-3 else 1)
        if 4e-3 < error_budget <= 6e-3:
            return types.SimpleNamespace(predicted_error=measured)
        err = revckpt.InfeasibleBudgetError("no plan fits", smallest_budget_bytes=1)
        err.plan = types.SimpleNamespace(predicted_error=measured)
        raise err

    assert 4e-3 < _within_error(fits_between, 1e-2).predicted_error <= 6e-3


def test_a_plan_solved_again_for_a_tighter_error_says_the_callers_budget() -> None:
    from revckpt.inplace.confirm import _within_error
    from revckpt.models import mlp_chain
    from revckpt.schedule import baseline, profile

    store = baseline(profile(mlp_chain(2, 8), torch.randn(4, 8), codecs=(), repeats=1), "store")
    queue = [2e-2, 5e-3]

    def within(error_budget: float) -> Plan:
        return dataclasses.replace(store, error_budget=error_budget, predicted_error=queue.pop(0))

    plan = _within_error(within, 1e-2)
    assert plan.predicted_error == 5e-3 and plan.error_budget == 1e-2


def test_the_error_check_draws_the_reference_steps_dropout_masks() -> None:
    # with dropout, the check step and the store-all step it is compared with run from one
    # seed: an approx plan's measured error is the codec's, not two draws of the masks (which
    # would read O(1) and leave only exact plans); the caller's generator is left as it was
    torch.manual_seed(0)
    model = zoo.GPT(zoo.GPTConfig(dropout=0.1)).train()
    example = zoo.CASES["nanogpt"].make_example(*PLANNED["nanogpt"])
    state = torch.get_rng_state()
    plan = revckpt.fit(
        model, example, memory_budget=0.6, error_budget=2e-2,
        strategies=["store", "approx:bf16"], loss_fn=lambda out: out[1],
    )  # fmt: skip
    assert torch.equal(torch.get_rng_state(), state)
    assert any(s.strategy == "approx:bf16" for s in plan.segments), plan.segments
    assert 0 < plan.predicted_error <= 2e-2


def test_verify_measures_the_error_budgets_figure_as_fits_check_does() -> None:
    # the planned blocks' parameter gradients against store-all's, from one seed: a hand-made
    # plan with one bf16 block reads in verify what a plain copy's step says of those blocks
    # (all the parameters, as before, read lower: the head and embedding are exact under approx)
    case = _case("nanogpt")
    example = case.make_example(*PLANNED["nanogpt"])
    model = case.make_model()
    plain = copy.deepcopy(model)
    hand_made = _hand_made(model, example, case.loss_fn, "approx:bf16")
    found = fit_verified(
        model, example, memory_budget=1.0, error_budget=1.0, loss_fn=case.loss_fn,
        plan=hand_made, rounds=1,
    )  # fmt: skip
    measured = found.report.row("hand-made").gradient_error
    revckpt.fit(
        model, example, memory_budget=1.0, error_budget=1.0, loss_fn=case.loss_fn, plan=hand_made
    )
    for m in (model, plain):
        _measured_step(m, example, case.loss_fn)
    blocks = [n for n, _ in plain.named_parameters() if n.startswith("transformer.h.")]
    got, want = dict(model.named_parameters()), dict(plain.named_parameters())
    num = sum(float((got[n].grad - want[n].grad).double().norm() ** 2) for n in blocks)
    den = sum(float(want[n].grad.double().norm() ** 2) for n in blocks)
    assert measured == pytest.approx(math.sqrt(num / den), rel=1e-6)


class _MaskedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(32, 32)

    def forward(self, h: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        out = self.fc(h)
        return h + (out if mask is None else out * mask)


class _MaskedModel(nn.Module):
    """Passes its blocks a mask only when some entry is padding, as Hugging Face does."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_MaskedBlock() for _ in range(3))

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        mask = None if bool(pad.all()) else pad.unsqueeze(-1).to(x.dtype)
        for block in self.blocks:
            x = block(x, mask=mask)
        return x.sum()


def test_a_tensor_argument_the_example_did_not_have_warns() -> None:
    """Fitted on a batch without padding (no mask given to the blocks), a padded batch of the
    same shape passed a mask the plan did not price: a Hugging Face Llama's step then measured
    1.12x its budget, silently."""
    torch.manual_seed(0)
    x, full = torch.randn(4, 16, 32), torch.ones(4, 16, dtype=torch.bool)
    padded = full.clone()
    padded[0, :5] = False
    for saved in (False, True):
        model = _MaskedModel()
        plan = revckpt.fit(model, (x, full), memory_budget=1.0, loss_fn=lambda out: out)
        if saved:
            assert plan.block_tensors == ((0,), (0,), (0,))
            revckpt.fit(model, (x, full), memory_budget=1.0, loss_fn=lambda o: o, plan=plan)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            model(x, full).backward()  # as fit's example: no warning
        with pytest.warns(revckpt.PlanWarning, match="keyword 'mask', which the example"):
            model(x, padded).backward()  # each fit warns (not once per process)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            model(x, padded).backward()  # and once
    model = _MaskedModel()
    revckpt.fit(model, (x, padded), memory_budget=1.0, loss_fn=lambda out: out)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(x, padded).backward()  # fitted on a padded example: priced, no warning
        model(x, full).backward()


def test_a_scalar_tensor_argument_the_example_did_not_have_does_not_warn() -> None:
    # Trainer passes num_items_in_batch (a 0-dim tensor) through the model to its layers: the
    # warning's advice (fit on a padded batch) could not silence it, and it costs nothing
    torch.manual_seed(0)
    x, full = torch.randn(4, 16, 32), torch.ones(4, 16, dtype=torch.bool)
    model = _MaskedModel()
    revckpt.fit(model, (x, full), memory_budget=1.0, loss_fn=lambda out: out)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        h = x
        for block in model.blocks:
            h = block(h, mask=torch.tensor(1.0))  # a 0-dim tensor the trace did not see
        h.sum().backward()


class _MoELayer(nn.Module):
    """A hand-written mixture of experts: a ModuleList of experts, each run on its tokens."""

    def __init__(self, d: int = 32, experts: int = 4) -> None:
        super().__init__()
        self.ln, self.router = nn.LayerNorm(d), nn.Linear(d, experts)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
            for _ in range(experts)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln(x)
        probs = self.router(h).softmax(-1)
        top = probs.argmax(-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            chosen = top == e
            if chosen.any():
                out[chosen] = expert(h[chosen]) * probs[chosen][:, e : e + 1]
        return x + out


class _MoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(64, 32), nn.Linear(32, 64)
        self.blocks = nn.ModuleList(_MoELayer() for _ in range(3))

    def forward(self, idx: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), target.flatten())


def test_a_layers_experts_are_not_planned_as_blocks_but_the_layers(tmp_path) -> None:
    """12 experts outnumber 3 layers, and the default rule picked them; each gets the tokens
    routed to it, so the next step on the very same batch was refused ("planned for hidden
    states of shape [30, 32] ... got [34, 32]"). Experts do not chain: fit plans the layers."""
    torch.manual_seed(0)
    model = _MoE().double()
    plain = copy.deepcopy(model)
    data = torch.randint(0, 64, (4, 17))
    batch = (data[:, :-1], data[:, 1:])
    plan = revckpt.fit(model, batch, memory_budget=1.0)
    assert plan.block_names == ("blocks.0", "blocks.1", "blocks.2")
    path = tmp_path / "plan.json"
    plan.to_json(path)
    again = copy.deepcopy(plain)
    revckpt.fit(again, batch, memory_budget=1.0, plan=path)  # by the plan's block names
    for m in (model, again, plain):
        for _ in range(2):
            m(*batch).backward()
    for a, b, c in zip(model.parameters(), again.parameters(), plain.parameters(), strict=True):
        assert torch.equal(a.grad, c.grad) and torch.equal(b.grad, c.grad)
    unused = copy.deepcopy(plain)
    with torch.no_grad():
        for layer in unused.blocks:
            layer.router.bias[3] = -100.0  # no token for expert 3: it never runs
    plan = revckpt.fit(unused, batch, memory_budget=1.0)  # refused ("never ran") before
    assert plan.block_names == ("blocks.0", "blocks.1", "blocks.2")


class _StagedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


class _Stage(nn.Module):
    def __init__(self, residual_outside: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_StagedBlock() for _ in range(3))
        self.down = nn.Linear(16, 16)
        self.residual_outside = residual_outside

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x) if self.residual_outside else block(x)
        return self.down(x)


def test_blocks_that_chain_inside_repeated_stages_are_planned_not_the_stages() -> None:
    """Swin, ConvNeXt: blocks inside stages that repeat. The experts rule (blocks that do not
    chain: plan the layers around them) read the calls after they were detached, where no
    block chains, and planned the 2 stages (the smallest budget 54.6% of store-all, against
    31.9% with the 6 blocks)."""
    for residual_outside in (False, True):  # x = x + block(x): made from the output, too
        model = nn.Sequential(_Stage(residual_outside), _Stage(residual_outside))
        plan = revckpt.fit(model, torch.randn(8, 16), memory_budget=1.0, loss_fn=lambda y: y.sum())
        assert len(plan.block_names) == 6 and plan.block_names[0] == "0.blocks.0"


def _bart() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    from transformers import BartConfig, BartForConditionalGeneration

    torch.manual_seed(0)
    config = BartConfig(
        vocab_size=256, d_model=64, encoder_layers=3, decoder_layers=3,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
        decoder_ffn_dim=128, max_position_embeddings=128, use_cache=False,
    )  # fmt: skip
    ids = torch.randint(3, 256, (4, 64), generator=torch.Generator().manual_seed(1))
    return BartForConditionalGeneration(config), {"input_ids": ids, "labels": ids}


def test_an_encoder_decoders_encoder_and_decoder_layers_are_both_planned() -> None:
    """BART, Whisper, Marian: the encoder's and the decoder's layers are two classes. Only the
    decoder's (more parameters per layer) were planned, and checkpointed by convert (HF's
    gradient checkpointing does both): fit named 65% of store-all the smallest budget, where
    both stacks planned reach 38%."""
    from revckpt.inplace.blocks import find_blocks

    model, batch = _bart()
    stacks = ("model.encoder.layers", "model.decoder.layers")
    names = [f"{stack}.{i}" for stack in stacks for i in range(3)]
    assert [fqn for fqn, _ in find_blocks(model)] == names
    plan = revckpt.fit(model, batch, memory_budget=0.5)
    assert list(plan.block_names) == names
    with MemoryMeter() as meter:
        model(**batch).loss.backward()
    assert meter.peak_bytes <= plan.memory_budget_bytes
    revckpt.restore(model)
    revckpt.convert(model, "checkpoint")
    assert all(planned(model.get_submodule(fqn)) is not None for fqn in names)
    revckpt.restore(model)
    model.model.encoder.layerdrop = 0.9  # a review: the fallback to one class hid LayerDrop
    with pytest.raises(revckpt.InvalidArgumentError, match="LayerDrop"):
        revckpt.fit(model, batch, memory_budget=0.5)
    model.model.encoder.layerdrop = 0.0
    # one reversible stack: the first class's (the decoder's), as before
    assert [fqn for fqn, _ in find_blocks(model, one_class=True)] == names[3:]


class _FrozenTrunkLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from revckpt.models import transformer_chain

        self.emb = nn.Embedding(64, 32)
        self.blocks = transformer_chain(6, 32, heads=2)
        self.head = nn.Linear(32, 64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for block in self.blocks:
            h = block(h)
        return F.cross_entropy(self.head(h).flatten(0, 1), ids.flatten())


def test_frozen_blocks_off_the_backwards_path_are_not_planned() -> None:
    """The embedding and the first blocks frozen (partial fine-tuning): autograd records
    nothing in those blocks, yet each was priced as a trainable block's (a leaf input that
    requires grad): fit checkpointed them for savings they do not make, predicting 1.86x the
    peak its plan measured. They are left out; the plan's prediction is its measurement."""
    torch.manual_seed(0)
    model = _FrozenTrunkLM()
    model.emb.requires_grad_(False)
    model.blocks[:3].requires_grad_(False)
    ids = torch.randint(0, 64, (4, 64), generator=torch.Generator().manual_seed(1))
    plan = revckpt.fit(model, ids, memory_budget=0.6)
    assert list(plan.block_names) == [f"blocks.{i}" for i in range(3, 6)]
    with MemoryMeter() as meter:
        model(ids).backward()
    assert meter.peak_bytes <= plan.memory_budget_bytes
    assert plan.predicted_peak_bytes <= 1.05 * meter.peak_bytes, (plan, meter.peak_bytes)
    # unfrozen after a warm-up: they keep activations the budget never counted (2.2x over,
    # silently, in a review's model): refused, saying to fit again
    model.blocks[0].requires_grad_(True)
    with pytest.raises(InvalidArgumentError, match=r"left out of revckpt\.fit's plan"):
        model(ids).backward()
    model.blocks[0].requires_grad_(False)
    # the same from the plan saved and applied again (a review: no guard there)
    assert plan.left_out == ("blocks.0", "blocks.1", "blocks.2")
    saved = Plan.from_json(plan.to_json())
    for verify in (False, True):  # (verify=True installed no guard: a second review)
        revckpt.restore(model)
        revckpt.fit(model, ids, memory_budget=0.6, plan=saved, verify=verify)
        model.blocks[0].requires_grad_(True)
        with pytest.raises(InvalidArgumentError, match=r"left out of revckpt\.fit's plan"):
            model(ids).backward()
        model.blocks[0].requires_grad_(False)
    with pytest.raises(InvalidArgumentError, match="planned or left out"):
        dataclasses.replace(plan, left_out=("blocks.3",))
    revckpt.restore(model)
    model.blocks.requires_grad_(False)  # a linear probe: no block is on the path
    with pytest.raises(InvalidArgumentError, match="reaches none of the blocks"):
        revckpt.fit(model, ids, memory_budget=0.6)
    assert all(planned(b) is None for b in model.blocks)


class _Interleaved(nn.Module):
    """Two lists of layers of two classes called in turn (diffusers' ``zip(resnets,
    attentions)``), the attentions listed first."""

    def __init__(self, n: int = 3) -> None:
        super().__init__()
        self.attentions = nn.ModuleList(_DenseLayer() for _ in range(n))
        self.resnets = nn.ModuleList(
            nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)) for _ in range(n)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for resnet, attention in zip(self.resnets, self.attentions, strict=True):
            x = attention(x + resnet(x))
        return x.square().mean()


class _DenseLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(32), nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(self.norm(x))


class _DenseThenExperts(nn.Module):
    """A stack of dense layers, then a stack of mixture-of-experts layers."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.enc = nn.ModuleList(_DenseLayer() for _ in range(2))
        self.dec = nn.ModuleList(_MoELayer() for _ in range(3))
        self.head = nn.Linear(32, 64)

    def forward(self, idx: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for layer in [*self.enc, *self.dec]:
            x = layer(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), tgt.flatten())


def test_several_classes_of_blocks_fall_back_where_the_step_refuses_them() -> None:
    """A review of the rule taking every class of layers: interleaved lists ran in another
    order than their modules' (refused, where the larger class alone was planned before);
    a dense stack beside experts outvoted the experts' links, and the experts were planned
    (a plan the next batch broke)."""
    torch.manual_seed(0)
    model = _Interleaved()
    reference = copy.deepcopy(model)
    x = torch.randn(4, 16, 32)
    with pytest.warns(revckpt.PlanWarning, match="blocks of one class and not"):
        plan = revckpt.fit(model, x, memory_budget=1.0, loss_fn=lambda out: out)
    assert len(set(plan.block_names)) == 3, plan.block_names  # one class
    model(x).backward()
    reference(x).backward()
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)
    torch.manual_seed(0)
    model = _DenseThenExperts().double()
    data = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(1))
    plan = revckpt.fit(model, (data[:, :-1], data[:, 1:]), memory_budget=1.0)
    assert list(plan.block_names) == ["enc.0", "enc.1", "dec.0", "dec.1", "dec.2"]
    # the second class's list run in a loop (a second review: CallCountError, where the
    # first class alone was planned before)
    torch.manual_seed(0)
    model = _Interleaved()
    model.forward = lambda x: _looped(model, x)  # type: ignore[method-assign]
    with pytest.warns(revckpt.PlanWarning, match="blocks of one class and not"):
        plan = revckpt.fit(model, x, memory_budget=1.0, loss_fn=lambda out: out)
    assert len(plan.block_names) == 3


def _looped(model: _Interleaved, x: torch.Tensor) -> torch.Tensor:
    for resnet in model.resnets:  # (the first class: more parameters per block)
        x = x + resnet(x)
    for _ in range(2):
        for attention in model.attentions:
            x = attention(x)
    return x.square().mean()


def test_a_left_out_block_with_a_trainable_parameter_it_does_not_use_trains() -> None:
    """A review: the guard on blocks left out of the plan read their parameters' flags, and
    refused the next step of a frozen block holding a trainable parameter it did not use (an
    expert routed nothing, an adapter switched off); it reads what the block returns now."""
    torch.manual_seed(0)
    model = _FrozenTrunkLM()
    model.emb.requires_grad_(False)
    model.blocks[:3].requires_grad_(False)
    model.blocks[0].unused = nn.Linear(32, 32)  # trainable, never called
    ids = torch.randint(0, 64, (4, 64), generator=torch.Generator().manual_seed(1))
    plan = revckpt.fit(model, ids, memory_budget=0.8)
    assert "blocks.0" not in plan.block_names
    model(ids).backward()


def test_a_lossy_plans_error_is_measured_on_the_model_where_no_block_parameter_trains() -> None:
    """Prompt tuning (blocks frozen under a trainable embedding): the error budget's figure,
    the planned blocks' parameter gradients, had nothing to measure; a saved lossy plan was
    refused (a review), then trusted (the next: 5.7e-3 where it said 0, under 1e-6). It is
    measured on the model's trainable parameters there, by fit's check step too."""

    def build() -> nn.Module:
        torch.manual_seed(0)
        model = _FrozenTrunkLM()
        model.blocks.requires_grad_(False)
        model.head.requires_grad_(False)
        return model

    ids = torch.randint(0, 64, (4, 64), generator=torch.Generator().manual_seed(1))
    exact = revckpt.fit(build(), ids, memory_budget=1.0)
    lossy = dataclasses.replace(
        exact, segments=(Segment(0, 1, "approx:e4m3"), Segment(1, exact.length, "store"))
    )
    assert lossy.predicted_error == 0.0
    with pytest.raises(InvalidArgumentError, match="measured a gradient error of"):
        revckpt.fit(build(), ids, memory_budget=1.0, error_budget=1e-6, plan=lossy)
    plan = revckpt.fit(build(), ids, memory_budget=1.0, error_budget=5e-2, plan=lossy)
    assert plan.strategies[0] == "approx:e4m3" and 0.0 < plan.predicted_error <= 5e-2


@dataclasses.dataclass
class _Carried:
    hidden: torch.Tensor


class _DataclassBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(32, 32)

    def forward(self, h: torch.Tensor) -> _Carried:
        return _Carried(h + torch.tanh(self.fc(h)))


def test_blocks_returning_a_dataclass_are_on_the_backwards_path() -> None:
    """A review: the trace read a plain dataclass output as one leaf, so every block was
    'off the backward's path' and fit refused."""

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(_DataclassBlock() for _ in range(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = block(x).hidden
            return x.square().mean()

    torch.manual_seed(0)
    model = Model()
    model.blocks[0].requires_grad_(False)
    plan = revckpt.fit(model, torch.randn(8, 32), memory_budget=1.0, loss_fn=lambda out: out)
    assert plan.block_names == ("blocks.1", "blocks.2", "blocks.3")


def test_fit_refuses_lazy_buffers_not_initialised_with_the_way_out() -> None:
    """LazyBatchNorm1d(affine=False): fit's steps put the model's state back, and a buffer
    without a shape raised torch's raw ValueError there."""
    model = nn.Sequential(
        *(nn.Sequential(nn.Linear(8, 8), nn.LazyBatchNorm1d(affine=False)) for _ in "abc")
    )
    with pytest.raises(InvalidArgumentError, match="not initialised yet"):
        revckpt.fit(model, torch.randn(16, 8), memory_budget=1.0, loss_fn=lambda y: y.sum())
    with torch.no_grad():
        model(torch.randn(16, 8))
    revckpt.fit(model, torch.randn(16, 8), memory_budget=1.0, loss_fn=lambda y: y.sum())


class _TupleStateBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, state):
        return (state[0] + torch.tanh(self.fc(state[0])),)


class _TupleStateModel(nn.Module):
    """Blocks that take and return their hidden state inside a tuple."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_TupleStateBlock() for _ in range(3))

    def forward(self, x):
        state = (x,)
        for block in self.blocks:
            state = block(state)
        return state[0].pow(2).sum()


def test_a_block_whose_hidden_state_revckpt_cannot_find_is_said_not_saved_silently():
    """A hidden state inside a tuple (or a keyword of another name): convert reported the
    blocks converted and ran them plainly, saving nothing, without a word; fit said they
    never ran and pointed to convert."""
    model = _TupleStateModel()
    x = torch.randn(4, 16, requires_grad=True)
    revckpt.convert(model, "checkpoint")
    with pytest.warns(revckpt.PlanWarning, match=r"block blocks\.0 .* got tuple.* saves nothing"):
        model(x).backward()
    other = _TupleStateModel()
    with pytest.raises(InvalidArgumentError, match=r"blocks\.0 .* fit cannot plan it"):
        revckpt.fit(other, (x,), memory_budget="50%", loss_fn=lambda out: out)
    assert all(planned(block) is None for block in other.blocks)  # left plain


def test_a_saved_plan_is_never_predicted_below_its_own_check(tmp_path) -> None:
    """fit(plan=path) on a batch with padding (its attention mask costs a little more): the
    plan came back predicting less than the check step it had just measured."""
    pytest.importorskip("transformers")
    from revckpt.inplace.step import measure_step

    ids = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(1))
    path = tmp_path / "plan.json"
    revckpt.fit(_gpt2(4), dict(input_ids=ids, labels=ids), memory_budget="70%").to_json(path)
    mask = torch.ones_like(ids)
    mask[:, 20:] = 0
    padded = dict(input_ids=ids, attention_mask=mask, labels=ids)
    model = _gpt2(4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = revckpt.fit(model, padded, memory_budget="70%", plan=path)
        measured = measure_step(model, padded, None)
    assert measured <= plan.predicted_peak_bytes


class _WithHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(64, 512), nn.Tanh(), nn.Linear(512, 64)) for _ in range(4)
        )
        self.head = nn.Linear(64, 128)

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        logits = self.head(x)
        return logits, logits.square().mean()


def test_the_infeasible_message_counts_what_the_step_holds_in_the_blocks_backward():
    """Peaking in the blocks' backward, the message said the step held 0 B outside them: the
    model's output, held across their backward, was counted as the blocks' own (a trial's
    nanoGPT: 512 KiB of logits among '3.84 MiB of theirs')."""
    torch.manual_seed(0)
    with pytest.raises(revckpt.InfeasibleBudgetError) as caught:
        revckpt.fit(_WithHead(), torch.randn(512, 64), memory_budget="5%", loss_fn=lambda o: o[1])
    held = str(caught.value).split("peaks inside the blocks: ")[1].split(" the step holds")[0]
    assert held != "0 B"


class _Routed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.router = nn.Linear(32, 32), nn.Linear(32, 4)

    def forward(self, x):
        return x + torch.tanh(self.fc(x)) * self.router(x).softmax(-1)[..., :1]


class _RouterLossModel(nn.Module):
    """Router logits collected by forward hooks into an auxiliary loss, as Hugging Face's
    mixture-of-experts models do with ``output_router_logits=True``."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Routed() for _ in range(4))
        for block in self.blocks:
            block.router.register_forward_hook(_record_output)

    def forward(self, x):
        aux = 0.0
        for block in self.blocks:
            x = block(x)
            aux = aux + block.router.__dict__.pop("recorded").square().mean()
        return x.square().mean() + aux


def _record_output(module: nn.Module, inputs: object, output: torch.Tensor) -> None:
    module.__dict__["recorded"] = output  # (a recompute records again: the last one is read)


def test_fit_with_an_error_budget_plans_around_a_side_output_the_loss_uses():
    """approx keeps nothing of a block's first forward: fit's check step raised a raw
    RevckptError from the backward (Mixtral with output_router_logits=True under
    error_budget=); it plans again without approx, saying so (here only 'store' is left, which
    does not fit: the budget's own error)."""
    torch.manual_seed(0)
    model = _RouterLossModel().double()
    x = torch.randn(4096, 32, dtype=torch.float64)
    with (
        pytest.warns(revckpt.PlanWarning, match="side output") as said,
        pytest.raises(revckpt.InfeasibleBudgetError),
    ):
        revckpt.fit(
            model, x, memory_budget="90%", error_budget=5e-2, loss_fn=lambda o: o,
            strategies=["store", "approx:bf16"],
        )  # fmt: skip
    # the warning names the caller's line, not one inside revckpt
    assert {w.filename for w in said if "side output" in str(w.message)} == {__file__}
    reference = copy.deepcopy(model)
    revckpt.fit(model, x, memory_budget="90%", error_budget=5e-2, loss_fn=lambda o: o)
    model(x).backward()
    reference(x).backward()
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-12)


class _TwoTowers(nn.Module):
    """Two stacks of the same layer class, the second run first (Hugging Face's CLIP runs its
    vision tower before its text tower)."""

    def __init__(self) -> None:
        super().__init__()
        self.text = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))
        self.vision = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))

    def forward(self, x):
        v, t = x, x
        for layer in self.vision:
            v = torch.tanh(layer(v))
        for layer in self.text:
            t = torch.tanh(layer(t))
        return (v * t).sum()


def test_blocks_out_of_module_order_are_refused_naming_a_way_out():
    with pytest.raises(InvalidArgumentError, match=r"blocks='vision'"):
        revckpt.fit(_TwoTowers(), torch.randn(8, 16), memory_budget="90%", loss_fn=lambda o: o)
    plan = revckpt.fit(_TwoTowers(), torch.randn(8, 16), memory_budget=1.0,
                       loss_fn=lambda o: o, blocks="vision")  # fmt: skip
    assert plan.segments


def test_fit_verify_leaves_out_the_recipes_fit_left_out():
    """verify=True measured 'approx on every block' although fit had just planned without
    approx (the loss uses a side output): the recipe raised SideOutputError (a review's
    repro)."""
    torch.manual_seed(0)
    model = _RouterLossModel().double()
    x = torch.randn(4096, 32, dtype=torch.float64)
    with warnings.catch_warnings():
        # (whether fit's own choice tried approx, and so warned of the side output, depends
        # on the measured times: under load it picked an exact plan, and pytest.warns failed)
        warnings.simplefilter("ignore", revckpt.PlanWarning)
        plan = revckpt.fit(model, x, memory_budget="90%", error_budget=5e-2,
                           loss_fn=lambda o: o, verify=True)  # fmt: skip
    assert not any(s.startswith("approx") for s in plan.strategies)
    # store-all fits: fit's plan is exact and its check step never runs approx, so fit
    # keeps approx among its strategies; the recipe 'approx on every block' raised
    # SideOutputError out of verify (a flaky failure of the lines above, where the time
    # model picked an exact plan under load)
    found = fit_verified(
        model, x, memory_budget=1.0, error_budget=5e-2, loss_fn=lambda o: o, rounds=1
    )
    assert not any("approx" in row.name for row in found.report.rows), found.report.table()


class _CrossAttending(nn.Module):
    """Blocks that attend to a memory tensor passed beside the hidden state (a decoder's
    encoder output): what each keeps grows with the memory's length."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.TransformerDecoderLayer(d, 4, 64, dropout=0.0, batch_first=True) for _ in range(3)
        )

    def forward(self, x: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, memory)
        return x


def test_a_longer_tensor_beside_the_hidden_state_is_refused_as_a_longer_hidden_state(tmp_path):
    """The plan's shape check read the hidden state only: a decoder fitted on an encoder
    output of length 32 ran one of length 512 at 1.67x the budget, silently (GPT-2 with
    cross-attention; a frozen BART encoder's longer source: 1.97x). Every tensor argument's
    shape is in the plan now (saved with it), and a larger one is refused; an unbatched
    input is said to be one."""
    torch.manual_seed(0)
    model = _CrossAttending()
    x, memory = torch.randn(4, 16, 32), torch.randn(4, 32, 32)

    def loss_fn(y: torch.Tensor) -> torch.Tensor:
        return y.square().mean()

    plan = revckpt.fit(model, (x, memory), memory_budget=0.6, loss_fn=loss_fn)
    assert plan.block_tensor_shapes == (((4, 16, 32), (4, 32, 32)),) * 3
    path = tmp_path / "plan.json"
    plan.to_json(path)
    assert Plan.from_json(path.read_text()).block_tensor_shapes == plan.block_tensor_shapes
    loss_fn(model(x, memory[:, :8])).backward()  # shorter: runs
    with pytest.raises(InvalidArgumentError, match=r"argument 1 of shape \[4, 32, 32\]"):
        model(x, torch.randn(4, 512, 32))
    with pytest.raises(InvalidArgumentError, match="an unbatched input"):
        model(x[0], memory[0])
    revckpt.restore(model)
    revckpt.fit(model, (x, memory), memory_budget=0.6, loss_fn=loss_fn, plan=path)
    with pytest.raises(InvalidArgumentError, match=r"argument 1 of shape \[4, 32, 32\]"):
        model(x, torch.randn(4, 512, 32))
    with pytest.raises(InvalidArgumentError, match="block_tensor_shapes must give one shape"):
        dataclasses.replace(plan, block_tensor_shapes=(((4, 16, 32),),) * 3)
    # a plan saved before the shapes were recorded applies, without their limit (a raw
    # ValueError from a strict zip, in a review)
    older = {k: v for k, v in plan.to_dict().items() if k != "block_tensor_shapes"}
    revckpt.restore(model)
    revckpt.fit(model, (x, memory), memory_budget=0.6, loss_fn=loss_fn,
                plan=Plan.from_dict(older))  # fmt: skip
    loss_fn(model(x, memory)).backward()


def test_parameters_added_or_unfrozen_after_fit_are_refused():
    """The plan's budget holds for the parameters fit planned with: an adapter added after
    fit (peft.get_peft_model on a fitted GPT-2: 1.08x the budget) or layers unfrozen (a
    frozen BART encoder: 1.68x) ran over it, silently. Freezing more runs; eval runs."""
    case = _case("nanogpt")
    example = case.make_example(4, 32)
    model = case.make_model()
    model.get_submodule(case.blocks_path)[0].requires_grad_(False)
    plan = revckpt.fit(model, example, memory_budget=0.8, loss_fn=case.loss_fn)
    zoo.step(model, example, case.loss_fn)
    blocks = model.get_submodule(case.blocks_path)
    blocks[0].requires_grad_(True)  # unfrozen
    with pytest.raises(InvalidArgumentError, match="trainable parameter elements"):
        zoo.step(model, example, case.loss_fn)
    blocks[0].requires_grad_(False)
    blocks[1].requires_grad_(False)  # frozen more: within the budget
    zoo.step(model, example, case.loss_fn)
    blocks[1].requires_grad_(True)
    blocks[2].register_parameter("adapter", nn.Parameter(torch.zeros(3)))  # added
    with pytest.raises(InvalidArgumentError, match=r"parameters of \d+ elements when"):
        zoo.step(model, example, case.loss_fn)
    with torch.no_grad():
        model(*example) if isinstance(example, tuple) else model(example)  # eval: plainly
    revckpt.restore(model)
    assert plan.block_names
    revckpt.fit(model, example, memory_budget=0.8, loss_fn=case.loss_fn)  # after the change
    zoo.step(model, example, case.loss_fn)


class _SparseConv(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, adj: torch.Tensor) -> torch.Tensor:
        return x + torch.sparse.mm(adj, torch.tanh(self.lin(x)))


class _SparseNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_SparseConv() for _ in range(3))

    def forward(self, h: torch.Tensor, adj: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            h = block(h, adj)
        return h


def test_fit_plans_blocks_given_a_sparse_tensor():
    """A graph convolution's sparse adjacency beside the hidden state: fit's profiler read
    the storage of every tensor the block saved (a sparse one has none: a raw
    NotImplementedError)."""
    torch.manual_seed(0)
    net = _SparseNet().double()
    plain = copy.deepcopy(net)
    n = 64
    index = torch.stack([torch.arange(n), torch.arange(n).roll(1)])
    adj = torch.sparse_coo_tensor(index, torch.full((n,), 0.5), (n, n)).double().coalesce()
    x = torch.randn(n, 16, dtype=torch.float64)

    def loss_fn(y: torch.Tensor) -> torch.Tensor:
        return y.square().sum()

    plan = revckpt.fit(net, (x, adj), memory_budget=0.9, loss_fn=loss_fn)
    assert plan.block_names == ("blocks.0", "blocks.1", "blocks.2")
    loss_fn(net(x, adj)).backward()
    loss_fn(plain(x, adj)).backward()
    for a, b in zip(net.parameters(), plain.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)


class _EnergyBlock(nn.Module):
    """Differentiates inside its forward (a physics-informed or energy model)."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xx = x if x.requires_grad else x.detach().requires_grad_()
        (g,) = torch.autograd.grad(torch.tanh(self.l1(xx)).pow(2).sum(), xx, create_graph=True)
        return x + 0.1 * self.l2(g)


def test_fit_plans_blocks_that_differentiate_inside_their_forward():
    """fit's profile ran each block once under no_grad, where its autograd.grad cannot run
    (a raw RuntimeError, after following the advice of the error before it, which named
    fit's internal 'InSitu' module)."""
    torch.manual_seed(0)
    model = nn.Sequential(*(_EnergyBlock() for _ in range(3))).double()
    plain = copy.deepcopy(model)
    x = torch.randn(8, 16, dtype=torch.float64, requires_grad=True)

    def loss_fn(y: torch.Tensor) -> torch.Tensor:
        return y.square().sum()

    with pytest.raises(revckpt.DoubleBackwardError, match=r"^_EnergyBlock \(0\) ran with"):
        revckpt.fit(model, x, memory_budget=0.9, loss_fn=loss_fn)
    plan = revckpt.fit(
        model, x, memory_budget=0.96, loss_fn=loss_fn, strategies=["store", "checkpoint"]
    )
    assert "checkpoint" in plan.strategies
    loss_fn(model(x)).backward()
    loss_fn(plain(x)).backward()
    for a, b in zip(model.parameters(), plain.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)


class _ComplexBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return z * torch.tanh(self.w)


def test_complex_hidden_states_are_refused_as_complex():
    """The refusal said the block got no floating-point tensor and to pass the hidden state
    as a tensor, which it was: complex hidden states are said to be unsupported."""
    model = nn.Sequential(*(_ComplexBlock() for _ in range(3)))
    z = torch.randn(4, 8, dtype=torch.complex64)
    with pytest.raises(InvalidArgumentError, match="complex hidden states are not supported"):
        revckpt.fit(model, z, memory_budget=0.5, loss_fn=lambda y: y.abs().sum())


class _Counting(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, x: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
        step.add_(1)  # a counter the model keeps in its batch
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x


def test_a_model_that_changes_its_example_in_place_is_refused_by_fit():
    """fit runs its step several times on the same example: a counter in the batch ended at
    3 (the docs said fit leaves the batch as it was), and a workspace the model copies
    hidden states into made torch raise 'backward through the graph a second time'."""
    model, step = _Counting(), torch.zeros(())
    with pytest.raises(InvalidArgumentError, match="changed a tensor of the example"):
        revckpt.fit(model, (torch.randn(4, 8), step), memory_budget=0.9,
                    loss_fn=lambda y: y.sum())  # fmt: skip
    assert planned(model.blocks[0]) is None  # nothing left installed


class _CuLinear(nn.Linear):
    def forward(self, x: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
        return torch.tanh(super().forward(x)) * (1 + 0 * cu[-1])


class _Packed(nn.Module):
    """Blocks given packed sequences' boundaries (cu_seqlens: one entry per sequence + 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_CuLinear(16, 16) for _ in range(3))

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, cu_seqlens)
        return x


def test_more_packed_sequences_in_as_many_tokens_are_not_refused():
    """The shape limit reads floating-point arguments only: a packed batch of more, shorter
    sequences has a longer cu_seqlens (an index) in as many tokens, and keeps no more (a
    review: refused as larger)."""
    model = _Packed()
    x = torch.randn(1, 120, 16)
    four, six = torch.tensor([0, 30, 60, 90, 120]), torch.tensor([0, 20, 40, 60, 80, 100, 120])
    revckpt.fit(model, (x, four), memory_budget=0.9, loss_fn=lambda y: y.sum())
    model(x, six).sum().backward()
