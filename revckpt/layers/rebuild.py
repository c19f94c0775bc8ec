"""The reconstruct-from-output autograd of :class:`~revckpt.layers.ReversibleSequential`.

The stack is a chain of *half steps*, each updating one stream from the other,
``s[target] = combine(s[target], branch(s[other]))``: one :class:`HalfStepNode` each, which
keeps nothing for backward (but, at anchors, its exact inputs), and one :class:`OutputNode`
that keeps the stack's output and seeds the backward walk. In backward each half step re-runs
its branch once through :class:`revckpt.engine.rerun.Rerun` (keyword leaves, hooked
parameters, the unregistered-tensor check, replay of the forward's state), rebuilds its
target's input from ``separate(y, h)`` and differentiates ``combine(a, h)``. The drift of the
rebuilt inputs is measured and reported here too (:class:`ReconstructionWarning`).
"""

from __future__ import annotations

import contextlib
import functools
import sys
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..engine.autograd import differentiable_once, vjp
from ..engine.rerun import Rerun, any_changed, first_forward
from ..errors import InvalidArgumentError, ModifiedInputError, RevckptError
from ..replay import ForwardState
from .coupling import Coupling, ScaledCoupling
from .drift import ReconstructionWarning, auto_tolerance, finish_drift, record_drift, sample
from .grid import GridCoupling

__all__ = [
    "FORWARD_AD_WAY_OUT",
    "HalfStep",
    "HalfStepNode",
    "OutputNode",
    "ReconstructionWarning",
    "StackCall",
    "auto_tolerance",
]

Targets = tuple[tuple[torch.Tensor, ...], tuple[nn.Module, ...]]

# the message of a double backward through a stack: the way out of a make_reversible model
_STACK_WAY_OUT = (
    "A model converted by make_reversible runs it exactly with "
    "revckpt.inplace.reversible_layers(model).mode = 'checkpoint'. "
)
#: the way out of forward-mode AD through a stack
FORWARD_AD_WAY_OUT = (
    "A model converted by make_reversible runs it with "
    "revckpt.inplace.reversible_layers(model).mode = 'checkpoint' (or 'store'); a "
    "ReversibleSequential, called plainly (its blocks one after the other)"
)


@dataclass
class StackCall:
    """State shared by the nodes of one forward call of a ReversibleSequential.

    In backward, ``values`` holds the current value of every stream, starting from the output;
    each half step rebuilds its target's previous value and puts it back, so exactly one value
    per stream is alive.
    """

    kwargs: dict[str, Any]
    grad_kwargs: tuple[str, ...]
    check_inverse: float | None
    on_drift: str
    recompute_dtype: torch.dtype | None
    drift: list[float | None]
    devices: list[torch.device]
    strict: bool = False  # the default check: a drift past it raises whatever on_drift says
    scaled: bool = False  # a coupling divides by a scale (ScaledCoupling): drift is expected
    exact: bool = False  # couplings on the grid (GridCoupling): any drift is a recompute's
    anchored: bool = False  # every block input kept (anchor_every=1): said in the message
    pending: list[tuple[int, torch.Tensor, float | None]] = field(default_factory=list)
    # the default check's unit round-off where every input is anchored (None: not so): an
    # anchored scaled coupling's rebuild rounds by up to eps / scale, past the tolerance
    anchored_eps: float | None = None
    # the keyword tensors with their versions at the forward (a mask changed in place since
    # would reach every branch's recompute)
    kw_versions: list[tuple[torch.Tensor, int]] = field(default_factory=list)
    values: dict[int, torch.Tensor] = field(default_factory=dict)
    owned: set[int] = field(default_factory=set)  # streams whose value this walk created


@dataclass(frozen=True)
class HalfStep:
    """One half step: ``s[target] = combine(s[target], branch(s[other]))`` of block ``index``,
    built once per stack layout (the branch's parameters and normalisation layers are looked up
    per call: they may change between calls).

    ``anchor``: 0 keeps nothing, 1 keeps the target's input, 2 also the other stream (the first
    half step of an anchored block). ``linear``: ``s`` when the coupling is ``y = s * a + h``
    (exactly :class:`AdditiveCoupling`, ``s = 1``, or :class:`ScaledCoupling`; ``s = 0``: an
    input known to be zeros), which allows in-place updates and differentiating ``h`` alone
    (``da = s * dy``); ``None`` otherwise.
    """

    block: Any  # the ReversibleBlock
    which: str
    index: int
    target: int
    other: int
    anchor: int
    branch: nn.Module
    coupling: Coupling
    linear: float | None = field(init=False)
    label: str = field(init=False)

    def __post_init__(self) -> None:
        # the exact class must declare it: a subclass may change combine
        declared = "linear_scale" in type(self.coupling).__dict__
        object.__setattr__(self, "linear", self.coupling.linear_scale if declared else None)
        object.__setattr__(self, "label", f"branch {self.which} of reversible block {self.index}")

    def current(self) -> bool:
        """Whether the block still has this branch and coupling."""
        block = self.block
        if self.which == "f":
            return block.f is self.branch and block.coupling is self.coupling
        return block.g is self.branch and block.g_coupling is self.coupling


