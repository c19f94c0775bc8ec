"""The recompute node: one autograd node per block call that keeps what its strategy keeps of
the block's positional tensor arguments and, in backward, rebuilds them and re-runs the block.

A strategy says only what it keeps and how it rebuilds it, with a :class:`Keep`:

* :class:`Keep` itself keeps the arguments exactly (through ``ctx.save_for_backward``, so
  version checks and saved-tensor hooks apply: host offload moves them with such hooks);
* :class:`revckpt.approx.recompute.Compressed` keeps them encoded by a codec and may re-run
  the block in bf16.

The node's inputs are the tensor arguments, the trainable parameters of the modules the block
calls and the keyword tensors that require grad, so ``torch.autograd.grad``, hooks and DDP see
ordinary gradients; its first forward and its re-run go through :mod:`revckpt.engine.rerun`
and :mod:`revckpt.replay`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from .._determinism import _storage_key
from ..errors import (
    Float16RangeError,
    InvalidArgumentError,
    InvalidInputTypeError,
    ModifiedInputError,
)
from ..replay import ForwardState
from .autograd import (
    differentiable_once,
    flatten_output,
    grad_keywords,
    graph_leaves,
    module_targets,
    modules_of,
    refuse_forward_ad,
    refuse_functorch,
    refuse_nested_grad_arguments,
    unflatten_output,
)
from .rerun import Rerun, first_forward, output_grads

__all__ = ["EXACT", "Keep", "run_node"]


class Keep:
    """What a recompute node keeps of the block's positional tensor arguments, and how it
    rebuilds them in backward. This base keeps them exactly; subclasses override the three
    methods."""

    __slots__ = ()

    def keep(self, tensors: Sequence[torch.Tensor], label: str) -> tuple[list[torch.Tensor], Any]:
        """The tensors to save for ``tensors`` and a recipe for :meth:`rebuild`."""
        return list(tensors), None

    def rebuild(self, saved: Sequence[torch.Tensor], recipe: Any) -> list[torch.Tensor]:
        """The block's positional tensors again, from what :meth:`keep` saved."""
        return list(saved)

    def rerun_context(self, device_type: str) -> contextlib.AbstractContextManager[Any]:
        """The context the re-run runs in, inside the replayed forward state."""
        return contextlib.nullcontext()


EXACT = Keep()


class _BlockCall:
    """Everything one call needs in backward, except the kept tensors: the block, its
    positional arguments with the tensors taken out (``template``, ``slots``), its keyword
    arguments, and what it differentiates and replays."""

    __slots__ = (
        "fn",
        "grad_kwargs",
        "keep",
        "kwargs",
        "label",
        "modules",
        "norms",
        "out_spec",
        "own",
        "params",
        "preserve_rng_state",
        "slots",
        "template",
        "tensors",
    )

    def __init__(self, fn: Callable[..., Any], args: Sequence[Any], label: str) -> None:
        self.fn = fn
        self.label = label
        self.template: list[Any] = []  # the positional args, tensors replaced by None
        self.slots: list[int] = []  # positions of the tensor args in template
        self.tensors: list[torch.Tensor] = []  # the tensor args of this call (forward only)
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                self.slots.append(i)
                self.tensors.append(a)
                self.template.append(None)
            else:
                self.template.append(a)
        self.kwargs: dict[str, Any] = {}
        self.grad_kwargs: tuple[str, ...] = ()
        self.params: tuple[torch.Tensor, ...] = ()
        self.modules: tuple[nn.Module, ...] = ()
        self.own: tuple[nn.Module, ...] = ()
        self.norms: tuple[nn.Module, ...] | None = None
        self.keep: Keep = EXACT
        self.preserve_rng_state = True
        self.out_spec: _OutSpec | None = None  # the output's structure, set by the forward

    def args(self, tensors: Sequence[Any]) -> list[Any]:
        args = list(self.template)
        for slot, t in zip(self.slots, tensors, strict=True):
            args[slot] = t
        return args


