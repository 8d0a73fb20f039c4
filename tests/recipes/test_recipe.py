"""The recipe, in-process, on a random 1-layer Qwen3 for a few steps (seconds each)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

import pepo.loss
import pepo.weighting as pw
import pepo_recipe
from pepo.training.config import find_config, list_configs, register_resolvers, validate_config
from pepo.training.precision import cpu_attention_in_fp32
from tests.recipe_helpers import tiny_cfg


def run(cfg):
    return pepo_recipe.recipe_main(cfg, log_config=False)


def losses(recipe):
    return [h["loss"] for h in recipe.history if "loss" in h]


# Recorded from this test's own configuration (torch 2.13.0, CPU). A change in any part of the
# step (sampling, advantages, weighting, loss, optimizer) moves them. Last moved when sampling
# became per-rollout (counter-based uniforms from per-rollout seeds) and mini-batches tiled,
# which makes a run independent of the number of processes.
RECORDED_LOSSES = [-0.26014187932014465, -0.023417994379997253, 0.18298020958900452]


def test_losses_match_recorded_values(tmp_path):
    recipe = run(tiny_cfg(tmp_path, num_steps=3))
    got = losses(recipe)
    assert len(got) == 3
    torch.testing.assert_close(
        torch.tensor(got), torch.tensor(RECORDED_LOSSES), rtol=1e-4, atol=1e-6
    )


@pytest.mark.slow
def test_bundled_configs_validate_and_instantiate(tmp_path):
    register_resolvers()
    assert {"tiny", "tiny_spo"} <= set(list_configs())
    for name in list_configs():
        cfg = OmegaConf.load(find_config(name))
        if "estimator" not in cfg or OmegaConf.is_missing(cfg, "checkpoint_dir"):
            continue  # evaluation configs (test_eval.py); paper configs (test_recipe_hf.py)
        validate_config(cfg)
        # no single-stream prior: it would sample the whole training set
        cfg = OmegaConf.merge(cfg, {"output_dir": str(tmp_path / name)})
        if cfg.estimator.name == "single_stream":
            cfg.estimator.prior_samples = 0
        recipe = pepo_recipe.PEPORecipe(cfg)
        recipe.setup(cfg)
        assert sum(p.numel() for p in recipe.model.parameters()) > 0
        assert cpu_attention_in_fp32(recipe.model) == 0  # the recipe did it (a CPU run)
        recipe.cleanup()


@pytest.mark.parametrize("name", ["tiny", "tiny_spo"])
def test_resume_is_exact(tmp_path, name, monkeypatch):
    real = pepo.loss.clipped_policy_loss

    def drawing_loss(*args, **kwargs):  # draws from the global RNG each call, as dropout would
        torch.rand(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(pepo.loss, "clipped_policy_loss", drawing_loss)
    full = run(tiny_cfg(tmp_path / "full", name, num_steps=4))
    full_torch_rng = torch.get_rng_state()
    first = run(tiny_cfg(tmp_path / "split", name, num_steps=2))
    second = run(tiny_cfg(tmp_path / "split", name, num_steps=4, resume_from_checkpoint=True))
    assert second.step == 4 and first.step == 2
    torch.testing.assert_close(
        torch.tensor(losses(second)), torch.tensor(losses(full)), rtol=0, atol=1e-6
    )
    for (k, a), b in zip(full.model.state_dict().items(), second.model.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=k)
    # the state that decides the next step: estimator (SPO tracker), data position, RNGs
    assert _same_estimator_state(second.estimator.state_dict(), full.estimator.state_dict())
    assert second.sampler.state_dict() == full.sampler.state_dict()
    assert torch.equal(second.rng.get_state(), full.rng.get_state())
    assert torch.equal(second.sample_rng.get_state(), full.sample_rng.get_state())
    # the loss above drew from it: a resume that did not restore it lacks steps 1-2's draws
    assert torch.equal(torch.get_rng_state(), full_torch_rng)


def _same_estimator_state(a, b) -> bool:
    for key in ("alpha", "beta", "last_visit"):
        if key in a:
            assert a[key].keys() == b[key].keys(), key
            for pid in a[key]:
                assert a[key][pid] == pytest.approx(b[key][pid], rel=1e-6, abs=1e-9), (key, pid)
    assert a.get("drift_total", 0.0) == pytest.approx(b.get("drift_total", 0.0), rel=1e-6, abs=1e-9)
    assert a["config"] == b["config"]
    return True


def test_single_stream_runs_and_updates_tracker(tmp_path):
    recipe = run(tiny_cfg(tmp_path, "tiny_spo", num_steps=2))
    assert recipe.estimator.name == "single_stream"
    assert len(recipe.estimator) == 16  # every training prompt got a prior
    rows = [json.loads(line) for line in
            (tmp_path / "run" / "rollouts" / "step_000002.jsonl").read_text().splitlines()]
    assert len(rows) == 8 and len({r["prompt_id"] for r in rows}) == 8  # one rollout per prompt


@pytest.mark.parametrize("strategy", pw.list_strategies())
def test_every_strategy_runs(tmp_path, strategy):
    recipe = run(tiny_cfg(tmp_path, num_steps=1, strategy={"name": strategy}))
    assert all(math.isfinite(v) for v in losses(recipe))


def test_parameters_change(tmp_path):
    cfg = tiny_cfg(tmp_path, num_steps=1)
    recipe = pepo_recipe.PEPORecipe(cfg)
    recipe.setup(cfg)
    before = {k: v.clone() for k, v in recipe.model.state_dict().items()}
    recipe.train()
    changed = [k for k, v in recipe.model.state_dict().items() if not torch.equal(v, before[k])]
    assert len(changed) == len(before), set(before) - set(changed)


def test_equal_rewards_give_no_update(tmp_path):
    cfg = tiny_cfg(tmp_path, num_steps=1,
                   reward={"_component_": "tests.recipe_helpers.ConstantReward"})
    recipe = pepo_recipe.PEPORecipe(cfg)
    recipe.setup(cfg)
    before = {k: v.clone() for k, v in recipe.model.state_dict().items()}
    recipe.train()
    for k, v in recipe.model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert recipe.history[-1]["zero_advantage"] == 1.0


def test_validation_summary():
    summary = pepo_recipe.validation_summary
    hist = [{"step": 0, "val_accuracy": 0.3125}, {"step": 5, "loss": 0.1},
            {"step": 10, "val_accuracy": 0.617}, {"step": 20, "val_accuracy": 0.617},
            {"step": 30, "val_accuracy": 0.336}]
    assert summary(hist, 4) == ("Validation accuracy (avg@4): 0.312 before -> 0.336 after "
                                "(highest 0.617 at step 10)")
    # the last validation is the highest: nothing to add
    assert summary(hist[:3], 8) == "Validation accuracy (avg@8): 0.312 before -> 0.617 after"
    # training made it worse from the start: the highest is among the steps trained (each has
    # a checkpoint; the line that names the best one counts the same steps), never the
    # validation before training, whose score the line gives already
    worse = [{"step": 0, "val_accuracy": 0.5}, {"step": 10, "val_accuracy": 0.25}]
    assert summary(worse, 1).endswith("0.500 before -> 0.250 after")
    worse[1:1] = [{"step": 4, "val_accuracy": 0.5}, {"step": 6, "val_accuracy": 0.375}]
    assert summary(worse, 1).endswith("0.500 before -> 0.250 after (highest 0.500 at step 4)")
    # a history that does not start with a validation, or has none at all
    assert summary([{"step": 1, "loss": 0.0}, {"step": 2, "val_accuracy": 0.5}], 4) is None
    assert summary([], 4) is None


def test_outputs_written(tmp_path, caplog, capsys):
    with caplog.at_level("INFO"):
        recipe = run(
            tiny_cfg(tmp_path, num_steps=2, plot=True, validation={"every": 1, "samples": 1})
        )
    assert pepo_recipe.validation_summary(recipe.history, 1) in caplog.messages
    # off a terminal (pytest's capture, a log file) the steps are plain lines, each validation
    # and checkpoint has its own, and nothing redraws: no carriage return, no cursor move up
    # to a bar (`ESC[A`), garbage in a log file (pepo.training.progress; the bar on a terminal
    # is tests/training/test_progress.py's)
    captured = capsys.readouterr()
    err = captured.err
    for step in (1, 2):
        assert f"step {step}: validation avg@1 " in err, err[-2000:]
        assert f"pepo[proximal_softmax] step {step}/2: val=" in err
        assert f"step {step}: checkpoint {tmp_path / 'run' / 'checkpoints' / f'step_{step}'}" in err
    assert "\x1b[A" not in err + captured.out and "\r" not in err + captured.out
    out = tmp_path / "run"
    assert (out / "training_curves.png").stat().st_size > 1000
    assert "val_accuracy" in (out / "logs" / "metrics.txt").read_text()
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_2"
    rows = [json.loads(x) for x in (out / "rollouts" / "step_000001.jsonl").read_text()
            .splitlines()]
    row = rows[0]
    n = len(row["token_ids"])
    assert n == len(row["entropies"]) == len(row["token_advantages"]) == len(row["tokens"]) > 0
    assert set(row) >= {"prompt", "response", "reward", "advantage", "token_weights"}
    # each row's prompt group: consecutive blocks of group_size (the analysis groups by it)
    size = len(rows) // len({r["group"] for r in rows})
    assert [r["group"] for r in rows] == [i // size for i in range(len(rows))] and size > 1


def test_validation_dump_holds_the_scored_responses(tmp_path):
    """``validation.dump``: one file per validation with every rollout (4 prompts x 2 samples),
    whose successes give back the logged accuracy. Catches the key ignored, a dump of the
    training rollouts instead, and records whose reward is not their response's."""
    recipe = run(tiny_cfg(tmp_path, num_steps=2,
                          validation={"every": 2, "samples": 2, "dump": True}))
    out = tmp_path / "run" / "val_rollouts"
    assert sorted(f.name for f in out.iterdir()) == ["step_000000.jsonl", "step_000002.jsonl"]
    accs = {h["step"]: h["val_accuracy"] for h in recipe.history if "val_accuracy" in h}
    for step in (0, 2):
        rows = [json.loads(x) for x in (out / f"step_{step:06d}.jsonl").read_text(
            encoding="utf-8").splitlines()]
        assert len(rows) == 8 and {r["step"] for r in rows} == {step}
        assert sorted(r["prompt"] for r in rows) == sorted(
            p.prompt for p in recipe.val_data for _ in range(2))
        assert sum(r["success"] for r in rows) / 8 == pytest.approx(accs[step])
        scored = recipe.reward_fn([r["response"] for r in rows], [r["answer"] for r in rows])
        assert [r["reward"] for r in rows] == pytest.approx([float(x) for x in scored], rel=1e-6)
    plain = run(tiny_cfg(tmp_path / "off", num_steps=1, validation={"every": 1, "samples": 1}))
    assert plain.val_dump is False and not (tmp_path / "off" / "run" / "val_rollouts").exists()


