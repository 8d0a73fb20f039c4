"""The paper's bias diagnostics and token heatmaps, from the recipe's rollout dumps.

    python -m pepo.study.analysis pepo_runs/tiny/rollouts --out analysis/ [--windows 11 31 101]
    python -m pepo.study.analysis intervene --config tiny_drift \\
        --replacement RUN/checkpoints/step_N --budgets 0 5 10 15 20 30 \\
        --metrics global proximal --out intervention/

The first form reads one dump file (``rollouts/step_N.jsonl``, or ``.jsonl.gz``), a directory of
them or several such paths (pooled, each file's groups kept apart) and writes (the difficulty
table, the weight mass and the heatmap at ``--window``, default the largest of ``--windows``):

* ``positional_bias.png`` / ``.csv`` — the relative deviation ``(x_t - mean_t x) / mean_t x`` of
  global entropy ``H``, proximal entropy ``e`` (Eq. 6) and its softmax-free counterpart, the
  window ratio ``H_t / Σ_{k∈W(t)} H_k`` (App. E; ``window_average``'s statistic), from each
  rollout's own mean, averaged over the tokens in each bin of generation percentile ``t / T``
  (all rollouts' tokens pooled: a rollout weighs by its tokens in the bin; the paper's Fig. 2 and
  Fig. 4), for each window;
* ``difficulty_bias.md`` — prompts grouped by pass rate over their rollouts of one step into
  hard (≤ 1/8), moderate and easy (≥ 7/8), with the mean global and proximal entropy of their
  tokens, pooled over the group's rollouts (Table 1); needs group-mode dumps;
* ``heatmap.html`` — a few rollouts with each token coloured by ``H / mean H`` and by its PEPO
  weight ``c = e / mean e`` (Eq. 7), side by side (Fig. 3); self-contained, text escaped;
* ``profile.md`` / ``.json`` — the numbers that say whether a task has the paper's entropy
  structure: response lengths, the mean token entropy, the share of near-deterministic tokens
  (``H < 0.01``), the 80th percentile of token entropy, the share of all entropy held by the top
  20% of tokens, the mean entropy of the tokens in the first and the last tenth of their
  responses and the ratio of the two, the span (max - min over the 20 bins) of global entropy's
  positional deviation, the largest |deviation| of proximal entropy per window, and (group-mode
  dumps) each difficulty group's share of the rollouts and the hard / easy ratio of mean global
  entropy;
* ``weight_mass.csv`` / ``.md`` — the share of each strategy's token weight (computed from the
  dumped entropies with every advantage set to +1) by position decile and by difficulty group,
  and the share held by its 20% highest-weighted tokens (how far it is from uniform).

Everything runs on padded tensors with :mod:`pepo.weighting`, so thousands of 4k-token rollouts
take seconds.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import html
import json
import math
import shutil
import sys
import time
import zlib
from collections import defaultdict
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import torch

from pepo import weighting
from pepo.study.cli import DefaultsFormatter, count_arg, window_arg

__all__ = [
    "PROFILE_ROWS",
    "RolloutDump",
    "compare_stages",
    "difficulty_bias",
    "entropy_profile",
    "heatmap_html",
    "load_dump",
    "main",
    "positional_bias",
    "weight_mass",
]

GROUPS = ("hard", "moderate", "easy")


class RolloutDump:
    """Dumped rollouts as padded tensors.

    Attributes:
        entropies: ``[N, T]`` fp32, 0 at padding.
        mask: ``[N, T]`` bool.
        records: the dump records (without their per-token lists).
        tokens: per-rollout token strings.
    """

    def __init__(self, records: list[dict[str, Any]]) -> None:
        if not records:
            raise ValueError("the dump holds no rollouts")
        lengths = [len(r["entropies"]) for r in records]
        width = max(max(lengths), 1)
        self.entropies = torch.zeros(len(records), width)
        for i, r in enumerate(records):
            self.entropies[i, : lengths[i]] = torch.tensor(r["entropies"], dtype=torch.float32)
        self.mask = torch.arange(width) < torch.tensor(lengths)[:, None]
        self.tokens = [r.get("tokens") or [] for r in records]
        self.records = [
            {k: v for k, v in r.items() if k not in ("entropies", "tokens", "token_ids",
                                                     "token_advantages", "token_weights")}
            for r in records
        ]

    def __len__(self) -> int:
        return len(self.records)


def load_dump(path: Union[str, Path, Sequence[Union[str, Path]]]) -> RolloutDump:
    """Reads a rollout dump: one ``.jsonl`` file (or ``.jsonl.gz``) or a directory of them
    (sorted), or a list of such paths pooled. Each file's groups are kept apart from another
    file's (a file is one step of one run), so two runs that drew the same prompt at the same
    step are two groups, not one, whether their dumps are named one by one or sit in one
    directory. A directory's file kept both plain and compressed (``x.jsonl`` beside
    ``x.jsonl.gz``: ``pepo.study.restore`` decompresses beside the archive) is read once."""
    paths = [path] if isinstance(path, (str, Path)) else list(path)
    records = []
    source = 0
    for one in paths:
        p = Path(one)
        if p.is_dir():
            plain = {f.name for f in p.glob("*.jsonl")}
            files = sorted([*p.glob("*.jsonl"),
                            *(f for f in p.glob("*.jsonl.gz") if f.name[:-3] not in plain)])
        else:
            files = [p]
        if not files or not files[0].is_file():
            raise ValueError(f"no rollout dump at {str(p)!r} (a .jsonl file or a directory of "
                             f"them)")
        for f in files:
            source += 1
            try:
                with (gzip.open(f, "rt", encoding="utf-8") if f.name.endswith(".gz")
                      else open(f, encoding="utf-8")) as fh:
                    for n, line in enumerate(fh, 1):
                        if line.strip():
                            records.append({**_record(line, f, n), "source": source})
            except (OSError, EOFError, UnicodeDecodeError, zlib.error) as e:  # cut, not gzip
                raise ValueError(f"{f}: cannot be read as a rollout dump "
                                 f"({type(e).__name__}: {e})") from None
    return RolloutDump(records)


def _record(line: str, path: Path, n: int) -> dict[str, Any]:
    """One dump record, checked for what the analysis reads; errors name the file and line."""
    where = f"{path}:{n}"
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e.msg})") from None
    if not isinstance(rec, dict):
        raise ValueError(f"{where}: a record must be a JSON object, got {type(rec).__name__}")
    ent = rec.get("entropies")
    if not isinstance(ent, list) or not all(
        isinstance(x, (int, float)) and not isinstance(x, bool) for x in ent
    ):
        raise ValueError(f"{where}: 'entropies' must be a list of numbers, got {ent!r:.80}")
    reward = rec.get("reward")
    if isinstance(reward, bool) or not isinstance(reward, (int, float)):
        raise ValueError(f"{where}: 'reward' must be a number, got {reward!r:.80}")
    tokens = rec.get("tokens")
    if tokens is not None and (not isinstance(tokens, list) or len(tokens) != len(ent)):
        raise ValueError(f"{where}: 'tokens' must be a list as long as 'entropies' ({len(ent)})")
    return rec


def _relative_deviation(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``(x - mean) / mean`` per row over valid tokens; rows with mean 0 give 0."""
    n = mask.sum(-1, keepdim=True).clamp_min(1)
    mean = torch.where(mask, x, 0.0).sum(-1, keepdim=True) / n  # [N, 1]
    safe = torch.where(mean > 0, mean, 1.0)
    return torch.where(mask & (mean > 0), (x - mean) / safe, 0.0)


