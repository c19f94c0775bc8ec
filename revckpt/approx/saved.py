"""Compressed saved activations: a block's saved tensors kept in bf16 or fp8, no recompute.

``compress_saved(fn, x, store="bf16")`` runs ``fn(x)`` once, as plain autograd would, but every
tensor autograd saves for backward inside it (matmul inputs, activation inputs, attention
outputs, normalisation inputs...) goes through a :class:`~revckpt.approx.formats.Codec`
(ActNN / COAT style, with :func:`torch.autograd.graph.saved_tensors_hooks`)::

    forward:   y = fn(x)                         (exact: the forward is untouched)
    kept:      encode(a) for every saved a       (payload + scales, instead of a)
    backward:  the VJP of every operation with its saved a replaced by a_hat = decode(encode(a))

so each element of a saved tensor is within ``k * (u * |a| + eta / s)`` of its value (see
:mod:`revckpt.approx.formats`; ``u = 2**-8`` for bf16, ``2**-4`` for e4m3, ``2**-3`` for e5m2),
and only the gradients see the approximation. Against
``revckpt.checkpoint(fn, x, strategy=Approx(...))``, which keeps the block *input* compressed
and re-runs the forward, it costs no forward (an encode per saved tensor and a decode in
backward) and keeps more bytes (every saved activation, at 1 or 2 bytes per element instead
of 4).

What is compressed: floating-point activations that require grad, with at least ``min_numel``
elements, whose dtype is wider than the format (a bf16 tensor, e.g. a matmul input under bf16
autocast, is not "compressed" to bf16; fp8 compresses bf16 and float16 ones). Kept as they are:
tensors that do not require grad (attention masks and position biases, an input without grad:
constants, often one tensor shared by every layer, which a copy per layer would cost more than;
and a mask's ``finfo.min`` or ``-inf`` would set an fp8 row's scale so that every bias value in
the row decodes to 0: on a Hugging Face Falcon layer with ALiBi, 8692 of 9264 unmasked entries),
parameters and every other leaf that requires grad (or a view of one: autograd keeps its
storage alive anyway, so a copy would add memory), integer and boolean tensors (dropout masks,
indices), small tensors (normalisation statistics, log-sum-exps), expanded (stride-0) views,
which a codec would materialise, and tensor subclasses. An activation that requires grad and
holds inf or nan raises :class:`~revckpt.approx.NonFiniteInputError`: the model overflowed.

A tensor saved by several operations in one call (the same view of the same storage, at the same
version) is encoded once, and so is a dense tensor and its reshapes or permutations (a linear
layer's ``(batch * seq, dim)`` view of its input); each is decoded once per backward for all its
uses (the decoded copy lives from its first use in backward to its last).

.. warning:: A saved tensor whose storage outlives the call anyway (the block's output saved by
   its own last operation, say a final ``tanh``, or an input the caller keeps) is compressed
   too, and then costs its compressed bytes on top. Keep such blocks stored, or raise
   ``min_numel``.

.. note:: ``torch.compile``: :func:`compress_saved` and ``fn`` run eagerly inside a compiled
   caller (its graph breaks there). Compiled, ``fn``'s saved tensors would be its graph's
   outputs, which do not require grad: the hooks would keep them exact, taking them for
   constants, and the memory saving would be lost without a word (before session 30: 128 KiB
   compressed against 1154 KiB kept exact on a LayerNorm-Linear-GELU-Linear block, where eager
   compresses 1280 KiB). So a compressed block keeps what it keeps eagerly, with the same
   gradients, and is not compiled (tested in ``tests/test_compile.py``); measure the memory of
   compiled code with ``MemoryMeter("cpu", method="allocator")``.
"""

from __future__ import annotations

import copy
import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from .._numbers import relative_error
from ..engine.autograd import label_of, refuse_grad_transform
from ..errors import InvalidArgumentError, InvalidInputTypeError, ModifiedInputError
from .formats import FORMATS, Codec, Encoded, NonFiniteInputError, Rounding, Scaling
from .recompute import Approx

