"""Autograd plumbing shared by the strategies that run their own backward (reversible stacks,
approximate recompute): which tensors a module's recompute differentiates, a lean VJP, and the
check that no gradient is dropped.

Those strategies wrap a block in one ``torch.autograd.Function`` whose inputs are the block
input, the module's trainable parameters and any keyword tensor that requires grad; backward
recomputes the block with autograd on and returns the VJP for exactly those tensors, so hooks,
``torch.autograd.grad`` and DDP see ordinary gradients.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence, Set
from typing import Any

import torch
from torch import nn
from torch.autograd import forward_ad
from torch.nn.modules.batchnorm import _NormBase
from torch.utils._pytree import tree_flatten, tree_unflatten

from .._module_state import layout_and_modules, submodules
from ..errors import (
    DoubleBackwardError,
    InvalidArgumentError,
    InvalidInputTypeError,
    SideOutputError,
)

__all__ = [
    "differentiable_once",
    "first_unregistered_leaf",
    "flatten_output",
    "forward_as_plain",
    "grad_keywords",
    "grad_transform_active",
    "graph_leaves",
    "label_of",
    "module_targets",
    "modules_of",
    "refuse_forward_ad",
    "refuse_functorch",
    "refuse_grad_transform",
    "refuse_nested_grad_arguments",
    "unflatten_output",
    "vjp",
]


def differentiable_once(
    what: str, way_out: str = ""
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorate the ``backward`` of a node that recomputes without a graph of its gradient.

    Like ``torch.autograd.function.once_differentiable`` the backward runs under ``no_grad``;
    unlike it, a backward reached with ``create_graph=True`` raises
    :class:`~revckpt.DoubleBackwardError` at once. ``once_differentiable`` only defers an error
    when an incoming gradient requires grad, and otherwise returns gradients without a graph,
    which silently drops the second-order term through the node (a gradient penalty then
    trains the wrong thing). ``way_out``: a way to run that part exactly, said first.
    """

    def decorate(backward: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(backward)
        def run(ctx: Any, *grads: Any) -> Any:
            if torch.is_grad_enabled():
                raise DoubleBackwardError(
                    f"create_graph=True (double backward) reached {what}, which is "
                    "differentiable once: its backward recomputes without recording a graph of "
                    "the gradient, so second-order terms through it would be lost. "
                    + way_out
                    + "Use revckpt.checkpoint (convert(model, 'checkpoint'), or fit(..., "
                    "strategies=['store', 'checkpoint'])), which supports double backward, or "
                    "keep this part of the model stored"
                )
            with torch.no_grad():
                return backward(ctx, *grads)

        return run

    return decorate


class _Targets:
    """The parameters (each once, trainable or not) and normalisation layers under one root
    module, with what they were found from: the root's layout (:func:`layout_and_modules`: a new one
    once a submodule was added, removed or replaced) and the identity of every registered
    parameter (one added, removed or replaced, as ``functional_call`` does, changes it).
    Modules are held through the layout (by weak reference): the cache maps each root to its
    targets, which must not keep the root alive."""

    __slots__ = ("ids", "layout", "params")

    def __init__(self, root: nn.Module) -> None:
        self.layout, modules = layout_and_modules(root)
        self.ids = _parameter_ids(modules)
        params: dict[int, torch.Tensor] = {}
        for m in modules:
            for p in m._parameters.values():
                if p is not None:
                    params.setdefault(id(p), p)
        self.params = tuple(params.values())


def _parameter_ids(modules: list[nn.Module]) -> list[int]:
    return [id(p) for m in modules for p in m._parameters.values()]


_TARGETS: weakref.WeakKeyDictionary[nn.Module, _Targets] = weakref.WeakKeyDictionary()


def module_targets(module: Any) -> tuple[tuple[torch.Tensor, ...], tuple[nn.Module, ...]]:
    """A module's trainable parameters (shared ones once) and the normalisation modules it can
    call. Runs per block and forward: the walk is cached per module and checked against its
    current submodules and parameters; ``requires_grad`` is read each call (a parameter frozen
    or unfrozen since). Not a module: ``((), ())``."""
    if not isinstance(module, nn.Module):
        return (), ()
    if torch.compiler.is_compiling():  # traced, not cached (see _module_state.submodules)
        return _traced_targets(module)
    found = _TARGETS.get(module)
    layout, modules = layout_and_modules(module)
    if found is None or layout is not found.layout or _parameter_ids(modules) != found.ids:
        found = _TARGETS[module] = _Targets(module)
    return tuple(p for p in found.params if p.requires_grad), tuple(
        modules[i] for i in layout.norm_slots
    )


def _traced_targets(module: nn.Module) -> tuple[tuple[torch.Tensor, ...], tuple[nn.Module, ...]]:
    modules = submodules(module)
    params: dict[int, torch.Tensor] = {}
    for m in modules:
        for p in m._parameters.values():
            if p is not None and p.requires_grad:
                params.setdefault(id(p), p)
    return tuple(params.values()), tuple(m for m in modules if isinstance(m, _NormBase))


def _drop(t: torch.Tensor) -> None:
    return None


def _never(packed: Any) -> torch.Tensor:
    raise SideOutputError(
        "a gradient reached a tensor computed inside a block's first forward, which keeps "
        "nothing for backward under the approx and offload strategies and in reversible "
        "stacks (the block is recomputed or rebuilt from its output alone): a side output of "
        "the block that the loss uses, such as a mixture-of-experts layer's router logits "
        "(output_router_logits=True, for the auxiliary loss), attention weights "
        "(output_attentions=True) in the loss, or a key/value cache entry made by the layer "
        "and used in a later step. Use the 'checkpoint' or 'selective:...' strategy for "
        "such blocks (they differentiate side outputs), leave the side output out of the "
        "loss (output_router_logits=False, or detach it), or run that forward plainly (a "
        "decoding loop with gradients: revckpt.inplace.reversible_layers(model).reversible "
        "= False, or decode under torch.no_grad() as model.generate does)"
    )


def forward_as_plain() -> contextlib.AbstractContextManager[Any]:
    """The context of a node's first forward inside ``autograd.Function.forward``: grad mode on,
    as plain autograd runs it, while nothing is kept for backward (every saved tensor dropped).

    ``Function.forward`` runs under ``no_grad``, and modules take another path there:
    ``nn.TransformerEncoderLayer`` and ``nn.MultiheadAttention`` switch to their inference fast
    path (nested tensors with a padding mask: other values at padded positions), a
    ``parametrize.cached()`` weight is cached without its graph. The graph built here is
    dropped with the output's history (the caller returns detached outputs); its cost is the
    bookkeeping of the graph, not memory. Under ``torch.compile`` the compiler traces the
    forward as it is.
    """
    if torch.compiler.is_compiling():
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(torch.enable_grad())
    stack.enter_context(torch.autograd.graph.saved_tensors_hooks(_drop, _never))
    return stack


def modules_of(fn: Any, *, closures: bool = True) -> tuple[nn.Module, ...]:
    """The modules a callable block runs: itself, the owner of a bound method, the modules a
    ``functools.partial`` holds (its function, arguments and keywords: HF's
    ``partial(forward, layer, **kwargs)``), and (``closures``) the modules a closure captures.
    Replay checks and re-establishes their state; a block reaching modules in other ways
    (globals) is not covered."""
    found: dict[int, nn.Module] = {}
    todo = [fn]
    while todo:
        obj = todo.pop()
        if isinstance(obj, nn.Module):
            found.setdefault(id(obj), obj)
        elif isinstance(obj, functools.partial):
            todo += [obj.func, *obj.args, *obj.keywords.values()]
        elif callable(obj):
            owner = getattr(obj, "__self__", None)
            if isinstance(owner, nn.Module):
                found.setdefault(id(owner), owner)
            for cell in (getattr(obj, "__closure__", None) or ()) if closures else ():
                try:
                    content = cell.cell_contents
                except ValueError:  # an empty cell
                    continue
                if isinstance(content, (nn.Module, functools.partial)):
                    todo.append(content)
    return tuple(found.values())


def vjp(
    output: torch.Tensor, inputs: tuple[torch.Tensor, ...], cotangent: torch.Tensor
) -> tuple[torch.Tensor | None, ...]:
    """``torch.autograd.grad(output, inputs, cotangent, allow_unused=True)``.

    Runs once per block and step: when the cotangent already has the output's shape, dtype and
    device (the usual case), it goes straight to the engine and skips ``grad``'s argument
    normalisation, which costs as much Python time as the rest of a block's bookkeeping.
    """
    engine_run = getattr(torch.autograd.graph, "_engine_run_backward", None)
    with reentrant_refused():
        if (
            engine_run is None
            or not isinstance(output, torch.Tensor)
            or cotangent.shape != output.shape
            or cotangent.dtype != output.dtype
            or cotangent.device != output.device
        ):
            return torch.autograd.grad(output, inputs, cotangent, allow_unused=True)
        return engine_run(
            (output,), (cotangent,), False, False, inputs, True, accumulate_grad=False
        )


@contextlib.contextmanager
def reentrant_refused() -> Iterator[None]:
    """A recompute's VJP (``torch.autograd.grad``) through torch's reentrant checkpoint
    inside the block: torch's raw error, said with what to do."""
    try:
        yield
    except RuntimeError as e:
        if "use_reentrant=True" not in str(e):
            raise
        raise InvalidArgumentError(
            "a block revckpt recomputes and differentiates with torch.autograd.grad (approx, "
            "offload, a reversible stack) calls torch.utils.checkpoint(..., "
            "use_reentrant=True) inside, which torch.autograd.grad cannot differentiate: pass "
            "use_reentrant=False there (the same memory, and torch's recommended mode), or "
            "plan the block with 'checkpoint' or 'store'"
        ) from e


# Modules and functions whose recompute graph has been checked once (the walk costs ~1% of a
# step; a block's structure rarely changes between calls).
_CHECKED: weakref.WeakSet[Any] = weakref.WeakSet()


@dataclasses.dataclass(frozen=True)
class _Fields:
    """The spec of a dataclass output that pytree does not flatten: its first forward's
    object (copied, its fields set, for the output) and the pytree spec of its fields."""

    template: Any
    names: tuple[str, ...]
    inner: Any

    def __eq__(self, other: object) -> bool:  # a re-run's: the same class and fields
        return (
            isinstance(other, _Fields)
            and type(other.template) is type(self.template)
            and (other.names, other.inner) == (self.names, self.inner)
        )

    __hash__ = None  # type: ignore[assignment]


def flatten_output(out: Any) -> tuple[list[Any], Any]:
    """``tree_flatten``, and a plain ``@dataclass`` output (which pytree takes for a leaf)
    flattened by its fields, as ``torch.utils.checkpoint`` passes it through."""
    if dataclasses.is_dataclass(out) and not isinstance(out, type):
        leaves, inner = tree_flatten(out)
        if len(leaves) == 1 and leaves[0] is out:  # not a registered pytree node
            names = tuple(f.name for f in dataclasses.fields(out))
            leaves, inner = tree_flatten([getattr(out, n) for n in names])
            return leaves, _Fields(out, names, inner)
    return tree_flatten(out)


def unflatten_output(leaves: list[Any], spec: Any) -> Any:
    if not isinstance(spec, _Fields):
        return tree_unflatten(leaves, spec)
    out = copy.copy(spec.template)
    for name, value in zip(spec.names, tree_unflatten(leaves, spec.inner), strict=True):
        object.__setattr__(out, name, value)  # (a frozen dataclass too)
    return out


def first_unregistered_leaf(
    owner: Any, outputs: Any, sources: tuple[torch.Tensor, ...]
) -> torch.Tensor | None:
    """A leaf that requires grad, reached from ``outputs``, that is not among ``sources`` (its
    gradient would be dropped silently), or ``None``. Walks the graph on the first call per
    ``owner`` (a module or function; anything that cannot be weakly referenced is walked
    every time)."""
    try:
        if owner in _CHECKED:
            return None
    except TypeError:
        pass
    known = {id(t) for t in sources}
    # a source with a history (a fast weight torch.func.functional_call swapped in, made from
    # the parameter) ends the walk: the node differentiates it, autograd the rest
    ends = {(t.grad_fn, t.output_nr) for t in sources if t.grad_fn is not None}
    for leaf in graph_leaves(outputs, ends=ends):
        if id(leaf) not in known and leaf.requires_grad:
            return leaf
    with contextlib.suppress(TypeError):
        _CHECKED.add(owner)
    return None


def graph_leaves(
    outputs: Any, *, ends: Set[tuple[Any, int]] = frozenset(), stops: Set[Any] = frozenset()
) -> Iterator[torch.Tensor]:
    """The leaves ``outputs``' graph accumulates gradients into, walking neither an edge in
    ``ends`` (``(node, output_nr)``) nor past a node in ``stops``."""
    seen: set[Any] = set(stops)
    todo = [
        t.grad_fn for t in flatten_output(outputs)[0] if isinstance(t, torch.Tensor) and t.grad_fn
    ]
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        leaf = getattr(fn, "variable", None)
        if leaf is not None:
            yield leaf
        todo.extend(n for n, nr in fn.next_functions if (n, nr) not in ends)


def grad_keywords(kwargs: dict[str, Any]) -> tuple[str, ...]:
    """Names of the keyword tensors that require grad (they become inputs of the node, so
    their gradients are returned). A tensor requiring grad nested in a container cannot be
    returned a gradient: raise, naming the keyword."""
    for k, v in kwargs.items():
        _refuse_nested_grad(v, f"keyword {k!r}", "keyword tensors", "as its own keyword")
    return tuple(k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and v.requires_grad)


def label_of(fn: Any) -> str:
    """How messages name a block: its qualified name, or for a ``functools.partial`` (the
    forward of a block ``convert`` or ``fit`` planned) the class of the module it binds; a
    module standing for another (fit's profiled unit of a block) names it as ``revckpt_label``."""
    named = getattr(fn, "revckpt_label", None) if isinstance(fn, nn.Module) else None
    if isinstance(named, str):
        return named
    if isinstance(fn, functools.partial):
        for a in fn.args:
            if isinstance(a, nn.Module):
                return type(a).__name__
            if isinstance(a, functools.partial):
                return label_of(a)
        return label_of(fn.func)
    owner = getattr(fn, "__self__", None)
    if isinstance(owner, nn.Module) and fn.__name__ in _CALLS:  # partial(layer.__call__, ...)
        return type(owner).__name__
    return getattr(fn, "__qualname__", type(fn).__name__)


# the names of nn.Module's call (Hugging Face checkpoints partial(layer.__call__, ...))
_CALLS = frozenset({"__call__", "_wrapped_call_impl", "_call_impl"})


_STRATEGIES_IN_FUNCTORCH = (
    "Inside vmap the 'checkpoint' and 'compress' strategies run; inside torch.func.grad, vjp "
    "or jacrev none does (torch supports no saved-tensor hooks there): call the block plainly"
)


def refuse_functorch(label: str, strategy: str, instead: str = _STRATEGIES_IN_FUNCTORCH) -> None:
    """Raise inside a ``torch.func`` transform (``vmap``, ``grad``, ``jacrev``): ``strategy``'s
    autograd node (or torch's selective-checkpoint cache) has no batching rule there, and
    torch's own error does not say which block or what to do; ``instead`` says what to do."""
    active = getattr(torch._C, "_are_functorch_transforms_active", lambda: False)
    if active():
        raise InvalidArgumentError(
            f"{label}: the {strategy} strategy cannot run inside a torch.func transform (vmap, "
            f"grad, jacrev...): its recompute has no batching rule there. {instead}"
        )


def refuse_forward_ad(
    label: str,
    strategy: str,
    tensors: Sequence[Any],
    modules: Iterable[nn.Module] = (),
    way_out: str = "",
) -> None:
    """Raise for a dual tensor of ``torch.autograd.forward_ad`` among ``tensors`` or the
    parameters and buffers of ``modules`` (a frozen weight made dual by ``functional_call``,
    whose tangent the node would drop): the node has no forward-mode rule, and torch's
    ``NotImplementedError`` ("implement the jvp function") names neither the block nor what
    to do. Free where no dual level is open. ``way_out``: what to do, said first."""
    if forward_ad._current_level < 0:
        return
    held = (t for m in modules for t in (*m.parameters(), *m.buffers()))
    if any(
        isinstance(t, torch.Tensor) and forward_ad.unpack_dual(t).tangent is not None
        for t in (*tensors, *held)
    ):
        raise InvalidArgumentError(
            f"{label}: a dual tensor (torch.autograd.forward_ad: forward-mode AD, a "
            f"forward-over-reverse Hessian) reached the {strategy} strategy, which has no "
            f"forward-mode rule. {way_out or _FORWARD_AD_WAY_OUT}"
        )


_FORWARD_AD_WAY_OUT = (
    "Use the 'checkpoint' or 'selective:...' strategy for this block (they run "
    "forward-mode AD; torch.func.jvp runs through 'checkpoint'), or call it plainly"
)


def grad_transform_active() -> bool:
    """Whether a ``torch.func.grad``, ``vjp``, ``jacrev`` or ``hessian`` transform is on
    functorch's stack (where torch supports no saved-tensor hooks, even under no_grad)."""
    if torch.compiler.is_compiling():
        return False
    try:
        from torch._C._functorch import TransformType
        from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters
    except ImportError:  # a torch without functorch's Python interpreters: nothing to see
        return False
    return any(i.key() == TransformType.Grad for i in retrieve_all_functorch_interpreters())


def refuse_grad_transform(label: str, strategy: str) -> None:
    """Raise inside a grad transform (:func:`grad_transform_active`): torch's own error names
    neither the block nor what to do. ``vmap`` alone is left to run."""
    if grad_transform_active():
        raise InvalidArgumentError(
            f"{label}: the {strategy} strategy cannot run inside torch.func.grad, vjp, jacrev "
            "or hessian: it keeps its tensors through saved-tensor hooks, which torch does "
            "not support inside those transforms. Call the block plainly there (a plain copy "
            "of the model, or revckpt.restore(model)), or take gradients with torch.autograd "
            "(loss.backward(), torch.autograd.grad)"
        )


def refuse_nested_grad_arguments(args: Sequence[Any]) -> None:
    """Raise for a positional argument that holds tensors requiring grad in a container: the
    node returns gradients for top-level tensors only, and checks its recompute graph for
    others once per block, so one that starts requiring grad later (a frozen encoder's
    output, unfrozen after warm-up) would get none."""
    for i, a in enumerate(args):
        _refuse_nested_grad(a, f"positional argument {i}", "positional tensors", "on its own")


def _refuse_nested_grad(value: Any, what: str, top_level: str, way_out: str) -> None:
    if not isinstance(value, torch.Tensor) and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in tree_flatten(value)[0]
    ):
        raise InvalidInputTypeError(
            f"{what} holds tensors that require grad inside a {type(value).__name__}; "
            f"gradients are returned for top-level {top_level} only: pass each such tensor "
            f"{way_out}"
        )
