"""The records of the cost model (:mod:`.costs`): what was measured of one block
(:class:`BlockCost`), a piece of a plan (:class:`Segment`) and what the model predicts for it
(:class:`SegmentCost`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ["BlockCost", "Segment", "SegmentCost"]


@dataclass(frozen=True)
class BlockCost:
    """Measured costs of one block (bytes and seconds). ``param_bytes``: its trainable
    parameters' gradients. ``approx_bytes[c]`` and ``approx_error[c]``: the block input's size
    compressed by codec ``c``, and the estimated relative parameter-gradient error of
    compressing it; ``approx_encode_peak_bytes[c]``: the peak live bytes of compressing it
    (its temporaries and the result; missing: the result only). ``offload_kept_bytes``: the
    bytes of the block's input still on the device
    when it is offloaded (``None``: offload not profiled); ``offload_fetch_s``: the time of
    copying it back, saved when it is prefetched. ``rng_bytes[s]``: the bytes of forward-time
    state that strategy ``s`` keeps for its recompute from the block's forward to its backward
    (the generator states of a forward that draws random numbers; 0 for a block that draws
    none; a selective segment counts them in ``selective_bytes``), and ``rng_late_bytes[s]``
    what of them stays alive after the block's backward, until the step ends; ``loss_bytes``:
    a scalar loss and its gradient, alive during backward when the block ends the chain;
    ``reversible_check_bytes``: the samples a reversible stack starting with this block keeps
    for its default invertibility check (once per stack); ``grads_new``: the step creates the
    block's parameter gradients (they are ``None`` before it, as after ``zero_grad()``): they
    stay alive from the block's backward to the end of the step, and its backward transients
    were measured so (their own gradients included); ``input_kept``: a stored block keeps its
    input alive until its backward (it saves it, or the block before saves its own output);
    if not, its input goes once it has run; ``chained_s``: the extra seconds the block adds
    when it is recomputed inside a longer checkpoint or approx segment, not first in it (its
    recompute without a node of its own; ``None``: its forward time is assumed);
    ``compress_*[c]``: run with its saved tensors compressed by codec ``c``
    (:func:`revckpt.approx.compress_saved`): the bytes they keep, the forward and backward
    transients, and the relative errors of its parameter and input gradients."""

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
    approx_bytes: Mapping[str, int] = field(default_factory=dict)
    approx_error: Mapping[str, float] = field(default_factory=dict)
    backward_capture_peak_bytes: int | None = None
    checkpoint_peak_bytes: int | None = None
    reversible_peak_bytes: int | None = None
    output_saved: bool = False
    strategy_overhead_s: Mapping[str, float] = field(default_factory=dict)
    selective_bytes: Mapping[str, int] = field(default_factory=dict)
    selective_forward_peak_bytes: Mapping[str, int] = field(default_factory=dict)
    selective_backward_peak_bytes: Mapping[str, int] = field(default_factory=dict)
    selective_output_kept: Mapping[str, bool] = field(default_factory=dict)
    approx_input_error: Mapping[str, float] = field(default_factory=dict)
    approx_perturbation: Mapping[str, float] = field(default_factory=dict)
    approx_amplification: Mapping[str, float] = field(default_factory=dict)
    grad_sq: float | None = None
    upstream_grad_sq: float | None = None
    chain_grad_sq: float | None = None
    offload_kept_bytes: int | None = None
    offload_fetch_s: float = 0.0
    rng_bytes: Mapping[str, int] = field(default_factory=dict)
    rng_late_bytes: Mapping[str, int] = field(default_factory=dict)
    loss_bytes: int = 0
    reversible_check_bytes: int = 0
    grads_new: bool = False
    input_kept: bool = True
    chained_s: float | None = None
    approx_encode_peak_bytes: Mapping[str, int] = field(default_factory=dict)
    compress_bytes: Mapping[str, int] = field(default_factory=dict)
    compress_forward_peak_bytes: Mapping[str, int] = field(default_factory=dict)
    compress_backward_peak_bytes: Mapping[str, int] = field(default_factory=dict)
    compress_error: Mapping[str, float] = field(default_factory=dict)
    compress_input_error: Mapping[str, float] = field(default_factory=dict)

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
