"""A small model zoo for whole-model memory-planning tests.

Each :class:`Case` builds one tiny float32 model with random weights (no downloads) and
examples for it, in training mode, deterministically: ``make_model()`` seeds its own RNG
(and leaves the caller's global RNG untouched), ``make_example(batch, seq)`` draws from a
private generator, so the same call gives the same weights and the same batch every time.

Hugging Face cases (``gpt2``, ``llama``, ``qwen2``, ``bert``) need ``transformers``; the
others (``nanogpt``, ``encoder``, ``resnet``) are plain PyTorch and written here.

Notes found while building it (transformers 5.x):

* causal LMs default to ``use_cache=True`` even in training mode, so their output carries a
  ``DynamicCache`` holding every layer's keys and values; the zoo sets ``use_cache=False``
  so the output is only ``loss`` and ``logits``, which is what a training step means;
* ``GPT2LMHeadModel``'s name matches no loss in transformers' table, which warns
  "`loss_type=None` ... Using the default loss: `ForCausalLMLoss`"; the zoo names it;
* ``GPT2Config`` keeps GPT-2's ``bos/eos_token_id=50256``, outside a 256-token vocabulary
  (transformers warns); the zoo sets them to 0;
* dropout probabilities are 0.0 everywhere so that a recomputed forward is bitwise the same.

``resnet`` has BatchNorm in training mode: each forward updates running statistics, so a
strategy that reruns a forward changes the buffers (``num_batches_tracked`` most visibly).
``encoder`` is ``nn.TransformerEncoder`` built with ``enable_nested_tensor=False``: with it on,
a forward without grad in eval mode takes the nested-tensor fast path and returns zeros at
padded positions, unlike the training forward (with it off, that forward still takes the fused
fast path, equal to the training forward only to round-off, about 1e-6).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

BATCH = 4
SEQ = 32
VOCAB = 256
SIDE = 16  # resnet image side
_SMALLER = ((4, 24), (2, 32), (2, 16))


@dataclass(frozen=True)
class Case:
    name: str
    make_model: Callable[[], nn.Module]
    make_example: Callable[..., Any]  # make_example(batch=None, seq=None)
    loss_fn: Callable[[Any], torch.Tensor] | None  # None: the output has .loss
    blocks_path: str  # "" where the blocks span several stages (resnet)
    smaller: tuple[tuple[int, int], ...]
    size: tuple[int, int] = (BATCH, SEQ)  # the default (batch, seq); seq is the side for resnet


def step(model: nn.Module, example: Any, loss_fn: Callable[[Any], torch.Tensor] | None):
    """The user's training step: forward, loss, backward; returns the detached loss."""
    if isinstance(example, dict):
        out = model(**example)
    elif isinstance(example, tuple):
        out = model(*example)
    else:
        out = model(example)
    loss = loss_fn(out) if loss_fn is not None else out.loss
    loss.backward()
    return loss.detach()


def blocks(model: nn.Module, case: Case) -> nn.Module:
    """The repeated blocks of ``model`` (``case.blocks_path``); the model itself for ``""``."""
    return model.get_submodule(case.blocks_path)


# --- helpers ------------------------------------------------------------------------------


def _seeded(build: Callable[[], nn.Module], seed: int = 0) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = build()
        return model.float().train()

    return make


def _gen(batch: int, seq: int) -> torch.Generator:
    return torch.Generator().manual_seed(1000 * batch + seq)


def _tokens(batch: int, seq: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=_gen(batch, seq))


