"""revckpt.checkpoint / checkpoint_sequential with strategy=: every form, the options that do not
apply, and the deprecated spellings (a FutureWarning naming the new call, the same result)."""

import dataclasses
import warnings

import pytest
import torch
from helpers import bitwise_equal, train_step, twin

import revckpt
from revckpt import InvalidArgumentError, InvalidInputTypeError, Strategy
from revckpt.approx import Approx, compress_saved
from revckpt.models import ResidualMLPBlock, mlp_chain
from revckpt.offload import Offload
from revckpt.policy import Selective


def _same(run_old, run_new, model, x, **kwargs):
    other = twin(model)
    with pytest.warns(FutureWarning) as caught:
        old = train_step(model, x, run_old, **kwargs)
    new_call = [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        new = train_step(other, x, run_new, **kwargs)
    assert torch.equal(old[0], new[0]) and torch.equal(old[2], new[2])
    assert bitwise_equal(old[1], new[1])
    return new_call


def _block_and_input():
    torch.manual_seed(0)
    return ResidualMLPBlock(16, 32, dropout=0.2), torch.randn(4, 16, requires_grad=True)


def _chain_and_input():
    torch.manual_seed(0)
    return mlp_chain(4, 16, 32, dropout=0.2), torch.randn(4, 16, requires_grad=True)


# --- deprecated spellings ----------------------------------------------------------------------


def test_checkpoint_policy_alias():
    block, x = _block_and_input()
    said = _same(
        lambda m, z: revckpt.checkpoint(m, z, policy="matmul"),
        lambda m, z: revckpt.checkpoint(m, z, strategy="selective:matmul"),
        block,
        x,
    )
    assert any("strategy='selective:p'" in s for s in said)


def test_checkpoint_sequential_policy_alias():
    chain, x = _chain_and_input()
    said = _same(
        lambda m, z: revckpt.checkpoint_sequential(m, 2, z, policy="matmul"),
        lambda m, z: revckpt.checkpoint_sequential(m, 2, z, strategy="selective:matmul"),
        chain,
        x,
    )
    assert any("strategy='selective:p'" in s for s in said)


def test_checkpoint_sequential_approx_alias():
    chain, x = _chain_and_input()
    said = _same(
        lambda m, z: revckpt.checkpoint_sequential(m, 2, z, approx=Approx(store="bf16")),
        lambda m, z: revckpt.checkpoint_sequential(m, 2, z, strategy=Approx(store="bf16")),
        chain,
        x,
    )
    assert any("strategy=revckpt.approx.Approx(...)" in s for s in said)


def test_approx_checkpoint_alias():
    block, x = _block_and_input()
    said = _same(
        lambda m, z: revckpt.approx.checkpoint(m, z, store="e4m3", scaling="tensor"),
        lambda m, z: revckpt.checkpoint(m, z, strategy=Approx(store="e4m3", scaling="tensor")),
        block,
        x,
    )
    assert any("revckpt.checkpoint(fn, *args, strategy=revckpt.approx.Approx(" in s for s in said)


def test_offload_checkpoint_alias():
    block, x = _block_and_input()
    with revckpt.offload.force_copies():
        said = _same(
            lambda m, z: revckpt.offload.checkpoint(m, z, pin_memory=False),
            lambda m, z: revckpt.checkpoint(m, z, strategy=Offload(pin_memory=False)),
            block,
            x,
        )
    assert any("strategy=revckpt.offload.Offload(" in s for s in said)


def test_offload_checkpoint_sequential_alias():
    chain, x = _chain_and_input()
    with revckpt.offload.force_copies():
        said = _same(
            lambda m, z: revckpt.offload.checkpoint_sequential(m, 4, z, prefetch=False),
            lambda m, z: revckpt.checkpoint_sequential(m, 4, z, strategy=Offload(prefetch=False)),
            chain,
            x,
        )
    assert any(
        "revckpt.checkpoint_sequential(blocks, segments, input, strategy=" in s for s in said
    )


def test_the_warning_points_at_the_callers_line():
    block, x = _block_and_input()
    with pytest.warns(FutureWarning) as caught:
        revckpt.checkpoint(block, x, policy="matmul")
    assert caught[0].filename == __file__


# --- strategy= forms ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("one", "other"),
    [
        (None, "checkpoint"),
        ("checkpoint", Strategy("checkpoint")),
        ("selective:matmul", Selective("matmul")),
        ("selective:attention+matmul", Strategy("selective", "matmul+attention")),
        ("approx:e4m3", Approx(store="e4m3")),
        ("approx:bf16", Strategy("approx", "bf16")),
        ("offload", Offload()),
    ],
)
def test_equivalent_forms_give_bitwise_equal_results(one, other):
    block, x = _block_and_input()
    twin_block = twin(block)
    a = train_step(block, x, lambda m, z: revckpt.checkpoint(m, z, strategy=one))
    b = train_step(twin_block, x, lambda m, z: revckpt.checkpoint(m, z, strategy=other))
    assert torch.equal(a[0], b[0]) and bitwise_equal(a[1], b[1]) and torch.equal(a[2], b[2])


