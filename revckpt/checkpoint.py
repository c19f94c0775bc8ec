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

import itertools
import math
import operator
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as _torch_checkpoint

from .approx.recompute import Approx, keep_of
from .engine.autograd import modules_of
from .engine.chain import Segment, as_chain, run_nodes
from .engine.frame import FrameCall, run_checkpoint
from .errors import InvalidArgumentError, InvalidInputTypeError
from .policy import (
    POLICY_PRESETS,
    Policy,
    canonical_policy,
    parse_policy,
    policy_context_fn,
    policy_text,
)

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
    call = FrameCall(
        fn,
        kwargs,
        (args, kwargs, *modules),
        modules=modules,
        preserve_rng_state=preserve_rng_state,
        check_values=determinism_check == "values",
        context_fn=policy_context_fn(policy) if policy is not None else None,
        label=label,
    )
    return run_checkpoint(call, args, determinism_check)


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
            else later dropout masks differ). torch's selective-checkpoint cache is consumed
            by the first backward: a second backward over the same graph
            (``retain_graph=True``) is not supported with a policy.

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
        raise _not_callable(fn)
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
    chain = as_chain(blocks, input, what="checkpoint_sequential")
    _check_options(determinism_check, preserve_rng_state)
    bounds = segment_bounds(len(chain), segments)
    if approx is not None:
        if policy is not None or determinism_check == "values":
            raise InvalidArgumentError(
                "approx= recomputes from a compressed input, so its values differ from the "
                "forward by design: drop policy= and determinism_check='values' when using it"
            )
        keep = keep_of(approx)
        return run_nodes(
            chain, bounds, input, kwargs, keep=keep, preserve_rng_state=preserve_rng_state
        )
    x = input
    for start, stop in bounds:
        part = chain[start:stop]
        x = _checkpoint(
            Segment(part),
            (x,),
            kwargs,
            modules=tuple(m for b in part for m in modules_of(b)),
            preserve_rng_state=preserve_rng_state,
            determinism_check=determinism_check,
            policy=policy,
            label=f"blocks[{start}:{stop}]",
        )
    return x
