"""pepo's token weighting inside verl's v1 PPO trainer (verl 0.9.1).

Registered with verl through the ``verl.plugins`` entry point (``pyproject.toml``), so
``import verl`` in the driver and in every Ray worker registers the trainer ``pepo``::

    python -m verl.trainer.main_ppo ... algorithm.adv_estimator=grpo \\
        trainer.v1.trainer_mode=pepo \\
        +pepo.strategy=proximal_softmax +pepo.params.window=101

:class:`PepoPPOTrainer` is verl's synchronous v1 trainer (it runs as ``trainer_mode=sync``,
with that section's settings) with one step changed: after verl's
``_compute_advantage`` it reads the advantages, the rollout ``entropy`` that
``_compute_old_log_prob`` already wrote (the old policy's forward: no extra pass), the response
mask, the reward scores and each rollout's prompt ``uid`` from verl's data store, applies the
strategy, and writes the token advantages back. verl's policy losses take ``[B, T]`` advantages,
so no worker or loss changes. A rollout succeeded when its summed token scores are ``> 0``
(``+pepo.success_threshold=...`` to change it). The rollouts of one prompt share a ``uid``; the
strategy gets them as integer ``groups`` (what ``gtpo`` compares), every strategy alike.

pepo's strategies weight one advantage per rollout (``Â_{i,t} = c_{i,t} A_i`` and its kin), so
the adapter takes verl's estimators whose advantages are one value per response, broadcast over
its tokens (:data:`CONSTANT_ROW_ESTIMATORS`), and refuses, at construction, those whose
advantages vary along the response (:data:`ROW_VARYING_ESTIMATORS`: a critic, per-token
baselines; and the returns-to-go of ``reinforce_plus_plus`` with ``gamma < 1`` or
``use_kl_in_reward``), and those verl 0.9.1's v1 trainer cannot run (:data:`V1_UNAVAILABLE`:
``remax`` and ``gdpo`` need inputs only its legacy trainer computes). Every step also checks
that each row's advantages are one value, so an estimator registered elsewhere, or token-level
reward scores, fail in one line instead of being flattened. Weighting each token's own advantage
(``c_{i,t} A_{i,t}``) was not chosen: it is no strategy's formula (PEPO's ``Σ_t c_{i,t} = T_i``
would no longer keep the row's total advantage; ``entropy_bonus`` caps its bonus by ``|A_i|``;
``gtpo`` builds its own advantages; a user strategy is a function of one advantage per row), so
it would train something untested.
"""

from __future__ import annotations

import copy
import math
from typing import Any, Mapping, Optional, Sequence

import torch

import pepo.weighting as pw

try:
    import transfer_queue as tq
    from omegaconf import OmegaConf
    from tensordict import TensorDict
    from verl.trainer.ppo.v1.trainer_base import register_trainer
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
    from verl.workers.utils.padding import response_to_nested
except ImportError as e:  # pragma: no cover - exercised in an environment without verl
    raise ImportError(
        "pepo.integrations.verl needs verl 0.9.1 and its v1 trainer's packages: "
        "pip install verl==0.9.1 TransferQueue cachetools uvicorn fastapi"
    ) from e

__all__ = [
    "CONSTANT_ROW_ESTIMATORS",
    "ROW_VARYING_ESTIMATORS",
    "V1_UNAVAILABLE",
    "PepoPPOTrainer",
    "SEQUENCE_ADVANTAGE_LOSSES",
    "check_adv_estimator",
    "check_policy_loss",
    "group_ids",
    "strategy_from_config",
    "token_advantages",
]

#: verl 0.9.1's estimators that give each response one advantage, broadcast over its tokens
#: (a function of the summed token rewards, then at most a whitening over the batch).
CONSTANT_ROW_ESTIMATORS = (
    "gpg", "grpo", "grpo_passk", "grpo_vectorized", "opo",
    "reinforce_plus_plus_baseline", "rloo", "rloo_vectorized",
)
#: verl 0.9.1's estimators whose advantages vary along each response: a critic's values
#: (``gae``) or a baseline per token position (the optimal token baselines).
ROW_VARYING_ESTIMATORS = ("gae", "optimal_token_baseline", "tir_optimal_token_baseline")
#: returns-to-go: one value per response only with ``gamma == 1``, no KL penalty in the reward
#: and an outcome reward on one token; refused otherwise.
_RETURN_ESTIMATORS = ("reinforce_plus_plus",)
#: verl 0.9.1's estimators its v1 trainer (the one pepo's trainer is) cannot run, each with what
#: it lacks: the v1 advantage step passes neither a greedy rollout's reward nor reward components.
V1_UNAVAILABLE = {
    "remax": "needs reward_baselines (a greedy rollout's reward), which only verl's legacy "
             "trainer computes",
    "gdpo": "needs the reward's components (algorithm.gdpo_reward_keys), the prompts and the "
            "attention mask, which verl's v1 advantage step does not fetch",
}

