"""The module state a recompute depends on: captured with the forward, checked and re-established
by its replay (a part of :mod:`revckpt.replay`, which every strategy goes through).

A recompute runs the forward of the same modules a second time, during backward. Plain autograd
differentiates the forward *as it ran*; to give its gradients the recompute must see the same
module state, and must leave the state as one forward left it:

* **Parameters and buffers changed in place between forward and backward**
  (``optimizer.step()``, ``load_state_dict``, ``p.mul_(...)`` under ``no_grad``). Plain
  autograd raises (its version counters); a recompute would silently use the new values.
  Versions are recorded when the forward ends and compared before the replay:
  :class:`~revckpt.ModifiedParameterError`. A parameter or buffer *replaced* by another tensor
  meanwhile (``torch.func.functional_call`` during the forward, a rebinding) is swapped back
  for the recompute: plain autograd differentiates the tensors the forward used.
* **Plain module attributes** (``training``, and every ``bool`` / ``int`` / ``float`` / ``str`` /
  ``None`` attribute not starting with ``_``: a dropout ``p``, a causal flag, a call counter).
  ``model.eval()`` between forward and backward must not change what the recompute computes:
  replay sets them to their values when the forward started and restores them afterwards.
* **Buffers the forward writes** (``spectral_norm``'s power-iteration vectors, an EMA, a step
  counter; normalisation statistics are left to :func:`~revckpt.replay.freeze_running_stats`).
  The recompute runs on a copy of their value *before* the forward, and the real buffer keeps
  the value one forward left; the running statistics an eval-mode normalisation layer reads
  are copied too (a training-mode forward of the same layer updates them without moving their
  version counters). Which buffers a module writes is learned on its first forward
  under a recompute strategy: all its buffers are copied for that call and the copies of the
  untouched ones are dropped when it ends. A buffer written for the first time on a later call
  has no copy of its old value, and that call's replay raises :class:`~revckpt.ReplayError`
  (the next calls copy it). A buffer the first forward registers is absent in its recompute,
  as it was when the forward started, and copied by the next calls.

Cost per forward: one walk over the modules, their plain attributes and the versions of their
tensors; memory: nothing, but copies of buffers that the forward writes.
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase
from torch.nn.modules.lazy import LazyModuleMixin
from torch.nn.parameter import is_lazy
from torch.utils._python_dispatch import _disable_current_modes

from .errors import InvalidArgumentError, ModifiedParameterError, ReplayError

__all__ = ["ModuleState", "copy_bytes", "layout_learnt", "submodules"]

_PLAIN = (bool, int, float, str, type(None))
_STATS = frozenset(("running_mean", "running_var", "num_batches_tracked"))
_MISSING = object()

# Buffers each module's forward was seen writing (learned on its first captured forward).
_WRITES: weakref.WeakKeyDictionary[nn.Module, frozenset[str]] = weakref.WeakKeyDictionary()


def _walk(modules: Iterable[Any]) -> list[nn.Module]:
    out: list[nn.Module] = []
    seen: set[int] = set()
    todo = [m for m in modules if isinstance(m, nn.Module)]
    todo.reverse()
    while todo:
        m = todo.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        out.append(m)
        todo.extend(c for c in reversed(m._modules.values()) if c is not None)
    return out


class _Layout:
    """The modules under one root, the names of their plain attributes and their normalisation
    layers, found once per root (the walk and the attribute scan cost more than the rest of a
    capture). ``closed``: whether a recompute of the root was seen to call no normalisation
    layer but its own (``None``: not seen yet; see :meth:`ModuleState.norms`).

    It holds the modules by weak reference: the cache maps each root to its layout, and a
    layout holding its own root would keep every module ever captured alive. The attributes
    and normalisation layers are kept as positions in the module list, so that one pass over
    the references (:meth:`alive`) serves a whole capture."""

    __slots__ = (
        "__weakref__",
        "_modules",
        "attr_slots",
        "checked",
        "closed",
        "norm_slots",
        "signature",
    )

    def __init__(self, root: nn.Module) -> None:
        modules = _walk((root,))
        _refuse_lazy(modules)
        self._modules = tuple(weakref.ref(m) for m in modules)
        self.signature = _signature(modules)
        self.norm_slots = tuple(i for i, m in enumerate(modules) if isinstance(m, _NormBase))
        self.closed: bool | None = None
        # whether the attributes were scanned again after a forward (see ModuleState)
        self.checked = False
        # (position of the module, its plain attributes' names, a getter of their values)
        self.attr_slots: list[tuple[int, tuple[str, ...], Any]] = []
        self.scan_attributes(modules)

    def scan_attributes(self, modules: list[nn.Module]) -> None:
        self.attr_slots = []
        for i, m in enumerate(modules):
            keys = _plain_keys(m)
            if keys:
                self.attr_slots.append((i, keys, operator.itemgetter(*keys)))

    @property
    def modules(self) -> list[nn.Module]:
        return [ref() for ref in self._modules]  # type: ignore[misc]  # alive with the root

    @property
    def norms(self) -> tuple[nn.Module, ...]:
        modules = self.modules
        return tuple(modules[i] for i in self.norm_slots)

    def alive(self) -> list[nn.Module] | None:
        """The modules, when none was added, removed or replaced since the scan (new
        attributes of an existing module are not seen until the root is scanned again);
        else ``None``."""
        modules = [ref() for ref in self._modules]
        if None in modules or _signature(modules) != self.signature:
            return None
        return modules  # type: ignore[return-value]


def _plain_keys(m: nn.Module) -> tuple[str, ...]:
    """The names of ``m``'s plain attributes (public, of a plain type), which replay sets back."""
    return tuple(k for k, v in m.__dict__.items() if k[0] != "_" and type(v) in _PLAIN)


