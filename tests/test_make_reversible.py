"""revckpt.make_reversible: a pretrained model's own layers as one reversible stack, in place
(MEFT-style adapters and scaled couplings), on the zoo's transformers."""

from __future__ import annotations

import copy
import math
import warnings
from typing import Any

import pytest
import torch
import zoo
from torch import nn

import revckpt
from revckpt import InvalidArgumentError, MemoryMeter, RevckptError
from revckpt.inplace import make_reversible, reversible_layers
from revckpt.layers import ReconstructionWarning
from revckpt.report import measure_step

CASES = ["nanogpt", "gpt2", "llama", "bert", "encoder"]


def _logits(model: nn.Module, example):
    out = model(**example) if isinstance(example, dict) else model(*example)
    out = out[0] if isinstance(out, tuple) else out
    return out.logits if hasattr(out, "logits") else out


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p))
        for n, p in model.named_parameters()
        if p.requires_grad
    }


def _converted(name: str, **options):
    case = zoo.CASES[name]
    model = case.make_model().double()
    original = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' notes on configs
        make_reversible(model, blocks=case.blocks_path, **options)
    return case, original, model


@pytest.mark.parametrize("variant", ["layer_f", "layer_g"])
@pytest.mark.parametrize("name", CASES)
def test_gradients_equal_plain_autograd_in_float64(name, variant):
    """The reversible backward gives the gradients plain autograd gives for the same
    converted function (everything stored), for the adapters and the pretrained weights."""
    case, _, model = _converted(name, variant=variant, scale=2**-3, trainable="all")
    torch.manual_seed(1)
    for n, p in model.named_parameters():
        if "revckpt_adapter" in n:  # trained adapters: up is no longer zero
            p.data.normal_(0, 0.05)
    example = case.make_example()
    loss = zoo.step(model, example, case.loss_fn)
    reversible = _grads(model)
    model.zero_grad(set_to_none=True)
    reversible_layers(model).reversible = False
    plain_loss = zoo.step(model, example, case.loss_fn)
    plain = _grads(model)
    assert loss.item() == plain_loss.item()
    for n, g in plain.items():
        torch.testing.assert_close(reversible[n], g, rtol=1e-9, atol=1e-12, msg=n)
    assert any(g.abs().sum() > 0 for n, g in reversible.items() if "revckpt_adapter" in n)


@pytest.mark.parametrize("name", CASES)
def test_gradients_at_the_defaults_equal_plain_autograd_in_float64(name):
    """At the defaults (scale 2^-8, the exact rebuild in every dtype) a float64 model's
    gradients are plain autograd's of the same converted model to float64's round-off (an
    anchored floating-point rebuild at 2^-8 was off by up to 5e-8)."""
    case, _, model = _converted(name, trainable="all")
    assert reversible_layers(model).exact
    torch.manual_seed(1)
    for n, p in model.named_parameters():
        if "revckpt_adapter" in n:
            p.data.normal_(0, 0.05)
    example = case.make_example()
    torch.manual_seed(2)
    zoo.step(model, example, case.loss_fn)
    reversible = _grads(model)
    model.zero_grad(set_to_none=True)
    reversible_layers(model).reversible = False
    torch.manual_seed(2)
    zoo.step(model, example, case.loss_fn)
    for n, g in _grads(model).items():
        torch.testing.assert_close(reversible[n], g, rtol=1e-12, atol=1e-14, msg=n)


def test_a_gradient_penalty_is_refused_naming_the_mode_that_runs_it_exactly():
    """A double backward through the stack: the message named revckpt.checkpoint and keeping
    the part stored, not the one line that runs it exactly on a converted model."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=2, n_embd=16, n_head=2, vocab_size=32, n_positions=16, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=0,
        attn_implementation="eager",  # (SDPA on the CPU has no double backward)
    )  # fmt: skip
    model = make_reversible(GPT2LMHeadModel(config).double().train(), trainable="all")
    ids = torch.randint(0, 32, (2, 8))

    def penalty() -> None:
        loss = model(input_ids=ids, labels=ids).loss
        params = [p for p in model.parameters() if p.requires_grad]
        grads = torch.autograd.grad(loss, params, create_graph=True, allow_unused=True)
        sum(g.pow(2).sum() for g in grads if g is not None).backward()

    with pytest.raises(revckpt.DoubleBackwardError, match=r"reversible_layers\(model\)\.mode"):
        penalty()
    model.zero_grad(set_to_none=True)
    reversible_layers(model).mode = "checkpoint"
    penalty()  # the way out the message names runs
    assert any(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("how", ["hook", "retain_grad", "forward_hook"])
def test_a_hook_on_a_hidden_state_between_layers_is_refused_not_ignored(how):
    """output_hidden_states=True and a gradient-stopping hook on one of them: the stack rebuilt
    that hidden state on its own streams, the hook never ran, and the layers before it got
    gradients plain autograd does not give (8.9e-2 where the hook makes 0); retain_grad()
    left .grad None. Now refused, naming the mode that runs hooks exactly."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=3, n_embd=16, n_head=2, vocab_size=32, n_positions=16, use_cache=False,
        bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    model = make_reversible(GPT2LMHeadModel(config).double().train(), trainable="all")
    ids = torch.randint(0, 32, (2, 8))

    def hook_output(module: nn.Module, args: Any, output: Any) -> None:
        hidden = output[0] if isinstance(output, tuple) else output
        hidden.register_hook(torch.zeros_like)  # the tensor itself is not kept

    def step() -> torch.Tensor:
        handle = model.transformer.h[1].register_forward_hook(hook_output)
        try:
            out = model(input_ids=ids, labels=ids, output_hidden_states=how != "forward_hook")
        finally:
            handle.remove()
        h = out.hidden_states[2] if how != "forward_hook" else None  # what layer 1 returned
        if how == "hook":
            h.register_hook(torch.zeros_like)
        elif how == "retain_grad":
            h.retain_grad()
        out.loss.backward()
        return h

    with pytest.raises(InvalidArgumentError, match=r"transformer\.h\.1 returned"):
        step()
    model.zero_grad(set_to_none=True)
    model(input_ids=ids, labels=ids, output_hidden_states=True).loss.backward()  # no hook: runs
    grads = {}
    for mode in ("store", "checkpoint"):  # plain autograd, and the way out the message names
        model.zero_grad(set_to_none=True)
        reversible_layers(model).mode = mode
        h = step()
        assert how != "retain_grad" or h.grad is not None
        grads[mode] = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    for a, b in zip(grads["store"], grads["checkpoint"], strict=True):
        assert torch.equal(a, b)


def test_forward_mode_ad_runs_through_a_stack_run_plainly_and_is_refused_reversible():
    """The coupling's grid-rounded combination had no forward-mode rule: a converted model
    raised torch's NotImplementedError even in mode 'store' (plain autograd)."""
    import torch.autograd.forward_ad as fwAD
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=2, n_embd=16, n_head=2, vocab_size=32, n_positions=16, use_cache=False,
        bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        attn_implementation="eager",
    )  # fmt: skip
    model = make_reversible(GPT2LMHeadModel(config).double().train(), trainable="all")
    embeds = torch.randn(2, 8, 16, dtype=torch.float64)
    direction = torch.randn_like(embeds)

    def logits(e: torch.Tensor) -> torch.Tensor:
        return model(inputs_embeds=e).logits

    def jvp() -> torch.Tensor:
        with fwAD.dual_level():
            return fwAD.unpack_dual(logits(fwAD.make_dual(embeds, direction))).tangent

    with pytest.raises(InvalidArgumentError, match="forward-mode"):
        jvp()
    reversible_layers(model).mode = "store"
    tangent = jvp()
    # the tangent agrees with reverse mode: <J v, u> = <v, J^T u> (the grid-rounded
    # combination is differentiated as scale * x + h both ways)
    leaf = embeds.clone().requires_grad_()
    cotangent = torch.randn_like(tangent)
    (pulled,) = torch.autograd.grad(logits(leaf), leaf, cotangent)
    forward, reverse = float((tangent * cotangent).sum()), float((direction * pulled).sum())
    assert forward == pytest.approx(reverse, rel=1e-10)


def test_a_converted_model_quantised_dynamically_runs():
    """torch.ao.quantization.quantize_dynamic swaps the adapters' Linears too, whose weight
    is then a method: the adapter read its dtype off it (a raw AttributeError)."""
    case, _, model = _converted("nanogpt")
    model = model.float().eval()
    example = case.make_example()
    quantised = torch.ao.quantization.quantize_dynamic(
        copy.deepcopy(model), {nn.Linear}, dtype=torch.qint8
    )
    with torch.no_grad():
        want, got = case.loss_fn(model(*example)), case.loss_fn(quantised(*example))
    assert abs(float(got) - float(want)) <= 0.05 * abs(float(want))


@pytest.mark.parametrize("variant", ["layer_f", "layer_g"])
def test_output_at_conversion_moves_by_about_scale(variant):
    """The first layer is exact; each further one moves by ``scale`` times the auxiliary
    stream: the output's relative change shrinks with the scale."""
    moved = []
    for scale in (2**-1, 2**-3, 2**-6):
        case, original, model = _converted("nanogpt", variant=variant, scale=scale)
        example = case.make_example()
        with torch.no_grad():
            ref, got = _logits(original, example), _logits(model, example)
        moved.append(((got - ref).norm() / ref.norm()).item())
    assert moved[0] > moved[1] > moved[2] > 0
    assert moved[2] < 0.05
    # a single converted layer is the original layer exactly
    case = zoo.CASES["nanogpt"]
    model = case.make_model().double()
    original = copy.deepcopy(model)
    make_reversible(model, blocks=lambda m, fqn: fqn == "transformer.h.0", variant=variant)
    example = case.make_example()
    with torch.no_grad():
        torch.testing.assert_close(_logits(model, example), _logits(original, example))


def test_both_variants_move_the_output_by_the_same_update():
    """At conversion both variants move each layer's input by ``scale`` times the residual
    update of the layer before: layer_f's auxiliary stream is minus that update, layer_g's
    is the hidden state one layer back with ``scale * u`` subtracted in G (Centred). So the
    two give the same logits (float64), and both are closer than MEFT's ``scale * a`` with
    the hidden state (what layer_g computed before)."""
    logits, moved = {}, {}
    for variant in ("layer_f", "layer_g"):
        case, original, model = _converted("gpt2", variant=variant, scale=2**-4, exact=False)
        example = case.make_example()  # (in floating point: the grid would round both)
        with torch.no_grad():
            ref, logits[variant] = _logits(original, example), _logits(model, example)
        moved[variant] = ((logits[variant] - ref).norm() / ref.norm()).item()
    torch.testing.assert_close(logits["layer_g"], logits["layer_f"], rtol=1e-12, atol=1e-12)
    assert 0 < moved["layer_g"] < 2**-4


