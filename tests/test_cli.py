"""The revckpt command: demo, plan and bench, and one-line errors with exit status 2."""

import json
import pathlib
import runpy
import subprocess
import sys

import pytest
import torch

import revckpt
from revckpt import InvalidArgumentError
from revckpt.cli import main
from revckpt.schedule import Plan

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_demo_writes_report_plots_and_table(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "demo"
    args = ["demo", "--size", "tiny", "--out", str(out), "--repeats", "2"]  # its default budget
    assert main(args) == 0
    text = capsys.readouterr()
    for name in ("store-all", "checkpoint per block", "checkpoint sqrt", "approx bf16"):
        assert f"| {name}" in text.out
    assert "reversible (RevGPT variant)" in text.out and "scheduler *" in text.out
    assert str(out.resolve()) in text.out
    data = json.loads((out / "report.json").read_text())
    assert data["format"] == "revckpt.Demo/1"
    names = [r["name"] for r in data["rows"]]
    assert names[0] == "store-all" and "scheduler" in names
    for row in data["rows"]:
        assert row["measured_peak_bytes"] > 0 and row["time_ratio"] > 0
    # nothing kept for backward but the default invertibility check's 2 x 64 float32 samples
    assert data["reversible"]["measured_retained_bytes"] == 2 * 64 * 4
    for png in ("memory_vs_overhead.png", "gradient_error.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
    assert json.loads((out / "plan.json").read_text())["format"] == "revckpt.Plan/1"


@pytest.mark.parametrize("budget", ["0.7", "0.9"])
def test_demo_never_shows_the_scheduler_beaten_on_both_axes(tmp_path, capsys, budget):
    out = tmp_path / "demo"
    args = ["demo", "--size", "tiny", "--budget", budget, "--out", str(out), "--repeats", "2"]
    assert main([*args, "--no-progress"]) == 0
    text = capsys.readouterr().out
    data = json.loads((out / "report.json").read_text())
    rows = {r["name"]: r for r in data["rows"]}
    floor = rows["store-all"]["gradient_error"]
    scheduler = rows["scheduler"]
    assert scheduler["measured_peak_bytes"] <= data["budget_bytes"]
    assert "scheduler" in data["verify"]["pareto"] and f"verify: {data['verify']['note']}" in text
    for name, r in rows.items():
        over = r["gradient_error"] > data["error_budget"] + 2 * floor
        assert r["over_error_budget"] == over
        assert (f"| {name} (over the error budget) |" in text) == over
        if over:
            continue  # over the error budget: not a plan the scheduler may pick
        figures = (r["measured_peak_bytes"], r["time_ratio"])
        mine = (scheduler["measured_peak_bytes"], scheduler["time_ratio"])
        beaten = figures[0] <= mine[0] and figures[1] <= mine[1] and figures != mine
        assert not beaten, f"{name} {figures} beats the scheduler {mine}"


def test_plan_on_the_example_model_measures_within_budget(monkeypatch, tmp_path, capsys):
    monkeypatch.chdir(ROOT)
    out = tmp_path / "plan.json"
    args = ["plan", "examples.user_model:build", "--budget", "0.3", "--measure", "--out", str(out)]
    threads = torch.get_num_threads()
    try:
        assert main([*args, "--repeats", "1", "--threads", "1"]) == 0
        assert torch.get_num_threads() == 1  # profiled with the threads asked for
    finally:
        torch.set_num_threads(threads)
    text = capsys.readouterr().out
    assert "within the budget" in text
    assert json.loads(out.read_text())["format"] == "revckpt.Plan/1"


def test_plan_with_compress_profiles_it(monkeypatch, capsys):
    """``--strategies ... compress:bf16`` was accepted, the chain profiled, and the solve then
    said compress was not available for this profile."""
    monkeypatch.chdir(ROOT)
    args = ["plan", "examples.user_model:build", "--budget", "0.6", "--repeats", "1"]
    assert main([*args, "--strategies", "store", "checkpoint", "compress:bf16"]) == 0
    assert "error" not in capsys.readouterr().err


def test_plan_with_offload_on_the_cpu_profiles_only_what_is_asked(monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    args = ["plan", "examples.user_model:build", "--budget", "0.6", "--measure"]
    assert main([*args, "--strategies", "store", "offload", "--repeats", "1"]) == 0
    text = capsys.readouterr().out
    assert "offload" in text and "within the budget" in text
    assert "approx" not in text and "selective" not in text


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["plan", "no_such_module:build", "--budget", "1GiB"], "cannot import module"),
        (["plan", "examples.user_model", "--budget", "1GiB"], "is not MODULE:FACTORY"),
        (["plan", "examples.user_model:nope", "--budget", "1GiB"], "has no function 'nope'"),
        (["plan", "examples.user_model:build", "--budget", "lots"], "cannot read the memory"),
        (["plan", "examples.user_model:build", "--budget", "0.01"], "no plan fits"),
        (["plan", "examples.user_model:build", "--budget", "8"], "write a unit"),
        (["plan", "examples.user_model:build", "--budget", "2", "GiB"], "quote values"),
        (["plan", "examples.user_model:build"], "--budget"),
        (
            ["plan", "examples.user_model:build", "--budget", "0.5", "--strategies", "offlaod"],
            "unknown strategy 'offlaod'",
        ),
        (["plan", ":build", "--budget", "1GiB"], "the module before ':' is missing"),
        (["plan", "examples.user_model:", "--budget", "1GiB"], "the function after ':'"),
        (["plan", "examples/user_model.py", "--budget", "1GiB"], "there is no ':'"),
        (["plan", "./no_such_model.py:build", "--budget", "1GiB"], "no Python file"),
        (["plan", "not-a-module:build", "--budget", "1GiB"], "neither a module name nor"),
        (
            ["plan", "examples.user_model:build", "--budget", "0.5", "--out", "no/dir/p.json"],
            "its folder does not exist",
        ),
        (["demo", "--threads", "0"], "--threads: must be a whole number of at least 1"),
        (["demo", "--repeats", "zero"], "--repeats: must be a whole number"),
        (["demo", "--device", "gpu0"], "not a device"),
        (["demo", "--budget", "lots"], "cannot read the memory budget"),
        (["demo", "--budget", "1e400"], "memory budget '1e400'"),
        (["plan", "examples.user_model:build", "--budget", "1e400"], "memory budget '1e400'"),
        (
            ["plan", "examples.user_model:build", "--budget", "0.5", "--error-budget", "nan"],
            "--error-budget nan: pass a number >= 0",
        ),
        (["plan", "examples.user_model:build", "--budget", "0.5", "--out", "."], "is a folder"),
        (
            ["plan", "examples.user_model:build", "--budget", "0.5", "--threads", "0"],
            "--threads: must be a whole number of at least 1",
        ),
        (["demo", "--error-budget", "-1"], "--error-budget -1.0: pass a number >= 0"),
        (["demo", "--budget", "0"], "--budget 0: memory_budget='0'"),
        (["frobnicate"], "invalid choice"),
    ],
)
def test_bad_input_is_one_line_with_exit_status_2(monkeypatch, capsys, args, expected):
    monkeypatch.chdir(ROOT)
    assert main([*args, "--repeats", "1"] if args[0] == "plan" and len(args) > 3 else args) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("revckpt: error: ") and expected in lines[0]
    assert "Traceback" not in err


