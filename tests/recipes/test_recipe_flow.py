"""What flows through the recipe's step, checked against values recomputed independently.

Each test names the wrong implementation it catches: a parameter ignored, a call never made, a
value read from the wrong place. The recipe runs in-process on a random 1-layer Qwen3.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

import pepo.weighting as pw
import pepo_recipe
from pepo.estimators import SingleStreamEstimator
from tests.recipe_helpers import tiny_cfg


def run(cfg):
    return pepo_recipe.recipe_main(cfg, log_config=False)


def read_dump(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def dump_batch(rows: list[dict]):
    """The step's batch as the strategy saw it: advantages [B], entropies [B, T], mask,
    success flags [B] and the token advantages the recipe produced (0 at padding)."""
    width = max(len(r["entropies"]) for r in rows)
    ent = torch.zeros(len(rows), width)
    got = torch.zeros(len(rows), width)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, r in enumerate(rows):
        n = len(r["entropies"])
        ent[i, :n] = torch.tensor(r["entropies"])
        got[i, :n] = torch.tensor(r["token_advantages"])
        mask[i, :n] = True
    adv = torch.tensor([r["advantage"] for r in rows])
    success = torch.tensor([r["success"] for r in rows])
    return adv, ent, mask, success, got


CUSTOM = '''
import torch
import pepo.weighting as pw

@pw.register_strategy("flow_test_custom", overwrite=True)
def flow_test_custom(boost: float = 3.0):
    def fn(advantages, entropies, mask, positive):
        a = advantages[:, None]
        return torch.where(positive[:, None], a * (1 + boost * entropies), a)
    return fn
'''


@pytest.mark.parametrize("strategy, name", [
    (s, n) for s in [*pw.list_strategies(), "flow_test_custom"] for n in ["tiny", "tiny_spo"]
    if not (s == "gtpo" and n == "tiny_spo")])  # gtpo needs group mode (a config error)
def test_dumped_token_advantages_are_the_strategy_of_the_dumped_inputs(tmp_path, monkeypatch,
                                                                       strategy, name):
    """After a step, the dumped token advantages equal ``get_strategy(name, **params)`` applied
    to the dumped advantages, entropies and mask with the reward's success flags.

    Catches: a recipe that ignores ``strategy.<name>`` parameters, calls another strategy,
    passes no ``positive`` flags (A > 0 would be used: the test asserts some successful
    rollout has A <= 0, or a failed one A > 0, so the two differ), or dumps other values."""
    (tmp_path / "flow_custom_strategy.py").write_text(CUSTOM)
    monkeypatch.syspath_prepend(str(tmp_path))
    params = {"proximal_softmax": {"window": 5, "temperature": 0.5},
              "window_average": {"window": 3},
              "global_topk": {"fraction": 0.3, "score": "proximal", "window": 5},
              "entropy_bonus": {"alpha": 0.7, "kappa": 3.0},
              "gtpo": {"alpha1": 0.8, "alpha2": 0.5},
              "flow_test_custom": {"boost": 2.5}}
    section = {"name": strategy, **({strategy: params[strategy]} if strategy in params else {})}
    cfg = tiny_cfg(tmp_path, name, num_steps=2, imports=["flow_custom_strategy"], strategy=section)
    recipe = run(cfg)
    sname = cfg.strategy.name  # read from the config itself, not through the recipe's reader
    sparams = OmegaConf.to_container(cfg.strategy.get(sname) or OmegaConf.create({}))
    assert sname == strategy and recipe.strategy.params == {
        **pw.get_strategy(strategy).params, **sparams}
    expected_fn = pw.get_strategy(strategy, **sparams)
    for step in (1, 2):
        rows = read_dump(tmp_path / "run" / "rollouts" / f"step_{step:06d}.jsonl")
        adv, ent, mask, success, got = dump_batch(rows)
        # the dump keeps the batch's order: consecutive prompt groups
        groups = torch.arange(len(rows)) // recipe.estimator.rollouts_per_prompt
        per_prompt = recipe.estimator.rollouts_per_prompt
        assert all(r["prompt_id"] == rows[int(g) * per_prompt]["prompt_id"]
                   for r, g in zip(rows, groups))
        expected = expected_fn(adv, ent, mask, positive=success, groups=groups)
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)
    # the success flags are not the advantage's sign here, so passing none would show
    assert bool((success != (adv > 0)).any())


def test_first_loss_is_minus_mean_token_advantage_when_the_ratio_is_one(tmp_path):
    """With one mini-batch and one epoch the policy that is trained is the rollout policy, so
    every ratio is exactly 1: the loss is ``-Σ Â / N`` and nothing is clipped.

    Catches: old log-probs from another function than the training forward (dropout on, a
    different temperature, another micro-batch split), a loss normalised by something other
    than the batch's valid tokens, or token advantages other than those dumped."""
    cfg = tiny_cfg(tmp_path, num_steps=1, ppo_mini_batches=1, ppo_epochs=1, micro_batch_size=2,
                   generation={"temperature": 0.7, "max_new_tokens": 12})
    recipe = run(cfg)
    adv, ent, mask, success, token_adv = dump_batch(
        read_dump(tmp_path / "run" / "rollouts" / "step_000001.jsonl"))
    m = recipe.history[-1]
    expected = -float(token_adv.double().sum()) / int(mask.sum())
    assert m["loss"] == pytest.approx(expected, rel=1e-5, abs=1e-8)
    assert m["clip_fraction"] == 0.0 and m["approx_kl"] == 0.0
    assert abs(expected) > 1e-4  # a loss of 0 would not tell anything


