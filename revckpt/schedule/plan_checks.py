"""The checks of a :class:`~revckpt.schedule.Plan`'s fields, made or read from JSON: segments
(in order, covering the chain, known strategies), block names, figures and the input
signature, the blocks' digest; each error names the offending value and the form expected."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..approx.formats import FORMATS
from ..checkpoint import POLICY_PRESETS
from ..errors import InvalidArgumentError, InvalidInputTypeError
from ..strategy import Strategy, kind_of
from .costs import COMPRESS, SELECTIVE, Segment

if TYPE_CHECKING:
    from .plan import Plan

__all__: list[str] = []

_SEGMENT_FORM = (
    "a plan's segments are [start, stop, strategy] (blocks start to stop - 1), in block order "
    "from block 0, each starting where the one before stops"
)


def _strategy_form() -> str:
    return (
        "'store', 'checkpoint', 'reversible', 'offload', 'approx:<codec>' or "
        f"'compress:<codec>' with a codec of {sorted(FORMATS)}, or 'selective:<policy>' with a "
        f"policy of {sorted(POLICY_PRESETS)} (or groups and aten ops joined by '+')"
    )


def _known_strategy(strategy: str) -> bool:
    """Whether ``strategy`` is the text form of a :class:`~revckpt.Strategy` (exactly: no
    spaces around it, a known policy or codec)."""
    try:
        return str(Strategy.parse(strategy)) == strategy
    except InvalidArgumentError:
        return False


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _show(seg: Segment) -> str:
    return f"[{seg.start!r}, {seg.stop!r}, {seg.strategy!r}]"


def _checked_segments(segments: Any) -> tuple[Segment, ...]:
    """The segments as a tuple, checked: Segment objects with int bounds and a known strategy,
    non-empty ranges, selective segments of one block, in order, without gaps or overlaps."""
    if not isinstance(segments, (tuple, list)) or not segments:
        raise InvalidArgumentError(f"a plan needs at least one segment, got {segments!r}")
    for i, seg in enumerate(segments):
        if not isinstance(seg, Segment):
            raise InvalidInputTypeError(
                f"segment {i} is {seg!r}, not a revckpt.schedule.Segment(start, stop, strategy)"
            )
        if not (_is_int(seg.start) and _is_int(seg.stop) and isinstance(seg.strategy, str)):
            raise InvalidInputTypeError(
                f"segment {i} {_show(seg)}: start and stop are ints and strategy a string"
            )
        if not 0 <= seg.start < seg.stop:
            raise InvalidArgumentError(
                f"segment {i} {_show(seg)} is an empty or negative range; {_SEGMENT_FORM}"
            )
        if not _known_strategy(seg.strategy):
            raise InvalidArgumentError(
                f"segment {i} {_show(seg)}: unknown strategy; use {_strategy_form()}"
            )
        if kind_of(seg.strategy) == COMPRESS and seg.stop != seg.start + 1:
            raise InvalidArgumentError(
                f"segment {i} {_show(seg)}: a compress segment covers one block; give one "
                "segment per block"
            )
        if kind_of(seg.strategy) == SELECTIVE and seg.stop != seg.start + 1:
            raise InvalidArgumentError(
                f"segment {i} {_show(seg)}: a selective segment covers one block (its policy "
                f"applies per block); split it into {seg.stop - seg.start} segments of one"
            )
    _check_order(segments)
    return tuple(segments)


def _span(first: int, last: int) -> str:
    return f"block {first}" if first == last else f"blocks {first} to {last}"


def _check_order(segments: Sequence[Segment]) -> None:
    for i in range(1, len(segments)):
        a, b = segments[i - 1], segments[i]
        if b.start < a.start:
            raise InvalidArgumentError(
                f"segment {i} {_show(b)} comes after segment {i - 1} {_show(a)}: out of order; "
                f"{_SEGMENT_FORM}"
            )
    first = segments[0]
    if first.start != 0:
        raise InvalidArgumentError(
            f"segment 0 {_show(first)} does not start at block 0 "
            f"({_span(0, first.start - 1)} would not run); {_SEGMENT_FORM}"
        )
    for i in range(1, len(segments)):
        a, b = segments[i - 1], segments[i]
        if b.start < a.stop:
            what = f"overlaps ({_span(b.start, min(a.stop, b.stop) - 1)} would run twice)"
        elif b.start > a.stop:
            what = f"leaves a gap after ({_span(a.stop, b.start - 1)} would not run)"
        else:
            continue
        raise InvalidArgumentError(
            f"segment {i} {_show(b)} {what} segment {i - 1} {_show(a)}; {_SEGMENT_FORM}"
        )


def _checked_names(names: Any, length: int) -> tuple[str, ...]:
    return _per_block(names, length, "block_names", ("name", "names"))


def _per_block(values: Any, length: int, key: str, noun: tuple[str, str]) -> tuple[str, ...]:
    """``values``: none, or one string (``noun``: singular, plural) per block of the plan's
    ``length``."""
    if not isinstance(values, (tuple, list)) or not all(isinstance(v, str) for v in values):
        raise InvalidInputTypeError(f"{key} must be a list of strings, got {values!r}")
    if values and len(values) != length:
        raise InvalidArgumentError(
            f"{key} has {len(values)} {noun[1]} but the segments cover {length} blocks; give "
            f"one {noun[0]} per block, or none"
        )
    return tuple(values)


def _check_fields(plan: Plan) -> None:
    """Types and ranges of the figures (what JSON could get wrong)."""
    least = {"predicted_peak_bytes": 0, "store_all_peak_bytes": 1, "memory_budget_bytes": 1}
    for name, low in least.items():
        value = getattr(plan, name)
        if name == "memory_budget_bytes" and value is None:
            continue
        if not _is_int(value):
            raise InvalidInputTypeError(f"{name}={value!r}: a plan's byte figures are ints")
        if value < low:
            raise InvalidArgumentError(f"{name}={value!r}: pass an int >= {low}")
    for name in ("predicted_overhead", "predicted_error", "error_budget", "base_time_s"):
        value = getattr(plan, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise InvalidInputTypeError(f"{name}={value!r}: pass a number >= 0")
        if not value >= 0:
            raise InvalidArgumentError(f"{name}={value!r}: pass a number >= 0")
    if not isinstance(plan.name, str):
        raise InvalidInputTypeError(f"name={plan.name!r}: a plan's name is a string")
    for name in ("model_digest", "blocks_digest"):
        value = getattr(plan, name)
        if value is not None and not isinstance(value, str):
            raise InvalidInputTypeError(f"{name}={value!r}: null, or a digest (a string)")
    if not isinstance(plan.compiled, bool):
        raise InvalidInputTypeError(f"compiled={plan.compiled!r}: pass true or false")
    if plan.input_signature is not None:
        _check_signature(plan.input_signature)
    if plan.autocast is not None and (
        not isinstance(plan.autocast, str) or dtype_named(plan.autocast) is None
    ):
        raise InvalidArgumentError(
            f"autocast={plan.autocast!r}: null, or the name of a torch dtype such as 'bfloat16'"
        )


def _checked_keys(keys: Any, length: int) -> tuple[int | str | None, ...]:
    """``block_keys``: none, or per block where its hidden state is among its arguments: a
    position (an int >= 0), a keyword name, or ``None`` (found by the rule)."""
    if not isinstance(keys, (tuple, list)) or not all(
        k is None or isinstance(k, str) or (_is_int(k) and k >= 0) for k in keys
    ):
        raise InvalidInputTypeError(
            f"block_keys must be a list of argument positions (ints >= 0), keyword names or "
            f"nulls, got {keys!r}"
        )
    if keys and len(keys) != length:
        raise InvalidArgumentError(
            f"block_keys has {len(keys)} entries but the segments cover {length} blocks; give "
            "one entry per block, or none"
        )
    return tuple(keys)


def _checked_tensor_arguments(sites: Any, length: int) -> tuple[tuple[int | str, ...], ...]:
    """``block_tensors``: none, or per block the positions (ints >= 0) and keyword names of
    its arguments that were tensors in the traced step."""
    if not isinstance(sites, (tuple, list)) or not all(
        isinstance(s, (tuple, list))
        and all(isinstance(k, str) or (_is_int(k) and k >= 0) for k in s)
        for s in sites
    ):
        raise InvalidInputTypeError(
            "block_tensors must be a list, per block, of lists of argument positions (ints "
            f">= 0) and keyword names, got {sites!r}"
        )
    if sites and len(sites) != length:
        raise InvalidArgumentError(
            f"block_tensors has {len(sites)} entries but the segments cover {length} blocks; "
            "give one entry per block, or none"
        )
    return tuple(tuple(s) for s in sites)


def _checked_tensor_shapes(
    shapes: Any, sites: tuple[tuple[int | str, ...], ...]
) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """``block_tensor_shapes``: none, or per block the shape (a list of ints >= 0) of each
    argument ``block_tensors`` names, in its order."""
    if not isinstance(shapes, (tuple, list)) or not all(
        isinstance(b, (tuple, list))
        and all(isinstance(s, (tuple, list)) and all(_is_int(n) and n >= 0 for n in s) for s in b)
        for b in shapes
    ):
        raise InvalidInputTypeError(
            "block_tensor_shapes must be a list, per block, of the shapes (lists of ints >= 0) "
            f"of its tensor arguments, got {shapes!r}"
        )
    if shapes and [len(b) for b in shapes] != [len(s) for s in sites]:
        raise InvalidArgumentError(
            "block_tensor_shapes must give one shape per argument block_tensors names, per "
            f"block ({[len(s) for s in sites]}), got {[len(b) for b in shapes]}; write plans "
            "with Plan.to_json"
        )
    return tuple(tuple(tuple(s) for s in b) for b in shapes)


def _checked_dtypes(dtypes: Any, length: int) -> tuple[str, ...]:
    """``block_dtypes``: none, or one torch dtype name per block (``"float32"``)."""
    dtypes = _per_block(dtypes, length, "block_dtypes", ("entry", "entries"))
    bad = [d for d in dtypes if dtype_named(d) is None]
    if bad:
        raise InvalidArgumentError(
            f"block_dtypes {bad[:3]} are not torch dtypes; use names such as 'float32'"
        )
    return dtypes


def blocks_digest(blocks: Sequence[nn.Module]) -> str:
    """A digest of the blocks' parameter names, shapes and dtypes, block by block (a plan is
    applied to the chain it was profiled on only)."""
    h = hashlib.sha256()
    for i, block in enumerate(blocks):
        block = getattr(block, "_orig_mod", block)  # torch.compile's wrapper: the same block
        for name, p in block.named_parameters():
            h.update(f"{i}.{name}:{tuple(p.shape)}:{p.dtype};".encode())
    return h.hexdigest()[:16]


def dtype_named(name: str) -> torch.dtype | None:
    """The torch dtype ``name`` names (``"float32"`` or ``"torch.float32"``), or ``None``."""
    found = getattr(torch, name.removeprefix("torch."), None)
    return found if isinstance(found, torch.dtype) else None


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` as ``"float32"``."""
    return str(dtype).removeprefix("torch.")


