"""The recipe's steps, back to back against another revision: this tree against ``--against``.

    python benchmarks/bench_recipe_ab.py --against REV [--config smollm2] [--runs 3]
        [--steps 4] [--median-steps 2 3] [--json FILE] [key=value ...]

Runs ``tune run pepo_recipe --config CONFIG num_steps=STEPS validation.every=0 save_every=0
plot=false dump_rollouts_every=0 [key=value ...]`` ``--runs`` times with this working tree
(uncommitted changes included) and as many times with revision ``REV`` (checked out into a
temporary ``git worktree``, removed at the end), one process per run, alternating (ABBA...), so
that a machine that slows down or speeds up during the comparison weighs on both sides alike.
Each side runs its own ``src/`` and ``recipes/`` (on ``PYTHONPATH``) and its own copy of the
config. Nothing else should run meanwhile: two heavy processes on a few cores slow each other
many times over.

Prints, per side, step 1's split (generation and rewards, old log-probs, update: the mean over
the runs, and its loss per run: equal losses on both sides mean the same rollouts, so the same
work), the median step time of ``--median-steps`` per run, each run's wall clock and peak
resident memory (the run's process tree), and the ratios of this tree to ``REV`` on the means.
From step 2 on the two sides may draw other rollouts (weights that differ in their last bits),
so compare those steps' times over several runs, and read step 1's as the like-for-like one.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from machine import cpu_name

ROOT = Path(__file__).resolve().parent.parent
_STEP_LINE = re.compile(r"^Step (\d+) \| (.*)$")
_PARTS = (("generation and rewards", "gen_time"), ("old log-probs and entropies", "logprob_time"),
          ("update", "update_time"), ("whole step", "step_time"))


def git(*args: str, cwd: Path = ROOT) -> str:
    """``git ARGS`` in ``cwd``; its stdout, stripped. Exits with git's message on failure."""
    res = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)
    if res.returncode != 0:
        sys.exit(f"git {' '.join(args)} failed: {res.stderr.strip() or res.stdout.strip()}")
    return res.stdout.strip()


def read_steps(output_dir: Path) -> dict[int, dict[str, float]]:
    """The training steps' metrics from the run's ``logs/*.txt`` (torchtune's ``DiskLogger``
    lines ``Step N | key:value ...``), by step; validation lines (no ``step_time``) left out."""
    steps: dict[int, dict[str, float]] = {}
    for path in sorted((output_dir / "logs").glob("*.txt")):
        for line in path.read_text(encoding="utf-8").splitlines():
            m = _STEP_LINE.match(line.strip())
            if not m:
                continue
            values = {}
            for item in m.group(2).split():
                key, _, value = item.partition(":")
                try:
                    values[key] = float(value)
                except ValueError:
                    continue
            if "step_time" in values:
                steps[int(m.group(1))] = values
    return steps


def tune_command() -> list[str]:
    """torchtune's ``tune``, beside this interpreter where it is (a virtualenv), else on PATH."""
    here = Path(sys.executable).parent / "tune"
    found = str(here) if here.exists() else shutil.which("tune")
    if found is None:
        sys.exit("`tune` not found: install the recipe's packages (README: pip install -e "
                 "\".[recipe]\")")
    return [found]


def config_path(tree: Path, config: str) -> str:
    """``config`` as a file when it is one, else ``tree``'s ``recipes/configs/<config>.yaml``."""
    if config.endswith((".yaml", ".yml")) and Path(config).is_file():
        return str(Path(config).resolve())
    path = tree / "recipes" / "configs" / f"{config}.yaml"
    if not path.is_file():
        sys.exit(f"config {config!r} not found in {tree.name}: no {path.relative_to(tree)}")
    return str(path)


