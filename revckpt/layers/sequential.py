"""Reversible blocks and stacks: zero-storage backward by rebuilding inputs from outputs.

A :class:`ReversibleBlock` maps two streams ``(x1, x2)`` to ``(y1, y2)`` with two couplings
(see :mod:`revckpt.layers.coupling`); additive::

    y1 = x1 + F(x2)          x2 = y2 - G(y1)
    y2 = x2 + G(y1)          x1 = y1 - F(x2)

A :class:`ReversibleSequential` runs a stack of them keeping **only its output** for backward.
Each block is one autograd node; backward walks the stack from the top, and at each block

1. evaluates ``h = G(y1)`` once with autograd, rebuilds ``x2 = separate(y2, h)``, and
   differentiates ``combine(x2, h)`` for the gradients of ``y1``, ``x2`` and G's parameters;
2. does the same with ``F(x2)`` for ``x1``, F's parameters and the rest of ``x2``'s gradient;
3. hands the rebuilt ``(x1, x2)`` to the block below and drops its own ``(y1, y2)``.

So each branch runs once in forward and once in backward (no third evaluation), the memory held
between forward and backward is the output (plus RNG states of branches that draw random numbers
and, with ``anchor_every``, the anchored inputs), and the backward peak is one block's
activations whatever the depth. Parameter gradients are returned to autograd block by block, so
hooks, ``torch.autograd.grad``, gradient accumulation and DDP's bucketed all-reduce see ordinary
gradients. Every branch evaluation in backward replays the forward's RNG, autocast state and
frozen BatchNorm statistics through :mod:`revckpt.replay`.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from .._autograd import (
    differentiable_once,
    first_unregistered_leaf,
    forward_as_plain,
    grad_keywords,
    module_targets,
    vjp,
)
from ..approx.recompute import Approx
from ..errors import InvalidArgumentError, InvalidInputTypeError, ReconstructionError
from ..replay import ForwardState, devices_of
from .coupling import AdditiveCoupling, Coupling, make_coupling

__all__ = ["ReconstructionWarning", "ReversibleBlock", "ReversibleSequential", "ReversibleUnit"]

Streams = tuple[torch.Tensor, torch.Tensor]
Named = tuple[tuple[str, torch.Tensor], ...]


class ReconstructionWarning(UserWarning):
    """A rebuilt block input drifted from the original by more than ``check_inverse``."""


def _call(branch: Callable[..., Any], u: torch.Tensor, kwargs: dict[str, Any]) -> Any:
    return branch(u, **kwargs) if kwargs else branch(u)


class ReversibleBlock(nn.Module):
    """Two-stream reversible block ``(x1, x2) -> (y1, y2)``.

    With both branches: ``y1 = c(x1, f(x2))``, ``y2 = c(x2, g(y1))``, where ``c`` is the
    coupling's ``combine`` (``x + h`` for ``"additive"``). With ``g=None`` the block updates one
    stream and swaps them: ``(y1, y2) = (x2, c(x1, f(x2)))``, so a stack of such blocks updates
    the two streams alternately.

    Calling the block runs plain autograd (everything stored); inside a
    :class:`ReversibleSequential` it runs with the reversible backward. :meth:`inverse` rebuilds
    the input from the output. Keyword arguments of ``forward`` reach ``f`` and ``g``.
    """

    def __init__(
        self,
        f: Callable[..., Any],
        g: Callable[..., Any] | None = None,
        *,
        coupling: str | Coupling = "additive",
    ) -> None:
        super().__init__()
        for name, branch in (("f", f), ("g", g)):
            if branch is not None and not isinstance(branch, nn.Module):
                raise InvalidInputTypeError(
                    f"ReversibleBlock branch {name} must be an nn.Module (its parameters receive "
                    f"gradients from the reversible backward), got {type(branch).__name__}; wrap "
                    "a function as a module, e.g. class Branch(nn.Module) with a forward"
                )
        self.f = f
        self.g = g
        self.coupling = make_coupling(coupling)

    def _branch(self, which: str, u: torch.Tensor, x: torch.Tensor, kwargs: dict[str, Any]) -> Any:
        h = _call(self.f if which == "f" else self.g, u, kwargs)
        self.coupling.check(x, h, branch=which)
        return h

    def forward(self, x1: torch.Tensor, x2: torch.Tensor, **kwargs: Any) -> Streams:
        y1 = self.coupling.combine(x1, self._branch("f", x2, x1, kwargs))
        if self.g is None:
            return x2, y1
        return y1, self.coupling.combine(x2, self._branch("g", y1, x2, kwargs))

    def inverse(self, y1: torch.Tensor, y2: torch.Tensor, **kwargs: Any) -> Streams:
        """The input ``(x1, x2)`` that produced ``(y1, y2)``."""
        if self.g is None:
            return self.coupling.separate(y2, self._branch("f", y1, y2, kwargs)), y1
        x2 = self.coupling.separate(y2, self._branch("g", y1, y2, kwargs))
        return self.coupling.separate(y1, self._branch("f", x2, y1, kwargs)), x2

    def extra_repr(self) -> str:
        return f"coupling={self.coupling!r}, branches={'f' if self.g is None else 'f, g'}"


@dataclass
class _Chain:
    """State shared by the nodes of one forward call of a ReversibleSequential.

    The stack is a chain of *half steps*, each updating one stream from the other:
    ``s[target] = combine(s[target], branch(s[other]))``. In backward, ``values`` holds the
    current value of every stream, starting from the output; each half step rebuilds its
    target's previous value and puts it back, so exactly one value per stream is alive.
    """

    kwargs: dict[str, Any]
    grad_kwargs: tuple[str, ...]
    check_inverse: float | None
    on_drift: str
    recompute_dtype: torch.dtype | None
    drift: list[float | None]
    devices: list[torch.device]
    strict: bool = False  # the default check: a drift past it raises whatever on_drift says
    pending: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    values: dict[int, torch.Tensor] = field(default_factory=dict)
    owned: set[int] = field(default_factory=set)  # streams whose value this walk created


def _sample(x: torch.Tensor) -> torch.Tensor:
    """64 elements of ``x`` at evenly spaced positions (the same for the rebuilt tensor)."""
    flat = x.detach().reshape(-1)
    return flat[:: max(1, flat.numel() // 64)][:64].clone()


def _norms(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``[|a - b|, |b|]`` in float64, left on the device (read once per backward walk)."""
    a64, b64 = a.detach().double().reshape(-1), b.detach().double().reshape(-1)
    return torch.stack([(a64 - b64).norm(), b64.norm()])