def test_compress_strategy_is_compress_saved():
    block, x = _block_and_input()
    block.eval()  # no dropout: two separate runs
    twin_block = twin(block)
    a = train_step(block, x, lambda m, z: revckpt.checkpoint(m, z, strategy="compress:bf16"))
    b = train_step(twin_block, x, lambda m, z: compress_saved(m, z, store="bf16"))
    assert torch.equal(a[0], b[0]) and bitwise_equal(a[1], b[1]) and torch.equal(a[2], b[2])
    chain, y = _chain_and_input()
    chain.eval()
    got = revckpt.checkpoint_sequential(chain, 2, y, strategy="compress:e4m3")
    assert torch.equal(got, chain(y))


def test_offload_strategy_in_sequential_matches_plain_checkpoint():
    chain, x = _chain_and_input()
    other = twin(chain)
    a = train_step(chain, x, lambda m, z: revckpt.checkpoint_sequential(m, 4, z))
    with revckpt.offload.force_copies():
        b = train_step(
            other, x, lambda m, z: revckpt.checkpoint_sequential(m, 4, z, strategy=Offload())
        )
    assert torch.equal(a[0], b[0]) and bitwise_equal(a[1], b[1]) and torch.equal(a[2], b[2])


def test_options_that_do_not_apply_raise():
    block, x = _block_and_input()
    for strategy in ("offload", Offload(), "approx:e4m3", "compress:bf16"):
        with pytest.raises(InvalidArgumentError, match="applies to strategy=None / 'checkpoint'"):
            revckpt.checkpoint(block, x, strategy=strategy, determinism_check="values")
    with pytest.raises(InvalidArgumentError, match="preserve_rng_state=False does not apply"):
        revckpt.checkpoint(block, x, strategy="compress:bf16", preserve_rng_state=False)
    with (
        pytest.raises(InvalidArgumentError, match="both strategy= and policy="),
        pytest.warns(FutureWarning),
    ):
        revckpt.checkpoint(block, x, strategy="checkpoint", policy="matmul")
    chain, y = _chain_and_input()
    with (
        pytest.raises(InvalidArgumentError, match="pass only strategy="),
        pytest.warns(FutureWarning),
    ):
        revckpt.checkpoint_sequential(chain, 2, y, strategy="offload", approx=Approx())


def test_bad_strategies_raise_naming_the_forms():
    block, x = _block_and_input()
    with pytest.raises(InvalidArgumentError, match="unknown strategy 'fast'"):
        revckpt.checkpoint(block, x, strategy="fast")
    with pytest.raises(InvalidArgumentError, match="'store' is no checkpoint"):
        revckpt.checkpoint(block, x, strategy="store")
    with pytest.raises(InvalidArgumentError, match=r"revckpt\.layers"):
        revckpt.checkpoint(block, x, strategy=Strategy("reversible"))
    with pytest.raises(InvalidInputTypeError, match=r"Offload\(\.\.\.\)"):
        revckpt.checkpoint(block, x, strategy=3)
    with pytest.raises(InvalidArgumentError, match="pin_memory"):
        Offload(pin_memory="yes")


