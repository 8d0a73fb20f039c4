"""What a user's own code does with pepo's core, as a type checker reads it.

pepo ships ``py.typed``: a user's mypy or pyright checks their calls against pepo's annotations.
CI runs mypy on the core, the adapters and this file (pyproject.toml's ``[tool.mypy]``), so that
an annotation a user would trip on fails there: each block below is a use the docs show that a
wrong annotation refused (a strategy without ``positive``, a plain-attribute estimator assigned
to ``Estimator``). This file is read, never run (pytest collects ``test_*.py`` only).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import Any, Optional

import torch

import pepo.estimators as est
import pepo.weighting as pw
from pepo.entropy import logprobs_and_entropy, logprobs_and_entropy_from_hidden
from pepo.loss import clipped_policy_loss, policy_loss_metrics


@pw.register_strategy("typing_usage_scaled")
def scaled(gain: float = 1.0) -> pw.StrategyFn:
    # no ``positive``, no ``groups``: a strategy that treats every row alike (docs/strategies.md)
    def fn(advantages: torch.Tensor, entropies: torch.Tensor, mask: torch.Tensor
           ) -> torch.Tensor:
        return torch.where(mask, gain * advantages[:, None], 0.0)

    return fn


@est.register_estimator("typing_usage_constant")
class Constant:
    """An estimator of plain attributes (docs/recipe.md's example has the same form)."""

    name = "typing_usage_constant"
    rollouts_per_prompt = 2
    candidate_pool = 1
    needs_drift = False
    prior_samples = 0

    def prepare(self, prompt_ids: est.PromptIds, score: est.ScoreFn) -> dict[Hashable, float]:
        return {}

    def set_prior(self, pass_rates: Mapping[Hashable, float]) -> None:
        pass

    def choose(self, prompt_ids: est.PromptIds, k: int,
               generator: torch.Generator) -> list[int]:
        return list(range(k))

    def advantages(self, prompt_ids: est.PromptIds, rewards: torch.Tensor) -> torch.Tensor:
        return rewards.float() - 0.5

    def observe(self, prompt_ids: est.PromptIds, rewards: torch.Tensor,
                drift: Optional[float] = None) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        pass


@est.register_estimator("typing_usage_dr_grpo")
class DrGRPO(est.GroupEstimator):
    """docs/recipe.md's subclass: a class attribute ``name`` over GroupEstimator's."""

    name = "typing_usage_dr_grpo"

    def __init__(self, group_size: int = 8):
        super().__init__(group_size, normalize_std=False)


def step(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor,
         rewards: torch.Tensor, hidden: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
    estimators: list[est.Estimator] = [est.GroupEstimator(group_size=4),
                                       est.SingleStreamEstimator(), Constant(),
                                       DrGRPO()]
    estimator: est.Estimator = est.build_estimator("group", group_size=4)
    n: int = estimators[0].rollouts_per_prompt + estimator.candidate_pool
    old_logprobs, entropies = logprobs_and_entropy(logits, targets)
    _, _ = logprobs_and_entropy_from_hidden(hidden, head, targets, temperature=1.0)
    advantages = est.group_advantages(rewards, n, validate=False)
    weigh: pw.Strategy = pw.get_strategy("proximal_softmax", window=101)
    token_adv = weigh(advantages, entropies, mask, positive=rewards > 0, validate=False)
    loss = clipped_policy_loss(old_logprobs, old_logprobs.detach(), token_adv, mask,
                               num_tokens=mask.sum(), validate=False)
    metrics: dict[str, torch.Tensor] = policy_loss_metrics(old_logprobs, old_logprobs, token_adv,
                                                           mask)
    return loss + metrics["approx_kl"]
