"""The documentation is in step with the code: the API reference is regenerated from the
docstrings, every guide the README and the quickstart name exists, the README's test command
is the one CI runs, and the README's count of the names the main jobs need is the reference's."""

import importlib.util
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _gen_api():
    spec = importlib.util.spec_from_file_location("gen_api", ROOT / "docs" / "gen_api.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_api_reference_is_up_to_date():
    assert (ROOT / "docs" / "api.md").read_text() == _gen_api().render(), (
        "docs/api.md is out of date: run python docs/gen_api.py"
    )


def test_named_docs_exist():
    for source in ("README.md", "docs/quickstart.md", "docs/troubleshooting.md"):
        text = (ROOT / source).read_text()
        for name in set(re.findall(r"`(docs/[a-z_]+\.md)`", text)):
            assert (ROOT / name).exists(), f"{source} names {name}, which does not exist"


def _bash_after(text: str, heading: str) -> str:
    """The first bash block after the line that starts with ``heading``."""
    found = re.search(rf"^{re.escape(heading)}.*?```bash\n(.*?)\n```", text, flags=re.S | re.M)
    assert found, f"README.md has no bash block after {heading!r}"
    return found.group(1).strip()


def test_readme_set_up_commands():
    readme = (ROOT / "README.md").read_text()
    demo = _bash_after(readme, "See what it does")
    assert demo.startswith("pip install ") and demo.endswith("&& revckpt demo")
    tests = _bash_after(readme, "Run the tests")
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert tests in ci, f".ci/run does not run the README's test command {tests!r}"


def test_readme_counts_the_essential_names():
    readme = (ROOT / "README.md").read_text()
    essential = [name for names in _gen_api().ESSENTIAL.values() for name in names]
    found = re.search(r"main\s+jobs\s+need\s+(\d+)\s+of", readme)
    assert found and int(found.group(1)) == len(essential)
    for name in essential:
        assert f"`{name.removeprefix('revckpt.')}`" in readme, f"README.md does not list {name}"
