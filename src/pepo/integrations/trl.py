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

- **entropies of the rollout policy**, at the sampling temperature, without a forward pass of the
  adapter's wherever TRL's own work already yields them:

  - when TRL computes old log-probs during generation (a generation serves several optimizer
    steps, or vLLM's importance-sampling correction is on), that forward also returns them, and
    the weights are computed there;
  - otherwise (TRL's default: every loss of a generation runs before the next update, so the
    policy in ``_compute_loss`` *is* the rollout policy) the weights of a row depend on its own
    entropies only, for ``proximal_softmax``, ``window_average`` and ``entropy_bonus``, and are
    computed inside ``_compute_loss`` from the (detached) entropies of the loss's own forward;
  - ``global_topk``, ``gtpo`` and strategies registered by users (whose dependence on other rows
    is not known) need every entropy of the generation batch before the first loss: there the
    adapter records them while ``transformers``' ``generate`` samples the completions (a logits
    processor that reads each step's logits and changes nothing). Where generation does not go
    through ``generate`` (vLLM without the importance-sampling correction, continuous batching,
    tool calling, a ``rollout_func``), or where ``generate`` changes the logits before sampling
    (a ``repetition_penalty`` other than 1, or ``generation_kwargs`` such as ``suppress_tokens``
    or ``min_new_tokens``, or such a setting in the model's own ``generation_config``, which
    ``generate`` reads where TRL leaves one unset), it adds one no-grad forward over the
    generation batch, so that every strategy reads the policy's entropies, as TRL's own forward
    and loss do.
    ``uniform`` needs no entropies.

- **successful completions** (``positive=``) from TRL's rewards: the weighted sum of the reward
  functions, as TRL computes it, ``> 0`` (or ``pepo_success(rewards)``), not the sign of the
  advantage. Each process reads the flags of its own completions.
- **only the model's own tokens**: tool results (TRL's ``tool_mask``) are masked out, so they
  neither get weight nor enter a window; so are unscorable completions (every reward function
  returned ``None``), which TRL gives advantage 0.
- **one threshold for the whole generation batch of all processes** for ``global_topk``: its
  quantile is taken over every completion token of every process. TRL's own
  ``top_entropy_quantile`` also gathers the entropies of all processes, but takes its threshold
  per micro-batch (``per_device_train_batch_size`` completions per process), and on every pass
  over a generation from the current policy's entropies: the two select the same tokens when a
  generation is one micro-batch (``steps_per_generation=1``), on its first pass.
- **each prompt's group** for ``gtpo`` and any strategy that takes ``groups=`` (by name or
  ``**kwargs``): TRL's generation batch holds the ``num_generations``
  completions of a prompt one after another, in the order of the processes; the adapter gathers
  the batch of every process and applies the strategy to it whole, so a group split between
  micro-batches or processes is compared as one.

Each weighting logs ``pepo/token_advantage_abs_mean`` (mean ``|Â_{i,t}|`` over valid tokens) and
``pepo/top_fifth_weight_share`` (the share of a row's ``Σ_t |Â_{i,t}|`` on its fifth of tokens
with the largest ``|Â_{i,t}|``, averaged over rows with a nonzero advantage: 0.2 for ``uniform``,
more where a strategy concentrates the weight), beside TRL's own metrics.

``pepo_strategy="uniform"`` trains exactly as plain ``GRPOTrainer``: TRL's ``[B]`` advantages pass
unchanged (the same completions, losses, weights and TRL metrics, bit for bit); only the ``pepo/``
metrics are added.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Callable, Mapping, Optional, cast

import torch

import pepo.weighting as pw

try:
    from transformers import LogitsProcessor, LogitsProcessorList
    from trl import GRPOTrainer
except ImportError as e:  # pragma: no cover - exercised in an environment without TRL
    raise ImportError(
        "pepo.integrations.trl needs TRL (tested with 1.16.0): pip install trl==1.16.0"
    ) from e

__all__ = ["EntropyRecorder", "PepoGRPOTrainer", "top_fifth_weight_share"]

# Strategies whose weights for a row depend on that row's entropies alone: weighted inside
# _compute_loss when the loss's policy is the rollout policy, with no forward of their own.
ROW_WISE = frozenset({"proximal_softmax", "window_average", "entropy_bonus"})