def _auto_tolerance(dtype: torch.dtype) -> float:
    """The default check's tolerance: far above the round-off drift of a deep stack in the
    dtype the branches compute in (1e-2 for float32, 1/16 for float16, 1/2 for bfloat16), far
    below the O(1) error of a branch whose recompute differs from its forward."""
    return max(1e-2, 64 * torch.finfo(dtype).eps)


@dataclass(frozen=True)
class _Step:
    """One half step: ``s[target] = combine(s[target], branch(s[other]))`` of block ``index``.

    ``anchor``: 0 keeps nothing, 1 keeps the target's input, 2 also the other stream (the first
    half step of an anchored block). ``params``: the branch's trainable parameters, in the order
    they are passed to the node; ``norms``: its normalisation modules, for replay. ``additive``:
    the coupling is exactly :class:`AdditiveCoupling` (``y = a + h``), which allows in-place
    updates and differentiating ``h`` alone.
    """

    block: ReversibleBlock
    which: str
    index: int
    target: int
    other: int
    anchor: int
    params: tuple[torch.Tensor, ...]
    norms: tuple[nn.Module, ...]
    branch: nn.Module = field(init=False)
    additive: bool = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "branch", self.block.f if self.which == "f" else self.block.g)
        object.__setattr__(self, "additive", _plain_additive(self.block.coupling))


