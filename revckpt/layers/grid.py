"""An exact coupling: streams on a fixed-point grid, the bits a scale drops kept.

A reversible stack that scales a stream (``y = scale * x + h``, :class:`ScaledCoupling`, the
coupling that makes a pretrained layer reversible) loses information in floating point: the
rebuild divides by ``scale``, and the rounding of every layer above grows by ``1 / scale``
per layer, which anchors (stored exact inputs) have to stop. With the streams held on a grid
of ``2^-bits`` in float64 (every value an integer multiple of it, below ``2^(52 - bits)`` in
magnitude), the arithmetic of the coupling is exact (after MacKay et al., "Reversible
Recurrent Neural Networks", 2018, who keep fixed-point hidden states and the bits a
multiplication drops):

- the branch output is rounded to the grid, ``h_q = round(h * 2^bits) / 2^bits``;
- ``scale = 2^-k`` splits ``x * scale`` into its grid part ``q = floor(x * 2^(bits - k)) /
  2^bits`` and the ``k`` bits below it, ``lost = (x * 2^bits) mod 2^k``, kept (one byte per
  element for ``k <= 8``: the whole cost of exactness);
- ``y = q + h_q`` is a sum of grid values, exact, and so is ``y - h_q = q``; the rebuild is
  ``x = q * 2^k + lost / 2^bits``, bit for bit.

The rebuild needs ``h`` recomputed bitwise as the forward had it (the branch deterministic,
which it is on a CPU and with deterministic kernels elsewhere; the replay of random state
covers dropout). Gradients are those of ``y = scale * x + h`` (the roundings pass gradients
through as the identity; they move values by at most ``2^-bits``).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..errors import InvalidArgumentError, ReconstructionError, RevckptError
from .coupling import AdditiveCoupling, Coupling

__all__ = ["GRID_BITS", "MAX_SHIFT", "GridCoupling", "on_grid", "rebuilt_later", "recorded"]

#: Fractional bits of the grid: a resolution of 2^-30 (about 1e-9), values up to 2^22 (4e6).
GRID_BITS = 30
#: The most bits a coupling can drop and keep (``scale >= 2^-MAX_SHIFT``): two bytes.
MAX_SHIFT = 16
_OFFSET = 2**15  # kept bits beyond a byte are held in int16, shifted by this


def on_grid(x: torch.Tensor, bits: int = GRID_BITS, *, check: bool = True) -> torch.Tensor:
    """``x`` in float64 rounded to the grid ``2^-bits`` (a stack's input, before its first
    exact coupling); raises if a value is too large for the grid (``check=False``: does
    not look, for a forward nothing will be rebuilt from)."""
    q = torch.round(x.detach().to(torch.float64) * 2.0**bits) * 2.0**-bits
    if check:
        _check_range(q, bits)
    return q


def recorded() -> bool:
    """Whether this forward is being recorded for deployment (``torch.jit.trace``,
    ``torch.export``): a reversible stack then runs as plain layers, and checks that read a
    value on the host (which a recorded graph cannot hold) are left out."""
    exporting = getattr(torch.compiler, "is_exporting", lambda: False)  # torch >= 2.5
    return torch.jit.is_tracing() or exporting()


def rebuilt_later() -> bool:
    """Whether what a plain forward computes may be rebuilt from in a backward: with autograd
    on, outside a recorded forward; otherwise the grid's range check is left out (it reads
    one value on the host; an inference forward rebuilds nothing)."""
    return torch.is_grad_enabled() and not recorded()


def _check_range(y: torch.Tensor, bits: int) -> None:
    limit = 2.0 ** (52 - bits)
    if not y.numel():
        return
    low, high = torch.aminmax(y)  # one pass, no |y| made: a nan fails this too
    if bool((high < limit) & (low > -limit)):
        return
    what = "an exact reversible stack (make_reversible(..., exact=True))"
    if not bool(y.isfinite().all()):
        raise ReconstructionError(
            f"a stream of {what} is not finite (nan or inf): the model computed it (an "
            "overflow, a nan in the input or the weights, a diverging run), not the grid; find "
            "where it starts (exact=False carries it on silently, as the model without revckpt "
            "would)"
        )
    raise ReconstructionError(
        f"a stream of {what} reached {float(y.abs().amax()):.3g}, beyond the grid's range "
        f"{limit:.3g}: a diverging run (lower the learning rate), or a model whose hidden "
        "states are that large (then use exact=False: anchors instead)"
    )


class GridCoupling(Coupling):
    """``y = scale * x + h`` on the grid (see the module docstring), ``scale`` one of ``0``
    (an input known to be zeros: ``y = h``), ``1`` (additive) or ``2^-k`` with ``1 <= k <= 16``.
    :meth:`combine` gives the grid value with the gradients of the linear map;
    :meth:`split` also returns the dropped bits, which :meth:`rebuild` needs."""

    def __init__(self, scale: float, bits: int = GRID_BITS) -> None:
        k = -math.log2(scale) if isinstance(scale, (int, float)) and scale > 0 else -1.0
        if not (scale == 0 or (k == int(k) and 0 <= k <= MAX_SHIFT)):
            raise InvalidArgumentError(
                f"scale={scale!r}: an exact coupling scales by 0, 1 or a power of two "
                f"2^-k with k <= {MAX_SHIFT} (e.g. 2**-8); use exact=False for other scales"
            )
        self.scale, self.k, self.bits = float(scale), int(k), bits

    @property
    def linear_scale(self) -> float:  # type: ignore[override]
        return self.scale

    def split(
        self, x: torch.Tensor, h: torch.Tensor, *, check: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(y, lost)`` without a graph: ``y`` on the grid, ``lost`` the bits of ``x *
        scale`` below it (``uint8`` for ``k <= 8``, else ``int16`` less ``2^15``; ``None``
        when nothing is dropped); ``check``: raise if ``y`` is beyond the grid's range."""
        with torch.no_grad():  # in place where it can: float64 temporaries are the cost
            hq = _laid_out_as(self._grid(h), x)
            if self.scale == 0:
                y, lost = hq, None
            elif self.k == 0:
                y, lost = hq.add_(x.detach()), None
            else:
                units = x.detach() * 2.0 ** (self.bits - self.k)  # x * scale, in grid units
                q = torch.floor(units)
                lost = units.sub_(q).mul_(2.0**self.k)
                lost = lost.to(torch.uint8) if self.k <= 8 else lost.sub_(_OFFSET).to(torch.int16)
                del units
                y = q.mul_(2.0**-self.bits).add_(hq)
        if check:
            _check_range(y, self.bits)
        return y, lost

    def _grid(self, h: torch.Tensor) -> torch.Tensor:
        """``h`` rounded to the grid, in float64 (a new tensor)."""
        return (h.detach().to(torch.float64) * 2.0**self.bits).round_().mul_(2.0**-self.bits)

    def combine(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """The grid value of ``scale * x + h``, differentiable as that linear map (exactly the
        value :meth:`split` gives: plain autograd and the rebuild see the same numbers);
        its range checked where a backward may rebuild from it (:func:`rebuilt_later`)."""
        y, _ = self.split(x, h, check=rebuilt_later())
        return _AsLinear.apply(x, h, y, self.scale)

    def rebuild(self, y: torch.Tensor, h: torch.Tensor, lost: torch.Tensor | None) -> torch.Tensor:
        """``x``, exactly, from ``y``, the recomputed ``h`` and the bits :meth:`split` kept,
        laid out as ``y`` (the stream's layout in the forward: a branch output laid out
        otherwise, channels-last from a broadcast with an ``(N, C, 1, 1)`` gate, made the
        next branch's recompute pick other kernels, which round differently)."""
        with torch.no_grad():
            # y - h_q, exact: with scale 0 (an input known to be zeros), zeros again where the
            # recompute gives the forward's h, and not where it differs (the check sees it)
            q = _laid_out_as(self._grid(h), y).neg_().add_(y)
            if self.scale == 0:
                return q
            if lost is None:
                return q
            q.mul_(2.0**self.k).add_(lost, alpha=2.0**-self.bits)
            return q if lost.dtype == torch.uint8 else q.add_(_OFFSET * 2.0**-self.bits)

    def separate(self, y: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        raise RevckptError(
            "GridCoupling.separate needs the dropped bits: a reversible stack rebuilds with "
            "GridCoupling.rebuild(y, h, lost)"
        )

    def check(self, x: torch.Tensor, h: object, *, branch: str) -> None:
        AdditiveCoupling().check(x, h, branch=branch)  # type: ignore[arg-type]
        if x.dtype != torch.float64:
            raise InvalidArgumentError(
                f"branch {branch}: an exact coupling's streams are float64 on a grid, got "
                f"{x.dtype}; start the stack from revckpt.layers.grid.on_grid(x)"
            )

    def __repr__(self) -> str:
        return f"GridCoupling(scale={self.scale:g}, bits={self.bits})"


def _laid_out_as(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``t`` (a fresh tensor) with ``like``'s strides: the streams keep one layout whatever a
    branch returns (a broadcast with an ``(N, C, 1, 1)`` gate came out channels-last, and a
    stream taking its layout made the next branch's recompute pick other kernels than its
    forward did, which round differently: a rebuild 5e-5 off, gradients 1e-2 off)."""
    if t.stride() == like.stride():
        return t
    return torch.empty_like(like, dtype=t.dtype).copy_(t)


class _AsLinear(torch.autograd.Function):
    """``y`` (computed without a graph) with the gradients of ``scale * x + h``; written
    with ``setup_context`` so that ``torch.func`` transforms run it (a stack run plainly,
    ``reversible = False``, inside ``torch.func.grad``)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor, h: torch.Tensor, y: torch.Tensor, scale: float) -> torch.Tensor:
        return y

    @staticmethod
    def setup_context(ctx: object, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        ctx.scale = inputs[3]  # type: ignore[attr-defined]

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None, None]:
        return grad * ctx.scale, grad, None, None  # type: ignore[attr-defined]

    @staticmethod
    def jvp(
        ctx: object, x_t: torch.Tensor | None, h_t: torch.Tensor | None, *_: Any
    ) -> torch.Tensor:
        """The tangent of ``scale * x + h`` (forward-mode AD through a stack run plainly)."""
        scale = ctx.scale  # type: ignore[attr-defined]
        parts = [t for t in (None if x_t is None else x_t * scale, h_t) if t is not None]
        return parts[0] if len(parts) == 1 else parts[0] + parts[1]
