"""What a reward function returns, checked before it becomes a tensor (issue: bad returns)."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from pepo.training.evaluation import RewardError, reward_tensor
from tests.recipe_helpers import BadReward


@pytest.mark.parametrize("value, shown", [
    (None, "returned None (NoneType) for response 2"),
    ("1.0", "returned '1.0' (str) for response 2"),
    ([1.0], "returned [1.0] (list) for response 2"),
    (1e300, "returned 1e+300 for response 2; rewards must be finite numbers within float32's"),
    (float("nan"), "returned nan for response 2; rewards must be finite numbers"),
    (float("-inf"), "returned -inf for response 2"),
    (torch.tensor([1.0, 2.0]), "returned tensor([1., 2.]) (Tensor) for response 2"),
])
def test_a_bad_value_is_named_as_returned_with_the_component(value, shown):
    fn = BadReward(value)
    with pytest.raises(RewardError) as e:
        reward_tensor(fn(["a", "b", "c"], ["1"] * 3), 3, fn)
    msg = str(e.value)
    assert msg.startswith("reward tests.recipe_helpers.BadReward ") and shown in msg, msg
    assert "inf" not in msg or value == float("-inf")  # 1e300 is not reported as the cast's inf


def test_wrong_count_and_non_lists_are_named():
    def score(responses, answers):
        return 1.0

    with pytest.raises(RewardError,
                       match=r"reward .*score must return a list of 3 numbers .* got float 1\.0"):
        reward_tensor(score(None, None), 3, score)
    with pytest.raises(RewardError, match="returned 2 values for 3 responses"):
        reward_tensor([1.0, 0.0], 3, score)
    with pytest.raises(RewardError, match="got str 'abc'"):
        reward_tensor("abc", 3, score)


@pytest.mark.parametrize("values", [
    [1, 0.5, -2.0], [True, False, True], np.array([1.0, 0.5, -2.0]),
    [np.float32(1.0), np.int64(0), np.float64(-2.0)], torch.tensor([1.0, 0.5, -2.0]),
    [torch.tensor(1.0), torch.tensor(0.5), torch.tensor(-2)], (3.0e38, -3.0e38, 0),
])
def test_good_values_of_every_usual_type_pass_exactly(values):
    out = reward_tensor(values, 3, BadReward(None))
    expected = [float(v) for v in (values.tolist() if hasattr(values, "tolist") else values)]
    assert out.dtype == torch.float32 and out.shape == (3,)
    assert out.tolist() == torch.tensor(expected, dtype=torch.float32).tolist()


def test_an_estimators_reward_range_names_the_first_value_outside():
    """Catches the bounds read the wrong way round (1.5 let through, 0 refused), the first
    value outside not the one named, and a range required of estimators that declare none."""
    from pepo.estimators import build_estimator
    from pepo.training.rollouts import check_reward_range

    spo, group = build_estimator("single_stream"), build_estimator("group")
    fn = BadReward(None)
    check_reward_range(torch.tensor([0.0, 1.0, 0.5]), fn, spo)  # the ends are in range
    for bad, i, shown in ((torch.tensor([0.0, 1.5, -1.0]), 1, "1.5"),
                          (torch.tensor([1.0, 0.0, -0.25]), 2, "-0.25")):
        with pytest.raises(RewardError) as e:
            check_reward_range(bad, fn, spo)
        assert str(e.value).startswith(
            f"reward tests.recipe_helpers.BadReward returned {shown} for response {i}; the "
            f"single_stream estimator takes rewards in [0, 1]"), str(e.value)
        check_reward_range(bad, fn, group)  # group advantages take any finite reward


class _Est:
    """A registered estimator's two per-step calls, returning what it is given."""

    name = "test_est"

    def __init__(self, adv=None, picked=None):
        self.adv, self.picked = adv, picked

    def advantages(self, prompt_ids, rewards):
        return self.adv

    def choose(self, prompt_ids, k, generator):
        return self.picked


