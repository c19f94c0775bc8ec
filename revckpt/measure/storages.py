"""The CPU storage tracker behind ``MemoryMeter("cpu")`` (see :mod:`revckpt.measure.memory`
for what it counts and its blind spots): a ``TorchDispatchMode`` that records each new
storage an operation makes once, with its ``nbytes``, subtracts it when a weak reference sees
it freed, and notes when the block runs compiled code it cannot see."""

from __future__ import annotations

import sys
import threading
import weakref
from types import FrameType
from typing import Any

import torch
from torch._C._dynamo.eval_frame import get_eval_frame_callback
from torch.utils._python_dispatch import TorchDispatchMode
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
    if caller.f_code.co_filename.endswith("eval_frame.py") and "prior" in caller.f_locals:
        return caller.f_locals["prior"]
    return get_eval_frame_callback()


def _compiled_code(caller: FrameType) -> str | None:
    """Why an operation comes from compiled code (the message to raise), or None."""
    node = torch._C._current_autograd_node()
    if node is not None and node.name() == "CompiledFunctionBackward":
        return _COMPILED_BACKWARD
    callback = _dynamo_callback(caller)
    if callback is not None and callback is not False:
        return _COMPILED_FORWARD
    return None


def _storage(t: torch.Tensor) -> torch.UntypedStorage | None:
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return None  # sparse, nested, or a subclass without storage


class _StorageTracker(TorchDispatchMode):
    """Counts live bytes of storages created by operations, on one device type."""

    def __init__(self, device_type: str) -> None:
        super().__init__()
        self.device_type = device_type
        self.sizes: dict[int, int] = {}
        self.refs: dict[int, weakref.ref[Any]] = {}
        self.live = 0
        self.peak = 0
        self.compiled: str | None = None  # why the block ran compiled code, if it did
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

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.compiled is None:
            self.compiled = _compiled_code(sys._getframe(1))
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
