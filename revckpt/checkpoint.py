"""Classic checkpoint segments, done right.

A checkpointed block keeps only its inputs during forward and re-runs its forward during
backward to get back the tensors autograd needs: activation memory of a block falls from
``saved(block)`` to ``bytes(input)``, for one extra forward per block.

Compared with ``torch.utils.checkpoint`` (whose non-reentrant engine does the bookkeeping):

* state replay goes through :mod:`revckpt.replay`: the same dropout masks, the forward's autocast
  state, and BatchNorm running statistics updated **once** per step (torch updates them on the
  recompute again); RNG state is kept only if the block drew random numbers;
* the non-reentrant engine is always used; no warning, no reentrant pitfalls;
* :func:`checkpoint_sequential` checkpoints **every** segment (torch stores the last one), accepts
  ``"sqrt"`` or explicit boundaries, passes keyword tensors (masks) to every block, and rejects
  segment counts that do not fit the chain instead of crashing;
* ``determinism_check="values"`` compares the recomputed values of every operation with the first
  forward (torch compares only shapes, dtypes and devices) and names the first operation that
  differs;
* ``policy=`` selects op-level selective recompute (keep matrix-multiply / attention outputs,
  recompute the cheap pointwise and normalisation work), built on torch's selective-checkpoint
  contexts; a policy spec names any keep-set of aten operations (``"matmul+gelu"``,
  :func:`parse_policy`) and has one canonical text (:func:`canonical_policy`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import math
import operator
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

import torch
import torch.utils.checkpoint as _tcp
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    create_selective_checkpoint_contexts,
    set_checkpoint_early_stop,
)
from torch.utils.checkpoint import checkpoint as _torch_checkpoint

from ._autograd import modules_of
from ._determinism import ValueLog
from .approx.recompute import Approx, run_approx
from .errors import DoubleBackwardError, InvalidArgumentError, InvalidInputTypeError
from .replay import ForwardState

__all__ = [
    "POLICY_PRESETS",
    "DeterminismCheck",
    "Policy",
    "canonical_policy",
    "checkpoint",
    "checkpoint_sequential",
    "parse_policy",
    "policy_text",
    "segment_bounds",
]

DeterminismCheck = Literal["metadata", "values", "none"]
_DETERMINISM_CHECKS = ("metadata", "values", "none")

Policy = str | Callable[[torch._ops.OpOverload], "bool | CheckpointPolicy"]


def _aten_packets(*names: str) -> frozenset[Any]:
    return frozenset(getattr(torch.ops.aten, n) for n in names if hasattr(torch.ops.aten, n))


_MATMUL = _aten_packets(
    "mm", "addmm", "bmm", "baddbmm", "addbmm", "convolution", "_int_mm", "_scaled_mm"
)
_ATTENTION = _aten_packets(
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable",
    "_flash_attention_forward",
    "_efficient_attention_forward",
)

#: Named selective-recompute policies: the aten operations whose outputs are kept; every other
#: operation of the block (norms, activations, dropout, reshapes, softmax) is recomputed.
POLICY_PRESETS: dict[str, frozenset[Any]] = {
    "matmul": _MATMUL,
    "attention": _ATTENTION,
    "matmul+attention": _MATMUL | _ATTENTION,
}

# The groups a policy spec may name (disjoint), in the order its canonical text writes them.
_GROUPS: dict[str, frozenset[Any]] = {k: v for k, v in POLICY_PRESETS.items() if "+" not in k}
# Words that read as something a spec cannot mean (aten.all is a boolean reduction).
_RESERVED = {
    "all": "keeping everything autograd saves is Strategy('store')",
    "none": "keeping nothing is plain checkpoint (policy=None, Strategy('checkpoint'))",
}


def _spec_form() -> str:
    groups = ", ".join(repr(g) for g in _GROUPS)
    return (
        f"a policy spec is '+'-joined tokens, each a group ({groups}) or an aten operation "
        "named by its overload packet, as in torch.ops.aten.<name> ('addmm', "
        "'native_layer_norm', 'gelu', '_softmax'), e.g. 'matmul+gelu'"
    )


def _is_random(packet: Any) -> bool:
    return any(
        torch.Tag.nondeterministic_seeded in getattr(packet, name).tags
        for name in packet.overloads()
    )


def _aten_packet(token: str, spec: str) -> Any:
    what = repr(token) if token == spec else f"{token!r} in {spec!r}"
    if not token:
        raise InvalidArgumentError(f"policy {spec!r} has an empty token; {_spec_form()}")
    if token in _RESERVED:
        raise InvalidArgumentError(
            f"{what} is not a policy token: {_RESERVED[token]}; {_spec_form()}"
        )
    if "." in token or ":" in token:
        raise InvalidArgumentError(
            f"{what}: name an aten operation by its packet alone ('addmm' for "
            f"torch.ops.aten.addmm.default); {_spec_form()}"
        )
    try:
        packet = getattr(torch.ops.aten, token)
    except (AttributeError, RuntimeError):
        packet = None
    if not isinstance(packet, torch._ops.OpOverloadPacket):
        raise InvalidArgumentError(f"unknown checkpoint policy {what}; {_spec_form()}")
    if _is_random(packet) and not any(packet in g for g in _GROUPS.values()):
        raise InvalidArgumentError(
            f"{what} is a random operation: a policy keeping its output would skip its draws "
            "in the recompute, so the random operations after it would draw other numbers "
            "(other dropout masks); leave it out (recomputed, it replays the forward's draws)"
        )
    return packet


def parse_policy(spec: str) -> frozenset[Any]:
    """The aten operation packets a selective-recompute policy spec keeps the outputs of.

    A spec is ``"+"``-joined tokens; each is a group (``"matmul"``: matrix multiplies and
    convolutions; ``"attention"``: fused attention kernels) or an aten operation named by its
    overload packet (``"addmm"``, ``"native_layer_norm"``, ``"gelu"``, ``"_softmax"``,
    ``"mul"``): every call of that operation, all overloads, keeps its outputs. The presets of
    :data:`POLICY_PRESETS` are specs (``"matmul+attention"``); ``"matmul+gelu"`` keeps every
    matrix multiply and every GELU output. Group names take precedence over aten names (aten's
    ``matmul`` is composite and never reaches a policy). Random operations (dropout's
    ``native_dropout``, ``bernoulli``) are refused: a kept one would not draw again during the
    recompute, shifting the numbers of every random operation after it.
    """
    if not isinstance(spec, str):
        raise InvalidInputTypeError(
            f"a policy spec is a string such as 'matmul+gelu', got {type(spec).__name__}"
        )
    keep: set[Any] = set()
    for raw in spec.split("+"):
        token = raw.strip()
        keep |= _GROUPS[token] if token in _GROUPS else {_aten_packet(token, spec)}
    return frozenset(keep)


def policy_text(ops: Iterable[Any]) -> str:
    """The canonical spec of a keep-set of aten operation packets (or overloads): the groups it
    contains whole, in the order of :data:`POLICY_PRESETS` (``"matmul"``, ``"attention"``),
    then the names of the other operations, sorted; joined by ``"+"``. Two specs of one
    keep-set have one canonical text (``"gelu+mm+matmul"`` and ``"matmul+gelu"``:
    ``"matmul+gelu"``); each preset is its own canonical text."""
    keep = frozenset(getattr(op, "overloadpacket", op) for op in ops)
    if not keep:
        raise InvalidArgumentError(
            "an empty keep-set is plain checkpoint, not a selective policy: use policy=None "
            "(Strategy('checkpoint'))"
        )
    bad = [op for op in keep if not isinstance(op, torch._ops.OpOverloadPacket)]
    if bad or any(not op._qualified_op_name.startswith("aten::") for op in keep):
        raise InvalidInputTypeError(
            "a keep-set holds aten operation packets (torch.ops.aten.<name>), got "
            f"{sorted(map(str, keep))}"
        )
    rest, parts = set(keep), []
    for name, group in _GROUPS.items():
        if group and group <= rest:
            parts.append(name)
            rest -= group
    text = "+".join([*parts, *sorted(op.__name__ for op in rest)])
    parse_policy(text)  # the operations' names are tokens a spec accepts
    return text


@functools.lru_cache(maxsize=1024)
def canonical_policy(spec: str) -> str:
    """The canonical text (:func:`policy_text`) of a policy spec, checked by
    :func:`parse_policy`: ``canonical_policy("attention+matmul") == "matmul+attention"``."""
    return policy_text(parse_policy(spec))


def _policy_context_fn(policy: Policy) -> Callable[[], tuple[Any, Any]]:
    if isinstance(policy, str):
        keep = parse_policy(policy)

        def decide(op: Any) -> bool | CheckpointPolicy:
            return op.overloadpacket in keep
    elif callable(policy):
        decide = policy
    else:
        raise InvalidInputTypeError(
            f"policy must be a spec (a preset name {sorted(POLICY_PRESETS)}, or groups and aten "
            f"operation names joined by '+') or a function op -> bool, got "
            f"{type(policy).__name__}"
        )

    def torch_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        verdict = decide(op)
        if isinstance(verdict, CheckpointPolicy):
            return verdict
        return CheckpointPolicy.MUST_SAVE if verdict else CheckpointPolicy.PREFER_RECOMPUTE

    return functools.partial(create_selective_checkpoint_contexts, torch_policy)


class _Call:
    """One checkpoint call: the block, its state captured with the forward, and the contexts of
    the forward and of each recompute (a second backward with ``retain_graph=True`` recomputes
    again, except with a selective policy, whose torch cache serves one backward)."""

    __slots__ = (
        "device_context",
        "fn",
        "kwargs",
        "label",
        "modules",
        "owners",
        "preserve_rng_state",
        "recomputed",
        "sac",
        "state",
        "values",
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
        policy: Policy | None,
        label: str,
    ) -> None:
        self.fn = fn
        self.kwargs = kwargs
        self.owners = owners
        self.modules = modules
        self.label = label
        self.preserve_rng_state = preserve_rng_state
        self.values = ValueLog(label) if check_values else None
        self.sac = _policy_context_fn(policy)() if policy is not None else None
        self.state: ForwardState | None = None
        self.device_context: Any = None
        self.recomputed = False

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

    def recompute_contexts(self) -> list[contextlib.AbstractContextManager[Any]]:
        """The contexts a recompute runs in: the forward's state replayed, the policy's cache
        and the value check."""
        assert self.state is not None, "recompute before the checkpointed forward ran"
        if self.sac is not None and self.recomputed:
            raise DoubleBackwardError(
                f"{self.label} ran with a selective-recompute policy, whose cache of kept "
                "outputs serves one backward; a second backward through it (retain_graph=True, "
                "or create_graph=True double backward) cannot recompute it again. Use "
                "policy=None (plain checkpoint: supports both), or keep the block stored"
            )
        self.recomputed = True
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
        """The recompute of the frame engine (:func:`_run_frame`): the block re-run in the
        recompute contexts (torch's frame collects what it saves)."""
        with _Entered(self.recompute_contexts):
            self.fn(*args, **self.kwargs)


class _Finished:
    """Exits by recording what the forward left (:meth:`ForwardState.forward_finished`)."""

    __slots__ = ("state",)

    def __init__(self, state: ForwardState) -> None:
        self.state = state

    def __enter__(self) -> None:
        pass

    def __exit__(self, *exc: Any) -> None:
        self.state.forward_finished()


class _Entered:
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


def _check_options(determinism_check: str, preserve_rng_state: bool) -> None:
    if determinism_check not in _DETERMINISM_CHECKS:
        raise InvalidArgumentError(
            f"determinism_check={determinism_check!r} is not an option; use 'metadata' (compare "
            "shapes and dtypes of recomputed tensors), 'values' (also compare their values) or "
            "'none'"
        )
    if determinism_check == "values" and not preserve_rng_state:
        raise InvalidArgumentError(
            "determinism_check='values' with preserve_rng_state=False flags every block that "
            "draws random numbers (its recompute draws new ones); keep preserve_rng_state=True "
            "or use determinism_check='metadata'"
        )


def _checkpoint(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    modules: tuple[nn.Module, ...],
    preserve_rng_state: bool,
    determinism_check: str,
    policy: Policy | None,
    label: str,
) -> Any:
    if torch.compiler.is_compiling():
        return _compiled_checkpoint(fn, args, kwargs, determinism_check, policy)
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)  # nothing will be differentiated: torch runs it plainly too
    call = _Call(
        fn,
        kwargs,
        (args, kwargs, *modules),
        modules=modules,
        preserve_rng_state=preserve_rng_state,
        check_values=determinism_check == "values",
        policy=policy,
        label=label,
    )
    # Without a policy the recompute of a block that drew random numbers runs to its end (torch
    # stops it after the last saved tensor), so replay can check it drew exactly the forward's.
    early_stop = call.sac is not None or not preserve_rng_state
    if _frame_usable():
        return _run_frame(call, args, early_stop, metadata=determinism_check != "none")
    call.device_context = None  # torch's own checkpoint re-enters the device context

    def context_fn() -> tuple[_Entered, _Entered]:
        return _Entered(call.forward_contexts), _Entered(call.recompute_contexts)

    with set_checkpoint_early_stop(early_stop):
        return _torch_checkpoint(
            fn,
            *args,
            use_reentrant=False,
            context_fn=context_fn,
            determinism_check="none" if determinism_check == "none" else "default",
            preserve_rng_state=False,
            **kwargs,
        )


