"""Measure without side effects: put a model's gradients and buffers back afterwards."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

__all__ = ["cut_from_graph", "preserved"]


@contextlib.contextmanager
def preserved(
    modules: nn.Module | Iterable[nn.Module],
    *,
    grads: bool = True,
    tensors: Iterable[torch.Tensor] = (),
) -> Iterator[None]:
    """Within this context the modules may be run forward and backward freely: on exit every
    buffer (BatchNorm running statistics, counters) gets its value back, in the tensor the
    module held (one a forward rebound, ``self.ema = 0.9 * self.ema + ...``, is put back; one a
    forward registered is removed), every plain public attribute (a call counter) its value
    (one a forward made is removed), and, with ``grads``, every trainable parameter its
    ``.grad`` (the same tensor object, or ``None``). ``tensors`` (the modules' inputs): the leaves
    among them that require grad have no ``.grad`` within the context, and get theirs back on exit.
    Modules the given ones hold in a plain list, tuple or dict attribute (not registered,
    e.g. ``self.shared = [norm]``) count as theirs; modules reached through globals are not
    seen."""
    every = _reached([modules] if isinstance(modules, nn.Module) else list(modules))
    registered = [(s, dict(s._buffers)) for s in every]
    attributes = [(s, type(s), {k: s.__dict__[k] for k in _plain_keys(s)}) for s in every]
    seen: set[int] = set()
    params, buffers = [], []
    for m in every:
        for p in m.parameters(recurse=False):
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                params.append(p)
        for b in m.buffers(recurse=False):
            if id(b) not in seen:
                seen.add(id(b))
                buffers.append((b, b.detach().clone()))
    inputs = [t for t in tensors if t.requires_grad and t.is_leaf and id(t) not in seen]
    saved_grads = [p.grad for p in params]
    input_grads = [t.grad for t in inputs]
    for t in inputs:  # not accumulated into: their gradients are the caller's
        t.grad = None
    try:
        yield
    finally:
        if grads:
            for p, g in zip(params, saved_grads, strict=True):
                p.grad = g
        for t, g in zip(inputs, input_grads, strict=True):
            t.grad = g
        _restore_modules(registered, attributes)
        with torch.no_grad():
            for b, value in buffers:
                b.copy_(value)


# A module's plain attributes: public, of a plain type (the rule replay's module state uses,
# revckpt._module_state._plain_keys; measure imports nothing of revckpt but its errors).
_PLAIN = (bool, int, float, str, type(None))


def _plain_keys(m: nn.Module) -> list[str]:
    return [k for k, v in m.__dict__.items() if k[0] != "_" and type(v) in _PLAIN]


def _reached(roots: list[nn.Module]) -> list[nn.Module]:
    """``roots``, their submodules and the modules any of them holds in a plain list, tuple or
    dict attribute (and their submodules), each once."""
    found: dict[int, nn.Module] = {}
    todo = list(roots)
    while todo:
        for s in todo.pop().modules():
            if id(s) in found:
                continue
            found[id(s)] = s
            for v in s.__dict__.values():
                if isinstance(v, (list, tuple, dict)):
                    items = v.values() if isinstance(v, dict) else v
                    todo += [c for c in items if isinstance(c, nn.Module)]
    return list(found.values())


def _restore_modules(
    registered: list[tuple[nn.Module, dict[str, Any]]],
    attributes: list[tuple[nn.Module, type, dict[str, Any]]],
) -> None:
    """Each module's buffer table and plain public attributes as they were (the tensors
    themselves, not their values: the caller copies those back); not the attributes of a
    module whose class changed (a lazy module's first forward made it another one, with its
    sizes set for good)."""
    for s, table in registered:
        now = s._buffers
        if now.keys() != table.keys() or any(now[k] is not v for k, v in table.items()):
            now.clear()
            now.update(table)
    for s, cls, values in attributes:
        if type(s) is not cls:
            continue
        for k in _plain_keys(s):
            if k not in values:
                del s.__dict__[k]
        s.__dict__.update(values)


def cut_from_graph(values: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` (keyword arguments of blocks about to be measured) with every tensor that
    requires grad, inside lists, tuples and dicts too, replaced by a detached leaf that requires
    grad (the same storage): the measuring steps' backward passes stop there instead of running
    into the caller's graph (a non-leaf one would be backpropagated through twice) or
    accumulating into its leaves."""

    def cut(t: torch.Tensor) -> torch.Tensor:
        return t.detach().requires_grad_(True) if t.requires_grad else t

    return {k: tree_map_only(torch.Tensor, cut, v) for k, v in values.items()}