class _RecomputeNode(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, call: _BlockCall, *inputs: torch.Tensor) -> Any:
        tensors = inputs[: len(call.slots)]
        ctx.call = call
        # an output the loss does not use gets None, not zeros: parameters reached only through
        # it keep .grad None, as in plain autograd (zeros would move them under weight decay)
        ctx.set_materialize_grads(False)
        ctx.state = ForwardState.capture(
            *tensors,
            call.kwargs,
            call.fn,
            preserve_rng_state=call.preserve_rng_state,
            norms=call.norms,
            modules=call.modules,
        )
        out = first_forward(ctx.state, call.label, call.fn, *call.args(tensors), **call.kwargs)
        _refuse_unfrozen(call, out, (*tensors, *call.kwargs.values()))
        # whether its float16 outputs were finite: a 0-d tensor, read in backward (no wait on
        # the device here)
        ctx.finite = None if call.keep is EXACT else _finite(out)
        saved, ctx.recipe = call.keep.keep(tensors, call.label)
        ctx.leaves = [t.is_floating_point() or t.is_complex() for t in tensors]
        # an inference tensor cannot be saved (nor changed in place outside inference mode):
        # it stays in the call's keywords as it is
        kw = call.kwargs
        ctx.kw_names = [k for k, v in kw.items() if torch.is_tensor(v) and not v.is_inference()]
        ctx.kw_start = len(saved)
        saved += [call.kwargs[k] for k in ctx.kw_names]
        ctx.save_for_backward(*saved)
        outs, call.out_spec = _OutSpec.split(out, call.label)
        del out
        detached = tuple(o.detach() for o in outs)  # the node is their history, not forward's
        # an output without a graph in the forward (a constant, h.detach()) stays without one
        constant = [d for d, o in zip(detached, outs, strict=True) if not o.requires_grad]
        ctx.mark_non_differentiable(*constant)
        return detached

    @staticmethod
    @differentiable_once("an approximate-recompute or offloaded block")
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        call: _BlockCall = ctx.call
        saved = _saved(ctx, call.label)
        rebuilt = call.keep.rebuild(saved[: ctx.kw_start], ctx.recipe)
        args_in = [
            t.detach().requires_grad_(True) if leaf else t
            for t, leaf in zip(rebuilt, ctx.leaves, strict=True)
        ]
        leaves = [t for t, leaf in zip(args_in, ctx.leaves, strict=True) if leaf]
        kw = dict(call.kwargs)
        for name, t in zip(ctx.kw_names, saved[ctx.kw_start :], strict=True):
            kw[name] = t  # through saved_tensors: an in-place change since forward raises
        rerun = Rerun(
            call.fn,
            call.params,
            kw,
            call.grad_kwargs,
            label=call.label,
            modules=call.modules,
            own=call.own,
        )
        floats = [t for t in args_in if t.is_floating_point()]
        device_type = (floats or args_in)[0].device.type
        replay = ctx.state.replay(label=call.label, exact_draws=True)
        with torch.enable_grad(), replay, call.keep.rerun_context(device_type):
            out = rerun(*call.args(args_in))
        sources = rerun.sources(leaves)
        leaf = rerun.unregistered(out, sources)
        if leaf is not None:
            raise _unregistered(call, leaf)
        if ctx.finite is not None:
            _check_in_range(out, ctx.finite, call.label)
        result = output_grads(_rerun_outputs(out, call), grads, sources)
        del out
        arg_grads, i = [], 0
        for leaf in ctx.leaves:
            arg_grads.append(result[i] if leaf else None)
            i += leaf
        return (None, *arg_grads, *result[len(leaves) :])


