"""The parameters a fitted model trains, as :func:`revckpt.fit` measured its step with: a
plan's memory budget holds for them. Checked once per training step (at the first planned
block): parameters added since (``peft.get_peft_model`` on a fitted model: 1.08x the budget),
or more of them trainable (layers unfrozen: up to 1.68x, a frozen encoder unfrozen), keep
activations and gradients the plan does not count, and are refused; fewer (a merge, FSDP's
sharded parameters, layers frozen) run."""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import InvalidArgumentError
from .install import planned

__all__ = ["TrainedParameters", "watch_trained"]


def _counts(model: nn.Module) -> tuple[int, int, int]:
    """The number of parameters, their elements and the elements of the trainable ones."""
    count = numel = trainable = 0
    for p in model.parameters():
        count += 1
        n = p.numel()
        numel += n
        if p.requires_grad:
            trainable += n
    return count, numel, trainable


@dataclass(frozen=True)
class TrainedParameters:
    """What :func:`revckpt.fit` planned ``model``'s step with (held weakly)."""

    model: Any  # weakref.ref to the model
    count: int
    numel: int
    trainable: int

    @classmethod
    def of(cls, model: nn.Module) -> TrainedParameters:
        return cls(weakref.ref(model), *_counts(model))

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        # A pickled or deep-copied model drops the check (its plan stays): the model is held
        # weakly, and a block pickled or copied alone must not take its whole model along
        return _dropped, ()

    def check(self, fqn: str) -> None:
        """Raise where the model's parameters are not those the plan was made for."""
        model = self.model()
        if model is None or torch.compiler.is_compiling():
            return
        count, numel, trainable = _counts(model)
        # more of them only: fewer (a merge, FSDP's sharded or flattened parameters) keep less
        if count > self.count or numel > self.numel:
            change = (
                f"{self.count} parameters of {self.numel} elements when revckpt.fit planned "
                f"it, {count} of {numel} now (modules added: an adapter such as "
                "peft.get_peft_model, a module attached)"
            )
            instead = ""
        elif trainable > self.trainable:
            change = (
                f"{self.trainable} trainable parameter elements when revckpt.fit planned it, "
                f"{trainable} now (layers unfrozen)"
            )
            instead = "; or freeze them again"
        else:
            return
        raise InvalidArgumentError(
            f"the model whose block {fqn} revckpt.fit planned has {change}: the activations "
            "and gradients they can add are not in the plan's memory budget. Fit after the "
            f"change (revckpt.restore(model), then revckpt.fit(model, example, ...)){instead}"
        )


def _dropped() -> None:
    return None


def watch_trained(model: nn.Module, block_names: tuple[str, ...]) -> None:
    """Check ``model``'s parameters at each training forward of the first planned block."""
    if not block_names:
        return
    info = planned(model.get_submodule(block_names[0]))
    if info is not None:
        info.trained = TrainedParameters.of(model)
