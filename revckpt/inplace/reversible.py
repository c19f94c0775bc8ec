"""Reversible fine-tuning of a pretrained model, in place (:func:`make_reversible`).

The model's repeated layers become one reversible stack (:mod:`revckpt.layers.adapters`)
while the model's own forward keeps calling them one by one: each layer's ``forward`` is
replaced on the instance (its class, parameters and ``state_dict`` keys stay), and the call of
layer ``i`` runs block ``i`` of the stack (:class:`revckpt.layers.steps.StackRun`). The
auxiliary stream travels from call to call beside the hidden state the model passes on; the
last layer's call ends the stack, whose backward rebuilds every layer's input from its output.
The adapters are registered on their layers (``<layer>.revckpt_adapter_f`` / ``_g``), so an
optimiser over ``model.parameters()`` and ``state_dict`` see them; the original
``state_dict`` loads with ``strict=False`` (only the adapters are missing).
"""

from __future__ import annotations

import math
import types
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from ..errors import InvalidArgumentError, RevckptError
from ..layers.adapters import VARIANTS, Adapter, LayerBranch, adapter_block
from ..layers.coupling import ScaledCoupling
from ..layers.sequential import ReversibleBlock, ReversibleSequential
from ..layers.steps import StackRun
from .blocks import Blocks, find_blocks
from .calls import Key, carried_key, drop_caches, hidden_of, replaced
from .install import REVERSIBLE_ATTR

__all__ = ["ReversibleLayers", "make_reversible", "reversible_layers"]

_ATTR = REVERSIBLE_ATTR


@dataclass
class _Calls:
    """The arguments of each layer's call in one forward pass (the hidden state left out),
    for its branch to re-run it in backward, and the output of the call being made."""

    args: dict[int, tuple[tuple[Any, ...], dict[str, Any], Key]] = field(default_factory=dict)
    output: Any = None
    forwarding: bool = False


@dataclass
class _Pass:
    """One forward pass through the stack: where it is, its streams and its run."""

    calls: _Calls
    run: StackRun | None
    streams: tuple[torch.Tensor, torch.Tensor]
    next_index: int = 1


