"""The converted layers of :func:`revckpt.make_reversible` at run time: each call of a layer by
the model's own loop runs that layer's block of the reversible stack (:class:`ReversibleLayers`),
through the picklable instance ``forward`` installed on it (:class:`InstalledForward`)."""

from __future__ import annotations

import math
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .._autocast import autocast_dtype
from ..checkpoint import checkpoint
from ..errors import InvalidArgumentError, RevckptError
from ..layers.drift import ReconstructionWarning
from ..layers.grid import on_grid, rebuilt_later
from ..layers.sequential import ReversibleSequential
from ..layers.steps import StackRun
from ._reversible_calls import check_constant, dtype_of, passes, with_hidden
from .calls import (
    Key,
    cache_holds_past,
    cache_index,
    carried_key,
    drop_caches,
    has_cache,
    replaced,
)
from .install import REVERSIBLE_ATTR, ModuleForward, within

__all__ = ["MODES", "SIXTEEN_BITS", "Calls", "InstalledForward", "ReversibleLayers", "auto_anchors"]

#: The dtypes in which a floating-point rebuild drifts past 1e-2 even with an anchor per layer
#: (``benchmarks/bench_finetune.py``'s drift table): ``exact="auto"`` rebuilds exactly there.
SIXTEEN_BITS = (torch.bfloat16, torch.float16)

#: How the stack's layers keep what their backward needs (:attr:`ReversibleLayers.mode`): every
#: layer's input rebuilt from its output; everything stored (plain autograd); each layer's two
#: input streams kept and its forward re-run in backward (checkpointed).
MODES = ("reversible", "store", "checkpoint")


@dataclass
class Calls:
    """The arguments of each layer's call in one forward pass (the hidden state left out),
    for its branch to re-run it in backward, and the output of the call being made."""

    args: dict[int, tuple[tuple[Any, ...], dict[str, Any], Key]] = field(default_factory=dict)
    # the first forward's arguments where they differ (an empty cache it fills; the recompute
    # in backward runs without it)
    forward_args: dict[int, tuple[tuple[Any, ...], dict[str, Any], Key]] = field(
        default_factory=dict
    )
    output: Any = None
    forwarding: bool = False
    # run by autograd (stored or checkpointed, not rebuilt): the layers' further outputs keep
    # their gradients (T5's position bias), as in plain autograd
    by_autograd: bool = False


@dataclass
class _Progress:
    """How far one forward pass got (what the early-exit check reads in backward)."""

    last: str  # the name of the last layer called
    finished: bool = False
    # (layer name, hooks dict, weak reference) of the hidden states the layers before the
    # last returned
    between: list[tuple[str, Any, Any]] = field(default_factory=list)


@dataclass
class _Pass:
    """One forward pass through the stack: where it is, its streams and its run."""

    calls: Calls
    run: StackRun | None
    streams: tuple[torch.Tensor, torch.Tensor]
    progress: _Progress
    returned: torch.Tensor | None = None  # the hidden state the last layer called returned
    version: int | None = None  # its version counter then (None: an inference tensor)
    plain: bool = False  # run by plain autograd: a cache with past entries in eval mode
    next_index: int = 1


class InstalledForward(ModuleForward):
    """The ``forward`` :func:`revckpt.make_reversible` puts on a converted layer (picklable:
    :class:`~revckpt.inplace.install.ModuleForward`)."""

    __slots__ = ()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        held = self.block.__dict__.get(REVERSIBLE_ATTR)
        if not isinstance(held, tuple) or (self.owner is not None and held[1] is not self.owner):
            return self.plain(*args, **kwargs)  # restored under a wrapper added after it
        index, layers = held
        return layers.call(index, args, kwargs)


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