__all__ = ["DEFAULT_MIN_NUMEL", "RelativeErrors", "compress_saved", "compress_saved_error"]

DEFAULT_MIN_NUMEL = 4096
"""Saved tensors below this many elements stay exact: normalisation statistics and similar
per-row vectors, whose compression would save little and whose scales would cost much."""


class _Packed:
    """One compressed saved tensor, shared by every save of the same view within one call.

    ``uses`` saves refer to it; the first unpack of a backward decodes it, the ``uses``-th
    drops the decoded copy again (a backward that skips some of the saving operations leaves
    it until the graph is freed)."""

    __slots__ = ("decoded", "encoded", "stride", "unpacked", "uses")

    def __init__(self, encoded: Encoded, stride: tuple[int, ...]) -> None:
        self.encoded = encoded
        self.stride = stride  # the original's dense layout, restored on decode (views need it)
        self.uses = 1
        self.unpacked = 0
        self.decoded: torch.Tensor | None = None

    def unpack(self) -> torch.Tensor:
        t = self.decoded
        if t is None:
            t = self.encoded.decode()
            if t.stride() != self.stride:
                t = torch.empty_strided(t.shape, self.stride, dtype=t.dtype, device=t.device).copy_(
                    t
                )
        self.unpacked += 1
        if self.unpacked >= self.uses:
            self.unpacked, self.decoded = 0, None
        else:
            self.decoded = t
        return t


class _SavedCodec:
    """The pack and unpack hooks of one :func:`compress_saved` call."""

    def __init__(self, codec: Codec, min_numel: int, label: str) -> None:
        self.codec = codec
        self.min_numel = min_numel
        self.label = label
        self.width = codec.spec.itemsize
        # (storage, offset, shape, stride, dtype, version) -> (weak storage, entry), this call
        self.seen: dict[tuple[Any, ...], tuple[weakref.ref[Any], _Packed]] = {}

    def compressible(self, t: torch.Tensor) -> bool:
        if type(t) not in (torch.Tensor, nn.Parameter) or t.layout != torch.strided:
            return False  # subclasses (DTensor, FakeTensor) and sparse tensors: as they are
        if not t.is_floating_point() or t.numel() < self.min_numel:
            return False
        if t.element_size() <= self.width:
            return False  # not wider than the format: nothing to gain
        if not t.requires_grad:
            return False  # a constant: a mask, a position bias, an input without grad
        base = t if t._base is None else t._base
        if base.requires_grad and base.is_leaf:
            return False  # a parameter or a leaf input (or a view of one): alive anyway
        return all(s != 0 or n == 1 for s, n in zip(t.stride(), t.shape, strict=True))

    def pack(self, t: torch.Tensor) -> Any:
        if not self.compressible(t):
            # detached: the graph must not hold the tensor's own grad_fn; with its version, as
            # autograd saves it, so that a change in place before backward raises
            if t.is_inference():
                return t.detach()
            return _Exact(t.detach(), t._version, self.label)
        # A reshape or permutation of a whole dense tensor (the (batch * seq, dim) view a linear
        # layer saves, attention output transposed back) is encoded as that tensor, so every
        # view of it shares one encoding; other views (slices: q, k, v of one projection) are
        # encoded on their own.
        source = t
        base = t._base
        if base is not None and base.numel() == t.numel() and _dense(base):
            source = base
        storage = source.untyped_storage()
        key = (
            storage._cdata,
            source.storage_offset(),
            tuple(source.shape),
            tuple(source.stride()),
            source.dtype,
            source._version,
        )
        hit = self.seen.get(key)
        if hit is not None and hit[0]() is storage:
            entry = hit[1]
            entry.uses += 1
        else:
            encoded = self._encode(source)
            entry = _Packed(encoded, _dense_stride(source))
            self.seen[key] = (weakref.ref(storage), entry)
        if source is t:
            return entry
        offset = t.storage_offset() - source.storage_offset()
        return _View(entry, tuple(t.shape), tuple(t.stride()), offset)

    def _encode(self, t: torch.Tensor) -> Encoded:
        """``t`` (an activation that requires grad) encoded."""
        try:
            return self.codec.encode(t)
        except NonFiniteInputError:
            bad = int((~torch.isfinite(t)).sum())
            raise NonFiniteInputError(
                f"compress_saved(store={self.codec.format!r}) in {self.label}: an activation "
                f"of shape {tuple(t.shape)} ({str(t.dtype).removeprefix('torch.')}) that "
                f"autograd saves for backward holds {bad} non-finite value(s) (inf or nan), "
                f"which the {self.codec} codec would saturate (every codec refuses them, bf16 "
                "included; only tensors that do not require grad, such as -inf masks, are "
                "kept exact instead). Keep this block's saved tensors stored (call it without "
                "compress_saved, or store=None), or find where the model overflows (e.g. with "
                "torch.autograd.detect_anomaly)"
            ) from None

    @staticmethod
    def unpack(packed: Any) -> torch.Tensor:
        if isinstance(packed, _Exact):
            return packed.unpack()
        if isinstance(packed, _Packed):
            return packed.unpack()
        if isinstance(packed, _View):
            return packed.entry.unpack().as_strided(packed.size, packed.stride, packed.offset)
        return packed