def _bins(mask: torch.Tensor, n_bins: int) -> torch.Tensor:
    """Generation-percentile bin of every token: ``floor(t / T * n_bins)``.

    A response of ``T < n_bins`` tokens puts its first token in the first bin and never reaches
    the last, so where many responses are short the first bin weighs more than the last; the
    midpoint rule ``floor((t + 1/2) / T * n_bins)`` is symmetric. The published tables use
    this rule (docs/results.md says by how much the midpoint rule differs on SmolLM2)."""
    t = torch.arange(mask.shape[1], dtype=torch.float32)
    T = mask.sum(-1, keepdim=True).clamp_min(1).float()
    return (t / T * n_bins).floor().clamp_max(n_bins - 1).long()  # [N, T]


def _binned_mean(x: torch.Tensor, mask: torch.Tensor, n_bins: int) -> torch.Tensor:
    b = _bins(mask, n_bins)[mask]
    sums = torch.zeros(n_bins).index_add_(0, b, x[mask].float())
    counts = torch.zeros(n_bins).index_add_(0, b, torch.ones_like(b, dtype=torch.float32))
    return torch.where(counts > 0, sums / counts.clamp_min(1), math.nan)  # a bin no token reached


def _cell(fmt: str, v: Any) -> str:
    """``v`` in ``fmt`` (``"{:.3f}"``), or "–" where there is no value (None, NaN, inf)."""
    return "–" if v is None or (isinstance(v, float) and not math.isfinite(v)) else fmt.format(v)


