"""MEFT's third variant (attention as ``F``, MLP as ``G``) at conversion, for ``bench_finetune.py``.

revckpt does not build this variant (docs/reversible.md says why); this measures what it would
start from. At conversion the adapters are zero, so a reversible stack computes exactly its
coupling formulas, written out here in float64 on the pretrained GPT's own sub-layers
(``S_attn(u) = u + attn(ln1(u))``, ``S_mlp(u) = u + mlp(ln2(u))``), each coupling centred as
revckpt's are (the scaled stream minus the branch input, so the move is ``scale`` times a
residual update):

* ``layer_f`` (what :func:`revckpt.make_reversible` builds): ``h' = L(h) + scale * a``,
  ``a' = h - h'``; one scaled coupling per layer;
* attention as ``F``, MLP as ``G``: ``m = S_attn(h) + scale * (a - h)``, ``h' = S_mlp(m) +
  scale * (h - m)``, the streams ``(m, h')``; two scaled couplings per layer.

Each scaled coupling drops ``log2(1 / scale)`` bits per element, which an exact rebuild must
keep (``exact=True``: one byte per element per coupling), so the table also gives the bits a
layer costs.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
from _finetune_model import GPT


def _embed(model: GPT, idx: torch.Tensor) -> torch.Tensor:
    return model.drop(model.tok(idx) + model.pos(torch.arange(idx.shape[1])))


def _layer_f(model: GPT, x: torch.Tensor, scale: float) -> torch.Tensor:
    h, a = x, torch.zeros_like(x)  # the first layer's auxiliary input: zeros, exact
    for block in model.blocks:
        out = block(h) + scale * a
        a, h = h - out, out
    return h


def _attention_f(model: GPT, x: torch.Tensor, scale: float) -> torch.Tensor:
    h, a = x, None
    for block in model.blocks:
        mid = h + block.attn(block.ln1(h))
        if a is not None:  # the first layer's auxiliary input is zeros: no move
            mid = mid + scale * (a - h)
        out = mid + block.mlp(block.ln2(mid)) + scale * (h - mid)
        a, h = mid, out
    return h


def split_rows(pretrained: GPT, idx: torch.Tensor, scales: tuple[float, ...]) -> list[dict]:
    """Per variant and scale: the relative change of the logits at conversion, and the bits
    per element per layer an exact rebuild keeps."""
    model = copy.deepcopy(pretrained).double().eval()
    rows: list[dict[str, Any]] = []
    with torch.no_grad():
        x = _embed(model, idx)
        ref = model.head(model.ln_f(torch.nn.Sequential(*model.blocks)(x)))
        for name, run, couplings in (
            ("layer_f", _layer_f, 1),
            ("attention F, MLP G", _attention_f, 2),
        ):
            for scale in scales:
                got = model.head(model.ln_f(run(model, x, scale)))
                rows.append({
                    "variant": name,
                    "scale": scale,
                    "start_relative_logit_diff": ((got - ref).norm() / ref.norm()).item(),
                    "bits_per_element_per_layer": couplings * int(-math.log2(scale)),
                })  # fmt: skip
    return rows


def split_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| variant | scale | start (relative logit change) | bits kept per element and layer |",
        "|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['variant']} | 2^{int(math.log2(r['scale']))} | "
            f"{r['start_relative_logit_diff']:.2e} | {r['bits_per_element_per_layer']} |"
        )
    return "\n".join(lines)
