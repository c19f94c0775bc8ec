"""What :func:`~revckpt.measure.gradient_error` checks and warns about before it compares:
lazy or ``meta`` models refused, a lossy strategy installed on the candidate, parameter hooks a
float64 copy drops, and the dtype a reference's inputs take."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from ..errors import InvalidArgumentError

__all__: list[str] = []


# What convert and fit put on a block they planned (revckpt.inplace.install._ATTR; measure
# imports nothing of the planner, so the attribute is read by name): its ``strategy``.
_PLANNED_ATTR = "_revckpt_planned"


def _warn_if_installed(candidate: nn.Module) -> None:
    """Warn when the float64 copy would run a lossy strategy (approx, compress) that ``convert``
    or ``fit`` installed on ``candidate``'s blocks: its error is then in the reference too."""
    installed = [
        f"{name} ({strategy})"
        for name, m in candidate.named_modules()
        for strategy in [str(getattr(vars(m).get(_PLANNED_ATTR), "strategy", ""))]
        if strategy.startswith(("approx", "compress"))
    ]
    if installed:
        warnings.warn(
            f"gradient_error(model, None, ...): the float64 copy of the model runs the lossy "
            f"strategy revckpt installed on {len(installed)} of its blocks (e.g. "
            f"{installed[0]}), so its error is in the reference too, and the figure is the "
            "float32 round-off alone. To measure the strategy's error, pass a reference copied "
            "before convert or fit (or revckpt.restore(copy.deepcopy(model)))",
            UserWarning,
            stacklevel=4,  # the caller of gradient_error
        )


def _check_materialised(model: nn.Module, role: str, inputs: Any) -> None:
    """Refuse what has no values to compare: lazy parameters not made yet (a float64 copy
    would make different ones), tensors on the ``meta`` device."""
    for name, p in model.named_parameters():
        if isinstance(p, nn.parameter.UninitializedParameter):
            raise InvalidArgumentError(
                f"the {role}'s parameter {name!r} is a lazy module's, not made yet: run the model "
                "once (a forward on an example input) before comparing gradients, so that both "
                "sides have the same weights"
            )
    tensors = [*model.parameters(), *model.buffers()]
    tensors += [t for t in tree_flatten(inputs)[0] if isinstance(t, torch.Tensor)]
    if any(t.is_meta for t in tensors):
        raise InvalidArgumentError(
            f"the {role} or its inputs are on the 'meta' device, which holds shapes and no "
            "values: materialise the model (e.g. model.to_empty(device='cpu') and load its "
            "weights) before comparing gradients"
        )


def _warn_if_parameter_hooks(candidate: nn.Module) -> None:
    """``copy.deepcopy`` keeps module hooks but not the hooks registered on parameters
    (``p.register_hook``): the float64 copy runs without them. They are not copied over: a
    hook may have side effects (accumulating into a buffer of the caller's) or return the
    candidate's dtype. Warn, naming them, where they would make the figure."""
    hooked = [n for n, p in candidate.named_parameters() if p.requires_grad and p._backward_hooks]
    if hooked:
        warnings.warn(
            f"gradient_error(model, None, ...): {len(hooked)} parameters of the model have "
            f"hooks (p.register_hook, e.g. {hooked[0]!r}), which the float64 copy does not "
            "carry (deepcopy drops them; copied, a hook with side effects would run twice), "
            "so the reference's gradients are taken without them. Pass a reference with the "
            "same hooks registered (e.g. a float64 copy you make and hook yourself)",
            UserWarning,
            stacklevel=4,
        )


def _real_dtypes(model: nn.Module) -> set[torch.dtype]:
    """The real dtypes of the model's floating-point and complex parameters (complex128 as
    float64)."""
    dtypes = set()
    for p in model.parameters():
        if p.is_complex():
            dtypes.add(p.real.dtype)
        elif p.is_floating_point():
            dtypes.add(p.dtype)
    return dtypes


def _inputs_dtype_for(reference: nn.Module, candidate: nn.Module) -> torch.dtype | None:
    """The dtype to give a reference's floating-point (and complex) inputs: its parameters'
    one dtype where the candidate's are not all of it (a float64 copy made by hand, a float32
    original of a bf16 model, a candidate of mixed dtypes), else as given."""
    ref = _real_dtypes(reference)
    if len(ref) != 1 or _real_dtypes(candidate) == ref:
        return None
    return ref.pop()