#: verl 0.9.1's policy losses that average each response's token advantages into one before
#: they meet its tokens (``geo_mean``, GMPO: "we only support sequence level advantage"): a
#: weighting keeps nothing there but the row's mean (PEPO's is GRPO's ``A_i``). Every other loss
#: weights each token's own term by its advantage (``gspo`` included: its ratio's gradient is
#: each token's own log-prob's, scaled by the sequence ratio).
SEQUENCE_ADVANTAGE_LOSSES = ("geo_mean",)


def check_policy_loss(config: Any, strategy: str) -> None:
    """Refuses, for a strategy other than ``uniform``, a verl ``config`` whose loss does not
    train each token's advantage: ``actor_rollout_ref.actor.policy_loss.loss_mode`` of
    :data:`SEQUENCE_ADVANTAGE_LOSSES`, or distillation without the task's rewards (verl sets
    the policy loss to 0)."""
    if strategy == "uniform":
        return
    loss_mode = OmegaConf.select(config, "actor_rollout_ref.actor.policy_loss.loss_mode",
                                 default=None)
    if loss_mode in SEQUENCE_ADVANTAGE_LOSSES:
        raise ValueError(
            f"actor_rollout_ref.actor.policy_loss.loss_mode={loss_mode} averages each "
            f"response's token advantages into one before its loss, so pepo.strategy="
            f"{strategy} would train as its row means (PEPO's are GRPO's advantages); use "
            f"another loss_mode (vanilla, gspo, cispo, ...)"
        )
    if (OmegaConf.select(config, "distillation.enabled", default=False) and not OmegaConf.select(
            config, "distillation.distillation_loss.use_task_rewards", default=True)):
        raise ValueError(
            "distillation.distillation_loss.use_task_rewards=False trains on the teacher's "
            "distillation loss alone (verl sets the policy loss to 0), so no advantage, and no "
            f"pepo.strategy={strategy} weight, reaches the gradient; set it to true or leave "
            "trainer_mode=pepo out")


def _supported() -> str:
    return ", ".join(CONSTANT_ROW_ESTIMATORS + _RETURN_ESTIMATORS)


def check_adv_estimator(algorithm: Optional[Mapping[str, Any]]) -> Optional[str]:
    """The name of verl's ``algorithm.adv_estimator``, or an error if its advantages vary along
    each response (see the module's docstring). ``None`` when there is no ``algorithm`` section;
    estimators this module does not know pass here and are checked on each step's advantages.

    Raises:
        ValueError: ``gae``, ``optimal_token_baseline``, ``tir_optimal_token_baseline``;
            ``reinforce_plus_plus`` with ``gamma != 1`` or ``use_kl_in_reward``; ``remax`` and
            ``gdpo`` (:data:`V1_UNAVAILABLE`).
    """
    if algorithm is None:
        return None
    name = algorithm.get("adv_estimator", "gae")  # verl's default
    name = str(getattr(name, "value", name))
    why = None
    if name in V1_UNAVAILABLE:
        raise ValueError(f"algorithm.adv_estimator={name} {V1_UNAVAILABLE[name]} (its first step "
                         f"would fail); use one of: {_supported()}")
    if name in ROW_VARYING_ESTIMATORS:
        why = "gives each token its own advantage"
    elif name == "reinforce_plus_plus" and float(algorithm.get("gamma", 1.0)) != 1.0:
        why = f"with algorithm.gamma={algorithm.get('gamma')} discounts along the response"
    elif name in _RETURN_ESTIMATORS and algorithm.get("use_kl_in_reward", False):
        why = "with algorithm.use_kl_in_reward=True takes returns of per-token rewards"
    if why is not None:
        raise ValueError(
            f"algorithm.adv_estimator={name} {why}, which pepo's strategies (one advantage per "
            f"rollout) would flatten; use one of: {_supported()}"
        )
    return name


_PEPO_KEYS = ("strategy", "params", "success_threshold")