def _span(curve: torch.Tensor) -> float:
    """max - min over the bins some token reached."""
    seen = curve[~curve.isnan()]
    return float(seen.max() - seen.min()) if seen.numel() else math.nan


def positional_bias(
    r: RolloutDump, windows: Sequence[int] = (31, 51, 101), n_bins: int = 20
) -> dict[str, torch.Tensor]:
    """Mean relative deviation from the rollout mean per percentile bin: the mean over the bin's
    tokens, every rollout's pooled (a long response weighs more than a short one).

    Returns ``{"global": [n_bins], "proximal_W": [n_bins], "window_average_W": [n_bins], ...}``.
    """
    out = {"global": _binned_mean(_relative_deviation(r.entropies, r.mask), r.mask, n_bins)}
    for w in windows:
        e = weighting.proximal_entropy(r.entropies, r.mask, window=w)
        out[f"proximal_{w}"] = _binned_mean(_relative_deviation(e, r.mask), r.mask, n_bins)
        lin = weighting.window_average_entropy(r.entropies, r.mask, window=w)  # App. E
        out[f"window_average_{w}"] = _binned_mean(_relative_deviation(lin, r.mask), r.mask, n_bins)
    return out


def _difficulty(r: RolloutDump) -> list[Optional[str]]:
    """hard / moderate / easy per rollout, from its prompt's pass rate within its step: the
    share of its rollouts whose record says ``success`` (the reward's own rule, as the trainer
    counts it; dumps without the flag: reward > 0). A step's group is its ``group`` (dumps
    without it: its prompt, which merges two groups of one prompt in a step)."""
    groups: dict[tuple, list[int]] = defaultdict(list)
    for i, rec in enumerate(r.records):
        group = rec["group"] if rec.get("group") is not None else rec.get(
            "prompt_id", rec.get("prompt"))
        groups[(rec.get("source"), rec.get("step"), group)].append(i)
    out: list[Optional[str]] = [None] * len(r)
    for members in groups.values():
        if len(members) < 2:
            continue  # single-stream: no pass rate within the step
        rate = sum(bool(r.records[i].get("success", r.records[i]["reward"] > 0))
                   for i in members) / len(members)
        label = "hard" if rate <= 1 / 8 else "easy" if rate >= 7 / 8 else "moderate"
        for i in members:
            out[i] = label
    return out


def difficulty_bias(r: RolloutDump, window: int = 101) -> dict[str, dict[str, float]]:
    """Mean global and proximal entropy of the tokens of each difficulty group (Table 1), pooled
    over the group's tokens (not a mean of per-rollout means)."""
    labels = _difficulty(r)
    e = weighting.proximal_entropy(r.entropies, r.mask, window=window)
    out = {}
    for g in GROUPS:
        rows = torch.tensor([lab == g for lab in labels])
        m = r.mask & rows[:, None]
        n = int(m.sum())
        if rows.any():  # a group of empty responses is counted, its means missing (NaN)
            out[g] = {"global": float(r.entropies[m].mean()) if n else math.nan,
                      "proximal": float(e[m].mean()) if n else math.nan,
                      "rollouts": int(rows.sum()), "tokens": n}
    return out


NEAR_DETERMINISTIC = 0.01  # nats: a token below this is (nearly) decided before it is sampled


