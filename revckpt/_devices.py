"""Which devices a block's tensors live on, and their random generators' states: what
:mod:`revckpt.replay` captures per device. Part of replay (it imports nothing else of revckpt
but the module-state walk)."""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from ._module_state import submodules

__all__ = ["devices_of", "get_rng", "set_rng"]


@functools.cache
def _accelerator_type() -> str | None:
    if not torch.accelerator.is_available():
        return None
    accelerator = torch.accelerator.current_accelerator()
    return None if accelerator is None else accelerator.type


def _accelerator_initialised() -> bool:
    """Whether any accelerator runtime has been started (else every tensor lives on the CPU)."""
    if torch.cuda.is_initialized():
        return True
    # traced, the uncached lookup: Dynamo skips a cache, and warns at it
    kind = _accelerator_type.__wrapped__() if torch.compiler.is_compiling() else _accelerator_type()
    if kind is None or kind == "cuda":
        return False
    module = torch.get_device_module(kind)
    return bool(getattr(module, "is_initialized", lambda: True)())


def devices_of(*objs: Any) -> list[torch.device]:
    """The distinct devices of the tensors in ``objs`` (nested containers and modules included).

    Modules contribute their parameters and buffers (scanned only once an accelerator runtime
    has started: before that, every tensor is on the CPU). The result is ordered by first
    appearance; ``meta`` tensors are ignored.
    """
    scan_modules = _accelerator_initialised()
    seen: dict[torch.device, None] = {}
    for obj in objs:
        if isinstance(obj, nn.Module):
            if scan_modules:
                for m in submodules(obj):  # the walk is cached per module tree
                    for t in (*m._parameters.values(), *m._buffers.values()):
                        if t is not None:
                            seen[t.device] = None
        else:
            _scan(obj, seen)
    seen.pop(_META, None)
    if len(seen) == 1 and _CPU in seen:
        return [_CPU]
    return list(dict.fromkeys(_normalise(d) for d in seen))


_CPU = torch.device("cpu")
_META = torch.device("meta")
_PLAIN = (int, float, str, bool, type(None))


def _scan(obj: Any, seen: dict[torch.device, None]) -> None:
    """Add the devices of the tensors in ``obj`` to ``seen``: tuples, lists and dicts are walked
    here (a block's arguments, called per block and step), other containers by pytree."""
    kind = type(obj)
    if isinstance(obj, torch.Tensor):
        seen[obj.device] = None
    elif kind is tuple or kind is list:
        for item in obj:
            _scan(item, seen)
    elif kind is dict:
        for item in obj.values():
            _scan(item, seen)
    elif not isinstance(obj, _PLAIN):
        for t in tree_flatten(obj)[0]:
            if isinstance(t, torch.Tensor):
                seen[t.device] = None


def _normalise(device: torch.device) -> torch.device:
    if device.type == "cpu" or device.index is not None:
        return torch.device(device.type) if device.type == "cpu" else device
    module = torch.get_device_module(device.type)
    return torch.device(device.type, module.current_device())


def get_rng(device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return torch.get_rng_state()
    module = torch.get_device_module(device.type)
    if device.type == "mps":
        return module.get_rng_state()
    return module.get_rng_state(device.index)


def set_rng(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cpu":
        torch.set_rng_state(state)
        return
    module = torch.get_device_module(device.type)
    if device.type == "mps":
        module.set_rng_state(state)
    else:
        module.set_rng_state(state, device.index)
