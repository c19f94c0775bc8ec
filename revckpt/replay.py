"""Forward-time state, captured once and replayed by every recompute.

A recompute (a checkpoint segment, an approximate recompute, a reversible block rebuilding its
input) runs a block's forward a second time, during backward. To give the same values and the
same gradients as the first forward, and to leave the model as one forward would have left it,
three kinds of state must match:

* **RNG.** The recompute must draw the same dropout masks. :class:`ForwardState` captures the
  generator state of the CPU and of every accelerator device the inputs and parameters live on,
  and keeps it only if the forward actually drew random numbers (a block without dropout retains
  no RNG state, where ``torch.utils.checkpoint`` keeps 5,056 bytes per call). Replay sets the
  captured state, runs, and restores the generators, so the global RNG stream is the same as
  without recompute.
* **Autocast.** Backward usually runs outside the ``torch.autocast`` block of the forward. The
  recompute re-enters the forward's autocast state (enabled, dtype, cache) for the CPU and for
  the accelerator device types, and disables autocast that backward may run under but the
  forward did not.
* **Normalisation statistics.** BatchNorm (and InstanceNorm with ``track_running_stats``) update
  ``running_mean``, ``running_var`` and ``num_batches_tracked`` in training mode. During replay
  :func:`freeze_running_stats` hands such modules throwaway copies of those buffers, so the
  recompute performs the same operations (and saves the same tensors) as the first forward while
  the real statistics are updated exactly once per step. The first recompute of a block finds
  them with global module hooks; once it called no normalisation layer but the block's own,
  later recomputes swap exactly those, without hooks (learned again when the block's modules
  change; a block whose forward reaches other layers keeps the hooks). A layer that only a
  data-dependent branch reaches through a global, never taken in that first recompute, is not
  seen.

* **Module state** (:mod:`revckpt._module_state`): parameters and buffers changed in place
  between forward and backward raise :class:`~revckpt.ModifiedParameterError` (as plain
  autograd's version check does); ``train()`` / ``eval()`` and other plain module attributes
  changed meanwhile are set back to the forward's values for the recompute; buffers the forward
  itself writes (``spectral_norm``, an EMA) are recomputed from their value before the forward
  and keep the value one forward left.
* **Threads.** The global CPU generator is shared by every thread. A forward that keeps RNG
  state for replay, and every replay, hold one process-wide lock, so two models training in two
  threads with revckpt draw their masks in turn; strategies that re-run the whole forward
  (approx, offload, reversible) also check that the recompute ended at the generator state the
  forward ended at, and raise :class:`~revckpt.ReplayError` when code outside revckpt drew
  random numbers in another thread meanwhile.

This module imports nothing of revckpt but the errors (and its own ``_module_state``); every
strategy uses it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn
from torch.nn.modules.batchnorm import _NormBase
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten

from ._module_state import ModuleState, submodules
from .errors import ReplayError

__all__ = [
    "AutocastState",
    "ForwardState",
    "devices_of",
    "freeze_running_stats",
    "is_replaying",
]

_RUNNING_STAT_BUFFERS = ("running_mean", "running_var", "num_batches_tracked")


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
    kind = _accelerator_type()
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


def _get_rng(device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return torch.get_rng_state()
    module = torch.get_device_module(device.type)
    if device.type == "mps":
        return module.get_rng_state()
    return module.get_rng_state(device.index)


def _set_rng(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cpu":
        torch.set_rng_state(state)
        return
    module = torch.get_device_module(device.type)
    if device.type == "mps":
        module.set_rng_state(state)
    else:
        module.set_rng_state(state, device.index)


@functools.cache
def _autocast_types(extra: frozenset[str]) -> tuple[str, ...]:
    types = {"cpu", *extra}
    if torch.cuda.is_available():
        types.add("cuda")
    return tuple(sorted(t for t in types if torch.amp.is_autocast_available(t)))


def _autocast_device_types(devices: Iterable[torch.device]) -> tuple[str, ...]:
    extra = [d.type for d in devices if d.type != "cpu"]
    return _autocast_types(frozenset(extra) if extra else _NO_EXTRA)


_NO_EXTRA: frozenset[str] = frozenset()


@functools.lru_cache(maxsize=256)
def _autocast_state(
    device_type: str, enabled: bool, dtype: torch.dtype, cache_enabled: bool
) -> AutocastState:
    return AutocastState(device_type, enabled, dtype, cache_enabled)


@dataclasses.dataclass(frozen=True)
class AutocastState:
    """The autocast settings of one device type at capture time."""

    device_type: str
    enabled: bool
    dtype: torch.dtype
    cache_enabled: bool

    @classmethod
    def capture(cls, device_type: str) -> AutocastState:
        """The autocast settings now in effect for ``device_type`` (one shared instance per
        distinct setting: a capture runs per block and step)."""
        return _autocast_state(
            device_type,
            torch.is_autocast_enabled(device_type),
            torch.get_autocast_dtype(device_type),
            torch.is_autocast_cache_enabled(),
        )

    def matches_current(self) -> bool:
        """Whether autocast on this device type is already in this state (so replay need not
        enter a context)."""
        if not torch.is_autocast_enabled(self.device_type):
            return not self.enabled
        return (
            self.enabled
            and torch.get_autocast_dtype(self.device_type) == self.dtype
            and torch.is_autocast_cache_enabled() == self.cache_enabled
        )

    def context(self) -> contextlib.AbstractContextManager[Any]:
        """A context that re-establishes these settings (or disables autocast if it was off)."""
        return torch.autocast(
            self.device_type,
            dtype=self.dtype,
            enabled=self.enabled,
            cache_enabled=self.cache_enabled,
        )


# The global CPU generator is shared by all threads. This lock is held from the capture of a
# forward that may draw random numbers until that forward ends, and during the replay of one
# that did, so that two threads' recomputed forwards draw in turn. It is never waited for
# without a bound (a block may run sub-blocks in threads of its own: they must not hang):
_WAIT_UNKNOWN_S = 1.0  # a block not seen yet: if the lock stays busy, run and check instead
_WAIT_DRAWING_S = 30.0  # a block known to draw: past this, refuse (ReplayError)
_RNG_LOCK = threading.RLock()
# Whether each block's last forward drew random numbers (blocks that never do take no lock).
_DRAWS: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


def _known_draws(modules: tuple[nn.Module, ...]) -> bool | None:
    """Whether the forward of ``modules`` drew random numbers last time; ``None``: not known."""
    if not modules:
        return None
    seen = [_DRAWS.get(m) for m in modules]
    return True if True in seen else (None if None in seen else False)


def _lock_for(what: str, *, drawing: bool) -> bool:
    """Take the RNG lock (see above); returns whether it is held."""
    if _RNG_LOCK.acquire(timeout=_WAIT_DRAWING_S if drawing else _WAIT_UNKNOWN_S):
        return True
    if not drawing:
        return False  # replay's end-of-draws check catches a race, if one happens
    raise ReplayError(
        f"{what} draws random numbers and waited {_WAIT_DRAWING_S:g} s for another thread's "
        "recomputed block to finish drawing. If this thread was started inside that block's "
        "forward (sub-blocks run in a thread pool), their draws from the shared generator "
        "cannot be replayed: draw them in the outer thread, or keep the sub-blocks or the "
        "outer block stored"
    )


def _digest(state: torch.Tensor) -> int:
    return hash(state.cpu().numpy().tobytes())


class ForwardState:
    """RNG, autocast and module state of one forward pass, for replay during its recompute.

    Use::

        state = ForwardState.capture(inputs, module, modules=(module,))  # before the forward
        try:
            out = module(*inputs)
        finally:
            state.forward_finished()        # drops RNG state the forward did not use
        ...
        with state.replay(label="block 3"):  # during backward
            out_again = module(*inputs)      # same masks, autocast, modes; stats frozen

    ``forward_finished`` must run however the forward ends (it releases the RNG lock).
    ``preserve_rng_state=False`` skips RNG capture entirely (then a recompute with dropout draws
    new masks, as with ``torch.utils.checkpoint(preserve_rng_state=False)``).
    """

    __slots__ = ("_end", "_locked", "_owners", "_rng", "autocast", "devices", "modules", "norms")

    def __init__(
        self,
        devices: list[torch.device],
        rng: dict[torch.device, torch.Tensor],
        autocast: tuple[AutocastState, ...],
    ) -> None:
        self.devices = devices
        self._rng = rng
        self._end: dict[torch.device, int] = {}
        self._locked = False
        self._owners: tuple[nn.Module, ...] = ()
        self.autocast = autocast
        self.norms: tuple[nn.Module, ...] | None = None
        self.modules: ModuleState | None = None

    @classmethod
    def capture(
        cls,
        *owners: Any,
        preserve_rng_state: bool = True,
        norms: tuple[nn.Module, ...] | None = None,
        devices: list[torch.device] | None = None,
        modules: tuple[nn.Module, ...] = (),
    ) -> ForwardState:
        """Capture the state for a forward whose tensors and modules are ``owners``.

        The CPU generator is always captured (CPU code may draw random numbers whatever the
        device of the data); accelerator generators for every device found in ``owners``.
        ``norms``: when the caller knows every normalisation module the forward can call (its
        branches are modules with registered submodules), replay freezes exactly those and
        skips the global module hooks; ``None`` freezes whatever normalisation module runs.
        ``devices``: the result of :func:`devices_of` for the owners, when the caller already
        has it (a stack capturing many forwards over the same tensors scans them once).
        ``modules``: the modules the forward calls, whose parameters, buffers and attributes
        replay checks and re-establishes (see :mod:`revckpt._module_state`).
        """
        if devices is None:
            devices = devices_of(*owners)
        locked = False
        if preserve_rng_state and not torch.compiler.is_compiling():
            draws = _known_draws(modules)
            if draws is not False:
                locked = _lock_for("a checkpointed forward", drawing=bool(draws))
        try:
            rng: dict[torch.device, torch.Tensor] = {}
            if preserve_rng_state:
                for device in [torch.device("cpu"), *devices]:
                    if device not in rng:
                        rng[device] = _get_rng(device)
            autocast = tuple(AutocastState.capture(t) for t in _autocast_device_types(devices))
            state = cls(devices, rng, autocast)
            state.norms = norms
            state._owners = modules
            if modules and not torch.compiler.is_compiling():
                state.modules = ModuleState(modules)
        except BaseException:
            if locked:
                _RNG_LOCK.release()
            raise
        state._locked = locked
        return state

    def forward_finished(self) -> None:
        """Forget generator states that the forward did not advance (replay needs none of
        them), record the module state the forward left, and release the RNG lock."""
        try:
            for device in list(self._rng):
                before, now = self._rng[device], _get_rng(device)
                if torch.equal(before, now):
                    del self._rng[device]
                else:
                    # The getters allocate outside the dispatcher; a clone makes the state kept
                    # for replay an ordinary tensor that memory meters see.
                    self._rng[device] = before.clone()
                    self._end[device] = _digest(now)
            if self.modules is not None:
                self.modules.forward_finished()
            for m in self._owners:
                _DRAWS[m] = bool(self._end)
        finally:
            if self._locked:
                self._locked = False
                _RNG_LOCK.release()

    @property
    def rng_devices(self) -> tuple[torch.device, ...]:
        """The devices whose generator state is kept for replay."""
        return tuple(self._rng)

    @property
    def retained_bytes(self) -> int:
        """Bytes this state keeps alive (the RNG states; autocast state is a few flags)."""
        return sum(s.numel() * s.element_size() for s in self._rng.values())

    def replay(
        self, *, label: str = "the recompute", exact_draws: bool = False
    ) -> contextlib.AbstractContextManager[None]:
        """Run the body as the captured forward ran: same RNG streams, same autocast, module
        attributes as the forward found them, with running statistics frozen. The caller's RNG
        state and module state are restored afterwards.

        Raises :class:`~revckpt.ModifiedParameterError` first if a parameter or buffer changed
        since the forward. ``exact_draws``: the body re-runs the whole forward, so it must end
        at the generator state the forward ended at; if not (another thread drew random numbers
        from the global generator while the forward ran), raise :class:`~revckpt.ReplayError`.

        Only what differs is touched: no generator is set when the forward drew no random
        numbers, no autocast context is entered when the current settings already match, and
        no statistics are frozen when ``norms`` is an empty tuple (a recompute runs per block
        of a deep stack, so the common case costs a few attribute reads).
        """
        return _Replay(self, label, exact_draws)


class _Replay:
    """The context of :meth:`ForwardState.replay` (a class: cheaper than a generator and an
    ``ExitStack`` on a path that runs once per block and step)."""

    __slots__ = ("_contexts", "_exact", "_label", "_locked", "_outer", "_state", "_undo")

    def __init__(self, state: ForwardState, label: str, exact_draws: bool) -> None:
        self._state = state
        self._label = label
        self._exact = exact_draws
        self._locked = False
        self._outer: dict[torch.device, torch.Tensor] = {}
        self._undo: list[tuple[Any, ...]] = []
        self._contexts: list[contextlib.AbstractContextManager[Any]] = []

    def __enter__(self) -> None:
        state = self._state
        if state.modules is not None:
            state.modules.check(self._label)
        if state._rng:
            self._locked = _lock_for(f"the recompute of {self._label}", drawing=True)
        self._contexts = []
        try:
            self._outer = {device: _get_rng(device) for device in state._rng}
            for device, rng in state._rng.items():
                _set_rng(device, rng)
            if state.modules is not None:
                self._undo = state.modules.enter()
            pending: list[contextlib.AbstractContextManager[Any]] = [
                ac.context() for ac in state.autocast if not ac.matches_current()
            ]
            norms = state.norms
            if norms is None and state.modules is not None:
                norms = state.modules.norms()
            if norms is None:
                pending.append(_LearnNorms(state.modules))
            elif norms:
                pending.append(_swapped_statistics(norms))
            for context in pending:
                context.__enter__()
                self._contexts.append(context)
        except BaseException:
            self._unwind(None, None, None)
            raise
        _replaying.depth += 1

    def __exit__(self, *exc: Any) -> None:
        _replaying.depth -= 1
        self._unwind(*exc)

    def _unwind(self, *exc: Any) -> None:
        try:
            try:
                while self._contexts:
                    self._contexts.pop().__exit__(*exc)
            finally:
                ModuleState.exit(self._undo)
                self._undo = []
            if self._exact and exc[0] is None:
                self._check_draws()
        finally:
            for device, rng in self._outer.items():
                _set_rng(device, rng)
            self._outer = {}
            if self._locked:
                self._locked = False
                _RNG_LOCK.release()

    def _check_draws(self) -> None:
        for device, end in self._state._end.items():
            if _digest(_get_rng(device)) != end:
                raise ReplayError(
                    f"the recompute of {self._label} drew other random numbers than its forward "
                    f"on {device} (the generator ended elsewhere), so its dropout masks would "
                    "differ. Either the block's random draws depend on state that changed since "
                    "the forward and that replay cannot see (a module switched to eval(), or a "
                    "dropout rate changed, in a module reached through a global rather than "
                    "passed as the block or in its closure: checkpoint the module itself), or "
                    "another thread drew from the global generator while the forward ran "
                    "(train such models in separate processes, or run the other thread's model "
                    "through revckpt too: their forwards then take turns)"
                )


# The exception torch's checkpoint stops a recompute with once every tensor it needs is back.
_STOPPED: tuple[type[BaseException], ...] = (
    (torch.utils.checkpoint._StopRecomputationError,)
    if hasattr(torch.utils.checkpoint, "_StopRecomputationError")
    else ()
)


class _LearnNorms:
    """Freeze whatever normalisation layer the recompute calls (global module hooks), and tell
    ``modules`` which ones ran (so that their next recomputes freeze exactly those, without
    hooks: :meth:`ModuleState.norms`)."""

    __slots__ = ("_context", "_installed", "_modules", "_ran")

    def __init__(self, modules: ModuleState | None) -> None:
        self._modules = modules
        self._ran: list[nn.Module] = []
        self._installed = False
        self._context = _freeze_called(self._ran if modules is not None else None)

    def __enter__(self) -> None:
        self._installed = self._context.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self._context.__exit__(*exc)
        finished = exc[0] is None or issubclass(exc[0], _STOPPED)
        if finished and self._installed and self._modules is not None:
            self._modules.learn_norms(self._ran)


class _ReplayDepth(threading.local):
    depth: int = 0


_replaying = _ReplayDepth()


def is_replaying() -> bool:
    """Whether the current thread is inside :meth:`ForwardState.replay`, i.e. recomputing.

    Custom modules that update their own state in forward (an EMA, a counter) can check this to
    update once per step, as :func:`freeze_running_stats` does for normalisation layers.
    """
    return _replaying.depth > 0


def _swap_in_copies(module: nn.Module) -> dict[str, torch.Tensor | None]:
    originals = {n: module._buffers[n] for n in _RUNNING_STAT_BUFFERS if n in module._buffers}
    # The copies are bookkeeping, not part of the block: hide them from dispatch modes
    # (selective-checkpoint caches, value checks, memory meters) and from autograd.
    with _disable_current_modes(), torch.no_grad():
        for name, buf in originals.items():
            if buf is not None:
                module._buffers[name] = buf.clone()
    return originals


@contextlib.contextmanager
def _swapped_statistics(modules: Iterable[nn.Module]) -> Iterator[None]:
    swapped = {}
    try:
        for m in modules:
            if (
                isinstance(m, _NormBase)
                and m.training
                and m.track_running_stats
                and m not in swapped
            ):
                swapped[m] = _swap_in_copies(m)
        yield
    finally:
        for m, originals in swapped.items():
            m._buffers.update(originals)


class _Frozen(threading.local):
    depth: int = 0


_frozen = _Frozen()


@contextlib.contextmanager
def freeze_running_stats(modules: Iterable[nn.Module] | None = None) -> Iterator[None]:
    """Within this context, normalisation modules in training mode do not change their statistics.

    Every ``torch.nn`` BatchNorm / SyncBatchNorm / InstanceNorm module with
    ``track_running_stats=True`` that is called in training mode on this thread gets throwaway
    copies of ``running_mean``, ``running_var`` and ``num_batches_tracked`` for the duration of its
    call; its output (which uses batch statistics in training mode) and the tensors it saves for
    backward are unchanged. The real buffers are restored when the call returns or raises.
    Nested uses share one table per thread (the hooks are installed by the outermost only), so a
    recompute inside a recompute restores the real buffers too.

    ``modules``: when given, exactly these modules are frozen for the whole context (their
    buffers swapped on entry, restored on exit) and no global hook is installed, which keeps
    module calls on PyTorch's fast path; pass every normalisation module the code can call.

    .. note:: Normalisation layers written from scratch (buffers updated by hand with
       ``F.batch_norm``) are not recognised; derive them from
       ``torch.nn.modules.batchnorm._NormBase``, check :func:`is_replaying` in their forward,
       or keep such blocks out of recompute.
    """
    if modules is not None:
        with _swapped_statistics(modules):
            yield
        return
    with _freeze_called(None):
        yield


@contextlib.contextmanager
def _freeze_called(ran: list[nn.Module] | None) -> Iterator[bool]:
    """:func:`freeze_running_stats` for whatever normalisation module runs (global module
    hooks). ``ran``: gets every normalisation module called on this thread meanwhile (in any
    mode). Yields whether this context installed the hooks (``False`` inside another one,
    whose hooks do the work: then ``ran`` stays empty)."""
    state = _frozen
    if state.depth > 0:
        state.depth += 1
        try:
            yield False
        finally:
            state.depth -= 1
        return
    owner = threading.get_ident()
    swapped: dict[nn.Module, dict[str, torch.Tensor | None]] = {}

    def before(module: nn.Module, args: Any) -> None:
        if threading.get_ident() != owner or not isinstance(module, _NormBase):
            return
        if ran is not None:
            ran.append(module)
        if module.training and module.track_running_stats and module not in swapped:
            swapped[module] = _swap_in_copies(module)

    def restore(module: nn.Module) -> None:
        originals = swapped.pop(module, None)
        if originals is not None:
            module._buffers.update(originals)

    def after(module: nn.Module, args: Any, output: Any) -> None:
        if threading.get_ident() == owner:
            restore(module)

    pre = nn.modules.module.register_module_forward_pre_hook(before)
    post = nn.modules.module.register_module_forward_hook(after, always_call=True)
    state.depth = 1
    try:
        yield True
    finally:
        state.depth = 0
        pre.remove()
        post.remove()
        for module in list(swapped):
            restore(module)