def _top20_share(x: torch.Tensor) -> float:
    """Share of ``x.sum()`` held by its largest 20% of values (at least one)."""
    top = x.sort(descending=True).values[: max(1, int(0.2 * x.numel()))]
    return float(top.sum() / x.sum().clamp_min(1e-30))


def entropy_profile(r: RolloutDump, windows: Sequence[int] = (31, 51, 101),
                    n_bins: int = 20) -> dict[str, float]:
    """Summary numbers of a dump's entropy structure (see the module docstring)."""
    lengths = r.mask.sum(-1).float()
    h = r.entropies[r.mask]
    curves = positional_bias(r, windows, n_bins)
    tenths = _binned_mean(r.entropies, r.mask, 10)  # pooled over the tokens of each tenth
    out = {
        "rollouts": float(len(r)),
        "length_min": float(lengths.min()),
        "length_mean": float(lengths.mean()),
        "length_max": float(lengths.max()),
        "mean_entropy": float(h.mean()),
        "near_deterministic_share": float((h < NEAR_DETERMINISTIC).float().mean()),
        "entropy_p80": _quantile(h, 0.8),
        "top20_entropy_share": _top20_share(h),
        "first_tenth_entropy": float(tenths[0]),
        "last_tenth_entropy": float(tenths[-1]),
        "first_over_last_tenth": float(tenths[0] / tenths[-1]) if tenths[-1] > 0 else math.nan,
        "global_span": _span(curves["global"]),
    }
    for w in windows:
        c = curves[f"proximal_{w}"].abs()
        out[f"proximal_{w}_max_abs"] = float(c[~c.isnan()].max()) if (~c.isnan()).any() \
            else math.nan
    diff = difficulty_bias(r, max(windows))
    if diff:  # group-mode dumps: each group's share of the rollouts and hard / easy entropy
        for g in GROUPS:
            out[f"{g}_share"] = diff[g]["rollouts"] / len(r) if g in diff else 0.0
        if "hard" in diff and "easy" in diff and diff["easy"]["global"] > 0:
            out["hard_over_easy_entropy"] = diff["hard"]["global"] / diff["easy"]["global"]
    return out


def _quantile(x: torch.Tensor, q: float) -> float:
    """The ``q`` quantile of ``x`` with linear interpolation (``numpy.quantile``'s default);
    by sorting, since ``torch.quantile`` refuses more than 2^24 values."""
    v = x.double().sort().values
    pos = q * (v.numel() - 1)
    lo = int(pos)
    hi = min(lo + 1, v.numel() - 1)
    return float(v[lo] + (pos - lo) * (v[hi] - v[lo]))


STRATEGIES = {
    "uniform (GRPO)": ("uniform", {}),
    "global_topk (80/20)": ("global_topk", {"fraction": 0.2}),
    "global_topk, proximal score": ("global_topk", {"fraction": 0.2, "score": "proximal"}),
    "entropy_bonus (Entropy Adv.)": ("entropy_bonus", {}),
    "proximal_softmax (PEPO)": ("proximal_softmax", {}),
    "window_average": ("window_average", {}),
    "proximal_softmax, τ = 0.5": ("proximal_softmax", {"temperature": 0.5}),
    "proximal_softmax, τ = 2": ("proximal_softmax", {"temperature": 2.0}),
}


def weight_mass(r: RolloutDump, window: int = 101) -> dict[str, dict[str, float]]:
    """Share of each strategy's total token weight by position decile and difficulty group,
    and the share its 20% highest-weighted tokens hold (``top20``; 0.2 for uniform weights).

    Weights are the strategies' token advantages with every sequence advantage set to +1,
    computed step by step (``global_topk`` selects within each step's batch, as in training).
    """
    labels = _difficulty(r)
    deciles = _bins(r.mask, 10)
    ones = torch.ones(len(r))
    by_step: dict[Any, list[int]] = defaultdict(list)
    for i, rec in enumerate(r.records):
        by_step[(rec.get("source"), rec.get("step"))].append(i)
    steps = {k: torch.tensor(v) for k, v in by_step.items()}
    out = {}
    for name, (strategy, params) in STRATEGIES.items():
        if strategy in ("proximal_softmax", "window_average") or params.get("score") == "proximal":
            params = {**params, "window": window}
        fn = weighting.get_strategy(strategy, **params)
        w = torch.zeros_like(r.entropies)  # [N, T]
        for idx in steps.values():  # per step: global_topk's threshold is over one batch
            w[idx] = fn(ones[idx], r.entropies[idx], r.mask[idx])
        total = float(w[r.mask].sum()) or 1.0
        row = {f"decile_{d + 1}": float(w[r.mask & (deciles == d)].sum()) / total
               for d in range(10)}
        for g in GROUPS:
            rows = torch.tensor([lab == g for lab in labels])
            row[g] = float(w[r.mask & rows[:, None]].sum()) / total
        row["top20"] = _top20_share(w[r.mask])
        out[name] = row
    return out


