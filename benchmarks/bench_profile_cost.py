"""What ``revckpt.schedule.profile`` costs, in training steps, on each model of
``bench_schedule.py`` (issue 15: "profiling costs at most 10 training steps").

A profile's cost is its wall time over the stored chain's training step, which it times itself
(``Profile.cost_in_steps``). That step moves by about 20% from one profile to the next on a
shared machine, so one profile says little: each model is profiled ``--rounds`` times in a
process of its own (one thread, after ``revckpt.measure.keep_freed_memory()``, as
``bench_schedule.py`` profiles; ``--in-process``: every model in this one process, each
model's first profile then coming after the models before it), and the table gives the first
profile of the process (it also warms each strategy up, ``revckpt/schedule/probe.py``) and the
median and interquartile range of the rest, with their wall seconds.

A second figure divides each profile's wall time by a training step as a user's loop runs
it, timed right after the profile: forward, a loss, backward, an AdamW step and
``zero_grad()`` (the median of five, after one untimed step). The profile's own stored step
is the chain's forward and backward alone, the time model's unit; the user's step adds the
loss and the optimizer, which the user pays in every step too.

Run ``python benchmarks/bench_profile_cost.py`` (``--quick``: small models, two rounds;
``--error-stride k``: ``profile(..., error_stride=k)``, the codec errors run on every ``k``-th
block of a group and interpolated between); prints a table and writes
``benchmarks/results/bench_profile_cost.json``.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from _common import environment, write_json  # benchmarks/_common.py
from bench_schedule import models

import revckpt
from revckpt.measure.timing import wall_time
from revckpt.schedule import profile

OUT = Path(__file__).parent / "results" / "bench_profile_cost.json"
USER_STEPS = 5  # training steps timed after each profile


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) < 2:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def _user_step(chain: torch.nn.Sequential, x: torch.Tensor) -> Any:
    """A training step as a user's loop runs it: forward, loss (mean square of the output),
    backward, an AdamW step and ``zero_grad()``; on a copy of the chain, which the profiles
    never see (they profile the chain as it was built)."""
    model = copy.deepcopy(chain)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def step() -> None:
        loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()

    return step


def profile_costs(
    chain: torch.nn.Sequential, x: torch.Tensor, rounds: int, error_stride: int = 1
) -> dict[str, Any]:
    """``rounds`` profiles of ``chain`` on ``x``: each one's cost in steps and wall seconds;
    after each, ``USER_STEPS`` training steps as a user runs them (:func:`_user_step`, one
    untimed first), and the profile's cost in those (over their median)."""
    steps, seconds, user_steps, user_seconds = [], [], [], []
    user = _user_step(chain, x)
    for _ in range(rounds):
        start = time.perf_counter()
        prof = profile(chain, x, error_stride=error_stride)
        seconds.append(time.perf_counter() - start)
        steps.append(prof.cost_in_steps)
        user()  # untimed: the first one makes AdamW's state
        pace = statistics.median(wall_time(user) for _ in range(USER_STEPS))
        user_seconds.append(pace)
        user_steps.append(seconds[-1] / pace)
    later, later_user = steps[1:] or steps, user_steps[1:] or user_steps
    q1, median, q3 = _quartiles(later)
    u1, user_median, u3 = _quartiles(later_user)
    return {
        "steps": steps,
        "seconds": seconds,
        "first_steps": steps[0],
        "median_steps": median,
        "iqr_steps": (q1, q3),
        "median_seconds": statistics.median(seconds[1:] or seconds),
        "user_step_seconds": user_seconds,
        "user_steps": user_steps,
        "first_user_steps": user_steps[0],
        "median_user_steps": user_median,
        "iqr_user_steps": (u1, u3),
    }


def _in_own_process(name: str, rounds: int, stride: int, quick: bool) -> dict[str, Any]:
    """``name``'s row from a fresh process (this script with ``--model``): its first profile
    is then the first of a process, as a user's is, not one after other models' profiles."""
    argv = [sys.executable, __file__, "--model", name, "--rounds", str(rounds)]
    argv += ["--error-stride", str(stride)] + (["--quick"] if quick else [])
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"profiling {name} in its own process failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(rows: dict[str, dict[str, Any]]) -> str:
    lines = [
        "| model | first profile: own stored steps / user steps | later profiles: own stored "
        "steps, median (IQR) | later: user steps, median (IQR) | median seconds |",
        "|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        q1, q3 = r["iqr_steps"]
        u1, u3 = r["iqr_user_steps"]
        lines.append(
            f"| {name} | {r['first_steps']:.1f} / {r['first_user_steps']:.1f} | "
            f"{r['median_steps']:.1f} ({q1:.1f}-{q3:.1f}) | "
            f"{r['median_user_steps']:.1f} ({u1:.1f}-{u3:.1f}) | {r['median_seconds']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small models, two rounds")
    parser.add_argument("--rounds", type=int, default=None, help="profiles per model (9)")
    parser.add_argument(
        "--error-stride",
        type=int,
        default=1,
        help="profile(..., error_stride=): codec errors on every k-th block of a group "
        "(default 1, profile's: every block)",
    )
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="profile every model in this one process (default: each in a fresh one)",
    )
    parser.add_argument("--model", default=None, help=argparse.SUPPRESS)  # one model's row
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    rounds = args.rounds or (2 if args.quick else 9)
    torch.set_num_threads(1)
    revckpt.measure.keep_freed_memory()
    stride = args.error_stride
    if args.model is not None:  # one model, in this process: its row as JSON, last line
        chain, x = models(args.quick)[args.model]
        print(json.dumps(profile_costs(chain, x, rounds, stride)))
        return {}
    built = models(args.quick)
    names = list(built)
    if args.in_process:
        rows = {n: profile_costs(*built[n], rounds, stride) for n in names}
    else:
        del built
        rows = {n: _in_own_process(n, rounds, stride, args.quick) for n in names}
    command = "python benchmarks/bench_profile_cost.py" + (" --quick" if args.quick else "")
    command += (f" --error-stride {stride}" if stride != 1 else "") + (
        " --in-process" if args.in_process else ""
    )
    result = {
        "benchmark": "bench_profile_cost",
        "command": command,
        "error_stride": stride,
        "own_process_per_model": not args.in_process,
        "environment": environment(),
        "rounds": rounds,
        "threads": 1,
        "models": rows,
    }
    print(table(rows))
    write_json(result, args.out)
    return result


if __name__ == "__main__":
    main()
