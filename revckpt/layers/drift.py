"""The drift of a reversible stack's rebuilt inputs: sampled in forward, compared in
backward, read once per backward walk, and reported (:class:`ReconstructionWarning`) or
refused (:class:`~revckpt.ReconstructionError`) past ``check_inverse``."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import torch

from ..errors import ReconstructionError

if TYPE_CHECKING:
    from .rebuild import StackCall

__all__ = ["ReconstructionWarning", "auto_tolerance"]


class ReconstructionWarning(UserWarning):
    """A rebuilt block input drifted from the original by more than ``check_inverse``."""


def record_drift(
    call: StackCall,
    index: int,
    rebuilt: torch.Tensor,
    exact: torch.Tensor,
    tolerance: float | None = None,
    reference: torch.Tensor | None = None,
) -> None:
    """Record one rebuilt input's drift, relative to ``exact`` (or to ``reference``: the
    output, where the input is zeros); ``tolerance``: this one's, where it is not the stack's
    ``check_inverse`` (a scaled coupling's anchored rebuild)."""
    call.pending.append((index, norms(rebuilt, exact, reference), tolerance))


def finish_drift(call: StackCall) -> None:
    """Read the drift of every rebuilt block input of this walk (one host read) into
    ``last_drift``, and warn or raise past ``check_inverse``."""
    if not call.pending:
        return
    pending, call.pending = call.pending, []
    values = torch.stack([n for _, n, _ in pending]).tolist()
    worst: tuple[float, int, float, str] | None = None
    for (index, _, own), (diff, ref) in zip(pending, values, strict=True):
        err = diff / ref if ref > 0 else (0.0 if diff == 0 else float("inf"))
        err = err if err == err else float("inf")  # nan (an overflowed rebuild): past any tol
        previous = call.drift[index]
        call.drift[index] = err if previous is None else max(previous, err)
        tol = call.check_inverse if own is None else own
        if tol is not None and err > tol and (worst is None or err > worst[0]):
            by = f"{err:.3e} (relative)" if ref > 0 else f"{diff:.3e} (it was zeros)"
            worst = (err, index, tol, by)
    if worst is None:
        return
    err, index, tol, by = worst
    if call.strict and call.exact:
        raise ReconstructionError(
            f"reversible block {index}: its rebuilt input differs from the original by "
            f"{by}, where an exact stack (make_reversible's default for a "
            "scale 2^-k) rebuilds bit for bit: the branch's recompute in backward did not "
            "give bitwise what its forward gave. Nondeterministic kernels do that (on CUDA, "
            "torch.use_deterministic_algorithms(True) picks deterministic ones), as does a "
            "branch whose state changes between forward and backward. Use exact=False (a "
            "floating-point rebuild with anchors) to tolerate rounding differences"
        )
    if call.strict and call.scaled:
        fix = (
            "Every block input is anchored already (anchor_every=1): one block's rebuild is "
            "that far off, either from the scale (use a larger one, or a scale 2^-k, k <= 16, "
            "with exact=True) or from a branch whose recompute differs from its forward"
            if call.anchored
            else "Set anchor_every=k to store every k-th block input exactly (smaller k, "
            "smaller drift), use a larger scale, or keep the streams in a wider dtype"
        )
        raise ReconstructionError(
            f"reversible block {index}: its rebuilt input differs from the original by "
            f"{by}, past the default tolerance {tol:g}: the "
            "scaled couplings (ScaledCoupling, revckpt.make_reversible) amplify rounding by "
            f"about 1 / scale per block. {fix}"
        )
    if call.strict:
        raise ReconstructionError(
            f"reversible block {index}: its rebuilt input differs from the original by "
            f"{by}, far more than round-off (default check_inverse='auto', "
            f"tolerance {tol:g}), so its gradients would be wrong. A branch "
            "must compute the same function of its input in forward and backward: no state "
            "that changes between them, no input other than its stream and the keyword "
            "tensors. Fix the branch, or store this block instead (or pass check_inverse=None "
            "to skip the check)"
        )
    message = (
        f"reversible block {index}: rebuilt input differs from the original by {by} > "
        f"check_inverse={tol:g}. Reconstruction drift grows with "
        "depth and with low precision: set anchor_every=k to store every k-th block input "
        "exactly, keep the streams in float32, or use an affine coupling with a smaller clamp"
    )
    if call.on_drift == "raise":
        raise ReconstructionError(message)
    warnings.warn(message, ReconstructionWarning, stacklevel=2)


def sample(x: torch.Tensor) -> torch.Tensor:
    """64 elements of ``x`` at evenly spaced positions (the same for the rebuilt tensor)."""
    flat = x.detach().reshape(-1)
    return flat[:: max(1, flat.numel() // 64)][:64].clone()


def norms(a: torch.Tensor, b: torch.Tensor, reference: torch.Tensor | None = None) -> torch.Tensor:
    """``[|a - b|, |b|]`` (``|reference|`` for the second where given) in float64, left on
    the device (read once per backward walk)."""
    a64, b64 = a.detach().double().reshape(-1), b.detach().double().reshape(-1)
    ref = b64 if reference is None else reference.detach().double().reshape(-1)
    return torch.stack([(a64 - b64).norm(), ref.norm()])


def auto_tolerance(dtype: torch.dtype) -> float:
    """The default check's tolerance: far above the round-off drift of a deep stack in the
    dtype the branches compute in (1e-2 for float32, 1/16 for float16, 1/2 for bfloat16), far
    below the O(1) error of a branch whose recompute differs from its forward."""
    return max(1e-2, 64 * torch.finfo(dtype).eps)
