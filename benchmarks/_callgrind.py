"""Instructions executed by a stretch of Python code, counted by valgrind's callgrind: a
measure of work that does not move with the machine's load (the same binary, inputs and
environment give the same count within a fraction of a percent), where wall-clock ratios on
this shared machine move by several percent between runs of identical code.

A process started by :func:`count` runs under ``valgrind --tool=callgrind
--instr-atstart=no``: nothing is counted (and the import of torch runs uninstrumented, so
faster) until the code calls :func:`start`, which zeroes the counters and turns counting on;
:func:`stop` turns it off and writes the counts. The two are callgrind's client requests,
compiled into a small shared library with the machine's C compiler and loaded with ctypes.

Needs ``valgrind`` with its headers (Debian: ``apt install valgrind``) and ``gcc``.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

_SOURCE = """
#include <valgrind/callgrind.h>
void revckpt_count_start(void) { CALLGRIND_ZERO_STATS; CALLGRIND_START_INSTRUMENTATION; }
void revckpt_count_stop(void) {
    CALLGRIND_STOP_INSTRUMENTATION;
    CALLGRIND_DUMP_STATS_AT("counted");
}
"""
_LIBRARY = "REVCKPT_CALLGRIND_LIBRARY"
_TRIGGER = "desc: Trigger: Client Request: counted"


def available() -> str | None:
    """``None`` where counting works here, else what is missing."""
    for tool in ("valgrind", "gcc"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    if not Path("/usr/include/valgrind/callgrind.h").exists():
        return "valgrind's headers (valgrind/callgrind.h) are not installed"
    return None


def build(folder: Path) -> Path:
    """The client-request library, compiled into ``folder``."""
    source, library = folder / "count.c", folder / "libcount.so"
    source.write_text(_SOURCE)
    subprocess.run(
        ["gcc", "-shared", "-fPIC", "-O1", "-o", str(library), str(source)],
        check=True,
        capture_output=True,
    )
    return library


def _library() -> ctypes.CDLL:
    return ctypes.CDLL(os.environ[_LIBRARY])


def start() -> None:
    """Counting on, from zero (in a process started by :func:`count`)."""
    _library().revckpt_count_start()


def stop() -> None:
    """Counting off; the counts are written for :func:`count` to read."""
    _library().revckpt_count_stop()


def count(command: list[str], library: Path, env: dict[str, str]) -> int:
    """Run ``command`` under callgrind; the instructions it executed between :func:`start`
    and :func:`stop`."""
    with tempfile.TemporaryDirectory(prefix="revckpt-callgrind-") as tmp:
        out = Path(tmp) / "callgrind.out"
        subprocess.run(
            [
                "valgrind",
                "--tool=callgrind",
                "--instr-atstart=no",
                f"--callgrind-out-file={out}",
                *command,
            ],
            check=True,
            capture_output=True,
            env={**env, _LIBRARY: str(library), "PYTHONHASHSEED": "0"},
        )
        for dump in Path(tmp).iterdir():
            text = dump.read_text(errors="replace")
            if _TRIGGER in text:
                found = re.search(r"^totals: (\d+)", text, re.MULTILINE)
                if found:
                    return int(found.group(1))
    raise RuntimeError(f"no counts were written by {command}: did it call start() and stop()?")
