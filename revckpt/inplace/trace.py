"""The user's own training step: its forward and loss run once to see how the model calls its
blocks, then the whole step once, metered, to measure what it does outside them
(:class:`~revckpt.schedule.StepCosts`).

The step is ``loss_fn(model(*args, **kwargs))`` then ``loss.backward()``, the model output held
until the backward ends (as ``out = model(**batch); out.loss.backward()`` holds it). Both runs
leave the model as they found it: gradients, buffers and the RNG state are put back. The calls
are kept detached from the first run's graph (which is dropped unused), so that holding them
holds no activations.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .._autocast import autocast_dtype
from .._numbers import tensor_bytes
from ..engine.autograd import flatten_output
from ..engine.rerun import any_changed, input_versions
from ..errors import InvalidArgumentError, InvalidInputTypeError
from ..measure import MemoryMeter
from ..schedule.block_runs import changes_its_input
from ..schedule.sensitivities import (
    Sensitivities,
    chain_sensitivities,
    rng_state,
    step_sensitivities,
)
from ..schedule.step import StepCosts
from .calls import Key, carried_key, get, hidden_of
from .step import (
    LossFn,
    Reference,
    casts_in_step,
    error_parameters,
    gradient_copies,
    left_as_found,
    loss_of,
    run_step,
    seed_step,
    split_example,
)

__all__ = ["Call", "CallCountError", "OffGraphError", "Recorder", "Trace", "trace"]


@dataclass
class Call:
    """One block call of the traced forward: its arguments, where the hidden state is among
    them, the hidden state it returned, and the autocast dtype it ran under (``None``: off)."""

    fqn: str
    block: nn.Module
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    key: Key
    output: torch.Tensor
    autocast: torch.dtype | None = None

    @property
    def input(self) -> torch.Tensor:
        return get(self.args, self.kwargs, self.key)


@dataclass(frozen=True)
class Trace:
    """What one step showed: the block calls, whether each block takes the previous block's
    output, the step's costs outside the chain and its measured store-all peak; where asked
    for, the blocks' :class:`Sensitivities` from the traced forward's graph (``gradients``;
    ``None`` for a chain whose input needs no gradient); per block, whether code outside the
    blocks saved its input for backward (``input_held``)."""

    calls: tuple[Call, ...]
    chained: bool
    step: StepCosts
    store_peak: int
    gradients: Sensitivities | None = None
    input_held: tuple[bool, ...] = ()
    reference: Reference | None = None  # the metered step's block gradients, where asked for
    # per pair of consecutive calls, whether the second's input was made from the first's
    # output (it, or a few operations on it: x = x + block(x)); read before the calls are
    # detached, after which no pair would be
    links: tuple[bool, ...] = ()


class Recorder:
    """Set on the installed forwards while tracing: receives every block call."""

    def __init__(self, blocks: list[tuple[str, nn.Module]]) -> None:
        self.index = {id(m): (i, fqn) for i, (fqn, m) in enumerate(blocks)}
        self.calls: list[Call] = []
        self.counts = [0] * len(blocks)
        self.hooks: list[Callable[[str, int, Any], None]] = []

    def called(self, block: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        i, _fqn = self.index[id(block)]
        self.counts[i] += 1
        for hook in self.hooks:
            hook("enter", i, (args, kwargs))

    def returned(self, block: nn.Module, args: Any, kwargs: Any, out: Any) -> None:
        i, _fqn = self.index[id(block)]
        for hook in self.hooks:
            hook("exit", i, (args, kwargs, out))


def _first_key_as_the_next(calls: list[Call]) -> None:
    """The first block's hidden state where the second block, of the same class, took the
    first one's output: the rule alone (the first floating positional tensor) takes a table
    passed first, ``forward(self, scale, h)``, for it."""
    if len(calls) < 2 or type(calls[0].block) is not type(calls[1].block):
        return
    first, second = calls[0], calls[1]
    key = second.key
    if key == first.key or second.input is not first.output:
        return
    try:
        candidate = get(first.args, first.kwargs, key)
    except (IndexError, KeyError):
        return
    if isinstance(candidate, torch.Tensor) and candidate.is_floating_point():
        first.key = key


def trace(
    model: nn.Module,
    example: Any,
    loss_fn: LossFn,
    blocks: list[tuple[str, nn.Module]],
    recorder_slot: Callable[[Recorder | None], None],
    *,
    gradients: bool = False,
    reference_seed: int | None = None,
    on_graph: bool = False,
) -> Trace:
    """Run the step twice (see the module docstring) with every block stored; ``recorder_slot``
    installs a :class:`Recorder` on the blocks' forwards (and removes it with ``None``).
    ``gradients``: the error model's weights from the first run's graph: for a chain, one
    backward of the seeded projection of its output
    (:func:`~revckpt.schedule.sensitivities.chain_sensitivities`, sparing the profile a run of
    the chain); where the blocks do not form a chain, of the model's loss
    (:func:`~revckpt.schedule.sensitivities.step_sensitivities`), as the error model cannot run
    such blocks one after the other. ``reference_seed``: the metered step runs from this
    generator state and the trace keeps its gradients of the blocks' parameters
    (:class:`~revckpt.inplace.step.Reference`), to measure approx plans' errors against.
    ``on_graph``: raise :class:`OffGraphError` for blocks none of whose outputs needs a
    gradient."""
    names = [fqn for fqn, _ in blocks]
    recorder = Recorder(blocks)
    calls: list[Call] = []

    states: list[Any] = []  # the generator states each block's forward started from

    entered: list[list[tuple[torch.Tensor, int]]] = []  # the tensors given, their versions
    off: list[str] = []  # the blocks none of whose outputs needs a gradient

    def capture(what: str, i: int, payload: Any) -> None:
        if what == "enter":
            states.append(_state_at(*payload))
            entered.append(input_versions(*payload))
        if what == "exit":
            args, kwargs, out = payload
            if any_changed(entered.pop()):
                raise changes_its_input(names[i], blocks[i][1])
            previous = calls[-1].output if calls else None
            key = carried_key(args, kwargs, previous)
            if key is None:
                raise InvalidInputTypeError(
                    f"block {names[i]} got no floating-point tensor argument to carry as its "
                    "hidden state; pick other blocks with blocks='attribute.path'"
                )
            hidden = hidden_of(out, f"block {names[i]}")
            outputs = [t for t in flatten_output(out)[0] if isinstance(t, torch.Tensor)]
            if not any(t.requires_grad for t in outputs):
                off.append(names[i])
            under = autocast_dtype(hidden.device.type)  # as at the call: contexts restore it
            calls.append(Call(names[i], blocks[i][1], args, kwargs, key, hidden, under))

    outside = _SavedOutside()
    recorder.hooks += [capture, outside.track]
    recorder_slot(recorder)
    try:
        weights = None
        with left_as_found(model, example), _runnable():
            args, kwargs = split_example(example)
            with outside:
                out = model(*args, **kwargs)  # the forward: no backward yet
                loss = _loss(out, loss_fn)
                del out
            _check_calls(recorder.counts, names, [c.fqn for c in calls])
            if on_graph:
                _check_on_graph(off, [c.fqn for c in calls])
            _first_key_as_the_next(calls)
            held = tuple(i > 0 and outside.saved(c.input) for i, c in enumerate(calls))
            chained = all(c.input is p.output for p, c in itertools.pairwise(calls))
            links = tuple(_made_from(c.input, p.output) for p, c in itertools.pairwise(calls))
            if gradients:
                weights = _sensitivities(loss, calls, chained, states)
            del loss
        recorder.hooks.clear()
        calls = [_detached(c) for c in calls]  # the first run's graph goes
        recorder.counts = [0] * len(names)
        with _runnable():
            step, peak, reference = _metered(
                model, example, loss_fn, recorder, calls, chained, reference_seed, blocks
            )
        _check_calls(recorder.counts, names, names)  # a backward may run blocks again
    finally:
        recorder_slot(None)
    return Trace(tuple(calls), chained, step, peak, weights, held, reference, links)


def _state_at(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    tensor = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
    return rng_state(tensor.device if tensor is not None else torch.device("cpu"))


def _sensitivities(
    loss: torch.Tensor, calls: list[Call], chained: bool, states: list[Any]
) -> Sensitivities | None:
    """The error model's weights from the traced forward's graph: for a chain, the seeded
    projection of its output (what the profile would otherwise run the chain again for; not
    where the chain's input needs no gradient, which the profile's own run gives one); for
    blocks that form no chain, the model's own loss."""
    ins, outs = [c.input for c in calls], [c.output for c in calls]
    blocks = [c.block for c in calls]
    if not chained:
        return step_sensitivities(loss, ins, outs, blocks)
    if ins[0].requires_grad and ins[0].is_floating_point():
        return chain_sensitivities(ins[0], outs, blocks, states)
    return None


