"""One training step as :func:`revckpt.fit` runs it: the example split into arguments, the
loss found in the output, the step run with the model left as it was found, and its peak
measured (:func:`measure_step`); from a seed, with the planned blocks' gradients, to measure an
approx plan's gradient error against the store-all step's (:class:`Reference`)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from .._autocast import autocast_dtype
from .._numbers import relative
from ..errors import InvalidArgumentError, InvalidInputTypeError
from ..measure import MemoryMeter
from ..measure.state import preserved

__all__ = [
    "Gradients",
    "LossFn",
    "Reference",
    "block_parameters",
    "casts_in_step",
    "check_example_leaves",
    "error_parameters",
    "gradient_copies",
    "left_as_found",
    "loss_of",
    "measure_step",
    "measured_gradients",
    "run_step",
    "seed_step",
    "split_example",
]

LossFn = Callable[[Any], torch.Tensor] | None


def split_example(example: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """One batch as positional and keyword arguments: a tensor, a tuple (or list) of positional
    arguments, or a mapping of keyword arguments (Hugging Face style: a dict, or a tokenizer's
    ``BatchEncoding``)."""
    if isinstance(example, torch.Tensor):
        return (example,), {}
    if isinstance(example, (tuple, list)):
        return tuple(example), {}
    if isinstance(example, Mapping):
        if not all(isinstance(k, str) for k in example):
            raise InvalidInputTypeError("an example dict has string keys (keyword arguments)")
        return (), dict(example)
    raise InvalidInputTypeError(
        f"example is one batch: a tensor, a tuple of positional arguments or a mapping of "
        f"keyword arguments (dict(input_ids=..., labels=...)), got {type(example).__name__}"
    )


def check_example_leaves(example: Any) -> None:
    """Refuse an example tensor that requires grad and has a graph (``inputs_embeds`` made
    from a parameter outside the model): fit runs its step several times, and that graph can
    be differentiated once ("backward through the graph a second time", after a first step
    had added to the outside parameter's gradient)."""
    for t in tree_leaves(split_example(example)):
        if isinstance(t, torch.Tensor) and t.requires_grad and not t.is_leaf:
            raise InvalidArgumentError(
                f"the example holds a tensor of shape {tuple(t.shape)} that requires grad and "
                "was computed from other tensors (inputs_embeds made from a parameter outside "
                "the model?): fit runs the step several times, and that graph can be "
                "differentiated once. Pass it detached (t.detach().requires_grad_()): the "
                "plan is the same for your steps"
            )


def loss_of(out: Any, loss_fn: LossFn) -> torch.Tensor:
    """The step's loss: ``loss_fn(out)``; without one, ``out.loss`` when the output has one,
    else the output itself when it is a scalar."""
    if loss_fn is not None:
        loss = loss_fn(out)
        what = "loss_fn(output)"
    elif getattr(out, "loss", None) is not None:
        loss, what = out.loss, "output.loss"
    elif isinstance(out, torch.Tensor) and out.dim() == 0:
        loss, what = out, "the output"
    else:
        raise InvalidArgumentError(
            f"the model returned {type(out).__name__} with no .loss and not a scalar: pass "
            "loss_fn=, a function from the model output to a scalar loss (or include labels "
            "in the example, for a Hugging Face model)"
        )
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0 or not loss.is_floating_point():
        shape = list(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise InvalidArgumentError(
            f"{what} is {shape}, not a floating-point scalar; return a scalar loss from loss_fn "
            "(e.g. .mean() it)"
        )
    if not loss.requires_grad:
        raise InvalidArgumentError(
            f"{what} does not require grad: no parameter reaches it (are the parameters "
            "frozen, or the model in a torch.no_grad() context?)"
        )
    return loss


def run_step(model: nn.Module, example: Any, loss_fn: LossFn) -> torch.Tensor:
    """One training step as :func:`revckpt.fit` plans it; returns the detached loss."""
    args, kwargs = split_example(example)
    given = [(t, t._version) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    try:
        out = model(*args, **kwargs)
        loss = loss_of(out, loss_fn)
        loss.backward()
        del out
    finally:
        changed = next((t for t, v in given if t._version != v), None)
    if changed is not None:
        raise InvalidArgumentError(
            f"the model changed a tensor of the example (shape {tuple(changed.shape)}) in place "
            "during a step (a counter it bumps, a workspace it writes hidden states into, an "
            "input normalised in place): revckpt.fit runs the step several times on the "
            "example, each on what the one before left, so it would plan for other values "
            "(or differentiate a graph twice). Make the model write into its own tensors "
            "(clone the input, allocate the workspace in forward), or leave that tensor out of "
            "the example fit is given"
        )
    return loss.detach()


def _cuda_devices(model: nn.Module) -> list[torch.device]:
    params = [p for p in model.parameters() if p.requires_grad]
    return sorted({p.device for p in params if p.device.type == "cuda"}, key=str)


@contextlib.contextmanager
def left_as_found(model: nn.Module, example: Any) -> Iterator[None]:
    """Steps run within leave the model as it was (parameters' gradients, buffers, plain
    attributes, the generators), and the example's tensors too: a leaf that requires grad (a
    trainable prompt, ``inputs_embeds``) has no ``.grad`` within, as after ``zero_grad()``,
    and gets its own back on exit (the steps' gradients are not the caller's)."""
    params = [p for p in model.parameters() if p.requires_grad]
    tensors = [t for t in tree_leaves(split_example(example)) if isinstance(t, torch.Tensor)]
    with (
        torch.random.fork_rng(devices=_cuda_devices(model)),
        preserved(model, tensors=tensors),
    ):
        for p in params:  # the step creates them, as after zero_grad()
            p.grad = None
        yield


def seed_step(model: nn.Module, seed: int) -> None:
    """Seed the generators :func:`left_as_found` puts back (the CPU's and those of the CUDA
    devices the model's parameters are on), so that two steps from ``seed`` draw the same
    dropout masks; call it inside :func:`left_as_found`. Other devices' generators are left
    alone (``torch.manual_seed`` would change them for good)."""
    torch.random.default_generator.manual_seed(seed)
    for device in _cuda_devices(model):
        torch.cuda.default_generators[device.index or 0].manual_seed(seed)


def casts_in_step(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """Under autocast, the step with autocast's weight-cast cache off: a training loop enters
    autocast per step and casts the weights within each step, where a step metered inside the
    caller's one long autocast context found them cast already and read low (a per-step loop
    measured 1.13x a budget fit planned for). Not that loop's peak either: its cache keeps the
    forward's casts to the forward's end, which this frees block by block (docs/models.md:
    1.013-1.067x measured); otherwise nothing changes."""
    dtype = autocast_dtype(device.type)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype, cache_enabled=False)


def measure_step(model: nn.Module, example: Any, loss_fn: LossFn) -> int:
    """The peak bytes of one step as planned (gradients ``None`` before it), leaving the model
    as it was."""
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    with left_as_found(model, example), casts_in_step(device), MemoryMeter(device) as meter:
        run_step(model, example, loss_fn)
    return meter.peak_bytes


def block_parameters(blocks: list[tuple[str, nn.Module]]) -> tuple[nn.Parameter, ...]:
    """The parameters of the planned blocks that take a gradient, each once."""
    seen: dict[int, nn.Parameter] = {}
    for _, block in blocks:
        for p in block.parameters():
            if p.requires_grad:
                seen.setdefault(id(p), p)
    return tuple(seen.values())


def error_parameters(
    model: nn.Module, blocks: list[tuple[str, nn.Module]]
) -> tuple[nn.Parameter, ...]:
    """The parameters whose gradients the error budget's figure is measured on: the planned
    blocks' trainable ones, or, where they have none (prompt tuning: frozen blocks under a
    trainable embedding), the model's (an approx plan's error there was not measured)."""
    params = block_parameters(blocks)
    if params:
        return params
    return block_parameters([("", model)])


Gradients = tuple[torch.Tensor | None, ...]


def gradient_copies(params: tuple[nn.Parameter, ...]) -> Gradients:
    """Copies of the gradients of ``params`` (``None`` where a parameter has none)."""
    return tuple(None if p.grad is None else p.grad.detach().clone() for p in params)


def measured_gradients(
    model: nn.Module, example: Any, loss_fn: LossFn, *, seed: int, params: tuple[nn.Parameter, ...]
) -> tuple[int, Gradients]:
    """:func:`measure_step` from the generator state ``seed`` (the same dropout masks as any
    other step from it), and copies of the gradients of ``params`` it made (taken outside the
    meter); the model and the generators are left as they were."""
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    with left_as_found(model, example):
        seed_step(model, seed)
        with casts_in_step(device), MemoryMeter(device) as meter:
            run_step(model, example, loss_fn)
        grads = gradient_copies(params)
    return meter.peak_bytes, grads


@dataclass(frozen=True)
class Reference:
    """The store-all step's gradients of the planned blocks' parameters, from the generator
    state ``seed``: what :func:`revckpt.fit` measures an approx plan's gradient error against
    (the error budget's figure: the relative L2 error of the planned blocks' parameter
    gradients, all together)."""

    seed: int
    params: tuple[nn.Parameter, ...]
    grads: Gradients

    def error_of(self, grads: Gradients) -> float:
        """The relative L2 error of ``grads`` (of :attr:`params`, from a step from
        :attr:`seed`) against these."""
        num = den = 0.0
        for g, r in zip(grads, self.grads, strict=True):
            if r is None:
                continue
            r64 = r.double()
            den += float(r64.norm() ** 2)
            num += float(((g.double() if g is not None else 0) - r64).norm() ** 2)
        return relative(math.sqrt(num), math.sqrt(den))
