"""pepo inside TRL's GRPOTrainer, checked against TRL's own code (a tiny random Qwen3 with a
character tokenizer, on CPU).

These tests need TRL (`pip install trl==1.16.0` beside the recipe install). Without it they are not
collected, unless PEPO_REQUIRE_TRL=1 (as `.ci/run` sets), when they fail instead.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

if importlib.util.find_spec("trl") is None:
    if os.environ.get("PEPO_REQUIRE_TRL") == "1":
        raise RuntimeError("PEPO_REQUIRE_TRL=1 but TRL is not installed")
    pytest.skip("TRL is not installed (pip install trl==1.16.0)", allow_module_level=True)

import transformers  # noqa: E402
from datasets import Dataset  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

import pepo.weighting as pw  # noqa: E402
from pepo.integrations.trl import PepoGRPOTrainer, top_fifth_weight_share  # noqa: E402
from tests.hf_fixtures import tiny_hf_qwen3  # noqa: E402

TEMPERATURE = 0.7  # not TRL's default, so entropies at the wrong temperature show


def reward_has_seven(completions, **kwargs):
    """A verifiable 0/1 reward that about half of the random model's completions pass: 1 when
    the completion's first character has an even code point."""
    return [float(len(c) > 0 and ord(c[0]) % 2 == 0) for c in completions]


def dataset(n=8):
    return Dataset.from_list([{"prompt": f"Say a number near {i}:"} for i in range(n)])


def ragged_dataset(n=8):
    """Prompts of four lengths: TRL left-pads the shorter ones in a batch."""
    return Dataset.from_list([{"prompt": "Say " + "a number " * (i % 4) + f"near {i}:"}
                              for i in range(n)])


def config(tmp_path, **overrides):
    kw = dict(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=16, num_generations=4,
        max_completion_length=16, max_steps=2, learning_rate=5e-2, logging_steps=1,
        report_to="none", use_cpu=True, seed=0, save_strategy="no", temperature=TEMPERATURE,
        beta=0.0, disable_tqdm=True, bf16=False,  # GRPOConfig autocasts to bf16 by default
    )
    kw.update(overrides)
    return GRPOConfig(**kw)


class Recording:
    """Records what TRL generated and what reached its loss, changing nothing."""

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        self.generations.append({k: out[k].detach().clone() for k in
                                 ("prompt_ids", "prompt_mask", "completion_ids",
                                  "completion_mask", "advantages", "tool_mask") if k in out})
        self.sequence_advantages.append(torch.tensor(list(self._logs["advantages"])[-len(inputs):]))
        return out

    def _compute_loss(self, model, inputs):
        loss = super()._compute_loss(model, inputs)
        self.losses.append(loss.detach().clone())
        self.loss_inputs.append({k: inputs[k].detach().clone() for k in
                                 ("prompt_ids", "completion_ids", "completion_mask", "advantages")})
        return loss


class RecordingGRPO(Recording, GRPOTrainer):
    pass


class RecordingPepo(Recording, PepoGRPOTrainer):
    pass


class VllmStandIn:
    """TRL's vLLM generation with the importance-sampling correction on, where vLLM is not
    installed: generate() samples the completions (as a vLLM engine holding the same weights
    would) and each sampled token's log-prob is reported as 0, so TRL runs its own
    old-log-prob forward and the correction as it does with vLLM."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.use_vllm = True

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations,
                              has_tool_images=False):
        self.use_vllm = False  # TRL's transformers path, instead of a vLLM engine
        try:
            ids, _ = super()._generate_single_turn(prompt_ids, images, multimodal_fields,
                                                   num_generations, has_tool_images)
        finally:
            self.use_vllm = True
        return ids, [[0.0] * len(c) for c in ids]


class VllmGRPO(VllmStandIn, RecordingGRPO):
    pass


class VllmPepo(VllmStandIn, RecordingPepo):
    pass


def train(cls, model_dir, args, reward=reward_has_seven, data=None, run=True, **kwargs):
    transformers.set_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    trainer = cls(model=model, reward_funcs=reward, args=args,
                  train_dataset=dataset() if data is None else data, processing_class=tok,
                  **kwargs)
    trainer.generations, trainer.sequence_advantages = [], []
    trainer.losses, trainer.loss_inputs = [], []
    forwards = []
    trainer.model.register_forward_hook(lambda *a: forwards.append(1))
    trainer.forwards = forwards
    if run:
        trainer.train()
    return trainer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_hf_qwen3(tmp_path_factory.mktemp("trl_qwen3"), seed=3, hidden=32, std=0.2)


@pytest.mark.parametrize("loss", [
    {}, {"loss_type": "grpo"}, {"loss_type": "dr_grpo"}, {"loss_type": "cispo"},
    # SGD: Adam would magnify the last-bit differences below on gradients near 0
    {"loss_type": "luspo", "importance_sampling_level": "sequence", "optim": "sgd"},
    {"loss_type": "vespo", "num_iterations": 2}])
def test_uniform_trains_exactly_as_plain_grpo(model_dir, tmp_path, loss):
    """Catches any change uniform makes to TRL's training (completions, advantages, losses,
    weights, forward passes, TRL's own logged metrics) under TRL's default loss (dapo) and
    others that aggregate per sequence or per token (a loss that averaged [B, T] advantages
    over B·T entries where TRL's [B, 1] ones average over B would differ; TRL's sequence-level
    clip ratios and vespo's phi average [B, T] advantages per token), and pepo/ metrics missing
    or off their exact uniform values (a top-fifth share that counts whole boundary tokens is
    not 0.2 on rows of 7 tokens)."""
    plain = train(RecordingGRPO, model_dir, config(tmp_path / "a", **loss))
    ours = train(RecordingPepo, model_dir, config(tmp_path / "b", **loss), pepo_strategy="uniform")
    assert len(plain.losses) == len(ours.losses) == 2
    for g0, g1 in zip(plain.generations, ours.generations):
        assert torch.equal(g0["completion_ids"], g1["completion_ids"])
        # uniform: TRL's own [B] sequence advantages, passed on unchanged
        assert torch.equal(g1["advantages"], g0["advantages"])
    assert any((g["advantages"] != 0).any() for g in ours.generations)  # the steps learned
    for l0, l1 in zip(plain.losses, ours.losses):
        assert torch.equal(l0, l1)
    for (n0, p0), (n1, p1) in zip(plain.model.named_parameters(), ours.model.named_parameters()):
        assert n0 == n1, n0
        assert torch.equal(p0, p1), n0
    def trl_metrics(trainer):  # TRL's own, less the clocks
        return [{k: v for k, v in h.items() if not k.startswith("pepo/") and "time" not in k
                 and not k.endswith("_per_second")} for h in trainer.state.log_history]

    assert trl_metrics(ours) == trl_metrics(plain)
    # and the training moved the weights (so equal weights are not two untouched models)
    fresh = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert any(not torch.equal(p, q) for p, q in zip(fresh.parameters(), ours.model.parameters()))
    assert len(ours.forwards) == len(plain.forwards)  # uniform adds no forward pass
    # its metrics: equal weights put exactly a fifth of each row's weight on a fifth of its
    # tokens; |token advantage| averages |A_i| over the valid tokens
    logged = [h for h in ours.state.log_history if "pepo/top_fifth_weight_share" in h]
    assert len(logged) == len(ours.generations) == 2 // loss.get("num_iterations", 1)
    for h, g in zip(logged, ours.generations):
        assert h["pepo/top_fifth_weight_share"] == pytest.approx(0.2, abs=1e-6)
        mask = g["completion_mask"].bool()
        want = torch.where(mask, g["advantages"][:, None].abs(), 0.0).sum() / mask.sum()
        assert h["pepo/token_advantage_abs_mean"] == pytest.approx(float(want), rel=1e-5)


def rollout_entropies(model_dir, gen):
    """The rollout policy's token entropies at the sampling temperature, from a fresh copy of
    the initial model (the policy that generated the first batch)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    ids = torch.cat([gen["prompt_ids"], gen["completion_ids"]], dim=1)
    attn = torch.cat([gen["prompt_mask"], gen["completion_mask"]], dim=1)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attn).logits
    t = gen["completion_ids"].size(1)
    logp = torch.log_softmax(logits[:, -t - 1:-1] / TEMPERATURE, dim=-1)
    return -(logp.exp() * logp).sum(-1)