def _frame_parts() -> bool:
    """Whether the installed torch has the non-reentrant checkpoint frame :func:`_run_frame`
    drives (torch 2.6 on; older versions run through ``torch.utils.checkpoint.checkpoint``)."""
    frame = getattr(_tcp, "_CheckpointFrame", None)
    if frame is None or not hasattr(frame, "save_inputs"):
        return False
    parts = ("_checkpoint_hook", "_Holder", "_default_meta_extractor")
    if not all(hasattr(_tcp, name) for name in parts):
        return False
    names = list(inspect.signature(frame.__init__).parameters)
    return names == ["self", "recompute_fn", "early_stop", "unpack_error_cb", "metadata_fn"]


_FRAME = _frame_parts()
_non_strict_tracing = getattr(torch.compiler, "_is_non_strict_tracing", lambda: False)


def _frame_usable() -> bool:
    """The frame engine runs eager code; torch's own entry handles its debug mode, export's
    non-strict tracing and proxy tracing (``make_fx``)."""
    return (
        _FRAME
        and not _tcp._checkpoint_debug_enabled
        and not _non_strict_tracing()
        and torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.PROXY) is None
    )


def _run_frame(call: _Call, args: tuple[Any, ...], early_stop: bool, *, metadata: bool) -> Any:
    """``torch.utils.checkpoint.checkpoint(use_reentrant=False)``'s engine (its frame, saved
    tensor hooks and recompute on unpack), driven directly.

    torch's entry around the frame does what :mod:`revckpt.replay` does again (RNG stash and
    fork, the autocast state of two device types re-entered, the device type of the inputs
    inferred), in a generator and nested context managers; its pack hook records the metadata
    of each saved tensor under ``no_grad``. Here the frame's recompute is :meth:`_Call.recompute`
    and the pack hook records the same metadata directly, so a checkpointed block costs less
    Python time per call than torch's checkpoint does. The frame's unpack hook (the recompute on
    first unpack, per graph task; early stop; the metadata check) is torch's own. A forward that
    drew no random numbers is recomputed up to its last saved tensor only (early stop), as by
    torch, unless values are checked.
    """
    frame = _tcp._CheckpointFrame(
        call.recompute,
        early_stop,
        None,
        _tcp._default_meta_extractor if metadata else _no_metadata,
    )
    frame.save_inputs(*args)
    hook = _tcp._checkpoint_hook(frame)
    hook.pack_hook = _pack_hook(frame, metadata)
    call.device_context = _device_context()
    with hook, _Entered(call.forward_contexts):
        out = call.fn(*args, **call.kwargs)
    frame.forward_completed = True
    assert call.state is not None
    if not call.state.rng_devices and call.values is None:
        # The forward drew no random numbers, so replay has no draws to check at the end of
        # the recompute: it may stop after the last saved tensor, as torch's does.
        frame.early_stop = True
    return out


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


