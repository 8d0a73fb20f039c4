"""A trainer process for the fault tests: ``python -m tests.fault_driver CONFIG.yaml``.

Runs the recipe on a resolved config file (as ``tune run`` would), resuming when the output
directory already holds checkpoints. Two hooks, for the test that kills it:

* ``PEPO_TEST_PROGRESS=path``: after each step its number is appended to ``path``;
* ``PEPO_TEST_KILL=phase:n``: the process SIGKILLs itself at the n-th time the checkpoint
  writer reaches ``phase``: ``write`` (after a file of a checkpoint is written and fsynced),
  ``rename`` (after the checkpoint directory or the ``latest`` marker is renamed into place).
"""

from __future__ import annotations

import os
import signal
import sys

from omegaconf import OmegaConf

import pepo.checkpointing as ck
import pepo_recipe
from pepo.recipe_config import register_resolvers


def _kill_hook(module_attr: str, real, phase: str, target: int):
    calls = [0]

    def hooked(*args, **kwargs):
        out = real(*args, **kwargs)
        calls[0] += 1
        if calls[0] == target:
            os.kill(os.getpid(), signal.SIGKILL)
        return out

    return hooked


def main() -> None:
    register_resolvers()
    cfg = OmegaConf.load(sys.argv[1])
    kill = os.environ.get("PEPO_TEST_KILL")
    if kill:
        phase, n = kill.split(":")
        if phase == "write":
            ck._write_file = _kill_hook("_write_file", ck._write_file, phase, int(n))
        elif phase == "rename":
            ck.os = type("os_proxy", (), {  # only the checkpointer's os.replace is hooked
                "__getattr__": lambda self, name: getattr(os, name),
                "replace": staticmethod(_kill_hook("replace", os.replace, phase, int(n))),
            })()
    progress = os.environ.get("PEPO_TEST_PROGRESS")
    if progress:
        real_step = pepo_recipe.PEPORecipe.train_step

        def train_step(self):
            out = real_step(self)
            with open(progress, "a") as f:
                f.write(f"{self.step}\n")
            return out

        pepo_recipe.PEPORecipe.train_step = train_step
    resume = ck.AtomicCheckpointer(os.path.join(cfg.output_dir, "checkpoints")).has_checkpoints()
    cfg.resume_from_checkpoint = resume
    try:
        pepo_recipe.recipe_main(cfg, log_config=False)
    except pepo_recipe.TrainingStopped as e:  # as `tune run pepo_recipe` ends on SIGTERM
        print(e, file=sys.stderr)
        sys.exit(143)


if __name__ == "__main__":
    main()