@pytest.mark.parametrize("variant", ["layer_f", "layer_g"])
def test_every_adapter_moves_the_output_as_far_at_any_scale(variant):
    """An adapter's effect on the output does not shrink with the scale: the same small
    weights in each adapter of the second layer move the logits about as far at scale 2^-3 as
    at 2^-8 (layer_f's A_g reaches the next layer through ``scale * a'``, so it is divided by
    the scale; undivided, it moved them 2^-8 / 2^-3 = 1/32 as far)."""
    moved = {}
    for scale in (2**-3, 2**-8):
        case, _, model = _converted("nanogpt", variant=variant, scale=scale)
        layer = reversible_layers(model).layers[1][1]  # layer_g's first A_f sees zeros
        example = case.make_example()
        with torch.no_grad():
            ref = _logits(model, example)
            for which in ("f", "g"):
                up = getattr(layer, f"revckpt_adapter_{which}").up.weight
                gen = torch.Generator().manual_seed(0)  # not constant: a norm would remove it
                up.copy_(torch.randn(up.shape, generator=gen, dtype=up.dtype) * 1e-3)
                moved[(scale, which)] = (_logits(model, example) - ref).norm().item()
                up.zero_()
    for which in ("f", "g"):
        ratio = moved[(2**-8, which)] / moved[(2**-3, which)]
        assert 0.5 < ratio < 2, (which, moved)


def test_trainable_adapters_freezes_the_converted_layers_only():
    """trainable="adapters" freezes the converted (pretrained) layers' own parameters; the
    rest of the model keeps requires_grad as the user set it: a task head added on top trains,
    a part the user froze stays frozen."""
    case = zoo.CASES["gpt2"]
    model = case.make_model().double()
    model.head = nn.Linear(64, 3).double()  # a new task head
    model.transformer.wpe.requires_grad_(False)  # frozen by the user
    make_reversible(model, blocks=case.blocks_path, scale=2**-3)
    layers = reversible_layers(model).layers
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    inside = {f"{fqn}.{n}" for fqn, layer in layers for n, _ in layer.named_parameters()}
    last_g = f"{layers[-1][0]}.revckpt_adapter_g."  # reaches nothing: frozen
    adapters = {n for n in inside if "revckpt_adapter" in n and not n.startswith(last_g)}
    assert {n for n in trainable if n in inside} == adapters
    assert {n for n in trainable if n not in inside} == {
        "transformer.wte.weight", "transformer.ln_f.weight", "transformer.ln_f.bias",
        "head.weight", "head.bias",
    }  # fmt: skip
    out = model(**case.make_example())
    (out.loss + model.head(out.logits[..., :64]).pow(2).mean()).backward()
    for n, p in model.named_parameters():
        assert (p.grad is not None) == (n in trainable), n


def test_state_dict_is_the_original_plus_adapters():
    case, original, model = _converted("llama")
    before = {n: p for n, p in original.state_dict().items()}
    after = model.state_dict()
    adapters = {k for k in after if "revckpt_adapter" in k}
    assert set(after) - set(before) == adapters and set(before) <= set(after)
    result = model.load_state_dict(original.state_dict(), strict=False)
    assert set(result.missing_keys) == adapters and not result.unexpected_keys
    fresh = zoo.CASES["llama"].make_model().double()
    ids = {n: p.data_ptr() for n, p in fresh.named_parameters()}
    make_reversible(fresh, blocks=case.blocks_path)
    assert all(p.data_ptr() == ids[n] for n, p in fresh.named_parameters() if n in ids)


def test_adapters_saved_for_another_scale_or_variant_are_refused():
    """The same adapter weights compute another function at another scale or variant: the
    state_dict records both (each adapter's extra state), and loading into a model converted
    otherwise raises, naming what they were saved for; the same conversion loads them."""
    case = zoo.CASES["nanogpt"]
    saved = case.make_model()
    make_reversible(saved, blocks=case.blocks_path, scale=2**-3)
    state = saved.state_dict()
    for options in ({}, {"scale": 2**-3, "variant": "layer_g"}):
        other = case.make_model()
        make_reversible(other, blocks=case.blocks_path, **options)
        with pytest.raises(InvalidArgumentError, match=r"saved for variant='layer_f', scale=0.125"):
            other.load_state_dict(state)
    same = case.make_model()
    make_reversible(same, blocks=case.blocks_path, scale=2**-3)
    same.load_state_dict(state)  # strict: every key, the extra states included


def test_scale_auto_keeps_the_start_within_the_tolerance():
    """scale="auto" measures the output's change at conversion on the example and picks the
    largest 2^-k within start_tolerance (the change is linear in the scale: at twice the
    scale it is above); the model's modes come back; the figure is kept."""
    case = zoo.CASES["gpt2"]
    example = {"input_ids": case.make_example(4, 32)["input_ids"]}
    model = case.make_model()
    make_reversible(model, scale="auto", example=example)
    layers = reversible_layers(model)
    k = -math.log2(layers.scale)
    assert k == int(k) and 1 <= k <= 16 and layers.exact and model.training
    assert 0 < layers.start <= 1e-3
    twice = case.make_model()
    make_reversible(twice, scale=2 * layers.scale, example=example)  # measured, not chosen
    assert reversible_layers(twice).start > 1e-3
    looser = case.make_model()
    make_reversible(looser, scale="auto", example=example, start_tolerance=1e-2)
    assert reversible_layers(looser).scale > layers.scale


def test_scale_auto_judges_the_logits_of_a_tuple_with_a_loss_first():
    """``return_dict=False`` with labels: ``(loss, logits, ...)``; the loss moved 3600x less
    than the logits, and scale 2^-1 was taken for a start of 0.19 reported as 5e-5."""
    case = zoo.CASES["gpt2"]
    ids = case.make_example(4, 32)["input_ids"]
    example = {"input_ids": ids, "labels": ids, "return_dict": False}
    original = case.make_model()
    model = make_reversible(copy.deepcopy(original), scale="auto", example=example)
    layers = reversible_layers(model)
    assert layers.scale <= 2**-8
    with torch.no_grad():
        before = original.eval()(input_ids=ids).logits.double()
        after = model.eval()(input_ids=ids).logits.double()
    change = ((after - before).norm() / before.norm()).item()
    assert change <= 1e-3 and layers.start == pytest.approx(change, rel=1e-3)


def test_scale_auto_refuses_what_it_cannot_do():
    case = zoo.CASES["nanogpt"]
    idx, _ = case.make_example(2, 16)
    with pytest.raises(InvalidArgumentError, match="pass example="):
        make_reversible(case.make_model(), scale="auto")
    with pytest.raises(InvalidArgumentError, match="start_tolerance="):
        make_reversible(case.make_model(), scale="auto", example=idx, start_tolerance=0)
    with pytest.raises(InvalidArgumentError, match=r"start_tolerance=.*leave it out"):
        make_reversible(case.make_model(), scale=2**-8, start_tolerance=1e-4)  # not ignored
    model = case.make_model()
    before = model(idx)[0]
    with pytest.raises(InvalidArgumentError, match=r"even at scale 2\^-16"):
        make_reversible(model, scale="auto", example=idx, start_tolerance=1e-12)
    assert not any("revckpt_adapter" in n for n, _ in model.named_parameters())
    assert torch.equal(model(idx)[0], before)  # left as it was
    assert all(p.requires_grad for p in model.parameters())


def test_scale_auto_refuses_an_example_the_model_computes_nan_on():
    """The original's output on ``example`` holds nan: ``OverflowError`` from the search (and
    the model was left converted); now a clear error before converting."""
    case = zoo.CASES["nanogpt"]
    idx, _ = case.make_example(2, 16)
    model = case.make_model()
    with torch.no_grad():
        model.lm_head.weight[0, 0] = float("nan")
    with pytest.raises(InvalidArgumentError, match="not finite"):
        make_reversible(model, scale="auto", example=idx, exact=False)
    assert not any("revckpt_adapter" in n for n, _ in model.named_parameters())


def test_a_converted_output_turned_non_finite_tries_the_smallest_scale_first():
    from revckpt.inplace._reversible_start import shift_for

    assert shift_for(math.inf, 1e-3) == 16
    assert shift_for(0.0, 1e-3) == 1


def test_eval_and_no_grad_compute_the_same_function():
    case, _, model = _converted("nanogpt", scale=2**-2, trainable="all")
    example = case.make_example()
    train = _logits(model, example)
    with torch.no_grad():
        plain = _logits(model, example)
    model.eval()
    with torch.no_grad():
        evaluated = _logits(model, example)
    torch.testing.assert_close(train.detach(), plain, rtol=0, atol=0)
    torch.testing.assert_close(evaluated, plain, rtol=0, atol=0)


def _retained(name: str, depth: int, convert: bool, exact: bool = False) -> int:
    case = zoo.CASES[name]
    model = case.make_model()
    layers = model.transformer.h
    while len(layers) < depth:
        layers.append(copy.deepcopy(layers[-1]))
    if convert:
        make_reversible(
            model, blocks=case.blocks_path, trainable="all", scale=0.5, anchor_every=None,
            exact=exact,
        )  # fmt: skip
    idx, _ = case.make_example()

    class Step(nn.Module):  # measure_step's model: one tensor in, one out
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.model(x.long())[0]

    return measure_step(Step(), idx.float()).retained_bytes


def test_activation_memory_is_a_few_hidden_states_whatever_the_depth():
    hidden = zoo.BATCH * zoo.SEQ * 64 * 4
    full = [_retained("nanogpt", d, convert=False) for d in (4, 8)]
    rev = [_retained("nanogpt", d, convert=True) for d in (4, 8)]
    assert full[1] > 1.8 * full[0]  # grows with depth
    assert rev[1] - rev[0] <= hidden // 8  # flat in depth
    assert rev[1] < 0.1 * full[1], (rev, full)
    # the exact rebuild keeps the bit scale 1/2 drops: one byte per element and layer more
    exact = [_retained("nanogpt", d, convert=True, exact=True) for d in (4, 8)]
    elements = hidden // 4
    assert abs(exact[1] - exact[0] - 4 * elements) <= hidden // 8, (exact, elements)


