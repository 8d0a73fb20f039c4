"""pepo.training.reporting: the rollout dumps, summary.json and the training curves a run
leaves for people."""

from __future__ import annotations

import json
import math

import pytest

from pepo.training.reporting import plot_curves, read_summary, write_rollouts, write_summary


def test_a_failed_rollout_dump_leaves_no_file_behind(tmp_path):
    """A record json cannot write (an object left in it) fails the write: catches the temporary
    file kept (``step_000003.jsonl.tmp`` beside the dumps, half written) and a partial dump
    renamed into place."""
    path = tmp_path / "rollouts" / "step_000003.jsonl"
    with pytest.raises(TypeError, match="not JSON serializable"):
        write_rollouts(path, [{"step": 3, "reward": 1.0}, {"step": 3, "reward": object()}])
    assert list((tmp_path / "rollouts").iterdir()) == []


def test_rollout_dumps_keep_the_text_as_written(tmp_path):
    """The dumps are read by people in an editor: catches ``ensure_ascii`` left on (``τ`` and
    every CJK or accented token written as ``\\u03c4`` escapes)."""
    path = write_rollouts(tmp_path / "step_000001.jsonl",
                          [{"response": "τ = 2, 答案 4"}, {"response": "é"}])
    text = path.read_text(encoding="utf-8")
    assert text == '{"response": "τ = 2, 答案 4"}\n{"response": "é"}\n'
    assert [json.loads(line) for line in text.splitlines()][1] == {"response": "é"}


def test_the_summary_holds_the_history_and_the_runs_facts(tmp_path):
    """Catches the facts (the validation's size, the precision, ...) dropped from
    ``summary.json``, which the study reads without importing the recipe."""
    history = [{"step": 0, "val_accuracy": 0.25}, {"step": 1, "reward": 0.5}]
    write_summary(tmp_path, history, val_problems=8, compute_dtype=None)
    assert read_summary(tmp_path) == {"history": history, "val_problems": 8,
                                      "compute_dtype": None}


def test_a_run_without_a_summary_is_one_error_naming_it(tmp_path):
    """Catches the check left out (a bare FileNotFoundError naming only the file, not that the
    run did not finish)."""
    with pytest.raises(FileNotFoundError, match=r"summary.json does not exist: the run in .* did "
                                                r"not finish$"):
        read_summary(tmp_path)


def test_the_curves_leave_out_missing_and_non_finite_points(tmp_path, monkeypatch):
    """The train reward (raw, then its trailing mean over a tenth of the steps) and the
    validation accuracy, each over the steps that have a finite value. Catches a NaN reward (a
    step whose rollouts all failed to score) plotted: it blanked the trailing mean of the next
    ``win`` steps; and a step without validation drawn as 0."""
    from matplotlib.axes import Axes

    drawn, real = [], Axes.plot

    def plot(self, x, y, *args, **kwargs):
        drawn.append((list(x), list(y)))
        return real(self, x, y, *args, **kwargs)

    monkeypatch.setattr(Axes, "plot", plot)
    rewards = [0.1 * i for i in range(20)]
    history = [{"step": 0, "val_accuracy": 0.5}]
    history += [{"step": i + 1, "reward": r} for i, r in enumerate(rewards)]
    history[5]["reward"] = float("nan")  # step 5
    history[10]["val_accuracy"] = 0.75
    history[12]["val_accuracy"] = None
    path = plot_curves(history, tmp_path / "curves" / "training_curves.png", title="t")
    assert path.is_file() and path.stat().st_size > 0
    raw, smooth, val = drawn
    kept = [r for i, r in enumerate(rewards) if i != 4]
    assert raw == ([i + 1 for i in range(20) if i != 4], kept)
    win = len(kept) // 10  # 19 finite points: a window of 1
    assert win == 1 and smooth[1] == kept
    assert val == ([0, 10], [0.5, 0.75])
    assert all(math.isfinite(y) for y in raw[1] + smooth[1] + val[1])


def test_the_trailing_mean_is_over_the_last_tenth_of_the_steps(tmp_path, monkeypatch):
    """Catches another window, or a centred one: each point is the mean of itself and the
    ``len // 10 - 1`` points before it (fewer at the start)."""
    from matplotlib.axes import Axes

    drawn, real = [], Axes.plot

    def plot(self, x, y, *args, **kwargs):
        drawn.append(list(y))
        return real(self, x, y, *args, **kwargs)

    monkeypatch.setattr(Axes, "plot", plot)
    rewards = [float(i * i % 7) for i in range(30)]
    plot_curves([{"step": i, "reward": r} for i, r in enumerate(rewards)], tmp_path / "c.png")
    want = [sum(rewards[max(0, i - 2): i + 1]) / len(rewards[max(0, i - 2): i + 1])
            for i in range(30)]
    assert drawn[1] == pytest.approx(want, rel=1e-12)
