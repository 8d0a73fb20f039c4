"""A trainer process for the distributed tests: ``torchrun ... -m tests.dist_driver CFG.yaml``.

Runs the recipe on a resolved config file as ``tune run`` would (resuming when its output
directory holds checkpoints) and, at the end, writes this rank's estimator state to
``<output_dir>/estimator_rank<R>.pt`` so a test can compare the ranks. With
``PEPO_TEST_PROGRESS=path`` each finished step's number is appended to ``path`` (rank 0); with
``PEPO_TEST_FAIL_RANK=r`` rank ``r`` raises at step 2.
"""

from __future__ import annotations

import os
import sys

import torch
from omegaconf import OmegaConf

import pepo.checkpointing as ck
import pepo_recipe
from pepo.recipe_config import register_resolvers


def main() -> None:
    register_resolvers()
    cfg = OmegaConf.load(sys.argv[1])
    progress = os.environ.get("PEPO_TEST_PROGRESS")
    if progress and os.environ.get("RANK", "0") == "0":
        real_step = pepo_recipe.PEPORecipe.train_step

        def train_step(self):
            out = real_step(self)
            with open(progress, "a") as f:
                f.write(f"{self.step}\n")
            return out

        pepo_recipe.PEPORecipe.train_step = train_step
    fail_rank = os.environ.get("PEPO_TEST_FAIL_RANK")
    if fail_rank is not None and os.environ.get("RANK") == fail_rank:
        real = pepo_recipe.PEPORecipe.train_step

        def failing_step(self):
            if self.step == 2:
                raise RuntimeError(f"injected failure on rank {fail_rank} at step 2")
            return real(self)

        pepo_recipe.PEPORecipe.train_step = failing_step
    cfg.resume_from_checkpoint = ck.AtomicCheckpointer(
        os.path.join(cfg.output_dir, "checkpoints")).has_checkpoints()
    try:
        recipe = pepo_recipe.recipe_main(cfg, log_config=False)
    except pepo_recipe.TrainingStopped as e:
        print(e, file=sys.stderr)
        sys.exit(143)
    torch.save(recipe.estimator.state_dict(),
               os.path.join(cfg.output_dir, f"estimator_rank{recipe.dist.rank}.pt"))


if __name__ == "__main__":
    main()
