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
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from torch import nn

from ..errors import InfeasibleBudgetError, InvalidArgumentError, InvalidInputTypeError
from ..schedule.budget import human_bytes, parse_budget
from ..schedule.plan import Plan
from ..schedule.profile import Profile
from ..schedule.solver import solve
from ..strategy import Strategy, StrategyLike, argument_of, kind_of
from .blocks import Blocks, find_blocks
from .install import Planned, install, is_fsdp, planned, uninstall
from .measure import profile_in_situ
from .runners import runner_for, segment_runners
from .trace import LossFn, Recorder, measure_step, trace

__all__ = ["convert", "fit", "restore"]

_EXACT = ("store", "checkpoint", "selective:matmul+attention")
_CODECS = ("bf16", "e4m3")
_T = TypeVar("_T")


def _check_budget_syntax(memory_budget: Any) -> None:
    """The budget's syntax, before any profiling (a fraction is read once the step's store-all
    peak is known)."""
    dummy = 1 << 62
    try:
        parse_budget(memory_budget, dummy)
    except InvalidArgumentError as err:
        raise InvalidArgumentError(str(err).replace(f" ({dummy:,} bytes)", "")) from None


def model_digest(model: nn.Module) -> str:
    """A digest of the model's parameter names, shapes and dtypes."""
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype};".encode())
    return h.hexdigest()[:16]


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
) -> Plan:
    """Make the model's training step fit ``memory_budget``, in place, and return the plan.

    The step planned for is ``loss_fn(model(*args, **kwargs))`` then ``.backward()``, with
    ``example`` one batch: a tensor, a tuple of positional arguments or a dict of keyword
    arguments. Without ``loss_fn`` the loss is ``output.loss`` (Hugging Face models given
    labels), or the output when it is a scalar.

    Args:
        memory_budget: bytes (int), a string (``"8GiB"``, ``"30%"``) or a fraction in
            ``(0, 1]`` of the whole step's store-all peak. A byte budget bounds what the step
            allocates above what exists before it (parameters, optimizer state, gradients
            that already exist): what :class:`~revckpt.MemoryMeter` measures around the step.
            Gradients that are ``None`` before the step (``optimizer.zero_grad()``) count in
            it, and the plan assumes they are.
        error_budget: the largest predicted relative gradient error (0: exact strategies
            only; above 0, approx boundaries in bf16 or fp8 may be chosen).
        strategies: the strategies a plan may use (default: store, checkpoint and
            selective recompute; plus approx codecs when ``error_budget > 0``).
        blocks: the blocks to plan: an attribute path (``"model.layers"``) or a function
            ``(module, fqn) -> bool``; default: the model's repeated blocks.
        plan: a plan saved by :meth:`Plan.to_json` (a path or JSON text) or a :class:`Plan` to
            apply instead of solving, after checking it was made for this model.
        repeats: timing repeats of the profile (median).
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

    Returns the :class:`~revckpt.schedule.Plan`, whose predicted peak is the whole step's.
    Batches no larger in any dimension than ``example`` keep within the budget; a larger one
    raises an error in training. Eval mode and ``torch.no_grad()`` run the model plainly.
    Undo with :func:`restore`. Under ``torch.distributed`` (initialised before ``fit``) every
    rank applies rank 0's plan; the budget is per rank.
    """
    options = dict(
        error_budget=error_budget,
        loss_fn=loss_fn,
        strategies=strategies,
        blocks=blocks,
        plan=plan,
        repeats=repeats,
        progress=progress,
        segment_blocks=segment_blocks,
    )
    if verify:
        from .verify import fit_verified  # it builds on this module

        return fit_verified(model, example, memory_budget=memory_budget, **options).plan
    return _fit(model, example, memory_budget=memory_budget, **options).plan


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


