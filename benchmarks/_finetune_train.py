"""Training loops of ``bench_finetune.py``: the pretrained model (cached) and fine-tuning runs.

Every run is AdamW (betas 0.9/0.95, no weight decay), gradient norm clipped at 1, batches of
``batch`` sequences of ``context`` tokens drawn from a seed (the same batches for every
variant and learning rate). Pretraining warms the learning rate up over 10% of the steps and
decays it along a cosine to a tenth; fine-tuning keeps it constant.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from _finetune_data import Batch, Language, markov_language, related_language
from _finetune_model import GPT, GPTConfig
from torch import nn

CACHE_DIR = Path(__file__).parent / "results" / "finetune_cache"
DATA_VERSION = "markov4x4-v1"  # in the cache file names: bump when the languages change
HELDOUT_SEED = 10_000  # held-out batches; training batches are drawn from the run's seed
TRAIN_SEED = 1_000


def tasks(vocab: int = 64) -> tuple[Language, Language]:
    """(task 1, task 2): the pretraining language and the related fine-tuning one."""
    task1 = markov_language(vocab, seed=0)
    return task1, related_language(task1, 0.5, seed=1)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


@torch.no_grad()
def heldout_loss(model: nn.Module, batches: Sequence[Batch]) -> float:
    was = model.training
    model.eval()
    loss = statistics.fmean(lm_loss(model(x), y).item() for x, y in batches)
    model.train(was)
    return loss


def adamw(params: Sequence[nn.Parameter], lr: float) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)


def train_step(
    model: nn.Module, params: Sequence[nn.Parameter], opt: torch.optim.Optimizer, batch: Batch
) -> float:
    """One step: forward, loss, backward, clip, optimizer step; returns the loss."""
    opt.zero_grad(set_to_none=False)
    loss = lm_loss(model(batch[0]), batch[1])
    loss.backward()
    nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    return loss.item()


def _cosine(step: int, steps: int) -> float:
    warm = max(1, steps // 10)
    if step < warm:
        return (step + 1) / warm
    return 0.1 + 0.45 * (1 + math.cos(math.pi * (step - warm) / max(1, steps - warm)))


def _window_means(losses: Sequence[float], points: int = 5, window: int = 10) -> list[dict]:
    """The mean training loss over ``window`` steps at ``points`` evenly spaced steps."""
    marks = sorted({round(i * (len(losses) - 1) / (points - 1)) for i in range(points)})
    return [
        {"step": m, "loss": statistics.fmean(losses[max(0, m + 1 - window) : m + 1])} for m in marks
    ]


def _cache_path(cache_dir: Path, config: GPTConfig, steps: int, seed: int, batch: int) -> Path:
    c = config
    name = f"gpt_d{c.depth}_w{c.width}_h{c.heads}_c{c.context}_v{c.vocab}_t{int(c.tie)}"
    return cache_dir / f"{name}_steps{steps}_b{batch}_seed{seed}_{DATA_VERSION}.pt"


def _pretrain_run(model: GPT, steps: int, seed: int, batch: int, lr: float) -> dict[str, Any]:
    task1, _ = tasks(model.config.vocab)
    params = list(model.parameters())
    opt = adamw(params, lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _cosine(s, steps))
    g = torch.Generator().manual_seed(TRAIN_SEED + seed)
    start = time.perf_counter()
    losses = []
    for _ in range(steps):
        s = task1.sample(batch, model.config.context + 1, g)
        losses.append(train_step(model, params, opt, (s[:, :-1], s[:, 1:])))
        sched.step()
    seconds = time.perf_counter() - start
    heldout = task1.batches(batch, model.config.context, HELDOUT_SEED, 4)
    return {
        "steps": steps,
        "batch": batch,
        "lr": lr,
        "seed": seed,
        "seconds": seconds,
        "final_train_loss": statistics.fmean(losses[-10:]),
        "heldout_loss": heldout_loss(model, heldout),
        "curve": _window_means(losses),
        "uniform_loss": math.log(model.config.vocab),
        "task1_floor": task1.floor(context=model.config.context),
    }


def pretrain(
    depth: int = 6,
    width: int = 128,
    steps: int = 200,
    seed: int = 0,
    *,
    heads: int = 4,
    context: int = 64,
    vocab: int = 64,
    batch: int = 16,
    lr: float = 2e-3,
    cache_dir: Path = CACHE_DIR,
    log: Callable[[str], None] = print,
) -> GPT:
    """The GPT pretrained on task 1, loaded from ``cache_dir`` when a run of the same settings
    is saved there, else trained and saved. Its ``pretrain_record`` attribute holds the run's
    figures (time, loss curve, final losses); ``"cached"`` says whether it was loaded."""
    config = GPTConfig(vocab=vocab, context=context, depth=depth, width=width, heads=heads)
    path = _cache_path(Path(cache_dir), config, steps, seed, batch)
    torch.manual_seed(seed)
    model = GPT(config)
    if path.exists():
        saved = torch.load(path, weights_only=True)
        model.load_state_dict(saved["state_dict"])
        record = {**saved["record"], "cached": True}
        log(f"pretrained model loaded from {path}")
    else:
        log(f"pretraining depth {depth}, width {width}, {steps} steps ...")
        record = _pretrain_run(model, steps, seed, batch, lr)
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"state_dict": model.state_dict(), "record": record}, path)
        record = {**record, "cached": False}
    log(
        f"pretraining: final train loss {record['final_train_loss']:.3f}, held-out "
        f"{record['heldout_loss']:.3f} (uniform {record['uniform_loss']:.3f}, floor "
        f"{record['task1_floor']:.3f}), {record['seconds']:.1f} s"
    )
    model.pretrain_record = record
    return model


def finetune(
    model: nn.Module,
    params: Sequence[nn.Parameter],
    task: Language,
    *,
    steps: int,
    lr: float,
    batch: int,
    seed: int,
    heldout: Sequence[Batch],
    eval_points: int = 3,
) -> dict[str, Any]:
    """Train ``params`` of ``model`` on ``task`` for ``steps`` steps at a constant ``lr``.

    ``final_heldout_loss`` is the mean of the held-out loss at the last ``eval_points``
    evaluations, every ``max(1, steps // 20)`` steps up to the last one."""
    opt = adamw(params, lr)
    g = torch.Generator().manual_seed(TRAIN_SEED + seed)
    every = max(1, steps // 20)
    evals_at = {steps - i * every for i in range(eval_points)}
    context = heldout[0][0].shape[1]  # the held-out batches' length
    losses, evals = [], []
    for step in range(1, steps + 1):
        s = task.sample(batch, context + 1, g)
        losses.append(train_step(model, params, opt, (s[:, :-1], s[:, 1:])))
        if step in evals_at:
            evals.append(heldout_loss(model, heldout))
    finite = all(math.isfinite(v) for v in losses)
    return {
        "lr": lr,
        "final_train_loss": statistics.fmean(losses[-10:]),
        "final_heldout_loss": statistics.fmean(evals) if finite else math.inf,
        "curve": _window_means(losses),
    }
