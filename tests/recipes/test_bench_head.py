"""benchmarks/bench_head.py: its table at a small shape, and its argument errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "bench_head.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=120, env={"OMP_NUM_THREADS": "1", "PATH": ""})


def test_table_has_a_row_per_row_count_and_the_products_agree():
    """Catches: a row count skipped, the transposed product taken wrongly (``w.t() @ x``, or
    no transpose back: a shape error; ``w @ x.t()`` read back as ``view(rows, V)``: a large
    difference), and a ratio that is not of the two printed times (an inverted one wherever
    the two times differ by more than their rounding, which a tiny shape does not ensure)."""
    res = _run("--vocab", "96", "--dim", "16", "--rows", "5", "1", "--calls", "2",
               "--repeats", "1")
    assert res.returncode == 0, res.stderr
    rows = [line for line in res.stdout.splitlines() if line.startswith("| ") and "ms" not in line]
    assert [r.split("|")[1].strip() for r in rows] == ["5", "1"]
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert float(cells[1]) > 0 and float(cells[2]) > 0
        ratio = float(cells[3].rstrip("x"))  # of the medians; the cells hold 3 digits
        assert abs(ratio - float(cells[2]) / float(cells[1])) <= 0.006 + 0.012 * ratio
        assert float(cells[4]) < 1e-5


def test_bad_arguments_name_the_value():
    """Catches: a zero row count or vocabulary reaching torch (an empty product, a ratio of
    0/0) instead of one line naming the value."""
    res = _run("--rows", "4", "0")
    assert res.returncode == 2 and "--rows must be at least 1, got 0" in res.stderr
    res = _run("--vocab", "0")
    assert res.returncode == 2 and "--vocab must be at least 1, got 0" in res.stderr