def test_module_entry_point_and_help():
    done = subprocess.run(
        [sys.executable, "-m", "revckpt", "plan", "--help"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0
    assert "MODULE:FACTORY" in done.stdout and "--budget" in done.stdout


def test_bench_runs_a_script_without_touching_the_results(capfd):
    results = ROOT / "benchmarks" / "results" / "bench_solver.json"
    before = results.read_bytes() if results.exists() else None
    assert main(["bench", "--quick", "--only", "bench_solver"]) == 0
    out = capfd.readouterr().out
    assert "bench_solver.py" in out and "| blocks |" in out
    assert (results.read_bytes() if results.exists() else None) == before  # quick: elsewhere
    assert main(["bench", "--only", "bench_nothing"]) == 2


def test_factories_that_return_the_wrong_thing(tmp_path, monkeypatch, capsys):
    (tmp_path / "wrong_models.py").write_text(
        "import torch\n"
        "def single():\n    return torch.nn.Linear(4, 4), torch.randn(2, 4)\n"
        "def needs(depth):\n    return None\n"
    )
    monkeypatch.chdir(tmp_path)
    # (Linear, tensor) is a whole model for revckpt.fit now, one without repeated blocks
    cases = (("wrong_models:single", "no repeated blocks"), ("wrong_models:needs", "default"))
    for spec, expected in cases:
        assert main(["plan", spec, "--budget", "0.5", "--repeats", "1"]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and expected in err and "Traceback" not in err


def test_version_and_unknown_option(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and "revckpt" in capsys.readouterr().out
    assert main(["demo", "--frobnicate"]) == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments" in err and "quote" not in err


def test_plan_takes_the_path_of_a_python_file(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    spec = f"{ROOT / 'examples' / 'user_model.py'}:build"
    args = ["plan", spec, "--budget", "0.5", "--strategies", "store", "checkpoint"]
    assert main([*args, "--repeats", "1"]) == 0
    assert "checkpoint" in capsys.readouterr().out


def test_any_revckpt_error_is_one_line_with_exit_status_2(monkeypatch, capsys):
    import revckpt.schedule

    def refuse(budget, store_all_peak):
        raise InvalidArgumentError(f"memory budget {budget!r} is too large; write e.g. '2GiB'")

    monkeypatch.setattr(revckpt.schedule, "parse_budget", refuse)
    assert main(["plan", "examples.user_model:build", "--budget", "1e400"]) == 2
    err = capsys.readouterr().err
    assert err == "revckpt: error: memory budget '1e400' is too large; write e.g. '2GiB'\n"


# -- revckpt plan on a whole model (revckpt.fit) ------------------------------------------

FACTORY = """
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class Net(nn.Module):
    def __init__(self, dim=16, depth=4):
        super().__init__()
        self.trunk = nn.Module()
        self.trunk.layers = nn.ModuleList(Block(dim) for _ in range(depth))
        self.head = nn.Linear(dim, 1)

    def forward(self, x):
        for block in self.trunk.layers:
            x = block(x)
        return self.head(x)


def _net():
    torch.manual_seed(0)
    return Net(), torch.randn(4, 32, 16)


def make():  # the loss is the model's output: a scalar
    model, x = _net()
    model.head.register_forward_hook(lambda m, args, out: out.mean())
    return model, x


def make_with_loss():
    model, x = _net()
    return model, x, lambda out: out.square().mean()


def not_a_model():
    return "a model", torch.randn(2, 16)


def bad_third():
    model, x = _net()
    return model, x, 3


def not_a_tuple():
    return 7
"""


@pytest.fixture
def factory(tmp_path):
    path = tmp_path / "factory.py"
    path.write_text(FACTORY)
    return path


def test_plan_a_whole_model_writes_a_plan_that_fit_applies(factory, tmp_path, capsys):
    out = tmp_path / "plan.json"
    args = ["plan", f"{factory}:make", "--budget", "60%", "--out", str(out), "--repeats", "1"]
    assert main(args) == 0
    text = capsys.readouterr()
    assert "planned 4 blocks of Net (trunk.layers.0 .. trunk.layers.3)" in text.out
    assert "| blocks | strategy |" in text.out and str(out.resolve()) in text.out
    assert text.err == ""  # stderr is not a terminal: no progress bar
    plan = Plan.from_json(out)
    assert plan.block_names == tuple(f"trunk.layers.{i}" for i in range(4))
    assert plan.strategies != ["store"] * 4  # 60% of the step is not met by storing all
    model, example = runpy.run_path(str(factory))["make"]()
    applied = revckpt.fit(model, example, memory_budget="60%", plan=out)
    assert applied.to_dict() == plan.to_dict()
    model(example).backward()  # the step runs with the plan installed
    assert all(p.grad is not None for p in model.parameters())


def test_plan_a_whole_model_with_loss_fn_blocks_and_comma_strategies(
    factory, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)  # --out defaults to plan.json in the working directory
    args = ["plan", "factory:make_with_loss", "--budget", "0.6", "--blocks", "trunk.layers"]
    assert main([*args, "--strategies", "store,checkpoint", "--repeats", "1"]) == 0
    text = capsys.readouterr().out
    assert "selective" not in text and "approx" not in text
    plan = Plan.from_json(tmp_path / "plan.json")
    assert set(plan.strategies) <= {"store", "checkpoint"} and "checkpoint" in plan.strategies


def test_plan_draws_a_progress_bar_only_on_a_terminal(factory, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    args = ["plan", f"{factory}:make", "--budget", "60%", "--out", str(tmp_path / "p.json")]
    assert main([*args, "--repeats", "1"]) == 0
    err = capsys.readouterr().err
    assert err.startswith("\r[") and "] 2/4 blocks" in err
    assert err.endswith(f"\r[{'#' * 24}] 4/4 blocks\n")  # the line is ended before the table
    assert main([*args, "--repeats", "1", "--no-progress"]) == 0
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("budget", ["lots", "8", "150%", "0", "1e400"])
def test_plan_checks_the_budget_before_importing_the_module(tmp_path, capsys, budget):
    marker = tmp_path / "imported"
    (tmp_path / "boom.py").write_text(
        f"open({str(marker)!r}, 'w').close()\nraise RuntimeError('imported')\n"
    )
    assert main(["plan", f"{tmp_path / 'boom.py'}:make", "--budget", budget]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "memory" in err and "budget" in err, err
    assert f"{1 << 62:,}" not in err  # the dummy peak the syntax is checked against
    assert err.startswith("revckpt: error: ") and "Traceback" not in err
    assert not marker.exists()
    # and the strategies' names
    spec = f"{tmp_path / 'boom.py'}:make"
    assert main(["plan", spec, "--budget", "50%", "--strategies", "store,chekpoint"]) == 2
    assert "unknown strategy 'chekpoint'" in capsys.readouterr().err
    assert not marker.exists()


@pytest.mark.parametrize(
    ("spec", "extra", "expected"),
    [
        ("{dir}/nope.py:make", [], "no Python file"),
        ("no_such_module_anywhere:make", [], "cannot import module 'no_such_module_anywhere'"),
        ("{dir}/factory.py:nope", [], "has no function 'nope'"),
        ("{dir}/factory.py:not_a_model", [], "returned str where the model goes"),
        ("{dir}/factory.py:bad_third", [], "returned int as its third element"),
        ("{dir}/factory.py:not_a_tuple", [], "returned int; return (model, example"),
        ("{dir}/factory.py:make", ["--budget", "1KiB"], "no plan fits a memory budget of 1.00"),
        ("{dir}/factory.py:make", ["--blocks", "trunk.nope"], "has no submodule 'nope'"),
        ("{dir}/factory.py:make", ["--measure"], "fit already checks the plan"),
        ("{dir}/factory.py:make", ["--offload"], "fit does not price offload"),
        ("{dir}/factory.py:make", ["--strategies", ","], "name at least one"),
        ("{dir}/factory.py:make", ["--strategies", "reversible"], "changes the architecture"),
    ],
)
def test_plan_a_whole_model_bad_input_is_one_line(factory, capsys, spec, extra, expected):
    args = ["plan", spec.format(dir=factory.parent), "--repeats", "1", "--out"]
    args += [str(factory.parent / "plan.json")]
    args += extra if "--budget" in extra else ["--budget", "60%", *extra]
    assert main(args) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("revckpt: error: ") and expected in lines[0], lines[0]
    assert "Traceback" not in err
    assert not (factory.parent / "plan.json").exists()


def test_plan_blocks_flag_is_refused_for_a_chain(monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    args = ["plan", "examples.user_model:build", "--budget", "0.5", "--blocks", "layers"]
    assert main(args) == 2
    assert "--blocks picks the blocks inside a whole model" in capsys.readouterr().err


def test_plan_as_a_command(factory, tmp_path):
    out = tmp_path / "cmd.json"
    args = ["plan", f"{factory}:make", "--budget", "60%", "--out", str(out), "--repeats", "1"]
    done = subprocess.run(
        [sys.executable, "-m", "revckpt", *args],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr == "" and "| blocks | strategy |" in done.stdout
    assert Plan.from_json(out).block_names[0] == "trunk.layers.0"
