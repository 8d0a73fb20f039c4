"""The Python examples in README.md and docs/*.md run as written (each file's blocks in order)."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# docs/integrations.md's examples need TRL or verl: tests/integrations runs them where installed
DOCS = [ROOT / "README.md",
        *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "integrations.md")]


def blocks(path: pathlib.Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


@pytest.mark.parametrize("path", [p for p in DOCS if blocks(p)], ids=lambda p: p.name)
def test_examples_run(path):
    namespace: dict = {}
    for code in blocks(path):
        exec(compile(code, str(path), "exec"), namespace)
