"""The records one training step passes along, and the step's parts that need no loop state.

A step of ``recipes/pepo_recipe.py`` runs generate → score → advantages → weights → update →
observe; :class:`Trajectory` (as torchtune's ``GRPOTrajectory``) carries what each part adds,
:class:`StepStats` (as torchtune's ``GRPOStats``) what the update measured. The rest of this
module is what the recipe does with them and could do without a model: the policy forward
(:func:`policy_logprobs`), the step's metrics (:func:`step_metrics`), the rollout dump's records
(:func:`dump_records`) and the run's closing validation line (:func:`validation_summary`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from pepo.entropy import logprobs_and_entropy, logprobs_and_entropy_from_hidden
from pepo.training.generation import Rollouts, sequence_inputs
from pepo.training.precision import no_autocast
from pepo.training.stopping import NonFiniteError

__all__ = [
    "StepStats",
    "Trajectory",
    "weigh",
    "weigh_from_update",
    "by_length",
    "row_extent",
    "closing_summary",
    "dump_records",
    "mean_abs_change",
    "policy_logprobs",
    "saves_logits",
    "step_metrics",
    "validation_summary",
]


@dataclass
class Trajectory:
    """One step's rollouts and what the step computes from them.

    The whole batch has ``B`` rows (every rank chooses the same problems); this process
    generates and trains on rows ``part`` of it (``b`` rows, whole prompt groups). Fields that
    end in ``_all`` are the whole batch's, gathered from every rank.

    Attributes:
        prompt_ids: ``[B]`` the prompt of each row (rollouts of a prompt are contiguous).
        problems: this rank's ``b`` problems.
        part: this rank's rows of the whole batch.
        rollouts: this rank's responses (``tokens``, ``mask`` ``[b, T]``, the engine's
            ``logprobs``).
        texts: this rank's decoded responses.
        rewards: ``[b]`` this rank's rewards; ``rewards_all`` ``[B]``.
        advantages_all: ``[B]`` sequence advantages (the estimator's).
        success_all: ``[B]`` bool, the reward's success flags.
        groups: ``[b]`` prompt-group ids of this rank's rows (GTPO's ``groups``).
        old_logprobs, entropies: ``[b, T]`` of the rollout policy (the trainer's forward).
        is_weights: ``[b, T]`` truncated importance weights (``loss.tis_cap``) or None.
        token_advantages: ``[b, T]`` the strategy's (detached).
    """

    prompt_ids: list
    problems: list
    part: slice
    rollouts: Rollouts
    texts: list
    rewards: torch.Tensor
    rewards_all: torch.Tensor
    advantages_all: Optional[torch.Tensor] = None
    success_all: Optional[torch.Tensor] = None
    groups: Optional[torch.Tensor] = None
    old_logprobs: Optional[torch.Tensor] = None
    entropies: Optional[torch.Tensor] = None
    is_weights: Optional[torch.Tensor] = None
    token_advantages: Optional[torch.Tensor] = None

    @property
    def batch(self) -> int:
        """Rows of the whole batch ``B``."""
        return len(self.prompt_ids)

    @property
    def mask(self) -> torch.Tensor:
        """``[b, T]`` bool, True at generated tokens."""
        return self.rollouts.mask

    @property
    def advantages(self) -> torch.Tensor:
        """``[b]`` this rank's sequence advantages."""
        return self.advantages_all[self.part]

    @property
    def success(self) -> torch.Tensor:
        """``[b]`` this rank's success flags."""
        return self.success_all[self.part]


@dataclass
class StepStats:
    """What the update measured (the same on every rank).

    Attributes:
        losses: each optimizer step's mini-batch loss (summed over ranks), scalar tensors.
        grad_norms: each optimizer step's gradient norm, scalar tensors.
        clip_fraction, approx_kl: token-weighted sums over the update (divide by ``tokens``).
        tokens: valid tokens the sums are over.
        drift: mean |Δ log-prob| across the update (when the estimator needs it).
        times: seconds of the step's parts (``gen_time``, ``logprob_time``, ``update_time``).
    """

    losses: list = field(default_factory=list)
    grad_norms: list = field(default_factory=list)
    clip_fraction: float = 0.0
    approx_kl: float = 0.0
    tokens: float = 0.0
    drift: Optional[float] = None
    times: dict = field(default_factory=dict)


def saves_logits(targets: int, vocab: int, save_logits_mib: float) -> bool:
    """Whether :func:`policy_logprobs` keeps the head's logits for the backward: where the fp32
    logits of ``targets`` tokens over ``vocab`` entries take at most ``save_logits_mib`` MiB."""
    return targets * vocab * 4 <= save_logits_mib * 2**20


def policy_logprobs(model: Any, ro: Rollouts, rows: torch.Tensor, *, chunk_size: int,
                    temperature: float, from_hidden: bool = False, save_logits_mib: float = 0
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropies ``[b, T]`` of the responses of ``rows`` under ``model`` (a
    torchtune ``TransformerDecoder``), at the sampling ``temperature``.

    The forward covers these rows' own extent only: the prompt columns that are padding in every
    one of them (prompts are left-padded to the batch's longest) and the response columns after
    the longest of their responses are cut off, and the outputs are zero-padded back to ``T``
    (zeros at columns where no row of ``rows`` has a token). Causal attention with the padding
    masked out makes every kept position's output the same as over the full width. The
    attention mask is built for these rows only (``[b, S, S]``). With ``from_hidden`` the
    model's output step is replaced, for this forward, by
    :func:`pepo.entropy.logprobs_and_entropy_from_hidden`, which applies the output projection
    chunk by chunk, so the ``[b, S, V]`` logits are never held. It runs inside the model's own
    forward, where FSDP2 has gathered the root's parameters (the tied embedding); where a
    gradient will be taken and the responses' fp32 logits take at most ``save_logits_mib`` MiB,
    they are kept for the backward (``save_logits``). Under autocast the logits are made in the
    parameters' dtype all the same, as the decoder makes them
    (:func:`pepo.training.precision.no_autocast`).
    """
    from pepo.training.models import head_weight

    if from_hidden:  # refuses a head that is more than its weight's product, before the forward
        head_weight(model.output, required=True)
    start, end = row_extent(ro.prompt_mask[rows], ro.mask[rows])
    prompt_mask = ro.prompt_mask[rows][:, start:]
    targets = ro.tokens[rows][:, :end]  # [b, T']
    plen = prompt_mask.shape[1]
    seq = torch.cat([ro.prompt_tokens[rows][:, start:], targets], dim=1)  # [b, S]
    attn, pos = sequence_inputs(prompt_mask, end)  # [b, S, S], [b, S]
    kw = dict(chunk_size=chunk_size, temperature=temperature)

    def head(h: torch.Tensor) -> Any:  # fp32 logits also under autocast
        if not from_hidden:
            with no_autocast(h.device):
                return type(model).unembed(model, h)  # [b, S, V]
        # read here, inside the model's forward, where FSDP2 has gathered the weight
        weight = head_weight(model.output)  # [V, D]
        # keeps the logits in the weight's dtype itself; under autocast the gradient's products
        # run in bf16
        save = saves_logits(targets.numel(), weight.shape[0], save_logits_mib)
        return logprobs_and_entropy_from_hidden(model.norm(h)[:, plen - 1 : -1], weight,
                                                targets, save_logits=save, **kw)

    model.unembed = head  # an instance attribute: shadows TransformerDecoder.unembed
    try:
        out = model(seq, mask=attn, input_pos=pos)
    finally:
        del model.unembed
    lp, ent = out if from_hidden else logprobs_and_entropy(out[:, plen - 1 : -1], targets, **kw)
    return _pad_to(lp, ro.tokens.shape[1]), _pad_to(ent, ro.tokens.shape[1])


def row_extent(prompt_mask: torch.Tensor, mask: torch.Tensor) -> tuple[int, int]:
    """``(start, end)``: the first prompt column holding a token of any row (prompts are
    left-padded) and one past the last response column holding one (at least 1), from
    ``prompt_mask`` ``[b, P]`` and the response ``mask`` ``[b, T]``."""
    first = prompt_mask.any(0).nonzero()
    last = mask.any(0).nonzero()
    start = int(first[0]) if len(first) else 0
    return start, max(int(last[-1]) + 1 if len(last) else 0, 1)


def _pad_to(x: torch.Tensor, width: int) -> torch.Tensor:
    """``x`` ``[b, t]`` zero-padded on the right to ``[b, width]``."""
    return torch.nn.functional.pad(x, (0, width - x.shape[1])) if x.shape[1] < width else x


def by_length(rows: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``rows`` ordered by response length (``mask`` ``[b, T]`` of all rows; stable), so that
    micro-batches cut from it hold rows of similar length and :func:`policy_logprobs` pads
    each only to its own longest. A sum of per-micro-batch gradients does not depend on the
    grouping (up to the order of float additions). ``rows`` may be on the CPU and ``mask``
    on the GPU (the order is ``rows``' own device's)."""
    lengths = mask[rows].sum(1)
    return rows[torch.sort(lengths, stable=True).indices.to(rows.device)]


def _default_group() -> Any:
    """The default process group of a multi-process run, else None."""
    import torch.distributed as dist

    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


def weigh(strategy: Any, advantages: torch.Tensor, entropies: torch.Tensor, mask: torch.Tensor,
          **kwargs: Any) -> torch.Tensor:
    """The token advantages of ``strategy`` with ``validate=False``: non-finite log-probs (a
    NaN logit) give NaN token advantages, which the loss guard skips, where the strategy's
    checks would raise. A registered (not built-in) strategy's result is refused, in one host
    sync, where it is non-finite at a valid token while every advantage and valid entropy is
    finite: its own NaN or inf, which the guard would skip step after step without naming it.
    The counts are summed over the processes (``process_group``, else the default group of a
    multi-process run), so that every rank stops together.

    Raises:
        NonFiniteError: naming the strategy (the run stops; the last checkpoint is kept).
    """
    out = strategy(advantages, entropies, mask, validate=False, **kwargs)
    if not getattr(strategy, "builtin", True):
        counts = torch.stack([
            (mask & ~torch.isfinite(entropies)).sum(), (~torch.isfinite(advantages)).sum(),
            (mask & ~torch.isfinite(out)).sum()])
        group = kwargs.get("process_group") or _default_group()
        if group is not None:  # every rank stops, or none (each weighs rows of its own)
            import torch.distributed as dist

            dist.all_reduce(counts, group=group)
        bad_ent, bad_adv, bad_out = counts.tolist()
        if bad_out and not (bad_ent or bad_adv):  # (a NaN input may spread: not blamed then)
            raise NonFiniteError(
                f"strategy {strategy.name!r} returned {bad_out} non-finite token advantages at "
                f"valid tokens from finite advantages and entropies: its own NaN or inf, not "
                f"the model's (each optimizer step they reach would be skipped)")
    return out


def weigh_from_update(traj: Trajectory, rows: torch.Tensor, logprobs: torch.Tensor,
                      entropies: torch.Tensor, strategy: Any,
                      tis_cap: Optional[float] = None) -> None:
    """The old-policy values of ``rows`` from the update's own forward, and their token
    advantages: for a step whose one update (one epoch, one mini-batch) starts from the policy
    that sampled, so that the update's first forward of each row *is* the old-policy pass, and
    a strategy that weighs each row on its own (:attr:`pepo.weighting.Strategy.row_local`).

    Fills ``rows`` of ``traj.old_logprobs``, ``entropies``, ``token_advantages`` and (with
    ``tis_cap``) ``is_weights``, allocating them ``[b, T]`` on the first call; ``logprobs`` and
    ``entropies`` are the forward's ``[len(rows), T]`` (detached here).
    """
    lp, ent = logprobs.detach(), entropies.detach()
    if traj.old_logprobs is None:
        traj.old_logprobs = lp.new_zeros(traj.mask.shape)
        traj.entropies = ent.new_zeros(traj.mask.shape)
        traj.token_advantages = lp.new_zeros(traj.mask.shape)
        if tis_cap is not None:
            traj.is_weights = lp.new_zeros(traj.mask.shape)
    traj.old_logprobs[rows], traj.entropies[rows] = lp, ent
    traj.token_advantages[rows] = weigh(
        strategy, traj.advantages[rows], ent, traj.mask[rows], positive=traj.success[rows],
        groups=traj.groups[rows])
    if tis_cap is not None:
        from pepo.loss import truncated_is_weights

        traj.is_weights[rows] = truncated_is_weights(lp, traj.rollouts.logprobs[rows],
                                                     traj.mask[rows], tis_cap)


def mean_abs_change(new: torch.Tensor, old: torch.Tensor, mask: torch.Tensor,
                    dist: Any) -> float:
    """The mean of ``|new - old|`` over the valid tokens of the whole batch (summed over
    ``dist``'s ranks) where it is finite: SPO's policy drift across a step's update (a row whose
    old log-probs were NaN, its optimizer steps skipped, leaves the others' change counted);
    0.0 where no token has one. Shapes ``[b, T]``."""
    diff = (new.float() - old.float()).abs()
    keep = mask & torch.isfinite(diff)
    total, count = dist.sum(torch.stack([torch.where(keep, diff, 0.0).sum(),
                                         keep.sum().float()])).tolist()
    return total / count if count else 0.0


def step_metrics(traj: Trajectory, stats: StepStats, dist: Any, *, lr: float,
                 nonfinite_skipped: int, step_time: float) -> dict[str, float]:
    """The step's metrics over the whole batch (the same on every rank: ``dist`` reduces the
    per-rank sums; ``docs/recipe.md`` names each)."""
    mask, ro = traj.mask, traj.rollouts
    # the rollout engine's log-probs against the trainer's, for the same policy
    gap = torch.where(mask, (traj.old_logprobs - ro.logprobs).abs(), 0.0)  # [b, T]
    totals = dist.sum(torch.stack([
        mask.sum().float(), torch.where(mask, traj.entropies, 0.0).sum(), gap.sum(),
        (~ro.finished).float().sum(),
    ]))
    ntok, ent_sum, gap_sum, truncated = totals.tolist()
    gap_max = dist.max(gap.amax().reshape(1) if gap.numel() else gap.new_zeros(1))
    n_valid, rows = max(ntok, 1.0), traj.batch
    grad_norms = torch.stack(stats.grad_norms)
    metrics = {
        "reward": float(traj.rewards_all.mean()),
        "accuracy": float(traj.success_all.float().mean()),
        "loss": float(torch.stack(stats.losses).mean()),
        "grad_norm": float(grad_norms.mean()),
        "grad_norm_max": float(grad_norms.max()),
        "lr": lr,
        "entropy": ent_sum / n_valid,
        "response_len": ntok / rows,
        "truncated": truncated / rows,
        "zero_advantage": float((traj.advantages_all == 0).float().mean()),
        "clip_fraction": stats.clip_fraction / max(stats.tokens, 1.0),
        "approx_kl": stats.approx_kl / max(stats.tokens, 1.0),
        "rollout_logprob_gap": gap_sum / n_valid,
        "rollout_logprob_gap_max": float(gap_max),
        "nonfinite_skipped": nonfinite_skipped,
        "tokens_per_s": ntok / step_time,
        "step_time": step_time,
        **stats.times,
    }
    if stats.drift is not None:
        metrics["policy_drift"] = stats.drift
    return metrics


def dump_records(traj: Trajectory, *, step: int, strategy: str,
                 id_to_token: Any) -> list[dict[str, Any]]:
    """One record per rollout of this rank (``rollouts/step_NNNNNN.jsonl``): the inputs of the
    strategy and its token advantages, so that ``get_strategy(strategy, **params)(advantage,
    entropies, mask, positive=success)`` over a step's file gives back ``token_advantages``
    (``gtpo`` also takes ``groups=``: the rows' ``group``, the step's prompt group, which tells
    two groups of one prompt apart).
    ``token_weights`` is token advantage / advantage (None where the advantage is 0)."""
    records = []
    adv, success = traj.advantages, traj.success
    groups = traj.groups.tolist() if traj.groups is not None else [None] * len(traj.problems)
    for i, p in enumerate(traj.problems):
        m = traj.mask[i]
        ids = traj.rollouts.tokens[i][m].tolist()
        a = float(adv[i])
        ta = traj.token_advantages[i][m].tolist()
        records.append({
            "step": step,
            "prompt_id": p.id,
            "group": groups[i],
            "prompt": p.prompt,
            "answer": p.answer,
            "response": traj.texts[i],
            "token_ids": ids,
            "tokens": [id_to_token(t) for t in ids],
            "entropies": traj.entropies[i][m].tolist(),
            "reward": float(traj.rewards[i]),
            "success": bool(success[i]),
            "advantage": a,
            "token_advantages": ta,
            "token_weights": [x / a for x in ta] if a != 0 else None,
            "strategy": strategy,
        })
    return records


def validation_summary(history: list[dict], samples: int) -> Optional[str]:
    """The run's closing line: validation accuracy before and after training and, when an
    intermediate validation scored higher than the last one, that step (its checkpoint may
    still be on disk). The validation before training is not one: it has no checkpoint, and
    the line says its score already. Each validation is labelled with the ``val_samples`` its
    history entry records (a resume may change ``validation.samples``), else ``samples``."""
    vals = [(h["step"], h["val_accuracy"], h.get("val_samples", samples))
            for h in history if "val_accuracy" in h]
    if not vals or history[0].get("val_accuracy") is None:
        return None
    (_, first, k0), (_, last, k1) = vals[0], vals[-1]
    if k0 == k1:
        line = f"Validation accuracy (avg@{k1}): {first:.3f} before -> {last:.3f} after"
    else:
        line = f"Validation accuracy: {first:.3f} before (avg@{k0}) -> {last:.3f} after (avg@{k1})"
    best_step, best, k = max((v for v in vals if v[0] >= 1), key=lambda v: v[1],
                             default=(0, last, k1))  # the earliest of equal scores
    if best > last:
        line += f" (highest {best:.3f} at step {best_step}" + (
            f", avg@{k})" if k != k1 else ")")
    return line


def closing_summary(history: list[dict], samples: int, checkpointer: Any = None) -> list[str]:
    """The lines a run ends with: :func:`validation_summary` and, given the ``checkpointer``
    that keeps the best validation's checkpoint, where that checkpoint is (none without a
    validation before and after training)."""
    summary = validation_summary(history, samples)
    if summary is None:
        return []
    lines = [summary]
    best = checkpointer.best() if checkpointer is not None else None
    if best is not None:
        meta = checkpointer.metadata(best)
        k = next((h.get("val_samples", samples) for h in history
                  if h["step"] == meta["step"] and "val_accuracy" in h), samples)
        lines.append(f"Best validation checkpoint (kept with the newest {checkpointer.keep}): "
                     f"{best} (avg@{k} {meta['val_accuracy']:.3f} at step {meta['step']})")
    return lines