def _device_context() -> Any:
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


def _compiled_checkpoint(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    determinism_check: str,
    policy: Policy | None,
) -> Any:
    """Under ``torch.compile`` the recompute is planned by the compiler, not replayed in Python.

    Dynamo traces torch's checkpoint as one region; AOT autograd's partitioner recomputes its
    pure operations in the backward graph. Buffer updates (BatchNorm statistics) are not part of
    what it recomputes, and random operations are saved or replayed by the compiler, so
    :mod:`revckpt.replay` has nothing to do there; the selective policy is handed to the
    compiler through torch's selective-checkpoint contexts.
    """
    if determinism_check == "values":
        raise InvalidArgumentError(
            "determinism_check='values' runs Python code on every operation and cannot run "
            "inside torch.compile; use determinism_check='metadata' in compiled code, or check "
            "values in an eager run"
        )
    options: dict[str, Any] = {}
    if policy is not None:
        options["context_fn"] = _policy_context_fn(policy)
    return _torch_checkpoint(
        fn,
        *args,
        use_reentrant=False,
        determinism_check="none" if determinism_check == "none" else "default",
        **options,
        **kwargs,
    )


def checkpoint(
    fn: Callable[..., Any],
    *args: Any,
    preserve_rng_state: bool = True,
    determinism_check: DeterminismCheck = "metadata",
    policy: Policy | None = None,
    **kwargs: Any,
) -> Any:
    """Run ``fn(*args, **kwargs)`` keeping only its inputs; recompute it during backward.

    Memory: the tensors ``fn`` would save for backward are dropped after the forward; what
    stays alive is what the caller passed in (``args``, ``kwargs``) and, if ``fn`` drew random
    numbers, the generator state (5,056 bytes on CPU, 16 per CUDA device). Cost: one more
    forward of ``fn`` during backward. Gradients are bitwise equal to running ``fn`` plainly.

    Args:
        fn: the block: a module or any callable. Parameters of a module (or of the module a bound
            method belongs to) decide which accelerator RNGs are captured.
        *args, **kwargs: passed to ``fn``; keyword tensors (masks, positions) may require grad.
        preserve_rng_state: replay the forward's RNG so dropout masks match. Only generators the
            forward actually advanced are kept.
        determinism_check: ``"metadata"`` (default) errors if the recompute saves tensors of other
            shapes or dtypes; ``"values"`` also fingerprints the value of every operation's output
            during the forward and raises :class:`~revckpt.CheckpointMismatchError` naming the
            first operation whose recomputed value differs; ``"none"`` checks nothing.
        policy: op-level selective recompute: a spec naming the aten ops whose outputs to
            keep (see :func:`parse_policy`): a preset in :data:`POLICY_PRESETS` (``"matmul"``,
            ``"attention"``, ``"matmul+attention"``) or groups and aten op names joined by
            ``"+"`` (``"matmul+gelu"``); or a function ``op -> bool`` returning True for the
            aten ops whose outputs to keep (it may keep random ops: keep all of them or none,
            else later dropout masks differ). torch's
            selective-checkpoint cache is consumed by the first backward: a second backward
            over the same graph (``retain_graph=True``) is not supported with a policy.

    .. note:: Autocast: the recompute runs under the forward's autocast state, whatever the
       state during backward. BatchNorm: running statistics are updated by the first forward
       only (see :func:`revckpt.replay.freeze_running_stats`).

    .. note:: Under ``torch.compile`` the region is handed to the compiler as torch's own
       checkpoint (with the selective policy, if any): the compiler plans the recompute, keeps
       BatchNorm statistics single-updated and handles random ops itself;
       ``determinism_check="values"`` raises there (it needs eager execution).

    .. warning:: The names ``preserve_rng_state``, ``determinism_check`` and ``policy`` are taken
       by this function; ``fn`` cannot receive keyword arguments of those names through it.
    """
    if not callable(fn):
        raise InvalidInputTypeError(
            f"checkpoint(fn, ...) needs a callable block (an nn.Module or a function), got "
            f"{type(fn).__name__}"
        )
    _check_options(determinism_check, preserve_rng_state)
    return _checkpoint(
        fn,
        args,
        kwargs,
        modules=modules_of(fn),
        preserve_rng_state=preserve_rng_state,
        determinism_check=determinism_check,
        policy=policy,
        label=getattr(fn, "__qualname__", type(fn).__name__),
    )


