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
  changed meanwhile are set back to the forward's values for the recompute (and one the
  forward itself created on a block's first call is absent in it again); buffers the forward
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
import threading
import weakref
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn

from ._autocast import AutocastState, autocast_device_types
from ._devices import devices_of, get_rng, set_rng
from ._module_state import ModuleState, layout_learnt
from ._running_stats import freeze_called, freeze_running_stats, swapped_statistics
from .errors import ReplayError

__all__ = [
    "AutocastState",
    "ForwardState",
    "devices_of",
    "freeze_running_stats",
    "is_replaying",
]


# The global CPU generator is shared by all threads. This lock is held from the capture of a
# forward that may draw random numbers until that forward ends, and during the replay of one
# that did, so that two threads' recomputed forwards draw in turn. It is never waited for
# without a bound (a block may run sub-blocks in threads of its own: they must not hang):
_WAIT_UNKNOWN_S = 1.0  # a block not seen yet: if the lock stays busy, run and check instead
_WAIT_DRAWING_S = 30.0  # a block known to draw: past this, refuse (ReplayError)
_RNG_LOCK = threading.RLock()
_CPU = torch.device("cpu")
# Whether each block's last forward drew random numbers (blocks that never do take no lock).
_DRAWS: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


def _known_draws(modules: tuple[nn.Module, ...]) -> bool | None:
    """Whether the forward of ``modules`` drew random numbers last time; ``None``: not known."""
    if not modules:
        return None
    seen = [_DRAWS.get(m) for m in modules]
    return True if True in seen else (None if None in seen else False)


def learnt(block: nn.Module) -> bool:
    """Whether revckpt knows what it learns about ``block`` on its first captured forward and
    first recompute (as the single root of a capture: its modules' layout, whether its forward
    draws random numbers, which buffers it writes, which normalisation layers its recompute
    calls). Until then a recomputed call of the block also does the learning, and costs more
    than its later calls (:class:`revckpt.engine.rehearsal.Rehearsal`)."""
    return _DRAWS.get(block) is not None and layout_learnt(block)


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


def _same_state(before: torch.Tensor, now: torch.Tensor) -> bool:
    """Whether two generator states are equal, read eight bytes at a time where their layout
    allows (a CPU state is 5,056 bytes; compared byte by byte, it was most of a checkpoint
    call's own work on small blocks); else byte by byte."""
    try:
        return torch.equal(before.view(torch.int64), now.view(torch.int64))
    except RuntimeError:  # a size, offset or stride that an int64 view cannot take
        return torch.equal(before, now)


def _digest(state: torch.Tensor) -> int:
    return hash(state.cpu().numpy().tobytes())


class ForwardState:
    """RNG, autocast and module state of one forward pass, for replay during its recompute.

    Use::

        state = ForwardState.capture(inputs, module, modules=(module,))  # before the forward
        try:
            out = module(*inputs)
        except BaseException:
            state.forward_finished(completed=False)  # releases the lock, records nothing
            raise
        state.forward_finished()        # drops RNG state the forward did not use
        ...
        with state.replay(label="block 3"):  # during backward
            out_again = module(*inputs)      # same masks, autocast, modes; stats frozen

    ``forward_finished`` must run however the forward ends: it releases the RNG lock.
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
        compiling = torch.compiler.is_compiling()
        if preserve_rng_state and not compiling:
            draws = _known_draws(modules)
            if draws is not False:
                locked = _lock_for("a checkpointed forward", drawing=bool(draws))
        try:
            rng: dict[torch.device, torch.Tensor] = {}
            if preserve_rng_state:
                rng[_CPU] = get_rng(_CPU)
                for device in devices:
                    if device not in rng:
                        rng[device] = get_rng(device)
            autocast = tuple([AutocastState.capture(t) for t in autocast_device_types(devices)])
            state = cls(devices, rng, autocast)
            state.norms = norms
            state._owners = modules
            if modules and not compiling:
                state.modules = ModuleState(modules)
        except BaseException:
            if locked:
                _RNG_LOCK.release()
            raise
        state._locked = locked
        return state

    def forward_finished(self, *, completed: bool = True) -> None:
        """Forget generator states that the forward did not advance (replay needs none of
        them), record the module state the forward left, and release the RNG lock.
        ``completed=False`` (the forward raised): release the lock and record nothing, so that
        what a partial forward did (the buffers it wrote so far, whether it drew random
        numbers, the attributes it made) is not taken for what the block's forward does."""
        try:
            if not completed:
                self._rng.clear()
                if self.modules is not None:
                    self.modules.forward_failed()
                return
            for device in list(self._rng):
                before, now = self._rng[device], get_rng(device)
                if _same_state(before, now):
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
            self._outer = {device: get_rng(device) for device in state._rng}
            for device, rng in state._rng.items():
                set_rng(device, rng)
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
                pending.append(swapped_statistics(norms))
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
                set_rng(device, rng)
            self._outer = {}
            if self._locked:
                self._locked = False
                _RNG_LOCK.release()

    def _check_draws(self) -> None:
        for device, end in self._state._end.items():
            if _digest(get_rng(device)) != end:
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
        self._context = freeze_called(self._ran if modules is not None else None)

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
