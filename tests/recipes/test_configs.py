"""Every bundled config: its settings reach the objects that use them.

Parametrized over ``list_configs()`` with a table of expected values, so a new config without
an entry fails here instead of being skipped. Recipe configs run one step on tiny stand-ins of
their architecture (with their sampling, clipping, strategy and estimator settings untouched)
while spies record what generation, the loss and the strategy received; eval configs run with
a spy in place of ``avg_at_k``.
"""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

import pepo.loss
import pepo.training.engines
import pepo_eval
import pepo_recipe
from pepo.training.config import find_config, list_configs, register_resolvers
from tests import hf_fixtures as F
from tests.recipe_helpers import MODEL_OVERRIDES, random_checkpoint

# App. C.1 (Table 7): W = 101, τ = 1, positive-only, ε 0.2 / 0.28, T 0.6, top-p 0.6, G = 8, lr 1e-6,
# responses up to 4096 tokens.
PAPER = dict(
    strategy=("proximal_softmax", {"window": 101, "temperature": 1.0, "apply_to": "positive"}),
    eps=(0.2, 0.28),
    temperature=0.6,
    top_p=0.6,
    top_k=None,
    max_new_tokens=4096,
    lr=1e-6,
)
DRIFT_LR = 5e-5
TINY = dict(
    strategy=("proximal_softmax", {"window": 11, "temperature": 1.0, "apply_to": "positive"}),
    eps=(0.2, 0.28),
    temperature=1.0,
    top_p=1.0,
    top_k=None,
    max_new_tokens=64,
    lr=2e-5,
)
DRIFT = dict(TINY, strategy=("proximal_softmax", {"window": 21, "temperature": 1.0,
                                                  "apply_to": "positive"}),
             max_new_tokens=232, lr=DRIFT_LR)
REASON = dict(DRIFT, lr=3e-5)
# the real-model showcase: SmolLM2-135M-Instruct on small sums (its own tokenizer and template)
SMOLLM2 = dict(strategy=("proximal_softmax", {"window": 101, "temperature": 1.0,
                                              "apply_to": "positive"}),
               eps=(0.2, 0.28), temperature=0.7, top_p=1.0, top_k=None, max_new_tokens=96,
               lr=1e-5, estimator=("group", {"group_size": 8}), arch="llama", bundled_task=True)
# the real-model study: the same model on sums and differences asked step by step, W = 5 (about
# 4 % of its ~115-token responses, as the paper's 101 was of 2,000-3,000)
SMOLLM2_STEPS = dict(SMOLLM2, strategy=("proximal_softmax", {"window": 5, "temperature": 1.0,
                                                             "apply_to": "positive"}),
                     max_new_tokens=256)
EXPECTED = {
    "smollm2": SMOLLM2,
    "smollm2_steps": SMOLLM2_STEPS,
    "tiny": dict(TINY, estimator=("group", {"group_size": 8})),
    "tiny_drift": dict(DRIFT, estimator=("group", {"group_size": 8})),
    "tiny_drift_spo": dict(
        DRIFT,
        estimator=(
            "single_stream",
            {"candidate_pool": 4, "prior_samples": 4, "adaptive_forgetting": True},
        ),
    ),
    "tiny_reason": dict(REASON, estimator=("group", {"group_size": 8})),
    "tiny_reason_spo": dict(
        REASON,
        estimator=(
            "single_stream",
            {"candidate_pool": 4, "prior_samples": 4, "adaptive_forgetting": True},
        ),
    ),
    "tiny_spo": dict(
        TINY,
        estimator=(
            "single_stream",
            {"candidate_pool": 4, "prior_samples": 4, "adaptive_forgetting": True},
        ),
    ),
    "qwen3_1_7b_pepo": dict(PAPER, estimator=("group", {"group_size": 8}), arch="qwen3"),
    "qwen3_4b_pepo": dict(PAPER, estimator=("group", {"group_size": 8}), arch="qwen3"),
    "llama3_2_3b_pepo": dict(PAPER, estimator=("group", {"group_size": 8}), arch="llama"),
    "qwen3_4b_pespo": dict(
        PAPER,
        estimator=(
            "single_stream",
            {"candidate_pool": 4, "prior_samples": 8, "adaptive_forgetting": True},
        ),
        arch="qwen3",
    ),
    # Sec. 5.1: avg@16 on AIME and AMC, avg@1 on MATH500, T 0.6, top-p 0.6, 4096 tokens
    "eval_math": dict(
        eval={"AIME2024": 16, "AIME2025": 16, "AMC": 16, "MATH500": 1},
        temperature=0.6,
        top_p=0.6,
        top_k=None,
        max_new_tokens=4096,
    ),
    "eval_smollm2": dict(
        eval={"small_sums_val": 4}, temperature=0.7, top_p=1.0, top_k=None, max_new_tokens=96
    ),
    "eval_tiny": dict(
        eval={"modsum_val": 8}, temperature=1.0, top_p=1.0, top_k=None, max_new_tokens=64
    ),
    # the training runs' validations: k 4, T 1, their 232 new tokens
    "eval_tiny_drift": dict(
        eval={"drift_val": 4}, temperature=1.0, top_p=1.0, top_k=None, max_new_tokens=232
    ),
    "eval_tiny_reason": dict(
        eval={"reason_val": 4}, temperature=1.0, top_p=1.0, top_k=None, max_new_tokens=232
    ),
}


