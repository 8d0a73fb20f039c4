"""What other trainers' config keys are called in pepo's recipe config.

Users come from TRL (``GRPOConfig``), verl (``actor_rollout_ref``) and torchtune, and write the
names they know. An unknown key that is one of these gets pepo's name (and what differs) in its
error, instead of the closest spelling (``gradient_accumulation_steps`` is not a misspelt
``num_steps``).
"""

from __future__ import annotations

from typing import Optional

__all__ = ["ALIASES", "foreign_key_hint", "other_estimators_key"]

_ACCUMULATE = ("micro_batch_size (each optimizer step's mini-batch, the step's rollouts / "
               "ppo_mini_batches, is accumulated over micro-batches of this many rows)")
_BATCH = ("prompts_per_step (prompts per step; each is sampled estimator.group_size times), "
          "ppo_mini_batches (optimizer steps per pass) and micro_batch_size (rows per "
          "forward/backward)")
_CLIP = "loss.eps_low and loss.eps_high (the clip range, ε_low and ε_high)"
_KL = "pepo has no such key: the recipe's loss is the clipped surrogate alone, no KL penalty"

# Keyed by the name as written (in any section): pepo's key(s), or why there is none.
ALIASES: dict[str, str] = {
    "gradient_accumulation_steps": _ACCUMULATE,
    "ppo_micro_batch_size": _ACCUMULATE,
    "ppo_micro_batch_size_per_gpu": _ACCUMULATE,
    "per_device_train_batch_size": _BATCH,
    "train_batch_size": _BATCH,
    "batch_size": _BATCH,
    "ppo_mini_batch_size": _BATCH,
    "learning_rate": "optimizer.lr",
    "lr": "optimizer.lr",
    "max_steps": "num_steps",
    "total_training_steps": "num_steps",
    "total_steps": "num_steps",
    "num_iterations": "ppo_epochs (passes over a step's rollouts)",
    "num_generations": "estimator.group_size (rollouts per prompt)",
    "rollout_n": "estimator.group_size (rollouts per prompt)",
    "n": "estimator.group_size (rollouts per prompt)",
    "epsilon": _CLIP,
    "epsilon_high": _CLIP,
    "clip_ratio": _CLIP,
    "clip_ratio_low": _CLIP,
    "clip_ratio_high": _CLIP,
    "cliprange": _CLIP,
    "beta": _KL,
    "kl_coef": _KL,
    "kl_loss_coef": _KL,
    "use_kl_loss": _KL,
    "max_completion_length": "generation.max_new_tokens",
    "max_response_length": "generation.max_new_tokens",
    "max_tokens": "generation.max_new_tokens",
    "max_new_tokens": "generation.max_new_tokens",
    "temperature": "generation.temperature",
    "top_p": "generation.top_p",
    "top_k": "generation.top_k",
    "max_grad_norm": "clip_grad_norm",
    "grad_clip": "clip_grad_norm",
    "model_name_or_path": "checkpoint_dir (a directory of HF weights, or ${pepo_pretrained:NAME})",
    "model_path": "checkpoint_dir (a directory of HF weights, or ${pepo_pretrained:NAME})",
    "save_steps": "save_every",
    "eval_steps": "validation.every",
    "use_vllm": "generation.engine (inprocess or vllm)",
    "loss_type": ("loss._component_ (another aggregation is another component: see "
                  "pepo.loss.ClippedPolicyLoss)"),
}


def foreign_key_hint(name: str, where: str, known: set[str]) -> Optional[str]:
    """``pepo calls it ...`` for an unknown key ``where + name`` that is another trainer's name
    for one of pepo's keys, else None (the closest spelling is the hint then). ``known`` holds
    the keys valid at ``where``. An alias answers only where its key is: at the top level when
    the key's section or key is one there (not in an eval config, which has no optimizer or
    estimator), in a section when the key is that section's (``loss.epsilon``;
    ``estimator.epsilon`` is a misspelt ``estimator.eps``, ``validation.n`` not a group size),
    and the no-KL line at the top level or under ``loss``."""
    target = ALIASES.get(name)
    if target is None or name in known:
        return None
    key = target.split(" ", 1)[0]
    if target.startswith("pepo "):
        fits = where in ("", "loss.")
    elif where == "":
        fits = key.split(".")[0] in known
    else:
        fits = key.startswith(where) and key[len(where):] in known
    if not fits:
        return None
    return target if target.startswith("pepo ") else f"pepo calls it {target}"


def other_estimators_key(key: str, estimator: str) -> str:
    """`` (a key of estimator.name='group': remove it ...)`` when ``key``, unknown
    to ``estimator``, is another registered estimator's parameter (the config was written for
    that one, and ``estimator.name`` was changed on the command line), else ``""``."""
    from pepo import estimators

    other = [e for e in estimators.list_estimators()
             if e != estimator and key in estimators.estimator_parameters(e)]
    return (f" (a key of estimator.name={other[0]!r}: remove it on the command line with "
            f"~estimator.{key})" if other else "")
