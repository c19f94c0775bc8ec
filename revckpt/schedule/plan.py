"""A plan: which strategy runs which blocks, with the figures the cost model predicts for it."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..errors import InvalidArgumentError
from .costs import Segment

__all__ = ["Plan"]


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

    @property
    def length(self) -> int:
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
        return self.predicted_peak_bytes / self.store_all_peak_bytes

    def table(self) -> str:
        """Per-segment strategies and the predictions, as Markdown."""
        budget = "none" if self.memory_budget_bytes is None else _mib(self.memory_budget_bytes)
        lines = [
            f"plan {self.name!r}: predicted peak {_mib(self.predicted_peak_bytes)} "
            f"({self.predicted_peak_fraction:.1%} of store-all {_mib(self.store_all_peak_bytes)},"
            f" budget {budget}), overhead +{self.predicted_overhead:.1%} of a plain step, "
            f"gradient error {self.predicted_error:.2e} (budget {self.error_budget:g})",
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
        d = asdict(self)
        d["segments"] = [[s.start, s.stop, s.strategy] for s in self.segments]
        d["block_names"] = list(self.block_names)
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
        if d.get("format") != "revckpt.Plan/1":
            raise InvalidArgumentError(
                "not a revckpt plan (missing format 'revckpt.Plan/1'); write plans with "
                "Plan.to_json and read them with Plan.from_json"
            )
        fields = {k: v for k, v in d.items() if k != "format"}
        fields["segments"] = tuple(Segment(int(a), int(b), str(s)) for a, b, s in d["segments"])
        fields["block_names"] = tuple(d.get("block_names", ()))
        return cls(**fields)

    @classmethod
    def from_json(cls, text_or_path: str | Path) -> Plan:
        """Read a plan from JSON text or a file path."""
        text = str(text_or_path)
        if not text.lstrip().startswith("{"):
            text = Path(text_or_path).read_text()
        return cls.from_dict(json.loads(text))


def check_segments(segments: Sequence[Segment], length: int) -> None:
    if not segments or segments[0].start != 0 or segments[-1].stop != length:
        raise InvalidArgumentError(f"a plan must cover blocks 0 to {length - 1}")