def _colour(v: float, lo: float = 0.0, hi: float = 3.0) -> str:
    """White at 1 (the mean), red above, blue below, saturating at ``hi`` / ``lo``."""
    if v >= 1:
        a = min((v - 1) / (hi - 1), 1.0)
        return f"rgba(220,40,40,{a:.3f})"
    a = min((1 - v) / (1 - lo), 1.0)
    return f"rgba(40,90,220,{0.6 * a:.3f})"


def heatmap_html(r: RolloutDump, indices: Sequence[int], window: int = 101) -> str:
    """Self-contained HTML: each rollout's tokens coloured by ``H / mean H`` (left) and by the
    PEPO weight ``c`` (right). Token text is HTML-escaped."""
    c = weighting.get_strategy("proximal_softmax", window=window, apply_to="all")(
        torch.ones(len(r)), r.entropies, r.mask
    )
    parts = [
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        "<title>pepo token heatmap</title><style>"
        "body{font-family:sans-serif;margin:1.5em}"
        ".pair{display:flex;gap:1.5em;margin-bottom:2em}"
        ".col{flex:1;border:1px solid #ccc;padding:.6em}"
        ".tok{font-family:monospace;white-space:pre-wrap;border-radius:2px}"
        "h2{font-size:1em}h3{font-size:.9em;margin:.2em 0 .5em}"
        "</style></head><body>",
        f"<h1>Token heatmap</h1><p>Red: above the rollout's mean, blue: below. Left: global "
        f"entropy H / mean H. Right: PEPO weight c = e / mean e (W = {window}). Hover a token "
        f"for its values.</p>",
    ]
    for i in indices:
        rec = r.records[i]
        n = int(r.mask[i].sum())
        toks = r.tokens[i] or ["·"] * n
        h = r.entropies[i, :n]
        hm = float(h.mean()) or 1.0
        cols = []
        for title, vals in (("global entropy (H / mean H)", (h / hm).tolist()),
                            ("PEPO weight c", c[i, :n].tolist())):
            spans = "".join(
                f'<span class="tok" style="background:{_colour(v)}" '
                f'title="H={float(h[t]):.3f} value={v:.2f}">{html.escape(str(toks[t]))}</span>'
                for t, v in enumerate(vals)
            )
            cols.append(f'<div class="col"><h3>{html.escape(title)}</h3>{spans}</div>')
        head = (f"rollout {i}: step {rec.get('step')}, reward {rec.get('reward')}, "
                f"advantage {rec.get('advantage', 0.0):.3f}")
        prompt = html.escape(str(rec.get("prompt", "")))
        parts.append(f"<h2>{html.escape(head)}</h2><p><code>{prompt}</code></p>"
                     f'<div class="pair">{"".join(cols)}</div>')
    parts.append("</body></html>\n")
    return "".join(parts)


