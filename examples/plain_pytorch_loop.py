"""PEPO in a hand-written PyTorch loop: the core library (torch alone), no recipe, no framework.

The loop a user of ``import pepo.weighting`` writes around their own policy:

1. sample a group of responses per prompt from the policy, and mask everything after EOS;
2. one forward pass without grad: shift the logits against the response tokens, and get the
   rollout policy's log-probs and the entropies from it at once (``pepo.entropy``);
3. score the responses, turn rewards into group advantages (``pepo.estimators``) and the
   advantages into token advantages with a strategy (``pepo.weighting``);
4. the update in micro-batches, each loss divided by the *whole* batch's valid-token count
   (``num_tokens``), so that the accumulated gradient is the full batch's gradient exactly.

The task is small enough to learn in a minute on a CPU: the prompt is ``a + b =`` with digits
``a, b``, the reward is 1 when the response's first token is ``(a + b) mod 10``; a response is up
to four tokens and ends at EOS. Run it::

    python examples/plain_pytorch_loop.py --strategy proximal_softmax     # 400 steps, ~20 s
"""

from __future__ import annotations

import argparse

import torch

import pepo.estimators as est
import pepo.weighting as pw
from pepo.entropy import logprobs_and_entropy
from pepo.loss import clipped_policy_loss

PLUS, EQUALS, EOS, PAD = 10, 11, 12, 13  # ids 0-9 are the digits
VOCAB, MAX_NEW = 14, 4


class Policy(torch.nn.Module):
    """A one-layer GRU language model over the 14 tokens."""

    def __init__(self, dim: int = 64):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, dim)
        self.gru = torch.nn.GRU(dim, dim, batch_first=True)
        self.head = torch.nn.Linear(dim, VOCAB)

    def forward(self, tokens: torch.Tensor, state=None):
        out, state = self.gru(self.embed(tokens), state)
        return self.head(out), state  # logits [B, S, V]: position s predicts token s + 1


@torch.no_grad()
def sample(policy: Policy, prompts: torch.Tensor, generator: torch.Generator):
    """Responses ``[B, MAX_NEW]`` and their mask: True up to and including the first EOS, False
    after it (those positions hold PAD and never enter a loss)."""
    logits, state = policy(prompts)
    out = torch.full((len(prompts), MAX_NEW), PAD, dtype=torch.long)
    done = torch.zeros(len(prompts), dtype=torch.bool)
    mask = torch.zeros(len(prompts), MAX_NEW, dtype=torch.bool)
    for t in range(MAX_NEW):
        probs = torch.softmax(logits[:, -1], dim=-1)
        tok = torch.multinomial(probs, 1, generator=generator).squeeze(1)
        mask[:, t] = ~done
        out[:, t] = tok.masked_fill(done, PAD)
        done |= tok == EOS
        logits, state = policy(out[:, t : t + 1], state)
    return out, mask


def response_logits(policy: Policy, prompts: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
    """Logits that score each response token: the forward of prompt + response, shifted by one
    (the logit at position s predicts token s + 1), cut to the response. ``[B, T, V]``."""
    logits, _ = policy(torch.cat([prompts, responses], dim=1))
    return logits[:, prompts.shape[1] - 1 : -1]


def rewards_of(prompts: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
    return (responses[:, 0] == (prompts[:, 0] + prompts[:, 2]) % 10).float()


def weigh_batch(policy, weigh, prompts, responses, mask, rewards, group_size):
    """Step 2-3 for one batch: the rollout policy's log-probs and entropies from one forward
    without grad, group advantages, and the strategy's token advantages. Returns the three
    tensors the update needs (old log-probs, token advantages) and the entropies."""
    targets = responses.clamp_max(VOCAB - 1)  # PAD is a valid id; masked anyway
    with torch.no_grad():  # once per batch: old log-probs and entropies from one forward
        old_logprobs, entropies = logprobs_and_entropy(
            response_logits(policy, prompts, responses), targets)
    advantages = est.group_advantages(rewards, group_size)  # rows of a prompt are contiguous
    groups = torch.arange(len(prompts)) // group_size  # which prompt each row answers (GTPO)
    token_adv = weigh(advantages, entropies, mask, positive=rewards > 0, groups=groups)
    return old_logprobs, token_adv, entropies


def update(policy, optimizer, prompts, responses, mask, old_logprobs, token_adv, micro_batch):
    """One optimizer step over the batch in micro-batches. Each micro-batch's loss is divided by
    the whole batch's valid tokens (``num_tokens``), so the summed gradients equal those of one
    full-batch loss (a per-micro-batch mean would weight short micro-batches' tokens more)."""
    n_tokens = int(mask.sum())
    optimizer.zero_grad()
    total = 0.0
    for i in range(0, len(prompts), micro_batch):
        mb = slice(i, i + micro_batch)
        logprobs, _ = logprobs_and_entropy(response_logits(policy, prompts[mb], responses[mb]),
                                           responses[mb].clamp_max(VOCAB - 1))
        loss = clipped_policy_loss(logprobs, old_logprobs[mb], token_adv[mb], mask[mb],
                                   eps_low=0.2, eps_high=0.28, num_tokens=n_tokens)
        loss.backward()
        total += float(loss.detach())
    optimizer.step()
    return total


def main(steps: int = 400, strategy: str = "proximal_softmax", prompts_per_step: int = 16,
         group_size: int = 8, micro_batch: int = 32, lr: float = 3e-3, seed: int = 0,
         log_every: int = 50) -> list[float]:
    """Trains a fresh policy; returns the mean reward of every step."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    policy = Policy()
    optimizer = torch.optim.AdamW(policy.parameters(), lr=lr)
    # the paper's PEPO: window 101, temperature 1, weights on the successful rollouts
    params = {"proximal_softmax": {"window": 101, "temperature": 1.0, "apply_to": "positive"}}
    weigh = pw.get_strategy(strategy, **params.get(strategy, {}))
    history = []
    for step in range(1, steps + 1):
        digits = torch.randint(0, 10, (prompts_per_step, 2), generator=gen)
        prompts = torch.stack([digits[:, 0], torch.full_like(digits[:, 0], PLUS), digits[:, 1],
                               torch.full_like(digits[:, 0], EQUALS)], dim=1)
        prompts = prompts.repeat_interleave(group_size, dim=0)  # G rollouts per prompt, contiguous
        responses, mask = sample(policy, prompts, gen)
        rewards = rewards_of(prompts, responses)
        old_logprobs, token_adv, entropies = weigh_batch(policy, weigh, prompts, responses, mask,
                                                         rewards, group_size)
        # one optimizer step a batch: the update starts from the rollout policy, so its ratio
        # is 1 and the clip never binds; it matters with several mini-batches or epochs
        update(policy, optimizer, prompts, responses, mask, old_logprobs, token_adv, micro_batch)
        history.append(float(rewards.mean()))
        if log_every and (step % log_every == 0 or step == 1):
            print(f"step {step:4d}  reward {history[-1]:.3f}  mean entropy "
                  f"{float(entropies[mask].mean()):.3f}  tokens {int(mask.sum())}", flush=True)
    return history


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--strategy", default="proximal_softmax", choices=pw.list_strategies())
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    if a.steps < 1:
        ap.error(f"--steps must be >= 1, got {a.steps}")
    h = main(steps=a.steps, strategy=a.strategy, seed=a.seed)
    n = min(10, len(h))
    print(f"mean reward: first {n} steps {sum(h[:n]) / n:.3f}, "
          f"last {n} steps {sum(h[-n:]) / n:.3f}")
