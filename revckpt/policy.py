"""Selective-recompute policies: which aten operations' outputs a checkpoint keeps.

A policy spec is ``"+"``-joined tokens, each a group (``"matmul"``, ``"attention"``) or an aten
operation named by its overload packet (``"gelu"``, ``"native_layer_norm"``):
:func:`parse_policy` turns it into the keep-set, :func:`policy_text` writes a keep-set's one
canonical text, :data:`POLICY_PRESETS` names the usual ones, and :func:`policy_context_fn`
makes the selective-checkpoint contexts torch's checkpoint takes for a spec or a function
``op -> bool``. Every operation outside the keep-set is recomputed in backward. Imported by
:mod:`revckpt.checkpoint`, which re-exports the public names.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from .errors import InvalidArgumentError, InvalidInputTypeError

__all__ = [
    "POLICY_PRESETS",
    "Policy",
    "Selective",
    "canonical_policy",
    "parse_policy",
    "policy_context_fn",
    "policy_text",
]

Policy = str | Callable[[torch._ops.OpOverload], "bool | CheckpointPolicy"]


def _aten_packets(*names: str) -> frozenset[Any]:
    return frozenset(getattr(torch.ops.aten, n) for n in names if hasattr(torch.ops.aten, n))


_MATMUL = _aten_packets(
    "mm", "addmm", "bmm", "baddbmm", "addbmm", "convolution", "_int_mm", "_scaled_mm"
)
_ATTENTION = _aten_packets(
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable",
    "_flash_attention_forward",
    "_efficient_attention_forward",
)

#: Named selective-recompute policies: the aten operations whose outputs are kept; every other
#: operation of the block (norms, activations, dropout, reshapes, softmax) is recomputed.
POLICY_PRESETS: dict[str, frozenset[Any]] = {
    "matmul": _MATMUL,
    "attention": _ATTENTION,
    "matmul+attention": _MATMUL | _ATTENTION,
}

# The groups a policy spec may name (disjoint), in the order its canonical text writes them.
_GROUPS: dict[str, frozenset[Any]] = {k: v for k, v in POLICY_PRESETS.items() if "+" not in k}
# Words that read as something a spec cannot mean (aten.all is a boolean reduction).
_RESERVED = {
    "all": "keeping everything autograd saves is Strategy('store')",
    "none": "keeping nothing is plain checkpoint (policy=None, Strategy('checkpoint'))",
}


def _spec_form() -> str:
    groups = ", ".join(repr(g) for g in _GROUPS)
    return (
        f"a policy spec is '+'-joined tokens, each a group ({groups}) or an aten operation "
        "named by its overload packet, as in torch.ops.aten.<name> ('addmm', "
        "'native_layer_norm', 'gelu', '_softmax'), e.g. 'matmul+gelu'"
    )


def _is_random(packet: Any) -> bool:
    return any(
        torch.Tag.nondeterministic_seeded in getattr(packet, name).tags
        for name in packet.overloads()
    )


def _aten_packet(token: str, spec: str) -> Any:
    what = repr(token) if token == spec else f"{token!r} in {spec!r}"
    if not token:
        raise InvalidArgumentError(f"policy {spec!r} has an empty token; {_spec_form()}")
    if token in _RESERVED:
        raise InvalidArgumentError(
            f"{what} is not a policy token: {_RESERVED[token]}; {_spec_form()}"
        )
    if "." in token or ":" in token:
        raise InvalidArgumentError(
            f"{what}: name an aten operation by its packet alone ('addmm' for "
            f"torch.ops.aten.addmm.default); {_spec_form()}"
        )
    try:
        packet = getattr(torch.ops.aten, token)
    except (AttributeError, RuntimeError):
        packet = None
    if not isinstance(packet, torch._ops.OpOverloadPacket):
        raise InvalidArgumentError(f"unknown checkpoint policy {what}; {_spec_form()}")
    if _is_random(packet) and not any(packet in g for g in _GROUPS.values()):
        raise InvalidArgumentError(
            f"{what} is a random operation: a policy keeping its output would skip its draws "
            "in the recompute, so the random operations after it would draw other numbers "
            "(other dropout masks); leave it out (recomputed, it replays the forward's draws)"
        )
    return packet


def parse_policy(spec: str) -> frozenset[Any]:
    """The aten operation packets a selective-recompute policy spec keeps the outputs of.

    A spec is ``"+"``-joined tokens; each is a group (``"matmul"``: matrix multiplies and
    convolutions; ``"attention"``: fused attention kernels) or an aten operation named by its
    overload packet (``"addmm"``, ``"native_layer_norm"``, ``"gelu"``, ``"_softmax"``,
    ``"mul"``): every call of that operation, all overloads, keeps its outputs. The presets of
    :data:`POLICY_PRESETS` are specs (``"matmul+attention"``); ``"matmul+gelu"`` keeps every
    matrix multiply and every GELU output. Group names take precedence over aten names (aten's
    ``matmul`` is composite and never reaches a policy). Random operations (dropout's
    ``native_dropout``, ``bernoulli``) are refused: a kept one would not draw again during the
    recompute, shifting the numbers of every random operation after it.
    """
    if not isinstance(spec, str):
        raise InvalidInputTypeError(
            f"a policy spec is a string such as 'matmul+gelu', got {type(spec).__name__}"
        )
    keep: set[Any] = set()
    for raw in spec.split("+"):
        token = raw.strip()
        keep |= _GROUPS[token] if token in _GROUPS else {_aten_packet(token, spec)}
    return frozenset(keep)


def policy_text(ops: Iterable[Any]) -> str:
    """The canonical spec of a keep-set of aten operation packets (or overloads): the groups it
    contains whole, in the order of :data:`POLICY_PRESETS` (``"matmul"``, ``"attention"``),
    then the names of the other operations, sorted; joined by ``"+"``. Two specs of one
    keep-set have one canonical text (``"gelu+mm+matmul"`` and ``"matmul+gelu"``:
    ``"matmul+gelu"``); each preset is its own canonical text."""
    keep = frozenset(getattr(op, "overloadpacket", op) for op in ops)
    if not keep:
        raise InvalidArgumentError(
            "an empty keep-set is plain checkpoint, not a selective policy: use policy=None "
            "(Strategy('checkpoint'))"
        )
    bad = [op for op in keep if not isinstance(op, torch._ops.OpOverloadPacket)]
    if bad or any(not op._qualified_op_name.startswith("aten::") for op in keep):
        raise InvalidInputTypeError(
            "a keep-set holds aten operation packets (torch.ops.aten.<name>), got "
            f"{sorted(map(str, keep))}"
        )
    rest, parts = set(keep), []
    for name, group in _GROUPS.items():
        if group and group <= rest:
            parts.append(name)
            rest -= group
    text = "+".join([*parts, *sorted(op.__name__ for op in rest)])
    parse_policy(text)  # the operations' names are tokens a spec accepts
    return text


@functools.lru_cache(maxsize=1024)
def canonical_policy(spec: str) -> str:
    """The canonical text (:func:`policy_text`) of a policy spec, checked by
    :func:`parse_policy`: ``canonical_policy("attention+matmul") == "matmul+attention"``."""
    return policy_text(parse_policy(spec))


def policy_context_fn(policy: Policy) -> Callable[[], tuple[Any, Any]]:
    """torch's ``context_fn`` for a checkpoint with this selective policy (a spec or a function
    ``op -> bool | CheckpointPolicy``)."""
    if isinstance(policy, str):
        # a set, not the frozenset: traced by torch.compile, a frozenset made in the graph and
        # alive at a graph break cannot be rebuilt by Dynamo ("frozenset not in co_names", seen
        # with torch 2.13 on Hugging Face layers wrapped by the `kernels` package)
        keep = set(parse_policy(policy))
        save, recompute = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE

        def spec_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
            return save if op.overloadpacket in keep else recompute  # runs per operation

        return functools.partial(create_selective_checkpoint_contexts, spec_policy)
    if not callable(policy):
        raise InvalidInputTypeError(
            f"policy must be a spec (a preset name {sorted(POLICY_PRESETS)}, or groups and aten "
            f"operation names joined by '+') or a function op -> bool, got "
            f"{type(policy).__name__}"
        )
    decide = policy

    def torch_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        verdict = decide(op)
        if isinstance(verdict, CheckpointPolicy):
            return verdict
        return CheckpointPolicy.MUST_SAVE if verdict else CheckpointPolicy.PREFER_RECOMPUTE

    return functools.partial(create_selective_checkpoint_contexts, torch_policy)


@dataclass(frozen=True)
class Selective:
    """The selective strategy with a policy the text form cannot carry: a function
    ``op -> bool`` (or ``-> torch.utils.checkpoint.CheckpointPolicy``) returning True for the
    aten operations whose outputs to keep, for ``revckpt.checkpoint(..., strategy=Selective(f))``.
    A spec string works too (``Selective("matmul")`` is ``strategy="selective:matmul"``)."""

    policy: Policy

    def __post_init__(self) -> None:
        policy_context_fn(self.policy)  # a spec that parses, or a callable