class _Layers(nn.Module):
    """Three layers of width 8 the model calls in turn: the stack the small tests convert."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8)) for _ in range(3)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class _Holding(nn.Module):
    """A model around another (a task wrapper, peft's ``PeftModel``)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


def test_a_model_that_changes_the_hidden_state_between_layers_is_refused():
    class Scaled(_Layers):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = layer(x) * 2
            return x

    model = make_reversible(Scaled(), blocks="layers", trainable="all")
    with pytest.raises(RevckptError, match="did not get the hidden state"):
        model(torch.randn(2, 8))


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_full_backward_hook_on_a_layer_is_named(when):
    # its wrapper hands the next layer another tensor: the message said the model changed the
    # hidden state between the layers
    model = _Layers()
    hook = lambda module, grad_in, grad_out: None  # noqa: E731
    if when == "before":
        model.layers[1].register_full_backward_hook(hook)
    model = make_reversible(model, blocks="layers", trainable="all")
    if when == "after":
        model.layers[1].register_full_backward_hook(hook)
    with pytest.raises(RevckptError, match=r"layers\.1 has a full backward hook"):
        model(torch.randn(2, 8))


@pytest.mark.parametrize("grad", [True, False])
def test_a_model_that_changes_the_hidden_state_in_place_between_layers_is_refused(grad):
    """``x.mul_(0.5)`` between two converted layers: the stack carries the hidden state in its
    own streams, which the change does not reach; it went unseen (the output moved by 1.9,
    relative, where the start is about 2e-3)."""

    class Halved(_Layers):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = layer(x)
                x.mul_(0.5)
            return x

    model = make_reversible(Halved(), blocks="layers", trainable="all")
    with torch.set_grad_enabled(grad), pytest.raises(RevckptError, match="changed in place"):
        model(torch.randn(2, 8))


class _Pool(nn.Module):
    """Keeps the width, not the shape: (batch, tokens, width) to (batch, 1, width)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x.mean(1, keepdim=True))


def test_a_layer_that_changes_the_shape_is_refused():
    """A pooling layer in the stack: the coupling broadcast its output over the input and
    trained a different function, silently."""

    class Pooled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(
                [*(nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8)) for _ in range(2)), _Pool()]
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = layer(x)
            return x

    model = make_reversible(Pooled(), blocks="layers", trainable="all")
    with pytest.raises(InvalidArgumentError, match=r"shape \(2, 1, 8\) for one of shape"):
        model(torch.randn(2, 5, 8))


def test_a_cache_in_eval_mode_with_autograd_on_is_kept():
    """A decoding loop in eval mode outside ``torch.no_grad()``: the cache was dropped, as in
    training, and the cached step's logits moved by 1.15 (relative). Now the prompt's pass
    fills it (its recompute runs without it), and a step on a cache holding past entries runs
    by plain autograd (as Hugging Face checkpoints in training only)."""
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = make_reversible(zoo.deeper("llama", 2)()).eval()
    ids = torch.randint(0, zoo.VOCAB, (1, 7))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing dropped, nothing warned
        first = model(input_ids=ids[:, :6], use_cache=True)
        assert first.past_key_values.get_seq_length() == 6
        step = model(input_ids=ids[:, 6:], cache=first.past_key_values, use_cache=True)
    full = model(input_ids=ids).logits[:, -1]
    torch.testing.assert_close(step.logits[:, -1], full, rtol=1e-4, atol=1e-5)
    # the prompt's keys and values were made in a reversible forward, which keeps nothing:
    # a gradient through them is refused, naming the way out
    with pytest.raises(RevckptError, match="key/value cache entry"):
        step.logits.sum().backward()


def test_an_eval_pass_filling_a_cache_leaves_no_graph_behind():
    # the stack's record of the pass held the cache it filled, which the graph's nodes held in
    # a cycle the collector cannot see: every eval forward with use_cache=True leaked its
    # cache and graph (and resize_token_embeddings then broke backward)
    import gc

    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = make_reversible(zoo.deeper("llama", 2)()).eval()
    ids = torch.randint(0, zoo.VOCAB, (2, 8))

    def graphs() -> int:
        gc.collect()
        return sum(isinstance(o, torch.Tensor) and o.grad_fn is not None for o in gc.get_objects())

    before = graphs()
    for _ in range(2):
        out = model(input_ids=ids, use_cache=True)
        assert out.past_key_values.get_seq_length() == 8
        del out
    assert graphs() == before


def test_converting_again_through_a_parent_or_a_part_is_refused():
    """``make_reversible(model.transformer)`` after ``make_reversible(model)``, or of a wrapper
    holding it: accepted, and the next forward raised ``RecursionError``."""

    model = make_reversible(_Holding(_Layers()), blocks="inner.layers")
    with pytest.raises(InvalidArgumentError, match="by make_reversible already"):
        make_reversible(model.inner, blocks="layers")
    wrapper = nn.Sequential(model)
    with pytest.raises(InvalidArgumentError, match="by make_reversible already"):
        make_reversible(wrapper, blocks="0.inner.layers")
    model(torch.randn(2, 8)).sum().backward()  # the first conversion still runs


def test_a_second_stack_converts_through_the_parent():
    """Two stacks of one model, the second converted through the parent: refused by the
    first version of the check above (it refused any converted layer inside)."""

    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first = nn.ModuleList(
                nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8)) for _ in range(2)
            )
            self.second = nn.ModuleList(
                nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8)) for _ in range(2)
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in [*self.first, *self.second]:
                x = layer(x)
            return x

    torch.manual_seed(0)
    model = Two().double()
    make_reversible(model.first, trainable="all")
    make_reversible(model, blocks="second", trainable="all")
    x = torch.randn(3, 8, dtype=torch.float64)
    model(x).sum().backward()
    got = _grads(model)
    for owner in (model.first, model):
        reversible_layers(owner).reversible = False
    model.zero_grad(set_to_none=True)
    model(x).sum().backward()
    for name, want in _grads(model).items():
        torch.testing.assert_close(got[name], want, rtol=1e-10, atol=1e-12, msg=name)


def test_the_encoders_nested_tensor_fast_path_is_off_while_converted():
    """``nn.TransformerEncoder`` (``enable_nested_tensor=True``, its default) in eval mode under
    ``no_grad`` with a padding mask hands its layers a nested tensor, which the stack cannot
    split: a raw ``RuntimeError`` at first, then a refusal at every validation step. The
    fast path is off while converted (scale="auto" measures the start without it too) and back
    on after restore."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    encoder = nn.TransformerEncoder(layer, 2)
    x, pad = torch.randn(2, 5, 16), torch.zeros(2, 5, dtype=torch.bool)
    pad[0, 3:] = True
    example = dict(src=x, src_key_padding_mask=pad)
    model = make_reversible(copy.deepcopy(encoder), scale="auto", example=example).eval()
    assert not model.use_nested_tensor and reversible_layers(model).start <= 1e-3
    with torch.no_grad():
        got = model(x, src_key_padding_mask=pad)
    encoder.use_nested_tensor = False
    with torch.no_grad():
        want = encoder.eval()(x, src_key_padding_mask=pad)
    assert (got - want).norm() <= 1e-3 * want.norm()
    revckpt.restore(model)
    assert model.use_nested_tensor


def test_inside_torch_func_the_message_names_a_way_out_that_runs():
    """torch.func.grad over a converted model: refused naming ``reversible = False``, which
    then gives plain autograd's gradients (the exact coupling's node had no
    ``setup_context``: torch's raw error, whatever the mode)."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).double()
    model = make_reversible(model, trainable="all")
    x = torch.randn(2, 3, 8, dtype=torch.float64)
    params = {n: p.detach() for n, p in model.named_parameters()}

    def loss(p):
        return torch.func.functional_call(model, p, (x,)).square().sum()

    with pytest.raises(
        InvalidArgumentError, match=r"reversible_layers\(model\)\.reversible = False"
    ):
        torch.func.grad(loss)(params)
    reversible_layers(model).reversible = False
    got = torch.func.grad(loss)(params)
    model(x).square().sum().backward()
    for n, p in model.named_parameters():
        want = torch.zeros_like(p) if p.grad is None else p.grad
        torch.testing.assert_close(got[n], want, rtol=1e-12, atol=1e-14, msg=n)


@pytest.mark.parametrize("reentrant", [True, False])
def test_hugging_face_gradient_checkpointing_changes_nothing(reentrant):
    """``gradient_checkpointing_enable`` on a converted model: with ``use_reentrant=True``
    (peft's ``prepare_model_for_kbit_training`` default) backward failed ("incompatible with
    .grad()"); now the layers run without HF's wrapper, with the same gradients."""
    pytest.importorskip("transformers")
    case, _, model = _converted("llama")
    plain = copy.deepcopy(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    example = case.make_example()
    for m in (model, plain):
        m.train()
        zoo.step(m, example, case.loss_fn)
    for (name, a), (_, b) in zip(_grads(model).items(), _grads(plain).items(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_the_mode_changes_after_a_forward_that_stopped_early_without_grad():
    """An early exit under ``no_grad`` (nothing to differentiate) left its pass behind, and
    setting ``reversible`` then raised "in the middle of a forward pass"."""

    class Exits(_Layers):
        def forward(self, x: torch.Tensor, stop: int = 3) -> torch.Tensor:
            for layer in self.layers[:stop]:
                x = layer(x)
            return x

    model = make_reversible(Exits(), blocks="layers", trainable="all")
    x = torch.randn(2, 8)
    with torch.no_grad():
        model(x, stop=1)
    reversible_layers(model).reversible = False
    reversible_layers(model).reversible = True
    model(x).sum().backward()


@pytest.mark.parametrize("options", [{"exact": False}, {"anchor_every": 2}, {}])
def test_a_floating_point_conversion_cast_to_16_bits_warns(options):
    """With ``exact=False`` given, a cast to bfloat16 after conversion warned nothing (its
    rebuild then drifted by 4e-2), where ``anchor_every=2`` or ``scale=0.1`` warned."""
    case = zoo.CASES["nanogpt"]
    scale = 0.1 if not options else 2**-3
    model = make_reversible(case.make_model(), blocks=case.blocks_path, scale=scale, **options)
    model.to(torch.bfloat16)
    with pytest.warns(ReconstructionWarning, match="cast after conversion"):
        model(case.make_example()[0])


def test_an_eval_step_with_the_default_cache_keeps_the_saving_and_the_gradients():
    """``model.eval()`` to switch dropout off, HF's ``use_cache=True`` left on: the step kept
    every activation (the first fix of the cache above ran any pass with a cache plainly:
    68.8 MiB against 14.8 on an 8-layer GPT-2). The stack's saving holds, the cache is
    filled, and the gradients are store mode's (float64)."""
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    case = zoo.CASES["llama"]
    model = make_reversible(zoo.deeper("llama", 3)().double(), trainable="all").eval()
    example = case.make_example()

    def step(reversible: bool, cache: bool = True) -> tuple[dict[str, torch.Tensor], int, Any]:
        reversible_layers(model).reversible = reversible
        model.zero_grad(set_to_none=True)
        with MemoryMeter("cpu") as meter:
            out = model(**example, use_cache=cache)
            out.loss.backward()
        return _grads(model), meter.peak_bytes, out.past_key_values

    rev, rev_peak, filled = step(True)
    store, store_peak, _ = step(False)
    _, without_peak, _ = step(True, cache=False)
    assert filled.get_seq_length() == example["input_ids"].shape[1]
    cache_bytes = sum(
        t.numel() * t.element_size() for c in filled.layers for t in (c.keys, c.values)
    )
    # the saving holds: what the cache itself holds on top, no activation
    assert rev_peak <= without_peak + cache_bytes < store_peak, (rev_peak, without_peak, store_peak)
    for name, want in store.items():
        torch.testing.assert_close(rev[name], want, rtol=1e-9, atol=1e-12, msg=name)


def test_restore_undoes_a_stack_whose_converted_model_is_gone():
    """peft's ``merge_and_unload()`` returns the base model of a converted ``PeftModel``: its
    layers ran the reversible stack still, and ``restore`` on it restored 0 layers. Restoring
    through the layers undoes the stack, and the model that held it forgets it."""

    torch.manual_seed(0)
    base = _Layers()
    x = torch.randn(2, 8)
    want = base(x)
    wrapper = make_reversible(_Holding(base), blocks="inner.layers", scale=2**-2)
    assert not torch.equal(wrapper(x), want)
    assert revckpt.restore(base) == 3
    assert torch.equal(base(x), want)
    assert not any("revckpt_adapter" in n for n, _ in base.named_parameters())
    assert revckpt.restore(wrapper) == 0
    make_reversible(wrapper, blocks="inner.layers")  # converts again
    wrapper(x).sum().backward()


def test_an_eval_step_on_a_static_cache_or_a_partial_stack():
    """A pre-allocated ``StaticCache`` reads empty before its first update, but a forward
    attends over all its slots: the recompute without it crashed in backward (size
    mismatch). A stack that starts after the model's first layer read that layer's filled
    entry as a cache holding past, and ran every eval step plainly."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    base = zoo.deeper("llama", 3)().double().eval()
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[0, 0] = 0  # left padding: the mask spans the cache's slots
    example = {"input_ids": torch.randint(0, zoo.VOCAB, (2, 6)), "attention_mask": mask}

    def grads(model: nn.Module, reversible: bool, cache: Any) -> dict[str, torch.Tensor]:
        reversible_layers(model).reversible = reversible
        model.zero_grad(set_to_none=True)
        model(**example, cache=cache(model), use_cache=True).logits.pow(2).mean().backward()
        return _grads(model)

    static = make_reversible(copy.deepcopy(base), trainable="all")

    def fresh_static(m: nn.Module) -> Any:
        return transformers.StaticCache(config=m.config, max_cache_len=16)

    got, want = grads(static, True, fresh_static), grads(static, False, fresh_static)
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, rtol=1e-9, atol=1e-12, msg=name)

    deeper = zoo.deeper("llama", 6)().double().eval()
    rest = {f"model.layers.{i}" for i in range(1, 6)}
    later = make_reversible(deeper, blocks=lambda m, fqn: fqn in rest)
    example = {"input_ids": torch.randint(0, zoo.VOCAB, (2, 32))}

    def peak(reversible: bool) -> int:
        reversible_layers(later).reversible = reversible
        later.zero_grad(set_to_none=True)
        with MemoryMeter("cpu") as meter:
            later(**example, use_cache=True).logits.pow(2).mean().backward()
        return meter.peak_bytes

    assert peak(True) < peak(False)  # the stack keeps its saving with the default cache


def test_bad_options_are_refused():
    case = zoo.CASES["nanogpt"]
    with pytest.raises(InvalidArgumentError, match="variant"):
        make_reversible(case.make_model(), variant="attention", blocks=case.blocks_path)
    with pytest.raises(InvalidArgumentError, match="trainable"):
        make_reversible(case.make_model(), trainable="lora", blocks=case.blocks_path)
    with pytest.raises(InvalidArgumentError, match="scale"):
        make_reversible(case.make_model(), scale=0.0, blocks=case.blocks_path)
    model = make_reversible(case.make_model(), blocks=case.blocks_path)
    with pytest.raises(InvalidArgumentError, match="already"):
        make_reversible(model, blocks=case.blocks_path)


def test_wider_streams_rebuild_closer():
    """float32 layers on float64 streams (the default for a float32 model): the rebuilt inputs
    drift far less than on float32 streams, and the model's output stays float32."""
    drift = {}
    for streams in (torch.float64, None):
        case = zoo.CASES["nanogpt"]
        model = case.make_model()
        make_reversible(
            model, blocks=case.blocks_path, scale=2**-3, anchor_every=None,
            check_inverse=1e9, trainable="all", stream_dtype=streams, exact=False,
        )  # fmt: skip
        idx, _ = case.make_example()
        logits, _ = model(idx)
        assert logits.dtype == torch.float32
        logits.pow(2).mean().backward()
        drift[streams] = reversible_layers(model).last_drift[0]
    assert reversible_layers(model).stream_dtype is None
    assert drift[torch.float64] < 1e-3 * drift[None], drift


def test_convert_refuses_a_reversible_model():
    import revckpt

    case = zoo.CASES["nanogpt"]
    model = revckpt.make_reversible(case.make_model(), blocks=case.blocks_path)
    with pytest.raises(InvalidArgumentError, match="reversible stack"):
        revckpt.convert(model, "checkpoint")


def test_fit_picks_the_stack_mode_for_the_budget():
    """fit on a converted model: the fastest of store / checkpoint / reversible whose measured
    step fits; the three give the same gradients."""
    import revckpt
    from revckpt.inplace.step import measure_step

    case = zoo.CASES["gpt2"]
    model = case.make_model()
    make_reversible(model, blocks=case.blocks_path, trainable="all")
    example, layers = case.make_example(), reversible_layers(model)
    peaks, grads = {}, {}
    for mode in ("store", "checkpoint", "reversible"):
        layers.mode = mode
        peaks[mode] = measure_step(model, example, None)
        model.zero_grad(set_to_none=True)
        zoo.step(model, example, None)
        grads[mode] = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    for mode in ("checkpoint", "reversible"):
        assert peaks[mode] < peaks["store"]
        for g, r in zip(grads[mode], grads["store"], strict=True):
            torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6)
    model.zero_grad(set_to_none=True)
    plan = revckpt.fit(model, example, memory_budget=1.0)
    assert plan.strategies == ["store"] * len(layers.layers) and layers.mode == "store"
    assert plan.predicted_peak_bytes == peaks["store"] and plan.model_digest is not None
    both = max(peaks["checkpoint"], peaks["reversible"])
    plan = revckpt.fit(model, example, memory_budget=both)
    assert layers.mode == plan.strategies[0] in ("checkpoint", "reversible")
    assert measure_step(model, example, None) <= both
    plan = revckpt.fit(model, example, memory_budget=both, strategies=["reversible"])
    assert layers.mode == "reversible" and plan.predicted_peak_bytes == peaks["reversible"]
    smallest = min(peaks.values())
    with pytest.raises(revckpt.InfeasibleBudgetError, match=f"raise the budget to {smallest:,}"):
        revckpt.fit(model, example, memory_budget=smallest - 1)
    assert layers.mode == "reversible"  # a failed fit leaves the mode as it was
    with pytest.raises(InvalidArgumentError, match="runs as a whole"):
        revckpt.fit(model, example, memory_budget=1.0, strategies=["approx:bf16"])
    with pytest.raises(InvalidArgumentError, match="blocks= and plan="):
        revckpt.fit(model, example, memory_budget=1.0, blocks=case.blocks_path)


def test_anchors_start_after_the_exact_first_layer():
    case, _, model = _converted("gpt2", anchor_every=1, trainable="all")
    layers = reversible_layers(model)
    anchored = {step.index for step in layers.stack._steps().steps if step.anchor}
    assert anchored == set(range(1, len(layers.layers)))  # layer 0 is rebuilt exactly
    zoo.step(model, case.make_example(), case.loss_fn)
    assert all(d < 1e-10 for d in layers.last_drift[1:] if d is not None)  # one layer each


def test_a_deep_copy_runs_its_own_layers():
    case, _, model = _converted("nanogpt", trainable="all")
    twin = copy.deepcopy(model)
    for p in twin.transformer.h.parameters():
        p.data.zero_()
    example = case.make_example()
    with torch.no_grad():
        assert not torch.equal(_logits(twin, example), _logits(model, example))
    zoo.step(twin, example, case.loss_fn)  # its backward reaches its own parameters
    assert all(p.grad is None for p in model.parameters())


def test_an_overflowed_rebuild_raises_rather_than_passing_nan():
    """A nan drift compares false with any tolerance: it counts as infinite."""
    case = zoo.CASES["nanogpt"]
    model = case.make_model()
    layers = model.transformer.h
    while len(layers) < 32:
        layers.append(copy.deepcopy(layers[len(layers) % 4]))
    make_reversible(model, blocks=case.blocks_path, scale=2**-6, anchor_every=None, exact=False)
    with pytest.raises(revckpt.ReconstructionError):
        zoo.step(model, case.make_example(), case.loss_fn)


def test_an_exact_stack_whose_recompute_differs_says_so():
    """An exact stack rebuilds bit for bit only when each layer's recompute in backward gives
    bitwise what its forward gave; a layer that differs by one ulp on alternate calls (what a
    nondeterministic kernel does) raises ReconstructionError naming the cause and the ways
    out, not the anchors' advice of the floating-point rebuild."""
    case = zoo.CASES["nanogpt"]
    model = case.make_model()
    calls = [0]

    def jitter(module, args, out):
        calls[0] += 1
        return out * (1 + 2**-23) if calls[0] % 2 else out

    for block in model.transformer.h:
        block.mlp.register_forward_hook(jitter)
    make_reversible(model, blocks=case.blocks_path, trainable="all")
    assert reversible_layers(model).exact
    with pytest.raises(revckpt.ReconstructionError, match=r"bitwise.*use_deterministic_algo"):
        zoo.step(model, case.make_example(2, 16), case.loss_fn)


class _QKNormLayer(nn.Module):
    """A layer with a per-head norm narrower than the hidden state (as Qwen3's q_norm)."""

    def __init__(self, width: int = 16, head: int = 4) -> None:
        super().__init__()
        self.q_norm = nn.LayerNorm(head)
        self.norm = nn.LayerNorm(width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q_norm(x.unflatten(-1, (-1, 4))).flatten(-2)
        return x + self.proj(self.norm(x + q))


def test_the_width_is_the_widest_norm_and_is_checked():
    model = nn.Sequential(_QKNormLayer(), _QKNormLayer())
    make_reversible(model, trainable="all")
    model(torch.randn(2, 16)).sum().backward()
    wrong = make_reversible(nn.Sequential(_QKNormLayer(), _QKNormLayer()), width=8)
    with pytest.raises(InvalidArgumentError, match="width"):
        wrong(torch.randn(2, 16))


def test_wide_streams_under_autocast_and_bad_stream_dtypes():
    case = zoo.CASES["nanogpt"]
    model = make_reversible(
        case.make_model(), blocks=case.blocks_path, stream_dtype=torch.float64, trainable="all"
    )
    idx, _ = case.make_example()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, _ = model(idx)
    logits.float().pow(2).mean().backward()
    for bad in ("float64", torch.int64, torch.float16):
        with pytest.raises(InvalidArgumentError, match="stream_dtype"):
            make_reversible(case.make_model(), blocks=case.blocks_path, stream_dtype=bad)


def test_non_consecutive_layers_and_intermediate_only_losses_are_refused():
    case = zoo.CASES["nanogpt"]
    pick = lambda m, fqn: fqn in ("transformer.h.0", "transformer.h.2")  # noqa: E731
    with pytest.raises(InvalidArgumentError, match="consecutive"):
        make_reversible(case.make_model(), blocks=pick)
    model = make_reversible(case.make_model(), blocks=case.blocks_path, trainable="all")
    seen = []
    model.transformer.h[1].register_forward_hook(lambda m, i, o: seen.append(o))
    model(case.make_example()[0])
    with pytest.raises(RevckptError, match="intermediate stream"):
        seen[0].sum().backward()


def test_the_last_adapter_that_reaches_nothing_is_frozen():
    _, _, model = _converted("nanogpt", trainable="all")
    last = reversible_layers(model).layers[-1][1]
    assert not any(p.requires_grad for p in last.revckpt_adapter_g.parameters())
    assert all(p.requires_grad for p in last.revckpt_adapter_f.parameters())


def _gpt2_step(model: nn.Module, example) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    zoo.step(model, example, None)
    return _grads(model)


def test_a_pickled_model_loads_computes_and_trains(tmp_path):
    """torch.save(model) / torch.load(weights_only=False) round trip; and the state_dict
    loads into a freshly converted model: both compute the same output and gradients."""
    case, _, model = _converted("gpt2", trainable="all")
    torch.manual_seed(2)
    for n, p in model.named_parameters():
        if "revckpt_adapter" in n:
            p.data.normal_(0, 0.05)
    example = case.make_example()
    with torch.no_grad():
        ref = _logits(model, example)
    grads = _gpt2_step(model, example)
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    torch.save(model.state_dict(), tmp_path / "state.pt")
    fresh = _converted("gpt2", trainable="all")[2]
    fresh.load_state_dict(torch.load(tmp_path / "state.pt"))
    for other in (loaded, fresh):
        assert reversible_layers(other).layers[0][1] is other.transformer.h[0]
        with torch.no_grad():
            torch.testing.assert_close(_logits(other, example), ref, rtol=0, atol=0)
        got = _gpt2_step(other, example)
        assert got.keys() == grads.keys()
        for n, g in grads.items():
            torch.testing.assert_close(got[n], g, rtol=1e-12, atol=1e-14, msg=n)
        assert reversible_layers(other).last_drift[0] is not None  # the reversible backward
        assert all(p.grad is None or p.grad.equal(grads[n]) for n, p in model.named_parameters())


def test_restore_removes_the_conversion():
    """revckpt.restore undoes make_reversible: the layers' forwards back, the adapters gone,
    requires_grad as before, the output the original's bit for bit (after training the
    adapters)."""
    case = zoo.CASES["gpt2"]
    model = case.make_model().double()
    model.transformer.wpe.requires_grad_(False)
    original = copy.deepcopy(model)
    keys, flags = set(model.state_dict()), {n: p.requires_grad for n, p in model.named_parameters()}
    make_reversible(model, blocks=case.blocks_path, scale=2**-3)
    example = case.make_example()
    adapters = [p for n, p in model.named_parameters() if "revckpt_adapter" in n]
    optimizer = torch.optim.SGD(adapters, lr=0.5)
    zoo.step(model, example, None)
    optimizer.step()
    assert revckpt.restore(model) == len(model.transformer.h)
    assert set(model.state_dict()) == keys
    assert {n: p.requires_grad for n, p in model.named_parameters()} == flags
    for layer in model.transformer.h:
        assert "forward" not in layer.__dict__ and not hasattr(layer, "revckpt_adapter_f")
    with pytest.raises(InvalidArgumentError, match="not converted"):
        reversible_layers(model)
    with torch.no_grad():
        assert torch.equal(_logits(model, example), _logits(original, example))
    assert revckpt.restore(model) == 0
    make_reversible(model, blocks=case.blocks_path)  # and it converts again
    revckpt.convert(copy.deepcopy(original), "checkpoint")  # convert still refuses:
    with pytest.raises(InvalidArgumentError, match="restore"):
        revckpt.convert(model, "checkpoint")


class _CrossLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        return x + self.proj(self.norm(x)) * context.mean()


class _CrossModel(nn.Module):
    """Layers that get a context computed from parameters (a cross-attention's encoder)."""

    def __init__(self, positional: bool = False) -> None:
        super().__init__()
        self.encoder = nn.Linear(8, 8)
        self.layers = nn.ModuleList(_CrossLayer() for _ in range(3))
        self.positional = positional

    def forward(self, x: torch.Tensor, c: torch.Tensor, detach: bool = False) -> torch.Tensor:
        context = self.encoder(c)
        context = context.detach() if detach else context
        for layer in self.layers:
            x = layer(x, context) if self.positional else layer(x, context=context)
        return x


def test_layer_arguments_that_require_grad_are_refused():
    x, c = torch.randn(2, 8), torch.randn(2, 8)
    for positional, named in ((False, "'context'"), (True, "argument 1")):
        model = make_reversible(_CrossModel(positional), blocks="layers", trainable="all")
        with pytest.raises(InvalidArgumentError, match=f"layers.0 was called with {named}"):
            model(x, c)
        model(x, c, detach=True).pow(2).sum().backward()  # a constant context is fine
        with torch.no_grad():
            model(x, c)
        reversible_layers(model).reversible = False  # plain autograd takes it
        model(x, c).pow(2).sum().backward()
        assert model.encoder.weight.grad is not None


def test_a_model_cast_after_conversion_computes_in_its_new_dtype():
    """Converted in float32 with a scale the grid cannot take (a floating-point rebuild),
    cast to float64 (and bfloat16) afterwards: the layers, adapters and anchors follow;
    float64 gradients equal plain autograd's of the same model."""
    case = zoo.CASES["gpt2"]
    model = case.make_model()
    make_reversible(model, blocks=case.blocks_path, scale=0.1, trainable="all")
    torch.manual_seed(3)
    for n, p in model.named_parameters():
        if "revckpt_adapter" in n:
            p.data.normal_(0, 0.05)
    model.double()
    example = case.make_example()
    with torch.no_grad():
        assert _logits(model, example).dtype == torch.float64
    loss = zoo.step(model, example, None)
    assert reversible_layers(model).stack.anchor_every is None  # float64: no anchors at depth 4
    reversible = _grads(model)
    model.zero_grad(set_to_none=True)
    reversible_layers(model).reversible = False
    plain_loss = zoo.step(model, example, None)
    plain = _grads(model)
    assert abs(loss.item() - plain_loss.item()) < 1e-12
    for n, g in plain.items():
        torch.testing.assert_close(reversible[n], g, rtol=1e-10, atol=1e-12, msg=n)
    reversible_layers(model).reversible = True
    model.zero_grad(set_to_none=True)
    model.to(torch.bfloat16)
    with pytest.warns(ReconstructionWarning, match="cast after conversion"):
        logits = model(example["input_ids"]).logits
    assert logits.dtype == torch.bfloat16
    assert reversible_layers(model).stack.anchor_every == 1  # bfloat16: an anchor per layer
    logits.float().pow(2).mean().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    narrow = make_reversible(
        zoo.CASES["nanogpt"].make_model().bfloat16(), blocks="transformer.h",
        stream_dtype=torch.float32,
    ).double()  # fmt: skip
    with pytest.raises(InvalidArgumentError, match="stream_dtype"):
        narrow(zoo.CASES["nanogpt"].make_example()[0])


def test_the_cache_warning_is_once_per_conversion():
    case = zoo.CASES["gpt2"]
    example = case.make_example()
    for _ in range(2):  # a second conversion warns again, once
        model = make_reversible(case.make_model(), blocks=case.blocks_path, trainable="all")
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            for _ in range(2):
                model(**example, use_cache=True).loss.backward()
        cache = [w for w in seen if "key/value cache" in str(w.message)]
        assert len(cache) == 1, [str(w.message) for w in cache]
        assert "make_reversible(transformer.h.0 .. transformer.h.3)" in str(cache[0].message)


class _EarlyExit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8)) for _ in range(4)
        )

    def forward(self, x: torch.Tensor, order: list[int]) -> torch.Tensor:
        for i in order:
            x = x + self.layers[i](x) if i == -1 else self.layers[i](x)
        return x


def test_an_early_exit_gets_a_clear_error():
    """A forward that returns before the last converted layer, or starts the stack again
    midway, gets a RevckptError in backward (not a gradient rebuilt from nothing)."""
    torch.manual_seed(4)
    model = make_reversible(_EarlyExit(), blocks="layers", trainable="all")
    x = torch.randn(2, 8)
    for order in ([0, 1], [0, 1, 0, 1, 2, 3]):
        with pytest.raises(RevckptError, match=r"stopped before its last layer layers\.3"):
            model(x, order).pow(2).sum().backward()
    model.zero_grad(set_to_none=True)
    model(x, [0, 1])  # an early exit left behind does not disturb the next full pass
    model(x, [0, 1, 2, 3]).pow(2).sum().backward()
    reversible = _grads(model)
    model.zero_grad(set_to_none=True)
    reversible_layers(model).reversible = False
    model(x, [0, 1, 2, 3]).pow(2).sum().backward()
    for n, g in _grads(model).items():
        torch.testing.assert_close(reversible[n], g, msg=n)
    with pytest.raises(RevckptError, match="out of order"):
        model(x, [0, 2])


def test_t5s_position_bias_needs_its_weights_frozen():
    """T5's first layer returns the relative position bias its weights make, and the model
    hands it to every later layer: with those weights trainable a reversible stack cannot
    carry it (a clear error says so); frozen (trainable="adapters"), float64 gradients equal
    plain autograd's of the same converted model."""
    transformers = pytest.importorskip("transformers")
    config = transformers.T5Config(
        vocab_size=64, d_model=32, d_ff=64, num_layers=3, num_heads=4, d_kv=8,
        dropout_rate=0.0, use_cache=False,
    )  # fmt: skip
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    trainable_bias = make_reversible(transformers.T5EncoderModel(config), trainable="all")
    with pytest.raises(InvalidArgumentError, match="position bias"):
        trainable_bias(input_ids=ids)
    torch.manual_seed(0)
    model = make_reversible(transformers.T5EncoderModel(config).double())
    for n, p in model.named_parameters():
        if "revckpt_adapter" in n and p.requires_grad:
            p.data.normal_(0, 0.05)
    grads = []
    for reversible in (True, False):
        reversible_layers(model).reversible = reversible
        model.zero_grad(set_to_none=True)
        model(input_ids=ids).last_hidden_state.pow(2).mean().backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for n, g in grads[1].items():
        torch.testing.assert_close(grads[0][n], g, rtol=1e-10, atol=1e-12, msg=n)


def test_torch_compile_runs_the_converted_model():
    """torch.compile over a converted model (graph breaks at the stack's Python) gives the
    eager gradients to float32 round-off."""
    case = zoo.CASES["nanogpt"]
    model = make_reversible(case.make_model(), blocks=case.blocks_path, trainable="all")
    for n, p in model.named_parameters():
        if "revckpt_adapter" in n:
            p.data.normal_(0, 0.05)
    example = case.make_example()
    zoo.step(model, example, case.loss_fn)
    eager = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    compiled = torch.compile(model)
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        zoo.step(compiled, example, case.loss_fn)
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert got.keys() == eager.keys()
    for n, g in eager.items():
        torch.testing.assert_close(got[n], g, rtol=1e-4, atol=1e-6, msg=n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_exact_streams_rebuild_bitwise_and_keep_no_anchor(dtype):
    """exact=True: float32 or bfloat16 layers, streams on the float64 grid; every rebuilt
    input exact (drift 0, no anchors, even at scale 2^-8 in bfloat16), gradients bitwise
    plain autograd's of the same converted model, the start as without it."""
    case = zoo.CASES["gpt2"]
    example = case.make_example()
    start = {}
    for exact in (False, True):
        model = case.make_model().to(dtype)
        with torch.no_grad():
            before = _logits(model, example).float()
        make_reversible(model, blocks=case.blocks_path, scale=2**-8, trainable="all", exact=exact)
        with torch.no_grad():
            after = _logits(model, example).float()
        start[exact] = float((after - before).norm() / before.norm())
    layers = reversible_layers(model)
    assert layers.stack.anchor_every is None and layers.exact
    torch.manual_seed(1)
    for n, p in model.named_parameters():
        if "revckpt_adapter" in n:
            p.data.normal_(0, 0.05)
    loss = zoo.step(model, example, None)
    assert all(d == 0.0 for d in layers.last_drift if d is not None)
    reversible = _grads(model)
    model.zero_grad(set_to_none=True)
    layers.reversible = False
    assert torch.equal(zoo.step(model, example, None), loss)
    for n, g in _grads(model).items():
        assert torch.equal(reversible[n], g), n
    assert abs(start[True] - start[False]) <= 1e-2 * start[False] + 1e-6, start


def test_exact_streams_refuse_what_does_not_apply():
    case = zoo.CASES["nanogpt"]
    for options, match in (
        ({"scale": 0.3}, "power of two"),
        ({"stream_dtype": torch.float64}, "stream_dtype"),
        ({"anchor_every": 2}, "anchor_every"),
    ):
        with pytest.raises(InvalidArgumentError, match=match):
            make_reversible(case.make_model(), blocks=case.blocks_path, exact=True, **options)


def test_exact_streams_under_torch_compile_rebuild_bitwise():
    """torch.compile over an exact stack: the branches' first forwards run eagerly (a compiled
    forward rounds differently from the eager re-run in backward, and the rebuild multiplies
    that by 1 / scale per layer: drift 2e7 at eight layers and 2^-8 before), so drift stays 0
    and the gradients are the eager ones, bitwise."""
    case = zoo.CASES["nanogpt"]
    model = make_reversible(
        case.make_model(), blocks=case.blocks_path, scale=2**-8, trainable="all", exact=True
    )
    torch.manual_seed(1)
    for n, p in model.named_parameters():
        if "revckpt_adapter" in n:
            p.data.normal_(0, 0.05)
    example = case.make_example()
    zoo.step(model, example, case.loss_fn)
    eager = _grads(model)
    compiled = torch.compile(model)
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        zoo.step(compiled, example, case.loss_fn)
    assert all(d == 0.0 for d in reversible_layers(model).last_drift if d is not None)
    got = _grads(model)
    for n, g in eager.items():
        assert torch.equal(got[n], g), n


@pytest.mark.parametrize("exact", [False, True])
def test_intermediate_hidden_states_keep_the_models_dtype(exact):
    """output_hidden_states=True on a float32 model with float64 streams (exact=True, or
    stream_dtype): the hidden states between layers come back float32, so a loss through the
    model's own head on one of them runs, with gradients bitwise the stored mode's."""
    case = zoo.CASES["gpt2"]
    model = case.make_model()
    options = {"exact": True} if exact else {"stream_dtype": torch.float64}
    make_reversible(model, blocks=case.blocks_path, scale=2**-3, trainable="all", **options)
    layers, example = reversible_layers(model), case.make_example()
    grads = {}
    for mode in ("reversible", "store"):
        layers.mode = mode
        model.zero_grad(set_to_none=True)
        out = model(**example, output_hidden_states=True)
        assert {h.dtype for h in out.hidden_states} == {torch.float32}
        (out.loss + model.lm_head(out.hidden_states[2]).pow(2).mean()).backward()
        grads[mode] = _grads(model)
    for n, g in grads["store"].items():
        if exact:
            assert torch.equal(grads["reversible"][n], g), n
        else:
            torch.testing.assert_close(grads["reversible"][n], g, rtol=1e-4, atol=1e-6, msg=n)


def test_fit_on_a_stack_refuses_a_larger_batch_in_training():
    """fit's budget holds for batches no larger than its example: on a converted model, as on
    a planned one, a larger hidden state is refused in training (not in eval or no_grad); a
    later fit on the larger batch, or limit = None, lifts it."""
    case = zoo.CASES["nanogpt"]
    model = make_reversible(case.make_model(), blocks=case.blocks_path, exact=True)
    layers = reversible_layers(model)
    small, large = case.make_example(batch=2), case.make_example(batch=4)
    revckpt.fit(model, small, memory_budget=1.0, loss_fn=case.loss_fn)
    zoo.step(model, case.make_example(batch=1), case.loss_fn)  # smaller: as planned
    with pytest.raises(InvalidArgumentError, match="largest batch you train on"):
        zoo.step(model, large, case.loss_fn)
    with torch.no_grad():
        model(*large)
    revckpt.fit(model, large, memory_budget=1.0, loss_fn=case.loss_fn)
    zoo.step(model, large, case.loss_fn)
    revckpt.fit(model, small, memory_budget=1.0, loss_fn=case.loss_fn)
    layers.limit = None
    zoo.step(model, large, case.loss_fn)


def test_fit_on_a_stack_refuses_a_wider_dtype_in_training():
    """As for a larger batch: model.double() after a float32 fit doubles what the step keeps
    (it ran on silently, past the budget); a narrower dtype runs, limit = None lifts it."""
    case = zoo.CASES["nanogpt"]
    model = make_reversible(case.make_model(), blocks=case.blocks_path, exact=True)
    example = case.make_example(batch=2)
    plan = revckpt.fit(model, example, memory_budget=1.0, loss_fn=case.loss_fn)
    assert plan.block_dtypes == ("float32",) * plan.length
    model.double()
    with pytest.raises(InvalidArgumentError, match=r"for torch\.float32 hidden states and got"):
        zoo.step(model, example, case.loss_fn)
    reversible_layers(model).limit = None
    zoo.step(model, example, case.loss_fn)
    revckpt.fit(model, example, memory_budget=1.0, loss_fn=case.loss_fn)  # a fit in float64
    model.float()  # narrower: runs
    zoo.step(model, example, case.loss_fn)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plan = revckpt.fit(model, example, memory_budget=1.0, loss_fn=case.loss_fn)
        zoo.step(model, example, case.loss_fn)
    assert plan.autocast == "bfloat16"
    with pytest.raises(InvalidArgumentError, match=r"under torch\.autocast in torch\.bfloat16"):
        zoo.step(model, example, case.loss_fn)  # without it: wider activations


def test_exact_auto_rebuilds_sixteen_bit_layers_exactly():
    """exact="auto" (the default): a bfloat16 or float16 model is converted exact (a floating
    rebuild there drifts past 1e-2 even with an anchor per layer), its gradients bitwise plain
    autograd's; so is a float32 model (at 2^-8 a floating rebuild needs an anchor per layer)
    and a float64 one (an anchored rebuild's gradients are off by 1e-8); the float options (an
    anchor_every number, stream_dtype) or exact=False keep it too; a 16-bit model with a scale
    the grid cannot take warns and rebuilds in floating point."""
    case = zoo.CASES["gpt2"]
    for dtype in (torch.bfloat16, torch.float16):
        model = make_reversible(case.make_model().to(dtype), blocks=case.blocks_path)
        layers = reversible_layers(model)
        assert layers.exact and layers.stack.anchor_every is None, dtype
        example = case.make_example()
        zoo.step(model, example, None)
        assert max(d for d in layers.last_drift if d is not None) == 0.0
        rebuilt = _grads(model)
        model.zero_grad(set_to_none=True)
        layers.reversible = False
        zoo.step(model, example, None)
        for n, g in _grads(model).items():
            assert torch.equal(rebuilt[n], g), (dtype, n)
    assert reversible_layers(make_reversible(case.make_model(), blocks=case.blocks_path)).exact
    double = make_reversible(case.make_model().double(), blocks=case.blocks_path)
    assert reversible_layers(double).exact
    for options in ({"anchor_every": 2}, {"stream_dtype": torch.float64}, {"exact": False}):
        model = make_reversible(case.make_model().bfloat16(), blocks=case.blocks_path, **options)
        assert not reversible_layers(model).exact, options
    with pytest.warns(ReconstructionWarning, match="scale=0.1"):
        model = make_reversible(case.make_model().bfloat16(), blocks=case.blocks_path, scale=0.1)
    assert not reversible_layers(model).exact
    with pytest.raises(InvalidArgumentError, match="exact="):
        make_reversible(case.make_model(), blocks=case.blocks_path, exact="yes")
    with pytest.raises(InvalidArgumentError, match=r"in \(0, 1\]"):
        make_reversible(case.make_model(), blocks=case.blocks_path, scale=1.5)


def test_layer_outputs_besides_the_hidden_state_are_values():
    """BLOOM's layers return their attention weights whether asked or not (the model drops
    them): they come back detached, so the model trains, its float64 gradients plain
    autograd's; a loss on them (output_attentions=True) raises in backward, naming them."""
    transformers = pytest.importorskip("transformers")
    config = transformers.BloomConfig(vocab_size=64, hidden_size=32, n_layer=3, n_head=4)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    model = make_reversible(transformers.BloomForCausalLM(config).double(), trainable="all")
    grads = []
    for reversible in (True, False):
        reversible_layers(model).reversible = reversible
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for n, g in grads[1].items():
        torch.testing.assert_close(grads[0][n], g, rtol=1e-10, atol=1e-12, msg=n)
    reversible_layers(model).reversible = True
    out = model(input_ids=ids, output_attentions=True, use_cache=False)
    loss = out.logits.sum() + sum(a.sum() for a in out.attentions)
    with pytest.raises(RevckptError, match="output item 1"):
        loss.backward()


class _ConvBlock(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.c1, self.n1 = nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c)
        self.c2 = nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.c2(torch.relu(self.n1(self.c1(x))))


def test_channels_first_layers_get_adapters_over_their_channels():
    """A CNN's (N, C, H, W) hidden state: the width comes from its BatchNorm2d, so the
    adapters act on dimension 1 (1x1 convolutions over the channels), whatever the image
    size; float64 gradients are plain autograd's. A stated feature_dim that does not fit the
    hidden state is refused naming both options."""
    torch.manual_seed(0)
    body = nn.Sequential(*[_ConvBlock(6) for _ in range(3)])
    model = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), body, nn.AdaptiveAvgPool2d(1))
    model = make_reversible(model.double(), blocks="1", trainable="all", scale=2**-3)
    adapter = body[1].revckpt_adapter_f
    assert reversible_layers(model).feature_dim == 1 and adapter.dim == 1
    for n, p in model.named_parameters():
        if "revckpt_adapter" in n:
            p.data.normal_(0, 0.1)
    u = torch.randn(2, 6, 5, 7, dtype=torch.float64)
    per_pixel = adapter.up(adapter.act(adapter.down(u.movedim(1, -1)))).movedim(-1, 1)
    torch.testing.assert_close(adapter(u), per_pixel)
    x = torch.randn(2, 3, 9, 11, dtype=torch.float64)
    grads = []
    for reversible in (True, False):
        reversible_layers(model).reversible = reversible
        model.zero_grad(set_to_none=True)
        model(x).pow(2).sum().backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    for n, g in grads[1].items():
        torch.testing.assert_close(grads[0][n], g, rtol=1e-10, atol=1e-12, msg=n)
    wrong = nn.Sequential(*[_ConvBlock(6) for _ in range(2)])
    make_reversible(wrong, feature_dim=-1)
    with pytest.raises(InvalidArgumentError, match="feature_dim="):
        wrong(torch.randn(1, 6, 4, 4))


def test_fit_on_a_stack_records_no_negative_overhead(monkeypatch):
    """A mode that recomputes can time faster than storing everything on a loaded machine
    (noise); fit then records no overhead rather than refusing its own plan."""
    import revckpt
    from revckpt.inplace import fit_stack

    case = zoo.CASES["gpt2"]
    model = make_reversible(case.make_model(), blocks=case.blocks_path, trainable="all")
    monkeypatch.setattr(
        fit_stack, "_ratios", lambda *a, **k: {"checkpoint": 0.98, "reversible": 0.97}
    )
    plan = revckpt.fit(model, case.make_example(), memory_budget=0.9)
    assert plan.predicted_overhead == 0.0 and plan.strategies[0] == "reversible"


def test_a_refused_conversion_leaves_the_model_as_it_was():
    """A width make_reversible cannot read (no norm) or a bad feature_dim is refused before
    anything is frozen or added (trainable="adapters" froze the layers first)."""
    model = nn.Sequential(*[_Residual(4) for _ in range(2)])
    for options in ({}, {"feature_dim": "x"}):
        with pytest.raises(InvalidArgumentError):
            make_reversible(model, **options)
        assert all(p.requires_grad for p in model.parameters()), options
        assert not any("revckpt_adapter" in n for n, _ in model.named_modules())


class _Residual(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(x)


def test_an_anchor_on_every_layer_is_said():
    """A floating-point rebuild whose automatic anchors land on every layer keeps as much as
    storing every layer's input: converted so (exact=False at 2^-8 in float32), or converted
    in float64 (no anchor there at this depth) and cast to float32, it warns once; the exact
    rebuild, and a scale whose anchors are sparser, do not."""
    case = zoo.CASES["gpt2"]
    example = case.make_example()
    model = make_reversible(case.make_model(), blocks=case.blocks_path, exact=False)
    with pytest.warns(ReconstructionWarning, match="anchor on every layer"):
        zoo.step(model, example, None)
    assert reversible_layers(model).stack.anchor_every == 1
    double = make_reversible(case.make_model().double(), blocks=case.blocks_path, exact=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ReconstructionWarning)
        zoo.step(double, example, None)  # float64: sparser anchors
        for options in ({}, {"exact": False, "scale": 2**-3}):
            zoo.step(make_reversible(case.make_model(), blocks=case.blocks_path, **options),
                     example, None)  # fmt: skip
    double.float()
    with pytest.warns(ReconstructionWarning, match=r"torch\.float32 at scale=0\.00390625"):
        zoo.step(double, example, None)


def test_a_16_bit_float_rebuild_anchored_on_every_layer_trains():
    """exact=False in bfloat16 at the default scale anchors every layer, so no gradient uses
    a rebuilt input: the stack says so at its first forward (as in float32) and trains, with
    the gradients of storing every layer (the default inverse check's tolerance follows the
    1 / scale the one rebuild left amplifies its rounding by) rather than raising about a
    one-block drift nothing uses."""
    case = zoo.CASES["gpt2"]
    example = case.make_example()
    model = make_reversible(
        case.make_model().bfloat16(), blocks=case.blocks_path, trainable="all", exact=False
    )
    layers = reversible_layers(model)
    grads = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for mode in ("reversible", "store"):
            layers.mode = mode
            model.zero_grad(set_to_none=True)
            zoo.step(model, example, None)
            grads[mode] = _grads(model)
    said = [w for w in caught if issubclass(w.category, ReconstructionWarning)]
    assert len(said) == 1, [str(w.message) for w in said]  # once, at the first forward
    assert layers.stack.anchor_every == 1
    assert "anchor on every layer" in str(said[0].message)
    assert grads["store"].keys() == grads["reversible"].keys()
    store, rev = grads["store"], grads["reversible"]
    diff = sum((rev[n].double() - g.double()).norm() ** 2 for n, g in store.items())
    ref = sum(g.double().norm() ** 2 for g in store.values())
    assert (diff / ref) ** 0.5 < 2e-2  # bfloat16 round-off of a recompute (2.6e-3 measured)
    # a branch whose recompute differs is still refused: the check widened by 1 / scale only
    layers.mode = "reversible"
    calls = [0]

    def drift(module, args, out):
        calls[0] += 1
        return out + 0.25 if calls[0] == 2 else None  # the recompute in backward differs

    handle = layers.layers[1][1].mlp.register_forward_hook(drift)
    try:
        with pytest.raises(revckpt.ReconstructionError, match="reversible block 1"):
            zoo.step(model, example, None)
    finally:
        handle.remove()


@pytest.mark.parametrize(
    "options",
    [dict(rank=0), dict(exact=False, anchor_every=0), dict(check_inverse=-1.0)],
)
def test_a_refused_option_leaves_the_model_as_it_was(options):
    # the layers were frozen and the adapters added before the adapters or the stack checked
    # their options: restore() had nothing to undo, and a retry recorded requires_grad=False
    model = _Layers()
    keys = set(model.state_dict())
    with pytest.raises(InvalidArgumentError):
        make_reversible(model, blocks="layers", **options)
    assert set(model.state_dict()) == keys
    assert all(p.requires_grad for p in model.parameters())
    make_reversible(model, blocks="layers")
    revckpt.restore(model)
    assert set(model.state_dict()) == keys
    assert all(p.requires_grad for p in model.parameters())


def test_a_stack_anchored_at_every_layer_says_so_when_its_check_fails():
    # scale 2^-20 (a floating-point rebuild, anchors on every layer): the message said to
    # anchor more often (anchor_every=1 already). The check stays: the branches' gradients
    # come from their recompute, which it guards. One layer's rebuild rounds to 8e-2 off at
    # this scale, within the check's tolerance for it (4 eps / scale: the rebuild's rounding
    # is amplified by 1 / scale, as is a recompute's difference)
    case = zoo.CASES["gpt2"]
    example = case.make_example(2, 16)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = make_reversible(case.make_model(), trainable="all", scale=2**-20)
        zoo.step(model, example, case.loss_fn)
    layers = reversible_layers(model)
    assert layers.stack.anchor_every == 1
    assert 1e-2 < max(d for d in layers.last_drift if d is not None) < 0.5
    calls = [0]

    def drift(module, args, out):
        calls[0] += 1
        return out * (1 + 2**-12) if calls[0] == 2 else None  # the recompute differs

    layers.layers[1][1].mlp.register_forward_hook(drift)
    with pytest.raises(revckpt.ReconstructionError, match="anchored already"):
        zoo.step(model, example, case.loss_fn)


@pytest.mark.parametrize("scale", [2**-8, "auto"])
def test_a_conversion_refused_on_the_example_leaves_the_model_as_it_was(scale):
    # with a scale given, the converted model's forward on example= was refused and the model
    # stayed converted (adapters in the state_dict, layers frozen)
    class Scaled(_Layers):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = layer(x) * 0.5  # refused: changes the hidden state between layers
            return x

    model = Scaled()
    keys = set(model.state_dict())
    with pytest.raises(RevckptError, match="did not get the hidden state"):
        make_reversible(model, blocks="layers", scale=scale, example=torch.randn(2, 8))
    assert set(model.state_dict()) == keys and all(p.requires_grad for p in model.parameters())
    assert revckpt.restore(model) == 0


class _Part(nn.Module):
    def __init__(self, halve: bool = False) -> None:
        super().__init__()
        self.halve = halve
        self.layers = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8)) for _ in range(3)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x) * (0.5 if self.halve else 1)  # halve: refused once converted
        return x