class _HalfStep(torch.autograd.Function):
    """``y = combine(a, branch(u))`` as an autograd node that keeps nothing for backward
    (except, at anchors, its exact inputs)."""

    @staticmethod
    def forward(
        ctx: Any,
        chain: _Chain,
        step: _Step,
        a: torch.Tensor,
        u: torch.Tensor,
        token: torch.Tensor,
        *tensors: torch.Tensor,
    ) -> torch.Tensor:
        block, anchor = step.block, step.anchor
        ctx.chain, ctx.step = chain, step
        ctx.state = state = ForwardState.capture(
            norms=step.norms, devices=chain.devices, modules=(step.branch,)
        )
        try:
            with forward_as_plain():
                h = _detached(block._branch(step.which, u, a, chain.kwargs))
        finally:
            state.forward_finished()
        # y = a + h is written over the branch's fresh output when nothing else holds it: no
        # view or alias of its memory, and no Python reference but this frame's (a buffer, a
        # tensor the branch caches on itself, a keyword tensor returned as is all hold one)
        private = step.additive and _private_result(h, a) and sys.getrefcount(h) <= _LOCAL_REFS
        y = h.add_(a) if private else block.coupling.combine(a, h)
        del h
        if anchor:  # 1 = keep a, 2 = keep a and u (the first half step of an anchored block)
            ctx.save_for_backward(*((a, u)[:anchor]))
        # the default check samples block 0's inputs only: every reconstruction error above
        # reaches them, for 2 x 64 elements whatever the depth
        sampled = chain.check_inverse is not None and not (chain.strict and step.index)
        ctx.sample = _sample(a) if sampled and not anchor else None
        return y

    @staticmethod
    @differentiable_once("a reversible block (revckpt.layers.ReversibleSequential)")
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:
        chain: _Chain = ctx.chain
        step: _Step = ctx.step
        target, anchor, values = step.target, step.anchor, chain.values
        exact = ctx.saved_tensors if anchor else ()
        if anchor == 2:
            values[step.other] = exact[1]
            chain.owned.discard(step.other)
        y, u = values[target], values[step.other]
        kw, kw_leaves = chain.kwargs, ()
        if chain.grad_kwargs:
            kw = dict(kw)
            for name in chain.grad_kwargs:
                kw[name] = kw[name].detach().requires_grad_(True)
            kw_leaves = tuple(kw[name] for name in chain.grad_kwargs)
        u_leaf = u.detach().requires_grad_(True)
        branch, params = step.branch, step.params
        hooked = any(p._backward_hooks for p in params)
        if hooked:
            # Differentiate through detached aliases of the parameters, so that their hooks fire
            # once, in the outer backward that receives these gradients, and not also here.
            names = {id(p): name for name, p in branch.named_parameters()}
            aliases = {names[id(p)]: p.detach().requires_grad_(True) for p in params}
            params = tuple(aliases.values())

        replay = ctx.state.replay(
            label=f"branch {step.which} of reversible block {step.index}", exact_draws=True
        )
        with torch.enable_grad(), replay, _recompute_autocast(chain, u):
            if hooked:
                h = torch.func.functional_call(branch, aliases, (u_leaf,), kw, strict=False)
            else:
                h = _call(branch, u_leaf, kw)
            leaf = first_unregistered_leaf(branch, h, (u_leaf, *params, *kw_leaves))
            if leaf is not None:
                raise InvalidArgumentError(
                    f"branch {step.which} of reversible block {step.index} uses a tensor of "
                    f"shape {tuple(leaf.shape)} that requires grad but is not one of its "
                    "registered parameters, so the reversible backward cannot return its "
                    "gradient; register it as an nn.Parameter (or submodule) of the branch, or "
                    "pass it as a keyword tensor"
                )
            with torch.no_grad():
                if step.additive and target in chain.owned and _sole_owner(y):
                    a = y.sub_(h)  # a value this walk rebuilt, held by nobody else: overwrite
                else:
                    a = step.block.coupling.separate(y, _detached(h))
            if anchor:
                _record_drift(chain, step.index, a, exact[0])
                a = exact[0]
            elif ctx.sample is not None:
                _record_drift(chain, step.index, _sample(a), ctx.sample)
                ctx.sample = None  # used: nothing of the forward outlives the walk
            if step.additive:
                # y = a + h: dy/da = dy/dh = identity, so differentiate h alone.
                a_leaf, y_again = None, h
            else:
                a_leaf = a.detach().requires_grad_(True)
                y_again = step.block.coupling.combine(a_leaf, h)
        sources = (
            (u_leaf, *params, *kw_leaves)
            if a_leaf is None
            else (u_leaf, *params, *kw_leaves, a_leaf)
        )
        if y_again.dtype != dy.dtype:  # a low-precision recompute: h is in its dtype
            dy = dy.to(y_again.dtype) if a_leaf is None else dy
        grads = vjp(y_again, sources, dy)
        del y, h, y_again
        if step.index == 0 and step.which == "f":
            # the walk is over: drop the rebuilt stack input, which would otherwise stay alive
            # (through the graph) while the layers before the stack run their backward
            chain.values, chain.owned = {}, set()
            _finish_drift(chain)
        else:
            values[target] = a.detach()
            if anchor:
                chain.owned.discard(target)  # an anchor is a kept forward tensor: never overwrite
            else:
                chain.owned.add(target)
        da = dy if a_leaf is None else _zeros_if_none(grads[-1], a)
        du = _zeros_if_none(grads[0], u)
        rest = grads[1 : 1 + len(params) + len(kw_leaves)]
        return (None, None, da, du, None, *rest)


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