def _finite(out: Any) -> torch.Tensor | None:
    """Whether every float16 tensor of ``out`` is finite, as a 0-d tensor on its device
    (``None`` without float16 tensors: bf16 and wider formats hold float32's range)."""
    halves = [
        t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.dtype == torch.float16
    ]
    if not halves:
        return None
    return torch.stack([torch.isfinite(t).all() for t in halves]).all()


def _check_in_range(out: Any, forward_finite: torch.Tensor | None, label: str) -> None:
    """Raise where a float16 recompute from decoded (rounded) inputs reached inf or nan and
    its forward did not: a value the forward held at 64096 can come back at 65504 (fp8 rounds
    up, the decode clamps to the largest float16) and overflow in the next layer, where plain
    autograd's gradients are finite (inf silently before session 33). A forward that made
    infinities itself (a -inf mask, an overflow) is left as plain autograd leaves it, and so
    is the backward (a GradScaler's overflow)."""
    if forward_finite is None or not bool(forward_finite):
        return
    now = _finite(out)
    if now is not None and not bool(now):
        raise Float16RangeError(
            f"the recompute of {label} from its compressed input reached inf or nan in "
            "float16 where its forward was finite: the rounded input moved values near "
            "float16's largest (65504) past it, so its gradients would be inf where plain "
            "autograd's are finite. Keep that block's input exact (checkpoint instead of "
            "approx), compute in bfloat16 or float32, or scale the activations down"
        )


def _refuse_unfrozen(call: _BlockCall, out: Any, inputs: Sequence[Any]) -> None:
    """Raise for a parameter a hook made trainable during the forward before the forward used
    it (a pre-hook that unfreezes a layer): the node took the trainable parameters before it
    ran, so that parameter's gradient would be lost (``.grad`` None where plain autograd sets
    it). One unfrozen after its use gets no gradient from this call in plain autograd either."""
    taken = {id(p) for p in call.params}
    late = {id(p) for p in _targets(call.own)[0] if id(p) not in taken}
    if late:  # the block's own: the walk stops at its inputs' histories (a weight used
        # before the block is not the block's)
        stops = {t.grad_fn for t in tree_flatten(list(inputs))[0] if isinstance(t, torch.Tensor)}
        late = [p for p in graph_leaves(out, stops=stops) if id(p) in late]
    if late:
        raise InvalidArgumentError(
            f"{call.label}: a parameter of shape {tuple(late[0].shape)} started requiring grad "
            "during the block's forward (a hook unfroze it, or the block registered it "
            "there); an approx or offload block takes its trainable parameters before its "
            "forward, so its gradient would be lost. Unfreeze (or register) it before the "
            "forward, or checkpoint the block"
        )


def _unregistered(call: _BlockCall, leaf: torch.Tensor) -> InvalidArgumentError:
    """The error for a tensor the re-run differentiates that is none of the node's inputs."""
    held = [m for m in call.modules if m not in call.own and any(leaf is p for p in m.parameters())]
    if held:  # a closure's module: its parameters are not the node's inputs
        return InvalidArgumentError(
            f"{call.label} uses a parameter of a {type(held[0]).__name__} it reaches through a "
            "closure (a lambda or nested function capturing the module), whose gradient would "
            "be lost: approx and offload differentiate the parameters of the block itself, "
            "of a bound method's module and of the modules a functools.partial holds; pass "
            "the module, its bound method or functools.partial(module, ...) instead"
        )
    return InvalidArgumentError(
        f"{call.label} uses a tensor of shape {tuple(leaf.shape)} that requires grad but is "
        "neither a tensor argument of its own nor a parameter of the checkpointed module (a "
        "tensor inside a list, tuple or dict argument, or one the block reads from elsewhere), "
        "so its gradient would be lost; pass the tensor as an argument of its own, or "
        "register it in an nn.Module the block holds"
    )


def _storage(t: torch.Tensor) -> int | None:
    """Its storage's address; ``None`` for an empty tensor (all share address 0) or one with
    no storage (a subclass, a batched tensor)."""
    return _storage_key(t) if t.numel() else None


