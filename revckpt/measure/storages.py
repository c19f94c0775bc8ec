"""The CPU storage tracker behind ``MemoryMeter("cpu")`` (see :mod:`revckpt.measure.memory`
for what it counts and its blind spots): a ``TorchDispatchMode`` that records each new
storage an operation makes once, with its ``nbytes``, subtracts it when a weak reference sees
it freed, and notes when the block runs compiled code it cannot see.

It runs on every operation of the metered block, so its per-operation Python is what metering
costs (the scheduler's profile meters each block in several modes). The fast path
(:meth:`_StorageTracker.__torch_dispatch__`) finds the tensors of plain argument tuples and
flat lists itself, ``tree_flatten`` only for anything else; reads the arguments' sizes before the
operation only when its schema says it may write one (``resize_``, ``out=``, in-place: the only
ways a storage from before the block can grow); and takes the lock once per operation that
made or grew a storage. The general path (:meth:`_StorageTracker._general`, ``fast=False``)
is the plain version, flattening everything and reading every argument's size; both count
the same bytes, and the tests compare them."""

from __future__ import annotations

import sys
import threading
import weakref
from types import FrameType
from typing import Any

import torch
from torch._C._dynamo.eval_frame import get_eval_frame_callback
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _get_current_dispatch_mode_stack,
    _pop_mode,
    _push_mode,
)
from torch.utils._pytree import tree_flatten

__all__: list[str] = []

_LIFT_OPS = frozenset(
    getattr(torch.ops.aten, name)
    for name in ("lift_fresh", "lift_fresh_copy", "lift")
    if hasattr(torch.ops.aten, name)
)


_COMPILED_FORWARD = (
    "MemoryMeter('cpu') ran torch.compile'd code: Dynamo does not compile while a "
    "TorchDispatchMode (this meter) is active, so it ran eagerly and the figures would be "
    "eager ones; torch may also keep the compiled functions and modules eager after the block "
    "(pytorch/pytorch#190286) until torch._dynamo.reset(). Measure compiled code with "
    "MemoryMeter('cpu', method='allocator')"
)
_COMPILED_BACKWARD = (
    "MemoryMeter('cpu') ran the backward of a torch.compile'd forward: compiled code "
    "allocates its buffers outside the dispatcher, so this meter does not see them and would "
    "report too little. Measure it with MemoryMeter('cpu', method='allocator')"
)


def _dynamo_callback(caller: FrameType) -> Any:
    """The Dynamo frame callback in force where the operation was called. torch wraps a
    mode's ``__torch_dispatch__`` in ``torch._dynamo.disable``, whose wrapper (``caller``)
    switches the callback off and keeps the one in force in its local ``prior``."""
    if caller.f_code.co_filename.endswith("eval_frame.py"):
        local = caller.f_locals
        if "prior" in local:
            return local["prior"]
    return get_eval_frame_callback()


def _converted_codes() -> Any:
    """The ids of the code objects Dynamo has converted since its last reset (a set), or None
    where this torch does not keep them where :func:`_compiled_code` looks."""
    try:
        from torch._dynamo import convert_frame
    except ImportError:  # pragma: no cover - torch without Dynamo
        return None
    seen = getattr(getattr(convert_frame, "input_codes", None), "seen_ids", None)
    return seen if isinstance(seen, set) else None


_CONVERTED = _converted_codes()


def _compiled_code(caller: FrameType) -> str | None:
    """Why an operation comes from compiled code (the message to raise), or None."""
    node = torch._C._current_autograd_node()
    if node is not None and node.name() == "CompiledFunctionBackward":
        return _COMPILED_BACKWARD
    if _CONVERTED is not None and not _CONVERTED:
        # Dynamo has converted no frame since its last reset (which drops compiled code):
        # no compiled forward can be running, and reading the callback in force (the
        # caller's locals) is a third of the meter's own cost per operation
        return None
    callback = _dynamo_callback(caller)
    if callback is not None and callback is not False:
        return _COMPILED_FORWARD
    return None


def _storage(t: torch.Tensor) -> torch.UntypedStorage | None:
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return None  # sparse, nested, or a subclass without storage


# What the fast path takes apart itself: plain tensors, the leaves of an operation's arguments
# that cannot hold a tensor, and flat lists and tuples of these. Anything else (a tensor
# subclass, a dict, a namedtuple, a registered pytree node) goes through ``tree_flatten``.
_TENSORS = frozenset({torch.Tensor, torch.nn.Parameter})
_LEAVES = frozenset(
    {int, float, bool, complex, str, type(None), torch.dtype, torch.device, torch.layout}
    | {torch.memory_format, torch.SymInt, torch.SymFloat, torch.SymBool}
)


