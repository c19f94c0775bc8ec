"""A plan: which strategy runs which blocks, with the figures the cost model predicts for it."""

from __future__ import annotations

import dataclasses
import functools
import json
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .._numbers import mib
from ..approx import Approx, compress_saved
from ..checkpoint import checkpoint, checkpoint_sequential
from ..errors import InvalidArgumentError, InvalidInputTypeError, PlanWarning
from ..layers import ReversibleSequential, ReversibleUnit
from ..strategy import argument_of, kind_of
from .costs import (
    APPROX,
    CHECKPOINT,
    COMPRESS,
    OFFLOAD,
    REVERSIBLE,
    SELECTIVE,
    STORE,
    Segment,
)
from .plan_checks import (
    _check_fields,
    _checked_dtypes,
    _checked_keys,
    _checked_names,
    _checked_segments,
    _checked_tensor_arguments,
    _checked_tensor_shapes,
    _is_int,
    _json_list,
    _segments_from_json,
    _signature_from_json,
    blocks_digest,
)

__all__ = ["Plan", "Scheduled", "apply"]


@dataclass(frozen=True)
class Plan:
    """Segments of a chain with a strategy each, and the predictions of the cost model.

    A plan made by :func:`revckpt.fit` covers a whole training step: ``block_names`` are
    the blocks' names in the model, ``block_shapes`` the hidden-state shapes it was made for
    (every batch no larger in any dimension holds), ``block_dtypes`` their dtypes (``"float32"``;
    a wider one, as after ``model.double()``, makes every kept tensor larger and is refused as
    a larger shape is), ``autocast`` the autocast dtype it was made under (``None``: autocast
    off; run without it, or in a wider one, the blocks keep wider activations and it is refused
    too), ``block_keys`` where each block's hidden state is among its arguments (a position or
    a keyword name, as the traced step showed; a saved plan reused by ``fit(..., plan=)``
    reads it there, not by a rule), ``block_tensors`` which of each block's arguments were
    tensors there (a tensor argument the step did not have, as a Hugging Face attention mask
    that comes only with padding, warns: its cost is not in the plan), ``block_tensor_shapes``
    their shapes, in that order (a larger one, as a longer encoder output a decoder layer
    attends to, is refused in training as a larger hidden state is), ``model_digest`` a
    digest of the model's parameter names and shapes (a saved plan is applied to the model it
    was made for only), and the predictions are those of the whole step. ``threads``: the
    intra-op thread count the times were measured with; running with another warns once
    (:class:`~revckpt.PlanWarning`): the memory predictions hold, the time predictions do
    not. ``compiled``: solved from a
    profile of the blocks under ``torch.compile`` (``profile(..., compiled=True)``): its
    predictions hold for ``torch.compile(apply(blocks, plan))``; run eagerly, it warns once
    (eager selective blocks keep more than compiled ones). ``blocks_digest``: a digest of the
    profiled blocks' parameter names, shapes and dtypes (:func:`apply` refuses other blocks:
    the plan's predictions are theirs; ``None`` in plans made before 2026-12-07 and by
    :func:`revckpt.fit`, whose ``model_digest`` covers the whole model). ``left_out``: the
    blocks :func:`revckpt.fit` left out of the plan, their output needing no gradient (frozen,
    on inputs that need none): refused in training once it needs one.

    ``predicted_peak_bytes``: forward+backward peak of live tensor bytes; ``predicted_overhead``:
    recompute time over the plain chain's forward+backward time; ``predicted_error``: summed
    estimated relative gradient error of the approx segments (from :func:`revckpt.fit`, at
    least what its check step measured, as ``predicted_peak_bytes`` is). ``name`` says where
    the plan came
    from (``"optimal"``, ``"per-block"``, ``"sqrt"``, ``"every-4"``, ``"greedy"``, ...).
    """

    segments: tuple[Segment, ...]
    predicted_peak_bytes: int
    predicted_overhead: float
    predicted_error: float
    memory_budget_bytes: int | None
    error_budget: float
    store_all_peak_bytes: int
    base_time_s: float
    name: str = "optimal"
    block_names: tuple[str, ...] = field(default=())
    input_signature: tuple[Any, ...] | None = None
    block_shapes: tuple[tuple[int, ...], ...] = field(default=())
    block_dtypes: tuple[str, ...] = field(default=())
    autocast: str | None = None
    model_digest: str | None = None
    threads: int | None = None
    compiled: bool = False
    blocks_digest: str | None = None
    block_keys: tuple[int | str | None, ...] = field(default=())
    block_tensors: tuple[tuple[int | str, ...], ...] = field(default=())
    left_out: tuple[str, ...] = field(default=())
    block_tensor_shapes: tuple[tuple[tuple[int, ...], ...], ...] = field(default=())

    def __post_init__(self) -> None:
        object.__setattr__(self, "segments", _checked_segments(self.segments))
        object.__setattr__(self, "block_names", _checked_names(self.block_names, self.length))
        left_out = self.left_out
        if not isinstance(left_out, tuple) or not all(isinstance(n, str) for n in left_out):
            raise InvalidInputTypeError("Plan.left_out is a tuple of block names")
        both = sorted(set(left_out) & set(self.block_names))
        if both:
            raise InvalidArgumentError(
                f"Plan.left_out names planned blocks ({both}): a block is planned or left "
                "out, not both; write plans with Plan.to_json"
            )
        dtypes = _checked_dtypes(self.block_dtypes, self.length)
        object.__setattr__(self, "block_dtypes", dtypes)
        object.__setattr__(self, "block_keys", _checked_keys(self.block_keys, self.length))
        tensors = _checked_tensor_arguments(self.block_tensors, self.length)
        object.__setattr__(self, "block_tensors", tensors)
        shapes = _checked_tensor_shapes(self.block_tensor_shapes, tensors)
        object.__setattr__(self, "block_tensor_shapes", shapes)
        if self.block_shapes and len(self.block_shapes) != self.length:
            raise InvalidArgumentError(
                f"block_shapes has {len(self.block_shapes)} shapes but the segments cover "
                f"{self.length} blocks; give one shape per block, or none"
            )
        _check_fields(self)

    @property
    def length(self) -> int:
        """Number of blocks the plan covers."""
        return self.segments[-1].stop

    @property
    def strategies(self) -> list[str]:
        """The strategy of every block, in order."""
        out: list[str] = []
        for seg in self.segments:
            out += [seg.strategy] * (seg.stop - seg.start)
        return out

    @property
    def predicted_peak_fraction(self) -> float:
        """Predicted peak over the store-all peak."""
        return self.predicted_peak_bytes / self.store_all_peak_bytes

    def table(self) -> str:
        """Per-segment strategies and the predictions, as Markdown."""
        budget = "none" if self.memory_budget_bytes is None else mib(self.memory_budget_bytes)
        lines = [
            f"plan {self.name!r}: predicted peak {mib(self.predicted_peak_bytes)} "
            f"({self.predicted_peak_fraction:.1%} of store-all {mib(self.store_all_peak_bytes)},"
            f" budget {budget}), overhead +{self.predicted_overhead:.1%} of a plain step, "
            f"gradient error {self.predicted_error:.2e}"
            + ("" if self.memory_budget_bytes is None else f" (budget {self.error_budget:g})"),
            "| blocks | strategy |",
            "|---|---|",
        ]
        for seg in self.segments:
            names = ""
            if self.block_names:
                names = f" ({self.block_names[seg.start]}"
                names += (
                    f" .. {self.block_names[seg.stop - 1]})" if seg.stop - seg.start > 1 else ")"
                )
            lines.append(f"| {seg.start}-{seg.stop - 1}{names} | {seg.strategy} |")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    # -- JSON -------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """The plan as plain data (format ``revckpt.Plan/1``)."""
        d = asdict(self)
        d["segments"] = [[s.start, s.stop, s.strategy] for s in self.segments]
        d["block_names"] = list(self.block_names)
        d["block_shapes"] = [list(s) for s in self.block_shapes]
        d["block_dtypes"] = list(self.block_dtypes)
        d["block_keys"] = list(self.block_keys)
        d["block_tensors"] = [list(t) for t in self.block_tensors]
        d["block_tensor_shapes"] = [[list(s) for s in b] for b in self.block_tensor_shapes]
        d["left_out"] = list(self.left_out)
        if self.input_signature is not None:
            shape, dtype, device = self.input_signature
            d["input_signature"] = [list(shape), dtype, device]
        d["format"] = "revckpt.Plan/1"
        return d

    def to_json(self, path: str | Path | None = None) -> str:
        """The plan as JSON text; also written to ``path`` when given."""
        text = json.dumps(self.to_dict(), indent=2)
        if path is not None:
            Path(path).write_text(text + "\n")
        return text

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Plan:
        """The plan :meth:`to_dict` wrote."""
        if not isinstance(d, dict):
            raise InvalidInputTypeError(
                f"a plan is a JSON object (a dict), got {type(d).__name__}; read plans written "
                "by Plan.to_json with Plan.from_json"
            )
        if d.get("format") != "revckpt.Plan/1":
            raise InvalidArgumentError(
                "not a revckpt plan (missing format 'revckpt.Plan/1'); write plans with "
                "Plan.to_json and read them with Plan.from_json"
            )
        fields = {k: v for k, v in d.items() if k != "format"}
        missing = sorted(_REQUIRED - set(fields))
        unknown = sorted(set(fields) - _REQUIRED - _OPTIONAL)
        if missing or unknown:
            wrong = [
                f"{what} keys {keys}"
                for what, keys in (("missing", missing), ("unknown", unknown))
                if keys
            ]
            raise InvalidArgumentError(
                f"plan JSON with {' and '.join(wrong)}: a revckpt.Plan/1 has the keys "
                f"{sorted(_REQUIRED)} and optionally {sorted(_OPTIONAL)}; write plans with "
                "Plan.to_json"
            )
        fields["segments"] = _segments_from_json(fields["segments"])
        fields["block_names"] = tuple(_json_list(fields.get("block_names", []), "block_names"))
        fields["input_signature"] = _signature_from_json(fields.get("input_signature"))
        shapes = _json_list(fields.get("block_shapes", []), "block_shapes")
        if not all(isinstance(s, list) and all(_is_int(n) for n in s) for s in shapes):
            raise InvalidInputTypeError("block_shapes in plan JSON is a list of lists of ints")
        fields["block_shapes"] = tuple(tuple(s) for s in shapes)
        fields["block_dtypes"] = tuple(_json_list(fields.get("block_dtypes", []), "block_dtypes"))
        fields["block_keys"] = tuple(_json_list(fields.get("block_keys", []), "block_keys"))
        tensors = _json_list(fields.get("block_tensors", []), "block_tensors")
        fields["block_tensors"] = tuple(tuple(_json_list(t, "block_tensors")) for t in tensors)
        shapes = _json_list(fields.get("block_tensor_shapes", []), "block_tensor_shapes")
        fields["block_tensor_shapes"] = tuple(
            tuple(
                tuple(_json_list(s, "block_tensor_shapes"))
                for s in _json_list(b, "block_tensor_shapes")
            )
            for b in shapes
        )
        left_out = _json_list(fields.get("left_out", []), "left_out")
        if not all(isinstance(n, str) for n in left_out):
            raise InvalidInputTypeError("left_out in plan JSON is a list of block names")
        fields["left_out"] = tuple(left_out)
        return cls(**fields)

    @classmethod
    def from_json(cls, text_or_path: str | Path) -> Plan:
        """Read a plan from JSON text or a file path."""
        if not isinstance(text_or_path, (str, Path)):
            raise InvalidInputTypeError(
                f"Plan.from_json takes JSON text or a path, got {type(text_or_path).__name__}"
            )
        text = str(text_or_path)
        if not text.lstrip().startswith(("{", "[")):
            try:
                text = Path(text_or_path).read_text()
            except (OSError, UnicodeDecodeError) as err:
                raise InvalidArgumentError(
                    f"cannot read a plan from {str(text_or_path)[:200]!r} ({err}); pass JSON "
                    "text or the path of a file Plan.to_json wrote"
                ) from err
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise InvalidArgumentError(
                f"the plan is not valid JSON ({err.msg} at line {err.lineno}, column "
                f"{err.colno}); write plans with Plan.to_json"
            ) from err
        return cls.from_dict(data)