@pytest.mark.parametrize("adv, message", [
    ([0.5, -0.5, 0.0], r"advantages\(\) returned a list, not a float tensor of shape \[3\]"),
    (torch.zeros(2), r"advantages\(\) returned a torch.float32 tensor of shape \[2\], not a "
                     r"float tensor of shape \[3\] \(one per rollout\)"),
    (torch.zeros(3, dtype=torch.long),
     r"advantages\(\) returned a torch.int64 tensor of shape \[3\]"),
    (torch.tensor([0.5, float("nan"), float("inf")]),
     r"advantages\(\) returned 2 non-finite values of 3 from finite rewards"),
])
def test_a_registered_estimators_advantages_are_checked(adv, message):
    """A list (an AttributeError in the recipe), a wrong length (named no estimator), a NaN
    (skipped step after step by the loss guard). Catches each reaching the update."""
    from pepo.training.rollouts import ComponentError, advantages_of

    with pytest.raises(ComponentError, match=r"^estimator 'test_est': " + message):
        advantages_of(_Est(adv=adv), ["a", "a", "b"], torch.ones(3))
    good = torch.tensor([0.5, -0.5, 0.0])
    assert advantages_of(_Est(adv=good), ["a", "a", "b"], torch.ones(3)) is good


@pytest.mark.parametrize("picked", [[0, 1], [0, 0, 1], [0, 1, 5], [0, 1, -1], [0.5, 1, 2], None])
def test_a_registered_estimators_choice_is_k_distinct_indices_into_the_pool(picked):
    """k - 1 indices trained on fewer prompts in silence; a repeat, an index past the pool or
    negative (Python's from-the-end), a float, None. Catches each taken."""
    from pepo.training.rollouts import ComponentError, choice_of

    with pytest.raises(ComponentError, match=r"^estimator 'test_est': choose\(\) must return 3 "
                                             r"distinct indices into the pool of 4 candidates"):
        choice_of(_Est(picked=picked), list("abcd"), 3, None)
    assert choice_of(_Est(picked=torch.tensor([3, 0, 1])), list("abcd"), 3, None) == [3, 0, 1]


def test_more_values_than_responses_and_a_huge_negative_reward_are_named():
    """Catches a reward that returns more values than responses taken (the
    rewards no longer line up with the rollouts; the extra ones would be given to nothing),
    and -1e300, which float32 makes -inf, let through because only the upper end was
    checked."""
    from pepo.training.rollouts import reward_tensor

    fn = BadReward(None)
    with pytest.raises(RewardError, match="returned 4 values for 3 responses"):
        reward_tensor([1.0, 0.0, 1.0, 0.0], 3, fn)
    with pytest.raises(RewardError, match=r"returned -1e\+300 for response 1; rewards must be "
                                          r"finite numbers within float32's range"):
        reward_tensor([0.0, -1e300, 0.0], 3, fn)
    out = reward_tensor([-3.0e38, 0.0, 3.0e38], 3, fn)  # within float32 either way: kept
    assert out.tolist() == torch.tensor([-3.0e38, 0.0, 3.0e38], dtype=torch.float32).tolist()


def test_advantages_of_another_shape_with_as_many_values_are_refused():
    """Catches advantages of shape ``[N, 1]`` (or ``[1, N]``) taken because they
    hold N values: broadcast against ``[N, T]`` token losses, a column is right by luck but a
    row ``[1, N]`` weights every rollout by every other's advantage."""
    from pepo.training.rollouts import ComponentError, advantages_of

    for bad, shape in ((torch.zeros(3, 1), "[3, 1]"), (torch.zeros(1, 3), "[1, 3]")):
        with pytest.raises(ComponentError, match=rf"returned a torch.float32 tensor of shape "
                                                 rf"{re.escape(shape)}, not a float tensor of "
                                                 rf"shape \[3\]"):
            advantages_of(_Est(adv=bad), ["a", "a", "b"], torch.ones(3))