def test_grad_norm_is_logged_as_mean_and_max_over_optimizer_steps(tmp_path, monkeypatch):
    """Catches a logged grad_norm that is only the last mini-batch's."""
    seen = []
    real = torch.nn.utils.clip_grad_norm_

    def spy(*a, **k):
        out = real(*a, **k)
        seen.append(float(out))
        return out

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", spy)
    recipe = run(tiny_cfg(tmp_path, num_steps=1, ppo_mini_batches=4, micro_batch_size=2))
    m = recipe.history[-1]
    assert len(seen) == 4 and len(set(seen)) == 4
    assert m["grad_norm"] == pytest.approx(sum(seen) / 4, rel=1e-6)
    assert m["grad_norm_max"] == pytest.approx(max(seen), rel=1e-6)


def test_log_prob_forwards_run_without_dropout(tmp_path, monkeypatch):
    """Catches a recipe that leaves the model in train mode (dropout on) for the log-prob
    forwards: every forward of the model must see ``training == False``."""
    cfg = tiny_cfg(tmp_path, num_steps=1)
    recipe = pepo_recipe.PEPORecipe(cfg)
    recipe.setup(cfg)
    modes = []
    recipe.model.register_forward_pre_hook(lambda mod, args: modes.append(mod.training))
    recipe.train()
    assert modes and not any(modes)


# ------------------------------------------------------------------------- single-stream


class AnswerParityReward:
    """1 for prompts whose answer is even, 0 otherwise: every prompt's prior is known."""

    def __call__(self, responses, answers):
        return [1.0 if int(a) % 2 == 0 else 0.0 for a in answers]


class HalfDigitReward:
    """A varying reward in [0, 1]: the share of digits, rounded to halves."""

    def __call__(self, responses, answers):
        return [round(2 * sum(c.isdigit() for c in r) / max(1, len(r))) / 2 for r in responses]


