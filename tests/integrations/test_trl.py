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
from pepo.integrations.trl import PepoGRPOTrainer  # noqa: E402
from tests.hf_fixtures import tiny_hf_qwen3  # noqa: E402

TEMPERATURE = 0.7  # not TRL's default, so entropies at the wrong temperature show


def reward_has_seven(completions, **kwargs):
    """A verifiable 0/1 reward that about half of the random model's completions pass: 1 when
    the completion's first character has an even code point."""
    return [float(len(c) > 0 and ord(c[0]) % 2 == 0) for c in completions]


def dataset(n=8):
    return Dataset.from_list([{"prompt": f"Say a number near {i}:"} for i in range(n)])


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
                                  "completion_mask", "advantages")})
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


def train(cls, model_dir, args, **kwargs):
    transformers.set_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    trainer = cls(model=model, reward_funcs=reward_has_seven, args=args,
                  train_dataset=dataset(), processing_class=tok, **kwargs)
    trainer.generations, trainer.sequence_advantages = [], []
    trainer.losses, trainer.loss_inputs = [], []
    forwards = []
    trainer.model.register_forward_hook(lambda *a: forwards.append(1))
    trainer.forwards = forwards
    trainer.train()
    return trainer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_hf_qwen3(tmp_path_factory.mktemp("trl_qwen3"), seed=3, hidden=32, std=0.2)


def test_uniform_trains_exactly_as_plain_grpo(model_dir, tmp_path):
    plain = train(RecordingGRPO, model_dir, config(tmp_path / "a"))
    ours = train(RecordingPepo, model_dir, config(tmp_path / "b"), pepo_strategy="uniform")
    assert len(plain.losses) == len(ours.losses) == 2
    for g0, g1 in zip(plain.generations, ours.generations):
        assert torch.equal(g0["completion_ids"], g1["completion_ids"])
        mask = g1["completion_mask"].bool()
        # uniform: each row's sequence advantage on its tokens, 0 on padding
        expected = torch.where(mask, g0["advantages"][:, None], torch.zeros(()))
        assert torch.equal(g1["advantages"], expected)
    assert any((g["advantages"] != 0).any() for g in ours.generations)  # the steps learned something
    for l0, l1 in zip(plain.losses, ours.losses):
        assert torch.equal(l0, l1)
    for (n0, p0), (n1, p1) in zip(plain.model.named_parameters(), ours.model.named_parameters()):
        assert n0 == n1 and torch.equal(p0, p1), n0
    # and the training moved the weights (so equal weights are not two untouched models)
    fresh = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert any(not torch.equal(p, q) for p, q in zip(fresh.parameters(), ours.model.parameters()))
    assert len(ours.forwards) == len(plain.forwards)  # uniform adds no forward pass


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


@pytest.mark.parametrize("strategy,params,misaligned,where", [
    # TRL's default: weighted inside _compute_loss from the loss's own forward
    ("proximal_softmax", {"window": 5, "temperature": 0.5}, False, "loss"),
    ("entropy_bonus", {"alpha": 0.4, "kappa": 2.0}, False, "loss"),
    # a generation serves two optimizer steps: TRL computes old log-probs during generation,
    # and the entropies come from that forward
    ("proximal_softmax", {"window": 5, "temperature": 0.5}, True, "generation"),
    # a batch-wide threshold: every entropy before the first loss (one pass of the adapter's)
    ("global_topk", {"fraction": 0.2}, False, "generation"),
])
def test_advantages_reaching_the_loss_are_the_strategy_on_rollout_entropies(
        model_dir, tmp_path, strategy, params, misaligned, where):
    overrides = {"steps_per_generation": 2} if misaligned else {}
    args = config(tmp_path, **overrides)
    ours = train(RecordingPepo, model_dir, args, pepo_strategy=strategy, pepo_params=params)
    gen = ours.generations[0]
    # where the weighting happened: [B, T] advantages leave generation, or [B] go to the loss
    assert gen["advantages"].dim() == (2 if where == "generation" else 1)
    mask = gen["completion_mask"].bool()
    ent = rollout_entropies(model_dir, gen)
    texts = ours.processing_class.batch_decode(gen["completion_ids"], skip_special_tokens=True)
    success = torch.tensor(reward_has_seven(texts)) > 0
    assert 0 < int(success.sum()) < len(success)  # both kinds present, so positive= matters
    seq_adv = ours.sequence_advantages[0]
    expected = pw.get_strategy(strategy, **params)(seq_adv, ent.float(), mask, positive=success)
    assert not torch.equal(expected, torch.where(mask, seq_adv[:, None], 0.0))  # not uniform
    if where == "generation":
        torch.testing.assert_close(gen["advantages"], expected, rtol=1e-4, atol=1e-5)

    # what reached TRL's loss: the same rows (shuffled and split by TRL), matched by tokens
    def key(prompt, completion):
        return tuple(prompt.tolist()) + (-1,) + tuple(completion.tolist())

    want = {}
    for i in range(len(seq_adv)):
        want.setdefault(key(gen["prompt_ids"][i], gen["completion_ids"][i]), []).append(expected[i])
    seen = 0
    for inp in ours.loss_inputs[:args.steps_per_generation]:  # the first generation's
        assert inp["advantages"].dim() == 2
        for j in range(inp["completion_ids"].size(0)):
            rows = want[key(inp["prompt_ids"][j], inp["completion_ids"][j])]
            assert any(torch.allclose(inp["advantages"][j], r, rtol=1e-4, atol=1e-5) for r in rows)
            seen += 1
    assert seen == len(seq_adv)

    plain = train(RecordingGRPO, model_dir, config(tmp_path / "plain", **overrides))
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


