"""``revckpt.fit``'s predicted gradient error against the measured one, on Hugging Face models
this project did not write (issue 15's error budget: "a bounded, reported gradient error").

Each architecture is built from a tiny config with random weights (4 layers, width 64,
vocabulary 256, batch 4 x 32 tokens; T5 3 + 3 layers; dropout 0), in train mode. For each of
``approx:bf16`` and ``approx:e4m3`` (``strategies=["store", "approx:<codec>"]``, so that the
plan uses the codec), ``fit(model, batch, memory_budget=0.5, error_budget=1e-2)`` (where 50% is
infeasible, at the error's ``smallest_budget_bytes``), then one training step of the fitted
model, and the relative L2 error of all parameter gradients against a float64 copy of the
model made before ``fit`` (``revckpt.measure.gradient_error``, the model's own loss). A row
reads the plan's ``predicted_error``, the measured error, and measured / predicted; ``over``
marks a measured error above the error budget.

Run ``python benchmarks/bench_error_hf.py`` (about two minutes on one CPU thread; ``--quick``:
two architectures, one codec); prints a table and writes
``benchmarks/results/bench_error_hf.json``.
"""

from __future__ import annotations

import argparse
import copy
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import transformers as T
from _common import environment, write_json  # benchmarks/_common.py

import revckpt
from revckpt.measure import gradient_error

OUT = Path(__file__).parent / "results" / "bench_error_hf.json"
BATCH, SEQ, VOCAB, WIDTH = 4, 32, 256, 64
Build = Callable[[], tuple[torch.nn.Module, dict[str, torch.Tensor]]]


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ))


def _causal(config: Any, model: Any, **options: Any) -> Build:
    def build() -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
        m = model(config(vocab_size=VOCAB, use_cache=False, **options))
        m.loss_type = "ForCausalLM"  # some names match no loss of transformers' table
        ids = _tokens()
        return m, {"input_ids": ids, "labels": ids}

    return build


_DECODER = dict(
    hidden_size=WIDTH,
    num_hidden_layers=4,
    num_attention_heads=4,
    intermediate_size=128,
    max_position_embeddings=SEQ,
)


def _bert() -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    config = T.BertConfig(vocab_size=VOCAB, hidden_dropout_prob=0.0,
                          attention_probs_dropout_prob=0.0, **_DECODER)  # fmt: skip
    ids, mask = _tokens(), torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[-1, 24:] = 0  # one padded sequence
    labels = ids.masked_fill((torch.arange(SEQ) % 3 != 0) | (mask == 0), -100)
    return T.BertForMaskedLM(config), {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _t5() -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    config = T.T5Config(vocab_size=VOCAB, d_model=WIDTH, d_kv=16, d_ff=128, num_layers=3,
                        num_decoder_layers=3, num_heads=4, dropout_rate=0.0, use_cache=False,
                        decoder_start_token_id=0, pad_token_id=0)  # fmt: skip
    labels = torch.randint(1, VOCAB, (BATCH, 16))
    return T.T5ForConditionalGeneration(config), {"input_ids": _tokens(), "labels": labels}


ARCHITECTURES: dict[str, Build] = {
    "gpt2": _causal(
        T.GPT2Config,
        T.GPT2LMHeadModel,
        n_embd=WIDTH,
        n_layer=4,
        n_head=4,
        n_positions=SEQ,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    ),
    "llama": _causal(T.LlamaConfig, T.LlamaForCausalLM, num_key_value_heads=2, **_DECODER),
    "qwen2": _causal(T.Qwen2Config, T.Qwen2ForCausalLM, num_key_value_heads=2, **_DECODER),
    "gemma": _causal(
        T.GemmaConfig, T.GemmaForCausalLM, num_key_value_heads=2, head_dim=16, **_DECODER
    ),
    "phi": _causal(
        T.PhiConfig,
        T.PhiForCausalLM,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attention_dropout=0.0,
        **_DECODER,
    ),
    "gpt_neox": _causal(
        T.GPTNeoXConfig, T.GPTNeoXForCausalLM, hidden_dropout=0.0, attention_dropout=0.0, **_DECODER
    ),
    "opt": _causal(
        T.OPTConfig,
        T.OPTForCausalLM,
        hidden_size=WIDTH,
        num_hidden_layers=4,
        num_attention_heads=4,
        ffn_dim=128,
        max_position_embeddings=SEQ,
        word_embed_proj_dim=WIDTH,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        layerdrop=0.0,
    ),
    "bloom": _causal(
        T.BloomConfig,
        T.BloomForCausalLM,
        hidden_size=WIDTH,
        n_layer=4,
        n_head=4,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    ),
    "bert": _bert,
    "t5": _t5,
}


def _loss(out: Any) -> torch.Tensor:
    return out.loss


def one_fit(build: Build, codec: str, error_budget: float) -> dict[str, Any]:
    """``fit`` with ``approx:<codec>`` allowed, then its measured gradient error."""
    torch.manual_seed(0)
    model, batch = build()
    model.train()
    reference = copy.deepcopy(model).double()
    options = dict(error_budget=error_budget, strategies=["store", f"approx:{codec}"],
                   loss_fn=_loss)  # fmt: skip
    budget: Any = 0.5
    try:
        plan = revckpt.fit(model, batch, memory_budget=budget, **options)
    except revckpt.InfeasibleBudgetError as err:
        budget = err.smallest_budget_bytes
        plan = revckpt.fit(model, batch, memory_budget=budget, **options)
    measured = gradient_error(model, reference, (), kwargs=batch, loss_fn=_loss).overall.rel_l2
    approx = [str(s.strategy) for s in plan.segments if str(s.strategy).startswith("approx")]
    return {
        "codec": codec,
        "budget": budget,
        "plan": str(plan.segments),
        "approx_segments": len(approx),
        "predicted_error": plan.predicted_error,
        "measured_error": measured,
        "ratio": measured / plan.predicted_error if plan.predicted_error > 0 else None,
        "over_budget": measured > error_budget,
    }


def table(rows: dict[str, list[dict[str, Any]]]) -> str:
    lines = [
        "| model | codec | approx segments | predicted | measured | measured / predicted |",
        "|---|---|---|---|---|---|",
    ]
    for name, fits in rows.items():
        for r in fits:
            ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}"
            over = " (over)" if r["over_budget"] else ""
            lines.append(
                f"| {name} | {r['codec']} | {r['approx_segments']} | {r['predicted_error']:.2e} "
                f"| {r['measured_error']:.2e}{over} | {ratio} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two architectures, bf16 only")
    parser.add_argument("--error-budget", type=float, default=1e-2)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    names = ["gpt2", "opt"] if args.quick else list(ARCHITECTURES)
    codecs = ["bf16"] if args.quick else ["bf16", "e4m3"]
    rows = {n: [one_fit(ARCHITECTURES[n], c, args.error_budget) for c in codecs] for n in names}
    result = {
        "benchmark": "bench_error_hf",
        "command": "python benchmarks/bench_error_hf.py" + (" --quick" if args.quick else ""),
        "environment": environment(),
        "error_budget": args.error_budget,
        "threads": 1,
        "models": rows,
    }
    print(table(rows))
    write_json(result, args.out)
    return result


if __name__ == "__main__":
    main()
