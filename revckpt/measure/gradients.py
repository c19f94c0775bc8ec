"""Gradient error of a candidate against a reference, by default a float64 copy of the model.

Both models run the same inputs under the same RNG seed (so dropout draws the same masks; on
CPU the masks do not depend on the dtype) and are differentiated through the same scalar loss,
by default a fixed random projection of the outputs, ``L = sum_i <w_i, y_i>`` with
``w_i ~ N(0, 1)`` from a seeded generator, rounded to the candidate's output dtype for both
models so that a bf16 candidate is not charged for rounding ``w`` (a random projection exercises
every output element, where ``y.sum()`` would give every element the same cotangent). For
every parameter (and every input that requires grad), with ``g`` the candidate's gradient and
``r`` the reference's, in float64:

    rel_l2        = ||g - r||_2 / ||r||_2
    one_minus_cos = 1 - <g, r> / (||g||_2 ||r||_2)
    max_abs_rel   = max|g - r| / max|r|

and the same over all tensors concatenated (``overall``). Zero reference gradients give 0 when
the candidate's is zero too and ``inf`` otherwise. Buffers (BatchNorm statistics) of both models
are restored afterwards and ``.grad`` is not touched.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import keystr, tree_flatten, tree_flatten_with_path, tree_map

from ..errors import InvalidArgumentError, InvalidInputTypeError
from ._gradient_checks import (
    _check_materialised,
    _inputs_dtype_for,
    _warn_if_installed,
    _warn_if_parameter_hooks,
)
from .gradient_records import GradientError, TensorError, real_flat
from .state import preserved

__all__ = ["GradientError", "TensorError", "gradient_error"]

Inputs = torch.Tensor | Sequence[Any]


def _widened(t: torch.Tensor) -> torch.Tensor:
    if t.is_floating_point():
        return t.to(torch.float64)
    return t.to(torch.complex128) if t.is_complex() else t


def _as_args(inputs: Inputs) -> tuple[Any, ...]:
    if isinstance(inputs, torch.Tensor):
        return (inputs,)
    if isinstance(inputs, Sequence) and not isinstance(inputs, (str, bytes)):
        return tuple(inputs)
    raise InvalidInputTypeError(
        f"inputs must be a tensor or a tuple of positional arguments, got {type(inputs).__name__}"
    )


_COMPLEX = {torch.float64: torch.complex128, torch.float32: torch.complex64}


def _prepare(obj: Any, dtype: torch.dtype | None) -> Any:
    """Fresh leaf copies of floating tensors (cast to ``dtype`` if given), same requires_grad."""

    def one(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        y = x.detach()
        if dtype is not None and y.is_floating_point():
            y = y.to(dtype)
        elif dtype in _COMPLEX and y.is_complex():
            y = y.to(_COMPLEX[dtype])
        y = y.clone()
        return y.requires_grad_(x.requires_grad and (y.is_floating_point() or y.is_complex()))

    return tree_map(one, obj)


def _projection_loss(
    out: Any, seed: int, round_to: list[torch.dtype] | None
) -> tuple[torch.Tensor, list[torch.dtype]]:
    """``sum_i <w_i, y_i>``; ``w_i`` is rounded to ``round_to[i]`` (the candidate's output
    dtypes) first, so candidate and reference are differentiated along the same direction."""
    tensors = [
        t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()
    ]
    if not tensors:
        raise InvalidArgumentError(
            "the model returned no floating-point tensor to differentiate; pass loss_fn=... that "
            "maps its output to a scalar"
        )
    gen = torch.Generator().manual_seed(seed)
    total = None
    for i, t in enumerate(tensors):
        w = torch.randn(t.shape, generator=gen, dtype=torch.float64)
        if round_to is not None and i < len(round_to):
            w = w.to(round_to[i])
        term = (t * w.to(t.device, t.dtype)).sum()
        total = term if total is None else total + term.to(total.dtype)
    assert total is not None
    return total, [t.dtype for t in tensors]


def _fork_all_rng() -> Any:
    """fork_rng over the CPU and every initialised CUDA device (``manual_seed`` seeds them all)."""
    cuda = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    return torch.random.fork_rng(devices=cuda)


def _input_tensors(args: Any, kwargs: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """The inputs that require grad, named ``input.<position or keyword>``, one inside a list,
    tuple or dict with its place in brackets (``input.1[0]``, ``input.feats['key']``)."""
    for top, value in [*enumerate(args), *kwargs.items()]:
        for place, a in _leaves_with_places(value):
            if isinstance(a, torch.Tensor) and a.requires_grad:
                yield f"input.{top}{place}", a


def _leaves_with_places(value: Any) -> list[tuple[str, Any]]:
    """``value``'s pytree leaves with their places; by their order (``[#2]``) inside a
    container registered without keys (``register_pytree_node`` without
    ``flatten_with_keys_fn``)."""
    try:
        return [(keystr(path), leaf) for path, leaf in tree_flatten_with_path(value)[0]]
    except ValueError:
        leaves = tree_flatten(value)[0]
        return [(f"[#{i}]", leaf) for i, leaf in enumerate(leaves)]


def _checked_loss(loss: Any) -> torch.Tensor:
    if not isinstance(loss, torch.Tensor):
        raise InvalidInputTypeError(
            f"loss_fn returned a {type(loss).__name__}; it must return a scalar tensor that "
            "depends on the model's output (e.g. lambda out: out.logits.square().mean())"
        )
    if loss.numel() != 1:
        raise InvalidArgumentError(
            f"loss_fn returned a tensor of shape {tuple(loss.shape)}; it must return a scalar "
            "(reduce it, e.g. with .sum() or .mean())"
        )
    if not loss.requires_grad:
        raise InvalidArgumentError(
            "the loss does not depend on anything that requires grad; give the model "
            "parameters that require grad or an input with requires_grad=True"
        )
    return loss


def _differentiated(loss: torch.Tensor, tensors: list[torch.Tensor]) -> tuple[Any, ...]:
    try:
        return torch.autograd.grad(loss, tensors, allow_unused=True) if tensors else ()
    except RuntimeError as err:
        if ".grad()" not in str(err) or "checkpoint" not in str(err).lower():
            raise
        raise InvalidArgumentError(
            "the model runs torch.utils.checkpoint with use_reentrant=True, which works with "
            ".backward() only; gradient_error takes gradients with torch.autograd.grad, leaving "
            ".grad alone: checkpoint with use_reentrant=False (or revckpt.checkpoint)"
        ) from err


def _grads(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    loss_fn: Callable[[Any], torch.Tensor] | None,
    seed: int,
    round_to: list[torch.dtype] | None = None,
) -> tuple[dict[str, torch.Tensor | None], list[torch.dtype] | None]:
    names, tensors = [], []
    for n, p in model.named_parameters():
        if p.requires_grad:
            names.append(n)
            tensors.append(p)
    taken = set(names)
    for name, a in _input_tensors(args, kwargs):
        if name in taken:
            raise InvalidArgumentError(
                f"an input that requires grad would be named {name!r}, as a parameter of the "
                "model or another input is: rename the parameter or the keyword, or pass the "
                "input without requires_grad"
            )
        taken.add(name)
        names.append(name)
        tensors.append(a)
    dtypes = None
    with _fork_all_rng(), preserved(model, grads=False):  # buffers (BatchNorm) as they were
        torch.manual_seed(seed)
        out = model(*args, **kwargs)
        if loss_fn is not None:
            loss = _checked_loss(loss_fn(out))
        else:
            loss, dtypes = _projection_loss(out, seed, round_to)
            loss = _checked_loss(loss)
        grads = _differentiated(loss, tensors)
    return dict(zip(names, grads, strict=True)), dtypes


def _paired_gradients(
    candidate: nn.Module,
    reference: nn.Module | None,
    inputs: Inputs,
    kwargs: Mapping[str, Any] | None,
    loss_fn: Callable[[Any], torch.Tensor] | None,
    seed: int,
) -> tuple[list[tuple[str, torch.Tensor, torch.Tensor]], tuple[str, ...]]:
    """Gradients of candidate and reference, paired by name; and the names neither produced.

    ``reference=None`` uses a float64 deep copy of ``candidate`` fed float64 copies of the
    floating-point inputs.
    """
    if not isinstance(candidate, nn.Module):
        raise InvalidInputTypeError(
            f"candidate must be an nn.Module, got {type(candidate).__name__}"
        )
    if reference is not None and not isinstance(reference, nn.Module):
        raise InvalidInputTypeError(
            f"reference must be an nn.Module or None (a float64 copy of candidate), got "
            f"{type(reference).__name__}"
        )
    args, kw = _as_args(inputs), dict(kwargs or {})
    _check_materialised(candidate, "candidate", (args, kw))
    ref_dtype = None
    if reference is not None:
        _check_materialised(reference, "reference", ())
        ref_dtype = _inputs_dtype_for(reference, candidate)
    # gradients are what is asked for, also when called under no_grad or inference_mode (where
    # the float64 copy would be made of inference tensors)
    with torch.inference_mode(False), torch.enable_grad():
        if reference is None:
            _warn_if_installed(candidate)
            # complex parameters to complex128: Module.to(torch.float64) drops their imaginary
            # part
            _warn_if_parameter_hooks(candidate)
            reference = copy.deepcopy(candidate)._apply(_widened)
            ref_dtype = torch.float64
        cand, dtypes = _grads(candidate, _prepare(args, None), _prepare(kw, None), loss_fn, seed)
        ref, _ = _grads(
            reference, _prepare(args, ref_dtype), _prepare(kw, ref_dtype), loss_fn, seed, dtypes
        )
    if cand.keys() != ref.keys():
        only_c, only_r = sorted(cand.keys() - ref.keys()), sorted(ref.keys() - cand.keys())
        raise InvalidArgumentError(
            "candidate and reference have different trainable tensors "
            f"(only in candidate: {only_c[:5]}, only in reference: {only_r[:5]}); the reference "
            "must be the same model (same parameter names), e.g. reference=None for a float64 copy"
        )
    pairs, skipped = [], []
    for name, g in cand.items():
        r = ref[name]
        if g is None and r is None:
            skipped.append(name)
            continue
        if g is not None and r is not None and g.shape != r.shape:
            raise InvalidArgumentError(
                f"gradient of {name!r} has shape {tuple(g.shape)} in the candidate but "
                f"{tuple(r.shape)} in the reference; compare the same architecture"
            )
        g = torch.zeros_like(r) if g is None else g
        r = torch.zeros_like(g) if r is None else r
        pairs.append((name, g, r))
    return pairs, tuple(skipped)


def gradient_error(
    candidate: nn.Module,
    reference: nn.Module | None,
    inputs: Inputs,
    *,
    kwargs: Mapping[str, Any] | None = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    seed: int = 0,
) -> GradientError:
    """Per-tensor and overall error of ``candidate``'s gradients against ``reference``'s.

    Args:
        candidate: the model under test (any strategy, any dtype).
        reference: the model to compare with, same parameter names; ``None`` for a float64 deep
            copy of ``candidate``, which runs what ``convert``, ``fit`` or ``make_reversible``
            installed on it too (a lossy strategy's error is then in both, and it warns): for a
            strategy's error, pass a copy made before them.
        inputs: a tensor or a tuple of positional inputs. Inputs with ``requires_grad=True``
            (also inside lists, tuples and dicts, and among ``kwargs``) get their gradients
            compared too.
        kwargs: keyword inputs for both models (masks, positions).
        loss_fn: maps the model's output to a scalar; default a seeded random projection.
        seed: seeds the RNG for both forwards and the projection.
    """
    pairs, skipped = _paired_gradients(candidate, reference, inputs, kwargs, loss_fn, seed)
    if not pairs:
        raise InvalidArgumentError(
            "nothing to compare: no parameter or input of the model received a gradient; give "
            "an input requires_grad=True or check that the parameters require grad"
        )
    per = {name: TensorError.between(g, r) for name, g, r in pairs}
    overall = TensorError.between(
        torch.cat([real_flat(g).cpu() for _, g, _ in pairs]),
        torch.cat([real_flat(r).cpu() for _, _, r in pairs]),
    )
    return GradientError(per_tensor=per, overall=overall, skipped=skipped)