def _realiased(outs: Sequence[torch.Tensor], given: Sequence[Any]) -> tuple[torch.Tensor, ...]:
    """The node's outputs, each one that shares memory with a tensor the block was given (a
    skipped layer's ``return x``) or with an output before it (``(h, h.view(-1))``) made again
    as a view of that tensor (``as_strided``, same geometry): the node's outputs are detached,
    so autograd would not see the sharing, and an in-place change through one would move the
    other's value under a history that does not say so (gradients 3/4 and 1/2 of plain
    autograd's). As views, they behave as in plain autograd, and nothing more is kept. An
    output with a graph and one without share memory only as ``h`` and ``h.detach()`` do:
    left apart, as in plain autograd (as a view of the other, the detached one took its graph,
    or cut it)."""
    # keyed by storage and graph: (h.detach(), h, h.view(-1)) makes the view one of h
    by_storage: dict[tuple[int, bool], torch.Tensor] = {}
    for t in given:
        if isinstance(t, torch.Tensor):
            key = _storage(t)
            if key is not None:
                by_storage.setdefault((key, t.requires_grad), t)
    result = []
    for o in outs:
        key = _storage(o)
        base = by_storage.get((key, o.requires_grad)) if key is not None else None
        if base is not None and base.dtype == o.dtype and base.device == o.device:
            o = base.as_strided(o.size(), o.stride(), o.storage_offset())
        elif key is not None:
            by_storage.setdefault((key, o.requires_grad), o)
        result.append(o)
    return tuple(result)


def _saved(ctx: Any, label: str) -> tuple[torch.Tensor, ...]:
    """The node's saved tensors; a tensor the block was given exactly (a keyword, a further
    argument without grad, an exact boundary) changed in place since the forward is named."""
    try:
        return ctx.saved_tensors
    except RuntimeError as e:
        if "modified by an inplace operation" not in str(e):
            raise
        raise ModifiedInputError(
            f"{label}: a tensor it was given (an argument or keyword it keeps exactly, e.g. an "
            "attention mask) was changed in place between its forward and its backward, so its "
            "recompute would run on other values. Change a copy (mask = mask.clone()) or make "
            "the change after backward"
        ) from e


class _OutSpec:
    """Where the tensors are in a block's output: the node returns only those, and the output
    is rebuilt around them with its other values (``None``, flags, a cache object) as they came
    from the first forward, the way ``torch.utils.checkpoint`` passes any output through."""

    __slots__ = ("leaves", "slots", "spec")

    def __init__(self, leaves: list[Any], slots: list[int], spec: Any) -> None:
        self.leaves, self.slots, self.spec = leaves, slots, spec

    @staticmethod
    def split(out: Any, label: str) -> tuple[list[torch.Tensor], _OutSpec]:
        if isinstance(out, torch.Tensor):  # the common case, without walking a tree
            return [out], _BARE
        leaves, spec = flatten_output(out)
        slots = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        if not slots:
            raise InvalidInputTypeError(
                f"{label} returned {type(out).__name__} with no tensor in it; a recompute node "
                "needs a block whose output holds at least one tensor"
            )
        tensors = [leaves[i] for i in slots]
        for i in slots:
            leaves[i] = None  # the node's outputs hold them
        return tensors, _OutSpec(leaves, slots, spec)

    def join(self, tensors: Sequence[torch.Tensor]) -> Any:
        if self is _BARE:
            return tensors[0]
        leaves = list(self.leaves)
        for i, t in zip(self.slots, tensors, strict=True):
            leaves[i] = t
        return unflatten_output(leaves, self.spec)


_BARE = _OutSpec([None], [0], None)  # an output that is one tensor