def _dense_stride(t: torch.Tensor) -> tuple[int, ...]:
    """The strides of ``torch.empty_like(t)``: ``t``'s own when it is dense (no gaps, no
    overlap), else contiguous ones in its dimension order."""
    return torch.empty_like(t, device="meta").stride()


def _dense(t: torch.Tensor) -> bool:
    return _dense_stride(t) == t.stride()


@dataclass(frozen=True)
class _Exact:
    """A saved tensor kept as it is (not compressed), with its version counter when saved."""

    tensor: torch.Tensor
    version: int
    label: str

    def unpack(self) -> torch.Tensor:
        if self.tensor._version != self.version:
            raise ModifiedInputError(
                f"compress_saved in {self.label}: a tensor of shape {tuple(self.tensor.shape)} "
                "saved for backward exactly (an input, a keyword argument, or one too small or "
                "without grad to compress) was changed in place after it was saved, so the "
                "backward would use the changed value (plain autograd raises here too). Change "
                "it out of place, or pass a copy (t.clone())"
            )
        return self.tensor


@dataclass(frozen=True)
class _View:
    """A saved view of an encoded dense tensor: where it lies in the decoded one."""

    entry: _Packed
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


def _codec(
    store: str | None, scaling: Scaling | Literal["auto"] | None, block_size: int, rounding: str
) -> Codec | None:
    """The checked codec of ``compress_saved(store=..., ...)`` (``None``: ``store=None``), built
    once per options (a compress segment asks at every call); only options of plain types are
    cached, so ``True`` is not taken for ``1`` and an unhashable option is checked as before."""
    options = (store, scaling, block_size, rounding)
    if all(type(v) in (str, int, type(None)) for v in options):
        return _cached_codec(*options)
    return _build_codec(*options)


def _build_codec(
    store: str | None, scaling: Scaling | Literal["auto"] | None, block_size: int, rounding: str
) -> Codec | None:
    if store is not None and store not in FORMATS:
        raise InvalidArgumentError(
            f"compress_saved: unknown store format {store!r}; use one of {sorted(FORMATS)} "
            "(bf16 halves the saved bytes, e4m3 / e5m2 quarter them) or None to keep them exact"
        )
    return Approx(store=store, scaling=scaling, block_size=block_size, rounding=rounding).codec


_cached_codec = functools.lru_cache(maxsize=64)(_build_codec)


def _check_min_numel(min_numel: Any) -> None:
    if isinstance(min_numel, bool) or not isinstance(min_numel, int) or min_numel < 0:
        raise InvalidArgumentError(
            f"min_numel={min_numel!r}: pass a non-negative int, the number of elements below "
            f"which saved tensors stay exact (default {DEFAULT_MIN_NUMEL})"
        )


