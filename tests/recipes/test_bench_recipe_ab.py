"""benchmarks/bench_recipe_ab.py: its reading of the metrics log, its summary and table, its
argument errors, and one whole comparison (the tiny config, one step, one run a side) in a
clone of the repository, against the clone's own HEAD."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "bench_recipe_ab.py"


def _bench():
    sys.path.insert(0, str(SCRIPT.parent))  # its `from machine import cpu_name`
    try:
        spec = importlib.util.spec_from_file_location("bench_recipe_ab", SCRIPT)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(SCRIPT.parent))
    return mod


def _log_line(step: int, **values) -> str:
    return f"Step {step} | " + " ".join(f"{k}:{v}" for k, v in values.items()) + " \n"


def test_read_steps_takes_training_lines_from_every_log(tmp_path):
    """Catches: a validation line (``val_accuracy`` only, no ``step_time``) read as a step, a
    second log file (a resumed run's) ignored, a value read from the wrong key, and a line that
    is not a step line (torchtune's header) breaking the parse."""
    bench = _bench()
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "log_1.txt").write_text(
        "some header\n" + _log_line(0, val_accuracy=0.3)
        + _log_line(1, loss=-0.5, gen_time=2.0, logprob_time=0.0, update_time=3.0,
                    step_time=5.5, note="x"), encoding="utf-8")
    (logs / "log_2.txt").write_text(
        _log_line(2, loss=0.25, gen_time=1.0, logprob_time=0.5, update_time=2.0, step_time=3.75)
        + _log_line(2, val_accuracy=0.6), encoding="utf-8")
    steps = bench.read_steps(tmp_path)
    assert sorted(steps) == [1, 2]
    assert steps[1]["loss"] == -0.5 and steps[1]["update_time"] == 3.0
    assert steps[1]["step_time"] == 5.5 and "note" not in steps[1]
    assert steps[2]["logprob_time"] == 0.5 and "val_accuracy" not in steps[2]


def _run(step_times: list[float], loss: float, wall: float) -> dict:
    steps = {i + 1: {"gen_time": t / 2, "logprob_time": 0.0, "update_time": t / 2,
                     "step_time": t, "loss": loss} for i, t in enumerate(step_times)}
    return {"steps": steps, "wall_s": wall, "peak_rss_gb": 1.5}


def test_summary_and_table_compare_this_tree_to_the_revision():
    """Catches: the median taken over all steps instead of the chosen ones (step 4's 100 s
    would move it), step 1's split averaged over the wrong runs, and a ratio inverted (base /
    new instead of new / base)."""
    bench = _bench()
    base = bench.summarize([_run([10, 8, 6, 100], 0.1, 40), _run([12, 6, 8, 100], 0.1, 50)],
                           [2, 3])
    new = bench.summarize([_run([5, 4, 3, 1], 0.2, 20), _run([7, 3, 4, 1], 0.2, 30)], [2, 3])
    assert base["median_steps"] == [7.0, 7.0] and new["median_steps"] == [3.5, 3.5]
    assert base["step1"]["step_time"] == 11.0 and new["step1"]["gen_time"] == 3.0
    assert base["step1_loss"] == [0.1, 0.1]
    text = bench.table(base, new, "abc1234", "def5678", [2, 3])
    lines = text.splitlines()
    assert lines[0] == "| seconds | abc1234 | this tree (def5678) |"
    assert "| step 1: whole step (mean) | 11.0 | 6.00 (0.55x) |" in lines
    assert "| median of steps 2-3, per run | 7.00, 7.00 | 3.50, 3.50 (0.50x) |" in lines
    assert "| wall clock, per run | 40, 50 | 20, 30 (0.56x) |" in lines
    assert bench.steps_label([2, 3, 4]) == "2-4" and bench.steps_label([2, 5]) == "2, 5"


@pytest.mark.parametrize("args, message", [
    (["--against", "HEAD", "--steps", "3", "--median-steps", "4"],
     "--median-steps 4 is not a step of a 3-step run"),
    (["--against", "HEAD", "--runs", "0"], "--runs and --steps must be at least 1 (got 0, 4)"),
    (["--against", "HEAD", "--bogus"], "unrecognized argument '--bogus'"),
    (["--against", "HEAD", "--json", "/nonexistent/ab.json"],  # it failed after every run
     "--json /nonexistent/ab.json: /nonexistent is not a directory"),
])
def test_bad_arguments_are_named(args, message, capsys):
    """Catches: an out-of-range step, a zero run count or a stray flag accepted and failing
    later (after minutes of runs) instead of at once, with the bad value named."""
    bench = _bench()
    with pytest.raises(SystemExit):
        bench.main(args)
    assert message in capsys.readouterr().err


def test_an_interrupted_benchmark_takes_its_run_with_it(tmp_path, monkeypatch):
    """Ctrl-C while a run is under way ends that run too (catches a wait that lets the
    interrupt through and leaves the training process running, on the cores the next
    measurement needs, with its worktree removed under it)."""
    bench = _bench()
    started, real_popen = [], subprocess.Popen

    def popen(*args, **kwargs):
        started.append(real_popen(*args, **kwargs))
        return started[-1]

    def interrupted(pid, options):
        raise KeyboardInterrupt

    config = tmp_path / "c.yaml"
    config.write_text("{}\n", encoding="utf-8")
    monkeypatch.setattr(bench, "tune_command",
                        lambda: [sys.executable, "-c", "import time; time.sleep(120)"])
    monkeypatch.setattr(bench.subprocess, "Popen", popen)
    monkeypatch.setattr(bench.os, "wait4", interrupted)
    with pytest.raises(KeyboardInterrupt):
        bench.run_once("this tree", tmp_path, str(config), tmp_path / "run1", 1, [])
    assert len(started) == 1 and started[0].poll() is not None


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_one_step_against_head_in_a_clone(tmp_path):
    """The whole tool as a user runs it, in a clone (its worktree comes and goes there, not in
    this checkout): one run a side of ``--config tiny``, one step. Both sides are the same
    commit, so step 1 draws the same rollouts: equal losses, which a side that ran nothing, or
    read the other side's log, would not give reliably; the table and the worktree's removal
    are checked too."""
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [sys.executable, str(clone / "benchmarks" / "bench_recipe_ab.py"), "--against", "HEAD",
         "--config", "tiny", "--runs", "1", "--steps", "1", "prompts_per_step=2",
         "micro_batch_size=4"],
        cwd=clone, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "run 1/1, this tree:" in out and "median of steps 1 " in out
    loss_row = next(line for line in out.splitlines() if line.startswith("| step 1: loss"))
    _, _, base_loss, new_loss, _ = loss_row.split("|")
    assert base_loss.strip() == new_loss.strip() and base_loss.strip() != ""
    assert "| step 1: whole step (mean) |" in out
    listed = subprocess.run(["git", "worktree", "list"], cwd=clone, capture_output=True,
                            text=True, check=True).stdout
    assert len(listed.strip().splitlines()) == 1, listed
