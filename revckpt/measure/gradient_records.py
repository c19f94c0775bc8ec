"""What :func:`~revckpt.measure.gradient_error` reports: the error of one gradient tensor
against its reference (:class:`TensorError`) and of a model's gradients, per tensor and overall
(:class:`GradientError`)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

from .._numbers import relative
from ..errors import InvalidArgumentError

__all__ = ["GradientError", "TensorError"]


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
        g, r = real_flat(g), real_flat(r)
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


def real_flat(t: torch.Tensor) -> torch.Tensor:
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
