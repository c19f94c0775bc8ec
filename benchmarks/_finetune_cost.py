"""Memory and time of one fine-tuning step, for ``bench_finetune.py``.

A step is what fine-tuning runs: ``zero_grad`` (gradients kept, zeroed in place), forward,
cross-entropy loss, backward, gradient clipping, AdamW step. Memory is measured by
``revckpt.MemoryMeter("cpu")`` (exact tensor storages) around a whole step, after a warm-up step
has allocated the gradients and AdamW's state, so the figures are above the static memory
(parameters, gradients, optimiser state, reported beside them): activations and the step's
transients. Times are interleaved rounds of every variant's step (``revckpt.time_ratios``),
divided by full fine-tuning's time of the same round.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
from _finetune_data import Batch
from _finetune_model import GPT, GPTConfig
from _finetune_train import adamw, lm_loss, train_step
from _finetune_variants import BASELINE, Variant, instantiate
from torch import nn

from revckpt import MemoryMeter, time_ratios


def _storage_bytes(tensors: Sequence[torch.Tensor]) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def static_bytes(
    model: nn.Module, params: Sequence[nn.Parameter], opt: torch.optim.Optimizer
) -> dict[str, int]:
    """Bytes of the parameters (all, trainable or not), of the trainable ones' gradients and of
    the optimiser's state."""
    state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return {
        "parameter_bytes": _storage_bytes(list(model.parameters())),
        "gradient_bytes": _storage_bytes([p.grad for p in params if p.grad is not None]),
        "optimizer_state_bytes": _storage_bytes(state),
    }


def step_memory(
    model: nn.Module, params: Sequence[nn.Parameter], batch: Batch, lr: float = 1e-4
) -> dict[str, int]:
    """Activation memory of one training step (see the module docstring): the step's peak,
    the peak of its forward and backward, and what the forward keeps for backward (the
    logits and loss included), all above the static memory."""
    opt = adamw(params, lr)
    train_step(model, params, opt, batch)  # warm-up: gradients and AdamW state allocated
    x, y = batch
    meter = MemoryMeter("cpu")
    with meter:
        opt.zero_grad(set_to_none=False)
        loss = lm_loss(model(x), y)
        retained = meter.live_bytes
        loss.backward()
        fwd_bwd_peak = meter.phase_peak_bytes
        nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        del loss
    return {
        "step_peak_bytes": meter.peak_bytes,
        "fwd_bwd_peak_bytes": fwd_bwd_peak,
        "retained_after_forward_bytes": retained,
        **static_bytes(model, params, opt),
    }


def cost_model(depth: int, width: int, heads: int, context: int, vocab: int) -> GPT:
    """The model the cost parts convert: a GPT of the fine-tuned one's shape at ``depth``,
    freshly initialised (memory and time do not depend on the weights' values)."""
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab=vocab, context=context, depth=depth, width=width, heads=heads))


def memory_rows(
    variants: Sequence[tuple[str, Variant]], base: GPT, batch: Batch
) -> list[dict[str, Any]]:
    rows = []
    for name, make in variants:
        model, params = instantiate(make, base)
        rows.append(
            {"depth": base.config.depth, "variant": name, **step_memory(model, params, batch)}
        )
    return rows


def time_rows(
    variants: Sequence[tuple[str, Variant]],
    base: GPT,
    batch: Batch,
    *,
    repeats: int,
    warmup: int = 2,
    lr: float = 1e-4,
) -> list[dict[str, Any]]:
    """Every variant's step, once per round in rotated order; ratios to full FT's step of the
    same round (median and interquartile range)."""
    fns = {}
    for name, make in variants:
        model, params = instantiate(make, base)
        opt = adamw(params, lr)
        fns[name] = functools.partial(train_step, model, params, opt, batch)
    ratios = time_ratios(fns, baseline=BASELINE, repeats=repeats, warmup=warmup)
    return [
        {
            "depth": base.config.depth,
            "variant": name,
            "time_ratio": r.ratio,
            "time_ratio_q25": r.q25,
            "time_ratio_q75": r.q75,
            "step_seconds_median": r.candidate_seconds,
            "repeats": r.repeats,
        }
        for name, r in ratios.items()
    ]
