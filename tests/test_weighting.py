"""pepo.weighting against the slow references of tests/reference.py."""

import math
import re
import types

import numpy as np
import pytest
import torch

import pepo.weighting as pw
from pepo._windows import reflect_index
from tests import reference as ref
from tests.conftest import ragged_batch

# fp32 results vs float64 references. Windowed sums add at most W positive terms, so the
# relative error is O(W * 2^-24) in the worst case and far below in practice.
RTOL32, ATOL32 = 2e-5, 1e-7

W_SMALL = 5
# Lengths 1..W+1 (every reflection regime, including rows shorter than the half-window),
# plus longer rows.
LENGTHS_SMALL = list(range(1, W_SMALL + 2)) + [11, 17]
LENGTHS_101 = [1, 2, 3, 49, 50, 51, 52, 100, 101, 102, 257]


def close(actual: torch.Tensor, expected: np.ndarray, rtol=RTOL32, atol=ATOL32):
    np.testing.assert_allclose(actual.double().numpy(), expected, rtol=rtol, atol=atol)


# ---------------------------------------------------------------------------- reflect padding


def test_reflect_index_matches_numpy_pad_including_repeated_reflection():
    for n in range(1, 13):
        half = 30
        expected = np.pad(np.arange(n), half, mode="reflect")
        j = torch.arange(-half, n + half)
        got = reflect_index(j, torch.tensor(n))
        assert got.tolist() == expected.tolist(), n


# ---------------------------------------------------------------------------- proximal entropy


@pytest.mark.parametrize("holes", [False, True])
@pytest.mark.parametrize(
    "window,lengths",
    [(1, [1, 2, 7]), (3, [1, 2, 3, 4, 9]), (W_SMALL, LENGTHS_SMALL), (101, LENGTHS_101)],
)
@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_proximal_entropy_matches_reference(window, lengths, holes, temperature):
    t_max = max(lengths) + (13 if holes else 3)
    _, ent, mask = ragged_batch(lengths, t_max, holes=holes, seed=window)
    got = pw.proximal_entropy(ent, mask, window=window, temperature=temperature)
    assert got.dtype == torch.float32
    close(got, ref.proximal_entropy(ent, mask, window, temperature))
    assert (got[~mask] == 0).all()


def test_tolerance_can_fail_on_wrong_padding_mode():
    # The comparison above distinguishes reflect from numpy's 'symmetric' (edge repeated) and
    # 'edge' padding: our tolerance is far tighter than the difference.
    _, ent, mask = ragged_batch([40], 40, seed=3)
    got = pw.proximal_entropy(ent, mask, window=11).double().numpy()[0]
    v = ref.valid_values(ent[0].double(), mask[0])
    for mode in ("symmetric", "edge"):
        other = ref.proximal_entropy_row(v, 11, 1.0, pad_mode=mode)
        assert not np.allclose(got, other, rtol=RTOL32, atol=ATOL32)


def test_row_of_length_one_sees_itself_w_times():
    ent = torch.tensor([[0.7, float("nan")]])
    mask = torch.tensor([[True, False]])
    e = pw.proximal_entropy(ent, mask, window=101)
    assert e[0, 0].item() == pytest.approx(1 / 101, rel=1e-6)
    out = pw.get_strategy("proximal_softmax")(torch.tensor([2.0]), ent, mask)
    assert out.tolist() == [[pytest.approx(2.0, rel=1e-6), 0.0]]


def test_proximal_entropy_hand_worked():
    # H = [0, ln 2, 0], W = 3, reflect pad -> [ln2, 0, ln2, 0, ln2].
    # t=0: window [ln2, 0, ln2] -> e = 1 / (2 + 1 + 2) = 0.2
    # t=1: window [0, ln2, 0]   -> e = 2 / (1 + 2 + 1) = 0.5
    # t=2: window [ln2, 0, ln2] -> e = 0.2
    ent = torch.tensor([[0.0, math.log(2.0), 0.0]])
    e = pw.proximal_entropy(ent, torch.ones(1, 3, dtype=torch.bool), window=3)
    torch.testing.assert_close(e, torch.tensor([[0.2, 0.5, 0.2]]), rtol=1e-6, atol=1e-7)
    # c = e / 0.9 * 3 and the advantage 1.5 of a positive row multiplies it.
    out = pw.get_strategy("proximal_softmax", window=3)(
        torch.tensor([1.5]), ent, torch.ones(1, 3, dtype=torch.bool)
    )
    torch.testing.assert_close(
        out, 1.5 * torch.tensor([[0.2, 0.5, 0.2]]) / 0.9 * 3, rtol=1e-6, atol=1e-6
    )


