"""What one :func:`revckpt.checkpoint` or :func:`revckpt.checkpoint_sequential` call was asked
for: its ``strategy=`` resolved to a kind and its options, the options checked against the
kind, and the deprecated spellings (``policy=``, ``approx=``) read with their warnings."""

from __future__ import annotations

import functools
from typing import Any, Literal

import torch

from ._deprecation import warn_deprecated
from .approx.recompute import Approx, keep_of
from .errors import InvalidArgumentError, InvalidInputTypeError
from .policy import Policy, Selective
from .strategy import Strategy, argument_of, kind_of

__all__ = [
    "DeterminismCheck",
    "check_applies",
    "check_options",
    "pop_torch_options",
    "resolve",
    "sequential_strategy_of",
    "strategy_of",
]

DeterminismCheck = Literal["metadata", "values", "none"]
_DETERMINISM_CHECKS = ("metadata", "values", "none")

_STRATEGY_FORMS = (
    "None or 'checkpoint' (exact), 'selective:<policy spec>', 'approx:<codec>', 'offload', "
    "'compress:<codec>' (or the revckpt.Strategy of one), revckpt.approx.Approx(...), "
    "revckpt.offload.Offload(...) or revckpt.policy.Selective(<function op -> bool>)"
)


@functools.lru_cache(maxsize=256)
def _resolve_text(text: str) -> tuple[str, Any]:
    """Cached per text (a checkpoint call per block and step parses the same few): every
    options object it returns is immutable (``Approx`` and ``Offload`` are frozen)."""
    return _resolve_typed(Strategy.parse(text))


def _resolve_typed(s: Strategy) -> tuple[str, Any]:
    if s.kind == "checkpoint":
        return "checkpoint", None
    if s.kind == "selective":
        return "selective", s.arg
    if s.kind == "approx":
        return "approx", Approx(store=s.arg)
    if s.kind == "offload":
        from .offload import Offload

        return "offload", Offload()
    if s.kind == "compress":
        return "compress", s.arg
    why = (
        "keeps everything autograd saves: call the block directly"
        if s.kind == "store"
        else "rebuilds inputs from outputs: build the stack from revckpt.layers "
        "(ReversibleSequential) or let revckpt.convert / revckpt.fit swap it in"
    )
    raise InvalidArgumentError(f"strategy {str(s)!r} is no checkpoint: it {why}")


def resolve(strategy: Any) -> tuple[str, Any]:
    """``(kind, options)`` of a ``strategy=`` value: options are ``None`` (checkpoint), the
    policy (selective), an :class:`Approx`, an ``Offload`` or the codec name (compress)."""
    if strategy is None:
        return "checkpoint", None
    if isinstance(strategy, str):
        if torch.compiler.is_compiling():
            if kind_of(strategy) in ("checkpoint", "selective"):
                # traced: parsing a Strategy (its policy's canonical text) would break the graph
                return kind_of(strategy), argument_of(strategy)
            return _resolve_typed(Strategy.parse(strategy))  # (Dynamo warns at a cache)
        return _resolve_text(strategy)
    if isinstance(strategy, Strategy):
        return _resolve_typed(strategy)
    if isinstance(strategy, Approx):
        return "approx", strategy
    if isinstance(strategy, Selective):
        return "selective", strategy.policy
    from .offload import Offload

    if isinstance(strategy, Offload):
        return "offload", strategy
    raise InvalidInputTypeError(f"strategy= takes {_STRATEGY_FORMS}; got {type(strategy).__name__}")


def check_applies(kind: str, determinism_check: str, preserve_rng_state: bool) -> None:
    """Options that have no meaning for ``kind`` raise, naming what applies."""
    if kind in ("checkpoint", "selective"):
        return
    if determinism_check == "values":
        why = (
            "keeps the saved tensors compressed and recomputes nothing"
            if kind == "compress"
            else "re-runs the block from a compressed input, so its values differ from the "
            "forward by design"
            if kind == "approx"
            else "re-runs the block as one recompute node, which fingerprints no values"
        )
        raise InvalidArgumentError(
            f"determinism_check='values' does not apply to the {kind} strategy (it {why}); "
            "it applies to strategy=None / 'checkpoint' and 'selective:<policy>': use "
            "determinism_check='metadata' (the default) or 'none' here"
        )
    if kind == "compress" and not preserve_rng_state:
        raise InvalidArgumentError(
            "preserve_rng_state=False does not apply to the compress strategy (it runs the "
            "block once and recomputes nothing, so no random numbers are drawn again); drop "
            "it, or choose a recomputing strategy ('checkpoint', 'approx:<codec>', 'offload')"
        )


