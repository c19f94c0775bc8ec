"""``python -m revckpt``: the same as the ``revckpt`` command."""

from .cli import main

raise SystemExit(main())