@pytest.mark.parametrize("name, row_ref, t, seed", [
    ("proximal_entropy", ref.proximal_entropy_row_fast, 32768, 0),
    ("window_average_entropy", ref.window_average_row_fast, 65536, 1),
])
def test_long_rows_stay_accurate(name, row_ref, t, seed):
    """32k- and 64k-token rows: catches window sums taken as differences of one cumulative sum
    over the row, whose fp32 rounding grows with the row's length (~4 digits lost at 32k for
    the proximal entropy; 6e-5 relative for the window average at 64k)."""
    g = torch.Generator().manual_seed(seed)
    ent = torch.rand(2, t, generator=g) * 3
    mask = torch.ones(2, t, dtype=torch.bool)
    mask[1, t - t // 10:] = False
    got = getattr(pw, name)(ent, mask, window=101)
    for i in range(2):
        v = ref.valid_values(ent[i].double(), mask[i])
        close(got[i], ref.scatter_back(row_ref(v, 101), mask[i]))


def test_wide_range_takes_exact_log_path():
    # Temperature 0.05 scales entropies in [0, 12) to [0, 240): fp32 exp underflows for a
    # shifted-exp formulation; the result must still match the reference.
    adv, ent, mask = ragged_batch([1, 7, 30, 64], 64, seed=5, scale=12.0)
    got = pw.proximal_entropy(ent, mask, window=9, temperature=0.05)
    assert torch.isfinite(got).all()
    close(got, ref.proximal_entropy(ent, mask, 9, 0.05), rtol=5e-5, atol=1e-7)


def test_fast_and_log_paths_agree():
    from pepo._windows import Rows, proximal_compact

    _, ent, mask = ragged_batch([1, 5, 50, 300], 300, seed=9)
    rows = Rows(torch.where(mask, ent, 0.0), mask)
    shift = rows.x.amax(dim=1)
    fast = proximal_compact(rows, 101, 1.0, exact_log=False, shift=shift)
    slow = proximal_compact(rows, 101, 1.0, exact_log=True, shift=shift)
    valid = torch.arange(300) < rows.lengths[:, None]
    torch.testing.assert_close(fast[valid], slow[valid], rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs_are_upcast(dtype):
    _, ent, mask = ragged_batch([3, 20, 64], 64, seed=2, dtype=dtype)
    got = pw.proximal_entropy(ent, mask, window=11)
    assert got.dtype == torch.float32
    close(got, ref.proximal_entropy(ent.float(), mask, 11))  # reference from the same values


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["proximal_softmax", "window_average", "entropy_bonus",
                                  "global_topk", "gtpo"])
def test_strategies_upcast_low_precision_entropies(name, dtype):
    """A bf16/fp16 batch gives what the fp32 reference gives on the same values: catches a
    strategy computing in the input's dtype (cleaning the entropies without upcasting put
    ``proximal_softmax`` 1e-2 off)."""
    adv, ent, mask = ragged_batch([3, 20, 64], 64, seed=2, dtype=dtype, holes=True)
    positive = torch.tensor([True, False, True])
    groups = torch.tensor([0, 0, 0])
    params = {"window": 11} if name in ("proximal_softmax", "window_average") else {}
    got = pw.get_strategy(name, **params)(adv, ent, mask, positive=positive, groups=groups)
    assert got.dtype == torch.float32
    e = ent.float()
    if name == "proximal_softmax":
        want = ref.multiplicative(adv, e, mask, lambda v: ref.proximal_entropy_row(v, 11),
                                  "positive", positive)
    elif name == "window_average":
        want = ref.multiplicative(adv, e, mask, lambda v: ref.window_average_row(v, 11),
                                  "positive", positive)
    elif name == "entropy_bonus":
        want = ref.entropy_bonus(adv, e, mask, 0.4, 2.0)
    elif name == "global_topk":
        want = ref.global_topk(adv, e, mask, 0.2)
    else:
        want = ref.gtpo(e, mask, positive, groups, 1.0, 0.1, 1e-8, "group")
    close(got, want, rtol=1e-5 if name == "gtpo" else RTOL32, atol=1e-5 if name == "gtpo" else 1e-6)


def test_padded_row_equals_row_alone():
    adv, ent, mask = ragged_batch([9, 37, 60], 64, holes=True, seed=4)
    batch = pw.proximal_entropy(ent, mask, window=7)
    for i in range(3):
        alone = ent[i][mask[i]][None, :]
        single = pw.proximal_entropy(alone, torch.ones_like(alone, dtype=torch.bool), window=7)
        torch.testing.assert_close(batch[i][mask[i]], single[0], rtol=1e-6, atol=1e-8)


# ---------------------------------------------------------------------------- strategies


@pytest.mark.parametrize("holes", [False, True])
@pytest.mark.parametrize("apply_to", ["positive", "all"])
@pytest.mark.parametrize("window,lengths", [(W_SMALL, LENGTHS_SMALL), (101, LENGTHS_101)])
def test_proximal_softmax_matches_reference(window, lengths, apply_to, holes):
    adv, ent, mask = ragged_batch(lengths, max(lengths) + 5, holes=holes, seed=7)
    adv[0], adv[1] = 0.0, -0.5  # zero and negative rows are kept uniform under 'positive'
    got = pw.get_strategy("proximal_softmax", window=window, apply_to=apply_to)(adv, ent, mask)
    expected = ref.multiplicative(
        adv, ent, mask, lambda v: ref.proximal_entropy_row(v, window), apply_to
    )
    close(got, expected, rtol=RTOL32, atol=1e-6)
    # Weight-sum preservation: Σ_t Â = T_i A_i on every row.
    torch.testing.assert_close(got.sum(1), adv * mask.sum(1), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
@pytest.mark.parametrize("window,lengths", [(W_SMALL, LENGTHS_SMALL), (101, LENGTHS_101)])
def test_proximal_softmax_temperature_matches_reference(window, lengths, temperature):
    """Catches a strategy that drops its ``temperature`` (τ = 1 would be used for every τ)."""
    adv, ent, mask = ragged_batch(lengths, max(lengths) + 5, holes=True, seed=29, scale=3.0)
    s = pw.get_strategy("proximal_softmax", window=window, temperature=temperature, apply_to="all")
    expected = ref.multiplicative(
        adv, ent, mask, lambda v: ref.proximal_entropy_row(v, window, temperature), "all"
    )
    close(s(adv, ent, mask), expected, rtol=RTOL32, atol=1e-6)
    if temperature != 1.0:  # the comparison can tell the temperatures apart
        at_one = ref.multiplicative(
            adv, ent, mask, lambda v: ref.proximal_entropy_row(v, window), "all"
        )
        assert not np.allclose(s(adv, ent, mask).double().numpy(), at_one, rtol=RTOL32, atol=1e-6)


def test_global_topk_proximal_score_uses_the_temperature():
    adv, ent, mask = ragged_batch([10, 40, 64], 64, holes=True, seed=31, scale=3.0)
    for tau in (0.5, 2.0):
        got = pw.get_strategy("global_topk", score="proximal", window=11, temperature=tau)(
            adv, ent, mask
        )
        scores = torch.tensor(ref.proximal_entropy(ent, mask, 11, tau), dtype=torch.float32)
        close(got, ref.global_topk(adv, scores, mask, 0.2), rtol=0, atol=0)


@pytest.mark.parametrize("name", ["proximal_softmax", "window_average"])
def test_positive_flags_choose_the_weighted_rows(name):
    """The rows weighted under apply_to='positive' are those flagged ``positive`` (successful
    rollouts), not those with A > 0: a successful rollout with A <= 0 (SPO's batch-normalised
    advantages) is weighted, a failed one with A > 0 is not. Catches a strategy that keeps
    keying on the advantage's sign."""
    adv, ent, mask = ragged_batch([7, 9, 12, 5], 12, holes=True, seed=37)
    adv = torch.tensor([-0.7, 0.4, 1.3, -0.2])
    positive = torch.tensor([True, False, True, False])
    row = ref.proximal_entropy_row if name == "proximal_softmax" else ref.window_average_row
    s = pw.get_strategy(name, window=5)
    got = s(adv, ent, mask, positive=positive)
    close(
        got,
        ref.multiplicative(adv, ent, mask, lambda v: row(v, 5), "positive", positive),
        atol=1e-6,
    )
    # without flags the advantage's sign decides (rows 1 and 2 weighted)
    close(
        s(adv, ent, mask),
        ref.multiplicative(adv, ent, mask, lambda v: row(v, 5), "positive"),
        atol=1e-6,
    )
    assert not torch.allclose(got, s(adv, ent, mask))
    # 'all' ignores the flags
    every = pw.get_strategy(name, window=5, apply_to="all")
    assert torch.equal(
        every(adv, ent, mask, positive=positive), every(adv, ent, mask, positive=~positive)
    )


def test_positive_flags_are_checked():
    s = pw.get_strategy("proximal_softmax", window=3)
    adv, ent, mask = ragged_batch([4, 4], 4)
    with pytest.raises(ValueError, match=r"positive must be \[B\]=\[2\].*got \[3\]"):
        s(adv, ent, mask, positive=torch.tensor([True, False, True]))
    with pytest.raises(ValueError, match="positive must have dtype torch.bool"):
        s(adv, ent, mask, positive=torch.tensor([1.0, 0.0]))


@pytest.mark.parametrize("name", sorted(pw.list_strategies()))
def test_row_local_says_whether_rows_can_be_weighted_apart(name):
    """The recipe weights micro-batches apart when ``row_local`` (it then skips the old-policy
    pass): a strategy is row-local exactly when each half of a batch, weighted alone, gives
    that half of the whole batch's weights. Catches ``row_local`` set on GTPO (a group split
    across micro-batches is standardised in pieces) or on ``global_topk`` (a threshold per
    micro-batch), and a row-local strategy that reads other rows."""
    adv, ent, mask = ragged_batch([5, 3, 4, 6], 6, seed=3)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    groups, pos = torch.tensor([0, 1, 1, 0]), adv > 0  # each group split by the halves
    fn = pw.get_strategy(name, window=3) if name in ("proximal_softmax", "window_average") \
        else pw.get_strategy(name)
    whole = fn(adv, ent, mask, positive=pos, groups=groups)
    halves = torch.cat([fn(adv[i:i + 2], ent[i:i + 2], mask[i:i + 2], positive=pos[i:i + 2],
                           groups=groups[i:i + 2]) for i in (0, 2)])
    assert fn.row_local == torch.allclose(halves, whole, rtol=1e-6, atol=1e-6)
    assert fn.row_local == (name not in ("global_topk", "gtpo"))


def test_a_registered_strategy_is_not_row_local_unless_it_says_so():
    """Catches a default of True: the recipe would weight a registered strategy's rows per
    micro-batch, which is wrong for any that reads across rows."""
    @pw.register_strategy("test_rows", overwrite=True)
    def rows(local: bool = False):
        def fn(advantages, entropies, mask):
            return advantages[:, None].expand(mask.shape)
        if local:
            fn.row_local = True
        return fn

    try:
        assert not pw.get_strategy("test_rows").row_local
        assert pw.get_strategy("test_rows", local=True).row_local
    finally:
        pw._REGISTRY.pop("test_rows", None)


def test_custom_strategy_receives_positive_flags_when_it_asks():
    seen = {}

    @pw.register_strategy("test_flags", overwrite=True)
    def flags():
        def fn(advantages, entropies, mask, positive):
            seen["positive"] = positive.clone()
            return advantages[:, None].expand(mask.shape)
        return fn

    try:
        adv, ent, mask = ragged_batch([2, 3], 3)
        flags_in = torch.tensor([False, True])
        pw.get_strategy("test_flags")(adv, ent, mask, positive=flags_in)
        assert torch.equal(seen["positive"], flags_in)
        pw.get_strategy("test_flags")(torch.tensor([1.0, -1.0]), ent, mask)
        assert seen["positive"].tolist() == [True, False]  # default: A > 0
    finally:
        pw._REGISTRY.pop("test_flags", None)


def test_custom_strategy_with_var_keywords_receives_positive_and_groups():
    """A ``fn(advantages, entropies, mask, **kwargs)`` gets ``positive`` and ``groups`` as
    keywords. Catches a registry that passes only the keywords a fn names (a ``**kwargs`` fn then
    sees neither), and one that takes ``**kwargs`` for a demand for groups: such a strategy used
    to refuse to run without ``groups=`` and reported ``needs_groups``, so the recipe's
    single-stream mode and the TRL/verl adapters refused it."""
    seen = []

    @pw.register_strategy("test_var_keywords", overwrite=True)
    def var_keywords():
        def fn(advantages, entropies, mask, **kwargs):
            seen.append(dict(kwargs))
            return advantages[:, None].expand(mask.shape)
        return fn

    @pw.register_strategy("test_optional_groups", overwrite=True)
    def optional_groups():
        def fn(advantages, entropies, mask, groups=None):
            seen.append({"groups": groups})
            return advantages[:, None].expand(mask.shape)
        return fn

    try:
        adv, ent, mask = ragged_batch([2, 3, 1], 3)
        s = pw.get_strategy("test_var_keywords")
        assert not s.needs_groups and s.reads_groups
        flags, ids = torch.tensor([False, True, True]), torch.tensor([4, 4, -1])
        out = s(adv, ent, mask, positive=flags, groups=ids)
        assert set(seen[-1]) == {"positive", "groups"}
        assert torch.equal(seen[-1]["positive"], flags) and torch.equal(seen[-1]["groups"], ids)
        torch.testing.assert_close(out, torch.where(mask, adv[:, None], 0.0))
        s(torch.tensor([1.0, -1.0, 0.0]), ent, mask)  # no groups: still runs
        assert seen[-1]["positive"].tolist() == [True, False, False]  # default: A > 0
        assert seen[-1]["groups"] is None
        opt = pw.get_strategy("test_optional_groups")
        assert not opt.needs_groups and opt.reads_groups
        assert not pw.get_strategy("proximal_softmax").reads_groups
        assert pw.get_strategy("gtpo").reads_groups
        opt(adv, ent, mask, groups=ids)
        assert torch.equal(seen[-1]["groups"], ids)
        opt(adv, ent, mask)
        assert seen[-1]["groups"] is None
    finally:
        pw._REGISTRY.pop("test_var_keywords", None)
        pw._REGISTRY.pop("test_optional_groups", None)


@pytest.mark.parametrize(
    "window,lengths",
    [(1, [1, 2, 7]), (3, [1, 2, 3, 4, 9]), (W_SMALL, LENGTHS_SMALL), (101, LENGTHS_101)],
)
@pytest.mark.parametrize("holes", [False, True])
def test_window_average_entropy_matches_reference(window, lengths, holes):
    _, ent, mask = ragged_batch(lengths, max(lengths) + (13 if holes else 3), holes=holes, seed=41)
    got = pw.window_average_entropy(ent, mask, window=window)
    expected = np.stack(
        [
            ref.scatter_back(
                ref.window_average_row(ref.valid_values(ent[i].double(), mask[i]), window), mask[i]
            )
            for i in range(len(lengths))
        ]
    )
    close(got, expected)
    assert (got[~mask] == 0).all()


def test_window_average_entropy_hand_worked_and_zero_windows():
    # H = [0, 1, 0, 0, 0], W = 3, reflect pad -> [1, 0, 1, 0, 0, 0, 0]
    # t=0: window [1, 0, 1] -> r = 0 / 2 = 0; t=1: [0, 1, 0] -> 1 / 1 = 1; t=2: [1, 0, 0] -> 0
    # t=3: [0, 0, 0] sums to 0 -> 1/W; t=4: [0, 0, 0] (reflected) -> 1/W
    ent = torch.tensor([[0.0, 1.0, 0.0, 0.0, 0.0]])
    r = pw.window_average_entropy(ent, torch.ones(1, 5, dtype=torch.bool), window=3)
    torch.testing.assert_close(r, torch.tensor([[0.0, 1.0, 0.0, 1 / 3, 1 / 3]]))


def test_the_old_name_linear_proximal_entropy_is_the_same_function_and_warns():
    """The name before the window average had one name: same values, same checks, a
    FutureWarning naming the new one, and the new one's keywords. Catches an alias that computes
    something else (the proximal entropy, say), drops ``check_finite`` or lacks ``validate``."""
    _, ent, mask = ragged_batch([1, 4, 9], 12, holes=True, seed=5)
    with pytest.warns(FutureWarning, match="use pepo.weighting.window_average_entropy"):
        old = pw.linear_proximal_entropy(ent, mask, window=5)
    assert torch.equal(old, pw.window_average_entropy(ent, mask, window=5))
    bad = torch.tensor([[0.2, math.nan, 0.1]])
    ones = torch.ones(1, 3, dtype=torch.bool)
    with pytest.warns(FutureWarning), pytest.raises(ValueError, match="NaN"):
        pw.linear_proximal_entropy(bad, ones, window=3)
    with pytest.warns(FutureWarning):
        assert torch.isnan(
            pw.linear_proximal_entropy(bad, ones, window=3, check_finite=False)  # its own name
        ).any()
    with pytest.warns(FutureWarning):
        assert torch.isnan(pw.linear_proximal_entropy(bad, ones, window=3, validate=False)).any()


def test_window_average_entropy_refuses_negative_entropies():
    mask = torch.ones(1, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="entropies must be >= 0 .* value of -0.5"):
        pw.window_average_entropy(torch.tensor([[0.2, -0.5, 0.1]]), mask, window=3)
    # validate=False reads no value on the host, so it cannot refuse: a negative entropy counts
    # as 0 (windows [0, .2, 0], [.2, 0, .1], [0, .1, 0]); catches a sync-free path that lets it
    # through (r_1 = -0.5 / -0.2 = 2.5)
    r = pw.window_average_entropy(torch.tensor([[0.2, -0.5, 0.1]]), mask, window=3,
                                  validate=False)
    torch.testing.assert_close(r, torch.tensor([[1.0, 0.0, 1.0]]))
    # fp32 rounding just below 0 counts as 0
    r = pw.window_average_entropy(torch.tensor([[0.2, -1e-7, 0.1]]), mask, window=3)
    assert r[0, 1] == 0.0


@pytest.mark.parametrize("holes", [False, True])
@pytest.mark.parametrize("apply_to", ["positive", "all"])
@pytest.mark.parametrize("window,lengths", [(W_SMALL, LENGTHS_SMALL), (101, LENGTHS_101)])
def test_window_average_matches_reference(window, lengths, apply_to, holes):
    adv, ent, mask = ragged_batch(lengths, max(lengths) + 5, holes=holes, seed=8)
    adv[2] = -1.0
    got = pw.get_strategy("window_average", window=window, apply_to=apply_to)(adv, ent, mask)
    expected = ref.multiplicative(
        adv, ent, mask, lambda v: ref.window_average_row(v, window), apply_to
    )
    close(got, expected, rtol=RTOL32, atol=1e-6)
    torch.testing.assert_close(got.sum(1), adv * mask.sum(1), rtol=1e-5, atol=1e-4)


def _decile_means(w, mask):
    """Mean of w per position decile, over rows (positions among each row's valid tokens)."""
    pos = (mask.long().cumsum(1) - 1).float() / mask.sum(1, keepdim=True).float()
    dec = (pos * 10).floor().clamp_max(9).long()
    return torch.stack([w[mask & (dec == d)].mean() for d in range(10)])


def test_window_average_is_flat_over_position_on_a_trended_input():
    """App. E: the window statistic removes the positional trend. On entropies that decay
    along the response (H = f(t) · u, f from 3 to 0.3), the weights stay flat over position;
    a windowed *mean* (the old implementation) keeps the trend (first decile ~1.7x, last ~0.25x)."""
    g = torch.Generator().manual_seed(0)
    n, T, W = 32, 600, 21
    f = 3.0 * torch.exp(-torch.arange(T) / T * math.log(10))  # 3 -> 0.3
    ent = f * (0.2 + torch.rand(n, T, generator=g))
    mask = torch.ones(n, T, dtype=torch.bool)
    c = pw.get_strategy("window_average", window=W, apply_to="all")(torch.ones(n), ent, mask)
    deciles = _decile_means(c, mask)
    assert float((deciles - 1).abs().max()) < 0.05, deciles
    # the same check catches the windowed mean
    half = W // 2
    padded = torch.from_numpy(np.pad(ent.numpy(), ((0, 0), (half, half)), mode="reflect"))
    m = padded.unfold(1, W, 1).mean(-1)
    trended = _decile_means(m / m.mean(1, keepdim=True), mask)
    assert float(trended[0]) > 1.5 and float(trended[-1]) < 0.5


def test_window_average_all_zero_entropy_row_is_uniform():
    ent = torch.zeros(1, 6)
    mask = torch.ones(1, 6, dtype=torch.bool)
    out = pw.get_strategy("window_average", window=3)(torch.tensor([0.5]), ent, mask)
    assert out.tolist() == [[0.5] * 6]


@pytest.mark.parametrize("alpha,kappa", [(0.4, 2.0), (1.0, 1.5)])
def test_entropy_bonus_matches_reference(alpha, kappa):
    adv, ent, mask = ragged_batch([1, 4, 9, 16], 16, holes=True, seed=11)
    adv[1] = 0.0
    got = pw.get_strategy("entropy_bonus", alpha=alpha, kappa=kappa)(adv, ent, mask)
    close(got, ref.entropy_bonus(adv, ent, mask, alpha, kappa), rtol=1e-6, atol=1e-7)


def test_entropy_bonus_hand_worked():
    # A = 1: bonus min(0.4 * 1.0, 0.5) = 0.4; min(0.4 * 2.0, 0.5) = 0.5 (clipped).
    # A = -1: the clip |A|/kappa = 0.5 keeps -1 + 0.5 < 0.
    ent = torch.tensor([[1.0, 2.0], [1.0, 2.0]])
    mask = torch.ones(2, 2, dtype=torch.bool)
    out = pw.get_strategy("entropy_bonus")(torch.tensor([1.0, -1.0]), ent, mask)
    torch.testing.assert_close(out, torch.tensor([[1.4, 1.5], [-0.6, -0.5]]))


def test_uniform_is_grpo():
    adv, ent, mask = ragged_batch([1, 3, 8], 8, holes=True)
    out = pw.get_strategy("uniform")(adv, ent, mask)
    expected = torch.where(mask, adv[:, None].expand(3, 8), 0.0)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("fraction", [0.05, 0.2, 0.5, 1.0])
@pytest.mark.parametrize("holes", [False, True])
def test_global_topk_matches_trl_quantile_rule(fraction, holes):
    adv, ent, mask = ragged_batch([1, 7, 33, 64, 20], 64, holes=holes, seed=13)
    got = pw.get_strategy("global_topk", fraction=fraction)(adv, ent, mask)
    close(got, ref.global_topk(adv, ent, mask, fraction), rtol=0, atol=0)


def test_global_topk_takes_the_exact_quantile_not_its_fp32_rounding():
    """At fraction 0.4 on 26 distinct scores the exact rank q(n-1) is 15, so 11 are kept;
    ``torch.quantile`` on fp32 scores (TRL's call) rounds q = 0.6 up and keeps 10. Catches a
    rank computed in fp32 (or a threshold from fp32 ``torch.quantile``), which the float64
    reference of the other tests would meet only at such sizes."""
    ent = torch.arange(26, dtype=torch.float32)[None, :] * 0.1
    mask = torch.ones(1, 26, dtype=torch.bool)
    out = pw.get_strategy("global_topk", fraction=0.4)(torch.ones(1), ent, mask)
    assert out.tolist() == [[0.0] * 15 + [1.0] * 11]
    fp32_rule = ent >= torch.quantile(ent[mask], 0.6)
    assert int(fp32_rule.sum()) == 10  # the documented difference from TRL's rule


def test_global_topk_ties_are_included():
    ent = torch.tensor([[1.0, 2.0, 2.0, 2.0, 0.5]])
    mask = torch.ones(1, 5, dtype=torch.bool)
    out = pw.get_strategy("global_topk", fraction=0.2)(torch.tensor([1.0]), ent, mask)
    # quantile(0.8) of [0.5, 1, 2, 2, 2] is 2: all three 2's are kept.
    assert out.tolist() == [[0.0, 1.0, 1.0, 1.0, 0.0]]


def test_global_topk_is_global_not_per_row():
    # Row 0 is all high, row 1 all low: a per-row threshold would pick tokens from both.
    ent = torch.tensor([[5.0, 6.0, 7.0, 8.0], [0.1, 0.2, 0.3, 0.4]])
    mask = torch.ones(2, 4, dtype=torch.bool)
    out = pw.get_strategy("global_topk", fraction=0.25)(torch.tensor([1.0, 1.0]), ent, mask)
    assert out.tolist() == [[0.0, 0.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]]


def test_global_topk_proximal_score_uses_proximal_entropy():
    adv, ent, mask = ragged_batch([10, 40, 64], 64, holes=True, seed=17)
    got = pw.get_strategy("global_topk", fraction=0.2, score="proximal", window=11)(adv, ent, mask)
    scores = torch.tensor(ref.proximal_entropy(ent, mask, 11), dtype=torch.float32)
    close(got, ref.global_topk(adv, scores, mask, 0.2), rtol=0, atol=0)


def test_global_topk_selected_tokens_normalisation():
    adv, ent, mask = ragged_batch([10, 40, 64], 64, seed=19)
    plain = pw.get_strategy("global_topk")(adv, ent, mask)
    scaled = pw.get_strategy("global_topk", normalize="selected_tokens")(adv, ent, mask)
    n_sel = int((plain != 0).sum())
    torch.testing.assert_close(scaled, plain * (int(mask.sum()) / n_sel))


def test_global_topk_above_2_pow_24_tokens():
    # torch.quantile refuses inputs above 2^24 elements; the selection must still be exact.
    n = 2**25
    # Distinct fp32 values, increasing with the index: consecutive bit patterns from 1.0 up.
    rank = torch.randperm(n, generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    ent = (rank + 0x3F800000).view(torch.float32).view(256, -1)
    mask = torch.ones_like(ent, dtype=torch.bool)
    out = pw.get_strategy("global_topk", fraction=0.2)(torch.ones(256), ent, mask)
    k = n - math.ceil(0.8 * (n - 1))
    selected = out.view(-1) != 0
    assert int(selected.sum()) == k
    assert torch.equal(selected, rank >= n - k)


def test_global_topk_empty_batch():
    ent = torch.zeros(2, 3)
    mask = torch.zeros(2, 3, dtype=torch.bool)
    out = pw.get_strategy("global_topk")(torch.ones(2), ent, mask)
    assert out.eq(0).all()


# ---------------------------------------------------------------------------- contract


_BITS = {torch.bfloat16: torch.int16, torch.float32: torch.int32}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", pw.list_strategies())
def test_contract_detached_fp32_zero_on_padding_no_mutation(name, dtype):
    """fp32 entropies catch a strategy cleaning them in place (``.float()`` copies only a
    bf16 input: a ``masked_fill_`` after it would write the caller's padding); the inputs are
    compared bit for bit."""
    adv, ent, mask = ragged_batch([1, 5, 30], 32, holes=True, seed=23)
    ent = torch.where(mask, ent, float("nan")).to(dtype).requires_grad_(True)
    adv = adv.requires_grad_(True)
    before = (adv.detach().clone(), ent.detach().clone(), mask.clone())
    groups = torch.tensor([0, 0, 0])  # ignored by all strategies but gtpo
    out = pw.get_strategy(name)(
        adv, ent, mask, positive=torch.tensor([True, False, True]), groups=groups
    )
    assert out.shape == mask.shape and out.dtype == torch.float32
    assert not out.requires_grad
    assert torch.isfinite(out).all()
    assert out[~mask].eq(0).all()
    assert torch.equal(adv.detach(), before[0])
    assert torch.equal(ent.detach().view(_BITS[dtype]), before[1].view(_BITS[dtype]))
    assert torch.equal(mask, before[2])


def test_list_and_registry_names():
    assert set(pw.list_strategies()) >= {
        "uniform",
        "global_topk",
        "entropy_bonus",
        "proximal_softmax",
        "window_average",
    }


def test_register_custom_strategy():
    @pw.register_strategy("test_double")
    def double(factor: float = 2.0):
        def fn(advantages, entropies, mask):
            return advantages[:, None] * factor * torch.ones_like(entropies)

        return fn

    try:
        assert "test_double" in pw.list_strategies()
        adv, ent, mask = ragged_batch([2, 3], 3)
        out = pw.get_strategy("test_double", factor=3.0)(adv, ent, mask)
        assert torch.equal(out, torch.where(mask, 3.0 * adv[:, None].expand(2, 3), 0.0))
        def other(factor: float = 2.0):
            return double(factor)

        with pytest.raises(ValueError, match=r"'test_double' is already registered \(by "
                                             r"tests.test_weighting.test_register_custom_strategy"
                                             r".<locals>.double\); pass overwrite=True"):
            pw.register_strategy("test_double")(other)  # another function, a taken name
        with pytest.raises(ValueError, match="'uniform' is already registered"):
            pw.register_strategy("uniform")(double)  # a built-in's name
        # the same function defined again (a notebook cell run twice, importlib.reload)
        again = types.FunctionType(double.__code__, double.__globals__, "double",
                                   double.__defaults__, double.__closure__)
        again.__qualname__ = double.__qualname__
        pw.register_strategy("test_double")(again)
        assert pw._REGISTRY["test_double"] is again
    finally:
        pw._REGISTRY.pop("test_double", None)


def test_a_registered_strategy_returning_nan_is_not_called_an_overflow():
    """Catches every non-finite output blamed on fp32 overflow ("scale the rewards down") when
    the user's strategy returned NaN itself; an overflow is still named one."""

    @pw.register_strategy("test_nan", overwrite=True)
    def nan(value: float = math.nan):
        def fn(advantages, entropies, mask):
            return advantages[:, None] * value * torch.ones_like(entropies)

        return fn

    try:
        adv, ent, mask = ragged_batch([2, 3], 3)
        n = int(mask.sum())
        with pytest.raises(ValueError, match=f"^strategy 'test_nan' returned {n} NaN token "
                                             f"advantages from finite inputs$"):
            pw.get_strategy("test_nan")(adv, ent, mask)
        with pytest.raises(ValueError, match="the weighted advantages overflow float32"):
            pw.get_strategy("test_nan", value=1e38)(adv * 1e3, ent, mask)
    finally:
        pw._REGISTRY.pop("test_nan", None)


@pytest.mark.parametrize(
    "name,registered",
    [("pepo", "proximal_softmax"), ("PEPO", "proximal_softmax"), ("GRPO", "uniform"),
     ("80/20", "global_topk"), ("80_20", "global_topk"), ("Entropy Adv.", "entropy_bonus"),
     ("PESPO", "proximal_softmax"), ("spo", "uniform")],
)
def test_paper_names_point_at_registered_names(name, registered):
    """What the paper calls a method is no registered name; the error names the one to use
    (catches a name matched case-sensitively or with its '/' or '.', a wrong pairing, the hint
    left out and difflib's guess given instead: 'pepo' is closest to nothing)."""
    with pytest.raises(ValueError, match=rf"unknown strategy {re.escape(repr(name))}; the "
                       rf"paper's \S.* is .*'{registered}'.*; registered strategies"):
        pw.get_strategy(name)
    with pytest.raises(ValueError, match=r"unknown strategy 'ppo'; registered strategies"):
        pw.get_strategy("ppo")  # no paper name and no close match: no hint
    with pytest.raises(ValueError, match=r"unknown strategy 'GTPO'; did you mean 'gtpo'\?"):
        pw.get_strategy("GTPO")  # a registered name in capitals (difflib alone finds nothing)


@pytest.mark.parametrize(
    "name,params,match",
    [
        ("nope", {}, r"unknown strategy 'nope'; registered strategies: \['entropy_bonus'"),
        ("proximal_softmax", {"windw": 5}, r"unknown parameter\(s\) \['windw'\]; valid parameters"),
        ("proximal_softmax", {"window": 4}, "window must be an odd int >= 1, got 4"),
        ("proximal_softmax", {"window": 0}, "window must be an odd int >= 1, got 0"),
        ("proximal_softmax", {"window": 10_000_001}, "window must be <= 65537 .* got 10000001"),
        (
            "proximal_softmax",
            {"temperature": 0.0},
            "temperature must be a finite number > 0, got 0.0",
        ),
        ("proximal_softmax", {"apply_to": "negative"}, "apply_to must be one of"),
        ("global_topk", {"fraction": 0.0}, r"fraction must be in \(0, 1\], got 0.0"),
        ("global_topk", {"fraction": 1.5}, r"fraction must be in \(0, 1\], got 1.5"),
        ("global_topk", {"score": "gradient"}, "score must be one of"),
        ("entropy_bonus", {"kappa": -1.0}, "kappa must be a finite number > 0"),
        ("entropy_bonus", {"kappa": 1.0}, "kappa must be > 1 .* got 1.0"),
        ("entropy_bonus", {"kappa": 0.5}, "kappa must be > 1"),
        ("proximal_softmax", {"temperature": 1e-300}, r"temperature must be in \[0.05, 1e\+06\]"),
        ("window_average", {"window": 2.0}, "window must be an odd int"),
    ],
)
def test_bad_parameters(name, params, match):
    with pytest.raises(ValueError, match=match):
        pw.get_strategy(name, **params)


def test_bad_inputs_name_the_problem():
    s = pw.get_strategy("proximal_softmax", window=3)
    adv, ent, mask = ragged_batch([4, 4], 4)
    with pytest.raises(ValueError, match=r"advantages must be \[B\]=\[2\].*got \[2, 1\]"):
        s(adv[:, None], ent, mask)
    with pytest.raises(ValueError, match=r"mask must have dtype torch.bool.*got torch.float32"):
        s(adv, ent, mask.float())
    with pytest.raises(ValueError,
                       match=r"mask must have the same shape .* \[2, 4\], got \[2, 3\]"):
        s(adv, ent, mask[:, :3])
    with pytest.raises(ValueError, match=r"entropies must be \[B, T\], got \[2, 4, 1\]"):
        s(adv, ent[..., None], mask)
    bad = ent.clone()
    bad[1, 2] = float("nan")
    # the first bad value named where it is: [row, column] of a masked tensor, the index of a
    # per-row one (which has no mask to speak of)
    with pytest.raises(ValueError, match=r"entropies holds 1 NaN/inf value\(s\) at valid "
                                         r"\(mask=True\) positions, the first \[1, 2\] \(nan\)"):
        s(adv, bad, mask)
    with pytest.raises(ValueError, match=r"advantages holds 1 NaN/inf value\(s\), the first at "
                                         r"index 1 \(inf\); fix"):
        s(torch.tensor([1.0, float("inf")]), ent, mask)
    twice = ent.clone()
    twice[0, 3], twice[1, 1] = float("inf"), float("nan")  # the first in row-major order
    with pytest.raises(ValueError, match=r"entropies holds 2 NaN/inf value\(s\) at valid "
                                         r"\(mask=True\) positions, the first \[0, 3\] \(inf\)"):
        s(adv, twice, mask)
    with pytest.raises(ValueError, match="entropies holds 1 NaN/inf"):
        pw.proximal_entropy(bad, mask, window=3)
    with pytest.raises(ValueError, match="must be a floating-point tensor"):
        s(adv, ent.long(), mask)


def test_check_finite_false_skips_the_check():
    s = pw.get_strategy("uniform")
    adv, ent, mask = ragged_batch([4], 4)
    ent[0, 1] = float("nan")
    out = s(adv, ent, mask, validate=False)  # uniform ignores entropies
    assert torch.isfinite(out).all()


def test_strategy_repr_shows_parameters():
    s = pw.get_strategy("proximal_softmax", window=51)
    assert (
        repr(s) == "Strategy('proximal_softmax', window=51, temperature=1.0, apply_to='positive')"
    )


@pytest.mark.parametrize("name", pw.list_strategies())
@pytest.mark.parametrize("shape", [(2, 0), (0, 5), (3, 4)])
def test_empty_batches_and_fully_masked_rows(name, shape):
    ent = torch.rand(shape)
    mask = torch.zeros(shape, dtype=torch.bool)
    groups = torch.arange(shape[0]) // 2
    out = pw.get_strategy(name)(torch.ones(shape[0]), ent, mask, groups=groups)
    assert out.shape == shape and out.eq(0).all()


@pytest.mark.parametrize(
    "name", ["proximal_softmax", "window_average", "entropy_bonus", "global_topk"]
)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_check_finite_false_propagates_nan_never_a_finite_guess(name, bad):
    """Without the check, a NaN/inf entropy must reach the output as NaN (so a loss built on
    it is NaN and the recipe's guard skips the step). Catches the old behaviour: a row whose
    softmax total was NaN fell back to uniform weights, a finite wrong value."""
    adv, ent, mask = ragged_batch([5, 7], 7, seed=3)
    adv = torch.tensor([1.0, 0.5])
    ent[0, 2] = bad
    out = pw.get_strategy(name, **({"window": 3} if name != "entropy_bonus" else {}))(
        adv, ent, mask, validate=False)
    if name == "entropy_bonus":  # token-local: only the bad token
        assert not torch.isfinite(out[0, 2]) and torch.isfinite(out[1][mask[1]]).all()
    elif name == "global_topk":  # batch threshold: everything
        assert torch.isnan(out[mask]).all()
    else:  # row-local window statistics: the whole row, the other row untouched
        assert torch.isnan(out[0][mask[0]]).all() and torch.isfinite(out[1][mask[1]]).all()


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("normalize", ["all_tokens", "selected_tokens"])
def test_global_topk_unvalidated_keeps_a_bad_advantage_where_no_token_is_selected(bad, normalize):
    """A NaN/inf advantage on a row none of whose tokens is selected reaches that row's valid
    tokens as NaN, not as 0 (the row's entropies are the batch's lowest); masked tokens stay 0
    and the other rows are untouched. Catches ``where(selected, A, 0)``, a finite guess."""
    ent = torch.tensor([[0.1, 0.1, 0.1, 0.0], [2.0, 2.0, 2.0, 2.0]])
    mask = torch.tensor([[True, True, False, True], [True, True, True, True]])
    s = pw.get_strategy("global_topk", fraction=0.2, normalize=normalize)
    out = s(torch.tensor([bad, 1.0]), ent, mask, validate=False)
    assert torch.isnan(out[0][mask[0]]).all() and out[0, 2] == 0.0
    want = 1.0 if normalize == "all_tokens" else 7 / 4  # N_valid / N_selected
    assert out[1].tolist() == [want] * 4
    good = s(torch.tensor([-0.5, 1.0]), ent, mask, validate=False)  # finite: exactly 0, not -0
    assert good[0].tolist() == [0.0] * 4 and not torch.signbit(good[0]).any()


# ---------------------------------------------------------- building blocks for user strategies


def test_normalize_to_length_against_the_formula(make_batch):
    adv, ent, mask = make_batch([5, 3, 0, 7], 8, holes=True, seed=11, pad_value=0.0)
    w = torch.where(mask, ent, 0.0)
    w[1] = 0.0  # a row with no mass: uniform
    got = pw.normalize_to_length(w, mask)
    for i in range(w.shape[0]):
        n = int(mask[i].sum())
        total = float(w[i].double().sum())
        for t in range(w.shape[1]):
            if not mask[i, t]:
                continue
            want = float(w[i, t]) / total * n if total > 0 else 1.0
            assert abs(float(got[i, t]) - want) <= 1e-6 * max(1.0, abs(want))
        if n and total > 0:
            assert float(got[i][mask[i]].double().sum()) == pytest.approx(n, rel=1e-6)
    nan_row = w.clone()
    nan_row[0, 0] = float("nan")
    assert torch.isnan(pw.normalize_to_length(nan_row, mask)[0]).all()  # never silently uniform
    with pytest.raises(ValueError, match="same"):
        pw.normalize_to_length(w[:, :4], mask)
    with pytest.raises(ValueError, match="bool"):
        pw.normalize_to_length(w, mask.float())


def test_weight_rows_weights_only_the_flagged_rows():
    adv = torch.tensor([1.0, -2.0, 0.5])
    c = torch.tensor([[2.0, 0.0], [0.5, 1.5], [1.0, 1.0]])
    positive = torch.tensor([True, False, True])
    got = pw.weight_rows(adv, c, positive)
    assert torch.equal(got, torch.tensor([[2.0, 0.0], [-2.0, -2.0], [0.5, 0.5]]))
    assert torch.equal(pw.weight_rows(adv, c), c * adv[:, None])
    with pytest.raises(ValueError, match="bool"):
        pw.weight_rows(adv, c, positive.float())
    with pytest.raises(ValueError, match=r"\[B\]"):
        pw.weight_rows(adv[:2], c)


def test_a_user_strategy_from_the_building_blocks_matches_window_average(make_batch):
    adv, ent, mask = make_batch([6, 4, 9], 10, seed=3, pad_value=0.0)

    @pw.register_strategy("test_my_window_average")
    def mine(window: int = 5):
        def fn(advantages, entropies, mask, positive):
            r = pw.window_average_entropy(entropies, mask, window=window)
            return pw.weight_rows(advantages, pw.normalize_to_length(r, mask), positive)
        return fn

    try:
        positive = torch.tensor([True, False, True])
        got = pw.get_strategy("test_my_window_average", window=5)(adv, ent, mask,
                                                                  positive=positive)
        want = pw.get_strategy("window_average", window=5)(adv, ent, mask, positive=positive)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    finally:
        pw._REGISTRY.pop("test_my_window_average", None)


def test_an_unknown_strategy_name_suggests_the_closest():
    with pytest.raises(ValueError, match="did you mean 'proximal_softmax'"):
        pw.get_strategy("proximal_sofmax")
    with pytest.raises(ValueError, match="registered strategies") as e:
        pw.get_strategy("zzz")
    assert "did you mean" not in str(e.value)


@pytest.mark.parametrize("name", pw.list_strategies())
def test_every_strategy_has_one_rule_for_negative_entropies(name):
    """entropy_bonus and global_topk took negative entropies that window_average refused; an
    entropy is never negative, so every strategy refuses one below -1e-4 (fp32 rounding a few
    ulps below 0 passes), and a negative value at a masked position is padding, not input."""
    mask = torch.tensor([[True, True, True, False]])
    adv = torch.tensor([1.0])
    with pytest.raises(ValueError,
                       match=r"entropies must be >= 0 \(an entropy is never negative\), "
                             r"got a valid value of -0.5$"):
        pw.get_strategy(name)(
            adv,
            torch.tensor([[0.2, -0.5, 0.1, 0.0]]),
            mask,
            groups=torch.zeros(1, dtype=torch.long),
        )
    out = pw.get_strategy(name)(
        adv, torch.tensor([[0.2, -1e-7, 0.1, -7.0]]), mask, groups=torch.zeros(1, dtype=torch.long)
    )
    assert torch.isfinite(out).all() and out[0, 3] == 0


def test_proximal_entropy_follows_the_same_rule():
    mask = torch.ones(1, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="entropies must be >= 0"):
        pw.proximal_entropy(torch.tensor([[0.2, -0.5, 0.1]]), mask, window=3)


@pytest.mark.parametrize("name, a", [("proximal_softmax", 3e38), ("window_average", 3e38),
                                     ("global_topk", 3e38)])
def test_weighted_advantages_that_overflow_are_refused_not_inf(name, a):
    """c·A with finite A near fp32's limit and weights c > 1 gave ±inf token advantages."""
    ent = torch.tensor([[2.0, 0.01, 0.01, 0.01, 0.01]])
    mask = torch.ones(1, 5, dtype=torch.bool)
    params = {"global_topk": {"normalize": "selected_tokens"}}.get(name, {"window": 5})
    with pytest.raises(ValueError,
                       match=rf"strategy '{name}' turned finite inputs into \d+ non-finite "
                             r"token advantages \(\|A\| up to 3e\+38\)"):
        pw.get_strategy(name, **params)(torch.tensor([a]), ent, mask)
    out = pw.get_strategy(name, **params)(torch.tensor([a]), ent, mask, validate=False)
    assert not torch.isfinite(out).all()  # what the check stops


# ---------------------------------------------------------------------------------------- GTPO

GTPO_LENGTHS = [1, 5, 30, 7, 0, 12, 3, 9, 30, 2, 4, 6, 8, 15, 4]
# 5 groups of 3 rows, deliberately not contiguous, with ids that are not 0..n-1
GTPO_GROUPS = torch.tensor([7, 3, 7, -2, 3, 11, 7, -2, 3, 11, -2, 11, 5, 5, 5])
# group 7: 2 successes + 1 failure; 3: 1 + 2; -2: all failed; 11: 2 + 1; 5: all succeeded
GTPO_POSITIVE = torch.tensor([True, True, True, False, False, True, False, False, False, False,
                              False, True, True, True, True])


@pytest.mark.parametrize("holes", [False, True])
@pytest.mark.parametrize(
    "alpha1, alpha2, eps", [(1.0, 0.1, 1e-8), (0.9, 0.1, 1e-8), (0.5, 2.0, 1e-3)]
)
def test_gtpo_rewards_match_reference(holes, alpha1, alpha2, eps):
    _, ent, mask = ragged_batch(GTPO_LENGTHS, 36, holes=holes, seed=41)
    first = mask.long().argmax(1)  # each row's first valid token
    # group 11 at t = 0: both successes (rows 5, 11) at entropy 0, so their entropy term is split
    # evenly; its failure (row 9) at entropy 0, so 1/(H + eps) = 1/eps takes the failures' share
    for i in (5, 11, 9):
        ent[i, first[i]] = 0.0
    got = pw.gtpo_rewards(ent, mask, GTPO_POSITIVE, GTPO_GROUPS, alpha1, alpha2, eps)
    assert got.dtype == torch.float32 and (got[~mask] == 0).all()
    close(got, ref.gtpo_rewards(ent, mask, GTPO_POSITIVE, GTPO_GROUPS, alpha1, alpha2, eps),
          rtol=1e-6, atol=1e-6)


def test_gtpo_rewards_hand_worked():
    """Two successes of lengths 3 and 2, two failures of lengths 3 and 2 (α1 = 1, α2 = 0.1).
    t = 0: successes' H 2 and 3 share 0.1·2 as 2:3, failures' 1/H (1/4, 2) as 1:8."""
    ent = torch.tensor([[2.0, 4.0, 1.0], [3.0, 1.0, 0.0], [4.0, 0.5, 3.0], [0.5, 4.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    got = pw.gtpo_rewards(ent, mask, torch.tensor([True, True, False, False]),
                          torch.zeros(4, dtype=torch.long), eps=1e-12)
    expected = torch.tensor([[1.08, 1.16, 1.1], [1.12, 1.04, 0.0],
                             [-1 - 0.2 / 9, -1 - 1.6 / 9, -1.1], [-1 - 1.6 / 9, -1 - 0.2 / 9, 0.0]])
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("normalize", ["group", "side"])
@pytest.mark.parametrize("holes", [False, True])
@pytest.mark.parametrize("alpha1, alpha2, eps", [(1.0, 0.1, 1e-8), (0.5, 2.0, 1e-3)])
def test_gtpo_matches_reference(normalize, holes, alpha1, alpha2, eps):
    """The second setting catches the strategy building its rewards with the defaults instead
    of its own ``alpha1``/``alpha2``/``eps`` (under ``"side"`` only ``eps`` shows: ``alpha1``
    cancels and ``alpha2``'s scale is standardised away)."""
    adv, ent, mask = ragged_batch(GTPO_LENGTHS, 36, holes=holes, seed=43)
    s = pw.get_strategy("gtpo", normalize=normalize, alpha1=alpha1, alpha2=alpha2, eps=eps)
    got = s(adv, ent, mask, positive=GTPO_POSITIVE, groups=GTPO_GROUPS)
    expected = ref.gtpo(ent, mask, GTPO_POSITIVE, GTPO_GROUPS, alpha1, alpha2, eps, normalize)
    close(got, expected, rtol=1e-5, atol=1e-5)
    # the all-failed group (-2) and the all-succeeded one (5) get 0, as GRPO's do (a check of
    # "both outcomes" reduced to "any success" would standardise group 5's rewards); the mixed
    # groups do not, except group 3 by side: each of its sides has one non-empty row, whose
    # shaped rewards are constant
    assert (got[GTPO_GROUPS == -2] == 0).all() and (got[GTPO_GROUPS == 5] == 0).all()
    for g in (7, 3, 11):
        rows = GTPO_GROUPS == g
        total = got[rows][mask[rows]].abs().sum()
        assert total < 1e-6 if (g, normalize) == (3, "side") else total > 1


def test_gtpo_reads_neither_advantages_nor_other_groups():
    adv, ent, mask = ragged_batch(GTPO_LENGTHS, 36, seed=45)
    s = pw.get_strategy("gtpo")
    base = s(adv, ent, mask, positive=GTPO_POSITIVE, groups=GTPO_GROUPS)
    torch.testing.assert_close(
        s(adv * -3 + 1, ent, mask, positive=GTPO_POSITIVE, groups=GTPO_GROUPS), base
    )
    other = ent.clone()
    other[GTPO_GROUPS == 7] = other[GTPO_GROUPS == 7] * 2 + 0.5  # another group's entropies
    out = s(adv, other, mask, positive=GTPO_POSITIVE, groups=GTPO_GROUPS)
    keep = GTPO_GROUPS != 7
    torch.testing.assert_close(out[keep], base[keep])
    assert not torch.allclose(out[~keep], base[~keep])


def test_gtpo_side_normalisation_cancels_the_outcome():
    """What the default's deviation is about: with normalize="side" a failed rollout's token
    can get a positive advantage and a successful one's a negative, by entropy alone."""
    ent = torch.tensor([[2.0, 0.1], [0.1, 2.0], [2.0, 0.1], [0.1, 2.0]])
    mask = torch.ones(4, 2, dtype=torch.bool)
    positive = torch.tensor([True, True, False, False])
    groups = torch.zeros(4, dtype=torch.long)
    side = pw.get_strategy("gtpo", normalize="side")(
        torch.zeros(4), ent, mask, positive=positive, groups=groups
    )
    group = pw.get_strategy("gtpo")(torch.zeros(4), ent, mask, positive=positive, groups=groups)
    assert (side[2:] > 0).any() and (side[:2] < 0).any()
    assert (group[:2] > 0).all() and (group[2:] < 0).all()
    # within each side the higher-entropy success / the lower-entropy failure is pushed harder
    assert group[0, 0] > group[0, 1] and group[2, 1] < group[2, 0]


def test_gtpo_group_normalisation_flips_low_entropy_successes_when_failures_are_short():
    """The default's centre is the group's token mean, ``c = (α1 + α2)(N+ − N−)/(N+ + N−)``
    (each side's shaped rewards at each position sum to ±(α1 + α2) times its count). With 7
    successes of 100 tokens and 1 failure of 2, ``c = 1.1 · 698/702 ≈ 1.094 > α1``, so every
    success token whose entropy is under ``(c − α1)/α2 ≈ 0.937`` times the mean entropy of the
    successes at its position gets a negative advantage: 325 of 700 (46 %) with entropies
    uniform in [0, 2), as docs/strategies.md states. A centre that keeps every sign (GRPO's
    per-rollout mean, 0.825 here, or 0) fails this test, and so does the docs' number if the
    statistic changes; with a 40-token failure (c ≈ 0.981 < α1) every sign is kept."""
    g = torch.Generator().manual_seed(0)
    ent = torch.rand(8, 100, generator=g) * 2
    mask = torch.zeros(8, 100, dtype=torch.bool)
    mask[:7] = True
    mask[7, :2] = True
    positive = torch.tensor([True] * 7 + [False])
    groups = torch.zeros(8, dtype=torch.long)
    s = pw.get_strategy("gtpo")
    out = s(torch.zeros(8), ent, mask, positive=positive, groups=groups)
    r = pw.gtpo_rewards(ent, mask, positive, groups).double()
    c = 1.1 * (700 - 2) / 702
    assert abs(float(r[mask].mean()) - c) < 1e-6
    # which success tokens fall under the centre, from the formula, one token at a time
    expected = torch.zeros(7, 100, dtype=torch.bool)
    for t in range(100):
        mean_h = sum(float(ent[k, t]) for k in range(7)) / 7
        for i in range(7):
            expected[i, t] = float(ent[i, t]) / mean_h < (c - 1.0) / 0.1
    assert torch.equal(out[:7] < 0, expected)
    assert int(expected.sum()) == 325  # 46 %, the figure the docs give
    assert (out[7, :2] < 0).all()
    close(out, ref.gtpo(ent, mask, positive, groups, 1.0, 0.1, 1e-8, "group"), rtol=1e-5, atol=1e-5)
    # a longer failure moves the centre under α1: every token keeps its outcome's sign
    mask[7, :40] = True
    out = s(torch.zeros(8), ent, mask, positive=positive, groups=groups)
    assert (out[:7] > 0).all() and (out[7, :40] < 0).all()


def test_gtpo_needs_groups_and_checks_them():
    adv, ent, mask = ragged_batch([3, 4], 4, seed=1)
    s = pw.get_strategy("gtpo")
    assert s.needs_groups and not pw.get_strategy("proximal_softmax").needs_groups
    with pytest.raises(ValueError,
                       match=r"strategy 'gtpo' compares the rollouts of each prompt's group: "
                             r"pass groups="):
        s(adv, ent, mask)
    with pytest.raises(ValueError,
                       match=r"groups must have an integer dtype \(one group id per rollout\), "
                             r"got torch.float32"):
        s(adv, ent, mask, groups=torch.zeros(2))
    with pytest.raises(ValueError,
                       match=r"groups must be \[B\]=\[2\] \(one group id per rollout\), got \[3\]"):
        s(adv, ent, mask, groups=torch.zeros(3, dtype=torch.long))
    # strategies that do not compare rollouts ignore groups
    torch.testing.assert_close(
        pw.get_strategy("uniform")(adv, ent, mask, groups=torch.tensor([0, 1])),
        pw.get_strategy("uniform")(adv, ent, mask),
    )


@pytest.mark.parametrize("params, match", [
    ({"alpha1": -1.0}, r"alpha1 must be a finite number >= 0, got -1.0"),
    ({"alpha2": float("inf")}, r"alpha2 must be a finite number >= 0, got inf"),
    ({"alpha1": 0, "alpha2": 0}, r"alpha1 and alpha2 are both 0"),
    ({"eps": 0.0}, r"eps must be"),
    ({"normalize": "batch"}, r"normalize must be one of \['group', 'side'\], got 'batch'"),
])
def test_gtpo_bad_parameters(params, match):
    with pytest.raises(ValueError, match=match):
        pw.get_strategy("gtpo", **params)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_gtpo_propagates_a_bad_entropy_to_its_group_as_nan(bad):
    adv, ent, mask = ragged_batch([5, 7, 6, 4], 7, seed=3)
    positive = torch.tensor([True, False, True, False])
    groups = torch.tensor([0, 0, 1, 1])
    ent[1, 2] = bad  # a failure's token: 1/inf would be a finite 0
    out = pw.get_strategy("gtpo")(
        adv, ent, mask, positive=positive, groups=groups, validate=False
    )
    assert torch.isnan(out[:2][mask[:2]]).all() and torch.isfinite(out[2:]).all()
    # a group whose rollouts all succeeded gets 0 (GRPO's), but a bad entropy there stays NaN,
    # not that finite 0 (catches where(mixed, out, 0.0)); masked tokens 0, finite groups +0
    positive = torch.tensor([True, True, True, False])
    out = pw.get_strategy("gtpo")(
        adv, ent, mask, positive=positive, groups=groups, validate=False
    )
    assert torch.isnan(out[:2][mask[:2]]).all() and out[:2][~mask[:2]].eq(0).all()
    assert torch.isfinite(out[2:]).all() and out[2:].abs().sum() > 0
    ent[1, 2] = 1.0
    out = pw.get_strategy("gtpo")(adv, ent, mask, positive=positive, groups=groups)
    assert out[:2].eq(0).all() and not torch.signbit(out[:2]).any()


# ---------------------------------------------------------------------------- the CUDA fast path


def test_compiled_path_falls_back_one_way_at_a_time(monkeypatch):
    """The fast path (CUDA's; run here directly on CPU tensors with a stand-in compiler) tries
    the C++ wrapper, then the Python wrapper, then the plain body, warning for each that
    failed. Catches: a failure that skips straight to the slow uncompiled body, an exception
    that escapes, a failed way retried on every call, a result that differs from the body's."""
    from pepo import _strategy

    made, runs = [], []

    def fake_compile(fn, dynamic=None, options=None):
        cpp = bool(options and options.get("cpp_wrapper"))
        made.append(cpp)

        def run(*args, **kwargs):
            runs.append(cpp)
            if cpp or broken["python"]:
                raise RuntimeError("no compiler here")
            return fn(*args, **kwargs)

        return run

    broken = {"python": False}
    monkeypatch.setattr(torch, "compile", fake_compile, raising=False)  # torch 1.13 has none
    monkeypatch.setitem(_strategy._COMPILE_OPTIONS, "cpp_wrapper", True)
    monkeypatch.setitem(_strategy._COMPILE, "on", True)  # whatever PEPO_COMPILE says
    # the compile chain alone: where Triton imports (CUDA builds of torch) its kernel is tried
    # first, and its own warning joined the list below
    monkeypatch.setitem(_strategy._TRITON, "on", False)
    adv, ent, mask = ragged_batch([3, 7, 10, 12], 12, holes=True, seed=4)
    kw = {"positive": adv > 0, "groups": torch.tensor([0, 0, 1, 1])}
    s = pw.get_strategy("gtpo")
    want = s._body(adv, ent, mask, **kw)
    fast = s._compiled_body()
    assert made == []  # compiled at the first call, inside the chain
    with pytest.warns(RuntimeWarning, match="C\\+\\+ wrapper failed.*runs torch.compile instead"):
        assert torch.equal(fast(adv, ent, mask, **kw), want)
    assert made == [True, False] and runs == [True, False]
    assert torch.equal(fast(adv, ent, mask, **kw), want)  # no warning, no retry of the C++ way
    assert runs == [True, False, False]

    broken["python"] = True
    s2 = pw.get_strategy("gtpo")
    with pytest.warns(RuntimeWarning) as caught:
        assert torch.equal(s2._compiled_body()(adv, ent, mask, **kw), want)
    assert [str(w.message).split(";")[1].strip() for w in caught] == [
        "it runs torch.compile instead", "it runs uncompiled instead"]
    assert s2._compiled_body() == s2._body  # for good


def test_compiled_path_without_the_cpp_wrapper(monkeypatch):
    """PEPO_COMPILE_CPP=0 (the option off): only the Python wrapper is made."""
    from pepo import _strategy

    made = []
    monkeypatch.setattr(torch, "compile",
                        lambda fn, dynamic=None, options=None: made.append(options) or fn,
                        raising=False)
    monkeypatch.setitem(_strategy._COMPILE_OPTIONS, "cpp_wrapper", False)
    monkeypatch.setitem(_strategy._COMPILE, "on", True)
    adv, ent, mask = ragged_batch([3, 7], 8, seed=1)
    pw.get_strategy("proximal_softmax")._compiled_body()(adv, ent, mask, positive=adv > 0)
    assert made == [None]


def test_compiled_path_triton_kernel_first_then_compile(monkeypatch):
    """entropy_bonus's fast path tries its Triton kernel first (stand-ins for Triton and the
    compiler, so this runs anywhere): a kernel that fails gives way to torch.compile with a
    warning; an out-of-memory error is raised and drops no way; without Triton, or with
    PEPO_TRITON=0, the kernel is not tried."""
    from pepo import _strategy, _triton

    calls = []

    def kernel(adv, ent, mask, alpha, inv_kappa):
        calls.append("kernel")
        raise error["next"]

    oom = _strategy._OUT_OF_MEMORY  # torch.cuda.OutOfMemoryError (every supported torch)
    error = {"next": oom("stand-in")}
    monkeypatch.setattr(_triton, "available", lambda: True)
    monkeypatch.setattr(_triton, "entropy_bonus", kernel)
    monkeypatch.setattr(torch, "compile", lambda fn, dynamic=None, options=None: fn,
                        raising=False)
    monkeypatch.setitem(_strategy._COMPILE, "on", True)
    monkeypatch.setitem(_strategy._COMPILE_OPTIONS, "cpp_wrapper", False)
    adv, ent, mask = ragged_batch([3, 7], 8, seed=2)
    s = pw.get_strategy("entropy_bonus")
    fast = s._compiled_body()
    with pytest.raises(oom):
        fast(adv, ent, mask)
    error["next"] = RuntimeError("no GPU here")
    with pytest.warns(RuntimeWarning, match="Triton kernel failed.*runs torch.compile instead"):
        assert torch.equal(fast(adv, ent, mask), s._body(adv, ent, mask))
    assert calls == ["kernel", "kernel"]
    fast(adv, ent, mask)
    assert calls == ["kernel", "kernel"]  # dropped for good after a real failure

    monkeypatch.setitem(_strategy._TRITON, "on", False)
    pw.get_strategy("entropy_bonus")._compiled_body()(adv, ent, mask)
    monkeypatch.setitem(_strategy._TRITON, "on", True)
    monkeypatch.setattr(_triton, "available", lambda: False)
    pw.get_strategy("entropy_bonus")._compiled_body()(adv, ent, mask)
    assert calls == ["kernel", "kernel"]


def test_compiled_path_without_torch_compile(monkeypatch):
    """A torch without torch.compile (1.13) or one that refuses this Python: the call warns and
    runs the plain body, instead of raising on every CUDA call."""
    from pepo import _strategy

    monkeypatch.delattr(torch, "compile", raising=False)
    monkeypatch.setitem(_strategy._COMPILE, "on", True)
    monkeypatch.setitem(_strategy._COMPILE_OPTIONS, "cpp_wrapper", False)
    adv, ent, mask = ragged_batch([3, 7], 8, seed=3)
    s = pw.get_strategy("window_average", window=3)
    with pytest.warns(RuntimeWarning, match="torch.compile failed.*runs uncompiled instead"):
        out = s._compiled_body()(adv, ent, mask, positive=adv > 0)
    assert torch.equal(out, s._body(adv, ent, mask, positive=adv > 0))
    assert s._compiled_body() == s._body


@pytest.mark.parametrize("negative", [-1e-7, -7.63e-6, -5e-5])
def test_slightly_negative_entropies_count_as_zero_in_every_strategy(negative):
    """Validation accepts entropies down to -1e-4 (fp32's ``logsumexp - Σ p z`` gives -7.6e-6
    for logits offset by 50) as 0; catches GTPO taking 1/(H + eps) of the negative value (the
    failed side's shaping fell back to uniform, or its order flipped) and entropy_bonus adding
    a bonus on an A = 0 row."""
    h = torch.tensor([[negative, 0.3], [0.01, 1e-5], [0.5, 0.2], [0.5, 0.7]])
    mask = torch.ones(4, 2, dtype=torch.bool)
    kw = dict(positive=torch.tensor([False, False, True, True]),
              groups=torch.zeros(4, dtype=torch.long))
    for name in pw.list_strategies():
        if name == "uniform":
            continue
        s = pw.get_strategy(name)
        for adv in (torch.zeros(4), torch.tensor([-1.0, -1.0, 1.0, 1.0])):
            got = s(adv, h, mask, **kw)
            want = s(adv, h.clamp_min(0.0), mask, **kw)
            torch.testing.assert_close(got, want, rtol=0, atol=0, msg=f"{name} {adv}")
    assert pw.gtpo_rewards(h, mask, **kw)[0, 0] < pw.gtpo_rewards(h, mask, **kw)[1, 0]
    # unvalidated, -inf is still an inf that reaches the output as NaN, not a clamped 0
    h[0, 0] = -math.inf
    adv = torch.tensor([-1.0, -1.0, 1.0, 1.0])
    for name in ("gtpo", "entropy_bonus"):
        got = pw.get_strategy(name)(adv, h, mask, validate=False, **kw)
        assert torch.isnan(got[0, 0]), (name, got)


def test_an_inf_reaches_the_unvalidated_window_average_as_nan():
    """``validate=False`` promises a NaN/inf reaches the output as NaN: catches the window
    average dividing its window's finite entropies by an inf total (0, a finite wrong value)."""
    h = torch.tensor([[0.5, 1.0, math.inf, 0.3, 0.2, 0.7, 0.1]])
    mask = torch.ones_like(h, dtype=torch.bool)
    got = pw.window_average_entropy(h, mask, window=3, validate=False)
    assert torch.isnan(got[0, 1:4]).all(), got
    finite = pw.window_average_entropy(h[:, 4:], mask[:, 4:], window=3)
    torch.testing.assert_close(got[0, 5:], finite[0, 1:])


def test_proximal_entropy_is_accurate_across_the_temperatures_it_accepts():
    """Catches a temperature range wider than fp32 serves: at τ = 1e-6 (the old lower bound)
    e was 26 % off a float64 loop for entropies up to log V ~ 12, 2e-4 at 1e-3 and 1e-4 at
    1e-2. Every
    accepted τ, both ends included, stays within 1e-4 (relative, where e > 1e-3)."""
    from pepo._checks import TEMPERATURE_RANGE

    lo, hi = TEMPERATURE_RANGE
    h = torch.rand(4, 300, generator=torch.Generator().manual_seed(0)) * 12.0
    mask = torch.ones_like(h, dtype=torch.bool)
    for tau in (lo, 0.1, 1.0, hi):
        got = pw.proximal_entropy(h, mask, window=11, temperature=tau).double().numpy()
        want = np.stack([ref.proximal_entropy_row_fast(row.double().numpy(), 11, tau)
                         for row in h])
        big = want > 1e-3
        assert (np.abs(got - want)[big] / want[big]).max() < 1e-4, tau
    with pytest.raises(ValueError, match="temperature must be in"):
        pw.proximal_entropy(h, mask, window=11, temperature=lo / 2)


def test_a_registered_strategy_gets_copies_of_its_inputs():
    """A registered fn that edits its inputs in place (``mask &= ...``, ``advantages.mul_``)
    changed the caller's tensors: the recipe's loss then trained on the edited mask. Catches
    the fn given the caller's tensors, and its result masked by its own edited copy instead of
    the caller's mask."""

    @pw.register_strategy("test_inplace", overwrite=True)
    def inplace():
        def fn(advantages, entropies, mask, positive):
            mask &= entropies > 0.5
            advantages.mul_(2)
            positive.zero_()
            return advantages[:, None] * torch.ones_like(entropies)

        return fn

    try:
        adv, ent, mask = ragged_batch([3, 4, 2], 4)
        adv = torch.tensor([1.0, -0.5, 2.0])
        pos = adv > 0
        before = adv.clone(), mask.clone(), pos.clone()
        out = pw.get_strategy("test_inplace")(adv, ent, mask, positive=pos)
        assert torch.equal(adv, before[0]) and torch.equal(mask, before[1])
        assert torch.equal(pos, before[2])
        assert torch.equal(out, torch.where(before[1], 2 * before[0][:, None], 0.0))
    finally:
        pw._REGISTRY.pop("test_inplace", None)


def test_a_registered_factorys_type_errors_name_the_strategy():
    """A factory's missing argument or a value it cannot take (``gain='abc'`` from a config)
    was a ``TypeError`` traceback naming no strategy, and the config check, which catches
    ``ValueError``, let it through. Catches either left a ``TypeError``."""

    @pw.register_strategy("test_typed", overwrite=True)
    def typed(k: int, gain=1.0):  # gain unannotated: the factory's own TypeError
        boost = gain + 1.0

        def fn(advantages, entropies, mask):
            return advantages[:, None] * boost * k * torch.ones_like(entropies)

        return fn

    try:
        with pytest.raises(ValueError, match=r"^strategy 'test_typed': missing a required "
                                             r"argument: 'k'$"):
            pw.get_strategy("test_typed")
        with pytest.raises(ValueError, match=r"^strategy 'test_typed': can only concatenate "
                                             r"str"):
            pw.get_strategy("test_typed", k=1, gain="abc")
        assert pw.get_strategy("test_typed", k=2).params == {"k": 2, "gain": 1.0}
    finally:
        pw._REGISTRY.pop("test_typed", None)


def test_a_registered_factorys_annotations_refuse_a_value_of_another_kind():
    """A parameter annotated ``float``, ``int``, ``bool`` or ``str`` takes only that kind, as a
    config writes it: ``gain: true`` was taken as 1 (a bool is an int), ``k: 2.5`` reached
    ``range``, ``mode: 3`` compared unequal to every choice. Ints pass as floats, NumPy scalars
    as numbers; an annotation of another type (or none) is the factory's own to check."""
    from typing import Optional

    @pw.register_strategy("test_annotated", overwrite=True)
    def annotated(gain: float = 1.0, k: int = 1, flip: bool = False, mode: str = "a",
                  other: Optional[float] = None, free=None):
        def fn(advantages, entropies, mask):
            return advantages[:, None] * gain * k * torch.ones_like(entropies)

        return fn

    try:
        for key, value, kind in (("gain", True, r"a number \(annotated float\), got True"),
                                 ("gain", "0.5", r"a number \(annotated float\), got '0.5'"),
                                 ("k", 2.5, r"an integer \(annotated int\), got 2.5"),
                                 ("k", False, r"an integer \(annotated int\), got False"),
                                 ("flip", 1, r"true or false \(annotated bool\), got 1"),
                                 ("mode", 3, r"a string \(annotated str\), got 3")):
            with pytest.raises(ValueError, match=rf"^strategy 'test_annotated': {key} must be "
                                                 rf"{kind}$"):
                pw.get_strategy("test_annotated", **{key: value})
        s = pw.get_strategy("test_annotated", gain=2, k=np.int64(3), flip=True, mode="b",
                            other="left to the factory", free=[1])
        assert s.params["gain"] == 2 and s.params["k"] == 3
    finally:
        pw._REGISTRY.pop("test_annotated", None)


def test_the_defaults_are_the_papers():
    """A call without parameters is the paper's setting (W = 101, τ = 1; 80/20's fifth; GTPO's
    published α and ε): a default changed in one place (``proximal_entropy``'s window to 99,
    ``window_average``'s) moved every call that relies on it, with no test failing. Checked on
    rows long enough for the window to matter, against the explicit call."""
    from pepo._gtpo import gtpo_rewards

    torch.manual_seed(0)
    ent = torch.rand(2, 300) * 3
    mask = torch.ones(2, 300, dtype=torch.bool)
    adv, pos = torch.tensor([1.0, -0.5]), torch.tensor([True, False])
    assert torch.equal(pw.proximal_entropy(ent, mask),
                       pw.proximal_entropy(ent, mask, window=101, temperature=1.0))
    assert torch.equal(pw.window_average_entropy(ent, mask),
                       pw.window_average_entropy(ent, mask, window=101))
    for name, explicit in (("proximal_softmax", {"window": 101, "temperature": 1.0,
                                                 "apply_to": "positive"}),
                           ("window_average", {"window": 101, "apply_to": "positive"}),
                           ("global_topk", {"fraction": 0.2, "score": "entropy"}),
                           ("entropy_bonus", {"alpha": 0.4, "kappa": 2.0})):
        assert torch.equal(pw.get_strategy(name)(adv, ent, mask, positive=pos),
                           pw.get_strategy(name, **explicit)(adv, ent, mask, positive=pos)), name
    # gtpo_rewards' own defaults, where ε shows: failures of entropy 0 and 1e-7 share Eq. 5's
    # inverse-entropy term 1e8 : 1/(1.1e-7), i.e. 0.917 / 0.083 of α2 · h_t = 0.1 · 2
    r = gtpo_rewards(torch.tensor([[1.0], [0.0], [1e-7]]), torch.ones(3, 1, dtype=torch.bool),
                     torch.tensor([True, False, False]), torch.zeros(3, dtype=torch.long))
    share = (1 / 1e-8) / (1 / 1e-8 + 1 / 1.1e-7)
    torch.testing.assert_close(r[:, 0], torch.tensor(
        [1.1, -1.0 - 0.2 * share, -1.0 - 0.2 * (1 - share)]), rtol=1e-5, atol=1e-6)


def test_the_largest_window_is_accepted_and_the_next_refused():
    """MAX_WINDOW (65537) is documented as allowed: catches a ``>=`` that refused it."""
    ent, mask = torch.rand(1, 8), torch.ones(1, 8, dtype=torch.bool)
    assert torch.isfinite(pw.proximal_entropy(ent, mask, window=65537)).all()
    with pytest.raises(ValueError, match="window must be <= 65537 .* got 65539"):
        pw.proximal_entropy(ent, mask, window=65539)


@pytest.mark.parametrize("name", ["uniform", "proximal_softmax", "window_average",
                                  "entropy_bonus", "global_topk", "gtpo"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_advantages_of_any_float_dtype_give_fp32_computed_in_fp32(name, dtype):
    """The documented output is fp32 whatever the advantages' dtype: fp64 advantages gave fp64
    weights, and bf16 ones computed entropy_bonus's cap |A|/κ in bf16. Catches the advantages
    not upcast (the entropies' upcast was tested, not theirs)."""
    ent, mask = torch.rand(4, 6) * 2, torch.ones(4, 6, dtype=torch.bool)
    adv = torch.tensor([0.7, -0.3, 1.3, -1.1])
    s = pw.get_strategy(name)
    kw = {"positive": adv > 0, "groups": torch.tensor([0, 0, 1, 1])}
    got = s(adv.to(dtype), ent, mask, **kw)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, s(adv.to(dtype).float(), ent, mask, **kw), rtol=0, atol=0)


def test_validated_rows_near_the_entropy_limits_match_a_float64_reference():
    """Two rows the generated batches never reach, each against float64 (a cumulative sum of
    shifted exponentials for the first, tests/reference.py for the second). Catches a window
    sum without the row's maximum subtracted, or with its minimum (every e underflows to 0 and
    the weights fall back to uniform in silence), and a wide-row guard that never fires (a
    window 100 nats below the row's maximum held as fp32 subnormals, off by 1 %)."""
    window, tau = 16385, 0.3
    g = torch.Generator().manual_seed(0)
    n = window + 200
    ent = 23.5 + 0.5 * torch.rand(1, n + 50, generator=g)  # H <= 24 nats, 50 padded columns
    mask = torch.zeros_like(ent, dtype=torch.bool)
    mask[:, :n] = True
    got = pw.proximal_entropy(ent, mask, window, tau)[0, :n].double().numpy()
    h = ent[0, :n].double().numpy() / tau
    x = np.pad(h, window // 2, mode="reflect")
    c = np.concatenate([[0.0], np.cumsum(np.exp(x - x.max()))])
    np.testing.assert_allclose(got, np.exp(h - x.max()) / (c[window:] - c[:-window]), rtol=1e-4)
    wide = torch.tensor([[130.0, 30.0, 30.5, 30.2, 30.1, 30.4, 30.3, 30.0]])
    full = torch.ones_like(wide, dtype=torch.bool)
    np.testing.assert_allclose(pw.proximal_entropy(wide, full, 3, 1.0).double().numpy()[0, 2:],
                               ref.proximal_entropy(wide, full, 3, 1.0)[0, 2:], rtol=1e-4)


# ------------------------------------------------------------- arguments as users pass them


def test_numpy_numbers_are_numbers():
    """A NumPy integer or float (a sweep's ``np.linspace``, a value read from an array) is the
    number it holds: the same output as the Python number. Catches ``isinstance(v, int)`` /
    ``(int, float)`` checks, which refused ``np.int64(5)`` and ``np.float32(0.5)`` with an
    error calling them not numbers."""
    adv, ent, mask = ragged_batch([6, 4, 9], 10, seed=5)
    for name, np_params, py_params in [
        ("proximal_softmax", {"window": np.int64(5), "temperature": np.float32(0.5)},
         {"window": 5, "temperature": 0.5}),
        ("global_topk", {"fraction": np.float32(0.25)}, {"fraction": float(np.float32(0.25))}),
        ("entropy_bonus", {"alpha": np.float32(0.5), "kappa": np.int64(2)},
         {"alpha": 0.5, "kappa": 2}),
    ]:
        got = pw.get_strategy(name, **np_params)(adv, ent, mask)
        assert torch.equal(got, pw.get_strategy(name, **py_params)(adv, ent, mask)), name
    assert torch.equal(pw.proximal_entropy(ent, mask, window=np.int64(3)),
                       pw.proximal_entropy(ent, mask, window=3))
    with pytest.raises(ValueError, match=r"window must be an odd int >= 1, got 4"):
        pw.get_strategy("window_average", window=np.int64(4))
    with pytest.raises(ValueError, match="window must be an odd int"):
        pw.get_strategy("window_average", window=np.float64(5.0))  # a float is no int


@pytest.mark.parametrize("flag", [None, "false", 0, 1])
def test_validate_must_be_a_bool(flag):
    """``validate=None`` (or a quoted ``"false"``) is refused, not read as a truth value.
    Catches ``bool(validate)``: ``None`` silently skipped every check and a NaN went through."""
    adv, ent, mask = ragged_batch([3, 2], 3)
    ent[0, 0] = math.nan
    with pytest.raises(ValueError, match=r"validate must be True or False, got "):
        pw.get_strategy("entropy_bonus")(adv, ent, mask, validate=flag)
    with pytest.raises(ValueError, match=r"validate must be True or False"):
        pw.proximal_entropy(ent, mask, window=3, validate=flag)
    with pytest.raises(ValueError, match=r"validate must be True or False"):
        pw.gtpo_rewards(ent, mask, torch.tensor([True, False]), torch.tensor([0, 0]),
                        validate=flag)


def test_gtpo_rewards_refuses_what_its_siblings_refuse():
    """Log-probabilities passed as entropies (negative values) and NaN entropies are refused as
    :func:`proximal_entropy` refuses them; ``validate=False`` lets a NaN through to its side's
    rewards at its position. Catches ``gtpo_rewards`` without the check: the ``-5`` was read as
    an entropy of 0 and the rewards came back finite and wrong."""
    ent = torch.tensor([[-5.0, 1.0], [1.0, 1.0]])
    mask = torch.ones(2, 2, dtype=torch.bool)
    pos, groups = torch.tensor([True, True]), torch.tensor([0, 0])
    with pytest.raises(ValueError, match=r"entropies must be >= 0 .*-5"):
        pw.gtpo_rewards(ent, mask, pos, groups)
    with pytest.raises(ValueError, match=r"entropies must be >= 0"):
        pw.proximal_entropy(ent, mask, window=1)  # the sibling's message
    ent[0, 0] = math.nan
    with pytest.raises(ValueError, match=r"entropies holds 1 NaN/inf value\(s\) at valid "
                                         r"\(mask=True\) positions, the first \[0, 0\]"):
        pw.gtpo_rewards(ent, mask, pos, groups)
    unchecked = pw.gtpo_rewards(ent, mask, pos, groups, validate=False)
    assert torch.isnan(unchecked[:, 0]).all() and torch.isfinite(unchecked[:, 1]).all()
    masked = mask.clone()
    masked[0, 0] = False  # the NaN at a masked position: not an input
    assert torch.isfinite(pw.gtpo_rewards(ent, masked, pos, groups)).all()


def test_building_blocks_refuse_what_the_strategies_refuse():
    """``normalize_to_length`` and ``weight_rows`` check their tensors as the strategies do, in
    one line naming the argument. Catches the old checks, which let a list fail with
    ``AttributeError``, a device mix with torch's error naming no argument, and int weights
    through (``c * A`` then truncated nothing but broke the float contract)."""
    mask = torch.ones(2, 3, dtype=torch.bool)
    w = torch.rand(2, 3)
    with pytest.raises(ValueError, match="weights must be a torch.Tensor, got list"):
        pw.normalize_to_length(w.tolist(), mask)
    with pytest.raises(ValueError, match="weights must be a floating-point tensor, got dtype "
                                         "torch.int64"):
        pw.normalize_to_length(torch.ones(2, 3, dtype=torch.long), mask)
    with pytest.raises(ValueError, match=r"weights \(cpu\), mask \(meta\) must be on the same"):
        pw.normalize_to_length(w, mask.to("meta"))
    adv = torch.tensor([1.0, -1.0])
    with pytest.raises(ValueError, match="advantages must be a torch.Tensor, got list"):
        pw.weight_rows([1.0, -1.0], w)
    with pytest.raises(ValueError, match="c must be a floating-point tensor"):
        pw.weight_rows(adv, torch.ones(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"advantages \(cpu\), c \(meta\) must be on the same"):
        pw.weight_rows(adv, w.to("meta"))
    with pytest.raises(ValueError, match=r"advantages must be \[B\] and c \[B, T\], got \[2\] "
                                         r"and \[3\]"):
        pw.weight_rows(adv, w[0])


def test_global_topk_refuses_a_process_group_that_is_no_group():
    """Catches a string (what a config can give) accepted and failing deep in
    ``torch.distributed`` with "'str' object has no attribute 'allreduce'"."""
    with pytest.raises(ValueError, match="process_group must be a torch.distributed "
                                         "ProcessGroup or None, got 'world'"):
        pw.get_strategy("global_topk", process_group="world")