def test_nonfinite_steps_are_skipped_then_stop(tmp_path, monkeypatch):
    cfg = tiny_cfg(tmp_path, num_steps=3, max_nonfinite_steps=3)
    recipe = pepo_recipe.PEPORecipe(cfg)
    recipe.setup(cfg)
    before = {k: v.clone() for k, v in recipe.model.state_dict().items()}
    real = pepo.loss.clipped_policy_loss
    monkeypatch.setattr(pepo.loss, "clipped_policy_loss",
                        lambda *a, **k: real(*a, **k) * float("nan"))
    with pytest.raises(pepo_recipe.NonFiniteError, match="3 optimizer steps in a row"):
        recipe.train()
    # ppo_mini_batches=2: the first step skips two optimizer steps, the second stops at one more
    assert recipe.nonfinite_total == 3
    assert recipe.history[-1]["nonfinite_skipped"] == 2
    for k, v in recipe.model.state_dict().items():
        assert torch.equal(v, before[k]), k


@pytest.mark.parametrize(
    "override, message",
    [
        ({"strategy": {"name": "nope"}}, "unknown strategy 'nope'; registered strategies"),
        # a misspelt name gets the closest registered one, as key typos and pw.get_strategy do
        (
            {"strategy": {"name": "proximal_sofmax"}},
            "unknown strategy 'proximal_sofmax'; did you mean 'proximal_softmax'\\? registered",
        ),
        ({"strategy": {"proximal_softmax": {"window": 4}}}, "window must be an odd int"),
        ({"micro_batch_size": 3}, "micro_batch_size=3 does not divide"),
        ({"ppo_mini_batches": 3}, "ppo_mini_batches=3 does not divide"),
        ({"estimator": {"group_size": 1}}, "estimator.group_size must be an int >= 2"),
        ({"estimator": {"name": "ppo"}}, "estimator.name must be one of"),
        # the paper's names point at pepo's (the schema passes the core's message on)
        ({"strategy": {"name": "PEPO"}}, "the paper's PEPO is 'proximal_softmax'; registered"),
        ({"estimator": {"name": "spo"}}, r"got 'spo' \(the paper's SPO is 'single_stream'\)"),
        (
            {"checkpoint_dir": "/nonexistent/ckpt"},
            "checkpoint_dir='/nonexistent/ckpt' does not exist",
        ),
        ({"generation": {"top_p": 0.0}}, "generation.top_p must be a number in"),
        ({"generation": {"compile": "yes"}}, "generation.compile must be true or false"),
        (
            {"generation": {"compile": True, "engine": "vllm"}},
            "generation.compile applies to the in-process decoder",
        ),
        ({"seed": None}, "seed must be an int"),
        ({"estimator": {"group_sise": 4}}, "unknown estimator key\\(s\\) \\['group_sise'\\]"),
        ({"keep_checkpoints": 0}, "keep_checkpoints must be an int >= 1"),
    ],
)
def test_bad_config_fails_before_model(tmp_path, override, message, monkeypatch):
    """The whole entry point (validation, then setup) must raise before any model is built.
    The spy on the model builder is shown to fire on a valid config, so it cannot pass
    vacuously."""
    import pepo.training.models

    built = []
    real = pepo.training.models.tiny_qwen3
    monkeypatch.setattr(
        pepo.training.models, "tiny_qwen3", lambda *a, **k: built.append(1) or real(*a, **k)
    )
    with pytest.raises(ValueError, match=message):
        run(tiny_cfg(tmp_path / "bad", **override))
    assert not built
    recipe = pepo_recipe.PEPORecipe(tiny_cfg(tmp_path / "good", num_steps=1))
    recipe.setup(tiny_cfg(tmp_path / "good", num_steps=1))
    assert built  # the spy sees real builds
    recipe.cleanup()


