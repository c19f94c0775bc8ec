import importlib
import inspect

import revckpt
from revckpt import RevckptError


def test_all_is_complete_and_importable():
    for name in revckpt.__all__:
        assert hasattr(revckpt, name), name


def test_subpackages_live_under_revckpt():
    for sub in ("layers", "approx", "measure", "models"):
        mod = importlib.import_module(f"revckpt.{sub}")
        assert mod.__name__ == f"revckpt.{sub}"
    # the install ships revckpt's packages only: no top-level `layers` or `approx`
    import pathlib

    import setuptools

    root = pathlib.Path(revckpt.__file__).parents[1]
    shipped = setuptools.find_packages(where=str(root), include=["revckpt*"])
    assert "revckpt.layers" in shipped and "revckpt.approx" in shipped
    assert all(name == "revckpt" or name.startswith("revckpt.") for name in shipped)


def test_every_public_error_derives_from_revckpt_error():
    errors = [
        obj
        for _, obj in inspect.getmembers(revckpt.errors, inspect.isclass)
        if obj.__module__ == "revckpt.errors"
    ]
    warnings = [e for e in errors if issubclass(e, Warning)]
    errors = [e for e in errors if e not in warnings]
    assert len(errors) >= 5
    assert all(issubclass(e, RevckptError) for e in errors)
    assert all(issubclass(w, UserWarning) for w in warnings)  # PlanWarning


def test_replay_and_measure_import_nothing_else_of_revckpt():
    import ast
    import pathlib

    root = pathlib.Path(revckpt.__file__).parent
    # replay and its parts: module state, devices and generators, autocast, running statistics
    parts = ("_module_state", "_devices", "_autocast", "_running_stats")
    replay = [root / "replay.py", *(root / f"{p}.py" for p in parts)]
    for path in [*replay, *(root / "measure").glob("*.py")]:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level > 0:
                target = node.module or ""
                siblings = (
                    "errors",
                    "_numbers",
                    "_module_state",
                    "_devices",
                    "_autocast",
                    "_running_stats",
                    *(p.stem for p in (root / "measure").glob("*.py")),  # its own modules
                )
                assert target in siblings or target.endswith("errors"), (
                    f"{path.name} imports .{target}"
                )