def _signature(modules: list[Any]) -> list[int]:
    return [id(c) for m in modules for c in m._modules.values()]


_LAYOUTS: weakref.WeakKeyDictionary[nn.Module, _Layout] = weakref.WeakKeyDictionary()


def _refuse_lazy(modules: list[nn.Module]) -> None:
    """A lazy module's first call shapes its parameters and draws their initial values: a
    recompute would find other random numbers drawn (a ``ReplayError`` about dropout masks,
    before) and other parameters. Once per layout: a materialised module is no longer lazy."""
    lazy = next((m for m in modules if _draws_when_materialised(m)), None)
    if lazy is not None:
        raise InvalidArgumentError(
            f"{type(lazy).__name__} is not initialised yet (a lazy module shapes and draws "
            "its parameters on its first call, which a recompute cannot repeat): run it once "
            "on a batch, e.g. under torch.no_grad(), before checkpointing it"
        )


def _draws_when_materialised(module: nn.Module) -> bool:
    """A lazy module with parameters still to shape (their initial values are drawn then; a
    lazy module with only buffers, ``LazyBatchNorm1d(affine=False)``, draws nothing)."""
    return isinstance(module, LazyModuleMixin) and any(
        is_lazy(p) for p in module.parameters(recurse=False)
    )


def layout_and_modules(root: nn.Module) -> tuple[_Layout, list[nn.Module]]:
    """``root``'s layout (cached; scanned again when a submodule was added, removed or
    replaced: a new layout object then) and its modules, checked in one pass."""
    layout = _LAYOUTS.get(root)
    modules = layout.alive() if layout is not None else None
    if modules is None:
        layout = _LAYOUTS[root] = _Layout(root)
        modules = layout.modules
    assert layout is not None
    return layout, modules


def layout_learnt(root: nn.Module) -> bool:
    """Whether ``root``'s layout is scanned (none of its submodules added, removed or replaced
    since), a captured forward of it finished (its attributes scanned again, the buffers it
    writes recorded) and a recompute of it was seen (which normalisation layers it calls)."""
    layout = _LAYOUTS.get(root)
    return (
        layout is not None
        and layout.checked
        and layout.closed is not None
        and layout.alive() is not None
    )