def _check_signature(sig: Any) -> None:
    form = "input_signature is null or (shape: list of ints, dtype: str, device: str)"
    if not (isinstance(sig, tuple) and len(sig) == 3):
        raise InvalidInputTypeError(f"input_signature={sig!r}: {form}")
    shape, dtype, device = sig
    if not (
        isinstance(shape, tuple)
        and all(_is_int(n) and n >= 0 for n in shape)
        and isinstance(dtype, str)
        and isinstance(device, str)
    ):
        raise InvalidInputTypeError(f"input_signature={sig!r}: {form}")


def _json_list(value: Any, key: str) -> list[Any]:
    if not isinstance(value, list):
        raise InvalidInputTypeError(f"{key} in plan JSON must be a list, got {value!r}")
    return value


def _segments_from_json(value: Any) -> tuple[Segment, ...]:
    out = []
    for i, item in enumerate(_json_list(value, "segments")):
        if not (isinstance(item, list) and len(item) == 3):
            raise InvalidInputTypeError(
                f"segment {i} in plan JSON is {item!r}; {_SEGMENT_FORM}, e.g. [0, 4, 'checkpoint']"
            )
        out.append(Segment(*item))
    return tuple(out)


def _signature_from_json(sig: Any) -> tuple[Any, ...] | None:
    if sig is None:
        return None
    if not (isinstance(sig, list) and len(sig) == 3 and isinstance(sig[0], list)):
        raise InvalidInputTypeError(
            f"input_signature in plan JSON is {sig!r}; expected null or [shape (a list of "
            "ints), dtype, device]"
        )
    return (tuple(sig[0]), sig[1], sig[2])
