"""The synthetic languages of ``bench_finetune.py``: deterministic from a seed, no downloads.

A :class:`Language` is a set of ``topics`` sparse Markov chains over one vocabulary: every
sequence draws a topic, a uniform first token, then each next token from its topic's row of the
current token. Each row has ``successors`` allowed next tokens with Dirichlet(1) weights. A
model that ignores the context beyond the current token mixes the topics' rows; telling the
topic from the tokens seen so far (attention) brings its loss down to the chains' own entropy,
:meth:`Language.floor`.

* task 1 (pretraining): ``markov_language(vocab, seed=...)``;
* task 2 (fine-tuning): ``related_language(task1, fraction, seed=...)``: the same topics, with
  the rows of a ``fraction`` of the tokens re-drawn (in every topic). The rest of the
  structure, and the way to infer a topic, carry over from task 1, so fine-tuning from the
  pretrained model starts (and ends) far below training from scratch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Language:
    probs: torch.Tensor  # (topics, vocab, vocab), rows sum to 1

    @property
    def vocab(self) -> int:
        return self.probs.shape[-1]

    def sample(self, batch: int, length: int, generator: torch.Generator) -> torch.Tensor:
        """``batch`` sequences of ``length`` tokens, (batch, length) int64."""
        topics, vocab = self.probs.shape[:2]
        topic = torch.randint(topics, (batch,), generator=generator)
        tokens = [torch.randint(vocab, (batch,), generator=generator)]
        for _ in range(length - 1):
            rows = self.probs[topic, tokens[-1]]
            tokens.append(torch.multinomial(rows, 1, generator=generator).squeeze(1))
        return torch.stack(tokens, dim=1)

    def batches(self, batch: int, context: int, seed: int, count: int) -> list[Batch]:
        """``count`` (inputs, targets) pairs of (batch, context) tokens, drawn from ``seed``."""
        g = torch.Generator().manual_seed(seed)
        out = []
        for _ in range(count):
            s = self.sample(batch, context + 1, g)
            out.append((s[:, :-1], s[:, 1:]))
        return out

    def floor(self, batch: int = 256, context: int = 64, seed: int = 12345) -> float:
        """Mean loss, in nats per token, of predicting with the true chain of each sequence's
        topic (known from the first token on): a little below the best a model can do, which
        has to infer the topic from the tokens."""
        g = torch.Generator().manual_seed(seed)
        topics, vocab = self.probs.shape[:2]
        topic = torch.randint(topics, (batch,), generator=g)
        cur = torch.randint(vocab, (batch,), generator=g)
        total = 0.0
        for _ in range(context):
            rows = self.probs[topic, cur]
            nxt = torch.multinomial(rows, 1, generator=g).squeeze(1)
            total += -rows.gather(1, nxt[:, None]).log().mean().item()
            cur = nxt
        return total / context


Batch = tuple[torch.Tensor, torch.Tensor]


def _rows(count: int, vocab: int, successors: int, g: torch.Generator) -> torch.Tensor:
    """``count`` rows over ``vocab`` tokens, each with ``successors`` non-zero Dirichlet(1)
    weights on distinct tokens."""
    rows = torch.zeros(count, vocab)
    for i in range(count):
        nxt = torch.randperm(vocab, generator=g)[:successors]
        w = -torch.rand(successors, generator=g).clamp_min(1e-6).log()  # Exp(1) -> Dirichlet(1)
        rows[i, nxt] = w / w.sum()
    return rows


def markov_language(
    vocab: int = 64, *, topics: int = 4, successors: int = 4, seed: int = 0
) -> Language:
    """Task 1: ``topics`` random sparse Markov chains over ``vocab`` tokens."""
    g = torch.Generator().manual_seed(seed)
    probs = torch.stack([_rows(vocab, vocab, successors, g) for _ in range(topics)])
    return Language(probs)


def related_language(
    base: Language, fraction: float = 0.5, *, successors: int = 4, seed: int = 1
) -> Language:
    """Task 2: ``base`` with the rows of ``round(fraction * vocab)`` tokens (the same tokens in
    every topic) re-drawn; the other rows are ``base``'s."""
    g = torch.Generator().manual_seed(seed)
    topics, vocab = base.probs.shape[:2]
    changed = torch.randperm(vocab, generator=g)[: round(fraction * vocab)]
    probs = base.probs.clone()
    for t in range(topics):
        probs[t, changed] = _rows(len(changed), vocab, successors, g)
    return Language(probs)


def uniform_loss(vocab: int) -> float:
    return math.log(vocab)
