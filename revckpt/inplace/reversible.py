"""Reversible fine-tuning of a pretrained model, in place (:func:`make_reversible`).

The model's repeated layers become one reversible stack (:mod:`revckpt.layers.adapters`)
while the model's own forward keeps calling them one by one: each layer's ``forward`` is
replaced on the instance (its class, parameters and ``state_dict`` keys stay), and the call of
layer ``i`` runs block ``i`` of the stack (:class:`revckpt.layers.steps.StackRun`, driven by
:class:`~revckpt.inplace._reversible_stack.ReversibleLayers`). The auxiliary stream travels
from call to call beside the hidden state the model passes on; the last layer's call ends the
stack, whose backward rebuilds every layer's input from its output. The adapters are
registered on their layers (``<layer>.revckpt_adapter_f`` / ``_g``), so an optimiser over
``model.parameters()`` and ``state_dict`` see them; the original ``state_dict`` loads with
``strict=False`` (only the adapters are missing). ``copy.deepcopy`` and ``torch.save(model)``
/ ``torch.load(..., weights_only=False)`` give a converted model that runs its own layers;
:func:`revckpt.restore` (:func:`remove_reversible`) undoes the conversion.
"""

from __future__ import annotations

import warnings
from typing import Any, Literal

import torch
from torch import nn

from ..errors import InvalidArgumentError
from ..layers.adapters import VARIANTS, Adapter, LayerBranch, adapter_block
from ..layers.coupling import ScaledCoupling
from ..layers.drift import ReconstructionWarning
from ..layers.grid import GridCoupling
from ..layers.sequential import ReversibleBlock, ReversibleSequential
from ._reversible_calls import (
    LayerCall,
    dtype_of,
    features_of,
    forward_function,
)
from ._reversible_stack import SIXTEEN_BITS, InstalledForward, ReversibleLayers, auto_anchors
from ._reversible_start import measure_start, relative_change, run_output
from ._reversible_undo import (
    _ADAPTERS,
    _KNOWN,
    _conversions,
    _names_of,
    _undo,
    refuse_reversible,
    remove_reversible,
    reversible_layers,
    stack_of,
)
from .blocks import Blocks, find_blocks
from .install import REVERSIBLE_ATTR, planned

__all__ = [
    "ReversibleLayers",
    "auto_anchors",
    "make_reversible",
    "refuse_reversible",
    "remove_reversible",
    "reversible_layers",
    "stack_of",
]

_ATTR = REVERSIBLE_ATTR


