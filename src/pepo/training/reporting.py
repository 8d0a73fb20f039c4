"""What a training run leaves behind for people: curves as a PNG and rollouts as JSONL.

Rollout dumps hold, per rollout: the step, prompt id and text, response text, token ids and
token strings, per-token entropies, reward, sequence advantage, token advantages and token
weights (token advantage / sequence advantage, None where the advantage is 0). One file per
dumped step (``rollouts/step_000010.jsonl``), so a resumed run rewrites rather than duplicates.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

__all__ = ["SUMMARY_FILE", "NullLogger", "plot_curves", "read_summary", "write_rollouts",
           "write_summary"]


def write_rollouts(path: Union[str, Path], records: Sequence[Mapping[str, Any]]) -> Path:
    """Writes ``records`` as JSON lines to ``path`` atomically (temp file, then rename; the
    temp file is removed when the write fails)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            for r in records:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
        os.replace(tmp, path)
    except BaseException:  # a full disk, a bad record: no half-written file left behind
        tmp.unlink(missing_ok=True)
        raise
    return path


SUMMARY_FILE = "summary.json"


class NullLogger:
    """A metric logger that keeps nothing: the one of every rank but the first."""

    def log_config(self, cfg: Any) -> None:
        pass

    def log_dict(self, metrics: Any, step: int) -> None:
        pass

    def close(self) -> None:
        pass


def write_summary(output_dir: Union[str, Path], history: Sequence[Mapping[str, Any]],
                  **facts: Any) -> Path:
    """Writes ``output_dir/summary.json`` atomically at the end of a run: ``history`` (one dict
    of metrics per step, ``step`` 0 the validation before training) and ``facts`` (the number of
    validation problems, say), for tools that read a finished run without importing the recipe
    (``pepo.study.compare``). Returns the path."""
    from pepo.training.checkpointing import atomic_write_text

    path = Path(output_dir) / SUMMARY_FILE
    text = json.dumps({"history": list(history), **facts}, indent=1, default=float)
    atomic_write_text(path, text + "\n")
    return path


def read_summary(output_dir: Union[str, Path]) -> dict[str, Any]:
    """The ``summary.json`` a finished run wrote in ``output_dir``.

    Raises:
        FileNotFoundError: the run did not finish (no summary), naming the path.
    """
    path = Path(output_dir) / SUMMARY_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: the run in {output_dir} did not finish")
    return json.loads(path.read_text(encoding="utf-8"))


def truncate_metrics_log(path: Union[str, Path], step: int) -> int:
    """Drops the lines of a ``DiskLogger`` file (``Step N | key:value ...``) logged after
    ``step``, atomically, so that a run resumed from the checkpoint of ``step`` logs each later
    step once. Returns the number of lines dropped (0 when there is no file).

    Lines that are not ``Step N | ...`` are kept."""
    path = Path(path)
    if not path.is_file():
        return 0
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)

    def logged_after(line: str) -> bool:
        head = line.split("|", 1)[0].split()
        return len(head) == 2 and head[0] == "Step" and head[1].isdigit() and int(head[1]) > step

    keep = [line for line in lines if not logged_after(line)]
    if len(keep) == len(lines):
        return 0
    from pepo.training.checkpointing import atomic_write_text

    atomic_write_text(path, "".join(keep))
    return len(lines) - len(keep)


def plot_curves(
    history: Sequence[Mapping[str, Any]],
    path: Union[str, Path],
    title: Optional[str] = None,
) -> Path:
    """Plots training reward and validation accuracy against step into the PNG ``path``.

    ``history`` holds one dict per logged step; ``reward`` and ``val_accuracy`` are read where
    present (validation runs only every few steps).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def series(key: str) -> tuple[list[int], list[float]]:
        pts = [
            (h["step"], float(h[key]))
            for h in history
            if key in h and h[key] is not None and math.isfinite(float(h[key]))
        ]
        return [p[0] for p in pts], [p[1] for p in pts]

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    sx, sy = series("reward")
    if sx:
        ax.plot(sx, sy, color="tab:blue", alpha=0.35, lw=1, label="train reward (per step)")
        win = max(1, len(sy) // 10)
        smooth = [sum(sy[max(0, i - win + 1) : i + 1]) / len(sy[max(0, i - win + 1) : i + 1])
                  for i in range(len(sy))]
        ax.plot(sx, smooth, color="tab:blue", lw=2, label=f"train reward ({win}-step mean)")
    vx, vy = series("val_accuracy")
    if vx:
        ax.plot(vx, vy, "o-", color="tab:red", lw=2, label="validation accuracy (avg@k)")
    ax.set_xlabel("step")
    ax.set_ylabel("reward / accuracy")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    if title:
        ax.set_title(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
