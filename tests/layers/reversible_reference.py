"""Plain-autograd references for reversible stacks: run a stack, or its blocks called one by
one (everything stored), on the same input and seed, and compare gradients."""

import torch

from revckpt import InvalidArgumentError
from revckpt.layers import Coupling


class GatedCoupling(Coupling):
    """A custom coupling that needs a branch twice the stream's width:
    ``y = x + sigmoid(a) * b`` with ``(a, b)`` the halves of ``h`` along ``dim``."""

    def __init__(self, dim=-1):
        self.dim = dim

    def combine(self, x, h):
        a, b = h.chunk(2, dim=self.dim)
        return x + torch.sigmoid(a) * b

    def separate(self, y, h):
        a, b = h.chunk(2, dim=self.dim)
        return y - torch.sigmoid(a) * b

    def branch_size(self, size, *, split_dim):
        if split_dim != self.dim:
            raise InvalidArgumentError(f"GatedCoupling splits h along {self.dim}, not {split_dim}")
        return 2 * size


def plain_forward(rev, x, **kwargs):
    """The same math with plain autograd: every block called directly."""
    x1, x2 = x.chunk(2, dim=rev.split_dim)
    for block in rev.blocks:
        x1, x2 = block(x1, x2, **kwargs)
    return torch.cat([x1, x2], dim=rev.split_dim)


def step(model_fn, model, x, mask, seed=99):
    """``model_fn(model, x, mask=...)`` from ``seed`` and a backward along a fixed direction:
    the output and the gradients of the parameters, ``x`` and (if it requires grad) the mask."""
    x = x.detach().clone().requires_grad_()
    kw = {}
    if mask is not None:
        kw["mask"] = mask.detach().clone().requires_grad_(mask.requires_grad)
    torch.manual_seed(seed)
    y = model_fn(model, x, **kw)
    # drawn in float64 and rounded: the same direction whatever the model's dtype
    w = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    w = w.to(y.dtype)
    (y * w).sum().backward()
    grads = [p.grad for p in model.parameters()] + [x.grad]
    if mask is not None and mask.requires_grad:
        grads.append(kw["mask"].grad)
    return y.detach(), grads


def assert_grads_match(got, want, rtol):
    """All gradients together, and each tensor, within ``rtol`` (relative) of ``want``."""
    flat_got = torch.cat([g.flatten().double() for g in got])
    flat_want = torch.cat([g.flatten().double() for g in want])
    scale = flat_want.norm()
    assert (flat_got - flat_want).norm() <= rtol * scale
    for g, w in zip(got, want, strict=True):
        # per tensor: relative, except for gradients that are zero up to round-off (a bias
        # right before BatchNorm)
        assert (g.double() - w.double()).norm() <= rtol * w.double().norm() + 1e-3 * rtol * scale