def make_reversible(
    model: nn.Module,
    *,
    variant: Literal["layer_f", "layer_g"] = "layer_f",
    scale: float | Literal["auto"] = 2**-8,
    example: Any = None,
    start_tolerance: float | None = None,
    rank: int = 8,
    trainable: Literal["adapters", "all"] = "adapters",
    blocks: Blocks = None,
    width: int | None = None,
    feature_dim: int | None = None,
    anchor_every: int | Literal["auto"] | None = "auto",
    check_inverse: float | Literal["auto"] | None = "auto",
    stream_dtype: torch.dtype | None = None,
    exact: bool | Literal["auto"] = "auto",
) -> nn.Module:
    """Make a pretrained model's layers one reversible stack, keeping its output at
    conversion up to ``scale`` (MEFT; see :mod:`revckpt.layers.adapters`). In place; returns
    the model.

    Args:
        variant: ``"layer_f"``, each layer as ``F`` with an adapter as ``G``, or
            ``"layer_g"``, an adapter as ``F`` and the layer as ``G``.
        scale: how much of the residual update of the layer before (carried by the auxiliary
            stream) enters each layer's input: the output at conversion moves in proportion
            to it (``2^-8``, the default: 8.5e-4 relative on the benchmark's pretrained GPT,
            1.7e-3 to 2.5e-3 on randomly initialised GPT-2, Llama, nanoGPT and
            ``nn.TransformerEncoder``; halve it to halve that). A power of two ``2^-k``
            (``k <= 16``) is rebuilt exactly at the cost of ``k`` bits per element and layer
            (``exact``); any other scale in floating point, where reconstruction error grows
            by about ``2 / scale`` per layer (``anchor_every`` bounds it). ``"auto"``: the
            largest ``2^-k`` (``k <= 16``) that moves the output on ``example`` by at most
            ``start_tolerance``, measured (:mod:`revckpt.inplace._reversible_start`).
        example: one batch (a tensor, a tuple of positional arguments or a dict of keyword
            arguments, as for :func:`revckpt.fit`): with it the relative change of the
            model's output at conversion is measured on it (eval mode, no gradients) and
            kept in ``reversible_layers(model).start``; ``scale="auto"`` needs it.
        start_tolerance: the largest relative change of the output at conversion
            ``scale="auto"`` accepts (default 1e-3; only with ``scale="auto"``).
        rank: the adapters' bottleneck width.
        trainable: ``"adapters"`` freezes the parameters of the converted layers (the
            pretrained ones: ``requires_grad=False``, no gradients, no memory for them), so
            of those layers only the adapters train; the rest of the model (embeddings, a
            final norm, a task head you added) keeps ``requires_grad`` as you set it: freeze
            it yourself (e.g. ``model.get_input_embeddings().requires_grad_(False)``) to
            train less. ``"all"`` leaves every parameter as it is.
        blocks: the layers (an attribute path such as ``"transformer.h"``, or a filter); by
            default the model's repeated blocks of the class found first
            (:func:`revckpt.inplace.find_blocks` with ``one_class=True``: an encoder-decoder's
            decoder layers), which must be consecutive children of one container.
        width: the hidden state's size (default: read off each layer's norm).
        feature_dim: the hidden state's dimension the adapters act on: ``-1`` (tokens, as
            ``(batch, sequence, width)``) or ``1`` (channels first, as a CNN's ``(N, C, H,
            W)``: the adapters are then 1x1 convolutions). Default: ``1`` when the width
            comes from a BatchNorm, GroupNorm or InstanceNorm, else ``-1``.
        anchor_every: store the inputs of layers ``k, 2k, ...`` exactly, so reconstruction
            error grows over at most ``k`` layers (two stored streams per anchor; layer 0 is
            rebuilt exactly).
            ``"auto"``: the largest ``k`` with ``(2 / scale) ** k * eps <= 1e-3`` for the
            layers' dtype (scale 1/8: 3 for float32, 1 for bfloat16, 10 for float64; 2^-8:
            1 for float32), none if that covers every layer, read at each forward (a model
            cast after conversion, ``model.to(torch.bfloat16)``, gets the anchors of its new
            dtype); ``None``: no anchors.
        check_inverse: as for :class:`revckpt.layers.ReversibleSequential`; the measured
            drift is in ``revckpt.inplace.reversible_layers(model).last_drift``, per layer
            for a number, for the first layer and the anchors only (``None`` for the others)
            with ``"auto"``, which samples the stack input (every error above reaches it).
        stream_dtype: carry the two streams in a wider dtype than the model's (e.g.
            ``torch.float64`` for a float32 model): the layers still run in their own dtype,
            the couplings and the rebuild in the wider one. Usually far less drift (a sum of
            a few float32 values is exact in float64), but not in the worst case: a rebuilt
            value that rounds to the layer's dtype differently from the forward injects that
            dtype's rounding, which grows as before, so the automatic anchors are the same and
            each costs twice the bytes. ``None`` (default): the model's dtype. A model cast
            after conversion to a dtype wider than ``stream_dtype`` is refused at its next
            forward.
        exact: carry the streams on a fixed-point grid (float64, resolution ``2^-30``) and
            keep, per layer, the ``log2(1 / scale)`` bits the scaling drops (one byte per
            element for ``k <= 8``, two up to 16; :mod:`revckpt.layers.grid`): every layer
            input is rebuilt bit for bit, so there is no drift and no anchor, whatever the
            depth. ``scale`` must be ``2^-k`` with ``k <= 16``; ``anchor_every`` and
            ``stream_dtype`` do not apply. The layers still run in their own dtype.
            ``"auto"`` (default): exact when the scale is such a power of two and neither
            ``stream_dtype`` nor an ``anchor_every`` number is given, in any dtype (in float64
            the grid's 2^-30 rounds the forward a little, and the gradients equal plain
            autograd's of the converted model to 1e-15 where an anchored rebuild's are off
            by 1e-8; in float32 a floating-point rebuild at ``2^-8`` needs an anchor per
            layer, which keeps more than checkpointing would; in 16 bits it is off by 1e-2 or
            more even so). A 16-bit
            model with a scale the grid cannot take, or one converted in floating point and
            cast to 16 bits afterwards, warns :class:`~revckpt.layers.ReconstructionWarning`.

    The layers must run in order, all of them, in every forward (an early exit, or a
    forward that starts the stack again midway, raises :class:`~revckpt.RevckptError` in
    backward), and their arguments other than the hidden state must not require grad (a
    cross-attention context computed by trainable parameters is refused at the call).
    Undo with :func:`revckpt.restore`.
    """
    if start_tolerance is not None and scale != "auto":
        raise InvalidArgumentError(
            f"start_tolerance={start_tolerance!r} is what scale='auto' keeps the output's "
            f"change within; with scale={scale!r} given, leave it out (example= measures the "
            "change at that scale: reversible_layers(model).start)"
        )
    if scale == "auto" or example is not None:
        options = dict(variant=variant, rank=rank, trainable=trainable, blocks=blocks,
                       width=width, feature_dim=feature_dim, anchor_every=anchor_every,
                       check_inverse=check_inverse, stream_dtype=stream_dtype,
                       exact=exact)  # fmt: skip
        tolerance = 1e-3 if start_tolerance is None else start_tolerance
        return _with_start(model, scale, example, tolerance, options)
    _check_options(variant, trainable, scale, exact)
    layers = _layers_of(model, blocks)
    model_dtype = dtype_of(layers[0][1]) or torch.float32
    auto = exact == "auto"
    exact = _auto_exact(scale, model_dtype, stream_dtype, anchor_every) if auto else exact
    if exact:
        stream_dtype, anchor_every = _exact_streams(scale, stream_dtype, anchor_every)
    _check_stream_dtype(stream_dtype, model_dtype)
    if feature_dim is not None and not isinstance(feature_dim, int):
        raise InvalidArgumentError(f"feature_dim={feature_dim!r}: pass -1, 1 or None")
    features = [features_of(layer, fqn, width, feature_dim) for fqn, layer in layers]
    frozen = _frozen(layers) if trainable == "adapters" else []  # the first change to the model
    try:  # an option the adapters or the stack refuse leaves the model as it was
        built = [
            _layer_block(i, fqn, layer, variant, scale, rank, features[i], exact)
            for i, (fqn, layer) in enumerate(layers)
        ]
        if variant == "layer_f":  # the last layer's auxiliary output reaches nothing: the
            layers[-1][1].revckpt_adapter_g.requires_grad_(False)  # adapter making it can't learn
        k = (
            auto_anchors(scale, model_dtype, len(layers))
            if anchor_every == "auto"
            else anchor_every
        )
        stack = ReversibleSequential(
            *(block for block, _ in built), anchor_every=k, check_inverse=check_inverse
        )
    except BaseException:
        _undo(layers, frozen)
        raise
    # the first layer is rebuilt exactly (its auxiliary input is zeros): anchors k, 2k, ...
    stack.first_anchor = k or 0
    hidden = 1 if variant == "layer_f" else 0
    converted = ReversibleLayers(
        layers, stack, hidden, scale=scale, anchor_every=anchor_every, stream_dtype=stream_dtype
    )
    converted.exact = exact
    # warns if cast to 16 bits later, exact=False given or chosen (docs/reversible.md: a
    # model converted in floating point and cast to 16 bits warns)
    converted.auto_exact = not exact and model_dtype not in SIXTEEN_BITS
    converted.width, converted.feature_dim = features[0]
    converted.forwards = [before for _, before in built]
    converted.frozen_names = _names_of(layers, frozen)
    converted.frozen = frozen
    _KNOWN[converted] = frozenset(id(p) for p in model.parameters())
    converted.nested_off = _nested_tensors_off(model, layers)
    for i, (_, layer) in enumerate(layers):
        object.__setattr__(layer, _ATTR, (i, converted))
        previous = layer.__dict__.get("forward")
        object.__setattr__(layer, "forward", InstalledForward(layer, converted, previous))
    object.__setattr__(model, _ATTR, converted)
    return model


