"""Smoke runs of the benchmark scripts in their reduced mode, so they cannot rot."""

import importlib.util
import json
import math
import pathlib
import statistics
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def load(name):
    if str(ROOT / "benchmarks") not in sys.path:
        sys.path.insert(0, str(ROOT / "benchmarks"))  # the scripts import benchmarks/_common.py
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


def test_bench_reversible_quick(tmp_path):
    out = tmp_path / "r.json"
    result = load("bench_reversible").main(
        ["--quick", "--repeats", "1", "--depths", "2", "--processes", "2", "--out", str(out)]
    )
    rows = {r["variant"]: r for r in result["rows"]}
    ours = rows["revckpt ReversibleSequential"]
    assert ours["max_abs_diff_vs_plain"] < 1e-5
    assert ours["held_after_forward_bytes"] < rows["plain autograd"]["held_after_forward_bytes"]
    assert len(ours["time_ratio_per_process"]) == 2
    assert ours["time_ratio"] == pytest.approx(statistics.median(ours["time_ratio_per_process"]))
    assert json.loads(out.read_text())["rows"]


def test_drift_script(tmp_path):
    result = load("drift_reversible").main(["--out", str(tmp_path / "d.json")])
    by = {
        (r["dtype"], r["depth"], r["anchor_every"]): r["max_relative_drift"] for r in result["rows"]
    }
    assert by[("float32", 8, None)] < 1e-5
    assert by[("bfloat16", 128, 8)] < by[("bfloat16", 128, None)]


def test_bench_approx_quick(tmp_path):
    result = load("bench_approx").main(
        ["--quick", "--repeats", "1", "--out", str(tmp_path / "a.json")]
    )
    rows = {(r["chain"].split(" (")[0], r["config"]): r for r in result["rows"]}
    gelu = "MLP pre-norm GELU"
    assert rows[(gelu, "exact (store=None)")]["kept_fraction_of_fp32"] == 1.0
    assert rows[(gelu, "bf16")]["kept_fraction_of_fp32"] == 0.5
    assert 0.25 <= rows[(gelu, "e4m3 row")]["kept_fraction_of_fp32"] < 0.3
    for config in ("bf16", "e4m3 row", "e5m2 row"):
        r = rows[(gelu, config)]
        assert r["grad_rel_error_vs_fp64"] <= r["bound_rel"]


def test_bench_solver_small(tmp_path):
    result = load("bench_solver").main(["--lengths", "8", "--out", str(tmp_path / "s.json")])
    assert {r["blocks"] for r in result["rows"]} == {8}
    assert all(r["seconds_median"] > 0 for r in result["rows"])


def test_bench_schedule_quick(tmp_path):
    out = tmp_path / "sched.json"
    result = load("bench_schedule").main(
        ["--quick", "--repeats", "1", "--profile-repeats", "1", "--out", str(out)]
    )
    assert json.loads(out.read_text())["benchmark"] == "bench_schedule"
    for model in result["models"]:
        assert model["worst_prediction_error"] <= 0.05
        measured = [r for r in model["records"] if r["plan"] is not None]
        assert {r["method"] for r in measured} >= {"per-block", "optimal"}
        for r in measured:
            if r["budget_fraction"] is not None:
                assert r["within_budget_plus_5pct"]
        assert (out.parent / model["plot"]).stat().st_size > 10_000