class HalfStepNode(torch.autograd.Function):
    """``y = combine(a, branch(u))`` as an autograd node that keeps nothing for backward
    (except, at anchors, its exact inputs). ``targets``: the branch's trainable parameters (the
    node's inputs after ``token``, before the keyword tensors) and its normalisation layers."""

    @staticmethod
    def forward(
        ctx: Any,
        call: StackCall,
        step: HalfStep,
        targets: Targets,
        a: torch.Tensor,
        u: torch.Tensor,
        token: torch.Tensor,
        *tensors: torch.Tensor,
    ) -> torch.Tensor:
        anchor = step.anchor
        ctx.call, ctx.step, ctx.params = call, step, targets[0]
        ctx.set_materialize_grads(False)  # a stream the loss does not use: None, as autograd
        ctx.state = state = ForwardState.capture(
            norms=targets[1], devices=call.devices, modules=(step.branch,)
        )
        grid = isinstance(step.coupling, GridCoupling)  # exact: keeps the bits it drops
        forward = _eager_forward() if grid else first_forward
        label = f"branch {step.which} of a reversible block"
        h = _detached(forward(state, label, step.block._branch, step.which, u, a, call.kwargs))
        # y = a + h is written over the branch's fresh output when nothing else holds it: no
        # view or alias of its memory, and no Python reference but this frame's (a buffer, a
        # tensor the branch caches on itself, a keyword tensor returned as is all hold one)
        s, lost = step.linear, None
        if grid:
            y, lost = step.coupling.split(a, h)  # type: ignore[attr-defined]
        elif s is not None and _private_result(h, a) and sys.getrefcount(h) <= _LOCAL_REFS:
            y = h.add_(a) if s == 1 else h.add_(a, alpha=s)
        else:
            y = step.coupling.combine(a, h)
        del h
        # anchor 1 = keep a, 2 = keep a and u (the first half step of an anchored block)
        kept = (a, u)[:anchor] + (() if lost is None else (lost,))
        ctx.lost = lost is not None
        if kept:
            ctx.save_for_backward(*kept)
        # the default check samples block 0's inputs only: every reconstruction error above
        # reaches them, for 2 x 64 elements whatever the depth
        sampled = call.check_inverse is not None and not (call.strict and step.index)
        ctx.sample = sample(a) if sampled and not anchor else None
        return y

    @staticmethod
    @differentiable_once("a reversible block (revckpt.layers.ReversibleSequential)", _STACK_WAY_OUT)
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:
        call: StackCall = ctx.call
        step: HalfStep = ctx.step
        saved = ctx.saved_tensors if step.anchor or ctx.lost else ()
        exact, lost = saved[: step.anchor], saved[step.anchor] if ctx.lost else None
        if step.anchor == 2:
            call.values[step.other] = exact[1]
            call.owned.discard(step.other)
        if step.target not in call.values or step.other not in call.values:
            raise RevckptError(
                f"{step.label}: its backward ran before the stack's output was reached: a "
                "loss that depends on an intermediate stream (a hidden state between layers) "
                "but not on the stack's output cannot be rebuilt from the output; add a term "
                "on the output, or store those layers instead"
            )
        y, u = call.values[step.target], call.values[step.other]
        u_leaf = u.detach().requires_grad_(True)
        rerun = Rerun(step.branch, ctx.params, call.kwargs, call.grad_kwargs, label=step.label)
        replay = ctx.state.replay(label=step.label, exact_draws=True)
        with torch.enable_grad(), replay, _recompute_autocast(call, u):
            h = rerun(u_leaf)
            _check_registered(rerun, h, (u_leaf,), step)
            a = _rebuilt_input(ctx, call, step, y, h, exact, lost)
            if step.linear is not None:
                # y = s * a + h: dy/dh = identity, dy/da = s, so differentiate h alone.
                a_leaf, y_again = None, h
            else:
                a_leaf = a.detach().requires_grad_(True)
                y_again = step.coupling.combine(a_leaf, h)
        sources = rerun.sources((u_leaf,) if a_leaf is None else (u_leaf, a_leaf))
        grads = _stream_grads(y_again, sources, dy, linear=a_leaf is None)
        del y, h, y_again
        _hand_down(call, step, a)
        if dy is None:  # the loss does not use this stream: no gradient, as in plain autograd
            return (None,) * 6 + grads[1 if a_leaf is None else 2 :]
        da = _linear_grad(step.linear, dy, ctx) if a_leaf is None else _zeros_if_none(grads[1], a)
        du = _zeros_if_none(grads[0], u)
        rest = grads[1 if a_leaf is None else 2 :]
        return (None, None, None, da, du, None, *rest)


