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
frozen BatchNorm statistics through :mod:`revckpt.replay`. The nodes and the backward walk are
in :mod:`revckpt.layers.rebuild`; the half steps of a stack are built once and rebuilt only
when its blocks, their branches or their couplings change.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Literal

import torch
from torch import nn

from ..approx.recompute import Approx
from ..engine.autograd import grad_keywords, module_targets, refuse_functorch
from ..engine.rerun import input_versions
from ..errors import InvalidArgumentError, InvalidInputTypeError
from ..replay import devices_of
from .coupling import Coupling, ScaledCoupling, make_coupling
from .grid import GridCoupling, recorded
from .rebuild import ReconstructionWarning, StackCall, auto_tolerance
from .steps import HalfSteps, StackRun

__all__ = ["ReconstructionWarning", "ReversibleBlock", "ReversibleSequential", "ReversibleUnit"]

Streams = tuple[torch.Tensor, torch.Tensor]

# what to do inside a torch.func transform, for a stack of either kind
_PLAINLY = (
    "Run the stack's blocks in a loop of your own (x1, x2 = block(x1, x2) for each of "
    "stack.blocks), which plain autograd differentiates; for a model make_reversible "
    "converted, set revckpt.inplace.reversible_layers(model).reversible = False"
)


def _call(branch: Callable[..., Any], u: torch.Tensor, kwargs: dict[str, Any]) -> Any:
    return branch(u, **kwargs) if kwargs else branch(u)


def _halves(x: torch.Tensor, dim: int, owner: str) -> Streams:
    """``x`` split into two equal streams along ``dim``, or an error saying how to fix it."""
    tuple_too = ", or pass the two streams as a tuple (x1, x2)" if owner != "ReversibleUnit" else ""
    if x.dim() == 0:
        raise InvalidArgumentError(
            f"{owner} got a 0-dimensional (scalar) input; it splits one tensor into two equal "
            f"streams along split_dim={dim}: pass a tensor with an even-sized dimension "
            f"there{tuple_too}"
        )
    size = x.shape[dim]
    if size % 2:
        raise InvalidArgumentError(
            f"cannot split an input of shape {tuple(x.shape)} into two equal streams along "
            f"dim {dim} (size {size} is odd); pad that dimension to an even size or choose "
            f"another split_dim{tuple_too}"
        )
    x1, x2 = x.chunk(2, dim=dim)
    return x1, x2


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


