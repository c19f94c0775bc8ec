"""The documentation is in step with the code: the API reference is regenerated from the
docstrings, and every guide the README and the quickstart name exists."""

import importlib.util
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_api_reference_is_up_to_date():
    spec = importlib.util.spec_from_file_location("gen_api", ROOT / "docs" / "gen_api.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert (ROOT / "docs" / "api.md").read_text() == module.render(), (
        "docs/api.md is out of date: run python docs/gen_api.py"
    )


def test_named_docs_exist():
    for source in ("README.md", "docs/quickstart.md", "docs/troubleshooting.md"):
        text = (ROOT / source).read_text()
        for name in set(re.findall(r"`(docs/[a-z_]+\.md)`", text)):
            assert (ROOT / name).exists(), f"{source} names {name}, which does not exist"