_FIELDS = {f.name: f for f in dataclasses.fields(Plan)}
_OPTIONAL = {n for n, f in _FIELDS.items() if f.default is not dataclasses.MISSING}
_OPTIONAL |= {n for n, f in _FIELDS.items() if f.default_factory is not dataclasses.MISSING}
_REQUIRED = set(_FIELDS) - _OPTIONAL


def _fits_signature(x: torch.Tensor, sig: tuple[Any, ...]) -> bool:
    """The profiled input, or the same with a smaller first (batch) dimension, which the
    predictions bound from above (a last, smaller batch)."""
    shape, dtype, device = sig
    if (str(x.dtype), x.device.type) != (dtype, device) or x.dim() != len(shape):
        return False
    if tuple(x.shape) == tuple(shape):
        return True
    return x.dim() > 0 and tuple(x.shape[1:]) == tuple(shape[1:]) and x.shape[0] <= shape[0]


class Scheduled(nn.Module):
    """A chain run by a :class:`Plan`. The blocks are registered under the names they had in
    the original container (``state_dict`` keys unchanged) and shared, not copied."""

    def __init__(self, blocks: nn.Sequential | Sequence[nn.Module], plan: Plan) -> None:
        super().__init__()
        if isinstance(blocks, nn.Sequential):
            named = list(blocks.named_children())
        else:
            named = [(str(i), b) for i, b in enumerate(blocks)]
        if len(named) != plan.length:
            raise InvalidArgumentError(
                f"the plan covers {plan.length} blocks but the chain has {len(named)}; apply a "
                "plan to the chain it was solved for"
            )
        for name, block in named:
            if not isinstance(block, nn.Module):
                raise InvalidInputTypeError(f"block {name} is not an nn.Module")
        _check_digest(plan, [block for _, block in named])
        for name, block in named:
            self.add_module(name, block)
        self._order = [name for name, _ in named]
        self.plan = plan
        self._runs = segment_runs([block for _, block in named], plan.segments)
        # each approx segment's configuration and codec, built once here, not per forward
        self._approx = [
            Approx(store=argument_of(strategy)) if kind_of(strategy) == APPROX else None
            for strategy, _ in self._runs
        ]

    def forward(self, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        # read first: past a graph break, Dynamo may run the rest of this frame eagerly
        compiling = torch.compiler.is_compiling()
        sig = self.plan.input_signature
        if (
            sig is not None
            and torch.is_grad_enabled()  # without a backward the predictions do not matter
            and not _fits_signature(x, sig)
        ):
            raise InvalidArgumentError(
                f"this plan was profiled on inputs of shape {list(sig[0])}, {sig[1]} on "
                f"{sig[2]}, but got shape {list(x.shape)}, {x.dtype} on {x.device.type}: its "
                "memory predictions do not hold for larger or other inputs (a smaller batch, "
                "or no grad, is fine). Profile and solve again for this input "
                "(schedule.profile(blocks, x))"
            )
        if torch.is_grad_enabled() and not compiling:  # (the checks would break the graph)
            warn_if_threads_differ(self.plan.threads)
            if self.plan.compiled:
                _warn_eager_run()
        for (strategy, run), approx in zip(self._runs, self._approx, strict=True):
            if approx is None:
                x = run_segment(strategy, run, x, kwargs)
            else:
                x = checkpoint_sequential(run, 1, x, strategy=approx, **kwargs)
        return x


def _check_digest(plan: Plan, blocks: list[nn.Module]) -> None:
    if plan.blocks_digest is not None and plan.blocks_digest != blocks_digest(blocks):
        raise InvalidArgumentError(
            "these blocks' parameters (names, shapes or dtypes) are not those of the chain the "
            "plan was profiled on, so its memory and time predictions are not theirs; profile "
            "and solve again for these blocks (schedule.profile(blocks, x))"
        )


_threads_warned: set[tuple[int, int]] = set()


@functools.cache
def _warn_eager_run() -> None:
    warnings.warn(
        "this plan was solved from a compiled profile (profile(..., compiled=True)) and runs "
        "eagerly: its memory and time predictions hold under torch.compile(apply(blocks, "
        "plan)); run it compiled, or profile eagerly for an eager plan",
        PlanWarning,
        stacklevel=3,
    )


def warn_if_threads_differ(threads: int | None) -> None:
    """Warn once per (planned, current) pair when a plan whose times were measured with
    ``threads`` intra-op threads runs with another count. Not while compiling (the thread
    count is not traceable: it broke every planned block's graph), the eager runs warn."""
    if threads is None or torch.compiler.is_compiling():
        return
    now = torch.get_num_threads()
    if threads == now or (threads, now) in _threads_warned:
        return
    _threads_warned.add((threads, now))
    warnings.warn(
        f"this plan's times were measured with {threads} intra-op thread(s) and it runs "
        f"with {now}: its memory predictions hold, its time predictions do not. Profile "
        f"again under torch.set_num_threads({now}), or set {threads} threads",
        PlanWarning,
        stacklevel=3,
    )


def segment_runs(chain: Sequence[nn.Module], segments: Sequence[Segment]) -> list[tuple[str, Any]]:
    """Per segment, its strategy and what runs it: its blocks (an ``nn.Sequential`` sharing
    them, not registered by the caller), or for a reversible segment the
    :class:`~revckpt.layers.ReversibleSequential` of their branches (sharing their modules)."""
    runs: list[tuple[str, Any]] = []
    for seg in segments:
        part = list(chain[seg.start : seg.stop])
        if seg.strategy != REVERSIBLE:
            # one container per segment, kept by the caller: its recompute node's per-module
            # caches (layouts, parameters) then hold from step to step (a list made a new
            # segment module, walked again, on every call)
            runs.append((seg.strategy, nn.Sequential(*part)))
            continue
        if not all(isinstance(b, ReversibleUnit) for b in part):
            raise InvalidArgumentError(
                f"segment {seg.start}-{seg.stop - 1} is planned reversible but holds "
                "blocks that are not ReversibleUnit; re-profile the chain"
            )
        dims = {b.split_dim for b in part}
        if len(dims) != 1:
            raise InvalidArgumentError("reversible units of one segment must share split_dim")
        runs.append(
            (REVERSIBLE, ReversibleSequential(*[b.block for b in part], split_dim=dims.pop()))
        )
    return runs


def run_segment(strategy: str, run: Any, x: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
    """Run one segment (as :func:`segment_runs` gives it) on ``x`` with its strategy."""
    if strategy == STORE:
        for block in run:
            x = block(x, **kwargs)
        return x
    if strategy == CHECKPOINT:
        return checkpoint_sequential(run, 1, x, **kwargs)
    if strategy == REVERSIBLE:
        return run(x, **kwargs)
    if strategy == OFFLOAD:
        return checkpoint_sequential(run, len(run), x, strategy=OFFLOAD, **kwargs)
    if kind_of(strategy) == SELECTIVE:
        return checkpoint(run[0], x, strategy=strategy, **kwargs)
    if kind_of(strategy) == COMPRESS:
        return compress_saved(run[0], x, store=argument_of(strategy), **kwargs)
    return checkpoint_sequential(run, 1, x, strategy=Approx(store=argument_of(strategy)), **kwargs)


def apply(blocks: nn.Sequential | Sequence[nn.Module], plan: Plan) -> Scheduled:
    """An ``nn.Module`` that runs ``blocks`` as ``plan`` says, sharing their parameters."""
    if not isinstance(plan, Plan):
        raise InvalidInputTypeError(f"apply(blocks, plan) needs a Plan, got {type(plan).__name__}")
    return Scheduled(blocks, plan)
