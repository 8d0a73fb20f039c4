"""pepo inside verl's v1 trainer, checked against verl's own code: its advantage estimators
(which give one advantage per response, which do not, and what the adapter does with each), its
registered policy loss, its trainer step (GTPO's groups from verl's uid included) and its plugin
discovery.

These tests need verl 0.9.1 (`pip install verl==0.9.1 TransferQueue cachetools uvicorn fastapi`
beside the core install, docs/integrations.md). Without it they are not collected, unless
PEPO_REQUIRE_VERL=1 (as `.ci/run` sets), when they fail instead.
"""

from __future__ import annotations

import importlib.util
import os
import random
import subprocess
import sys

import pytest
import torch

if importlib.util.find_spec("verl") is None:
    if os.environ.get("PEPO_REQUIRE_VERL") == "1":
        raise RuntimeError("PEPO_REQUIRE_VERL=1 but verl is not installed")
    pytest.skip("verl is not installed", allow_module_level=True)

import numpy as np  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from tensordict import NonTensorStack  # noqa: E402
from verl import DataProto  # noqa: E402
from verl.trainer.ppo import core_algos  # noqa: E402
from verl.trainer.ppo.v1.utils import compute_advantage_for_multi_trajectories  # noqa: E402

import pepo.estimators as est  # noqa: E402
import pepo.integrations.verl as pv  # noqa: E402
import pepo.weighting as pw  # noqa: E402
from pepo.loss import clipped_policy_loss  # noqa: E402

G = 4


def batch(seed=0, b=12, t=20):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    mask = torch.arange(t)[None, :] < lengths[:, None]
    rewards = (torch.rand(b, generator=g) > 0.5).float()
    rewards[:G] = 1.0  # one degenerate group (all succeed: advantage 0)
    scores = torch.zeros(b, t)
    scores[torch.arange(b), lengths - 1] = rewards  # verl puts the outcome on the last token
    entropy = torch.rand(b, t, generator=g) * 2
    return rewards, scores, mask, entropy


