"""The checkpoint engine: torch's non-reentrant checkpoint frame driven with revckpt's replay.

An exact checkpoint keeps the block's inputs and rebuilds every tensor autograd saved inside it
by re-running the block when backward first unpacks one (selective policies keep some of them:
torch's selective-checkpoint contexts). torch's frame does that bookkeeping (its saved-tensor
hooks, the recompute on first unpack per graph task, early stop, the metadata check);
:class:`FrameCall` is what revckpt adds around it: the forward state captured by
:mod:`revckpt.replay` and replayed by each recompute, the value check of
``determinism_check="values"`` and the forward's device context. :func:`run_checkpoint` runs a
call through the frame (:func:`run_frame`) or, where the frame cannot run (its debug mode,
export's non-strict tracing, proxy tracing, torch versions without it), through torch's entry
with the same contexts.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint as _tcp
from torch import nn
from torch.utils.checkpoint import checkpoint as _torch_checkpoint
from torch.utils.checkpoint import set_checkpoint_early_stop

from .._determinism import ValueLog
from ..errors import DoubleBackwardError, ModifiedInputError
from ..replay import ForwardState
from .kept import Watched, bump_if_changed, guard, watch
from .rerun import any_changed, check_versions, input_versions

__all__ = ["FRAME", "Entered", "FrameCall", "device_context", "frame_usable", "run_checkpoint"]


# what torch's selective checkpoint raises when its recompute reads a kept output the forward
# changed in place afterwards
_KEPT_CHANGED = "Tensor cached during selective activation checkpoint has been mutated"


class FrameCall:
    """One checkpoint call: the block, its state captured with the forward, and the contexts of
    the forward and of each recompute (a second backward with ``retain_graph=True`` recomputes
    again, except with a selective policy, whose torch cache serves one backward)."""

    __slots__ = (
        "device_context",
        "fn",
        "given",
        "kept",
        "kwargs",
        "label",
        "modules",
        "owners",
        "preserve_rng_state",
        "recomputed",
        "sac",
        "state",
        "values",
        "watched",
    )

    def __init__(
        self,
        fn: Callable[..., Any],
        kwargs: dict[str, Any],
        owners: tuple[Any, ...],
        *,
        modules: tuple[nn.Module, ...],
        preserve_rng_state: bool,
        check_values: bool,
        context_fn: Callable[[], tuple[Any, Any]] | None,
        label: str,
    ) -> None:
        self.fn = fn
        self.kwargs = kwargs
        self.owners = owners
        self.modules = modules
        self.label = label
        self.preserve_rng_state = preserve_rng_state
        self.values = ValueLog(label) if check_values else None
        self.sac = context_fn() if context_fn is not None else None
        # writes through aliases torch's version check misses (engine.kept)
        self.kept = guard(self.sac[0]) if self.sac is not None else None
        self.state: ForwardState | None = None
        self.device_context: Any = None
        self.recomputed = False
        self.watched: Watched = []  # outputs that alias kept ones (selective): engine.kept
        # the tensors given (and those in lists, tuples and dicts of them) as the forward
        # left them, which the recompute reads: torch checks only those it saves
        self.given: list[tuple[torch.Tensor, int]] = []

    def forward_contexts(self) -> list[contextlib.AbstractContextManager[Any]]:
        """Capture the forward's state; the contexts the forward runs in (the first one
        records, on exit, what the forward left)."""
        self.state = ForwardState.capture(
            *self.owners, preserve_rng_state=self.preserve_rng_state, modules=self.modules
        )
        contexts: list[contextlib.AbstractContextManager[Any]] = [_Finished(self.state)]
        if self.sac is not None:
            contexts.append(self.sac[0])
        if self.values is not None:
            contexts.append(self.values.recording())
        return contexts

    def check_given(self) -> None:
        """Raise :class:`~revckpt.ModifiedInputError` if a tensor the block was given changed
        in place since its forward (its recompute would read the changed value)."""
        if any_changed(self.given):
            raise ModifiedInputError(
                f"{self.label}: a tensor it was given (an argument, a keyword, or in a list, "
                "tuple or dict of them) was changed in place after its forward, before its "
                "backward: its recompute and backward "
                "would read the changed value (plain autograd raises for a tensor it saved that "
                "was changed so; a keyword the block never reads, such as position_ids beside "
                "rotary tables, is refused too, as revckpt cannot tell). Change it out of "
                "place, or pass a copy (t.clone())"
            )

    def recompute_contexts(self) -> list[contextlib.AbstractContextManager[Any]]:
        """The contexts a recompute runs in: the forward's state replayed, the policy's cache
        and the value check."""
        assert self.state is not None, "recompute before the checkpointed forward ran"
        if self.sac is not None and self.recomputed:
            raise DoubleBackwardError(
                f"{self.label} ran with a selective-recompute policy, whose cache of kept "
                "outputs serves one backward; a second backward through it (after a first with "
                "retain_graph=True; without it, plain autograd raises here too), or a "
                "create_graph=True double backward, cannot recompute it again. Use plain "
                "checkpointing, which supports both: strategy='checkpoint' (policy=None for "
                "revckpt.checkpoint; convert(model, 'checkpoint'); fit(..., "
                "strategies=['store', 'checkpoint'])), or keep the block stored"
            )
        self.check_given()
        self.recomputed = True
        bump_if_changed(self.kept, self.watched)  # an output aliasing a kept one, changed
        self.watched = []
        exact_draws = self.sac is None  # a policy may keep a random op's output
        contexts = [self.state.replay(label=self.label, exact_draws=exact_draws)]
        if self.sac is not None:
            contexts.append(self.sac[1])
        if self.values is not None:
            contexts.append(self.values.checking())
        if self.device_context is not None:
            contexts.append(self.device_context)
        return contexts

    def recompute(self, *args: Any) -> None:
        """The recompute of the frame engine (:func:`run_frame`): the block re-run in the
        recompute contexts (torch's frame collects what it saves)."""
        with Entered(self.recompute_contexts):
            try:
                self.fn(*args, **self.kwargs)
            except RuntimeError as e:
                if _KEPT_CHANGED not in str(e):
                    raise
                op = _reading(e) or "an operation"
                raise ModifiedInputError(
                    f"{self.label}: its selective policy keeps the output of {op}, which was "
                    "then changed in place, directly or through a reshape of it (by the block, "
                    "e.g. nn.ReLU(inplace=True) after a Linear, or through the block's output "
                    "after it returned), so its backward would use the changed value. Make "
                    f"that change out of place (inplace=False), use a policy that does not keep "
                    f"{op}, or checkpoint the block"
                ) from e


def _reading(error: BaseException) -> str | None:
    """The operation torch's selective cache was handing back when it raised ``error``: the
    ``func`` of its dispatch frame (nothing is looked at before such an error)."""
    tb, op = error.__traceback__, None
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_name == "__torch_dispatch__" and "func" in frame.f_locals:
            op = frame.f_locals["func"]
        tb = tb.tb_next
    return None if op is None else str(op)


class _Finished:
    """Exits by recording what the forward left (:meth:`ForwardState.forward_finished`;
    nothing when it raised)."""

    __slots__ = ("state",)

    def __init__(self, state: ForwardState) -> None:
        self.state = state

    def __enter__(self) -> None:
        pass

    def __exit__(self, *exc: Any) -> None:
        self.state.forward_finished(completed=exc[0] is None)


class Entered:
    """Enters the contexts ``make()`` returns, in order, and exits them in reverse (an
    ``ExitStack`` without its cost, on a path that runs per block and step). Reusable: torch
    enters the recompute context again for every backward. None of the contexts suppresses an
    exception."""

    __slots__ = ("make", "open")

    def __init__(self, make: Callable[[], list[contextlib.AbstractContextManager[Any]]]) -> None:
        self.make = make
        self.open: list[list[contextlib.AbstractContextManager[Any]]] = []

    def __enter__(self) -> None:
        entered: list[contextlib.AbstractContextManager[Any]] = []
        self.open.append(entered)
        try:
            for context in self.make():
                context.__enter__()
                entered.append(context)
        except BaseException as error:
            self.open.pop()
            _exit_all(entered, (type(error), error, error.__traceback__))
            raise

    def __exit__(self, *exc: Any) -> None:
        _exit_all(self.open.pop(), exc)


def _exit_all(entered: list[Any], exc: tuple[Any, ...]) -> None:
    error: BaseException | None = None
    while entered:
        try:
            entered.pop().__exit__(*exc)
        except BaseException as raised:
            error = raised
            exc = (type(raised), raised, raised.__traceback__)
    if error is not None:
        raise error


def _frame_parts() -> bool:
    """Whether the installed torch has the non-reentrant checkpoint frame :func:`run_frame`
    drives (torch 2.6 on; older versions run through ``torch.utils.checkpoint.checkpoint``)."""
    frame = getattr(_tcp, "_CheckpointFrame", None)
    if frame is None or not hasattr(frame, "save_inputs"):
        return False
    parts = ("_checkpoint_hook", "_Holder", "_default_meta_extractor")
    if not all(hasattr(_tcp, name) for name in parts):
        return False
    names = list(inspect.signature(frame.__init__).parameters)
    return names == ["self", "recompute_fn", "early_stop", "unpack_error_cb", "metadata_fn"]


FRAME = _frame_parts()
_non_strict_tracing = getattr(torch.compiler, "_is_non_strict_tracing", lambda: False)


def frame_usable() -> bool:
    """The frame engine runs eager code; torch's own entry handles its debug mode, export's
    non-strict tracing and proxy tracing (``make_fx``)."""
    return (
        FRAME
        and not _tcp._checkpoint_debug_enabled
        and not _non_strict_tracing()
        and torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.PROXY) is None
    )


