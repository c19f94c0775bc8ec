"""A checkpoint segment of several blocks that the model's own code calls one by one.

``checkpoint(fn, x)`` needs the whole segment as one callable; in place, the loop over the
blocks is in the user's forward. A :class:`Region` spans the calls instead: while a block of
the segment runs, the tensors autograd saves are replaced by handles (saved-tensor hooks, as
torch's non-reentrant checkpoint does), so the segment keeps only its first block's
arguments. The first handle unpacked in backward re-runs the segment's blocks in order from
that input, each under its forward's replayed state (:mod:`revckpt.replay`: RNG, autocast,
module state, frozen running statistics), and serves every saved tensor from that recompute.
Code between the blocks runs outside the hooks (what it saves is kept as usual); a block's
input must be the output of the block before it, which :func:`revckpt.fit` checks.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..engine.rerun import any_changed, check_versions, input_versions
from ..errors import CheckpointMismatchError, InvalidArgumentError, ModifiedInputError, ReplayError
from ..replay import ForwardState
from .calls import Key, hidden_of, replaced
from .install import is_fsdp

__all__ = ["Region"]


@dataclass
class _Record:
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    key: Key
    state: ForwardState
    label: str
    versions: list[tuple[torch.Tensor, int]]
    packed: int = 0


class _Run:
    """One forward of the segment: its records and, in backward, the recomputed tensors."""

    def __init__(self, first_input: torch.Tensor) -> None:
        self.first_input = first_input
        self.records: list[_Record] = []
        self.count = 0
        self.store: dict[int, torch.Tensor] = {}
        self.last_output: torch.Tensor | None = None
        self.last_version = 0
        self.lock = threading.Lock()

    def pack(self, t: torch.Tensor) -> Any:
        index = self.count
        self.count += 1
        return self, index

    @staticmethod
    def unpack(handle: Any) -> torch.Tensor:
        run, index = handle
        with run.lock:
            if index not in run.store:
                run.recompute()
            if index not in run.store:
                raise CheckpointMismatchError(
                    f"the recompute of a checkpoint segment ({run.records[0].label} .. "
                    f"{run.records[-1].label}) saved fewer tensors than its forward; the blocks "
                    "must run the same operations when re-run (no data-dependent branches on "
                    "state that changed)"
                )
            return run.store.pop(index)

    def recompute(self) -> None:
        store: dict[int, torch.Tensor] = {}

        def keep(t: torch.Tensor) -> None:
            store[len(store)] = t

        changed = [r.label for r in self.records if any_changed(r.versions)]
        if changed:
            raise ModifiedInputError(
                f"{changed[0]}, in a checkpoint segment ({self.records[0].label} .. "
                f"{self.records[-1].label}): a tensor it was given (the segment's input, an "
                "argument or keyword) was changed in place after its forward, before its "
                "backward, so the segment's recompute would read the changed value (plain "
                "autograd raises for a tensor it saved that was changed so). Change it out of "
                "place, or pass a copy (t.clone())"
            )
        x = self.first_input
        h = x.detach().requires_grad_(x.requires_grad)
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(keep, _never):
            for record in self.records:
                args, kwargs = replaced(record.args, record.kwargs, record.key, h)
                before = len(store)
                with record.state.replay(label=record.label, exact_draws=True):
                    out = record.fn(*args, **kwargs)
                if len(store) - before != record.packed:
                    raise CheckpointMismatchError(
                        f"the recompute of {record.label} saved {len(store) - before} tensors "
                        f"for backward, its forward {record.packed}; it must run the same "
                        "operations when re-run"
                    )
                h = hidden_of(out, record.label)
        self.store = store


def _never(packed: Any) -> torch.Tensor:
    raise RuntimeError("revckpt: a recomputed segment's own graph is never differentiated")


class Region:
    """Blocks ``0 .. size - 1`` of one checkpoint segment (see the module docstring)."""

    def __init__(self, size: int, labels: tuple[str, ...]) -> None:
        self.size = size
        self.labels = labels
        self._local = threading.local()

    def __getstate__(self) -> dict[str, Any]:  # a planned model pickles; runs do not
        return {"size": self.size, "labels": self.labels}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["size"], state["labels"])  # type: ignore[misc]

    @torch.compiler.disable
    def call(
        self,
        position: int,
        block: nn.Module,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        key: Key,
    ) -> Any:
        """Run the segment's block at ``position`` (0 starts a new forward of the segment)."""
        if is_fsdp(block):
            raise InvalidArgumentError(
                f"{self.labels[position]} is sharded by FSDP2 (fully_shard) inside a checkpoint "
                f"segment of {self.size} blocks: re-running the segment's earlier blocks would "
                "need their parameters gathered, which only their own FSDP hooks do. Plan with "
                "revckpt.fit(..., segment_blocks=1) before fully_shard"
            )
        hidden = args[key] if isinstance(key, int) else kwargs[key]
        run: _Run | None = getattr(self._local, "run", None)
        if position == 0:
            run = _Run(hidden)
        elif (
            run is None
            or len(run.records) != position
            or run.last_output is not hidden
            or hidden._version != run.last_version
        ):
            self._local.run = None
            raise ReplayError(
                f"{self.labels[position]} is planned inside a checkpoint segment with "
                f"{self.labels[0]}, but it was not called right after {self.labels[position - 1]} "
                "on that block's output as it returned it (a module hook added since fit, a "
                "full backward hook, a forward hook returning a new output or changing it in "
                "place, or the model's own code changing it in place between the blocks, also "
                "changes what the next block gets, which the segment's recompute "
                "would not see; so does a planned block removed, replaced or added since fit); "
                "plan with revckpt.fit again (it checks how the model calls its blocks), or use "
                "one-block segments (revckpt.fit(..., segment_blocks=1))"
            )
        self._local.run = run
        # the segment's first input is kept by the run; later ones are rebuilt in backward
        kept_args, kept_kwargs = replaced(args, kwargs, key, None) if position else (args, kwargs)
        state = ForwardState.capture(args, kwargs, modules=(block,))
        versions = input_versions(kept_args, kept_kwargs)
        record = _Record(fn, kept_args, kept_kwargs, key, state, self.labels[position], versions)
        run.records.append(record)
        start = run.count
        try:
            with torch.autograd.graph.saved_tensors_hooks(run.pack, _Run.unpack):
                out = fn(*args, **kwargs)
        except BaseException:
            state.forward_finished(completed=False)
            raise
        state.forward_finished()
        check_versions(versions, self.labels[position])  # changed its input: recompute differs
        record.packed = run.count - start
        run.last_output = hidden_of(out, self.labels[position])
        run.last_version = run.last_output._version
        if position == self.size - 1:
            self._local.run = None
            run.last_output = None
        return out