def _plot_positional(curves: dict[str, torch.Tensor], windows: Sequence[int], path: Path,
                     title: Optional[str] = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n_bins = len(curves["global"])
    x = [(b + 0.5) * 100 / n_bins for b in range(n_bins)]
    # up to three windows in a row; more in rows of two (fonts that stay legible in a page)
    cols = len(windows) if len(windows) <= 3 else 2
    rows = -(-len(windows) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.3 * rows + 0.3), dpi=110,
                             sharey=True, squeeze=False)
    for ax in axes.flat[len(windows):]:
        ax.set_visible(False)
    for ax, w in zip(axes.flat, windows):
        ax.axhline(0, color="k", lw=0.8)
        # three looks a greyscale print or a colour-blind reader tells apart: dark dashed,
        # thick solid blue, dotted orange (Okabe and Ito's palette)
        ax.plot(x, (100 * curves["global"]).tolist(), "--", color="#333333", lw=1.3,
                label="global entropy")
        ax.plot(x, (100 * curves[f"proximal_{w}"]).tolist(), "-", color="#0072B2", lw=2.2,
                label="proximal entropy")
        ax.plot(x, (100 * curves[f"window_average_{w}"]).tolist(), ":", color="#E69F00",
                lw=1.8, label=r"window ratio $H\,/\,\Sigma_W H$ (no softmax)")
        ax.set_title(f"W = {w}")
        ax.set_xlabel("generation percentile (%)")
        ax.grid(alpha=0.3)
    for row in axes:
        row[0].set_ylabel("deviation from sequence mean (%)")
    if title:
        fig.suptitle(title, fontsize=11)
    # below the panels, where it hides no curve
    fig.legend(*axes[0][0].get_legend_handles_labels(), loc="lower center", ncol=3, fontsize=9,
               bbox_to_anchor=(0.5, 0.0), frameon=False)
    fig.tight_layout(rect=(0, 0.08 / rows, 1, 1))
    fig.savefig(path)
    plt.close(fig)


def run(dump: Union[str, Path, Sequence[Union[str, Path]]], out: Union[str, Path],
        windows: Sequence[int] = (31, 51, 101),
        heatmap_rollouts: int = 4, window: Optional[int] = None,
        title: Optional[str] = None) -> dict[str, Path]:
    """Writes every diagnostic of the dump ``dump`` into ``out``; returns the files. The
    positional curves and the profile cover every one of ``windows``; the difficulty table, the
    weight mass and the heatmap use ``window`` (default: the largest of ``windows``). ``title``
    heads the positional figure (which model, task and stage; default: the rollouts' count)."""
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    t0 = time.perf_counter()
    r = load_dump(dump)
    if not bool(r.mask.any()):
        raise ValueError(f"{dump}: its {len(r)} rollouts hold no response token to analyse")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    files: dict[str, Path] = {}
    w_main = window or max(windows)

    curves = positional_bias(r, windows)
    files["positional_csv"] = out / "positional_bias.csv"
    with open(files["positional_csv"], "w", newline="", encoding="utf-8") as f:
        wr = csv.writer(f)
        wr.writerow(["percentile_bin_center", *curves])
        n_bins = len(curves["global"])
        for b in range(n_bins):
            wr.writerow([(b + 0.5) / n_bins, *(f"{float(v[b]):.6g}" for v in curves.values())])
    files["positional_png"] = out / "positional_bias.png"
    _plot_positional(curves, windows, files["positional_png"],
                     title or f"positional bias of {len(r)} rollouts")

    diff = difficulty_bias(r, w_main)
    lines = [f"Mean token entropy by prompt difficulty (pass rate over each prompt's rollouts of "
             f"a step; W = {w_main}); {len(r)} rollouts.", "",
             "| | rollouts | Global Entropy | Proximal Entropy |", "|---|---:|---:|---:|"]
    for g in GROUPS:
        if g in diff:
            d = diff[g]
            lines.append(f"| {g.capitalize()} | {d['rollouts']} | "
                         f"{_cell('{:.3f}', d['global'])} | {_cell('{:.5f}', d['proximal'])} |")
    if not diff:
        lines.append("| (no groups: single-stream dumps have one rollout per prompt) | | | |")
    files["difficulty_md"] = out / "difficulty_bias.md"
    files["difficulty_md"].write_text("\n".join(lines) + "\n", encoding="utf-8")

    prof = entropy_profile(r, windows)
    files["profile_json"] = out / "profile.json"  # null where there is no value (strict JSON)
    files["profile_json"].write_text(json.dumps(
        {k: v if math.isfinite(v) else None for k, v in prof.items()}, indent=2) + "\n",
        encoding="utf-8")
    files["profile_md"] = out / "profile.md"
    files["profile_md"].write_text("\n".join(
        [f"Entropy profile of {len(r)} rollouts.", "", "| quantity | value |", "|---|---:|"]
        + [f"| {k} | {_cell('{:.4g}', v)} |" for k, v in prof.items()]) + "\n", encoding="utf-8")

    mass = weight_mass(r, w_main)
    cols = [f"decile_{d}" for d in range(1, 11)] + list(GROUPS) + ["top20"]
    files["mass_csv"] = out / "weight_mass.csv"
    with open(files["mass_csv"], "w", newline="", encoding="utf-8") as f:
        wr = csv.writer(f)
        wr.writerow(["strategy", *cols])
        for name, row in mass.items():
            wr.writerow([name, *(f"{row[c]:.6g}" for c in cols)])
    md = ["Share of each strategy's token weight (advantages set to +1) by position decile "
          "and by difficulty group, and the share held by its 20% highest-weighted tokens "
          "(top 20%; 20 for uniform weights), in %.", "",
          "| strategy | " + " | ".join(c.replace("decile_", "D").replace("top20", "top 20%")
                                       for c in cols) + " |",
          "|---|" + "---:|" * len(cols)]
    md += [f"| {n} | " + " | ".join(f"{100 * row[c]:.1f}" for c in cols) + " |"
           for n, row in mass.items()]
    files["mass_md"] = out / "weight_mass.md"
    files["mass_md"].write_text("\n".join(md) + "\n", encoding="utf-8")

    # the heatmap shows correct rollouts of varied length first (their weights are the ones used)
    order = sorted(range(len(r)), key=lambda i: (r.records[i].get("reward", 0) <= 0, i))
    files["heatmap_html"] = out / "heatmap.html"
    files["heatmap_html"].write_text(heatmap_html(r, order[:heatmap_rollouts], w_main),
                                     encoding="utf-8")
    print(f"analysed {len(r)} rollouts in {time.perf_counter() - t0:.1f}s")
    for k, p in files.items():
        print(f"  {k:15s} {p}")
    return files