class _TwoHeads(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.a(x), self.b(x)


@pytest.mark.parametrize(
    "strategy", ["checkpoint", "approx:bf16", "offload", "selective:matmul", "compress:bf16"]
)
def test_an_output_the_loss_does_not_use_leaves_its_parameters_without_grad(strategy):
    # plain autograd: .grad None on parameters reached only through an unused output (zeros
    # would be moved by weight decay); approx and offload gave zeros
    torch.manual_seed(0)
    block = _TwoHeads().double()
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    used, _ = revckpt.checkpoint(block, x, strategy=strategy)
    used.sum().backward()
    assert block.b.weight.grad is None and block.b.bias.grad is None
    assert block.a.weight.grad is not None and x.grad is not None


@pytest.mark.parametrize("strategy", ["approx:bf16", "offload", "compress:bf16"])
@pytest.mark.parametrize("unfreeze", [False, True])
def test_a_parameter_frozen_or_unfrozen_between_forward_and_backward(strategy, unfreeze):
    # plain autograd differentiates the graph as recorded and leaves that weight's .grad None;
    # approx and offload raised torch's raw error (frozen) or named the block's own parameter
    # "neither an argument nor a parameter" (unfrozen)
    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
    block = block.double()
    ref = twin(block)
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    for m in (block, ref):
        m[0].weight.requires_grad_(unfreeze)
    out = revckpt.checkpoint(block, x, strategy=strategy)
    want = ref(x.detach().requires_grad_())
    for m in (block, ref):
        m[0].weight.requires_grad_(not unfreeze)
    out.square().sum().backward()
    want.square().sum().backward()
    assert block[0].weight.grad is None and ref[0].weight.grad is None
    tol = dict(rtol=0.05, atol=1e-3) if strategy != "offload" else dict(rtol=0, atol=0)
    torch.testing.assert_close(block[2].weight.grad, ref[2].weight.grad, **tol)


class _Closure(torch.nn.Module):
    def __init__(self, ext):
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.ext = [ext]  # requires grad, not registered

    def forward(self, x):
        return self.ext[0] * self.a(x)


@pytest.mark.parametrize("strategy", ["approx:bf16", "offload"])
def test_an_unfrozen_parameter_does_not_hide_an_unregistered_tensor(strategy):
    # the walk stopped at the block's own parameter (frozen in the forward, trainable since)
    # and let the closure's tensor lose its gradient silently
    ext = torch.randn(4, dtype=torch.float64, requires_grad=True)
    block = _Closure(ext).double()
    block.a.weight.requires_grad_(False)
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    out = revckpt.checkpoint(block, x, strategy=strategy)
    block.a.weight.requires_grad_(True)
    with pytest.raises(
        InvalidArgumentError, match="neither a tensor argument of its own nor a parameter"
    ):
        out.sum().backward()


@pytest.mark.parametrize("strategy", ["approx:bf16", "offload"])
def test_a_module_reached_through_a_closure_is_named_not_dropped(strategy):
    # lambda h: model(h): the module's parameters are not the node's inputs; this session's
    # unfrozen-parameter rule took them for the block's own and dropped their gradients
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh()).double()
    fn = (lambda m: lambda h: m(h))(model)
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    with pytest.raises(InvalidArgumentError, match="through a closure"):
        revckpt.checkpoint(fn, x, strategy=strategy).sum().backward()


@pytest.mark.parametrize("strategy", [None, "approx:bf16", "offload"])
def test_torch_checkpoint_options_are_read_not_passed_to_the_block(strategy):
    # use_reentrant=False reached nn.Linear.forward (a raw TypeError), or was taken silently by
    # a block with **kwargs, as were use_reentrant=True and context_fn
    block = torch.nn.Linear(4, 4).double()
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    out = revckpt.checkpoint(block, x, strategy=strategy, use_reentrant=False, debug=False)
    torch.testing.assert_close(out, block(x))
    chain = torch.nn.Sequential(block, torch.nn.Tanh())
    revckpt.checkpoint_sequential(chain, 1, x, strategy=strategy, use_reentrant=False)
    with pytest.raises(InvalidArgumentError, match=r"use_reentrant=True\): torch"):
        revckpt.checkpoint(block, x, strategy=strategy, use_reentrant=True)
    with pytest.raises(InvalidArgumentError, match="strategy='selective:<policy>'"):
        revckpt.checkpoint(block, x, strategy=strategy, context_fn=lambda: None)


@dataclasses.dataclass
class _Out:
    hidden: torch.Tensor
    aux: torch.Tensor
    note: str = "kept"


class _DataclassBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        h = self.lin(x)
        return _Out(h.tanh(), h.detach() + 1)


@pytest.mark.parametrize("strategy", ["approx:bf16", "offload"])
def test_a_dataclass_output_and_a_constant_output_as_plain_autograd(strategy):
    # a plain @dataclass was refused ("no tensor in it"); an output with no graph in the
    # forward (h.detach() + 1) came back requiring grad
    torch.manual_seed(0)
    block = _DataclassBlock().double()
    ref = twin(block)
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    out = revckpt.checkpoint(block, x, strategy=strategy)
    want = ref(x)
    assert isinstance(out, _Out) and out.note == "kept"
    assert out.hidden.requires_grad and not out.aux.requires_grad
    out.hidden.sum().backward()
    want.hidden.sum().backward()
    tol = dict(rtol=0, atol=0) if strategy == "offload" else dict(rtol=0.05, atol=1e-3)
    torch.testing.assert_close(block.lin.weight.grad, ref.lin.weight.grad, **tol)