def _stream_grads(
    y: torch.Tensor, sources: tuple[torch.Tensor, ...], dy: torch.Tensor | None, *, linear: bool
) -> tuple[torch.Tensor | None, ...]:
    """The half step's VJP for ``sources`` (all ``None`` when ``dy`` is: a stream the loss
    does not use leaves its branch's parameters without ``.grad``, as plain autograd does)."""
    if dy is None:
        return (None,) * len(sources)
    if y.dtype != dy.dtype and linear:  # a low-precision recompute: h's dtype
        dy = dy.to(y.dtype)
    return vjp(y, sources, dy)


def _linear_grad(s: float | None, dy: torch.Tensor, ctx: Any) -> torch.Tensor | None:
    """``da = s * dy`` of ``y = s * a + h`` (``None`` when ``a`` needs no gradient)."""
    if s == 1:
        return dy
    if not ctx.needs_input_grad[3]:  # a: the fourth input of HalfStepNode.forward
        return None
    return dy * s


def _check_registered(
    rerun: Rerun, h: Any, leaves: tuple[torch.Tensor, ...], step: HalfStep
) -> None:
    leaf = rerun.unregistered(h, rerun.sources(leaves))
    if leaf is not None:
        raise InvalidArgumentError(
            f"{step.label} uses a tensor of shape {tuple(leaf.shape)} that requires grad but is "
            "not one of its registered parameters, so the reversible backward cannot return "
            "its gradient; register it as an nn.Parameter (or submodule) of the branch, or "
            "pass it as a keyword tensor"
        )


def _rebuilt_input(
    ctx: Any,
    call: StackCall,
    step: HalfStep,
    y: torch.Tensor,
    h: Any,
    exact: tuple[Any, ...],
    lost: torch.Tensor | None,
) -> torch.Tensor:
    """The half step's input ``a = separate(y, h)`` (``y`` overwritten when this walk owns it;
    an exact coupling's from the bits it kept), its drift recorded; at an anchor, the kept
    exact input instead."""
    with torch.no_grad():
        s = step.linear
        if isinstance(step.coupling, GridCoupling):
            a = step.coupling.rebuild(y, h, lost)
        elif s and step.target in call.owned and _sole_owner(y):
            a = y.sub_(h)  # a value this walk rebuilt, held by nobody else: overwrite
            a = a if s == 1 else a.div_(s)
        else:
            a = step.coupling.separate(y, _detached(h))
    # an input known to be zeros (the first layer's auxiliary stream) is rebuilt as y - h,
    # zeros where the recompute gives the forward's h: its drift is relative to y
    zeros = step.linear == 0.0
    if step.anchor:
        ref = y if zeros else None
        record_drift(call, step.index, a, exact[0], _anchored_tolerance(call, step), ref)
        return exact[0]
    if ctx.sample is not None:
        record_drift(call, step.index, sample(a), ctx.sample, None, sample(y) if zeros else None)
        ctx.sample = None  # used: nothing of the forward outlives the walk
    return a


def _anchored_tolerance(call: StackCall, step: HalfStep) -> float | None:
    """The default check's tolerance for an anchored rebuild through a scaled coupling, whose
    rounding (and a recompute's difference) the division amplifies by ``1 / scale``: at
    least ``4 eps / scale``, at most 2 (rounding alone reaches about 1 in bfloat16 at 2^-8,
    where every rebuilt value is lost); ``None``: the stack's (an additive half step, or
    not every input anchored)."""
    eps, tol = call.anchored_eps, call.check_inverse
    if eps is None or tol is None or not isinstance(step.coupling, ScaledCoupling):
        return None
    return max(tol, min(4 * eps / step.coupling.scale, 2.0))


def _hand_down(call: StackCall, step: HalfStep, a: torch.Tensor) -> None:
    """Put the rebuilt input back as its stream's current value, for the half step below."""
    if step.index == 0 and step.which == "f":
        # the walk is over: drop the rebuilt stack input, which would otherwise stay alive
        # (through the graph) while the layers before the stack run their backward
        call.values, call.owned = {}, set()
        finish_drift(call)
        return
    call.values[step.target] = a.detach()
    if step.anchor:
        call.owned.discard(step.target)  # an anchor is a kept forward tensor: never overwrite
    else:
        call.owned.add(step.target)


