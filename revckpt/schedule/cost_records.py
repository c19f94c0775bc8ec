"""The records of the cost model (:mod:`.costs`): what was measured of one block
(:class:`BlockCost`, with one small record per strategy's measurements: :class:`ApproxCost`,
:class:`SelectiveCost`, :class:`CompressCost`, :class:`OffloadCost`, :class:`ReplayCost`, and
the gradient norms of the error model, :class:`GradNorms`), a piece of a plan
(:class:`Segment`) and what the model predicts for it (:class:`SegmentCost`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ["BlockCost", "Segment", "SegmentCost"]
# and the records of a block's measurements per strategy (fields of its BlockCost)
__all__ += ["ApproxCost", "CompressCost", "GradNorms", "OffloadCost", "ReplayCost", "SelectiveCost"]


@dataclass(frozen=True)
class ApproxCost:
    """What one codec ``c`` costs a block that starts an ``approx:<c>`` segment (its input kept
    compressed by ``c``, the segment recomputed from it): ``BlockCost.approx[c]``.
    The errors are measured with the input through the codec (see
    :func:`revckpt.schedule.profile`); ``None`` where they were not measured: the segment's
    error is then its first block's ``param_grad_error`` (none: ``0``)."""

    #: the block's input compressed by the codec, bytes (kept from its forward to its backward)
    kept_bytes: int
    #: the peak live bytes of compressing the input (the codec's temporaries and the result);
    #: ``None``: not measured, the result alone is counted
    encode_peak_bytes: int | None = None
    #: relative error of the block's parameter gradients when its input goes through the codec
    param_grad_error: float | None = None
    #: relative error of the block's input gradient, the same way
    input_grad_error: float | None = None
    #: how far the codec moves the block's input (relative)
    perturbation: float | None = None
    #: how much a perturbation of the input grows through the block (relative output change
    #: over relative input change)
    amplification: float | None = None


@dataclass(frozen=True)
class SelectiveCost:
    """What one selective-recompute policy ``p`` costs the block (``selective:<p>``, one
    block): ``BlockCost.selective[p]``, each figure measured with the policy."""

    #: the bytes it keeps from its forward to its backward besides its input: the outputs of
    #: the operations the policy keeps, and the replay state (generator states) of its recompute
    kept_bytes: int
    #: its forward's transient peak (above its input)
    forward_peak_bytes: int
    #: its recompute and backward's transient, measured together (``ts`` of the cost model)
    backward_peak_bytes: int
    #: the policy keeps the block's output (it keeps the operation that produces it)
    output_kept: bool = False


@dataclass(frozen=True)
class CompressCost:
    """What one codec ``c`` costs the block run with its saved tensors compressed
    (``compress:<c>``, one block, :func:`revckpt.approx.compress_saved`):
    ``BlockCost.compress[c]``. The errors are ``None`` where not measured (counted
    as none)."""

    #: the bytes its compressed saved tensors keep from its forward to its backward, its
    #: input's compressed copy among them where it saves its input (measured on an input that
    #: is not a leaf, as inside a model), or the input itself where it keeps it exact
    kept_bytes: int
    #: its forward's transient peak (above its input)
    forward_peak_bytes: int
    #: its backward's transient
    backward_peak_bytes: int
    #: relative error of the block's parameter gradients with its saved tensors compressed
    param_grad_error: float | None = None
    #: relative error of its input gradient, the same way
    input_grad_error: float | None = None
    #: whether it keeps its input exact (too small to compress: ``kept_bytes`` counts it)
    input_exact: bool = False


@dataclass(frozen=True)
class OffloadCost:
    """What offloading costs the block (its input moved to host memory until its backward):
    ``BlockCost.offload``, ``None`` when offload was not profiled."""

    #: the bytes of the block's input that stay on the device (what :mod:`revckpt.offload`
    #: did not move)
    kept_bytes: int
    #: seconds of copying what moved back to the device, saved when the copy is prefetched
    fetch_s: float = 0.0


@dataclass(frozen=True)
class ReplayCost:
    """The replay state strategy ``s`` keeps for the block's recompute (the generator states of
    a forward that draws random numbers; 0 for a block that draws none):
    ``BlockCost.replay[s]``. A missing figure counts as 0."""

    #: bytes kept from the block's forward to its backward; ``None`` for a selective strategy,
    #: which counts them in ``SelectiveCost.kept_bytes``
    kept_bytes: int | None = None
    #: what of them stays alive after the block's backward, until the step ends; ``None``:
    #: not measured (the block had no backward to meter)
    late_bytes: int | None = None
    #: of them, the copies of module state (buffers the forward writes, eval-mode
    #: normalisation statistics): one per block, where the generator states are one per
    #: recompute node, so a node of several blocks keeps every block's copies
    module_bytes: int = 0