def assert_reached_the_loss(micro_batches, gen, expected):
    """The advantages that reached TRL's loss are ``expected``'s rows: the generation's rows,
    shuffled and split by TRL, matched by their tokens."""
    def key(prompt, completion):
        return tuple(prompt.tolist()) + (-1,) + tuple(completion.tolist())

    want = {}
    for i in range(expected.size(0)):
        want.setdefault(key(gen["prompt_ids"][i], gen["completion_ids"][i]), []).append(expected[i])
    seen = 0
    for inp in micro_batches:
        assert inp["advantages"].dim() == 2
        for j in range(inp["completion_ids"].size(0)):
            rows = want[key(inp["prompt_ids"][j], inp["completion_ids"][j])]
            assert any(torch.allclose(inp["advantages"][j], r, rtol=1e-4, atol=1e-5) for r in rows)
            seen += 1
    assert seen == expected.size(0)


def slow_top_fifth_share(adv, mask):
    """Loop reference for pepo/top_fifth_weight_share: per row with a nonzero weight, sort the
    valid |advantages| in decreasing order and take the first n/5 of them (a fraction of the
    boundary one), over their total; the mean over those rows."""
    shares = []
    for a_row, m_row in zip(adv.tolist(), mask.tolist()):
        w = sorted((abs(a) for a, m in zip(a_row, m_row) if m), reverse=True)
        if sum(w) == 0:
            continue
        k, top = len(w) / 5, 0.0
        for j, x in enumerate(w):
            top += x * min(max(k - j, 0.0), 1.0)
        shares.append(top / sum(w))
    return sum(shares) / len(shares)


# (strategy, params, TRL overrides, where the weighting happens)
MISALIGNED = {"steps_per_generation": 2}  # a generation serves two optimizer steps
TWO_MICRO_BATCHES = {"steps_per_generation": 2, "gradient_accumulation_steps": 2}
VLLM_IS = {"vllm_importance_sampling_mode": "token_truncate", "vllm_stand_in": True}


@pytest.mark.parametrize("strategy,params,overrides,where", [
    # TRL's default: weighted inside _compute_loss from the loss's own forward
    ("proximal_softmax", {"window": 5, "temperature": 0.5}, {}, "loss"),
    ("entropy_bonus", {"alpha": 0.6, "kappa": 1.5}, {}, "loss"),
    ("window_average", {"window": 5}, {}, "loss"),
    # TRL computes old log-probs during generation, and the entropies come from that forward
    ("proximal_softmax", {"window": 5, "temperature": 0.5}, MISALIGNED, "generation"),
    # a batch-wide threshold: every entropy before the first loss, recorded while generate()
    # sampled (no forward pass of the adapter's)
    ("global_topk", {"fraction": 0.3}, {}, "generation"),
    # GTPO: each prompt's 4 completions compared as one group, over a generation batch that TRL
    # then shuffles and splits into two micro-batches
    ("gtpo", {"alpha1": 1.0, "alpha2": 0.3}, TWO_MICRO_BATCHES, "generation"),
    # vLLM with its importance-sampling correction (a stand-in): TRL runs its old-log-prob
    # forward, and every strategy takes its entropies from it
    ("proximal_softmax", {"window": 5, "temperature": 0.5}, VLLM_IS, "generation"),
    ("global_topk", {"fraction": 0.2}, VLLM_IS, "generation"),
])
def test_advantages_reaching_the_loss_are_the_strategy_on_rollout_entropies(
        model_dir, tmp_path, strategy, params, overrides, where):
    """Catches: entropies not of the rollout policy or at another temperature; the strategy's
    parameters dropped (none of them at its default here); success flags
    from the advantage's sign; GTPO without its groups, or grouped per micro-batch after TRL's
    shuffle; an adapter forward pass where TRL or generate() already gave the entropies
    (global_topk's extra no-grad forward, counted by a forward hook); pepo/ metrics that are
    not those of the advantages that reached the loss; with vLLM's importance-sampling
    correction, weighting in the loss or an adapter forward instead of TRL's old-log-prob
    forward."""
    overrides = dict(overrides)
    vllm = overrides.pop("vllm_stand_in", False)
    args = config(tmp_path, **overrides)
    ours = train(VllmPepo if vllm else RecordingPepo, model_dir, args, pepo_strategy=strategy,
                 pepo_params=params)
    if vllm:  # the stand-in took TRL's vLLM path: its importance-sampling ratio was logged
        assert "sampling/importance_sampling_ratio/mean" in ours.state.log_history[0]
    gen = ours.generations[0]
    # where the weighting happened: [B, T] advantages leave generation, or [B] go to the loss
    assert gen["advantages"].dim() == (2 if where == "generation" else 1)
    mask = gen["completion_mask"].bool()
    ent = rollout_entropies(model_dir, gen)
    texts = ours.processing_class.batch_decode(gen["completion_ids"], skip_special_tokens=True)
    success = torch.tensor(reward_has_seven(texts)) > 0
    assert 0 < int(success.sum()) < len(success)  # both kinds present, so positive= matters
    seq_adv = ours.sequence_advantages[0]
    groups = torch.arange(len(seq_adv)) // args.num_generations  # TRL's: consecutive rows
    expected = pw.get_strategy(strategy, **params)(seq_adv, ent.float(), mask, positive=success,
                                                   groups=groups)
    assert not torch.equal(expected, torch.where(mask, seq_adv[:, None], 0.0))  # not uniform
    if where == "generation":
        torch.testing.assert_close(gen["advantages"], expected, rtol=1e-4, atol=1e-5)

    micro_batches = ours.loss_inputs[:args.steps_per_generation]  # the first generation's
    assert_reached_the_loss(micro_batches, gen, expected)

    # the logged pepo/ metrics are those of the advantages that reached the loss (for the
    # loss-time path: of its one micro-batch)
    first = next(h for h in ours.state.log_history if "pepo/top_fifth_weight_share" in h)
    width = args.max_completion_length
    adv_all = torch.cat([torch.nn.functional.pad(i["advantages"],
                                                 (0, width - i["advantages"].size(1)))
                         for i in micro_batches])
    mask_all = torch.cat([torch.nn.functional.pad(i["completion_mask"].bool(),
                                                  (0, width - i["completion_mask"].size(1)))
                          for i in micro_batches])
    assert first["pepo/top_fifth_weight_share"] == pytest.approx(
        slow_top_fifth_share(adv_all, mask_all), rel=1e-5)
    assert first["pepo/top_fifth_weight_share"] > 0.2 + 5e-4  # more concentrated than uniform
    assert first["pepo/token_advantage_abs_mean"] == pytest.approx(
        float(adv_all.abs()[mask_all].mean()), rel=1e-5)

    # and no forward pass of the adapter's: as many model forwards as plain TRL's
    plain = train(VllmGRPO if vllm else RecordingGRPO, model_dir,
                  config(tmp_path / "plain", **overrides))
    assert len(ours.forwards) == len(plain.forwards)
    if strategy == "global_topk":
        # TRL's own top_entropy_quantile gathers every process's entropies too, but per
        # micro-batch: on a generation of one micro-batch it selects the tokens pepo does, on a
        # part of it others
        selected = pw.get_strategy(strategy, **params)(torch.ones(len(seq_adv)), ent, mask) != 0
        quantile = 1 - params["fraction"]
        assert torch.equal(ours.get_high_entropy_mask(ent, mask, quantile), selected)
        half = len(seq_adv) // 2
        assert not torch.equal(ours.get_high_entropy_mask(ent[:half], mask[:half], quantile),
                               selected[:half])


