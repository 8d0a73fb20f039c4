"""examples/plain_pytorch_loop.py, the hand-written loop around the core: it learns, and each
piece a user copies from it does what its comment says. Core only (torch alone)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

import pepo.estimators as est
import pepo.weighting as pw
from pepo.entropy import logprobs_and_entropy

PATH = Path(__file__).resolve().parents[1] / "examples" / "plain_pytorch_loop.py"
spec = importlib.util.spec_from_file_location("plain_pytorch_loop", PATH)
ex = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ex)


def batch(seed=0, n=24):
    torch.manual_seed(seed)
    policy = ex.Policy()
    gen = torch.Generator().manual_seed(seed)
    d = torch.randint(0, 10, (n, 2), generator=gen)
    prompts = torch.stack(
        [d[:, 0], torch.full((n,), ex.PLUS), d[:, 1], torch.full((n,), ex.EQUALS)], 1
    )
    responses, mask = ex.sample(policy, prompts, gen)
    return policy, prompts, responses, mask


@pytest.mark.slow
def test_the_loop_learns_the_task():
    history = ex.main(steps=400, seed=0, log_every=0)
    first, last = sum(history[:20]) / 20, sum(history[-20:]) / 20
    assert first < 0.15 and last > 0.3, (first, last)  # chance is 1/14; measured 0.08 -> 0.48


def test_everything_after_eos_is_masked_and_padded():
    _, _, responses, mask = batch(n=256)
    for r, m in zip(responses.tolist(), mask.tolist()):
        end = r.index(ex.EOS) + 1 if ex.EOS in r else len(r)
        assert m == [True] * end + [False] * (len(r) - end)
        assert r[end:] == [ex.PAD] * (len(r) - end)
    assert (~mask).any() and mask.all(dim=1).any()  # both kinds of rows occur


def test_response_logits_are_shifted_against_the_response_tokens():
    policy, prompts, responses, _ = batch()
    logits = ex.response_logits(policy, prompts, responses)
    assert logits.shape == (*responses.shape, ex.VOCAB)
    with torch.no_grad():
        first, state = policy(prompts)  # the prompt's last position predicts response token 0
        torch.testing.assert_close(logits[:, 0], first[:, -1], rtol=1e-5, atol=1e-6)
        step, _ = policy(responses[:, :1], state)  # response token 0 predicts token 1
        torch.testing.assert_close(logits[:, 1], step[:, 0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("micro_batch", [5, 7])
def test_micro_batches_give_the_full_batch_gradient(micro_batch):
    """num_tokens = the whole batch's valid tokens: micro-batches of uneven token counts sum to
    the gradient of one full-batch loss (a per-micro-batch mean would not)."""
    policy, prompts, responses, mask = batch()
    targets = responses.clamp_max(ex.VOCAB - 1)
    with torch.no_grad():
        old_lp, ent = logprobs_and_entropy(ex.response_logits(policy, prompts, responses), targets)
    rewards = (torch.arange(len(prompts)) % 3 == 0).float()
    token_adv = pw.get_strategy("proximal_softmax")(est.group_advantages(rewards, 4), ent, mask,
                                                   positive=rewards > 0)
    grads = []
    for mb in (len(prompts), micro_batch):
        opt = torch.optim.SGD(policy.parameters(), lr=0.0)  # records the gradient, moves nothing
        ex.update(policy, opt, prompts, responses, mask, old_lp, token_adv, mb)
        grads.append([p.grad.clone() for p in policy.parameters()])
    token_counts = [
        int(mask[i : i + micro_batch].sum()) for i in range(0, len(prompts), micro_batch)
    ]
    assert len(set(token_counts)) > 1  # uneven: the case a per-micro-batch mean gets wrong
    for full, split in zip(*grads):
        torch.testing.assert_close(split, full, rtol=1e-5, atol=1e-7)
    assert any(float(g.abs().max()) > 0 for g in grads[0])


def test_the_strategy_gets_the_rollout_policys_entropies_and_the_prompt_groups():
    """Catches the wiring a copier would inherit: entropies or old log-probs from anywhere but
    the rollout policy's own distribution of each response token (noise, unshifted logits, a
    later policy), ``positive`` other than ``rewards > 0``, and rows of one prompt not one
    group. (The learning test passes with random entropies.)"""
    policy, prompts, responses, mask = batch(n=12)
    rewards = (torch.arange(12) % 3 == 0).float()
    seen = {}

    def record(advantages, entropies, mask_, positive=None, groups=None):
        seen.update(a=advantages, h=entropies, m=mask_, pos=positive, g=groups)
        return advantages[:, None] * mask_

    old_lp, token_adv, ent = ex.weigh_batch(policy, record, prompts, responses, mask, rewards, 4)
    assert seen["h"] is ent and torch.equal(seen["m"], mask)
    with torch.no_grad():  # slow reference: each token's distribution from its own prefix
        for i in range(12):
            for t in range(int(mask[i].sum())):
                logits, _ = policy(torch.cat([prompts[i], responses[i, :t]])[None])
                logp = torch.log_softmax(logits[0, -1].double(), -1)
                entropy = -(logp.exp() * logp).sum()
                assert float(ent[i, t]) == pytest.approx(float(entropy), rel=1e-5, abs=1e-6)
                assert float(old_lp[i, t]) == pytest.approx(float(logp[responses[i, t]]),
                                                            rel=1e-5, abs=1e-6)
    assert torch.equal(seen["pos"], rewards > 0)
    assert seen["g"].tolist() == [i // 4 for i in range(12)]
    torch.testing.assert_close(seen["a"], est.group_advantages(rewards, 4))
    torch.testing.assert_close(token_adv, seen["a"][:, None] * mask)


@pytest.mark.parametrize("strategy", pw.list_strategies())
def test_every_strategy_the_command_line_offers_runs(strategy):
    """Catches a strategy of ``--strategy``'s choices that fails in the loop (GTPO needs the
    prompt groups)."""
    history = ex.main(steps=2, strategy=strategy, prompts_per_step=4, log_every=0)
    assert len(history) == 2 and all(0.0 <= r <= 1.0 for r in history)
