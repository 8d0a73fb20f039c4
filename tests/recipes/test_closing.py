"""How a run ends: a stop after its last step's checkpoint is closed by a resume, and a step
whose validation failed is kept and validated by the resume (:mod:`pepo.training.closing`)."""

from __future__ import annotations

import signal

import pytest

import pepo_recipe
from pepo.training.checkpointing import AtomicCheckpointer
from pepo.training.reporting import read_summary
from pepo.training.stopping import TrainingStopped
from tests.recipe_helpers import tiny_cfg


def losses(recipe):
    return [h["loss"] for h in recipe.history if h["step"] >= 1]


def _signal_at(monkeypatch, step):
    """SIGTERM arrives during training step ``step``."""
    real_step = pepo_recipe.PEPORecipe.train_step

    def signalled(self):
        m = real_step(self)
        if self.step == step:
            self.signals.handle(signal.SIGTERM)
        return m

    monkeypatch.setattr(pepo_recipe.PEPORecipe, "train_step", signalled)


def test_a_run_extended_and_stopped_after_its_new_last_step_is_closed_by_a_resume(
        tmp_path, monkeypatch):
    """A closed run (summary.json of 1 step) resumed to 2 steps and stopped after step 2's
    checkpoint. Catches the old summary.json left in place: the run looked closed, its resume
    was refused, and tools read a 1-step summary of a 2-step run."""
    out = tmp_path / "run"
    pepo_recipe.recipe_main(tiny_cfg(tmp_path, num_steps=1), log_config=False)
    assert read_summary(out)["num_steps"] == 1
    _signal_at(monkeypatch, 2)
    more = tiny_cfg(tmp_path, num_steps=2, resume_from_checkpoint=True)
    with pytest.raises(TrainingStopped):
        pepo_recipe.recipe_main(more, log_config=False)
    assert not (out / "summary.json").exists()  # no longer closed once it trains again
    monkeypatch.undo()
    pepo_recipe.recipe_main(more, log_config=False)
    summary = read_summary(out)
    assert summary["num_steps"] == 2 and [h["step"] for h in summary["history"]] == [1, 2]
    # what the numbers depend on beyond the config: tiny computes in its weights' dtype
    import datetime

    import pepo

    assert (summary["compute_dtype"], summary["world_size"]) == (None, 1)
    assert summary["pepo_version"] == pepo.__version__
    finished = datetime.datetime.fromisoformat(summary["finished"])
    assert abs((datetime.datetime.now(datetime.timezone.utc) - finished).total_seconds()) < 600


def test_a_run_stopped_after_its_last_step_is_closed_by_a_resume(tmp_path, monkeypatch):
    """SIGTERM during the last step: its checkpoint is written, then the run stops before
    ``summary.json``. Catches the resume that refused it ("num_steps asks for no more"): the
    run could never be completed, and tools reading summary.json called it unfinished. The
    resume trains nothing, writes the summary of the whole run; a second resume is refused."""
    real_step = pepo_recipe.PEPORecipe.train_step
    _signal_at(monkeypatch, 2)
    with pytest.raises(TrainingStopped, match="^stopped by SIGTERM at step 2"):
        pepo_recipe.recipe_main(tiny_cfg(tmp_path, num_steps=2), log_config=False)
    out = tmp_path / "run"
    assert (out / "checkpoints" / "latest").read_text(encoding="utf-8") == "step_2\n"
    assert not (out / "summary.json").exists()
    trained = []
    monkeypatch.setattr(pepo_recipe.PEPORecipe, "train_step",
                        lambda self: trained.append(self.step) or real_step(self))
    again = tiny_cfg(tmp_path, num_steps=2, resume_from_checkpoint=True)
    resumed = pepo_recipe.recipe_main(again, log_config=False)
    assert trained == []
    summary = read_summary(out)
    assert [h["step"] for h in summary["history"]] == [1, 2] and summary["num_steps"] == 2
    assert [h["loss"] for h in summary["history"]] == losses(resumed)
    recipe = pepo_recipe.PEPORecipe(again)
    with pytest.raises(ValueError, match="is at step 2, and num_steps=2 asks for no more"):
        recipe.setup(again)
    recipe.cleanup()