# generate() settings that add no logits processor before EntropyRecorder: the warpers (which run
# after it), lengths, ids and the cache. Any other (a repetition penalty other than 1, suppressed
# tokens, a minimum length, n-gram blocking, a sequence bias, ...) changes the logits the recorder
# would read, which are then not the policy's that TRL's forward and loss see.
_RECORDABLE = frozenset({
    "max_new_tokens", "max_length", "do_sample", "pad_token_id", "bos_token_id", "eos_token_id",
    "temperature", "top_p", "top_k", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff",
    "top_h", "repetition_penalty", "cache_implementation", "use_cache", "disable_compile",
})

# TRL's losses whose gradient reaches each token through its own log-prob under
# importance_sampling_level="sequence" (the others' flows through one ratio per sequence,
# exp(mean_t log ratio), so a row's token advantages act only through their sum)
_TOKEN_GRADIENT_LOSSES = frozenset({"cispo", "vespo"})

# settings a model's generation_config may hold that add no logits processor either
_INERT = frozenset({"length_penalty", "early_stopping", "num_return_sequences", "max_time",
                    "low_memory", "compile_config", "stop_strings"})


class EntropyRecorder(LogitsProcessor):
    """Records the entropy of each generation step's distribution at ``temperature``, changing
    nothing.

    ``generate`` runs custom processors after its own logit processors (repetition penalty,
    suppressed tokens, …) and before its warpers (temperature, top-k, top-p, min-p): without
    such processors the scores seen here are the model's logits, and
    ``softmax(scores / temperature)`` is the distribution TRL's forward computes its entropies
    from. :class:`PepoGRPOTrainer` records only then; with a repetition penalty or another
    processor it runs one forward instead.
    """

    def __init__(self, temperature: float) -> None:
        self.temperature = temperature
        self.steps: list[torch.Tensor] = []  # one [B] per generated token
        self.calls = 0  # generate() calls that used this recorder

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        with torch.no_grad():
            logp = torch.log_softmax(scores.float() / self.temperature, dim=-1)  # [B, V]
            # -inf logits (suppressed tokens) have p = 0 and contribute 0, not 0 * -inf = NaN
            plogp = torch.where(torch.isfinite(logp), logp.exp() * logp, 0.0)
            self.steps.append(-plogp.sum(-1))  # [B]
        return scores

    def entropies(self, rows: int, width: int) -> torch.Tensor:
        """The recorded entropies as ``[rows, width]``: step t of row i at ``[i, t]``, 0 beyond
        the last step."""
        if self.calls != 1 or not self.steps or self.steps[0].numel() != rows:
            raise RuntimeError(
                f"PepoGRPOTrainer recorded {len(self.steps)} generation steps over {self.calls} "
                f"generate() calls for {rows} completions; expected one call for all of them"
            )
        ent = torch.stack(self.steps, dim=1)[:, :width]  # [B, S]
        return torch.nn.functional.pad(ent, (0, width - ent.size(1)))


