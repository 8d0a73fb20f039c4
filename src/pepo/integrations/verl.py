"""pepo's token weighting inside verl's v1 PPO trainer (verl 0.9.1).

Registered with verl through the ``verl.plugins`` entry point (``pyproject.toml``), so
``import verl`` in the driver and in every Ray worker registers the trainer ``pepo``::

    python -m verl.trainer.main_ppo ... algorithm.adv_estimator=grpo \\
        trainer.v1.trainer_mode=pepo \\
        +pepo.strategy=proximal_softmax +pepo.params.window=101

:class:`PepoPPOTrainer` is verl's synchronous v1 trainer with one step changed: after verl's
``_compute_advantage`` (GRPO's sequence advantages, broadcast over each response), it reads the
advantages, the rollout ``entropy`` that ``_compute_old_log_prob`` already wrote (the old policy's
forward: no extra pass), the response mask and the reward scores from verl's data store, applies
the strategy, and writes the token advantages back. verl's policy losses take ``[B, T]``
advantages, so no worker or loss changes. A rollout succeeded when its summed token scores are
``> 0`` (``+pepo.success_threshold=...`` to change it).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch

import pepo.weighting as pw

try:
    import transfer_queue as tq
    from tensordict import TensorDict
    from verl.trainer.ppo.v1.trainer_base import register_trainer
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
    from verl.workers.utils.padding import response_to_nested
except ImportError as e:  # pragma: no cover - exercised in an environment without verl
    raise ImportError(
        "pepo.integrations.verl needs verl 0.9.1 and its v1 trainer's packages: "
        "pip install verl==0.9.1 TransferQueue cachetools uvicorn fastapi"
    ) from e

__all__ = ["PepoPPOTrainer", "strategy_from_config", "token_advantages"]


def strategy_from_config(cfg: Optional[Mapping[str, Any]]) -> tuple[pw.Strategy, float]:
    """The strategy and success threshold named by verl's top-level ``pepo`` config block.

    Raises:
        ValueError: no ``pepo.strategy``, an unknown strategy or a bad parameter.
    """
    if cfg is None or cfg.get("strategy") is None:
        raise ValueError(
            "trainer.v1.trainer_mode=pepo needs a strategy: add +pepo.strategy=NAME (one of "
            f"{', '.join(pw.list_strategies())}) and its parameters as +pepo.params.KEY=VALUE"
        )
    params = dict(cfg.get("params") or {})
    strategy = pw.get_strategy(str(cfg["strategy"]), **params)
    if strategy.needs_groups:
        raise ValueError(
            f"pepo.strategy={cfg['strategy']!r} compares the rollouts of each prompt's group, which "
            f"the verl adapter does not pass to strategies yet; train it with pepo's recipe"
        )
    return strategy, float(cfg.get("success_threshold", 0.0))


def token_advantages(
    strategy: pw.Strategy,
    advantages: torch.Tensor,
    entropy: torch.Tensor,
    response_mask: torch.Tensor,
    token_scores: torch.Tensor,
    success_threshold: float = 0.0,
) -> torch.Tensor:
    """verl's padded batch -> the strategy's token advantages ``[B, T]``.

    Args:
        advantages: ``[B, T]`` verl's GRPO advantages (each row's sequence advantage on its
            response tokens); the row's value is read at its first response token, as verl does.
        entropy: ``[B, T]`` the rollout entropies ``_compute_old_log_prob`` wrote.
        response_mask: ``[B, T]`` 1 on response tokens (0 on padding and tool tokens).
        token_scores: ``[B, T]`` verl's ``rm_scores``; a row succeeded when their sum exceeds
            ``success_threshold``.
    """
    if not (advantages.shape == entropy.shape == response_mask.shape == token_scores.shape):
        raise ValueError(
            f"advantages {list(advantages.shape)}, entropy {list(entropy.shape)}, response_mask "
            f"{list(response_mask.shape)} and rm_scores {list(token_scores.shape)} must have one "
            f"shape [B, T]"
        )
    mask = response_mask.bool()
    first = mask.int().argmax(dim=1)
    rows = torch.arange(advantages.size(0), device=advantages.device)
    sequence = torch.where(mask.any(dim=1), advantages[rows, first], 0.0)
    positive = token_scores.sum(dim=1) > success_threshold
    return strategy(sequence, entropy.float(), mask, positive=positive).to(advantages.dtype)


@register_trainer("pepo")
class PepoPPOTrainer(PPOTrainerSync):
    """verl's synchronous v1 trainer with pepo's token weighting of the advantages."""

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        # a bad `pepo` section fails here, before verl builds anything
        self.pepo_strategy, self.pepo_success_threshold = strategy_from_config(config.get("pepo"))
        super().__init__(config, *args, **kwargs)

    def _compute_advantage(self, batch, metrics: dict):
        batch = super()._compute_advantage(batch, metrics)
        data = tq.kv_batch_get(
            keys=batch.keys, partition_id=batch.partition_id,
            select_fields=["advantages", "entropy", "response_mask", "rm_scores"],
        )
        if data.get("entropy", None) is None:
            raise ValueError(
                "pepo needs the rollout entropies that verl's _compute_old_log_prob writes; "
                "algorithm.rollout_correction.bypass_mode=True skips that pass"
            )
        nested_mask = data["response_mask"]
        padded = data.to_padded_tensor()
        weighted = token_advantages(
            self.pepo_strategy, padded["advantages"], padded["entropy"], padded["response_mask"],
            padded["rm_scores"], self.pepo_success_threshold,
        )
        metrics["pepo/token_advantage_abs_mean"] = float(
            weighted.abs().sum() / padded["response_mask"].sum().clamp(min=1))
        out = TensorDict({"advantages": response_to_nested(weighted, nested_mask)},
                         batch_size=len(batch))
        return tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id, fields=out)
