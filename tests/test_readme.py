"""The README's Python snippets run as written (in order, sharing one namespace), and so do the
guides' snippets."""

import pathlib
import re

import pytest

from revckpt import CheckpointMismatchError

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def snippets(path: pathlib.Path = README) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


def run_in_order(blocks: list[str], filename: str) -> dict:
    """Run ``blocks`` in one namespace, then every ``test_*`` function they define.

    A block that passes ``determinism_check="values"`` to a drifting module is the example of a
    caught mismatch: it must raise ``CheckpointMismatchError`` naming the op that differs.
    """
    namespace: dict = {}
    for code in blocks:
        if 'determinism_check="values"' in code:
            with pytest.raises(CheckpointMismatchError, match=r"aten\.mul"):
                exec(compile(code, filename, "exec"), namespace)
        else:
            exec(compile(code, filename, "exec"), namespace)
    for name, fn in list(namespace.items()):
        if name.startswith("test_") and callable(fn):
            fn()
    return namespace


def test_readme_snippets_run():
    blocks = snippets()
    assert len(blocks) >= 5
    assert "revckpt.fit(" in blocks[0], "the README opens with the revckpt.fit example"
    namespace = run_in_order(blocks, "README.md")
    assert any(name.startswith("test_") for name in namespace), "a test for the user's suite"


GUIDES = ["approx.md", "reversible.md", "schedule.md", "quickstart.md", "offload.md"]


@pytest.mark.parametrize("guide", [*GUIDES, "troubleshooting.md"])
def test_guide_snippets_run(guide, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # files the snippets write land here
    blocks = snippets(README.parent / "docs" / guide)
    assert blocks
    run_in_order(blocks, guide)


def test_determinism_mismatch_example_is_tested():
    """The caught-mismatch example lives in the troubleshooting guide, which runs above."""
    guide = snippets(README.parent / "docs" / "troubleshooting.md")
    assert any('determinism_check="values"' in code for code in guide)