def test_single_stream_prior_is_each_prompts_own_mean_reward(tmp_path, monkeypatch):
    """Catches a prior sliced from the wrong rollouts (another prompt's, or interleaved)."""
    monkeypatch.setattr("tests.recipe_helpers.DigitReward", AnswerParityReward)
    cfg = tiny_cfg(tmp_path, "tiny_spo", estimator={"prior_samples": 3})
    recipe = pepo_recipe.PEPORecipe(cfg)
    recipe.setup(cfg)
    est = recipe.estimator
    parity = [int(p.answer) % 2 == 0 for p in recipe.train_data]
    assert 0 < sum(parity) < len(parity)
    reference = SingleStreamEstimator(prior_samples=3)
    reference.set_prior({p.id: 1.0 if even else 0.0 for p, even in zip(recipe.train_data, parity)})
    ids = [p.id for p in recipe.train_data]
    torch.testing.assert_close(est.values(ids), reference.values(ids), rtol=0, atol=0)
    recipe.cleanup()


def test_single_stream_tracker_follows_spo_with_drift_since_last_visit(tmp_path, monkeypatch):
    """Replays the tracker from the dumps with a loop reference: per step, each prompt's
    ``rho = clip(2^(-D / d_half))`` with ``D`` the sum of the recorded policy drifts since the
    prompt's last visit, then ``alpha <- rho alpha + r``, ``beta <- rho beta + 1 - r``.

    Catches: a recipe that never updates the tracker, a constant rho, or D measured on the
    step's own update only (the test asserts that some prompt is revisited after a gap of
    more than one step, so the two definitions differ)."""
    monkeypatch.setattr("tests.recipe_helpers.DigitReward", HalfDigitReward)
    est_cfg = {"prior_samples": 2, "candidate_pool": 2, "rho_min": 0.01, "rho_max": 1.0,
               "d_half": 0.05}
    cfg = tiny_cfg(tmp_path, "tiny_spo", num_steps=4, prompts_per_step=4, estimator=est_cfg,
                   micro_batch_size=2, dataset={"size": 8})
    recipe = pepo_recipe.PEPORecipe(cfg)
    recipe.setup(cfg)
    start = recipe.estimator.state_dict()
    recipe.train()
    alpha, beta = dict(start["alpha"]), dict(start["beta"])
    last_seen: dict[str, int] = {}
    drifts = [h["policy_drift"] for h in recipe.history if "policy_drift" in h]
    assert len(drifts) == 4 and all(d > 0 for d in drifts)
    gaps = []
    for step in range(1, 5):
        rows = read_dump(tmp_path / "run" / "rollouts" / f"step_{step:06d}.jsonl")
        for r in rows:
            pid, rew = r["prompt_id"], r["reward"]
            since = last_seen.get(pid, 0)  # the prior was taken before step 1
            d = sum(drifts[since : step - 1])  # drifts of the updates between the two samples
            gaps.append(step - 1 - since)
            rho = min(max(2 ** (-d / 0.05), 0.01), 1.0)
            a, b = alpha.get(pid, 0.5), beta.get(pid, 0.5)
            alpha[pid], beta[pid] = rho * a + rew, rho * b + 1 - rew
            last_seen[pid] = step - 1
    assert max(gaps) >= 2  # some D spans several updates
    final = recipe.estimator.state_dict()
    assert final["alpha"].keys() == alpha.keys()
    for pid in alpha:
        assert final["alpha"][pid] == pytest.approx(alpha[pid], rel=1e-9), pid
        assert final["beta"][pid] == pytest.approx(beta[pid], rel=1e-9), pid
    assert final["drift_total"] == pytest.approx(sum(drifts), rel=1e-9)


def test_single_stream_draws_prompts_by_the_sampling_weights(tmp_path):
    """Catches a recipe whose prompt choice ignores the tracker's sampling weights: with
    overwhelming weight on 8 prompts of a pool that holds all 16, those 8 are drawn."""
    cfg = tiny_cfg(tmp_path, "tiny_spo", estimator={"prior_samples": 0, "candidate_pool": 2})
    recipe = pepo_recipe.PEPORecipe(cfg)
    recipe.setup(cfg)
    ids = [p.id for p in recipe.train_data]
    assert len(ids) == 16 and recipe.prompts_per_step == 8
    favoured = set(ids[1::2])
    recipe.estimator.sampling_weights = lambda pids: torch.tensor(
        [1e6 if pid in favoured else 1e-6 for pid in pids])
    for _ in range(3):
        picked = recipe._next_problems()
        assert {p.id for p in picked} == favoured and len(picked) == 8
    recipe.cleanup()