def submodules(root: nn.Module) -> list[nn.Module]:
    """``root`` and its submodules, each once (cached per root; walked again when a submodule
    was added, removed or replaced). Under ``torch.compile`` the walk is traced, not cached:
    guards on the cache (a weak dictionary whose entries come and go) would not hold."""
    if torch.compiler.is_compiling():
        return _walk((root,))
    return layout_and_modules(root)[1]


def _tracked_buffers(m: nn.Module) -> Iterable[tuple[str, torch.Tensor]]:
    """Buffers whose value the forward may read, other than normalisation statistics (see
    :func:`_read_stats`). ``num_batches_tracked`` never reaches an output, and in training mode
    the running statistics are not read (batch statistics are): replay freezes them."""
    norm = isinstance(m, _NormBase)
    for name, b in m._buffers.items():
        if b is not None and not (norm and name in _STATS):
            yield name, b


def _read_stats(m: nn.Module) -> Iterable[tuple[str, torch.Tensor]]:
    """The running statistics an eval-mode normalisation layer reads. Their updates by a
    training-mode forward of the same layer do not move their version counters, so they are
    copied when the forward starts (two vectors of the layer's width) and replayed from the
    copy, as plain autograd keeps what it needs of them."""
    if isinstance(m, _NormBase) and not m.training and m.track_running_stats:
        for name in ("running_mean", "running_var"):
            b = m._buffers.get(name)
            if b is not None:
                yield name, b


def _to_copy(
    modules: Iterable[nn.Module], norms: Iterable[nn.Module]
) -> Iterator[tuple[bool, nn.Module, str, torch.Tensor]]:
    """What a captured forward copies for its recompute, as ``(statistic, module, name,
    buffer)``: the buffers of ``modules`` the forward was seen writing (every buffer it may
    read, where no forward of the module was captured yet), and the running statistics the
    eval-mode layers among ``norms`` read."""
    for m in modules:
        if m._buffers:
            known = _WRITES.get(m)
            for name, b in _tracked_buffers(m):
                if known is None or name in known:
                    yield False, m, name, b
    for m in norms:
        for name, b in _read_stats(m):
            yield True, m, name, b


def copy_bytes(root: nn.Module) -> int:
    """Bytes of the copies a captured forward of ``root`` keeps for its recompute
    (:class:`ModuleState`, :func:`_to_copy`). One per block, however many blocks one recompute
    node runs."""
    layout, modules = layout_and_modules(root)
    norms = [modules[i] for i in layout.norm_slots]
    return sum(b.numel() * b.element_size() for *_, b in _to_copy(modules, norms))


def _label(m: nn.Module, name: str, t: torch.Tensor) -> str:
    return f"{type(m).__name__}.{name} (shape {tuple(t.shape)})"


def _values(getter: operator.itemgetter, keys: tuple[str, ...], d: dict[str, Any]) -> tuple:
    try:
        values = getter(d)
    except KeyError:
        return tuple(d.get(k, _MISSING) for k in keys)
    return values if len(keys) > 1 else (values,)


