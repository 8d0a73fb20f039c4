"""benchmarks/bench_weighting.py: what its entropy rows say they are, and its argument errors."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "bench_weighting.py", "--quick", "--only", "entropy",
                           *args], cwd=ROOT / "benchmarks", capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.parametrize(("args", "said"), [
    ((), "; 1 timed run each after a warm-up)"),
    (("--entropy-repeats", "3"), "; the median of 3 timed runs each after a warm-up)"),
])
def test_entropy_rows_say_how_many_runs_they_are(args, said):
    """The entropy table's heading gives the timed runs behind each figure (catches the rows
    taking a third of ``--repeats`` unsaid: ``--repeats 3`` timed one run, which the docs
    called a median; and ``--entropy-repeats`` parsed and then not passed on)."""
    res = _run(*args)
    assert res.returncode == 0, res.stderr[-2000:]
    (head,) = [line for line in res.stdout.splitlines() if line.startswith("## logprobs")]
    assert head.endswith(said), head
    assert len([r for r in res.stdout.splitlines() if r.startswith("| logprobs_and_entropy |")
                or r.startswith("| ..._from_hidden |")]) == 2


def test_a_zero_repeat_count_is_named():
    res = _run("--entropy-repeats", "0")
    assert res.returncode == 2
    assert "must be at least 1 (got 7, 0, 1)" in res.stderr.splitlines()[-1]