def _fit(
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
    profiled: bool = False,
) -> Fitted:
    """:func:`fit` without ``verify``. ``profiled``: trace and profile the step even when a
    saved ``plan`` is given, and install that plan unchecked (verification measures it)."""
    if not isinstance(model, nn.Module):
        raise InvalidInputTypeError(f"fit(model, ...) needs an nn.Module, got {type(model)}")
    _check_budget_syntax(memory_budget)
    if not (isinstance(error_budget, (int, float)) and 0 <= error_budget < float("inf")):
        raise InvalidArgumentError(f"error_budget={error_budget!r}: pass a number >= 0")
    if loss_fn is not None and not callable(loss_fn):
        raise InvalidInputTypeError("loss_fn is a function from the model output to a scalar")
    chosen = _strategies(strategies, error_budget)
    if segment_blocks is not None and (
        not isinstance(segment_blocks, int)
        or isinstance(segment_blocks, bool)
        or segment_blocks < 1
    ):
        raise InvalidArgumentError(f"segment_blocks={segment_blocks!r}: pass None or an int >= 1")
    restore(model)
    found = find_blocks(model, blocks)
    sharded = [fqn for fqn, m in found if is_fsdp(m)]
    if sharded:
        raise InvalidArgumentError(
            f"block {sharded[0]} is already sharded by FSDP2 (fully_shard): fit runs blocks "
            "alone to profile them, which sharded blocks cannot do. Call revckpt.fit before "
            "fully_shard (with segment_blocks=1), then shard"
        )
    saved = _load(plan, model, found) if plan is not None else None
    try:
        for fqn, block in found:
            install(block, Planned(fqn, "store", runner_for("store")))
        if saved is not None and not profiled:
            budget = parse_budget(memory_budget, saved.store_all_peak_bytes)
            if saved.predicted_peak_bytes > budget:
                raise InvalidArgumentError(
                    f"the saved plan's whole step peaks at {saved.predicted_peak_bytes:,} bytes, "
                    f"above memory_budget={memory_budget!r} ({budget:,} bytes); make a plan for "
                    "this budget with revckpt.fit(model, example, memory_budget=...), or "
                    "measure it against the simple recipes with verify=True"
                )
            keys: list[Any] = [None] * len(found)
            _apply(saved, found, keys)
            return Fitted(saved, found, keys, tuple(chosen), error_budget, budget)
        traced = trace(model, example, loss_fn, found, _recorder_slot(found))
        if segment_blocks is not None:
            step = dataclasses.replace(traced.step, max_span=segment_blocks)
            traced = dataclasses.replace(traced, step=step)
        policies = [argument_of(s) for s in chosen if kind_of(s) == "selective"]
        codecs = [argument_of(s) for s in chosen if kind_of(s) == "approx"]
        compress = [argument_of(s) for s in chosen if kind_of(s) == "compress"]
        profile = profile_in_situ(
            model,
            traced,
            codecs=codecs,
            policies=policies,
            compress=compress,
            repeats=repeats,
            progress=progress,
        )
        keys = [c.key for c in traced.calls]
        budget = parse_budget(memory_budget, traced.store_peak)
        shapes = tuple(tuple(c.input.shape) for c in traced.calls)

        def fitted(done: Plan) -> Fitted:
            seen = (profile, traced.store_peak, shapes)
            return Fitted(done, found, keys, tuple(chosen), error_budget, budget, *seen)

        if saved is not None:
            _apply(saved, found, keys)
            return fitted(saved)

        def checked(budget: Any) -> tuple[Plan, int]:
            found_plan = solve(
                profile, memory_budget=budget, error_budget=error_budget, strategies=chosen
            )
            found_plan = dataclasses.replace(
                found_plan,
                block_shapes=shapes,
                model_digest=model_digest(model),
            )
            _apply(found_plan, found, keys)
            measured = measure_step(model, example, loss_fn)
            if measured <= found_plan.predicted_peak_bytes:
                return found_plan, 0
            short = measured - found_plan.predicted_peak_bytes
            return dataclasses.replace(found_plan, predicted_peak_bytes=measured), short

        result = _agreed(_within_budget(checked, memory_budget, traced.store_peak))
        _apply(result, found, keys)
        return fitted(result)
    except BaseException:
        restore(model)
        raise


def _within_budget(
    checked: Callable[[Any], tuple[Plan, int]], memory_budget: Any, store_peak: int
) -> Plan:
    """The plan solved for the budget, confirmed by one metered step (``checked`` returns the
    plan, its prediction raised to what the step measured, and by how much the cost model was
    short). A plan that measured over the budget is solved again with the largest shortfall
    seen taken off the budget. An infeasible budget is answered with the smallest budget a
    plan met in a measured step. ``store_peak``: the store-all step's measured peak, of which
    a fractional budget is a fraction (and the plan's ``store_all_peak_bytes``)."""
    budget = parse_budget(memory_budget, store_peak)
    target, worst, tried = budget, 0, []
    for _ in range(8):
        try:
            plan, short = checked(target)
        except InfeasibleBudgetError as err:
            smallest, _ = checked(err.smallest_budget_bytes)
            least = min([smallest.predicted_peak_bytes, *tried])
            raise _infeasible(err, budget, least, store_peak) from None
        if plan.predicted_peak_bytes <= budget:
            return dataclasses.replace(
                plan, memory_budget_bytes=budget, store_all_peak_bytes=store_peak
            )
        tried.append(plan.predicted_peak_bytes)
        worst = max(worst, short)
        target = min(target - 1, budget - worst)
    raise InfeasibleBudgetError(  # pragma: no cover - eight plans each short of the model
        f"no plan met {budget:,} bytes in a measured step (the cost model was up to {worst:,} "
        f"bytes short of these plans); raise the budget to {min(tried):,} bytes",
        smallest_budget_bytes=min(tried),
    )


