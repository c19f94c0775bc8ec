"""This checkout's revckpt against another commit's, head to head, in one run: does a change
make checkpointing, selective recompute, approx recompute or reversible stacks slower?

The other commit (``--base``, default ``HEAD``) is checked out with ``git worktree`` into a
temporary folder. Two worker processes, one importing each revckpt, stay up for the whole run
(one CPU thread each, the same seeds, the same workloads) and are driven in turn: in every
round each workload runs a burst of training steps in one worker, then the same burst in the
other (the order alternates by round), and the round's ratio is the median step time of this
checkout over the base's. Reported: the median ratio over the rounds, with its interquartile
range (> 1: this checkout is slower).

The workloads are those of ``bench_checkpoint.py`` and ``bench_reversible.py`` at their full
sizes (``--quick``: small ones), each written against the public API both sides have:

* ``checkpoint per block``: ``checkpoint_sequential(mlp, 32 segments)`` on a 32-block MLP;
* ``checkpoint sqrt``: ``checkpoint_sequential(mlp, "sqrt")``;
* ``selective per block``: every block of an 8-block transformer chain with policy
  ``matmul+attention``;
* ``approx bf16 per block``: the MLP's blocks in approx checkpoints with a bf16 boundary;
* ``reversible``: a 32-block ``ReversibleSequential`` of MLP branches (batch 256, width 512).

Run ``python benchmarks/bench_against.py --base <commit>``; prints a table and writes
``benchmarks/results/bench_against.json``.

``--instructions`` counts instead of timing: each workload's training steps run once per side
under valgrind's callgrind (``benchmarks/_callgrind.py``), after ten warm steps, and the
instructions per step are compared. Unlike the times, the counts do not move with the
machine's load, so a difference of a percent is visible; they weigh every instruction alike
(a cache miss costs no more than an add), so they measure work, not time. Writes
``benchmarks/results/bench_against_instructions.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from _common import environment, write_json  # benchmarks/_common.py

ROOT = Path(__file__).resolve().parents[1]
WORKLOADS = (
    "checkpoint per block",
    "checkpoint sqrt",
    "selective per block",
    "approx bf16 per block",
    "reversible",
)


# --- worker side: imports the revckpt found first on sys.path --------------------------------


def _new_api() -> bool:
    import revckpt

    return "strategy" in inspect.signature(revckpt.checkpoint).parameters


def _selective_run(block: Any, x: Any) -> Any:
    import revckpt

    if _new_api():  # one checkpoint with a strategy (no deprecation warning per call)
        return revckpt.checkpoint(block, x, strategy="selective:matmul+attention")
    return revckpt.checkpoint(block, x, policy="matmul+attention")


def _approx_run(block: Any, x: Any) -> Any:
    import revckpt

    if _new_api():
        return revckpt.checkpoint(block, x, strategy="approx:bf16")
    from revckpt.approx import checkpoint as approx_checkpoint

    return approx_checkpoint(block, x, store="bf16")


def _workload(name: str, quick: bool) -> Callable[[], None]:
    """One training step of workload ``name`` (built once, seeded)."""
    import torch

    from revckpt import checkpoint_sequential
    from revckpt.models import mlp_chain, transformer_chain

    torch.manual_seed(0)
    if name == "reversible":
        return _reversible(quick)
    if name == "selective per block":
        dim, seq, batch, depth = (32, 16, 2, 2) if quick else (256, 256, 4, 8)
        chain, x = transformer_chain(depth, dim, 4 if dim > 32 else 2), torch.randn(batch, seq, dim)

        def run(h: Any) -> Any:
            for block in chain:
                h = _selective_run(block, h)
            return h

    else:
        depth, width, hidden, batch = (4, 32, 64, 16) if quick else (32, 128, 512, 1024)
        chain, x = mlp_chain(depth, width, hidden), torch.randn(batch, width)
        if name == "checkpoint per block":

            def run(h: Any) -> Any:
                return checkpoint_sequential(chain, len(chain), h)

        elif name == "checkpoint sqrt":

            def run(h: Any) -> Any:
                return checkpoint_sequential(chain, "sqrt", h)

        else:

            def run(h: Any) -> Any:
                for block in chain:
                    h = _approx_run(block, h)
                return h

    return _step(run, x)


def _reversible(quick: bool) -> Callable[[], None]:
    import torch
    from torch import nn

    from revckpt.layers import ReversibleBlock, ReversibleSequential

    depth, batch, width, hidden = (4, 8, 16, 32) if quick else (32, 256, 512, 1024)

    def branch() -> nn.Module:
        return nn.Sequential(nn.Linear(width, hidden), nn.ReLU(), nn.Linear(hidden, width))

    stack = ReversibleSequential(
        *(ReversibleBlock(branch(), branch()) for _ in range(depth)), split_dim=1
    )
    return _step(stack, torch.randn(batch, 2 * width))


def _step(run: Callable[[Any], Any], x: Any) -> Callable[[], None]:
    def step() -> None:
        leaf = x.detach().clone().requires_grad_()
        run(leaf).sum().backward()

    return step


def worker(quick: bool) -> None:
    """Answers ``<workload> <steps>`` lines on stdin with the JSON list of step times."""
    import torch

    import revckpt

    torch.set_num_threads(1)
    print(json.dumps(str(Path(revckpt.__file__).parents[1])), flush=True)  # which revckpt
    steps: dict[str, Callable[[], None]] = {}
    for line in sys.stdin:
        name, _, count = line.strip().rpartition(" ")
        if name not in steps:
            steps[name] = _workload(name, quick)
            steps[name]()  # warm
        times = []
        for _ in range(int(count)):
            start = time.perf_counter()
            steps[name]()
            times.append(time.perf_counter() - start)
        print(json.dumps(times), flush=True)


# Warm steps before counting: CPython 3.11 specialises ("quickens") a code object after its
# first eight runs, once per process; code that runs once per step would pay that inside the
# counted step after fewer warm steps, on whichever side has more such code.
WARM_STEPS = 10


def counted(name: str, quick: bool, steps: int, root: str) -> None:
    """Under callgrind: ``WARM_STEPS`` steps of workload ``name``, uncounted, then ``steps``
    counted ones."""
    import _callgrind  # benchmarks/_callgrind.py
    import torch

    import revckpt

    if Path(revckpt.__file__).resolve().parents[1] != Path(root).resolve():
        raise RuntimeError(f"imported the revckpt of {revckpt.__file__}, not of {root}")
    torch.set_num_threads(1)
    step = _workload(name, quick)
    for _ in range(WARM_STEPS):
        step()
    _callgrind.start()
    for _ in range(steps):
        step()
    _callgrind.stop()


# --- driver side ----------------------------------------------------------------------------


class Worker:
    """A worker process importing the revckpt of ``root``."""

    def __init__(self, root: Path, quick: bool) -> None:
        cmd = [sys.executable, __file__, "--worker"] + (["--quick"] if quick else [])
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**_env(), "PYTHONPATH": str(root)},
        )
        assert self.proc.stdout is not None
        self.root = json.loads(self.proc.stdout.readline())
        if Path(self.root).resolve() != root.resolve():
            raise RuntimeError(f"the worker for {root} imported the revckpt of {self.root}")

    def run(self, name: str, steps: int) -> list[float]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{name} {steps}\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the worker stopped while running {name!r}")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=60)


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def _quantiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) < 2:
        return values[0], values[0], values[0]
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[1], q[0], q[2]


def compare(head: Worker, base: Worker, rounds: int, steps: int) -> list[dict[str, Any]]:
    ratios: dict[str, list[float]] = {w: [] for w in WORKLOADS}
    for r in range(rounds):
        for name in WORKLOADS:
            pair = (head, base) if r % 2 == 0 else (base, head)
            got = {id(w): statistics.median(w.run(name, steps)) for w in pair}
            ratios[name].append(got[id(head)] / got[id(base)])
    rows = []
    for name, values in ratios.items():
        median, q25, q75 = _quantiles(values)
        rows.append({"workload": name, "ratio": median, "q25": q25, "q75": q75, "rounds": values})
    return rows


def instructions(roots: dict[str, Path], quick: bool, steps: int) -> list[dict[str, Any]]:
    """Per workload, the instructions of a training step on each side (``roots``: side ->
    the folder its revckpt is imported from), the two sides counted at once."""
    import _callgrind  # benchmarks/_callgrind.py

    missing = _callgrind.available()
    if missing:
        raise SystemExit(f"--instructions needs valgrind and gcc: {missing}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="revckpt-count-") as tmp, ThreadPoolExecutor(2) as pool:
        library = _callgrind.build(Path(tmp))
        for name in WORKLOADS:
            jobs = {}
            for side, root in roots.items():
                cmd = [sys.executable, __file__, "--count", name, "--steps", str(steps)]
                cmd += ["--root", str(root)] + (["--quick"] if quick else [])
                env = {**_env(), "PYTHONPATH": str(root)}
                jobs[side] = pool.submit(_callgrind.count, cmd, library, env)
            per_step = {side: job.result() / steps for side, job in jobs.items()}
            rows.append(
                {
                    "workload": name,
                    "instructions_per_step": per_step,
                    "ratio": per_step["head"] / per_step["base"],
                }
            )
    return rows


@contextlib.contextmanager
def _checked_out(sha: str) -> Iterator[Path]:
    """Commit ``sha`` checked out with ``git worktree`` into a temporary folder."""
    with tempfile.TemporaryDirectory(prefix="revckpt-base-") as tmp:
        root = Path(tmp) / "base"
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(root), sha],
            check=True,
            capture_output=True,
        )
        try:
            yield root
        finally:
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(root)],
                check=False,
                capture_output=True,
            )


def _timed(base_root: Path, args: argparse.Namespace) -> dict[str, Any]:
    rounds = args.rounds or (3 if args.quick else 9)
    steps = args.steps or (3 if args.quick else 5)
    head, base = Worker(ROOT, args.quick), Worker(base_root, args.quick)
    try:
        rows = compare(head, base, rounds, steps)
    finally:
        head.close()
        base.close()
    return {"rounds": rounds, "steps_per_burst": steps, "rows": rows}


def _counted(base_root: Path, args: argparse.Namespace) -> dict[str, Any]:
    steps = args.steps or (1 if args.quick else 2)
    rows = instructions({"head": ROOT, "base": base_root}, args.quick, steps)
    return {"counted_steps": steps, "warm_steps": WARM_STEPS, "rows": rows}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="HEAD", help="the commit to compare against")
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke test")
    parser.add_argument("--rounds", type=int, default=None, help="alternating rounds")
    parser.add_argument("--steps", type=int, default=None, help="training steps per burst")
    parser.add_argument(
        "--instructions",
        action="store_true",
        help="count instructions per step under callgrind instead of timing",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--count", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--root", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None, help="the JSON to write")
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.quick)
        return {}
    if args.count:
        counted(args.count, args.quick, args.steps, args.root)
        return {}
    sha = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", args.base], capture_output=True, text=True, check=True
    ).stdout.strip()
    with _checked_out(sha) as base_root:
        measured = (_counted if args.instructions else _timed)(base_root, args)
    flags = (" --instructions" if args.instructions else "") + (" --quick" if args.quick else "")
    result = {
        "benchmark": "bench_against",
        "command": f"python benchmarks/bench_against.py --base {args.base}{flags}",
        "environment": environment(),
        "base": sha,
        **measured,
    }
    print(count_table(result) if args.instructions else table(result))
    name = "bench_against_instructions.json" if args.instructions else "bench_against.json"
    write_json(result, args.out or Path(__file__).parent / "results" / name)
    return result


def table(result: dict[str, Any]) -> str:
    lines = [
        f"this checkout / {result['base'][:10]} (median step time per burst, "
        f"{result['rounds']} alternating rounds; > 1: slower now)",
        "",
        "| workload | this / base (IQR) |",
        "|---|---|",
    ]
    for r in result["rows"]:
        lines.append(f"| {r['workload']} | {r['ratio']:.3f} ({r['q25']:.2f}-{r['q75']:.2f}) |")
    return "\n".join(lines)


def count_table(result: dict[str, Any]) -> str:
    lines = [
        f"this checkout / {result['base'][:10]}: instructions per training step under callgrind "
        f"({result['counted_steps']} steps counted after {result.get('warm_steps', 1)} warm "
        "ones; > 1: more work now)",
        "",
        "| workload | this checkout | base | this / base |",
        "|---|---|---|---|",
    ]
    for r in result["rows"]:
        n = r["instructions_per_step"]
        lines.append(
            f"| {r['workload']} | {n['head']:,.0f} | {n['base']:,.0f} | {r['ratio']:.4f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
