"""The study's response-length figure and table (``pepo.study.lengths``)."""

from __future__ import annotations

import statistics

import pytest

from pepo.study.lengths import plot_lengths, seeds_label


@pytest.mark.parametrize("seeds, label", [
    ([2, 0, 1, 3], "n=4, seeds 0–3"),
    ([0, 1], "n=2, seeds 0, 1"),          # two seeds are listed, not made a range
    ([0, 2, 3], "n=3, seeds 0, 2, 3"),    # a gap: listed
    ([1, 1, 2, 3], "n=3, seeds 1–3"),     # a seed twice (two tasks' runs) counted once
    ([5], "n=1, seeds 5"),
])
def test_seeds_label(seeds, label):
    """Catches a range for a gap or for two seeds, and a seed counted twice."""
    assert seeds_label(seeds) == label


def test_the_length_table_is_the_mean_over_seeds_at_the_first_middle_and_last_step(tmp_path):
    """Three seeds of one method, one with a longer curve than the others, one run without a
    ``len_curve`` (a restored older result): catches a median over seeds (whose value differs
    here), the middle step taken as ``n // 2`` of an even count, the curves' longest length
    (an index error, or a step only one seed reached), and the curve-less run counted."""
    curves = {0: [[1, 100.0], [2, 90.0], [3, 60.0], [4, 40.0]],
              1: [[1, 110.0], [2, 70.0], [3, 50.0], [4, 30.0], [5, 10.0]],
              2: [[1, 60.0], [2, 20.0], [3, 40.0], [4, 35.0]]}
    rows = [{"method": "PEPO", "seed": s, "len_curve": c} for s, c in curves.items()]
    rows.append({"method": "PEPO", "seed": 3})
    rows.append({"method": "GRPO", "seed": 0, "len_curve": []})
    table = plot_lengths(rows, ["GRPO", "PEPO"], tmp_path / "lengths.png", "t")
    mean = [statistics.fmean(c[i][1] for c in curves.values()) for i in range(4)]
    assert statistics.median(c[1][1] for c in curves.values()) != pytest.approx(mean[1])
    assert table.splitlines()[2:] == [
        f"| PEPO | 3 | {mean[0]:.1f} | {mean[1]:.1f} (step 2) | {mean[3]:.1f} (step 4) |"]
    assert (tmp_path / "lengths.png").stat().st_size > 0