def test_logprobs_from_hidden_with_a_head_it_cannot_take_fails_at_setup(tmp_path, monkeypatch):
    """Catches the recipe not checking the built model (``check_model``): a head with a bias
    under ``logprobs_from_hidden=true`` is refused when the model is built, before any step,
    instead of training with the bias dropped from every log-prob."""
    import pepo.training.models

    real = pepo.training.models.tiny_qwen3

    def biased_head(*a, **k):
        model = real(*a, **k)
        emb = model.tok_embeddings
        model.output = torch.nn.Linear(emb.embedding_dim, emb.num_embeddings)
        return model

    monkeypatch.setattr(pepo.training.models, "tiny_qwen3", biased_head)
    cfg = tiny_cfg(tmp_path, logprobs_from_hidden=True)
    with pytest.raises(ValueError, match="this model's is a Linear with a bias: set "
                                         "logprobs_from_hidden=false") as raised:
        run(cfg)
    # raised by the check of the built model, not by the first update's forward
    assert "check_model" in [entry.name for entry in raised.traceback]
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_resumed_run_logs_each_step_once(tmp_path):
    """A run killed after step 3 with its last checkpoint at step 2 logged step 3; the resume
    logs step 3 again. metrics.txt must hold one line per step (and keep step 0's validation)."""
    import shutil

    cfg = tiny_cfg(tmp_path, num_steps=3, save_every=2, keep_checkpoints=3)
    cfg.validation = {"every": 2, "samples": 1}
    run(cfg)
    ckpts = tmp_path / "run" / "checkpoints"
    shutil.rmtree(ckpts / "step_3")  # as if killed before step 3's checkpoint
    log = tmp_path / "run" / "logs" / "metrics.txt"
    before = log.read_text(encoding="utf-8").splitlines()
    assert sum(line.startswith("Step 3 ") for line in before) >= 1
    resumed = run(tiny_cfg(tmp_path, num_steps=4, save_every=2, keep_checkpoints=3,
                           resume_from_checkpoint=True, validation=cfg.validation))
    assert resumed.step == 4
    lines = log.read_text(encoding="utf-8").splitlines()
    train_steps = [int(line.split()[1]) for line in lines if "loss:" in line]
    val_steps = [int(line.split()[1]) for line in lines if "val_accuracy:" in line]
    assert train_steps == [1, 2, 3, 4] and val_steps == [0, 2, 4]
    assert lines[: len([x for x in before if not x.startswith("Step 3 ")])] == \
        [x for x in before if not x.startswith("Step 3 ")]  # what came before is untouched