def check_options(determinism_check: str, preserve_rng_state: bool) -> None:
    if determinism_check not in _DETERMINISM_CHECKS:
        raise InvalidArgumentError(
            f"determinism_check={determinism_check!r} is not an option; use 'metadata' (compare "
            "shapes and dtypes of recomputed tensors), 'values' (also compare their values) or "
            "'none'"
        )
    if determinism_check == "values" and not preserve_rng_state:
        raise InvalidArgumentError(
            "determinism_check='values' with preserve_rng_state=False flags every block that "
            "draws random numbers (its recompute draws new ones); keep preserve_rng_state=True "
            "or use determinism_check='metadata'"
        )


# torch.utils.checkpoint's own keywords, which a call swapped to revckpt may still pass: read
# here (what revckpt does anyway is accepted), never handed to the block
_TORCH_OPTIONS = {
    "use_reentrant": (False, "revckpt recomputes non-reentrantly (use_reentrant=False)"),
    "early_stop": (True, "revckpt's recompute stops at the last tensor backward needs"),
    "debug": (False, "for a recompute that differs, pass determinism_check='values'"),
}


def pop_torch_options(kwargs: dict[str, Any], what: str) -> None:
    """Take ``torch.utils.checkpoint``'s keywords out of ``kwargs`` (they would reach the
    block, which does not take them, or silently mean nothing): the value revckpt follows is
    accepted, another or ``context_fn`` raises, saying what to use."""
    for name, (follows, why) in _TORCH_OPTIONS.items():
        if name in kwargs:
            value = kwargs.pop(name)
            if value is not follows:
                raise InvalidArgumentError(
                    f"{what}({name}={value!r}): torch.utils.checkpoint's option; {why}: pass "
                    f"{name}={follows!r} or leave it out"
                )
    if "context_fn" in kwargs:
        kwargs.pop("context_fn")
        raise InvalidArgumentError(
            f"{what}(context_fn=...): torch.utils.checkpoint's option; choose what to keep "
            "with strategy='selective:<policy>' (or revckpt.policy.Selective(<function op -> "
            "bool>)) instead"
        )


def strategy_of(strategy: Any, policy: Policy | None) -> tuple[str, Any]:
    """``(kind, options)`` of :func:`checkpoint`'s ``strategy``, or of the deprecated
    ``policy=``."""
    if policy is None:
        return resolve(strategy)
    warn_deprecated(
        "revckpt.checkpoint(fn, *args, policy=p)",
        "revckpt.checkpoint(fn, *args, strategy='selective:p') (a function p: "
        "strategy=revckpt.policy.Selective(p))",
        depth=2,
    )
    if strategy is not None:
        raise InvalidArgumentError(
            "checkpoint got both strategy= and policy=; pass the policy in the strategy: "
            "strategy='selective:<policy>' or strategy=revckpt.policy.Selective(<function>)"
        )
    return "selective", policy


def sequential_strategy_of(
    strategy: Any, policy: Policy | None, approx: Approx | None, determinism_check: str
) -> tuple[str, Any]:
    """``(kind, options)`` of :func:`checkpoint_sequential`'s ``strategy``, or of the
    deprecated ``policy=`` / ``approx=``."""
    if policy is not None:
        warn_deprecated(
            "revckpt.checkpoint_sequential(..., policy=p)",
            "revckpt.checkpoint_sequential(..., strategy='selective:p') (a function p: "
            "strategy=revckpt.policy.Selective(p))",
            depth=2,
        )
    if approx is not None:
        warn_deprecated(
            "revckpt.checkpoint_sequential(..., approx=revckpt.approx.Approx(...))",
            "revckpt.checkpoint_sequential(..., strategy=revckpt.approx.Approx(...))",
            depth=2,
        )
    if (policy is not None or approx is not None) and strategy is not None:
        raise InvalidArgumentError(
            "checkpoint_sequential got strategy= and a deprecated policy= or approx=; pass "
            "only strategy= ('selective:<policy>', or the revckpt.approx.Approx itself)"
        )
    if approx is not None:
        if policy is not None or determinism_check == "values":
            raise InvalidArgumentError(
                "approx= recomputes from a compressed input, so its values differ from the "
                "forward by design: drop policy= and determinism_check='values' when using it"
            )
        if not isinstance(approx, Approx):
            keep_of(approx)  # raises, naming what approx= takes
        return "approx", approx
    if policy is not None:
        return "selective", policy
    return resolve(strategy)