class _SavedOutside(torch.autograd.graph.saved_tensors_hooks):
    """While entered, the storages of the tensors autograd saves outside the blocks' calls
    (code between blocks, the embedding, the head)."""

    def __init__(self) -> None:
        self.storages: set[int] = set()
        self.depth = 0
        super().__init__(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if self.depth == 0:
            self.storages.add(_storage(t))
        # detached (lossless): an op's saved output held with its grad_fn is a reference cycle
        # inside autograd, and the traced step's graph leaked after fit (2.9 MB on a 4-layer
        # Llama, growing with each fit; resize_token_embeddings then broke backward)
        return t.detach()

    def track(self, what: str, i: int, payload: Any) -> None:
        """A :class:`Recorder` hook: inside a block's call or not."""
        self.depth += 1 if what == "enter" else -1

    def saved(self, t: torch.Tensor) -> bool:
        return _storage(t) in self.storages


def _storage(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # no storage of its own (a tensor subclass)
        return -1


@contextlib.contextmanager
def _runnable() -> Iterator[None]:
    """An error of the user's step, other than revckpt's own, told as one that says so."""
    try:
        yield
    except Exception as err:
        if isinstance(err, (InvalidArgumentError, InvalidInputTypeError)):
            raise
        raise InvalidArgumentError(
            f"the model cannot run the example: {type(err).__name__}: {err}"[:600]
            + "; pass one batch the model takes (model(*example), model(**example) or "
            "model(example))"
        ) from err


def _loss(out: Any, loss_fn: LossFn) -> torch.Tensor:
    """:func:`loss_of`, an error of ``loss_fn`` told as its own (the model ran)."""
    try:
        return loss_of(out, loss_fn)
    except (InvalidArgumentError, InvalidInputTypeError):
        raise
    except Exception as err:
        raise InvalidArgumentError(
            f"loss_fn(output) raised {type(err).__name__}: {err}"[:400]
            + f" (the model ran and returned a {type(out).__name__}); pass a loss_fn that "
            "takes what the model returns to a scalar loss"
        ) from err


def _detached(call: Call) -> Call:
    """``call`` holding no graph: tensors made with one become leaves, requiring grad as the
    originals did (what the in-situ profile reads of them)."""

    def cut(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor) and obj.grad_fn is not None:
            return obj.detach().requires_grad_(obj.requires_grad)
        if type(obj) in (tuple, list):
            return type(obj)(cut(o) for o in obj)
        if type(obj) is dict:
            return {k: cut(v) for k, v in obj.items()}
        return obj

    output = call.output.detach().requires_grad_(call.output.requires_grad)
    return dataclasses.replace(call, args=cut(call.args), kwargs=cut(call.kwargs), output=output)


def _made_from(x: torch.Tensor, y: torch.Tensor, *, nodes: int = 32) -> bool:
    """Whether ``x`` is ``y`` or is made from it by a few operations (``y``'s autograd node
    among the first ``nodes`` of ``x``'s history): a residual added outside the block, a norm
    between blocks. A layer's experts each take a slice of one tensor made before any of
    them runs, so none is made from the one before."""
    if x is y:
        return True
    target, todo, seen = y.grad_fn, [x.grad_fn], set()
    if target is None:
        return False
    while todo and len(seen) < nodes:
        fn = todo.pop(0)
        if fn is None or fn in seen:
            continue
        if fn is target:
            return True
        seen.add(fn)
        todo.extend(n for n, _ in fn.next_functions)
    return False


class CallCountError(InvalidArgumentError):
    """A block the step ran more than once, or never (fit tries the blocks that hold them: a
    layer's experts, some of which the example routes no token to). ``shared``: the blocks
    it ran more than once (empty where it is one it never ran)."""

    shared: tuple[str, ...] = ()


def _check_calls(counts: list[int], names: list[str], order: list[str]) -> None:
    shared = [(n, c) for n, c in zip(names, counts, strict=True) if c > 1]
    if shared:
        shown = ", ".join(f"{n} {c} times" for n, c in shared[:4])
        err = CallCountError(
            f"each block must run exactly once per step, but the example ran {shown}: a module "
            "called at several places (shared weights, a loop) is one block for the planner "
            "but several calls in the step, which it cannot plan apart. Checkpoint each call "
            "in the model's forward with revckpt.checkpoint(block, x, strategy=...), or plan "
            "modules that contain every call and run once (blocks=lambda module, fqn: fqn in "
            "(...) naming those parents)"
        )
        err.shared = tuple(n for n, _ in shared)
        raise err
    unused = [n for n, c in zip(names, counts, strict=True) if c == 0]
    if unused:
        raise CallCountError(
            f"each block must run exactly once per step, but the example never ran "
            f"{', '.join(unused[:4])}; leave such blocks out with blocks=lambda module, fqn: "
            "... (or blocks='attribute.path' naming the blocks the step runs; a block called "
            "under torch.no_grad() is not seen either). If the model "
            "skips layers at random (LayerDrop: layerdrop=, stochastic depth), no plan holds "
            "for every step: set it to 0 for fit, or use revckpt.convert, which plans nothing"
        )
    if order != names:
        raise InvalidArgumentError(
            f"the blocks ran in the order {order[:6]}..., not in module order {names[:6]}...; "
            "revckpt plans a chain of blocks called one after the other. Where they form "
            "several chains (a vision and a text tower, an encoder and a decoder), plan one: "
            f"blocks='<attribute path of its layers>'{_example(order[0], names[0])}, or "
            "convert(model, 'checkpoint'), which plans nothing"
        )


class OffGraphError(InvalidArgumentError):
    """Some blocks' outputs need no gradient (frozen, and called on inputs that need none):
    autograd records nothing in them, so they keep nothing for
    backward and no strategy lowers or slows them. ``on_graph``: the other blocks, which fit
    plans instead."""

    def __init__(self, message: str, *, on_graph: tuple[str, ...]) -> None:
        super().__init__(message)
        self.on_graph = on_graph


def _check_on_graph(off: list[str], called: list[str]) -> None:
    if not off:
        return
    on_graph = tuple(fqn for fqn in called if fqn not in off)
    raise OffGraphError(
        f"the outputs of blocks {', '.join(off[:4])}{', ...' if len(off) > 4 else ''} need no "
        "gradient (their parameters are frozen and their inputs need none): they keep nothing "
        "for backward, so no plan of them lowers the step"
        + (
            "; the loss's gradient reaches none of the blocks, so a plan has nothing to save "
            "(the step's peak is outside them: a smaller batch or sequence lowers it)"
            if not on_graph
            else ""
        ),
        on_graph=on_graph,
    )


def _example(first_run: str, first_listed: str) -> str:
    """`` (e.g. blocks='<parent>')`` for the container of the block that ran first, where it
    is not the container the blocks were listed from (one list run in reverse: no chain)."""
    parent = first_run.rsplit(".", 1)[0] if "." in first_run else ""
    listed = first_listed.rsplit(".", 1)[0] if "." in first_listed else ""
    return f" (e.g. blocks='{parent}')" if parent and parent != listed else ""


def _metered(
    model: nn.Module,
    example: Any,
    loss_fn: LossFn,
    recorder: Recorder,
    calls: list[Call],
    chained: bool,
    seed: int | None,
    blocks: list[tuple[str, nn.Module]],
) -> tuple[StepCosts, int, Reference | None]:
    """The store-all step metered, with a mark at every phase boundary (bytes, and the time,
    for the chain's share of the step's time: the meter slows every operation alike, so the
    share is that of the plain step to a few percent); from the generator state ``seed``
    where given, with the blocks' parameter gradients it made (:class:`Reference`)."""
    last = len(calls) - 1
    marks: dict[str, int] = {}
    times: dict[str, float] = {}
    handles: list[Any] = []  # the hooks, removed after the step (x0 may be the caller's leaf)
    device = calls[0].input.device
    # the model's state is saved and put back outside the meter (it is not the step's)
    with left_as_found(model, example):
        if seed is not None:
            seed_step(model, seed)
        with casts_in_step(device), MemoryMeter(device) as meter:

            def mark(name: str) -> None:
                times[name] = _now(device)
                marks[name] = meter.live_bytes
                marks[name + "_peak"] = meter.phase_peak_bytes
                meter.reset_peak()

            def on_event(what: str, i: int, payload: Any) -> None:
                if what == "enter" and i == 0:
                    mark("chain_start")
                    x0 = get(*payload, calls[0].key)
                    if isinstance(x0, torch.Tensor) and x0.requires_grad:
                        handles.append(x0.register_hook(lambda g: mark("chain_done")))
                elif what == "exit" and i == last:
                    mark("chain_end")
                    out = hidden_of(payload[2], calls[-1].fqn)
                    if out.requires_grad:
                        handles.append(out.register_hook(lambda g: mark("head_done")))

            recorder.hooks.append(on_event)
            times["start"] = _now(device)
            try:
                run_step(model, example, loss_fn)
            finally:
                recorder.hooks.clear()
                for handle in handles:
                    handle.remove()
            times["end"] = _now(device)
            if "chain_done" not in marks:  # nothing before the chain to backpropagate into
                mark("chain_done")
        # outside the meter, before the model's gradients are put back: not in the peak
        reference = None if seed is None else _reference(seed, model, blocks)
    if "head_done" not in marks:
        raise InvalidArgumentError(
            f"no gradient reached the output of the last block ({calls[-1].fqn}): the loss does "
            "not depend on it; pick the blocks the loss goes through"
        )
    step = _step_costs(calls, marks, times, meter.stats.since_reset_peak_bytes, chained)
    return step, meter.peak_bytes, reference


def _reference(seed: int, model: nn.Module, blocks: list[tuple[str, nn.Module]]) -> Reference:
    params = error_parameters(model, blocks)
    return Reference(seed, params, gradient_copies(params))


def _step_costs(
    calls: list[Call], marks: dict[str, int], times: dict[str, float], last_peak: int, chained: bool
) -> StepCosts:
    """The step's costs outside the chain, from the bytes live and the phase peaks marked at
    each phase boundary of the metered step (``last_peak``: the peak after the last mark)."""
    new_grads = sum(tensor_bytes(p) for c in calls for p in c.block.parameters() if p.requires_grad)
    return StepCosts(
        before_peak=marks["chain_start_peak"],
        held=marks["chain_start"] - tensor_bytes(calls[0].input),
        head=tensor_bytes(calls[-1].output) + marks["head_done_peak"] - marks["chain_end"],
        backward_held=marks["head_done"] - marks["chain_end"],
        after=max(last_peak, marks["chain_done"]) - new_grads,
        chained=chained,
        chain_share=_chain_share(times),
    )


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _chain_share(times: dict[str, float]) -> float:
    """The blocks' share of the step's time: their forward (first block entered to last block
    left) and their backward (the last output's gradient to the first input's)."""
    whole = times["end"] - times["start"]
    chain = (times["chain_end"] - times["chain_start"]) + (
        min(times["chain_done"], times["end"]) - times["head_done"]
    )
    return min(1.0, max(chain, 1e-12) / whole) if whole > 0 else 1.0