def strategy_from_config(cfg: Optional[Mapping[str, Any]]) -> tuple[pw.Strategy, float]:
    """The strategy and success threshold named by verl's top-level ``pepo`` config block.

    Raises:
        ValueError: no ``pepo.strategy``, an unknown strategy or a bad parameter, a key of the
            block other than ``strategy``, ``params`` and ``success_threshold`` (a parameter
            written as ``+pepo.window=5`` would be dropped), ``params`` that are not a mapping, or
            a threshold that is not a finite number.
    """
    if cfg is None or cfg.get("strategy") is None:
        raise ValueError(
            "trainer.v1.trainer_mode=pepo needs a strategy: add +pepo.strategy=NAME (one of "
            f"{', '.join(pw.list_strategies())}) and its parameters as +pepo.params.KEY=VALUE"
        )
    unknown = sorted(str(k) for k in cfg.keys() if k not in _PEPO_KEYS)
    if unknown:
        raise ValueError(
            f"pepo.{unknown[0]} is not a key of verl's pepo block (strategy, params, "
            f"success_threshold); a strategy's parameter goes in +pepo.params.{unknown[0]}=VALUE"
        )
    params = cfg.get("params") or {}
    if not isinstance(params, Mapping):
        raise ValueError(f"pepo.params must be a mapping of the strategy's parameters "
                         f"(+pepo.params.KEY=VALUE), got {params!r}")
    if "process_group" in params:  # a run's object, which no config value can be
        raise ValueError("pepo.params must not set process_group: the driver weighs the whole "
                         "batch in one process")
    strategy = pw.get_strategy(str(cfg["strategy"]), **dict(params))
    given = cfg.get("success_threshold", 0.0)
    try:
        threshold = float(given) if not isinstance(given, bool) else math.nan
    except (TypeError, ValueError):
        threshold = math.nan
    if not math.isfinite(threshold):  # NaN: no rollout would succeed, and nothing be weighted
        raise ValueError(f"pepo.success_threshold must be a finite number (a rollout succeeds "
                         f"when its reward is above it), got {given!r}")
    return strategy, threshold


def group_ids(uids: Sequence[Any]) -> torch.Tensor:
    """verl's per-rollout prompt ``uid`` -> ``[B]`` int64 group ids, numbered in order of first
    appearance (equal uids, equal ids)."""
    index: dict[Any, int] = {}
    return torch.tensor([index.setdefault(u, len(index)) for u in uids], dtype=torch.long)