@pytest.mark.parametrize("generation, own", [
    ({"repetition_penalty": 1.5}, None), ({"generation_kwargs": {"no_repeat_ngram_size": 2}}, None),
    ({}, {"no_repeat_ngram_size": 2})])  # the model's own generation_config.json
def test_a_processor_before_sampling_means_a_forward_not_the_recorded_logits(
        model_dir, tmp_path, generation, own):
    """Under a repetition penalty (or another of generate()'s logit processors, which run before
    the recorder) the logits generate() samples from are not the policy's. Catches the adapter
    recording them anyway: GTPO's weights would then come from the penalised distribution, where
    TRL's forward and loss, and the row-wise strategies, read the policy's. The adapter runs one
    no-grad forward per generation instead (counted against plain TRL). A processor set in the
    model's own generation_config, which generate() applies where TRL leaves a setting unset,
    counts too (the adapter read TRL's settings alone and recorded there)."""
    if own is not None:
        import shutil

        shutil.copytree(model_dir, tmp_path / "model")
        model_dir = tmp_path / "model"
        gc = transformers.GenerationConfig.from_pretrained(model_dir)
        gc.update(**own)
        gc.save_pretrained(model_dir)
    args = config(tmp_path, **generation)
    params = {"alpha1": 1.0, "alpha2": 0.3}
    ours = train(RecordingPepo, model_dir, args, pepo_strategy="gtpo", pepo_params=params)
    gen = ours.generations[0]
    mask = gen["completion_mask"].bool()
    ent = rollout_entropies(model_dir, gen)
    texts = ours.processing_class.batch_decode(gen["completion_ids"], skip_special_tokens=True)
    success = torch.tensor(reward_has_seven(texts)) > 0
    seq_adv = ours.sequence_advantages[0]
    groups = torch.arange(len(seq_adv)) // args.num_generations
    expected = pw.get_strategy("gtpo", **params)(seq_adv, ent.float(), mask, positive=success,
                                                 groups=groups)
    torch.testing.assert_close(gen["advantages"], expected, rtol=1e-4, atol=1e-5)
    plain = train(RecordingGRPO, model_dir, config(tmp_path / "plain", **generation))
    assert len(ours.forwards) == len(plain.forwards) + len(ours.generations)


def unscorable(text: str) -> bool:
    return len(text) > 0 and ord(text[0]) % 3 == 0


def reward_or_none(completions, **kwargs):
    """reward_has_seven, but None (no verdict: TRL's unscorable completion) for a third."""
    scores = reward_has_seven(completions)
    return [None if unscorable(c) else r for c, r in zip(completions, scores)]


@pytest.mark.parametrize("strategy, params", [("gtpo", {"alpha1": 1.0, "alpha2": 0.3}),
                                              ("global_topk", {"fraction": 0.3})])
def test_unscorable_completions_get_no_weight_and_no_say(model_dir, tmp_path, strategy, params):
    """A completion every reward function returned None for: TRL gives it advantage 0 and keeps
    it out of its group's baseline. Catches pepo shaping it as a failure (gtpo gave it token
    advantages up to 1.0 from its own failure side) or counting its tokens in a group's entropy
    statistics or in global_topk's threshold: the weights equal the strategy applied to the
    scored rows alone (entropies from a float64 copy of the rollout policy)."""
    args = config(tmp_path)
    ours = train(RecordingPepo, model_dir, args, reward=reward_or_none, pepo_strategy=strategy,
                 pepo_params=params)
    gen = ours.generations[0]
    texts = ours.processing_class.batch_decode(gen["completion_ids"], skip_special_tokens=True)
    none = torch.tensor([unscorable(t) for t in texts])
    assert 0 < int(none.sum()) < len(texts)
    mask = gen["completion_mask"].bool()
    ent = rollout_entropies(model_dir, gen).float()
    seq_adv = ours.sequence_advantages[0]
    assert torch.all(seq_adv[none] == 0)  # TRL's own
    success = torch.tensor([r is not None and r > 0 for r in reward_or_none(texts)])
    groups = torch.arange(len(seq_adv)) // args.num_generations
    kept = ~none
    kwargs = {"groups": groups[kept]} if strategy == "gtpo" else {}
    expected = torch.zeros_like(gen["advantages"])
    expected[kept] = pw.get_strategy(strategy, **params)(
        seq_adv[kept], ent[kept], mask[kept], positive=success[kept], **kwargs)
    torch.testing.assert_close(gen["advantages"], expected, rtol=1e-4, atol=1e-5)


def test_unscorable_completions_are_left_out_of_the_row_wise_metrics(model_dir, tmp_path):
    """Row-wise strategies weigh inside the loss, where TRL's rewards are gone: there the
    unscorable completions' tokens (weight 0) were counted in pepo/token_advantage_abs_mean,
    and on the generation-time path not. Catches that: the metric is the mean over the scored
    rows' valid tokens of the advantages that reached the loss."""
    ours = train(RecordingPepo, model_dir, config(tmp_path), reward=reward_or_none,
                 pepo_strategy="proximal_softmax", pepo_params={"window": 5})
    first_in = ours.loss_inputs[0]
    texts = ours.processing_class.batch_decode(first_in["completion_ids"],
                                               skip_special_tokens=True)
    none = torch.tensor([unscorable(t) for t in texts])
    mask = first_in["completion_mask"].bool()
    adv = first_in["advantages"]
    assert mask[none].any() and torch.all(adv[none] == 0)
    first = next(h for h in ours.state.log_history if "pepo/token_advantage_abs_mean" in h)
    want = float(adv.abs()[mask & ~none[:, None]].mean())
    assert first["pepo/token_advantage_abs_mean"] == pytest.approx(want, rel=1e-5)
    assert want != pytest.approx(float(adv.abs()[mask].mean()), rel=1e-3)


def test_an_unscorable_completion_does_not_make_its_group_mixed():
    """gtpo shapes a group only when it holds both outcomes, counting rows: three successes and
    one unscorable completion (masked out, but still in the prompt's group) read as mixed, and
    the successes got token advantages where the group of them alone gets none. The adapter's
    weighing on a stand-in trainer: catches the unscorable row left in its prompt's group."""
    from collections import defaultdict
    from types import SimpleNamespace

    trainer = object.__new__(PepoGRPOTrainer)
    trainer._pepo_strategy = pw.get_strategy("gtpo")
    trainer.num_generations = 4
    trainer.accelerator = SimpleNamespace(num_processes=1, process_index=0,
                                          reduce=lambda t, reduction: t)
    trainer._metrics = {"train": defaultdict(list)}
    rewards = torch.tensor([[1.0], [1.0], [1.0], [float("nan")],  # 3 successes, 1 unscorable
                            [1.0], [0.0], [0.0], [1.0]])  # a mixed group
    trainer._pepo_rewards = rewards
    g = torch.Generator().manual_seed(0)
    batch = {"advantages": torch.zeros(8), "completion_mask": torch.ones(8, 6, dtype=torch.long)}
    ent = torch.rand(8, 6, generator=g) * 2
    positive = torch.nan_to_num(rewards[:, 0]) > 0
    out = trainer._pepo_weigh(batch, ent, positive)
    assert torch.all(out[:4] == 0)  # a group of successes only (its unscorable row: no weight)
    want = pw.get_strategy("gtpo")(torch.zeros(4), ent[4:], torch.ones(4, 6, dtype=torch.bool),
                                   positive=positive[4:], groups=torch.zeros(4, dtype=torch.long))
    torch.testing.assert_close(out[4:], want)
    assert want.abs().sum() > 0


