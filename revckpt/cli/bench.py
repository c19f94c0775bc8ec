"""``revckpt bench``: the benchmark scripts of a source checkout, run one after another."""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from .usage import _add_command, _UsageError


def _add_bench(sub: Any) -> None:
    """The ``bench`` subcommand and its options."""
    bench = _add_command(
        sub,
        "bench",
        _bench,
        summary="run the benchmark suite (source checkout)",
        description="Run the scripts in benchmarks/; peers that are not installed are skipped.",
    )
    bench.add_argument(
        "--quick",
        action="store_true",
        help="reduced sizes, results written to a temporary folder (a smoke run)",
    )
    bench.add_argument("--only", nargs="+", metavar="NAME", help=f"any of {', '.join(BENCHES)}")


def _benchmarks_dir() -> Path:
    here = Path(__file__).resolve().parents[2] / "benchmarks"
    if not here.is_dir():
        raise _UsageError(
            "the benchmark scripts live in a source checkout (benchmarks/): clone the "
            "repository and install it with pip install -e ."
        )
    return here


BENCHES = ("bench_checkpoint", "bench_reversible", "bench_approx", "bench_solver", "bench_schedule")


def _bench(args: argparse.Namespace) -> int:
    folder = _benchmarks_dir()
    names = args.only or list(BENCHES)
    unknown = [n for n in names if n not in BENCHES]
    if unknown:
        raise _UsageError(f"unknown benchmark {unknown}; choose from {list(BENCHES)}")
    for peer, hint in (
        ("revlib", "pip install -e '.[bench]'"),
        ("revtorch", "pip install -e '.[bench]'"),
        ("memcnn", "pip install --no-deps memcnn==1.5.2"),
    ):
        if importlib.util.find_spec(peer) is None:
            print(f"note: {peer} is not installed: its rows are skipped ({hint})")
    failed = []
    scratch = Path(tempfile.mkdtemp(prefix="revckpt-bench-")) if args.quick else None
    for name in names:
        cmd = [sys.executable, str(folder / f"{name}.py")]
        if args.quick:  # reduced sizes, written outside benchmarks/results
            cmd += ["--lengths", "32"] if name == "bench_solver" else ["--quick"]
            assert scratch is not None
            cmd += ["--out", str(scratch / f"{name}.json")]
        print(f"\n$ {' '.join(cmd[1:])}", flush=True)
        if subprocess.run(cmd, check=False).returncode != 0:
            failed.append(name)
    if scratch is not None:
        print(f"\nquick results in {scratch} (benchmarks/results/ untouched)")
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0
