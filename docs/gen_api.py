"""Generate docs/api.md from the docstrings of revckpt's public API.

Run ``python docs/gen_api.py`` after changing a public signature or docstring;
``tests/test_docs.py`` fails when docs/api.md is out of date.

Sphinx cross-reference roles (``:func:`revckpt.fit```, ``:class:`~revckpt.Plan```) become
Markdown code spans (``~`` keeps the last component, as Sphinx does); ``#:`` comments before
a module constant or a class attribute (a dataclass field) document the name they precede.
"""

from __future__ import annotations

import ast
import functools
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
    "revckpt.policy",
    "revckpt.schedule",
    "revckpt.report",
    "revckpt.measure",
    "revckpt.testing",
    "revckpt.replay",
    "revckpt.models",
)

OUT = Path(__file__).resolve().parent / "api.md"

#: The public names a user needs for the three main jobs, in the order the README gives them.
ESSENTIAL = {
    "fit a model's training step to a memory budget": ("revckpt.fit", "revckpt.restore"),
    "checkpoint a model or a function": (
        "revckpt.convert",
        "revckpt.checkpoint",
        "revckpt.checkpoint_sequential",
    ),
    "make a stack reversible": (
        "revckpt.layers.ReversibleSequential",
        "revckpt.layers.convert_to_reversible",
    ),
}

# :role:`target`, :role:`~a.b.c` (shown as c), :role:`title <target>` (shown as title)
_ROLE = re.compile(r":(?:py:)?(?:func|class|mod|data|attr|meth|exc|obj|const):`([^`]+)`")


def _role(match: re.Match[str]) -> str:
    target = match.group(1).strip()
    titled = re.fullmatch(r"(.+?)\s*<([^<>]+)>", target)
    if titled:
        return f"`{titled.group(1)}`"
    target = target.lstrip("!")
    if target.startswith("~"):
        target = target[1:].rsplit(".", 1)[-1]
    return f"`{target}`"


def _markdown(text: str) -> str:
    return _ROLE.sub(_role, text)


@functools.cache
def _attribute_docs(path: str) -> dict[str, str]:
    """``#:`` comments of a source file: ``{"NAME": doc, "Class.field": doc}``.

    The comment lines right above an assignment (or one ``#:`` at the end of its line)
    document the names it assigns, at module level and in class bodies (nested classes by
    their qualified name).
    """
    source = Path(path).read_text()
    lines = source.splitlines()
    docs: dict[str, str] = {}

    def comment_above(lineno: int) -> list[str]:
        found: list[str] = []
        i = lineno - 2  # the line above, 0-based
        while i >= 0 and lines[i].strip().startswith("#:"):
            found.insert(0, lines[i].strip()[2:].strip())
            i -= 1
        return found

    def visit(body: list[ast.stmt], prefix: str) -> None:
        for node in body:
            if isinstance(node, ast.ClassDef):
                visit(node.body, f"{prefix}{node.name}.")
                continue
            if isinstance(node, ast.AnnAssign):
                targets = [node.target]
            elif isinstance(node, ast.Assign):
                targets = node.targets
            else:
                continue
            text = comment_above(node.lineno)
            trailing = lines[node.end_lineno - 1].split("#:", 1)
            if not text and len(trailing) == 2 and node.lineno == node.end_lineno:
                text = [trailing[1].strip()]
            if not text:
                continue
            for target in targets:
                if isinstance(target, ast.Name):
                    docs[prefix + target.id] = " ".join(text)

    visit(ast.parse(source).body, "")
    return docs


def _defined_in(name: str, obj: object) -> list[str]:
    """Source files of the loaded revckpt modules that bind ``name`` to ``obj``."""
    files = []
    for module in list(sys.modules.values()):
        if not getattr(module, "__name__", "").startswith("revckpt"):
            continue
        if getattr(module, name, None) is obj and getattr(module, "__file__", None):
            files.append(module.__file__)
    return files


def _value_doc(name: str, obj: object) -> str | None:
    for path in _defined_in(name, obj):
        doc = _attribute_docs(path).get(name)
        if doc:
            return _markdown(doc)
    return None


def _field_docs(cls: type) -> list[tuple[str, str]]:
    """``(field, doc)`` of the class attributes documented by a ``#:`` comment."""
    try:
        path = inspect.getsourcefile(cls)
    except TypeError:
        return []
    if path is None:
        return []
    prefix = cls.__qualname__ + "."
    found = []
    for key, doc in _attribute_docs(path).items():
        if key.startswith(prefix) and "." not in key[len(prefix) :]:
            found.append((key[len(prefix) :], _markdown(doc)))
    return found


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
    return _markdown(doc.strip())


def _entry(module: str, name: str, obj: object) -> list[str]:
    if inspect.ismodule(obj):
        return []  # documented under its own heading
    kind = "class" if inspect.isclass(obj) else ("function" if callable(obj) else "value")
    lines = [f"### `{module}.{name}`", ""]
    if kind == "value":
        lines += [f"A constant of type `{type(obj).__name__}`.", ""]
        doc = _value_doc(name, obj)
        if doc:
            lines += [doc, ""]
        return lines
    lines += ["```python", f"{kind} {name}{_signature(obj)}", "```", "", _doc(obj), ""]
    if inspect.isclass(obj):
        annotations = inspect.get_annotations(obj)
        for field, doc in _field_docs(obj):
            hint = annotations.get(field)
            typed = f": {hint if isinstance(hint, str) else inspect.formatannotation(hint)}"
            lines += [f"- `{field}{typed if hint is not None else ''}`: {doc}"]
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


def _essentials() -> list[str]:
    lines = []
    for job, names in ESSENTIAL.items():
        for name in names:
            module, _, public = name.rpartition(".")
            if public not in getattr(importlib.import_module(module), "__all__", ()):
                raise SystemExit(f"ESSENTIAL names {name}, which {module}.__all__ does not export")
        lines.append(f"- {job}: " + ", ".join(f"`{name}`" for name in names))
    return lines


def render() -> str:
    exported = [
        getattr(module, public)
        for module in map(importlib.import_module, MODULES)
        for public in getattr(module, "__all__", ())
    ]
    distinct = {id(obj) for obj in exported if not inspect.ismodule(obj)}
    essential = sum(len(names) for names in ESSENTIAL.values())
    lines = [
        "# API reference",
        "",
        "Generated from the docstrings by `python docs/gen_api.py`; do not edit by hand.",
        "",
        f"{len(exported)} public names in the `__all__` of {len(MODULES)} modules ({len(distinct)}",
        "functions, classes and constants; the rest are subpackages and names exported twice,",
        f"e.g. by `revckpt` and `revckpt.measure`). The three main jobs need {essential} of them:",
        "",
        *_essentials(),
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