def test_group_mode_keeps_whole_groups_in_order(tmp_path):
    """Each prompt's G rollouts are contiguous (group advantages depend on it)."""
    cfg = tiny_cfg(tmp_path, num_steps=1, prompts_per_step=3, micro_batch_size=2)
    recipe = pepo_recipe.PEPORecipe(cfg)
    recipe.setup(cfg)
    ids = [p.id for p in recipe._next_problems()]
    assert len(ids) == 12 and all(len(set(ids[i : i + 4])) == 1 for i in range(0, 12, 4))
    assert len(set(ids)) == 3
    recipe.cleanup()


def test_resume_refuses_changed_estimator_hyper_parameters(tmp_path):
    """Catches a resume that silently replaces the configured tracker settings with the
    checkpoint's."""
    run(tiny_cfg(tmp_path, "tiny_spo", num_steps=1))
    cfg = tiny_cfg(tmp_path, "tiny_spo", num_steps=2, resume_from_checkpoint=True,
                   estimator={"rho_min": 0.9})
    recipe = pepo_recipe.PEPORecipe(cfg)
    with pytest.raises(ValueError, match=r"would change the experiment: "
                                         r"estimator.rho_min \(0.875 -> 0.9\)"):
        recipe.setup(cfg)
    recipe.cleanup()


@pytest.mark.parametrize("override, message", [
    ({"strategy": {"proximal_sofmax": {"window": 5}}},
     "unknown config key 'strategy.proximal_sofmax'; did you mean 'strategy.proximal_softmax'"),
    ({"strategy": {"proximal_softmax": {"windw": 5}}},
     "unknown config key 'strategy.proximal_softmax.windw'; did you mean "
     "'strategy.proximal_softmax.window'"),
    ({"strategy": {"global_topk": {"fraction": 2.0}}},
     r"strategy.global_topk: fraction must be in \(0, 1\]"),
    ({"generation": {"temprature": 0.6}},
     "unknown config key 'generation.temprature'; did you mean 'generation.temperature'"),
    ({"loss": {"eps_hgh": 0.4}}, "unknown config key 'loss.eps_hgh'; did you mean 'loss.eps_high'"),
    ({"validation": {"evry": 1}},
     "unknown config key 'validation.evry'; did you mean 'validation.every'"),
    ({"num_stepz": 200}, "unknown config key 'num_stepz'; did you mean 'num_steps'"),
    ({"estimator": {"rho_mn": 0.5}},
     r"unknown estimator key\(s\) \['rho_mn'\] for estimator.name='group'; valid keys"),
    ({"loss": {"eps_low": 1.0}}, "loss.eps_low must be < 1"),
    ({"strategy": {"entropy_bonus": {"kappa": 1.0}}}, "strategy.entropy_bonus: kappa must be > 1"),
    ({"strategy": {"gtpo": {"normalize": "batch"}}},
     r"strategy.gtpo: normalize must be one of \['group', 'side'\], got 'batch'"),
])
def test_misspelled_and_bad_keys_are_one_line_errors(tmp_path, override, message):
    with pytest.raises(ValueError, match=message) as e:
        pepo_recipe.PEPORecipe(tiny_cfg(tmp_path, **override))
    assert "\n" not in str(e.value)


def test_gtpo_needs_group_mode(tmp_path, monkeypatch):
    """Catches gtpo taken with single-stream rollouts (one per prompt: no group to compare),
    and refused with a registered group estimator (the docs' dr_grpo, a GroupEstimator of
    another name was refused: the rule read the name, not the rollouts per prompt)."""
    with pytest.raises(ValueError, match=r"strategy.name='gtpo' compares the rollouts of each "
                                         r"prompt's group, so it needs estimator.name=group \(or "
                                         r"an estimator of several rollouts per prompt\), got "
                                         r"estimator.name='single_stream'$"):
        pepo_recipe.PEPORecipe(tiny_cfg(tmp_path, "tiny_spo", strategy={"name": "gtpo"}))
    from pepo import estimators

    monkeypatch.setitem(estimators.ESTIMATORS, "test_own_group", estimators.GroupEstimator)
    cfg = tiny_cfg(tmp_path, strategy={"name": "gtpo"})
    cfg.estimator.name = "test_own_group"
    pepo_recipe.PEPORecipe(cfg)  # accepted


