"""Reconstruction drift of ``revckpt.make_reversible``, for ``bench_finetune.py``.

Per depth, dtype (float32, bfloat16), variant and scale (layer_f and layer_g at 2^-3,
layer_f at 2^-8) and anchoring (``anchor_every="auto"``, no anchors, and ``exact=True``:
the fixed-point streams), on a freshly initialised GPT of that depth (seeded; the pretrained
model of the benchmark has one depth only):

* start: the relative change of the logits at conversion, ``|y_rev - y| / |y|``;
* rebuild drift: the largest relative error of a rebuilt layer input in one backward
  (``reversible_layers(model).last_drift``; the check measures, ``check_inverse=1e9`` never
  raises);
* gradient error: the relative error of every trainable gradient, the largest over the
  parameters, against the same converted model run with plain autograd in the same dtype
  (``reversible = False``): what the rebuild costs, apart from the dtype's own rounding.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from typing import Any

import torch
from _finetune_model import GPT, GPTConfig
from _finetune_train import lm_loss

import revckpt
from revckpt.inplace import reversible_layers

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _grads(model: GPT, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    lm_loss(model(x).float(), y).backward()
    return {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}


def _gradient_error(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    worst = 0.0
    for name, ref in b.items():
        got = a.get(name, torch.zeros_like(ref))
        scale = ref.norm().item()
        if scale > 0:
            worst = max(worst, (got - ref).norm().item() / scale)
    return worst


def drift_row(
    config: GPTConfig, dtype: str, variant: str, anchors: str | None, batch: int, scale: float
) -> dict[str, Any]:
    torch.manual_seed(config.depth)
    model = GPT(config).to(DTYPES[dtype])
    original = copy.deepcopy(model)
    how = {"exact": True} if anchors == "exact" else {"anchor_every": anchors, "exact": False}
    revckpt.make_reversible(
        model, blocks="blocks", variant=variant, trainable="all", scale=scale,
        check_inverse=1e9, **how,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    data = torch.randint(0, config.vocab, (batch, config.context + 1), generator=gen)
    x, y = data[:, :-1], data[:, 1:]
    with torch.no_grad():
        ref, got = original(x).float(), model(x).float()
    start = ((got - ref).norm() / ref.norm()).item()
    layers = reversible_layers(model)
    rebuilt = _grads(model, x, y)
    drift = max((d for d in layers.last_drift if d is not None), default=0.0)
    layers.reversible = False
    plain = _grads(model, x, y)
    return {
        "depth": config.depth,
        "dtype": dtype,
        "variant": variant,
        "scale": scale,
        "anchor_every": layers.stack.anchor_every,
        "anchors": anchors or "none",
        "stream_dtype": str(layers.stream_dtype or DTYPES[dtype]).replace("torch.", ""),
        "start_relative_change": start,
        "rebuild_drift": drift,
        "gradient_error": _gradient_error(rebuilt, plain),
    }


SETTINGS = (("layer_f", 2**-3), ("layer_g", 2**-3), ("layer_f", 2**-8))


def drift_rows(depths: Sequence[int], width: int, batch: int) -> list[dict[str, Any]]:
    rows = []
    for depth in depths:
        config = GPTConfig(depth=depth, width=width)
        for dtype in DTYPES:
            for variant, scale in SETTINGS:
                for anchors in ("auto", None, "exact"):
                    rows.append(drift_row(config, dtype, variant, anchors, batch, scale))
                    r = rows[-1]
                    print(
                        f"  drift depth {depth} {dtype} {variant} {scale:g} {r['anchors']}: "
                        f"start {r['start_relative_change']:.2e}, rebuild "
                        f"{r['rebuild_drift']:.2e}, gradients {r['gradient_error']:.2e}",
                        flush=True,
                    )
    return rows


def drift_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| depth | dtype (streams) | variant | scale | anchor_every | start: relative change | "
        "rebuilt-input drift | gradient error vs plain autograd |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        k = r["anchor_every"]
        auto = r["anchors"] == "auto"
        anchors = (f"auto: {k or 'none'}") if auto else r["anchors"]
        lines.append(
            f"| {r['depth']} | {r['dtype']} ({r['stream_dtype']}) | {r['variant']} | "
            f"2^{round(math.log2(r['scale']))} | {anchors} | "
            f"{r['start_relative_change']:.2e} | {r['rebuild_drift']:.2e} | "
            f"{r['gradient_error']:.2e} |"
        )
    return "\n".join(lines)
