"""``make_reversible`` at its defaults (scale 2^-8, exact rebuild) on the device, for
``gpu_check.py``: the exact rebuild needs every layer's recompute in backward to give bitwise
what its forward gave, which the CPU does and CUDA kernels have not been shown to do.

On the fine-tuning benchmark's GPT (``_finetune_model.GPT``, pure torch; randomly initialised,
every weight trainable), one training step (cross-entropy on random tokens) rebuilt, the same
model's step with everything stored (``reversible_layers(model).mode = "store"``, plain
autograd of the same function) and with every layer checkpointed: the largest rebuilt-input
drift (0 when the rebuild is exact; ``check_inverse=1e9`` samples every layer and
never raises), the largest
gradient difference between the rebuilt and the stored step (0: bitwise), the start (the
converted model's logits against the model's before conversion) and each step's peak memory.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from _finetune_model import GPT, GPTConfig
from _finetune_variants import per_layer_checkpoint

import revckpt
from revckpt import MemoryMeter
from revckpt.inplace import reversible_layers

SIZES = {"gpu": (12, 768, 12, 8, 1024), "smoke": (3, 32, 2, 2, 16)}  # depth, width, heads, b, t


def _step(model: torch.nn.Module, idx: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        model.zero_grad(set_to_none=True)
        logits = model(idx)
        F.cross_entropy(logits.flatten(0, 1), idx.flatten()).backward()

    return step


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _peak(step: Callable[[], None], device: str) -> int:
    step()  # warm: what a later step reuses is allocated
    with MemoryMeter(device) as meter:
        step()
    return meter.peak_bytes


def reversible_rows(device: str, size: str) -> list[dict[str, Any]]:
    """The rows of the check (see the module docstring)."""
    depth, width, heads, batch, seq = SIZES[size]
    torch.manual_seed(0)
    config = GPTConfig(vocab=256, context=seq, depth=depth, width=width, heads=heads)
    plain = GPT(config).to(device)
    idx = torch.randint(0, 256, (batch, seq), device=device)
    model = copy.deepcopy(plain)
    revckpt.make_reversible(
        model, blocks="blocks", trainable="all", check_inverse=1e9
    )  # sampled everywhere, never raises
    layers = reversible_layers(model)
    with torch.no_grad():
        before, after = plain(idx).double(), model(idx).double()
    _step(model, idx)()
    drift = max(d for d in layers.last_drift if d is not None)
    rebuilt = _grads(model)
    layers.mode = "store"
    _step(model, idx)()
    stored = _grads(model)
    layers.mode = "reversible"
    worst = max((rebuilt[n] - g).abs().max().item() for n, g in stored.items())
    checkpointed = per_layer_checkpoint(copy.deepcopy(plain))[0]
    peaks = {
        "plain": _peak(_step(plain, idx), device),
        "per-layer checkpoint": _peak(_step(checkpointed, idx), device),
        "make_reversible (2^-8, exact)": _peak(_step(model, idx), device),
    }
    return [
        {
            "exact": layers.exact,
            "depth": depth,
            "width": width,
            "tokens": batch * seq,
            "start_relative_logit_change": float((after - before).norm() / before.norm()),
            "max_rebuilt_input_drift": drift,
            "max_abs_grad_difference_from_stored": worst,
            "peak_bytes": peaks,
        }
    ]


def reversible_lines(rows: list[dict[str, Any]]) -> list[str]:
    lines = []
    for r in rows:
        peaks = ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in r["peak_bytes"].items())
        lines.append(
            f"make_reversible defaults (exact={r['exact']}), GPT {r['depth']} x {r['width']}, "
            f"{r['tokens']} tokens: start {r['start_relative_logit_change']:.2e}, largest "
            f"rebuilt-input drift {r['max_rebuilt_input_drift']:.1e} (0: exact), largest "
            "gradient difference from plain autograd "
            f"{r['max_abs_grad_difference_from_stored']:.1e} (0: bitwise); step peaks: {peaks}"
        )
    return lines