class ReversibleLayers:
    """What :func:`make_reversible` installed on a model: the stack and the converted layers.

    ``last_drift``: per layer, the reconstruction error of its input measured in the last
    backward (see ``check_inverse``); ``reversible``: set ``False`` to run the same function
    with plain autograd (everything stored), e.g. for a reference gradient."""

    def __init__(
        self,
        layers: list[tuple[str, nn.Module]],
        stack: ReversibleSequential,
        hidden: int,
        stream_dtype: torch.dtype | None = None,
    ) -> None:
        self.layers = layers
        self.stack = stack
        self.hidden = hidden  # which stream of a block's input and output is the hidden state
        self.stream_dtype = stream_dtype
        self._dtype: torch.dtype | None = None  # the hidden state's, as the model passes it
        self.width: int | None = None  # the adapters' (the hidden state's last dimension)
        self.reversible = True
        self._pass: _Pass | None = None

    @property
    def last_drift(self) -> list[float | None]:
        return self.stack.last_drift

    def call(self, index: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Layer ``index`` called by the model with ``args`` and ``kwargs``."""
        if index == 0:
            key = carried_key(args, kwargs)
            state = self._start(args, kwargs, key)
        else:
            state = self._continue(index, args, kwargs)
            key = carried_key(args, kwargs, state.streams[self.hidden])
        assert key is not None
        if torch.is_grad_enabled():
            args, kwargs = drop_caches(args, kwargs, f"{self.layers[index][0]} (reversible)")
        state.calls.args[index] = (*replaced(args, kwargs, key, None), key)
        state.calls.forwarding = True
        try:
            streams = self._block(state, index)
        finally:
            state.calls.forwarding = False
        out, state.calls.output = state.calls.output, None
        last = index == len(self.layers) - 1
        if last and state.run is not None:
            streams = tuple(state.run.finish(None))
        state.streams = streams
        if last:
            self._pass = None
        hidden = streams[self.hidden]
        if last and self._dtype is not None and hidden.dtype != self._dtype:
            hidden = hidden.to(self._dtype)  # back from wider streams
        return hidden if isinstance(out, torch.Tensor) else _with_hidden(out, hidden)

    def _start(self, args: tuple[Any, ...], kwargs: dict[str, Any], key: Key | None) -> _Pass:
        if key is None:
            raise InvalidArgumentError(
                f"layer {self.layers[0][0]} got no floating-point tensor to carry as its hidden "
                "state; make_reversible converts layers whose first argument (or keyword "
                "hidden_states / x) is the hidden state"
            )
        h = args[key] if isinstance(key, int) else kwargs[key]
        width = self.width
        if width is not None and h.shape[-1] != width:
            raise InvalidArgumentError(
                f"layer {self.layers[0][0]} got a hidden state of shape {tuple(h.shape)}, but "
                f"make_reversible built its adapters for width {width}: pass width= (the size "
                "of the hidden state's last dimension)"
            )
        self._dtype = h.dtype
        if self.stream_dtype is not None:
            h = h.to(self.stream_dtype)
        aux = torch.zeros_like(h)
        streams = (aux, h) if self.hidden == 1 else (h, aux)
        calls = _Calls()
        run = self.stack.stepwise(*streams, calls=calls) if self.reversible else None
        self._pass = _Pass(calls, run, streams)
        return self._pass

    def _continue(self, index: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Pass:
        state = self._pass
        name = self.layers[index][0]
        if state is None or state.next_index != index:
            raise RevckptError(
                f"layer {name} was called out of order: make_reversible runs layers "
                f"{self.layers[0][0]} .. {self.layers[-1][0]} as one reversible stack, called "
                "one after the other in every forward pass"
            )
        hidden = state.streams[self.hidden]
        if not _passes(args, kwargs, hidden):
            raise RevckptError(
                f"layer {name} did not get the hidden state layer {self.layers[index - 1][0]} "
                "returned: the model changed it between the two layers, which a reversible "
                "stack cannot rebuild; convert a stack of layers that pass it on unchanged"
            )
        state.next_index = index + 1
        return state

    def _block(self, state: _Pass, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if state.run is not None:
            return state.run.block(index)
        block = self.stack.blocks[index]
        return block(*state.streams, calls=state.calls)


def _passes(args: tuple[Any, ...], kwargs: dict[str, Any], hidden: torch.Tensor) -> bool:
    return any(a is hidden for a in args) or any(v is hidden for v in kwargs.values())


def _with_hidden(out: Any, hidden: torch.Tensor) -> Any:
    """The layer's output with its hidden state replaced (a tuple's or list's first item)."""
    if isinstance(out, tuple):
        return (hidden, *out[1:])
    if isinstance(out, list):
        return [hidden, *out[1:]]
    raise InvalidArgumentError(
        f"make_reversible converts layers that return their hidden state as a tensor or as "
        f"the first item of a tuple, got {type(out).__name__}"
    )


class _LayerCall:
    """Layer ``index``'s own forward (its class's, or the instance ``forward`` it had before)
    on the hidden state ``u``, with the other arguments of its call in the current pass
    (recorded by :meth:`ReversibleLayers.call`). Called with the layer it runs, so a deep
    copy of the model runs its own copy."""

    def __init__(self, index: int, before: Any) -> None:
        self.index = index
        self.before = before  # an instance forward the layer had, as a plain function

    def __call__(self, layer: nn.Module, u: torch.Tensor, *, calls: _Calls) -> torch.Tensor:
        index = self.index
        args, kwargs, key = calls.args[index]
        a, k = replaced(args, kwargs, key, u)
        fn = type(layer).forward if self.before is None else self.before
        out = fn(layer, *a, **k)
        if calls.forwarding:
            calls.output = _without_hidden(out)
        return hidden_of(out, f"layer {index}")


def _without_hidden(out: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return out
    rest = tuple(out[1:]) if isinstance(out, (tuple, list)) else ()
    for t in rest:
        if isinstance(t, torch.Tensor) and t.requires_grad:
            raise InvalidArgumentError(
                "a converted layer returned a tensor that requires grad besides its hidden "
                "state (attention weights?); a reversible stack carries the hidden state only: "
                "call the model with output_attentions=False"
            )
    return type(out)((None, *rest)) if isinstance(out, (tuple, list)) else out


def _forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    index, layers = self.__dict__[_ATTR]
    return layers.call(index, args, kwargs)


def _dtype_of(layer: nn.Module) -> torch.dtype | None:
    p = next(layer.parameters(), None)
    return None if p is None else p.dtype


def _width(layer: nn.Module, fqn: str) -> int:
    """The hidden width: the size of the layer's widest normalisation weight (of a module whose
    class or a 1-D parameter whose name says norm or ln)."""
    sizes = []
    for m in layer.modules():
        weight = getattr(m, "weight", None)
        named_norm = "norm" in type(m).__name__.lower()
        if named_norm and isinstance(weight, torch.Tensor) and weight.dim() == 1:
            sizes.append(weight.numel())
    for name, p in layer.named_parameters():
        leaf = name.lower().rpartition(".")[0].rpartition(".")[2]
        if p.dim() == 1 and ("norm" in leaf or leaf.startswith("ln")):
            sizes.append(p.numel())
    if sizes:  # the largest: a per-head norm (QK-norm) is narrower than the hidden state
        return max(sizes)
    raise InvalidArgumentError(
        f"cannot tell the hidden width of layer {fqn}: pass width= (the size of its hidden "
        "state's last dimension)"
    )


def make_reversible(
    model: nn.Module,
    *,
    variant: Literal["layer_f", "layer_g"] = "layer_f",
    scale: float = 0.125,
    rank: int = 8,
    trainable: Literal["adapters", "all"] = "adapters",
    blocks: Blocks = None,
    width: int | None = None,
    anchor_every: int | Literal["auto"] | None = "auto",
    check_inverse: float | Literal["auto"] | None = "auto",
    stream_dtype: torch.dtype | None = None,
) -> nn.Module:
    """Make a pretrained model's layers one reversible stack, keeping its output at
    conversion up to ``scale`` (MEFT; see :mod:`revckpt.layers.adapters`). In place; returns
    the model.

    Args:
        variant: ``"layer_f"``, each layer as ``F`` with an adapter as ``G``, or
            ``"layer_g"``, an adapter as ``F`` and the layer as ``G``.
        scale: how much of the auxiliary stream (the hidden state one layer back) enters each
            layer's input; the smaller, the closer the output to the original model's, and
            the faster reconstruction error grows (by about ``1 / scale`` per layer: use
            ``anchor_every`` on deep stacks). A power of two is exact.
        rank: the adapters' bottleneck width.
        trainable: ``"adapters"`` freezes every parameter of the model but the adapters
            (``requires_grad=False``: no gradients, no memory for them); ``"all"`` leaves the
            model's parameters as they are.
        blocks: the layers (an attribute path such as ``"transformer.h"``, or a filter); by
            default the model's repeated blocks (:func:`revckpt.inplace.find_blocks`), which
            must be consecutive children of one container.
        width: the hidden state's size (default: read off the first layer's norm).
        anchor_every: store the inputs of layers ``k, 2k, ...`` exactly, so reconstruction
            error grows over at most ``k`` layers (two stored streams per anchor; layer 0 is
            rebuilt exactly).
            ``"auto"``: the largest ``k`` with ``(2 / scale) ** k * eps <= 1e-3`` for the
            layers' dtype (scale 1/8: 3 for float32, 1 for bfloat16, 10 for float64), none if
            that covers every layer; ``None``: no anchors.
        check_inverse: as for :class:`revckpt.layers.ReversibleSequential`; the measured
            drift per layer is in ``revckpt.inplace.reversible_layers(model).last_drift``.
        stream_dtype: carry the two streams in a wider dtype than the model's (e.g.
            ``torch.float64`` for a float32 model): the layers still run in their own dtype,
            the couplings and the rebuild in the wider one. Usually far less drift (a sum of
            a few float32 values is exact in float64), but not in the worst case: a rebuilt
            value that rounds to the layer's dtype differently from the forward injects that
            dtype's rounding, which grows as before, so the automatic anchors are the same and
            each costs twice the bytes. ``None`` (default): the model's dtype.
    """
    if variant not in VARIANTS:
        raise InvalidArgumentError(f"variant={variant!r}: use one of {', '.join(VARIANTS)}")
    if trainable not in ("adapters", "all"):
        raise InvalidArgumentError(f"trainable={trainable!r}: use 'adapters' or 'all'")
    ScaledCoupling(scale)  # checks the scale
    layers = _layers_of(model, blocks)
    if trainable == "adapters":
        for p in model.parameters():
            p.requires_grad_(False)
    built = [
        _layer_block(i, fqn, layer, variant, scale, rank, width)
        for i, (fqn, layer) in enumerate(layers)
    ]
    if variant == "layer_f":  # the last layer's auxiliary output reaches nothing: the adapter
        layers[-1][1].revckpt_adapter_g.requires_grad_(False)  # that makes it cannot learn
    model_dtype = _dtype_of(layers[0][1]) or torch.float32
    if stream_dtype is not None and not (
        isinstance(stream_dtype, torch.dtype)
        and stream_dtype.is_floating_point
        and torch.finfo(stream_dtype).eps <= torch.finfo(model_dtype).eps
    ):
        raise InvalidArgumentError(
            f"stream_dtype={stream_dtype!r}: pass a floating torch.dtype at least as wide as "
            f"the model's {model_dtype} (e.g. torch.float64), or None"
        )
    if anchor_every == "auto":
        anchor_every = auto_anchors(scale, model_dtype, len(layers))
    stack = ReversibleSequential(*built, anchor_every=anchor_every, check_inverse=check_inverse)
    # the first layer is rebuilt exactly (its auxiliary input is zeros): anchors k, 2k, ...
    stack.first_anchor = anchor_every or 0
    hidden = 1 if variant == "layer_f" else 0
    converted = ReversibleLayers(layers, stack, hidden, stream_dtype)
    converted.width = width if width is not None else _width(layers[0][1], layers[0][0])
    for i, (_, layer) in enumerate(layers):
        object.__setattr__(layer, _ATTR, (i, converted))
        object.__setattr__(layer, "forward", types.MethodType(_forward, layer))
    object.__setattr__(model, _ATTR, converted)
    return model


def _layer_block(
    i: int, fqn: str, layer: nn.Module, variant: str, scale: float, rank: int, width: int | None
) -> ReversibleBlock:
    """Layer ``i``'s reversible block, its two adapters registered on it."""
    size = width if width is not None else _width(layer, fqn)
    like = next(layer.parameters(), None)
    a_f, a_g = Adapter(size, rank), Adapter(size, rank)
    if like is not None:
        a_f.to(like.device, like.dtype)
        a_g.to(like.device, like.dtype)
    layer.add_module("revckpt_adapter_f", a_f)
    layer.add_module("revckpt_adapter_g", a_g)
    before = layer.__dict__.get("forward")
    if before is not None:  # an instance forward (a bound method): its function
        before = getattr(before, "__func__", None) or (lambda _layer, *a, **k: before(*a, **k))
    call, dtype = _LayerCall(i, before), _dtype_of(layer)
    if variant == "layer_f":
        branch, other = LayerBranch(layer, a_f, call, dtype=dtype), a_g
    else:
        branch, other = LayerBranch(layer, a_g, call, dtype=dtype), a_f
    return adapter_block(branch, other, variant=variant, scale=scale, first=i == 0)  # type: ignore[arg-type]


def auto_anchors(scale: float, dtype: torch.dtype, depth: int) -> int | None:
    """``anchor_every="auto"``: the largest ``k`` with ``(2 / scale) ** k * eps <= 1e-3``
    (``eps`` of the layers' ``dtype``; reconstruction error was measured to grow by up to
    ``2 / scale`` per layer; at least 1), or ``None`` when ``k`` covers all ``depth`` layers."""
    eps = torch.finfo(dtype if dtype.is_floating_point else torch.float32).eps
    rate = 2 / scale
    if rate <= 1:
        return None
    k = max(1, math.floor(math.log(1e-3 / eps) / math.log(rate))) if eps < 1e-3 else 1
    return None if k >= depth else k


def reversible_layers(model: nn.Module) -> ReversibleLayers:
    """What :func:`make_reversible` installed on ``model``."""
    found = model.__dict__.get(_ATTR)
    if not isinstance(found, ReversibleLayers):
        raise InvalidArgumentError(
            f"{type(model).__name__} was not converted by revckpt.make_reversible"
        )
    return found


def _layers_of(model: nn.Module, blocks: Blocks) -> list[tuple[str, nn.Module]]:
    if model.__dict__.get(_ATTR) is not None:
        raise InvalidArgumentError("this model was converted by make_reversible already")
    layers = find_blocks(model, blocks)
    parents = {fqn.rpartition(".")[0] for fqn, _ in layers}
    if len(parents) != 1 or len(layers) < 1:
        raise InvalidArgumentError(
            f"make_reversible converts one stack of layers; the blocks found span "
            f"{len(parents)} containers ({', '.join(sorted(parents))}): pass blocks='path' "
            "naming one"
        )
    parent = model.get_submodule(parents.pop()) if parents else model
    children = list(parent.children())
    chosen = [next(i for i, c in enumerate(children) if c is layer) for _, layer in layers]
    if chosen != list(range(chosen[0], chosen[0] + len(chosen))):
        raise InvalidArgumentError(
            "make_reversible converts consecutive layers (one reversible stack, each layer's "
            f"output the next one's input); the blocks chosen are {[f for f, _ in layers]}: "
            "pick a run of consecutive layers"
        )
    return layers
