"""avg@k evaluation, shared by the training recipe's validation and ``tune run pepo_eval``.

avg@k of a benchmark is the mean over its problems of the fraction of ``k`` sampled responses
that succeed (the paper reports avg@1 on MATH500 and avg@16 on AMC and AIME). The rollouts are
sampled and scored as the training step's are (:mod:`pepo.training.rollouts`, whose names also
import from here); success is :func:`pepo.training.rollouts.is_success`: reward > 0 unless the
reward component defines its own rule.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import torch

from pepo.training.generation import draw_seeds
from pepo.training.progress import rollout_counter
from pepo.training.rollouts import RewardError, is_success, reward_tensor, sample_and_score

__all__ = [
    "PAPER_COLUMNS",
    "RewardError",
    "reward_tensor",
    "avg_at_k",
    "is_success",
    "eval_generator",
    "format_table",
    "format_tables",
    "problem_se",
    "sample_and_score",
    "write_results",
]

PAPER_COLUMNS = ("AIME2024", "AIME2025", "AMC", "MATH500")


def eval_generator(seed: int, device: Union[str, torch.device] = "cpu") -> torch.Generator:
    """The sampling generator of an evaluation: the same for every evaluation of a run (and
    for ``pepo_eval`` with the same seed), so two evaluations differ only by the policy."""
    return torch.Generator(device=device).manual_seed(seed + 7919)


def avg_at_k(
    engine: Any,
    tokenizer: Any,
    problems: Sequence[Any],
    k: int,
    reward_fn: Callable[[list[str], list[str]], list[float]],
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    top_p: float = 1.0,
    generator: Optional[torch.Generator] = None,
    batch_size: int = 256,
    stop_tokens: Optional[Sequence[int]] = None,
    dist: Optional[Any] = None,
    progress: Optional[str] = None,
    records: Optional[list] = None,
    counts: Optional[dict] = None,
) -> float:
    """avg@k of ``problems`` (objects with ``prompt`` and ``answer``), sampled by ``engine``
    (a rollout engine of :mod:`pepo.training.engines`, or a model).

    Generation runs in batches of ``batch_size`` rollouts; ``generator`` makes it reproducible.
    With ``dist`` (a :class:`pepo.training.distributed.Dist`), each process samples its share of the
    ``len(problems) * k`` rollouts and the counts are summed: the same avg@k as one process.
    ``progress``: the label of a count of this process's rollouts as they finish, on standard
    error, on the main process only (:func:`pepo.training.progress.rollout_counter`: a bar on a
    terminal, removed when done; elsewhere a line a minute); None: no count.
    ``records``: a list that receives one dict per rollout of this process, in problem order
    (``prompt_id``, ``prompt``, ``answer``, ``response``, ``reward``, ``success``,
    ``truncated``).
    ``counts``: a dict that receives ``rollouts``, ``correct`` and ``truncated`` (responses that
    reached ``max_new_tokens`` without a stop token; the reward scored their text as it is), over
    every process.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if not problems:
        raise ValueError("no problems to evaluate")
    rows = [p for p in problems for _ in range(k)]
    seeds = draw_seeds(generator, len(rows)) if generator is not None else None
    part = slice(None) if dist is None else dist.shard(len(rows))
    mine = rows[part]
    bar = None
    if progress is not None and (dist is None or dist.is_main):
        bar = rollout_counter(len(mine), progress)
    try:
        ro, rewards, texts = sample_and_score(
            engine, tokenizer, mine, reward_fn,
            stop_tokens=list(tokenizer.stop_tokens if stop_tokens is None else stop_tokens),
            batch_size=batch_size, max_new_tokens=max_new_tokens, temperature=temperature,
            top_k=top_k, top_p=top_p, seeds=None if seeds is None else seeds[part],
            **({} if bar is None else {"progress": bar.update}),
        )
    finally:
        if bar is not None:
            bar.close()
    success = is_success(reward_fn, rewards)
    if records is not None:
        records.extend({"prompt_id": getattr(p, "id", None), "prompt": p.prompt,
                        "answer": p.answer, "response": t, "reward": float(r), "success": bool(s),
                        "truncated": not f}
                       for p, t, r, s, f in zip(mine, texts, rewards.tolist(), success.tolist(),
                                                ro.finished.tolist()))
    tally = torch.stack([success.float().sum(),
                         (~ro.finished).float().sum().to(success.device)])  # [2]
    if dist is not None:
        tally = dist.sum(tally)
    correct, truncated = (int(v) for v in tally.tolist())
    if counts is not None:
        counts.update(rollouts=len(rows), correct=correct, truncated=truncated)
    return correct / len(rows)


