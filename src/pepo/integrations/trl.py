"""pepo's token weighting inside TRL's ``GRPOTrainer`` (TRL 1.16).

:class:`PepoGRPOTrainer` is a ``GRPOTrainer`` that turns TRL's sequence advantages ``[B]`` into a
pepo strategy's token advantages ``[B, T]`` where TRL's maintainers point users to:
``_generate_and_score_completions``, whose ``advantages`` ``_compute_loss`` accepts as ``[B, T]``.
Everything else (generation, rewards, group normalisation, the loss and its normaliser, vLLM,
PEFT) is TRL's own::

    from pepo.integrations.trl import PepoGRPOTrainer

    trainer = PepoGRPOTrainer(
        model=model, reward_funcs=reward_fn, args=GRPOConfig(...), train_dataset=dataset,
        pepo_strategy="proximal_softmax", pepo_params={"window": 101},
    )
    trainer.train()

What it feeds the strategy, following the paper:

- **entropies of the rollout policy**, at the sampling temperature, taken from a forward TRL
  already runs, without a pass of the adapter's, wherever one exists:

  - when TRL computes old log-probs during generation (a generation serves several optimizer
    steps, or vLLM's importance-sampling correction is on), that forward also returns them, and
    the weights are computed there;
  - otherwise (TRL's default: every loss of a generation runs before the next update, so the
    policy in ``_compute_loss`` *is* the rollout policy) the weights of a row depend on its own
    entropies only, for every strategy but ``global_topk``, and are computed inside
    ``_compute_loss`` from the (detached) entropies of the loss's own forward;
  - ``global_topk`` (and strategies registered by users, whose dependence is not known) needs
    every entropy of the generation batch before the first loss: there the adapter adds one
    no-grad forward over the generation batch. ``uniform`` needs none.

- **successful completions** (``positive=``) from TRL's rewards: the weighted sum of the reward
  functions, as TRL computes it, ``> 0`` (or ``pepo_success(rewards)``), not the sign of the
  advantage.
- **one threshold for the whole generation batch of all processes** for ``global_topk``: its
  quantile is taken over every completion token of every process (TRL's own
  ``top_entropy_quantile`` takes it per micro-batch and per process).

``pepo_strategy="uniform"`` trains exactly as plain ``GRPOTrainer`` (the same completions, losses
and weights, bit for bit).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

import torch

import pepo.weighting as pw

try:
    from trl import GRPOTrainer
except ImportError as e:  # pragma: no cover - exercised in an environment without TRL
    raise ImportError(
        "pepo.integrations.trl needs TRL (tested with 1.16.0): pip install trl==1.16.0"
    ) from e

__all__ = ["PepoGRPOTrainer"]

# Strategies whose weights for a row depend on that row's entropies alone: weighted inside
# _compute_loss when the loss's policy is the rollout policy, with no forward of their own.
ROW_WISE = frozenset({"proximal_softmax", "window_average", "entropy_bonus"})


class PepoGRPOTrainer(GRPOTrainer):
    """``GRPOTrainer`` whose advantages are weighted per token by a pepo strategy.

    Args:
        *args, **kwargs: ``GRPOTrainer``'s own arguments.
        pepo_strategy: a registered strategy name (``pepo.weighting.list_strategies()``, your own
            ``@register_strategy`` ones included). Default ``"proximal_softmax"`` (PEPO).
        pepo_params: the strategy's parameters, e.g. ``{"window": 101, "temperature": 1.0}``.
            ``global_topk`` gets ``process_group`` from the trainer when it runs on several
            processes; do not pass one.
        pepo_success: maps TRL's rewards ``[B]`` (the weighted sum of the reward functions) to the
            successful completions (bool ``[B]``). Default ``rewards > 0``.

    Raises:
        ValueError: an unknown strategy, a bad parameter, or ``process_group`` in ``pepo_params``
            (before TRL loads anything).
    """

    def __init__(
        self,
        *args: Any,
        pepo_strategy: str = "proximal_softmax",
        pepo_params: Optional[Mapping[str, Any]] = None,
        pepo_success: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
        **kwargs: Any,
    ) -> None:
        params = dict(pepo_params or {})
        if "process_group" in params:
            raise ValueError(
                "pepo_params must not set process_group: PepoGRPOTrainer passes the trainer's own "
                "when it runs on several processes"
            )
        self.pepo_strategy_name = pepo_strategy
        self.pepo_params = params
        self._pepo_strategy = pw.get_strategy(pepo_strategy, **params)  # fails fast on bad input
        if self._pepo_strategy.needs_groups:
            raise ValueError(
                f"pepo_strategy={pepo_strategy!r} compares the completions of each prompt's group, "
                f"which PepoGRPOTrainer does not pass to strategies yet; train it with pepo's recipe"
            )
        self._pepo_success = pepo_success
        self._pepo_uses_entropy = pepo_strategy != "uniform"
        self._pepo_capture = False
        self._pepo_captured: Optional[torch.Tensor] = None
        self._pepo_rewards: Optional[torch.Tensor] = None
        self._pepo_loss_inputs: Optional[dict] = None
        super().__init__(*args, **kwargs)
        if self.accelerator.num_processes > 1 and "process_group" in (
            pw.strategy_parameters(pepo_strategy) or []
        ):
            import torch.distributed as dist

            self._pepo_strategy = pw.get_strategy(
                pepo_strategy, **params, process_group=dist.group.WORLD
            )

    # -- TRL hooks ---------------------------------------------------------------------------

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        # [N_all, F]: every process's completions (TRL gathers them before normalising per group)
        rewards_per_func = super()._calculate_rewards(
            inputs, prompts, completions, completion_ids_list
        )
        self._pepo_rewards = rewards_per_func
        return rewards_per_func

    def _get_per_token_logps_and_entropies(self, model, *args: Any, **kwargs: Any):
        pending = self._pepo_loss_inputs
        if pending is not None and kwargs.get("compute_entropy"):
            # the loss's own forward (on the rollout policy): weight this micro-batch's rows
            self._pepo_loss_inputs = None
            logps, entropies, aux = super()._get_per_token_logps_and_entropies(
                model, *args, **kwargs)
            pending["advantages"] = self._pepo_weigh(
                pending, entropies.detach().float(), pending.pop("pepo_positive"))
            return logps, entropies, aux
        # During generation, TRL's own old-log-prob forward (when it runs one) also yields the
        # entropies the strategy needs: ask for them and keep them.
        capture = self._pepo_capture and self._pepo_captured is None and model is self.model
        if capture:
            wanted = kwargs.get("compute_entropy", False)
            kwargs["compute_entropy"] = True
        logps, entropies, aux = super()._get_per_token_logps_and_entropies(model, *args, **kwargs)
        if capture:
            self._pepo_captured = entropies
            if not wanted:
                entropies = None
        return logps, entropies, aux

    def _generate_and_score_completions(self, inputs):
        mode = "train" if self.model.training else "eval"
        self._pepo_rewards, self._pepo_captured = None, None
        # TRL's old-log-prob pass runs on the current policy only under these conditions (its
        # own test); otherwise the first forward through self.model may be a PEFT reference.
        generate_every = self.args.steps_per_generation * self.num_iterations
        old_logps_pass = (
            self.args.gradient_accumulation_steps % generate_every != 0
            or (self.use_vllm and self.vllm_importance_sampling_correction)
        )
        self._pepo_capture = self._pepo_uses_entropy and mode == "train" and old_logps_pass
        try:
            output = super()._generate_and_score_completions(inputs)
        finally:
            self._pepo_capture = False
        if mode != "train":
            return output
        positive = self.pepo_success(len(inputs))
        if (self._pepo_uses_entropy and not old_logps_pass
                and self.pepo_strategy_name in ROW_WISE):
            output["pepo_positive"] = positive  # weighted in _compute_loss, row by row
        else:
            output["advantages"] = self.pepo_token_advantages(output, positive)
        self._pepo_rewards, self._pepo_captured = None, None
        return output

    def _compute_loss(self, model, inputs):
        if "pepo_positive" in inputs:
            self._pepo_loss_inputs = inputs
        try:
            loss = super()._compute_loss(model, inputs)
        finally:
            self._pepo_loss_inputs = None
        if "pepo_positive" in inputs:  # TRL's loss ran no entropy forward: nothing was weighted
            raise RuntimeError(
                "PepoGRPOTrainer weights row-wise strategies inside TRL's _compute_loss, from the "
                "entropies of its forward, and this TRL version computed none; use TRL 1.16"
            )
        return loss

    # -- the weighting -----------------------------------------------------------------------

    def pepo_success(self, local_count: int) -> torch.Tensor:
        """This process's successful completions (bool ``[B]``) from the rewards TRL computed for
        the current generation batch."""
        if self._pepo_rewards is None:
            raise RuntimeError("no rewards recorded for this generation batch")
        weights = self.reward_weights.to(self._pepo_rewards.device)
        rewards = (self._pepo_rewards * weights.unsqueeze(0)).nansum(dim=1)
        start = self.accelerator.process_index * local_count
        rewards = rewards[start : start + local_count]
        if self._pepo_success is None:
            return rewards > 0
        flags = torch.as_tensor(self._pepo_success(rewards), device=rewards.device)
        if flags.dtype != torch.bool or flags.shape != rewards.shape:
            raise ValueError(
                f"pepo_success must return a bool tensor of shape {list(rewards.shape)}, got "
                f"dtype {flags.dtype} and shape {list(flags.shape)}"
            )
        return flags

    def pepo_rollout_entropies(self, output: Mapping[str, Any]) -> torch.Tensor:
        """Token entropies ``[B, T]`` of the rollout policy for the generation batch in
        ``output``: those TRL's own forward produced, or one no-grad forward of the adapter's."""
        if self._pepo_captured is not None:
            return self._pepo_captured
        prompt_ids, completion_ids = output["prompt_ids"], output["completion_ids"]
        if any(k in output for k in ("pixel_values", "image_grid_thw", "num_images")):
            raise NotImplementedError(
                "PepoGRPOTrainer does not weight multimodal batches yet: its entropy pass "
                "passes text only"
            )
        with torch.no_grad():
            _, entropies, _ = self._get_per_token_logps_and_entropies(
                self.model,
                torch.cat([prompt_ids, completion_ids], dim=1),
                torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1),
                completion_ids.size(1),
                batch_size=self.args.per_device_train_batch_size,
                compute_entropy=True,
            )
        return entropies

    def pepo_token_advantages(self, output: Mapping[str, Any], positive: torch.Tensor) -> torch.Tensor:
        """The strategy's token advantages ``[B, T]`` for a generation batch TRL produced."""
        if self._pepo_uses_entropy:
            entropies = self.pepo_rollout_entropies(output).float()
        else:
            entropies = torch.zeros(output["completion_mask"].shape,
                                    device=output["completion_mask"].device)
        return self._pepo_weigh(output, entropies, positive)

    def _pepo_weigh(self, batch: Mapping[str, Any], entropies: torch.Tensor,
                    positive: torch.Tensor) -> torch.Tensor:
        advantages = batch["advantages"]
        mask = batch["completion_mask"].bool()
        if batch.get("tool_mask") is not None:
            mask = mask & batch["tool_mask"].bool()
        return self._pepo_strategy(advantages, entropies, mask, positive=positive).to(
            advantages.dtype
        )