@pytest.mark.parametrize("scale", [2**-8, "auto"])
def test_a_refused_second_stack_leaves_the_first_as_it_was(scale):
    # the undo removed every stack of the model (scale="auto": the first one's adapters were
    # dropped), or none when another existed (a scale given: the refused one stayed)
    model = nn.Sequential(_Part(), _Part(halve=True))
    make_reversible(model[0], blocks="layers", scale=2**-8)
    keys = set(model.state_dict())
    with pytest.raises(RevckptError, match="did not get the hidden state"):
        make_reversible(model, blocks="1.layers", scale=scale, example=torch.randn(2, 8))
    assert set(model.state_dict()) == keys
    assert all(p.requires_grad for p in model[1].parameters())
    assert reversible_layers(model[0]).scale == 2**-8


def test_a_layer_output_besides_the_hidden_state_keeps_its_gradient_by_autograd():
    # T5's first layer returns the position bias its later layers take: refused in reversible
    # mode (documented), and the way out the message names (reversible = False) raised the
    # same error, the bias still cut from its gradient
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.T5Config(d_model=16, d_ff=32, num_layers=2, num_decoder_layers=1,
                                   num_heads=2, d_kv=8, vocab_size=64, decoder_start_token_id=0,
                                   pad_token_id=0, use_cache=False, dropout_rate=0.0)  # fmt: skip
    model = transformers.T5ForConditionalGeneration(config).double()
    ids, labels = torch.randint(1, 64, (2, 8)), torch.randint(1, 64, (2, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        make_reversible(model, trainable="all", blocks="encoder.block")
    layers = reversible_layers(model)
    with pytest.raises(InvalidArgumentError, match="reversible = False"):
        model(input_ids=ids, labels=labels)
    grads = {}
    for mode in ("store", "checkpoint"):
        layers.mode = mode
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=labels).loss.backward()
        grads[mode] = _grads(model)
    bias = "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
    assert grads["store"][bias].abs().sum() > 0
    for name, g in grads["store"].items():
        torch.testing.assert_close(grads["checkpoint"][name], g, rtol=1e-12, atol=1e-14)


class _Gated(nn.Module):
    """A residual conv block whose output is a broadcast with an (N, C, 1, 1) gate: it came out
    channels-last, and so did the stream that took its layout."""

    def __init__(self, c: int = 8) -> None:
        super().__init__()
        self.conv, self.norm, self.gate = (
            nn.Conv2d(c, c, 3, padding=1),
            nn.BatchNorm2d(c),
            nn.Conv2d(c, c, 1),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.conv(x))
        return torch.relu(x + h * torch.sigmoid(self.gate(h.mean((2, 3), keepdim=True))))


def test_a_cnn_whose_layers_return_another_layout_is_rebuilt_bit_for_bit():
    # the streams took the branch outputs' layout in backward: the next branch's recompute
    # picked other kernels (rebuild 5.5e-5 off, gradients 1e-2 off, and no error: the default
    # check's tolerance was 1e-2 for an exact stack too; any drift is refused now)
    torch.manual_seed(0)
    model = nn.Sequential(*[_Gated() for _ in range(3)])
    make_reversible(model, trainable="all", scale=2**-7)
    layers = reversible_layers(model)
    x = torch.randn(4, 8, 8, 8)
    grads = {}
    for mode in ("store", "reversible"):
        layers.mode = mode
        model.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        grads[mode] = _grads(model)
    assert layers.last_drift[0] == 0.0
    for name, g in grads["store"].items():
        assert torch.equal(grads["reversible"][name], g), name


def test_a_conversion_is_found_from_a_part_of_the_model_it_was_made_on():
    """peft's ``merge_and_unload()`` returns the base model, still converted, while the
    conversion was recorded on the peft wrapper: ``convert`` accepted it and dropped the
    trained adapters (52 of 66 gradients changed), ``reversible_layers`` said it was not
    converted."""
    model = make_reversible(_Holding(_Layers()), blocks="inner.layers", trainable="all")
    inner, x = model.inner, torch.randn(2, 8)
    with pytest.raises(InvalidArgumentError, match="holds a reversible stack"):
        revckpt.convert(inner, "checkpoint", module_filter_fn=lambda m, n: n.startswith("layers."))
    assert reversible_layers(inner) is reversible_layers(model)
    assert reversible_layers(_Holding(model)) is reversible_layers(model)  # a wrapper added after
    inner(x).sum().backward()  # still the converted function, adapters trained
    assert model.inner.layers[0].revckpt_adapter_f.up.weight.grad is not None


class _LoraLike(nn.Module):
    """What peft puts in place of a linear layer: the frozen base and two trainable factors."""

    def __init__(self, base: nn.Linear) -> None:
        super().__init__()
        self.base_layer = base.requires_grad_(False)
        self.a = nn.Parameter(torch.randn(2, base.in_features) * 0.01)
        self.b = nn.Parameter(torch.zeros(base.out_features, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x) + x @ self.a.t() @ self.b.t()


def test_restore_leaves_frozen_what_a_library_added_after_the_conversion_trains_beside():
    """``make_reversible`` then peft then ``restore``: the base weights make_reversible froze
    were given back ``requires_grad=True`` (48 base weights trained, moved by AdamW)."""
    model = make_reversible(_Layers())
    for layer in model.layers:
        layer[1] = _LoraLike(layer[1])
    with pytest.warns(UserWarning, match="stay frozen"):
        revckpt.restore(model)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {f"layers.{i}.1.{f}" for i in range(3) for f in ("a", "b")}
    plain = make_reversible(_Layers())
    revckpt.restore(plain)  # nothing added after: every parameter trains again
    assert all(p.requires_grad for p in plain.parameters())


def test_a_cache_holding_keys_before_the_layer_runs_is_refused_in_training():
    """peft's prefix tuning passes its trainable prefix as a filled cache; revckpt dropped it
    in training (a raw shape error inside the attention, or fit blaming the batch)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = zoo.deeper("gpt2", 2)().train()
    cfg = model.config
    head = cfg.n_embd // cfg.n_head
    prefix = transformers.DynamicCache()
    for i in range(cfg.n_layer):
        kv = torch.randn(1, cfg.n_head, 3, head)
        prefix.update(kv, kv.clone(), i)
    ids = torch.randint(0, zoo.VOCAB, (1, 5))
    mask = torch.ones(1, 8, dtype=torch.long)
    revckpt.convert(model, "checkpoint")
    with pytest.raises(InvalidArgumentError, match="holds keys and values already"):
        model(input_ids=ids, attention_mask=mask, cache=prefix, use_cache=True)


def test_a_model_with_planned_blocks_is_refused_until_restored():
    """``make_reversible`` after ``convert``/``fit`` was accepted; ``restore`` then left each
    layer calling a removed plan (a raw ``KeyError``)."""
    model = _Layers()
    revckpt.convert(model, "checkpoint")
    with pytest.raises(InvalidArgumentError, match="planned by revckpt"):
        make_reversible(model)
    revckpt.restore(model)
    make_reversible(model)(torch.randn(2, 8)).sum().backward()


def test_restore_gives_requires_grad_back_to_parameters_replaced_since_the_conversion():
    """``load_state_dict(assign=True)`` or ``to_empty`` after the conversion: restore gave
    ``requires_grad`` back to the parameter objects it froze, gone from the model, and every
    layer weight stayed frozen."""
    source = make_reversible(_Layers())
    for how in ("assign", "to_empty"):
        model = make_reversible(_Layers())
        if how == "assign":
            model.load_state_dict(source.state_dict(), assign=True)
        else:
            model.to("meta").to_empty(device="cpu").load_state_dict(source.state_dict())
        revckpt.restore(model)
        assert all(p.requires_grad for p in model.parameters()), how


def test_restore_keeps_a_forward_wrapper_added_after_the_conversion():
    """accelerate's ``add_hook_to_module`` (or ``layer.forward = wrap(layer.forward)``) after
    ``make_reversible`` or ``convert``: ``restore`` dropped the wrapper, logits moved by 0.74."""

    def shifted(layer: nn.Module) -> None:
        inner = layer.forward
        layer.forward = lambda *a, **k: inner(*a, **k) + 1.0

    x = torch.randn(2, 8)
    plain = _Layers()
    expected_model = copy.deepcopy(plain)
    shifted(expected_model.layers[1])
    expected = expected_model(x)
    for how in ("make_reversible", "convert", "convert again"):
        model = copy.deepcopy(plain)
        if how == "make_reversible":
            make_reversible(model, trainable="all", scale=1.0, exact=False)
        else:
            revckpt.convert(model, "checkpoint")
        shifted(model.layers[1])
        if how == "convert again":
            revckpt.convert(model, "checkpoint")
            model(x).sum().backward()
        revckpt.restore(model)
        torch.testing.assert_close(model(x), expected, msg=how)


def test_a_layer_held_twice_is_refused_and_an_alias_elsewhere_is_not():
    model = _Layers()
    model.layers[2] = model.layers[0]
    with pytest.raises(InvalidArgumentError, match="the same layer twice"):
        make_reversible(model)
    aliased = _Layers()
    aliased.first = aliased.layers[0]  # a second name outside the layers' container
    make_reversible(aliased, blocks="layers")(torch.randn(2, 8)).sum().backward()


def test_a_cache_slot_that_keeps_nothing_counts_as_fresh():
    """transformers' ``DummyLayer`` (a layer reusing another's keys, NemotronH's MLP layers)
    has no ``get_seq_length``: training with the default ``use_cache=True`` raised a raw
    ``AttributeError`` once filled caches were refused."""
    transformers = pytest.importorskip("transformers")
    from transformers.cache_utils import DummyLayer

    from revckpt.inplace.calls import drop_caches

    cache = transformers.DynamicCache()
    cache.layers = [DummyLayer(), *cache.layers]
    _, kwargs = drop_caches((), {"cache": cache, "use_cache": True}, "Layer (h.0)", warn=False)
    assert kwargs == {"cache": None, "use_cache": False}


def test_restore_leaves_frozen_what_a_prefix_added_outside_the_layers_trains_beside():
    model = make_reversible(_Layers())
    model.prefix = nn.Parameter(torch.zeros(8))  # peft's prefix or prompt: outside the layers
    with pytest.warns(UserWarning, match="stay frozen"):
        revckpt.restore(model)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {"prefix"}


def test_planned_blocks_outside_the_layers_converted_are_fine_and_a_renamed_weight_thaws():
    model = _Holding(_Layers())
    model.head = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    revckpt.convert(model, "checkpoint", module_filter_fn=lambda m, n: n.startswith("head."))
    make_reversible(model, blocks="inner.layers")  # the plan is on other blocks
    from torch.nn.utils import parametrize

    class Same(nn.Module):
        def forward(self, w):
            return w

    # moves the weight, the same object, to parametrizations.weight.original
    parametrize.register_parametrization(model.inner.layers[0][1], "weight", Same())
    revckpt.restore(model)
    assert all(p.requires_grad for p in model.parameters())


@pytest.mark.parametrize("change", ["hook", "freeze"])
def test_a_hooked_or_newly_frozen_weight_leaves_the_model_its_parameters(change):
    """A base weight with a hook (p.register_hook), or frozen between the forward and the
    backward, makes the rebuild run through detached aliases. The layer holds the adapter its
    other branch runs, so the alias swap reached that adapter by two paths, and torch's
    restore left the alias in the model: its adapter lost its gradient, and the model then
    trained a detached copy (its parameters no longer the optimizer's)."""
    case, _, model = _converted("gpt2", trainable="all")
    example = case.make_example()
    stack = reversible_layers(model)
    weight = stack.layers[0][1].attn.c_attn.weight
    before = dict(model.named_parameters())
    results = []
    for mode in ("store", "reversible"):
        stack.mode = mode
        model.zero_grad(set_to_none=True)
        if change == "hook":
            handle = weight.register_hook(lambda g: g)
        out = model(**example) if isinstance(example, dict) else model(*example)
        loss = out.loss if hasattr(out, "loss") else out[0].sum()
        if change == "freeze":
            weight.requires_grad_(False)
        loss.backward()
        weight.requires_grad_(True)
        if change == "hook":
            handle.remove()
        results.append({n: p.grad for n, p in model.named_parameters()})
        now = dict(model.named_parameters())
        assert all(now[n] is p for n, p in before.items())
    for name, ref in results[0].items():
        got = results[1][name]
        assert (got is None) == (ref is None), name
        if ref is not None:
            torch.testing.assert_close(got, ref)


@pytest.mark.parametrize("exact", [True, False])
def test_a_reversible_model_is_traced_and_exported_for_inference(exact):
    """torch.jit.trace and torch.export of a converted model in eval mode, autograd on (as
    they are usually called) or off: they record the plain forward (the half-step nodes
    carry Python objects a recorded graph cannot hold: 'unordered_map::at'; the exact grid's
    range check reads a value on the host: GuardOnDataDependentSymNode), whose outputs are
    the model's on other inputs too."""
    torch.manual_seed(0)
    model = make_reversible(_Layers(), trainable="all", exact=exact).eval()
    x, other = torch.randn(2, 5, 8), torch.randn(2, 5, 8)
    with torch.no_grad():
        want = model(other)
    for grad in (True, False):
        with torch.set_grad_enabled(grad), warnings.catch_warnings():
            warnings.simplefilter("ignore", torch.jit.TracerWarning)
            traced = torch.jit.trace(model, (x,), check_trace=False)
            exported = torch.export.export(model, (x,)).module()
        with torch.no_grad():
            assert torch.equal(traced(other), want), grad
            assert torch.equal(exported(other), want), grad
    # training still checks the grid's range, and rebuilds as before
    model.train()
    if exact:
        with pytest.raises(revckpt.ReconstructionError, match="grid's range"):
            model(torch.full((2, 5, 8), 2.0**23)).sum().backward()
    model(x).sum().backward()
    assert reversible_layers(model).last_drift[0] == 0.0 or not exact


@pytest.mark.parametrize("exact", [True, False])
def test_the_first_layers_recompute_is_checked_too(exact):
    """The first layer's coupling rebuilt its auxiliary input as zeros whatever the
    recompute gave, so a first layer whose recompute differs went unseen (gradients 0.10
    off, silently), where the same on the second layer raised."""
    case = zoo.CASES["gpt2"]
    example = case.make_example()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = make_reversible(case.make_model(), blocks=case.blocks_path, exact=exact)
        zoo.step(model, example, None)  # as it is: trains
    calls = [0]

    def drift(module, args, out):
        calls[0] += 1
        return out * 1.25 if calls[0] == 2 else None  # the recompute in backward differs

    reversible_layers(model).layers[0][1].mlp.register_forward_hook(drift)
    with pytest.raises(revckpt.ReconstructionError, match="reversible block 0"):
        zoo.step(model, example, None)
