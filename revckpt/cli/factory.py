"""``revckpt plan``'s ``MODULE:FACTORY``: the module imported (by name or from a .py file) and
the factory found in it."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

from .usage import _UsageError


def _load_factory(spec: str) -> Any:
    module_name, colon, attr = spec.rpartition(":")
    problem = _spec_problem(module_name, colon, attr)
    if problem:
        raise _UsageError(
            f"{spec!r} is not MODULE:FACTORY ({problem}); write e.g. examples.user_model:build "
            "or ./model.py:build (a function returning (model, example) or (blocks, "
            "example_input))"
        )
    module = _import(module_name)
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise _UsageError(
            f"module {module_name!r} has no function {attr!r}; define {attr}() returning "
            "(model, example[, loss_fn]) or (blocks, example_input[, kwargs])"
        )
    return factory


def _spec_problem(module_name: str, colon: str, attr: str) -> str | None:
    if not colon:
        return "there is no ':' between the module and the function"
    if not module_name:
        return "the module before ':' is missing"
    if not attr:
        return "the function after ':' is missing"
    if not attr.isidentifier():
        return f"{attr!r} after ':' is not a function name"
    return None


def _import(name: str) -> Any:
    """A module by dotted name (from the current directory or PYTHONPATH) or a .py file."""
    if name.endswith(".py") or "/" in name or os.sep in name:
        return _import_file(Path(name))
    if not all(part.isidentifier() for part in name.split(".")):
        raise _UsageError(
            f"{name!r} is neither a module name nor a .py file; give a dotted module name "
            "(examples.user_model) or the path of a .py file (./model.py)"
        )
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # modules of the directory you run it from
    try:
        return importlib.import_module(name)
    except (ImportError, SyntaxError) as err:
        raise _UsageError(
            f"cannot import module {name!r} ({type(err).__name__}: {err}); run from the "
            "directory that contains it or put it on PYTHONPATH"
        ) from err


def _import_file(path: Path) -> Any:
    spec = importlib.util.spec_from_file_location(path.stem, path) if path.is_file() else None
    if spec is None or spec.loader is None:
        raise _UsageError(
            f"no Python file {str(path)!r}; give the path of the .py file that defines the "
            "factory, e.g. ./model.py:build"
        )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    sys.path.insert(0, str(path.resolve().parent))  # its own imports, as when run as a script
    try:
        spec.loader.exec_module(module)
    except (ImportError, SyntaxError) as err:
        raise _UsageError(f"cannot import {str(path)!r} ({type(err).__name__}: {err})") from err
    return module
