import copy
import math
import warnings

import pytest
import torch
from helpers import Chain
from torch import nn

from revckpt import InvalidArgumentError, gradient_error
from revckpt.models import mlp_chain


def test_exact_strategy_reports_zero_in_float64():
    chain = mlp_chain(6, 8, 16, dropout=0.2, norm="batch").double()
    x = torch.randn(5, 8, dtype=torch.float64, requires_grad=True)
    plain = Chain(copy.deepcopy(chain), None)  # same names, no checkpoint
    err = gradient_error(Chain(chain, 3), plain, x)
    assert err.overall.rel_l2 == 0.0 and err.overall.one_minus_cos == 0.0
    assert set(err.per_tensor) >= {"chain.0.fc1.weight", "input.0"}


def test_float32_candidate_against_float64_reference_is_roundoff():
    chain = mlp_chain(4, 16, 32, dropout=0.2)
    x = torch.randn(8, 16)
    err = gradient_error(Chain(chain, 4), None, x)
    assert 0 < err.overall.rel_l2 < 1e-5
    assert err.overall.one_minus_cos < 1e-10


def test_perturbed_model_reports_the_perturbation_size():
    torch.manual_seed(0)
    ref = nn.Linear(32, 32, bias=False).double()
    cand = copy.deepcopy(ref)
    with torch.no_grad():
        cand.weight.mul_(1.01)  # output and input gradient scale by 1.01
    x = torch.randn(16, 32, dtype=torch.float64, requires_grad=True)
    err = gradient_error(cand, ref, x)
    # dL/dW = w^T x does not depend on W: unchanged; dL/dx = w W scales by 1.01
    assert err.per_tensor["weight"].rel_l2 == 0.0
    assert err.per_tensor["input.0"].rel_l2 == pytest.approx(0.01, rel=1e-9)
    assert err.per_tensor["input.0"].max_abs_rel == pytest.approx(0.01, rel=1e-9)
    assert err.per_tensor["input.0"].one_minus_cos < 1e-14
    assert err.worst(1)[0][0] == "input.0"
    assert "input.0" in err.table()


def test_buffers_restored_and_grad_untouched():
    chain = mlp_chain(2, 4, 8, norm="batch")
    before = {n: b.clone() for n, b in chain.named_buffers()}
    gradient_error(chain, None, torch.randn(6, 4))
    for n, b in chain.named_buffers():
        assert torch.equal(before[n], b), n
    assert all(p.grad is None for p in chain.parameters())


def test_mismatched_reference_is_rejected():
    with pytest.raises(InvalidArgumentError, match="different trainable tensors"):
        gradient_error(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4)), torch.randn(2, 4))
    with pytest.raises(InvalidArgumentError, match="loss_fn"):
        gradient_error(nn.Flatten(), None, torch.randn(2, 4).long())


def test_nan_gradients_are_reported_not_hidden():
    model = nn.Linear(4, 4).double()
    model.weight.register_hook(lambda g: g * float("nan"))
    err = gradient_error(model, None, torch.randn(3, 4, dtype=torch.float64))
    assert math.isnan(err.per_tensor["weight"].rel_l2)
    assert math.isnan(err.per_tensor["weight"].one_minus_cos)


def test_bf16_projection_weights_do_not_add_an_error_floor():
    class Identity(nn.Module):
        def __init__(self):
            super().__init__()
            self.p = nn.Parameter(torch.randn(64))

        def forward(self, x):
            return self.p * 1.0

    model = Identity().bfloat16()
    err = gradient_error(model, None, torch.zeros(1))
    assert err.overall.rel_l2 == 0.0  # y = p: d<w, y>/dp = w exactly in any dtype


def test_a_float64_copy_of_a_converted_model_warns_that_it_runs_the_strategy_too():
    # reference=None copies the model as it is: on a model converted to approx the reference
    # runs the codec too, and the figure read 1.8e-7 where the codec's error is ~2e-2.
    import revckpt
    from revckpt.models import transformer_chain

    torch.manual_seed(0)
    model = nn.Sequential(transformer_chain(2, 32, heads=4))
    before = copy.deepcopy(model)
    revckpt.convert(model, "approx:e4m3")
    x = torch.randn(2, 8, 32)
    with pytest.warns(UserWarning, match="float64 copy of the model runs the lossy"):
        floor = gradient_error(model, None, x).overall.rel_l2
    assert floor < 1e-5 < gradient_error(model, before, x).overall.rel_l2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gradient_error(before, None, x)  # an unconverted model: no warning
        revckpt.convert(before, "checkpoint")
        gradient_error(before, None, x)  # nor an exact strategy


def test_complex_gradients_and_inputs_are_compared_whole():
    # .double() dropped the imaginary part: gradients differing only there compared equal, a
    # complex input requiring grad was left out, and reference=None kept it complex64.
    class M(nn.Module):
        def __init__(self, w):
            super().__init__()
            self.w = nn.Parameter(w)

        def forward(self, z):
            return torch.view_as_real(z * self.w).sum(-1)

    w = torch.randn(4, dtype=torch.complex64)
    a, b = M(w.clone()), M(w.clone())
    z = torch.randn(3, 4, dtype=torch.complex64, requires_grad=True)
    assert gradient_error(a, b, z).overall.rel_l2 == 0
    b.register_forward_pre_hook(lambda m, args: (args[0] * (1 + 0.1j),))  # moves grads' phase
    err = gradient_error(a, b, z)
    assert "input.0" in err.per_tensor and err.per_tensor["w"].rel_l2 > 0.05
    assert gradient_error(a, None, z).overall.rel_l2 < 1e-6  # complex128 reference


