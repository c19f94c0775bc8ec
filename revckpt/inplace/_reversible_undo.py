"""Finding and undoing :func:`~revckpt.inplace.reversible.make_reversible`'s conversions:
where a model's stack is (on the model converted, or on layers it holds while the converted
model is elsewhere, as peft's ``merge_and_unload()`` leaves them), the refusal of ``fit`` and
``convert`` on it, and :func:`remove_reversible` (what :func:`revckpt.restore` calls), which
gives back the layers' forwards, drops the adapters and returns ``requires_grad``."""

from __future__ import annotations

import warnings
import weakref

from torch import nn

from ..errors import InvalidArgumentError
from ._reversible_calls import instance_forward
from ._reversible_stack import InstalledForward, ReversibleLayers
from .install import REVERSIBLE_ATTR

__all__ = ["refuse_reversible", "remove_reversible", "reversible_layers", "stack_of"]

_ATTR = REVERSIBLE_ATTR
_ADAPTERS = ("revckpt_adapter_f", "revckpt_adapter_g")  # registered on each converted layer


def _names_of(
    layers: list[tuple[str, nn.Module]], frozen: list[tuple[nn.Parameter, bool]]
) -> list[tuple[int, str, bool]]:
    """What ``trainable="adapters"`` froze, by layer and name, in ``frozen``'s order (a model
    whose parameters are replaced since, ``load_state_dict(assign=True)`` or ``to_empty``,
    has other objects)."""
    where: dict[int, tuple[int, str]] = {}
    for i, (_, layer) in enumerate(layers):
        for name, p in layer.named_parameters():
            where.setdefault(id(p), (i, name))
    return [(*where[id(p)], was) for p, was in frozen]


def _frozen_now(converted: ReversibleLayers) -> list[tuple[nn.Parameter, bool]]:
    """What ``trainable="adapters"`` froze, as the parameters the layers hold now: by name,
    else the object frozen (renamed since: a parametrization registered after moves it)."""
    if converted.frozen_names is None:  # a conversion pickled before the names were kept
        return converted.frozen
    found = []
    for k, (i, name, was) in enumerate(converted.frozen_names):
        try:
            found.append((converted.layers[i][1].get_parameter(name), was))
        except AttributeError:
            if k < len(converted.frozen):
                found.append((converted.frozen[k][0], was))
    return found


def _undo(layers: list[tuple[str, nn.Module]], frozen: list[tuple[nn.Parameter, bool]]) -> None:
    """Take back what a conversion refused midway did: the adapters it added and the
    ``requires_grad`` it changed."""
    for _, layer in layers:
        for name in _ADAPTERS:
            layer._modules.pop(name, None)
    for p, requires_grad in frozen:
        p.requires_grad_(requires_grad)


def reversible_layers(model: nn.Module) -> ReversibleLayers:
    """What :func:`make_reversible` installed on ``model``, or on the model it holds (a peft
    wrapper added after the conversion, the base model ``merge_and_unload()`` returns)."""
    found = model.__dict__.get(_ATTR)
    if isinstance(found, ReversibleLayers) and not found.removed:
        return found
    stacks = _stacks_in(model)
    if len(stacks) == 1:
        return stacks[0]
    raise InvalidArgumentError(
        f"{type(model).__name__} holds {len(stacks)} reversible stacks (revckpt.make_reversible): "
        "ask the model each was converted on"
        if stacks
        else f"{type(model).__name__} was not converted by revckpt.make_reversible"
    )


# Per conversion, the ids of the converted model's parameters at conversion (kept out of the
# conversion itself: ids mean nothing in another process, after torch.save and load)
_KNOWN: weakref.WeakKeyDictionary[ReversibleLayers, frozenset[int]] = weakref.WeakKeyDictionary()


