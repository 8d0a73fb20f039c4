"""pepo inside verl's v1 trainer, checked against verl's own code: its GRPO advantages, its
registered policy loss, its trainer step and its plugin discovery.

These tests need verl 0.9.1 (`pip install verl==0.9.1 TransferQueue cachetools uvicorn fastapi`
beside the core install, docs/integrations.md). Without it they are not collected, unless
PEPO_REQUIRE_VERL=1 (as `.ci/run` sets), when they fail instead.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

if importlib.util.find_spec("verl") is None:
    if os.environ.get("PEPO_REQUIRE_VERL") == "1":
        raise RuntimeError("PEPO_REQUIRE_VERL=1 but verl is not installed")
    pytest.skip("verl is not installed", allow_module_level=True)

from omegaconf import OmegaConf  # noqa: E402
from verl.trainer.ppo import core_algos  # noqa: E402

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


def test_trainer_step_writes_back_exactly_the_weighted_advantages(monkeypatch):
    rewards, scores, mask, entropy = batch(seed=3)
    index = [str(i // G) for i in range(len(rewards))]
    verl_adv, _ = core_algos.compute_grpo_outcome_advantage(
        token_level_rewards=scores, response_mask=mask.float(), index=index)
    store = Store({"advantages": nested(verl_adv, mask), "entropy": nested(entropy, mask),
                   "response_mask": nested(mask.float(), mask), "rm_scores": nested(scores, mask)})
    monkeypatch.setattr(pv, "tq", store)
    # verl's own advantage step ran already: the stand-in holds its output
    monkeypatch.setattr(pv.PPOTrainerSync, "_compute_advantage", lambda self, b, m: b)
    trainer = object.__new__(pv.PepoPPOTrainer)
    trainer.pepo_strategy, trainer.pepo_success_threshold = pv.strategy_from_config(
        OmegaConf.create({"strategy": "proximal_softmax", "params": {"window": 5}}))
    metrics: dict = {}
    meta = Meta([f"k{i}" for i in range(len(rewards))])
    trainer._compute_advantage(meta, metrics)
    assert len(store.puts) == 1 and set(store.puts[0].keys()) == {"advantages"}
    written = store.puts[0]["advantages"].to_padded_tensor(0.0)
    want = pw.get_strategy("proximal_softmax", window=5)(
        est.group_advantages(rewards, group_size=G), entropy, mask, positive=rewards > 0)
    torch.testing.assert_close(written, want[:, :written.size(1)], rtol=1e-5, atol=1e-6)
    assert written.size(1) == int(mask.sum(1).max())
    assert "pepo/token_advantage_abs_mean" in metrics


def test_config_errors_name_the_fix():
    with pytest.raises(ValueError, match=r"\+pepo.strategy"):
        pv.strategy_from_config(None)
    with pytest.raises(ValueError, match="no_such"):
        pv.strategy_from_config(OmegaConf.create({"strategy": "no_such"}))
    with pytest.raises(ValueError, match=r"pepo.strategy='gtpo' compares the rollouts of each "
                                         r"prompt's group, which the verl adapter does not pass"):
        pv.strategy_from_config(OmegaConf.create({"strategy": "gtpo"}))


def test_the_trainer_checks_its_pepo_section_before_verl_builds_anything(monkeypatch):
    built = []
    monkeypatch.setattr(pv.PPOTrainerSync, "__init__", lambda self, config: built.append(config))
    with pytest.raises(ValueError, match="no_such"):
        pv.PepoPPOTrainer(OmegaConf.create({"pepo": {"strategy": "no_such"}}))
    assert built == []
    good = OmegaConf.create({"pepo": {"strategy": "global_topk", "params": {"fraction": 0.3}}})
    trainer = pv.PepoPPOTrainer(good)
    assert built == [good] and trainer.pepo_strategy is not None


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
