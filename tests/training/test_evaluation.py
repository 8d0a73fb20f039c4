"""avg@k (pepo.training.evaluation) through a recording engine: what reaches the decoder, and
what counts as a success."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch

from pepo.training.evaluation import avg_at_k
from pepo.training.generation import Rollouts
from pepo.training.rollouts import is_success


class RecordingEngine:
    """A rollout engine that answers every prompt with its row number (one token, a stop
    token) and records the keyword arguments of each call."""

    def __init__(self):
        self.calls: list[dict] = []

    def generate(self, prompts, **kwargs):
        self.calls.append(kwargs)
        b = len(prompts)
        return Rollouts(prompt_tokens=torch.ones(b, 1, dtype=torch.long),
                        prompt_mask=torch.ones(b, 1, dtype=torch.bool),
                        tokens=torch.arange(b)[:, None], mask=torch.ones(b, 1, dtype=torch.bool),
                        finished=torch.ones(b, dtype=torch.bool), logprobs=torch.zeros(b, 1))


class RowTokenizer:
    pad_id, stop_tokens = 0, (7,)

    def encode_prompt(self, prompt):
        return [1]

    def decode(self, ids):
        return str(ids[0])


class PartialCredit:
    """Rewards in (0, 1]: 1.0 for even rows, 0.25 for odd ones; a success needs >= 0.5."""

    def __call__(self, responses, answers):
        return [1.0 if int(r) % 2 == 0 else 0.25 for r in responses]

    @staticmethod
    def success(rewards):
        return rewards >= 0.5


PROBLEMS = [SimpleNamespace(prompt=f"p{i}", answer="0", id=i) for i in range(3)]


def test_avg_at_k_decodes_with_the_callers_sampling_settings():
    """Catches avg@k (validation, ``pepo_eval``) sampling with the defaults (T = 1, top-p 1)
    instead of the config's, or dropping ``stop_tokens`` for the tokenizer's."""
    engine = RecordingEngine()
    avg_at_k(engine, RowTokenizer(), PROBLEMS, 4, PartialCredit(), max_new_tokens=9,
             temperature=0.6, top_k=5, top_p=0.7, stop_tokens=[3, 4], batch_size=8,
             generator=torch.Generator().manual_seed(0))
    (call,) = engine.calls
    assert (call["max_new_tokens"], call["temperature"], call["top_k"], call["top_p"]) == (
        9, 0.6, 5, 0.7)
    assert call["stop_tokens"] == [3, 4] and call["batch_size"] == 8
    assert call["seeds"].shape == (12,)
    avg_at_k(engine, RowTokenizer(), PROBLEMS, 1, PartialCredit(), max_new_tokens=9)
    assert engine.calls[-1]["stop_tokens"] == [7]  # none given: the tokenizer's


def test_a_rewards_own_success_rule_decides_avg_at_k_and_the_records():
    """Partial credit: 0.25 is a reward above 0 but not a success. Catches ``rewards > 0`` used
    where the reward defines ``success`` (avg@k would be 1.0, every record a success)."""
    records: list[dict] = []
    got = avg_at_k(RecordingEngine(), RowTokenizer(), PROBLEMS, 2, PartialCredit(),
                   max_new_tokens=4, records=records)
    assert got == pytest.approx(3 / 6)  # rows 0, 2, 4 of 6
    assert [r["success"] for r in records] == [True, False] * 3
    assert [r["reward"] for r in records] == [1.0, 0.25] * 3
    rewards = torch.tensor([1.0, 0.25, 0.0, 0.5])
    assert is_success(PartialCredit(), rewards).tolist() == [True, False, False, True]
    assert is_success(lambda r, a: r, rewards).tolist() == [True, True, False, True]
    with pytest.raises(ValueError):
        is_success(SimpleNamespace(success=lambda r: r), rewards)  # not bool flags


def test_a_process_with_no_rollouts_of_its_own_samples_none_and_scores_none():
    """A validation or an offline prior of fewer rollouts than processes leaves some process an
    empty share: it raised in pad_prompts ("every prompt needs at least one token") after the
    engine's gather, while the others waited in theirs. Catches the in-process engine, the
    reward call or avg@k's tally not taking an empty share (with a stand-in of two processes
    where this one, rank 1, gets none of 1 rollout)."""
    from pepo.training.engines import InProcessEngine
    from pepo.training.models import tiny_qwen3
    from pepo.training.rollouts import sample_and_score

    ro = InProcessEngine(tiny_qwen3(vocab_size=16)).generate(
        [], max_new_tokens=3, pad_id=0, stop_tokens=[1])
    assert ro.tokens.shape == (0, 1) and ro.mask.shape == (0, 1) and ro.finished.shape == (0,)

    def reward(responses, answers):
        pytest.fail("the reward was asked about no responses")

    ro, rewards, texts = sample_and_score(RecordingEngine(), RowTokenizer(), [], reward,
                                          stop_tokens=[7], max_new_tokens=2)
    assert rewards.shape == (0,) and texts == []

    class SecondOfTwo:
        enabled, is_main, world_size = True, False, 2

        def shard(self, n):
            return slice(n, n)  # rank 1 of 2, n = 1: nothing

        def sum(self, t):
            return t + torch.tensor([1.0, 1.0])  # rank 0's one success of one

    assert avg_at_k(RecordingEngine(), RowTokenizer(), PROBLEMS[:1], 1, PartialCredit(),
                    dist=SecondOfTwo(), max_new_tokens=2) == 1.0


def test_a_success_rule_of_the_wrong_shape_is_refused():
    """Catches a custom ``success`` returning one flag for the whole batch, or a
    column (``[B, 1]``), taken: avg@k would count it broadcast or as one rollout."""
    class OneFlag:
        def __init__(self, shape_of):
            self.shape_of = shape_of

        def success(self, rewards):
            return self.shape_of(rewards)

    rewards = torch.tensor([1.0, 0.25, 1.0])
    for bad, shape in ((lambda r: torch.tensor(True), []), (lambda r: (r >= 0.5)[:, None], [3, 1]),
                       (lambda r: (r >= 0.5)[:2], [2])):
        with pytest.raises(ValueError, match=rf"success must return a bool tensor of shape \[3\], "
                                             rf"got dtype torch.bool and shape "
                                             rf"{re.escape(str(shape))}"):
            is_success(OneFlag(bad), rewards)
    assert is_success(OneFlag(lambda r: r >= 0.5), rewards).tolist() == [True, False, True]


def test_given_seeds_are_the_ones_sampled_with_and_the_generator_is_left_alone():
    """``seeds`` seed each rollout; only without them are they drawn from
    ``generator``. Catches seeds given by the caller (the recipe's, drawn for the whole batch
    before it is split among ranks) replaced by new draws from the generator, which would also
    move the generator's stream."""
    from pepo.training.rollouts import sample_and_score

    engine = RecordingEngine()
    g = torch.Generator().manual_seed(5)
    before = g.get_state()
    seeds = torch.tensor([11, 12, 13])
    sample_and_score(engine, RowTokenizer(), PROBLEMS, PartialCredit(), stop_tokens=[7],
                     generator=g, seeds=seeds, max_new_tokens=2)
    assert torch.equal(engine.calls[-1]["seeds"], seeds)
    assert torch.equal(g.get_state(), before)
    sample_and_score(engine, RowTokenizer(), PROBLEMS, PartialCredit(), stop_tokens=[7],
                     generator=g, max_new_tokens=2)  # none given: drawn from the generator
    from pepo.training.generation import draw_seeds

    assert torch.equal(engine.calls[-1]["seeds"],
                       draw_seeds(torch.Generator().manual_seed(5), 3))


