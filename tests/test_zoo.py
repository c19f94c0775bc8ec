"""The model zoo itself: deterministic, trainable end to end, every size runs, blocks found."""

import pytest
import torch
from torch import nn
from zoo import CASES, HF_CASES, blocks, step

# Parameters that legitimately get no gradient from step(), by case. None so far: every
# parameter of every zoo model is used by its training step (tied embeddings count once).
UNUSED: dict[str, frozenset[str]] = {name: frozenset() for name in CASES}

_models: dict[str, nn.Module] = {}


def _case(name):
    if name in HF_CASES:
        pytest.importorskip("transformers")
    return CASES[name]


def _fresh(name):
    """A fresh model per call, deep-copied from one build per case to keep the file fast."""
    import copy

    if name not in _models:
        _models[name] = _case(name).make_model()
    return copy.deepcopy(_models[name])


def _tensors(example):
    if isinstance(example, dict):
        return list(example.values())
    if isinstance(example, tuple):
        return list(example)
    return [example]


def _check_grads(name, model):
    missing = {n for n, p in model.named_parameters() if p.requires_grad and p.grad is None}
    assert missing == UNUSED[name], f"{name}: no gradient for {sorted(missing)}"
    for n, p in model.named_parameters():
        if p.grad is not None:
            assert torch.isfinite(p.grad).all(), f"{name}: non-finite gradient in {n}"


@pytest.mark.parametrize("name", list(CASES))
def test_make_model_is_deterministic(name):
    case = _case(name)
    rng = torch.get_rng_state()
    a, b = case.make_model(), case.make_model()
    assert torch.equal(torch.get_rng_state(), rng), "make_model must leave the global RNG alone"
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    assert a.training
    assert all(p.dtype == torch.float32 for p in a.parameters())


@pytest.mark.parametrize("name", list(CASES))
def test_make_example_is_deterministic(name):
    case = _case(name)
    for x, y in zip(_tensors(case.make_example()), _tensors(case.make_example()), strict=True):
        assert torch.equal(x, y)


@pytest.mark.parametrize("name", list(CASES))
def test_step_trains_every_parameter(name):
    case = _case(name)
    model = _fresh(name)
    loss = step(model, case.make_example(), case.loss_fn)
    assert loss.dim() == 0 and torch.isfinite(loss) and not loss.requires_grad
    _check_grads(name, model)


@pytest.mark.parametrize("name", list(CASES))
def test_smaller_examples_run(name):
    case = _case(name)
    assert len(case.smaller) == 3
    default = case.make_example()
    assert case.make_example(*case.size).__class__ is default.__class__
    for batch, seq in case.smaller:
        assert batch <= case.size[0] and seq <= case.size[1], (batch, seq)
        example = case.make_example(batch, seq)
        for x, d in zip(_tensors(example), _tensors(default), strict=True):
            assert x.dim() == d.dim() and all(a <= b for a, b in zip(x.shape, d.shape, strict=True))
            assert x.shape[0] == batch
        model = _fresh(name)
        loss = step(model, example, case.loss_fn)
        assert torch.isfinite(loss), (batch, seq)
        _check_grads(name, model)


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c.blocks_path])
def test_blocks_path_resolves(name):
    case = _case(name)
    chain = blocks(_fresh(name), case)
    assert isinstance(chain, (nn.ModuleList, nn.Sequential))
    children = list(chain.children())
    assert len(children) >= 2
    assert len({type(c) for c in children}) == 1


@pytest.mark.parametrize("name", sorted(HF_CASES))
def test_hf_output_is_loss_and_logits(name):
    """use_cache=True (the config default) would return every layer's keys and values too."""
    case = _case(name)
    out = _fresh(name)(**case.make_example())
    assert set(out.keys()) == {"loss", "logits"}


def test_resnet_stages():
    case = CASES["resnet"]
    assert case.blocks_path == ""
    model = _fresh("resnet")
    assert blocks(model, case) is model
    stages = [model.get_submodule(f"layer{i}") for i in (1, 2, 3)]
    assert all(isinstance(s, nn.Sequential) and len(s) == 3 for s in stages)
    assert [s[0].downsample is not None for s in stages] == [False, True, True]


@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_hf_padding_is_present(name):
    mask = _case(name).make_example()["attention_mask"]
    assert (mask == 0).any() and (mask == 1).all(dim=1).any()
    assert (mask.sum(dim=1) > 0).all()


def test_encoder_padding_is_present():
    _, padding = CASES["encoder"].make_example()
    assert padding.dtype == torch.bool and padding.any() and not padding.all(dim=1).any()


@pytest.mark.parametrize("name", list(CASES))
def test_default_example_size(name):
    case = _case(name)
    first = _tensors(case.make_example())[0]
    assert first.shape[0] == case.size[0] and first.shape[-1] == case.size[1]