class ModuleState:
    """Attributes, parameter and buffer versions of the modules one forward calls."""

    __slots__ = (
        "_absent",
        "_attrs",
        "_before",
        "_flags",
        "_fresh",
        "_frozen",
        "_layouts",
        "_modules",
        "_old",
        "_registered",
        "_stats",
        "_unseen",
    )

    # Bookkeeping runs eagerly: after a graph break Dynamo would otherwise compile these frames.
    @torch.compiler.disable
    def __init__(self, roots: Iterable[Any]) -> None:
        found = [layout_and_modules(r) for r in roots if isinstance(r, nn.Module)]
        layouts = [layout for layout, _ in found]
        mods = found[0][1] if len(found) == 1 else _walk(roots)
        self._layouts = layouts
        self._modules = mods
        self._attrs = [
            (d, keys, _values(get, keys, d))
            for layout, modules in found
            for i, keys, get in layout.attr_slots
            for d in (modules[i].__dict__,)
        ]
        # (module, name, tensor, version) of every buffer when the forward starts
        self._before = [
            (m, n, b, b._version) for m in mods if m._buffers for n, b in _tracked_buffers(m)
        ]
        self._old: dict[tuple[nn.Module, str], torch.Tensor] = {}
        self._stats: dict[tuple[nn.Module, str], torch.Tensor] = {}
        norms = [mods[i] for i in layouts[0].norm_slots] if len(found) == 1 else mods
        copies = [
            (self._stats if stat else self._old, (m, name), b)
            for stat, m, name, b in _to_copy(mods, norms)
        ]
        if copies:  # (a no_grad context costs more than the rest of a capture)
            with torch.no_grad():
                for table, key, b in copies:
                    table[key] = b.clone()
        self._frozen: list[tuple[dict[str, Any], str, torch.Tensor, int]] = []
        # each parameter's requires_grad when the forward starts (frozen or unfrozen before the
        # backward, or by a hook during the forward, the recompute would save other tensors:
        # torch's checkpoint then gave other parameters wrong gradients without a word, or
        # raised)
        self._flags = [
            (p, p.requires_grad) for m in mods for p in m._parameters.values() if p is not None
        ]
        self._unseen: list[str] = []
        # layouts scanned before any forward of theirs finished: a forward may create plain
        # attributes (a counter set on the first call), which the recompute must not find
        self._fresh = [(layout, modules) for layout, modules in found if not layout.checked]
        self._absent: list[tuple[dict[str, Any], str]] = []
        # each fresh layout's modules with the buffers they have before the forward (one may
        # register a buffer on its first call: the recompute must start without it too)
        self._registered = [
            (m, frozenset(n for n, _ in _tracked_buffers(m)))
            for _, modules in self._fresh
            for m in modules
        ]

    @torch.compiler.disable
    def forward_finished(self) -> None:
        """Keep the old values of the buffers the forward wrote, and record the versions of
        everything else for :meth:`check`."""
        frozen = self._frozen
        if self._before:
            self._buffers_finished()
        if self._fresh:
            self._attributes_finished()
        for m in self._modules:
            table = m._parameters
            for name, p in table.items():
                if p is not None:
                    frozen.append((table, name, p, p._version))

    @torch.compiler.disable
    def forward_failed(self) -> None:
        """The forward raised: record nothing of what it did (the buffers it wrote so far are
        not all it writes), but scan again the attributes of layouts no forward finished yet,
        so that an attribute it made counts as there before the next forward, as it is."""
        for layout, modules in self._fresh:
            layout.scan_attributes(modules)
            layout.checked = True
        self._fresh = []
        self._before = []
        self._registered = []

    def _buffers_finished(self) -> None:
        written: dict[nn.Module, set[str]] = {}
        for m, name, b, version in self._before:
            now = m._buffers.get(name)
            if now is b and b._version == version:
                self._old.pop((m, name), None)
                self._frozen.append((m._buffers, name, b, version))
                continue
            written.setdefault(m, set()).add(name)
            if (m, name) not in self._old:
                self._unseen.append(_label(m, name, b))
        for m in {m for m, *_ in self._before}:
            _WRITES[m] = _WRITES.get(m, frozenset()) | written.get(m, set())
        self._before = []

    def _attributes_finished(self) -> None:
        """The plain attributes and buffers the forward created (absent when it started: the
        recompute runs without them; a buffer it registered is one it writes, copied by the
        next captures), and each fresh layout scanned again to include them."""
        for m, before in self._registered:
            new = {n for n, _ in _tracked_buffers(m)} - before
            if new:
                self._absent += [(m._buffers, n) for n in new]
                _WRITES[m] = _WRITES.get(m, frozenset()) | new
        self._registered = []
        for layout, modules in self._fresh:
            had = {i: set(keys) for i, keys, _ in layout.attr_slots}
            for i, m in enumerate(modules):
                self._absent += [(m.__dict__, k) for k in _plain_keys(m) if k not in had.get(i, ())]
            layout.scan_attributes(modules)
            layout.checked = True
        self._fresh = []

    def norms(self) -> tuple[nn.Module, ...] | None:
        """The normalisation layers a recompute of these modules calls, once a recompute of the
        same modules (none added, removed or replaced since) was seen to call no other one;
        ``None`` until then (replay then freezes whatever normalisation layer runs, and
        reports what ran to :meth:`learn_norms`)."""
        layouts = self._layouts
        if not layouts or not all(layout.closed for layout in layouts):
            return None
        if len(layouts) == 1:
            return layouts[0].norms
        return tuple(dict.fromkeys(m for layout in layouts for m in layout.norms))

    def learn_norms(self, ran: Iterable[nn.Module]) -> None:
        """Record the normalisation layers one recompute of these modules called: if all are
        theirs, later recomputes freeze exactly those (no global module hooks)."""
        own = {id(m) for layout in self._layouts for m in layout.norms}
        closed = all(id(m) in own for m in ran)
        for layout in self._layouts:
            layout.closed = closed

    @torch.compiler.disable
    def check(self, label: str) -> None:
        """Raise if the recompute cannot run as the forward ran."""
        for _, name, t, version in self._frozen:
            if t._version != version:
                raise ModifiedParameterError(
                    f"the recompute of {label} cannot run: {name!r} (shape "
                    f"{tuple(t.shape)}) was modified in place between the forward and its "
                    "backward (an optimizer step, load_state_dict, or an in-place update under "
                    "no_grad), so the recompute would differentiate other weights than the "
                    "forward used; call backward before changing parameters or buffers "
                    "(optimizer.step() after loss.backward())"
                )
        if self._unseen:
            raise ReplayError(
                f"the recompute of {label} cannot run: the forward updated buffer "
                f"{self._unseen[0]} in place, and no copy of its value before the forward was "
                "kept (the module had not written it on earlier calls). Later steps keep a "
                "copy; to avoid it, run this step again, keep the block stored, or update the "
                "buffer only when not revckpt.replay.is_replaying()"
            )

    @torch.compiler.disable
    def enter(self) -> list[tuple[Any, ...]]:
        """Set attributes and written buffers as the forward found them; returns what to
        restore with :meth:`exit`."""
        undo: list[tuple[Any, ...]] = []
        for p, flag in self._flags:  # as the forward ran (plain autograd's graph is that one)
            if p.requires_grad != flag:
                undo.append((p, not flag))
                p.requires_grad_(flag)
        for table, name, t, _ in self._frozen:
            now = table.get(name, _MISSING)
            if now is not t:  # replaced since (functional_call, a rebinding): the forward's
                undo.append((table, name, now))
                table[name] = t
        for d, keys, values in self._attrs:
            for k, v in zip(keys, values, strict=True):
                now = d.get(k, _MISSING)
                if now is not v and v is not _MISSING:
                    undo.append((d, k, now))
                    d[k] = v
        for d, k in self._absent:  # created by the forward: the recompute starts without
            now = d.pop(k, _MISSING)
            if now is not _MISSING:
                undo.append((d, k, now))
        if self._old or self._stats:
            with _disable_current_modes(), torch.no_grad():
                for (m, name), old in (*self._old.items(), *self._stats.items()):
                    undo.append((m._buffers, name, m._buffers.get(name, _MISSING)))
                    m._buffers[name] = old.clone()
        return undo

    @staticmethod
    @torch.compiler.disable
    def exit(undo: list[tuple[Any, ...]]) -> None:
        """Restore what :meth:`enter` changed (and what the recompute changed in there)."""
        for entry in reversed(undo):
            if len(entry) == 2:  # a parameter's requires_grad
                entry[0].requires_grad_(entry[1])
                continue
            d, k, v = entry
            if v is _MISSING:
                d.pop(k, None)
            else:
                d[k] = v
