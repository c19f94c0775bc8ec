"""The strategies, as typed values: what :func:`revckpt.fit`, :func:`revckpt.convert`,
:func:`revckpt.schedule.solve` and a :class:`~revckpt.schedule.Plan` speak of.

A :class:`Strategy` is a kind and, for three kinds, an argument: ``Strategy("checkpoint")``,
``Strategy("selective", "matmul+attention")``, ``Strategy("approx", "e4m3")``. Its text form
(``str(s)``: ``"checkpoint"``, ``"selective:matmul+attention"``, ``"approx:e4m3"``) is what
JSON plans and the command line use; :meth:`Strategy.parse` is the one place that reads it.
:func:`kind_of` and :func:`argument_of` read the two parts of a text form (cached: the
scheduler asks in its loops), checking its form but not whether the argument is a known policy
or codec.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar

import torch

from .errors import InvalidArgumentError, InvalidInputTypeError

__all__ = ["Strategy", "StrategyLike", "argument_of", "kind_of", "parse_strategy"]


@dataclass(frozen=True)
class Strategy:
    """One strategy: ``kind`` in :attr:`KINDS`; ``arg``: the selective policy (a spec:
    a name of ``revckpt.POLICY_PRESETS``, or groups and aten op names joined by ``"+"``, see
    :func:`revckpt.checkpoint.parse_policy`; kept in its canonical text, so two spellings of
    one keep-set are one value) or the codec of approx (the block input kept compressed,
    the forward re-run) and compress (every saved tensor kept compressed, no recompute:
    :func:`revckpt.approx.compress_saved`): ``"bf16"``, ``"e4m3"``, ``"e5m2"``."""

    kind: str
    arg: str | None = None

    KINDS: ClassVar[tuple[str, ...]] = (
        "store",
        "checkpoint",
        "selective",
        "approx",
        "offload",
        "reversible",
        "compress",
    )
    _WITH_ARG: ClassVar[frozenset[str]] = frozenset({"selective", "approx", "compress"})

    def __post_init__(self) -> None:
        _check_form(self.kind, self.arg)
        if self.kind in self._WITH_ARG:
            self._check_arg()

    def _check_arg(self) -> None:
        if self.kind == "selective":
            from .checkpoint import canonical_policy

            # one value per keep-set: "attention+matmul" is stored as "matmul+attention"
            object.__setattr__(self, "arg", canonical_policy(self.arg))  # type: ignore[arg-type]
            return
        from .approx.formats import FORMATS

        if self.arg not in FORMATS:
            raise InvalidArgumentError(
                f"unknown codec {self.arg!r} for {self.kind}; use one of {sorted(FORMATS)}"
            )

    def __str__(self) -> str:
        return self.kind if self.arg is None else f"{self.kind}:{self.arg}"

    @classmethod
    def parse(cls, value: StrategyLike) -> Strategy:
        """A strategy from its text form (or itself)."""
        if isinstance(value, Strategy):
            return value
        if not isinstance(value, str):
            raise InvalidInputTypeError(
                f"a strategy is a revckpt.Strategy or its text form ('checkpoint', "
                f"'approx:e4m3'), got {type(value).__name__}"
            )
        return cls(*_parts(value.strip()))


StrategyLike = Strategy | str


def parse_strategy(value: StrategyLike) -> Strategy:
    """:meth:`Strategy.parse`."""
    return Strategy.parse(value)


def _parts(text: str) -> tuple[str, str | None]:
    """The kind and argument of a text form, unchecked."""
    kind, sep, arg = text.partition(":")
    return kind, (arg if sep else None)


def _check_form(kind: str, arg: str | None) -> None:
    """A known kind, with an argument where (and only where) it takes one."""
    if kind not in Strategy.KINDS:
        raise InvalidArgumentError(
            f"unknown strategy {kind!r}; use one of {list(Strategy.KINDS)}"
            " ('selective:<policy>', 'approx:<codec>', 'compress:<codec>')"
        )
    if (arg is not None) != (kind in Strategy._WITH_ARG):
        form = f"{kind}:<{'policy' if kind == 'selective' else 'codec'}>"
        raise InvalidArgumentError(
            f"strategy {kind!r} "
            + (f"needs an argument: {form}" if arg is None else "takes no argument")
        )


def _checked_parts(text: str) -> tuple[str, str | None]:
    if not isinstance(text, str):
        raise InvalidInputTypeError(
            f"a strategy's text form is a string ('checkpoint', 'approx:e4m3'), got "
            f"{type(text).__name__}"
        )
    kind, arg = _parts(text)
    _check_form(kind, arg)
    return kind, arg


# cached: the scheduler's dynamic programme asks in its loops (a few distinct texts); not
# under torch.compile, where Dynamo skips a cache and warns at every traced call
@functools.lru_cache(maxsize=1024)
def _cached_parts(text: str) -> tuple[str, str | None]:
    return _checked_parts(text)


def _parts_of(text: str) -> tuple[str, str | None]:
    if torch.compiler.is_compiling():
        return _checked_parts(text)
    return _cached_parts(text)


def kind_of(text: str) -> str:
    """The kind of a strategy's text form: ``"approx"`` for ``"approx:e4m3"``, ``"checkpoint"``
    for ``"checkpoint"``. Raises :class:`~revckpt.InvalidArgumentError` unless ``text`` is a
    known kind with an argument exactly where the kind takes one (no surrounding spaces); the
    argument's value is not checked (the scheduler checks it against what was profiled,
    :meth:`Strategy.parse` against the known policies and codecs)."""
    return _parts_of(text)[0]


def argument_of(text: str) -> str | None:
    """The argument of a strategy's text form: the codec of ``"approx:e4m3"``, the policy of
    ``"selective:matmul"``, ``None`` for the kinds without one; checked as :func:`kind_of`."""
    return _parts_of(text)[1]