def _infeasible(
    err: InfeasibleBudgetError, budget: int, smallest: int, store_peak: int
) -> InfeasibleBudgetError:
    cures = str(err).partition("; or lower that smallest budget: ")[2]
    return InfeasibleBudgetError(
        f"no plan fits a memory budget of {human_bytes(budget)} ({budget:,} bytes) for the "
        f"whole training step: the smallest budget a plan fits is {human_bytes(smallest)} "
        f"({smallest:,} bytes, {smallest / store_peak:.1%} of the step with every block "
        "stored, as measured on the example). Raise the budget to at least that, or use a "
        "smaller batch" + (f"; or lower that smallest budget: {cures}" if cures else ""),
        smallest_budget_bytes=smallest,
    )


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


def _apply(plan: Plan, found: list[tuple[str, nn.Module]], keys: Sequence[Any]) -> None:
    shapes = plan.block_shapes or (None,) * len(found)
    for seg in plan.segments:
        labels = tuple(fqn for fqn, _ in found[seg.start : seg.stop])
        if seg.strategy == "checkpoint":
            runners = segment_runners(labels)
        else:
            runners = [runner_for(seg.strategy)] * len(labels)
        for i, run in zip(range(seg.start, seg.stop), runners, strict=True):
            fqn, block = found[i]
            info = Planned(
                fqn, seg.strategy, run, key=keys[i], limit=shapes[i], threads=plan.threads
            )
            install(block, info)


def _load(plan: Any, model: nn.Module, found: list[tuple[str, nn.Module]]) -> Plan:
    if not isinstance(plan, Plan):
        plan = Plan.from_json(plan)
    names = tuple(fqn for fqn, _ in found)
    if plan.model_digest is None or plan.block_names != names:
        raise InvalidArgumentError(
            f"the plan covers blocks {list(plan.block_names)[:3]}... but this model's blocks "
            f"are {list(names)[:3]}...: it was made for another model; make one for this "
            "model with revckpt.fit(model, example, memory_budget=...)"
        )
    if plan.model_digest != model_digest(model):
        raise InvalidArgumentError(
            "the plan was made for a model with other parameters (names or shapes differ); "
            "make one for this model with revckpt.fit(model, example, memory_budget=...)"
        )
    return plan


def convert(
    model: nn.Module,
    strategy: StrategyLike = "checkpoint",
    *,
    module_filter_fn: Callable[[nn.Module, str], bool] | None = None,
    every: int = 1,
) -> list[str]:
    """Apply one ``strategy`` in place to the model's blocks, without profiling, in the style
    of torchao's ``convert_to_float8_training``: ``"checkpoint"``, ``"selective:<policy>"``,
    ``"approx:<codec>"`` or ``"offload"`` (or a :class:`~revckpt.Strategy`), on every
    ``every``-th block (the first of each group of ``every``) of the blocks
    ``module_filter_fn(module, fqn)`` selects (default: the model's repeated blocks).
    Returns the names of the converted blocks; undo with :func:`restore` (a later ``convert``
    or ``fit`` replaces it). Eval mode and
    ``torch.no_grad()`` run the model plainly."""
    if not isinstance(every, int) or isinstance(every, bool) or every < 1:
        raise InvalidArgumentError(f"every={every!r}: pass a positive int (1: every block)")
    run = runner_for(strategy)
    restore(model)  # a model is converted once: what was installed before goes
    found = find_blocks(model, module_filter_fn)
    chosen = found[::every]
    for fqn, block in chosen:
        install(block, Planned(fqn, str(Strategy.parse(strategy)), run))
    return [fqn for fqn, _ in chosen]


def restore(model: nn.Module) -> int:
    """Undo :func:`fit` or :func:`convert`: every block runs plainly again. Returns how many
    blocks were restored."""
    if not isinstance(model, nn.Module):
        raise InvalidInputTypeError(f"restore(model) needs an nn.Module, got {type(model)}")
    return sum(uninstall(m) for m in model.modules())