def _plain_additive(coupling: Coupling) -> bool:
    return type(coupling) is AdditiveCoupling  # a subclass may redefine combine / separate


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


def _recompute_autocast(chain: _Chain, u: torch.Tensor) -> contextlib.AbstractContextManager[Any]:
    if chain.recompute_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(u.device.type, dtype=chain.recompute_dtype)


def _detached(h: Any) -> Any:
    if isinstance(h, torch.Tensor):
        return h.detach()
    return type(h)(_detached(v) for v in h)


def _zeros_if_none(g: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(like) if g is None else g


def _record_drift(chain: _Chain, index: int, rebuilt: torch.Tensor, exact: torch.Tensor) -> None:
    chain.pending.append((index, _norms(rebuilt, exact)))


def _finish_drift(chain: _Chain) -> None:
    """Read the drift of every rebuilt block input of this walk (one host read) into
    ``last_drift``, and warn or raise past ``check_inverse``."""
    if not chain.pending:
        return
    pending, chain.pending = chain.pending, []
    values = torch.stack([n for _, n in pending]).tolist()
    worst: tuple[float, int] | None = None
    for (index, _), (diff, ref) in zip(pending, values, strict=True):
        err = diff / ref if ref > 0 else (0.0 if diff == 0 else float("inf"))
        previous = chain.drift[index]
        chain.drift[index] = err if previous is None else max(previous, err)
        tol = chain.check_inverse
        if tol is not None and err > tol and (worst is None or err > worst[0]):
            worst = (err, index)
    if worst is None:
        return
    err, index = worst
    if chain.strict:
        raise ReconstructionError(
            f"reversible block {index}: its rebuilt input differs from the original by "
            f"{err:.3e} (relative), far more than round-off (default check_inverse='auto', "
            f"tolerance {chain.check_inverse:g}), so its gradients would be wrong. A branch "
            "must compute the same function of its input in forward and backward: no state "
            "that changes between them, no input other than its stream and the keyword "
            "tensors. Fix the branch, or store this block instead (or pass check_inverse=None "
            "to skip the check)"
        )
    message = (
        f"reversible block {index}: rebuilt input differs from the original by {err:.3e} "
        f"(relative) > check_inverse={chain.check_inverse:g}. Reconstruction drift grows with "
        "depth and with low precision: set anchor_every=k to store every k-th block input "
        "exactly, keep the streams in float32, or use an affine coupling with a smaller clamp"
    )
    if chain.on_drift == "raise":
        raise ReconstructionError(message)
    warnings.warn(message, ReconstructionWarning, stacklevel=2)


class _Output(torch.autograd.Function):
    """The stack's output: keeps it (the only tensor kept) and seeds the backward walk."""

    @staticmethod
    def forward(
        ctx: Any,
        chain: _Chain,
        ids: tuple[int, int],
        dim: int | None,
        y1: torch.Tensor,
        y2: torch.Tensor,
    ) -> Any:
        ctx.chain, ctx.ids, ctx.dim = chain, ids, dim
        if dim is None:
            y1, y2 = y1.view_as(y1), y2.view_as(y2)
            ctx.save_for_backward(y1, y2)
            return y1, y2
        out = torch.cat([y1, y2], dim=dim)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    @differentiable_once("a reversible stack (revckpt.layers.ReversibleSequential)")
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        saved = ctx.saved_tensors
        if ctx.dim is None:
            y1, y2 = saved
            d1, d2 = grads
        else:
            y1, y2 = saved[0].chunk(2, dim=ctx.dim)
            d1, d2 = grads[0].chunk(2, dim=ctx.dim)
        ctx.chain.values = {ctx.ids[0]: y1, ctx.ids[1]: y2}
        ctx.chain.owned = set()  # the output is the caller's: never overwritten
        return None, None, None, d1, d2


class ReversibleSequential(nn.Module):
    """A stack of :class:`ReversibleBlock` whose backward rebuilds activations from the output.

    ``forward(x, **kwargs)`` takes one tensor, split into two equal halves along ``split_dim``
    and returned concatenated, or a tuple ``(x1, x2)`` and returns a tuple. Keyword tensors
    (masks, positions) reach every ``f`` and ``g``; they may require grad.

    Args:
        *blocks: :class:`ReversibleBlock` instances (or one iterable of them).
        split_dim: the dimension split into the two streams for a single-tensor input.
        check_inverse: a relative tolerance: backward measures how far each rebuilt block input
            is from the original (64 sampled elements per stream, kept from the forward; the
            full tensor at anchors) and warns (``on_drift="warn"``) or raises
            :class:`~revckpt.ReconstructionError` (``on_drift="raise"``) past it. The last
            measured drift per block is in :attr:`last_drift` (read once per backward, at the
            end of the walk). ``"auto"`` (default): a tolerance far above round-off (1e-2 for
            float32 streams, ``64 * eps`` of a lower-precision dtype or of the bf16 recompute)
            that catches a branch which is not invertible or whose recompute differs from its
            forward, and always raises. ``None``: no check (nothing sampled).
        anchor_every: keep the inputs of blocks ``0, k, 2k, ...`` exactly, so reconstruction
            restarts from a stored anchor: drift is bounded by ``k`` blocks instead of the
            whole depth, for ``ceil(L / k)`` stored block inputs.
        approx: ``revckpt.approx.Approx(store=None, recompute_dtype=torch.bfloat16)`` re-runs
            ``f`` and ``g`` under bf16 autocast in backward (the forward and the streams stay in
            their dtype). The rebuilt inputs then carry the bf16 error of each branch output,
            so combine it with ``anchor_every`` on deep stacks; ``check_inverse`` reports it.

    Memory held between forward and backward: the output, plus 5,056 bytes (CPU) or 16 bytes
    (per CUDA device) for each branch call that drew random numbers, plus the anchors and the
    drift samples when enabled. ``no_grad`` and ``eval()`` forwards without inputs or
    parameters requiring grad run the blocks plainly and keep nothing.
    """

    def __init__(
        self,
        *blocks: ReversibleBlock | Iterable[ReversibleBlock],
        split_dim: int = -1,
        check_inverse: float | Literal["auto"] | None = "auto",
        on_drift: Literal["warn", "raise"] = "warn",
        anchor_every: int | None = None,
        approx: Approx | None = None,
    ) -> None:
        super().__init__()
        if len(blocks) == 1 and not isinstance(blocks[0], nn.Module):
            blocks = tuple(blocks[0])  # type: ignore[arg-type]
        for i, block in enumerate(blocks):
            if not isinstance(block, ReversibleBlock):
                raise InvalidInputTypeError(
                    f"block {i} is a {type(block).__name__}, not a coupling block; wrap its "
                    "residual branches as revckpt.layers.ReversibleBlock(f, g) (or convert a "
                    "residual stack with revckpt.layers.convert_to_reversible)"
                )
        if not blocks:
            raise InvalidArgumentError("ReversibleSequential needs at least one ReversibleBlock")
        if check_inverse not in (None, "auto") and not (
            isinstance(check_inverse, (int, float)) and check_inverse > 0
        ):
            raise InvalidArgumentError(
                f"check_inverse={check_inverse!r}: pass a positive relative tolerance such as "
                "1e-4, 'auto' (the default: catch a branch whose recompute differs from its "
                "forward) or None to skip the check"
            )
        if on_drift not in ("warn", "raise"):
            raise InvalidArgumentError(f"on_drift={on_drift!r}: use 'warn' or 'raise'")
        if anchor_every is not None and (
            isinstance(anchor_every, bool) or not isinstance(anchor_every, int) or anchor_every < 1
        ):
            raise InvalidArgumentError(
                f"anchor_every={anchor_every!r}: pass a positive int k to store every k-th block "
                "input, or None for no anchors"
            )
        if approx is not None and not isinstance(approx, Approx):
            raise InvalidInputTypeError(
                f"approx= takes a revckpt.approx.Approx(...), got {type(approx).__name__}"
            )
        if approx is not None and approx.codec is not None:
            raise InvalidArgumentError(
                f"ReversibleSequential keeps no block inputs to compress (approx={approx}); "
                "its streams stay in full precision. Use "
                "Approx(store=None, recompute_dtype=torch.bfloat16) for a bf16 recompute"
            )
        self.blocks = nn.ModuleList(blocks)
        self.split_dim = split_dim
        self.check_inverse = check_inverse
        self.on_drift = on_drift
        self.anchor_every = anchor_every
        self.approx = approx
        self.last_drift: list[float | None] = []

    def _tolerance(self, x: torch.Tensor) -> float | None:
        if self.check_inverse != "auto":
            return self.check_inverse
        dtype = x.dtype if self.approx is None else self.approx.recompute_dtype or x.dtype
        return _auto_tolerance(dtype if dtype.is_floating_point else torch.float32)

    def _split(self, x: torch.Tensor) -> Streams:
        if x.dim() == 0:
            raise InvalidArgumentError(
                "ReversibleSequential got a 0-dimensional (scalar) input; it splits one tensor "
                f"into two equal streams along split_dim={self.split_dim}: pass a tensor with "
                "an even-sized dimension there, or the two streams as a tuple (x1, x2)"
            )
        size = x.shape[self.split_dim]
        if size % 2:
            raise InvalidArgumentError(
                f"cannot split an input of shape {tuple(x.shape)} into two equal streams along "
                f"dim {self.split_dim} (size {size} is odd); pad that dimension to an even size, "
                "choose another split_dim, or pass the two streams as a tuple (x1, x2)"
            )
        x1, x2 = x.chunk(2, dim=self.split_dim)
        return x1, x2

    def forward(self, x: torch.Tensor | Streams, **kwargs: Any) -> torch.Tensor | Streams:
        tuple_mode = isinstance(x, (tuple, list))
        if tuple_mode:
            if len(x) != 2 or not all(isinstance(t, torch.Tensor) for t in x):
                raise InvalidInputTypeError(
                    "ReversibleSequential takes one tensor (split in two) or a tuple of two "
                    f"tensors (x1, x2); got a {type(x).__name__} of {len(x)} items"
                )
            x1, x2 = x
        elif isinstance(x, torch.Tensor):
            x1, x2 = self._split(x)
        else:
            raise InvalidInputTypeError(
                f"ReversibleSequential takes a tensor or a tuple (x1, x2), got {type(x).__name__}"
            )
        grad_kwargs = grad_keywords(kwargs)
        scans = (
            [(module_targets(b.f), module_targets(b.g)) for b in self.blocks]
            if torch.is_grad_enabled()
            else []
        )
        needs_graph = torch.is_grad_enabled() and (
            x1.requires_grad
            or x2.requires_grad
            or bool(grad_kwargs)
            or any(f[0] or g[0] for f, g in scans)
        )
        if not needs_graph:
            for block in self.blocks:
                x1, x2 = block(x1, x2, **kwargs)
            return (x1, x2) if tuple_mode else torch.cat([x1, x2], dim=self.split_dim)
        chain = _Chain(
            kwargs=kwargs,
            grad_kwargs=grad_kwargs,
            check_inverse=self._tolerance(x1),
            strict=self.check_inverse == "auto",
            recompute_dtype=None if self.approx is None else self.approx.recompute_dtype,
            on_drift=self.on_drift,
            drift=[None] * len(self.blocks),
            devices=devices_of(x1, x2, kwargs, self),
        )
        self.last_drift = chain.drift
        kw_tensors = [kwargs[k] for k in grad_kwargs]
        # Every half step joins the graph (even one whose inputs and registered parameters need
        # no gradient), so that its backward runs and can check what its branch really used.
        token = torch.empty(0, requires_grad=True)
        streams = {0: x1, 1: x2}
        ids = (0, 1)  # which stream is the block's first and second input
        for i, (block, (scan_f, scan_g)) in enumerate(zip(self.blocks, scans, strict=True)):
            anchored = self.anchor_every is not None and i % self.anchor_every == 0
            first, second = ids
            step = _Step(block, "f", i, first, second, 2 if anchored else 0, *scan_f)
            streams[first] = _HalfStep.apply(
                chain, step, streams[first], streams[second], token, *step.params, *kw_tensors
            )
            if block.g is None:
                ids = (second, first)
            else:
                step = _Step(block, "g", i, second, first, 1 if anchored else 0, *scan_g)
                streams[second] = _HalfStep.apply(
                    chain, step, streams[second], streams[first], token, *step.params, *kw_tensors
                )
        out = _Output.apply(
            chain, ids, None if tuple_mode else self.split_dim, streams[ids[0]], streams[ids[1]]
        )
        return tuple(out) if tuple_mode else out


class ReversibleUnit(nn.Module):
    """A :class:`ReversibleBlock` with one tensor in and out: the input is split into the two
    streams along ``split_dim`` and the output concatenated, so it fits a chain of ordinary
    blocks. Plainly called it stores like any block; a run of units inside a
    ``ReversibleSequential`` (what ``revckpt.schedule`` builds for a reversible segment) keeps
    nothing. ``state_dict`` keys: ``block.<...>``."""

    def __init__(self, block: ReversibleBlock, *, split_dim: int = -1) -> None:
        super().__init__()
        if not isinstance(block, ReversibleBlock):
            raise InvalidInputTypeError(
                f"ReversibleUnit wraps a ReversibleBlock, got {type(block).__name__}"
            )
        self.block = block
        self.split_dim = split_dim

    def forward(self, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        size = x.shape[self.split_dim] if x.dim() else 0
        if x.dim() == 0 or size % 2:
            raise InvalidArgumentError(
                f"cannot split an input of shape {tuple(x.shape)} into two equal streams along "
                f"dim {self.split_dim}; pad it to an even size or choose another split_dim"
            )
        x1, x2 = x.chunk(2, dim=self.split_dim)
        y1, y2 = self.block(x1, x2, **kwargs)
        return torch.cat([y1, y2], dim=self.split_dim)
