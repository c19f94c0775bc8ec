"""Measure what the scheduler needs about each block of a chain.

:func:`profile` gives, per block, every figure of :class:`~revckpt.schedule.costs.BlockCost`:

* memory (:mod:`.block_memory`): the bytes its forward saves, its input and output bytes,
  whether it saves its own output, the transient peaks of its forward and backward in every
  mode a plan can run it in, the replay state each recomputing strategy keeps, what each
  selective policy keeps, the compressed size of its input per codec, what offload moves;
* time (:mod:`.probe`): its stored forward and backward and each strategy's extra time,
  measured *inside the chain's step* in a few mixed rounds, and what it adds inside a longer
  checkpoint segment; what the rounds did not reach is timed on the block alone
  (:mod:`.block_time`);
* error (:mod:`.block_errors`): per codec, the relative errors of its parameter and input
  gradients when its input goes through the codec, with the chain's cotangent, and the
  weights of the chain's error model.

Identical blocks (same class, structure, parameter shapes, input shape: a *group*) are
metered once and time their strategies together; only the codec errors are per block (they
depend on each block's input and weights). Backward is measured in steady state: parameter
gradients already exist, as from the second training step on. The model's gradients,
buffers (BatchNorm statistics; the tensors its modules hold, and their values), plain
attributes and RNG state are left as they were (:func:`revckpt.measure.preserved`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .._deprecation import warn_deprecated
from .._numbers import mib
from ..checkpoint import canonical_policy
from ..errors import InvalidArgumentError, InvalidInputTypeError
from ..measure.state import cut_from_graph, preserved
from .block_profile import profile_block
from .costs import BlockCost
from .error_samples import checked_stride
from .plan_checks import blocks_digest
from .profiling import AUTO, DEFAULT_POLICIES, Progress, _ProfilingJob
from .step import StepCosts

__all__ = ["Profile", "profile", "profile_block"]

DEFAULT_CODECS = ("bf16", "e4m3")


def _signature(x: torch.Tensor) -> tuple[tuple[int, ...], str, str]:
    return tuple(x.shape), str(x.dtype), x.device.type


@dataclass(frozen=True)
class Profile:
    """Per-block costs of a chain, the block names, and the example input's signature;
    ``step``: for a profile made in situ (:func:`revckpt.fit`), the whole training step's
    costs outside the chain, which the predictions then include; ``threads``: the intra-op
    threads it was timed with (``torch.get_num_threads()``: its times hold for that count);
    ``seconds``: what profiling took; ``compiled``: its costs are those of the blocks run
    under ``torch.compile`` (``profile(..., compiled=True)``); ``blocks_digest``: a digest of
    the blocks' parameter names, shapes and dtypes, which its plans carry to
    :func:`~revckpt.schedule.apply`."""

    blocks: tuple[BlockCost, ...]
    names: tuple[str, ...]
    input_signature: tuple[tuple[int, ...], str, str] | None
    step: StepCosts | None = None
    threads: int | None = None
    seconds: float | None = None
    compiled: bool = False
    blocks_digest: str | None = None

    @property
    def cost_in_steps(self) -> float | None:
        """What profiling took, in training steps of the stored chain (``seconds`` over the
        measured forward+backward time of every block; with ``step``, of the whole step)."""
        base = sum(b.forward_s + b.backward_s for b in self.blocks)
        if self.step is not None:
            base /= self.step.chain_share
        if self.seconds is None or base <= 0:
            return None
        return self.seconds / base

    def table(self) -> str:
        """Markdown: per block times, bytes, transient peaks, invertibility, codec errors."""
        lines = [
            "| block | fwd ms | bwd ms | input MB | saved MB | fwd peak MB | bwd peak MB | "
            "invertible | approx error (est.) |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for name, b in zip(self.names, self.blocks, strict=True):
            errs = ", ".join(
                f"{c} {a.param_grad_error:.1e}"
                for c, a in b.approx.items()
                if a.param_grad_error is not None
            )
            lines.append(
                f"| {name} | {b.forward_s * 1e3:.2f} | {b.backward_s * 1e3:.2f} | "
                f"{mib(b.input_bytes, unit=False)} | {mib(b.saved_bytes, unit=False)} | "
                f"{mib(b.forward_peak_bytes, unit=False)} | "
                f"{mib(b.backward_peak_bytes, unit=False)} | "
                f"{'yes' if b.invertible else 'no'} | {errs} |"
            )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def profile(
    blocks: nn.Sequential | Sequence[nn.Module],
    x: torch.Tensor,
    *,
    kwargs: Mapping[str, Any] | None = None,
    codecs: Sequence[str] = DEFAULT_CODECS,
    policies: Sequence[str] | str = DEFAULT_POLICIES,
    compress: Sequence[str] = (),
    repeats: int = 5,
    rounds: int = 1,
    device: str | torch.device | None = None,
    offload: bool | None = None,
    compiled: bool = False,
    error_stride: int = 1,
    progress: Progress | None = None,
    **block_kwargs: Any,
) -> Profile:
    """Profile the chain ``blocks`` on input ``x``.

    ``kwargs``: keyword arguments passed to every block (``block(h, **kwargs)``), as in
    :func:`~revckpt.schedule.verify`; passing them as extra keywords of ``profile`` is
    deprecated (it warns, a :class:`FutureWarning`, for one release).
    ``codecs``: the approx formats to price (``()`` for none). ``policies``: the selective
    recompute policies to price: specs (:func:`revckpt.checkpoint.parse_policy`: presets of
    :data:`revckpt.POLICY_PRESETS`, or groups and aten operations joined by ``"+"``; ``()``
    for none), or ``"auto"``: per group of identical blocks, the nested keep-sets
    :func:`~revckpt.schedule.ops.op_choices` proposes from the block's own operations (what
    each keeps against what recomputing it costs), the solver then choosing one per block.
    ``compress``: the formats to price for compressed saved activations
    (:func:`revckpt.approx.compress_saved`; default none: each costs one more run of every
    block to measure its error; on the GPT-like chain on one CPU thread every block compressed
    in bf16 took 1.29x a stored step against checkpointing's 1.51x, in e4m3 1.98x:
    ``benchmarks/bench_compress.py``).
    ``repeats``: timing rounds of a block timed on its own (what the in-chain rounds did not
    reach). ``rounds``: how many times the in-chain timing steps run (each round adds two
    steps, or three for six strategies, rotated; more rounds average out a noisy machine, see
    :mod:`.probe`).
    ``device``: where memory is metered (default: ``x``'s device). ``offload``: price
    host offload (:mod:`revckpt.offload`): how many of each block input's bytes leave the
    device and the time of the copies; default ``None``, on when ``x`` is on a CUDA device (on
    the CPU the host is the device: offload saves nothing there, and is priced so only when
    asked). ``compiled``: price the strategies as they run under ``torch.compile`` (each
    group's block compiled per strategy, its bytes metered with the allocator meter and its
    times measured compiled, :mod:`.compiled`): store, checkpoint and the selective
    ``policies`` only, for a plan the caller runs as ``torch.compile(apply(blocks, plan))``.
    ``error_stride``: ``1`` (default) measures the codec errors (``codecs`` and ``compress``)
    on every block, one forward and backward of the block per codec; ``k > 1`` runs them on
    every ``k``-th block of a group of identical blocks and its last and interpolates between
    (:mod:`.error_samples`): cheaper, and right only where the errors move slowly along the
    chain; blocks whose weights differ (a trained model's) can read errors several times too
    low, and plans then break their error budget.
    ``progress(done, total)``: called as the work advances (a progress bar).
    """
    # over 60 lines for its signature and docstring: every option of the profiler, explained
    kwargs = cut_from_graph(_block_kwargs(kwargs, block_kwargs))
    chain = _chain_of(blocks)
    for name, value in (("codecs", codecs), ("compress", compress), ("policies", policies)):
        if isinstance(value, str) and not (name == "policies" and value == "auto"):
            raise InvalidInputTypeError(f"{name}={value!r}: pass a list, e.g. [{value!r}]")
    offload, policies = _checked_options(
        chain,
        x,
        repeats=repeats,
        rounds=rounds,
        offload=offload,
        compiled=compiled,
        compress=compress,
        policies=policies,
    )
    error_stride = checked_stride(error_stride)
    names = (  # by slot: a block the chain holds twice has a name at each place
        tuple(blocks._modules)
        if isinstance(blocks, nn.Sequential)
        else tuple(str(i) for i in range(len(chain)))
    )
    started = time.perf_counter()
    job = _ProfilingJob(
        chain,
        x,
        () if compiled else tuple(codecs),
        policies,
        tuple(compress),
        repeats,
        rounds,
        device or x.device,
        kwargs,
        compiled,
        error_stride,
    )
    rng_devices = [x.device] if x.device.type == "cuda" else []
    # leave the model and the caller's tensors as they were: gradients, running statistics, RNG
    callers = [x, *(v for v in kwargs.values() if isinstance(v, torch.Tensor))]
    with (
        torch.random.fork_rng(devices=rng_devices),
        torch.enable_grad(),
        preserved(chain, tensors=callers),
    ):
        costs = job.run(offload=offload, progress=progress)
    return Profile(
        tuple(costs),
        names,
        _signature(x),
        threads=torch.get_num_threads(),
        seconds=time.perf_counter() - started,
        compiled=compiled,
        blocks_digest=blocks_digest(chain),
    )


def _block_kwargs(kwargs: Mapping[str, Any] | None, block_kwargs: dict[str, Any]) -> dict[str, Any]:
    """The blocks' keyword arguments: ``kwargs=``, or the deprecated extra keywords of
    :func:`profile` given in its place (warned at profile's caller); both given raises."""
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise InvalidInputTypeError(
            f"profile(..., kwargs=): pass a mapping of the blocks' keyword arguments, got "
            f"{type(kwargs).__name__}"
        )
    if not block_kwargs:
        return dict(kwargs or {})
    warn_deprecated(
        f"profile(blocks, x, {', '.join(f'{k}=...' for k in block_kwargs)})",
        f"profile(blocks, x, kwargs={{{', '.join(repr(k) + ': ...' for k in block_kwargs)}}})",
        depth=2,
    )
    if kwargs is not None:
        raise InvalidArgumentError(
            f"profile got kwargs= and the blocks' keyword arguments {sorted(block_kwargs)} as "
            "extra keywords (their deprecated spelling); pass them all in kwargs= only"
        )
    return block_kwargs


def _checked_options(
    chain: list[nn.Module],
    x: torch.Tensor,
    *,
    repeats: int,
    rounds: int,
    offload: bool | None,
    compiled: bool,
    compress: Sequence[str],
    policies: Sequence[str] | str,
) -> tuple[bool, tuple[str, ...] | str]:
    """:func:`profile`'s arguments checked: ``offload`` decided (``None``: on CUDA) and the
    policies canonical (or ``AUTO``)."""
    if not chain:
        raise InvalidArgumentError("profile needs a non-empty chain of blocks")
    if not all(isinstance(b, nn.Module) for b in chain):
        raise InvalidInputTypeError("profile needs nn.Module blocks (an nn.Sequential or a list)")
    if not isinstance(x, torch.Tensor):
        raise InvalidInputTypeError(f"profile(blocks, x): x must be a tensor, got {type(x)}")
    if repeats < 1:
        raise InvalidArgumentError(f"repeats={repeats}: pass at least 1")
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise InvalidArgumentError(f"rounds={rounds!r}: pass an int >= 1")
    if offload is None:
        offload = x.device.type == "cuda"
    elif not isinstance(offload, bool):
        raise InvalidArgumentError(f"offload={offload!r}: pass True, False or None (auto)")
    if not isinstance(compiled, bool):
        raise InvalidArgumentError(f"compiled={compiled!r}: pass True or False")
    if compiled and (offload or compress):
        raise InvalidArgumentError(
            "compiled=True prices store, checkpoint and selective only: drop offload and "
            "compress, or profile eagerly"
        )
    auto = isinstance(policies, str) and policies == AUTO
    if not auto:
        if isinstance(policies, str):
            raise InvalidInputTypeError(
                f"policies={policies!r}: pass a list of policies (e.g. ['matmul+attention']) or "
                f"{AUTO!r}"
            )
        return offload, tuple(canonical_policy(p) for p in policies)  # raises on a bad spec
    return offload, AUTO


def _chain_of(blocks: Any) -> list[nn.Module]:
    """The chain's blocks in order; one module that is not a container of blocks is refused."""
    if isinstance(blocks, nn.Module) and not isinstance(blocks, (nn.Sequential, nn.ModuleList)):
        raise InvalidInputTypeError(
            f"profile(blocks, x) takes a chain of blocks (nn.Sequential, nn.ModuleList or a "
            f"list of modules), got one {type(blocks).__name__}: pass [block] for one block, "
            "or revckpt.fit(model, example, ...) for a whole model"
        )
    try:
        return list(blocks)
    except TypeError as err:
        raise InvalidInputTypeError(
            f"profile(blocks, x) takes a chain of blocks (nn.Sequential or a list of modules), "
            f"got {type(blocks).__name__}"
        ) from err