def test_inert_settings_in_the_models_generation_config_add_no_forward(model_dir, tmp_path):
    """Settings of a model's generation_config that add no logits processor (one beam, one
    sequence, a time limit) keep the recorder (no forward of the adapter's); one that adds a
    processor does not. Catches every setting of the file read as a processor (a forward each
    generation for most published checkpoints) and a processor missed."""
    import shutil

    def recorded(settings):
        d = tmp_path / f"model_{len(list(tmp_path.iterdir()))}"
        shutil.copytree(model_dir, d)
        gc = transformers.GenerationConfig.from_pretrained(d)
        gc.update(**settings)
        gc.save_pretrained(d)
        trainer = PepoGRPOTrainer(model=str(d), reward_funcs=reward_has_seven,
                                  args=config(tmp_path / d.name), train_dataset=dataset(),
                                  pepo_strategy="gtpo")
        return trainer._pepo_generates_with_transformers()

    assert recorded({"num_beams": 1, "num_return_sequences": 1, "max_time": 60.0})
    assert not recorded({"num_beams": 1, "no_repeat_ngram_size": 3})


class InjectingGRPO(RecordingGRPO):
    """Plain TRL whose loss gets the strategy's token advantages computed here, independently of
    the adapter: on entropies of a fresh float64 copy of the initial model (the rollout policy
    of the first step), with success from the reward on the decoded completions."""

    pepo_strategy = None

    def _compute_loss(self, model, inputs):
        gen = {k: inputs[k] for k in ("prompt_ids", "prompt_mask", "completion_ids",
                                      "completion_mask")}
        ent = rollout_entropies(self.model_dir, gen).float()
        texts = self.processing_class.batch_decode(inputs["completion_ids"],
                                                   skip_special_tokens=True)
        success = torch.tensor(reward_has_seven(texts)) > 0
        inputs["advantages"] = self.pepo_strategy(inputs["advantages"], ent,
                                                  inputs["completion_mask"].bool(),
                                                  positive=success)
        return super()._compute_loss(model, inputs)


@pytest.mark.parametrize("strategy,params", [
    ("proximal_softmax", {"window": 5, "temperature": 0.5}),
    ("entropy_bonus", {"alpha": 0.6, "kappa": 1.5}),
])
def test_row_wise_weights_are_what_the_loss_trains_on(model_dir, tmp_path, strategy, params):
    """TRL's default path weights inside ``_compute_loss``: one SGD step of the adapter moves
    the weights as plain TRL given the strategy's token advantages does, and not as plain TRL
    does (the loss value alone cannot tell: PEPO's weights keep each row's total). Catches
    advantages written into the loss's inputs after TRL has read them (what a record of the
    inputs, taken after the loss, still shows)."""
    args = dict(max_steps=1, optim="sgd", learning_rate=0.5)
    ours = train(RecordingPepo, model_dir, config(tmp_path / "a", **args),
                 pepo_strategy=strategy, pepo_params=params)
    InjectingGRPO.model_dir = model_dir
    InjectingGRPO.pepo_strategy = pw.get_strategy(strategy, **params)
    want = train(InjectingGRPO, model_dir, config(tmp_path / "b", **args))
    plain = train(RecordingGRPO, model_dir, config(tmp_path / "c", **args))
    assert torch.equal(ours.generations[0]["completion_ids"], want.generations[0]["completion_ids"])
    fresh = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)

    def moved(trainer):
        return [p - q for p, q in zip(trainer.model.parameters(), fresh.parameters())]

    off_uniform = 0.0
    for a, b, c in zip(moved(ours), moved(want), moved(plain)):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-7)
        off_uniform = max(off_uniform, float((b - c).detach().abs().max()))
    assert off_uniform > 1e-4  # the weighted step is not the uniform one: the check can fail


def tool_rollout(prompts, trainer):
    """A ``rollout_func`` standing in for a multi-turn rollout with tools: random completions of
    6-16 tokens, and every other one with a tool result (``env_mask`` 0, TRL's ``tool_mask``)
    at tokens 2-4."""
    tok = trainer.processing_class
    g = torch.Generator().manual_seed(len(trainer.state.log_history))
    chars = [tok.convert_tokens_to_ids(c) for c in "0123456789abcdefghij"]
    prompt_ids, completion_ids, env_mask = [], [], []
    for i, prompt in enumerate(prompts):
        n = int(torch.randint(6, 17, (), generator=g))
        prompt_ids.append(tok(prompt)["input_ids"])
        completion_ids.append([chars[int(k)] for k in torch.randint(len(chars), (n,), generator=g)])
        env_mask.append([int(i % 2 == 0 or not 2 <= t < 5) for t in range(n)])
    return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None,
            "env_mask": env_mask}


