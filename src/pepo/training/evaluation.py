"""avg@k evaluation, shared by the training recipe's validation and ``tune run pepo_eval``.

avg@k of a benchmark is the mean over its problems of the fraction of ``k`` sampled responses
that succeed (the paper reports avg@1 on MATH500 and avg@16 on AMC and AIME). Success is
:func:`is_success`: reward > 0 unless the reward component defines its own rule; the training
recipe uses the same flags to choose the rollouts PEPO weights.
"""

from __future__ import annotations

import json
import math
import numbers
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import torch

from pepo.training.engines import as_engine
from pepo.training.generation import Rollouts, draw_seeds

__all__ = [
    "PAPER_COLUMNS",
    "RewardError",
    "reward_tensor",
    "avg_at_k",
    "is_success",
    "eval_generator",
    "format_table",
    "format_tables",
    "sample_and_score",
    "write_results",
]

PAPER_COLUMNS = ("AIME2024", "AIME2025", "AMC", "MATH500")


class RewardError(ValueError):
    """The reward component returned something other than one finite number per response."""


_F32_MAX = float(torch.finfo(torch.float32).max)


def _reward_name(reward_fn: Any) -> str:
    """``module.Name`` of a reward function, or of a reward component's class."""
    name = getattr(reward_fn, "__qualname__", None) or type(reward_fn).__qualname__
    module = getattr(reward_fn, "__module__", None) or type(reward_fn).__module__
    return f"{module}.{name}" if module and module != "builtins" else name


def reward_tensor(values: Any, n: int, reward_fn: Any) -> torch.Tensor:
    """``values``, as returned by ``reward_fn`` for ``n`` responses, as a float32 ``[n]`` tensor.

    Raises:
        RewardError: not ``n`` values, or a value that is not a finite real number within
            float32's range (``None``, a string, NaN, inf, ``1e300``), named as returned, with
            the reward component and the response's index.
    """
    name = _reward_name(reward_fn)
    if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
        raise RewardError(f"reward {name} must return a list of {n} numbers (one per response), "
                          f"got {type(values).__name__} {_short(values)}")
    if len(values) != n:
        raise RewardError(f"reward {name} returned {len(values)} values for {n} responses")
    out = []
    for i, v in enumerate(values):
        x = v.item() if getattr(v, "ndim", None) == 0 and hasattr(v, "item") else v  # 0-d tensors
        # and numpy scalars
        if not isinstance(x, numbers.Real):
            raise RewardError(f"reward {name} returned {_short(v)} ({type(v).__name__}) for "
                              f"response {i}; rewards must be finite numbers")
        x = float(x)
        if not math.isfinite(x) or abs(x) > _F32_MAX:
            raise RewardError(
                f"reward {name} returned {_short(v)} for response {i}; rewards must be finite "
                + ("numbers" if not math.isfinite(x) else f"numbers within float32's range (|r| <= {_F32_MAX:.4g})"))
        out.append(x)
    return torch.tensor(out, dtype=torch.float32)


