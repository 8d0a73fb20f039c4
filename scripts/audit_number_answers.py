"""Which rewarded rollouts were credited only because math-verify compares by value.

    python scripts/audit_number_answers.py study_runs/smollm2_steps/group/*/seed_*

math-verify scores "9 + 9 = ?" (the question restated) as a correct answer to 18: it parses the
expression and compares its value. For every run directory given (one with ``rollouts/``
holding the recipe's dumps), this re-scores each rewarded rollout with
``math_verify_score(..., number_only=True)`` and prints, as a Markdown table, how many of the
rewarded rollouts at the first, middle and last dumped step (and over all steps) fail it: the
share of the reward that came from writing an expression instead of a number. About a second a
step on 2 cores.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

from pepo.tasks.rewards import math_verify_score


def _rows(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def audit(run: Path) -> list[tuple[int, int, int, int]]:
    """``(step, rollouts, rewarded, rewarded by value only)`` for each dumped step of ``run``."""
    out = []
    for f in sorted((run / "rollouts").glob("step_*.jsonl*")):
        rows = _rows(f)
        won = [r for r in rows if r["reward"] > 0]
        by_value = sum(math_verify_score(r["response"], str(r["answer"]), number_only=True) == 0
                       for r in won)
        out.append((int(rows[0]["step"]) if rows else -1, len(rows), len(won), by_value))
    return out


def _cell(s: tuple[int, int, int, int]) -> str:
    return f"step {s[0]}: {s[3]} of {s[2]} rewarded"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="run directories (with rollouts/)")
    args = ap.parse_args(argv)
    print("| run | first step | middle step | last step | all steps |")
    print("|---|---|---|---|---:|")
    for run in args.runs:
        if not (run / "rollouts").is_dir():
            sys.exit(f"error: {run} has no rollouts/ directory")
        steps = audit(run)
        if not steps:
            continue

        won, by_value = sum(s[2] for s in steps), sum(s[3] for s in steps)
        name = "/".join(run.resolve().parts[-2:])
        print(f"| {name} | {_cell(steps[0])} | {_cell(steps[(len(steps) - 1) // 2])} | "
              f"{_cell(steps[-1])} | {by_value} of {won} ({100 * by_value / max(won, 1):.0f} %) |",
              flush=True)


if __name__ == "__main__":
    main()