def compress_saved(
    fn: Callable[..., Any],
    *args: Any,
    store: str | None = "bf16",
    scaling: Scaling | Literal["auto"] | None = "auto",
    block_size: int = 128,
    rounding: Rounding = "nearest",
    min_numel: int = DEFAULT_MIN_NUMEL,
    **kwargs: Any,
) -> Any:
    """Run ``fn(*args, **kwargs)`` once, keeping the tensors its autograd saves compressed.

    ``store`` is the format of the saved tensors (``"bf16"``, ``"e4m3"``, ``"e5m2"``, or
    ``None`` for a plain call); ``scaling``, ``block_size`` and ``rounding`` are those of
    :class:`~revckpt.approx.Approx` (``"auto"``: no scale for bf16, one per row for fp8);
    saved tensors with fewer than ``min_numel`` elements stay exact. See the module docstring
    for which saved tensors are compressed. Returns what ``fn`` returns, bitwise as a plain call
    does; arguments are passed through untouched.

    Memory held between forward and backward: every compressed saved tensor's payload and
    scales (2 bytes per element for bf16, 1 plus ``4 / row length`` for fp8 with row scaling,
    against 4 for float32) plus what stays exact. Extra work: an encode per saved tensor in
    forward, a decode in backward; no recompute.

    .. warning:: Non-finite values in a saved activation that requires grad raise
       :class:`~revckpt.approx.NonFiniteInputError` in the forward (the codecs refuse them
       rather than saturate; constants such as ``-inf`` masks are kept exact). Double backward
       (``create_graph=True``) differentiates through the decoded values, so second
       derivatives carry the codec error too.

    .. note:: Under autocast, tensors already in bf16 are left alone by the bf16 format; the
       float32 ones (normalisation inputs, softmax outputs) are compressed. Hooks nest
       innermost-first: a ``torch.utils.checkpoint`` (non-reentrant) inside ``fn`` saves its
       own way.
    """
    codec = _codec(store, scaling, block_size, rounding)
    _check_min_numel(min_numel)
    if not callable(fn):
        raise InvalidInputTypeError(
            f"compress_saved(fn, *args): fn must be callable, got {type(fn).__name__}"
        )
    if codec is None or not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    refuse_grad_transform(label_of(fn), "compress")
    hooks = _SavedCodec(codec, min_numel, label_of(fn))
    return _eager_with_hooks(hooks, fn, args, kwargs)