@functools.cache
def _eager_forward() -> Any:
    """:func:`first_forward` never compiled: an exact coupling rebuilds its input bit for bit
    only from a branch output its eager re-run in backward gives again, and a forward that
    ``torch.compile`` compiles (fused kernels) rounds differently, which the rebuild would
    multiply by ``1 / scale`` per layer."""
    return torch.compiler.disable(first_forward)


def _refs_of_a_local() -> int:
    h = torch.empty(0)
    return sys.getrefcount(h)


# sys.getrefcount of a tensor held by one local variable and nothing else
_LOCAL_REFS = _refs_of_a_local()


@functools.cache
def _sole_use_count() -> int:
    """The storage use count of a tensor that nothing else references (read off a fresh one)."""
    fresh = torch.empty(1)
    return torch._C._storage_Use_Count(fresh.untyped_storage()._cdata)


def _sole_owner(t: torch.Tensor) -> bool:
    """Whether ``t`` is the only tensor on its memory: no view, ``detach()`` or ``.data`` alias
    held by a hook, a cache or a module, so it may be overwritten."""
    if t._base is not None or t.requires_grad or torch.compiler.is_compiling():
        return False  # compiled: no storage counts to read (the reuse is only an optimisation)
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata) <= _sole_use_count()


def _private_result(h: Any, a: torch.Tensor) -> bool:
    """Whether ``a + h`` may be written into the branch output ``h``: a tensor of the result's
    shape, dtype and device that nothing else holds."""
    if not isinstance(h, torch.Tensor):
        return False
    if (
        h.shape != a.shape
        or h.dtype != torch.promote_types(a.dtype, h.dtype)
        or h.device != a.device
    ):
        return False
    return _sole_owner(h)


def _recompute_autocast(call: StackCall, u: torch.Tensor) -> contextlib.AbstractContextManager[Any]:
    if call.recompute_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(u.device.type, dtype=call.recompute_dtype)


def _detached(h: Any) -> Any:
    if isinstance(h, torch.Tensor):
        return h.detach()
    return type(h)(_detached(v) for v in h)


def _zeros_if_none(g: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(like) if g is None else g


class OutputNode(torch.autograd.Function):
    """The stack's output: keeps it (the only tensor kept) and seeds the backward walk."""

    @staticmethod
    def forward(
        ctx: Any,
        call: StackCall,
        ids: tuple[int, int],
        dim: int | None,
        y1: torch.Tensor,
        y2: torch.Tensor,
    ) -> Any:
        ctx.call, ctx.ids, ctx.dim = call, ids, dim
        ctx.set_materialize_grads(False)  # an unused stream's gradient stays None
        if dim is None:
            y1, y2 = y1.view_as(y1), y2.view_as(y2)
            ctx.save_for_backward(y1, y2)
            return y1, y2
        out = torch.cat([y1, y2], dim=dim)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    @differentiable_once("a reversible stack (revckpt.layers.ReversibleSequential)", _STACK_WAY_OUT)
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        try:
            saved = ctx.saved_tensors
        except RuntimeError as e:
            if "modified by an inplace operation" not in str(e):
                raise
            raise ModifiedInputError(
                "the output of a reversible stack was changed in place after the stack "
                "returned it (y.mul_(2), y += b), before the backward: the stack rebuilds "
                "every block's input from that output, so it needs it as it returned it (plain "
                "autograd, which stores every input, does not). Change it out of place "
                "(y = y * 2), or change a copy"
            ) from e
        if ctx.dim is None:
            y1, y2 = saved
            d1, d2 = grads
        else:
            y1, y2 = saved[0].chunk(2, dim=ctx.dim)
            whole = grads[0] if grads[0] is not None else torch.zeros_like(saved[0])
            d1, d2 = whole.chunk(2, dim=ctx.dim)
        if any_changed(ctx.call.kw_versions):
            raise ModifiedInputError(
                "a keyword tensor given to a reversible stack (an attention mask, a position "
                "table) was changed in place between its forward and its backward, so the "
                "branches' recomputes would run on other values than the forward did. Change a "
                "copy (mask = mask.clone()) or make the change after backward"
            )
        ctx.call.values = {ctx.ids[0]: y1, ctx.ids[1]: y2}
        ctx.call.owned = set()  # the output is the caller's: never overwritten
        return None, None, None, d1, d2
