"""Puts a study's published runs back under a study directory, so that
:mod:`pepo.study.compare` goes on from them on another machine instead of training them again.

The report of ``pepo.study.compare`` copies each finished run's result JSON to
``docs/images/<task>_study/results/<method>_seed_<n>.json`` (everything the report's tables,
curves and second scoring read), and the rollout dumps its mechanism tables pool to
``docs/images/<task>_study/mechanism/<stage>/rollouts/<method>_seed_<n>_step_N.jsonl.gz``.
This writes each result as the ``result.json`` of its run directory under ``--out``, where
``compare`` reads finished runs back, and each dump as that run's ``rollouts/step_N.jsonl``::

    python -m pepo.study.restore docs/images/smollm2_steps_study --out study_runs

A run directory that already holds a result keeps it (a different one is an error: two
results for one run), and a dump already there is kept. Checkpoints and the other steps' dumps
are not published, so the intervention (which reads a checkpoint) is not restored.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import shutil
import zlib
from pathlib import Path
from typing import Optional, Sequence

from pepo.study.methods import (
    METHODS,
    RESULT_KEYS,
    methods,
    read_result,
    run_dir,
    saved_result,
    slug,
)
from pepo.training.config import check_output_dir

REQUIRED = RESULT_KEYS
DUMP = re.compile(r"(?P<method>.+)_seed_(?P<seed>[0-9]+)_(?P<step>step_[0-9]+)\.jsonl\.gz")


def read_published(path: Path) -> dict:
    """One published result JSON, checked: a clear error naming the file and what is wrong."""
    r = read_result(path)
    known = [label for label, _ in methods(r["mode"])] if r["mode"] in METHODS else []
    if r["method"] not in known:
        raise ValueError(f"{path}: method {r['method']!r} is not one of mode {r['mode']!r}'s: "
                         f"{', '.join(known) or 'none (unknown mode)'}")
    return r


def restore(results: Path, out: Path) -> tuple[int, int]:
    """Writes every ``*.json`` of ``results`` as its run's ``result.json`` under ``out``;
    returns (written, already there)."""
    files = sorted(results.glob("*.json"))
    if not files:
        raise ValueError(f"{results}: no result JSONs (*.json) there")
    rows = [(f, read_published(f)) for f in files]  # every file checked before any is written
    todo, kept = [], 0
    for f, r in rows:
        d = run_dir(out, r["task"], r["mode"], r["method"], int(r["seed"]))
        saved = saved_result(d)
        if saved is None:
            todo.append((d, r))
        elif {k: saved.get(k) for k in REQUIRED} == {k: r[k] for k in REQUIRED}:
            kept += 1
        else:
            raise ValueError(f"{d / 'result.json'} holds another result for {r['method']} "
                             f"seed {r['seed']} than {f}: left as it is")
    for d, r in todo:
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / "result.json.tmp"
        tmp.write_text(json.dumps(r, indent=2), encoding="utf-8")
        os.replace(tmp, d / "result.json")  # whole or absent, as compare writes it
    return len(todo), kept


def restore_dumps(mechanism: Path, out: Path, task: str) -> tuple[int, int]:
    """Writes every published dump under ``mechanism/*/rollouts`` back as its run's
    ``rollouts/step_N.jsonl`` (the run of method ``group``); returns (written, already there)."""
    labels = {slug(label): label for label, _ in methods("group")}
    found = [(f, DUMP.fullmatch(f.name)) for f in sorted(mechanism.glob("*/rollouts/*.jsonl.gz"))]
    for f, m in found:  # every name checked before any dump is written
        if m is None or m["method"] not in labels:
            raise ValueError(f"{f}: not a published dump (<method>_seed_<n>_step_N.jsonl.gz "
                             f"of a method of mode 'group')")
    written = kept = 0
    for f, m in found:
        d = run_dir(out, task, "group", labels[m["method"]], int(m["seed"])) / "rollouts"
        dest = d / f"{m['step']}.jsonl"
        if dest.is_file() or dest.with_suffix(".jsonl.gz").is_file():
            kept += 1
            continue
        d.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_suffix(".jsonl.tmp")
        try:
            with gzip.open(f, "rb") as src, open(tmp, "wb") as dst:
                shutil.copyfileobj(src, dst)
        except (EOFError, gzip.BadGzipFile, zlib.error) as e:  # a truncated or broken archive
            tmp.unlink(missing_ok=True)
            raise ValueError(f"{f}: cannot be decompressed ({type(e).__name__}: {e})") from None
        os.replace(tmp, dest)
        written += 1
    return written, kept


def main(argv: Optional[Sequence[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    ap.add_argument("study", help="a study's published folder (docs/images/<task>_study, "
                                  "with results/ and mechanism/), or a folder of result JSONs")
    ap.add_argument("--out", required=True, help="the study directory (compare's --out)")
    args = ap.parse_args(argv)
    study, out = Path(args.study), Path(args.out)
    results = study / "results" if (study / "results").is_dir() else study
    if not results.is_dir():
        raise SystemExit(f"error: {study} is not a folder of result JSONs")
    try:
        check_output_dir(out, "--out")
        written, kept = restore(results, out)
        tasks = {read_result(f)["task"] for f in results.glob("*.json")}
        dumps = (0, 0)
        if (study / "mechanism").is_dir():
            if len(tasks) != 1:
                raise ValueError(f"{results}: results of several tasks "
                                 f"({', '.join(sorted(tasks))}) beside one mechanism/ folder")
            dumps = restore_dumps(study / "mechanism", out, tasks.pop())
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    print(f"restored {written} run(s) and {dumps[0]} rollout dump(s) under {out}; "
          f"{kept} run(s) and {dumps[1]} dump(s) were there already")


if __name__ == "__main__":
    main()
