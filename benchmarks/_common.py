"""Shared pieces of the benchmark scripts: environment record, table cells, JSON output."""

from __future__ import annotations

import json
import platform
from pathlib import Path
from typing import Any

import torch

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