def test_one_normalised_single_stream_rollout_a_step_is_refused(tmp_path):
    """Its centred advantage is always 0: catches a run that trains on nothing, silently."""
    with pytest.raises(ValueError, match=r"prompts_per_step=1 with estimator.name="
                                         r"'single_stream' gives one rollout a step"):
        pepo_recipe.PEPORecipe(tiny_cfg(tmp_path, "tiny_spo", prompts_per_step=1,
                                        ppo_mini_batches=1, micro_batch_size=1))
    pepo_recipe.PEPORecipe(tiny_cfg(tmp_path, "tiny_spo", prompts_per_step=1,
                                    ppo_mini_batches=1, micro_batch_size=1,
                                    estimator={"normalize": False}))


def test_interpolation_variables_are_not_typos(tmp_path):
    """A top-level key the config reads as ``${key}`` (the paper configs' ``train_data``) is a
    variable; the same key unused is a typo."""
    cfg = tiny_cfg(tmp_path, data_size=32, dataset={"size": "${data_size}"})
    pepo_recipe.PEPORecipe(cfg)
    with pytest.raises(ValueError, match="unknown config key 'data_size'"):
        pepo_recipe.PEPORecipe(tiny_cfg(tmp_path, data_size=32))


@pytest.mark.parametrize("strategy", ["proximal_softmax", "entropy_bonus"])
def test_the_old_policy_pass_is_skipped_when_the_update_starts_from_it(tmp_path, monkeypatch,
                                                                       strategy):
    """One epoch, one mini-batch, a row-local strategy: the update's own forward gives the old
    log-probs, the entropies and (row by row) the token advantages, and the old-policy pass
    does not run. Same numbers as with the pass (recompute_old_logprobs=true): every logged
    metric but the clocks', the dumped token advantages and entropies. Catches a skip that
    changes the run (weights from the micro-batch's rows leaking into others', old log-probs
    taken after a step), a pass that still runs, or a skip where the old policy is not the
    one trained (two mini-batches: the second starts from an updated policy)."""
    calls = []
    real = pepo_recipe.PEPORecipe._all_logprobs
    monkeypatch.setattr(pepo_recipe.PEPORecipe, "_all_logprobs",
                        lambda self, ro: calls.append(len(ro.tokens)) or real(self, ro))
    kw = dict(num_steps=2, ppo_mini_batches=1, ppo_epochs=1, micro_batch_size=2,
              strategy={"name": strategy}, loss={"tis_cap": 2.0})
    fused = run(tiny_cfg(tmp_path / "a", **kw))
    assert fused.old_from_update and calls == []
    again = run(tiny_cfg(tmp_path / "b", recompute_old_logprobs=True, **kw))
    assert not again.old_from_update and len(calls) == 2
    def numbers(h):  # every metric but the clocks'
        return {k: v for k, v in h.items() if not k.endswith(("_time", "_per_s"))}

    assert [numbers(h) for h in fused.history] == [numbers(h) for h in again.history]
    for step in (1, 2):
        name = f"rollouts/step_{step:06d}.jsonl"
        a, b = (read_dump(tmp_path / r / "run" / name) for r in "ab")
        assert [(r["token_advantages"], r["entropies"]) for r in a] == \
            [(r["token_advantages"], r["entropies"]) for r in b]
    two = run(tiny_cfg(tmp_path / "c", **{**kw, "ppo_mini_batches": 2, "prompts_per_step": 2}))
    assert not two.old_from_update
    topk = run(tiny_cfg(tmp_path / "d", **{**kw, "strategy": {"name": "global_topk"}}))
    assert not topk.old_from_update  # a batch-wide threshold needs every row first


