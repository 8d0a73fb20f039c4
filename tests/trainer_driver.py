"""A trainer process for the fault and distributed tests:
``python -m tests.trainer_driver CONFIG.yaml`` (under torchrun for several processes).

Runs the recipe on a resolved config file as ``tune run`` would, resuming when the output
directory already holds checkpoints, and exits with 143 when SIGTERM stopped it (130: Ctrl-C).
At the end it writes this rank's estimator state to ``<output_dir>/estimator_rank<R>.pt`` so a
test can compare ranks. Hooks, set by environment variables, for the tests that disturb it:

* ``PEPO_TEST_PROGRESS=path``: after each step (rank 0) its number is appended to ``path``;
* ``PEPO_TEST_KILL=phase:n``: the process SIGKILLs itself at the n-th time the checkpoint
  writer reaches ``phase``: ``write`` (after a file of a checkpoint is written and fsynced),
  ``rename`` (after the checkpoint directory or the ``latest`` marker is renamed into place);
* ``PEPO_TEST_FAIL_RANK=r``: rank ``r`` raises at step 2;
* ``PEPO_TEST_STEP_SLEEP=s``: each step sleeps ``s`` seconds first;
* ``PEPO_TEST_VALIDATION_SLEEP=s:path``: each validation creates ``path`` and sleeps ``s``
  seconds first (a validation long enough for a signal test to land inside it).
"""

from __future__ import annotations

import os
import signal
import sys

import torch
from omegaconf import OmegaConf

import pepo.training.checkpointing as ck
import pepo_recipe
from pepo.training.config import register_resolvers
from pepo.training.distributed import exit_without_teardown


def _kill_after(real, target: int):
    calls = [0]

    def hooked(*args, **kwargs):
        out = real(*args, **kwargs)
        calls[0] += 1
        if calls[0] == target:
            os.kill(os.getpid(), signal.SIGKILL)
        return out

    return hooked


def _wrap_step(after=None, before=None) -> None:
    real = pepo_recipe.PEPORecipe.train_step

    def train_step(self):
        if before is not None:
            before(self)
        out = real(self)
        if after is not None:
            after(self)
        return out

    pepo_recipe.PEPORecipe.train_step = train_step


def _install_hooks() -> None:
    rank = os.environ.get("RANK", "0")
    kill = os.environ.get("PEPO_TEST_KILL")
    if kill:
        phase, n = kill.split(":")
        if phase == "write":
            ck._write_file = _kill_after(ck._write_file, int(n))
        elif phase == "rename":
            ck.os = type("os_proxy", (), {  # only the checkpointer's os.replace is hooked
                "__getattr__": lambda self, name: getattr(os, name),
                "replace": staticmethod(_kill_after(os.replace, int(n))),
            })()
    progress = os.environ.get("PEPO_TEST_PROGRESS")
    if progress and rank == "0":
        def record(recipe):
            with open(progress, "a") as f:
                f.write(f"{recipe.step}\n")

        _wrap_step(after=record)
    pause = os.environ.get("PEPO_TEST_STEP_SLEEP")
    if pause:  # a longer step, so that a signal test can land inside one
        import time

        _wrap_step(before=lambda recipe: time.sleep(float(pause)))
    validation_pause = os.environ.get("PEPO_TEST_VALIDATION_SLEEP")
    if validation_pause:
        import time

        seconds, marker = validation_pause.split(":", 1)
        real_validate = pepo_recipe.PEPORecipe.validate

        def validate(self):
            open(marker, "a").close()
            time.sleep(float(seconds))
            return real_validate(self)

        pepo_recipe.PEPORecipe.validate = validate
    fail_rank = os.environ.get("PEPO_TEST_FAIL_RANK")
    if fail_rank is not None and rank == fail_rank:
        def fail(recipe):
            if recipe.step == 2:
                raise RuntimeError(f"injected failure on rank {fail_rank} at step 2")

        _wrap_step(before=fail)


def main() -> None:
    register_resolvers()
    cfg = OmegaConf.load(sys.argv[1])
    _install_hooks()
    cfg.resume_from_checkpoint = ck.AtomicCheckpointer(
        os.path.join(cfg.output_dir, "checkpoints")).has_checkpoints()
    several = int(os.environ.get("WORLD_SIZE", "1")) > 1
    try:
        recipe = pepo_recipe.recipe_main(cfg, log_config=False)
    except pepo_recipe.TrainingStopped as e:  # as `tune run pepo_recipe` ends on SIGTERM/SIGINT
        print(e, file=sys.stderr)
        if several:
            exit_without_teardown(e.exit_code)
        sys.exit(e.exit_code)
    torch.save(recipe.estimator.state_dict(),
               os.path.join(cfg.output_dir, f"estimator_rank{recipe.dist.rank}.pt"))
    if several:  # as `tune run` ends (pepo_recipe._main)
        exit_without_teardown(0)


if __name__ == "__main__":
    main()
