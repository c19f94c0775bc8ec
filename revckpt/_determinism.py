"""Value-level determinism check for recomputed forwards.

During the first forward every operation's freshly allocated outputs are fingerprinted with
three float64 reductions, ``sum(x)``, ``sum(|x|)`` and ``sum(x_i * w_i)`` with a fixed
position-dependent weight (so reordered values are caught too); the recompute fingerprints its
outputs again, in the same order, and the first difference raises
:class:`CheckpointMismatchError` naming the operation. Operations whose outputs all alias an
input (views, ``detach``, in-place updates such as a BatchNorm counter) and allocations of
uninitialised memory (``empty_like``) are skipped: only values the block computes are compared.
The check costs three reductions per output and 24 bytes per output kept until backward, so it
is opt-in (``determinism_check="values"``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten

from .errors import CheckpointMismatchError

# Operations whose outputs hold uninitialised memory: nothing to compare until written.
_UNINITIALISED = frozenset(
    getattr(torch.ops.aten, name)
    for name in ("empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided")
    if hasattr(torch.ops.aten, name)
)


def _storage_key(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


def _fingerprint(t: torch.Tensor) -> torch.Tensor:
    x = t.detach()
    if x.is_complex():
        x = torch.view_as_real(x)
    x = x.to(torch.float64).reshape(-1)
    # a position-dependent weight (fractional parts of i * golden ratio) catches reordered values
    # that leave sum(x) and sum|x| unchanged
    ramp = torch.arange(x.numel(), dtype=torch.float64, device=x.device).mul_(0.6180339887498949)
    ramp = ramp.frac_().sub_(0.5)
    return torch.stack([x.sum(), x.abs().sum(), (x * ramp).sum()]).cpu()


def _fresh_outputs(out: Any, args: Any, kwargs: Any) -> list[torch.Tensor]:
    inputs = {
        _storage_key(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)
    }
    return [
        t
        for t in tree_flatten(out)[0]
        if isinstance(t, torch.Tensor)
        and t.layout == torch.strided
        and t.device.type != "meta"
        and _storage_key(t) not in inputs
    ]


class _Mode(TorchDispatchMode):
    def __init__(self, log: ValueLog, recording: bool) -> None:
        super().__init__()
        self.log = log
        self.recording = recording
        self.position = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.overloadpacket in _UNINITIALISED:
            return out
        fresh = _fresh_outputs(out, args, kwargs)
        if not fresh:
            return out  # views, detach, in-place updates: nothing newly computed to compare
        # Fingerprints are bookkeeping: hidden from the modes below (a selective-checkpoint
        # cache must not see them) and from autograd.
        with _disable_current_modes(), torch.no_grad():
            prints = [_fingerprint(t) for t in fresh]
            if self.recording:
                self.log.entries.append((func, prints))
            else:
                self._compare(func, prints)
        return out

    def _compare(self, func: Any, prints: list[torch.Tensor]) -> None:
        index = self.position
        self.position += 1
        where = f"in checkpointed {self.log.label}, operation #{index}"
        if index >= len(self.log.entries):
            raise CheckpointMismatchError(
                f"{where} ({func}) was not run by the first forward: the recompute took a "
                "different path. Make the block's control flow independent of global state, or "
                "pass determinism_check='none' to disable this check."
            )
        first_func, first_prints = self.log.entries[index]
        if first_func != func or len(first_prints) != len(prints):
            raise CheckpointMismatchError(
                f"{where}: the first forward ran {first_func} but the recompute ran {func}. "
                "Make the block's control flow independent of global state, or pass "
                "determinism_check='none' to disable this check."
            )
        for k, (a, b) in enumerate(zip(first_prints, prints, strict=True)):
            if not torch.equal(torch.nan_to_num(a), torch.nan_to_num(b)):
                raise CheckpointMismatchError(
                    f"{where} ({func}), output {k}: recomputed values differ from the first "
                    f"forward (sum {a[0].item():.9g} -> {b[0].item():.9g}, sum|x| "
                    f"{a[1].item():.9g} -> {b[1].item():.9g}). The block depends on state that "
                    "changed between forward and backward (a module attribute, a global flag, "
                    "an unseeded random source) or on a nondeterministic kernel; fix that, or "
                    "pass determinism_check='none' to disable this check."
                )


class ValueLog:
    """Fingerprints of one checkpointed forward, and the contexts that record and check them."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.entries: list[tuple[Any, list[torch.Tensor]]] = []

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        self.entries.clear()
        with _Mode(self, recording=True):
            yield

    @contextlib.contextmanager
    def checking(self) -> Iterator[None]:
        with _Mode(self, recording=False):
            yield