def test_bench_schedule_retest_scores_a_second_measurement_as_a_prediction():
    from types import SimpleNamespace

    retest = load("bench_schedule").retest

    def rep(ratios):
        return SimpleNamespace(
            rows=[
                SimpleNamespace(name=n, time_ratio=r, measured_peak_bytes=b)
                for n, (r, b) in ratios.items()
            ]
        )

    plans = [SimpleNamespace(name=n) for n in ("a", "b", "c", "d")]
    first = {"a": (1.50, 20), "b": (1.40, 40), "c": (1.20, 60), "d": (1.02, 95)}
    same = retest(rep(first), rep(first), plans, base=100)
    assert same["within"] == 4 and same["spearman"] == 1.0 and same["worst_relative_error"] == 0
    # b measured 20% lower the second time (out of 15%); d off by 0.02 (within 0.03)
    again = {"a": (1.50, 20), "b": (1.32, 40), "c": (1.20, 60), "d": (1.04, 95)}
    moved = retest(rep(first), rep(again), plans, base=100)
    assert [r["within_15pct_or_0.03"] for r in moved["plans"]] == [True, False, True, True]
    assert moved["worst_relative_error"] == pytest.approx(1.0)  # d: 0.02 against 0.02
    assert moved["plans_10_to_90pct"] == 3  # d keeps 95% of store-all
    assert moved["spearman"] == 1.0  # the order held


def test_gpu_check_smoke_mode_on_cpu(tmp_path):
    out = str(tmp_path / "g.json")
    result = load("gpu_check").main(["--smoke", "--repeats", "1", "--out", out])
    rows = {r["variant"]: r for r in result["rows"]}
    assert result["size"] == "smoke" and rows["store-all"]["peak_fraction"] == 1.0
    assert rows["checkpoint per block"]["peak_fraction"] < 1.0
    assert any(name.startswith("scheduler") for name in rows)
    assert any(name.startswith("revckpt reversible") for name in rows)
    assert {"offload per block", "offload per block, no prefetch"} <= rows.keys()
    # the peers installed here (extra bench) run the same RevGPT blocks
    peers = {n.split(" (")[0] for n in rows} & {"revlib 1.7.2", "revtorch 0.2.4", "memcnn 1.5.2"}
    assert len(peers) + len(result["notes"]) == 3
    # on the CPU the host is the device: offload keeps what a checkpoint keeps (2 blocks)
    retained = result["retained_after_forward_bytes"]
    assert retained["offload per block"] == retained["checkpoint per block"]
    assert retained["checkpoint per block"] == 2 * result["boundary_bytes"]
    (rev,) = result["make_reversible"]  # the exact rebuild: no drift, plain autograd's grads
    assert rev["exact"] and rev["max_rebuilt_input_drift"] == 0.0
    assert rev["max_abs_grad_difference_from_stored"] == 0.0
    assert 0 < rev["start_relative_logit_change"] < 1e-2
    fp16 = {r["variant"]: r for r in result["fp16_gradscaler"]}
    assert all(r["fp16_gradscaler_finite_grads"] for r in fp16.values())
    for exact in ("checkpoint per block", "offload per block"):  # same arithmetic as store-all
        assert fp16[exact]["relative_difference_from_store_all"] == 0.0
    assert 0 < fp16["approx e4m3"]["relative_difference_from_store_all"] < 0.1


def test_bench_vs_torch_quick(tmp_path, capsys):
    out = tmp_path / "vs.json"
    args = ["--quick", "--repeats", "1", "--profile-repeats", "1", "--budgets", "0.5"]
    args += ["--max-tries", "3", "--compiled-warmup", "2", "--out", str(out)]
    result = load("bench_vs_torch").main(args)
    assert json.loads(out.read_text())["benchmark"] == "bench_vs_torch"
    assert "| mode | option | variant |" in capsys.readouterr().out
    groups = {}
    for r in result["rows"]:
        groups.setdefault((r["mode"], r["option"]), {})[r["variant"]] = r
    store = groups[("eager", "-")]["store-all"]
    assert store["storages_peak_bytes"] == store["predicted_peak_bytes"]
    options = [key for key in groups if key[1] != "-"]
    assert [mode for mode, _ in options] == ["eager", "eager", "compiled"]
    for key in options:
        rows = groups[key]
        assert len(rows) == 3 and "torch" in rows
        torch_peak = rows["torch"]["peak_bytes"]
        assert torch_peak < store["peak_bytes"]
        for name, r in rows.items():
            if name == "torch":
                continue
            assert name.startswith("revckpt") and "time_ratio" in r and "vs_torch" in r
            assert r["no_more_memory"] == (r["peak_bytes"] <= torch_peak)
            if key[0] == "eager":  # the plan measures as predicted, within the option's peak
                assert r["storages_peak_bytes"] == r["predicted_peak_bytes"]
                assert r["peak_bytes"] <= torch_peak
    assert result["budget_takes_effect"]  # budget 0.5 peaks below compiled store-all