@pytest.mark.parametrize("strategy,params", [
    ("proximal_softmax", {"window": 5, "temperature": 0.5}),  # weighted in TRL's loss
    ("global_topk", {"fraction": 0.2}),  # at generation, from a forward pass of the adapter's
])
def test_tool_tokens_get_no_weight_and_enter_no_window(model_dir, tmp_path, monkeypatch,
                                                        strategy, params):
    """Catches tool results (TRL's tool_mask) weighted as the model's own tokens: they must get
    0 and be left out of the windows and the threshold, so each row's model tokens get what the
    strategy gives the row with its tool tokens cut out (masked = sliced). Also: a rollout that
    does not go through generate() (here a rollout_func) makes global_topk run its one no-grad
    forward over the generation batch."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    args = config(tmp_path)
    ours = train(RecordingPepo, model_dir, args, pepo_strategy=strategy, pepo_params=params,
                 rollout_func=tool_rollout)
    gen = ours.generations[0]
    tool = gen["tool_mask"].bool()
    assert (~tool & gen["completion_mask"].bool()).any()  # tool tokens present
    mask = gen["completion_mask"].bool() & tool
    ent = rollout_entropies(model_dir, gen)  # with the tool results in the context
    texts = ours.processing_class.batch_decode(gen["completion_ids"], skip_special_tokens=True)
    success = torch.tensor(reward_has_seven(texts)) > 0
    seq_adv = ours.sequence_advantages[0]
    # the strategy on the rows with their tool tokens cut out, put back in place
    keep = [m.nonzero().squeeze(1) for m in mask]
    width = max(len(k) for k in keep)
    sliced_ent = torch.zeros(len(keep), width, dtype=ent.dtype)
    sliced_mask = torch.zeros(len(keep), width, dtype=torch.bool)
    for i, k in enumerate(keep):
        sliced_ent[i, :len(k)], sliced_mask[i, :len(k)] = ent[i, k], True
    sliced = pw.get_strategy(strategy, **params)(seq_adv, sliced_ent.float(), sliced_mask,
                                                 positive=success)
    expected = torch.zeros(mask.shape)
    for i, k in enumerate(keep):
        expected[i, k] = sliced[i, :len(k)]
    assert (expected[mask] != 0).any()
    assert_reached_the_loss(ours.loss_inputs[:1], gen, expected)

    plain = train(RecordingGRPO, model_dir, config(tmp_path / "plain"), rollout_func=tool_rollout)
    extra = len(ours.generations) if strategy == "global_topk" else 0
    assert len(ours.forwards) == len(plain.forwards) + extra


def test_success_comes_from_rewards_not_the_advantage_sign(model_dir, tmp_path):
    # pepo_success sees TRL's weighted reward sum (here at most 1) and calls nothing a success:
    # PEPO (apply_to="positive") then leaves every token at its sequence advantage, although
    # half of the advantages are > 0 (an adapter reading the advantage's sign would weight them)
    def never(completions, **kwargs):
        return [0.0 for _ in completions]

    transformers.set_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    trainer = RecordingPepo(model=model, reward_funcs=[reward_has_seven, never],
                            args=config(tmp_path, max_steps=1),
                            train_dataset=dataset(), processing_class=tok,
                            pepo_strategy="proximal_softmax", pepo_params={"window": 5},
                            pepo_success=lambda r: r > 5.0)
    trainer.generations, trainer.sequence_advantages = [], []
    trainer.losses, trainer.loss_inputs = [], []
    trainer.train()
    seq = trainer.sequence_advantages[0]
    assert (seq > 0).any()
    inp = trainer.loss_inputs[0]  # the whole generation (one micro-batch), shuffled
    adv, mask = inp["advantages"], inp["completion_mask"].bool()
    assert adv.dim() == 2
    row = adv[:, :1]  # each row's value: constant on its tokens, 0 on padding
    assert torch.equal(adv, torch.where(mask, row, torch.zeros(())))
    assert sorted(row.squeeze(1).tolist()) == sorted(seq.tolist())


def test_success_is_the_weighted_reward_sum(model_dir, tmp_path):
    """A second reward of 1 on every completion, weighted -2: TRL's weighted sum is at most -1,
    so no completion succeeds by the default rule (> 0) and PEPO keeps every row uniform.
    Catches the flags taken from the unweighted sum (then every completion would succeed)."""
    def one(completions, **kwargs):
        return [1.0 for _ in completions]

    transformers.set_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    with pytest.warns(UserWarning, match="pepo_success"):
        trainer = RecordingPepo(model=model, reward_funcs=[reward_has_seven, one],
                                args=config(tmp_path, max_steps=1, reward_weights=[1.0, -2.0]),
                                train_dataset=dataset(), processing_class=tok,
                                pepo_strategy="proximal_softmax", pepo_params={"window": 5})
    trainer.generations, trainer.sequence_advantages = [], []
    trainer.losses, trainer.loss_inputs = [], []
    trainer.train()
    assert (trainer.sequence_advantages[0] > 0).any()
    inp = trainer.loss_inputs[0]
    adv, mask = inp["advantages"], inp["completion_mask"].bool()
    assert torch.equal(adv, torch.where(mask, adv[:, :1], torch.zeros(())))  # every row uniform


@pytest.mark.parametrize("signature", ["optional", "kwargs"])
def test_a_user_strategy_that_takes_groups_gets_trls_groups(model_dir, tmp_path, monkeypatch,
                                                           signature):
    """A registered strategy declaring ``groups=None`` or ``**kwargs`` gets TRL's groups (the
    ``num_generations`` consecutive completions of a prompt) and the success flags, as verl's
    adapter gives them. Catches groups passed only to strategies that require them (these got
    None)."""
    seen = []

    def factory():
        if signature == "optional":
            def fn(advantages, entropies, mask, positive, groups=None):
                seen.append({"positive": positive, "groups": groups})
                return torch.where(mask, advantages[:, None], 0.0)
        else:
            def fn(advantages, entropies, mask, **kw):
                seen.append(kw)
                return torch.where(mask, advantages[:, None], 0.0)
        return fn

    monkeypatch.setitem(pw._REGISTRY, "trl_groups_probe", factory)
    ours = train(RecordingPepo, model_dir, config(tmp_path, max_steps=1),
                 pepo_strategy="trl_groups_probe")
    gen = ours.generations[0]
    texts = ours.processing_class.batch_decode(gen["completion_ids"], skip_special_tokens=True)
    assert torch.equal(seen[0]["groups"], torch.arange(16) // 4)
    assert torch.equal(seen[0]["positive"], torch.tensor(reward_has_seven(texts)) > 0)


def test_bad_strategy_or_params_fail_before_training(model_dir, tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="no_such"):
        PepoGRPOTrainer(model=str(model_dir), reward_funcs=reward_has_seven,
                        args=config(tmp_path), train_dataset=dataset(), pepo_strategy="no_such")
    with pytest.raises(ValueError, match="process_group"):
        PepoGRPOTrainer(model=str(model_dir), reward_funcs=reward_has_seven,
                        args=config(tmp_path), train_dataset=dataset(),
                        pepo_strategy="global_topk", pepo_params={"process_group": None})
    # a threshold where the function belongs, a string for the dict: one line naming the
    # argument, before the model loads (they failed at the first batch, or as dict()'s error)
    loads = []
    monkeypatch.setattr(GRPOTrainer, "__init__", lambda self, *a, **k: loads.append(1))
    for kw, message in (({"pepo_success": 1.0}, "pepo_success must be a function"),
                        ({"pepo_params": "window=5"}, "pepo_params must be a dict")):
        with pytest.raises(ValueError, match=message):
            PepoGRPOTrainer(model=str(model_dir), reward_funcs=reward_has_seven,
                            args=config(tmp_path), train_dataset=dataset(), **kw)
    assert loads == []


def test_liger_loss_that_bypasses_the_weights_is_refused(model_dir, tmp_path, monkeypatch):
    """TRL before 1.16 computes the loss with Liger's kernel (``compute_liger_loss``, sequence
    advantages only) when ``use_liger_kernel=True``, never calling ``_compute_loss``: training
    would run as plain GRPO in silence. Catches the check missing, or made on a TRL without that
    path (1.16 routes Liger through ``_compute_loss``: accepted there), or for ``uniform``."""
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    args = config(tmp_path, use_liger_kernel=True)
    loaded = []
    def stand_in(self, *a, **k):  # TRL's __init__, loading nothing
        loaded.append(1)
        self.reward_funcs = [reward_has_seven]

    monkeypatch.setattr(GRPOTrainer, "__init__", stand_in)
    kw = dict(model=model, reward_funcs=reward_has_seven, args=args, train_dataset=dataset(),
              processing_class=tok)
    PepoGRPOTrainer(**kw)  # this TRL: no Liger loss path, nothing to refuse
    monkeypatch.setattr(GRPOTrainer, "compute_liger_loss", lambda *a: None, raising=False)
    PepoGRPOTrainer(pepo_strategy="uniform", **kw)  # nothing to drop
    assert len(loaded) == 2
    with pytest.raises(ValueError, match="use_liger_kernel=True: this TRL version"):
        PepoGRPOTrainer(pepo_strategy="gtpo", **kw)
    with pytest.raises(ValueError, match="'proximal_softmax' with use_liger_kernel"):
        PepoGRPOTrainer(model, reward_has_seven, args)  # args given by position
    assert len(loaded) == 2  # refused before TRL loaded anything


def test_sequence_level_ratios_that_would_flatten_the_weights_are_refused(model_dir, tmp_path,
                                                                          monkeypatch):
    """Under ``importance_sampling_level="sequence"`` TRL's ratio is one per row,
    ``exp(mean_t log ratio)``, and for every loss but cispo and vespo the gradient reaches the
    tokens only through it: a row's token advantages act through their sum, so PEPO (which
    keeps it) trained exactly as uniform, and 80/20 trained every token of a row alike (an
    audit measured PEPO's update equal to uniform's to 3e-8 with dapo, grpo, luspo and sapo).
    Catches the check missing, made for uniform, at token level, or for cispo/vespo (whose loss
    multiplies each token's own log-prob: the weights act there)."""
    loaded = []

    def stand_in(self, *a, **k):  # TRL's __init__, loading nothing
        loaded.append(1)
        self.reward_funcs = [reward_has_seven]

    monkeypatch.setattr(GRPOTrainer, "__init__", stand_in)

    def build(strategy, **overrides):
        PepoGRPOTrainer(model=str(model_dir), reward_funcs=reward_has_seven,
                        args=config(tmp_path, **overrides), train_dataset=dataset(),
                        pepo_strategy=strategy)

    for loss in ("dapo", "grpo", "bnpo", "dr_grpo", "luspo", "sapo"):
        for strategy in ("proximal_softmax", "global_topk"):
            with pytest.raises(ValueError, match=rf"pepo_strategy='{strategy}' with "
                               rf"importance_sampling_level='sequence' and loss_type='{loss}'"
                               rf".*only through their sum"):
                build(strategy, importance_sampling_level="sequence", loss_type=loss)
    assert loaded == []  # refused before TRL loaded anything
    build("uniform", importance_sampling_level="sequence", loss_type="dapo")
    build("proximal_softmax", importance_sampling_level="sequence", loss_type="cispo")
    build("proximal_softmax", importance_sampling_level="sequence", loss_type="vespo")
    build("proximal_softmax", importance_sampling_level="token", loss_type="dapo")
    assert len(loaded) == 4


def test_one_graded_reward_without_pepo_success_warns_once(model_dir, tmp_path):
    """One reward function of partial credit (0.5 or 1): the default success rule (> 0) counts
    every completion a success, so gtpo saw all-success groups (every token 0 where TRL had
    12 of 16 rows to learn from) and PEPO weighted the failures. Catches no warning, one per
    batch, one for a 0/1 reward, with pepo_success, or for a strategy that reads no success."""
    def graded(completions, **kwargs):  # full credit for odd lengths, half for even ones
        return [1.0 if len(c) % 2 else 0.5 for c in completions]

    def run(strategy, reward, **kwargs):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            train(PepoGRPOTrainer, model_dir, config(tmp_path, max_steps=2), reward=reward,
                  pepo_strategy=strategy, **kwargs)
        return [str(w.message) for w in caught if "graded positive rewards" in str(w.message)]

    (message,) = run("gtpo", graded)  # two generations, one warning
    assert "pepo_strategy='gtpo'" in message and "(from 0.5 to 1)" in message
    assert "pass pepo_success=" in message
    assert run("gtpo", reward_has_seven) == []

    def plus_minus_one(completions, **kwargs):  # binary, as > 0 reads it: no partial credit
        return [1.0 if "7" in c else -1.0 for c in completions]

    assert run("gtpo", plus_minus_one) == []
    assert run("gtpo", graded, pepo_success=lambda r: r >= 1.0) == []
    assert run("global_topk", graded) == []


def test_dropout_left_on_while_training_warns(model_dir, tmp_path):
    """TRL trains with dropout unless ``disable_dropout=True``, and every entropy pepo reads
    (the loss's forward, generate's logits, TRL's old-log-prob pass) is then taken under it: an
    audit measured a LoRA run's (lora_dropout=0.05) up to 0.56 nats off the policy's, moving
    80/20's selection by up to 14 of 47 tokens, in silence. Catches no warning for a dropout
    layer or a config's attention dropout (which TRL's switch does not zero), and one where
    TRL zeroed the layers, for uniform (which reads no entropy), or with no dropout at all."""
    def build(strategy, disable, attention=0.0, layer=True):
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        model.config.attention_dropout = attention
        if layer:
            model.pepo_test_dropout = torch.nn.Dropout(0.1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            PepoGRPOTrainer(model=model, reward_funcs=reward_has_seven,
                            args=config(tmp_path, disable_dropout=disable),
                            train_dataset=dataset(), pepo_strategy=strategy)
        return [str(w.message) for w in caught if "dropout" in str(w.message)]

    (message,) = build("proximal_softmax", disable=False)
    assert "1 dropout layer(s) are active (p=0.1)" in message
    assert "pepo_strategy='proximal_softmax'" in message and "disable_dropout=True" in message
    assert build("proximal_softmax", disable=True) == []  # TRL set the layer's p to 0
    (message,) = build("gtpo", disable=True, attention=0.1)
    assert "attention_dropout=0.1" in message
    assert build("uniform", disable=False) == []
    assert build("global_topk", disable=False, layer=False) == []


def test_several_reward_functions_without_pepo_success_warn_once(model_dir, tmp_path):
    """Catches the default success rule (rewards > 0 on TRL's weighted sum) applied silently
    where a positive format reward would count a wrong answer as a success."""
    def fmt(completions, **kwargs):
        return [0.5 for _ in completions]

    def build(**kwargs):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            PepoGRPOTrainer(model=str(model_dir), args=config(tmp_path), train_dataset=dataset(),
                            **kwargs)
        return [w for w in caught if "pepo_success" in str(w.message)]

    caught = build(reward_funcs=[reward_has_seven, fmt])
    assert len(caught) == 1 and caught[0].category is UserWarning
    message = str(caught[0].message)
    assert "rewards > 0" in message and "2 reward functions" in message
    assert "pass pepo_success=" in message
    # not with pepo_success, one reward function, or a strategy that never reads success
    assert build(reward_funcs=[reward_has_seven, fmt], pepo_success=lambda r: r >= 1) == []
    assert build(reward_funcs=reward_has_seven) == []
    assert build(reward_funcs=[reward_has_seven, fmt], pepo_strategy="global_topk") == []


def test_trls_entropy_mask_beside_a_strategy_warns(model_dir, tmp_path):
    """TRL's top_entropy_quantile < 1 masks the loss to the current policy's high-entropy tokens
    after pepo's weighting: the two multiply (PEPO x 80/20) in silence. Catches no warning, and
    one for uniform (which TRL's mask alone then is) or at the default 1.0."""
    def build(strategy, quantile):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            PepoGRPOTrainer(model=str(model_dir), reward_funcs=reward_has_seven,
                            args=config(tmp_path, top_entropy_quantile=quantile),
                            train_dataset=dataset(), pepo_strategy=strategy)
        return [str(w.message) for w in caught if "top_entropy_quantile" in str(w.message)]

    (message,) = build("proximal_softmax", 0.2)
    assert "top_entropy_quantile=0.2 with pepo_strategy='proximal_softmax'" in message
    assert "top_entropy_quantile=1.0" in message
    assert build("uniform", 0.2) == [] and build("proximal_softmax", 1.0) == []


def test_top_fifth_weight_share_against_a_loop():
    """Catches a share over the wrong tokens (padding, or the top fifth by position), a whole
    boundary token instead of its fraction (then uniform rows would not give 0.2), and rows
    without weight counted as 0 instead of left out (NaN)."""
    g = torch.Generator().manual_seed(0)
    adv = torch.randn(7, 13, generator=g)
    mask = torch.rand(7, 13, generator=g) > 0.3
    mask[0] = False
    mask[0, 4] = True  # one token: as uniform as a row can be, 0.2
    mask[4], adv[4] = False, 0.0
    mask[4, :10], adv[4, [3, 7]] = True, torch.tensor([2.0, -1.0])  # all on 2 of 10 tokens: 1
    adv[1] = 0.0  # no weight: NaN
    adv[2] = torch.where(mask[2], -0.7, float("nan"))  # uniform (NaN in padding): 0.2
    adv[3, ~mask[3]] = 1e6  # padding values never count
    got = top_fifth_weight_share(adv, mask)
    assert torch.isnan(got[1]) and not torch.isnan(got[[0, 2, 3, 4, 5, 6]]).any()
    assert got[0] == pytest.approx(0.2, abs=1e-6) and got[4] == pytest.approx(1.0, abs=1e-6)
    assert got[2] == pytest.approx(0.2, abs=1e-6)
    for i in [0, 2, 3, 4, 5, 6]:
        want = slow_top_fifth_share(adv[i:i + 1].nan_to_num(), mask[i:i + 1])
        assert float(got[i]) == pytest.approx(want, rel=1e-6), i


def test_the_docs_example_runs(tmp_path, monkeypatch):
    doc = Path(__file__).resolve().parents[2] / "docs" / "integrations.md"
    code = re.findall(r"```python\n(.*?)```", doc.read_text(), flags=re.S)[0]
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(code, str(doc), "exec"), namespace)
    trainer = namespace["trainer"]
    assert isinstance(trainer, PepoGRPOTrainer) and trainer.pepo_strategy_name == "proximal_softmax"
    assert trainer.state.global_step == 8


def test_a_loss_without_an_entropy_forward_is_an_error_not_unweighted_training(monkeypatch):
    # the row-wise path weights inside TRL's loss forward; a TRL whose loss skips it must not
    # silently train on unweighted [B] advantages
    monkeypatch.setattr(GRPOTrainer, "_compute_loss", lambda self, model, inputs: torch.zeros(()))
    trainer = object.__new__(PepoGRPOTrainer)
    trainer._pepo_loss_inputs = None
    inputs = {"advantages": torch.ones(2), "pepo_positive": torch.ones(2, dtype=torch.bool)}
    with pytest.raises(RuntimeError, match="computed none"):
        trainer._compute_loss(None, inputs)
    assert trainer._pepo_loss_inputs is None
    # without the flag (uniform, generation-time weighting, eval) the loss passes through
    assert trainer._compute_loss(None, {"advantages": torch.ones(2)}) == 0


def test_the_adapters_forward_masks_the_left_padding_of_shorter_prompts(model_dir, tmp_path):
    """Prompts of several lengths (TRL left-pads the shorter ones) under a repetition penalty,
    where the adapter runs its own no-grad forward for gtpo's entropies. Catches that forward
    given an all-ones attention mask: the padded rows' entropies attend to padding, and gtpo's
    weights come out wrong without an error (every other test's prompts have one length)."""
    args = config(tmp_path, max_steps=1, repetition_penalty=1.5)
    params = {"alpha1": 1.0, "alpha2": 0.3}
    ours = train(RecordingPepo, model_dir, args, data=ragged_dataset(), pepo_strategy="gtpo",
                 pepo_params=params)
    gen = ours.generations[0]
    assert (gen["prompt_mask"] == 0).any()  # some rows are left-padded
    texts = ours.processing_class.batch_decode(gen["completion_ids"], skip_special_tokens=True)
    seq_adv = ours.sequence_advantages[0]
    expected = pw.get_strategy("gtpo", **params)(
        seq_adv, rollout_entropies(model_dir, gen).float(), gen["completion_mask"].bool(),
        positive=torch.tensor(reward_has_seven(texts)) > 0,
        groups=torch.arange(len(seq_adv)) // args.num_generations)
    torch.testing.assert_close(gen["advantages"], expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("strategy", ["gtpo", "proximal_softmax"])
def test_eval_batches_are_not_weighted(model_dir, tmp_path, strategy):
    """docs/integrations.md: eval batches are not weighted. Catches the adapter weighting them
    too (the mode check dropped): the eval loss would change for a row-wise strategy, and eval
    would append pepo/ entries to the train metrics."""
    trainer = train(RecordingPepo, model_dir, config(tmp_path, per_device_eval_batch_size=16),
                    run=False, eval_dataset=dataset(), pepo_strategy=strategy)
    trainer.evaluate()
    assert trainer.loss_inputs and all(i["advantages"].dim() == 1 for i in trainer.loss_inputs)
    assert not any(v for k, v in trainer._metrics["train"].items() if k.startswith("pepo/"))


def none_for_a_third(completions, **kwargs):
    """A second reward function that abstains (None) on a third of the completions."""
    return [None if unscorable(c) else 0.0 for c in completions]


def test_a_completion_one_reward_function_of_two_scored_is_weighted(model_dir, tmp_path):
    """Two reward functions, the second abstaining on some completions the first scored. TRL
    sums the scores it has (nansum): those completions are scored, and succeed or fail by the
    first function. Catches a completion called unscorable when any function abstained (weight
    0), and a plain sum (NaN: every such success read as a failure)."""
    args = config(tmp_path, max_steps=1)
    params = {"alpha1": 1.0, "alpha2": 0.3}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # several reward functions without pepo_success
        ours = train(RecordingPepo, model_dir, args, reward=[reward_has_seven, none_for_a_third],
                     pepo_strategy="gtpo", pepo_params=params)
    gen = ours.generations[0]
    texts = ours.processing_class.batch_decode(gen["completion_ids"], skip_special_tokens=True)
    abstained = torch.tensor([unscorable(t) for t in texts])
    success = torch.tensor(reward_has_seven(texts)) > 0
    assert (abstained & success).any() and (abstained & ~success).any()
    seq_adv = ours.sequence_advantages[0]
    expected = pw.get_strategy("gtpo", **params)(
        seq_adv, rollout_entropies(model_dir, gen).float(), gen["completion_mask"].bool(),
        positive=success, groups=torch.arange(len(seq_adv)) // args.num_generations)
    assert expected[abstained].abs().sum() > 0
    torch.testing.assert_close(gen["advantages"], expected, rtol=1e-4, atol=1e-5)


def test_entropies_are_captured_from_the_policys_first_forward_of_a_generation(monkeypatch):
    """With PEFT and ``beta > 0``, TRL's reference forward runs through ``self.model`` too
    (adapters off), after the old-log-prob forward. Catches the adapter keeping the second
    capture (the reference model's entropies) instead of the first (the rollout policy's)."""
    calls = []

    def trls_forward(self, model, *args, compute_entropy=False, **kwargs):
        calls.append(compute_entropy)
        ent = torch.full((2, 3), float(len(calls)))
        return torch.zeros(2, 3), (ent if compute_entropy else None), None

    monkeypatch.setattr(GRPOTrainer, "_get_per_token_logps_and_entropies", trls_forward)
    trainer = object.__new__(PepoGRPOTrainer)
    policy = torch.nn.Linear(1, 1)
    trainer.model = policy
    trainer._pepo_loss_inputs, trainer._pepo_capture, trainer._pepo_captured = None, True, None
    _, ent, _ = trainer._get_per_token_logps_and_entropies(policy, None, None, 3)
    assert ent is None  # TRL did not ask for them: it gets none back
    trainer._get_per_token_logps_and_entropies(policy, None, None, 3)  # the reference forward
    assert torch.equal(trainer._pepo_captured, torch.full((2, 3), 1.0))
    assert calls == [True, False]


@pytest.fixture(scope="module")
def two_processes(model_dir, tmp_path_factory):
    """Two CPU processes (gloo) under torch.distributed.run train one step of each scenario of
    trl_two_process_worker.py; returns a loader of what each rank saved."""
    out = tmp_path_factory.mktemp("trl_two_processes")
    worker = Path(__file__).with_name("trl_two_process_worker.py")
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(root), str(root / "src"), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         str(worker), str(model_dir), str(out)],
        env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    def load(name):
        ranks = [torch.load(out / f"{name}_rank{r}.pt") for r in range(2)]
        assert [r["world_size"] for r in ranks] == [2, 2]
        assert [len(r["weighed"]) for r in ranks] == [1, 1]  # one batch each, weighted once
        return ranks

    return load


def _cat(parts, key, fill):
    """The ranks' tensors one after the other, [B, T] ones right-padded to a common width."""
    width = max(p["mask"].size(1) for p in parts)
    return torch.cat([torch.nn.functional.pad(p[key], (0, width - p[key].size(1)), value=fill)
                      if p[key].dim() == 2 else p[key] for p in parts])


def test_global_topk_threshold_covers_every_process(two_processes):
    """Catches a threshold taken over each process's tokens only. What each rank's strategy
    returned must equal the strategy applied once (no process group) to both ranks' batches
    together."""
    parts = [r["weighed"][0] for r in two_processes("global_topk")]
    # the ranks generated different completions (else a per-rank threshold could not differ)
    assert not torch.equal(parts[0]["entropies"], parts[1]["entropies"])
    width = max(p["mask"].size(1) for p in parts)
    fn = pw.get_strategy("global_topk", fraction=0.2)
    mask = _cat(parts, "mask", False)
    expected = fn(_cat(parts, "advantages", 0.0), _cat(parts, "entropies", 0.0), mask,
                  positive=_cat(parts, "positive", False))
    assert torch.equal(_cat(parts, "token_advantages", 0.0), expected)
    # a per-process threshold (each rank's strategy without the gather) selects other tokens
    local = torch.cat([torch.nn.functional.pad(
        fn(p["advantages"], p["entropies"], p["mask"]), (0, width - p["mask"].size(1)))
        for p in parts])
    assert not torch.equal(local != 0, expected != 0)
    # and from Eq. (4) directly: A_i on the tokens at or above the 0.8 quantile of all ranks'
    # valid entropies (torch.quantile's), 0 elsewhere
    ent, adv = _cat(parts, "entropies", 0.0), _cat(parts, "advantages", 0.0)
    tau = torch.quantile(ent[mask].double(), 0.8)
    by_formula = torch.where(mask & (ent.double() >= tau), adv[:, None], torch.zeros(()))
    assert torch.equal(_cat(parts, "token_advantages", 0.0), by_formula)


def test_each_process_reads_its_own_success_flags(two_processes):
    """Catches success flags sliced from another process's part of TRL's gathered rewards
    (e.g. every rank reading the first rank's): a row-wise strategy, weighted inside TRL's loss
    on each rank, with a reward that differs by rank."""
    ranks = two_processes("row_wise")
    own_flags = [torch.tensor([v > 0 for _, v in r["rewarded"]]) for r in ranks]
    # in generation order the two ranks' flags differ, so reading the other's would show
    assert [len(f) for f in own_flags] == [16, 16]
    assert not torch.equal(own_flags[0], own_flags[1])
    fn = pw.get_strategy("proximal_softmax", window=5, temperature=0.5)
    for r in ranks:
        reward_of = {tuple(ids): v for ids, v in r["rewarded"]}
        w = r["weighed"][0]  # the loss's micro-batch: TRL's shuffle of the generation batch
        rows = [tuple(ids[m].tolist()) for ids, m in zip(w["completion_ids"], w["mask"])]
        assert torch.equal(w["positive"], torch.tensor([reward_of[k] > 0 for k in rows]))
        assert 0 < int(w["positive"].sum()) < len(rows)  # both kinds, so the flags matter
        expected = fn(w["advantages"], w["entropies"], w["mask"], positive=w["positive"])
        assert torch.equal(w["token_advantages"], expected)


def test_gtpo_groups_span_processes(two_processes):
    """Catches GTPO grouped per process (or per micro-batch): each rank holds 6 completions and
    TRL's groups are 4 consecutive completions of both ranks' batches in rank order, so the
    middle group is rows 4-5 of rank 0 and rows 0-1 of rank 1. What each rank returned must be
    gtpo applied once to the 12 completions with those groups."""
    parts = [r["weighed"][0] for r in two_processes("gtpo")]
    assert [p["mask"].size(0) for p in parts] == [6, 6]
    positive, mask = _cat(parts, "positive", False), _cat(parts, "mask", False)
    assert 0 < int(positive[4:8].sum()) < 4  # the spanning group has both outcomes
    fn = pw.get_strategy("gtpo")
    expected = fn(_cat(parts, "advantages", 0.0), _cat(parts, "entropies", 0.0), mask,
                  positive=positive, groups=torch.arange(12) // 4)
    got = _cat(parts, "token_advantages", 0.0)
    assert torch.equal(got, expected)
    assert (got[4:8] != 0).any()
    # each rank on its own (groups 0,0,0,0,1,1 locally) gives the spanning group other values
    width = mask.size(1)
    local = torch.cat([torch.nn.functional.pad(
        fn(p["advantages"], p["entropies"], p["mask"], positive=p["positive"],
           groups=torch.arange(6) // 4), (0, width - p["mask"].size(1))) for p in parts])
    assert not torch.equal(local[4:8], expected[4:8])


def _own_scored(rank, weighed):
    """Which of a rank's weighed rows its own reward function scored (matched by tokens)."""
    verdict = {tuple(ids): r for ids, r in rank["rewarded"]}
    return torch.tensor([verdict[tuple(ids[m].tolist())] is not None
                         for ids, m in zip(weighed["completion_ids"], weighed["mask"])])


@pytest.mark.parametrize("name", ["unscored_row_wise", "unscored_topk"])
def test_each_process_masks_its_own_unscorable_completions(two_processes, name):
    """Rank 0 has unscorable completions, rank 1 none. Catches a rank reading rank 0's slice of
    the generation's scored flags (both in the loss-time path, row-wise, and the generation-time
    one, global_topk): rank 1 would zero scored rows, and rank 0's unscorable rows would enter
    the threshold. Each rank's weights equal the strategy on its own scored rows (global_topk's
    threshold over both ranks' scored tokens)."""
    ranks = two_processes(name)
    parts = [r["weighed"][0] for r in ranks]
    scored = [_own_scored(r, p) for r, p in zip(ranks, parts)]
    assert not scored[0].all() and scored[1].all()
    if name == "unscored_row_wise":
        fn = pw.get_strategy("proximal_softmax", window=5, temperature=0.5)
        for p, s in zip(parts, scored):
            assert torch.equal(p["token_advantages"], fn(p["advantages"], p["entropies"],
                                                         p["mask"] & s[:, None],
                                                         positive=p["positive"]))
        return
    kept = [{**p, "mask": p["mask"] & s[:, None]} for p, s in zip(parts, scored)]
    want = pw.get_strategy("global_topk", fraction=0.2)(
        _cat(kept, "advantages", 0.0), _cat(kept, "entropies", 0.0), _cat(kept, "mask", False))
    assert torch.equal(_cat(parts, "token_advantages", 0.0), want)


def test_the_logged_metric_covers_every_process(two_processes):
    """Catches pepo/token_advantage_abs_mean over rank 0's tokens alone (the reduction across
    processes dropped): the logged value is the mean over both ranks' scored valid tokens."""
    ranks = two_processes("unscored_topk")
    total = count = 0.0
    for r in ranks:
        p = r["weighed"][0]
        m = p["mask"] & _own_scored(r, p)[:, None]
        total += float(p["token_advantages"].abs()[m].sum())
        count += int(m.sum())
    one = ranks[0]["weighed"][0]
    m0 = one["mask"] & _own_scored(ranks[0], one)[:, None]
    assert float(one["token_advantages"].abs()[m0].mean()) != pytest.approx(total / count,
                                                                             rel=1e-3)
    logged = next(h for h in ranks[0]["log_history"] if "pepo/token_advantage_abs_mean" in h)
    assert logged["pepo/token_advantage_abs_mean"] == pytest.approx(total / count, rel=1e-5)
