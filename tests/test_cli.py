"""The revckpt command: demo, plan and bench, and one-line errors with exit status 2."""

import json
import pathlib
import subprocess
import sys

import pytest

from revckpt import InvalidArgumentError
from revckpt.cli import main

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_demo_writes_report_plots_and_table(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "demo"
    args = ["demo", "--size", "tiny", "--budget", "0.9", "--out", str(out), "--repeats", "2"]
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


def test_plan_on_the_example_model_measures_within_budget(monkeypatch, tmp_path, capsys):
    monkeypatch.chdir(ROOT)
    out = tmp_path / "plan.json"
    args = ["plan", "examples.user_model:build", "--budget", "0.3", "--measure", "--out", str(out)]
    assert main([*args, "--repeats", "1"]) == 0
    text = capsys.readouterr().out
    assert "within the budget" in text
    assert json.loads(out.read_text())["format"] == "revckpt.Plan/1"


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
    cases = (("wrong_models:single", "nn.Sequential"), ("wrong_models:needs", "default"))
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