def run_frame(call: FrameCall, args: tuple[Any, ...], early_stop: bool, *, metadata: bool) -> Any:
    """``torch.utils.checkpoint.checkpoint(use_reentrant=False)``'s engine (its frame, saved
    tensor hooks and recompute on unpack), driven directly.

    torch's entry around the frame does what :mod:`revckpt.replay` does again (RNG stash and
    fork, the autocast state of two device types re-entered, the device type of the inputs
    inferred), in a generator and nested context managers; its pack hook records the metadata
    of each saved tensor under ``no_grad``. Here the frame's recompute is
    :meth:`FrameCall.recompute` and the pack hook records the same metadata directly, so a
    checkpointed block costs less Python time per call than torch's checkpoint does. The
    frame's unpack hook (the recompute on first unpack, per graph task; early stop; the
    metadata check) is torch's own. A forward that drew no random numbers is recomputed up to
    its last saved tensor only (early stop), as by torch, unless values are checked.
    """
    frame = _tcp._CheckpointFrame(
        call.recompute,
        early_stop,
        None,
        _tcp._default_meta_extractor if metadata else _no_metadata,
    )
    frame.save_inputs(*args)
    if hasattr(frame, "get_inputs"):  # torch >= 2.8: the inputs are unpacked before recompute
        # before torch's own check of a positional input's version (raw); the frame held
        # weakly: a cycle through it would keep what it recomputed alive until a collection
        frame.get_inputs = functools.partial(_checked_inputs, call, weakref.ref(frame))
    hook = _tcp._checkpoint_hook(frame)
    hook.pack_hook = _pack_hook(frame, metadata)
    call.device_context = device_context()
    with hook, Entered(call.forward_contexts):
        out = call.fn(*args, **call.kwargs)
    frame.forward_completed = True
    assert call.state is not None
    if not call.state.rng_devices and call.values is None:
        # The forward drew no random numbers, so replay has no draws to check at the end of
        # the recompute: it may stop after the last saved tensor, as torch's does.
        frame.early_stop = True
    return out


