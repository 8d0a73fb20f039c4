"""Which rewarded rollouts were credited only because math-verify compares by value.

    python scripts/audit_number_answers.py study_runs/smollm2_steps/group/*/seed_*

math-verify scores "9 + 9 = ?" (the question restated) as a correct answer to 18: it parses the
expression and compares its value. For every run directory given (one with ``rollouts/``
holding the recipe's dumps), this re-scores each rewarded rollout with
``math_verify_score(..., number_only=True)`` and prints, as a Markdown table, how many of the
rewarded rollouts at the first, middle and last dumped step (and over all steps) fail it: the
share of the reward that came from writing an expression instead of a number.

Two more columns measure math-verify's other reading of free text: with no anchor ("answer:",
``\\boxed``), its answer is the last number the response writes, wherever it stands. Each
response's last stated result (the last ``= n`` not followed by an operator) is compared with
the gold answer: how many rewarded rollouts stated another result (rewarded for a later stray
number, "0 + 8 = 9 ... adding 0 to 8"), and how many unrewarded ones stated the gold answer and
then wrote another number ("13 + 16 = 29. This adds 13 and 16."). Responses without such a
result, or a gold answer that is not a plain number, count in neither. About a second a step on
2 cores. ``--validation`` reads the validations' responses instead (``val_rollouts/``, which a
run writes with ``validation.dump=true``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pepo.study.rescore import dump_files, gold_number, last_stated_result, read_rows
from pepo.tasks.rewards import math_verify_score

__all__ = ["audit", "last_stated_result", "stated"]


def stated(run: Path, sub: str = "rollouts") -> tuple[int, int, int, int]:
    """Over all dumped steps of ``run``: ``(rewarded, of which the last stated result is another
    number, unrewarded, of which the last stated result is the gold answer)``."""
    won = won_other = lost = lost_gold = 0
    for f in dump_files(run / sub):
        for r in read_rows(f):
            said, gold = last_stated_result(r["response"]), gold_number(r["answer"])
            if r["reward"] > 0:
                won += 1
                won_other += said is not None and gold is not None and said != gold
            else:
                lost += 1
                lost_gold += said is not None and gold is not None and said == gold
    return won, won_other, lost, lost_gold


def audit(run: Path, sub: str = "rollouts") -> list[tuple[int, int, int, int]]:
    """``(step, rollouts, rewarded, rewarded by value only)`` for each dumped step of ``run``."""
    out = []
    for f in dump_files(run / sub):
        rows = read_rows(f)
        if not rows:  # an empty dump (a write cut short): no step to report
            continue
        won = [r for r in rows if r["reward"] > 0]
        by_value = sum(math_verify_score(r["response"], str(r["answer"]), number_only=True) == 0
                       for r in won)
        out.append((int(rows[0]["step"]), len(rows), len(won), by_value))
    return out


def _cell(s: tuple[int, int, int, int]) -> str:
    return f"step {s[0]}: {s[3]} of {s[2]} rewarded"


def _pct(k: int, n: int) -> str:
    return f"{100 * k / max(n, 1):.0f} %"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="run directories (with rollouts/)")
    ap.add_argument("--validation", action="store_true",
                    help="the validations' responses (val_rollouts/, written with "
                         "validation.dump=true) instead of the training rollouts")
    args = ap.parse_args(argv)
    sub = "val_rollouts" if args.validation else "rollouts"
    print("| run | first step | middle step | last step | all steps | rewarded, stated another "
          "result | unrewarded, stated the answer |")
    print("|---|---|---|---|---:|---:|---:|")
    missing = [run for run in args.runs if not (run / sub).is_dir()]
    if len(missing) == len(args.runs):
        sys.exit(f"error: no run given has a {sub}/ directory (first: {args.runs[0]})")
    for run in missing:  # e.g. a restored study keeps dumps of some methods only
        print(f"{run}: no {sub}/ directory; left out", file=sys.stderr)
    for run in args.runs:
        if run in missing:
            continue
        try:
            steps = audit(run, sub)
            if not steps:
                continue
            _, won_other, lost, lost_gold = stated(run, sub)
        except ValueError as e:  # a dump that cannot be read, named
            sys.exit(f"error: {e}")
        won, by_value = sum(s[2] for s in steps), sum(s[3] for s in steps)
        name = "/".join(run.resolve().parts[-2:])
        print(f"| {name} | {_cell(steps[0])} | {_cell(steps[(len(steps) - 1) // 2])} | "
              f"{_cell(steps[-1])} | {by_value} of {won} ({_pct(by_value, won)}) | "
              f"{won_other} of {won} ({_pct(won_other, won)}) | "
              f"{lost_gold} of {lost} ({_pct(lost_gold, lost)}) |", flush=True)


if __name__ == "__main__":
    main()