def _tree_leaves(value: Any, found: list[Any]) -> None:
    """Every tensor and storage among ``tree_flatten(value)``'s leaves, appended to ``found``."""
    found.extend(
        v for v in tree_flatten(value)[0] if isinstance(v, (torch.Tensor, torch.UntypedStorage))
    )


def _leaves(values: Any, found: list[Any]) -> None:
    """What :func:`_tree_leaves` finds in the sequence ``values``, in its order: tensors and
    flat lists or tuples of tensors and scalars are taken apart here, anything else by it."""
    for v in values:
        cls = type(v)
        if cls in _TENSORS:
            found.append(v)
        elif cls in _LEAVES:
            continue
        elif cls is list or cls is tuple:
            for w in v:
                c = type(w)
                if c in _TENSORS:
                    found.append(w)
                elif c not in _LEAVES:
                    _tree_leaves(w, found)
        else:
            _tree_leaves(v, found)


# id(operation) -> (the operation, kept alive so that its id stays its own; whether its schema
# lets it write an argument; whether it is a lift op, whose result is a new tensor even when it
# shares its argument's storage)
_KINDS: dict[int, tuple[Any, bool, bool]] = {}


def _kind(func: Any) -> tuple[Any, bool, bool]:
    kind = _KINDS.get(id(func))
    if kind is None:
        schema = getattr(func, "_schema", None)
        writes = schema is None or bool(schema.is_mutable)
        kind = _KINDS[id(func)] = (func, writes, func.overloadpacket in _LIFT_OPS)
    return kind


# What ``TorchDispatchMode.__enter__`` saves of torch's mode flags, restored by its ``__exit__``
_SAVED_FLAGS = (
    "old_dispatch_mode_flags",
    "old_non_infra_dispatch_mode_flags",
    "old_without_ignore_compile_internals_dispatch_mode_flags",
)


