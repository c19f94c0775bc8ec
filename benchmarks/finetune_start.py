"""How far ``revckpt.make_reversible`` moves a model's output at conversion, per scale, on
models nobody here wrote (issue 17: "output at conversion ... goal <= 1e-3").

The test zoo's transformers (``tests/zoo.py``: Hugging Face GPT-2, Llama, Qwen2 and BERT from
tiny configs, a nanoGPT-style GPT, ``nn.TransformerEncoder``), randomly initialised, each
converted (``variant``: layer_f and layer_g) at scales ``2^-k`` and rebuilt exactly (the
default for such scales), in float32. Per model and scale: the relative change of the output
(logits, or the last hidden state where there are none) against the model before conversion,
``||after - before|| / ||before||`` in float64, on one batch in eval mode, and the bits per
element and layer the exact rebuild keeps (``k``); and the scale ``make_reversible(...,
scale="auto", example=...)`` chose for a start within 1e-3, with the start it measured.

The change is the scale times the residual updates the auxiliary stream carries (see
``docs/reversible.md``), so it halves with the scale: a model whose updates are large against
its hidden state (random initialisation is such a model) needs a smaller scale for the same
start. Run ``python benchmarks/finetune_start.py`` (about a minute); prints a table and writes
``benchmarks/results/finetune_start.json``.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

import torch
from _common import environment, write_json  # benchmarks/_common.py

import revckpt

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "tests") not in sys.path:
    sys.path.append(str(ROOT / "tests"))  # the model zoo, tests/zoo.py
import zoo  # noqa: E402

OUT = Path(__file__).parent / "results" / "finetune_start.json"
NAMES = ("gpt2", "llama", "qwen2", "bert", "nanogpt", "encoder")
SHIFTS = (3, 6, 8, 10)


def _output(out: Any) -> torch.Tensor:
    for name in ("logits", "last_hidden_state"):
        if hasattr(out, name):
            return getattr(out, name)
    return out[0] if isinstance(out, tuple) else out


def _run(model: torch.nn.Module, example: Any) -> torch.Tensor:
    if isinstance(example, dict):
        args, kwargs = (), {k: v for k, v in example.items() if k != "labels"}
    else:
        args, kwargs = (example if isinstance(example, tuple) else (example,)), {}
    with torch.no_grad():
        return _output(model(*args, **kwargs)).double()


def start(name: str, variant: str, shift: int) -> float:
    """The relative output change of zoo model ``name`` converted at scale ``2^-shift``."""
    case = zoo.CASES[name]
    model = case.make_model().eval()
    example = case.make_example(4, 32)
    before = _run(model, example)
    revckpt.make_reversible(model, variant=variant, scale=2.0**-shift, blocks=case.blocks_path)
    after = _run(model, example)
    return float((after - before).norm() / before.norm())


def auto(name: str, variant: str) -> tuple[int, float]:
    """``make_reversible(scale="auto", example=...)`` on zoo model ``name``: the ``k`` of the
    scale ``2^-k`` it chose for a start within 1e-3, and the start it measured."""
    case = zoo.CASES[name]
    model = case.make_model()
    example = case.make_example(4, 32)
    revckpt.make_reversible(model, variant=variant, scale="auto", example=example,
                            blocks=case.blocks_path)  # fmt: skip
    layers = revckpt.inplace.reversible_layers(model)
    return round(-math.log2(layers.scale)), float(layers.start)


def table(rows: list[dict[str, Any]]) -> str:
    head = " | ".join(f"2^-{k} ({k} bits)" for k in SHIFTS)
    lines = [
        f"| model | variant | {head} | scale='auto': chosen, start |",
        "|---|---|" + "---|" * (len(SHIFTS) + 1),
    ]
    for r in rows:
        cells = " | ".join(f"{r['start'][str(k)]:.2e}" for k in SHIFTS)
        chosen = f"2^-{r['auto_shift']}, {r['auto_start']:.2e}"
        lines.append(f"| {r['model']} | {r['variant']} | {cells} | {chosen} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(NAMES), choices=NAMES)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for m in args.models:
        for v in ("layer_f", "layer_g"):
            shift, measured = auto(m, v)
            rows.append(
                {
                    "model": m,
                    "variant": v,
                    "start": {str(k): start(m, v, k) for k in SHIFTS},
                    "auto_shift": shift,
                    "auto_start": measured,
                }
            )
    result = {
        "benchmark": "finetune_start",
        "command": "python benchmarks/finetune_start.py",
        "environment": environment(),
        "dtype": "float32",
        "rows": rows,
    }
    print(table(rows))
    write_json(result, args.out)
    return result


if __name__ == "__main__":
    main()