class ReversibleLayers:
    """What :func:`make_reversible` installed on a model: the stack and the converted layers.

    ``last_drift``: per layer, the reconstruction error of its input measured in the last
    backward (see ``check_inverse``); ``mode``: how the same function is differentiated, one
    of :data:`MODES` (``"reversible"``; :func:`revckpt.fit` picks one for a budget);
    ``reversible``: ``mode == "reversible"``, set ``False`` for plain autograd (everything
    stored), e.g. for a reference gradient; ``limit``: the largest hidden-state shape
    :func:`revckpt.fit` chose the mode for (a larger one is refused in training, as is a
    wider dtype than ``limit_dtype``, the hidden state's then, and a run without the autocast
    it ran under, ``limit_autocast``; ``None``: no limit, what setting it to ``None``
    gives). The layers' dtype
    is read at each forward: a model cast after conversion computes in its new dtype (with
    ``anchor_every="auto"``, the anchors for it)."""

    # defaults for a conversion pickled before they existed (torch.save of the model)
    limit: tuple[int, ...] | None = None
    limit_dtype: torch.dtype | None = None
    limit_autocast: torch.dtype | None = None
    shape: tuple[int, ...] | None = None
    hidden_dtype: torch.dtype | None = None
    hidden_autocast: torch.dtype | None = None
    auto_exact = False  # rebuilt in floating point from a wider dtype: the 16-bit warning
    removed = False  # undone by revckpt.restore through its layers (remove_reversible)
    start: float | None = None  # the output's relative change at conversion, where measured
    feature_dim = -1  # the adapters' dimension of the hidden state
    frozen_names: list[tuple[int, str, bool]] | None = None  # (pickled before it existed)

    def __init__(
        self,
        layers: list[tuple[str, nn.Module]],
        stack: ReversibleSequential,
        hidden: int,
        *,
        scale: float,
        anchor_every: int | str | None,
        stream_dtype: torch.dtype | None = None,
    ) -> None:
        self.layers = layers
        self.stack = stack
        self.hidden = hidden  # which stream of a block's input and output is the hidden state
        self.scale = scale
        self.anchor_every = anchor_every  # as passed: "auto" is resolved per layers' dtype
        self.stream_dtype = stream_dtype
        self.exact = False  # streams on the fixed-point grid (make_reversible(exact=True))
        self._dtype: torch.dtype | None = None  # the hidden state's, as the model passes it
        self.width: int | None = None  # the adapters' (the size of feature_dim)
        self.feature_dim = -1  # the hidden state's dimension the adapters act on
        self._mode = "reversible"
        #: the largest hidden-state shape revckpt.fit measured the mode with (None: any): a
        #: larger one is refused in training; ``shape``: the hidden state's at the last forward
        self.limit: tuple[int, ...] | None = None
        self.limit_dtype: torch.dtype | None = None
        self.limit_autocast: torch.dtype | None = None
        self.shape: tuple[int, ...] | None = None
        self.hidden_dtype: torch.dtype | None = None
        self.hidden_autocast: torch.dtype | None = None
        #: for revckpt.restore: each layer's instance forward before (as LayerCall.before), and
        #: the parameters make_reversible froze, with their requires_grad before
        self.forwards: list[Any] = []
        # what trainable="adapters" froze: (layer index, parameter name, requires_grad before)
        self.frozen_names: list[tuple[int, str, bool]] | None = []
        self.frozen: list[tuple[nn.Parameter, bool]] = []  # a conversion pickled before names
        #: the nn.TransformerEncoders whose nested-tensor fast path conversion turned off
        self.nested_off: list[nn.Module] = []
        self._warned: set[str] = set()  # the cache warning: once per conversion
        self._what = f"make_reversible({layers[0][0]} .. {layers[-1][0]})"
        self._pass: _Pass | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_pass": None}  # a pickle or deep copy takes no pass with it

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, ReconstructionWarning, stacklevel=5)

    @property
    def last_drift(self) -> list[float | None]:
        return self.stack.last_drift

    @property
    def mode(self) -> str:
        return self._mode

    @mode.setter
    def mode(self, mode: str) -> None:
        if mode not in MODES:
            raise InvalidArgumentError(f"mode={mode!r}: use one of {', '.join(MODES)}")
        # a pass a forward left before the last layer (an early exit under no_grad) is
        # dropped; a forward still running would call its next layer out of order, which raises
        self._pass = None
        self._mode = mode

    @property
    def reversible(self) -> bool:
        return self._mode == "reversible"

    @reversible.setter
    def reversible(self, on: bool) -> None:
        self.mode = "reversible" if on else "store"

    def call(self, index: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Layer ``index`` called by the model with ``args`` and ``kwargs``."""
        if index == 0:
            key = carried_key(args, kwargs)
            state = self._start(args, kwargs, key)
        else:
            state = self._continue(index, args, kwargs)
            key = carried_key(args, kwargs, state.returned)
        assert key is not None
        name = self.layers[index][0]
        forward_args = None
        if torch.is_grad_enabled() and not state.plain:
            # in eval mode an empty cache is filled by the forward (a decoding loop's prompt
            # outside no_grad) and left out of the recompute, which then computes the same
            # values; in training it is dropped, as Hugging Face does under checkpointing
            keep = not self.layers[0][1].training and has_cache(args, kwargs)
            if keep:
                forward_args = (*replaced(args, kwargs, key, None), key)
            args, kwargs = drop_caches(
                args,
                kwargs,
                self._what,
                layer=cache_index(self.layers[index][1]),
                seen=self._warned,
                warn=not keep,
            )
        if torch.is_grad_enabled() and state.run is not None:
            check_constant(name, args, kwargs, key)
        state.calls.args[index] = (*replaced(args, kwargs, key, None), key)
        if forward_args is not None:
            state.calls.forward_args[index] = forward_args
        state.calls.forwarding = True
        try:
            streams = self._block(state, index)
        finally:
            state.calls.forwarding = False
            # the cache the forward filled is the model's: held here, the graph's nodes would
            # hold it (and its tensors their graph) in a cycle the collector cannot see
            state.calls.forward_args.pop(index, None)
        out, state.calls.output = state.calls.output, None
        return self._returned(state, index, streams, out)

    def _returned(self, state: _Pass, index: int, streams: Any, out: Any) -> Any:
        """What layer ``index``'s call returns to the model, its streams ``streams``."""
        last = index == len(self.layers) - 1
        state.progress.last = self.layers[index][0]
        if last and state.run is not None:
            streams = tuple(state.run.finish(None))
        state.streams = streams
        hidden = streams[self.hidden]
        # the model sees its own dtype (output_hidden_states, a loss on them), not the wider
        # streams'; the next layer is run on the stream itself
        narrowed = self._dtype is not None and hidden.dtype != self._dtype
        if narrowed:
            hidden = hidden.to(self._dtype)
        if last:
            self._pass = None
            state.progress.finished = True
            if state.progress.between and hidden.requires_grad:
                hidden.register_hook(_hooks_between_check(state.progress))
        elif state.run is not None and hidden.requires_grad:
            if not narrowed:  # its own node: a gradient reaching it is an error
                hidden = hidden.view_as(hidden)
            hidden.register_hook(_early_exit_check(state.progress, self.layers[-1][0]))
            # its hooks' dict strongly (a forward hook may hook the tensor and drop it), the
            # tensor weakly (for retain_grad, which a tensor gone cannot have asked for)
            hooks = hidden._backward_hooks
            state.progress.between.append((self.layers[index][0], hooks, weakref.ref(hidden)))
        state.returned = hidden
        state.version = None if hidden.is_inference() else hidden._version
        return hidden if isinstance(out, torch.Tensor) else with_hidden(out, hidden)

    def _start(self, args: tuple[Any, ...], kwargs: dict[str, Any], key: Key | None) -> _Pass:
        if key is None:
            raise InvalidArgumentError(
                f"layer {self.layers[0][0]} got no floating-point tensor to carry as its hidden "
                "state; make_reversible converts layers whose first argument (or keyword "
                "hidden_states / x) is the hidden state"
            )
        h = args[key] if isinstance(key, int) else kwargs[key]
        if h.is_nested:
            raise InvalidArgumentError(
                f"layer {self.layers[0][0]} got a nested tensor (nn.TransformerEncoder's fast "
                "path in eval mode with a padding mask), which a reversible stack cannot carry "
                "in its two streams: build the encoder with enable_nested_tensor=False, or set "
                "encoder.use_nested_tensor = False"
            )
        self._check_width(h)
        self._check_limit(h)
        self._dtype = h.dtype
        self._follow_dtype(dtype_of(self.layers[0][1]) or h.dtype)
        if self.exact:  # on the grid, differentiable as the identity
            h64 = h.to(torch.float64)
            h = h64 + (on_grid(h64, check=rebuilt_later()) - h64).detach()
        elif self.stream_dtype is not None:
            h = h.to(self.stream_dtype)
        aux = torch.zeros_like(h)
        streams = (aux, h) if self.hidden == 1 else (h, aux)
        calls = Calls()
        # a cache holding past keys and values in eval mode with autograd on (a decoding
        # step outside no_grad): the recompute without the cache would compute other values,
        # with it would update it twice; as Hugging Face checkpoints in training only, the
        # pass runs plainly (one step of new tokens: little to keep)
        plain = (
            torch.is_grad_enabled()
            and not self.layers[0][1].training
            and has_cache(args, kwargs)
            and cache_holds_past(args, kwargs, cache_index(self.layers[0][1]))
        )
        run = self.stack.stepwise(*streams, calls=calls) if self.reversible and not plain else None
        calls.by_autograd = run is None
        self._pass = _Pass(calls, run, streams, _Progress(self.layers[0][0]), plain=plain)
        return self._pass

    def _check_width(self, h: torch.Tensor) -> None:
        width, dim = self.width, self.feature_dim
        if width is None or (-h.dim() <= dim < h.dim() and h.shape[dim] == width):
            return
        raise InvalidArgumentError(
            f"layer {self.layers[0][0]} got a hidden state of shape {tuple(h.shape)}, but "
            f"make_reversible built its adapters for {width} features on dimension {dim}: "
            "pass width= (the number of features) and feature_dim= (their dimension: -1 "
            "for tokens, 1 for channels-first images)"
        )

    def _check_limit(self, h: torch.Tensor) -> None:
        """Refuse, in training, a hidden state larger than the one :func:`revckpt.fit` chose
        the mode for (its memory budget holds for batches no larger in any dimension)."""
        shape, limit = tuple(h.shape), self.limit
        self.shape, self.hidden_dtype = shape, h.dtype
        self.hidden_autocast = autocast_dtype(h.device.type)
        if limit is None or not (torch.is_grad_enabled() and self.layers[0][1].training):
            return
        under, now = self.limit_autocast, self.hidden_autocast
        if under is not None and (now is None or now.itemsize > under.itemsize):
            raise InvalidArgumentError(
                f"revckpt.fit chose the reversible stack's mode ({self._mode}) under "
                f"torch.autocast in {under}, and it runs "
                f"{'without autocast' if now is None else f'under autocast in {now}'}: the "
                "activations it keeps are wider, so the memory budget no longer holds. Train "
                "under the autocast you fit under, or fit again without it"
            )
        planned = self.limit_dtype
        if planned is not None and h.element_size() > planned.itemsize:
            raise InvalidArgumentError(
                f"revckpt.fit chose the reversible stack's mode ({self._mode}) for {planned} "
                f"hidden states and got {h.dtype}: every tensor the step keeps is larger, so "
                "the memory budget no longer holds. Fit again after changing the model's dtype "
                "(revckpt.fit(model, example, ...)), or set "
                "revckpt.inplace.reversible_layers(model).limit = None to run it anyway"
            )
        if within(shape, limit):
            return
        raise InvalidArgumentError(
            f"revckpt.fit chose the reversible stack's mode ({self._mode}) for hidden states "
            f"of shape {list(limit)} (the example it was given) and got {list(shape)}: the "
            "memory budget holds for batches no larger in any dimension. Fit for the largest "
            "batch you train on (revckpt.fit(model, largest_batch, ...)), or set "
            "revckpt.inplace.reversible_layers(model).limit = None to run it anyway"
        )

    def _follow_dtype(self, dtype: torch.dtype) -> None:
        """The checks and the automatic anchors for the layers' dtype as it is now."""
        wide = self.stream_dtype
        if wide is not None and torch.finfo(wide).eps > torch.finfo(dtype).eps:
            raise InvalidArgumentError(
                f"the converted layers compute in {dtype} now, wider than stream_dtype={wide} "
                "given to make_reversible (was the model cast after conversion?): set "
                "revckpt.inplace.reversible_layers(model).stream_dtype to a dtype at least as "
                "wide, or None"
            )
        if dtype in SIXTEEN_BITS and not self.exact and self.auto_exact:
            self._warn_once(
                "16-bit",
                f"{self._what}: the converted layers compute in {dtype} now (was the model "
                "cast after conversion?), with floating-point rebuilds, which drift by 1e-2 "
                f"or more in {dtype} even with an anchor per layer: convert with a scale "
                "2^-k (k <= 16) and exact=True (or 'auto') to rebuild exactly",
            )
        if self.anchor_every == "auto":
            k = auto_anchors(self.scale, dtype, len(self.layers))
            self.stack.anchor_every = k
            # the first layer is rebuilt exactly (its auxiliary input is zeros): k, 2k, ...
            self.stack.first_anchor = k or 0
            said = dtype in SIXTEEN_BITS and self.auto_exact  # the 16-bit warning above
            if k == 1 and len(self.layers) > 1 and not said:
                self._warn_once(
                    "anchors",
                    f"{self._what}: in {dtype} at scale={self.scale:g}, a floating-point "
                    "rebuild needs an anchor on every layer (anchor_every='auto': its error "
                    "grows by up to 2 / scale per layer), so the stack keeps every layer's "
                    "input, as storing them would: convert with exact=True (a scale 2^-k, "
                    "k <= 16) to rebuild exactly with no anchor"
                    + ("" if dtype in SIXTEEN_BITS else ", or with a larger scale"),
                )

    def _continue(self, index: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Pass:
        state = self._pass
        name = self.layers[index][0]
        if state is None or state.next_index != index:
            raise RevckptError(
                f"layer {name} was called out of order: make_reversible runs layers "
                f"{self.layers[0][0]} .. {self.layers[-1][0]} as one reversible stack, called "
                "one after the other in every forward pass (a layer replaced, removed or added "
                "since the conversion, or one module called twice, breaks the order: "
                "revckpt.restore, then make_reversible on the model as it is now; a model that "
                "skips layers at random in training, LayerDrop (config.layerdrop, "
                "encoder_layerdrop, decoder_layerdrop), needs it set to 0)"
            )
        assert state.returned is not None
        if not passes(args, kwargs, state.returned):
            before = self.layers[index - 1]
            hooked = [n for n, layer in (before, self.layers[index]) if _backward_hooked(layer)]
            if hooked:
                raise RevckptError(
                    f"layer {hooked[0]} has a full backward hook (register_full_backward_hook "
                    "or a backward pre-hook; also nn.modules.module's global ones), which "
                    "wraps the hidden state each layer returns and needs every layer's "
                    "output gradient from autograd: a reversible stack rebuilds its layers "
                    "in its own backward and cannot run it. Remove the hook (a gradient-norm "
                    "log can read the parameters' .grad after backward instead), or convert "
                    "without those layers (blocks=...)"
                )
            raise RevckptError(
                f"layer {name} did not get the hidden state layer {before[0]} "
                "returned: the model changed it between the two layers, which a reversible "
                "stack cannot rebuild; convert a stack of layers that pass it on unchanged"
            )
        if state.version is not None and state.returned._version != state.version:
            raise RevckptError(
                f"layer {name} got the hidden state layer {self.layers[index - 1][0]} returned "
                "changed in place (x.mul_(...), x += ...): the stack carries that hidden state "
                "in its own streams, which the change does not reach, so the layers would "
                "compute a different function. Change it out of place (x = x * ...) outside "
                "the converted layers, or convert only layers that pass it on unchanged"
            )
        state.next_index = index + 1
        return state

    def _block(self, state: _Pass, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if state.run is not None:
            return state.run.block(index)
        block = self.stack.blocks[index]
        if self._mode == "checkpoint" and torch.is_grad_enabled() and not state.plain:
            return checkpoint(block, *state.streams, calls=state.calls)
        return block(*state.streams, calls=state.calls)


def _early_exit_check(progress: _Progress, last: str) -> Any:
    """The hook on a hidden state a layer before the last returns: a gradient reaching it
    from a pass that never got to the last layer (an early exit, or a forward that started
    the stack again) cannot be rebuilt from the stack's output, which was never made."""

    def check(grad: torch.Tensor) -> None:
        if not progress.finished:
            raise RevckptError(
                f"the forward pass ran the reversible stack (revckpt.make_reversible) up to "
                f"layer {progress.last} and stopped before its last layer {last} (an early "
                "exit, the stack started again from its first layer, or LayerDrop skipped "
                "layers: config.layerdrop, encoder_layerdrop, decoder_layerdrop must be 0), "
                "and the loss depends "
                "on that hidden state: the backward rebuilds layer inputs from the last "
                "layer's output, which this pass never made. Run every converted layer, in "
                "order, in each forward; convert only the layers every forward runs "
                "(blocks=...); or set revckpt.inplace.reversible_layers(model).reversible = "
                "False (plain autograd)"
            )

    return check


def _hooks_between_check(progress: _Progress) -> Any:
    """The hook on the hidden state the last layer returns, run as the stack's backward
    starts: a hook or ``retain_grad`` the model put on a hidden state a layer before returned
    (``output_hidden_states``, a forward hook) would never see its gradient, which the
    rebuild computes on the stack's own streams (a gradient-stopping hook there was ignored,
    silently: other gradients than plain autograd's)."""

    def check(grad: torch.Tensor) -> None:
        for name, hooks, ref in progress.between:
            t = ref()
            if (t is not None and t.retains_grad) or (hooks is not None and len(hooks) > 1):
                raise InvalidArgumentError(
                    f"a hook (register_hook) or retain_grad() is on the hidden state layer "
                    f"{name} returned (output_hidden_states=True, or a forward hook on the "
                    "layer): in a reversible stack (revckpt.make_reversible) the next layer runs "
                    "on the stack's own streams and the backward rebuilds that hidden state, so "
                    "its gradient never passes through the tensor the model got (plain autograd "
                    "would call the hook with it, and use what the hook returns). Set "
                    "revckpt.inplace.reversible_layers(model).mode = 'checkpoint' (exact; hooks "
                    "see their gradients), or hook something else"
                )

    return check


def _backward_hooked(layer: nn.Module) -> bool:
    """Whether ``layer`` runs full backward hooks (its own or torch's global ones), whose
    wrapper hands the next layer another tensor than the one the layer returned."""
    module = nn.modules.module
    return bool(
        layer._backward_hooks
        or layer._backward_pre_hooks
        or module._global_backward_hooks
        or module._global_backward_pre_hooks
    )