def _with_start(
    model: nn.Module, scale: Any, example: Any, tolerance: float, options: dict[str, Any]
) -> nn.Module:
    """:func:`make_reversible` with the output's change at conversion measured on
    ``example`` (and, for ``scale="auto"``, the scale chosen from it)."""
    if example is None:
        raise InvalidArgumentError(
            "make_reversible(scale='auto') measures how far conversion moves the output: pass "
            "example= (one batch, as for revckpt.fit), or a scale (e.g. 2**-8)"
        )

    def convert(s: float) -> None:
        make_reversible(model, scale=s, **options)

    layers = _layers_of(model, options["blocks"])
    first = layers[0][1]

    def undo() -> None:  # this conversion only (another stack of the model stays)
        if _ATTR in first.__dict__:
            remove_reversible(first)

    # the output before is measured as the converted model will run (no nested tensors)
    nested_off = _nested_tensors_off(model, layers)
    try:
        if scale == "auto":
            _, start = measure_start(convert, undo, model, example, tolerance)
        else:
            before = run_output(model, example)
            convert(scale)
            start = relative_change(before, run_output(model, example))
    except BaseException:
        undo()
        for encoder in nested_off:
            encoder.use_nested_tensor = True
        raise
    reversible_layers(model).start = start
    reversible_layers(model).nested_off.extend(nested_off)
    return model