def token_advantages(
    strategy: pw.Strategy,
    advantages: torch.Tensor,
    entropy: torch.Tensor,
    response_mask: torch.Tensor,
    token_scores: torch.Tensor,
    success_threshold: float = 0.0,
    *,
    groups: Optional[torch.Tensor] = None,
    adv_estimator: Optional[str] = None,
    generated_mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """verl's padded batch -> the strategy's token advantages ``[B, T]``.

    Args:
        strategy: the pepo strategy (:func:`strategy_from_config` of the ``pepo`` section).
        advantages: ``[B, T]`` verl's advantages, one value per row on its response tokens (the
            estimators of :data:`CONSTANT_ROW_ESTIMATORS` broadcast it so).
        entropy: ``[B, T]`` the rollout entropies ``_compute_old_log_prob`` wrote.
        response_mask: ``[B, T]`` 1 on response tokens (0 on padding and tool tokens).
        token_scores: ``[B, T]`` verl's ``rm_scores``; a row succeeded when their sum exceeds
            ``success_threshold``.
        success_threshold: see ``token_scores`` (the ``pepo`` section's key; 0: a positive
            reward is a success).
        groups: ``[B]`` integer, equal for the rollouts of one prompt (:func:`group_ids` of
            verl's ``uid``); needed by strategies that compare a group's rollouts (``gtpo``).
        adv_estimator: verl's estimator, named in the error below.
        generated_mask: ``[B, T]`` the tokens the policy generated, where ``response_mask``
            also leaves out the tokens verl's rollout correction rejected (rejection sampling
            zeroes them in the mask it writes back): they were generated all the same and stay
            in the context, so the strategy weighs the rows over these (each window, ``T_i``,
            a group's or the batch's statistics), and the rejected tokens then get 0, as
            verl's loss drops them. None: ``response_mask``.

    Raises:
        ValueError: shapes that differ, advantages that are not floating point (the weights
            would be truncated), a ``response_mask`` with values other than 0 and 1, or a row
            whose advantages differ along its response tokens (they would be flattened to one
            value).
    """
    if not advantages.is_floating_point():
        raise ValueError(f"advantages must be a floating-point tensor, got dtype "
                         f"{advantages.dtype}")
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
    same = (advantages == sequence[:, None]) | (advantages.isnan() & sequence.isnan()[:, None])
    varying = (mask & ~same).any(dim=1)
    odd = (response_mask != 0) & (response_mask != 1)
    any_varying, any_odd = torch.stack([varying.any(), odd.any()]).tolist()  # one sync
    if any_odd:
        raise ValueError(f"response_mask must hold 0 and 1 only, got "
                         f"{response_mask[odd][0].item()!r}")
    if any_varying:
        i = int(varying.nonzero()[0])
        row = advantages[i][mask[i]]
        named = f" (algorithm.adv_estimator={adv_estimator})" if adv_estimator else ""
        raise ValueError(
            f"verl's advantages{named} vary along {int(varying.sum())} of {len(varying)} "
            f"responses (row {i}: from {float(row.min()):.6g} to {float(row.max()):.6g}); pepo's "
            f"strategies weight one advantage per rollout: use one of {_supported()}, with an "
            f"outcome reward"
        )
    positive = token_scores.sum(dim=1) > success_threshold
    generated = mask if generated_mask is None else generated_mask.bool() | mask
    out = strategy(sequence, entropy.float(), generated, positive=positive, groups=groups)
    return torch.where(mask, out, 0.0).to(advantages.dtype)


_NO_ENTROPY = ("pepo needs the rollout entropies that verl's _compute_old_log_prob writes; "
               "algorithm.rollout_correction.bypass_mode=True skips that pass: set it to False")
_NO_ENTROPY_FIELD = ("verl's batch holds no 'entropy' field at its advantage step: pepo reads "
                     "the rollout entropies that verl 0.9.1's _compute_old_log_prob writes "
                     "there, which this verl version names otherwise or does not keep")


@register_trainer("pepo")
class PepoPPOTrainer(PPOTrainerSync):
    """verl's synchronous v1 trainer with pepo's token weighting of the advantages."""

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        # a bad `pepo` section or an estimator pepo would flatten fails here, before verl builds
        # anything
        self.pepo_strategy, self.pepo_success_threshold = strategy_from_config(config.get("pepo"))
        self.pepo_adv_estimator = check_adv_estimator(config.get("algorithm"))
        check_policy_loss(config, self.pepo_strategy.name)
        correction = (config.get("algorithm") or {}).get("rollout_correction") or {}
        if correction.get("bypass_mode", False):
            raise ValueError(_NO_ENTROPY)
        # verl chose this class by trainer.v1.trainer_mode=pepo, and its v1 base then compares
        # that value with "sync" (the replay buffer, refills, the data store's checkpoints): this
        # is the sync trainer, so it runs as trainer_mode=sync, with the `sync` section's settings
        # (on a copy: the caller's config still selects this trainer)
        if OmegaConf.select(config, "trainer.v1.trainer_mode") is not None:
            config = copy.deepcopy(config)
            OmegaConf.update(config, "trainer.v1.trainer_mode", "sync")
        super().__init__(config, *args, **kwargs)

    def _compute_advantage(self, batch, metrics: dict):
        # the response mask as generated: verl's step writes back one without the tokens its
        # rollout correction rejected (token_advantages' generated_mask)
        generated = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id,
                                    select_fields=["response_mask"]).to_padded_tensor()
        batch = super()._compute_advantage(batch, metrics)
        data = tq.kv_batch_get(
            keys=batch.keys, partition_id=batch.partition_id,
            select_fields=["advantages", "entropy", "response_mask", "rm_scores", "uid"],
        )
        if data.get("entropy", None) is None:  # bypass_mode was refused in __init__
            raise ValueError(_NO_ENTROPY_FIELD)
        nested_mask = data["response_mask"]
        padded = data.to_padded_tensor()
        groups = group_ids(padded.pop("uid").tolist())  # as verl's own advantage step reads it
        weighted = token_advantages(
            self.pepo_strategy, padded["advantages"], padded["entropy"], padded["response_mask"],
            padded["rm_scores"], self.pepo_success_threshold, groups=groups,
            adv_estimator=self.pepo_adv_estimator, generated_mask=generated["response_mask"],
        )
        metrics["pepo/token_advantage_abs_mean"] = float(
            weighted.abs().sum() / padded["response_mask"].sum().clamp(min=1))
        out = TensorDict({"advantages": response_to_nested(weighted, nested_mask)},
                         batch_size=len(batch))
        return tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id, fields=out)
