"""The end of a training run, and a step whose validation failed.

* :func:`close_run` leaves what a finished run leaves, in an order that makes ``summary.json``
  its last word: the closing lines, the Hugging Face export (``hf_model/``, written whole and
  renamed into place), ``summary.json``, then the curves (a diagnostic). A run stopped after
  its last step's checkpoint but before ``summary.json`` (a signal during that step, a crash
  in the export) is finished by a resume, which trains nothing and closes it.
* :func:`keep_unvalidated_step` keeps a step whose scheduled validation raised (an out-of-memory
  error, a verifier that failed): the step is logged and checkpointed, marked as owing its
  validation, before the error goes on; a resume runs that validation first
  (:func:`settle_validation`).
* :func:`check_output_dir_state` refuses, before a run starts, what would write over a run
  (its checkpoints, or a finished run's ``summary.json``) or resume nothing.
"""

from __future__ import annotations

import datetime
import logging
from typing import Any

import pepo
from pepo.training import resume
from pepo.training.checkpointing import AtomicCheckpointer
from pepo.training.hf import PROMPT_FILE, save_hf
from pepo.training.reporting import SUMMARY_FILE, plot_curves, write_summary
from pepo.training.step import closing_summary

__all__ = ["check_output_dir_state", "close_run", "is_closed", "keep_unvalidated_step",
           "reopen", "settle_validation"]


def is_closed(output_dir: Any) -> bool:
    """Whether the run in ``output_dir`` was closed (its ``summary.json`` is written)."""
    return (output_dir / SUMMARY_FILE).is_file()


def check_output_dir_state(output_dir: Any, resume: bool) -> None:
    """Refuses what would overwrite a run or resume nothing: a fresh run in an ``output_dir``
    holding checkpoints, any run in one holding a finished run's ``summary.json`` and no
    checkpoint (deleted: nothing to go on from, results not to be lost), a resume without a
    checkpoint.

    Raises:
        ValueError: naming the directory and what to do.
    """
    has_checkpoints = AtomicCheckpointer(output_dir / "checkpoints").has_checkpoints()
    if not resume and has_checkpoints:
        raise ValueError(
            f"output_dir={str(output_dir)!r} already holds a run's checkpoints; pass "
            f"resume_from_checkpoint=True to continue it, or choose another output_dir")
    if is_closed(output_dir) and not has_checkpoints:
        raise ValueError(f"output_dir={str(output_dir)!r} holds a finished run (its summary.json) "
                         f"and no checkpoint to go on from: choose another output_dir, or remove "
                         f"that run's files first")
    if resume and not has_checkpoints:
        raise ValueError(f"resume_from_checkpoint=True but {output_dir / 'checkpoints'} holds no "
                         f"checkpoint; start without it for a new run")


def reopen(output_dir: Any) -> None:
    """Marks the run in ``output_dir`` as not closed before it trains: the ``summary.json`` of
    the steps before a resume that trains further goes (it would call the run closed, and
    describe fewer steps than it has)."""
    (output_dir / SUMMARY_FILE).unlink(missing_ok=True)


def close_run(recipe: Any, log: logging.Logger) -> None:
    """The closing lines, ``hf_model/`` (with a Hugging Face source), ``summary.json`` and the
    training curves (with ``plot``) of a run whose steps are all trained."""
    if recipe.dist.is_main:
        for line in closing_summary(recipe.history, recipe.val_samples,
                                    recipe.checkpointer if recipe.keep_best else None):
            log.info(line)
    if recipe.hf_source is not None:
        weights = resume.model_state_dict(recipe.model, recipe.dist, cpu_offload=True)
        if recipe.dist.is_main:
            path = save_hf(weights, recipe.output_dir / "hf_model", source_dir=recipe.hf_source,
                           tokenizer=recipe.tokenizer, stop_tokens=recipe.stop_tokens)
            log.info(f"Hugging Face checkpoint of the final model: {path}")
            prompt = getattr(recipe.tokenizer, "enable_thinking", True) is False or getattr(
                recipe.tokenizer, "system_prompt", None)
            if prompt:  # what apply_chat_template's defaults do not render
                log.info(f"  its prompts as in training: apply_chat_template with the settings "
                         f"in {path / PROMPT_FILE}")
        recipe.dist.barrier()
    if recipe.dist.is_main:
        write_summary(recipe.output_dir, recipe.history, val_problems=len(recipe.val_data),
                      val_samples=recipe.val_samples, num_steps=recipe.num_steps,
                      train_problems=len(recipe.train_data),
                      prompts_dropped=recipe.prompts_dropped, **run_facts(recipe))
    if recipe.plot and recipe.dist.is_main:
        curves = recipe.output_dir / "training_curves.png"
        title = f"{recipe.config_name}: {recipe.strategy_name}, {recipe.estimator.name}"
        if recipe.write_diagnostic("training curves", curves,
                                   lambda: plot_curves(recipe.history, curves, title=title)):
            log.info(f"Training curves: {curves}")


def run_facts(recipe: Any) -> dict[str, Any]:
    """What a finished run's numbers depend on beyond its config (``summary.json``): the
    precision ``compute_dtype: auto`` chose (None: no autocast, the weights' dtype), the number
    of processes, pepo's version, and when it finished (UTC)."""
    dtype = recipe.compute_dtype
    return {"compute_dtype": None if dtype is None else str(dtype).removeprefix("torch."),
            "world_size": recipe.dist.world_size, "pepo_version": pepo.__version__,
            "finished": datetime.datetime.now(datetime.timezone.utc).isoformat(
                timespec="seconds")}


def keep_unvalidated_step(recipe: Any, metrics: dict[str, Any], error: BaseException,
                          log: logging.Logger) -> None:
    """Logs and checkpoints step ``recipe.step`` (its ``metrics`` without a validation) as owing
    its validation, which failed with ``error`` (the caller raises it again). One process only:
    with several, the others may be waiting in the failed validation's collectives, where a
    checkpoint's gather would hang. A checkpoint that fails too is logged, not raised: the
    validation's error is the one to see."""
    step = recipe.step
    log.error(f"the validation at step {step} failed: {type(error).__name__}: {error}")
    if recipe.dist.enabled:
        return
    recipe.history.append({"step": step, **metrics})
    recipe.metric_logger.log_dict(metrics, step=step)
    recipe.validation_pending = True
    try:
        recipe.save_checkpoint(step)
    except Exception as e:  # a full disk too
        log.error(f"step {step}'s checkpoint could not be written either ({e}); the last "
                  f"checkpoint is {recipe.checkpointer.latest()}")
        return
    log.error(f"step {step} is trained and its checkpoint written in {recipe.checkpointer.root}: "
              f"resume_from_checkpoint=True runs that validation again and goes on")


def settle_validation(recipe: Any, log: logging.Logger) -> None:
    """The validation a resumed step owes (:func:`keep_unvalidated_step`), recorded in its
    history, its metrics log and its checkpoint again; nothing when validation is off now."""
    recipe.validation_pending = False
    if not recipe.val_every:
        return
    acc = recipe.validate()
    recipe.history[-1].update(val_accuracy=acc, val_samples=recipe.val_samples)
    recipe.metric_logger.log_dict({"val_accuracy": acc}, step=recipe.step)
    recipe.save_checkpoint(recipe.step, {"val_accuracy": acc})
    if recipe.dist.is_main:
        log.info(f"Validation accuracy at step {recipe.step} (avg@{recipe.val_samples}), which "
                 f"the run owed: {acc:.3f}")