@pytest.mark.parametrize("name,params", [
    ("proximal_softmax", {"window": 5}), ("global_topk", {"fraction": 0.2}),
    ("entropy_bonus", {}), ("uniform", {}),
])
def test_verl_grpo_then_pepo_equals_pepo_group_advantages_then_weights(name, params):
    rewards, scores, mask, entropy = batch()
    index = [str(i // G) for i in range(len(rewards))]
    verl_adv, _ = core_algos.compute_grpo_outcome_advantage(
        token_level_rewards=scores, response_mask=mask.float(), index=index,
        norm_adv_by_std_in_grpo=True)
    strategy = pw.get_strategy(name, **params)
    got = pv.token_advantages(strategy, verl_adv, entropy, mask.float(), scores)
    ours = est.group_advantages(rewards, group_size=G)
    want = strategy(ours, entropy, mask, positive=rewards > 0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert (want != 0).any()


def test_verl_vanilla_loss_on_weighted_advantages_equals_clipped_policy_loss():
    rewards, scores, mask, entropy = batch(seed=1)
    adv = pw.get_strategy("proximal_softmax", window=5)(
        est.group_advantages(rewards, group_size=G), entropy, mask, positive=rewards > 0)
    g = torch.Generator().manual_seed(2)
    old = -torch.rand(mask.shape, generator=g) * 3
    lp_verl = (old + torch.randn(mask.shape, generator=g) * 0.3).requires_grad_(True)
    lp_ours = lp_verl.detach().clone().requires_grad_(True)
    n = int(mask.sum())
    cfg = OmegaConf.create({  # verl's dual clip disabled: clip_ratio_c far above any ratio
        "clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 1e9,
        "global_batch_info": {"dp_size": 1, "batch_num_tokens": n}})
    loss_fn = core_algos.get_policy_loss_fn("vanilla")
    verl_loss, _ = loss_fn(old_log_prob=old, log_prob=lp_verl, advantages=adv,
                           response_mask=mask.float(), loss_agg_mode="token-mean", config=cfg)
    our_loss = clipped_policy_loss(lp_ours, old, adv, mask, eps_low=0.2, eps_high=0.28)
    verl_loss.backward()
    our_loss.backward()
    torch.testing.assert_close(verl_loss, our_loss, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(lp_verl.grad, lp_ours.grad, rtol=1e-6, atol=1e-8)
    assert lp_ours.grad.abs().sum() > 0


class Store:
    """An in-memory stand-in for verl's TransferQueue: nested response tensors by key."""

    def __init__(self, fields):
        self.fields = dict(fields)
        self.puts = []

    def kv_batch_get(self, keys, partition_id, select_fields):
        from tensordict import TensorDict

        return TensorDict({f: self.fields[f] for f in select_fields}, batch_size=len(keys))

    def kv_batch_put(self, keys, partition_id, fields):
        self.puts.append(fields)
        for k, v in fields.items():
            self.fields[k] = v
        return Meta(keys, partition_id)


class Meta:
    def __init__(self, keys, partition_id="train"):
        self.keys, self.partition_id = keys, partition_id

    def __len__(self):
        return len(self.keys)


def nested(padded, mask):
    return torch.nested.as_nested_tensor([padded[i, :int(m.sum())] for i, m in enumerate(mask)],
                                         layout=torch.jagged)


@pytest.mark.parametrize("threshold", [0.0, 0.5])
def test_trainer_step_writes_back_exactly_the_weighted_advantages(monkeypatch, threshold):
    """Partial-credit scores in [0, 1): a row succeeds when its score exceeds
    +pepo.success_threshold. Catches the threshold ignored (every row above 0 would be
    weighted), and a logged pepo/ metric over the wrong tokens."""
    rewards, scores, mask, entropy = batch(seed=3)
    rewards = torch.rand(len(rewards), generator=torch.Generator().manual_seed(4))
    scores = torch.zeros_like(scores)
    scores[torch.arange(len(rewards)), mask.sum(1) - 1] = rewards
    index = [str(i // G) for i in range(len(rewards))]
    verl_adv, _ = core_algos.compute_grpo_outcome_advantage(
        token_level_rewards=scores, response_mask=mask.float(), index=index)
    store = Store({"advantages": nested(verl_adv, mask), "entropy": nested(entropy, mask),
                   "response_mask": nested(mask.float(), mask), "rm_scores": nested(scores, mask),
                   "uid": NonTensorStack(*index)})
    monkeypatch.setattr(pv, "tq", store)
    # verl's own advantage step ran already: the stand-in holds its output
    monkeypatch.setattr(pv.PPOTrainerSync, "_compute_advantage", lambda self, b, m: b)
    trainer = object.__new__(pv.PepoPPOTrainer)
    trainer.pepo_strategy, trainer.pepo_success_threshold = pv.strategy_from_config(
        OmegaConf.create({"strategy": "proximal_softmax", "params": {"window": 5},
                          "success_threshold": threshold}))
    trainer.pepo_adv_estimator = "grpo"
    metrics: dict = {}
    meta = Meta([f"k{i}" for i in range(len(rewards))])
    trainer._compute_advantage(meta, metrics)
    assert len(store.puts) == 1 and set(store.puts[0].keys()) == {"advantages"}
    written = store.puts[0]["advantages"].to_padded_tensor(0.0)
    positive = rewards > threshold
    assert 0 < int(positive.sum()) < len(rewards) or threshold == 0.0
    want = pw.get_strategy("proximal_softmax", window=5)(
        est.group_advantages(rewards, group_size=G), entropy, mask, positive=positive)
    torch.testing.assert_close(written, want[:, :written.size(1)], rtol=1e-5, atol=1e-6)
    assert written.size(1) == int(mask.sum(1).max())
    assert metrics["pepo/token_advantage_abs_mean"] == pytest.approx(
        float(want.abs()[mask].mean()), rel=1e-5)


def test_config_errors_name_the_fix():
    with pytest.raises(ValueError, match=r"\+pepo.strategy"):
        pv.strategy_from_config(None)
    with pytest.raises(ValueError, match="no_such"):
        pv.strategy_from_config(OmegaConf.create({"strategy": "no_such"}))
    strategy, _ = pv.strategy_from_config(OmegaConf.create({"strategy": "gtpo"}))
    assert strategy.name == "gtpo"  # accepted: the trainer passes the groups (uid)
    # a parameter outside params (dropped before: trained with the default window of 101), a
    # misspelt threshold (dropped: 0), a threshold that is not a number (float's own message)
    with pytest.raises(ValueError, match=r"pepo.window is not a key.*\+pepo.params.window="):
        pv.strategy_from_config(OmegaConf.create({"strategy": "proximal_softmax", "window": 5}))
    with pytest.raises(ValueError, match="pepo.sucess_threshold is not a key"):
        pv.strategy_from_config(OmegaConf.create({"strategy": "gtpo", "sucess_threshold": 0.5}))
    for bad in ("high", "nan", float("inf"), True):  # NaN: no rollout succeeds, silently
        with pytest.raises(ValueError, match=f"pepo.success_threshold must be a finite number.*"
                                             f"got {bad!r}"):
            pv.strategy_from_config(OmegaConf.create({"strategy": "gtpo",
                                                      "success_threshold": bad}))
    with pytest.raises(ValueError, match=r"pepo.params must be a mapping .*got 5"):
        pv.strategy_from_config(OmegaConf.create({"strategy": "gtpo", "params": 5}))
    # a config can only give a process group as a string, which failed in torch.distributed
    with pytest.raises(ValueError, match="pepo.params must not set process_group"):
        pv.strategy_from_config(OmegaConf.create({"strategy": "global_topk",
                                                  "params": {"process_group": "world"}}))
    strategy, threshold = pv.strategy_from_config(OmegaConf.create(
        {"strategy": "proximal_softmax", "params": {"window": 5}, "success_threshold": "0.5"}))
    assert (strategy.params["window"], threshold) == (5, 0.5)


def test_the_trainer_checks_its_pepo_section_before_verl_builds_anything(monkeypatch):
    built = []
    monkeypatch.setattr(pv.PPOTrainerSync, "__init__", lambda self, config: built.append(config))
    grpo = {"adv_estimator": "grpo", "gamma": 1.0, "use_kl_in_reward": False}
    with pytest.raises(ValueError, match="no_such"):
        pv.PepoPPOTrainer(OmegaConf.create({"pepo": {"strategy": "no_such"}, "algorithm": grpo}))
    # verl's default estimator is gae (a critic's per-token advantages): refused before building
    # (catches an adapter that checks the estimator only once a step's advantages exist)
    for algorithm in ({"adv_estimator": "gae"}, {}, {**grpo, "adv_estimator": "remax",
                                                     "use_kl_in_reward": True}):
        with pytest.raises(ValueError, match=r"algorithm.adv_estimator=(gae|remax) "):
            pv.PepoPPOTrainer(OmegaConf.create({"pepo": {"strategy": "uniform"},
                                                "algorithm": algorithm}))
    # without _compute_old_log_prob's pass there are no rollout entropies: refused here, not at
    # the first step's advantages
    with pytest.raises(ValueError, match="bypass_mode=True skips that pass: set it to False"):
        pv.PepoPPOTrainer(OmegaConf.create({"pepo": {"strategy": "uniform"}, "algorithm": {
            **grpo, "rollout_correction": {"bypass_mode": True}}}))
    assert built == []
    good = OmegaConf.create({"pepo": {"strategy": "global_topk", "params": {"fraction": 0.3}},
                             "algorithm": {**grpo, "rollout_correction": {"bypass_mode": False}}})
    trainer = pv.PepoPPOTrainer(good)
    assert built == [good] and trainer.pepo_strategy is not None
    assert trainer.pepo_adv_estimator == "grpo"


@pytest.mark.parametrize("mode", ["geo_mean", "gspo", "vanilla"])
def test_losses_that_average_a_rows_advantages_are_refused(mode, monkeypatch):
    """verl's geo_mean (GMPO) averages each response's token advantages into one before its
    loss: its gradient on token advantages equals that on their row means (pinned below with
    verl's own loss), so PEPO trained there as GRPO in silence. gspo's ratio carries each
    token's own log-prob (its gradient tells the two apart) and stays allowed. Catches the
    check missing, made for uniform, or made for gspo or vanilla (which do weight tokens)."""
    from verl.workers.config import FSDPActorConfig

    cfg = FSDPActorConfig(strategy="fsdp", rollout_n=G, clip_ratio=0.2, clip_ratio_low=0.2,
                          clip_ratio_high=0.28, ppo_micro_batch_size_per_gpu=1,
                          global_batch_info={"dp_size": 1, "batch_num_tokens": 8,
                                             "global_batch_size": 2})
    g = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1.0] * 5, [1.0] * 3 + [0.0] * 2])
    old = -torch.rand(2, 5, generator=g)
    new = old + 0.1 * torch.randn(2, 5, generator=g)
    tokens = torch.tensor([[0.2, 1.8, 1.0, 0.5, 1.5], [-1.0, -0.5, -1.5, 0.0, 0.0]])
    means = (tokens * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True) * mask
    grads = []
    for adv in (tokens, means):
        lp = new.clone().requires_grad_(True)
        loss, _ = core_algos.get_policy_loss_fn(mode)(
            old_log_prob=old, log_prob=lp, advantages=adv, response_mask=mask,
            loss_agg_mode="token-mean", config=cfg)
        loss.backward()
        grads.append(lp.grad)
    flattens = torch.equal(grads[0], grads[1])
    assert flattens == (mode in pv.SEQUENCE_ADVANTAGE_LOSSES)
    built = []
    monkeypatch.setattr(pv.PPOTrainerSync, "__init__", lambda self, config: built.append(config))
    grpo = {"adv_estimator": "grpo", "gamma": 1.0, "use_kl_in_reward": False}

    def trainer(strategy):
        return pv.PepoPPOTrainer(OmegaConf.create({
            "pepo": {"strategy": strategy}, "algorithm": grpo,
            "actor_rollout_ref": {"actor": {"policy_loss": {"loss_mode": mode}}}}))

    trainer("uniform")
    if flattens:
        with pytest.raises(ValueError, match=rf"policy_loss.loss_mode={mode} averages each "
                                             rf"response's token advantages .*proximal_softmax"):
            trainer("proximal_softmax")
        assert len(built) == 1  # refused before verl built anything
    else:
        trainer("proximal_softmax")
        assert len(built) == 2


def test_distillation_without_the_task_rewards_is_refused(monkeypatch):
    """verl's distillation with use_task_rewards=False sets the policy loss to 0 (pinned below
    in verl's own code): no advantage reaches the gradient, so a weighting strategy would run,
    log its metric and change nothing. Catches the check missing, made for uniform (plain verl
    then), or made with the task's rewards on."""
    import inspect

    from verl.trainer.distillation import losses

    assert "policy_loss = 0.0" in inspect.getsource(losses.distillation_ppo_loss)
    built = []
    monkeypatch.setattr(pv.PPOTrainerSync, "__init__", lambda self, config: built.append(config))

    def trainer(strategy, use_task_rewards):
        return pv.PepoPPOTrainer(OmegaConf.create({
            "pepo": {"strategy": strategy},
            "algorithm": {"adv_estimator": "grpo", "gamma": 1.0, "use_kl_in_reward": False},
            "distillation": {"enabled": True,
                             "distillation_loss": {"use_task_rewards": use_task_rewards}}}))

    with pytest.raises(ValueError, match=r"use_task_rewards=False trains on the teacher's "
                                         r"distillation loss alone .*pepo.strategy=gtpo"):
        trainer("gtpo", False)
    assert built == []
    trainer("gtpo", True)
    trainer("uniform", False)
    assert len(built) == 2


def test_the_trainer_runs_as_verls_sync_trainer():
    """Built from verl's own composed config with trainer_mode=pepo (how verl selects it), it
    runs as the sync trainer: catches verl's v1 base reading the mode 'pepo' as an asynchronous
    one (its async replay buffer, which keeps DAPO's surplus groups for later steps, and its
    one-prompt refills)."""
    import verl
    from hydra import compose, initialize_config_dir
    from verl.trainer.ppo.v1 import get_trainer_cls
    from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer

    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=[
            "algorithm.adv_estimator=grpo", "trainer.v1.trainer_mode=pepo",
            "+pepo.strategy=proximal_softmax"])
    cls = get_trainer_cls(cfg.trainer.v1.trainer_mode)
    assert cls is pv.PepoPPOTrainer
    trainer = cls(config=cfg)
    assert trainer.trainer_mode == "sync" and trainer.config.trainer.v1.trainer_mode == "sync"
    assert type(trainer.replay_buffer) is ReplayBuffer
    assert get_trainer_cls(cfg.trainer.v1.trainer_mode) is pv.PepoPPOTrainer  # caller's intact


def test_import_verl_registers_the_trainer_through_the_entry_point():
    code = ("import sys, verl; from verl.trainer.ppo.v1 import get_trainer_cls; "
            "c = get_trainer_cls('pepo'); print(c.__module__, c.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-2:] == ["pepo.integrations.verl", "PepoPPOTrainer"]
    # and not registered without the entry point (the registration is not the test's own import)
    off = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "VERL_USE_EXTERNAL_PLUGINS": "none"})
    assert off.returncode != 0 and "Unknown trainer 'pepo'" in off.stderr


# --- verl's advantage estimators: which give one advantage per response -----------------------

def algorithm(name, gamma=1.0, kl=False):
    return OmegaConf.create({"adv_estimator": name, "gamma": gamma, "lam": 0.95,
                             "use_kl_in_reward": kl, "norm_adv_by_std_in_grpo": True,
                             "use_pf_ppo": False})


def verl_advantages(name, rewards, scores, mask, uids, gamma=1.0, kl=False, seed=0):
    """verl's own advantage step on a padded batch: the v1 trainer's
    `compute_advantage_for_multi_trajectories`, which dispatches to the estimator registered
    under `name` exactly as `_compute_advantage` does (gdpo: its registered function, which
    without per-component rewards falls back to the summed token rewards). `kl` subtracts a
    per-token penalty from the rewards, as `use_kl_in_reward` does."""
    b, t = mask.shape
    g = torch.Generator().manual_seed(seed + 100)
    fm = mask.float()
    token_rewards = scores - (0.05 * torch.rand(b, t, generator=g) * fm if kl else 0.0)
    if name == "gdpo":
        adv, _ = core_algos.get_adv_estimator_fn("gdpo")(
            token_level_rewards=token_rewards, response_mask=fm, index=np.array(uids, object))
        return adv
    tensors = {"token_level_rewards": token_rewards, "response_mask": fm,
               "values": torch.randn(b, t, generator=g) * fm,
               "old_log_probs": -torch.rand(b, t, generator=g) * 3 * fm,
               "sum_pi_squared": torch.rand(b, t, generator=g) * fm}
    if name == "remax":  # verl passes it to any estimator when present; remax alone takes it
        tensors["reward_baselines"] = torch.rand(b, generator=g)
    data = DataProto.from_dict(tensors=tensors, non_tensors={"uid": np.array(uids, dtype=object)})
    keys = [f"{u}_{i}_0" for i, u in enumerate(uids)]  # verl's {uid}_{session}_{output} keys
    out = compute_advantage_for_multi_trajectories(
        data, batch_keys=keys, adv_estimator=name, gamma=gamma, lam=0.95, num_repeat=G,
        norm_adv_by_std_in_grpo=True, config=algorithm(name, gamma, kl))
    return out.batch["advantages"]


def blocks(b):
    return [f"p{i // G}" for i in range(b)]


def test_every_estimator_verl_registers_is_classified():
    """A verl release that registers an estimator the adapter has not sorted into 'one advantage
    per response' or 'varies along it' fails here, not silently in training."""
    known = set(pv.CONSTANT_ROW_ESTIMATORS) | set(pv.ROW_VARYING_ESTIMATORS) | {
        "reinforce_plus_plus"} | set(pv.V1_UNAVAILABLE)
    assert set(core_algos.ADV_ESTIMATOR_REGISTRY) == known
    assert not set(pv.CONSTANT_ROW_ESTIMATORS) & set(pv.ROW_VARYING_ESTIMATORS)


SUPPORTED = [(name, {"kl": True}) for name in pv.CONSTANT_ROW_ESTIMATORS] + [
    ("reinforce_plus_plus", {})]


@pytest.mark.parametrize("name,kw", SUPPORTED, ids=[n for n, _ in SUPPORTED])
def test_supported_estimators_give_one_advantage_per_response_and_pass_unchanged(name, kw):
    """verl's own estimators listed as supported (the sum-based ones even with a per-token KL
    penalty in the reward; returns-to-go with gamma=1 and an outcome reward) give each response
    one advantage: `uniform` returns verl's advantages bit for bit, and `proximal_softmax` equals
    the strategy on each row's value read at its last token. Catches a supported estimator that
    in fact varies along the row (the run-time check would refuse it) and an adapter that
    changes, shifts or rescales the advantages it reads."""
    rewards, scores, mask, entropy = batch(seed=5)
    adv = verl_advantages(name, rewards, scores, mask, blocks(len(rewards)), **kw)
    assert pv.check_adv_estimator(algorithm(name, kl=kw.get("kl", False))) == name
    assert adv[mask].abs().sum() > 0
    got = pv.token_advantages(pw.get_strategy("uniform"), adv, entropy, mask.float(), scores,
                              adv_estimator=name)
    assert torch.equal(got, torch.where(mask, adv, 0.0))
    strategy = pw.get_strategy("proximal_softmax", window=5)
    last = mask.sum(1) - 1
    want = strategy(adv[torch.arange(len(adv)), last], entropy, mask, positive=rewards > 0)
    got = pv.token_advantages(strategy, adv, entropy, mask.float(), scores)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


REFUSED = [("gae", {}), ("optimal_token_baseline", {}), ("tir_optimal_token_baseline", {}),
           ("reinforce_plus_plus", {"gamma": 0.9}), ("reinforce_plus_plus", {"kl": True})]


@pytest.mark.parametrize("name,kw", REFUSED, ids=[f"{n}-{kw}" for n, kw in REFUSED])
def test_row_varying_estimators_are_refused_not_flattened(name, kw):
    """verl's own gae, optimal token baselines and REINFORCE++ with gamma<1 (or either
    returns-to-go estimator with a KL penalty in the reward) give per-token advantages that vary
    along each response. The adapter used to read each row's first value and spread it over the
    row, so even `uniform` trained differently from verl: the old code returns the flattened
    rows without an error here. Now the construction check refuses the configuration and the
    run-time check refuses the advantages, each in one line naming the estimator."""
    rewards, scores, mask, entropy = batch(seed=6)
    adv = verl_advantages(name, rewards, scores, mask, blocks(len(rewards)), **kw)
    first = adv[torch.arange(len(adv)), mask.int().argmax(1)]
    varies = (mask & (adv != first[:, None])).any(1)
    assert varies.sum() >= len(adv) // 2  # verl's rows do vary: flattening would change them
    with pytest.raises(ValueError, match=rf"algorithm.adv_estimator={name} ") as e:
        pv.check_adv_estimator(algorithm(name, **kw))
    assert "\n" not in str(e.value) and "grpo" in str(e.value)
    with pytest.raises(ValueError, match=rf"verl's advantages \(algorithm.adv_estimator={name}\) "
                                         rf"vary along {int(varies.sum())} of {len(adv)} "):
        pv.token_advantages(pw.get_strategy("uniform"), adv, entropy, mask.float(), scores,
                            adv_estimator=name)


@pytest.mark.parametrize("name", sorted(pv.V1_UNAVAILABLE))
def test_estimators_verls_v1_trainer_cannot_run_are_refused_when_built(name):
    """remax and gdpo were listed as supported, but verl 0.9.1's v1 advantage step (the trainer
    pepo's is) fails on them at the first step: remax without the greedy rollout's
    reward_baselines, gdpo without the reward's components. Refused at construction, naming what
    is missing, not blaming the flattening of row-varying advantages (theirs are one per row); the
    second half pins verl's behaviour (a verl that runs them fails here, and the refusal is to be
    lifted)."""
    with pytest.raises(ValueError, match=rf"algorithm.adv_estimator={name} needs .*first step "
                                         rf"would fail\).*use one of: gpg, grpo") as e:
        pv.check_adv_estimator(algorithm(name))
    assert "\n" not in str(e.value) and name not in str(e.value).split("use one of")[1]
    assert "flatten" not in str(e.value)
    rewards, scores, mask, _ = batch(seed=5)
    uids = blocks(len(rewards))
    data = DataProto.from_dict(tensors={"token_level_rewards": scores,
                                        "response_mask": mask.float()},
                               non_tensors={"uid": np.array(uids, dtype=object)})
    cfg = algorithm(name)
    if name == "gdpo":  # with its keys set, the components are still not in v1's batch
        cfg = OmegaConf.merge(cfg, {"gdpo_reward_keys": ["accuracy", "format"]})
    missing = {"remax": "reward_baselines", "gdpo": "prompts"}[name]  # what v1 does not fetch
    with pytest.raises((TypeError, KeyError), match=missing):
        compute_advantage_for_multi_trajectories(
            data, batch_keys=[f"{u}_{i}_0" for i, u in enumerate(uids)], adv_estimator=name,
            gamma=1.0, lam=0.95, num_repeat=G, norm_adv_by_std_in_grpo=True, config=cfg)


@pytest.mark.parametrize("offset", [2, 0])
def test_tokens_rollout_correction_rejected_stay_in_the_windows_with_no_weight(monkeypatch,
                                                                               offset):
    """verl's rollout correction (rejection sampling, decoupled mode) zeroes rejected tokens in
    the response mask its advantage step writes back. They were generated and stay in the
    context: the strategy weighs each row over the generated tokens (its windows, T_i, the
    batch's threshold), and the rejected ones get 0, as verl's loss drops them. The adapter read
    the mask after verl's step and weighed the rows as if the rejected tokens were a gap (a
    rejected high-entropy fork's neighbours got about 4 times their weight). Catches that, and
    weight left on a rejected token; uniform still equals verl's advantages bit for bit. With
    a row's first token rejected (offset 0), catches the row's advantage read at position 0
    (where verl wrote 0: a false "advantages vary" error), and the logged
    pepo/token_advantage_abs_mean taken over the generated tokens instead of those verl
    trains (the kept ones)."""
    rewards, scores, mask, entropy = batch(seed=9)
    uids = blocks(len(rewards))
    rows = torch.arange(len(rewards))
    first = mask.int().argmax(1)
    long_rows = mask.sum(1) >= 6
    rejected = torch.zeros_like(mask)
    rejected[rows[long_rows], first[long_rows] + offset] = True  # one in each longer row
    entropy[rejected] = 2.5  # a fork: what shapes its neighbours' weights most
    kept = mask & ~rejected
    verl_adv, _ = core_algos.compute_grpo_outcome_advantage(
        token_level_rewards=scores, response_mask=kept.float(), index=uids)
    store = Store({"advantages": nested(verl_adv, mask), "entropy": nested(entropy, mask),
                   "response_mask": nested(mask.float(), mask), "rm_scores": nested(scores, mask),
                   "uid": NonTensorStack(*uids)})

    def verls_step(self, meta, metrics):  # rejection sampling writes the kept tokens' mask back
        store.fields["response_mask"] = nested(kept.float(), mask)
        return meta

    monkeypatch.setattr(pv, "tq", store)
    monkeypatch.setattr(pv.PPOTrainerSync, "_compute_advantage", verls_step)
    strategy = pw.get_strategy("proximal_softmax", window=5)
    trainer = object.__new__(pv.PepoPPOTrainer)
    trainer.pepo_strategy, trainer.pepo_success_threshold = strategy, 0.0
    trainer.pepo_adv_estimator = "grpo"
    metrics: dict = {}
    trainer._compute_advantage(Meta([f"{u}_{i}_0" for i, u in enumerate(uids)]), metrics)
    got = store.puts[-1]["advantages"].to_padded_tensor(0.0)
    narrow = kept[:, :got.size(1)]
    assert metrics["pepo/token_advantage_abs_mean"] == pytest.approx(
        float(got.abs()[narrow].mean()), rel=1e-6)
    seq = verl_adv[rows, kept.int().argmax(1)]
    want = torch.where(kept, strategy(seq, entropy, mask, positive=rewards > 0), 0.0)
    torch.testing.assert_close(got, want[:, :got.size(1)], rtol=1e-6, atol=1e-7)
    gap = torch.where(kept, strategy(seq, entropy, kept, positive=rewards > 0), 0.0)
    assert (gap - want).abs().max() > 0.05  # the old reading differs on these rows
    assert float(got.abs()[narrow].mean()) != pytest.approx(
        float(got.abs().sum() / mask.sum()), rel=1e-3)  # so the metric's tokens matter
    uniform = pv.token_advantages(pw.get_strategy("uniform"), verl_adv, entropy, kept.float(),
                                  scores, generated_mask=mask.float())
    assert torch.equal(uniform, torch.where(kept, verl_adv, 0.0))


def test_by_default_a_positive_score_is_a_success():
    """Partial-credit scores (0.3) with no ``success_threshold`` in the config: a row with a
    positive score succeeded. Catches another default threshold (0.5 would read every row as a
    failure and weight none)."""
    strategy, threshold = pv.strategy_from_config(OmegaConf.create(
        {"strategy": "proximal_softmax", "params": {"window": 5}}))
    assert threshold == 0.0
    rewards, scores, mask, entropy = batch(seed=3)
    scores = 0.3 * scores
    adv = verl_advantages("grpo", rewards, scores, mask, blocks(len(rewards)))
    seq = adv[torch.arange(len(adv)), mask.int().argmax(1)]
    torch.testing.assert_close(
        pv.token_advantages(strategy, adv, entropy, mask.float(), scores, threshold),
        strategy(seq, entropy, mask, positive=rewards > 0), rtol=1e-6, atol=1e-7)


def test_success_is_the_sum_of_a_rows_token_scores():
    """A row scored +1 on its last token and -1.5 on its first (a penalty verl's GRPO sums into
    one outcome of -0.5, so its advantages stay one value a row) failed. Catches the flags read
    from the largest token score (the +1: a success) instead of the sum the docs name."""
    rewards, scores, mask, entropy = batch(seed=11)
    rows, lengths = torch.arange(len(rewards)), mask.sum(1)
    scores = torch.zeros_like(scores)
    scores[rows, lengths - 1] = 1.0
    penalised = (rows % 2 == 0) & (lengths >= 2)
    scores[rows[penalised], 0] = -1.5
    adv = verl_advantages("grpo", rewards, scores, mask, blocks(len(rewards)))
    strategy = pw.get_strategy("proximal_softmax", window=5)
    seq = adv[rows, mask.int().argmax(1)]
    want = strategy(seq, entropy, mask, positive=scores.sum(1) > 0)
    torch.testing.assert_close(pv.token_advantages(strategy, adv, entropy, mask.float(), scores),
                               want, rtol=1e-6, atol=1e-7)
    by_max = strategy(seq, entropy, mask, positive=scores.amax(1) > 0)
    assert (by_max - want).abs().max() > 1e-3  # the two readings differ on this batch


def test_a_mask_of_other_values_and_integer_advantages_are_refused():
    """``response_mask`` holding 0.5 or 2 (a weight, not verl's 0/1 mask) is refused, not read
    as True; integer advantages are refused, not weighted and cast back (1.3 A -> A). Catches
    ``response_mask.bool()`` unchecked and the final ``.to(advantages.dtype)`` truncating."""
    rewards, scores, mask, entropy = batch(seed=3)
    adv = verl_advantages("grpo", rewards, scores, mask, blocks(len(rewards)))
    s = pw.get_strategy("proximal_softmax", window=5)
    for value in (0.5, 2.0):
        odd = mask.float()
        odd[1, 0] = value
        with pytest.raises(ValueError, match=f"response_mask must hold 0 and 1 only, got "
                                             f"{value}"):
            pv.token_advantages(s, adv, entropy, odd, scores)
    with pytest.raises(ValueError, match="advantages must be a floating-point tensor, got dtype "
                                         "torch.int64"):
        pv.token_advantages(s, adv.round().long(), entropy, mask.float(), scores)
    ok = pv.token_advantages(s, adv, entropy, mask.long(), scores)  # an int 0/1 mask is fine
    assert torch.equal(ok, pv.token_advantages(s, adv, entropy, mask.float(), scores))


def test_token_level_scores_are_caught_at_run_time():
    """An estimator that passes the construction check (REINFORCE++ with gamma=1) still varies
    along the row when the reward is spread over tokens (a process reward in `rm_scores`): the
    run-time check refuses it. A NaN advantage is left to the strategy's non-finite check
    (NaN != NaN must not read as 'varies'). Catches a construction-only check."""
    rewards, scores, mask, entropy = batch(seed=7)
    process = scores + 0.1 * mask.float() * torch.rand(mask.shape,
                                                       generator=torch.Generator().manual_seed(1))
    adv = verl_advantages("reinforce_plus_plus", rewards, process, mask, blocks(len(rewards)))
    assert pv.check_adv_estimator(algorithm("reinforce_plus_plus")) == "reinforce_plus_plus"
    with pytest.raises(ValueError, match="vary along"):
        pv.token_advantages(pw.get_strategy("uniform"), adv, entropy, mask.float(), process)
    flat = torch.where(mask, 1.0, 0.0)
    flat[2] = torch.where(mask[2], float("nan"), 0.0)
    with pytest.raises(ValueError, match="advantages holds 1 NaN/inf"):
        pv.token_advantages(pw.get_strategy("uniform"), flat, entropy, mask.float(), scores)


# --- the trainer step with verl's groups (uid) ------------------------------------------------

def trainer_step(monkeypatch, pepo_cfg, rewards, scores, mask, entropy, uids):
    """The trainer's advantage step on verl's GRPO advantages (v1's own path), with an in-memory
    data store holding each row's prompt uid as verl's does (a non-tensor field)."""
    adv = verl_advantages("grpo", rewards, scores, mask, uids)
    store = Store({"advantages": nested(adv, mask), "entropy": nested(entropy, mask),
                   "response_mask": nested(mask.float(), mask), "rm_scores": nested(scores, mask),
                   "uid": NonTensorStack(*uids)})
    monkeypatch.setattr(pv, "tq", store)
    monkeypatch.setattr(pv.PPOTrainerSync, "_compute_advantage", lambda self, b, m: b)
    trainer = object.__new__(pv.PepoPPOTrainer)
    trainer.pepo_strategy, trainer.pepo_success_threshold = pv.strategy_from_config(
        OmegaConf.create(pepo_cfg))
    trainer.pepo_adv_estimator = "grpo"
    trainer._compute_advantage(Meta([f"{u}_{i}_0" for i, u in enumerate(uids)]), {})
    written = store.puts[0]["advantages"].to_padded_tensor(0.0)
    return pad_to(written, mask.size(1))


def pad_to(x, t):
    return torch.nn.functional.pad(x, (0, t - x.size(1)))


def shuffled_batch(seed, b=16):
    """A batch whose prompt groups are interleaved (verl's rows need not be in group order)."""
    rewards, scores, mask, entropy = batch(seed=seed, b=b)
    order = list(range(b))
    random.Random(seed).shuffle(order)
    uids = [f"{seed}-{'abcd'[order[i] % 4]}" for i in range(b)]
    return rewards, scores, mask, entropy, uids


def test_gtpo_in_verl_equals_gtpo_on_the_whole_batch_with_verls_groups(monkeypatch):
    """GTPO through the trainer equals `pepo.weighting.gtpo` on the whole batch with the groups
    of verl's uid (numbered differently here: only equality of ids counts). The adapter used to
    refuse gtpo. Catches groups taken as contiguous blocks of `rollout.n` rows, or one group for
    the batch, which give different advantages on this interleaved batch (checked below)."""
    rewards, scores, mask, entropy, uids = shuffled_batch(seed=8)
    got = trainer_step(monkeypatch, {"strategy": "gtpo"}, rewards, scores, mask, entropy, uids)
    gtpo = pw.get_strategy("gtpo")
    ids = torch.tensor([sorted(set(uids)).index(u) for u in uids])
    want = gtpo(torch.zeros(len(uids)), entropy, mask, positive=rewards > 0, groups=ids)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    assert want.abs().sum() > 0
    for wrong in (torch.arange(len(uids)) // G, torch.zeros(len(uids), dtype=torch.long)):
        other = gtpo(torch.zeros(len(uids)), entropy, mask, positive=rewards > 0, groups=wrong)
        assert (other - want).abs().max() > 1e-2


def test_a_user_strategy_with_kwargs_gets_positive_and_groups(monkeypatch):
    """A user strategy declared `fn(advantages, entropies, mask, **kw)` receives the success flags
    and verl's groups (ids in order of first appearance of the uid). The adapter used to refuse
    it (`needs_groups` is true for **kwargs). Catches flags or groups not passed, or groups
    numbered by row instead of by uid."""
    seen = {}

    def factory():
        def fn(advantages, entropies, mask, **kw):
            seen.update(kw)
            return advantages[:, None] * mask
        return fn

    monkeypatch.setitem(pw._REGISTRY, "verl_kwargs_probe", factory)
    rewards, scores, mask, entropy, uids = shuffled_batch(seed=9)
    trainer_step(monkeypatch, {"strategy": "verl_kwargs_probe"}, rewards, scores, mask, entropy,
                 uids)
    firsts = list(dict.fromkeys(uids))
    assert torch.equal(seen["positive"], rewards > 0)
    assert torch.equal(seen["groups"], torch.tensor([firsts.index(u) for u in uids]))
    assert torch.equal(pv.group_ids(["x", "y", "x", 3, "y", 3]), torch.tensor([0, 1, 0, 2, 1, 2]))


def test_verl_writes_the_entropy_field_the_adapter_reads():
    """The stand-in store above supplies ``entropy`` itself; this pins that verl's own
    old-log-prob step (the base of the trainer the adapter extends) writes a field of that
    name into the store, computed at the rollout's temperature. Catches a verl whose field is
    named otherwise, which every stand-in test would pass."""
    import inspect

    source = inspect.getsource(pv.PPOTrainerSync._compute_old_log_prob)
    assert 'fields=data.select("old_log_probs", "entropy")' in source
    assert '"calculate_entropy": True' in source
    assert '"temperature": self.config.actor_rollout_ref.rollout.temperature' in source