class _StorageTracker(TorchDispatchMode):
    """Counts live bytes of storages created by operations, on one device type. ``fast``:
    the fast path (the default) or the general one (see the module docstring)."""

    def __init__(self, device_type: str, *, fast: bool = True) -> None:
        super().__init__()
        self.device_type = device_type
        self.cpu = device_type == "cpu"
        self.device = torch.device(device_type)
        self.sizes: dict[int, int] = {}
        self.refs: dict[int, weakref.ref[Any]] = {}
        self.live = 0
        self.peak = 0
        self.compiled: str | None = None  # why the block ran compiled code, if it did
        self.fast = fast
        # Re-entrant: a weak-reference callback can run inside _add on this very thread, when
        # an allocation there triggers a garbage collection that frees a tracked storage.
        self.lock = threading.RLock()

    def _freed(self, key: int) -> None:
        with self.lock:
            self.live -= self.sizes.pop(key, 0)
            self.refs.pop(key, None)

    def resync(self) -> None:
        """Re-read the size of every tracked storage: catches storages resized outside the
        dispatcher (``untyped_storage().resize_(0)``, as some libraries do to free a tensor)."""
        for key, ref in list(self.refs.items()):
            storage = ref()
            if storage is not None:
                nbytes = storage.nbytes()
                self.live += nbytes - self.sizes[key]
                self.sizes[key] = nbytes
        self.peak = max(self.peak, self.live)  # what grew unseen was live at least at the end

    def _add(self, storage: torch.UntypedStorage) -> None:
        key = storage._cdata
        nbytes = storage.nbytes()
        with self.lock:
            if key in self.sizes:
                grown = nbytes - self.sizes[key]  # resize_ or an out= argument that grew
                if grown == 0:
                    return
                self.sizes[key] = nbytes
                self.live += grown
            else:
                self.sizes[key] = nbytes
                self.refs[key] = weakref.ref(storage, lambda _, k=key: self._freed(k))
                self.live += nbytes
            self.peak = max(self.peak, self.live)

    def _general(self, func: Any, args: Any, kwargs: Any) -> Any:
        """Run ``func`` and count what it made: every tensor of its arguments and results found
        by ``tree_flatten``, the size of every argument read before and after."""
        before: dict[int, tuple[torch.UntypedStorage, int]] = {}
        for a in tree_flatten((args, kwargs))[0]:
            st = _storage(a) if isinstance(a, torch.Tensor) else a
            if isinstance(st, torch.UntypedStorage) and st.device.type == self.device_type:
                before[st._cdata] = (st, st.nbytes())
        out = func(*args, **kwargs)
        inputs = set() if func.overloadpacket in _LIFT_OPS else set(before)
        for key, (st, nbytes) in before.items():
            if key not in self.sizes and st.nbytes() > nbytes:
                # a storage from before the block grew (out= argument, resize_): count the growth
                with self.lock:
                    self.live += st.nbytes() - nbytes
                    self.peak = max(self.peak, self.live)
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.device.type != self.device_type:
                continue
            st = _storage(t)
            if st is None:
                continue
            if st._cdata in inputs and st._cdata not in self.sizes:
                continue  # an alias of a storage that existed before the block
            self._add(st)
        return out

    def _arguments(self, args: Any, kwargs: Any) -> list[Any]:
        found: list[Any] = []
        _leaves(args, found)
        if kwargs:
            _leaves(kwargs.values(), found)
        return found

    def _sizes_before(self, args: Any, kwargs: Any) -> dict[int, tuple[Any, int]]:
        """The storages on this device among the arguments of an operation that may write
        them, with their sizes."""
        before: dict[int, tuple[torch.UntypedStorage, int]] = {}
        device, device_type = self.device, self.device_type
        for a in self._arguments(args, kwargs):
            st = _storage(a) if isinstance(a, torch.Tensor) else a
            if st is None:
                continue
            where = st.device  # (comparing devices is quicker than reading .type)
            if where == device or where.type == device_type:
                before[st._cdata] = (st, st.nbytes())
        return before

    def _argument_keys(self, args: Any, kwargs: Any) -> set[int]:
        """The storages of an operation's arguments (any device: a storage here cannot be the
        same as one elsewhere)."""
        keys = set()
        for a in self._arguments(args, kwargs):
            if isinstance(a, torch.Tensor):
                try:
                    keys.add(a.untyped_storage()._cdata)
                except (RuntimeError, NotImplementedError, TypeError):
                    continue  # sparse, nested, or a subclass without storage
            else:
                keys.add(a._cdata)
        return keys

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        """Run ``func`` and count what it made (the fast path, see the module docstring)."""
        if kwargs is None:
            kwargs = {}
        if self.compiled is None:
            self.compiled = _compiled_code(sys._getframe(1))
        if not self.fast:
            return self._general(func, args, kwargs)
        _, writes, lift = _KINDS.get(id(func)) or _kind(func)
        before = self._sizes_before(args, kwargs) if writes else None
        out = func(*args, **kwargs)
        found: list[Any] = [out] if type(out) in _TENSORS else []
        if not found:
            _leaves((out,), found)
        sizes, cpu, device_type = self.sizes, self.cpu, self.device_type
        changes: list[int] = []  # what live gains, in order: applied under the lock at once
        if before:
            for key, (st, nbytes) in before.items():
                if key not in sizes and st.nbytes() > nbytes:
                    changes.append(st.nbytes() - nbytes)  # a storage from before the block grew
        inputs = None if before is None else (set() if lift else set(before))
        for t in found:
            if not isinstance(t, torch.Tensor):
                continue
            if not t.is_cpu if cpu else t.device.type != device_type:
                continue
            try:
                st = t.untyped_storage()
            except (RuntimeError, NotImplementedError, TypeError):
                continue  # sparse, nested, or a subclass without storage
            key = st._cdata
            if key in sizes:
                grown = st.nbytes() - sizes[key]  # resize_ or an out= argument that grew
                if grown != 0:
                    sizes[key] += grown
                    changes.append(grown)
                continue
            if not lift:
                if inputs is None:
                    inputs = self._argument_keys(args, kwargs)
                if key in inputs:
                    continue  # an alias of a storage that existed before the block
            sizes[key] = nbytes = st.nbytes()
            self.refs[key] = weakref.ref(st, lambda _, k=key, freed=self._freed: freed(k))
            changes.append(nbytes)
        if changes:
            self._apply(changes)
        return out

    def leave(self, exc: Any) -> bool:
        """Exit the mode wherever it is on torch's dispatch-mode stack. ``__exit__`` pops the
        top one: a meter exited before one entered after it (not innermost first) would pop
        the other's tracker and leave its own, counting every later operation of the process.
        Here the modes above it stay, and the one right above inherits the state this one
        saved at its entry, which its own exit then restores. ``False``: this thread has no
        mode to take (the meter was entered on another thread)."""
        stack = _get_current_dispatch_mode_stack()
        if not stack:
            return False  # exited on another thread than it was entered on
        # not on the stack: another mode exited out of order before it took this one off
        # (torch's exit pops the top mode), and taking the top one leaves the stack as it was
        if stack[-1] is self or not any(m is self for m in stack):
            self.__exit__(*exc)
            return True
        above = []
        while (top := _pop_mode()) is not self:
            above.append(top)
        for mode in reversed(above):
            _push_mode(mode)
        upper = above[-1]
        for name in _SAVED_FLAGS:
            mine, theirs = getattr(self, name, None), getattr(upper, name, None)
            if mine and theirs:
                theirs[-1] = mine.pop()
        return True

    def _apply(self, changes: list[int]) -> None:
        with self.lock:
            for change in changes:
                self.live += change
                if self.live > self.peak:
                    self.peak = self.live
