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
