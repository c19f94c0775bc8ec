"""A block's two runs under a recompute node: the first forward, which keeps nothing, and its
re-run in backward, which differentiates exactly the node's inputs.

Every node that runs its own backward (:mod:`revckpt.engine.node` for checkpoint-style nodes,
the half steps of :mod:`revckpt.layers.rebuild`) runs the block through these two functions:

* :func:`first_forward`: the forward under its captured :class:`~revckpt.replay.ForwardState`,
  with grad mode on as plain autograd runs it and nothing saved
  (:func:`~revckpt.engine.autograd.forward_as_plain`); the state records what the forward left
  however it ends.
* :class:`Rerun`: the backward's re-run. Keyword tensors that require grad become fresh leaves
  (their gradients are returned by the node); parameters with backward hooks are replaced by
  detached aliases (``torch.func.functional_call``), so their hooks fire once, in the outer
  backward that receives the node's gradients, not also inside the node; a tensor that requires
  grad but is none of the node's inputs is reported (its gradient would be lost).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.utils.stateless
from torch import nn

from ..errors import InvalidArgumentError, ModifiedInputError
from ..replay import ForwardState
from .autograd import first_unregistered_leaf, forward_as_plain, reentrant_refused, vjp

__all__ = [
    "Rerun",
    "any_changed",
    "changed_in_place",
    "check_versions",
    "first_forward",
    "input_versions",
    "output_grads",
]


def first_forward(
    state: ForwardState, label: str, fn: Callable[..., Any], /, *args: Any, **kwargs: Any
) -> Any:
    """``fn(*args, **kwargs)`` (the block ``label`` names) as a node's first forward: grad
    mode on, nothing kept for backward; ``state.forward_finished()`` runs however it ends (it
    releases the RNG lock; it records nothing when the forward raised). A forward that
    changes a tensor it was given in place raises :class:`~revckpt.ModifiedInputError` (see
    :func:`changed_in_place`)."""
    versions = input_versions(args, kwargs)
    try:
        with forward_as_plain():
            out = fn(*args, **kwargs)
    except BaseException:
        state.forward_finished(completed=False)
        raise
    state.forward_finished()
    check_versions(versions, label)
    return out


def input_versions(args: Sequence[Any], kwargs: dict[str, Any]) -> list[tuple[torch.Tensor, int]]:
    """The tensors among a call's arguments (and in its lists, tuples and dicts) with their
    version counters, for :func:`check_versions` after the call. Not inference tensors (no
    version counter, and nothing outside inference mode can change them in place); none while
    compiling (the compiler plans its own recompute)."""
    if torch.compiler.is_compiling():
        return []
    found: list[tuple[torch.Tensor, int]] = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            _add(found, a)
        elif isinstance(a, (list, tuple, dict)):  # a list of tensors, a branch's keywords
            for t in a.values() if isinstance(a, dict) else a:
                if isinstance(t, torch.Tensor):
                    _add(found, t)
    return found


def _add(found: list[tuple[torch.Tensor, int]], t: torch.Tensor) -> None:
    if not t.is_inference():  # no version counter
        found.append((t, t._version))


def any_changed(versions: list[tuple[torch.Tensor, int]]) -> bool:
    """Whether a tensor of ``versions`` (:func:`input_versions`) was changed in place since."""
    return any(t._version != v for t, v in versions)


def check_versions(versions: list[tuple[torch.Tensor, int]], label: str) -> None:
    """Raises :func:`changed_in_place` when a tensor of ``versions`` changed since."""
    if any_changed(versions):
        raise changed_in_place(label)


def changed_in_place(label: str) -> ModifiedInputError:
    """The error for a recomputed block that changed its input in place: its recompute would
    start from the changed value (plain autograd has no recompute, so there it is fine)."""
    return ModifiedInputError(
        f"{label} changed a tensor it was given in place (e.g. nn.ReLU(inplace=True) or x.add_ "
        "on its input), so a recompute would start from the changed value. Make that operation "
        "out of place (inplace=False), start the recomputed segment one block earlier, so that "
        "the changed tensor is made inside it, or store this block"
    )


class Rerun:
    """The re-run of a block in backward, differentiating its node's inputs.

    ``params``: the block's trainable parameters, in the order the node takes them;
    ``kwargs``: its keyword arguments, of which ``grad_kwargs`` name the tensors that require
    grad. Call it with the positional arguments (under the caller's replay and grad mode);
    :meth:`sources` are the tensors to differentiate, in the order the node returns their
    gradients: the given leaves, then :attr:`params`, then :attr:`kw_leaves`.
    """

    __slots__ = ("aliases", "fn", "kw_leaves", "kwargs", "own", "owner", "params")

    def __init__(
        self,
        fn: Callable[..., Any],
        params: tuple[torch.Tensor, ...],
        kwargs: dict[str, Any],
        grad_kwargs: tuple[str, ...],
        *,
        label: str,
        modules: tuple[nn.Module, ...] = (),
        own: tuple[nn.Module, ...] | None = None,
    ) -> None:
        self.fn = fn
        self.kw_leaves: tuple[torch.Tensor, ...] = ()
        if grad_kwargs:
            kwargs = dict(kwargs)
            for name in grad_kwargs:
                kwargs[name] = kwargs[name].detach().requires_grad_(True)
            self.kw_leaves = tuple(kwargs[name] for name in grad_kwargs)
        self.kwargs = kwargs
        self.aliases: dict[str, torch.Tensor] | None = None
        self.owner: nn.Module | None = None
        # the modules whose trainable parameters the node takes (not those a closure reaches)
        self.own = own if own is not None else (fn,) if isinstance(fn, nn.Module) else ()
        # a parameter frozen since the forward is differentiated through an alias too (the
        # forward recorded it; its AccumulateGrad drops the gradient, as in plain autograd)
        if any(p._backward_hooks or not p.requires_grad for p in params):
            self.owner = _owner_of(fn, params, modules, label)
            alias = {id(p): p.detach().requires_grad_(True) for p in params}
            self.aliases = {name: alias[id(p)] for name, p in _places(self.owner, alias)}
            params = tuple(alias[id(p)] for p in params)
        self.params = params

    def __call__(self, *args: Any) -> Any:
        if self.aliases is not None:
            try:
                return self._aliased(args)
            finally:  # a hook that froze a weight once used froze its alias: ours, used so
                for alias in self.aliases.values():
                    alias.requires_grad_(True)
        return self.fn(*args, **self.kwargs)

    def _aliased(self, args: tuple[Any, ...]) -> Any:
        fn, aliases, owner = self.fn, self.aliases, self.owner
        assert aliases is not None
        # every place of a parameter is named (a weight tied to another's), once per module:
        # tie_weights would swap a module reached by two paths twice, and its restore left the
        # alias in the module (the model trained a detached copy)
        if fn is owner:
            return torch.func.functional_call(
                fn, aliases, args, self.kwargs, strict=False, tie_weights=False
            )
        assert _reparametrized is not None and owner is not None  # (by _owner_of)
        with _reparametrized(owner, aliases, tie_weights=False):  # a bound forward
            return fn(*args, **self.kwargs)

    def sources(self, leaves: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """The tensors to differentiate: ``leaves`` (the rebuilt inputs), the parameters (or
        their aliases) and the keyword leaves."""
        return (*leaves, *self.params, *self.kw_leaves)

    def unregistered(self, out: Any, sources: tuple[torch.Tensor, ...]) -> torch.Tensor | None:
        """A tensor ``out`` depends on that requires grad but is not in ``sources`` (its
        gradient would be lost), or ``None`` (the graph is walked once per block). A parameter
        of the block that was frozen in its forward and trains now is not one: the forward did
        not record it, so plain autograd gives it no gradient from this call either."""
        while True:
            leaf = first_unregistered_leaf(self.fn, out, sources)
            if leaf is None or not isinstance(leaf, nn.Parameter):
                return leaf
            if not any(leaf is p for m in self.own for p in m.parameters()):
                return leaf  # a closure's module's, say: not among the node's inputs
            sources = (*sources, leaf)  # the block's own: look on for another


def _places(owner: nn.Module, wanted: Mapping[int, Any]) -> list[tuple[str, torch.Tensor]]:
    """Each place in ``owner`` that holds a parameter in ``wanted`` (by id), by one name per
    holding module: a parameter tied to another module's is named in both, a module reached
    by two paths (a submodule a branch also holds) once."""
    places: dict[tuple[int, str], tuple[str, torch.Tensor]] = {}
    for prefix, m in owner.named_modules(remove_duplicate=False):
        for attr, p in m._parameters.items():
            if p is not None and id(p) in wanted:
                places.setdefault((id(m), attr), (f"{prefix}.{attr}" if prefix else attr, p))
    return list(places.values())


def _owner_of(
    fn: Callable[..., Any],
    params: tuple[torch.Tensor, ...],
    modules: tuple[nn.Module, ...],
    label: str,
) -> nn.Module:
    """The module whose parameters the recompute swaps for detached aliases (a parameter with
    a backward hook would otherwise fire it in the recompute and again when the node hands
    its gradient over): ``fn`` itself, or one of the ``modules`` it calls holding them all."""
    wanted = {id(p) for p in params}
    for module in (fn, *modules) if isinstance(fn, nn.Module) else modules:
        usable = module is fn or _reparametrized is not None
        if usable and wanted <= {id(p) for p in module.parameters()}:
            return module
    raise InvalidArgumentError(
        f"{label}: a parameter has a backward hook (or was frozen since the forward), which "
        "the recompute runs through detached aliases of the parameters, and no one module it "
        "calls holds them all; pass the block as an nn.Module (one holding every parameter it "
        "uses)"
    )


# torch.func.functional_call's machinery, for a function of a module (its bound forward with
# other arguments bound): it swaps the module's parameters for the call
_reparametrized = getattr(torch.nn.utils.stateless, "_reparametrize_module", None)


def output_grads(
    outs: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor | None],
    sources: tuple[torch.Tensor, ...],
) -> tuple[torch.Tensor | None, ...]:
    """The VJP of the re-run outputs ``outs`` with the node's incoming ``grads`` (each cast to
    its output's dtype: a low-precision re-run), for ``sources``; outputs without a gradient or
    a graph are skipped."""
    pairs = [
        (o, g if g.dtype == o.dtype else g.to(o.dtype))
        for o, g in zip(outs, grads, strict=True)
        if g is not None and o.requires_grad
    ]
    if not pairs:
        return (None,) * len(sources)
    if len(pairs) == 1:
        return vjp(pairs[0][0], sources, pairs[0][1])
    with reentrant_refused():
        return torch.autograd.grad(
            [o for o, _ in pairs], sources, [g for _, g in pairs], allow_unused=True
        )
