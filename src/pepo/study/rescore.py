"""A second scoring of a run's validation: by the result each response states, not by the last
number it writes.

With no anchor ("answer:", ``\\boxed{}``) math-verify takes the last number a response writes as
its answer (GSM8K's "flexible extract"), wherever it stands: "0 + 8 = 9 ... adding 0 to 8" is
rewarded for the stray 8, and "13 + 16 = 29. This adds 13 and 16." is not. A method that ends its
responses on the number loses less to this reading than one that explains after the result, so a
difference between methods can come from where they put the answer. This module scores each
validation response a second way: where the response states a result (its last ``= n`` not
followed by an operator), that result decides; where it states none, the verifier's verdict
stands. ``validation.dump: true`` keeps the responses this reads (``val_rollouts/``).

    python -m pepo.study.rescore RUN_DIR [RUN_DIR ...]
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import statistics
import zlib
from pathlib import Path
from typing import Optional, Sequence

__all__ = ["dump_files", "last_stated_result", "gold_number", "stated_success", "read_rows",
           "validation_curve", "stated_results", "stated_section"]

# "= 29" ends a stated result; "= 3 + 4" does not (an operator follows the number on its line:
# "= 19" before a line that starts "- " does, and so does "= 3" before a line "+ 4", a wrapped
# sum); "= 1,234" is 1234 (and a list "= 100,200" one number). "**" after the number closes
# Markdown bold ("**5 + 2 = 7**"), unless a number or "(" follows it (a power: "= 2**3").
_STATED = re.compile(r"=\s*\$?\s*(-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?)"
                     r"(?![\d.,]*[ \t]*(?:[-+/×÷^]|\*(?!\*)|\*\*[ \t]*[\d(]))")


def last_stated_result(response: str) -> Optional[float]:
    """The number of the response's last ``= n`` that ends an equation, or None."""
    found = _STATED.findall(response)
    return float(found[-1].replace(",", "")) if found else None


def gold_number(answer: object) -> Optional[float]:
    """The gold answer as a number, or None when it is not a plain number."""
    try:
        return float(str(answer))
    except ValueError:
        return None


def stated_success(response: str, answer: object, success: bool) -> bool:
    """The response's stated result against the gold answer; ``success`` (the verifier's) where
    either is not a number."""
    said, gold = last_stated_result(response), gold_number(answer)
    if said is None or gold is None:
        return bool(success)
    return said == gold


def read_rows(path: Path) -> list[dict]:
    """The rows of one dump (``.jsonl`` or ``.jsonl.gz``).

    Raises:
        ValueError: the file cannot be read as one (truncated, not gzip, not UTF-8, a line
            that is not JSON), naming it (and the line).
    """
    opener = gzip.open if path.suffix == ".gz" else open
    rows, n = [], 0
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    rows.append(json.loads(line))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{n}: not valid JSON ({e.msg})") from None
    except (OSError, EOFError, UnicodeDecodeError, zlib.error) as e:  # BadGzipFile: OSError
        raise ValueError(f"{path}: cannot be read as a rollout dump "
                         f"({type(e).__name__}: {e})") from None
    return rows


def dump_files(folder: Path) -> list[Path]:
    """The ``step_N.jsonl`` (or ``.jsonl.gz``) dumps of ``folder``, one a step, in step order:
    never a killed write's ``.tmp``, and a dump kept plain and compressed once."""
    files: dict[str, Path] = {}
    for f in sorted(Path(folder).glob("step_*.jsonl")) + sorted(
            Path(folder).glob("step_*.jsonl.gz")):
        files.setdefault(f.name.split(".")[0], f)
    return [files[k] for k in sorted(files)]


def validation_curve(run: Path) -> Optional[list[list[float]]]:
    """``[[step, accuracy by the verifier, accuracy by the stated result, responses], ...]`` for
    each validation the run dumped (``run/val_rollouts/step_*.jsonl``), by step; None when it
    dumped none."""
    curve = []
    for f in dump_files(Path(run) / "val_rollouts"):
        rows = read_rows(f)
        if not rows:
            continue
        n = len(rows)
        verifier = sum(bool(r["success"]) for r in rows) / n
        stated = sum(stated_success(r["response"], r["answer"], r["success"]) for r in rows) / n
        curve.append([int(rows[0]["step"]), verifier, stated, n])
    return sorted(curve) or None


def stated_results(rows: list[dict]) -> list[dict]:
    """The runs whose last validation was dumped, with ``val_after`` (and ``val_before``, from
    any run of the seed that dumped step 0: the warm start is the same for every method of a
    seed) scored by the stated result (:func:`stated_success`). A run whose dumped last
    validation does not give its logged accuracy is left out: the dump is not that run's."""
    before = {r["seed"]: c[0][2] for r in rows if (c := r.get("stated_curve")) and c[0][0] == 0}
    out = []
    for r in rows:
        c = r.get("stated_curve")
        if not c or c[-1][0] != r["val_curve"][-1][0] or abs(c[-1][1] - r["val_after"]) > 1e-9:
            continue
        out.append({**r, "val_before": before.get(r["seed"]), "val_after": c[-1][2]})
    return out


def stated_section(task: str, rows: list[dict], labels: list[str], dest: Path) -> Optional[str]:
    """Each method against GRPO with every validation response scored by the result it
    states (:func:`stated_success`), over the runs that kept their responses; None when
    no method has 2 seeds paired with GRPO. The methods with at least 2 seeds paired with GRPO
    are corrected as one family, as in the main table."""
    from pepo.study import power  # scipy: only the study's report needs it

    scored = stated_results(rows)
    base = {r["seed"] for r in scored if r["method"] == labels[0]}
    found = [k for k in labels[1:] if any(r["method"] == k for r in scored)]
    if not any(sum(r["method"] == k and r["seed"] in base for r in scored) >= 2 for k in found):
        return None
    shift = [r["stated_curve"][-1][2] - r["stated_curve"][-1][1] for r in scored
             if r["method"] in labels]  # the runs of the table below, not an ablation's
    return (f"### {task}: scored by the result each response states\n\n"
            "math-verify reads the last number a free-text response writes as its answer. "
            "Here each validation response whose last `= n` states a result is scored by that "
            "result instead (the verifier's verdict stands where it states none: "
            "`pepo.study.rescore`), over the runs that kept their validation responses "
            f"(`validation.dump`). The second scoring moves a run's final accuracy by "
            f"{100 * min(shift):+.1f} to {100 * max(shift):+.1f} points "
            f"(mean {100 * statistics.fmean(shift):+.1f}).\n\n"
            + power.report(scored, labels[0], found, dest, f"images/{task}_study/stated",
                           f"{task}: methods - GRPO, scored by the stated result"))


def main(argv: Optional[Sequence[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", type=Path,
                    help="run directories with val_rollouts/ (validation.dump=true)")
    args = ap.parse_args(argv)
    print("| run | step | responses | verifier, % | stated result, % | difference, points |")
    print("|---|---:|---:|---:|---:|---:|")
    for run in args.runs:
        try:
            curve = validation_curve(run)
        except ValueError as e:  # a dump that cannot be read, named
            raise SystemExit(f"error: {e}") from None
        if curve is None:
            raise SystemExit(f"error: {run} has no validation dumps (val_rollouts/step_*.jsonl); "
                             f"run it with validation.dump=true")
        name = "/".join(run.resolve().parts[-2:])
        for step, verifier, stated, n in curve:
            print(f"| {name} | {step} | {n} | {100 * verifier:.1f} | {100 * stated:.1f} | "
                  f"{100 * (stated - verifier):+.1f} |")


if __name__ == "__main__":
    main()
