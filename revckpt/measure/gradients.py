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
import dataclasses
import math
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import keystr, tree_flatten, tree_flatten_with_path, tree_map

from .._numbers import relative
from ..errors import InvalidArgumentError, InvalidInputTypeError
from .state import preserved

__all__ = ["GradientError", "TensorError", "gradient_error"]

Inputs = torch.Tensor | Sequence[Any]


@dataclass(frozen=True)
class TensorError:
    """Error of one gradient tensor (or of all of them, concatenated)."""

    rel_l2: float
    one_minus_cos: float
    max_abs_rel: float
    diff_norm: float
    ref_norm: float
    numel: int

    @classmethod
    def between(cls, g: torch.Tensor, r: torch.Tensor) -> TensorError:
        """Errors of ``g`` against the reference ``r`` (complex ones as pairs of reals)."""
        numel = r.numel()
        g, r = _real_flat(g), _real_flat(r)
        d = g - r
        dn, rn, gn = d.norm().item(), r.norm().item(), g.norm().item()
        rmax = r.abs().max().item() if r.numel() else 0.0
        dmax = d.abs().max().item() if d.numel() else 0.0
        return cls(
            rel_l2=relative(dn, rn),
            one_minus_cos=_one_minus_cos(g, r, dn, gn, rn),
            max_abs_rel=relative(dmax, rmax),
            diff_norm=dn,
            ref_norm=rn,
            numel=numel,
        )


def _widened(t: torch.Tensor) -> torch.Tensor:
    if t.is_floating_point():
        return t.to(torch.float64)
    return t.to(torch.complex128) if t.is_complex() else t


def _real_flat(t: torch.Tensor) -> torch.Tensor:
    """``t`` in float64, flat; a complex one as its real and imaginary parts (``.double()``
    drops the imaginary part: gradients differing there compared equal); a sparse one dense
    (``nn.Embedding(sparse=True)``'s gradient)."""
    t = t.detach()
    if t.layout != torch.strided:
        t = t.to_dense()
    if t.is_complex():
        return torch.view_as_real(t.to(torch.complex128)).flatten()
    return t.double().flatten()


def _one_minus_cos(g: torch.Tensor, r: torch.Tensor, dn: float, gn: float, rn: float) -> float:
    if not math.isfinite(dn):
        return math.nan  # a non-finite gradient has no direction: say so, do not report 0
    if dn == 0:
        return 0.0
    if gn == 0 or rn == 0:
        return 1.0
    return max(0.0, 1.0 - torch.dot(g, r).item() / (gn * rn))


@dataclass(frozen=True)
class GradientError:
    """Per-tensor and overall gradient errors; ``per_tensor`` maps names to :class:`TensorError`.

    Parameter names are those of ``named_parameters()``; inputs are ``"input.0"``, ``"input.1"``,
    ... (positional) and ``"input.<name>"`` (keyword), a tensor inside a list, tuple or dict
    with its place in brackets (``"input.1[0]"``, ``"input.feats['key']"``).
    """

    per_tensor: dict[str, TensorError]
    overall: TensorError
    skipped: tuple[str, ...] = field(default=())

    def worst(self, k: int = 5, *, by: str = "rel_l2") -> list[tuple[str, TensorError]]:
        """The ``k`` tensors with the largest error (``by`` one of the TensorError fields)."""
        fields = [f.name for f in dataclasses.fields(TensorError)]
        if by not in fields:
            raise InvalidArgumentError(f"worst(by={by!r}): use one of {fields}")
        return sorted(self.per_tensor.items(), key=lambda kv: -getattr(kv[1], by))[:k]

    def table(self, k: int | None = None) -> str:
        """The ``k`` worst tensors and the overall error, as a text table."""
        rows = self.worst(k or len(self.per_tensor))
        width = max([len(n) for n, _ in rows] + [7])
        lines = [f"{'tensor':<{width}}  {'rel_l2':>10}  {'1-cos':>10}  {'max_abs_rel':>11}"]
        for name, e in [*rows, ("overall", self.overall)]:
            lines.append(
                f"{name:<{width}}  {e.rel_l2:>10.3e}  {e.one_minus_cos:>10.3e}  "
                f"{e.max_abs_rel:>11.3e}"
            )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table(5)


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
        torch.cat([_real_flat(g).cpu() for _, g, _ in pairs]),
        torch.cat([_real_flat(r).cpu() for _, _, r in pairs]),
    )
    return GradientError(per_tensor=per, overall=overall, skipped=skipped)
