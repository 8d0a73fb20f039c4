"""A run's training state: what the recipe's checkpoint holds beside the weights, how it is
saved, and how a resumed run puts it back.

Checkpoints hold the whole (unsharded) state, written by rank 0, so a run resumes with any number
of processes: the weights (gathered across ranks under FSDP2), the optimizer, the LR schedule
and the number of optimizer steps it spans, the prompt sampler's position, the host and device
generators, torch's RNG, the estimator (SPO's value tracker), the metric history and the
non-finite-step counters (:class:`pepo.training.checkpointing.AtomicCheckpointer` writes them
atomically). The functions take the recipe (``pepo_recipe.PEPORecipe``) and read or set its
public attributes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from pepo.training.checkpointing import MODEL_FILE
from pepo.training.models import check_state_matches
from pepo.training.reporting import truncate_metrics_log
from pepo.training.stopping import CheckpointFailed, checkpoint_failure

__all__ = ["agreed_checkpoint", "load_state", "model_state_dict", "save_state",
           "truncate_metrics"]


def model_state_dict(model: torch.nn.Module, dist: Any,
                     cpu_offload: bool = False) -> dict[str, torch.Tensor]:
    """The model's whole state dict (gathered across ranks under FSDP2; every rank takes part,
    and with ``cpu_offload`` only rank 0 receives it)."""
    opts = StateDictOptions(full_state_dict=True, cpu_offload=cpu_offload and dist.enabled)
    return get_model_state_dict(model, options=opts)


def save_state(recipe: Any, step: int, metrics: Optional[dict[str, float]] = None) -> None:
    """An atomic checkpoint of ``recipe``'s whole state at ``step``; ``metrics`` go into its
    metadata. A full disk or another write failure the checkpointer reports becomes
    :class:`pepo.training.stopping.CheckpointFailed` (the previous checkpoint is intact)."""
    weights = model_state_dict(recipe.model, recipe.dist, cpu_offload=True)
    optimizer = get_optimizer_state_dict(
        recipe.model, recipe.optimizer,
        options=StateDictOptions(full_state_dict=True, cpu_offload=recipe.dist.enabled))
    state = {
        "step": step,
        "optimizer": optimizer,
        "sampler": recipe.sampler.state_dict(),
        "rng": recipe.rng.get_state(),
        "sample_rng": recipe.sample_rng.get_state().cpu(),
        "torch_rng": torch.get_rng_state(),
        "history": recipe.history,
        "nonfinite_total": recipe.nonfinite.total,
        "nonfinite_in_a_row": recipe.nonfinite.in_a_row,
        "validation_pending": recipe.validation_pending,  # this step's validation failed
    }
    if recipe.lr_scheduler is not None:
        state["lr_scheduler"] = recipe.lr_scheduler.state_dict()
        state["schedule_steps"] = recipe.schedule_steps
    state["estimator"] = readable_state(recipe.estimator)
    state["experiment"] = recipe.experiment
    if recipe.dist.is_main:
        checkpointer = recipe.checkpointer
        try:
            checkpointer.save(step, weights, state, metrics)
        # torch.save reports a full disk as a C++ error, safetensors as its own
        except (OSError, RuntimeError, SafetensorError) as e:
            failed = checkpoint_failure(e, step, checkpointer.root, checkpointer.marked())
            if failed is None:
                raise
            raise failed from None
    recipe.dist.barrier()


def readable_state(estimator: Any) -> Any:
    """``estimator.state_dict()`` when a resume can read it back: a checkpoint is loaded with
    ``torch.load(weights_only=True)`` (tensors, Python numbers and strings, lists, tuples and
    plain dicts). A registered estimator that kept a numpy scalar or a ``defaultdict`` there
    wrote checkpoints that every resume then called damaged. pepo's own estimators are not
    checked (their states are tested).

    Raises:
        CheckpointFailed: naming the estimator and what ``torch.load`` refused (the run stops;
            its checkpoints so far are kept, none of them resumable for this reason).
    """
    import io

    state = estimator.state_dict()
    if type(estimator).__module__ == "pepo.estimators":  # pepo's own: tested, and SPO's state
        return state  # of 100k prompts takes a second to write twice
    buffer = io.BytesIO()
    try:
        torch.save(state, buffer)
        buffer.seek(0)
        torch.load(buffer, weights_only=True)
    except Exception as e:  # an unpicklable object, or a type weights_only refuses
        why = str(e).strip().splitlines()
        why = next((line for line in why if "GLOBAL" in line or "pickle" in line.lower()),
                   why[0] if why else type(e).__name__).split(" Please use")[0]
        raise CheckpointFailed(
            f"estimator {getattr(estimator, 'name', type(estimator).__name__)!r}: its "
            f"state_dict() cannot be read back by a resume (torch.load(weights_only=True): "
            f"{why.strip()[:300]}); keep tensors, Python numbers, strings, lists and plain "
            f"dicts in it (float(x) of a numpy scalar, dict(d) of a defaultdict)") from None
    return state


def agreed_checkpoint(checkpointer: Any, dist: Any, **kwargs: Any) -> tuple[Path, dict[str, Any]]:
    """The checkpoint a resume goes on from, the same on every rank: rank 0 chooses it
    (:func:`pepo.training.config.resumable_checkpoint` with ``kwargs``, which skips a damaged
    one for an older one), the others load that one's state and no other (a read that failed
    on one rank alone, a file system that differs between nodes, had that rank go on from
    another step, its weights mixed into the others' shards).

    Raises:
        ValueError: rank 0's refusal, or a rank that cannot load the chosen state, on every rank.
    """
    from pepo.training.config import resumable_checkpoint

    if not dist.enabled:
        return resumable_checkpoint(checkpointer, **kwargs)
    found, error = None, None
    if dist.is_main:
        try:
            found = resumable_checkpoint(checkpointer, **kwargs)
        except ValueError as e:
            error = str(e)
    path, error = dist.gather_objects((found and str(found[0]), error))[0]
    if error is not None:
        raise ValueError(error)
    if found is None:
        try:
            found = Path(path), checkpointer.load_state(path)
        except Exception as e:  # OSError, pickle errors, out of memory ...
            error = f"{path}: its training state does not load here ({type(e).__name__}: {e})"
    if dist.any(error is not None):
        raise ValueError(error or f"another process could not load {path}'s training state")
    return found


def load_state(recipe: Any, path: Path, state: dict[str, Any],
               log: Callable[[str], None]) -> None:
    """Puts a whole (unsharded) checkpoint, written with any number of processes, back into
    ``recipe``: the checkpoint directory ``path`` and its training ``state``."""
    weights = load_file(str(path / MODEL_FILE))
    check_state_matches(recipe.model, weights, path)
    set_model_state_dict(recipe.model, weights, options=StateDictOptions(full_state_dict=True))
    set_optimizer_state_dict(recipe.model, recipe.optimizer, state["optimizer"],
                             options=StateDictOptions(full_state_dict=True))
    if recipe.lr_scheduler is not None:
        if state.get("schedule_steps") != recipe.schedule_steps:
            raise ValueError(
                f"the checkpoint's LR schedule spans {state.get('schedule_steps')} optimizer "
                f"steps, this config's {recipe.schedule_steps} (num_steps x ppo_epochs x "
                f"ppo_mini_batches): an exact resume needs the same schedule"
            )
        recipe.lr_scheduler.load_state_dict(state["lr_scheduler"])
    recipe.sampler.load_state_dict(state["sampler"])
    recipe.rng.set_state(state["rng"])
    recipe.sample_rng.set_state(state["sample_rng"])
    torch.set_rng_state(state["torch_rng"])
    try:  # a registered estimator's own code: its state's keys may have changed since
        recipe.estimator.load_state_dict(state["estimator"])
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"checkpoint {path}: estimator "
                         f"{getattr(recipe.estimator, 'name', '?')!r} could not load its state "
                         f"({type(e).__name__}: {e})") from None
    recipe.step = state["step"]
    recipe.history = list(state["history"])
    recipe.nonfinite.total = state["nonfinite_total"]
    recipe.nonfinite.in_a_row = state["nonfinite_in_a_row"]
    recipe.validation_pending = state.get("validation_pending", False)
    log(f"Resumed from {path} at step {recipe.step}")


DUMP_DIRS = ("rollouts", "val_rollouts")


def drop_later_dumps(output_dir: Path, step: int, log: Callable[[str], None]) -> int:
    """The rollout and validation dumps (``step_N.jsonl[.gz]``) of steps after ``step`` are
    removed, with the training curves' picture of a fresh run (``step=-1``): they are an
    earlier run's, which a resumed run makes again (or, with other dump settings, not), and a
    fresh run none of; left, an analysis of the folder pooled two runs. Returns the number of
    dumps removed."""
    gone = 0
    for name in DUMP_DIRS:
        for f in sorted((output_dir / name).glob("step_*.jsonl*")):
            number = f.name[len("step_"):].split(".")[0]
            if number.isdigit() and int(number) > step:
                f.unlink(missing_ok=True)
                gone += 1
    if gone:
        log(f"{output_dir}: removed {gone} rollout dump(s) of an earlier run " + (
            "that wrote no checkpoint" if step < 0 else f"after step {step}, which this "
            f"resumed run makes again"))
    if step < 0:
        (output_dir / "training_curves.png").unlink(missing_ok=True)
    return gone


def truncate_metrics(cfg: Any, step: int, log: Callable[[str], None]) -> None:
    """A resumed run logs the steps after its checkpoint again: the disk log's lines for them
    (from the run that was stopped) go, so that the file has one line per step, and so do its
    dumps (:func:`drop_later_dumps`). A fresh run (``step=-1``) drops every step's line and
    dump: an earlier run in this output_dir left no checkpoint to go on from."""
    drop_later_dumps(Path(str(cfg.output_dir)), step, log)
    lc = cfg.get("metric_logger")
    if lc is None or not str(lc._component_).endswith("DiskLogger") or not lc.get("filename"):
        return  # DiskLogger without a filename starts a new file per run
    path = Path(str(lc.log_dir)) / str(lc.filename)
    if step < 0 and not path.resolve().is_relative_to(Path(str(cfg.output_dir)).resolve()):
        return  # a log outside output_dir may be shared: a fresh run leaves it alone
    dropped = truncate_metrics_log(path, step)
    if dropped and step < 0:
        log(f"{path}: dropped {dropped} line(s) of an earlier run that wrote no checkpoint")
    elif dropped:
        log(f"{path}: dropped {dropped} line(s) logged after step {step}, which this resumed "
            f"run logs again")
