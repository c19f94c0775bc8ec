"""The fine-tuning variants of ``bench_finetune.py``.

A variant is a name and a function ``make(model: GPT) -> (model_to_train, params)``:

* ``model`` is the pretrained GPT, already a private copy (``copy.deepcopy``): the function may
  change it in place and return it. The harness seeds torch (``torch.manual_seed``) before the
  call, so random initialisations inside it are reproducible.
* ``model_to_train`` maps token ids (batch, time) int64 to logits (batch, time, vocab), in
  training mode; it is what the harness trains, measures and times.
* ``params`` are the parameters the optimiser updates (all others must stay fixed); their
  gradients, and AdamW's state for them, count as the static memory, not the activations.

The same variant runs in the three parts of the benchmark: the fine-tuning sweep (held-out
loss of task 2, and how far its untrained output is from the pretrained model's: 0 when it
keeps the starting point), the activation memory of one step, and the time of one step.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from _finetune_model import GPT, add_lora
from torch import nn

import revckpt

Variant = Callable[[GPT], tuple[nn.Module, list[nn.Parameter]]]

BASELINE = "full FT"
SAME_LOSS_AS_BASELINE = "per-layer checkpoint"  # exact recompute: not trained in the sweep


def full_finetune(model: GPT) -> tuple[nn.Module, list[nn.Parameter]]:
    """Every parameter trainable."""
    return model, list(model.parameters())


def from_scratch(model: GPT) -> tuple[nn.Module, list[nn.Parameter]]:
    """Full training of a freshly initialised GPT of the same configuration (the reference a
    pretrained starting point must beat)."""
    fresh = GPT(model.config)
    return fresh, list(fresh.parameters())


def lora(rank: int = 8) -> Variant:
    """Rank-``rank`` adapters on the blocks' attention and MLP linear layers, the rest frozen
    (embeddings, LayerNorms and head included)."""

    def make(model: GPT) -> tuple[nn.Module, list[nn.Parameter]]:
        return model, add_lora(model, rank)

    make.__doc__ = f"LoRA rank {rank}"
    return make


class Checkpointed(nn.Module):
    """``revckpt.checkpoint(block, x)``: the block's input kept, its inside recomputed."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return revckpt.checkpoint(self.block, x)


def per_layer_checkpoint(model: GPT) -> tuple[nn.Module, list[nn.Parameter]]:
    """Full fine-tuning with every block checkpointed (same arithmetic as full FT)."""
    model.blocks = nn.ModuleList(Checkpointed(b) for b in model.blocks)
    return model, list(model.parameters())


def reversible(
    variant: str, trainable: str, scale: float | None = None, exact: bool | str = "auto"
) -> Variant:
    """``revckpt.make_reversible`` on the GPT's blocks (MEFT-style adapters; ``trainable``:
    ``"adapters"``, everything but the adapters frozen, embeddings and head included, as for
    the LoRA baseline; or ``"all"``); ``scale=None``: make_reversible's default (2^-8, rebuilt
    exactly by its default ``exact="auto"``)."""

    def make(model: GPT) -> tuple[nn.Module, list[nn.Parameter]]:
        if trainable == "adapters":  # make_reversible freezes the blocks; the rest too here
            model.requires_grad_(False)
        options: dict = {} if scale is None else {"scale": scale}
        revckpt.make_reversible(
            model, blocks="blocks", variant=variant, trainable=trainable, exact=exact, **options
        )
        return model, [p for p in model.parameters() if p.requires_grad]

    how = "defaults" if scale is None else f"scale {scale:g}"
    how += "" if exact == "auto" else (", exact" if exact else ", floating point")
    make.__doc__ = f"reversible {variant}, {how}, trainable {trainable}"
    return make


def reversible_variants() -> list[tuple[str, Variant]]:
    """The reversible fine-tuning variants (issue 17, after MEFT), at make_reversible's
    defaults (scale 2^-8, exact rebuild): the layer as F with an adapter as G, and the
    reverse, adapters only; layer_f with every weight trainable (full fine-tuning in a
    reversible stack) and with LoRA; then scale 1/8 (the default before session 19: four times
    further from the start, three bits fewer kept per element), in floating point with
    anchors and exact."""
    return [
        ("reversible layer_f", reversible("layer_f", "adapters")),
        ("reversible layer_g", reversible("layer_g", "adapters")),
        ("reversible layer_f, all trainable", reversible("layer_f", "all")),
        ("reversible layer_f + LoRA r=8", reversible_lora(8)),
        ("reversible layer_f, 1/8 floating", reversible("layer_f", "adapters", 0.125, False)),
        (
            "reversible layer_f, 1/8 floating, all trainable",
            reversible("layer_f", "all", 0.125, False),
        ),
        ("reversible layer_f, 1/8 exact, all trainable", reversible("layer_f", "all", 0.125, True)),
    ]


def reversible_lora(rank: int) -> Variant:
    """LoRA on the blocks' linear layers (the base frozen), then ``make_reversible`` keeping
    what is trainable as it is: the LoRA factors and the reversible adapters train."""

    def make(model: GPT) -> tuple[nn.Module, list[nn.Parameter]]:
        add_lora(model, rank)
        revckpt.make_reversible(model, blocks="blocks", trainable="all")
        return model, [p for p in model.parameters() if p.requires_grad]

    return make


def finetune_variants(lora_rank: int = 8) -> list[tuple[str, Variant]]:
    """The variants whose fine-tuning loss the benchmark measures."""
    return [
        (BASELINE, full_finetune),
        ("full FT from scratch", from_scratch),
        (f"LoRA r={lora_rank}", lora(lora_rank)),
        *reversible_variants(),
    ]


def cost_variants(lora_rank: int = 8) -> list[tuple[str, Variant]]:
    """The variants whose memory and time the benchmark measures (the first is the baseline)."""
    return [
        (BASELINE, full_finetune),
        (f"LoRA r={lora_rank}", lora(lora_rank)),
        (SAME_LOSS_AS_BASELINE, per_layer_checkpoint),
        *reversible_variants(),
    ]


def instantiate(
    make: Variant, pretrained: GPT, seed: int = 0
) -> tuple[nn.Module, list[nn.Parameter]]:
    """``make`` applied to a deep copy of ``pretrained``, torch seeded first."""
    torch.manual_seed(seed)
    model, params = make(copy.deepcopy(pretrained))
    model.train()
    return model, list(params)