def test_a_failed_validation_keeps_its_step_and_the_resume_runs_it(tmp_path, monkeypatch):
    """Validation at step 2 of 3 raises (a verifier that fails, an out-of-memory error).
    Catches the step lost with it (validation ran before the checkpoint: with save_every=0
    nothing of steps 1-2 was kept). Now step 2 is checkpointed owing its validation, and the
    resume validates it first, then trains step 3: the losses and validations are the
    uninterrupted run's, and the checkpoints record step 2's accuracy (the best). The resume
    asks for avg@2: catches every validation labelled with the resume's k (the history's
    entries of steps 0-1 say avg@1)."""
    scores = {0: 0.3, 1: 0.4, 2: 0.8, 3: 0.6}

    def validate(self):
        if self.step == 2 and fail:
            raise RuntimeError("the verifier is down")
        return scores[self.step]

    monkeypatch.setattr(pepo_recipe.PEPORecipe, "validate", validate)

    def cfg(path, samples=1, **kw):
        c = tiny_cfg(path, num_steps=3, save_every=0, **kw)
        c.validation = {"every": 1, "samples": samples}
        return c

    fail = False
    whole = pepo_recipe.recipe_main(cfg(tmp_path / "whole"), log_config=False)
    fail = True
    with pytest.raises(RuntimeError, match="the verifier is down"):
        pepo_recipe.recipe_main(cfg(tmp_path / "cut"), log_config=False)
    ckpts = tmp_path / "cut" / "run" / "checkpoints"
    assert (ckpts / "latest").read_text(encoding="utf-8") == "step_2\n"
    assert AtomicCheckpointer.metadata(ckpts / "step_2") == {"step": 2}
    fail = False
    # the resume changes validation.samples (a run setting): each validation records its k
    resumed = pepo_recipe.recipe_main(cfg(tmp_path / "cut", samples=2,
                                          resume_from_checkpoint=True), log_config=False)
    assert losses(resumed) == losses(whole)
    assert ([h.get("val_accuracy") for h in resumed.history]
            == [h.get("val_accuracy") for h in whole.history] == [0.3, 0.4, 0.8, 0.6])
    assert [h.get("val_samples") for h in resumed.history] == [1, 1, 2, 2]
    assert [h.get("val_samples") for h in whole.history] == [1, 1, 1, 1]
    assert AtomicCheckpointer.metadata(ckpts / "step_2") == {"step": 2, "val_accuracy": 0.8}
    assert (ckpts / "best").read_text(encoding="utf-8") == "step_2\n"


def test_a_failed_validation_whose_checkpoint_fails_too_raises_the_validation_error(
        tmp_path, monkeypatch, caplog):
    """Catches the checkpoint's error replacing the validation's (a full disk would have shown
    only "could not write the checkpoint"): both are logged, the validation's is raised."""
    import logging

    def validate(self):
        if self.step == 1:
            raise RuntimeError("the verifier is down")
        return 0.5

    def save(self, step, metrics=None):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pepo_recipe.PEPORecipe, "validate", validate)
    monkeypatch.setattr(pepo_recipe.PEPORecipe, "save_checkpoint", save)
    cfg = tiny_cfg(tmp_path, num_steps=2, save_every=0)
    cfg.validation = {"every": 1, "samples": 1}
    with caplog.at_level(logging.ERROR), pytest.raises(RuntimeError, match="the verifier is down"):
        pepo_recipe.recipe_main(cfg, log_config=False)
    text = caplog.text
    assert "the validation at step 1 failed: RuntimeError: the verifier is down" in text
    assert "step 1's checkpoint could not be written either" in text


def test_the_summary_counts_the_prompts_dropped_for_length(tmp_path):
    """Prompts that do not fit ``max_seq_len`` with the response budget are dropped when the
    run starts; the count was in a warning only, so a finished run (and a study reading it)
    could not tell it trained on fewer problems than its dataset holds. The tiny task's prompts
    are 19-25 tokens: a 35-token model with 12 new tokens keeps those up to 23. Catches the
    counts not written, the two datasets' counts swapped, or the kept count taken as dropped."""
    cfg = tiny_cfg(tmp_path, num_steps=1, model={"max_seq_len": 35})
    pepo_recipe.recipe_main(cfg, log_config=False)
    summary = read_summary(tmp_path / "run")
    assert summary["prompts_dropped"] == {"dataset": 13, "val_dataset": 1}
    assert summary["train_problems"] == 64 - 13 and summary["val_problems"] == 4 - 1


def test_run_facts_name_the_precision_and_processes_a_run_had():
    """``compute_dtype: auto`` resolves per machine (bf16 where the CPU has bf16 units): the
    summary records the choice, or two runs of one config could not be told apart. Catches the
    config's ``auto`` recorded, or the dtype's repr (``torch.bfloat16``)."""
    from types import SimpleNamespace

    import torch

    from pepo.training.closing import run_facts

    facts = run_facts(SimpleNamespace(compute_dtype=torch.bfloat16,
                                      dist=SimpleNamespace(world_size=2)))
    assert (facts["compute_dtype"], facts["world_size"]) == ("bfloat16", 2)


class _Recipe:
    """What keep_unvalidated_step and settle_validation read and call on a recipe, recorded."""

    def __init__(self, *, enabled=False, val_every=1, step=2):
        from types import SimpleNamespace

        self.step, self.val_every, self.val_samples = step, val_every, 4
        self.history = [{"step": step - 1, "loss": 0.5}]
        self.validation_pending = None
        self.calls = []
        self.dist = SimpleNamespace(enabled=enabled, is_main=True)
        self.metric_logger = SimpleNamespace(
            log_dict=lambda metrics, step: self.calls.append(("log", dict(metrics), step)))
        self.checkpointer = SimpleNamespace(root="ckpts", latest=lambda: "ckpts/step_1")

    def save_checkpoint(self, step, metrics=None):
        self.calls.append(("save", step, metrics))

    def validate(self):
        self.calls.append(("validate",))
        return 0.75


