"""The README's Python snippets run as written (in order, sharing one namespace)."""

import pathlib
import re

import pytest

from revckpt import CheckpointMismatchError

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def snippets():
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_snippets_run():
    blocks = snippets()
    assert len(blocks) >= 5
    namespace: dict = {}
    for code in blocks:
        if 'determinism_check="values"' in code:
            with pytest.raises(CheckpointMismatchError, match=r"aten\.mul"):
                exec(compile(code, "README.md", "exec"), namespace)
        else:
            exec(compile(code, "README.md", "exec"), namespace)
    namespace["test_checkpointed_model_is_exact"]()


@pytest.mark.parametrize(
    "guide", ["approx.md", "reversible.md", "schedule.md", "quickstart.md", "offload.md"]
)
def test_guide_snippets_run(guide, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # files the snippets write land here
    path = README.parent / "docs" / guide
    blocks = re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)
    assert blocks
    namespace: dict = {}
    for code in blocks:
        exec(compile(code, guide, "exec"), namespace)
    for name, fn in list(namespace.items()):
        if name.startswith("test_") and callable(fn):
            fn()