def test_an_earlier_runs_dumps_are_not_mixed_into_a_new_or_resumed_runs(tmp_path):
    """A run killed before its first checkpoint left rollout and validation dumps; a fresh run
    in its directory dropped only its metrics lines, so ``pepo.study.analysis`` of the folder
    pooled the two runs. A resumed run's dumps after its checkpoint are the stopped run's (and,
    with other dump settings, not made again). Catches either kept, a dump of a step the
    checkpoint covers removed, and a stale training-curves picture kept by a fresh run."""
    out = tmp_path / "run"
    for d, steps in (("rollouts", (1, 2, 3, 7)), ("val_rollouts", (0, 3))):
        (out / d).mkdir(parents=True)
        for s in steps:
            (out / d / f"step_{s:06d}.jsonl").write_text('{"stale": true}\n')
    (out / "rollouts" / "step_000004.jsonl.gz").write_bytes(b"")
    (out / "training_curves.png").write_bytes(b"stale")
    run(tiny_cfg(tmp_path, num_steps=2, save_every=1, keep_checkpoints=3, dump_rollouts_every=2))
    assert sorted(p.name for p in (out / "rollouts").iterdir()) == ["step_000002.jsonl"]
    assert "stale" not in (out / "rollouts" / "step_000002.jsonl").read_text()
    assert not list((out / "val_rollouts").iterdir())  # validation.every=0: none of its own
    assert not (out / "training_curves.png").exists()  # plot=False: none of its own
    import shutil

    shutil.rmtree(out / "checkpoints" / "step_2")  # as if killed before step 2's checkpoint
    (out / "summary.json").unlink()
    (out / "rollouts" / "step_000009.jsonl").write_text("{}\n")
    run(tiny_cfg(tmp_path, num_steps=2, save_every=1, keep_checkpoints=3, dump_rollouts_every=3,
                 resume_from_checkpoint=True))
    assert not list((out / "rollouts").iterdir())  # step 2's is after the checkpoint (step 1)
    (out / "rollouts" / "step_000001.jsonl").write_text("{}\n")
    shutil.rmtree(out / "checkpoints" / "step_2")
    (out / "summary.json").unlink()
    run(tiny_cfg(tmp_path, num_steps=2, save_every=1, keep_checkpoints=3, dump_rollouts_every=3,
                 resume_from_checkpoint=True))
    assert [p.name for p in (out / "rollouts").iterdir()] == ["step_000001.jsonl"]  # kept


