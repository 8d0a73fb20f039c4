"""The README's quickstart, run as printed: its figures must be what a user sees."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_quickstart_prints_the_readmes_figures(tmp_path):
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    quick = readme[readme.index("## Quickstart"):]
    block = quick[quick.index("```\nValidation"):]
    block = block[4: block.index("```", 4)]
    expected = [line for line in block.splitlines() if line.startswith("Validation accuracy")]
    assert len(expected) == 2, block
    out = subprocess.run(
        [str(Path(sys.executable).parent / "tune"), "run", "pepo_recipe", "--config", "tiny",
         f"output_dir={tmp_path / 'pepo_runs' / 'tiny'}", "plot=false"],
        cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout + out.stderr
    # what a terminal shows: a progress bar's cursor movements and carriage returns put the
    # next line at the start of a line (a validation bar, removed when done, ends in "\x1b[A")
    text = re.sub(r"[ \t]*\x1b\[[0-9;]*[A-Za-z]|[^\n]*\r", "", text)
    for line in expected:
        assert re.search(r"^" + re.escape(line) + r"\s*$", text, re.M), (line, text[-3000:])