def test_a_step_whose_validation_failed_is_logged_and_checkpointed_owing_it(caplog):
    """Catches the step's metrics kept out of the metrics log (the resume does not log them
    again), and the step marked as not owing its validation (the resume would skip it)."""
    import logging

    from pepo.training.closing import keep_unvalidated_step

    r = _Recipe()
    with caplog.at_level(logging.ERROR):
        keep_unvalidated_step(r, {"loss": 0.25}, RuntimeError("oom"), logging.getLogger("t"))
    assert r.history[-1] == {"step": 2, "loss": 0.25} and r.validation_pending is True
    assert r.calls == [("log", {"loss": 0.25}, 2), ("save", 2, None)]
    assert "step 2 is trained and its checkpoint written in ckpts" in caplog.text


def test_with_several_processes_a_failed_validation_keeps_nothing(caplog):
    """The other processes may wait in the failed validation's collectives, where a
    checkpoint's gather would hang: catches the step kept (and checkpointed) anyway."""
    import logging

    from pepo.training.closing import keep_unvalidated_step

    r = _Recipe(enabled=True)
    with caplog.at_level(logging.ERROR):
        keep_unvalidated_step(r, {"loss": 0.25}, RuntimeError("oom"), logging.getLogger("t"))
    assert r.calls == [] and r.history == [{"step": 1, "loss": 0.5}]
    assert r.validation_pending is None
    assert "the validation at step 2 failed: RuntimeError: oom" in caplog.text


@pytest.mark.parametrize("val_every", [0, 3])
def test_the_validation_a_resumed_step_owes_is_run_only_with_validation_on(val_every):
    """A resume that turned validation off (``validation.every=0``) owes nothing: catches the
    owed validation run all the same, and the flag left set (every later checkpoint would
    owe it again). With validation on: validated, recorded in the history, the metrics log and
    the step's checkpoint."""
    import logging

    from pepo.training.closing import settle_validation

    r = _Recipe(val_every=val_every)
    r.history.append({"step": 2, "loss": 0.25})  # the resumed step, as its checkpoint kept it
    r.validation_pending = True
    settle_validation(r, logging.getLogger("t"))
    assert r.validation_pending is False
    if not val_every:
        assert r.calls == [] and r.history[-1] == {"step": 2, "loss": 0.25}
        return
    assert r.calls == [("validate",), ("log", {"val_accuracy": 0.75}, 2),
                       ("save", 2, {"val_accuracy": 0.75})]
    assert r.history[-1] == {"step": 2, "loss": 0.25, "val_accuracy": 0.75, "val_samples": 4}


@pytest.mark.parametrize("thinking, system, keep_best, said", [
    (False, None, False, True), (True, "Be brief.", True, True), (True, None, True, False)])
def test_the_closing_lines_say_what_the_export_needs_and_the_best_checkpoint_when_kept(
        tmp_path, monkeypatch, caplog, thinking, system, keep_best, said):
    """The export's prompts differ from ``apply_chat_template``'s defaults when training
    switched thinking off or added a system turn: the closing lines say where those settings
    are. Catches the line left out for ``enable_thinking=False`` alone, and a best checkpoint
    named by a run that does not keep one (``keep_best=false`` on a resume of a run that
    did: its marker is stale)."""
    import logging
    from types import SimpleNamespace

    import pepo.training.closing as closing

    monkeypatch.setattr(closing.resume, "model_state_dict", lambda *a, **k: {})
    monkeypatch.setattr(closing, "save_hf", lambda w, path, **k: path)
    history = [{"step": 0, "val_accuracy": 0.25}, {"step": 1, "val_accuracy": 0.5}]
    checkpointer = SimpleNamespace(best=lambda: tmp_path / "checkpoints" / "step_1", keep=2,
                                   metadata=lambda p: {"step": 1, "val_accuracy": 0.5})
    recipe = SimpleNamespace(
        dist=SimpleNamespace(is_main=True, barrier=lambda: None, world_size=1), history=history,
        val_samples=1, checkpointer=checkpointer, keep_best=keep_best, hf_source=tmp_path,
        model=None, output_dir=tmp_path, stop_tokens=[0], val_data=[0], train_data=[0, 1],
        tokenizer=SimpleNamespace(enable_thinking=thinking, system_prompt=system),
        num_steps=1, prompts_dropped={}, compute_dtype=None, plot=False)
    with caplog.at_level(logging.INFO):
        closing.close_run(recipe, logging.getLogger("t"))
    assert ("its prompts as in training: apply_chat_template with the settings in "
            in caplog.text) is said
    assert ("Best validation checkpoint (kept with the newest 2)" in caplog.text) is keep_best
    assert read_summary(tmp_path)["history"] == history
