"""Token intervention (paper Sec. 5.5, Table 5): does a metric find the tokens that matter?

Generate with a base model; rank each response's positions by a token metric (global entropy
``H`` or proximal entropy ``e``, Eq. 6, both of the base model at the sampling temperature);
replace the top ``budget`` fraction of positions with tokens sampled from a replacement model
(an RL checkpoint) and let the base model continue autoregressively; score avg@k per budget.
If a metric ranks the decision tokens first, a small budget recovers much of the replacement
model's accuracy.

* :func:`mixed_generate` decodes with two models in lockstep: at position ``t`` of row ``i``
  the token is drawn from the replacement model where ``replace[i, t]``, else from the base.
  Both models see the same sequence (each keeps its own KV cache) and every row's draws use the
  same counter-based uniforms as :func:`pepo.training.generation.generate` with the same
  ``seeds``, so an all-False mask reproduces the base model's rollouts exactly and an all-True
  mask the replacement model's.
* :func:`select_positions` turns a metric and a budget into that mask.
* :func:`intervene` runs a whole table; ``python -m pepo.study.analysis intervene`` is its CLI.

Positions are those of the base response: budget ``b`` replaces ``ceil(b * T_i)`` of row
``i``'s ``T_i`` positions (ties broken towards earlier positions). Positions the base response
never reached are replaced only at budget 1 (so budget 1 is the replacement model's own
generation).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import torch

from pepo import weighting
from pepo.study.cli import DefaultsFormatter, percent_arg, positive_arg, window_arg
from pepo.training import evaluation
from pepo.training.checkpointing import atomic_write_text
from pepo.training.evaluation import eval_generator
from pepo.training.fast_decoder import FastPlan
from pepo.training.files import weights_digest
from pepo.training.generation import Rollouts, decode, draw_seeds
from pepo.training.precision import autocast
from pepo.training.rollouts import is_success, reward_tensor

__all__ = ["METRICS", "MixedRollouts", "intervene", "main", "mixed_generate", "problem_se",
           "sampling_se", "select_positions", "token_metric", "write_table"]

METRICS = ("global", "proximal")


@dataclass
class MixedRollouts(Rollouts):
    """:class:`pepo.training.generation.Rollouts` plus, per generated position, the base model's
    entropy ``H`` (``[B, T]`` fp32, 0 at padding) and whether the token came from the
    replacement model (``[B, T]`` bool)."""

    entropies: Optional[torch.Tensor] = None
    replaced: Optional[torch.Tensor] = None


@torch.no_grad()
def mixed_generate(
    base: torch.nn.Module,
    replacement: Optional[torch.nn.Module],
    prompts: Sequence[Sequence[int]],
    replace: Optional[torch.Tensor],
    *,
    seeds: torch.Tensor,
    max_new_tokens: int,
    pad_id: int,
    stop_tokens: Sequence[int],
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    top_p: float = 1.0,
) -> MixedRollouts:
    """Samples one response per prompt, position ``t`` of row ``i`` from ``replacement`` where
    ``replace[i, t]`` (``[B, max_new_tokens]`` bool; None or ``replacement=None``: never).

    Raises:
        ValueError: a mask of the wrong shape, seeds not ``[B]``, or a sequence longer than a
            model's ``max_seq_len``.
    """
    bsz = len(prompts)
    if seeds.shape != (bsz,):
        raise ValueError(f"seeds must be [B]=[{bsz}], got {list(seeds.shape)}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    device = next(base.parameters()).device
    if replacement is base:
        replacement = None  # one model: every token is the base model's anyway
    if replace is None or replacement is None:
        replace = torch.zeros((bsz, max_new_tokens), dtype=torch.bool)
    if replace.shape != (bsz, max_new_tokens) or replace.dtype != torch.bool:
        raise ValueError(f"replace must be a bool [B, max_new_tokens]=[{bsz}, {max_new_tokens}] "
                         f"mask, got {replace.dtype} {list(replace.shape)}")
    replace = replace.to(device)
    models = [base] if replacement is None else [base, replacement]
    plans = [FastPlan.of(m) for m in models]
    prompt_tokens, prompt_mask, out, out_lp, valid, done, ent = decode(
        models, plans if all(p is not None for p in plans) else None, prompts,
        max_new_tokens=max_new_tokens, pad_id=pad_id, stop_tokens=stop_tokens, seeds=seeds,
        generator=None, temperature=temperature, top_k=top_k, top_p=top_p,
        replace=replace, entropies=True)
    return MixedRollouts(
        prompt_tokens=prompt_tokens, prompt_mask=prompt_mask, tokens=out, mask=valid,
        finished=done, logprobs=out_lp, entropies=ent,
        replaced=replace[:, : out.shape[1]] & valid,
    )


def token_metric(name: str, entropies: torch.Tensor, mask: torch.Tensor,
                 window: int = 101) -> torch.Tensor:
    """The ranking metric ``[B, T]``: ``global`` is ``H``, ``proximal`` is ``e`` (Eq. 6)."""
    if name == "global":
        return torch.where(mask, entropies, 0.0)
    if name == "proximal":
        return weighting.proximal_entropy(entropies, mask, window=window)
    raise ValueError(f"unknown metric {name!r}; expected one of {list(METRICS)}")


def select_positions(metric: torch.Tensor, mask: torch.Tensor, budget: float,
                     width: int) -> torch.Tensor:
    """``[B, width]`` bool: the ``ceil(budget * T_i)`` valid positions of row ``i`` with the
    highest metric (earlier positions first among ties); every position at ``budget >= 1``."""
    if not 0.0 <= budget <= 1.0:
        raise ValueError(f"budget must be a fraction in [0, 1], got {budget}")
    if metric.shape != mask.shape:
        raise ValueError(f"metric {list(metric.shape)} and mask {list(mask.shape)} differ")
    bsz, T = mask.shape
    if width < T:
        raise ValueError(f"width={width} is shorter than the responses ({T})")
    if budget >= 1.0:
        return torch.ones((bsz, width), dtype=torch.bool, device=mask.device)
    n = mask.sum(-1)  # [B]
    k = torch.ceil(budget * n.double() - 1e-9).long()  # [B]
    score = torch.where(mask, metric.double(), -math.inf)
    # stable descending order: earlier positions first among equal scores
    order = torch.sort(score, dim=-1, descending=True, stable=True).indices  # [B, T]
    rank = order.argsort(dim=-1)  # each position's place in it (the inverse permutation)
    chosen = (rank < k[:, None]) & mask
    return torch.nn.functional.pad(chosen, (0, width - T), value=False)


def problem_se(success: torch.Tensor, k: int) -> float:
    """The standard error of a mean over problems, the problems a sample of the task's:
    ``success`` is ``[N * k]`` (row ``i`` is sample ``i % k`` of problem ``i // k``); the samples
    of one problem are not independent, so the error is that of the ``N`` per-problem means
    (sample SD / sqrt(N)); NaN for one problem, or where every problem's mean is the same
    (no spread to estimate it from: both rankings scoring 0 everywhere is no exact 0). The
    paired differences use it; the formula is :func:`pepo.training.evaluation.problem_se`'s."""
    se = evaluation.problem_se(success.double().tolist(), k)
    return se if se is not None and se > 0 else math.nan


def sampling_se(success: torch.Tensor, k: int) -> float:
    """The standard error of avg@k on a fixed set of problems (as the paper's avg@16 on AIME):
    only the sampling varies, so it is ``sqrt(sum_j s_j^2 / k) / N`` with ``s_j^2`` problem
    ``j``'s sample variance over its ``k`` samples (ddof 1); for ``k = 1``, the binomial
    ``sqrt(p (1 - p) / N)``. NaN where that plug-in is 0 because no sample differs from its
    problem's others (an accuracy of 0 or 100 % at ``k = 1``): no spread to estimate it from,
    not an exact accuracy."""
    rows = success.double().reshape(-1, k)
    n = rows.shape[0]
    if k == 1:
        p = float(rows.mean())
        se = math.sqrt(p * (1 - p) / n)
    else:
        se = float(rows.var(dim=-1).sum().div(k).sqrt() / n)
    return se if se > 0 else math.nan


def _load_cells(cache: Path, key: dict[str, Any]) -> dict[str, Any]:
    """The cells a killed intervention of the same settings left in ``cache`` (``{}`` if none).

    Raises:
        ValueError: ``cache`` holds an intervention of other settings (naming the first one).
    """
    if not cache.is_file():
        return {}
    saved = json.loads(cache.read_text(encoding="utf-8"))
    for name in sorted(set(key) | set(saved.get("settings", {}))):
        if saved["settings"].get(name) != key.get(name):
            older = (" (an earlier pepo kept cells under the checkpoints' paths, not their "
                     "weights)" if name in ("base", "replacement", "dtype", "device") else "")
            raise ValueError(f"{cache} holds an intervention with {name}="
                             f"{saved['settings'].get(name)!r}, not {key.get(name)!r}{older}; "
                             f"give another --out or remove it")
    return saved["cells"]


def intervene(
    base: torch.nn.Module,
    replacement: torch.nn.Module,
    tokenizer: Any,
    problems: Sequence[Any],
    reward_fn: Any,
    *,
    budgets: Sequence[float],
    metrics: Sequence[str] = METRICS,
    k: int = 4,
    window: int = 101,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    top_p: float = 1.0,
    stop_tokens: Sequence[int],
    seed: int = 0,
    batch_size: int = 256,
    compute_dtype: Optional[torch.dtype] = None,
    cache: Optional[Union[str, Path]] = None,
    settings: Optional[dict[str, Any]] = None,
    progress: Optional[Any] = None,
) -> dict[str, dict[Any, Any]]:
    """avg@k for every metric and budget: ``{metric: {budget: accuracy}}``, plus the
    replacement model's own avg@k under ``"replacement"`` (``{1.0: acc}``), the standard error of
    each of those cells on these problems (:func:`sampling_se`) under ``"se"`` (``{name:
    {budget: se}}``) and, when both metrics ran, the paired difference proximal - global under
    ``"paired"`` (``{budget: [difference, its standard error over problems]}``
    (:func:`problem_se`): the same rows, seeds and budget, so only the ranking differs).

    The base rollouts are sampled once (seeds from ``seed``); every intervened rollout reuses
    its row's seed, so budgets and metrics differ only in the positions replaced. The models run
    under ``torch.autocast`` to ``compute_dtype`` (None: their own dtype), as the trainer's
    rollouts do. With ``cache`` (a JSON file), each finished generation's successes are saved
    there (and the base rollouts' entropies beside it, ``.pt``) with the ``settings`` that
    identify the run, so a killed intervention resumes where it stopped.

    Raises:
        ValueError: an unknown metric, a budget outside [0, 1], no problems, ``k < 1``, or a
            ``cache`` of other settings.
    """
    for m in metrics:
        if m not in METRICS:
            raise ValueError(f"unknown metric {m!r}; expected one of {list(METRICS)}")
    for b in budgets:
        if not 0.0 <= b <= 1.0:
            raise ValueError(f"budgets are fractions in [0, 1], got {b}")
    if k < 1 or not problems:
        raise ValueError(f"need k >= 1 and at least one problem, got k={k}, "
                         f"{len(problems)} problems")
    rows = [p for p in problems for _ in range(k)]
    prompts = [tokenizer.encode_prompt(p.prompt) for p in rows]
    answers = [p.answer for p in rows]
    seeds = draw_seeds(eval_generator(seed), len(rows))  # avg_at_k's seeds
    kw = dict(max_new_tokens=max_new_tokens, pad_id=tokenizer.pad_id, stop_tokens=stop_tokens,
              temperature=temperature, top_k=top_k, top_p=top_p)
    device = next(base.parameters()).device
    key = {**(settings or {}), "k": k, "seed": seed, "max_new_tokens": max_new_tokens,
           "temperature": temperature, "top_k": top_k, "top_p": top_p,
           "stop_tokens": list(stop_tokens), "compute_dtype": str(compute_dtype),
           "prompts": len(prompts), "answers": [str(a) for a in answers[::k]]}
    cache = None if cache is None else Path(cache)
    cells = {} if cache is None else _load_cells(cache, key)
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
    saved_base = None if cache is None else cache.with_suffix(".pt")

    def run(name: str, replace: Optional[torch.Tensor],
            use_replacement: bool = True) -> tuple[torch.Tensor, list]:
        """The rows' successes ([N * k] float) of one generation, and its rollouts; the
        successes are kept in ``cache`` at once."""
        parts = []
        for i in range(0, len(rows), batch_size):
            sl = slice(i, i + batch_size)
            with autocast(device, compute_dtype):
                parts.append(mixed_generate(
                    base, replacement if use_replacement else None, prompts[sl],
                    None if replace is None else replace[sl], seeds=seeds[sl], **kw))
        texts = [tokenizer.decode(t[m].tolist()) for r in parts for t, m in zip(r.tokens, r.mask)]
        rewards = reward_tensor(reward_fn(texts, answers), len(texts), reward_fn)
        success = is_success(reward_fn, rewards).double()
        cells[name] = success.tolist()
        if name == "base" and saved_base is not None:  # what the metrics rank, before its cell
            torch.save(([r.entropies for r in parts], [r.mask for r in parts]), saved_base)
        if cache is not None:
            atomic_write_text(cache, json.dumps({"settings": key, "cells": cells}))
        if progress is not None:
            progress()
        return success, parts

    def kept(name: str) -> Optional[torch.Tensor]:
        return torch.tensor(cells[name], dtype=torch.double) if name in cells else None

    if "base" in cells and saved_base is not None and saved_base.is_file():
        s0 = kept("base")
        ents, masks = torch.load(saved_base, weights_only=True)
    else:
        s0, base_parts = run("base", None, use_replacement=False)
        ents = [r.entropies for r in base_parts]
        masks = [r.mask for r in base_parts]
    # every token replaced is the same run whatever the metric: generated once
    s1 = kept("all")
    if s1 is None:
        s1 = run("all", torch.ones((len(rows), max_new_tokens), dtype=torch.bool))[0]
    success: dict[str, dict[float, torch.Tensor]] = {}
    for m in metrics:
        success[m] = {}
        scores = [token_metric(m, e, mk, window) for e, mk in zip(ents, masks)]
        for b in budgets:
            if b in (0.0, 1.0):
                success[m][b] = s0 if b == 0.0 else s1
                continue
            name = f"{m}@{b!r}"
            found = kept(name)
            if found is None:
                found = run(name, torch.cat([select_positions(s, mk, b, max_new_tokens)
                                             for s, mk in zip(scores, masks)]))[0]
            success[m][b] = found
    success["replacement"] = {1.0: s1}
    out: dict[str, dict[Any, Any]] = {
        n: {b: float(s.mean()) for b, s in d.items()} for n, d in success.items()}
    out["se"] = {n: {b: sampling_se(s, k) for b, s in d.items()} for n, d in success.items()}
    if all(m in metrics for m in METRICS):
        out["paired"] = {b: [float((success["proximal"][b] - success["global"][b]).mean()),
                             # at 0 and 100 % both are the same generations: exactly 0
                             0.0 if b in (0.0, 1.0) else
                             problem_se(success["proximal"][b] - success["global"][b], k)]
                         for b in budgets}
    return out


def _pct(se: float) -> str:
    """A standard error in percent, or "–" where it could not be estimated (NaN)."""
    return "–" if math.isnan(se) else f"{100 * se:.1f}"


def write_table(results: dict[str, dict[Any, Any]], out: Union[str, Path], *,
                k: int, title: str = "") -> dict[str, Path]:
    """``intervention.{csv,md,png}`` of :func:`intervene`'s results (accuracies in %, each with
    its standard error where ``results`` has ``"se"``)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    se = results.get("se", {})
    metrics = [m for m in results if m not in ("replacement", "se", "paired")]
    budgets = sorted({b for m in metrics for b in results[m]})
    files = {"csv": out / "intervention.csv", "md": out / "intervention.md",
             "png": out / "intervention.png"}

    def cell(name: str, b: float) -> str:
        e = se.get(name, {}).get(b)
        return f"{100 * results[name][b]:.1f}" + ("" if e is None else f" ± {_pct(e)}")

    with open(files["csv"], "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["metric", "budget_percent", f"avg@{k}", "se"])
        for m in metrics:
            for b in budgets:
                e = se.get(m, {}).get(b)
                w.writerow([m, f"{100 * b:g}", f"{results[m][b]:.6f}",
                            "" if e is None else f"{e:.6f}"])
        if "replacement" in results:
            e = se.get("replacement", {}).get(1.0)
            w.writerow(["replacement", "100", f"{results['replacement'][1.0]:.6f}",
                        "" if e is None else f"{e:.6f}"])
        for b, (d, e) in sorted(results.get("paired", {}).items()):
            w.writerow(["proximal - global", f"{100 * b:g}", f"{d:.6f}", f"{e:.6f}"])
    names = {"global": "Global Entropy", "proximal": "Proximal Entropy"}
    md = [title or f"Token-replacement intervention, avg@{k} (%); budget = fraction of token "
                    f"positions replaced" + (
                        "; ± one standard error of the sampling, these problems fixed; the "
                        "paired difference's is over problems, as a sample of the task's; – "
                        "where the samples show no spread to estimate it from."
                        if se else "."), "",
          "| Metric | " + " | ".join(f"{100 * b:g}%" for b in budgets) + " |",
          "|---|" + "---:|" * len(budgets)]
    for m in metrics:
        md.append(f"| {names.get(m, m)} | " + " | ".join(cell(m, b) for b in budgets) + " |")
    if "paired" in results:
        md.append("| Proximal − Global (paired) | " + " | ".join(
            f"{100 * results['paired'][b][0]:+.1f} ± {_pct(results['paired'][b][1])}"
            for b in budgets) + " |")
    if "replacement" in results:
        md += ["", f"Replacement model alone (every token replaced): "
                   f"{cell('replacement', 1.0)}%."]
    files["md"].write_text("\n".join(md) + "\n", encoding="utf-8")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for m in metrics:
        ax.errorbar([100 * b for b in budgets], [100 * results[m][b] for b in budgets],
                    yerr=[100 * se[m][b] for b in budgets] if m in se else None, marker="o",
                    capsize=3, label=names.get(m, m))
    if "replacement" in results:
        ax.axhline(100 * results["replacement"][1.0], color="grey", ls="--",
                   label="replacement model")
    ax.set_xlabel("budget (% of token positions replaced)")
    ax.set_ylabel(f"avg@{k} (%)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(files["png"])
    plt.close(fig)
    return files


def main(argv: Optional[Sequence[str]] = None) -> dict[str, dict[float, float]]:
    """``python -m pepo.study.analysis intervene``: the intervention table of two checkpoints."""
    ap = argparse.ArgumentParser(
        prog="python -m pepo.study.analysis intervene",
        description="Token intervention (Table 5): replace the top-ranked tokens of the base "
                    "model's responses with the replacement model's and score avg@k.",
        formatter_class=DefaultsFormatter)
    ap.add_argument("--config", required=True,
                    help="a recipe config (bundled name or YAML path): its tokenizer, model, "
                         "val_dataset, reward and generation settings are used")
    ap.add_argument("--base", default=None,
                    help="base checkpoint directory (default: the config's checkpoint_dir)")
    ap.add_argument("--replacement", required=True,
                    help="replacement checkpoint directory (a run's checkpoints/step_N, or an "
                         "HF directory)")
    ap.add_argument("--budgets", type=percent_arg, nargs="+", default=[0, 5, 10, 15, 20, 30],
                    help="percent of each response's positions to replace")
    ap.add_argument("--metrics", nargs="+", default=list(METRICS), choices=METRICS,
                    help="the rankings of the tokens to replace")
    ap.add_argument("--window", type=window_arg, default=None,
                    help="proximal entropy window (default: the config's "
                         "strategy.proximal_softmax.window, else 101)")
    ap.add_argument("--k", type=positive_arg, default=4, help="samples per problem (avg@k)")
    ap.add_argument("--problems", type=positive_arg, default=None,
                    help="use the first N validation problems (default: all)")
    ap.add_argument("--seed", type=int, default=0, help="the sampling's seed")
    ap.add_argument("--batch-size", type=positive_arg, default=256,
                    help="rollouts generated at once")
    ap.add_argument("--compute-dtype", default=None, choices=["auto", "fp32", "bf16"],
                    help="the matmuls' precision (default: the config's compute_dtype, as its "
                         "runs sampled)")
    ap.add_argument("--out", required=True, help="directory for intervention.{csv,md,png}")
    ap.add_argument("--cache", default=None,
                    help="directory where each finished generation is kept (cells.json, and "
                         "the base rollouts' entropies in cells.pt), so that the same command "
                         "resumes a killed run (default: --out)")
    args = ap.parse_args(argv)
    try:
        return _main(args)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    except KeyboardInterrupt:  # what each finished generation wrote is kept
        print(f"interrupted (Ctrl-C): the finished generations are kept in "
              f"{args.cache or args.out}; the same command goes on from them", file=sys.stderr)
        raise SystemExit(130) from None


def _main(args: argparse.Namespace) -> dict[str, dict[float, float]]:
    from omegaconf import DictConfig, OmegaConf
    from torchtune import config as tt_config
    from torchtune import training, utils

    from pepo.training.checkpointing import resolve_marker
    from pepo.training.config import (
        check_checkpoint_dir,
        check_device,
        check_output_dir,
        find_config,
        register_resolvers,
    )
    from pepo.training.precision import cpu_warnings, describe, resolve_compute_dtype
    from pepo.training.tokenizers import stop_token_ids
    from pepo.training.weights import load_model_weights

    check_output_dir(args.out, "--out")  # before hours of sampling
    check_output_dir(args.cache or args.out, "--cache")
    register_resolvers()
    path = find_config(args.config)
    try:
        cfg = OmegaConf.load(path)
    except Exception as e:  # yaml's own errors
        raise ValueError(f"--config {path} is not a YAML config: {' '.join(str(e).split())}")
    missing = [k for k in ("model", "tokenizer", "val_dataset", "checkpoint_dir", "generation")
               if not isinstance(cfg, DictConfig) or cfg.get(k) is None]  # absent, or null
    if missing:  # an eval config, say: the intervention samples a training config's prompts
        raise ValueError(f"--config {path} is not a training config with validation prompts: "
                         f"it has no {', '.join(missing)}")
    args.replacement = resolve_marker(args.replacement)  # RUN/checkpoints/best works
    base_dir = resolve_marker(args.base) or str(cfg.checkpoint_dir)
    check_checkpoint_dir(base_dir, "--base")
    check_checkpoint_dir(args.replacement, "--replacement")
    budgets = [b / 100 for b in args.budgets]  # percent_arg checked them
    window = args.window or int(OmegaConf.select(cfg, "strategy.proximal_softmax.window",
                                                 default=101))
    tokenizer = tt_config.instantiate(cfg.tokenizer)
    problems = list(tt_config.instantiate(cfg.val_dataset))
    if args.problems is not None:
        if args.problems < 1:
            raise ValueError(f"--problems must be >= 1, got {args.problems}")
        problems = problems[: args.problems]
    device_name = str(OmegaConf.select(cfg, "device", default="cpu"))
    check_device(device_name)  # the config's device and dtype, as its runs used them
    device = utils.get_device(device_name)
    dtype = training.get_dtype(str(OmegaConf.select(cfg, "dtype", default="fp32")), device=device)
    models = []
    for d in (base_dir, args.replacement):
        with training.set_default_dtype(dtype), device:
            m = tt_config.instantiate(cfg.model)
        load_model_weights(m, d)
        models.append(m.eval())
    g = cfg.generation
    setting = args.compute_dtype or str(OmegaConf.select(cfg, "compute_dtype", default="fp32"))
    compute_dtype = resolve_compute_dtype(setting, device)
    stop_tokens = stop_token_ids(tokenizer, g.get("stop_tokens"))
    cache = Path(args.cache or args.out) / "cells.json"
    settings = {"window": window, **{  # which weights, without writing their paths down
        name: weights_digest(d) for name, d in (("base", base_dir),
                                                 ("replacement", args.replacement))},
        "dtype": str(dtype), "device": device.type,  # what the models ran in and on
        "reward": OmegaConf.to_container(cfg.reward, resolve=True)}  # what scored the cells
    n_runs = 2 + len(args.metrics) * sum(0 < b < 1 for b in budgets)
    if cache.is_file():
        print(f"resuming: the generations already in {cache} are not run again")
    reward = tt_config.instantiate(cfg.reward)
    done = [0]
    t0 = time.perf_counter()

    def progress() -> None:
        done[0] += 1
        print(f"  generation {done[0]}/{n_runs}  {time.perf_counter() - t0:6.1f}s", flush=True)

    print(f"intervention: {len(problems)} problems x {args.k} samples, budgets "
          f"{', '.join(f'{b:g}' for b in args.budgets)} %, metrics {', '.join(args.metrics)}, "
          f"W={window}; "
          + describe(setting, compute_dtype, device), flush=True)
    for line in cpu_warnings(compute_dtype, None, device):
        print(f"warning: {line}", flush=True)
    try:
        results = intervene(
            models[0], models[1], tokenizer, problems, reward, budgets=budgets,
            metrics=args.metrics, k=args.k, window=window,
            max_new_tokens=int(g.max_new_tokens), temperature=float(g.temperature),
            top_k=g.get("top_k"), top_p=float(g.get("top_p", 1.0)),
            stop_tokens=stop_tokens, seed=args.seed, batch_size=args.batch_size,
            compute_dtype=compute_dtype, cache=cache, settings=settings, progress=progress)
    finally:
        close = getattr(reward, "close", None)
        if callable(close):
            close()
    files = write_table(results, args.out, k=args.k)
    print(files["md"].read_text(encoding="utf-8"))
    for name, p in files.items():
        print(f"  {name:4s} {p}")
    return results


if __name__ == "__main__":  # the same as python -m pepo.study.analysis intervene
    main()