def test_the_run_warns_of_tis_under_a_sampling_filter(tmp_path, caplog):
    """Catches :func:`setting_warnings` never called by the recipe (its cases are tested in
    test_config_schema)."""
    import logging

    cfg = tiny_cfg(tmp_path, num_steps=1, generation={"top_p": 0.9}, loss={"tis_cap": 2.0})
    with caplog.at_level(logging.WARNING):
        run(cfg)
    said = [r.getMessage() for r in caplog.records
            if r.getMessage().startswith("loss.tis_cap=2 with generation.top_p=0.9: ")]
    assert len(said) == 1, [r.getMessage() for r in caplog.records]


def test_validation_without_a_val_dataset_is_off_not_nan(tmp_path):
    """Catches the paper configs' validation.every with val_dataset=null printing and saving a
    NaN accuracy at every validation (summary.json then is not strict JSON)."""
    recipe = run(tiny_cfg(tmp_path, num_steps=2, val_dataset=None, validation={"every": 1}))
    assert recipe.step == 2 and not any("val_accuracy" in h for h in recipe.history)

    def refuse(constant):
        raise ValueError(f"{constant} in summary.json")

    summary = json.loads((tmp_path / "run" / "summary.json").read_text(encoding="utf-8"),
                         parse_constant=refuse)
    assert summary


@pytest.mark.parametrize("setting, units, want", [
    ("bf16", (), torch.bfloat16), ("auto", ("avx512_bf16",), torch.bfloat16),
    ("auto", (), None), ("fp32", ("amx_bf16",), None)])
def test_compute_dtype_reaches_the_engine_and_the_trainer(tmp_path, monkeypatch, setting,
                                                          units, want):
    """``compute_dtype`` on the tiny model, on any CPU (the CPU's units are stubbed): the run
    resolves it (``auto`` by the units, ``bf16``/``fp32`` forced), the in-process engine
    samples at it and the trainer's forward runs at it, the one update reading old log-probs
    from that forward; the loss and the rollout/trainer gap come out finite, the gap within
    the bf16 body's error (exactly the fp32 decoder's otherwise, 1e-5). Catches a setting
    that stops at the trainer (the engine left fp32 and the gap then as large as bf16
    against fp32 can make it) or one that is ignored."""
    from pepo.training import precision

    monkeypatch.setattr(precision, "cpu_bf16_units", lambda: units)
    forwards = []
    real = pepo_recipe.policy_logprobs

    def spy(*args, **kwargs):  # the trainer's forward: autocast's dtype inside it
        on = torch.is_autocast_enabled("cpu")
        forwards.append(torch.get_autocast_dtype("cpu") if on else None)
        return real(*args, **kwargs)

    monkeypatch.setattr(pepo_recipe, "policy_logprobs", spy)
    r = run(tiny_cfg(tmp_path, num_steps=1, compute_dtype=setting, micro_batch_size=4))
    assert r.compute_dtype is want and r.engine.compute_dtype is want
    assert forwards and all(f is want for f in forwards)  # autocast active inside the forward
    m = r.history[-1]
    assert torch.isfinite(torch.tensor(m["loss"]))
    assert m["rollout_logprob_gap_max"] < (0.1 if want else 1e-5), m["rollout_logprob_gap_max"]


