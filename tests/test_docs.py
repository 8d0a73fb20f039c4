"""The Python examples in README.md and docs/*.md run as written (each file's blocks in order)."""

import ast
import pathlib
import re
from typing import Any, Optional

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
# docs/integrations.md's examples need TRL or verl: tests/integrations runs them where installed
DOCS = [ROOT / "README.md",
        *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "integrations.md")]


def blocks(path: pathlib.Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


SHOWN = re.compile(r"# \[\[.*\]\]\s*")  # a value the docs show for the expression above


def printed_value(lines: list[str], end: int) -> Optional[str]:
    """The ``# [[...]]`` comment among the comment lines right after line ``end`` (1-based, a
    statement's last line): the value the docs show for that expression, or None."""
    for line in lines[end:]:
        if not line.startswith("#"):
            return None
        if SHOWN.fullmatch(line):
            return line[2:]
    return None


def check_printed(value: Any, shown: str, where: str) -> None:
    """``value`` equals the list ``shown``, each number to the decimals it is printed with
    (exactly where it shows an integer)."""
    numbers = re.findall(r"-?\d+(?:\.(\d+))?", shown)  # the decimals of each, in order
    atol = torch.tensor([0.5 * 10 ** -len(d) + 1e-6 if d else 1e-6 for d in numbers],
                        dtype=torch.float64)
    expected = torch.tensor(ast.literal_eval(shown), dtype=torch.float64)
    got = value.double().flatten()
    assert got.shape == atol.shape and expected.numel() == atol.numel(), where
    assert ((got - expected.flatten()).abs() <= atol).all(), (
        f"{where}: the docs show {shown}, the code gives {value.tolist()}")


@pytest.mark.parametrize("path", [p for p in DOCS if blocks(p)], ids=lambda p: p.name)
def test_examples_run(path):
    """Each block runs statement by statement; an expression followed by a ``# [[...]]``
    comment must give that value. Catches a docs example that still runs but shows numbers
    the code no longer gives."""
    namespace: dict = {}
    checked = 0
    for code in blocks(path):
        lines = code.splitlines()
        body = ast.parse(code).body
        before = checked
        for i, stmt in enumerate(body):
            last_on_line = i + 1 == len(body) or body[i + 1].lineno > stmt.end_lineno
            shown = printed_value(lines, stmt.end_lineno) if last_on_line else None
            if isinstance(stmt, ast.Expr) and shown is not None:
                value = eval(compile(ast.Expression(stmt.value), str(path), "eval"), namespace)
                check_printed(value, shown, f"{path.name}: {ast.unparse(stmt)}")
                checked += 1
            else:
                exec(compile(ast.Module([stmt], []), str(path), "exec"), namespace)
        # a shown value after anything but a top-level expression would go unchecked
        shown_here = sum(bool(SHOWN.fullmatch(x.strip())) for x in lines)
        assert checked - before == shown_here, f"{path.name}: a shown value is not checked"
    if path.name == "strategies.md":  # its shown values: uniform, PEPO, 80/20, GTPO (2), custom
        assert checked == 6