class ReversibleBlock(nn.Module):
    """Two-stream reversible block ``(x1, x2) -> (y1, y2)``.

    With both branches: ``y1 = c(x1, f(x2))``, ``y2 = c_g(x2, g(y1))``, where ``c`` is the
    coupling's ``combine`` (``x + h`` for ``"additive"``) and ``c_g`` the ``g_coupling``'s
    (default: the same coupling); with ``swap=True`` the block returns ``(y2, y1)``. With
    ``g=None`` the block updates one stream and swaps them: ``(y1, y2) = (x2, c(x1, f(x2)))``,
    so a stack of such blocks updates the two streams alternately.

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
        g_coupling: str | Coupling | None = None,
        swap: bool = False,
    ) -> None:
        super().__init__()
        if g is None and (g_coupling is not None or swap):
            raise InvalidArgumentError(
                "a ReversibleBlock without g updates one stream and swaps the two already: "
                "g_coupling= and swap= need a g branch"
            )
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
        self.g_coupling = self.coupling if g_coupling is None else make_coupling(g_coupling)
        self._swap = bool(swap)

    @property
    def swap(self) -> bool:
        """Whether the block returns ``(y2, y1)`` (fixed at construction)."""
        return self._swap

    def _branch(self, which: str, u: torch.Tensor, x: torch.Tensor, kwargs: dict[str, Any]) -> Any:
        h = _call(self.f if which == "f" else self.g, u, kwargs)
        (self.coupling if which == "f" else self.g_coupling).check(x, h, branch=which)
        return h

    def forward(self, x1: torch.Tensor, x2: torch.Tensor, **kwargs: Any) -> Streams:
        y1 = self.coupling.combine(x1, self._branch("f", x2, x1, kwargs))
        if self.g is None:
            return x2, y1
        y2 = self.g_coupling.combine(x2, self._branch("g", y1, x2, kwargs))
        return (y2, y1) if self._swap else (y1, y2)

    def inverse(self, y1: torch.Tensor, y2: torch.Tensor, **kwargs: Any) -> Streams:
        """The input ``(x1, x2)`` that produced ``(y1, y2)``."""
        if self.g is None:
            return self.coupling.separate(y2, self._branch("f", y1, y2, kwargs)), y1
        if self._swap:
            y1, y2 = y2, y1
        x2 = self.g_coupling.separate(y2, self._branch("g", y1, y2, kwargs))
        return self.coupling.separate(y1, self._branch("f", x2, y1, kwargs)), x2

    def extra_repr(self) -> str:
        text = f"coupling={self.coupling!r}"
        if self.g_coupling is not self.coupling:
            text += f", g_coupling={self.g_coupling!r}"
        text += f", branches={'f' if self.g is None else 'f, g'}"
        return text + (", swap=True" if self._swap else "")


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
            end of the walk; ``None`` for a block not measured). ``"auto"`` (default): block
            0's input is sampled (every reconstruction error above reaches it) and anchors
            compared whole, the other blocks not measured, against a tolerance far above
            round-off (1e-2 for float32 streams, ``64 * eps`` of a lower-precision dtype or of
            the bf16 recompute; where every block is anchored, a scaled coupling's rebuild
            gets ``4 * eps / scale``, at most 2: its rounding is amplified by ``1 / scale``,
            as is a recompute's difference) that catches a branch which is not invertible or whose
            recompute differs from its forward, and always raises. ``None``: no check
            (nothing sampled).
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
        if anchor_every is not None and not _positive_int(anchor_every):
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
        #: the first anchored block (then every ``anchor_every``-th): 0 keeps the stack input;
        #: a stack whose input is cheap to rebuild exactly may start later
        self.first_anchor = 0
        self.approx = approx
        self.last_drift: list[float | None] = []
        self._half_steps: HalfSteps | None = None

    def _checked_dtype(self, x: torch.Tensor) -> torch.dtype:
        """The dtype the default check's tolerance is for: the streams', or the recompute's."""
        dtype = x.dtype if self.approx is None else self.approx.recompute_dtype or x.dtype
        return dtype if dtype.is_floating_point else torch.float32

    def _tolerance(self, x: torch.Tensor) -> float | None:
        if self.check_inverse != "auto":
            return self.check_inverse
        return auto_tolerance(self._checked_dtype(x))

    def _streams(self, x: torch.Tensor | Streams) -> Streams:
        if isinstance(x, (tuple, list)):
            if len(x) != 2 or not all(isinstance(t, torch.Tensor) for t in x):
                raise InvalidInputTypeError(
                    "ReversibleSequential takes one tensor (split in two) or a tuple of two "
                    f"tensors (x1, x2); got a {type(x).__name__} of {len(x)} items"
                )
            return x[0], x[1]
        if isinstance(x, torch.Tensor):
            return _halves(x, self.split_dim, "ReversibleSequential")
        raise InvalidInputTypeError(
            f"ReversibleSequential takes a tensor or a tuple (x1, x2), got {type(x).__name__}"
        )

    def _steps(self) -> HalfSteps:
        """The cached half steps, rebuilt when the blocks, a branch, a coupling or
        ``anchor_every`` changed since."""
        blocks = tuple(self.blocks._modules.values())
        steps = getattr(self, "_half_steps", None)
        first = self.first_anchor
        if steps is None or not steps.current(blocks, self.anchor_every, first):
            steps = self._half_steps = HalfSteps(blocks, self.anchor_every, first)
        return steps

    def forward(self, x: torch.Tensor | Streams, **kwargs: Any) -> torch.Tensor | Streams:
        tuple_mode = isinstance(x, (tuple, list))
        x1, x2 = self._streams(x)
        run = self.stepwise(x1, x2, **kwargs)
        if run is None:
            for block in self.blocks:
                x1, x2 = block(x1, x2, **kwargs)
            return (x1, x2) if tuple_mode else torch.cat([x1, x2], dim=self.split_dim)
        for i in range(len(self.blocks)):
            run.block(i)
        out = run.finish(None if tuple_mode else self.split_dim)
        return tuple(out) if tuple_mode else out

    def stepwise(self, x1: torch.Tensor, x2: torch.Tensor, **kwargs: Any) -> StackRun | None:
        """Start one forward call to be driven block by block (``run.block(i)`` for ``i`` in
        order, then ``run.finish(dim)``), as :meth:`forward` does and as a model converted in
        place does from its own loop; ``None`` when nothing needs a graph (``no_grad``, or no
        input, keyword tensor or parameter requiring grad): then call the blocks plainly."""
        grad_kwargs = grad_keywords(kwargs)
        # a recorded forward (jit.trace, export) is for inference: the plain forward, which
        # its graph can hold (the half-step nodes carry Python objects it cannot)
        plan = self._steps() if torch.is_grad_enabled() and not recorded() else None
        # Looked up per call (cached per branch, rescanned when its modules or parameters
        # change): a parameter frozen or unfrozen since, or swapped by functional_call.
        targets = [module_targets(step.branch) for step in plan.steps] if plan else []
        needs_graph = plan is not None and (
            x1.requires_grad or x2.requires_grad or bool(grad_kwargs) or any(p for p, _ in targets)
        )
        if not needs_graph:
            return None
        assert plan is not None
        refuse_functorch(type(self).__name__, "reversible", _PLAINLY)
        exact = any(isinstance(step.coupling, GridCoupling) for step in plan.steps)
        strict = self.check_inverse == "auto"
        call = StackCall(
            kwargs=kwargs,
            grad_kwargs=grad_kwargs,
            # an exact stack rebuilds bit for bit: by default any drift is refused (a
            # recompute that differs), not only one past the floating-point tolerance
            check_inverse=0.0 if exact and strict else self._tolerance(x1),
            strict=strict,
            scaled=any(isinstance(step.coupling, ScaledCoupling) for step in plan.steps),
            exact=exact,
            anchored=self.anchor_every == 1,
            # every input anchored: the drift checked at a scaled coupling is one rebuild's,
            # amplified by 1 / scale, as is a recompute's difference (rebuild._anchored_tolerance)
            anchored_eps=(
                torch.finfo(self._checked_dtype(x1)).eps
                if strict and not exact and self.anchor_every == 1
                else None
            ),
            recompute_dtype=None if self.approx is None else self.approx.recompute_dtype,
            on_drift=self.on_drift,
            drift=[None] * len(self.blocks),
            devices=devices_of(x1, x2, kwargs, self),
            kw_versions=input_versions((), kwargs),
        )
        self.last_drift = call.drift
        return StackRun(plan, call, targets, x1, x2, [kwargs[k] for k in grad_kwargs])


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
        x1, x2 = _halves(x, self.split_dim, "ReversibleUnit")
        y1, y2 = self.block(x1, x2, **kwargs)
        return torch.cat([y1, y2], dim=self.split_dim)