def _exact_streams(
    scale: float, stream_dtype: torch.dtype | None, anchor_every: Any
) -> tuple[torch.dtype, None]:
    """``exact=True``'s streams (float64) and anchors (none), the options checked."""
    GridCoupling(scale)  # checks the scale
    if stream_dtype is not None or anchor_every not in ("auto", None):
        raise InvalidArgumentError(
            "exact=True carries the streams in float64 on a grid and rebuilds exactly: "
            "leave stream_dtype and anchor_every out"
        )
    return torch.float64, None


def _auto_exact(
    scale: float, dtype: torch.dtype, stream_dtype: torch.dtype | None, anchor_every: Any
) -> bool:
    """``exact="auto"``: exact for a scale the grid takes, unless the float options are
    chosen; a 16-bit model whose scale the grid cannot take
    warns that its rebuild will drift."""
    if stream_dtype is not None or anchor_every not in ("auto", None):
        return False
    try:
        GridCoupling(scale)
    except InvalidArgumentError:
        if dtype not in SIXTEEN_BITS:
            return False
        warnings.warn(
            f"make_reversible: layers in {dtype} with scale={scale:g}, which the exact "
            f"rebuild (exact=True) cannot take: the rebuild is in floating point and in "
            f"{dtype} drifts by 1e-2 or more; pass a scale 2^-k (k <= 16, e.g. 2**-8) to "
            "rebuild exactly",
            ReconstructionWarning,
            stacklevel=3,
        )
        return False
    return True


def _frozen(layers: list[tuple[str, nn.Module]]) -> list[tuple[nn.Parameter, bool]]:
    """Freeze the converted layers' own parameters (before the adapters exist); each with the
    ``requires_grad`` it had, for :func:`remove_reversible`."""
    frozen = []
    for p in nn.ModuleList(layer for _, layer in layers).parameters():
        frozen.append((p, p.requires_grad))
        p.requires_grad_(False)
    return frozen


def _nested_tensors_off(model: nn.Module, layers: list[tuple[str, nn.Module]]) -> list[nn.Module]:
    """Turn off the nested-tensor fast path of each ``nn.TransformerEncoder`` whose layers are
    converted: in eval mode under ``no_grad`` with a padding mask it hands its layers a nested
    tensor, which a reversible stack cannot split into streams (restore turns it back on)."""
    converted = {id(layer) for _, layer in layers}
    found = []
    for m in model.modules():
        if (
            isinstance(m, nn.TransformerEncoder)
            and getattr(m, "use_nested_tensor", False)
            and any(id(layer) in converted for layer in m.layers)
        ):
            m.use_nested_tensor = False
            found.append(m)
    return found


def _check_options(variant: str, trainable: str, scale: float, exact: Any) -> None:
    if exact not in (True, False, "auto"):
        raise InvalidArgumentError(f"exact={exact!r}: use True, False or 'auto'")
    if variant not in VARIANTS:
        raise InvalidArgumentError(f"variant={variant!r}: use one of {', '.join(VARIANTS)}")
    if trainable not in ("adapters", "all"):
        raise InvalidArgumentError(f"trainable={trainable!r}: use 'adapters' or 'all'")
    ScaledCoupling(scale)  # checks the scale
    if scale > 1:
        raise InvalidArgumentError(
            f"scale={scale!r}: make_reversible's scale is the share of the layer before's "
            "update that moves each layer's input, in (0, 1]; the smaller, the closer to the "
            "pretrained model (e.g. 2**-8)"
        )


