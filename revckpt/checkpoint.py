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
* ``strategy="selective:<spec>"`` selects op-level selective recompute (keep matrix-multiply /
  attention outputs, recompute the cheap pointwise and normalisation work), built on torch's
  selective-checkpoint contexts; a policy spec names any keep-set of aten operations
  (``"matmul+gelu"``, :func:`parse_policy`) and has one canonical text
  (:func:`canonical_policy`).
"""

from __future__ import annotations

import functools
import itertools
import math
import operator
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as _torch_checkpoint

from ._call_options import (
    DeterminismCheck,
    check_applies,
    check_options,
    pop_torch_options,
    sequential_strategy_of,
    strategy_of,
)
from .approx import recompute as _approx
from .approx.recompute import Approx, keep_of
from .approx.saved import compress_saved
from .engine.autograd import label_of, modules_of, refuse_functorch, refuse_grad_transform
from .engine.chain import Segment, as_chain, run_nodes
from .engine.frame import FrameCall, run_checkpoint
from .errors import InvalidArgumentError, InvalidInputTypeError
from .policy import (
    POLICY_PRESETS,
    Policy,
    Selective,
    canonical_policy,
    parse_policy,
    policy_context_fn,
    policy_text,
)
from .strategy import Strategy

if TYPE_CHECKING:
    from .offload import Offload

__all__ = [
    "POLICY_PRESETS",
    "DeterminismCheck",
    "Policy",
    "Selective",
    "canonical_policy",
    "checkpoint",
    "checkpoint_sequential",
    "parse_policy",
    "policy_text",
    "segment_bounds",
]


def _label(fn: Any) -> str:
    return label_of(fn)


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
    if policy is not None:
        refuse_functorch(label, "selective")
    else:
        refuse_grad_transform(label, "checkpoint")
    call = FrameCall(
        fn,
        kwargs,
        (args, kwargs, *modules),
        modules=modules,
        preserve_rng_state=preserve_rng_state,
        check_values=determinism_check == "values",
        context_fn=None if policy is None else _context_fn(policy),
        label=label,
    )
    return run_checkpoint(call, args, determinism_check)


def _context_fn(policy: Policy) -> Callable[[], tuple[Any, Any]]:
    """The eager context function, cached per spec (each call makes new contexts)."""
    return _spec_context_fn(policy) if isinstance(policy, str) else policy_context_fn(policy)


_spec_context_fn = functools.lru_cache(maxsize=128)(policy_context_fn)


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
        options["context_fn"] = policy_context_fn(policy)
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
    strategy: str | Strategy | Approx | Offload | Selective | None = None,
    preserve_rng_state: bool = True,
    determinism_check: DeterminismCheck = "metadata",
    policy: Policy | None = None,
    **kwargs: Any,
) -> Any:
    """Run ``fn(*args, **kwargs)`` keeping less than autograd would; rebuild it during backward.

    With the default ``strategy=None`` (``"checkpoint"``) only the inputs are kept and ``fn``
    is re-run during backward. Memory: the tensors ``fn`` would save for backward are dropped
    after the forward; what stays alive is what the caller passed in (``args``, ``kwargs``)
    and, if ``fn`` drew random numbers, the generator state (5,056 bytes on CPU, 16 per CUDA
    device). Cost: one more forward of ``fn`` during backward. Gradients are bitwise equal to
    running ``fn`` plainly.

    Args:
        fn: the block: a module or any callable. Parameters of a module (or of the module a bound
            method belongs to) decide which accelerator RNGs are captured.
        *args, **kwargs: passed to ``fn``; keyword tensors (masks, positions) may require grad.
        strategy: what to keep and how to rebuild it:

            * ``None`` or ``"checkpoint"``: the inputs, exact recompute (above);
            * ``"selective:<policy>"``: op-level selective recompute: the outputs of the aten
              ops a policy spec names are kept too (see :func:`parse_policy`): a preset in
              :data:`POLICY_PRESETS` (``"selective:matmul+attention"``) or groups and aten op
              names joined by ``"+"`` (``"selective:matmul+gelu"``);
              :class:`~revckpt.policy.Selective` takes a function ``op -> bool`` instead (it
              may keep random ops: keep all of them or none, else later dropout masks differ).
              torch's selective-checkpoint cache is consumed by the first backward: a second
              backward over the same graph (``retain_graph=True``) is not supported;
            * ``"approx:<codec>"`` or :class:`revckpt.approx.Approx`: the tensor arguments kept
              compressed (bf16, fp8), the block re-run from them (optionally in bf16): see
              :mod:`revckpt.approx.recompute`; exact forward, approximate gradients;
            * ``"offload"`` or :class:`revckpt.offload.Offload`: the positional tensor
              arguments kept in host memory and copied back for the recompute
              (:mod:`revckpt.offload`);
            * ``"compress:<codec>"``: no recompute: every tensor autograd saves inside ``fn``
              kept compressed (:func:`revckpt.approx.compress_saved`, its defaults).

            A :class:`~revckpt.Strategy` of these kinds works too.
        preserve_rng_state: replay the forward's RNG so dropout masks match. Only generators the
            forward actually advanced are kept. Not for ``"compress"`` (nothing is re-run).
        determinism_check: ``"metadata"`` (default) errors if the recompute saves tensors of other
            shapes or dtypes; ``"values"`` also fingerprints the value of every operation's output
            during the forward and raises :class:`~revckpt.CheckpointMismatchError` naming the
            first operation whose recomputed value differs; ``"none"`` checks nothing. The
            checks apply to ``"checkpoint"`` and ``"selective"``; ``"values"`` raises with the
            other strategies.
        policy: deprecated: ``strategy="selective:<policy>"`` (or ``Selective(<function>)``).

    .. note:: Autocast: the recompute runs under the forward's autocast state, whatever the
       state during backward. BatchNorm: running statistics are updated by the first forward
       only (see :func:`revckpt.replay.freeze_running_stats`).

    .. note:: Under ``torch.compile`` an exact or selective region is handed to the compiler as
       torch's own checkpoint (with the selective policy, if any): the compiler plans the
       recompute, keeps BatchNorm statistics single-updated and handles random ops itself;
       ``determinism_check="values"`` raises there (it needs eager execution).

    .. warning:: The names ``strategy``, ``preserve_rng_state``, ``determinism_check`` and
       ``policy`` are taken by this function; ``fn`` cannot receive keyword arguments of those
       names through it. Nor of ``torch.utils.checkpoint``'s: ``use_reentrant=False``,
       ``early_stop=True`` and ``debug=False`` (what revckpt does) are accepted, so a call
       swapped from torch runs as it is; another value, or ``context_fn``, raises
       :class:`~revckpt.InvalidArgumentError` naming revckpt's way.
    """
    # (over 60 lines for its docstring: the body is the dozen lines below)
    pop_torch_options(kwargs, "revckpt.checkpoint")
    kind, options = strategy_of(strategy, policy)
    if not callable(fn):
        raise _not_callable(fn)
    check_options(determinism_check, preserve_rng_state)
    check_applies(kind, determinism_check, preserve_rng_state)
    if kind == "checkpoint" or kind == "selective":
        if torch.compiler.is_compiling():  # before modules_of: a traced walk of fn's closure
            # cells made Dynamo fail on every Hugging Face layer ("Expected CellVariable")
            return _compiled_checkpoint(fn, args, kwargs, determinism_check, options)
        return _checkpoint(
            fn,
            args,
            kwargs,
            modules=modules_of(fn),
            preserve_rng_state=preserve_rng_state,
            determinism_check=determinism_check,
            policy=options,
            label=_label(fn),
        )
    return _run_other(kind, options, fn, args, kwargs, preserve_rng_state)


def _run_other(
    kind: str,
    options: Any,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    preserve_rng_state: bool,
) -> Any:
    """One call with the approx, offload or compress strategy."""
    if kind == "approx":
        return _approx._checkpoint(
            fn, args, kwargs, config=options, preserve_rng_state=preserve_rng_state
        )
    if kind == "offload":
        from .offload import _checkpoint as _offload_checkpoint

        return _offload_checkpoint(
            fn, args, kwargs, config=options, preserve_rng_state=preserve_rng_state
        )
    return compress_saved(fn, *args, store=options, **kwargs)


def _not_callable(fn: Any) -> InvalidInputTypeError:
    return InvalidInputTypeError(
        f"checkpoint(fn, ...) needs a callable block (an nn.Module or a function), got "
        f"{type(fn).__name__}"
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


def checkpoint_sequential(
    blocks: nn.Sequential | Sequence[Callable[..., Any]],
    segments: int | str | Sequence[int],
    input: torch.Tensor,
    *,
    strategy: str | Strategy | Approx | Offload | Selective | None = None,
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
        **kwargs: passed to every block (``block(x, **kwargs)``): attention masks, positions;
            but the names :func:`checkpoint` reserves (its options, and
            ``torch.utils.checkpoint``'s ``use_reentrant``, ``early_stop``, ``debug`` and
            ``context_fn``, read as in :func:`checkpoint`).
        strategy: as in :func:`checkpoint`, for every segment: with ``"approx:<codec>"`` or an
            :class:`revckpt.approx.Approx` each segment input is kept compressed (and the
            segment optionally re-run in bf16); with ``"offload"`` or an
            :class:`revckpt.offload.Offload` each segment input lives in host memory, and
            with ``Offload(prefetch=True)`` (the default) backward copies segment ``p - 1``'s
            input back while segment ``p`` runs its backward (keyword arguments stay on the
            device); with ``"compress:<codec>"`` each segment keeps its saved tensors
            compressed and recomputes nothing.
        preserve_rng_state, determinism_check: as in :func:`checkpoint`.
        policy: deprecated: ``strategy="selective:<policy>"``.
        approx: deprecated: ``strategy=<the Approx>``.
    """
    # (over 60 lines for its signature and docstring: the body is the 30 lines below)
    pop_torch_options(kwargs, "revckpt.checkpoint_sequential")
    kind, options = sequential_strategy_of(strategy, policy, approx, determinism_check)
    chain = as_chain(blocks, input, what="checkpoint_sequential")
    check_options(determinism_check, preserve_rng_state)
    bounds = segment_bounds(len(chain), segments)
    check_applies(kind, determinism_check, preserve_rng_state)
    rng = preserve_rng_state
    if kind == "approx":
        keep = keep_of(options)
        return run_nodes(
            chain, bounds, input, kwargs, keep=keep, preserve_rng_state=rng, source=blocks
        )
    if kind == "offload":
        from .offload import _run_sequential

        return _run_sequential(
            chain, bounds, input, kwargs, config=options, preserve_rng_state=rng, source=blocks
        )
    x = input
    for start, stop in bounds:
        part = chain[start:stop]
        if kind == "compress":
            x = compress_saved(Segment(part), x, store=options, **kwargs)
            continue
        x = _checkpoint(
            Segment(part),
            (x,),
            kwargs,
            modules=tuple(m for b in part for m in modules_of(b)),
            preserve_rng_state=preserve_rng_state,
            determinism_check=determinism_check,
            policy=options,
            label=f"blocks[{start}:{stop}]",
        )
    return x
