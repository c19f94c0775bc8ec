"""The front door: :func:`fit`, :func:`convert` and :func:`restore`, on the user's own model.

``fit`` finds the model's blocks (:mod:`~revckpt.inplace.blocks`), runs the user's training
step on one example to see how the model calls them and what the step does outside them
(:mod:`~revckpt.inplace.trace`), profiles each block on its real arguments
(:mod:`~revckpt.inplace.measure`), solves for the cheapest plan whose **whole step** fits the
budget (:func:`revckpt.schedule.solve` with the step's costs) and installs it in place
(:mod:`~revckpt.inplace.install`): module types, parameters, ``state_dict`` keys and the
model's forward stay as they were. ``convert`` installs one strategy without profiling;
``restore`` removes either.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from torch import nn
from torch.nn.parameter import is_lazy

from ..errors import (
    Float16RangeError,
    InvalidArgumentError,
    InvalidInputTypeError,
    PlanWarning,
    SideOutputError,
)
from ..schedule.budget import UNKNOWN_PEAK, parse_budget
from ..schedule.costs import evaluate, peak_phases, strategy_names
from ..schedule.error_samples import checked_stride
from ..schedule.kinds import approximate
from ..schedule.plan import Plan
from ..schedule.plan_checks import dtype_name
from ..schedule.profile import Profile
from ..schedule.solver import solve
from ..strategy import Strategy, StrategyLike, argument_of, kind_of
from .blocks import Blocks, find_blocks, model_digest
from .confirm import _within_budget, _within_error
from .convert import convert, restore
from .fit_blocks import guard_left_out, traced_or_again
from .fit_checks import (
    caller_level,
    check_saved_strategies,
    load_plan,
    planned_names,
    uncompiled,
    without_approx,
    without_nodes,
)
from .fit_saved import ERROR_SEED, install_saved, seedable
from .fit_stack import fit_converted
from .install import Planned, install, is_fsdp, planned, site_shapes, tensor_sites
from .measure import profile_in_situ
from .plan_install import apply_plan
from .reversible import refuse_reversible, stack_of
from .runners import runner_for
from .step import (
    LossFn,
    Reference,
    check_example_leaves,
    measure_step,
    measured_gradients,
)
from .trace import Recorder
from .trainable import watch_trained

__all__ = ["convert", "fit", "restore"]

_EXACT = ("store", "checkpoint", "selective:matmul+attention")
_CODECS = ("bf16", "e4m3")
_T = TypeVar("_T")


def _check_budget_syntax(memory_budget: Any) -> None:
    """The budget's syntax, before any profiling (a fraction is read once the step's store-all
    peak is known)."""
    parse_budget(memory_budget, UNKNOWN_PEAK)


def _strategies(strategies: Sequence[StrategyLike] | None, error_budget: float) -> list[str]:
    """The strategies a plan may use, in their text form (the solver's)."""
    if strategies is None:
        chosen = list(_EXACT)
        if error_budget > 0:
            chosen += [f"approx:{c}" for c in _CODECS]
        return chosen
    if isinstance(strategies, (str, Strategy)):
        raise InvalidInputTypeError(
            f"strategies={strategies!r}: pass a list, e.g. [{str(strategies)!r}]"
        )
    parsed = [Strategy.parse(s) for s in strategies]
    for s in parsed:
        if s.kind == "offload":
            raise InvalidArgumentError(
                "fit does not price 'offload' yet (on a CPU the host is the device and it saves "
                "nothing); leave it out, or apply it to every block with "
                "revckpt.convert(model, 'offload')"
            )
        if s.kind == "reversible":
            raise InvalidArgumentError(
                "strategies=['reversible'] changes the architecture: fit plans reversible "
                "segments only for blocks that already are reversible (revckpt.layers), and "
                "this model's blocks are not; leave 'reversible' out"
            )
    lossy = [str(s) for s in parsed if s.kind in ("approx", "compress")]
    if lossy and not error_budget > 0:
        raise InvalidArgumentError(
            f"strategies={[str(s) for s in parsed]} includes {lossy}, whose gradients are "
            f"approximate, and error_budget={error_budget!r} allows exact strategies only: "
            "pass error_budget= (e.g. 1e-2, the largest relative gradient error you accept), "
            "or leave them out"
        )
    return [str(s) for s in parsed]


def fit(
    model: nn.Module,
    example: Any,
    *,
    memory_budget: int | float | str,
    error_budget: float = 0.0,
    loss_fn: LossFn = None,
    strategies: Sequence[StrategyLike] | None = None,
    blocks: Blocks = None,
    plan: Plan | str | Path | None = None,
    repeats: int = 3,
    progress: Callable[[int, int], None] | None = None,
    segment_blocks: int | None = None,
    verify: bool = False,
    error_stride: int = 1,
) -> Plan:
    """Make the model's training step fit ``memory_budget``, in place, and return the plan.

    The step planned for is ``loss_fn(model(*args, **kwargs))`` then ``.backward()``, with
    ``example`` one batch: a tensor, a tuple of positional arguments or a mapping of keyword
    arguments (a dict, a tokenizer's ``BatchEncoding``). Without ``loss_fn`` the loss is
    ``output.loss`` (Hugging Face models given labels), or the output when it is a scalar.

    Args:
        memory_budget: bytes (int), a string (``"8GiB"``, ``"30%"``) or a fraction in
            ``(0, 1]`` of the whole step's store-all peak. A byte budget bounds what the step
            allocates above what exists before it (parameters, optimizer state, gradients
            that already exist): what :class:`~revckpt.MemoryMeter` measures around the step.
            Gradients that are ``None`` before the step (``optimizer.zero_grad()``) count in
            it, and the plan assumes they are.
        error_budget: the largest relative gradient error of the planned blocks' parameter
            gradients, all together (the model's trainable ones where the blocks have none;
            0: exact strategies only; above 0, approx boundaries in bf16 or fp8 may be
            chosen). The check step of a plan with approx boundaries also
            measures its error against the store-all step on ``example``; where that is over
            the budget, ``fit`` plans again for a smaller predicted error.
        strategies: the strategies a plan may use (default: store, checkpoint and
            selective recompute; plus approx codecs when ``error_budget > 0``: bf16 and
            e4m3, e4m3 alone where every block input is 16-bit).
        blocks: the blocks to plan: an attribute path (``"model.layers"``) or a function
            ``(module, fqn) -> bool``; default: the model's repeated blocks.
        plan: a plan saved by :meth:`Plan.to_json` (a path or JSON text) or a :class:`Plan` to
            apply instead of solving, after checking it was made for this model, that its
            lossy segments fit ``error_budget``, and that one metered step on ``example``
            with it installed fits ``memory_budget``.
        repeats: timing repeats of the profile (median).
        error_stride: with codecs to price (``error_budget > 0``): ``1`` (default) measures
            their gradient errors on every block, one forward and backward of the block per
            codec; ``k > 1`` on every ``k``-th block of a group of blocks of the same costs
            and its last, interpolated between (:mod:`revckpt.schedule.error_samples`):
            cheaper, and right only where the errors move slowly from block to block (a
            trained model's layers can read errors several times too low).
        progress: called as ``progress(done, total)`` while the blocks are profiled (the
            CLI draws a progress bar with it).
        segment_blocks: the most blocks one checkpoint segment may span (default: any). Pass
            1 for FSDP2 with ``fully_shard`` per block: re-running earlier blocks of a
            segment would need their parameters gathered, which only their own hooks do.
        verify: measure the plan in the step next to the whole-model recipes predicted to fit
            (store-all, every block checkpointed, every block ``selective:<policy>`` or
            ``approx:<codec>``) and install the fastest that fits both budgets by
            measurement, named ``"<its name> (verified)"``; about nine training steps per
            recipe measured (see :func:`revckpt.inplace.verify.fit_verified`, which also
            returns the measurements). With ``plan=``, the saved plan is measured instead of
            being refused when predicted over the budget.

    A model holding a reversible stack (:func:`revckpt.make_reversible`) is planned as a
    whole: ``fit`` measures its step with the stack stored, checkpointed and reversible (those
    of the three ``strategies`` names; same gradients), and installs the fastest that fits
    (:mod:`revckpt.inplace.fit_stack`); ``blocks`` and ``plan`` do not apply.

    Returns the :class:`~revckpt.schedule.Plan`, whose predicted peak is the whole step's.
    Batches no larger in any dimension than ``example`` (every tensor a block is given) keep
    within the budget; a larger one raises an error in training. Eval mode and
    ``torch.no_grad()`` run the model plainly.
    Undo with :func:`restore`. Under ``torch.distributed`` (initialised before ``fit``) every
    rank applies rank 0's plan; the budget is per rank.
    """
    # over 60 lines for its docstring alone: the front door's contract, kept whole
    if not isinstance(model, nn.Module):
        raise InvalidInputTypeError(f"fit(model, ...) needs an nn.Module, got {type(model)}")
    with uncompiled(model) as model:
        return _fit_front(model, example, memory_budget, error_budget, loss_fn, strategies,
                          blocks, plan, repeats, progress, segment_blocks, verify,
                          error_stride)  # fmt: skip


def _fit_front(
    model: nn.Module,
    example: Any,
    memory_budget: Any,
    error_budget: float,
    loss_fn: LossFn,
    strategies: Any,
    blocks: Blocks,
    plan: Any,
    repeats: int,
    progress: Any,
    segment_blocks: int | None,
    verify: bool,
    error_stride: int,
) -> Plan:
    """:func:`fit` on the (uncompiled) model."""
    if progress is not None and not callable(progress):
        raise InvalidInputTypeError(
            f"progress={progress!r}: pass a function progress(done, total), or None"
        )
    checked_stride(error_stride)  # also where a reversible stack ignores it (no codec errors)
    if isinstance(repeats, bool) or not isinstance(repeats, numbers.Integral) or repeats < 1:
        raise InvalidArgumentError(f"repeats={repeats!r}: pass an int >= 1 (timing repeats)")
    check_example_leaves(example)
    converted = stack_of(model)
    if converted is not None:
        return fit_converted(model, converted, example, memory_budget=memory_budget,
                             strategies=strategies, blocks=blocks, plan=plan, loss_fn=loss_fn,
                             repeats=repeats)  # fmt: skip
    options = _FitOptions(
        error_budget,
        loss_fn,
        strategies,
        blocks,
        plan,
        repeats,
        progress,
        segment_blocks,
        error_stride,
    )
    if verify:
        from .verify import fit_verified  # it builds on this module

        found = fit_verified(model, example, memory_budget=memory_budget, **vars(options)).plan
    else:
        found = _fit(model, example, memory_budget=memory_budget, **vars(options)).plan
    watch_trained(model, found.block_names)
    return found


@dataclass(frozen=True)
class _FitOptions:
    """The keyword arguments of :func:`fit` but ``memory_budget`` and ``verify``."""

    error_budget: float = 0.0
    loss_fn: LossFn = None
    strategies: Sequence[StrategyLike] | None = None
    blocks: Blocks = None
    plan: Plan | str | Path | None = None
    repeats: int = 3
    progress: Callable[[int, int], None] | None = None
    segment_blocks: int | None = None
    error_stride: int = 1
    # fit's own, when it fits again: blocks off the backward's path, and the default rule's
    # first class of blocks only
    left_out: frozenset[str] = frozenset()
    one_class: bool = False


@dataclass(frozen=True)
class Fitted:
    """What :func:`_fit` installed and what it found on the way (the profile and the store-all
    step's measured peak only when it traced the step)."""

    plan: Plan
    found: list[tuple[str, nn.Module]]
    keys: list[Any]
    strategies: tuple[str, ...]
    error_budget: float
    budget: int
    profile: Profile | None = None
    store_peak: int | None = None
    shapes: tuple[tuple[int, ...], ...] = ()  # the traced blocks' hidden-state shapes
    dtypes: tuple[str, ...] = ()  # and their dtypes' names
    autocast: str | None = None  # the autocast dtype the example ran under (None: off)
    sites: tuple[frozenset[Any], ...] = ()  # per block, its arguments that held tensors
    site_shapes: tuple[tuple[tuple[int, ...], ...], ...] = ()  # and their shapes (sorted)


def _fit(
    model: nn.Module,
    example: Any,
    *,
    memory_budget: int | float | str,
    profiled: bool = False,
    **options: Any,
) -> Fitted:
    """:func:`fit` without ``verify`` (``options``: its other keyword arguments).
    ``profiled``: trace and profile the step even when a saved ``plan`` is given, and install
    that plan unchecked (verification measures it)."""
    o = _FitOptions(**options)
    chosen = _checked(model, memory_budget, o)
    restore(model)
    named = o.blocks if o.blocks is not None else planned_names(o.plan, model)
    found = find_blocks(model, named, one_class=o.one_class)
    left = [(fqn, b) for fqn, b in found if fqn in o.left_out]  # off the backward's path
    found = [(fqn, b) for fqn, b in found if fqn not in o.left_out]
    _refuse_sharded(found)
    if o.plan is None or profiled:
        _refuse_eval_mode(found)
    saved = load_plan(o.plan, model, found) if o.plan is not None else None
    if saved is not None:
        check_saved_strategies(saved, tuple(chosen), o)
    try:
        for fqn, block in found:
            install(block, Planned(fqn, "store", runner_for("store")))
        if saved is not None and not profiled:
            plan, keys, budget = install_saved(saved, found, memory_budget, o, model, example)
            return Fitted(plan, found, keys, tuple(chosen), o.error_budget, budget)
        priced = any(kind_of(s) in ("approx", "compress") for s in chosen)  # errors measured
        checked_error = priced and o.error_budget > 0 and seedable(model, found)
        seed = ERROR_SEED if checked_error else None  # approx plans' errors measured
        slot = _recorder_slot(found)
        traced = traced_or_again(model, example, o, found, slot, priced, seed)
        if isinstance(traced, dict):  # other blocks to plan: fit again
            restore(model)
            changed = {**options, **traced}
            return _fit(model, example, memory_budget=memory_budget, profiled=profiled, **changed)
        if o.segment_blocks is not None:
            step = dataclasses.replace(traced.step, max_span=o.segment_blocks)
            traced = dataclasses.replace(traced, step=step)
        if o.strategies is None and all(c.input.element_size() <= 2 for c in traced.calls):
            # bf16 keeps a 16-bit block input as it is: checkpoint's bytes, a codec's time
            # more (a fit on bfloat16 models picked it where noise read it faster)
            chosen = [s for s in chosen if s != "approx:bf16"]
        profile = _profile(model, traced, chosen, o)
        chosen = _runnable(chosen, strategy_names(profile.blocks), o.strategies is None)
        keys = [c.key for c in traced.calls]
        sites = tuple(tensor_sites(c.args, c.kwargs) for c in traced.calls)
        arg_shapes = tuple(
            site_shapes(c.args, c.kwargs, s) for c, s in zip(traced.calls, sites, strict=True)
        )
        budget = parse_budget(memory_budget, traced.store_peak)
        shapes = tuple(tuple(c.input.shape) for c in traced.calls)
        dtypes = tuple(dtype_name(c.input.dtype) for c in traced.calls)
        under = traced.calls[0].autocast if traced.calls else None  # at the blocks' calls
        autocast = None if under is None else dtype_name(under)
        if saved is not None:  # (verify measures it): its left-out blocks guarded as in fit
            result = saved
            left = [(fqn, m) for fqn, m in model.named_modules() if fqn in set(saved.left_out)]
        else:

            def checked(budget: Any, error_budget: float) -> tuple[Plan, int]:
                found_plan = solve(
                    profile, memory_budget=budget, error_budget=error_budget, strategies=chosen
                )
                found_plan = dataclasses.replace(
                    found_plan,
                    block_shapes=shapes,
                    block_dtypes=dtypes,
                    block_keys=tuple(keys),
                    block_tensors=tuple(tuple(sorted(s, key=str)) for s in sites),
                    block_tensor_shapes=arg_shapes,
                    autocast=autocast,
                    model_digest=model_digest(model),
                    left_out=tuple(fqn for fqn, _ in left),
                )
                return _measured(
                    found_plan, model, example, o.loss_fn, found, keys, traced.reference
                )

            def phases(plan: Plan) -> dict[str, dict[str, int]]:
                assert profile.step is not None
                return peak_phases(profile.blocks, plan.segments, profile.step)

            def within(error_budget: float) -> Plan:
                at = functools.partial(checked, error_budget=error_budget)
                return _within_budget(at, memory_budget, traced.store_peak, phases)

            def modelled(plan: Plan) -> float:  # the error model's figure, not the measured
                return evaluate(profile.blocks, plan.segments, step=profile.step).error

            try:
                result = _agreed(_within_error(within, o.error_budget, modelled))
            except (SideOutputError, Float16RangeError) as err:  # (checked reads chosen)
                side = isinstance(err, SideOutputError)
                chosen = without_nodes(chosen) if side else without_approx(chosen)
                result = _agreed(_within_error(within, o.error_budget, modelled))
        apply_plan(result, found, keys, sites)
        guard_left_out(left)
        seen = (profile, traced.store_peak, shapes, dtypes, autocast, sites, arg_shapes)
        return Fitted(result, found, keys, tuple(chosen), o.error_budget, budget, *seen)
    except BaseException:
        restore(model)
        raise


def _runnable(chosen: list[str], runnable: list[str], defaults: bool) -> list[str]:
    """Of ``chosen``, those some block can run with: of the defaults, silently; of the
    caller's, saying which were left out; none left: an error saying so."""
    kept = [s for s in chosen if s in runnable]
    if defaults or kept == chosen:
        return kept
    left = [s for s in chosen if s not in runnable]
    why = (
        "no block's profile priced them (approx on a float16 block whose recompute from a "
        "rounded input overflows; a selective policy that keeps nothing a block saves)"
    )
    if not kept:
        raise InvalidArgumentError(
            f"no block can run strategies={chosen} here: {why}. Allow others (strategies=None "
            f"picks among {runnable})"
        )
    warnings.warn(
        f"revckpt.fit: no block can run {left} here ({why}): planned without them",
        PlanWarning,
        stacklevel=caller_level(),
    )
    return kept


def _checked(model: nn.Module, memory_budget: Any, o: _FitOptions) -> list[str]:
    """:func:`fit`'s arguments checked, before any profiling; the strategies a plan may use."""
    if not isinstance(model, nn.Module):
        raise InvalidInputTypeError(f"fit(model, ...) needs an nn.Module, got {type(model)}")
    refuse_reversible(model, "fit")  # before fit's restore, which would undo it
    state = (*model.named_parameters(), *model.named_buffers())
    lazy = next((n for n, t in state if is_lazy(t)), None)
    if lazy is not None:  # (fit's steps put the model's state back: not a shapeless one)
        raise InvalidArgumentError(
            f"{lazy} is not initialised yet (a lazy module shapes it on its first call): run "
            "the model's forward once on a batch, e.g. under torch.no_grad(), before fit (a "
            "lazy module the forward never calls: initialise it yourself, or remove it)"
        )
    _check_budget_syntax(memory_budget)
    error_budget = o.error_budget
    if not (isinstance(error_budget, (int, float)) and 0 <= error_budget < float("inf")):
        raise InvalidArgumentError(f"error_budget={error_budget!r}: pass a number >= 0")
    if o.loss_fn is not None and not callable(o.loss_fn):
        raise InvalidInputTypeError("loss_fn is a function from the model output to a scalar")
    chosen = _strategies(o.strategies, error_budget)
    segment_blocks = o.segment_blocks
    if segment_blocks is not None and (
        not isinstance(segment_blocks, int)
        or isinstance(segment_blocks, bool)
        or segment_blocks < 1
    ):
        raise InvalidArgumentError(f"segment_blocks={segment_blocks!r}: pass None or an int >= 1")
    checked_stride(o.error_stride)
    return chosen


def _refuse_sharded(found: list[tuple[str, nn.Module]]) -> None:
    sharded = [fqn for fqn, m in found if is_fsdp(m)]
    if sharded:
        raise InvalidArgumentError(
            f"block {sharded[0]} is already sharded by FSDP2 (fully_shard): fit runs blocks "
            "alone to profile them, which sharded blocks cannot do. Call revckpt.fit before "
            "fully_shard (with segment_blocks=1), then shard"
        )


def _refuse_eval_mode(found: list[tuple[str, nn.Module]]) -> None:
    """fit profiles the training step, which planned blocks take part in only in train mode
    (in eval mode they run plainly): a model left in eval mode, as ``from_pretrained`` returns
    it, would show the trace no block at all."""
    idle = [fqn for fqn, m in found if not m.training]
    if idle:
        raise InvalidArgumentError(
            f"revckpt.fit plans the training step, and block {idle[0]} is in eval mode "
            f"({len(idle)} of the {len(found)} blocks; from_pretrained returns models in eval "
            "mode), where planned blocks run plainly: call model.train() before fit (with the "
            "dropout probabilities at 0 for a step without dropout)"
        )


def _profile(model: nn.Module, traced: Any, chosen: list[str], o: _FitOptions) -> Profile:
    """The blocks profiled in situ, for the codecs, policies and formats ``chosen`` names."""
    return profile_in_situ(
        model,
        traced,
        codecs=[argument_of(s) for s in chosen if kind_of(s) == "approx"],
        policies=[argument_of(s) for s in chosen if kind_of(s) == "selective"],
        compress=[argument_of(s) for s in chosen if kind_of(s) == "compress"],
        repeats=o.repeats,
        error_stride=o.error_stride,
        progress=o.progress,
    )


def _measured(
    plan: Plan,
    model: nn.Module,
    example: Any,
    loss_fn: LossFn,
    found: list[tuple[str, nn.Module]],
    keys: Sequence[Any],
    reference: Reference | None = None,
) -> tuple[Plan, int]:
    """``plan`` installed and checked in one metered step: the plan, its predictions raised to
    what the step measured, and by how much the cost model was short of the peak (negative
    where it read high). With a
    :class:`Reference` (the store-all step's gradients), a plan with approximate segments runs
    its step from the reference's generator state and its gradient error is measured too."""
    apply_plan(plan, found, keys)
    if reference is not None and any(approximate(s) for s in plan.strategies):
        measured, grads = measured_gradients(
            model, example, loss_fn, seed=reference.seed, params=reference.params
        )
        error = reference.error_of(grads)
        if not error <= plan.predicted_error:  # nan (a non-finite gradient) reads as infinite
            plan = dataclasses.replace(plan, predicted_error=error if error > 0 else math.inf)
    else:
        measured = measure_step(model, example, loss_fn)
    short = measured - plan.predicted_peak_bytes  # below 0: the model read high
    if short <= 0:
        return plan, short
    return dataclasses.replace(plan, predicted_peak_bytes=measured), short


def _agreed(plan: _T) -> _T:
    """Under ``torch.distributed``, every rank takes rank 0's plan (or any object): plans weigh
    measured times, which differ between processes, and ranks whose blocks recompute
    differently would hold different memory (and FSDP2 needs every rank to run the same
    blocks the same way)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return plan
    box: list[Any] = [plan if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _recorder_slot(found: list[tuple[str, nn.Module]]) -> Callable[[Recorder | None], None]:
    def slot(recorder: Recorder | None) -> None:
        for _, block in found:
            info = planned(block)
            assert info is not None
            info.recorder = recorder

    return slot
