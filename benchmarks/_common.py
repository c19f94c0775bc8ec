"""Shared pieces of the benchmark scripts: environment record, table cells, JSON output, the
reversible peers."""

from __future__ import annotations

import json
import platform
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

import revckpt


def environment() -> dict[str, str]:
    return {
        "torch": torch.__version__,
        "revckpt": revckpt.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
    }


def ratio_cell(row: dict[str, Any]) -> str:
    """``1.234 (1.20-1.26)``: median time ratio and its interquartile range."""
    return f"{row['time_ratio']:.3f} ({row['time_ratio_q25']:.2f}-{row['time_ratio_q75']:.2f})"


def write_json(result: dict[str, Any], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


def reversible_peers(blocks: Sequence[Any], split_dim: int) -> tuple[dict[str, Any], list[str]]:
    """The installed reversible peers running ``blocks`` (each with ``.f`` and ``.g``, the
    two branches of ``y1 = x1 + F(x2); y2 = x2 + G(y1)``), split along ``split_dim`` (a
    non-negative dimension); a note for each peer that is not installed."""
    found: dict[str, Any] = {}
    notes = []
    warnings.filterwarnings("ignore", category=FutureWarning)
    try:
        import revlib

        found["revlib 1.7.2"] = revlib.ReversibleSequential(
            *[m for b in blocks for m in (b.f, b.g)], split_dim=split_dim
        )
    except ImportError:
        notes.append("revlib not installed: skipped (pip install -e '.[bench]')")
    try:
        import memcnn

        found["memcnn 1.5.2"] = nn.Sequential(
            *[
                memcnn.InvertibleModuleWrapper(
                    memcnn.AdditiveCoupling(b.f, b.g, split_dim=split_dim),
                    keep_input=False,
                    keep_input_inverse=False,
                )
                for b in blocks
            ]
        )
    except ImportError:
        notes.append("memcnn not installed: skipped (pip install --no-deps memcnn==1.5.2)")
    try:
        import revtorch

        found["revtorch 0.2.4"] = revtorch.ReversibleSequence(
            nn.ModuleList(
                [revtorch.ReversibleBlock(b.f, b.g, split_along_dim=split_dim) for b in blocks]
            )
        )
    except ImportError:
        notes.append("revtorch not installed: skipped (pip install -e '.[bench]')")
    return found, notes