def test_bad_strategy_or_params_fail_before_training(model_dir, tmp_path):
    with pytest.raises(ValueError, match="no_such"):
        PepoGRPOTrainer(model=str(model_dir), reward_funcs=reward_has_seven,
                        args=config(tmp_path), train_dataset=dataset(), pepo_strategy="no_such")
    with pytest.raises(ValueError, match="process_group"):
        PepoGRPOTrainer(model=str(model_dir), reward_funcs=reward_has_seven,
                        args=config(tmp_path), train_dataset=dataset(),
                        pepo_strategy="global_topk", pepo_params={"process_group": None})
    with pytest.raises(ValueError, match=r"pepo_strategy='gtpo' compares the completions of each "
                                         r"prompt's group, which PepoGRPOTrainer does not pass"):
        PepoGRPOTrainer(model=str(model_dir), reward_funcs=reward_has_seven,
                        args=config(tmp_path), train_dataset=dataset(), pepo_strategy="gtpo")


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


def test_global_topk_threshold_covers_every_process(model_dir, tmp_path):
    # Two CPU processes (gloo) train one step of global_topk; each saves what the strategy got and
    # gave on its rank. The threshold must be the quantile over both ranks' tokens together:
    # the strategy applied once (no process group) to the concatenation gives both ranks' output.
    worker = Path(__file__).with_name("trl_two_process_worker.py")
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(root), str(root / "src"), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         str(worker), str(model_dir), str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert [r["world_size"] for r in ranks] == [2, 2]
    assert [len(r["weighed"]) for r in ranks] == [1, 1]  # one generation batch, weighted once
    parts = [r["weighed"][0] for r in ranks]
    # the ranks generated different completions (else a per-rank threshold could not differ)
    assert not torch.equal(parts[0]["entropies"], parts[1]["entropies"])
    width = max(p["mask"].size(1) for p in parts)

    def cat(key, fill):
        return torch.cat([torch.nn.functional.pad(p[key], (0, width - p[key].size(1)), value=fill)
                          if p[key].dim() == 2 else p[key] for p in parts])

    fn = pw.get_strategy("global_topk", fraction=0.2)
    mask = cat("mask", False)
    expected = fn(cat("advantages", 0.0), cat("entropies", 0.0), mask, positive=cat("positive", False))
    assert torch.equal(cat("token_advantages", 0.0), expected)
    # a per-process threshold (TRL's own top_entropy_quantile) gives another selection here
    local = torch.cat([torch.nn.functional.pad(
        fn(p["advantages"], p["entropies"], p["mask"]), (0, width - p["mask"].size(1)))
        for p in parts])
    assert not torch.equal(local != 0, expected != 0)
    # and from Eq. (4) directly: A_i on the tokens at or above the 0.8 quantile of all ranks'
    # valid entropies (torch.quantile's), 0 elsewhere
    ent, adv = cat("entropies", 0.0), cat("advantages", 0.0)
    tau = torch.quantile(ent[mask].double(), 0.8)
    by_formula = torch.where(mask & (ent.double() >= tau), adv[:, None], torch.zeros(()))
    assert torch.equal(cat("token_advantages", 0.0), by_formula)
