"""Planned blocks, in place: a block's ``forward`` is replaced on the instance only.

The module keeps its class, its parameters and its ``state_dict`` keys; the model's own
``forward`` (its loop over the blocks) is untouched. The installed forward runs the block
plainly in eval mode and under ``no_grad`` (one attribute read and one flag test; in eval
mode with gradients on it warns once that a backward there saves nothing), and in
training hands it to the block's runner (a strategy of :mod:`revckpt.inplace.runners`).
``copy.deepcopy`` of a planned model gives a planned copy; :func:`uninstall` (what
:func:`revckpt.restore` calls) removes every trace.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .._autocast import autocast_dtype
from ..engine.autograd import flatten_output
from ..errors import InvalidArgumentError, PlanWarning
from ..schedule.plan import warn_if_threads_differ
from ..strategy import kind_of
from .calls import HIDDEN_NAMES, Key, cache_index, carried_key, class_forward, drop_caches

__all__ = ["Planned", "Runner", "install", "is_fsdp", "planned", "uninstall"]

#: ``runner(block, fn, args, kwargs, key) -> output``: runs ``fn`` (the block's own forward).
Runner = Callable[[nn.Module, Callable[..., Any], tuple[Any, ...], dict[str, Any], Key], Any]

_ATTR = "_revckpt_planned"
REVERSIBLE_ATTR = "_revckpt_reversible"  # what revckpt.make_reversible puts on its layers


@dataclass
class Planned:
    """What is installed on one block."""

    fqn: str
    strategy: str
    runner: Runner
    original: Any = None  # an instance ``forward`` the block had before, if any
    key: Key | None = None  # where its hidden state is among its arguments (None: find it)
    limit: tuple[int, ...] | None = None  # the largest hidden-state shape the plan holds for
    dtype: torch.dtype | None = None  # the hidden state's dtype it was planned for
    autocast: torch.dtype | None = None  # the autocast dtype it was planned under (None: off)
    threads: int | None = None  # the intra-op threads its times were measured with
    recorder: Any = None  # set while tracing (revckpt.inplace.trace.Recorder)
    # the arguments that held tensors in the traced call (None: not traced, a saved plan)
    tensors: frozenset[Key] | None = None
    # the arguments warned about (shared by the blocks of one fit: one warning per argument)
    warned: set[Key] | None = None
    # left out of fit's plan: its output needed no gradient (frozen, on inputs that need none)
    off_graph: bool = False
    # the largest shape of each tensor argument the plan holds for (None: not recorded)
    arg_limits: dict[Key, tuple[int, ...]] | None = None
    # the model's parameters fit planned with, checked here (the first planned block's):
    # a revckpt.inplace.trainable.TrainedParameters
    trained: Any = None

    def function(self, block: nn.Module) -> Callable[..., Any]:
        if self.original is not None:
            return self.original
        # not types.MethodType, which Dynamo cannot trace: a graph break there made
        # torch.compile run the model's own forward eagerly and compile each block's forward
        # apart, recompiling per block (its name is guarded on) up to its limit of 8
        return class_forward(block)


def is_fsdp(module: nn.Module) -> bool:
    """Whether FSDP2's ``fully_shard`` manages the module (its class is FSDP's subclass)."""
    return type(module).__name__.startswith("FSDP") and callable(getattr(module, "unshard", None))


def planned(block: nn.Module) -> Planned | None:
    """What is installed on ``block``, or ``None``."""
    return block.__dict__.get(_ATTR)


def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The forward of a planned block (see the module docstring)."""
    info: Planned = self.__dict__[_ATTR]
    fn = info.function(self)
    if not (self.training and torch.is_grad_enabled()):
        if torch.is_grad_enabled() and info.strategy != "store":
            _warn_eval_backward()
        return fn(*args, **kwargs)
    if info.trained is not None:
        info.trained.check(info.fqn)
    args, kwargs = drop_caches(
        args, kwargs, f"{type(self).__name__} ({info.fqn})", layer=cache_index(self)
    )
    if info.off_graph:  # stored: what it returns says whether it kept anything
        return _off_graph(info, fn(*args, **kwargs))
    key = info.key if info.key is not None else carried_key(args, kwargs)
    if key is None:  # no hidden state to carry: nothing to plan
        if info.recorder is not None:  # fit's trace: its plan would hold for nothing
            raise InvalidArgumentError(_no_hidden_state(info, args, kwargs, "fit cannot plan it"))
        outcome = f"the block runs plainly and its strategy ({info.strategy}) saves nothing"
        warnings.warn(_no_hidden_state(info, args, kwargs, outcome), PlanWarning, stacklevel=1)
        return fn(*args, **kwargs)
    hidden = args[key] if isinstance(key, int) else kwargs.get(key)
    if info.limit is not None:
        _check_shape(info, hidden)
    if info.arg_limits:
        _check_argument_shapes(info, args, kwargs, key)
    if info.key is not None and isinstance(hidden, torch.Tensor):  # where fit traced it
        _check_dtype(info, hidden, self)
        _check_autocast(info, hidden)
    warn_if_threads_differ(info.threads)
    if info.tensors is not None and not torch.compiler.is_compiling():
        # (compiled, Hugging Face builds the causal mask eager runs leave out, and a warning
        # in traced code breaks the graph: six graphs for GPT-2's one)
        _warn_if_more_tensors(info, args, kwargs)
    if info.recorder is not None:
        info.recorder.called(self, args, kwargs)
    out = info.runner(self, fn, args, kwargs, key)
    if info.recorder is not None:
        info.recorder.returned(self, args, kwargs, out)
    return out


