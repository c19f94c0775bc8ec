"""The strategies, as typed values: what :func:`revckpt.fit`, :func:`revckpt.convert`,
:func:`revckpt.schedule.solve` and a :class:`~revckpt.schedule.Plan` speak of.

A :class:`Strategy` is a kind and, for two kinds, an argument: ``Strategy("checkpoint")``,
``Strategy("selective", "matmul+attention")``, ``Strategy("approx", "e4m3")``. Its text form
(``str(s)``: ``"checkpoint"``, ``"selective:matmul+attention"``, ``"approx:e4m3"``) is what
JSON plans and the command line use; :meth:`Strategy.parse` is the one place that reads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .errors import InvalidArgumentError, InvalidInputTypeError

__all__ = ["Strategy", "StrategyLike", "parse_strategy"]


@dataclass(frozen=True)
class Strategy:
    """One strategy: ``kind`` in :attr:`KINDS`; ``arg``: the selective policy (a name of
    ``revckpt.POLICY_PRESETS``) or the approx codec (``"bf16"``, ``"e4m3"``, ``"e5m2"``)."""

    kind: str
    arg: str | None = None

    KINDS: ClassVar[tuple[str, ...]] = (
        "store",
        "checkpoint",
        "selective",
        "approx",
        "offload",
        "reversible",
    )
    _WITH_ARG: ClassVar[frozenset[str]] = frozenset({"selective", "approx"})

    def __post_init__(self) -> None:
        if self.kind not in self.KINDS:
            raise InvalidArgumentError(
                f"unknown strategy {self.kind!r}; use one of {list(self.KINDS)}"
                " ('selective:<policy>', 'approx:<codec>')"
            )
        if (self.arg is not None) != (self.kind in self._WITH_ARG):
            form = f"{self.kind}:<{'policy' if self.kind == 'selective' else 'codec'}>"
            raise InvalidArgumentError(
                f"strategy {self.kind!r} "
                + (f"needs an argument: {form}" if self.arg is None else "takes no argument")
            )
        if self.kind in self._WITH_ARG:
            self._check_arg()

    def _check_arg(self) -> None:
        from .approx.formats import FORMATS
        from .checkpoint import POLICY_PRESETS

        known = POLICY_PRESETS if self.kind == "selective" else FORMATS
        if self.arg not in known:
            what = "policy" if self.kind == "selective" else "codec"
            raise InvalidArgumentError(
                f"unknown {what} {self.arg!r} for {self.kind}; use one of {sorted(known)}"
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
        kind, sep, arg = value.strip().partition(":")
        return cls(kind, arg if sep else None)


StrategyLike = Strategy | str


def parse_strategy(value: StrategyLike) -> Strategy:
    """:meth:`Strategy.parse`."""
    return Strategy.parse(value)
