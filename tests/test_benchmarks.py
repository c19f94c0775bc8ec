"""Smoke runs of the benchmark scripts in their reduced mode, so they cannot rot."""

import importlib.util
import json
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_checkpoint_quick(tmp_path, capsys):
    out = tmp_path / "r.json"
    result = load("bench_checkpoint").main(["--quick", "--repeats", "1", "--out", str(out)])
    rows = {(r["chain"], r["variant"]): r for r in json.loads(out.read_text())["rows"]}
    assert len(rows) == len(result["rows"]) == 16
    mlp = [r for (chain, v), r in rows.items() if chain.startswith("MLP") and "head" not in v]
    plain = next(r for r in mlp if r["variant"] == "plain")
    per_block = next(r for r in mlp if r["variant"] == "revckpt per-block")
    assert per_block["retained_bytes"] < plain["retained_bytes"]
    assert "| chain | variant |" in capsys.readouterr().out
