"""Couplings: how a reversible block mixes a stream with a function of the other stream.

A coupling is a pair of elementwise maps, ``combine(x, h) -> y`` and its inverse in ``x``,
``separate(y, h) -> x``, where ``h = F(u)`` is the output of a residual branch applied to the
*other* stream. A reversible block applies two couplings in turn::

    y1 = combine(x1, F(x2))            x2 = separate(y2, G(y1))
    y2 = combine(x2, G(y1))            x1 = separate(y1, F(x2))

so its input can be rebuilt from its output whatever ``F`` and ``G`` are. During backward the
branch ``h = F(u)`` is evaluated once, with autograd: its value serves the inverse and its graph
the gradient, so a reversible backward costs one extra forward of each branch, no more.

Writing a custom coupling: subclass :class:`Coupling` and implement ``combine`` and
``separate`` with ``separate(combine(x, h), h) == x`` (up to rounding) for every ``h`` the
branch can produce; both must be differentiable in ``x`` and ``h`` and must not modify their
arguments. ``check`` may validate shapes; ``branch_size`` tells the ready blocks of
:mod:`revckpt.layers.blocks` how wide to build their branches (default: as wide as the stream).
For example, a gated coupling ``y = x + sigmoid(a) * b`` with ``h = (a, b)``, or one tensor
twice the stream's size along the last dim that is split into ``a`` and ``b``::

    class GatedCoupling(Coupling):
        def combine(self, x, h):
            a, b = h if isinstance(h, tuple) else h.chunk(2, dim=-1)
            return x + torch.sigmoid(a) * b

        def separate(self, y, h):
            a, b = h if isinstance(h, tuple) else h.chunk(2, dim=-1)
            return y - torch.sigmoid(a) * b

        def branch_size(self, size, *, split_dim):  # a and b stacked along the last dim
            if split_dim != -1:
                raise InvalidArgumentError(f"GatedCoupling splits h along -1, not {split_dim}")
            return 2 * size
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .._deprecation import warn_deprecated
from ..errors import InvalidArgumentError

__all__ = ["AdditiveCoupling", "AffineCoupling", "Coupling", "ScaledCoupling", "make_coupling"]


class Coupling:
    """Base class: an invertible elementwise map ``y = combine(x, h)`` in ``x``, given ``h``."""

    def combine(self, x: torch.Tensor, h: Any) -> torch.Tensor:
        """``y = combine(x, h)``: update stream ``x`` with the branch output ``h``."""
        raise NotImplementedError

    def separate(self, y: torch.Tensor, h: Any) -> torch.Tensor:
        """``x = separate(y, h)``: undo :meth:`combine` (``separate(combine(x, h), h) == x``)."""
        raise NotImplementedError

    #: ``s`` when ``combine(x, h) == s * x + h`` exactly (the reversible backward then
    #: differentiates ``h`` alone and updates streams in place); ``None`` otherwise. Only the
    #: class that declares it is trusted: a subclass must declare it again.
    linear_scale: float | None = None

    def check(self, x: torch.Tensor, h: Any, *, branch: str) -> None:
        """Raise :class:`~revckpt.InvalidArgumentError` if ``h`` cannot be coupled with ``x``."""

    def branch_size(
        self, size: int, *, split_dim: int | None = None, dim: int | None = None
    ) -> int:
        """The size along ``split_dim`` of the branch output ``h`` this coupling needs for a
        stream of size ``size`` there (a ready block's branches produce their features along
        ``split_dim``). Default: ``size``, ``h`` has the stream's shape. A coupling that splits
        ``h`` along a fixed dim raises :class:`~revckpt.InvalidArgumentError` for any other
        ``split_dim``. ``dim=``: deprecated spelling of ``split_dim=``."""
        _split_dim(split_dim, dim, "Coupling.branch_size(size, dim=...)", None, depth=2)
        return size

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class AdditiveCoupling(Coupling):
    """``y = x + h``; inverse ``x = y - h``. Volume preserving; ``h`` has the shape of ``x``.

    Rounding: the rebuilt ``x`` carries the rounding of the sum and of the difference,
    ``|x_hat - x| <= 2u * (|x| + |h|)`` per block (to first order in ``u``, the unit roundoff
    of the dtype: half its machine epsilon).
    """

    linear_scale = 1.0

    def combine(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """``y = x + h``."""
        return x + h

    def separate(self, y: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """``x = y - h``."""
        return y - h

    def check(self, x: torch.Tensor, h: Any, *, branch: str) -> None:
        if not isinstance(h, torch.Tensor) or h.shape != x.shape:
            got = tuple(h.shape) if isinstance(h, torch.Tensor) else type(h).__name__
            raise InvalidArgumentError(
                f"branch {branch} returned {got} for a stream of shape {tuple(x.shape)}; an "
                "additive coupling needs a branch that keeps the shape (y = x + branch(u))"
            )


class ScaledCoupling(Coupling):
    """``y = scale * x + h``; inverse ``x = (y - h) / scale``, with a constant ``scale > 0``.

    What makes a pretrained layer reversible while keeping its output (MEFT, Liao et al. 2023;
    :func:`revckpt.make_reversible`): with a small ``scale`` the stream ``x`` barely enters
    ``y``, so ``y`` is close to ``h``, the layer's own output. The price is in the inverse,
    which divides by ``scale``: the rebuilt ``x`` carries the rounding of ``y`` amplified by
    ``1 / scale``, ``|x_hat - x| <= 2u * (|x| + |h| / scale)`` per block (``u``: the unit
    roundoff), and the error of the blocks above it grows by the same factor per block. A
    power of two (the default, 1/8) scales exactly.
    """

    def __init__(self, scale: float = 0.125) -> None:
        if not (_is_number(scale) and scale > 0 and math.isfinite(scale)):
            raise InvalidArgumentError(
                f"scale={scale!r}: pass a positive finite number, e.g. 0.125 (a power of two "
                "scales exactly)"
            )
        self.scale = float(scale)

    @property
    def linear_scale(self) -> float:  # type: ignore[override]
        return self.scale

    def combine(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """``y = scale * x + h``."""
        return torch.add(h, x, alpha=self.scale)

    def separate(self, y: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """``x = (y - h) / scale``."""
        return (y - h) / self.scale

    def check(self, x: torch.Tensor, h: Any, *, branch: str) -> None:
        AdditiveCoupling().check(x, h, branch=branch)

    def __repr__(self) -> str:
        return f"ScaledCoupling(scale={self.scale:g})"


class AffineCoupling(Coupling):
    """``y = x * s + t`` with ``s = exp(c * tanh(a / c))``; inverse ``x = (y - t) / s``.

    The branch returns ``h = (a, t)``, or one tensor twice the stream's size along
    ``split_dim`` that is split into ``a`` and ``t``. The scale is bounded,
    ``exp(-c) <= s <= exp(c)`` (``c = clamp``, default 2), so the inverse never divides by a
    vanishing number and a block amplifies reconstruction error by at most ``exp(c)``.
    Rounding: four roundings, ``|x_hat - x| <= 4u * (|x| + |t| / s)`` per block (to first order
    in the unit roundoff ``u``).
    ``dim=``: deprecated spelling of ``split_dim=``.
    """

    def __init__(self, *, clamp: float = 2.0, split_dim: int = -1, dim: int | None = None) -> None:
        split_dim = _split_dim(split_dim, dim, "AffineCoupling(dim=...)", -1, depth=2)
        if not (_is_number(clamp) and clamp > 0 and math.isfinite(clamp)):
            raise InvalidArgumentError(
                f"clamp={clamp!r}: the scale bound must be a positive finite number, e.g. 2.0"
            )
        if isinstance(split_dim, bool) or not isinstance(split_dim, int):
            raise InvalidArgumentError(
                f"split_dim={split_dim!r}: pass the int dimension along which a single-tensor "
                "branch output is split into (log_scale, shift), e.g. -1"
            )
        self.clamp = float(clamp)
        self.split_dim = split_dim

    @property
    def dim(self) -> int:
        """Deprecated: :attr:`split_dim`."""
        warn_deprecated("AffineCoupling.dim", "AffineCoupling.split_dim")
        return self.split_dim

    def _scale_shift(self, h: Any) -> tuple[torch.Tensor, torch.Tensor]:
        a, t = h if isinstance(h, (tuple, list)) else h.chunk(2, dim=self.split_dim)
        return torch.exp(self.clamp * torch.tanh(a / self.clamp)), t

    def combine(self, x: torch.Tensor, h: Any) -> torch.Tensor:
        s, t = self._scale_shift(h)
        return x * s + t

    def separate(self, y: torch.Tensor, h: Any) -> torch.Tensor:
        s, t = self._scale_shift(h)
        return (y - t) / s

    def check(self, x: torch.Tensor, h: Any, *, branch: str) -> None:
        if isinstance(h, (tuple, list)):
            shapes = [tuple(p.shape) for p in h if isinstance(p, torch.Tensor)]
            ok = len(h) == 2 and shapes == [tuple(x.shape)] * 2
        elif isinstance(h, torch.Tensor):
            if not -x.dim() <= self.split_dim < x.dim():
                raise InvalidArgumentError(
                    f"AffineCoupling(split_dim={self.split_dim}) splits the branch output along "
                    f"dim {self.split_dim}, but the stream has shape {tuple(x.shape)}; pass a dim "
                    "the stream has as split_dim, or return (log_scale, shift) as a tuple"
                )
            want = list(x.shape)
            want[self.split_dim] *= 2
            ok, shapes = list(h.shape) == want, [tuple(h.shape)]
        else:
            ok, shapes = False, [type(h).__name__]
        if not ok:
            raise InvalidArgumentError(
                f"branch {branch} returned {shapes} for a stream of shape {tuple(x.shape)}; an "
                "affine coupling needs (log_scale, shift) of the stream's shape, or one tensor "
                f"twice its size along dim {self.split_dim}"
            )

    def branch_size(
        self, size: int, *, split_dim: int | None = None, dim: int | None = None
    ) -> int:
        """``2 * size``: the branch returns log-scale and shift stacked along ``split_dim``,
        which must be the coupling's own ``split_dim``. ``dim=``: deprecated spelling."""
        split_dim = _split_dim(
            split_dim, dim, "AffineCoupling.branch_size(size, dim=...)", None, depth=2
        )
        if split_dim != self.split_dim:
            raise InvalidArgumentError(
                f"AffineCoupling(split_dim={self.split_dim}) splits the branch output along dim "
                f"{self.split_dim}, but this block's branches produce their features along dim "
                f"{split_dim}; pass AffineCoupling(split_dim={split_dim}) or coupling='affine'"
            )
        return 2 * size

    def __repr__(self) -> str:
        return f"AffineCoupling(clamp={self.clamp}, split_dim={self.split_dim})"


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def make_coupling(
    coupling: str | Coupling, *, split_dim: int = -1, dim: int | None = None
) -> Coupling:
    """A coupling from a name (``"additive"``, ``"affine"``) or a :class:`Coupling` instance
    (returned as is). ``split_dim``: the dimension a named affine coupling splits its branch
    output along (``AffineCoupling(split_dim=split_dim)``); ``dim=``: its deprecated spelling."""
    split_dim = _split_dim(split_dim, dim, "make_coupling(coupling, dim=...)", -1, depth=2)
    if isinstance(coupling, Coupling):
        return coupling
    if isinstance(coupling, str) and coupling in ("additive", "affine"):
        if coupling == "additive":
            return AdditiveCoupling()
        return AffineCoupling(split_dim=split_dim)
    raise InvalidArgumentError(
        f"coupling={coupling!r} is not a coupling; use 'additive', 'affine', or an instance of "
        "revckpt.layers.Coupling (subclass it to write your own)"
    )


def _split_dim(
    split_dim: int | None, dim: int | None, old: str, default: int | None, *, depth: int
) -> int:
    """``split_dim``, or the deprecated ``dim=`` given in its place (warned at the caller of the
    function ``depth - 1`` frames up); both given raises."""
    if dim is None:
        if split_dim is None and default is None:
            raise InvalidArgumentError(f"{old.replace('dim=', 'split_dim=')} needs split_dim")
        return split_dim
    warn_deprecated(old, old.replace("dim=", "split_dim="), depth=depth)
    if split_dim is not None and split_dim != default:
        raise InvalidArgumentError(
            f"got split_dim={split_dim} and its deprecated spelling dim={dim}; pass split_dim only"
        )
    return dim
