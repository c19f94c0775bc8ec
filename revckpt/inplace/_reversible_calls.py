"""How :func:`revckpt.make_reversible` calls a converted layer: its own forward on the hidden
state (:class:`LayerCall`), what it may and may not be given besides (:func:`check_constant`),
what it returns, and the hidden width read off its norms."""

from __future__ import annotations

import types
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..errors import InvalidArgumentError, RevckptError
from .calls import Key, hidden_of, own_forward, replaced, static_forward

if TYPE_CHECKING:
    from ._reversible_stack import Calls

__all__ = [
    "LayerCall",
    "Plain",
    "check_constant",
    "dtype_of",
    "features_of",
    "forward_function",
    "passes",
    "with_hidden",
]


class Plain:
    """An instance ``forward`` that is not a method of its layer (a ``functools.partial``, a
    hook's wrapper), called as ``fn(*args, **kwargs)`` (the layer argument dropped); picklable
    when ``fn`` is."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def __call__(self, _layer: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


def forward_function(layer: nn.Module) -> Any:
    """The instance ``forward`` the layer has, as ``fn(layer, *args, **kwargs)``: ``None``
    (none: its class's), the function of a method bound to the layer itself, or :class:`Plain`."""
    before = layer.__dict__.get("forward")
    if before is None:
        return None
    if isinstance(before, types.MethodType) and before.__self__ is layer:
        return before.__func__
    return Plain(before)


def instance_forward(layer: nn.Module, fn: Any) -> Any:
    """The inverse of :func:`forward_function`: what to put back as ``layer.forward``."""
    if fn is None:
        return None
    if isinstance(fn, Plain):
        return fn.fn
    return types.MethodType(fn, layer)


def passes(args: tuple[Any, ...], kwargs: dict[str, Any], hidden: torch.Tensor) -> bool:
    return any(a is hidden for a in args) or any(v is hidden for v in kwargs.values())


def with_hidden(out: Any, hidden: torch.Tensor) -> Any:
    """The layer's output with its hidden state replaced (a tuple's or list's first item)."""
    if isinstance(out, tuple):
        return (hidden, *out[1:])
    if isinstance(out, list):
        return [hidden, *out[1:]]
    raise InvalidArgumentError(
        f"make_reversible converts layers that return their hidden state as a tensor or as "
        f"the first item of a tuple, got {type(out).__name__}"
    )


def _grad_tensors(name: str, value: Any) -> list[str]:
    """``name`` (or ``name[i]``, ``name['k']`` one level down) where ``value`` holds a tensor
    that requires grad."""
    if isinstance(value, torch.Tensor):
        return [name] if value.requires_grad else []
    if isinstance(value, (tuple, list)):
        items: Any = enumerate(value)
    elif isinstance(value, dict):
        items = ((repr(k), v) for k, v in value.items())
    else:
        return []
    found = []
    for k, v in items:
        if isinstance(v, torch.Tensor) and v.requires_grad:
            found.append(f"{name}[{k}]")
    return found


def check_constant(fqn: str, args: tuple[Any, ...], kwargs: dict[str, Any], key: Key) -> None:
    """Refuse a layer argument other than the hidden state that requires grad: the reversible
    backward returns gradients for the two streams and the layers' parameters only."""
    found = [n for i, a in enumerate(args) if i != key for n in _grad_tensors(f"argument {i}", a)]
    found += [n for k, v in kwargs.items() if k != key for n in _grad_tensors(repr(k), v)]
    if not found:
        return
    raise InvalidArgumentError(
        f"layer {fqn} was called with {', '.join(found)} requiring grad besides its hidden "
        "state (a cross-attention context, a position bias computed from parameters?): a "
        "reversible stack returns gradients to its hidden state and its layers' parameters "
        "only, so that tensor's gradient would be lost. Convert only layers whose other "
        "arguments need no gradient (blocks= naming the self-attention stack), keep it "
        "constant (freeze what computes it, or pass it detached), or set "
        "revckpt.inplace.reversible_layers(model).reversible = False (plain autograd)"
    )


class LayerCall:
    """Layer ``index``'s own forward (its class's, or the instance ``forward`` it had before,
    as ``before(layer, ...)``) on the hidden state ``u``, with the other arguments of its call
    in the current pass (recorded by ``ReversibleLayers.call``), in the layer's dtype as it is
    now (``u`` is cast to it and the output back: wider streams, or a model cast after
    conversion). Called with the layer it runs, so a deep copy of the model runs its own copy."""

    def __init__(self, index: int, before: Any) -> None:
        self.index = index
        self.before = before

    def __call__(self, layer: nn.Module, u: torch.Tensor, *, calls: Calls) -> torch.Tensor:
        index = self.index
        first = calls.forward_args.get(index) if calls.forwarding else None
        args, kwargs, key = calls.args[index] if first is None else first
        dtype = dtype_of(layer)
        v = u if dtype is None or dtype == u.dtype else u.to(dtype)
        a, k = replaced(args, kwargs, key, v)
        if self.before is not None:
            out = self.before(layer, *a, **k)
        elif static_forward(type(layer)):
            out = type(layer).forward(*a, **k)
        else:
            out = own_forward(type(layer).forward)(layer, *a, **k)
        if calls.forwarding:
            calls.output = _without_hidden(out, keep=calls.by_autograd)
        h = hidden_of(out, f"layer {index}")
        if h.shape != v.shape:  # the coupling would broadcast it, or fail deep inside
            raise InvalidArgumentError(
                f"layer {index} of the stack make_reversible converted returned a hidden state "
                f"of shape {tuple(h.shape)} for one of shape {tuple(v.shape)}: a reversible "
                "stack adds each layer's output to its input, so its layers keep the shape "
                "(pooling, or a change of width, is not a residual layer); convert only the "
                "layers that keep it (blocks=...)"
            )
        return h if h.dtype == u.dtype else h.to(u.dtype)


def _without_hidden(out: Any, *, keep: bool = False) -> Any:
    """The layer's output with its hidden state left out; a further output that requires grad
    (attention weights, which BLOOM's layers return whether asked or not; a position bias) is
    given back detached, its gradient refused in backward (:class:`_NoGradient`), unless
    ``keep`` (the pass runs by autograd: its gradient flows)."""
    if isinstance(out, torch.Tensor) or keep:
        return out
    rest = list(out[1:]) if isinstance(out, (tuple, list)) else []
    for i, t in enumerate(rest):
        if isinstance(t, torch.Tensor) and t.requires_grad:
            rest[i] = _NoGradient.apply(torch.zeros((), requires_grad=True), t.detach(), i + 1)
    return type(out)((None, *rest)) if isinstance(out, (tuple, list)) else out


class _NoGradient(torch.autograd.Function):
    """A layer output besides the hidden state, as a value: the reversible stack differentiates
    the hidden state only, so a gradient reaching it raises (unused, as a model that drops
    its layers' attention weights does, it costs nothing)."""

    @staticmethod
    def forward(ctx: Any, _anchor: torch.Tensor, value: torch.Tensor, item: int) -> torch.Tensor:
        ctx.item, ctx.shape = item, tuple(value.shape)
        return value.view_as(value)

    @staticmethod
    def backward(ctx: Any, _grad: torch.Tensor) -> tuple[None, None, None]:
        raise RevckptError(
            f"a gradient reached output item {ctx.item} (shape {ctx.shape}) of a layer "
            "converted by make_reversible, besides its hidden state: attention weights, or a "
            "position bias made from trainable weights (T5's first layer returns one)? A "
            "reversible stack carries the hidden state only, so that gradient would be lost: "
            "call the model with output_attentions=False, freeze what computes it, or set "
            "revckpt.inplace.reversible_layers(model).reversible = False (plain autograd)"
        )


def dtype_of(layer: nn.Module) -> torch.dtype | None:
    p = next(layer.parameters(), None)
    return None if p is None else p.dtype


#: Norms over dimension 1 of their input (channels first): the hidden state's features are there.
CHANNELS_FIRST = (
    nn.modules.batchnorm._BatchNorm,
    nn.GroupNorm,
    nn.modules.instancenorm._InstanceNorm,
)


def features_of(
    layer: nn.Module, fqn: str, width: int | None = None, dim: int | None = None
) -> tuple[int, int]:
    """The hidden width and the dimension it is on (``width``, ``dim``: given, else read off
    the layer): the size of the layer's widest normalisation weight (of a module whose class
    or a 1-D parameter whose name says norm or ln), on dimension 1 when that norm is a
    BatchNorm, GroupNorm or InstanceNorm (channels first, as in a CNN), else the last
    (LayerNorm, RMSNorm: tokens)."""
    if width is not None and dim is not None:
        return width, dim
    sizes = [s for s in _norm_sizes(layer) if width is None or s[0] == width]
    if sizes:  # the largest: a per-head norm (QK-norm) is narrower than the hidden state
        found = max(sizes, key=lambda s: s[0])  # the first of the widest: its module's axis
        return found[0], found[1] if dim is None else dim
    if width is not None:
        return width, -1 if dim is None else dim
    raise InvalidArgumentError(
        f"cannot tell the hidden width of layer {fqn}: pass width= (the size of its hidden "
        "state's feature dimension) and, for channels-first inputs, feature_dim=1"
    )


def _norm_sizes(layer: nn.Module) -> list[tuple[int, int]]:
    sizes: list[tuple[int, int]] = []
    for m in layer.modules():
        weight = getattr(m, "weight", None)
        named_norm = "norm" in type(m).__name__.lower()
        if named_norm and isinstance(weight, torch.Tensor) and weight.dim() == 1:
            sizes.append((weight.numel(), 1 if isinstance(m, CHANNELS_FIRST) else -1))
    for name, p in layer.named_parameters():
        leaf = name.lower().rpartition(".")[0].rpartition(".")[2]
        if p.dim() == 1 and ("norm" in leaf or leaf.startswith("ln")):
            sizes.append((p.numel(), -1))
    return sizes