def _check_stream_dtype(stream_dtype: torch.dtype | None, model_dtype: torch.dtype) -> None:
    if stream_dtype is not None and not (
        isinstance(stream_dtype, torch.dtype)
        and stream_dtype.is_floating_point
        and torch.finfo(stream_dtype).eps <= torch.finfo(model_dtype).eps
    ):
        raise InvalidArgumentError(
            f"stream_dtype={stream_dtype!r}: pass a floating torch.dtype at least as wide as "
            f"the model's {model_dtype} (e.g. torch.float64), or None"
        )


def _layer_block(
    i: int,
    fqn: str,
    layer: nn.Module,
    variant: str,
    scale: float,
    rank: int,
    features: tuple[int, int],
    exact: bool,
) -> tuple[ReversibleBlock, object]:
    """Layer ``i``'s reversible block, its two adapters (``features``: their width and the
    hidden state's dimension they act on) registered on it, and the instance forward it had
    (as :attr:`LayerCall.before`)."""
    size, dim = features
    like = next(layer.parameters(), None)
    a_f, a_g = Adapter(size, rank, dim=dim), Adapter(size, rank, dim=dim)
    a_f.converted_as = a_g.converted_as = (variant, scale)  # kept in the state_dict
    if like is not None:
        a_f.to(like.device, like.dtype)
        a_g.to(like.device, like.dtype)
    layer.add_module(_ADAPTERS[0], a_f)
    layer.add_module(_ADAPTERS[1], a_g)
    before = forward_function(layer)
    call = LayerCall(i, before)  # in the layer's dtype at call time
    if variant == "layer_f":
        branch, other = LayerBranch(layer, a_f, call), a_g
    else:
        branch, other = LayerBranch(layer, a_g, call), a_f
    block = adapter_block(branch, other, variant=variant, scale=scale, first=i == 0, exact=exact)  # type: ignore[arg-type]
    return block, before


def _layers_of(model: nn.Module, blocks: Blocks) -> list[tuple[str, nn.Module]]:
    _conversions(model)  # drops the marks of conversions undone through their layers
    if model.__dict__.get(_ATTR) is not None:
        raise InvalidArgumentError(
            "this model was converted by make_reversible already; revckpt.restore(model) "
            "undoes it (and drops the adapters) before converting again"
        )
    layers = find_blocks(model, blocks, one_class=True)
    plans = [
        f"{fqn}.{name}".rstrip(".")
        for fqn, layer in layers
        for name, m in layer.named_modules()
        if planned(m) is not None
    ]
    if plans:  # restore would take the plan's forwards from under the stack
        raise InvalidArgumentError(
            f"layers to convert hold blocks planned by revckpt.fit or convert ({plans[0]}, "
            "...): revckpt.restore(model) undoes the plan before make_reversible; revckpt.fit "
            "on the converted model then picks the stack's mode for a budget"
        )
    _refuse_shared_layers(model, layers)
    again = [fqn for fqn, layer in layers if _ATTR in layer.__dict__]
    if again:  # converting them again (through a parent, or a part of the model) recursed
        raise InvalidArgumentError(
            f"layers {', '.join(again)} were converted by make_reversible already (on a model "
            "holding them, or a part of it): convert each layer once; revckpt.restore on the "
            "model make_reversible was given undoes it (and drops the adapters)"
        )
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


def _refuse_shared_layers(model: nn.Module, layers: list[tuple[str, nn.Module]]) -> None:
    """A layer held twice (``nn.ModuleList([a, b, b])``; ``find_blocks`` names each module
    once) would be called twice per pass, which a stack of its layers cannot run."""
    ids = {id(layer) for _, layer in layers}
    parents = {fqn.rpartition(".")[0] for fqn, _ in layers}  # another name elsewhere is an alias
    first: dict[int, str] = {}
    for fqn, m in model.named_modules(remove_duplicate=False):
        if id(m) not in ids or fqn.rpartition(".")[0] not in parents:
            continue
        if first.setdefault(id(m), fqn) != fqn:
            raise InvalidArgumentError(
                f"{first[id(m)]} and {fqn} are one module (the same layer twice): a reversible "
                "stack runs each of its layers once per pass; convert a model whose layers are "
                "distinct modules (copy.deepcopy the repeated one)"
            )