def test_every_bundled_config_has_expectations():
    assert set(list_configs()) == set(EXPECTED)


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory):
    root = tmp_path_factory.mktemp("stand_ins")
    return {"qwen3": F.tiny_hf_qwen3(root / "qwen3"), "llama": F.tiny_hf_llama(root / "llama"),
            "root": root}


def _recipe_cfg(name, tmp_path, stand_ins):
    """The bundled config with only sizes, paths and device replaced."""
    cfg = OmegaConf.load(find_config(name))
    small = {"output_dir": str(tmp_path / "run"), "device": "cpu", "dtype": "fp32",
             "num_steps": 1, "prompts_per_step": 2, "micro_batch_size": 2,
             "validation": {"every": 0}, "dump_rollouts_every": 0, "save_every": 0,
             "plot": False, "generation": {"max_new_tokens": 6}, "estimator": {"prior_samples": 1}
             if cfg.estimator.name == "single_stream" else {}}
    if EXPECTED[name].get("bundled_task"):  # its own dataset; the model: a stand-in
        small.update({"checkpoint_dir": str(stand_ins[EXPECTED[name]["arch"]]),
                      "model": {"max_seq_len": 512}, "reward": {"workers": 1, "timeout": 2},
                      "val_dataset": None})
    elif "arch" in EXPECTED[name]:
        rows = F.dapo_rows(32) if cfg.estimator.name == "single_stream" else F.deepmath_rows(8)
        small.update({"checkpoint_dir": str(stand_ins[EXPECTED[name]["arch"]]),
                      "train_data": str(F.write_parquet(tmp_path / "train.parquet", rows)),
                      "model": {"max_seq_len": 512}, "reward": {"workers": 1, "timeout": 2}})
    else:
        small.update({"checkpoint_dir": str(random_checkpoint(tmp_path / "init")),
                      "model": MODEL_OVERRIDES, "dataset": {"size": 16}, "val_dataset": None})
    if cfg.estimator.name == "single_stream":  # one rollout per prompt: more prompts
        small["prompts_per_step"] = 2 * cfg.ppo_mini_batches
    return OmegaConf.merge(cfg, small), cfg


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_config_values_reach_the_objects_that_use_them(name, tmp_path, stand_ins, monkeypatch):
    register_resolvers()
    want = EXPECTED[name]
    gen_calls, loss_calls, strategy_calls, avg_calls = [], [], [], []
    real_generate = pepo.training.engines.generate
    monkeypatch.setattr(pepo.training.engines, "generate",
                        lambda *a, **k: gen_calls.append(k) or real_generate(*a, **k))
    if "eval" in want:
        cfg = OmegaConf.load(find_config(name))
        original = cfg
        data = F.write_benchmarks(tmp_path / "data")
        cfg = OmegaConf.merge(cfg, {"output_dir": str(tmp_path / "out"), "device": "cpu",
                                    "dtype": "fp32"})
        if name == "eval_math":
            cfg = OmegaConf.merge(cfg, {"checkpoint_dir": str(stand_ins["qwen3"]),
                                        "data_dir": str(tmp_path / "data"),  # prompts and 4096
                                        "model": {"max_seq_len": 4608}})  # new tokens fit
            cfg.benchmarks.AIME2025.dataset.path = str(data["aime25"])
        if name == "eval_smollm2":  # a stand-in for the packaged model
            cfg = OmegaConf.merge(cfg, {"checkpoint_dir": str(stand_ins["llama"]),
                                        "model": {"max_seq_len": 512}})
        monkeypatch.setattr(
            pepo_eval,
            "avg_at_k",
            lambda model, tok, problems, k, reward, **kw: avg_calls.append((k, kw)) or 0.5,
        )
        results = pepo_eval.eval_main(cfg)
        assert set(results) == set(want["eval"])
        assert [k for k, _ in avg_calls] == [want["eval"][b] for b in cfg.benchmarks]
        for _, kw in avg_calls:
            for key in ("temperature", "top_p", "top_k", "max_new_tokens"):
                assert kw[key] == want[key], key
        assert original.generation.max_new_tokens == want["max_new_tokens"]
        return

    real_loss = pepo.loss.clipped_policy_loss
    monkeypatch.setattr(pepo.loss, "clipped_policy_loss",
                        lambda *a, **k: loss_calls.append(k) or real_loss(*a, **k))
    cfg, original = _recipe_cfg(name, tmp_path, stand_ins)
    recipe = pepo_recipe.PEPORecipe(cfg)
    recipe.setup(cfg)
    real_strategy = recipe.strategy
    recipe.strategy = lambda *a, **k: strategy_calls.append(k) or real_strategy(*a, **k)
    try:
        recipe.train()
    finally:
        recipe.cleanup()
    sname, sparams = want["strategy"]
    assert real_strategy.name == sname and real_strategy.params == sparams
    assert strategy_calls and all(k["positive"] is not None for k in strategy_calls)
    assert gen_calls and all(
        (k["temperature"], k["top_p"], k["top_k"])
        == (want["temperature"], want["top_p"], want["top_k"])
        for k in gen_calls
    )
    assert loss_calls and all((k["eps_low"], k["eps_high"]) == want["eps"] for k in loss_calls)
    assert recipe.optimizer.param_groups[0]["lr"] == pytest.approx(want["lr"])
    assert original.generation.max_new_tokens == want["max_new_tokens"]
    est_name, est_params = want["estimator"]
    assert recipe.estimator.name == est_name
    for key, value in est_params.items():
        configured = original.estimator[key]
        assert configured == value, key
        if key != "prior_samples":  # shrunk above for speed
            assert getattr(recipe.estimator, key) == value, key


