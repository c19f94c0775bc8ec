"""``docs/models.md`` runs as written, and ``benchmarks/bench_models.py`` runs in its quick mode.

The guide's blocks (everything before "## Model by model") run in order in one namespace,
after a prelude that builds the ``model``, ``batch`` and ``optimizer`` the first block uses (a
tiny Hugging Face GPT-2, as the guide says). Every model snippet after that heading runs on its
own, in a fresh namespace, so each is checked to be self-contained. Snippets that use
transformers are skipped where it is not installed.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import re
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "models.md"
MODELS_HEADING = "## Model by model"

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def guide_blocks() -> list[str]:
    return _python_blocks(DOC.read_text().split(MODELS_HEADING)[0])


def model_snippets() -> list[tuple[str, str]]:
    """``(section title, code)`` of every python block after the models heading."""
    after = DOC.read_text().split(MODELS_HEADING, 1)[1]
    found = []
    for section in re.split(r"\n### ", after)[1:]:
        title = section.splitlines()[0].strip()
        found += [(title, code) for code in _python_blocks(section)]
    return found


def _needs_transformers(code: str) -> bool:
    return re.search(r"^\s*(from|import) transformers\b", code, flags=re.M) is not None


def _prelude() -> dict:
    """The ``model``, ``batch`` and ``optimizer`` of the guide's first block."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=8,
        n_embd=64,
        n_head=4,
        n_positions=256,
        vocab_size=256,
        bos_token_id=0,
        eos_token_id=0,
        use_cache=False,
    )
    model = GPT2LMHeadModel(config).train()
    model.loss_type = "ForCausalLM"
    ids = torch.randint(0, 256, (8, 128))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return {
        "model": model,
        "batch": dict(input_ids=ids, labels=ids.clone()),
        "optimizer": optimizer,
    }


def test_the_doc_has_its_snippets() -> None:
    assert len(guide_blocks()) >= 6
    titles = [title for title, _ in model_snippets()]
    assert len(titles) == 5, titles
    assert 'memory_budget="30%"' in guide_blocks()[0]


def test_guide_blocks_run_in_order(tmp_path, monkeypatch) -> None:
    pytest.importorskip("transformers")
    monkeypatch.chdir(tmp_path)  # the saved plan lands here
    namespace = _prelude()
    for code in guide_blocks():
        exec(compile(code, str(DOC), "exec"), namespace)
    assert (tmp_path / "gpt2-plan.json").exists()


@pytest.mark.parametrize(
    "title, code", model_snippets(), ids=[t.split(" (")[0] for t, _ in model_snippets()]
)
def test_model_snippet_runs_on_its_own(title: str, code: str, tmp_path, monkeypatch) -> None:
    if _needs_transformers(code):
        pytest.importorskip("transformers")
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__main__"}
    exec(compile(code, f"{DOC} ({title})", "exec"), namespace)
    plan, meter = namespace["plan"], namespace["meter"]
    assert meter.peak_bytes <= plan.memory_budget_bytes
    assert meter.peak_bytes <= plan.predicted_peak_bytes


def _load_bench():
    if str(ROOT / "benchmarks") not in sys.path:
        sys.path.insert(0, str(ROOT / "benchmarks"))  # the script imports benchmarks/_common.py
    spec = importlib.util.spec_from_file_location(
        "bench_models", ROOT / "benchmarks" / "bench_models.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_models_quick(tmp_path, capsys) -> None:
    names = ["nanogpt"]
    if importlib.util.find_spec("transformers") is not None:
        names.append("gpt2")  # the Hugging Face rows: HF's own checkpointing, head to head
    out = tmp_path / "m.json"
    argv = ["--quick", "--repeats", "1", "--warmup", "0", "--models", *names, "--out", str(out)]
    result = _load_bench().main(argv)
    assert json.loads(out.read_text())["benchmark"] == "bench_models"
    assert [m["model"] for m in result["models"]] == names
    for m in result["models"]:
        rows = {r["variant"].split(" -> ")[0]: r for r in m["rows"]}
        assert {"store-all", "fit 50%", "fit 25%", "fit 10%", "fit 25%, error 1e-2"} <= rows.keys()
        assert rows["store-all"]["fraction_of_store_all"] == 1.0
        for name, r in rows.items():
            if name.startswith("fit"):
                assert r["within_budget"], r
                assert r["measured_over_predicted"] <= 1.0, r
                assert r["fit_steps"] > 0
                if "error" not in name:
                    assert r["gradient_error"] == 0.0, r  # exact strategies: bitwise gradients
            if r.get("infeasible"):
                assert r["smallest_budget_bytes"] == r["budget_bytes"]
        assert (m["head_to_head"] is not None) == (m["model"] == "gpt2")
    assert "| model | variant |" in capsys.readouterr().out
