"""The dependency arrows of docs/DESIGN.md, checked on the imports of every module of revckpt.

    cli ──> schedule ──> checkpoint, approx, layers, offload ──> engine ──> replay
                    layers ──> approx (bf16 recompute)

``replay`` (with its module-state part) and ``measure`` import nothing of revckpt but the
errors and the shared numbers; the strategies and the engine never import the planner, the
in-place front door, the report or the command line; nothing imports ``cli`` (but
``python -m revckpt``); ``approx`` knows nothing of ``layers``; the engine knows none of the
strategies that use it.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

import revckpt

ROOT = pathlib.Path(revckpt.__file__).parent

# Top-level parts of revckpt: a subpackage or module name (``replay`` includes its
# ``_module_state``, ``_devices``, ``_autocast`` and ``_running_stats`` parts, ``offload``
# its ``_host_copies``, ``checkpoint`` its ``policy``).
PART_OF = {
    "_module_state": "replay",
    "_devices": "replay",
    "_autocast": "replay",
    "_running_stats": "replay",
    "_host_copies": "offload",
    "policy": "checkpoint",
    "_call_options": "checkpoint",
}
LEAVES = {"errors", "_numbers"}
STRATEGIES = {"checkpoint", "approx", "layers", "offload", "engine"}
PLANNER_SIDE = {"schedule", "inplace", "report", "cli"}
ENGINE_USERS = {"checkpoint", "approx", "layers", "offload"}


def _module_name(path: pathlib.Path) -> str:
    parts = ["revckpt", *path.relative_to(ROOT).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: pathlib.Path) -> set[str]:
    """The revckpt modules ``path`` imports (relative imports resolved, function-level ones
    included; ``from . import x`` counts as ``package.x``)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "revckpt"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            if target.split(".")[0] != "revckpt":
                continue
            found.add(target)
            if node.module is None:
                found |= {f"{target}.{a.name}" for a in node.names}
    return found


def _part(module: str) -> str:
    """``revckpt.approx.recompute`` -> ``approx``; ``revckpt._module_state`` -> ``replay``."""
    head = module.split(".")[1] if "." in module else ""
    return PART_OF.get(head, head)


MODULES = {
    _module_name(p): {_part(t) for t in _imports(p)} - {""} for p in sorted(ROOT.rglob("*.py"))
}


def test_the_walk_sees_the_package():
    assert {"revckpt.replay", "revckpt.engine.node", "revckpt.layers.sequential"} <= set(MODULES)
    assert "engine" in MODULES["revckpt.checkpoint"]
    assert "approx" in MODULES["revckpt.layers.sequential"]


@pytest.mark.parametrize("part", ["replay", "measure"])
def test_replay_and_measure_import_nothing_of_revckpt_but_errors_and_numbers(part):
    for module, parts in MODULES.items():
        if _part(module) == part:
            assert parts <= LEAVES | {part}, f"{module} imports {sorted(parts - LEAVES - {part})}"


def test_strategies_never_import_the_planner_report_or_cli():
    for module, parts in MODULES.items():
        if _part(module) in STRATEGIES:
            assert not parts & PLANNER_SIDE, f"{module} imports {sorted(parts & PLANNER_SIDE)}"


def test_nothing_imports_cli():
    for module, parts in MODULES.items():
        if _part(module) != "cli" and module != "revckpt.__main__":
            assert "cli" not in parts, f"{module} imports cli"


def test_approx_knows_nothing_of_layers():
    for module, parts in MODULES.items():
        if _part(module) == "approx":
            assert "layers" not in parts, f"{module} imports layers"


def test_the_engine_imports_none_of_the_strategies_that_use_it():
    for module, parts in MODULES.items():
        if _part(module) == "engine":
            assert not parts & ENGINE_USERS, f"{module} imports {sorted(parts & ENGINE_USERS)}"
