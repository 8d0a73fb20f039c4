"""What a reward function returns, checked before it becomes a tensor (issue: bad returns)."""

from __future__ import annotations

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