def top_fifth_weight_share(token_advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The share of each row's weight on its heaviest fifth of tokens.

    For row i with ``n_i`` valid tokens and weights ``w = |token_advantages|`` sorted in
    decreasing order, ``(Σ_{j < ⌊n_i/5⌋} w_j + frac(n_i/5) · w_{⌊n_i/5⌋}) / Σ_j w_j``: the top
    fifth counts a fraction of the boundary token, so equal weights (``uniform``) give 0.2 at
    every length (to fp32 rounding, within 1e-7), and a row whose weight sits on at most n_i/5
    of its tokens gives 1.

    Shape:
        token_advantages: ``[B, T]``; mask: ``[B, T]`` bool; returns ``[B]`` fp32, NaN for rows
        whose weights are all 0 (nothing to share).
    """
    w = torch.where(mask, token_advantages.detach().float().abs(), 0.0)  # [B, T]
    top = w.sort(dim=1, descending=True).values  # [B, T]: masked zeros last
    k = mask.sum(1, keepdim=True).float() / 5  # [B, 1]
    j = torch.arange(w.size(1), device=w.device, dtype=torch.float32)  # [T]
    part = (k - j).clamp(0.0, 1.0)  # [B, T]: 1 inside the top fifth, its fraction at the boundary
    total = w.sum(1)  # [B]
    share = (top * part).sum(1) / torch.where(total > 0, total, 1.0)
    return torch.where(total > 0, share, torch.nan)


def _active_dropout(model: torch.nn.Module) -> Optional[str]:
    """What dropout ``model`` applies in training mode (a ``torch.nn.Dropout`` of p > 0, which
    TRL's ``disable_dropout=True`` zeroes; an ``attention_dropout`` of its config, which it does
    not), or None."""
    layers = [m for m in model.modules() if isinstance(m, torch.nn.Dropout) and m.p > 0]
    if layers:
        return f"{len(layers)} dropout layer(s) are active (p={layers[0].p})"
    rate = getattr(getattr(model, "config", None), "attention_dropout", 0.0)
    if isinstance(rate, (int, float)) and rate > 0:
        return f"the model config's attention_dropout={rate} is active"
    return None


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
            successful completions (bool ``[B]``). Default ``rewards > 0``; with several reward
            functions and a strategy that reads success, the trainer warns that this default
            counts a positive format reward as a success, and with one whose positive rewards
            take several values, that it counts a partial credit as one (at the first such
            batch).

    Raises:
        ValueError: an unknown strategy, a bad parameter, ``process_group`` in ``pepo_params``,
            ``pepo_params`` not a mapping, ``pepo_success`` not callable, a strategy other than
            ``uniform`` with ``importance_sampling_level="sequence"`` and a loss whose gradient
            then sees only each row's sum of token advantages (all but ``cispo``, ``vespo``), or
            ``use_liger_kernel=True`` on a TRL whose loss then bypasses ``_compute_loss`` (before
            TRL loads anything).
    """

    def __init__(
        self,
        *args: Any,
        pepo_strategy: str = "proximal_softmax",
        pepo_params: Optional[Mapping[str, Any]] = None,
        pepo_success: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
        **kwargs: Any,
    ) -> None:
        if pepo_params is not None and not isinstance(pepo_params, Mapping):
            raise ValueError(f"pepo_params must be a dict of the strategy's parameters (such as "
                             f"{{'window': 101}}), got {pepo_params!r}")
        if pepo_success is not None and not callable(pepo_success):
            raise ValueError(f"pepo_success must be a function of TRL's rewards [B] returning "
                             f"bool [B] (such as lambda rewards: rewards >= 1.0), got "
                             f"{pepo_success!r}")
        params = dict(pepo_params or {})
        if "process_group" in params:
            raise ValueError(
                "pepo_params must not set process_group: PepoGRPOTrainer passes the trainer's own "
                "when it runs on several processes"
            )
        trl_args = kwargs.get("args", args[2] if len(args) > 2 else None)
        if (pepo_strategy != "uniform" and getattr(trl_args, "use_liger_kernel", False)
                and hasattr(type(self), "compute_liger_loss")):
            # TRL before 1.16 computes the loss with Liger's kernel, which takes sequence
            # advantages [B] and never calls _compute_loss: every weighting would be dropped
            raise ValueError(
                f"pepo_strategy={pepo_strategy!r} with use_liger_kernel=True: this TRL version "
                f"computes the loss with Liger's fused kernel, which takes no token advantages, "
                f"so pepo's weights would be dropped; set use_liger_kernel=False or use TRL 1.16"
            )
        level = getattr(trl_args, "importance_sampling_level", "token")
        loss_type = getattr(trl_args, "loss_type", None)
        if (pepo_strategy != "uniform" and level == "sequence"
                and loss_type not in _TOKEN_GRADIENT_LOSSES):
            raise ValueError(
                f"pepo_strategy={pepo_strategy!r} with importance_sampling_level='sequence' and "
                f"loss_type={loss_type!r}: the loss's gradient then flows through one ratio per "
                f"sequence, exp(mean_t log ratio), so each row's token advantages act only "
                f"through their sum (PEPO, which keeps it, trains as GRPO); use "
                f"importance_sampling_level='token', or loss_type 'cispo' or 'vespo' (each "
                f"token's own log-prob carries its weight)"
            )
        self.pepo_strategy_name = pepo_strategy
        self.pepo_params = params
        self._pepo_strategy = pw.get_strategy(pepo_strategy, **params)  # fails fast on bad input
        self._pepo_success = pepo_success
        self._pepo_uses_entropy = pepo_strategy != "uniform"
        self._pepo_capture = False
        self._pepo_captured: Optional[torch.Tensor] = None
        self._pepo_recorder: Optional[EntropyRecorder] = None
        self._pepo_rewards: Optional[torch.Tensor] = None
        self._pepo_loss_inputs: Optional[dict] = None
        self._pepo_graded_warned = False
        super().__init__(*args, **kwargs)
        reads_success = self._pepo_strategy.reads_positive
        if pepo_success is None and len(self.reward_funcs) > 1 and reads_success:
            warnings.warn(
                f"PepoGRPOTrainer counts a completion as successful when TRL's weighted sum of "
                f"its {len(self.reward_funcs)} reward functions is > 0 (rewards > 0), so a "
                f"positive format reward makes a wrong answer a success for "
                f"pepo_strategy={pepo_strategy!r}; pass pepo_success= (e.g. "
                f"lambda rewards: rewards >= 1.0) to say which completions succeeded",
                UserWarning, stacklevel=2,
            )
        quantile = getattr(trl_args, "top_entropy_quantile", 1.0)
        if pepo_strategy != "uniform" and quantile is not None and quantile < 1.0:
            warnings.warn(
                f"top_entropy_quantile={quantile} with pepo_strategy={pepo_strategy!r}: TRL "
                f"masks its loss to the current policy's high-entropy tokens after pepo's "
                f"weighting, so the two multiply (pepo's global_topk is that selection on the "
                f"rollout policy's entropies); set top_entropy_quantile=1.0 to train the "
                f"strategy alone",
                UserWarning, stacklevel=2,
            )
        model = getattr(self, "model", None)
        dropout = (_active_dropout(model) if self._pepo_uses_entropy
                   and isinstance(model, torch.nn.Module) else None)
        if dropout is not None:
            warnings.warn(
                f"PepoGRPOTrainer: {dropout} while TRL trains, so the entropies "
                f"pepo_strategy={pepo_strategy!r} weighs by are read under dropout, not the "
                f"policy's (a LoRA run with lora_dropout=0.05 read them up to 0.56 nats off); "
                f"set disable_dropout=True (and a model config without attention dropout), as "
                f"pepo's own recipe trains",
                UserWarning, stacklevel=2,
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
                pending, entropies.detach().float(), pending.pop("pepo_positive"),
                scored=pending.pop("pepo_scored", None))
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

    def _generate_single_turn(self, prompt_ids, *args: Any, **kwargs: Any):
        recorder = self._pepo_recorder
        if recorder is None or self.use_vllm or self.use_transformers_continuous_batching:
            return super()._generate_single_turn(prompt_ids, *args, **kwargs)
        # TRL calls generate() on this unwrapped model with its own arguments only; the recorder
        # joins them for this call, and the model's generate is restored after it.
        model = self.accelerator.unwrap_model(self.model_wrapped)
        own = model.__dict__.get("generate")
        generate = model.generate

        def recording_generate(*a: Any, **kw: Any):
            processors = LogitsProcessorList(kw.pop("logits_processor", None) or [])
            processors.append(recorder)
            recorder.calls += 1
            return generate(*a, logits_processor=processors, **kw)

        model.generate = recording_generate
        try:
            return super()._generate_single_turn(prompt_ids, *args, **kwargs)
        finally:
            if own is None:
                del model.generate
            else:
                model.generate = own

    def _generate_and_score_completions(self, inputs):
        mode = "train" if self.model.training else "eval"
        self._pepo_rewards, self._pepo_captured, self._pepo_recorder = None, None, None
        # TRL's old-log-prob pass runs on the current policy only under these conditions (its
        # own test); otherwise the first forward through self.model may be a PEFT reference.
        generate_every = self.args.steps_per_generation * self.num_iterations
        old_logps_pass = (
            self.args.gradient_accumulation_steps % generate_every != 0
            or (self.use_vllm and self.vllm_importance_sampling_correction)
        )
        train = self._pepo_uses_entropy and mode == "train"
        row_wise = self.pepo_strategy_name in ROW_WISE
        self._pepo_capture = train and old_logps_pass
        if (train and not old_logps_pass and not row_wise
                and self._pepo_generates_with_transformers()):
            self._pepo_recorder = EntropyRecorder(self.temperature)
        try:
            output = super()._generate_and_score_completions(inputs)
        finally:
            self._pepo_capture = False
        if mode != "train":
            return output
        positive = self.pepo_success(len(inputs))
        if self._pepo_uses_entropy and not old_logps_pass and row_wise:
            output["pepo_positive"] = positive  # weighted in _compute_loss, row by row, where
            start = self.accelerator.process_index * len(positive)  # the rewards are gone
            output["pepo_scored"] = self._pepo_scored()[start : start + len(positive)].to(
                positive.device)
        elif self._pepo_uses_entropy:
            output["advantages"] = self.pepo_token_advantages(output, positive)
        else:  # uniform: A_i on every valid token is what TRL's own [B] advantages give; they
            # stay [B], so that TRL's per-sequence metrics (clip ratios under sequence-level
            # importance sampling, vespo's) read them as in plain GRPOTrainer
            self.pepo_token_advantages(output, positive)  # its pepo/ metrics
        self._pepo_rewards, self._pepo_captured, self._pepo_recorder = None, None, None
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

    def _pepo_generates_with_transformers(self) -> bool:
        """Whether this generation samples every completion in one ``transformers`` ``generate``
        call (TRL's default), where :class:`EntropyRecorder` can see each step, with logits that
        are the policy's: no repetition penalty and no other ``generation_kwargs`` that add a
        logits processor before the recorder (then the adapter runs a forward instead)."""
        if (self.use_vllm or self.use_transformers_continuous_batching
                or self.rollout_func is not None or self.tools):
            return False
        kwargs = dict(getattr(self, "generation_kwargs", None) or {})
        # generate() fills each setting TRL leaves None from the model's own generation_config
        # (its generation_config.json, or what the user set on it): n-gram blocking there runs
        # before the recorder as surely as in generation_kwargs
        own = getattr(self.accelerator.unwrap_model(self.model), "generation_config", None)
        if own is not None:
            for k, v in own.to_diff_dict().items():
                if (kwargs.get(k) is None and v not in (None, False, 0, [], {})
                        and not (k, v) == ("num_beams", 1) and k not in _INERT
                        and not k.startswith(("output_", "return_", "transformers_", "_"))):
                    kwargs[k] = v  # (what generate() returns, settings of beam search and of
                    # when to stop, and the file's own bookkeeping add no processor)
        penalty = kwargs.get("repetition_penalty")
        return penalty in (None, 1.0) and all(k in _RECORDABLE for k in kwargs)

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
            self._pepo_warn_graded(rewards)
            return rewards > 0
        flags = torch.as_tensor(self._pepo_success(rewards), device=rewards.device)
        if flags.dtype != torch.bool or flags.shape != rewards.shape:
            raise ValueError(
                f"pepo_success must return a bool tensor of shape {list(rewards.shape)}, got "
                f"dtype {flags.dtype} and shape {list(flags.shape)}"
            )
        return flags

    def _pepo_warn_graded(self, rewards: torch.Tensor) -> None:
        """Warns once when one reward function's rewards are graded (its positive rewards take
        more than one value: partial credit) and the default ``rewards > 0`` decides success for
        a strategy that reads it: a partial credit of 0.5 is then a success, as a full 1.0 is (a
        binary reward of any two values, -1/1 or a weighted 0/1, is what > 0 reads right;
        several functions: the warning when the trainer was built)."""
        if (self._pepo_graded_warned or len(self.reward_funcs) != 1
                or not self._pepo_strategy.reads_positive):
            return
        scored = rewards > 0
        low, high = torch.stack([torch.where(scored, rewards, math.inf).min(),  # one host sync
                                 torch.where(scored, rewards, -math.inf).max()]).tolist()
        if low < high:  # (no positive reward: inf > -inf)
            self._pepo_graded_warned = True
            warnings.warn(
                f"PepoGRPOTrainer counts a completion as successful when its reward is > 0, and "
                f"this reward function gives graded positive rewards (from {low:.4g} to "
                f"{high:.4g}), so a partial credit counts as a success for "
                f"pepo_strategy={self.pepo_strategy_name!r}; pass pepo_success= (e.g. "
                f"lambda rewards: rewards >= 1.0) to say which completions succeeded",
                UserWarning, stacklevel=2,
            )

    def pepo_rollout_entropies(self, output: Mapping[str, Any]) -> torch.Tensor:
        """Token entropies ``[B, T]`` of the rollout policy for the generation batch in
        ``output``: those TRL's own forward produced, those recorded while ``generate`` sampled,
        or one no-grad forward of the adapter's."""
        if self._pepo_captured is not None:
            return self._pepo_captured
        prompt_ids, completion_ids = output["prompt_ids"], output["completion_ids"]
        if self._pepo_recorder is not None:
            return self._pepo_recorder.entropies(*completion_ids.shape)
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

    def pepo_token_advantages(self, output: Mapping[str, Any],
                              positive: torch.Tensor) -> torch.Tensor:
        """The strategy's token advantages ``[B, T]`` for a generation batch TRL produced."""
        if self._pepo_uses_entropy:
            entropies = self.pepo_rollout_entropies(output).float()
        else:
            entropies = torch.zeros(output["completion_mask"].shape,
                                    device=output["completion_mask"].device)
        return self._pepo_weigh(output, entropies, positive)

    def _pepo_weigh(self, batch: Mapping[str, Any], entropies: torch.Tensor,
                    positive: torch.Tensor, scored: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The strategy's token advantages for ``batch``'s rows; ``scored``: which of them some
        reward function scored (by default read from the generation's rewards)."""
        advantages = batch["advantages"]
        mask = batch["completion_mask"].bool()
        if batch.get("tool_mask") is not None:
            mask = mask & batch["tool_mask"].bool()
        if scored is None and (every := self._pepo_scored()) is not None:
            start = self.accelerator.process_index * mask.size(0)
            scored = every[start : start + mask.size(0)]
        if scored is not None:  # unscorable completions get no weight, as TRL gives them
            # advantage 0, and enter no threshold or metric (gtpo shaped them as failures)
            mask = mask & scored.to(mask.device)[:, None]
        if self._pepo_strategy.reads_groups:  # gtpo, and user strategies that take groups=
            out = self._pepo_weigh_groups(advantages, entropies, mask, positive)
        else:
            # batch-global statistics (global_topk's threshold) span every process; the strategy
            # passes the group only to a function that declares it
            group = None
            if self.accelerator.num_processes > 1:
                import torch.distributed as dist

                group = dist.group.WORLD
            out = self._pepo_strategy(advantages, entropies, mask, positive=positive,
                                      process_group=group)
        self._pepo_log(out, mask)
        return out.to(advantages.dtype)

    def _pepo_scored(self) -> Optional[torch.Tensor]:
        """The generation batch's completions (every process's, bool ``[N]``) that some reward
        function scored; the others (every function returned ``None``) TRL calls unscorable and
        gives advantage 0. None outside a generation."""
        if self._pepo_rewards is None:
            return None
        return ~torch.isnan(self._pepo_rewards).all(dim=1)

    def _pepo_weigh_groups(self, advantages: torch.Tensor, entropies: torch.Tensor,
                           mask: torch.Tensor, positive: torch.Tensor) -> torch.Tensor:
        """The strategy on the generation batch of every process at once, with TRL's groups:
        ``num_generations`` consecutive completions of the processes' batches in process order
        (the order TRL normalises rewards in), so a group may span two processes."""
        acc = self.accelerator
        rows, width = mask.shape
        if acc.num_processes > 1:
            advantages = acc.gather(advantages.float())
            entropies = acc.gather(acc.pad_across_processes(entropies.float(), dim=1))
            mask = acc.gather(acc.pad_across_processes(mask.long(), dim=1)).bool()
            positive = acc.gather(positive.long()).bool()
        groups = torch.arange(mask.size(0), device=mask.device) // cast(int, self.num_generations)
        scored = self._pepo_scored()
        if scored is not None:  # an unscorable completion is a group of its own: in its
            # prompt's group it would make a group of successes look mixed (gtpo counts rows),
            # where TRL leaves it out of the baseline
            alone = groups.numel() + torch.arange(groups.numel(), device=mask.device)
            groups = torch.where(scored[: groups.numel()].to(mask.device), groups, alone)
        out = self._pepo_strategy(advantages, entropies, mask, positive=positive, groups=groups)
        start = acc.process_index * rows  # every process holds the same number of rows
        return out[start : start + rows, :width]

    def _pepo_log(self, token_advantages: torch.Tensor, mask: torch.Tensor) -> None:
        """Appends this batch's ``pepo/`` metrics (over every process) to TRL's train metrics."""
        share = top_fifth_weight_share(token_advantages, mask)  # [B]
        weighted = ~torch.isnan(share)
        stats = torch.stack([
            torch.where(mask, token_advantages.float().abs(), 0.0).sum(),
            mask.sum().float(),
            torch.where(weighted, share, 0.0).sum(),
            weighted.sum().float(),
        ])
        abs_sum, tokens, share_sum, rows = self.accelerator.reduce(stats, reduction="sum").tolist()
        metrics = self._metrics["train"]
        metrics["pepo/token_advantage_abs_mean"].append(abs_sum / max(tokens, 1.0))
        if rows > 0:
            metrics["pepo/top_fifth_weight_share"].append(share_sum / rows)