def run_once(label: str, tree: Path, config: str, out: Path, steps: int,
             overrides: list[str]) -> dict:
    """One ``tune run pepo_recipe`` of ``tree``'s code; its steps, wall clock and peak RSS."""
    env = dict(os.environ)
    path = [str(tree / "src"), str(tree / "recipes")]
    env["PYTHONPATH"] = os.pathsep.join(path + ([env["PYTHONPATH"]] if env.get("PYTHONPATH")
                                                else []))
    cmd = tune_command() + [
        "run", "pepo_recipe", "--config", config_path(tree, config), f"output_dir={out}",
        f"num_steps={steps}", "validation.every=0", "save_every=0", "plot=false",
        "dump_rollouts_every=0", *overrides]
    out.mkdir(parents=True, exist_ok=True)
    log = out.parent / f"{out.name}.log"
    t0 = time.perf_counter()
    with open(log, "w", encoding="utf-8") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=tree)
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        except BaseException:  # Ctrl-C: the run ends with the benchmark, not after it
            proc.kill()
            proc.wait()
            raise
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        tail = log.read_text(encoding="utf-8", errors="replace").splitlines()[-15:]
        sys.exit(f"the {label} run failed (exit {proc.returncode}): {' '.join(cmd)}\n"
                 + "\n".join(tail))
    # ru_maxrss: kilobytes on Linux, bytes on macOS; the largest of the process and the
    # descendants it waited for (the reward workers), as /usr/bin/time reports it
    rss_gb = usage.ru_maxrss * (1 if sys.platform == "darwin" else 1024) / 1e9
    found = read_steps(out)
    if sorted(found) != list(range(1, steps + 1)):
        sys.exit(f"the {label} run logged steps {sorted(found)}, expected 1..{steps} "
                 f"(its log: {log})")
    return {"wall_s": wall, "peak_rss_gb": rss_gb, "steps": found}


def summarize(runs: list[dict], median_steps: list[int]) -> dict:
    """Step 1's split (means over the runs) and each run's median over ``median_steps``."""
    step1 = {key: statistics.fmean(r["steps"][1][key] for r in runs) for _, key in _PARTS}
    return {
        "step1": step1,
        "step1_loss": [r["steps"][1].get("loss") for r in runs],
        "median_steps": [statistics.median(r["steps"][s]["step_time"] for s in median_steps)
                         for r in runs],
        "wall_s": [r["wall_s"] for r in runs],
        "peak_rss_gb": [r["peak_rss_gb"] for r in runs],
        "runs": [{str(k): v for k, v in r["steps"].items()} for r in runs],  # every metric
    }


def steps_label(steps: list[int]) -> str:
    """``2-3`` for a run of consecutive steps, else ``2, 5, 7``."""
    if len(steps) > 1 and steps == list(range(steps[0], steps[-1] + 1)):
        return f"{steps[0]}-{steps[-1]}"
    return ", ".join(map(str, steps))


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def seconds(value: float) -> str:
    """Seconds to 0.1 s, or to 0.01 s below 10 s (a small config's steps)."""
    return f"{value:.2f}" if abs(value) < 10 else f"{value:.1f}"


