"""The strategy comparison on the embedded task: every method × seeds → docs/results.md.

    python scripts/compare_strategies.py [--seeds 0 1 2] [--out comparison_runs] [--only group]

Runs the ``tiny`` config (group mode) with GRPO, 80/20, 80/20 with the proximal score,
Entropy Adv., PEPO and the windowed average, and the ``tiny_spo`` config (single-stream) with
SPO, S-80/20, S-Entropy Adv. and PESPO, once per seed (the seed sets the prompt order and the
sampling; the warm-start checkpoint is the same). Each run is the recipe in this process, as
``tune run pepo_recipe`` would run it. Writes ``results.json`` and ``comparison.png`` into
``--out`` and the Markdown report ``docs/results.md`` (validation avg@8 before and after as
mean ± sample SD over seeds, step time relative to the baseline of the same mode measured in
the same invocation, and the diagnostics of ``pepo.analysis`` for one PEPO run). Resumable:
finished runs (a ``result.json`` in their directory) are read back, not rerun.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from omegaconf import OmegaConf

import pepo_recipe
from pepo import analysis
from pepo.recipe_config import find_config, register_resolvers

ROOT = Path(__file__).resolve().parents[1]

METHODS = {
    "group": [
        ("GRPO", {"name": "uniform"}),
        ("80/20", {"name": "global_topk"}),
        ("80/20, proximal score", {"name": "global_topk", "global_topk": {"score": "proximal"}}),
        ("Entropy Adv.", {"name": "entropy_bonus"}),
        ("PEPO", {"name": "proximal_softmax"}),
        ("windowed average", {"name": "window_average"}),
    ],
    "single_stream": [
        ("SPO", {"name": "uniform"}),
        ("S-80/20", {"name": "global_topk"}),
        ("S-Entropy Adv.", {"name": "entropy_bonus"}),
        ("PESPO", {"name": "proximal_softmax"}),
    ],
}
CONFIG = {"group": "tiny", "single_stream": "tiny_spo"}


def slug(label: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in label).strip("_").lower()


def run_one(mode: str, label: str, strategy: dict, seed: int, out: Path, val_every: int) -> dict:
    run_dir = out / mode / slug(label) / f"seed_{seed}"
    done = run_dir / "result.json"
    if done.is_file():
        return json.loads(done.read_text())
    register_resolvers()
    cfg = OmegaConf.load(find_config(CONFIG[mode]))
    cfg = OmegaConf.merge(cfg, {"seed": seed, "output_dir": str(run_dir), "strategy": strategy,
                                "validation": {"every": val_every}, "plot": False,
                                "save_every": 0, "keep_checkpoints": 1})
    t0 = time.perf_counter()
    recipe = pepo_recipe.recipe_main(cfg, log_config=False)
    val = [(h["step"], h["val_accuracy"]) for h in recipe.history if "val_accuracy" in h]
    steps = [h["step_time"] for h in recipe.history if "step_time" in h]
    result = {
        "mode": mode, "method": label, "seed": seed, "val_curve": val,
        "val_before": val[0][1], "val_after": val[-1][1],
        "step_time_median": statistics.median(steps), "wall_s": time.perf_counter() - t0,
        "rollouts_dir": str(run_dir / "rollouts"),
    }
    done.write_text(json.dumps(result, indent=2))
    print(f"{mode:13s} {label:24s} seed {seed}: {result['val_before']:.3f} -> "
          f"{result['val_after']:.3f}  ({result['wall_s']:.0f}s)", flush=True)
    return result


def mean_sd(xs: list[float]) -> str:
    if len(xs) < 2:
        return f"{100 * xs[0]:.1f}"
    return f"{100 * statistics.mean(xs):.1f} ± {100 * statistics.stdev(xs):.1f}"


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), dpi=110, sharey=True)
    for ax, mode in zip(axes, ("group", "single_stream")):
        for label, _ in METHODS[mode]:
            runs = [r for r in results if r["mode"] == mode and r["method"] == label]
            if not runs:
                continue
            steps = [s for s, _ in runs[0]["val_curve"]]
            mean = [statistics.mean(r["val_curve"][i][1] for r in runs) for i in range(len(steps))]
            ax.plot(steps, mean, "o-", label=f"{label} (n={len(runs)})")
        ax.set_title(f"{CONFIG[mode]} ({mode.replace('_', '-')})")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    axes[0].set_ylabel("validation avg@8 (mean over seeds)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def report(results: list[dict], out: Path, seeds: list[int]) -> str:
    lines = [
        "# Results on the embedded task",
        "",
        "Produced by `python scripts/compare_strategies.py --seeds "
        + " ".join(map(str, seeds)) + "` (rerun it to reproduce; finished runs are reused).",
        "Validation accuracy is avg@8 on the 64 held-out prompts, in %, as mean ± sample SD over "
        "seeds; step time is the median over a run's steps, relative to the mode's baseline "
        "(GRPO / SPO) measured in the same invocation on the same machine.",
        "",
    ]
    for mode in ("group", "single_stream"):
        base = [r["step_time_median"] for r in results
                if r["mode"] == mode and r["method"] == METHODS[mode][0][0]]
        lines += [f"## {CONFIG[mode]}: {mode.replace('_', '-')}", "",
                  "| method | seeds | before | after | step time vs " + METHODS[mode][0][0] + " |",
                  "|---|---:|---:|---:|---:|"]
        for label, _ in METHODS[mode]:
            runs = [r for r in results if r["mode"] == mode and r["method"] == label]
            if not runs:
                continue
            ratio = (statistics.mean(r["step_time_median"] for r in runs) / statistics.mean(base)
                     if base else float("nan"))
            lines.append(f"| {label} | {len(runs)} | {mean_sd([r['val_before'] for r in runs])} | "
                         f"{mean_sd([r['val_after'] for r in runs])} | {ratio:.2f}× |")
        lines.append("")
    lines += ["![validation accuracy over training](images/comparison.png)", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--out", default="comparison_runs")
    ap.add_argument("--only", choices=["group", "single_stream"], default=None)
    ap.add_argument("--val-every", type=int, default=20)
    ap.add_argument("--docs", default=str(ROOT / "docs"))
    ap.add_argument("--discussion", default=str(ROOT / "docs" / "results_discussion.md"),
                    help="Markdown appended to the report (what the numbers mean)")
    args = ap.parse_args()
    out = Path(args.out)
    results = []
    for mode in ("group", "single_stream"):
        if args.only and mode != args.only:
            continue
        for seed in args.seeds:  # seeds outermost: a partial study still covers every method
            for label, strategy in METHODS[mode]:
                results.append(run_one(mode, label, strategy, seed, out, args.val_every))
    docs = Path(args.docs)
    (docs / "images").mkdir(parents=True, exist_ok=True)
    plot(results, docs / "images" / "comparison.png")
    (out / "results.json").write_text(json.dumps(results, indent=2))
    text = report(results, out, args.seeds)
    pepo_run = next((r for r in results if r["method"] == "PEPO"), None)
    if pepo_run is not None:
        rollouts = out / "group" / slug("PEPO") / f"seed_{pepo_run['seed']}" / "rollouts"
        files = analysis.run(rollouts, docs / "images" / "pepo_tiny_analysis",
                             windows=(5, 11, 21))
        text += ("\n## Diagnostics of one PEPO run (seed {seed})\n\n"
                 "`python -m pepo.analysis {d} --out docs/images/pepo_tiny_analysis "
                 "--windows 5 11 21`\n\n![positional bias](images/pepo_tiny_analysis/"
                 "positional_bias.png)\n\n{diff}\n{mass}").format(
            seed=pepo_run["seed"], d=rollouts,
            diff=files["difficulty_md"].read_text(), mass=files["mass_md"].read_text())
    discussion = Path(args.discussion) if args.discussion else None
    if discussion is not None and discussion.is_file():  # the authors' reading of the numbers
        text += "\n" + discussion.read_text()
    (docs / "results.md").write_text(text)
    print(f"wrote {docs / 'results.md'}")


if __name__ == "__main__":
    main()