@pytest.mark.parametrize("name", ["qwen3_1_7b_pepo", "qwen3_4b_pepo", "qwen3_4b_pespo",
                                  "llama3_2_3b_pepo"])
def test_the_paper_configs_pass_their_rules_as_shipped(name, tmp_path, stand_ins):
    """The paper configs with only their required paths filled in (the test above shrinks the
    batch and the steps before anything is checked): catches a batch layout the rules refuse
    (mini-batches, micro-batches, tiles of the 500-step, 256-rollout step). The schema and the
    rules only: the machine check wants a GPU."""
    from pepo.training import schema
    from pepo.training.config import check_rules, setting_warnings

    register_resolvers()
    data = F.write_parquet(tmp_path / "train.parquet", F.deepmath_rows(4))
    cfg = OmegaConf.merge(OmegaConf.load(find_config(name)), {
        "checkpoint_dir": str(stand_ins["llama" if "llama" in name else "qwen3"]),
        "train_data": str(data),
        "output_dir": str(tmp_path / "run")})
    rc = schema.parse(cfg)
    check_rules(rc)
    assert rc.num_steps == 500 and rc.prompts_per_step * rc.estimator.build(
    ).rollouts_per_prompt == 256
    assert setting_warnings(rc) == [  # the user gives the validation set
        "validation.every=50 with val_dataset=null: no validation is run (and no best "
        "checkpoint kept); set val_dataset to validate"]
