"""Approximate recompute: a checkpoint whose kept input is compressed, optionally re-run in bf16.

``checkpoint(fn, x, store="e4m3")`` runs ``fn(x)`` without keeping its activations, like
:func:`revckpt.checkpoint`, but keeps ``x`` itself compressed by a
:class:`~revckpt.approx.formats.Codec` (1 byte per element plus a float32 scale per row for
fp8, 2 bytes for bf16, against 4 for float32). Backward decodes ``x_hat``, re-runs ``fn`` from
it, and returns the gradients of that recompute::

    kept:      encode(x)                                 (payload + scales)
    backward:  x_hat = decode(encode(x));  y_hat = fn(x_hat)
               dx, dtheta = VJP of y_hat at (x_hat, theta) with the incoming dy

So the forward output is exact and only the gradients see the approximation: each element of
``x_hat`` is within ``k * (u * |x| + eta / s)`` of ``x`` (see :mod:`revckpt.approx.formats`) and
:mod:`revckpt.approx.bounds` turns that into a bound on each parameter gradient.

``recompute_dtype=torch.bfloat16`` re-runs ``fn`` under bf16 autocast during backward while the
first forward stays exact. With ``store=None`` and no ``recompute_dtype`` nothing is approximate
and the gradients are bitwise those of :func:`revckpt.checkpoint` (tensors used by several
operations of one node, such as keyword tensors that require grad or parameters tied across a
segment's blocks: to round-off, the node summing their contributions first).

RNG (dropout masks), autocast state and BatchNorm statistics go through :mod:`revckpt.replay`,
as for every recompute. The block is one autograd node whose inputs are the tensor arguments,
the trainable parameters of ``fn`` (when it is an ``nn.Module``) and keyword tensors that
require grad, so ``torch.autograd.grad``, hooks and DDP see ordinary gradients.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from .._autograd import (
    differentiable_once,
    first_unregistered_leaf,
    forward_as_plain,
    grad_keywords,
    module_targets,
    modules_of,
    vjp,
)
from ..errors import InvalidArgumentError, InvalidInputTypeError
from ..replay import ForwardState
from .formats import FORMATS, Codec, Encoded, NonFiniteInputError, Rounding, Scaling

__all__ = ["Approx", "checkpoint"]

_RECOMPUTE_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Approx:
    """What an approximate recompute keeps and how it re-runs.

    Args:
        store: format of the kept block input: ``"bf16"``, ``"e4m3"``, ``"e5m2"``, or ``None``
            to keep it exact.
        scaling: ``"tensor"``, ``"row"``, ``"block"``, ``None``, or ``"auto"`` (``"row"`` for
            fp8, none for bf16, whose range is float32's).
        block_size: elements per scale with ``scaling="block"``.
        rounding: ``"nearest"`` or ``"stochastic"``.
        recompute_dtype: ``torch.bfloat16`` (or ``torch.float16``) to re-run the forward
            under autocast of that dtype during backward; ``None`` re-runs it as the first
            forward ran.
    """

    store: str | None = "e4m3"
    scaling: Scaling | Literal["auto"] | None = "auto"
    block_size: int = 128
    rounding: Rounding = "nearest"
    recompute_dtype: torch.dtype | None = None
    codec: Codec | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.store is not None and self.store not in FORMATS:
            raise InvalidArgumentError(
                f"unknown store format {self.store!r}; use one of {sorted(FORMATS)} or None to "
                "keep the block input exact"
            )
        if self.recompute_dtype is not None and self.recompute_dtype not in _RECOMPUTE_DTYPES:
            raise InvalidArgumentError(
                f"recompute_dtype={self.recompute_dtype!r}: use torch.bfloat16, torch.float16 "
                "or None (recompute as the forward ran)"
            )
        if self.store is None and (
            self.scaling != "auto" or self.rounding != "nearest" or self.block_size != 128
        ):
            raise InvalidArgumentError(
                "scaling, block_size and rounding describe a compressed format, but "
                "store=None keeps the input exact: drop them, or choose store='bf16', 'e4m3' "
                "or 'e5m2'"
            )
        codec = None
        if self.store is not None:
            scaling = self.scaling
            if scaling == "auto":
                scaling = None if self.store == "bf16" else "row"
            codec = Codec(self.store, scaling, block_size=self.block_size, rounding=self.rounding)
        object.__setattr__(self, "codec", codec)

    @property
    def exact(self) -> bool:
        """Nothing approximate: the gradients are those of a plain checkpoint."""
        return self.codec is None and self.recompute_dtype is None

    def __str__(self) -> str:
        parts = [f"store {self.codec}" if self.codec is not None else "store exact"]
        if self.recompute_dtype is not None:
            parts.append(f"recompute {str(self.recompute_dtype).removeprefix('torch.')}")
        return ", ".join(parts)


@dataclass
class _Block:
    """Everything one call needs in backward, except the kept tensors."""

    fn: Callable[..., Any]
    template: list[Any]  # the positional args, tensors replaced by None
    slots: list[int]  # positions of the tensor args in template
    kwargs: dict[str, Any]
    grad_kwargs: tuple[str, ...]
    params: tuple[torch.Tensor, ...]
    modules: tuple[nn.Module, ...]
    norms: tuple[nn.Module, ...] | None
    config: Approx
    preserve_rng_state: bool
    label: str

    def args(self, tensors: Sequence[Any]) -> list[Any]:
        args = list(self.template)
        for slot, t in zip(self.slots, tensors, strict=True):
            args[slot] = t
        return args


class _Kept:
    """A kept block input: saved exactly, or as an encoded payload and its scales. Every kept
    tensor goes through ``ctx.save_for_backward`` (version checks, saved-tensor hooks); these
    are indices into ``ctx.saved_tensors``."""

    __slots__ = ("dtype", "payload", "requires_grad", "scales")

    def __init__(self, payload: int, scales: int, dtype: torch.dtype | None, grad: bool) -> None:
        self.payload = payload  # index of the exact tensor or of the payload
        self.scales = scales  # index of the scales, or -1 (exact, or an unscaled codec)
        self.dtype = dtype  # the original dtype when encoded, else None
        self.requires_grad = grad


class _ApproxFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, block: _Block, *inputs: torch.Tensor) -> Any:
        n = len(block.slots)
        tensors = inputs[:n]
        ctx.block = block
        ctx.state = ForwardState.capture(
            *tensors,
            block.kwargs,
            block.fn,
            preserve_rng_state=block.preserve_rng_state,
            norms=block.norms,
            modules=block.modules,
        )
        try:
            with forward_as_plain():
                out = block.fn(*block.args(tensors), **block.kwargs)
        finally:
            ctx.state.forward_finished()
        codec = block.config.codec
        kept, saved = [], []
        for i, t in enumerate(tensors):
            if codec is not None and t.is_floating_point():
                enc = _encode(codec, t, i, block.label)
                kept.append(
                    _Kept(
                        len(saved), len(saved) + 1 if enc.scales is not None else -1, t.dtype, True
                    )
                )
                saved.append(enc.payload)
                if enc.scales is not None:
                    saved.append(enc.scales)
            else:
                kept.append(_Kept(len(saved), -1, None, t.is_floating_point()))
                saved.append(t)
        ctx.kept = kept
        ctx.kw_names = [k for k, v in block.kwargs.items() if isinstance(v, torch.Tensor)]
        ctx.kw_start = len(saved)
        saved += [block.kwargs[k] for k in ctx.kw_names]
        ctx.save_for_backward(*saved)
        outs, multiple = _outputs(out, block.label)
        del out
        outs = [o.detach() for o in outs]  # the node is their history, not the forward's graph
        return tuple(outs) if multiple else outs[0]

    @staticmethod
    @differentiable_once("an approximate-recompute or offloaded block")
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        block: _Block = ctx.block
        saved = ctx.saved_tensors
        codec = block.config.codec
        leaves, args_in = [], []
        for k in ctx.kept:
            if k.dtype is None:
                t = saved[k.payload]
            else:
                assert codec is not None
                scales = saved[k.scales] if k.scales >= 0 else None
                t = codec.decode(Encoded(saved[k.payload], scales, k.dtype, codec))
            if k.requires_grad:
                t = t.detach().requires_grad_(True)
                leaves.append(t)
            args_in.append(t)
        kw = dict(block.kwargs)
        for name, t in zip(ctx.kw_names, saved[ctx.kw_start :], strict=True):
            kw[name] = t  # through saved_tensors: an in-place change since forward raises
        kw_leaves: tuple[torch.Tensor, ...] = ()
        if block.grad_kwargs:
            for name in block.grad_kwargs:
                kw[name] = kw[name].detach().requires_grad_(True)
            kw_leaves = tuple(kw[name] for name in block.grad_kwargs)
        params = block.params
        hooked = any(p._backward_hooks for p in params)
        aliases: dict[str, torch.Tensor] = {}
        if hooked:
            # Differentiate through detached aliases so parameter hooks fire once, in the outer
            # backward that receives these gradients.
            if not isinstance(block.fn, nn.Module):
                raise InvalidArgumentError(
                    f"{block.label}: a parameter has a backward hook, which needs the block as "
                    "an nn.Module to recompute through detached aliases; pass nn.Module blocks"
                )
            names = {id(p): name for name, p in block.fn.named_parameters()}
            aliases = {names[id(p)]: p.detach().requires_grad_(True) for p in params}
            params = tuple(aliases.values())
        floats = [t for t in args_in if t.is_floating_point()]
        device_type = (floats or args_in)[0].device.type
        replay = ctx.state.replay(label=block.label, exact_draws=True)
        with torch.enable_grad(), replay, _recompute_autocast(block, device_type):
            args = block.args(args_in)
            if hooked:
                out = torch.func.functional_call(block.fn, aliases, tuple(args), kw, strict=False)
            else:
                out = block.fn(*args, **kw)
        sources = (*leaves, *params, *kw_leaves)
        leaf = first_unregistered_leaf(block.fn, out, sources)
        if leaf is not None:
            raise InvalidArgumentError(
                f"{block.label} uses a tensor of shape {tuple(leaf.shape)} that requires grad "
                "but is neither an argument nor a parameter of the checkpointed module, so its "
                "gradient would be lost; pass an nn.Module that registers it, or pass the "
                "tensor as an argument"
            )
        outs, _ = _outputs(out, block.label)
        pairs = [
            (o, g if g.dtype == o.dtype else g.to(o.dtype))
            for o, g in zip(outs, grads, strict=True)
            if g is not None and o.requires_grad
        ]
        if not pairs:
            result: tuple[torch.Tensor | None, ...] = (None,) * len(sources)
        elif len(pairs) == 1:
            result = vjp(pairs[0][0], sources, pairs[0][1])
        else:
            result = torch.autograd.grad(
                [o for o, _ in pairs], sources, [g for _, g in pairs], allow_unused=True
            )
        del out, outs, pairs
        arg_grads, i = [], 0
        for k in ctx.kept:
            if k.requires_grad:
                arg_grads.append(result[i])
                i += 1
            else:
                arg_grads.append(None)
        return (None, *arg_grads, *result[len(leaves) :])


def _encode(codec: Codec, t: torch.Tensor, index: int, label: str) -> Encoded:
    try:
        return codec.encode(t)
    except NonFiniteInputError:
        raise NonFiniteInputError(
            f"positional argument {index} of {label} has non-finite values and would be "
            f"compressed ({codec}). A mask or constant with -inf belongs in a keyword argument "
            "(kept exactly); otherwise find where the model overflows (e.g. with "
            "torch.autograd.detect_anomaly) or keep the boundary exact (store=None)"
        ) from None


def _recompute_autocast(block: _Block, device_type: str) -> contextlib.AbstractContextManager[Any]:
    dtype = block.config.recompute_dtype
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=dtype)


def _outputs(out: Any, label: str) -> tuple[list[torch.Tensor], bool]:
    if isinstance(out, torch.Tensor):
        return [out], False
    if isinstance(out, (tuple, list)) and out and all(isinstance(o, torch.Tensor) for o in out):
        return list(out), True
    raise InvalidInputTypeError(
        f"{label} returned {type(out).__name__}; an approximate checkpoint needs a block that "
        "returns a tensor or a tuple of tensors"
    )


def run_approx(
    fn: Callable[..., Any],
    args: Sequence[Any],
    kwargs: dict[str, Any],
    *,
    config: Approx,
    modules: Sequence[nn.Module] | None = None,
    complete: bool | None = None,
    preserve_rng_state: bool = True,
    label: str = "the approximate checkpoint",
) -> Any:
    """Run ``fn(*args, **kwargs)`` as one approximate-recompute node (the shared engine of
    :func:`checkpoint` and ``checkpoint_sequential(approx=...)``). ``modules``: the modules
    ``fn`` calls (default: ``fn`` itself when it is a module); ``complete``: whether they are
    all it calls (then replay freezes exactly their normalisation layers; else any that runs).
    """
    if modules is None:
        modules = modules_of(fn, closures=False)  # their parameters become the node's inputs
    if complete is None:
        complete = isinstance(fn, nn.Module)
    params: list[torch.Tensor] = []
    norms: list[nn.Module] = []
    seen: set[int] = set()
    for m in modules:
        module_params, module_norms = module_targets(m)
        for t in module_params:
            if id(t) not in seen:
                seen.add(id(t))
                params.append(t)
        norms += module_norms
    template, slots, tensors = [], [], []
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            slots.append(i)
            tensors.append(a)
            template.append(None)
        else:
            template.append(a)
    if not tensors:
        raise InvalidInputTypeError(
            f"{label} got no tensor argument; pass the block input as a positional tensor"
        )
    grad_kwargs = grad_keywords(kwargs)
    block = _Block(
        fn=fn,
        template=template,
        slots=slots,
        kwargs=kwargs,
        grad_kwargs=grad_kwargs,
        params=tuple(params),
        modules=tuple(dict.fromkeys((*modules, *modules_of(fn)))),
        norms=tuple(norms) if complete else None,
        config=config,
        preserve_rng_state=preserve_rng_state,
        label=label,
    )
    if any(t.is_complex() for t in tensors):
        raise InvalidInputTypeError(
            f"{label} got a complex tensor; approximate recompute supports real floating-point "
            "tensors (and keeps integer and boolean ones exact): split complex values into "
            "real and imaginary parts"
        )
    needs_graph = any(t.requires_grad for t in tensors) or bool(params) or bool(grad_kwargs)
    if not torch.is_grad_enabled() or not needs_graph:
        return fn(*args, **kwargs)  # nothing to differentiate: keep nothing, plain call
    return _ApproxFunction.apply(block, *tensors, *params, *(kwargs[k] for k in grad_kwargs))


def checkpoint(
    fn: Callable[..., Any],
    *args: Any,
    store: str | None = "e4m3",
    scaling: Scaling | Literal["auto"] | None = "auto",
    block_size: int = 128,
    rounding: Rounding = "nearest",
    recompute_dtype: torch.dtype | None = None,
    preserve_rng_state: bool = True,
    **kwargs: Any,
) -> Any:
    """Run ``fn(*args, **kwargs)`` keeping only its tensor arguments, compressed.

    Floating-point tensor arguments are kept in ``store`` format (see :class:`Approx` for the
    options; integer and boolean tensors are kept exactly); keyword arguments are passed to
    ``fn`` unchanged and kept as they are. ``fn`` is typically an ``nn.Module``: its trainable
    parameters receive gradients. A plain function must take every tensor that requires grad
    as an argument (else backward raises, naming the tensor).

    Memory held between forward and backward: the compressed arguments (payload and scales),
    plus RNG state when ``fn`` drew random numbers. Extra work: one forward of ``fn`` in
    backward, plus an encode and a decode.
    """
    config = Approx(
        store=store,
        scaling=scaling,
        block_size=block_size,
        rounding=rounding,
        recompute_dtype=recompute_dtype,
    )
    if not callable(fn):
        raise InvalidInputTypeError(
            f"approx.checkpoint(fn, *args): fn must be callable, got {type(fn).__name__}"
        )
    label = getattr(fn, "__qualname__", type(fn).__name__)
    return run_approx(
        fn, args, kwargs, config=config, preserve_rng_state=preserve_rng_state, label=label
    )
