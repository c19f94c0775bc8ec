"""A block's forward recorded call by call, for :mod:`.ops`: every aten call timed (summed
per overload packet), its outputs kept, which storages it allocated, whether it drew random
numbers, and which storages autograd saved; the global RNG and the block's buffers are left as
they were."""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import SAC_IGNORED_OPS

from ..errors import InvalidInputTypeError
from ..replay import ForwardState, devices_of

__all__ = ["RecordedForward", "record_forward"]


@dataclass
class _Call:
    packet: Any
    outputs: list[torch.Tensor]
    versions: list[int]
    new: list[int]  # storages of outputs this call allocated
    drew: bool

    def mutated(self) -> bool:
        """Whether an output changed in place since the call (as torch's cache checks)."""
        return any(t._version != v for t, v in zip(self.outputs, self.versions, strict=True))


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _rng_states(devices: list[torch.device]) -> list[torch.Tensor]:
    states = [torch.get_rng_state()]
    for d in devices:
        if d.type != "cpu":
            module = torch.get_device_module(d.type)
            states.append(module.get_rng_state() if d.type == "mps" else module.get_rng_state(d))
    return states


class _Recorder(TorchDispatchMode):
    """Times every aten call (summed per packet); with ``record``, also keeps each call's
    outputs (so no storage is freed and its id reused during the forward), which storages it
    allocated, and whether it drew random numbers."""

    def __init__(self, devices: list[torch.device], *, record: bool) -> None:
        super().__init__()
        self.devices = devices
        self.record = record
        self.sync = any(d.type != "cpu" for d in devices)
        self.seconds: dict[Any, float] = defaultdict(float)
        self.calls: list[_Call] = []
        self.seen: set[int] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in SAC_IGNORED_OPS:  # invisible to a selective policy
            return func(*args, **kwargs)
        seeded = self.record and torch.Tag.nondeterministic_seeded in func.tags
        before = _rng_states(self.devices) if seeded else []
        if self.sync:
            torch.accelerator.synchronize()
        start = time.perf_counter()
        out = func(*args, **kwargs)
        if self.sync:
            torch.accelerator.synchronize()
        self.seconds[func.overloadpacket] += time.perf_counter() - start
        if self.record:
            drew = seeded and not all(map(torch.equal, before, _rng_states(self.devices)))
            inputs = {_key(t) for t in _tensors((args, kwargs))}
            outputs = _tensors(out)
            new = []
            for t in outputs:
                k = _key(t)
                if k not in inputs and k not in self.seen:
                    new.append(k)
                self.seen.add(k)
            self.seen |= inputs
            versions = [t._version for t in outputs]
            self.calls.append(_Call(func.overloadpacket, outputs, versions, new, drew))
        return out


@contextlib.contextmanager
def _untouched(block: nn.Module, devices: list[torch.device]) -> Iterator[None]:
    """Leaves the global RNG and the block's buffers (BatchNorm statistics) as they were."""
    buffers = [(b, b.detach().clone()) for b in block.buffers()]
    accelerators = [d for d in devices if d.type != "cpu"]
    kind = accelerators[0].type if accelerators else "cuda"
    indices = [d.index for d in accelerators if d.type == kind]
    try:
        with torch.random.fork_rng(devices=indices, device_type=kind):
            yield
    finally:
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)


@dataclass(frozen=True)
class RecordedForward:
    """A block's forward on a leaf made from its input: every call (first run), the storage
    of the output, the storages autograd saved, the replay state's bytes and, per run, the
    seconds per packet."""

    calls: list[_Call]
    output: int
    saved: set[int]
    replay_bytes: int
    timings: list[dict[Any, float]]


def record_forward(
    block: nn.Module, x: torch.Tensor, kwargs: dict[str, Any], repeats: int
) -> RecordedForward:
    """Runs ``block(x, **kwargs)`` ``repeats`` times with autograd, the first recorded."""
    leaf = x.detach().requires_grad_(x.is_floating_point())
    devices = devices_of(block, leaf, kwargs)
    saved: set[int] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.add(_key(t))
        return t.detach()  # no reference cycle through a saved output's grad_fn (a leak)

    with _untouched(block, devices):
        recorder = _Recorder(devices, record=True)
        state = ForwardState.capture(block, leaf, kwargs)
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), recorder:
                y = block(leaf, **kwargs)
        except BaseException:
            state.forward_finished(completed=False)
            raise
        state.forward_finished()
        if not isinstance(y, torch.Tensor):
            raise InvalidInputTypeError(
                f"op_costs handles blocks returning one tensor; {type(block).__name__} returned "
                f"{type(y).__name__}"
            )
        timings = [recorder.seconds]
        for _ in range(repeats - 1):
            timer = _Recorder(devices, record=False)
            with timer:
                block(leaf, **kwargs)
            timings.append(timer.seconds)
    return RecordedForward(recorder.calls, _key(y), saved, state.retained_bytes, timings)
