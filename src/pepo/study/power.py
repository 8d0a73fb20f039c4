"""Paired comparisons with confidence intervals, corrected for the number of comparisons, and
the smallest difference a study of that size resolves: what the real-model study reports.

Every method runs on the same seeds as the baseline (the seed sets the prompt order, the
sampling and the validation draws), so each seed gives one paired difference
``d_s = acc(method, s) - acc(baseline, s)`` of the final validation accuracy. For ``m`` methods
compared with one baseline:

* **the interval**: Student's t over the ``n`` differences, ``mean ± t_{1-α/(2m), n-1} · sd/√n``,
  Bonferroni's simultaneous ``1 - α`` interval: all ``m`` intervals hold together with
  probability at least ``1 - α``;
* **the test**: the paired t test's two-sided p value, Holm-adjusted over the ``m`` comparisons
  (uniformly more powerful than Bonferroni, and it controls the same family-wise error);
* **the resolvable difference**: ``(t_{1-α/(2m), n-1} + t_{power, n-1}) · sd/√n``, the true
  difference that a study with this spread of differences detects with probability ``power``
  at the corrected level (the usual normal-approximation formula with t quantiles; its exact
  power from the noncentral t is a little lower, :func:`exact_power`).

    python -m pepo.study.power RUNS_DIR --task smollm2_steps --out forest_smollm2_steps
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path
from typing import Any, Optional, Sequence

from scipy import stats

from pepo.study.methods import METHODS, read_result

__all__ = ["exact_power", "holm", "paired", "comparisons", "check_comparable", "no_spread",
           "forest_plot", "report", "seed_table", "collect", "write_result"]

# what must be equal for two runs' accuracies to be compared (where a result records it)
SETTINGS = ("task", "mode", "num_steps", "val_k", "val_problems")


def no_spread(diffs: Sequence[float]) -> bool:
    """Whether paired differences are all the same up to float rounding: accuracies are counts
    over the validation set (``k / 418``), so a gain of the same count on every seed differs in
    its last bits, an sd of 1e-17 and a t of 1e14, not 0."""
    mean = statistics.fmean(diffs)
    return max(abs(d - mean) for d in diffs) <= 1e-9 * max(1.0, abs(mean))


def check_comparable(results: Sequence[dict]) -> None:
    """Refuses results that cannot be compared: a ``val_after`` that is not a finite number,
    runs whose :data:`SETTINGS` or ``overrides`` (compare's ``--set``) differ (a run of 8 steps
    beside runs of 40, single-stream beside group mode, another learning rate; a result without
    ``overrides``, of an older pepo or restored, is not compared on them), or two results of
    one method and seed (a copied file would count a seed twice, as two pairs).

    Raises:
        ValueError: naming the run (method and seed) and the setting.
    """
    first = with_overrides = None
    seen = set()
    for r in results:
        name = f"run {r.get('method')!r} seed {r.get('seed')}"
        if (r.get("method"), r.get("seed")) in seen:
            raise ValueError(f"{name} has two results: each seed of a method is counted once "
                             f"(remove the copy)")
        seen.add((r.get("method"), r.get("seed")))
        v = r.get("val_after")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"{name}: val_after is {v!r}, not a finite accuracy")
        if "overrides" in r:  # compare's --set; results of an older pepo, restored ones, lack
            with_overrides = with_overrides or r  # it: not known, so not compared
        pairs = [*((k, first) for k in SETTINGS), *(
            [("overrides", with_overrides)] if "overrides" in r else [])]
        for key, other in pairs:
            if other is not None and other is not r and r.get(key) != other.get(key):
                raise ValueError(
                    f"{name} has {key}={r.get(key)!r} where run {other.get('method')!r} seed "
                    f"{other.get('seed')} has {other.get(key)!r}: runs of other settings are "
                    f"not compared (keep one setting per study directory)")
        first = first or r


def paired(diffs: Sequence[float], m: int = 1, alpha: float = 0.05,
           power: float = 0.8) -> dict[str, Any]:
    """Statistics of ``n >= 2`` paired differences, one comparison of ``m``: mean, sd, t, the
    uncorrected p, the Bonferroni-simultaneous interval ``[lo, hi]`` and the difference resolvable
    with ``power`` (both at level ``alpha / m``). Differences without spread (every seed the
    same, sd 0) are not testable: ``p``, ``lo``, ``hi`` and ``resolvable`` are NaN there, not a
    p of 0 and an interval of zero width.

    Raises:
        ValueError: fewer than 2 differences, ``m < 1``, or ``alpha``/``power`` outside (0, 1).
    """
    n = len(diffs)
    if n < 2:
        raise ValueError(f"a paired interval needs at least 2 differences, got {n}")
    if isinstance(m, bool) or not isinstance(m, int) or m < 1:
        raise ValueError(f"m (the number of comparisons) must be an int >= 1, got {m!r}")
    for name, v in (("alpha", alpha), ("power", power)):
        if not 0.0 < v < 1.0:
            raise ValueError(f"{name} must be in (0, 1), got {v!r}")
    mean = statistics.fmean(diffs)
    sd = statistics.stdev(diffs)
    se = sd / math.sqrt(n)
    crit = float(stats.t.ppf(1 - alpha / (2 * m), n - 1))
    if not no_spread(diffs):
        t = mean / se
        p = float(2 * stats.t.sf(abs(t), n - 1))
        lo, hi = mean - crit * se, mean + crit * se
        resolvable = (crit + float(stats.t.ppf(power, n - 1))) * se
    else:  # every seed gave the same difference: no spread to test against
        t = 0.0 if mean == 0 else math.copysign(math.inf, mean)
        p = lo = hi = resolvable = math.nan
    return {"n": n, "mean": mean, "sd": sd, "t": t, "p": p, "lo": lo, "hi": hi,
            "resolvable": resolvable, "m": m, "alpha": alpha, "power": power}


def exact_power(n: int, m: int, alpha: float = 0.05, power: float = 0.8) -> float:
    """The exact power of the two-sided paired t test (``n`` differences, level ``alpha / m``)
    at the resolvable difference of :func:`paired`, from the noncentral t distribution: what
    its approximation's nominal ``power`` is in fact (0.78 for n = 10, m = 5 at 0.8)."""
    crit = float(stats.t.ppf(1 - alpha / (2 * m), n - 1))
    nc = crit + float(stats.t.ppf(power, n - 1))  # resolvable / (sd / sqrt(n))
    # the lower tail P(T < -crit) as P(T' > crit) with T' = -T (noncentrality -nc): the same
    # number, where scipy's nct.cdf gives NaN for some (n, m), e.g. 3 seeds and 5 comparisons
    return float(stats.nct.sf(crit, n - 1, nc) + stats.nct.sf(crit, n - 1, -nc))


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm's step-down adjustment of ``m`` p values (in their order): the smallest is multiplied
    by ``m``, the next by ``m - 1`` and so on, made monotone, capped at 1.

    Raises:
        ValueError: a p value that is not a number in [0, 1] (NaN has no place in the order).
    """
    bad = [p for p in pvalues if not 0.0 <= p <= 1.0]  # NaN fails both comparisons
    if bad:
        raise ValueError(f"holm: p values must be numbers in [0, 1], got {bad[0]!r}")
    m = len(pvalues)
    order = sorted(range(m), key=lambda i: pvalues[i])
    adjusted, running = [0.0] * m, 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * pvalues[i]))
        adjusted[i] = running
    return adjusted


def comparisons(results: list[dict], base_label: str, labels: Sequence[str],
                alpha: float = 0.05, power: float = 0.8) -> dict[str, dict[str, Any]]:
    """Each of ``labels`` against ``base_label`` over the seeds both finished (``val_after``),
    corrected for the comparisons made: the labels with at least 2 paired seeds (a label with
    fewer gets ``{"n": k}`` only and is not counted, in the intervals and the resolvable
    difference as in Holm's p). Adds ``p_holm`` and wins / ties / losses; a comparison without
    spread counts in ``m`` and enters Holm's order as p = 1 (its own ``p_holm`` is NaN).

    Raises:
        ValueError: results :func:`check_comparable` refuses.
    """
    check_comparable(results)
    base = {r["seed"]: r["val_after"] for r in results if r["method"] == base_label}
    diffs = {label: [r["val_after"] - base[r["seed"]]
                     for r in sorted(results, key=lambda r: r["seed"])
                     if r["method"] == label and r["seed"] in base] for label in labels}
    m = sum(len(d) >= 2 for d in diffs.values())
    out: dict[str, dict[str, Any]] = {}
    for label, d in diffs.items():
        if len(d) < 2:
            out[label] = {"n": len(d)}
            continue
        out[label] = paired(d, m=m, alpha=alpha, power=power)
        out[label].update(wins=sum(x > 0 for x in d), ties=sum(x == 0 for x in d),
                          losses=sum(x < 0 for x in d))
    tested = [k for k in out if "p" in out[k]]
    ps = [out[k]["p"] for k in tested]
    for k, p, adjusted in zip(tested, ps, holm([1.0 if math.isnan(p) else p for p in ps])):
        out[k]["p_holm"] = math.nan if math.isnan(p) else adjusted
    return out


def forest_plot(comps: dict[str, dict[str, Any]], base_label: str, path: Path,
                title: str) -> None:
    """Mean paired difference (points) with its simultaneous interval, one row per method
    tested (a comparison without spread has no interval: it is left out)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [(k, v) for k, v in comps.items() if "lo" in v and not math.isnan(v["lo"])]
    fig, ax = plt.subplots(figsize=(7.5, 0.55 * len(rows) + 1.4), dpi=110)
    for y, (label, v) in enumerate(reversed(rows)):
        ax.plot([100 * v["lo"], 100 * v["hi"]], [y, y], "-", color="tab:blue", lw=2)
        ax.plot([100 * v["mean"]], [y], "o", color="tab:blue")
    ax.axvline(0.0, color="black", lw=0.8)
    ax.set_ylim(-0.7, len(rows) - 0.3)
    ax.set_yticks(range(len(rows)), [f"{k} (n={v['n']})" for k, v in reversed(rows)])
    level = 100 * (1 - rows[0][1]["alpha"]) if rows else 95
    ax.set_xlabel(f"final validation accuracy − {base_label}, points "
                  f"(mean, {level:.0f}% simultaneous interval)")
    ax.set_title(title, fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _fmt_p(p: float) -> str:
    return f"{p:.3f}" if p >= 0.001 else f"{p:.1e}"


def seed_table(results: list[dict], labels: Sequence[str]) -> str:
    """Each run's final validation accuracy (%), one row per label and one column per seed any
    of them ran (``–`` where a method has not run that seed), with the run's paired difference
    against the first label below it: what a study in progress has, seed by seed."""
    by = {(r["method"], r["seed"]): r["val_after"] for r in results}
    seeds = sorted({s for (m, s) in by if m in labels})
    if not seeds:
        return ""
    lines = ["| method | " + " | ".join(f"seed {s}" for s in seeds) + " |",
             "|---|" + "---:|" * len(seeds)]
    for label in labels:
        if not any((label, s) in by for s in seeds):
            continue
        lines.append(f"| {label} | " + " | ".join(
            f"{100 * by[label, s]:.1f}" if (label, s) in by else "–" for s in seeds) + " |")
        if label != labels[0]:
            lines.append(f"| − {labels[0]} | " + " | ".join(
                f"{100 * (by[label, s] - by[labels[0], s]):+.1f}"
                if (label, s) in by and (labels[0], s) in by else "–" for s in seeds) + " |")
    return "\n".join(lines)


def report(results: list[dict], base_label: str, labels: Sequence[str], out: Path,
           image_prefix: str, title: str, alpha: float = 0.05, power: float = 0.8) -> str:
    """The Markdown table of ``labels`` against ``base_label`` (before, after, Δ with its
    simultaneous interval, Holm-adjusted p, W/T/L, the resolvable difference), the forest plot
    ``out/forest.png`` (linked as ``image_prefix/forest.png``) and the :func:`seed_table`."""
    comps = comparisons(results, base_label, labels, alpha, power)
    m = sum("lo" in v for v in comps.values())  # the comparisons made (paired seeds)
    lines = [f"| method | seeds | before | after | Δ vs {base_label}, points "
             f"[{100 * (1 - alpha):.0f}% simultaneous CI] | "
             f"p (Holm, {m} comparison{'s' * (m != 1)}) | wins/ties/losses | resolvable Δ |",
             "|---|---:|---:|---:|---|---:|---:|---:|"]

    def acc(label: str, key: str) -> str:
        xs = [r[key] for r in results if r["method"] == label and r.get(key) is not None]
        if not xs:
            return "–"
        return (f"{100 * statistics.fmean(xs):.1f} ± {100 * statistics.stdev(xs):.1f}"
                if len(xs) > 1 else f"{100 * xs[0]:.1f}")

    for label in [base_label, *labels]:
        n = sum(r["method"] == label for r in results)
        if not n:
            continue
        v = comps.get(label, {})
        # the seeds column counts every run; Δ only those whose seed the baseline has too
        over = f" over {v['n']} paired seeds" if "lo" in v and v["n"] != n else ""
        if label == base_label:
            cells = "(baseline) | | |"
        elif "lo" in v and math.isnan(v["p"]):
            cells = (f"{100 * v['mean']:+.1f} on every seed{over}: no spread, not testable | – | "
                     f"{v['wins']}/{v['ties']}/{v['losses']} | –")
        elif "lo" in v:
            cells = (f"{100 * v['mean']:+.1f} [{100 * v['lo']:+.1f}, {100 * v['hi']:+.1f}]{over} | "
                     f"{_fmt_p(v['p_holm'])} | {v['wins']}/{v['ties']}/{v['losses']} | "
                     f"{100 * v['resolvable']:.1f}")
        else:
            cells = f"({v.get('n', 0)} paired seed(s)) | | |"
        lines.append(f"| {label} | {n} | {acc(label, 'val_before')} | {acc(label, 'val_after')} "
                     f"| {cells} |")
    spread = [v for v in comps.values() if "sd" in v and not math.isnan(v["p"])]
    sds = [v["sd"] for v in spread]
    if sds:
        ns = [v["n"] for v in spread]
        resolvable = statistics.median(v["resolvable"] for v in spread)
        exact = sorted({round(exact_power(v["n"], v["m"], alpha, power), 2) for v in spread})
        lines += ["", f"Seeds paired per comparison: {min(ns)}–{max(ns)}. The SD of the paired "
                  f"differences is {100 * min(sds):.1f}–{100 * max(sds):.1f} points (median "
                  f"{100 * statistics.median(sds):.1f}); at that spread the study resolves a true "
                  f"difference of about {100 * resolvable:.1f} "
                  f"points with probability {power:.0%} at the corrected level (last column: "
                  f"per comparison; the usual t approximation, whose exact power from the "
                  f"noncentral t is {min(exact):.0%}" + (f"–{max(exact):.0%}" if len(exact) > 1
                                                        else "") + ")."]
        # Holm's step-down p can pass where the Bonferroni interval holds 0 (and never the
        # other way): name such rows rather than print two verdicts that disagree
        split = [k for k, v in comps.items() if "lo" in v and not math.isnan(v["p"])
                 and v["p_holm"] < alpha and v["lo"] <= 0 <= v["hi"]]
        if split:
            lines += ["", f"{', '.join(split)}: Holm's p is below {alpha:g} while the "
                      f"simultaneous interval (Bonferroni's, at {alpha:g}/{m} each) still holds "
                      f"0; Holm's test is the more powerful of the two, the interval the more "
                      f"conservative."]
        out.mkdir(parents=True, exist_ok=True)
        forest_plot(comps, base_label, out / "forest.png", title)
        lines += ["", f"![paired differences]({image_prefix}/forest.png)"]
    seeds = seed_table(results, [base_label, *labels])
    if seeds:
        lines += ["", "Final validation accuracy of each run (%), and its difference from "
                  f"{base_label} on the same seed (points):", "", seeds]
    return "\n".join(lines)


NEEDED = ("method", "seed", "val_after")  # what the comparisons read of a result


def collect(runs: Path, task: str, dest: Path, mode: str = "group") -> list[dict]:
    """Every finished run's ``result.json`` of ``task`` in ``mode`` under the study directory
    ``runs``, also copied to ``dest/results/<method>_seed_<n>.json`` (what the report is
    recomputed from) without its ``checkpoint`` (a path of the machine that ran it)."""
    results = []
    (dest / "results").mkdir(parents=True, exist_ok=True)
    for f in sorted((runs / task / mode).glob("*/seed_*/result.json")):
        r = read_result(f, NEEDED)
        results.append(r)
        write_result(r, dest / "results" / f"{f.parent.parent.name}_{f.parent.name}.json")
    return results


def write_result(r: dict, path: Path) -> None:
    """A run's result JSON as the docs keep it: without its ``checkpoint``, a path of the
    machine that ran it, and with ``"<a path>"`` for any path among its ``--set`` overrides."""
    def no_paths(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: no_paths(x) for k, x in v.items()}
        if isinstance(v, list):
            return [no_paths(x) for x in v]
        return "<a path>" if isinstance(v, str) and v.startswith(("/", "~")) else v

    kept = {k: no_paths(v) if k == "overrides" else v for k, v in r.items() if k != "checkpoint"}
    path.write_text(json.dumps(kept, indent=2), encoding="utf-8")


def main(argv: Optional[Sequence[str]] = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", help="a study directory (--out of pepo.study.compare), or a folder "
                                 "of result JSONs (<method>_seed_<n>.json)")
    ap.add_argument("--task", default="smollm2_steps")
    ap.add_argument("--mode", default="group", choices=("group", "single_stream"),
                    help="the runs compared (their baselines differ: GRPO, SPO)")
    ap.add_argument("--base", default=None, help="the baseline (default: GRPO in group mode, "
                                                 "SPO in single-stream mode)")
    ap.add_argument("--methods", nargs="+", default=None,
                    help="labels to compare with --base, one family of comparisons (default: "
                         "the study's methods found, as pepo.study.compare's report tests them; "
                         "its optional ablations only when named)")
    ap.add_argument("--out", required=True, help="where forest.png (and results/) go")
    ap.add_argument("--alpha", type=float, default=0.05, help="the family-wise level, in (0, 1)")
    args = ap.parse_args(argv)
    if not 0 < args.alpha < 1:
        ap.error(f"--alpha: must be in (0, 1), got {args.alpha}")
    if args.methods and len(set(args.methods)) < len(args.methods):
        ap.error("--methods gives a label more than once")
    runs, out = Path(args.runs), Path(args.out)
    from pepo.training.config import check_output_dir

    tasks = sorted({p.parent.name for mode in ("group", "single_stream")  # a study directory's
                    for p in runs.glob(f"*/{mode}")})
    try:
        check_output_dir(out, "--out")
        if (runs / args.task).is_dir():
            results = collect(runs, args.task, out, args.mode)
        elif tasks:
            raise ValueError(f"--task {args.task!r} has no runs under the study directory "
                             f"{runs}; its tasks: {', '.join(tasks)}")
        else:  # result JSONs of one study (a docs folder): those of this task and mode
            results = [r for r in (read_result(f, NEEDED) for f in sorted(runs.glob("*.json")))
                       if r.get("task", args.task) == args.task
                       and r.get("mode", args.mode) == args.mode]
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    if not results:
        raise SystemExit(f"error: no finished {args.mode} runs of {args.task!r} under {runs}")
    args.base = args.base or {"group": "GRPO", "single_stream": "SPO"}[args.mode]
    if not any(r["method"] == args.base for r in results):
        raise SystemExit(f"error: --base {args.base!r} has no runs here; methods found: "
                         f"{', '.join(sorted({r['method'] for r in results}))}")
    found = {r["method"] for r in results}
    if args.methods and args.base in args.methods:
        raise SystemExit(f"error: --methods names the baseline {args.base!r}, which each method "
                         f"is compared with (as a comparison with itself it widens the others)")
    if args.methods and (absent := [m for m in args.methods if m not in found]):
        raise SystemExit(f"error: --methods {absent[0]!r} has no runs here (a smaller family "
                         f"would narrow the intervals); methods found: {', '.join(sorted(found))}")
    # default: the study's family, as its report tests it (optional ablations are their own)
    labels = args.methods or [k for k, _ in METHODS[args.mode] if k in found - {args.base}]
    if not labels:
        raise SystemExit(f"error: no method to compare with {args.base!r} here; name them with "
                         f"--methods (found: {', '.join(sorted(found))})")
    if left := sorted(found - {args.base, *labels}):
        print(f"not in this family (name them with --methods to test them): {', '.join(left)}")
    try:
        text = report(results, args.base, labels, out, str(out),
                      f"{args.task}: paired differences", alpha=args.alpha)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    print(text)
    return text


if __name__ == "__main__":
    main()