def test_truncate_metrics_log_keeps_other_lines_and_is_a_no_op_without_later_steps(tmp_path):
    from pepo.training.reporting import truncate_metrics_log

    log = tmp_path / "m.txt"
    assert truncate_metrics_log(log, 3) == 0 and not log.exists()
    log.write_text("Step 0 | val_accuracy:0.5 \nnote\nStep 3 | loss:1 \nStep 4 | loss:2 \n"
                   "Step 12 | loss:3 \n", encoding="utf-8")
    assert truncate_metrics_log(log, 3) == 2
    assert log.read_text(encoding="utf-8") == "Step 0 | val_accuracy:0.5 \nnote\nStep 3 | loss:1 \n"
    assert truncate_metrics_log(log, 3) == 0 and not list(tmp_path.glob("*.tmp"))


def test_resume_without_checkpoint_is_clear(tmp_path):
    """Refused before anything is built, leaving no directory behind (the run lock's
    .pepo.lock kept a new output_dir in place); a directory that was there stays."""
    cfg = tiny_cfg(tmp_path, resume_from_checkpoint=True)
    with pytest.raises(ValueError, match="holds no checkpoint"):
        pepo_recipe.PEPORecipe(cfg)  # before anything is built
    assert not Path(cfg.output_dir).exists()
    Path(cfg.output_dir).mkdir()
    with pytest.raises(ValueError, match="holds no checkpoint"):
        pepo_recipe.PEPORecipe(cfg)
    assert Path(cfg.output_dir).is_dir()


def test_custom_strategy_through_imports(tmp_path, monkeypatch):
    (tmp_path / "my_halving_strategy.py").write_text(
        "import pepo.weighting as pw\n"
        "@pw.register_strategy('halved_uniform_for_test', overwrite=True)\n"
        "def halved():\n"
        "    return lambda a, e, m: 0.5 * a[:, None].expand(m.shape)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = tiny_cfg(tmp_path, num_steps=1, imports=["my_halving_strategy"],
                   strategy={"name": "halved_uniform_for_test"})
    recipe = run(cfg)
    assert recipe.strategy_name == "halved_uniform_for_test" and losses(recipe)
    with pytest.raises(ValueError, match="imports: cannot import 'no_such_module_xyz'"):
        pepo_recipe.PEPORecipe(tiny_cfg(tmp_path / "b", imports=["no_such_module_xyz"]))