def _rerun_outputs(out: Any, call: _BlockCall) -> list[torch.Tensor]:
    """The re-run's output tensors, which must stand where the first forward's stood."""
    first = call.out_spec
    assert first is not None
    if first is _BARE:
        if isinstance(out, torch.Tensor):
            return [out]
        raise _changed_structure(call, type(out).__name__, "a tensor")
    leaves, spec = flatten_output(out)
    slots = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    if spec != first.spec or slots != first.slots:
        raise _changed_structure(call, spec, first.spec)
    return [leaves[i] for i in slots]


def _changed_structure(call: _BlockCall, now: Any, first: Any) -> InvalidArgumentError:
    return InvalidArgumentError(
        f"{call.label} returned an output of a different structure when re-run in backward "
        f"({now} against {first} in forward); a recomputed block must return the same "
        "structure each time it runs"
    )


def _targets(modules: Sequence[nn.Module]) -> tuple[tuple[torch.Tensor, ...], list[nn.Module]]:
    """The trainable parameters (each once) and normalisation layers of ``modules``."""
    params: list[torch.Tensor] = []
    norms: list[nn.Module] = []
    seen: set[int] = set()
    for m in modules:
        module_params, module_norms = module_targets(m)
        for t in module_params:
            if id(t) not in seen:
                seen.add(id(t))
                params.append(t)
        norms += module_norms
    return tuple(params), norms


def run_node(
    fn: Callable[..., Any],
    args: Sequence[Any],
    kwargs: dict[str, Any],
    *,
    keep: Keep = EXACT,
    modules: Sequence[nn.Module] | None = None,
    complete: bool | None = None,
    preserve_rng_state: bool = True,
    label: str,
) -> Any:
    """Run ``fn(*args, **kwargs)`` as one recompute node keeping what ``keep`` keeps of its
    positional tensors. ``modules``: the modules ``fn`` calls (default: ``fn`` itself when it
    is a module); ``complete``: whether they are all it calls (then replay freezes exactly
    their normalisation layers; else any that runs). Without grad mode, or with nothing to
    differentiate, ``fn`` runs plainly and nothing is kept."""
    if modules is None:
        modules = modules_of(fn, closures=False)  # their parameters become the node's inputs
    if complete is None:
        complete = isinstance(fn, nn.Module)
    params, norms = _targets(modules)
    call = _BlockCall(fn, args, label)
    tensors = call.tensors
    if not tensors:
        raise InvalidInputTypeError(
            f"{label} got no tensor argument; pass the block input as a positional tensor"
        )
    if keep is not EXACT and any(t.is_complex() for t in tensors):  # a codec's
        raise InvalidInputTypeError(
            f"{label} got a complex tensor; approximate recompute supports real floating-point "
            "tensors (and keeps integer and boolean ones exact): split complex values into "
            "real and imaginary parts"
        )
    grad_kwargs = grad_keywords(kwargs)
    refuse_nested_grad_arguments(args)
    needs_graph = any(t.requires_grad for t in tensors) or bool(params) or bool(grad_kwargs)
    if not torch.is_grad_enabled() or not needs_graph:
        return fn(*args, **kwargs)  # nothing to differentiate: keep nothing, plain call
    refuse_functorch(label, "approx or offload")
    call.modules = tuple(dict.fromkeys((*modules, *modules_of(fn))))
    refuse_forward_ad(
        label, "approx or offload", (*tensors, *params, *kwargs.values()), call.modules
    )
    call.tensors = []  # the node's inputs hold them; the call must not outlive them
    call.kwargs, call.grad_kwargs, call.params, call.keep = kwargs, grad_kwargs, params, keep
    call.own = tuple(modules)  # the modules whose parameters are the node's inputs
    call.norms = tuple(norms) if complete else None
    call.preserve_rng_state = preserve_rng_state
    outs = _RecomputeNode.apply(call, *tensors, *params, *(kwargs[k] for k in grad_kwargs))
    assert call.out_spec is not None
    return call.out_spec.join(_realiased(outs, (*tensors, *kwargs.values())))