@dataclass(frozen=True)
class GradNorms:
    """The weights of the chain's error model (:mod:`.kind_errors`), from one backward of
    the whole chain with a seeded random projection loss: ``BlockCost.grad_norms``."""

    #: the squared norm of the block's parameter gradients (``N_i^2``)
    own_sq: float
    #: the squared norms of the parameter gradients of the blocks before it and of the
    #: chain input's gradient, summed (``U_i``)
    upstream_sq: float
    #: those of every block's parameter gradients and of the chain input's gradient, summed
    #: (``N^2``)
    chain_sq: float


@dataclass(frozen=True)
class BlockCost:
    """Measured costs of one block (bytes and seconds). ``param_bytes``: its trainable
    parameters' gradients. ``loss_bytes``: a scalar loss and its gradient, alive during
    backward when the block ends the chain; ``reversible_check_bytes``: the samples a
    reversible stack starting with this block keeps for its default invertibility check (once
    per stack); ``grads_new``: the step creates the block's parameter gradients (they are
    ``None`` before it, as after ``zero_grad()``): they stay alive from the block's backward to
    the end of the step, and its backward transients were measured so (their own gradients
    included); ``input_kept``: a stored block keeps its input alive until its backward (it
    saves it, or the block before saves its own output, or ``input_held``); if not, its input
    goes once it has run; ``input_held``: code outside the blocks saves the block's input for
    its own backward (an activation between blocks), so the input stays alive until then
    whatever the plan (an approx segment starting here keeps its compressed copy beside it);
    ``chained_s``: the extra seconds the block adds when it is recomputed inside a longer
    checkpoint or approx segment, not first in it (its recompute without a node of its own;
    ``None``: its forward time is assumed); ``stacked_s``: the same inside a longer reversible
    stack (its rebuild and recompute without a stack of its own; ``None``: its one-block
    reversible time is assumed); ``split_dim``: the dim a reversible unit splits its input
    along (``None``: not a unit), which the units of one reversible segment share. Per
    strategy, the measurements of its own:
    ``approx[c]`` (:class:`ApproxCost`, per codec), ``selective[p]`` (:class:`SelectiveCost`,
    per policy), ``compress[c]`` (:class:`CompressCost`, per codec), ``offload``
    (:class:`OffloadCost`; ``None``: offload not profiled), ``replay[s]``
    (:class:`ReplayCost`, per strategy) and ``grad_norms`` (:class:`GradNorms`; ``None``: not
    measured, a segment's error is then its first block's)."""

    forward_s: float
    backward_s: float
    input_bytes: int
    output_bytes: int
    saved_bytes: int
    forward_peak_bytes: int
    forward_peak_nograd_bytes: int
    backward_peak_bytes: int
    invertible: bool = False
    param_bytes: int = 0
    backward_capture_peak_bytes: int | None = None
    checkpoint_peak_bytes: int | None = None
    reversible_peak_bytes: int | None = None
    output_saved: bool = False
    strategy_overhead_s: Mapping[str, float] = field(default_factory=dict)
    loss_bytes: int = 0
    reversible_check_bytes: int = 0
    grads_new: bool = False
    input_kept: bool = True
    input_held: bool = False
    chained_s: float | None = None
    stacked_s: float | None = None
    split_dim: int | None = None
    approx: Mapping[str, ApproxCost] = field(default_factory=dict)
    selective: Mapping[str, SelectiveCost] = field(default_factory=dict)
    compress: Mapping[str, CompressCost] = field(default_factory=dict)
    offload: OffloadCost | None = None
    replay: Mapping[str, ReplayCost] = field(default_factory=dict)
    grad_norms: GradNorms | None = None

    @property
    def capture_peak(self) -> int:
        """``tc``: the backward transient when the block's parameter gradients are returned
        (kept) rather than accumulated into ``.grad`` and freed, as inside one approx or
        reversible node; if not measured, ``tb + p`` (an upper bound)."""
        if self.backward_capture_peak_bytes is not None:
            return self.backward_capture_peak_bytes
        return self.backward_peak_bytes + self.param_bytes


@dataclass(frozen=True)
class Segment:
    """Blocks ``start`` to ``stop - 1`` run with ``strategy``."""

    start: int
    stop: int
    strategy: str


@dataclass(frozen=True)
class SegmentCost:
    """``kept``: bytes held from the segment's forward to its backward; ``work``: its peak
    above the bytes kept by earlier segments; ``time``: extra seconds (recompute); ``error``;
    ``backward_work``: the peak of its backward alone above those bytes; ``late``: bytes it
    keeps after its backward, to the end of the step."""

    kept: int
    work: int
    time: float
    error: float
    backward_work: int = 0
    late: int = 0