def test_find_config_by_name_and_path(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("name: mine\n")
    assert find_config(str(path)) == str(path)
    assert find_config("tiny").endswith("tiny.yaml")
    with pytest.raises(ValueError,
                       match="bundled configs: \\[.*'tiny', 'tiny_drift', 'tiny_drift_spo', "
                             "'tiny_reason', 'tiny_reason_spo', 'tiny_spo'"):
        find_config("tinyy")


def test_single_stream_tracker_values_are_checked_early(tmp_path):
    with pytest.raises(ValueError,
                       match="estimator: need 0 < rho_min <= rho_max <= 1, got rho_min=2.0"):
        pepo_recipe.PEPORecipe(tiny_cfg(tmp_path, "tiny_spo", estimator={"rho_min": 2.0}))


def test_fresh_run_refuses_an_output_dir_with_checkpoints(tmp_path):
    """... and one whose checkpoints were deleted (README: they can go when hf_model is all you
    need): its summary.json says a run finished there. Catches a new run that silently removed
    that summary and the metrics log's lines and wrote its curves, dumps and hf_model over the
    finished run's."""
    import shutil

    run(tiny_cfg(tmp_path, num_steps=1))
    with pytest.raises(ValueError, match="already holds a run's checkpoints"):
        pepo_recipe.PEPORecipe(tiny_cfg(tmp_path, num_steps=1))
    out = tmp_path / "run"
    shutil.rmtree(out / "checkpoints")
    summary = (out / "summary.json").read_text()
    for resume in (False, True):  # the resume's "start without it" would go round in a circle
        with pytest.raises(ValueError, match=r"holds a finished run \(its summary.json\) and no "
                                             r"checkpoint to go on from: choose another"):
            pepo_recipe.PEPORecipe(tiny_cfg(tmp_path, num_steps=1, resume_from_checkpoint=resume))
    assert (out / "summary.json").read_text() == summary


def test_resume_refuses_a_different_lr_schedule(tmp_path):
    sched = {"_component_": "torchtune.training.lr_schedulers.get_cosine_schedule_with_warmup",
             "num_warmup_steps": 1}
    run(tiny_cfg(tmp_path, num_steps=1, lr_scheduler=sched))
    cfg = tiny_cfg(tmp_path, num_steps=3, lr_scheduler=sched, resume_from_checkpoint=True)
    recipe = pepo_recipe.PEPORecipe(cfg)
    with pytest.raises(ValueError, match="LR schedule spans 2 optimizer steps, this config's 6"):
        recipe.setup(cfg)


def test_resume_restores_the_lr_schedule(tmp_path):
    """A run with a warm-up + cosine schedule, resumed from step 2 of 4, follows the LR curve
    and the losses of the run that was not stopped: catches the scheduler's state not saved or
    not loaded (the resumed steps then restart the warm-up: step 4 at LR 0.01 instead of 0)."""
    sched = {"_component_": "torchtune.training.lr_schedulers.get_cosine_schedule_with_warmup",
             "num_warmup_steps": 1}
    full = run(tiny_cfg(tmp_path / "full", num_steps=4, lr_scheduler=sched))
    run(tiny_cfg(tmp_path / "split", num_steps=4, lr_scheduler=sched, save_every=2,
                 keep_checkpoints=2))
    ckpts = tmp_path / "split" / "run" / "checkpoints"
    shutil.rmtree(ckpts / "step_4")  # as if the run had stopped after step 2
    (ckpts / "latest").write_text("step_2\n", encoding="utf-8")
    second = run(tiny_cfg(tmp_path / "split", num_steps=4, lr_scheduler=sched,
                          resume_from_checkpoint=True))
    lrs = [[h["lr"] for h in r.history if "lr" in h] for r in (full, second)]
    assert len(lrs[0]) == 4 and len(set(lrs[0])) > 2  # the schedule moves the LR each step
    # each step logs the LR its first optimizer step used (2 a step: ppo_mini_batches=2), not
    # the one the scheduler moved on to after its last (step 1 then logged the warm-up's end)
    from torchtune.training.lr_schedulers import get_cosine_schedule_with_warmup

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-2)
    curve = get_cosine_schedule_with_warmup(opt, num_warmup_steps=1, num_training_steps=8)
    used = []
    for _ in range(8):
        used.append(opt.param_groups[0]["lr"])
        opt.step()
        curve.step()
    assert lrs[0] == pytest.approx(used[::2], rel=1e-9, abs=1e-12)
    assert lrs[1] == pytest.approx(lrs[0], rel=1e-9, abs=1e-12)
    torch.testing.assert_close(torch.tensor(losses(second)), torch.tensor(losses(full)),
                               rtol=0, atol=1e-6)


