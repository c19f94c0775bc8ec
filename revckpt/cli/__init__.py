"""The ``revckpt`` command: ``demo``, ``plan`` and ``bench``.

``revckpt demo`` measures every strategy on a built-in GPT-like model and writes a report;
``revckpt plan MODULE:FACTORY --budget 2GiB`` plans for your own model (a whole model with
:func:`revckpt.fit` when the factory returns ``(model, example[, loss_fn])``, a chain of blocks
with :func:`revckpt.schedule.profile` and ``solve`` when it returns ``(blocks, example_input[,
kwargs])``); ``revckpt bench`` runs the benchmark scripts of a source checkout. Bad input ends
with one line on stderr that says what to do, and exit status 2.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from ..errors import RevckptError
from .bench import _add_bench
from .demo import _add_demo
from .plan import _add_plan
from .terminal import _OPEN_LINE
from .usage import EXIT_USAGE, _Parser, _UsageError

__all__ = ["main"]


def _parser() -> _Parser:
    parser = _Parser(
        prog="revckpt",
        description="Train deeper and wider models in the same memory, and see what it costs.",
    )
    from .. import __version__

    parser.add_argument("--version", action="version", version=f"revckpt {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    _add_demo(sub)
    _add_plan(sub)
    _add_bench(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``revckpt`` command; returns the exit status."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
        if getattr(args, "run", None) is None:
            parser.print_help()
            return EXIT_USAGE
        return int(args.run(args))
    except (_UsageError, RevckptError) as err:
        if _OPEN_LINE[0]:
            sys.stderr.write("\n")
            _OPEN_LINE[0] = False
        print(f"revckpt: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("revckpt: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