def tensor_sites(args: tuple[Any, ...], kwargs: dict[str, Any]) -> frozenset[Key]:
    """The positions and keyword names of a call's arguments that are tensors."""
    return frozenset(
        (*(i for i, a in enumerate(args) if isinstance(a, torch.Tensor)),
         *(k for k, v in kwargs.items() if isinstance(v, torch.Tensor)))
    )  # fmt: skip


def site_shapes(
    args: tuple[Any, ...], kwargs: dict[str, Any], sites: frozenset[Key]
) -> tuple[tuple[int, ...], ...]:
    """The shapes of a call's tensor arguments at ``sites``, in ``Plan.block_tensors``'
    order (sorted by name)."""
    values = [args[k] if isinstance(k, int) else kwargs[k] for k in sorted(sites, key=str)]
    return tuple(tuple(v.shape) for v in values)


def _check_argument_shapes(
    info: Planned, args: tuple[Any, ...], kwargs: dict[str, Any], key: Key
) -> None:
    """A tensor argument beside the hidden state larger than the traced call's (a longer
    encoder output a decoder layer attends to: 1.67x the budget, silently) is refused as a
    larger hidden state is: what the block keeps grows with it."""
    assert info.arg_limits is not None
    for site, limit in info.arg_limits.items():
        if site == key:
            continue  # the hidden state: _check_shape
        value = args[site] if isinstance(site, int) and site < len(args) else kwargs.get(site)
        # floating-point ones: what a block keeps grows with those (an encoder output, a
        # float mask); integer ones index (packed sequences' cu_seqlens: one entry per
        # sequence, more of them in as many tokens) and bool masks follow the hidden state
        if (
            isinstance(value, torch.Tensor)
            and value.is_floating_point()
            and not within(tuple(value.shape), limit)
        ):
            what = f"keyword {site!r}" if isinstance(site, str) else f"argument {site}"
            shape = tuple(value.shape)
            raise InvalidArgumentError(
                f"block {info.fqn} was planned for its {what} of shape {list(limit)} (the "
                f"example the plan was made on) and got {list(shape)}, and what it keeps "
                f"grows with it: {_larger(shape, limit, 'arguments')}"
            )