def segment_bounds(length: int, segments: int | str | Sequence[int]) -> list[tuple[int, int]]:
    """Split a chain of ``length`` blocks into checkpoint segments ``[(start, stop), ...]``.

    ``segments`` is

    * an int ``s`` with ``1 <= s <= length``: ``s`` contiguous segments whose lengths differ by at
      most one (the longer ones first);
    * ``"sqrt"``: ``round(sqrt(length))`` segments, the classic ``O(sqrt(L))`` memory schedule;
    * a list of boundaries: the strictly increasing block indices where a new segment starts,
      e.g. ``[3, 5]`` for ``[0:3], [3:5], [5:L]`` (a leading ``0`` and a trailing ``length`` may be
      included).
    """
    if not isinstance(segments, (bool, str, Sequence)) and hasattr(segments, "__index__"):
        segments = operator.index(segments)  # numpy and other integer scalars
    if isinstance(segments, bool) or not isinstance(segments, (int, str, Sequence)):
        raise InvalidInputTypeError(
            f"segments must be an int, 'sqrt' or a list of boundary indices, got "
            f"{type(segments).__name__}"
        )
    if isinstance(segments, str):
        if segments != "sqrt":
            raise InvalidArgumentError(
                f"segments={segments!r} is not understood; pass an int, 'sqrt' or a list of "
                "boundary indices such as [3, 5]"
            )
        segments = max(1, round(math.sqrt(length)))
    if isinstance(segments, int):
        if not 1 <= segments <= length:
            raise InvalidArgumentError(
                f"segments={segments} does not fit a chain of {length} blocks; pass an int "
                f"between 1 and {length} (1 = one segment, {length} = checkpoint every block)"
            )
        base, extra = divmod(length, segments)
        bounds, start = [], 0
        for i in range(segments):
            stop = start + base + (1 if i < extra else 0)
            bounds.append((start, stop))
            start = stop
        return bounds
    cuts = list(segments)
    if any(isinstance(c, bool) or not isinstance(c, int) for c in cuts):
        raise InvalidInputTypeError(f"segment boundaries must be ints, got {cuts!r}")
    if cuts and cuts[0] == 0:
        cuts = cuts[1:]
    if cuts and cuts[-1] == length:
        cuts = cuts[:-1]
    points = [0, *cuts, length]
    if any(b <= a for a, b in itertools.pairwise(points)) or (
        cuts and not (cuts[0] > 0 and cuts[-1] < length)
    ):
        raise InvalidArgumentError(
            f"segment boundaries {list(segments)!r} must be strictly increasing block indices "
            f"between 1 and {length - 1} (where each new segment starts; a leading 0 and a "
            f"trailing {length} are allowed), e.g. [{max(1, length // 2)}]"
        )
    return list(itertools.pairwise(points))