def test_resume_carries_the_non_finite_counts(tmp_path, monkeypatch):
    """Two skipped optimizer steps (step 1's two mini-batches), then a resume that still sees
    non-finite losses stops at the third in a row, and reports three in all: catches the
    guard's counts not restored (the resume would stop only at its own third)."""
    real = pepo.loss.clipped_policy_loss
    monkeypatch.setattr(pepo.loss, "clipped_policy_loss",
                        lambda *a, **k: real(*a, **k) * float("nan"))
    first = run(tiny_cfg(tmp_path, num_steps=1, max_nonfinite_steps=5))
    assert first.nonfinite_total == 2
    cfg = tiny_cfg(tmp_path, num_steps=2, max_nonfinite_steps=3, resume_from_checkpoint=True)
    recipe = pepo_recipe.PEPORecipe(cfg)
    recipe.setup(cfg)
    assert (recipe.nonfinite.total, recipe.nonfinite.in_a_row) == (2, 2)
    with pytest.raises(pepo_recipe.NonFiniteError, match="3 optimizer steps in a row") as e:
        recipe.train()
    assert recipe.nonfinite_total == 3
    # the message names the checkpoint to go back to (step 1's), not the directory
    step_1 = tmp_path / "run" / "checkpoints" / "step_1"
    assert str(e.value).endswith(f"The last checkpoint is {step_1}.")


def test_generation_stop_tokens_reach_training_and_validation(tmp_path, monkeypatch):
    """Catches the training step or the validation sampling with the tokenizer's stop tokens
    only, ``generation.stop_tokens`` dropped (every bundled config leaves it empty)."""
    from pepo.training.engines import InProcessEngine

    seen = []
    real = InProcessEngine.generate

    def recording(self, prompts, **kwargs):
        seen.append(list(kwargs["stop_tokens"]))
        return real(self, prompts, **kwargs)

    monkeypatch.setattr(InProcessEngine, "generate", recording)
    recipe = run(tiny_cfg(tmp_path, num_steps=1, generation={"stop_tokens": ["+"]},
                          validation={"every": 1, "samples": 1}))
    want = [*recipe.tokenizer.stop_tokens, recipe.tokenizer.token_id("+")]
    assert len(seen) >= 3 and all(s == want for s in seen), seen  # before, the step, after


def test_prompts_too_long_are_dropped(tmp_path):
    cfg = tiny_cfg(tmp_path, num_steps=1, model={"max_seq_len": 32},
                   generation={"max_new_tokens": 12})
    recipe = pepo_recipe.PEPORecipe(cfg)
    recipe.setup(cfg)  # prompts are 16-24 tokens: those over 20 go
    lengths = [len(recipe.tokenizer.encode(p.prompt)) for p in recipe.train_data]
    assert 0 < len(lengths) < 64 and max(lengths) <= 20


def test_memory_options_give_the_same_losses(tmp_path):
    """Hidden-state log-probs, activation checkpointing and batched generation are memory
    settings: the losses stay those of the plain path."""
    plain = losses(run(tiny_cfg(tmp_path / "a", num_steps=2)))
    lean = losses(run(tiny_cfg(tmp_path / "b", num_steps=2, logprobs_from_hidden=True,
                               enable_activation_checkpointing=True)))
    torch.testing.assert_close(torch.tensor(lean), torch.tensor(plain), rtol=1e-4, atol=1e-6)
    batched = run(tiny_cfg(tmp_path / "c", num_steps=2, generation={"batch_size": 3}))
    assert losses(batched) == plain  # each row draws from its own seed: the same rollouts


@pytest.mark.parametrize("keep_best", [True, False])
def test_the_best_validation_checkpoint_is_saved_and_kept(tmp_path, monkeypatch, keep_best):
    """keep_checkpoints=1 kept only the newest: the peak's weights were gone by the end."""
    accs = iter([0.5, 0.7, 0.9, 0.6, 0.8])  # steps 0..4
    monkeypatch.setattr(pepo_recipe.PEPORecipe, "validate", lambda self: next(accs))
    cfg = tiny_cfg(tmp_path, num_steps=4, save_every=0, keep_checkpoints=1, keep_best=keep_best)
    cfg.validation = {"every": 1, "samples": 1}
    run(cfg)
    ckpts = tmp_path / "run" / "checkpoints"
    kept = sorted(p.name for p in ckpts.glob("step_*"))
    if keep_best:
        assert kept == ["step_2", "step_4"]  # step 2 saved only because it was a new best
        assert (ckpts / "best").read_text(encoding="utf-8").strip() == "step_2"
        from pepo.training.checkpointing import AtomicCheckpointer

        assert AtomicCheckpointer.metadata(ckpts / "step_2") == {"step": 2, "val_accuracy": 0.9}
    else:
        assert kept == ["step_4"] and not (ckpts / "best").exists()