def _checked_inputs(call: FrameCall, frame: Any) -> list[Any]:
    call.check_given()
    return type(frame()).get_inputs(frame())


def _no_metadata(x: torch.Tensor) -> None:
    return None


def _pack_hook(frame: Any, metadata: bool) -> Callable[[torch.Tensor], Any]:
    """torch's checkpoint pack hook (a weakly held holder per saved tensor, its metadata for
    the determinism check), with the metadata taken without a ``no_grad`` context (reading
    ``shape``, ``dtype`` and ``device`` records nothing)."""
    holders = frame.weak_holders.append
    metas = frame.x_metadatas.append
    holder_type = _tcp._Holder
    ref = weakref.ref

    def pack(x: torch.Tensor) -> Any:
        holder = holder_type()
        holders(ref(holder))
        metas({"shape": x.shape, "dtype": x.dtype, "device": x.device} if metadata else None)
        return holder

    return pack


def device_context() -> Any:
    """The innermost ``with torch.device(...)`` context of the forward, which its recompute
    re-enters (as torch's checkpoint does); ``None`` when there is none."""
    if not torch._C._len_torch_function_stack():
        return None
    from torch.overrides import _get_current_function_mode_stack
    from torch.utils._device import DeviceContext

    for mode in reversed(_get_current_function_mode_stack()):
        if isinstance(mode, DeviceContext):
            return mode
    return None


def run_checkpoint(call: FrameCall, args: tuple[Any, ...], determinism_check: str) -> Any:
    """``call``'s block checkpointed (eager, grad mode on) on ``args``: its inputs kept, the rest
    recomputed on the first unpack in backward (with a policy, but what it keeps). A block that
    changes a tensor it was given in place raises :class:`~revckpt.ModifiedInputError` after its
    forward (its recompute would start from the changed value); one that changes an output its
    policy keeps, when its recompute reads that output (:meth:`FrameCall.recompute`: torch's
    cache raises then)."""
    versions = input_versions(args, call.kwargs)
    out = _run_checkpoint(call, args, determinism_check)
    check_versions(versions, call.label)
    call.given = versions  # unchanged by the forward (checked): what the recompute reads
    call.watched = watch(call.kept, out)
    return out


def _run_checkpoint(call: FrameCall, args: tuple[Any, ...], determinism_check: str) -> Any:
    fn = call.fn
    # Without a policy the recompute of a block that drew random numbers runs to its end (torch
    # stops it after the last saved tensor), so replay can check it drew exactly the forward's.
    early_stop = call.sac is not None or not call.preserve_rng_state
    if frame_usable():
        return run_frame(call, args, early_stop, metadata=determinism_check != "none")
    call.device_context = None  # torch's own checkpoint re-enters the device context

    def contexts() -> tuple[Entered, Entered]:
        return Entered(call.forward_contexts), Entered(call.recompute_contexts)

    with set_checkpoint_early_stop(early_stop):
        return _torch_checkpoint(
            fn,
            *args,
            use_reentrant=False,
            context_fn=contexts,
            determinism_check="none" if determinism_check == "none" else "default",
            preserve_rng_state=False,
            **call.kwargs,
        )
