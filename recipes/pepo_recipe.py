"""RL with verifiable rewards, any token-weighting strategy, group or single-stream advantages.

    tune run pepo_recipe --config tiny [key=value ...]

One step (PEPO paper, Sec. 4-5 and App. C.1; ``docs/recipe.md`` has the details):

1. choose prompts: a candidate pool from a seeded epoch-wise shuffle, from which the estimator
   picks ``prompts_per_step`` (group mode: the pool as it is; single-stream mode: SPO's
   prioritised draw by ``sqrt(p(1-p)) + eps`` from a pool ``candidate_pool`` times larger);
2. generate the estimator's rollouts per prompt (``group_size``, or 1) with a KV cache,
   temperature, top-k and top-p (``pepo.training.generation``);
3. verify → rewards (``reward`` component) and success flags
   (``pepo.training.evaluation.is_success``) → sequence advantages (``pepo.estimators``);
4. one no-grad forward of the rollout policy → old log-probs and entropies
   (``pepo.entropy.logprobs_and_entropy``, at the sampling temperature), skipped when one
   update of a row-local strategy starts from that policy (its own forward gives them, and 5);
5. token advantages from the strategy named in ``strategy.name`` (``pepo.weighting``), which
   weights the successful rollouts under ``apply_to: positive``;
6. ``ppo_epochs`` × ``ppo_mini_batches`` AdamW steps of ``pepo.loss.clipped_policy_loss``,
   with gradient accumulation over micro-batches normalised by the mini-batch's token count;
7. the estimator observes the step (single-stream: the value tracker absorbs the rewards,
   forgetting by the policy drift since each prompt's last visit, SPO's adaptive ρ; the drift
   of this step's update, the batch's mean |Δ log-prob|, is one extra no-grad forward).

Both estimators share one interface (``pepo.estimators``), so the step has no mode checks.

Deviations from the paper's setup, all deliberate:

* Log-probs and entropies ignore top-k/top-p truncation (as verl and TRL do): they are those of
  the temperature-scaled softmax, so the entropies PEPO weights by are at the sampling
  temperature (0.6 in the paper's configs; Eq. (3) writes ``π_θ`` without one), as verl's are.
* Rollouts come from ``generation.engine``: pepo's own KV-cached decoder (``inprocess``) on the
  torchtune model in the training process (the default) or a colocated vLLM engine that receives the
  trainer's weights after every optimizer step (``pepo.training.engines``). Either way the trainer
  recomputes the old log-probs itself; the engine's own log-probs only measure the mismatch
  (``rollout_logprob_gap``) and, with ``loss.tis_cap``, weight the loss by the capped ratio trainer
  / engine (truncated importance sampling).
* Single-stream forgetting: SPO's ``D(x)`` (the policy change since prompt ``x`` was last
  seen) is measured as the sum, over the steps in between, of each step's mean |Δ log-prob|
  across its update on that step's batch, a cheap stand-in for the KL between the two policies.
* Dropout is off in every forward (the model stays in eval mode), so the ratio of the first
  mini-batch is exactly 1 and old and new log-probs come from the same function.
* ``validation`` samples ``samples`` responses per held-out prompt with the training sampler's
  settings and a fixed seed, so successive evaluations differ only by the policy.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

from pepo import _extras

_extras.require("pepo_recipe")  # before torchtune: a missing extra gets the line that names it

import torch
from omegaconf import DictConfig
from torchtune import config, training, utils
from torchtune.modules import TransformerSelfAttentionLayer
from torchtune.recipe_interfaces import FTRecipeInterface

from pepo import weighting
from pepo.loss import policy_loss_metrics, truncated_is_weights
from pepo.sampling import PromptSampler
from pepo.training import closing, distributed, prior_cache, resume
from pepo.training.checkpointing import AtomicCheckpointer, resolve_marker
from pepo.training.config import (
    build,
    check_world_size,
    config_error_exit,
    experiment_config,
    prior_fingerprint,
    register_resolvers,
    resolve_config_arg,
    setting_warnings,
    val_before_fingerprint,
    validate_config,
)
from pepo.training.config_rules import resolve_component
from pepo.training.distributed import Dist, minibatch_indices, shard_model, tile_rows
from pepo.training.engines import build_engine, fitting_prompts, sequence_limit
from pepo.training.evaluation import (
    avg_at_k,
    eval_generator,
    is_success,
    sample_and_score,
)
from pepo.training.generation import Rollouts, draw_seeds
from pepo.training.models import check_model
from pepo.training.precision import (
    autocast,
    cpu_attention_in_fp32,
    cpu_warnings,
    resolve_compute_dtype,
)
from pepo.training.precision import describe as describe_precision
from pepo.training.progress import Progress, run_line
from pepo.training.reporting import NullLogger, write_rollouts
from pepo.training.rollouts import ComponentError, advantages_of, check_reward_range, choice_of
from pepo.training.run_lock import RunLock
from pepo.training.step import (
    StepStats,
    Trajectory,
    by_length,
    dump_records,
    mean_abs_change,
    policy_logprobs,
    step_metrics,
    validation_summary,
    weigh,
    weigh_from_update,
)
from pepo.training.stopping import (
    CheckpointFailed,
    NonFiniteError,
    NonFiniteGuard,
    StopSignals,
    TrainingStopped,
)
from pepo.training.tokenizers import stop_token_ids
from pepo.training.weights import load_model_weights

__all__ = ["CheckpointFailed", "NonFiniteError", "PEPORecipe", "TrainingStopped",
           "recipe_main", "validation_summary"]

log = utils.get_logger("INFO")

register_resolvers()


class PEPORecipe(FTRecipeInterface):
    """The RLVR training loop. ``cfg`` is read in ``__init__`` and :meth:`setup` only."""

    def __init__(self, cfg: DictConfig) -> None:
        if cfg.get("checkpoint_dir") is not None:  # RUN/checkpoints/best or .../latest works
            cfg.checkpoint_dir = resolve_marker(cfg.checkpoint_dir)
        c = self.config = validate_config(cfg)  # typed, with every default filled in
        device_type = str(c.device).split(":")[0]
        self.dist = Dist(device_type, timeout_s=c.distributed.timeout_s,
                         cpu_offload=c.distributed.cpu_offload)
        check_world_size(c, self.dist.world_size)
        self._device = (self.dist.device(device_type) if self.dist.enabled
                        else utils.get_device(c.device))
        self._dtype = training.get_dtype(c.dtype, device=self._device)
        self.compute_dtype = resolve_compute_dtype(c.compute_dtype, self._device)  # autocast
        self.seed = training.set_seed(seed=c.seed)
        self.output_dir = Path(c.output_dir)
        self.num_steps = c.num_steps
        self.prompts_per_step = c.prompts_per_step
        self.estimator = c.estimator.build()
        self.ppo_epochs = c.ppo_epochs
        self.ppo_mini_batches = c.ppo_mini_batches
        self.recompute_old = c.recompute_old_logprobs
        self.tile = tile_rows(self.estimator.rollouts_per_prompt, self.ppo_mini_batches)
        self.micro_batch_size = c.micro_batch_size
        self.eps_low, self.eps_high = float(c.loss.eps_low), float(c.loss.eps_high)
        # the loss component (pepo.loss.ClippedPolicyLoss unless loss._component_ names another)
        self.loss = resolve_component("loss", c.loss._component_)(eps_low=self.eps_low,
                                                                   eps_high=self.eps_high)
        self.tis_cap = c.loss.tis_cap
        self.clip_grad_norm = c.clip_grad_norm
        g = c.generation
        self.gen_kwargs = dict(max_new_tokens=g.max_new_tokens, temperature=g.temperature,
                               top_k=g.top_k, top_p=g.top_p)
        self.forward_kw = dict(chunk_size=c.logprob_chunk_size, from_hidden=c.logprobs_from_hidden,
                               save_logits_mib=c.save_logits_mib)  # policy_logprobs's options
        self.activation_checkpointing = c.enable_activation_checkpointing
        self.gen_batch_size = g.batch_size
        self.val_every = c.validation.every if c.val_dataset else 0  # none to run: warned
        self.val_samples = c.validation.samples
        self.val_dump = c.validation.dump
        self.save_every = c.save_every
        self.dump_every = c.dump_rollouts_every
        self.resume = c.resume_from_checkpoint
        self.plot = c.plot
        # one run per output_dir, from before the checkpoint check to the end of the run (rank 0
        # holds it for the job); a second run gets one config error naming the holder
        self.run_lock = RunLock(self.output_dir) if self.dist.is_main else None
        try:
            closing.check_output_dir_state(self.output_dir, self.resume)
        except BaseException:
            if self.run_lock is not None:  # refused: no empty output_dir left behind
                self.run_lock.abandon()
            raise
        self.experiment = experiment_config(cfg)
        self.prior_path, self.val_cache = c.prior_cache, c.validation.before_cache
        self.prior_fingerprint, self.val_fingerprint = (prior_fingerprint(cfg),
                                                        val_before_fingerprint(cfg))
        self.signals = StopSignals(lambda: self.step, lambda: self.checkpointer.marked(), log,
                                   any_rank=self.dist.any if self.dist.enabled else None)
        self.nonfinite = NonFiniteGuard(c.max_nonfinite_steps, log)
        self._diagnostic_failures: set[str] = set()
        self.validation_pending = False  # a resumed step's validation failed: it is owed
        self.step = 0
        self.history: list[dict[str, Any]] = []

    # ------------------------------------------------------------------ setup
    def setup(self, cfg: DictConfig) -> None:
        """Builds everything; what fails fast (tokenizer, stop tokens, data files, reward) comes
        before the model, so a bad path or field costs seconds, not a model load."""
        self.tokenizer = build(cfg, "tokenizer")
        c = self.config
        self.stop_tokens = stop_token_ids(self.tokenizer, c.generation.stop_tokens)
        train_data = list(build(cfg, "dataset"))
        val_data = list(build(cfg, "val_dataset")) if c.val_dataset else []
        self.reward_fn = build(cfg, "reward")
        name, params = c.strategy.name, c.strategy.params
        self.strategy_name = name
        self.strategy = weighting.get_strategy(name, **params)
        # the one update of a step starts from the sampling policy: its forward gives the old
        # log-probs and entropies, and a row-local strategy the weights (step.weigh_from_update)
        self.old_from_update = (not self.recompute_old and self.ppo_epochs == 1
                                and self.ppo_mini_batches == 1 and self.strategy.row_local)
        # the newest keep_checkpoints, and (keep_best) the one of the best validation accuracy:
        # also a resume without validation keeps the best of the steps before it
        self.keep_best = c.keep_best and bool(self.val_every)
        self.checkpointer = AtomicCheckpointer(
            self.output_dir / "checkpoints", keep=c.keep_checkpoints,
            best_metric="val_accuracy" if c.keep_best else None,
        )
        resume_state = resume.agreed_checkpoint(  # rank 0 chooses it for every rank
            self.checkpointer, self.dist, experiment=self.experiment, num_steps=self.num_steps,
            warn=log.warning, closed=closing.is_closed(self.output_dir)) if self.resume else None

        with training.set_default_dtype(self._dtype), self._device:
            self.model = build(cfg, "model")
        check_model(self.model, self.tokenizer.vocab_size,
                    logprobs_from_hidden=self.forward_kw["from_hidden"])
        load_model_weights(self.model, c.checkpoint_dir)
        self.model.eval()  # no dropout anywhere: rollout, old and new log-probs are one function
        if self._device.type == "cpu":  # its bf16 attention is slower than fp32 with a backward
            cpu_attention_in_fp32(self.model)
        if self.activation_checkpointing:
            training.set_activation_checkpointing(
                self.model, auto_wrap_policy={TransformerSelfAttentionLayer}
            )
        if self.dist.enabled:  # FSDP2: each decoder layer, then the root
            mp = c.distributed.mixed_precision
            shard_model(self.model, (TransformerSelfAttentionLayer,),
                        cpu_offload=c.distributed.cpu_offload,
                        mixed_precision=training.get_dtype(mp) if mp else None)
        self.optimizer = build(cfg, "optimizer", self.model.parameters())
        self.lr_scheduler = None
        self.schedule_steps = self.num_steps * self.ppo_epochs * self.ppo_mini_batches
        if c.lr_scheduler is not None:
            self.lr_scheduler = build(
                cfg, "lr_scheduler", self.optimizer, num_training_steps=self.schedule_steps
            )
        # a run that starts from a Hugging Face checkpoint also ends with one (for vLLM, HF)
        src = Path(str(c.checkpoint_dir))
        self.hf_source = src if (src / "config.json").is_file() else None
        engine, options = c.generation.engine, c.generation.engine_options
        # prompts that do not fit are dropped before the engine starts (vLLM's max_model_len
        # is checked here too, not at the first generation)
        self.seq_limit = sequence_limit(self.model, engine, options)
        fit = (self.tokenizer, self.seq_limit, self.gen_kwargs["max_new_tokens"],
               self.model.max_seq_len, log.warning)
        self.train_data = fitting_prompts(train_data, "dataset", *fit, per_step=(
            self.prompts_per_step, self.estimator.candidate_pool))
        self.val_data = fitting_prompts(val_data, "val_dataset", *fit) if val_data else []
        self.prompts_dropped = {"dataset": len(train_data) - len(self.train_data),
                                "val_dataset": len(val_data or ()) - len(self.val_data)}
        self.config_name = c.name
        if self.dist.is_main:
            log.info(run_line(self))
            log.info(describe_precision(c.compute_dtype, self.compute_dtype, self._device))
            for line in (cpu_warnings(self.compute_dtype, c.dtype, self._device)
                         + setting_warnings(c)):
                log.warning(line)
            if engine == "vllm" and self.compute_dtype is not None \
                    and options.get("dtype") != "bfloat16":
                log.warning(f"generation.vllm.dtype={options.get('dtype')} samples at another "
                            f"precision than the bf16 trainer (rollout_logprob_gap shows it)")
        self.engine = build_engine(engine, self.model, compile=c.generation.compile,
                                   compute_dtype=self.compute_dtype, **(
            {**options, "hf_dir": self.hf_source, "seed": self.seed, "device": self._device,
             "state_dict": lambda: resume.model_state_dict(self.model, self.dist)}
            if engine == "vllm" else {}))
        self.sampler = PromptSampler(len(self.train_data), seed=self.seed)
        # host-side choices (prompt draws, mini-batch order) and token sampling on the model's
        # device use separate generators; both are checkpointed
        self.rng = torch.Generator(device="cpu").manual_seed(self.seed)
        self.sample_rng = torch.Generator(device=self._device).manual_seed(self.seed + 1)
        # logs, plots, dumps and checkpoint files come from rank 0 only
        if self.dist.is_main:  # a fresh run (-1): an earlier run's lines go
            resume.truncate_metrics(cfg, resume_state[1]["step"] if resume_state else -1, log.info)
            if resume_state is None or resume_state[1]["step"] < self.num_steps:
                closing.reopen(self.output_dir)  # it trains: no longer closed
        self.metric_logger = build(cfg, "metric_logger") if self.dist.is_main else NullLogger()
        self.metric_logger.log_config(cfg)
        if resume_state is not None:
            resume.load_state(self, *resume_state, log=log.info)
        else:  # a validation cache of other settings: refused now, not after the prior
            self.val_fingerprint = prior_cache.checked_fingerprint(
                self.val_cache if self.val_every else None, self.val_fingerprint,
                c.checkpoint_dir, val_dataset=self.val_data)
            self._prepare_estimator()

    def _prepare_estimator(self) -> None:
        """Whatever the estimator needs before training (SPO: its offline prior, or the one
        kept in ``prior_cache``: :func:`pepo.training.prior_cache.prepare_estimator`), with the
        rollouts it asks for scored as training rollouts are. They draw their seeds from a
        generator of their own, so the training stream after it is the same whether the prior
        was computed or read."""
        data = self.train_data
        prior_rng = torch.Generator(device=self._device).manual_seed(self.seed + 2)

        def score(indices: list[int]) -> torch.Tensor:
            seeds = draw_seeds(prior_rng, len(indices))
            part = self.dist.shard(len(indices))
            problems = [data[i] for i in indices]
            return self._in_range(self.dist.gather(self._rollout(problems[part], seeds[part])[1]))

        fingerprint = {**self.prior_fingerprint, **prior_cache.input_digests(  # rank 0 reads
            self.prior_path if self.dist.is_main else None, self.config.checkpoint_dir,
            dataset=data)}
        prior_cache.prepare_estimator(self.estimator, [p.id for p in data], score, log=log,
                                      path=self.prior_path, fingerprint=fingerprint, dist=self.dist)

    # -------------------------------------------------------------- one step
    def _rollout(self, problems: list, seeds: torch.Tensor):
        """One response per problem, each sampled with its own seed; returns rollouts,
        rewards [b] and texts."""
        return sample_and_score(
            self.engine, self.tokenizer, problems, self.reward_fn, stop_tokens=self.stop_tokens,
            seeds=seeds, batch_size=self.gen_batch_size, **self.gen_kwargs,
        )

    def _forward_logprobs(self, ro: Rollouts, rows: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probs and entropies ``[b, T]`` of the responses of ``rows`` (the policy forward,
        :func:`pepo.training.step.policy_logprobs`)."""
        with autocast(self._device, self.compute_dtype):  # the rollouts' precision
            return policy_logprobs(self.model, ro, rows, **self.forward_kw,
                                   temperature=self.gen_kwargs["temperature"])

    def _all_logprobs(self, ro: Rollouts) -> tuple[torch.Tensor, torch.Tensor]:
        """No-grad log-probs and entropies ``[B, T]`` in the micro-batches training uses."""
        rows = by_length(torch.arange(ro.tokens.shape[0]), ro.mask)  # similar lengths together
        lp, ent = (torch.zeros(ro.mask.shape, device=ro.mask.device) for _ in range(2))
        with torch.no_grad():
            for r in rows.split(self.micro_batch_size):
                lp[r], ent[r] = self._forward_logprobs(ro, r)
        return lp, ent

    def _next_problems(self) -> list:
        """This step's problems, each repeated for the estimator's rollouts per prompt."""
        est = self.estimator
        drawn = self.sampler.next(self.prompts_per_step * est.candidate_pool)
        pool = [self.train_data[i] for i in drawn]
        picked = choice_of(est, [p.id for p in pool], self.prompts_per_step, self.rng)
        return [pool[i] for i in picked for _ in range(est.rollouts_per_prompt)]

    def _policy_drift(self, ro: Rollouts, old_lp: torch.Tensor) -> float:
        """Mean |Δ log-prob| over the whole batch's valid tokens across this step's update."""
        return mean_abs_change(self._all_logprobs(ro)[0], old_lp, ro.mask, self.dist)

    def train_step(self) -> dict[str, float]:
        """One RL step (PEPO paper, Sec. 4); returns its metrics (over the whole batch, the
        same on every rank)."""
        t0 = time.perf_counter()
        traj = self._generate()  # prompts -> rollouts -> rewards
        t_gen = time.perf_counter() - t0
        traj.advantages_all = advantages_of(self.estimator, traj.prompt_ids, traj.rewards_all)
        traj.success_all = is_success(self.reward_fn, traj.rewards_all)  # [B] bool
        traj.groups = (torch.arange(traj.batch, device=traj.advantages_all.device)[traj.part]
                       // self.estimator.rollouts_per_prompt)  # [b] prompt groups (GTPO)
        t_lp = time.perf_counter()
        if not self.old_from_update:  # else the update's forward gives them, row by row
            traj.old_logprobs, traj.entropies = self._all_logprobs(traj.rollouts)  # [b, T]
            if self.tis_cap is not None:
                traj.is_weights = truncated_is_weights(traj.old_logprobs, traj.rollouts.logprobs,
                                                       traj.mask, self.tis_cap)
            # unchecked: a NaN logit's NaN token advantages are skipped by the loss guard
            traj.token_advantages = weigh(
                self.strategy, traj.advantages, traj.entropies, traj.mask, positive=traj.success,
                groups=traj.groups, process_group=self.dist.group)  # [b, T]
        t_lp = time.perf_counter() - t_lp
        t_update = time.perf_counter()
        lr = self.optimizer.param_groups[0]["lr"]  # what the step's first optimizer step uses
        stats = self._update(traj)  # (the scheduler moves it after each)
        t_update, t_drift = time.perf_counter() - t_update, time.perf_counter()
        if self.estimator.needs_drift:  # a no-grad forward: counted with the old log-probs'
            stats.drift = self._policy_drift(traj.rollouts, traj.old_logprobs)
        stats.times = {"gen_time": t_gen, "logprob_time": t_lp + time.perf_counter() - t_drift,
                       "update_time": t_update}
        self.estimator.observe(traj.prompt_ids, traj.rewards_all, stats.drift)
        metrics = step_metrics(traj, stats, self.dist, lr=lr,
                               nonfinite_skipped=self.nonfinite.total,
                               step_time=time.perf_counter() - t0)
        if self.dump_every and self.step % self.dump_every == 0:
            self._dump(traj)
        return metrics

    def _generate(self) -> Trajectory:
        """This step's prompts (the same on every rank), this rank's share of their rollouts
        (whole prompt groups, each rollout with its own seed) and the whole batch's rewards."""
        problems = self._next_problems()
        seeds = draw_seeds(self.sample_rng, len(problems))  # one per rollout, rank-independent
        part = self.dist.shard(len(problems))  # this rank's rollouts: whole prompt groups
        ro, rewards, texts = self._rollout(problems[part], seeds[part])
        return Trajectory(prompt_ids=[p.id for p in problems], problems=problems[part],
                          part=part, rollouts=ro, texts=texts, rewards=rewards,
                          rewards_all=self._in_range(self.dist.gather(rewards)))

    def _in_range(self, rewards: torch.Tensor) -> torch.Tensor:
        """The whole batch's ``rewards``, refused on every rank alike when outside the range
        the estimator takes (single-stream: [0, 1])."""
        check_reward_range(rewards, self.reward_fn, self.estimator)
        return rewards

    def _update(self, traj: Trajectory) -> StepStats:
        """``ppo_epochs`` x ``ppo_mini_batches`` optimizer steps on this step's rollouts.

        Mini-batches are drawn on the whole batch (every rank draws the same) and this rank
        trains on its rows of each; each loss is divided by the whole mini-batch's token count
        and gradients are summed across ranks, so the update is the one a single process would
        make. The stats hold the mini-batch losses (summed over ranks), the token-weighted sums
        of the loss metrics, and the gradient norm of every optimizer step.
        """
        mask, part = traj.mask, traj.part
        stats = StepStats()
        sums = torch.zeros(3, device=mask.device)  # clip_fraction and approx_kl token sums, tokens
        for _ in range(self.ppo_epochs):
            for mb in minibatch_indices(traj.batch, self.tile, self.ppo_mini_batches, self.rng):
                mb = mb[(mb >= part.start) & (mb < part.stop)] - part.start  # this rank's rows
                num_tokens = self.dist.sum(mask[mb].sum())
                self.optimizer.zero_grad(set_to_none=True)
                mb_loss = torch.zeros((), device=mask.device)
                for micro in by_length(mb, mask).split(self.micro_batch_size):
                    lp, ent = self._forward_logprobs(traj.rollouts, micro)
                    if self.old_from_update:
                        weigh_from_update(traj, micro, lp, ent, self.strategy, self.tis_cap)
                    old_lp, adv = traj.old_logprobs, traj.token_advantages
                    loss = self.loss(
                        lp, old_lp[micro], adv[micro], mask[micro], num_tokens=num_tokens,
                        is_weights=None if traj.is_weights is None else traj.is_weights[micro],
                    )
                    (loss * self.dist.grad_scale).backward()  # FSDP averages: sum instead
                    mb_loss += loss.detach()
                    s = policy_loss_metrics(lp.detach(), old_lp[micro], adv[micro], mask[micro],
                                            self.eps_low, self.eps_high)
                    n = s["num_tokens"].float()
                    sums += torch.stack([s["clip_fraction"] * n, s["approx_kl"] * n, n])
                grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm=(
                    math.inf if self.clip_grad_norm is None else self.clip_grad_norm))
                if hasattr(grad_norm, "full_tensor"):  # a DTensor under FSDP2
                    grad_norm = grad_norm.full_tensor()
                mb_loss = self.dist.sum(mb_loss)  # the whole mini-batch's loss
                self._optimizer_step(mb_loss, grad_norm)
                stats.losses.append(mb_loss)
                stats.grad_norms.append(grad_norm.detach())
        stats.clip_fraction, stats.approx_kl, stats.tokens = self.dist.sum(sums).tolist()
        return stats

    def _optimizer_step(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        if self.nonfinite.finite(loss, grad_norm):
            self.optimizer.step()
            self.engine.weights_changed()  # a vLLM engine re-syncs before it next generates
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
            return
        self.optimizer.zero_grad(set_to_none=True)
        self.nonfinite.skipped(self.step, loss, grad_norm, self.checkpointer.latest)

    @property
    def nonfinite_total(self) -> int:
        """Optimizer steps skipped so far for a non-finite loss or gradient."""
        return self.nonfinite.total

    def _dump(self, traj: Trajectory) -> None:
        records = dump_records(traj, step=self.step, strategy=self.strategy_name,
                               id_to_token=self.tokenizer.id_to_token)
        records = [r for part in self.dist.gather_objects(records) for r in part]  # rank order
        if self.dist.is_main:
            path = self.output_dir / "rollouts" / f"step_{self.step:06d}.jsonl"
            self.write_diagnostic("rollout dump", path, lambda: write_rollouts(path, records))

    def write_diagnostic(self, what: str, path: Path, write: Callable[[], Any]) -> Any:
        """Runs ``write`` (a rollout dump, the curves). A diagnostic that cannot be written (a
        full disk, a quota) is a warning, once per kind, and training goes on: only checkpoints
        hold work that a failed write would lose. Returns ``write``'s result, None on failure."""
        try:
            return write()
        except OSError as e:
            if what not in self._diagnostic_failures:
                self._diagnostic_failures.add(what)
                log.warning(f"could not write the {what} {path}: {e.strerror or e}; training "
                            f"goes on without it (later {what} failures are not reported)")
            return None

    # ------------------------------------------------------------ validation
    def validate(self) -> float:
        """avg@k on the held-out prompts (``pepo.training.evaluation.avg_at_k``, as
        ``pepo_eval``)."""
        if not self.val_data:
            return float("nan")
        records: Optional[list] = [] if self.val_dump else None
        acc = avg_at_k(
            self.engine, self.tokenizer, self.val_data, self.val_samples, self.reward_fn,
            generator=eval_generator(self.seed, self._device),
            batch_size=self.gen_batch_size or 256,  # the training rollouts' memory bound too
            stop_tokens=self.stop_tokens, dist=self.dist, **self.gen_kwargs,
            progress=f"validation at step {self.step} (avg@{self.val_samples}, "
                     f"{len(self.val_data)} prompts)", records=records,
        )
        if records is not None:  # validation.dump
            rows = [{"step": self.step, **r}
                    for part in self.dist.gather_objects(records) for r in part]  # rank order
            if self.dist.is_main:
                path = self.output_dir / "val_rollouts" / f"step_{self.step:06d}.jsonl"
                self.write_diagnostic("validation dump", path, lambda: write_rollouts(path, rows))
        return acc

    # -------------------------------------------------------------- the loop
    def run(self) -> None:
        """:meth:`train`, then :meth:`cleanup` however it ends, under the stop-signal handlers
        (:class:`pepo.training.stopping.StopSignals`: SIGTERM or Ctrl-C stop the run after the
        current step and its checkpoint, a second signal of the same kind at once)."""
        with self.signals:
            try:
                self.train()
            finally:
                self.cleanup()  # still under the handlers: a second press during it is clean

    def train(self) -> None:
        if self.step == 0 and self.val_every:  # validation.before_cache may keep it
            acc, read = prior_cache.cached_value(self.val_cache, self.val_fingerprint,
                                                 self.validate, dist=self.dist)
            self.history.append({"step": 0, "val_accuracy": acc, "val_samples": self.val_samples})
            self.metric_logger.log_dict({"val_accuracy": acc}, step=0)
            if self.dist.is_main:
                log.info(f"Validation accuracy before training (avg@{self.val_samples}): {acc:.3f}"
                         + (f" (read from {self.val_cache})" if read else ""))
        if self.validation_pending:
            closing.settle_validation(self, log)
        with Progress(self.num_steps, self.step, f"pepo[{self.strategy_name}]",
                      enabled=self.dist.is_main, logger=log) as progress:
            while self.step < self.num_steps:
                self.signals.stepping = True
                self.step += 1
                m = self.train_step()
                new_best = False
                if self.val_every and (self.step % self.val_every == 0
                                       or self.step == self.num_steps):
                    try:
                        m["val_accuracy"] = self.validate()
                    except TrainingStopped:  # a second signal: at once
                        raise
                    except Exception as e:  # the step is trained: keep it (one process)
                        closing.keep_unvalidated_step(self, m, e, log)
                        raise
                    new_best = self.keep_best and m["val_accuracy"] > max(
                        (h["val_accuracy"] for h in self.history
                         if h["step"] >= 1 and "val_accuracy" in h), default=-math.inf)
                    progress.write(f"step {self.step}: validation avg@{self.val_samples} "
                                   f"{m['val_accuracy']:.3f}" + " (the best so far)" * new_best)
                self.history.append({"step": self.step, **m, **(
                    {"val_samples": self.val_samples} if "val_accuracy" in m else {})})
                self.metric_logger.log_dict(m, step=self.step)
                progress.step(self.step, m)
                stop = self.signals.vote()  # every rank stops together
                if (
                    (self.save_every and self.step % self.save_every == 0)
                    or self.step == self.num_steps or stop
                    or new_best  # the best validation so far: its weights are kept
                ):
                    self.save_checkpoint(self.step, {"val_accuracy": m["val_accuracy"]}
                                         if "val_accuracy" in m else None)
                    progress.write(f"step {self.step}: checkpoint "
                                   f"{self.checkpointer.root / f'step_{self.step}'}")
                if self.signals.stopping:
                    progress.close()
                    self.signals.check(self.checkpointer.root)
        closing.close_run(self, log)

    def save_checkpoint(self, step: int, metrics: Optional[dict[str, float]] = None) -> None:
        """An atomic checkpoint of the whole state (:func:`pepo.training.resume.save_state`)."""
        resume.save_state(self, step, metrics)

    def cleanup(self) -> None:
        """Closes what setup opened (also after a setup that failed half-way), and lets go of
        the output directory last."""
        try:
            logger = getattr(self, "metric_logger", None)
            if logger is not None:
                logger.close()
            for owner in (getattr(self, "reward_fn", None), getattr(self, "engine", None),
                          getattr(self, "dist", None)):
                close = getattr(owner, "close", None)
                if callable(close):  # MathVerify's workers, a vLLM engine, the process group
                    close()
        finally:
            self._release_run_lock()

    def _release_run_lock(self) -> None:
        if (lock := getattr(self, "run_lock", None)) is not None:
            lock.release()


def _built(cfg: DictConfig, log_config: bool) -> PEPORecipe:
    """A validated, set-up recipe (what it opened is closed again if setup fails)."""
    recipe = PEPORecipe(cfg)
    if log_config:
        config.log_config(recipe_name="PEPORecipe", cfg=cfg)
    try:
        recipe.setup(cfg)
    except BaseException:
        recipe.cleanup()
        raise
    return recipe


def recipe_main(cfg: DictConfig, log_config: bool = True) -> PEPORecipe:
    """Validates, sets up and runs the recipe on a resolved config and returns it (its
    ``history`` holds the metrics); the entry point for in-process runs."""
    recipe = _built(cfg, log_config)
    recipe.run()
    return recipe


@config.parse
def _main(cfg: DictConfig) -> Any:
    # a config error (a bad key, file, field or value) is one line; a step's errors keep theirs
    try:
        recipe = _built(cfg, log_config=True)
    except ValueError as e:
        config_error_exit(e)
    except KeyboardInterrupt:  # Ctrl-C before training began: nothing to save
        print("interrupted (Ctrl-C) while setting up; nothing was trained", file=sys.stderr)
        sys.exit(130)
    code: Any = 0
    try:
        recipe.run()
    except TrainingStopped as e:
        log.warning(str(e))
        code = e.exit_code  # 128 + the signal, as a process killed by it reports
    except (CheckpointFailed, ComponentError, NonFiniteError) as e:  # the last checkpoint is kept
        code = f"error: {e}"
    if recipe.dist.world_size > 1:  # all is closed: no teardown for gloo's threads to abort in
        distributed.exit_without_teardown(code)
    return code or None


if __name__ == "__main__":
    sys.argv = resolve_config_arg(sys.argv)
    sys.exit(_main())
