"""One strategy on a model's blocks without profiling (:func:`convert`), and :func:`restore`,
which undoes it or :func:`~revckpt.fit`."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from ..errors import InvalidArgumentError, InvalidInputTypeError
from ..strategy import Strategy, StrategyLike
from .blocks import find_blocks
from .install import Planned, install, uninstall
from .reversible import refuse_reversible, remove_reversible
from .runners import runner_for

__all__ = ["convert", "restore"]


def convert(
    model: nn.Module,
    strategy: StrategyLike = "checkpoint",
    *,
    module_filter_fn: Callable[[nn.Module, str], bool] | None = None,
    every: int = 1,
) -> list[str]:
    """Apply one ``strategy`` in place to the model's blocks, without profiling, in the style
    of torchao's ``convert_to_float8_training``: ``"checkpoint"``, ``"selective:<policy>"``,
    ``"approx:<codec>"`` or ``"offload"`` (or a :class:`~revckpt.Strategy`), on every
    ``every``-th block (the first of each group of ``every``) of the blocks
    ``module_filter_fn(module, fqn)`` selects (default: the model's repeated blocks).
    Returns the names of the converted blocks; undo with :func:`restore` (a later ``convert``
    or ``fit`` replaces it). Eval mode and
    ``torch.no_grad()`` run the model plainly."""
    if not isinstance(every, int) or isinstance(every, bool) or every < 1:
        raise InvalidArgumentError(f"every={every!r}: pass a positive int (1: every block)")
    run = runner_for(strategy)
    refuse_reversible(model, "convert")  # restore would undo make_reversible
    restore(model)  # a model is converted once: what was installed before goes
    found = find_blocks(model, module_filter_fn, option="module_filter_fn")
    chosen = found[::every]
    for fqn, block in chosen:
        install(block, Planned(fqn, str(Strategy.parse(strategy)), run))
    return [fqn for fqn, _ in chosen]


def restore(model: nn.Module) -> int:
    """Undo :func:`fit`, :func:`convert` or :func:`~revckpt.make_reversible` (its adapters
    go: :func:`revckpt.inplace.reversible.remove_reversible`): every block runs plainly
    again. Returns how many blocks were restored."""
    if not isinstance(model, nn.Module):
        raise InvalidInputTypeError(f"restore(model) needs an nn.Module, got {type(model)}")
    return sum(uninstall(m) for m in model.modules()) + remove_reversible(model)