def _short(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 80 else r[:77] + "..."


def is_success(reward_fn: Any, rewards: torch.Tensor) -> torch.Tensor:
    """Which rollouts succeeded: ``reward_fn.success(rewards)`` when the reward component
    defines it (for rewards that are not binary, e.g. partial credit), else ``rewards > 0``.

    Shape:
        rewards: ``[B]``; returns ``[B]`` bool on the rewards' device.

    Raises:
        ValueError: a custom rule that does not return one bool per reward.
    """
    rule = getattr(reward_fn, "success", None)
    if not callable(rule):
        return rewards > 0
    flags = torch.as_tensor(rule(rewards)).to(rewards.device)
    if flags.dtype != torch.bool or flags.shape != rewards.shape:
        raise ValueError(
            f"{type(reward_fn).__name__}.success must return a bool tensor of shape "
            f"{list(rewards.shape)}, got dtype {flags.dtype} and shape {list(flags.shape)}"
        )
    return flags


def eval_generator(seed: int, device: Union[str, torch.device] = "cpu") -> torch.Generator:
    """The sampling generator of an evaluation: the same for every evaluation of a run (and
    for ``pepo_eval`` with the same seed), so two evaluations differ only by the policy."""
    return torch.Generator(device=device).manual_seed(seed + 7919)


@torch.no_grad()
def sample_and_score(
    engine: Any,
    tokenizer: Any,
    problems: Sequence[Any],
    reward_fn: Callable[[list[str], list[str]], list[float]],
    *,
    stop_tokens: Sequence[int],
    generator: Optional[torch.Generator] = None,
    batch_size: Optional[int] = None,
    seeds: Optional[torch.Tensor] = None,
    **gen_kwargs: Any,
) -> tuple[Rollouts, torch.Tensor, list[str]]:
    """One sampled response per problem, decoded and scored: ``(rollouts, rewards [B], texts)``.

    The training step and every evaluation go through here. ``engine`` is a rollout engine of
    :mod:`pepo.training.engines` (or a model, sampled in-process); ``gen_kwargs`` are
    :func:`pepo.training.generation.generate`'s sampling arguments (``max_new_tokens``, ``temperature``,
    ``top_k``, ``top_p``); ``batch_size`` bounds the rows decoded at once. ``seeds`` (``[B]``,
    :func:`pepo.training.generation.draw_seeds`) seed each rollout's sampling on its own; without them
    they are drawn from ``generator`` (when given).

    Raises:
        RewardError: the reward function does not return one finite number per response.
    """
    if seeds is None and generator is not None:
        seeds = draw_seeds(generator, len(problems))
    ro = as_engine(engine).generate(
        [tokenizer.encode_prompt(p.prompt) for p in problems], pad_id=tokenizer.pad_id,
        stop_tokens=stop_tokens, generator=generator, batch_size=batch_size, seeds=seeds,
        **gen_kwargs,
    )
    texts = [tokenizer.decode(t[m].tolist()) for t, m in zip(ro.tokens, ro.mask)]
    rewards = reward_tensor(reward_fn(texts, [p.answer for p in problems]), len(problems),
                            reward_fn).to(ro.tokens.device)  # [B]
    return ro, rewards, texts


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
) -> float:
    """avg@k of ``problems`` (objects with ``prompt`` and ``answer``), sampled by ``engine``
    (a rollout engine of :mod:`pepo.training.engines`, or a model).

    Generation runs in batches of ``batch_size`` rollouts; ``generator`` makes it reproducible.
    With ``dist`` (a :class:`pepo.training.distributed.Dist`), each process samples its share of the
    ``len(problems) * k`` rollouts and the counts are summed: the same avg@k as one process.
    ``progress``: the label of a progress bar (tqdm, on standard error, removed when done) that
    counts this process's rollouts as they finish, on the main process only; None: no bar.
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
        from tqdm import tqdm

        bar = tqdm(total=len(mine), desc=progress, unit="rollout", leave=False,
                   dynamic_ncols=True)
    try:
        _, rewards, _ = sample_and_score(
            engine, tokenizer, mine, reward_fn,
            stop_tokens=list(tokenizer.stop_tokens if stop_tokens is None else stop_tokens),
            batch_size=batch_size, max_new_tokens=max_new_tokens, temperature=temperature,
            top_k=top_k, top_p=top_p, seeds=None if seeds is None else seeds[part],
            **({} if bar is None else {"progress": bar.update}),
        )
    finally:
        if bar is not None:
            bar.close()
    correct = is_success(reward_fn, rewards).float().sum().reshape(1)
    if dist is not None:
        correct = dist.sum(correct)
    return float(correct) / len(rows)


def format_table(results: Mapping[str, float], model_name: str = "model") -> str:
    """A Markdown table in the paper's layout: AIME2024, AIME2025, AMC, MATH500, Mean (in %).

    Benchmarks outside the paper's four follow them; Mean averages the benchmarks present.
    """
    return format_tables([(model_name, results)])


def format_tables(rows: Sequence[tuple[str, Mapping[str, float]]]) -> str:
    """:func:`format_table` with one row per evaluated model, over the benchmarks any of them
    has (``-`` where a model has no result; its Mean averages the benchmarks it has)."""
    present = {c for _, results in rows for c in results}
    cols = [c for c in PAPER_COLUMNS if c in present] + sorted(present - set(PAPER_COLUMNS))
    head = "| Model | " + " | ".join(cols) + " | Mean |"
    rule = "|---|" + "---:|" * (len(cols) + 1)
    lines = [head, rule]
    for name, results in rows:
        cells = [f"{100 * results[c]:.2f}" if c in results else "-" for c in cols]
        mean = sum(results.values()) / len(results)
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {100 * mean:.2f} |")
    return "\n".join(lines)


def write_results(
    results: Mapping[str, float], out_dir: Union[str, Path], model_name: str,
    meta: Optional[Mapping[str, Any]] = None,
) -> tuple[Path, Path]:
    """Writes ``eval_results.json`` and ``eval_results.md`` into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    js = out / "eval_results.json"
    js.write_text(json.dumps({"model": model_name, "results": dict(results), **(meta or {})},
                             indent=2) + "\n", encoding="utf-8")
    md = out / "eval_results.md"
    md.write_text(format_table(results, model_name) + "\n", encoding="utf-8")
    return js, md
