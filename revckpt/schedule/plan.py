"""A plan: which strategy runs which blocks, with the figures the cost model predicts for it."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..approx import Approx
from ..checkpoint import checkpoint, checkpoint_sequential
from ..errors import InvalidArgumentError, InvalidInputTypeError
from ..layers import ReversibleSequential, ReversibleUnit
from ..offload import checkpoint_sequential as offload_sequential
from .costs import (
    APPROX_PREFIX,
    CHECKPOINT,
    OFFLOAD,
    REVERSIBLE,
    SELECTIVE_PREFIX,
    STORE,
    Segment,
)

__all__ = ["Plan", "Scheduled", "apply"]


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


@dataclass(frozen=True)
class Plan:
    """Segments of a chain with a strategy each, and the predictions of the cost model.

    ``predicted_peak_bytes``: forward+backward peak of live tensor bytes; ``predicted_overhead``:
    recompute time over the plain chain's forward+backward time; ``predicted_error``: summed
    estimated relative gradient error of the approx segments. ``name`` says where the plan came
    from (``"optimal"``, ``"per-block"``, ``"sqrt"``, ``"every-4"``, ``"greedy"``, ...).
    """

    segments: tuple[Segment, ...]
    predicted_peak_bytes: int
    predicted_overhead: float
    predicted_error: float
    memory_budget_bytes: int | None
    error_budget: float
    store_all_peak_bytes: int
    base_time_s: float
    name: str = "optimal"
    block_names: tuple[str, ...] = field(default=())
    input_signature: tuple[Any, ...] | None = None

    @property
    def length(self) -> int:
        """Number of blocks the plan covers."""
        return self.segments[-1].stop

    @property
    def strategies(self) -> list[str]:
        """The strategy of every block, in order."""
        out: list[str] = []
        for seg in self.segments:
            out += [seg.strategy] * (seg.stop - seg.start)
        return out

    @property
    def predicted_peak_fraction(self) -> float:
        """Predicted peak over the store-all peak."""
        return self.predicted_peak_bytes / self.store_all_peak_bytes

    def table(self) -> str:
        """Per-segment strategies and the predictions, as Markdown."""
        budget = "none" if self.memory_budget_bytes is None else _mib(self.memory_budget_bytes)
        lines = [
            f"plan {self.name!r}: predicted peak {_mib(self.predicted_peak_bytes)} "
            f"({self.predicted_peak_fraction:.1%} of store-all {_mib(self.store_all_peak_bytes)},"
            f" budget {budget}), overhead +{self.predicted_overhead:.1%} of a plain step, "
            f"gradient error {self.predicted_error:.2e}"
            + ("" if self.memory_budget_bytes is None else f" (budget {self.error_budget:g})"),
            "| blocks | strategy |",
            "|---|---|",
        ]
        for seg in self.segments:
            names = ""
            if self.block_names:
                names = f" ({self.block_names[seg.start]}"
                names += (
                    f" .. {self.block_names[seg.stop - 1]})" if seg.stop - seg.start > 1 else ")"
                )
            lines.append(f"| {seg.start}-{seg.stop - 1}{names} | {seg.strategy} |")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    # -- JSON -------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """The plan as plain data (format ``revckpt.Plan/1``)."""
        d = asdict(self)
        d["segments"] = [[s.start, s.stop, s.strategy] for s in self.segments]
        d["block_names"] = list(self.block_names)
        if self.input_signature is not None:
            shape, dtype, device = self.input_signature
            d["input_signature"] = [list(shape), dtype, device]
        d["format"] = "revckpt.Plan/1"
        return d

    def to_json(self, path: str | Path | None = None) -> str:
        """The plan as JSON text; also written to ``path`` when given."""
        text = json.dumps(self.to_dict(), indent=2)
        if path is not None:
            Path(path).write_text(text + "\n")
        return text

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Plan:
        """The plan :meth:`to_dict` wrote."""
        if d.get("format") != "revckpt.Plan/1":
            raise InvalidArgumentError(
                "not a revckpt plan (missing format 'revckpt.Plan/1'); write plans with "
                "Plan.to_json and read them with Plan.from_json"
            )
        fields = {k: v for k, v in d.items() if k != "format"}
        fields["segments"] = tuple(Segment(int(a), int(b), str(s)) for a, b, s in d["segments"])
        fields["block_names"] = tuple(d.get("block_names", ()))
        sig = d.get("input_signature")
        fields["input_signature"] = None if sig is None else (tuple(sig[0]), sig[1], sig[2])
        return cls(**fields)

    @classmethod
    def from_json(cls, text_or_path: str | Path) -> Plan:
        """Read a plan from JSON text or a file path."""
        text = str(text_or_path)
        if not text.lstrip().startswith("{"):
            text = Path(text_or_path).read_text()
        return cls.from_dict(json.loads(text))


def _fits_signature(x: torch.Tensor, sig: tuple[Any, ...]) -> bool:
    """The profiled input, or the same with a smaller first (batch) dimension, which the
    predictions bound from above (a last, smaller batch)."""
    shape, dtype, device = sig
    if (str(x.dtype), x.device.type) != (dtype, device) or x.dim() != len(shape):
        return False
    if tuple(x.shape) == tuple(shape):
        return True
    return x.dim() > 0 and tuple(x.shape[1:]) == tuple(shape[1:]) and x.shape[0] <= shape[0]


class Scheduled(nn.Module):
    """A chain run by a :class:`Plan`. The blocks are registered under the names they had in
    the original container (``state_dict`` keys unchanged) and shared, not copied."""

    def __init__(self, blocks: nn.Sequential | Sequence[nn.Module], plan: Plan) -> None:
        super().__init__()
        if isinstance(blocks, nn.Sequential):
            named = list(blocks.named_children())
        else:
            named = [(str(i), b) for i, b in enumerate(blocks)]
        if len(named) != plan.length:
            raise InvalidArgumentError(
                f"the plan covers {plan.length} blocks but the chain has {len(named)}; apply a "
                "plan to the chain it was solved for"
            )
        for name, block in named:
            if not isinstance(block, nn.Module):
                raise InvalidInputTypeError(f"block {name} is not an nn.Module")
            self.add_module(name, block)
        self._order = [name for name, _ in named]
        self.plan = plan
        self._runs: list[tuple[str, Any]] = []
        chain = [block for _, block in named]
        for seg in plan.segments:
            part = chain[seg.start : seg.stop]
            if seg.strategy == REVERSIBLE:
                if not all(isinstance(b, ReversibleUnit) for b in part):
                    raise InvalidArgumentError(
                        f"segment {seg.start}-{seg.stop - 1} is planned reversible but holds "
                        "blocks that are not ReversibleUnit; re-profile the chain"
                    )
                dims = {b.split_dim for b in part}
                if len(dims) != 1:
                    raise InvalidArgumentError(
                        "reversible units of one segment must share split_dim"
                    )
                rev = ReversibleSequential(*[b.block for b in part], split_dim=dims.pop())
                self._runs.append((REVERSIBLE, rev))
            else:
                self._runs.append((seg.strategy, part))

    def forward(self, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        sig = self.plan.input_signature
        if (
            sig is not None
            and torch.is_grad_enabled()  # without a backward the predictions do not matter
            and not _fits_signature(x, sig)
        ):
            raise InvalidArgumentError(
                f"this plan was profiled on inputs of shape {list(sig[0])}, {sig[1]} on "
                f"{sig[2]}, but got shape {list(x.shape)}, {x.dtype} on {x.device.type}: its "
                "memory predictions do not hold for larger or other inputs (a smaller batch, "
                "or no grad, is fine). Profile and solve again for this input "
                "(schedule.profile(blocks, x))"
            )
        for strategy, run in self._runs:
            if strategy == STORE:
                for block in run:
                    x = block(x, **kwargs)
            elif strategy == CHECKPOINT:
                x = checkpoint_sequential(run, 1, x, **kwargs)
            elif strategy == REVERSIBLE:
                x = run(x, **kwargs)
            elif strategy == OFFLOAD:
                x = offload_sequential(run, len(run), x, **kwargs)
            elif strategy.startswith(SELECTIVE_PREFIX):
                x = checkpoint(run[0], x, policy=strategy[len(SELECTIVE_PREFIX) :], **kwargs)
            else:
                fmt = strategy[len(APPROX_PREFIX) :]
                x = checkpoint_sequential(run, 1, x, approx=Approx(store=fmt), **kwargs)
        return x


def apply(blocks: nn.Sequential | Sequence[nn.Module], plan: Plan) -> Scheduled:
    """An ``nn.Module`` that runs ``blocks`` as ``plan`` says, sharing their parameters."""
    if not isinstance(plan, Plan):
        raise InvalidInputTypeError(f"apply(blocks, plan) needs a Plan, got {type(plan).__name__}")
    return Scheduled(blocks, plan)