class _Fuse(nn.Module):
    def __init__(self, cut: bool = False):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.cut = cut

    def forward(self, x, feats):
        f = feats[0].detach() if self.cut else feats[0]
        return self.lin(x) + f


def test_inputs_nested_in_lists_and_dicts_have_their_gradients_compared():
    ref = _Fuse()
    cand = copy.deepcopy(ref)
    cand.cut = True  # its gradient to feats[0] is wrong (none)
    x, feat = torch.randn(3, 4), torch.randn(3, 4, requires_grad=True)
    err = gradient_error(cand, ref, (x, [feat]))
    assert err.per_tensor["input.1[0]"].rel_l2 == 1.0
    err = gradient_error(cand, ref, x, kwargs={"feats": {0: feat}})
    assert err.per_tensor["input.feats[0]"].rel_l2 == 1.0
    assert gradient_error(ref, None, (x, [feat])).per_tensor["input.1[0]"].rel_l2 < 1e-6

    class Two(nn.Module):
        def forward(self, x, **kw):
            return x * kw["f.0"] + kw["f"][0]

    a, b = torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)
    err = gradient_error(Two(), None, torch.randn(3), kwargs={"f.0": a, "f": [b]})
    assert {"input.f.0", "input.f[0]"} <= err.per_tensor.keys()


def test_an_input_named_as_a_parameter_is_refused():
    model = nn.Module()
    model.input = nn.ParameterList([nn.Parameter(torch.randn(4))])
    model.forward = lambda x: x * model.input[0]
    with pytest.raises(InvalidArgumentError, match=r"named 'input\.0'"):
        gradient_error(model, None, torch.randn(4, requires_grad=True))


def test_parameter_hooks_the_float64_copy_does_not_carry_are_named_and_not_run_twice():
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    calls = []
    model[0].weight.register_hook(lambda g: calls.append(g.dtype))  # a side effect
    with pytest.warns(UserWarning, match="does not carry"):
        gradient_error(model, None, torch.randn(2, 4))
    assert calls == [torch.float32]  # the candidate's, once


def test_inputs_inside_a_container_registered_without_keys_are_compared():
    from torch.utils import _pytree

    class Box:
        def __init__(self, t):
            self.t = t

    _pytree.register_pytree_node(Box, lambda b: ([b.t], None), lambda v, _: Box(v[0]))
    try:

        class Boxed(nn.Linear):
            def forward(self, x, box):
                return super().forward(x) + box.t

        model = Boxed(4, 3)
        err = gradient_error(
            model, None, torch.randn(2, 4), kwargs={"box": Box(torch.zeros(3, requires_grad=True))}
        )
        assert "weight" in err.per_tensor and "input.box[#0]" in err.per_tensor
    finally:
        _pytree._deregister_pytree_node(Box)


def test_unmade_lazy_parameters_and_meta_tensors_are_refused():
    with pytest.raises(InvalidArgumentError, match="lazy"):
        gradient_error(nn.Sequential(nn.LazyLinear(3)), None, torch.randn(2, 4))
    with pytest.raises(InvalidArgumentError, match="meta"):
        gradient_error(nn.Linear(4, 3, device="meta"), None, torch.randn(2, 4, device="meta"))


def test_gradients_are_taken_under_no_grad_and_inference_mode():
    model, x = nn.Linear(4, 3), torch.randn(2, 4)
    expected = gradient_error(model, None, x).overall.rel_l2
    with torch.no_grad():
        assert gradient_error(model, None, x).overall.rel_l2 == expected
    with torch.inference_mode():
        assert gradient_error(model, None, torch.randn(2, 4)).overall.rel_l2 < 1e-6


def test_a_reference_in_another_dtype_gets_its_inputs_in_that_dtype():
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    assert (
        gradient_error(model, copy.deepcopy(model).double(), torch.randn(2, 4)).overall.rel_l2
        < 1e-6
    )
    bf16 = copy.deepcopy(model).bfloat16()
    assert (
        gradient_error(bf16, model, torch.randn(2, 4, dtype=torch.bfloat16)).overall.rel_l2 < 0.05
    )


def test_sparse_gradients_are_compared_dense():
    model = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 2))
    err = gradient_error(model, None, torch.tensor([[1, 2, 2]]))
    assert err.per_tensor["0.weight"].rel_l2 < 1e-6


def test_bad_losses_worst_fields_and_reentrant_checkpoints_are_named():
    from torch.utils.checkpoint import checkpoint

    from revckpt import InvalidInputTypeError

    model, x = nn.Linear(4, 3), torch.randn(2, 4)
    with pytest.raises(InvalidArgumentError, match="scalar"):
        gradient_error(model, None, x, loss_fn=lambda y: y)
    with pytest.raises(InvalidInputTypeError, match="returned a float"):
        gradient_error(model, None, x, loss_fn=lambda y: float(y.sum()))
    with pytest.raises(InvalidArgumentError, match="use one of"):
        gradient_error(model, None, x).worst(by="rel")

    class Reentrant(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 3)

        def forward(self, x):
            return checkpoint(self.lin, x, use_reentrant=True)

    with pytest.raises(InvalidArgumentError, match="use_reentrant=False"):
        gradient_error(Reentrant(), None, torch.randn(2, 4, requires_grad=True))
