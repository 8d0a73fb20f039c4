"""Rollouts sampled and scored: one response per problem from a rollout engine, decoded, and
rewarded by the reward component, checked to be one finite number per response.

:func:`sample_and_score` is what the training step samples its rollouts with, and what every
evaluation (:func:`pepo.training.evaluation.avg_at_k`) samples with; :func:`is_success` gives
the success flags both use (the rollouts PEPO weights, and what avg@k counts).
"""

from __future__ import annotations

import math
import numbers
import operator
from typing import Any, Callable, Optional, Sequence

import torch

from pepo.training.engines import as_engine
from pepo.training.generation import Rollouts, draw_seeds

__all__ = ["ComponentError", "RewardError", "check_reward_range", "advantages_of",
           "choice_of", "is_success", "reward_tensor",
           "sample_and_score"]


class ComponentError(ValueError):
    """A component of the config (the reward, a registered estimator) returned what the run
    cannot use; the message names it. A run stops on it with one line, its last checkpoint
    kept."""


class RewardError(ComponentError):
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
                + ("numbers" if not math.isfinite(x)
                   else f"numbers within float32's range (|r| <= {_F32_MAX:.4g})"))
        out.append(x)
    return torch.tensor(out, dtype=torch.float32)


def check_reward_range(rewards: torch.Tensor, reward_fn: Any, estimator: Any) -> None:
    """Refuses rewards outside the ``reward_range`` ``(lo, hi)`` an estimator declares (SPO's
    Beta tracker counts rewards as successes: ``[0, 1]``); estimators without one take any.

    Raises:
        RewardError: naming the reward component, the first value outside and its response
            (its index in ``rewards``).
    """
    bounds = getattr(estimator, "reward_range", None)
    if bounds is None or rewards.numel() == 0:
        return
    lo, hi = bounds
    outside = ((rewards < lo) | (rewards > hi)).nonzero()
    if outside.numel():
        i = int(outside[0, 0])
        raise RewardError(
            f"reward {_reward_name(reward_fn)} returned {float(rewards[i])!r} for response {i}; "
            f"the {estimator.name} estimator takes rewards in [{lo:g}, {hi:g}] (rescale the "
            f"reward, or use the group estimator)")


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
    :func:`pepo.training.generation.generate`'s sampling arguments (``max_new_tokens``,
    ``temperature``, ``top_k``, ``top_p``); ``batch_size`` bounds the rows decoded at once.
    ``seeds`` (``[B]``, :func:`pepo.training.generation.draw_seeds`) seed each rollout's sampling
    on its own; without them they are drawn from ``generator`` (when given).

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
    if not problems:  # a process's empty share of a batch: nothing to ask the reward
        return ro, torch.zeros(0, device=ro.tokens.device), texts
    rewards = reward_tensor(reward_fn(texts, [p.answer for p in problems]), len(problems),
                            reward_fn).to(ro.tokens.device)  # [B]
    return ro, rewards, texts


def _estimator_name(estimator: Any) -> str:
    return str(getattr(estimator, "name", type(estimator).__name__))


def choice_of(estimator: Any, prompt_ids: list, k: int, generator: Any) -> list[int]:
    """``estimator.choose(prompt_ids, k, generator)`` when it is ``k`` distinct indices into the
    pool (a registered estimator's k - 1 trained on fewer prompts in silence).

    Raises:
        ComponentError: naming the estimator and what it returned.
    """
    picked = estimator.choose(prompt_ids, k, generator)
    try:
        idx = [operator.index(i) for i in picked]
    except TypeError:
        idx = None
    if idx is None or len(idx) != k or len(set(idx)) != k or not all(
            0 <= i < len(prompt_ids) for i in idx):
        raise ComponentError(
            f"estimator {_estimator_name(estimator)!r}: choose() must return {k} distinct "
            f"indices into the pool of {len(prompt_ids)} candidates, got {picked!r}"[:400])
    return idx


def advantages_of(estimator: Any, prompt_ids: Sequence, rewards: torch.Tensor) -> torch.Tensor:
    """``estimator.advantages(prompt_ids, rewards)`` when it is a float tensor ``[N]`` of finite
    values (the rewards are finite: a NaN is the estimator's, which the loss guard would skip
    step after step), in one host sync.

    Raises:
        ComponentError: naming the estimator and what it returned.
    """
    adv = estimator.advantages(prompt_ids, rewards)
    n, name = len(prompt_ids), _estimator_name(estimator)
    if not isinstance(adv, torch.Tensor) or not adv.is_floating_point() or adv.shape != (n,):
        got = (f"a {adv.dtype} tensor of shape {list(adv.shape)}" if isinstance(adv, torch.Tensor)
               else f"a {type(adv).__name__}")
        raise ComponentError(f"estimator {name!r}: advantages() returned {got}, not a float "
                             f"tensor of shape [{n}] (one per rollout)")
    bad = int((~torch.isfinite(adv)).sum())
    if bad:
        raise ComponentError(f"estimator {name!r}: advantages() returned {bad} non-finite "
                             f"values of {n} from finite rewards")
    return adv
