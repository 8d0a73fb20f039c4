"""Response lengths over training, per method: the study's length figure and table
(:mod:`pepo.study.compare` draws them from each run's ``len_curve``)."""

from __future__ import annotations

import statistics
from pathlib import Path

from pepo.study.methods import style

__all__ = ["plot_lengths", "seeds_label"]


def seeds_label(seeds: list[int]) -> str:
    """``n=10, seeds 0-9`` (a range where the seeds are consecutive, else listed): methods of
    other seeds are told apart in a figure's legend (their means are not paired)."""
    s = sorted(set(seeds))
    if s and s == list(range(s[0], s[-1] + 1)) and len(s) > 2:
        return f"n={len(s)}, seeds {s[0]}–{s[-1]}"
    return f"n={len(s)}, seeds {', '.join(map(str, s))}"


def plot_lengths(rows: list[dict], labels: list[str], path: Path, title: str) -> str:
    """Mean response length by step per method (mean over seeds) to ``path``; returns the
    Markdown table of the mean length at the first, middle and last step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4), dpi=110)
    table = ["| method | seeds | length at step 1 | at the middle step | at the last step |",
             "|---|---:|---:|---:|---:|"]
    for label in labels:
        mine = [r for r in rows if r["method"] == label and r.get("len_curve")]
        curves = [r["len_curve"] for r in mine]
        if not curves:
            continue
        n = min(len(c) for c in curves)
        steps = [c[0] for c in curves[0][:n]]
        mean = [statistics.fmean(c[i][1] for c in curves) for i in range(n)]
        ax.plot(steps, mean, markersize=3, **style(label),
                label=f"{label} ({seeds_label([r['seed'] for r in mine])})")
        table.append(f"| {label} | {len(curves)} | {mean[0]:.1f} | {mean[(n - 1) // 2]:.1f} "
                     f"(step {steps[(n - 1) // 2]}) | {mean[-1]:.1f} (step {steps[-1]}) |")
    ax.set_xlabel("step")
    ax.set_ylabel("mean response length, tokens (mean over seeds)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.tight_layout()
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)
    return "\n".join(table)