def _warn_if_more_tensors(info: Planned, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Warn, once per argument, for a tensor argument the traced call did not have
    (``None`` there): Hugging Face passes an attention mask only for a batch with padding, and
    that mask, and the attention kernels that keep more with one, are not in the plan."""
    extra = tensor_sites(args, kwargs) - info.tensors  # type: ignore[operator]
    warned = info.warned if info.warned is not None else set()
    for site in sorted(extra, key=str):
        value = args[site] if isinstance(site, int) else kwargs[site]
        if site in warned or value.dim() == 0:  # a scalar (Trainer's num_items_in_batch)
            continue
        warned.add(site)
        what = f"keyword {site!r}" if isinstance(site, str) else f"argument {site}"
        warnings.warn(
            f"revckpt: block {info.fqn} got a tensor as its {what}, which the example fit "
            "planned with did not give it (a Hugging Face attention mask comes only with "
            "padding): what it costs is not in the plan, whose memory budget may not hold. "
            "Fit on an example that has it (a padded batch)",
            PlanWarning,
            stacklevel=1,
        )


def _no_hidden_state(
    info: Planned, args: tuple[Any, ...], kwargs: dict[str, Any], outcome: str
) -> str:
    """Block ``info`` got no argument revckpt can take for its hidden state: ``outcome``."""
    given = [_kind(a) for a in args] + [f"{k}={_kind(v)}" for k, v in kwargs.items()]
    values = [*args, *kwargs.values()]
    if any(isinstance(v, torch.Tensor) and v.is_complex() for v in values):
        return (
            f"revckpt: block {info.fqn} was called with a complex tensor (it got "
            f"{', '.join(given)}) and no real floating-point one: complex hidden states are "
            f"not supported: {outcome}. Carry the state as real and imaginary parts "
            "(torch.view_as_real before the block, torch.view_as_complex inside it), or leave "
            "the block out of the plan (fit's blocks=..., convert's module_filter_fn=...)"
        )
    return (
        f"revckpt: block {info.fqn} was called with no floating-point tensor as a positional "
        f"argument or as a keyword named {', '.join(HIDDEN_NAMES)} (it got "
        f"{', '.join(given) or 'no arguments'}), so revckpt cannot tell which argument is its "
        f"hidden state: {outcome}. Pass the hidden state to the block as a tensor, "
        "positionally or under one of those names (a state in a tuple or dict: unpack it "
        "before the block), or leave a block without one (an embedding of integer ids) out "
        "of the plan (fit's blocks=..., convert's module_filter_fn=...)"
    )


def _kind(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"Tensor[{str(value.dtype).removeprefix('torch.')}]"
    return type(value).__name__


def _warn_eval_backward() -> None:
    """Say that planned blocks run plainly in eval mode with gradients on (as Hugging Face's
    gradient checkpointing does): a backward through them gets none of the plan's saving,
    which a loop calling ``model.eval()`` to switch dropout off would not expect. One message
    from one place: Python's warning filters show it once (the default), or as they are set."""
    warnings.warn(
        "revckpt: planned blocks run plainly in eval mode: with gradients on, a backward "
        "through this forward stores every activation and gets none of the plan's saving. "
        "To train without dropout, keep model.train() and set the dropout probabilities to "
        "0; to evaluate, wrap the forward in torch.no_grad()",
        PlanWarning,
        stacklevel=1,
    )


def within(shape: tuple[int, ...], limit: tuple[int, ...]) -> bool:
    """Whether a hidden state of ``shape`` is no larger in any dimension than ``limit`` (the
    example's, which a plan's memory budget holds for)."""
    return len(shape) == len(limit) and all(a <= b for a, b in zip(shape, limit, strict=True))


def _off_graph(info: Planned, out: Any) -> Any:
    """``out`` of a block fit left out of its plan (its output needed no gradient: frozen, on
    inputs that needed none; it kept nothing for backward), refused where it now needs one
    (unfrozen, or given an input that requires grad): it keeps activations the plan's budget
    does not count (a warm-up then unfreeze ran 2.2x over it, silently)."""
    if any(isinstance(t, torch.Tensor) and t.requires_grad for t in flatten_output(out)[0]):
        raise InvalidArgumentError(
            f"block {info.fqn} was left out of revckpt.fit's plan because its output needed no "
            "gradient (its parameters frozen, its inputs needing none), so it kept nothing for "
            "backward; now its output needs one (a parameter unfrozen, or an input that "
            "requires grad: Hugging Face's model.enable_input_require_grads() makes the "
            "embeddings' output need one, and Trainer(gradient_checkpointing=True) calls it) "
            "and it keeps its activations, which the plan's memory budget does not count. Fit "
            "again after the change (revckpt.restore(model); "
            "model.enable_input_require_grads(); revckpt.fit(model, example, ...)); with "
            "Trainer, leave gradient_checkpointing off: the plan replaces it"
        )
    return out


def _check_shape(info: Planned, hidden: Any) -> None:
    if not isinstance(hidden, torch.Tensor):
        return
    limit = info.limit
    assert limit is not None
    if within(tuple(hidden.shape), limit):
        return
    shape = tuple(hidden.shape)
    raise InvalidArgumentError(
        f"block {info.fqn} was planned for hidden states of shape {list(limit)} (the example "
        f"the plan was made on) and got {list(shape)}: {_larger(shape, limit, 'batches')}"
    )


def _larger(shape: tuple[int, ...], limit: tuple[int, ...], what: str) -> str:
    """Why a shape ``within`` refuses is refused, and what to do."""
    if len(shape) != len(limit):
        return (
            f"{len(shape)} dimensions where the plan has {len(limit)} (an unbatched input?), "
            "so revckpt cannot tell whether the plan's memory budget holds for it. Give the "
            "batch dimension the example had (x.unsqueeze(0)), or fit on such an input"
        )
    return (
        f"the memory plan holds for {what} no larger in any dimension. Plan for the largest "
        "batch you train on (revckpt.fit(model, largest_batch, ...))"
    )


def _check_dtype(info: Planned, hidden: torch.Tensor, block: nn.Module) -> None:
    """A hidden state wider than planned (``model.double()`` after a float32 fit) makes every
    tensor the block keeps larger: the memory plan no longer holds, as for a larger shape."""
    planned_as = info.dtype
    if planned_as is None or hidden.element_size() <= planned_as.itemsize:
        return
    weights = next((p.dtype for p in block.parameters() if p.is_floating_point()), None)
    cause = (
        f" (its parameters are {weights}: an input in another dtype than the model's?)"
        if weights is not None and weights != hidden.dtype
        else ""
    )
    raise InvalidArgumentError(
        f"block {info.fqn} was planned for {planned_as} hidden states (the example given to "
        f"revckpt.fit) and got {hidden.dtype}{cause}: every tensor it keeps is "
        f"{hidden.element_size() // planned_as.itemsize}x larger, so the memory plan no longer "
        "holds. Fit again after changing the model's dtype (revckpt.fit(model, example, ...))"
    )


def _check_autocast(info: Planned, hidden: torch.Tensor) -> None:
    """Planned under autocast and run without it (or in a wider dtype), a block keeps wider
    activations than planned, with the same hidden-state dtype: refused as a wider one is.
    Also on a bfloat16 or float64 model, where autocast often changes nothing: a layer that
    upcasts itself (``.float()``) keeps wider activations without it, which no dtype shows
    (a first relaxation ran such a plan 1.71x over its budget, silently)."""
    planned_as = info.autocast
    now = autocast_dtype(hidden.device.type)
    if now != planned_as and kind_of(info.strategy) in ("approx", "compress"):
        _refuse_lossy_autocast(info, planned_as, now)
    if planned_as is None or (now is not None and now.itemsize <= planned_as.itemsize):
        return
    running = "without autocast" if now is None else f"under autocast in {now}"
    raise InvalidArgumentError(
        f"block {info.fqn} was planned under torch.autocast in {planned_as} and runs "
        f"{running}: the activations it keeps can be wider than planned (on a bfloat16 or "
        "float64 model too, where a layer upcasts), so the memory plan no longer holds. Train "
        "under the autocast you fit under, or fit again without it"
    )


def _refuse_lossy_autocast(
    info: Planned, planned_as: torch.dtype | None, now: torch.dtype | None
) -> None:
    """A lossy block's gradient error was measured under the plan's autocast (or none):
    under another it rounds other values (an approx:bf16 plan fitted without autocast
    measured 3.5x its reported error under bf16 autocast, silently)."""

    def said(dtype: torch.dtype | None) -> str:
        return "without autocast" if dtype is None else f"under torch.autocast in {dtype}"

    raise InvalidArgumentError(
        f"block {info.fqn} ({info.strategy}) was planned {said(planned_as)} and runs "
        f"{said(now)}: its gradient error, which revckpt.fit measured against the error "
        "budget, differs under another autocast. Fit under the autocast you train with "
        "(with torch.autocast(...): revckpt.fit(model, example, ...); Trainer(bf16=True) "
        "trains under it)"
    )


class ModuleForward:
    """A ``forward`` revckpt installs on a module instance: a callable object holding the
    module, not a bound method, so ``torch.save(model)`` pickles it (a bound method pickles as
    ``getattr(module, "forward")``, which loads the class's forward: what was installed is
    dropped silently). Subclasses define ``__call__``."""

    __slots__ = ("block", "owner", "previous")

    def __init__(self, block: nn.Module, owner: Any = None, previous: Any = None) -> None:
        self.block = block
        # what it runs for (a plan, a conversion): in force while the block holds it
        self.owner = owner
        self.previous = previous  # the instance forward it replaced (None: the class's)

    def __getstate__(self) -> tuple[nn.Module, Any, Any]:
        return self.block, self.owner, self.previous

    def __setstate__(self, state: Any) -> None:
        # (a model pickled before ``owner`` and ``previous`` were kept: the block alone)
        self.block, self.owner, self.previous = (
            state if isinstance(state, tuple) else (state, None, None)
        )

    def plain(self, *args: Any, **kwargs: Any) -> Any:
        """What the block ran before revckpt installed this: once revckpt takes it off while a
        wrapper added after it (accelerate's hooks, ``block.forward = wrap(block.forward)``)
        still calls it, the wrapper stays and calls through to that."""
        if self.previous is not None:
            return self.previous(*args, **kwargs)
        return type(self.block).forward(self.block, *args, **kwargs)

    def installed_on(self, block: nn.Module) -> bool:
        """Whether this is ``block``'s ``forward`` still (nothing wrapped it since)."""
        return self is block.__dict__.get("forward") and self.block is block


class PlannedForward(ModuleForward):
    """The ``forward`` :func:`install` puts on a planned block (a fitted model saved with
    ``torch.save`` ran its step over budget when it was a bound method)."""

    __slots__ = ()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        info = self.block.__dict__.get(_ATTR)
        if info is None or (self.owner is not None and info is not self.owner):
            return self.plain(*args, **kwargs)  # restored under a wrapper added after it
        return forward(self.block, *args, **kwargs)


def install(block: nn.Module, info: Planned) -> None:
    """Install ``info`` on ``block`` (replacing what revckpt installed before)."""
    if REVERSIBLE_ATTR in block.__dict__:
        raise InvalidArgumentError(
            f"block {info.fqn} is a layer of a reversible stack (revckpt.make_reversible), "
            "which already keeps only the stack's output for backward: fit and convert do not "
            "plan its layers; plan a model that is not converted"
        )
    old = planned(block)
    if old is not None:
        info.original = old.original
    else:
        info.original = block.__dict__.get("forward")
    object.__setattr__(block, "forward", PlannedForward(block, info, info.original))
    object.__setattr__(block, _ATTR, info)


def uninstall(block: nn.Module) -> bool:
    """Remove what :func:`install` put on ``block``; ``False`` if nothing was there."""
    info = planned(block)
    if info is None:
        return False
    current = block.__dict__.get("forward")
    del block.__dict__[_ATTR]
    if not (isinstance(current, PlannedForward) and current.installed_on(block)):
        return True  # wrapped since: the wrapper stays, and calls through to the plain forward
    if info.original is not None:
        object.__setattr__(block, "forward", info.original)
    else:
        block.__dict__.pop("forward", None)
    return True
