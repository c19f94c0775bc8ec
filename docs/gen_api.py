"""Generate docs/api.md from the docstrings of revckpt's public API.

Run ``python docs/gen_api.py`` after changing a public signature or docstring;
``tests/test_docs.py`` fails when docs/api.md is out of date.
"""

from __future__ import annotations

import importlib
import inspect
import re
import sys
from pathlib import Path

MODULES = (
    "revckpt",
    "revckpt.layers",
    "revckpt.approx",
    "revckpt.offload",
    "revckpt.schedule",
    "revckpt.report",
    "revckpt.measure",
    "revckpt.testing",
    "revckpt.replay",
    "revckpt.models",
)

OUT = Path(__file__).resolve().parent / "api.md"


def _signature(obj: object) -> str:
    try:
        sig = str(inspect.signature(obj))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return ""
    # annotations are strings (from __future__ import annotations): unquote them, keep the
    # quotes of string defaults
    return re.sub(r"(: |-> )'([^']*)'", r"\1\2", sig)


def _doc(obj: object) -> str:
    doc = inspect.getdoc(obj) or "(no docstring)"
    return doc.strip()


def _entry(module: str, name: str, obj: object) -> list[str]:
    if inspect.ismodule(obj):
        return []  # documented under its own heading
    kind = "class" if inspect.isclass(obj) else ("function" if callable(obj) else "value")
    lines = [f"### `{module}.{name}`", ""]
    if kind == "value":
        lines += [f"A constant of type `{type(obj).__name__}`.", ""]
        return lines
    lines += ["```python", f"{kind} {name}{_signature(obj)}", "```", "", _doc(obj), ""]
    if inspect.isclass(obj):
        for attr, member in inspect.getmembers(obj):
            if attr.startswith("_") or attr not in obj.__dict__:
                continue
            if inspect.isfunction(member) or isinstance(obj.__dict__[attr], classmethod):
                first = _doc(member).split("\n\n")[0]
                lines += [f"- `{attr}{_signature(member)}`: {first}"]
            elif isinstance(obj.__dict__[attr], property):
                first = _doc(obj.__dict__[attr]).split("\n\n")[0]
                lines += [f"- `{attr}` (property): {first}"]
        lines.append("")
    return lines


def render() -> str:
    lines = [
        "# API reference",
        "",
        "Generated from the docstrings by `python docs/gen_api.py`; do not edit by hand.",
        "",
    ]
    for name in MODULES:
        module = importlib.import_module(name)
        lines += [f"## `{name}`", "", _doc(module), ""]
        for public in getattr(module, "__all__", []):
            lines += _entry(name, public, getattr(module, public))
    return "\n".join(lines).rstrip() + "\n"


def main() -> int:
    OUT.write_text(render())
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