def test_compiled_prediction_quick(tmp_path, capsys):
    pytest.importorskip("transformers")
    out = tmp_path / "c.json"
    result = load("compiled_prediction").main(["--quick", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["benchmark"] == "compiled_prediction" and saved["command"].endswith(" --quick")
    (row,) = saved["rows"]
    assert row == result["rows"][0] and row["budget"] == 0.8 and row["strategies"]
    assert row["measured_peak_bytes"] > 0 and row["predicted_peak_bytes"] > 0
    ratio = row["measured_peak_bytes"] / row["predicted_peak_bytes"]
    assert row["measured_over_predicted"] == pytest.approx(ratio)
    assert "| budget | plan | measured / predicted peak |" in capsys.readouterr().out


def test_bench_allocator_quick(tmp_path):
    out = tmp_path / "r.json"
    result = load("bench_allocator").main(["--quick", "--rounds", "2", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [r["plan"] for r in rows] == [r["plan"] for r in result["rows"]]
    assert len(rows) == 3 and all("steady" in r and "interleaved" in r for r in rows)


def test_bench_call_overhead_quick(tmp_path, capsys):
    before = tmp_path / "before.json"
    load("bench_call_overhead").main(["--quick", "--repeats", "1", "--out", str(before)])
    out = tmp_path / "after.json"
    args = ["--quick", "--repeats", "1", "--before", str(before), "--out", str(out)]
    result = load("bench_call_overhead").main(args)
    saved = json.loads(out.read_text())
    assert saved["benchmark"] == "bench_call_overhead" and len(saved["rows"]) == 6
    assert [r["case"] for r in saved["before"]] == [r["case"] for r in result["rows"]]
    assert all(r["time_ratio"] > 0 for r in result["rows"])
    assert "| case | before: revckpt / torch (IQR) |" in capsys.readouterr().out


def test_bench_demo_front_quick(tmp_path):
    out = tmp_path / "r.json"
    result = load("bench_demo_front").main(
        ["--runs", "1", "--size", "tiny", "--budget", "0.7", "--out", str(out)]
    )
    runs = json.loads(out.read_text())["runs"]
    assert len(runs) == 1 and runs[0]["dominated_by"] == [] and result["on_front"] == 1


_LOOP = """
import sys
sys.path.insert(0, sys.argv[2])
import _callgrind
total = sum(range(1000))  # before start(): not counted
_callgrind.start()
for i in range(int(sys.argv[1])):
    total += i
_callgrind.stop()
total += sum(range(100000))  # after stop(): not counted
"""


@pytest.mark.skipif(
    load("_callgrind").available() is not None, reason="needs valgrind, its headers and gcc"
)
def test_callgrind_counts_only_what_runs_between_start_and_stop(tmp_path):
    """The instruction counts of bench_against --instructions: the same code counts the same
    (within 1%), twice the loop counts twice the instructions."""
    cg = load("_callgrind")
    library = cg.build(tmp_path)
    script = tmp_path / "loop.py"
    script.write_text(_LOOP)

    def count(n):
        cmd = [sys.executable, str(script), str(n), str(ROOT / "benchmarks")]
        return cg.count(cmd, library, {"PATH": "/usr/bin:/bin"})

    once, again, twice = count(20000), count(20000), count(40000)
    assert abs(again - once) <= 0.01 * once
    assert 1.9 < twice / once < 2.1


def test_bench_against_quick(tmp_path):
    """Two workers (this checkout and HEAD's worktree), each importing its own revckpt."""
    result = load("bench_against").main(
        ["--quick", "--rounds", "1", "--steps", "1", "--out", str(tmp_path / "a.json")]
    )
    workloads = [r["workload"] for r in result["rows"]]
    assert workloads == list(load("bench_against").WORKLOADS)
    assert all(0 < r["ratio"] < float("inf") and len(r["rounds"]) == 1 for r in result["rows"])
    assert len(result["base"]) == 40


def test_bench_finetune_quick(tmp_path, capsys):
    out = tmp_path / "ft.json"
    args = ["--quick", "--repeats", "1", "--cache-dir", str(tmp_path / "cache"), "--out", str(out)]
    result = load("bench_finetune").main(args)
    assert json.loads(out.read_text())["benchmark"] == "bench_finetune"
    pre = result["pretraining"]
    assert not pre["cached"] and pre["heldout_loss"] < 0.85 * pre["uniform_loss"]
    rows = {r["variant"]: r for r in result["finetune"]}
    for kept in ("full FT", "LoRA r=8"):  # both start from the pretrained model's output
        assert rows[kept]["start_max_abs_logit_diff"] == 0.0
    loss = {name: r["final_heldout_loss"] for name, r in rows.items()}
    assert loss["full FT"] < loss["full FT from scratch"]  # the pretrained start helps
    assert result["checkpoint_check"]["max_abs_param_diff"] == 0.0
    # the written-out formulas of _finetune_split give make_reversible's own start (layer_f)
    split = {(r["variant"], r["scale"]): r for r in result["attention_f_mlp_g"]}
    simulated = split[("layer_f", 2**-8)]["start_relative_logit_diff"]  # the default scale
    measured = rows["reversible layer_f"]["start_relative_logit_diff"]
    assert simulated == pytest.approx(measured, rel=1e-3)
    assert split[("attention F, MLP G", 0.125)]["bits_per_element_per_layer"] == 6
    memory = {(r["depth"], r["variant"]): r for r in result["memory"]}
    for depth in (2, 4):
        full, lora = memory[(depth, "full FT")], memory[(depth, "LoRA r=8")]
        ckpt = memory[(depth, "per-layer checkpoint")]
        assert ckpt["step_peak_bytes"] < full["step_peak_bytes"]
        assert ckpt["gradient_bytes"] == full["gradient_bytes"] > lora["gradient_bytes"]
    assert {r["variant"] for r in result["time"]} == {v for _, v in memory}
    printed = capsys.readouterr().out
    assert "| variant | trainable params |" in printed and "| depth | variant |" in printed
    # a second run reuses the saved pretrained model
    assert load("bench_finetune").main(args)["pretraining"]["cached"]


def test_finetune_ranks_quick(tmp_path):
    out = tmp_path / "ranks.json"
    result = load("finetune_ranks").main(
        ["--quick", "--adapter-ranks", "8", "32", "--lora-ranks", "2", "--out", str(out)]
    )
    assert json.loads(out.read_text())["benchmark"] == "finetune_ranks"
    rows = {r["variant"]: r for r in result["finetune"]}
    assert list(rows) == [
        "full FT",
        "reversible layer_f, adapters r=8",
        "reversible layer_f, adapters r=32",
        "LoRA r=2",
    ]
    small = rows["reversible layer_f, adapters r=8"]
    large = rows["reversible layer_f, adapters r=32"]
    assert large["trainable_params"] == 4 * small["trainable_params"]
    # adapters start within make_reversible's scale of the pretrained model; LoRA exactly there
    assert 0 < small["start_relative_logit_diff"] < 1e-2
    assert rows["LoRA r=2"]["start_relative_logit_diff"] == 0
    for r in rows.values():
        assert math.isfinite(r["final_heldout_loss"])
        assert r["final_heldout_loss"] < r["start_heldout_loss"]


def test_finetune_start_is_linear_in_the_scale_and_auto_meets_it(tmp_path):
    out = tmp_path / "s.json"
    result = load("finetune_start").main(["--models", "nanogpt", "--out", str(out)])
    assert json.loads(out.read_text())["benchmark"] == "finetune_start"
    for row in result["rows"]:
        starts = [row["start"][str(k)] for k in (6, 8, 10)]
        assert starts[0] / starts[1] == pytest.approx(4, rel=0.05)  # halves with the scale
        assert starts[1] / starts[2] == pytest.approx(4, rel=0.05)
        assert 0 < row["auto_start"] <= 1e-3 and 1 <= row["auto_shift"] <= 16


def test_random_plan_peaks_few(tmp_path, capsys):
    out = tmp_path / "p.json"
    result = load("random_plan_peaks").main(["--plans", "3", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert rows == result["rows"] and len(rows) == 3
    assert all(r["plans"] == 3 and r["misses"] == 0 for r in rows), rows
    assert "| chain | plans |" in capsys.readouterr().out


def test_bench_profile_cost_quick(tmp_path):
    out = tmp_path / "cost.json"
    result = load("bench_profile_cost").main(["--quick", "--out", str(out)])
    assert json.loads(out.read_text())["benchmark"] == "bench_profile_cost"
    for row in result["models"].values():
        assert len(row["steps"]) == 2 and all(s > 0 for s in row["steps"])
        assert row["iqr_steps"][0] <= row["median_steps"] <= row["iqr_steps"][1]
        assert len(row["user_steps"]) == 2 and all(s > 0 for s in row["user_steps"])
        for seconds, pace, steps in zip(
            row["seconds"], row["user_step_seconds"], row["user_steps"], strict=True
        ):
            assert steps == pytest.approx(seconds / pace)


def test_bench_first_profile_quick(tmp_path, capsys):
    out = tmp_path / "first.json"
    result = load("bench_first_profile").main(["--quick", "--out", str(out)])
    assert json.loads(out.read_text())["benchmark"] == "bench_first_profile"
    assert [r["variant"] for r in result["runs"]] == ["rehearsed", "not rehearsed"]
    for per_model in result["summary"].values():
        assert set(per_model) == {"GPT-like", "HF Llama"}
        for row in per_model.values():
            assert row["processes"] == 1 and row["first_over_next"] > 0
            assert row["first_cost_steps"] > 0 and row["later_cost_steps"] > 0
    assert "| rehearsed | GPT-like |" in capsys.readouterr().out


def test_bench_step_context_quick(tmp_path, capsys):
    out = tmp_path / "context.json"
    result = load("bench_step_context").main(["--quick", "--out", str(out)])
    assert json.loads(out.read_text())["benchmark"] == "bench_step_context"
    assert "| GPT-like |" in capsys.readouterr().out
    layouts = load("bench_step_context")._layouts(7, 2)
    assert layouts["alternating"] == ["checkpoint"] * 2 + ["store"] * 2 + ["checkpoint"] * 2 + [
        "store"
    ]
    for row in result["models"].values():  # timings: present and finite, never compared (a
        # loaded machine read a profile's extra 0.0, clamped, and failed a "> 0" here)
        for key in ("profile_extra_over_forward", "checkpoint_step_extra_over_forward"):
            assert math.isfinite(row[key]) and row[key] >= 0, key
        assert row["checkpointed_blocks_alternating_over_all_checkpoint"] > 0


def test_bench_fit_depth_quick(tmp_path, capsys):
    out = tmp_path / "depth.json"
    result = load("bench_fit_depth").main(["--quick", "--rounds", "1", "--out", str(out)])
    assert json.loads(out.read_text())["benchmark"] == "bench_fit_depth"
    assert [(r["model"], r["layers"]) for r in result["rows"]] == [("gpt2", 2), ("gpt2", 4)]
    for row in result["rows"]:
        assert [f["error_budget"] for f in row["fits"]] == [0.0, 1e-2]
        for f in row["fits"]:
            assert f["fit_steps"] == pytest.approx(f["fit_seconds"] / f["plain_step_seconds"])
            assert f["within_budget"] and f["measured_over_predicted"] <= 1.0
    assert "| gpt2 | 4 |" in capsys.readouterr().out


def test_bench_models_time_model_summary_and_saved_tables(tmp_path, capsys):
    bench = load("bench_models")
    rows = [  # predicted overheads against measured ratios: within 15% / 0.03, or not
        {"variant": "fit", "predicted_overhead": 0.50, "time_ratio": 1.45},
        {"variant": "fit", "predicted_overhead": 0.60, "time_ratio": 1.40},
        {"variant": "fit", "predicted_overhead": 0.02, "time_ratio": 1.04},
        {"variant": "store-all", "time_ratio": 1.0},
    ]
    summary = bench.time_model({"models": [{"rows": rows}]})
    assert "for 2 of 3 fitted plans" in summary and "worst 50.0%" in summary
    saved = ROOT / "benchmarks" / "results" / "bench_models.json"
    result = bench.main(["--table-from", str(saved)])
    assert result["benchmark"] == "bench_models"
    out = capsys.readouterr().out
    assert "| model | variant |" in out and "time model:" in out


def test_bench_profile_spread_quick(tmp_path):
    result = load("bench_profile_spread").main(
        ["--quick", "--profiles", "2", "--repeats", "1", "--out", str(tmp_path / "s.json")]
    )
    for m in result["models"]:
        assert set(m["variants"]) == {"default", "one-stretch"}
        for r in m["variants"].values():
            assert len(r["within_15pct"]) == 2 and len(r["predicted"][0]) == len(m["plans"])
            assert 0 <= r["apart_median"] <= r["apart_worst"]
    from revckpt.schedule import probe

    assert probe._STRETCHES == 2  # the variants leave it as it ships


def test_bench_compress_quick(tmp_path):
    out = tmp_path / "c.json"
    result = load("bench_compress").main(["--quick", "--repeats", "1", "--out", str(out)])
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    assert len(rows) == len(result["rows"]) == 5
    store, bf16, e4m3 = rows["store"], rows["compress bf16"], rows["compress e4m3"]
    assert e4m3["held_after_forward_bytes"] < bf16["held_after_forward_bytes"]
    assert bf16["held_after_forward_bytes"] < store["held_after_forward_bytes"]
    assert store["gradient_error"] < 1e-5 < bf16["gradient_error"] < e4m3["gradient_error"]


def test_bench_error_hf_quick(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "e.json"
    result = load("bench_error_hf").main(["--quick", "--out", str(out)])
    assert json.loads(out.read_text())["benchmark"] == "bench_error_hf"
    for name, fits in result["models"].items():
        (row,) = fits
        assert not row["over_budget"]  # fit's check step keeps OPT's ReLU blocks within it
        if name == "gpt2":  # a plan with the codec, its error predicted and measured
            assert row["approx_segments"] >= 1
            assert row["predicted_error"] > 0 and row["measured_error"] > 0


def test_bench_segment_length_quick(tmp_path, capsys):
    out = tmp_path / "segments.json"
    result = load("bench_segment_length").main(["--quick", "--out", str(out)])
    assert json.loads(out.read_text())["benchmark"] == "bench_segment_length"
    assert load("bench_segment_length").lengths(24) == [1, 2, 3, 4, 6, 8, 12, 24]
    assert load("bench_segment_length").lengths(5) == [1, 2, 3, 4, 5]
    for row in result["models"].values():
        assert row["rows"][0]["blocks_per_segment"] == 1
        # measured times (a noisy profile can clamp one to 0): finite, not compared
        assert all(0 <= r["predicted_overhead"] < float("inf") for r in row["rows"])
    assert "| GPT-like | 1 |" in capsys.readouterr().out


def test_thread_clock_runs_a_benchmark_with_the_threads_cpu_clock(tmp_path):
    import subprocess

    script = tmp_path / "bench_probe.py"
    script.write_text(
        "import sys, time\n"
        "import revckpt.measure.timing as timing\n"
        "clock = timing.wall_time.__kwdefaults__['clock']\n"
        "print(time.perf_counter is time.thread_time, clock is time.thread_time, sys.argv[1:])\n"
    )
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "thread_clock.py"), str(script), "--x", "1"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.strip() == "True True ['--x', '1']", out