def _padding(batch: int, seq: int) -> torch.Tensor:
    """1 = real token, 0 = padding: the last row ends with ``seq // 4`` padding positions."""
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[-1, seq - max(1, seq // 4) :] = 0
    return mask


def _sizes(batch: int | None, seq: int | None, default_seq: int = SEQ) -> tuple[int, int]:
    return (BATCH if batch is None else batch), (default_seq if seq is None else seq)


def _class_targets(logits: torch.Tensor) -> torch.Tensor:
    """Deterministic targets for any batch size: 0, 1, 2, ... modulo the class count."""
    n = logits.numel() // logits.shape[-1]
    return torch.arange(n, device=logits.device) % logits.shape[-1]


def _cross_entropy(logits: torch.Tensor) -> torch.Tensor:
    flat = logits.reshape(-1, logits.shape[-1])
    return F.cross_entropy(flat, _class_targets(flat))


# --- Hugging Face ------------------------------------------------------------------------


def _causal_example(*, padded: bool) -> Callable[..., dict[str, torch.Tensor]]:
    def make_example(batch: int | None = None, seq: int | None = None) -> dict[str, torch.Tensor]:
        b, s = _sizes(batch, seq)
        ids = _tokens(b, s)
        if not padded:
            return dict(input_ids=ids, labels=ids.clone())
        mask = _padding(b, s)
        return dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))

    return make_example


def _gpt2(layers: int = 4) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_embd=64,
        n_layer=layers,
        n_head=4,
        n_positions=64,
        vocab_size=VOCAB,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
        use_cache=False,
        attn_implementation="sdpa",
    )
    model = GPT2LMHeadModel(config)
    # Its class name matches no entry of transformers' loss table, which then warns once.
    model.loss_type = "ForCausalLM"
    return model


def _llama_like(kind: str, layers: int = 4) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import transformers

        config_cls, model_cls = {
            "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
            "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        }[kind]
        config = config_cls(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=VOCAB,
            max_position_embeddings=64,
            attention_dropout=0.0,
            use_cache=False,
            attn_implementation="sdpa",
        )
        return model_cls(config)

    return build


def _bert() -> nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=128,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        attn_implementation="sdpa",
    )
    return BertForMaskedLM(config)


def _bert_example(batch: int | None = None, seq: int | None = None) -> dict[str, torch.Tensor]:
    b, s = _sizes(batch, seq)
    ids = _tokens(b, s)
    mask = _padding(b, s)
    # Masked-LM labels: every third position (and never padding) is predicted, the rest -100.
    predicted = (torch.arange(s) % 3 == 0).expand(b, s) & (mask == 1)
    labels = ids.masked_fill(~predicted, -100)
    return dict(input_ids=ids, attention_mask=mask, labels=labels)


# --- nanoGPT-style GPT -------------------------------------------------------------------


