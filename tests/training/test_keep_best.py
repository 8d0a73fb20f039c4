"""keep_best in the recipe: which steps it saves as a new best, and what ``best`` names."""

from __future__ import annotations

import pepo_recipe
from pepo.training.checkpointing import AtomicCheckpointer
from tests.recipe_helpers import tiny_cfg


def test_a_tie_is_not_a_new_best_and_step_0_does_not_count(tmp_path, monkeypatch):
    """Validation scores 0.95 (step 0, before training), 0.5, 0.7, 0.7 (a tie), 0.6; the run
    saves every 0 steps (so only the last step and new bests), keeps 2.

    Catches a new best on a tie (``>=`` for ``>``: step 3 saved too, and kept beside 2 and 4)
    and the step-0 score counted among the ones to beat (no trained step beats 0.95: steps 1
    and 2 never saved, and ``best`` names step_4, 0.6, instead of step_2, 0.7). Step 0 is the
    starting model, which no checkpoint holds: the best trained checkpoint is what ``best``
    names, whatever the starting model scored."""
    accs = iter([0.95, 0.5, 0.7, 0.7, 0.6])  # steps 0..4
    monkeypatch.setattr(pepo_recipe.PEPORecipe, "validate", lambda self: next(accs))
    saved = []
    save = AtomicCheckpointer.save
    monkeypatch.setattr(AtomicCheckpointer, "save",
                        lambda self, step, *a, **k: saved.append(step) or save(self, step, *a, **k))
    cfg = tiny_cfg(tmp_path, num_steps=4, save_every=0, keep_checkpoints=2)
    cfg.validation = {"every": 1, "samples": 1}
    pepo_recipe.recipe_main(cfg, log_config=False)
    ckpts = tmp_path / "run" / "checkpoints"
    assert saved == [1, 2, 4]  # 1 and 2: each a new best among trained steps; 4: the last
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_2", "step_4"]
    assert (ckpts / "best").read_text(encoding="utf-8") == "step_2\n"
    assert AtomicCheckpointer.metadata(ckpts / "step_2") == {"step": 2, "val_accuracy": 0.7}


def test_a_resume_without_validation_keeps_the_best_of_the_steps_before(tmp_path, monkeypatch):
    """Steps 1-2 validate (0.9, then 0.5) and keep 1 checkpoint besides the best; a resume to
    step 4 with ``validation.every=0`` (a key a resume may change) validates nothing more.
    Catches a resumed run that stops protecting the best: it pruned step_1, the peak's
    weights, and left ``best`` naming a deleted directory."""
    accs = iter([0.3, 0.9, 0.5])  # steps 0..2
    monkeypatch.setattr(pepo_recipe.PEPORecipe, "validate", lambda self: next(accs))
    cfg = tiny_cfg(tmp_path, num_steps=2, save_every=1, keep_checkpoints=1)
    cfg.validation = {"every": 1, "samples": 1}
    pepo_recipe.recipe_main(cfg, log_config=False)
    ckpts = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_1", "step_2"]
    cfg = tiny_cfg(tmp_path, num_steps=4, save_every=1, keep_checkpoints=1,
                   resume_from_checkpoint=True)
    cfg.validation = {"every": 0, "samples": 1}
    pepo_recipe.recipe_main(cfg, log_config=False)
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_1", "step_4"]
    assert (ckpts / "best").read_text(encoding="utf-8") == "step_1\n"
