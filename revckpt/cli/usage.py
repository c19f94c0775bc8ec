"""Bad command-line input: the parser that reports it on one line, and the argument types."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any, NoReturn

EXIT_USAGE = 2

_UNIT_WORDS = ("B", "KB", "MB", "GB", "TB", "KiB", "MiB", "GiB", "TiB", "%")


class _UsageError(Exception):
    """Bad command-line input: reported on one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        if message.startswith("unrecognized arguments") and any(
            unit in message.split(":", 1)[1].split() for unit in _UNIT_WORDS
        ):
            message += "; quote values that contain spaces, e.g. --budget '2 GiB'"
        raise _UsageError(f"{message} (see '{self.prog} --help')")


def _positive_int(text: str) -> int:
    """An argparse type: an integer of at least 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number of at least 1, got {text!r}")
    return value


def _add_command(
    sub: Any, name: str, run: Callable[[argparse.Namespace], int], *, summary: str, description: str
) -> argparse.ArgumentParser:
    """The subcommand ``name`` of ``sub`` (``summary`` in the command list, ``description`` in
    its ``--help``), run by ``run(args)``; its parser, for its options."""
    parser = sub.add_parser(name, help=summary, description=description)
    parser.set_defaults(run=run)
    return parser