def test_offload_takes_complex_inputs():
    # refused with approx's message, though offload keeps its inputs exactly
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(4, 4, dtype=torch.complex128))

        def forward(self, x):
            return (x @ self.w).abs()

    block = Block()
    ref = twin(block)
    x = torch.randn(2, 4, dtype=torch.complex128, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    revckpt.checkpoint(block, x, strategy="offload").sum().backward()
    ref(x2).sum().backward()
    assert torch.equal(x.grad, x2.grad) and torch.equal(block.w.grad, ref.w.grad)


@pytest.mark.parametrize("strategy", [None, "selective:matmul"])
def test_a_tensor_in_a_positional_dict_changed_after_the_forward_raises(strategy):
    # as a keyword the change was caught; in a positional dict the recompute read it (2.66 off)
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(4, 4, dtype=torch.float64))

        def forward(self, x, extra):
            return ((x @ self.w).tanh() * extra["scale"]).sin()

    scale = torch.randn(4, dtype=torch.float64)
    x = torch.randn(2, 4, dtype=torch.float64)
    out = revckpt.checkpoint(Block(), x, {"scale": scale}, strategy=strategy)
    scale.mul_(3)
    with pytest.raises(revckpt.ModifiedInputError, match="in a list, tuple or dict"):
        out.square().sum().backward()


@pytest.mark.parametrize("as_keyword", [False, True, "in a tuple"])
@pytest.mark.parametrize(
    "strategy", ["checkpoint", "selective:matmul", "approx:bf16", "approx:e4m3", "offload"]
)
def test_a_further_argument_changed_after_the_forward_raises_through_convert(strategy, as_keyword):
    # A bias the model passes every block, changed in place by the caller before backward:
    # under convert's approx and offload the recompute read it (weight gradient 0.54 off,
    # silently: the runner held it outside the node); under checkpoint and selective, passed
    # positionally, torch's raw version-counter error came first
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x, bias):
            bias = bias[0] if isinstance(bias, tuple) else bias  # (as Llama's (cos, sin))
            return x + torch.tanh(self.lin(x) + bias)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList(Block() for _ in range(2))

        def forward(self, x, bias):
            for block in self.blocks:
                if as_keyword == "in a tuple":
                    x = block(x, (bias, bias))
                else:
                    x = block(x, bias=bias) if as_keyword else block(x, bias)
            return x

    model = Model().double()
    assert len(revckpt.convert(model, strategy)) == 2
    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(8, dtype=torch.float64)
    out = model(x, bias)
    bias.mul_(3.0)
    with pytest.raises(revckpt.ModifiedInputError, match=r"(changed|modified) in place"):
        out.square().sum().backward()
    out = model(x, bias)  # unchanged: trains
    out.square().sum().backward()


@pytest.mark.parametrize("strategy", ["approx:bf16", "offload"])
def test_a_dataclass_output_is_checked_for_unregistered_tensors(strategy):
    # the check walked the output with pytree, which takes a dataclass for a leaf: no tensor,
    # nothing reported, and the closure's tensor lost its gradient silently
    scale = torch.randn(4, dtype=torch.float64, requires_grad=True)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4).double()

        def forward(self, x):
            return _Out(self.lin(x) * scale, x)

    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    out = revckpt.checkpoint(Block(), x, strategy=strategy)
    with pytest.raises(
        InvalidArgumentError, match="neither a tensor argument of its own nor a parameter"
    ):
        out.hidden.sum().backward()


@pytest.mark.parametrize("strategy", ["approx:bf16", "offload"])
def test_a_tensor_requiring_grad_in_a_list_argument_is_named_so_under_convert(strategy):
    # the refusal said the tensor was "neither an argument nor a parameter": it was in one
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x, extra):
            return self.lin(x) * extra[0]

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList(Block() for _ in range(2))

        def forward(self, x, scale):
            for block in self.blocks:
                x = block(x, [scale])
            return x

    model = Model()
    revckpt.convert(model, strategy)
    scale = torch.randn(4, requires_grad=True)
    with pytest.raises(InvalidArgumentError, match="inside a list, tuple or dict argument"):
        model(torch.randn(2, 4), scale).sum().backward()