@torch.compiler.disable
def _eager_with_hooks(
    hooks: _SavedCodec, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """``fn`` run eagerly under the hooks, also inside a compiled caller: a compiled ``fn``'s
    saved tensors are its graph's outputs, which do not require grad, so the hooks would take
    them for constants and keep them exact (a LayerNorm-Linear-GELU-Linear block: 128 KiB
    compressed against 1154 KiB kept exact, where eager compresses 1280 KiB)."""
    try:
        with torch.autograd.graph.saved_tensors_hooks(hooks.pack, hooks.unpack):
            return fn(*args, **kwargs)
    finally:
        hooks.seen.clear()


@dataclass(frozen=True)
class RelativeErrors:
    """Measured relative L2 errors of the gradients, ``||g - g64|| / ||g64||``: ``parameters``
    over all parameter gradients together, ``input`` of the gradient with respect to the block
    input. Same fields as :class:`~revckpt.approx.TotalEstimate`, so a planner can take either."""

    parameters: float
    input: float
    codec: str


def compress_saved_error(
    block: nn.Module,
    x: torch.Tensor,
    *,
    store: str,
    scaling: Scaling | Literal["auto"] | None = "auto",
    block_size: int = 128,
    rounding: Rounding = "nearest",
    min_numel: int = DEFAULT_MIN_NUMEL,
    cotangent: torch.Tensor | None = None,
    seed: int = 0,
    **kwargs: Any,
) -> RelativeErrors:
    """The gradient error of ``compress_saved(block, x, store=store, ...)``, measured in float64.

    A float64 copy of ``block`` runs twice on ``x`` (and the keyword arguments, floating ones
    in float64), plainly and under :func:`compress_saved`, with the same seed for dropout and
    its own copy of the buffers each time (the caller's block is not touched), and is
    differentiated with ``cotangent`` on its output (default: ones, i.e. ``loss = y.sum()``).
    ``x`` enters as an intermediate activation (not a leaf), so a saved block input is
    compressed as inside a model. Float64 takes float32's round-off out of the figures: what
    remains is the codec's. Returns :class:`RelativeErrors`.
    """
    if not isinstance(block, nn.Module):
        raise InvalidInputTypeError(
            f"compress_saved_error(block, x): block must be an nn.Module, got "
            f"{type(block).__name__}"
        )
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise InvalidInputTypeError(
            "compress_saved_error(block, x): x must be a floating-point tensor, got "
            f"{type(x).__name__ if not isinstance(x, torch.Tensor) else x.dtype}"
        )
    codec = _codec(store, scaling, block_size, rounding)
    _check_min_numel(min_numel)
    kw64 = {
        k: v.detach().double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
        for k, v in kwargs.items()
    }
    options = {"scaling": scaling, "block_size": block_size, "rounding": rounding}
    label = "exact" if codec is None else str(codec)
    state = (*block.parameters(), *block.buffers())  # (wider weights or buffers: wider saves)
    same = all(t.dtype == x.dtype for t in state if t.is_floating_point())
    if x.dtype in (torch.bfloat16, torch.float16) and same:  # saved tensors no wider than
        native = functools.partial(  # the format stay exact, so the codec may change nothing
            _gradients, block, x, kwargs, cotangent=cotangent, seed=seed, min_numel=min_numel,
            dtype=x.dtype,
        )  # fmt: skip
        plain, got = native(None), native({"store": store, **options})
        if all(torch.equal(a, b) for a, b in zip(_flat(plain), _flat(got), strict=True)):
            return RelativeErrors(parameters=0.0, input=0.0, codec=label)
    run = functools.partial(
        _gradients, block, x, kw64, cotangent=cotangent, seed=seed, min_numel=min_numel
    )
    exact_input, exact_params = run(None)
    got_input, got_params = run({"store": store, **options})
    return RelativeErrors(
        parameters=relative_error(got_params, exact_params),
        input=relative_error(got_input, exact_input),
        codec=label,
    )


def _flat(grads: tuple[torch.Tensor, list[torch.Tensor]]) -> list[torch.Tensor]:
    return [grads[0], *grads[1]]


def _gradients(
    block: nn.Module,
    x: torch.Tensor,
    kw: dict[str, Any],
    compressed: dict[str, Any] | None,
    *,
    cotangent: torch.Tensor | None,
    seed: int,
    min_numel: int,
    dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The input and parameter gradients of a copy of ``block`` in ``dtype`` at ``x`` (a
    non-leaf), run plainly (``compressed=None``) or under ``compress_saved(**compressed)``."""
    model = copy.deepcopy(block).to(dtype)
    leaf = x.detach().to(dtype).requires_grad_(True)
    inp = leaf.clone()  # a non-leaf, as a block input inside a model is
    devices = [x.device] if x.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        if compressed is not None:
            out = compress_saved(model, inp, min_numel=min_numel, **compressed, **kw)
        else:
            out = model(inp, **kw)
    if not isinstance(out, torch.Tensor):
        raise InvalidInputTypeError(
            f"compress_saved_error needs a block that returns one tensor, got {type(out).__name__}"
        )
    ct = torch.ones_like(out) if cotangent is None else cotangent.detach().to(out)
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(out, [leaf, *params], ct, allow_unused=True)
    full = [
        torch.zeros_like(t) if g is None else g for t, g in zip([leaf, *params], grads, strict=True)
    ]
    return full[0], full[1:]