class _Segment:
    """Runs ``blocks[start:stop]`` in order, passing keyword arguments to each block."""

    def __init__(self, blocks: Sequence[Callable[..., Any]]) -> None:
        self.blocks = blocks

    def __call__(self, x: Any, **kwargs: Any) -> Any:
        for block in self.blocks:
            x = block(x, **kwargs)
        return x


class _ModuleSegment(nn.Module):
    """A segment of module blocks as one module (parameter names ``blocks.<i>.<name>``), so a
    recompute can reparametrise it as a whole (approx path, parameters with hooks)."""

    def __init__(self, blocks: Sequence[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x: Any, **kwargs: Any) -> Any:
        for block in self.blocks:
            x = block(x, **kwargs)
        return x


def _as_blocks(blocks: Any) -> list[Callable[..., Any]]:
    if isinstance(blocks, nn.Module) and not isinstance(blocks, (nn.Sequential, nn.ModuleList)):
        raise InvalidInputTypeError(
            f"checkpoint_sequential needs a chain of blocks: an nn.Sequential, an nn.ModuleList or "
            f"a list of callables, got a single {type(blocks).__name__}; wrap it as "
            "nn.Sequential(...) or use revckpt.checkpoint(module, x)"
        )
    if isinstance(blocks, (str, bytes, torch.Tensor)) or not hasattr(blocks, "__iter__"):
        raise InvalidInputTypeError(
            f"checkpoint_sequential needs a chain of blocks (nn.Sequential, nn.ModuleList or a "
            f"list of callables), got {type(blocks).__name__}"
        )
    chain = list(blocks)
    if not chain:
        raise InvalidArgumentError(
            "checkpoint_sequential got an empty chain; pass at least one block"
        )
    for i, block in enumerate(chain):
        if not callable(block):
            raise InvalidInputTypeError(
                f"block {i} of the chain is a {type(block).__name__}, not a callable; every block "
                "must be an nn.Module or a function taking the previous block's output"
            )
    return chain


def checkpoint_sequential(
    blocks: nn.Sequential | Sequence[Callable[..., Any]],
    segments: int | str | Sequence[int],
    input: torch.Tensor,
    *,
    preserve_rng_state: bool = True,
    determinism_check: DeterminismCheck = "metadata",
    policy: Policy | None = None,
    approx: Approx | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """Run a chain of blocks with every segment checkpointed.

    With ``L`` blocks in ``s`` segments, forward keeps the ``s`` segment inputs and backward
    re-runs one segment at a time, so the activation memory is about
    ``s * bytes(boundary) + max_segment saved(segment)`` for ``L`` extra block forwards in
    total (``"sqrt"`` minimises the sum for uniform blocks; for transformer blocks, whose
    saved tensors are much larger than their boundary, per-block segments (``s = L``) peak
    lower at the same cost).

    Args:
        blocks: an ``nn.Sequential``, ``nn.ModuleList`` or list of callables ``x -> x``.
        segments: number of segments, ``"sqrt"``, or a list of boundaries (see
            :func:`segment_bounds`). Unlike ``torch.utils.checkpoint.checkpoint_sequential``,
            the last segment is checkpointed too.
        input: the chain's input tensor.
        **kwargs: passed to every block (``block(x, **kwargs)``): attention masks, positions.
        preserve_rng_state, determinism_check, policy: as in :func:`checkpoint`.
        approx: an :class:`revckpt.approx.Approx`: keep each segment input compressed and/or
            recompute in bf16 (see :func:`revckpt.approx.checkpoint`). The value-level
            determinism check and ``policy`` do not apply to an approximate recompute (its
            values differ by design): combining them raises.
    """
    chain = _as_blocks(blocks)
    if not isinstance(input, torch.Tensor):
        raise InvalidInputTypeError(
            f"checkpoint_sequential(blocks, segments, input): input must be a torch.Tensor, got "
            f"{type(input).__name__}; pass other arguments as keywords (they reach every block)"
        )
    _check_options(determinism_check, preserve_rng_state)
    bounds = segment_bounds(len(chain), segments)
    if approx is not None:
        if policy is not None or determinism_check == "values":
            raise InvalidArgumentError(
                "approx= recomputes from a compressed input, so its values differ from the "
                "forward by design: drop policy= and determinism_check='values' when using it"
            )
        return _approx_sequential(chain, bounds, input, kwargs, approx, preserve_rng_state)
    x = input
    for start, stop in bounds:
        part = chain[start:stop]
        modules = tuple(m for b in part for m in modules_of(b))
        x = _checkpoint(
            _Segment(part),
            (x,),
            kwargs,
            modules=modules,
            preserve_rng_state=preserve_rng_state,
            determinism_check=determinism_check,
            policy=policy,
            label=f"blocks[{start}:{stop}]",
        )
    return x


def _approx_sequential(
    chain: list[Callable[..., Any]],
    bounds: list[tuple[int, int]],
    x: torch.Tensor,
    kwargs: dict[str, Any],
    approx: Approx,
    preserve_rng_state: bool,
) -> torch.Tensor:
    if not isinstance(approx, Approx):
        raise InvalidInputTypeError(
            f"approx= takes a revckpt.approx.Approx(...), got {type(approx).__name__}"
        )
    for start, stop in bounds:
        part = chain[start:stop]
        all_modules = all(isinstance(b, nn.Module) for b in part)
        complete = all(isinstance(b, nn.Module) for b in part)
        x = run_approx(
            _ModuleSegment(part) if complete else _Segment(part),
            (x,),
            kwargs,
            config=approx,
            modules=tuple(part)
            if all_modules
            else tuple(b for b in part if isinstance(b, nn.Module)),
            preserve_rng_state=preserve_rng_state,
            label=f"blocks[{start}:{stop}]",
        )
        if stop < len(chain) and not isinstance(x, torch.Tensor):
            raise InvalidInputTypeError(
                f"blocks[{start}:{stop}] returned {type(x).__name__}, but the next block takes "
                "one tensor: every block of a chain but the last must return a tensor"
            )
    return x
