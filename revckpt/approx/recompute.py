"""Approximate recompute: a checkpoint whose kept input is compressed, optionally re-run in bf16.

``revckpt.checkpoint(fn, x, strategy=Approx(store="e4m3"))`` (or ``strategy="approx:e4m3"``)
runs ``fn(x)`` without keeping its activations, like a plain checkpoint, but keeps ``x`` itself
compressed by a
:class:`~revckpt.approx.formats.Codec` (1 byte per element plus a float32 scale per row for
fp8, 2 bytes for bf16, against 4 for float32). Backward decodes ``x_hat``, re-runs ``fn`` from
it, and returns the gradients of that recompute::

    kept:      encode(x)                                 (payload + scales)
    backward:  x_hat = decode(encode(x));  y_hat = fn(x_hat)
               dx, dtheta = VJP of y_hat at (x_hat, theta) with the incoming dy

So the forward output is exact and only the gradients see the approximation: each element of
``x_hat`` is within ``k * (u * |x| + eta / s)`` of ``x`` (see :mod:`revckpt.approx.formats`) and
:mod:`revckpt.approx.bounds` turns that into a bound on each parameter gradient.

``recompute_dtype=torch.bfloat16`` re-runs ``fn`` under bf16 autocast during backward while the
first forward stays exact. With ``store=None`` and no ``recompute_dtype`` nothing is approximate
and the gradients are bitwise those of :func:`revckpt.checkpoint` (tensors used by several
operations of one node, such as keyword tensors that require grad or parameters tied across a
segment's blocks: to round-off, the node summing their contributions first).

The block runs as one recompute node of :mod:`revckpt.engine.node` (its inputs are the tensor
arguments, the trainable parameters of ``fn`` when it is an ``nn.Module`` and keyword tensors
that require grad, so ``torch.autograd.grad``, hooks and DDP see ordinary gradients; RNG,
autocast state and BatchNorm statistics are replayed by :mod:`revckpt.replay`). This module
holds only what is approximate about it: :class:`Compressed` says what the codec keeps, how it
is decoded and under which autocast the block re-runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from .._deprecation import warn_deprecated
from ..engine.autograd import label_of
from ..engine.node import EXACT, Keep, run_node
from ..errors import InvalidArgumentError, InvalidInputTypeError
from .formats import FORMATS, Codec, Encoded, NonFiniteInputError, Rounding, Scaling

__all__ = ["Approx", "checkpoint"]

_RECOMPUTE_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Approx:
    """What an approximate recompute keeps and how it re-runs.

    Args:
        store: format of the kept block input: ``"bf16"``, ``"e4m3"``, ``"e5m2"``, or ``None``
            to keep it exact.
        scaling: ``"tensor"``, ``"row"``, ``"block"``, ``None``, or ``"auto"`` (``"row"`` for
            fp8, none for bf16, whose range is float32's).
        block_size: elements per scale with ``scaling="block"``.
        rounding: ``"nearest"`` or ``"stochastic"``.
        recompute_dtype: ``torch.bfloat16`` (or ``torch.float16``) to re-run the forward
            under autocast of that dtype during backward; ``None`` re-runs it as the first
            forward ran.
    """

    store: str | None = "e4m3"
    scaling: Scaling | Literal["auto"] | None = "auto"
    block_size: int = 128
    rounding: Rounding = "nearest"
    recompute_dtype: torch.dtype | None = None
    codec: Codec | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.store is not None and self.store not in FORMATS:
            raise InvalidArgumentError(
                f"unknown store format {self.store!r}; use one of {sorted(FORMATS)} or None to "
                "keep the block input exact"
            )
        if self.recompute_dtype is not None and self.recompute_dtype not in _RECOMPUTE_DTYPES:
            raise InvalidArgumentError(
                f"recompute_dtype={self.recompute_dtype!r}: use torch.bfloat16, torch.float16 "
                "or None (recompute as the forward ran)"
            )
        if self.store is None and (
            self.scaling != "auto" or self.rounding != "nearest" or self.block_size != 128
        ):
            raise InvalidArgumentError(
                "scaling, block_size and rounding describe a compressed format, but "
                "store=None keeps the input exact: drop them, or choose store='bf16', 'e4m3' "
                "or 'e5m2'"
            )
        codec = None
        if self.store is not None:
            scaling = self.scaling
            if scaling == "auto":
                scaling = None if self.store == "bf16" else "row"
            codec = Codec(self.store, scaling, block_size=self.block_size, rounding=self.rounding)
        object.__setattr__(self, "codec", codec)

    @property
    def exact(self) -> bool:
        """Nothing approximate: the gradients are those of a plain checkpoint."""
        return self.codec is None and self.recompute_dtype is None

    def __str__(self) -> str:
        parts = [f"store {self.codec}" if self.codec is not None else "store exact"]
        if self.recompute_dtype is not None:
            parts.append(f"recompute {str(self.recompute_dtype).removeprefix('torch.')}")
        return ", ".join(parts)


class Compressed(Keep):
    """What an approximate recompute keeps: floating-point arguments encoded by the codec
    (payload, and scales when the codec has them), the others exactly; the re-run under
    autocast of ``recompute_dtype`` when one is set."""

    __slots__ = ("codec", "recompute_dtype")

    def __init__(self, config: Approx) -> None:
        self.codec = config.codec
        self.recompute_dtype = config.recompute_dtype

    def keep(self, tensors: Sequence[torch.Tensor], label: str) -> tuple[list[torch.Tensor], Any]:
        codec = self.codec
        if self.recompute_dtype is not None and tensors:
            _check_recompute_dtype(self.recompute_dtype, tensors[0], label)
        saved: list[torch.Tensor] = []
        # per tensor: None if kept exactly, else (dtype, scaled, (index, label): for an error)
        recipe: list[tuple[torch.dtype, bool, tuple[int, str]] | None] = []
        for i, t in enumerate(tensors):
            # kept exactly: integers, and a further argument without grad (a mask or a
            # position bias passed positionally, as Hugging Face layers get them under eager
            # attention: their finfo.min would set an fp8 row's scale so that every bias value
            # in the row decodes to 0); the block input (argument 0) goes through the codec
            constant = i > 0 and not t.requires_grad
            if codec is None or not t.is_floating_point() or constant:
                recipe.append(None)
                saved.append(t)
                continue
            enc = _encode(codec, t, i, label)
            recipe.append((t.dtype, enc.scales is not None, (i, label)))
            saved.append(enc.payload)
            if enc.scales is not None:
                saved.append(enc.scales)
        return saved, recipe

    def rebuild(self, saved: Sequence[torch.Tensor], recipe: Any) -> list[torch.Tensor]:
        out, i = [], 0
        for entry in recipe:
            if entry is None:
                out.append(saved[i])
                i += 1
                continue
            assert self.codec is not None
            dtype, scaled, where = entry
            scales = saved[i + 1] if scaled else None
            out.append(_decode(self.codec, Encoded(saved[i], scales, dtype, self.codec), where))
            i += 2 if scaled else 1
        return out

    def rerun_context(self, device_type: str) -> contextlib.AbstractContextManager[Any]:
        if self.recompute_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type, dtype=self.recompute_dtype)


def _check_recompute_dtype(dtype: torch.dtype, x: torch.Tensor, label: str) -> None:
    """A recompute under autocast in ``dtype`` of a block whose input is ``x``: autocast casts
    float32 only, so a 16-bit block of the other format re-ran with mixed dtypes (torch's raw
    'mixed dtype' error in backward) and a float64 one re-ran unchanged, silently."""
    if not x.is_floating_point() or x.dtype in (torch.float32, dtype):
        return
    effect = (
        "autocast leaves float64 alone, so the recompute would run in float64: the option "
        "does nothing"
        if x.dtype == torch.float64
        else f"its layers would mix {x.dtype} and {dtype} in the recompute"
    )
    raise InvalidArgumentError(
        f"{label}: recompute_dtype={dtype} on a block whose input is {x.dtype}: {effect}. "
        "Pass recompute_dtype=None (the recompute runs in the block's own dtype), or the "
        "block's own dtype"
    )


def keep_of(config: Approx) -> Keep:
    """The recompute node's :class:`~revckpt.engine.node.Keep` for ``config``: exact when
    nothing is approximate, else :class:`Compressed`."""
    if not isinstance(config, Approx):
        raise InvalidInputTypeError(
            f"approx= takes a revckpt.approx.Approx(...), got {type(config).__name__}"
        )
    return EXACT if config.exact else Compressed(config)


def _encode(codec: Codec, t: torch.Tensor, index: int, label: str) -> Encoded:
    try:
        return codec.encode(t)
    except NonFiniteInputError:
        raise NonFiniteInputError(
            f"positional argument {index} of {label} has non-finite values and would be "
            f"compressed ({codec}). A mask or constant with -inf belongs in a keyword argument "
            "(kept exactly); otherwise find where the model overflows (e.g. with "
            "torch.autograd.detect_anomaly) or keep the boundary exact (store=None)"
        ) from None


def _decode(codec: Codec, enc: Encoded, where: tuple[int, str]) -> torch.Tensor:
    """``enc`` decoded; a non-finite input whose check the codec left to decode (off the CPU)
    is reported with where it was kept (argument index, block label), as at encode."""
    try:
        return codec.decode(enc)
    except NonFiniteInputError as err:
        index, label = where
        raise NonFiniteInputError(f"positional argument {index} of {label}: {err}") from None


def _checkpoint(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    config: Approx,
    preserve_rng_state: bool,
) -> Any:
    """``fn(*args, **kwargs)`` as one recompute node keeping its tensor arguments as ``config``
    says: what ``revckpt.checkpoint(fn, *args, strategy=config)`` runs (``fn`` checked)."""
    label = label_of(fn)
    return run_node(
        fn, args, kwargs, keep=keep_of(config), preserve_rng_state=preserve_rng_state, label=label
    )


def checkpoint(
    fn: Callable[..., Any],
    *args: Any,
    store: str | None = "e4m3",
    scaling: Scaling | Literal["auto"] | None = "auto",
    block_size: int = 128,
    rounding: Rounding = "nearest",
    recompute_dtype: torch.dtype | None = None,
    preserve_rng_state: bool = True,
    **kwargs: Any,
) -> Any:
    """Deprecated: ``revckpt.checkpoint(fn, *args, strategy=Approx(store=..., ...))``.

    Runs ``fn(*args, **kwargs)`` keeping only its tensor arguments, compressed.

    Floating-point tensor arguments are kept in ``store`` format (see :class:`Approx` for the
    options; integer and boolean tensors are kept exactly); keyword arguments are passed to
    ``fn`` unchanged and kept as they are. ``fn`` is typically an ``nn.Module``: its trainable
    parameters receive gradients. A plain function must take every tensor that requires grad
    as an argument (else backward raises, naming the tensor).

    Memory held between forward and backward: the compressed arguments (payload and scales),
    plus RNG state when ``fn`` drew random numbers. Extra work: one forward of ``fn`` in
    backward, plus an encode and a decode.
    """
    warn_deprecated(
        "revckpt.approx.checkpoint(fn, *args, store=...)",
        "revckpt.checkpoint(fn, *args, strategy=revckpt.approx.Approx(store=...))",
    )
    config = Approx(
        store=store,
        scaling=scaling,
        block_size=block_size,
        rounding=rounding,
        recompute_dtype=recompute_dtype,
    )
    if not callable(fn):
        raise InvalidInputTypeError(
            f"approx.checkpoint(fn, *args): fn must be callable, got {type(fn).__name__}"
        )
    return _checkpoint(fn, args, kwargs, config=config, preserve_rng_state=preserve_rng_state)
