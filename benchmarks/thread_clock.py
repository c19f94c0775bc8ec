"""Run a benchmark with the thread's CPU clock in place of the wall clock.

``python benchmarks/thread_clock.py benchmarks/bench_schedule.py --retest --out ...`` replaces
``time.perf_counter`` by ``time.thread_time`` before revckpt is imported (its timing functions
take the clock as a default argument), then runs the benchmark. With one intra-op thread, as the
benchmarks set, the CPU's work of a step runs on the calling thread, so the clock counts that
work and not the time the operating system gives other processes: it separates what another
process's preemption does to a measurement from what the work itself does (docs/schedule.md,
*The measurement against itself*). CPU only: on an accelerator the thread waits for kernels.
"""

from __future__ import annotations

import runpy
import sys
import time
from pathlib import Path


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit("usage: python benchmarks/thread_clock.py BENCHMARK.py [ARGS...]")
    time.perf_counter = time.thread_time
    script = Path(sys.argv[1])
    sys.argv = sys.argv[1:]
    sys.path.insert(0, str(script.parent))
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main()