def test_the_drift_forward_is_timed_and_a_nan_row_leaves_the_others_drift(tmp_path):
    """SPO's drift forward after the update is part of ``logprob_time`` (it was in none of
    ``step_time``'s parts: 12-16 % of a tiny_spo step unaccounted), and a row whose old-policy
    pass was NaN (its mini-batch skipped, the other one stepped) leaves the other rows' drift
    measured, where the whole mean was NaN and logged as 0 (no forgetting). Catches the drift
    timed outside the parts, or in ``update_time``, and an unmasked NaN."""
    import time

    cfg = tiny_cfg(tmp_path, "tiny_spo", num_steps=1, ppo_mini_batches=2, micro_batch_size=4,
                   save_every=0, dump_rollouts_every=0)
    recipe = pepo_recipe.PEPORecipe(cfg)
    recipe.setup(cfg)
    real, calls = recipe._all_logprobs, []

    def all_logprobs(ro):
        lp, ent = real(ro)
        calls.append(ro)
        if len(calls) == 1:  # the old-policy pass: row 0 NaN
            lp, ent = lp.clone(), ent.clone()
            lp[0], ent[0] = float("nan"), float("nan")
        else:  # the drift forward: slow enough to tell where it is counted
            time.sleep(2.0)
        return lp, ent

    recipe._all_logprobs = all_logprobs
    recipe.run()
    m = recipe.history[-1]
    assert len(calls) == 2 and m["nonfinite_skipped"] == 1  # one of the two mini-batches
    assert m["policy_drift"] > 0 and math.isfinite(m["policy_drift"])
    assert m["logprob_time"] >= 2.0  # the old-policy pass alone: well under 0.5 s


def test_the_trainer_takes_log_probs_at_the_sampling_temperature(tmp_path):
    """At a sampling temperature other than 1 the trainer's log-probs (the old ones, the
    update's and the entropies PEPO weights by) are the engine's sampling distribution's: the
    logged gap between the engine's and the trainer's log-probs is float noise. Catches the
    trainer's forward at temperature 1 (every other test runs at 1 or compares the trainer with
    itself: a gap of about 0.13 here)."""
    recipe = run(tiny_cfg(tmp_path, num_steps=1, generation={"temperature": 0.5,
                                                             "max_new_tokens": 12}))
    gap = recipe.history[-1]["rollout_logprob_gap"]
    assert 0 <= gap < 1e-5, gap


def test_every_epoch_makes_its_optimizer_steps(tmp_path, monkeypatch):
    """``ppo_epochs=2`` with 2 mini-batches: 4 optimizer steps a step. Catches ``ppo_epochs``
    read and then ignored (one epoch: 2 steps a step, which no other test would see: every
    config tested runs one epoch)."""
    calls = []
    real = pepo_recipe.PEPORecipe._optimizer_step

    def spy(self, loss, grad_norm):
        calls.append(self.step)
        return real(self, loss, grad_norm)

    monkeypatch.setattr(pepo_recipe.PEPORecipe, "_optimizer_step", spy)
    run(tiny_cfg(tmp_path, num_steps=2, ppo_epochs=2, ppo_mini_batches=2, micro_batch_size=2))
    assert calls == [1] * 4 + [2] * 4  # four optimizer steps in each of the two steps


def test_every_validation_samples_with_the_evaluation_generator(tmp_path, monkeypatch):
    """Each validation (before training, every step here, at the end) samples with a fresh
    ``eval_generator(seed)``, as ``pepo_eval`` does with the same seed, so that two validations
    differ only by the policy. Catches the generator left out (the validations then draw from
    the global stream: the change from before to after training holds sampling noise, and the
    recipe's avg@k is not pepo_eval's on the same checkpoint)."""
    from pepo.training.evaluation import eval_generator

    seeds = []
    real = pepo_recipe.avg_at_k

    def spy(*args, **kwargs):
        g = kwargs.get("generator")  # its seed, and its state (a fresh one's: unused yet)
        seeds.append(None if g is None else (g.initial_seed(), g.get_state()))
        return real(*args, **kwargs)

    monkeypatch.setattr(pepo_recipe, "avg_at_k", spy)
    cfg = tiny_cfg(tmp_path, num_steps=2, seed=3, validation={"every": 1})
    run(cfg)
    want = eval_generator(3)
    assert len(seeds) == 3 and all(s is not None for s in seeds)
    assert all(s[0] == want.initial_seed() and torch.equal(s[1], want.get_state())
               for s in seeds)
