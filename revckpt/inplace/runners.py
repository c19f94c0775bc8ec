"""One runner per strategy: how a planned block's forward is run in training.

Every runner calls the strategy's own public entry point (``revckpt.checkpoint``,
``revckpt.approx.checkpoint``, ``revckpt.offload.checkpoint``) on the block's forward; only a
checkpoint segment spanning several blocks needs a mechanism of its own
(:class:`~revckpt.inplace.region.Region`). Strategies that keep only the hidden state
(approx, offload) get the block as a ``functools.partial`` holding its other arguments (masks,
rotary tables, flags), whose tensors' versions its recompute checks (one changed in place
since the forward is refused); those that require grad go to the node as keywords, which it
keeps exactly and differentiates.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..approx import Approx, compress_saved
from ..checkpoint import checkpoint
from ..engine.rerun import any_changed, input_versions
from ..errors import InvalidArgumentError, ModifiedInputError
from ..replay import is_replaying
from ..strategy import Strategy, StrategyLike
from .calls import Key, replaced, run_with
from .install import Runner
from .region import Region

__all__ = ["runner_for", "segment_runners"]


def _store(block: nn.Module, fn: Callable[..., Any], args: Any, kwargs: Any, key: Key) -> Any:
    return fn(*args, **kwargs)


def _checkpoint(block: nn.Module, fn: Callable[..., Any], args: Any, kwargs: Any, key: Key) -> Any:
    return checkpoint(fn, *args, **kwargs)


@dataclass(frozen=True)
class _Selective:
    policy: str

    def __call__(
        self, block: nn.Module, fn: Callable[..., Any], args: Any, kwargs: Any, key: Key
    ) -> Any:
        return checkpoint(fn, *args, strategy=f"selective:{self.policy}", **kwargs)


@dataclass(frozen=True)
class _Compress:
    store: str

    def __call__(
        self, block: nn.Module, fn: Callable[..., Any], args: Any, kwargs: Any, key: Key
    ) -> Any:
        return compress_saved(fn, *args, store=self.store, **kwargs)


@dataclass(frozen=True)
class _HiddenOnly:
    """A strategy keeping only the hidden state (module-level, so planned models pickle)."""

    entry: str  # "approx" or "offload"
    store: str | None = None

    def __call__(
        self, block: nn.Module, fn: Callable[..., Any], args: Any, kwargs: Any, key: Key
    ) -> Any:
        hidden = args[key] if isinstance(key, int) else kwargs[key]
        rest_args, rest_kwargs = replaced(args, kwargs, key, None)
        graphs = _with_graph(rest_args, rest_kwargs)
        if graphs:  # through the node's keywords, which it keeps exactly and differentiates
            rest_args, rest_kwargs = _without(rest_args, rest_kwargs, graphs)
        # the others (in lists, tuples and dicts too) checked when the recompute reads them
        versions = input_versions(rest_args, rest_kwargs)
        label = f"{type(block).__name__} ({self.entry})"
        call = functools.partial(_run_hidden, fn, rest_args, rest_kwargs, key, (versions, label))
        if self.entry == "offload":
            return checkpoint(call, hidden, strategy="offload", **graphs)
        return checkpoint(call, hidden, strategy=Approx(store=self.store), **graphs)


_ARG, _KW = "_revckpt_arg_", "_revckpt_kw_"


def _with_graph(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The block's other tensor arguments that require grad (T5's position bias, a U-Net's
    skip tensor), by node keyword: a function of the hidden state alone would hide them from
    the node, whose backward would then drop their gradients."""
    graphs = {f"{_ARG}{i}": a for i, a in enumerate(args) if _requires_grad(a)}
    graphs.update({f"{_KW}{k}": v for k, v in kwargs.items() if _requires_grad(v)})
    return graphs


def _requires_grad(a: Any) -> bool:
    return isinstance(a, torch.Tensor) and a.requires_grad


def _without(
    args: tuple[Any, ...], kwargs: dict[str, Any], graphs: dict[str, torch.Tensor]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    args = tuple(None if f"{_ARG}{i}" in graphs else a for i, a in enumerate(args))
    return args, {k: v for k, v in kwargs.items() if f"{_KW}{k}" not in graphs}


def _run_hidden(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    key: Key,
    given: tuple[list[tuple[torch.Tensor, int]], str],
    hidden: Any,
    **graphs: torch.Tensor,
) -> Any:
    """``fn`` on ``hidden`` and its other arguments, those of ``graphs`` put back in place;
    in the recompute, refused where one of the others (``given``: their versions at the
    forward, and the block's label) was changed in place since."""
    versions, label = given
    if versions and is_replaying() and any_changed(versions):
        raise ModifiedInputError(
            f"{label}: a tensor it was given beside its hidden state (an argument, a keyword, "
            "or in a list, tuple or dict of them: a mask, a bias, rotary tables) was changed "
            "in place after its forward began, by the block or by the caller before backward: "
            "its recompute would read the changed value. Change it out of place, or pass a "
            "copy (t.clone())"
        )
    if graphs:
        args = tuple(graphs.get(f"{_ARG}{i}", a) for i, a in enumerate(args))
        kwargs = {**kwargs, **{k[len(_KW) :]: v for k, v in graphs.items() if k.startswith(_KW)}}
    return run_with(fn, args, kwargs, key, hidden)


@dataclass(frozen=True)
class _InRegion:
    region: Region
    position: int

    def __call__(
        self, block: nn.Module, fn: Callable[..., Any], args: Any, kwargs: Any, key: Key
    ) -> Any:
        return self.region.call(self.position, block, fn, args, kwargs, key)


def runner_for(strategy: StrategyLike) -> Runner:
    """The runner of a one-block ``strategy``: store, checkpoint, selective, approx, compress
    or offload (reversible changes the architecture: it has no in-place runner)."""
    s = Strategy.parse(strategy)
    if s.kind == "store":
        return _store
    if s.kind == "checkpoint":
        return _checkpoint
    if s.kind == "offload":
        return _HiddenOnly("offload")
    if s.kind == "selective":
        assert s.arg is not None
        return _Selective(s.arg)
    if s.kind == "approx":
        return _HiddenOnly("approx", s.arg)
    if s.kind == "compress":
        assert s.arg is not None
        return _Compress(s.arg)
    raise InvalidArgumentError(
        "'reversible' changes the architecture and cannot be applied to a block in place; "
        "build the model from revckpt.layers reversible blocks, or choose 'checkpoint', "
        "'selective:<policy>', 'approx:<codec>' or 'offload'"
    )


def segment_runners(labels: tuple[str, ...]) -> list[Runner]:
    """The runners of the blocks of one checkpoint segment of ``len(labels)`` blocks."""
    if len(labels) == 1:
        return [_checkpoint]
    region = Region(len(labels), labels)
    return [_InRegion(region, i) for i in range(len(labels))]
