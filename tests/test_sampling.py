"""pepo.sampling: the resumable prompt order and SPO's prioritised sampling."""

import pytest
import torch

from pepo.sampling import PromptSampler, prioritized_sample


def test_sampler_covers_each_epoch_and_resumes():
    s = PromptSampler(10, seed=3)
    first = s.next(7) + s.next(7)  # crosses into epoch 1
    assert sorted(first[:10]) == list(range(10))
    state = s.state_dict()
    cont = s.next(9)
    t = PromptSampler(10, seed=3)
    t.load_state_dict(state)
    assert t.next(9) == cont
    with pytest.raises(ValueError, match="dataset of 10 items"):
        PromptSampler(11).load_state_dict(state)
    # a damaged state: position -2 drew repeats within an epoch, 10 an empty slice
    for bad in ({"epoch": 1, "position": -2}, {"epoch": 1, "position": 10},
                {"epoch": -1, "position": 0}, {"epoch": 1.0, "position": 3}):
        with pytest.raises(ValueError, match="is not a place in a dataset of 10 items"):
            t.load_state_dict({**state, **bad})


def test_sampler_refuses_a_count_or_size_that_is_not_a_positive_int():
    """``next(0)`` and ``next(-1)`` returned [] (a step of no prompts, in silence) and a float
    size failed inside torch: each is one line naming the value."""
    s = PromptSampler(10, seed=3)
    for k in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match=rf"k must be an int >= 1 .*got {k!r}"):
            s.next(k)
    assert s.state_dict() == {"epoch": 0, "position": 0, "size": 10}  # nothing drawn
    with pytest.raises(ValueError, match=r"size must be an int .*got 3.5"):
        PromptSampler(3.5)
    with pytest.raises(ValueError, match=r"seed must be an int, got '1'"):
        PromptSampler(10, seed="1")
    with pytest.raises(ValueError, match=r"seed must be an int, got True"):
        PromptSampler(10, seed=True)
    import numpy as np  # a numpy integer is an int (operator.index takes it)

    assert PromptSampler(np.int64(10), seed=np.int32(3)).next(4) == PromptSampler(10, 3).next(4)


def test_sampler_order_depends_on_the_seed_and_the_epoch():
    """Catches a sampler that ignores its seed, or repeats one permutation every epoch."""
    a, b = PromptSampler(50, seed=3), PromptSampler(50, seed=4)
    first, second = a.next(50), a.next(50)
    assert sorted(first) == sorted(second) == list(range(50))
    assert first != second  # epoch 1 is another permutation
    assert b.next(50) != first  # another seed, another order
    assert PromptSampler(50, seed=3).next(100) == first + second  # the same seed, the same


def test_prioritized_sample_follows_weights():
    g = torch.Generator().manual_seed(0)
    w = torch.tensor([1.0, 1.0, 8.0, 1e-6])
    counts = torch.zeros(4)
    for _ in range(2000):
        counts[prioritized_sample(w, 1, g)[0]] += 1
    torch.testing.assert_close(counts / 2000, w / w.sum(), atol=0.03, rtol=0)
    assert sorted(prioritized_sample(w, 10, g)) == [0, 1, 2, 3]  # k > N: everything once
    with pytest.raises(ValueError, match="finite and > 0"):
        prioritized_sample(torch.tensor([1.0, 0.0]), 1, g)


def test_a_seeds_epochs_are_not_another_seeds_shifted():
    """Seed s at epoch 1 is not seed s + 1 at epoch 0: catches a permutation seeded by
    ``seed + epoch``, which made every seed replay its neighbour's order one epoch late."""
    a = PromptSampler(10, seed=0)
    a.next(10)
    assert a.next(10) != PromptSampler(10, seed=1).next(10)