def test_only_the_masked_tokens_of_a_response_are_decoded():
    """(Pepo's tokenizers drop the special pad and stop tokens when decoding, so this is
    latent with them.) Catches the right-padding after a response decoded with it: with a tokenizer
    whose pad id is an ordinary token, a reward would score ``"5 6 0 0"`` for ``"5 6"``."""
    from pepo.training.rollouts import sample_and_score

    class Padded(RecordingEngine):
        def generate(self, prompts, **kwargs):
            b = len(prompts)
            tokens = torch.tensor([[5, 6, 0, 0], [8, 0, 0, 0], [4, 3, 2, 9]])[:b]
            return Rollouts(prompt_tokens=torch.ones(b, 1, dtype=torch.long),
                            prompt_mask=torch.ones(b, 1, dtype=torch.bool), tokens=tokens,
                            mask=tokens != 0, finished=torch.ones(b, dtype=torch.bool),
                            logprobs=torch.zeros(b, 4))

    class Joining(RowTokenizer):
        def decode(self, ids):
            return " ".join(map(str, ids))

    _, _, texts = sample_and_score(Padded(), Joining(), PROBLEMS, AlwaysRight(),
                                   stop_tokens=[7], max_new_tokens=4)
    assert texts == ["5 6", "8", "4 3 2 9"]


class AlwaysRight:
    """A reward of 1.0 for every response (it reads none)."""

    def __call__(self, responses, answers):
        return [1.0] * len(responses)


def test_a_model_is_sampled_in_process_where_an_engine_is_expected():
    """``sample_and_score`` takes a bare module too (what a user's own loop holds): catches it
    called as an engine (``Module.generate`` does not exist). Its rollouts are the in-process
    engine's, token for token."""
    from pepo.training.engines import InProcessEngine
    from pepo.training.models import tiny_qwen3
    from pepo.training.rollouts import sample_and_score

    torch.manual_seed(0)
    model = tiny_qwen3(vocab_size=16)
    kw = dict(stop_tokens=[7], max_new_tokens=3, seeds=torch.tensor([1, 2, 3]))
    ro, rewards, texts = sample_and_score(model, RowTokenizer(), PROBLEMS, PartialCredit(), **kw)
    want = sample_and_score(InProcessEngine(model), RowTokenizer(), PROBLEMS, PartialCredit(),
                            **kw)
    assert torch.equal(ro.tokens, want[0].tokens) and torch.equal(rewards, want[1])
    assert texts == want[2] and ro.tokens.shape[0] == 3
