"""How a block is called by the model's own code: its arguments, the hidden state it carries
from block to block, and the key/value caches a recompute must not update twice."""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..errors import InvalidArgumentError, InvalidInputTypeError

__all__ = [
    "HIDDEN_NAMES",
    "cache_holds_past",
    "cache_index",
    "carried_key",
    "class_forward",
    "drop_caches",
    "has_cache",
    "hidden_of",
    "own_forward",
    "replaced",
    "run_with",
    "static_forward",
]

Key = int | str  # a positional index or a keyword name

HIDDEN_NAMES = ("hidden_states", "x", "src", "input", "inputs", "hidden")
_CACHE_KEYWORDS = ("cache", "layer_past", "past_key_value", "past_key_values")
_warned: set[str] = set()


def _floating(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point()


def static_forward(cls: type) -> bool:
    """Whether ``cls.forward`` is a ``staticmethod`` (called without the module). Not cached:
    it runs in compiled code, where Dynamo warns about a ``functools`` cache, and its walk
    of the class's MRO is a few dictionary lookups."""
    for klass in cls.__mro__:
        if "forward" in klass.__dict__:
            return isinstance(klass.__dict__["forward"], staticmethod)
    return False


def class_forward(module: nn.Module) -> Callable[..., Any]:
    """The forward of ``module``'s class as ``fn(*args, **kwargs)`` (a ``functools.partial``,
    not a bound method, which Dynamo cannot trace; without Hugging Face's checkpointing
    wrapper, :func:`own_forward`); a ``staticmethod`` forward as it is."""
    fn = own_forward(type(module).forward)
    return fn if static_forward(type(module)) else functools.partial(fn, module)


def own_forward(forward: Any) -> Any:
    """A Hugging Face layer's forward without the gradient-checkpointing wrapper
    ``GradientCheckpointingLayer`` puts on its class: a planned block or a reversible stack
    already decides what it keeps. Inside a reversible stack a reentrant checkpoint
    (``use_reentrant=True``, peft's ``prepare_model_for_kbit_training`` default) failed in
    backward ("incompatible with .grad()"), a non-reentrant one recomputed each layer a second
    time; a planned block under ``gradient_checkpointing_enable()`` (a Trainer with
    ``gradient_checkpointing=True``) ran its plan inside Hugging Face's checkpoint: each layer
    three times, stored blocks checkpointed."""
    code = getattr(forward, "__code__", None)
    inner = getattr(forward, "__wrapped__", None)
    if inner is not None and code is not None and code.co_name == "forward_with_checkpointing":
        return inner
    return forward


def carried_key(args: tuple[Any, ...], kwargs: dict[str, Any], previous: Any = None) -> Key | None:
    """Where the hidden state is among a block's arguments: the argument that *is* the
    previous block's output when there is one, else the first floating-point positional
    tensor, else a floating-point keyword tensor of a usual name (``hidden_states``, ``x``)."""
    if previous is not None:
        for i, a in enumerate(args):
            if a is previous:
                return i
        for k, v in kwargs.items():
            if v is previous:
                return k
    for i, a in enumerate(args):
        if _floating(a):
            return i
    for name in HIDDEN_NAMES:
        if _floating(kwargs.get(name)):
            return name
    return None


def get(args: tuple[Any, ...], kwargs: dict[str, Any], key: Key) -> Any:
    return args[key] if isinstance(key, int) else kwargs[key]


def replaced(
    args: tuple[Any, ...], kwargs: dict[str, Any], key: Key, value: Any
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The arguments with the one at ``key`` replaced by ``value``."""
    if isinstance(key, int):
        return (*args[:key], value, *args[key + 1 :]), kwargs
    return args, {**kwargs, key: value}


def hidden_of(out: Any, what: str) -> torch.Tensor:
    """The hidden state a block returns: the output itself, or the first item of a tuple, a
    list, a ``ModelOutput`` or a dataclass."""
    if isinstance(out, torch.Tensor):
        return out
    first: Any = None
    if isinstance(out, (tuple, list)) and out:
        first = out[0]
    elif dataclasses.is_dataclass(out) and not isinstance(out, type):
        fields = dataclasses.fields(out)
        first = getattr(out, fields[0].name) if fields else None
    if isinstance(first, torch.Tensor):
        return first
    raise InvalidInputTypeError(
        f"{what} returned {type(out).__name__}; revckpt plans blocks that return their hidden "
        "state as a tensor, or as the first item of a tuple, list or dataclass; pick other "
        "blocks with blocks='attribute.path'"
    )


def _is_cache(obj: Any) -> bool:
    """A key/value cache object (transformers' ``Cache`` and look-alikes)."""
    return callable(getattr(obj, "update", None)) and callable(getattr(obj, "get_seq_length", None))


def has_cache(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a call passes a key/value cache (or ``use_cache=True``)."""
    return bool(
        kwargs.get("use_cache")
        or any(kwargs.get(name) is not None for name in _CACHE_KEYWORDS)
        or any(_is_cache(a) for a in args)
    )


def cache_holds_past(args: tuple[Any, ...], kwargs: dict[str, Any], layer: int = 0) -> bool:
    """Whether a cache a call passes may hold keys and values already (a decoding step after
    the prompt) at ``layer`` (the cache's index of the first layer called): only a
    transformers ``DynamicCache`` empty there (an ``EncoderDecoderCache`` of two) counts as
    fresh; any other (a pre-allocated ``StaticCache``, whose keys a forward attends over in
    full; a cross-attention cache filled before) as holding them."""
    return any(not _fresh(cache, layer) for cache in _caches(args, kwargs))


def _filled(cache: Any, layer: int) -> bool:
    """Whether a transformers cache holds keys and values at ``layer`` (other objects: not
    known, taken as not)."""
    parts = [getattr(cache, n, None) for n in ("self_attention_cache", "cross_attention_cache")]
    if all(p is not None for p in parts):  # transformers' EncoderDecoderCache
        return any(_filled(p, layer) for p in parts)
    if not _is_cache(cache):
        return False
    try:
        return cache.get_seq_length(layer) > 0
    except (AttributeError, IndexError, TypeError):
        return False  # a slot that keeps nothing (transformers' DummyLayer: a shared-KV layer)


def _caches(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """The caches a call passes: under a cache keyword, or positionally."""
    found = [kwargs.get(name) for name in _CACHE_KEYWORDS if kwargs.get(name) is not None]
    return found + [a for a in args if _is_cache(a)]


def _refuse_filled(args: tuple[Any, ...], kwargs: dict[str, Any], layer: int, what: str) -> None:
    if any(_filled(cache, layer) for cache in _caches(args, kwargs)):
        raise InvalidArgumentError(
            f"{what}: the call passes a key/value cache that holds keys and values already "
            "(peft's prefix tuning passes its trainable prefix so). In training revckpt drops "
            "caches (a recompute would update them twice), and dropping this one would change "
            "what the layer computes: leave these layers to plain autograd (revckpt.restore), "
            "or train an adapter that does not go through the cache (LoRA)"
        )


def _fresh(cache: Any, layer: int) -> bool:
    parts = [getattr(cache, n, None) for n in ("self_attention_cache", "cross_attention_cache")]
    if all(p is not None for p in parts):  # transformers' EncoderDecoderCache
        return all(_fresh(p, layer) for p in parts)
    dynamic = any(c.__name__ == "DynamicCache" for c in type(cache).__mro__)
    return dynamic and _is_cache(cache) and cache.get_seq_length(layer) == 0


def cache_index(layer: nn.Module) -> int:
    """The index a Hugging Face layer has in its model's cache (its or its attention's
    ``layer_idx``; 0 when it has none)."""
    for m in layer.modules():
        index = getattr(m, "layer_idx", None)
        if isinstance(index, int) and not isinstance(index, bool):
            return index
    return 0


def drop_caches(
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    what: str,
    *,
    layer: int = 0,
    seen: set[str] | None = None,
    warn: bool = True,
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """What Hugging Face does under gradient checkpointing in training: no cache. A recomputed
    layer would append its keys and values to the cache a second time, so caches passed to a
    planned block while training are dropped (``use_cache=False``, cache arguments ``None``),
    with one warning per block class (per ``what``'s first word in ``seen``, when given;
    none with ``warn=False``). A transformers cache that holds keys and values at ``layer``
    (the block's index in it) already is refused: dropping it would change what the layer
    computes (peft's prefix tuning passes its trainable prefix so)."""
    if not has_cache(args, kwargs):
        return args, kwargs  # the usual training call: nothing to drop, nothing copied
    _refuse_filled(args, kwargs, layer, what)
    changed = False
    new_kwargs = dict(kwargs)
    if new_kwargs.get("use_cache"):
        new_kwargs["use_cache"] = False
        changed = True
    for name in _CACHE_KEYWORDS:
        if new_kwargs.get(name) is not None:
            new_kwargs[name] = None
            changed = True
    new_args = list(args)
    for i, a in enumerate(args):
        if _is_cache(a):
            new_args[i] = None
            changed = True
    if not changed:
        return args, kwargs
    kind = what.split(" ")[0]  # once per block class
    warned = _warned if seen is None else seen
    if warn and kind not in warned:
        warned.add(kind)
        warnings.warn(
            f"{what}: a key/value cache is not updated while training with revckpt (a "
            "recompute would update it twice); caching is off in training, as with Hugging "
            "Face gradient checkpointing. Pass use_cache=False to the forward call (or set "
            "model.config.use_cache = False) to silence this",
            stacklevel=4,
        )
    return tuple(new_args), new_kwargs


def run_with(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    key: Key,
    hidden: torch.Tensor,
) -> Any:
    """``fn`` called with its captured arguments and ``hidden`` at ``key`` (the form in which
    ``functools.partial`` hands a block to strategies that keep only the hidden state)."""
    a, k = replaced(args, kwargs, key, hidden)
    return fn(*a, **k)