def table(base: dict, new: dict, rev: str, here: str, median_steps: list[int]) -> str:
    """The comparison as a markdown table, this tree's column with its ratios to ``rev``'s."""
    def each(values: list[float], fmt=seconds) -> str:
        return ", ".join(fmt(v) for v in values)

    def ratio(a: float, b: float) -> str:  # none against a part that took no time
        return f" ({a / b:.2f}x)" if b >= 0.01 else ""

    span = steps_label(median_steps)
    rows = [f"| seconds | {rev} | this tree ({here}) |", "|---|---:|---:|"]
    for name, key in _PARTS:
        a, b = base["step1"][key], new["step1"][key]
        rows.append(f"| step 1: {name} (mean) | {seconds(a)} | {seconds(b)}{ratio(b, a)} |")
    loss = "{:.4g}".format
    rows.append(f"| step 1: loss, per run | {each(base['step1_loss'], loss)} | "
                f"{each(new['step1_loss'], loss)} |")
    a, b = statistics.fmean(base["median_steps"]), statistics.fmean(new["median_steps"])
    rows.append(f"| median of steps {span}, per run | {each(base['median_steps'])} | "
                f"{each(new['median_steps'])}{ratio(b, a)} |")
    a, b = statistics.fmean(base["wall_s"]), statistics.fmean(new["wall_s"])
    whole = "{:.0f}".format
    rows.append(f"| wall clock, per run | {each(base['wall_s'], whole)} | "
                f"{each(new['wall_s'], whole)}{ratio(b, a)} |")
    gb = "{:.1f}".format
    rows.append(f"| peak RSS GB, per run | {each(base['peak_rss_gb'], gb)} | "
                f"{each(new['peak_rss_gb'], gb)} |")
    return "\n".join(rows)


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--against", required=True, help="the revision to compare with (git)")
    ap.add_argument("--config", default="smollm2", help="a shipped config's name, or a file")
    ap.add_argument("--runs", type=int, default=3, help="runs per side")
    ap.add_argument("--steps", type=int, default=4, help="num_steps of each run")
    ap.add_argument("--median-steps", type=int, nargs="+", default=None,
                    help="the steps whose median step time is compared (default: 2-3)")
    ap.add_argument("--json", default=None, help="also write the figures to this file")
    args, overrides = ap.parse_known_args(argv)
    bad = [o for o in overrides if "=" not in o or o.startswith("-")]
    if bad:
        ap.error(f"unrecognized argument {bad[0]!r} (config overrides are key=value)")
    if args.runs < 1 or args.steps < 1:
        ap.error(f"--runs and --steps must be at least 1 (got {args.runs}, {args.steps})")
    if args.json and not Path(args.json).resolve().parent.is_dir():  # not after an hour's runs
        ap.error(f"--json {args.json}: {Path(args.json).resolve().parent} is not a directory")
    median_steps = sorted(set(args.median_steps or range(2, min(3, args.steps) + 1))) or [1]
    wrong = [s for s in median_steps if not 1 <= s <= args.steps]
    if wrong:
        ap.error(f"--median-steps {wrong[0]} is not a step of a {args.steps}-step run")
    git("rev-parse", "--is-inside-work-tree")
    rev = git("rev-parse", "--short", "--verify", f"{args.against}^{{commit}}")
    here = git("describe", "--always")
    if git("status", "--porcelain", "--untracked-files=normal", "--", "src", "recipes"):
        here += " with uncommitted changes"
    from pepo.training.precision import cpu_bf16_units

    units = ", ".join(cpu_bf16_units()) or "no bf16 units: compute_dtype=auto is fp32"
    print(f"# {cpu_name()} ({units}), {os.cpu_count()} CPUs; --config {args.config}, "
          f"{_count(args.steps, 'step')}, {_count(args.runs, 'run')} a side, alternating; "
          f"{rev} against this tree ({here})", flush=True)
    runs: dict[str, list[dict]] = {"base": [], "new": []}
    with tempfile.TemporaryDirectory(prefix="pepo-ab-") as tmp:
        base_tree = Path(tmp) / "base"
        git("worktree", "add", "--detach", str(base_tree), rev)
        try:
            trees = {"base": base_tree, "new": ROOT}
            for i in range(args.runs):
                for side in (("base", "new") if i % 2 == 0 else ("new", "base")):
                    label = f"{rev}" if side == "base" else "this tree"
                    res = run_once(label, trees[side], args.config,
                                   Path(tmp) / "runs" / f"{side}{i + 1}", args.steps, overrides)
                    runs[side].append(res)
                    med = statistics.median(res["steps"][s]["step_time"] for s in median_steps)
                    print(f"run {i + 1}/{args.runs}, {label}: {res['wall_s']:.0f} s, step 1 "
                          f"{seconds(res['steps'][1]['step_time'])} s, median of steps "
                          f"{steps_label(median_steps)} {seconds(med)} s, peak RSS "
                          f"{res['peak_rss_gb']:.1f} GB", flush=True)
        finally:
            git("worktree", "remove", "--force", str(base_tree))
    base, new = summarize(runs["base"], median_steps), summarize(runs["new"], median_steps)
    print()
    print(table(base, new, rev, here, median_steps))
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"against": rev, "tree": here, "config": args.config, "steps": args.steps,
             "median_steps": median_steps, "overrides": overrides, "cpu": cpu_name(),
             "base": base, "new": new}, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