@dataclass(frozen=True)
class GPTConfig:
    block_size: int = 64
    vocab_size: int = VOCAB
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.0
    bias: bool = True


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """A nanoGPT-style decoder: ``forward(idx, targets=None) -> (logits, loss)``; ``loss`` is
    None without targets. ``lm_head.weight`` is ``transformer.wte.weight`` (tied)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList(Block(config) for _ in range(config.n_layer)),
                ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        _, t = idx.shape
        assert t <= self.config.block_size, f"sequence {t} > block_size {self.config.block_size}"
        pos = torch.arange(t, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(
                logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1
            )
        return logits, loss


def _nanogpt_example(
    batch: int | None = None, seq: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    b, s = _sizes(batch, seq)
    data = torch.randint(0, VOCAB, (b, s + 1), generator=_gen(b, s))
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()


# --- nn.TransformerEncoder ---------------------------------------------------------------


class EncoderLM(nn.Module):
    """Token embedding, ``nn.TransformerEncoder`` (``encoder.layers``), linear head;
    ``forward(tokens, padding_mask)`` with ``padding_mask`` True at padding."""

    def __init__(self, vocab: int = VOCAB, d_model: int = 64, num_layers: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        layer = nn.TransformerEncoderLayer(
            d_model=d_model, nhead=4, dim_feedforward=128, dropout=0.0, batch_first=True
        )
        self.encoder = nn.TransformerEncoder(
            layer, num_layers=num_layers, enable_nested_tensor=False
        )
        self.head = nn.Linear(d_model, vocab)

    def forward(self, tokens: torch.Tensor, padding_mask: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens), src_key_padding_mask=padding_mask))


def _encoder_example(
    batch: int | None = None, seq: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    b, s = _sizes(batch, seq)
    return _tokens(b, s), _padding(b, s) == 0


# --- a small ResNet ----------------------------------------------------------------------


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample: nn.Module | None = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x if self.downsample is None else self.downsample(x)
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return self.relu(y + shortcut)


class ResNet(nn.Module):
    """Stem (conv-BN-ReLU), ``layer1..layer3`` (``depth`` BasicBlocks each, 8/16/32 channels,
    the last two stages stride 2), global average pool, linear head; ``forward(images)``.
    Three blocks per stage: with two, the stem and one block's recompute alone are more than
    half the step, so no block-level plan reaches 50% of it."""

    def __init__(
        self, widths: tuple[int, ...] = (8, 16, 32), num_classes: int = 10, depth: int = 3
    ) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, widths[0], 3, padding=1, bias=False),
            nn.BatchNorm2d(widths[0]),
            nn.ReLU(inplace=True),
        )
        cin = widths[0]
        for i, w in enumerate(widths):
            stride = 1 if i == 0 else 2
            rest = [BasicBlock(w, w) for _ in range(depth - 1)]
            setattr(self, f"layer{i + 1}", nn.Sequential(BasicBlock(cin, w, stride), *rest))
            cin = w
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.layer3(self.layer2(self.layer1(self.stem(images))))
        return self.fc(torch.flatten(self.pool(x), 1))


def _resnet_example(batch: int | None = None, seq: int | None = None) -> tuple[torch.Tensor]:
    b, side = _sizes(batch, seq, SIDE)
    return (torch.randn(b, 3, side, side, generator=_gen(b, side)),)


# --- the zoo -----------------------------------------------------------------------------

CASES: dict[str, Case] = {
    c.name: c
    for c in (
        Case("gpt2", _seeded(_gpt2), _causal_example(padded=True), None, "transformer.h", _SMALLER),
        Case(
            "llama",
            _seeded(_llama_like("llama")),
            _causal_example(padded=False),
            None,
            "model.layers",
            _SMALLER,
        ),
        Case(
            "qwen2",
            _seeded(_llama_like("qwen2")),
            _causal_example(padded=False),
            None,
            "model.layers",
            _SMALLER,
        ),
        Case("bert", _seeded(_bert), _bert_example, None, "bert.encoder.layer", _SMALLER),
        Case(
            "nanogpt",
            _seeded(lambda: GPT(GPTConfig())),
            _nanogpt_example,
            lambda out: out[1],
            "transformer.h",
            _SMALLER,
        ),
        Case(
            "encoder",
            _seeded(EncoderLM),
            _encoder_example,
            _cross_entropy,
            "encoder.layers",
            _SMALLER,
        ),
        Case(
            "resnet",
            _seeded(ResNet),
            _resnet_example,
            _cross_entropy,
            "",
            ((4, 12), (2, 16), (2, 8)),
            size=(BATCH, SIDE),
        ),
    )
}

HF_CASES = frozenset({"gpt2", "llama", "qwen2", "bert"})


def deeper(name: str, layers: int) -> Callable[[], nn.Module]:
    """The zoo's ``"gpt2"``, ``"llama"`` or ``"qwen2"`` with ``layers`` decoder layers (the zoo's
    own have 4), seeded as the zoo seeds its models; the case's example and loss apply."""
    builds = {
        "gpt2": functools.partial(_gpt2, layers),
        "llama": _llama_like("llama", layers),
        "qwen2": _llama_like("qwen2", layers),
    }
    if name not in builds:
        raise ValueError(f"deeper({name!r}): one of {sorted(builds)}")
    return _seeded(builds[name])