def problem_se(success: Sequence[bool], k: int) -> Optional[float]:
    """The standard error of avg@k over problems: the sample SD of the problems' shares of
    correct responses over the square root of their number (``success``: ``k`` consecutive
    flags per problem, as one process's :func:`avg_at_k` ``records`` come: without ``dist``);
    None for fewer than 2 problems. It counts the problems as a sample of all such problems, so
    it includes the sampling's own noise and the problems' spread."""
    n = len(success) // k if isinstance(k, int) and k >= 1 else -1
    if n < 0 or n * k != len(success):
        raise ValueError(f"{len(success)} flags are not k={k} for each of a whole number of "
                         f"problems")
    if n < 2:
        return None
    shares = [sum(success[i * k:(i + 1) * k]) / k for i in range(n)]
    return statistics.stdev(shares) / math.sqrt(n)


def format_table(results: Mapping[str, float], model_name: str = "model") -> str:
    """A Markdown table in the paper's layout: AIME2024, AIME2025, AMC, MATH500, Mean (in %).

    Benchmarks outside the paper's four follow them; Mean averages the benchmarks present.
    """
    return format_tables([(model_name, results)])


def format_tables(rows: Sequence[tuple[str, Mapping[str, float]]],
                  unfinished: Sequence[str] = ()) -> str:
    """:func:`format_table` with one row per evaluated model, over the benchmarks any of them
    has (``-`` where a model has no result). Mean averages the benchmarks every finished row
    has (rows named in ``unfinished`` do not narrow it), so that the rows' Means compare the
    same benchmarks: ``-`` for a row without all of them; where some row lacks one, a note
    under the table names those left out."""
    present = {c for _, results in rows for c in results}
    cols = [c for c in PAPER_COLUMNS if c in present] + sorted(present - set(PAPER_COLUMNS))
    done = [results for name, results in rows if name not in unfinished] or [
        results for _, results in rows]  # all unfinished: their own benchmarks
    shared = [c for c in cols if all(c in results for results in done)]
    head = "| Model | " + " | ".join(cols) + " | Mean |"
    rule = "|---|" + "---:|" * (len(cols) + 1)
    lines = [head, rule]
    for name, results in rows:
        cells = [f"{100 * results[c]:.2f}" if c in results else "-" for c in cols]
        mean = (f"{100 * sum(results[c] for c in shared) / len(shared):.2f}"
                if shared and all(c in results for c in shared) else "-")
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {mean} |")
    if len(shared) < len(cols):
        left = ", ".join(c for c in cols if c not in shared)
        lines.append(f"\nMean averages the benchmarks every finished row has ("
                     f"{', '.join(shared)}); left out: {left}, which some rows lack." if shared
                     else f"\nNo benchmark is in every finished row, so no Mean is given "
                     f"(rows lack: {left}).")
    return "\n".join(lines)


def write_results(
    results: Mapping[str, float], out_dir: Union[str, Path], model_name: str,
    meta: Optional[Mapping[str, Any]] = None,
) -> tuple[Path, Path]:
    """Writes ``eval_results.json`` and ``eval_results.md`` into ``out_dir``, each whole or not
    at all (a temporary file renamed over it)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    js, md = out / "eval_results.json", out / "eval_results.md"
    for path, text in ((js, json.dumps({"model": model_name, "results": dict(results),
                                        **(meta or {})}, indent=2)),
                       (md, format_table(results, model_name))):
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(text + "\n", encoding="utf-8")
        os.replace(tmp, path)
    return js, md
