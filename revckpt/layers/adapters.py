"""The pieces that make a pretrained layer reversible while keeping its output (MEFT: Liao,
Tan and Monz, "Make Pre-trained Model Reversible", NeurIPS 2023).

A pretrained residual layer ``L`` (the whole layer, its own residual included) and two small
adapters ``A_f``, ``A_g`` become one :class:`~revckpt.layers.ReversibleBlock` on a *hidden*
stream ``h`` (what the layer saw before) and an *auxiliary* stream ``a``:

``"layer_f"`` (MEFT's first variant: the layer in ``F``, an adapter as ``G``)::

    h' = scale * a + L(h) + A_f(h)      a' = h - h' + A_g(h') / scale      then the streams swap

``"layer_g"`` (the second: an adapter as ``F``, the layer in ``G``)::

    u = h + A_f(a)                       h' = scale * (a - u) + L(u) + A_g(u)    then they swap

The adapters are ``up(act(down(x)))`` with ``up`` zero at construction, so at conversion ``A =
0`` and the only change to what the layers compute is ``scale`` times the residual update of
the layer before (at the first layer, nothing: its auxiliary input is zeros). With
``"layer_f"``, ``a`` is minus that update (``h - h'``); with ``"layer_g"``, ``a`` is the hidden
state one layer back and ``G`` subtracts ``scale * u`` (:class:`Centred`), which leaves the
same ``scale * (a - u)``: both variants move each layer's input by ``scale`` times an update,
not by ``scale`` times a hidden state (MEFT's ``scale * a`` moved the logits of
``benchmarks/bench_finetune.py``'s GPT 4.7x further at scale 1/8). Both are still couplings
(what ``G`` adds is a function of ``u`` alone). ``"layer_f"``'s ``A_g`` is divided by
``scale`` so that it reaches the next layer's output at full strength, as the other adapters
do (``scale * a'`` enters it): undivided, an adapter trained at 2^-8 moved that output
2^-8 as far per step as the others, and adapters-only fine-tuning lost it. The inverse
divides by ``scale``: reconstruction error grows by about ``1 / scale`` per layer
(:class:`~revckpt.layers.ScaledCoupling`), which ``anchor_every`` bounds.
:func:`revckpt.make_reversible` builds these blocks on a model's own layers, in place.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import nn

from ..errors import InvalidArgumentError
from .coupling import AdditiveCoupling, Coupling, ScaledCoupling
from .grid import GridCoupling
from .sequential import ReversibleBlock

__all__ = ["VARIANTS", "Adapter", "Centred", "LayerBranch", "adapter_block"]

Variant = Literal["layer_f", "layer_g"]
VARIANTS: tuple[str, ...] = ("layer_f", "layer_g")


class Adapter(nn.Module):
    """``up(act(down(x)))``, a bottleneck of ``rank`` features, without biases: ``down`` drawn
    from ``N(0, init_std^2)`` (MEFT's 0.02), ``up`` zero, so a new adapter returns zeros and
    its first gradients reach ``up``. Extra keyword arguments (a block's) are ignored. ``dim``:
    the input's feature dimension (``-1``, tokens; ``1``, channels first, as a CNN's
    ``(N, C, H, W)``: a 1x1 convolution)."""

    dim = -1  # an adapter pickled before the option existed acts on the last dimension
    #: ``(variant, scale)`` of the stack it was made for (:func:`revckpt.make_reversible`),
    #: kept in the ``state_dict`` so that adapters trained for one are refused by another
    converted_as: tuple[str, float] | None = None

    def __init__(self, width: int, rank: int = 8, *, init_std: float = 0.02, dim: int = -1) -> None:
        super().__init__()
        self.dim = dim
        if not (isinstance(rank, int) and rank >= 1 and isinstance(width, int) and width >= 1):
            raise InvalidArgumentError(
                f"Adapter(width={width!r}, rank={rank!r}): pass positive ints"
            )
        self.down = nn.Linear(width, rank, bias=False)
        self.act = nn.GELU()
        self.up = nn.Linear(rank, width, bias=False)
        nn.init.normal_(self.down.weight, std=init_std)
        nn.init.zeros_(self.up.weight)

    def get_extra_state(self) -> torch.Tensor:
        """``[format, variant, scale]`` (float64; ``nan`` for an adapter of no stack): what
        its weights mean. Format 2: ``layer_f``'s ``A_g`` divided by the scale (2026-12-06)."""
        if self.converted_as is None:
            return torch.tensor([_FORMAT, math.nan, math.nan], dtype=torch.float64)
        variant, scale = self.converted_as
        return torch.tensor([_FORMAT, VARIANTS.index(variant), scale], dtype=torch.float64)

    def set_extra_state(self, state: Any) -> None:
        mine = self.get_extra_state()
        if isinstance(state, torch.Tensor) and torch.equal(
            state.detach().cpu().double().nan_to_num(-1.0), mine.nan_to_num(-1.0)
        ):
            return
        raise InvalidArgumentError(
            f"these adapter weights were saved for {_describe(state)}, and this adapter is "
            f"{_describe(mine)}: the same weights compute another function. Convert with "
            "the variant and scale they were trained with (make_reversible(model, "
            "variant=..., scale=...)), then load"
        )

    def forward(self, x: torch.Tensor, **_: Any) -> torch.Tensor:
        if self.dim in (-1, x.dim() - 1):
            return self._features_last(x)
        return self._features_last(x.movedim(self.dim, -1)).movedim(-1, self.dim)

    def _features_last(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.down.weight
        # (a quantised Linear's weight is a method, its packed weights no parameter: it takes
        # and returns float32)
        dtype = weight.dtype if isinstance(weight, torch.Tensor) else torch.float32
        if x.dtype == dtype or (x.dtype != torch.float64 and torch.is_autocast_enabled()):
            return self.up(self.act(self.down(x)))  # (autocast casts what it runs)
        return self.up(self.act(self.down(x.to(dtype)))).to(x.dtype)  # wider streams


_FORMAT = 2.0


def _describe(state: Any) -> str:
    """What an adapter's extra state says, in words."""
    if not (isinstance(state, torch.Tensor) and state.numel() == 3):
        return f"an unknown layout ({state!r})"
    fmt, variant, scale = state.tolist()
    if math.isnan(variant):
        return f"no reversible stack (format {fmt:g})"
    return f"variant={VARIANTS[int(variant)]!r}, scale={scale:g} (format {fmt:g})"


class LayerBranch(nn.Module):
    """A pretrained layer as a reversible branch: ``call(layer, u, **kwargs)`` (the layer's own
    forward on the hidden state ``u``, its other arguments supplied by ``call``) plus an
    adapter on ``u``. The layer and the adapter are submodules: their parameters are the
    branch's, trainable or frozen as they are in the model. ``dtype``: the layer's own
    (the streams may be wider: ``u`` is cast to it, and the output back)."""

    def __init__(
        self,
        layer: nn.Module,
        adapter: Adapter,
        call: Callable[..., torch.Tensor],
        *,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.layer = layer
        self.adapter = adapter
        self._call = call
        self._dtype = dtype

    def forward(self, u: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        if self._dtype is None or u.dtype == self._dtype:
            return self._call(self.layer, u, **kwargs) + self.adapter(u)
        v = u.to(self._dtype)
        return (self._call(self.layer, v, **kwargs) + self.adapter(v)).to(u.dtype)


class _StartCoupling(Coupling):
    """The first layer's coupling on the auxiliary stream, which enters as zeros: ``y = h``
    and the rebuilt input is ``y - h``, zeros again exactly where the recompute gives the
    forward's ``h`` (nothing divides by ``scale``), and not zeros where it differs, which the
    inverse check then sees."""

    linear_scale = 0.0

    def combine(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return h + 0 * x  # differentiable in x (gradient zero), as a coupling must be

    def separate(self, y: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return y - h

    def check(self, x: torch.Tensor, h: Any, *, branch: str) -> None:
        AdditiveCoupling().check(x, h, branch=branch)


class Centred(nn.Module):
    """``branch(u) - scale * u``: ``G`` of ``"layer_g"``, so that the coupling ``scale * a +
    G(u)`` gives ``L(u) + scale * (a - u)``, the layer's output moved by ``scale`` times the
    residual update of the layer before (``a - u``) rather than by ``scale`` times the hidden
    state ``a``. Computed in ``u``'s dtype (the streams'), ``scale`` a power of two: exact."""

    def __init__(self, branch: nn.Module, scale: float) -> None:
        super().__init__()
        self.branch = branch
        self.scale = scale

    def forward(self, u: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        return self.branch(u, **kwargs) - self.scale * u


class _Difference(nn.Module):
    """``adapter(u) * gain - u``: as ``G`` of ``"layer_f"`` (``gain = 1 / scale``), the
    auxiliary stream becomes ``h - h' + A_g(h') / scale``, minus the layer's residual update
    (small beside the hidden state) until the adapter learns, and ``scale`` times it, what
    enters the next layer, carries ``A_g`` at full strength. ``gain`` a power of two on the
    grid: exact."""

    gain = 1.0  # a block pickled before the gain existed

    def __init__(self, adapter: Adapter, gain: float = 1.0) -> None:
        super().__init__()
        self.adapter = adapter
        self.gain = gain

    def forward(self, u: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        out = self.adapter(u)
        return (out if self.gain == 1.0 else out * self.gain) - u


def adapter_block(
    layer: LayerBranch,
    adapter: Adapter,
    *,
    variant: Variant,
    scale: float,
    first: bool,
    exact: bool = False,
) -> ReversibleBlock:
    """The reversible block of one pretrained layer (see the module docstring). Its input is
    ``(a, h)`` for ``"layer_f"`` and ``(h, a)`` for ``"layer_g"``, and so is its output (the
    block swaps its streams), so a stack of them chains; ``first``: the block of the first
    layer, whose auxiliary input is zeros; ``exact``: both couplings on the fixed-point grid
    of :mod:`revckpt.layers.grid` (streams float64 on the grid; rebuilt bit for bit)."""
    if variant not in VARIANTS:
        raise InvalidArgumentError(f"variant={variant!r}: use one of {', '.join(VARIANTS)}")
    scaled: Coupling
    additive: Coupling | str
    if exact:
        scaled, additive = GridCoupling(0.0 if first else scale), GridCoupling(1.0)
    else:
        scaled, additive = (_StartCoupling() if first else ScaledCoupling(scale)), "additive"
    if variant == "layer_f":  # y1 = scale * a + F(h); y2 = h + A_g(y1) / scale; out (y2, y1)
        g = _Difference(adapter, 1.0 / scale)
        return ReversibleBlock(layer, g, coupling=scaled, g_coupling=additive, swap=True)
    # y1 = h + A_f(a); y2 = scale * a + G(y1) - scale * y1 (none at the first); out (y2, y1)
    g_layer = layer if first else Centred(layer, scale)
    return ReversibleBlock(adapter, g_layer, coupling=additive, g_coupling=scaled, swap=True)