class HalfLoss:
    """A loss component (``loss._component_``): half the default loss."""

    def __init__(self, eps_low: float, eps_high: float) -> None:
        self.inner = pepo.loss.ClippedPolicyLoss(eps_low, eps_high)

    def __call__(self, *args, **kwargs):
        return 0.5 * self.inner(*args, **kwargs)


class NoClipRange:
    def __init__(self, scale: float = 1.0) -> None:
        self.scale = scale


def test_the_loss_is_a_component_named_in_the_config(tmp_path):
    """Another aggregation is a config change. Catches a recipe that calls
    clipped_policy_loss itself whatever ``loss._component_`` says: with one optimizer step per
    training step the first step's loss (taken before the update, on the same rollouts) is
    exactly half the default's; a component that takes no clip range fails at validation."""
    a = run(tiny_cfg(tmp_path / "a", num_steps=1, ppo_mini_batches=1))
    b = run(tiny_cfg(tmp_path / "b", num_steps=1, ppo_mini_batches=1,
                     loss={"_component_": "tests.recipes.test_recipe.HalfLoss"}))
    assert losses(a)[0] != 0 and losses(b)[0] == pytest.approx(0.5 * losses(a)[0], rel=1e-6)
    with pytest.raises(ValueError, match="^loss: tests.recipes.test_recipe.NoClipRange got an "
                                         "unexpected keyword argument 'eps_low'"):
        validate_config(tiny_cfg(tmp_path / "c", loss={
            "_component_": "tests.recipes.test_recipe.NoClipRange"}))


def test_an_estimator_state_a_resume_cannot_read_stops_at_the_first_checkpoint(tmp_path,
                                                                               monkeypatch):
    """A registered estimator whose ``state_dict()`` held a numpy scalar wrote checkpoints that
    every resume then called damaged (``torch.load(weights_only=True)`` refuses the type), so
    the run could never go on. Catches the state saved unchecked; a plain state passes."""
    import numpy as np

    from pepo import estimators
    from pepo.training.stopping import CheckpointFailed

    class Ema(estimators.GroupEstimator):
        name = "test_ema"
        kind = "numpy"

        def state_dict(self):
            state = super().state_dict()
            return {**state, "baseline": np.float64(0.5) if self.kind == "numpy" else 0.5}

        def load_state_dict(self, state):
            super().load_state_dict({k: v for k, v in state.items() if k != "baseline"})

    monkeypatch.setitem(estimators.ESTIMATORS, "test_ema", Ema)
    cfg = tiny_cfg(tmp_path, num_steps=1, save_every=1)
    cfg.estimator = {"name": "test_ema", "group_size": cfg.estimator.group_size}
    with pytest.raises(CheckpointFailed, match=r"^estimator 'test_ema': its state_dict\(\) cannot "
                                               r"be read back by a resume \(torch.load\(weights_"
                                               r"only=True\): .*GLOBAL numpy.*allowed global by "
                                               r"default.\); keep tensors"):
        run(cfg)
    monkeypatch.setattr(Ema, "kind", "float")
    run(tiny_cfg(tmp_path / "ok", num_steps=1, save_every=1, estimator=cfg.estimator))


def test_an_estimator_that_cannot_load_its_saved_state_is_one_line(tmp_path, monkeypatch):
    """A registered estimator whose state's keys changed between a run and its resume (its
    code edited) was a ``KeyError`` traceback from ``resume.load_state``. Catches it unnamed
    (no checkpoint, no estimator in the message) or raised as something the recipe's setup
    does not print as one line (not a ``ValueError``)."""
    from pepo import estimators

    class Ema(estimators.GroupEstimator):
        name = "test_ema_keys"

        def state_dict(self):
            return {**super().state_dict(), "baselines": {}}

        def load_state_dict(self, state):
            super().load_state_dict({k: v for k, v in state.items() if k != "baselines"})
            state["baseline_v2"]  # the edited code's key

    monkeypatch.setitem(estimators.ESTIMATORS, "test_ema_keys", Ema)
    est = {"name": "test_ema_keys", "group_size": 4}
    run(tiny_cfg(tmp_path, num_steps=1, save_every=1, estimator=est))
    with pytest.raises(ValueError, match=r"^checkpoint .*step_1: estimator 'test_ema_keys' could "
                                         r"not load its state \(KeyError: 'baseline_v2'\)$"):
        run(tiny_cfg(tmp_path, num_steps=2, save_every=1, estimator=est,
                     resume_from_checkpoint=True))