def _conversions(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` (itself included) that :func:`make_reversible` converted (a
    conversion undone through its layers, see :func:`remove_reversible`, is dropped here)."""
    found = []
    for m in model.modules():
        converted = m.__dict__.get(_ATTR)
        if isinstance(converted, ReversibleLayers):
            if converted.removed:
                del m.__dict__[_ATTR]
            else:
                found.append(m)
    return found


def _stacks_in(model: nn.Module) -> list[ReversibleLayers]:
    """The conversions ``model`` holds: those of its modules (itself included) and those whose
    layers it holds while their converted model is elsewhere (peft's ``merge_and_unload()``
    returns the base model; a part of the converted model)."""
    stacks = [owner.__dict__[_ATTR] for owner in _conversions(model)]
    for m in model.modules():
        held = m.__dict__.get(_ATTR)
        fresh = isinstance(held, tuple) and not held[1].removed
        if fresh and not any(held[1] is s for s in stacks):
            stacks.append(held[1])
    return stacks


def remove_reversible(model: nn.Module) -> int:
    """Undo :func:`make_reversible` on ``model`` and its submodules (what
    :func:`revckpt.restore` calls): each converted layer gets back the forward it had, its
    adapters go (with what they learnt), the parameters ``trainable="adapters"`` froze get
    back the ``requires_grad`` they had, and the model computes what it did before
    conversion, bit for bit (the layers' own weights, as trained since). A stack whose
    layers are in ``model`` and whose converted model is not (peft's ``merge_and_unload()``
    returns the base model; or a part of the converted model) is undone too. Returns how
    many layers were restored (0: nothing was converted)."""
    stacks = _stacks_in(model)
    for owner in _conversions(model):
        del owner.__dict__[_ATTR]
    count = 0
    for converted in stacks:
        for (_, layer), before in zip(converted.layers, converted.forwards, strict=True):
            layer.__dict__.pop(_ATTR, None)
            current = layer.__dict__.get("forward")
            if not (isinstance(current, InstalledForward) and current.installed_on(layer)):
                continue  # wrapped since: the wrapper stays, calling through to the plain one
            layer.__dict__.pop("forward", None)
            original = instance_forward(layer, before)
            if original is not None:
                object.__setattr__(layer, "forward", original)
        _undo(converted.layers, _frozen_to_give_back(converted, model))  # adapters, grads
        for encoder in getattr(converted, "nested_off", ()):  # (a conversion pickled before)
            encoder.use_nested_tensor = True
        converted.removed = True  # its model, if it holds it still, forgets it
        count += len(converted.layers)
    return count


def _frozen_to_give_back(
    converted: ReversibleLayers, model: nn.Module
) -> list[tuple[nn.Parameter, bool]]:
    """The ``requires_grad`` to give back of what ``trainable="adapters"`` froze: all of it,
    unless the layers, or ``model`` (the one restore was given), now hold trainable
    parameters the conversion did not make nor find (peft's LoRA, a prefix or prompt added
    after it): their library then decides what trains (peft froze the base weights too), and
    they stay frozen, with a warning. (The model's parameters at conversion are known in the
    process that converted it; after a copy or a reload, the layers' only.)"""
    frozen = _frozen_now(converted)
    at_conversion = {id(p) for p, _ in frozen}
    at_conversion |= {
        id(p)
        for _, layer in converted.layers
        for name in _ADAPTERS
        if name in layer._modules
        for p in layer._modules[name].parameters()
    }
    at_conversion |= _KNOWN.get(converted, frozenset())
    candidates = [*nn.ModuleList(layer for _, layer in converted.layers).parameters()]
    if converted in _KNOWN:
        candidates += list(model.parameters())
    added = [p for p in candidates if p.requires_grad and id(p) not in at_conversion]
    unfrozen = [p for p, was in frozen if was and not p.requires_grad]
    if not added or not unfrozen:
        return frozen
    warnings.warn(
        f"revckpt.restore: the model holds {len(added)} trainable parameters added after "
        "make_reversible (e.g. peft's LoRA or prefix), whose library decides what trains, so the "
        f"{len(unfrozen)} parameters make_reversible(trainable='adapters') froze stay frozen; "
        "call requires_grad_(True) on those you mean to train",
        UserWarning,
        stacklevel=4,
    )
    return []


def refuse_reversible(model: nn.Module, what: str) -> None:
    """Raise if ``model`` holds a :func:`make_reversible` conversion (``what``: the caller,
    e.g. ``"fit"``), which a plan must not silently undo: on one of its modules, or on layers
    it holds whose converted model is elsewhere (peft's ``merge_and_unload()``)."""
    found = _stacks_in(model)
    if found:
        raise InvalidArgumentError(
            f"{what}: this model holds a reversible stack (revckpt.make_reversible), which "
            f"{what} does not plan layer by layer: revckpt.fit(model, example, memory_budget="
            "...) picks the stack's mode (store, checkpoint or reversible) for a budget; to "
            "plan the layers one by one, undo the conversion first with revckpt.restore(model) "
            "(its adapters go)"
        )


def stack_of(model: nn.Module) -> ReversibleLayers | None:
    """The reversible stack ``model`` holds (``None``: none); one at the most."""
    found = _stacks_in(model)
    if len(found) > 1:
        raise InvalidArgumentError(
            f"this model holds {len(found)} reversible stacks (revckpt.make_reversible): fit "
            "plans one; convert one stack per model"
        )
    return found[0] if found else None