# the quantities of compare_stages' table (entropy_profile's keys)
PROFILE_ROWS = (("rollouts", "rollouts", "{:.0f}"),
                ("length_mean", "mean length (tokens)", "{:.1f}"),
                ("mean_entropy", "mean token entropy (nats)", "{:.3f}"),
                ("near_deterministic_share", "share of tokens below 0.01 nats", "{:.1%}"),
                ("entropy_p80", "80th percentile (nats)", "{:.3f}"),
                ("top20_entropy_share", "entropy held by the top 20 % of tokens", "{:.1%}"),
                ("first_over_last_tenth", "first / last tenth of a response", "{:.2f}"),
                ("global_span", "span of global entropy's positional deviation", "{:.1%}"),
                ("hard_share", "hard prompts (pass rate <= 1/8), share of rollouts", "{:.1%}"),
                ("moderate_share", "moderate prompts, share", "{:.1%}"),
                ("easy_share", "easy prompts (>= 7/8), share", "{:.1%}"))


def _stage_label(title: str, files: Sequence[Any]) -> str:
    """A stage's title with its number of runs, as its column and its figure name it."""
    return f"{title}, {len(files)} run{'s' if len(files) > 1 else ''}"


def compare_stages(stages: Sequence[tuple[str, str, Sequence[Path]]], dest: Path, link: str,
                   windows: Sequence[int], window: int, task: str) -> str:
    """Table 1 and Fig. 2 of several stages side by side (Markdown): each stage is ``(name,
    title, dumps)``, its dumps pooled (each file's groups apart) and analysed by :func:`run`
    into ``dest/name`` (images linked as ``link/name/...``), with the dumps themselves kept
    gzipped in ``dest/name/rollouts`` (as ``<method>_seed_<n>_step_N.jsonl.gz`` for a run's
    ``.../<method>/seed_<n>/rollouts/step_N.jsonl``) so that the tables can be recomputed."""
    profiles, tables = {}, []
    for name, title, files in stages:
        kept = dest / name / "rollouts"  # the dumps themselves, so the docs reproduce the tables
        if kept.is_dir():
            shutil.rmtree(kept)
        kept.mkdir(parents=True)
        for f in map(Path, files):
            method, seed = f.parent.parent.parent.name, f.parent.parent.name
            with open(f, "rb") as src, open(kept / f"{method}_{seed}_{f.name}.gz", "wb") as raw, \
                    gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as gz:
                shutil.copyfileobj(src, gz)
        run(files, dest / name, windows=windows, window=window,
            title=f"{task}: {_stage_label(title, files)}")
        profiles[name] = json.loads((dest / name / "profile.json").read_text(encoding="utf-8"))
        diff = difficulty_bias(load_dump(files), window)
        tables += [f"| {title} | {g} | {d['rollouts']} | {_cell('{:.3f}', d['global'])} | "
                   f"{_cell('{:.4f}', d['proximal'])} |" for g, d in diff.items()]
    head = " | ".join(_stage_label(title, files) for _, title, files in stages)
    lines = [f"### {task}: the entropy structure before and after training (W = {window})", "",
             "Each stage pools one step's rollouts over the seeds, kept (gzipped) in "
             f"`{link}/STAGE/rollouts/`: `python -m pepo.study.analysis docs/{link}/STAGE/"
             "rollouts --out DIR --windows " + " ".join(map(str, windows))
             + f" --window {window}` reproduces a stage.", "",
             f"| quantity | {head} |", "|---|" + "---:|" * len(stages)]
    lines += [f"| {text} | " + " | ".join(_cell(fmt, profiles[name].get(key, math.nan))
                                          for name, _, _ in stages) + " |"
              for key, text, fmt in PROFILE_ROWS]
    for v in windows:
        cells = [_cell("{:.1%}", profiles[name].get(f"proximal_{v}_max_abs", math.nan))
                 for name, _, _ in stages]
        lines.append(f"| largest deviation of proximal entropy by position, W = {v} | "
                     + " | ".join(cells) + " |")
    lines += ["", f"Table 1 on this task: mean token entropy by prompt difficulty "
                  f"(W = {window}).", "",
              "| stage | group | rollouts | Global Entropy | Proximal Entropy |",
              "|---|---|---:|---:|---:|", *tables, "",
              "Fig. 2 on this task (deviation from each response's mean, by position):", ""]
    lines += [f"![{title}]({link}/{name}/positional_bias.png)" for name, title, _ in stages]
    lines += ["", "Token heatmaps (global entropy and PEPO's weight, token by token): "
              + ", ".join(f"[{title}]({link}/{name}/heatmap.html)" for name, title, _ in stages)
              + "."]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["intervene"]:  # python -m pepo.study.analysis intervene ... (Table 5)
        from pepo.study import intervention

        intervention.main(argv[1:])
        return
    ap = argparse.ArgumentParser(
        prog="python -m pepo.study.analysis", description=__doc__.split("\n")[0],
        formatter_class=DefaultsFormatter,
        epilog="python -m pepo.study.analysis intervene --help: the token intervention "
               "(Table 5) of two checkpoints")
    ap.add_argument("dump", nargs="+", help="a rollouts/step_N.jsonl file or the rollouts/ "
                                            "directory (every step's dump in it, pooled); "
                                            "several are pooled, each run's groups kept apart")
    ap.add_argument("--out", required=True, help="directory for the plots and tables")
    ap.add_argument("--windows", type=window_arg, nargs="+", default=[31, 51, 101],
                    help="the windows W of the positional curves and the profile")
    ap.add_argument("--heatmap-rollouts", type=count_arg, default=4,
                    help="rollouts shown in heatmap.html")
    ap.add_argument("--window", type=window_arg, default=None,
                    help="the W of the difficulty table, the weight mass and the heatmap "
                         "(default: the largest of --windows)")
    ap.add_argument("--title", default=None,
                    help="a title above the positional figure: which model, task and stage "
                         "(default: the number of rollouts)")
    args = ap.parse_args(argv)
    try:
        from pepo.training.config import check_output_dir

        check_output_dir(args.out, "--out")  # before reading the dump
        run(args.dump if len(args.dump) > 1 else args.dump[0], args.out, args.windows,
            args.heatmap_rollouts, args.window, args.title)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
    main()
