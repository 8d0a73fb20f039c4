"""pepo.estimators against loop references of GRPO's Eq. (1) and SPO's tracker."""

import math
import statistics

import pytest
import torch

import pepo.estimators as est


def ref_group(rewards, g, eps=1e-6, unbiased=True, normalize_std=True):
    out = []
    for s in range(0, len(rewards), g):
        grp = [float(r) for r in rewards[s : s + g]]
        if max(grp) == min(grp):
            out += [0.0] * g
            continue
        mu = statistics.fmean(grp)
        sd = statistics.stdev(grp) if unbiased else statistics.pstdev(grp)
        out += [(r - mu) / (sd + eps) if normalize_std else r - mu for r in grp]
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("g", [2, 4, 8])
@pytest.mark.parametrize("unbiased", [True, False])
@pytest.mark.parametrize("normalize_std", [True, False])
@pytest.mark.parametrize("eps", [1e-6, 1e-4, 0.5])
def test_group_advantages_match_reference(g, unbiased, normalize_std, eps):
    """``eps`` = 1e-4 (TRL's) and 0.5 catch an ``eps`` ignored for verl's 1e-6; the
    ``GroupEstimator`` built with the same settings catches one that drops them."""
    gen = torch.Generator().manual_seed(g)
    r = (torch.rand(6 * g, generator=gen) > 0.5).float()
    r[:g] = 1.0  # a degenerate group
    r[g : 2 * g] = torch.rand(g, generator=gen)  # a continuous-reward group
    want = ref_group(r, g, eps=eps, unbiased=unbiased, normalize_std=normalize_std)
    got = est.group_advantages(r, g, unbiased=unbiased, normalize_std=normalize_std, eps=eps)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-7)
    estimator = est.GroupEstimator(group_size=g, normalize_std=normalize_std,
                                   unbiased=unbiased, eps=eps)
    ids = [i // g for i in range(len(r))]
    torch.testing.assert_close(estimator.advantages(ids, r).double(), want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("normalize_std", [True, False])
def test_group_advantages_keep_fp64_precision(normalize_std):
    """float64 rewards were computed in float32: [1, 1 + 1e-7] gave [0, 0.107], not ±a."""
    r = torch.tensor([1.0, 1.0 + 1e-7, 5.0, 5.0 + 3e-9], dtype=torch.float64)
    got = est.group_advantages(r, 2, normalize_std=normalize_std)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, ref_group(r, 2, normalize_std=normalize_std), rtol=1e-9, atol=0)
    assert got[0] < 0 and torch.isclose(got[0], -got[1], rtol=1e-6, atol=0)  # fp32 gave 0, 0.107


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_group_advantages_near_the_dtype_limit_are_not_a_silent_zero(dtype):
    """Rewards near 3e38 overflowed the fp32 std to inf: every advantage came out 0."""
    big = torch.finfo(dtype).max / 1.2
    r = torch.tensor([big, -big, big, 1.0, 0.0, 1.0], dtype=dtype)
    got = est.group_advantages(r, 3)
    want = ref_group([1.0, -1.0, 1.0, 1.0, 0.0, 1.0], 3, eps=0.0)  # scale-free up to eps/|r|
    torch.testing.assert_close(got[:3].double(), want[:3], rtol=1e-6, atol=0)
    torch.testing.assert_close(got[3:].double(), ref_group(r[3:], 3), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError,
                       match=r"the advantages r - mean overflow torch.float(32|64) \(rewards "
                             r"from -.* to .*\); scale the rewards down"):
        est.group_advantages(r, 3, normalize_std=False)  # r - mean itself is beyond the dtype


def test_the_power_of_two_scaling_changes_no_bit():
    """The scaling that prevents overflow is by powers of two: the same numbers as unscaled."""
    gen = torch.Generator().manual_seed(0)
    r = torch.randn(64, generator=gen) * 7
    for normalize_std in (True, False):
        got = est.group_advantages(r, 8, normalize_std=normalize_std)
        x = r.view(-1, 8)
        c = x - x.mean(1, keepdim=True)
        if normalize_std:
            c = c / (x.std(1, keepdim=True) + 1e-6)
        assert torch.equal(got, c.reshape(-1))


def test_group_advantages_hand_worked():
    # Group [1, 0, 0, 0]: mean 0.25, unbiased std sqrt(0.25) = 0.5 -> [1.5, -0.5, -0.5, -0.5].
    got = est.group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), 4, eps=0.0)
    torch.testing.assert_close(got, torch.tensor([1.5, -0.5, -0.5, -0.5]))


def test_degenerate_groups_are_exactly_zero():
    r = torch.tensor([0.1] * 8 + [0.7] * 8)  # 0.1 is not exact in binary: mean != 0.1 in fp32
    assert torch.equal(est.group_advantages(r, 8), torch.zeros(16))


@pytest.mark.parametrize(
    "rewards,g,match",
    [
        (torch.zeros(8), 1, "group_size must be an int >= 2"),
        (torch.zeros(9), 4, "rewards has 9 entries, not a multiple of group_size=4"),
        (torch.zeros(8, 1), 4, r"rewards must be \[N\], got \[8, 1\]"),
        (torch.tensor([0.0, float("nan")]), 2, r"rewards holds 1 NaN/inf value\(s\), the first "
                                               r"at index 1 \(nan\)"),
    ],
)
def test_group_advantages_errors(rewards, g, match):
    with pytest.raises(ValueError, match=match):
        est.group_advantages(rewards, g)


# ---------------------------------------------------------------------------- SPO


def test_prior_from_offline_pass_rates_matches_reference_code():
    # verl recipe/spo: N0 = 1/(1-0.875) = 8; alpha0 = N0 (k + 0.5)/(n + 1) with k of n = 8.
    t = est.SingleStreamEstimator({"a": 0.25, "b": 1.0})
    st = t.state_dict()
    assert st["alpha"]["a"] == pytest.approx(8 * (2 + 0.5) / 9)
    assert st["beta"]["a"] == pytest.approx(8 * (6 + 0.5) / 9)
    assert t.values(["a", "b", "unseen"]).tolist() == pytest.approx([2.5 / 9, 8.5 / 9, 0.5])


def test_advantages_use_pre_update_values_and_batch_normalisation():
    t = est.SingleStreamEstimator({0: 0.5, 1: 0.25, 2: 0.75})
    ids, r = [0, 1, 2, 2], torch.tensor([1.0, 0.0, 1.0, 0.0])
    p = t.values(ids).double()
    raw = r.double() - p
    expected = (raw - raw.mean()) / (raw.std() + 1e-8)
    got = t.advantages(ids, r)
    torch.testing.assert_close(got.double(), expected, rtol=1e-6, atol=1e-6)
    assert abs(float(got.mean())) < 1e-6
    t_raw = est.SingleStreamEstimator({0: 0.5, 1: 0.25, 2: 0.75}, normalize=False)
    torch.testing.assert_close(t_raw.advantages(ids, r).double(), raw, rtol=1e-6, atol=1e-7)


def test_single_stream_eps_is_added_to_the_batch_std():
    """``(A - mean A) / (std A + eps)`` with a large eps: catches eps ignored (the default
    1e-8 is far below any tolerance, so no other test sees it)."""
    prior = {0: 0.5, 1: 0.25, 2: 0.75}
    ids, r = [0, 1, 2], torch.tensor([1.0, 0.0, 1.0])
    raw = r.double() - est.SingleStreamEstimator(prior).values(ids).double()
    got = est.SingleStreamEstimator(prior, eps=0.5).advantages(ids, r)
    torch.testing.assert_close(got.double(), (raw - raw.mean()) / (raw.std() + 0.5),
                               rtol=1e-6, atol=1e-7)
    assert (got.abs() < est.SingleStreamEstimator(prior).advantages(ids, r).abs()).all()


def test_one_normalised_rollout_is_refused():
    """Centred over a batch of one, the advantage is always 0 (a step that trains on nothing):
    catches it returned silently; without normalisation one rollout is fine."""
    with pytest.raises(ValueError, match="at least 2 rollouts"):
        est.SingleStreamEstimator({"a": 0.25}).advantages(["a"], [1.0])
    raw = est.SingleStreamEstimator({"a": 0.25}, normalize=False)
    torch.testing.assert_close(raw.advantages(["a"], [1.0]), 1 - raw.values(["a"]).float())
    assert 0.7 < float(raw.advantages(["a"], [1.0])) < 0.75  # p: the smoothed prior, 2.5 / 9
    assert est.SingleStreamEstimator().advantages([], torch.zeros(0)).shape == (0,)


def test_update_with_kl_adaptive_forgetting():
    t = est.SingleStreamEstimator()
    t.update(["x"], [1.0], kl=[0.0])  # rho = clip(2^0 = 1) = 0.96
    assert t.state_dict()["alpha"]["x"] == pytest.approx(0.96 * 0.5 + 1)
    assert t.state_dict()["beta"]["x"] == pytest.approx(0.96 * 0.5)
    a, b = t.state_dict()["alpha"]["x"], t.state_dict()["beta"]["x"]
    t.update(["x"], [0.0], kl=[0.03])  # rho = 2^(-0.5) = 0.7071 -> clipped to 0.875
    assert t.state_dict()["alpha"]["x"] == pytest.approx(0.875 * a)
    assert t.state_dict()["beta"]["x"] == pytest.approx(0.875 * b + 1)
    rho = t.forgetting(torch.tensor([0.0, 0.003, 0.06, 10.0]))
    expected = [min(max(2 ** (-d / 0.06), 0.875), 0.96) for d in (0.0, 0.003, 0.06, 10.0)]
    assert rho.tolist() == pytest.approx(expected)
    # other bounds and half-life: catches rho_min, rho_max or d_half fixed at their defaults
    u = est.SingleStreamEstimator(rho_min=0.5, rho_max=0.99, d_half=0.01)
    u.update(["x"], [1.0], kl=[0.0])  # rho = clip(1, 0.5, 0.99) = 0.99
    assert u.state_dict()["alpha"]["x"] == pytest.approx(0.99 * 0.5 + 1)
    d = (0.0, 0.003, 0.01, 10.0)
    assert u.forgetting(torch.tensor(d)).tolist() == pytest.approx(
        [min(max(2 ** (-x / 0.01), 0.5), 0.99) for x in d])


def test_update_constant_rho_and_repeats_in_order():
    t = est.SingleStreamEstimator(rho=0.9)
    t.update([7, 7], [1.0, 0.0])
    a = 0.9 * (0.9 * 0.5 + 1) + 0
    b = 0.9 * (0.9 * 0.5) + 1
    assert t.state_dict()["alpha"][7] == pytest.approx(a)
    assert t.state_dict()["beta"][7] == pytest.approx(b)


def test_a_prompt_twice_in_one_step_is_forgotten_once():
    """A candidate pool across an epoch's end can hold a prompt twice. Catches the drift since
    the last visit read once for the whole batch: the second row was forgotten with the first
    row's drift, though its last visit is that first row, under the same policy (drift 0)."""
    def tracker():
        t = est.SingleStreamEstimator(rho_min=0.5, rho_max=0.97, d_half=0.5)
        t.set_prior({"x": 0.25})
        t.observe(["y"], [1.0], drift=1.0)  # the policy moves on before x is seen again
        return t

    together, apart = tracker(), tracker()
    torch.testing.assert_close(together.drift_since_last_visit(["x", "y", "x"]),
                               torch.tensor([1.0, 1.0, 0.0], dtype=torch.float64))
    together.observe(["x", "x"], [1.0, 0.0], drift=0.2)
    apart.observe(["x"], [1.0], drift=0.0)
    apart.observe(["x"], [0.0], drift=0.2)
    assert together.state_dict()["alpha"]["x"] == pytest.approx(apart.state_dict()["alpha"]["x"])
    assert together.state_dict()["beta"]["x"] == pytest.approx(apart.state_dict()["beta"]["x"])
    # by hand: rho 2^-2 (clipped to 0.5) at the first row, rho_max at the second
    a0, b0 = apart.prior_weight * 2.5 / 9, apart.prior_weight * 6.5 / 9
    assert together.state_dict()["alpha"]["x"] == pytest.approx(0.97 * (0.5 * a0 + 1))
    assert together.state_dict()["beta"]["x"] == pytest.approx(0.97 * (0.5 * b0) + 1)


def test_a_prior_set_later_is_the_prompts_last_visit():
    """Catches ``set_prior`` that leaves the last visit alone: a prior set (or reset) after the
    policy moved would be forgotten by the drift from the start."""
    t = est.SingleStreamEstimator()
    t.add_drift(1.0)
    t.set_prior({"x": 0.5})
    assert t.drift_since_last_visit(["x", "z"]).tolist() == [0.0, 1.0]


def test_prepare_scores_every_prompt_across_chunks():
    """Real datasets take many chunks of ``chunk_rollouts``; catches a chunk loop that skips or
    repeats a prompt at a chunk's edge (every prompt then must have its own mean)."""
    t = est.build_estimator("single_stream", prior_samples=3)
    ids = [f"p{i}" for i in range(11)]
    calls = []

    def score(idx):
        calls.append(list(idx))
        return torch.tensor([(i % 4) / 3 if k % 3 == 0 else 0.0 for k, i in enumerate(idx)])

    rates = t.prepare(ids, score, chunk_rollouts=7)  # 2 prompts (6 rollouts) a call
    assert [i for c in calls for i in c] == [i for i in range(11) for _ in range(3)]
    assert len(calls) == 6 and all(len(c) <= 7 for c in calls)
    assert rates == pytest.approx({f"p{i}": (i % 4) / 9 for i in range(11)})


@pytest.mark.parametrize("sampling_eps", [0.05, 0.2])
def test_sampling_weights(sampling_eps):
    t = est.SingleStreamEstimator({"easy": 1.0, "mid": 0.5}, sampling_eps=sampling_eps)
    w = t.sampling_weights(["easy", "mid"])
    p = 8.5 / 9
    assert w.tolist() == pytest.approx([math.sqrt(p * (1 - p)) + sampling_eps,
                                        math.sqrt(0.5 * 0.5) + sampling_eps])


def test_choose_draws_in_proportion_to_the_sampling_weights():
    """SPO's prioritised sampling: catches ``choose`` taking the first candidates (as group
    mode does) or drawing uniformly."""
    t = est.SingleStreamEstimator({"easy": 1.0, "mid": 0.5, "hard": 0.0})
    ids = ["easy", "mid", "hard"]
    w = t.sampling_weights(ids).double()
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(3, dtype=torch.float64)
    for _ in range(3000):
        counts[t.choose(ids, 1, g)[0]] += 1
    # binomial standard deviations are below 0.009 here; 0.035 is four of them
    torch.testing.assert_close(counts / 3000, w / w.sum(), atol=0.035, rtol=0)
    assert abs(float(w[1] / w.sum()) - 1 / 3) > 0.1  # a uniform draw would fail the above
    assert sorted(t.choose(ids, 3, g)) == [0, 1, 2]


@pytest.mark.parametrize("rho_min, n0", [(0.875, 8.0), (0.8, 5.0)])
def test_prior_weight_follows_rho_min(rho_min, n0):
    """N0 = 1/(1 - rho_min): catches a prior weight fixed at the default's 8."""
    t = est.SingleStreamEstimator({"a": 0.25}, rho_min=rho_min)
    assert t.prior_weight == pytest.approx(n0)
    assert t.state_dict()["alpha"]["a"] == pytest.approx(n0 * (2 + 0.5) / 9)
    assert t.state_dict()["beta"]["a"] == pytest.approx(n0 * (6 + 0.5) / 9)


def test_state_dict_round_trip_resumes_exactly():
    t = est.SingleStreamEstimator({"a": 0.5}, rho_min=0.8)
    t.update(["a", "b"], [1.0, 0.0], kl=[0.01, 0.2])
    t.add_drift(0.02)
    u = est.SingleStreamEstimator(rho_min=0.8)
    u.load_state_dict(t.state_dict())
    for tracker in (t, u):
        tracker.observe(["a", "c"], [0.0, 1.0], drift=0.05)
    assert u.state_dict() == t.state_dict()
    assert u.rho_min == 0.8


def test_load_state_dict_refuses_other_hyper_parameters():
    """Catches a resume that silently swaps the configured hyper-parameters for the saved."""
    t = est.SingleStreamEstimator(rho_min=0.8)
    with pytest.raises(ValueError, match="rho_min: saved 0.8, configured 0.875"):
        est.SingleStreamEstimator().load_state_dict(t.state_dict())
    g = est.GroupEstimator(group_size=4)
    with pytest.raises(ValueError, match="group_size: saved 4, configured 8"):
        est.GroupEstimator(group_size=8).load_state_dict(g.state_dict())
    with pytest.raises(ValueError, match="state_dict is of estimator 'group', not 'single_stream'"):
        est.SingleStreamEstimator().load_state_dict(
            {**g.state_dict(), "alpha": {}, "beta": {}, "drift_total": 0.0, "last_visit": {}})
    with pytest.raises(ValueError, match="state_dict is of estimator 'single_stream', not 'group'"):
        est.GroupEstimator().load_state_dict(t.state_dict())


def test_drift_since_last_visit_is_the_change_between_the_two_rewards_policies():
    """D(x) sums the drift of the updates made between the two visits' rollouts: a prompt seen
    at step 1 and again at step 4 gets d1 + d2 + d3 (its step-1 reward came from the policy
    before update 1, its step-4 reward from the policy before update 4)."""
    t = est.SingleStreamEstimator(rho_min=0.01, rho_max=1.0, d_half=0.1)
    t.set_prior({"x": 0.5})  # the prior's rollouts came from the initial policy
    drifts = [0.03, 0.05, 0.07]
    t.observe(["x"], [1.0], drift=drifts[0])  # step 1: D = 0 (prior taken just before)
    a1, b1 = t.state_dict()["alpha"]["x"], t.state_dict()["beta"]["x"]
    t.observe(["y"], [0.0], drift=drifts[1])  # step 2: another prompt
    t.observe(["y"], [1.0], drift=drifts[2])  # step 3
    torch.testing.assert_close(t.drift_since_last_visit(["x", "y", "new"]),
                               torch.tensor([0.15, 0.07, 0.15], dtype=torch.float64))
    t.observe(["x"], [0.0], drift=0.01)  # step 4: D = 0.03 + 0.05 + 0.07
    rho = 2 ** (-0.15 / 0.1)
    assert t.state_dict()["alpha"]["x"] == pytest.approx(rho * a1)
    assert t.state_dict()["beta"]["x"] == pytest.approx(rho * b1 + 1)
    assert t.drift_total == pytest.approx(0.16)
    with pytest.raises(ValueError, match="needs the step's policy drift"):
        t.observe(["x"], [1.0])
    constant = est.SingleStreamEstimator(adaptive_forgetting=False, rho=0.9)
    assert not constant.needs_drift
    constant.observe(["x"], [1.0])
    assert constant.state_dict()["alpha"]["x"] == pytest.approx(0.9 * 0.5 + 1)


def test_step_interface_of_both_estimators():
    g = est.build_estimator("group", group_size=2)
    assert (g.rollouts_per_prompt, g.candidate_pool, g.needs_drift) == (2, 1, False)
    assert g.choose(["a", "b", "c"], 2, torch.Generator()) == [0, 1]
    adv = g.advantages(["a", "a", "b", "b"], torch.tensor([1.0, 0.0, 1.0, 1.0]))
    torch.testing.assert_close(adv, est.group_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0]), 2))
    with pytest.raises(ValueError, match="contiguous groups of 2"):
        g.advantages(["a", "b", "a", "b"], torch.tensor([1.0, 0.0, 1.0, 1.0]))
    with pytest.raises(ValueError, match="contiguous groups of 2"):  # only a later group mixed
        g.advantages(["a", "a", "b", "c", "c", "b"], torch.rand(6))
    s = est.build_estimator("single_stream", candidate_pool=3, prior_samples=2)
    assert (s.rollouts_per_prompt, s.candidate_pool, s.needs_drift) == (1, 3, True)
    calls = []

    def score(idx):
        calls.append(list(idx))
        return torch.tensor([1.0 if i == 1 else 0.0 for i in idx])

    s.prepare(["p0", "p1", "p2"], score)
    assert calls == [[0, 0, 1, 1, 2, 2]]
    assert s.values(["p0", "p1"]).tolist() == pytest.approx([0.5 / 3, 2.5 / 3])
    with pytest.raises(ValueError,
                       match=r"unknown single_stream estimator key\(s\) \['group_size'\]"):
        est.build_estimator("single_stream", group_size=4)
    with pytest.raises(ValueError, match="estimator name must be one of .*, got 'ppo'$"):
        est.build_estimator("ppo")
    # what the paper calls an estimator is named (catches the hint left out, or matched
    # case-sensitively)
    for name, registered in [("grpo", "group"), ("SPO", "single_stream")]:
        with pytest.raises(ValueError, match=rf"got '{name}' \(the paper's {name.upper()} is "
                           rf"'{registered}'\)$"):
            est.build_estimator(name)
    with pytest.raises(ValueError,
                       match=r"got 'Single-Stream' \(did you mean 'single_stream'\?\)$"):
        est.build_estimator("Single-Stream")


def test_tensor_prompt_ids():
    t = est.SingleStreamEstimator()
    t.update(torch.tensor([3, 4]), torch.tensor([1.0, 0.0]))
    assert t.known([3, 4, 5]) == [True, True, False]


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda t: t.advantages([1, 2], torch.tensor([1.0])), r"rewards must be \[N\]=\[2\]"),
        (lambda t: t.update([1], [1.5]), r"rewards must lie in \[0, 1\]"),
        (lambda t: t.update([1], [1.0], kl=[-0.1]), "kl must be finite and >= 0"),
        (lambda t: t.update([1, 2], [1.0, 0.0], kl=[0.1]), r"kl must be \[N\]=\[2\]"),
        (lambda t: t.set_prior({"q": 2.0}), r"prior pass rate of prompt 'q' must be in \[0, 1\]"),
    ],
)
def test_spo_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call(est.SingleStreamEstimator())


def test_spo_bad_config():
    with pytest.raises(ValueError, match="rho_min"):
        est.SingleStreamEstimator(rho_min=0.97, rho_max=0.96)


@pytest.mark.parametrize("call, name", [
    (lambda v: est.group_advantages(torch.ones(4), 2, normalize_std=v), "normalize_std"),
    (lambda v: est.group_advantages(torch.ones(4), 2, unbiased=v), "unbiased"),
    (lambda v: est.GroupEstimator(2, normalize_std=v), "normalize_std"),
    (lambda v: est.GroupEstimator(2, unbiased=v), "unbiased"),
    (lambda v: est.SingleStreamEstimator(normalize=v), "normalize"),
    (lambda v: est.SingleStreamEstimator(adaptive_forgetting=v), "adaptive_forgetting"),
])
@pytest.mark.parametrize("value", ["false", "no", 0, None])
def test_a_switch_must_be_a_bool(call, name, value):
    """Catches ``bool(value)``: the string "false" (a quoted YAML value) turned the switch on,
    0 and None off, in silence."""
    with pytest.raises(ValueError, match=f"^{name} must be True or False, got {value!r}$"):
        call(value)


def test_single_stream_advantages_of_equal_rewards_are_zero_also_without_eps():
    """Catches 0 / 0 with ``eps=0`` (the config accepts it): every advantage was NaN. Centred
    equal advantages are 0, as with eps > 0 up to rounding."""
    for eps in (0.0, 1e-8):
        a = est.SingleStreamEstimator(eps=eps).advantages(["a", "b", "c"], torch.ones(3) * 0.1)
        assert torch.isfinite(a).all() and a.abs().max() < 1e-6
    assert torch.equal(est.SingleStreamEstimator(eps=0.0).advantages(["a", "b"], torch.ones(2)),
                       torch.zeros(2))


@pytest.mark.parametrize("k", [0, -1, 1.5, True])
def test_choose_refuses_a_count_that_is_not_a_positive_int(k):
    """Catches the two estimators disagreeing at the edge: the single-stream one raised torch's
    "cannot sample n_sample <= 0 samples", the group one chose nothing in silence."""
    g = torch.Generator().manual_seed(0)
    for e in (est.GroupEstimator(2), est.SingleStreamEstimator()):
        with pytest.raises(ValueError, match=f"^k must be an int >= 1 \\(prompts to choose\\), "
                                             f"got {k!r}$"):
            e.choose(["a", "b", "c"], k, g)
    assert est.GroupEstimator(2).choose(["a", "b"], 5, g) == [0, 1]  # k > n: all, as documented


def test_both_estimators_implement_the_whole_protocol():
    """Catches a loop that must special-case one estimator (``getattr(est, "prior_samples",
    0)``, ``set_prior`` on one only): both are ``Estimator``s with every member, and the group
    estimator takes the empty prior its ``prepare`` returns and refuses a real one."""
    for name in ("group", "single_stream"):
        e = est.build_estimator(name)
        assert isinstance(e, est.Estimator), name
    g = est.build_estimator("group", group_size=2)
    assert g.prior_samples == 0
    g.set_prior(g.prepare(["a"], lambda idx: torch.zeros(len(idx))))  # nothing to set
    with pytest.raises(ValueError, match="the group estimator takes no offline prior"):
        g.set_prior({"a": 0.5})
    s = est.build_estimator("single_stream", prior_samples=2)
    s.set_prior({"a": 0.5})  # k = 1 of n = 2: alpha = N0 (1 + 1/2) / 3, beta the same
    assert s.values(["a"]).tolist() == pytest.approx([0.5])


def test_register_estimator_mirrors_register_strategy():
    """Catches a registry that only knows the two built-in names: a registered estimator is
    listed, its keyword arguments are its config keys, build_estimator builds it, a second
    registration under a taken name is refused, and a factory whose result lacks part of the
    protocol is refused by name."""

    @est.register_estimator("test_leave_one_out")
    class LeaveOneOut(est.GroupEstimator):
        name = "test_leave_one_out"

        def __init__(self, group_size: int = 4, *, scale: float = 1.0) -> None:
            super().__init__(group_size)
            self.scale = scale

    class Half:
        name, rollouts_per_prompt, candidate_pool, needs_drift = "test_half", 1, 1, False

        def advantages(self, prompt_ids, rewards):
            return rewards - 0.5

    try:
        assert "test_leave_one_out" in est.list_estimators()
        assert est.estimator_parameters("test_leave_one_out") == ["group_size", "scale"]
        built = est.build_estimator("test_leave_one_out", scale=2.0)
        assert isinstance(built, LeaveOneOut) and built.scale == 2.0
        with pytest.raises(ValueError, match=r"estimator 'test_leave_one_out' is already "
                                             r"registered \(by tests.test_estimators.test_regis"
                                             r"ter_estimator_mirrors_register_strategy.<locals>."
                                             r"LeaveOneOut\); pass overwrite=True"):
            est.register_estimator("test_leave_one_out")(Half)  # another class, a taken name
        # the same class defined again (a notebook cell run twice, a reload) replaces it
        est.register_estimator("test_leave_one_out")(type("LeaveOneOut", (LeaveOneOut,), {
            "__qualname__": LeaveOneOut.__qualname__, "__module__": LeaveOneOut.__module__}))
        assert est.ESTIMATORS["test_leave_one_out"] is not LeaveOneOut
        est.register_estimator("test_half")(Half)
        with pytest.raises(ValueError, match=r"'test_half' does not implement the Estimator "
                                             r"protocol: it has no \['prior_samples', 'prepare'"):
            est.build_estimator("test_half")
    finally:
        est.ESTIMATORS.pop("test_leave_one_out", None)
        est.ESTIMATORS.pop("test_half", None)


def test_a_registered_estimators_type_errors_name_it():
    """Catches a factory's ``TypeError`` (a value it cannot take, ``decay='abc'``) left a
    traceback naming no estimator, past the config check that catches ``ValueError``."""

    class Decaying(est.GroupEstimator):
        name = "test_decaying"

        def __init__(self, group_size: int = 4, *, decay: float = 0.9) -> None:
            super().__init__(group_size)
            self.keep = 1.0 - decay

    est.register_estimator("test_decaying")(Decaying)
    try:
        with pytest.raises(ValueError, match=r"^estimator 'test_decaying': unsupported operand "
                                             r"type\(s\) for -: 'float' and 'str'$"):
            est.build_estimator("test_decaying", decay="abc")
        assert est.build_estimator("test_decaying", decay=0.5).keep == 0.5
    finally:
        est.ESTIMATORS.pop("test_decaying", None)


def test_group_estimator_names_the_rewards_shape_before_the_ids():
    """A reward count that differs from the prompt ids' count, or 2-D rewards, is named as
    such. Catches the old message, which blamed the prompt ids' grouping for both."""
    e = est.GroupEstimator(group_size=2)
    ids = [0, 0, 1, 1]
    with pytest.raises(ValueError, match=r"rewards must be \[N\]=\[4\] \(one per prompt id\), "
                                         r"got \[6\]"):
        e.advantages(ids, torch.ones(6))
    with pytest.raises(ValueError, match=r"rewards must be \[N\]=\[4\] .*got \[4, 1\]"):
        e.advantages(ids, torch.ones(4, 1))
    with pytest.raises(ValueError, match="contiguous groups of 2"):
        e.advantages([0, 1, 0, 1], torch.ones(4))
    want = est.group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), 2)
    assert torch.equal(e.advantages(ids, [1.0, 0.0, 0.0, 0.0]), want)  # a list, as SPO's


def test_load_state_dict_refuses_a_broken_state_in_one_line():
    """A state missing its ``config`` and one holding a Beta parameter that is not a finite
    number > 0 are refused naming what is wrong. Catches the ``KeyError: 'config'`` of the group
    estimator, and a NaN or negative ``alpha`` loaded silently (NaN values, then a
    ``ZeroDivisionError`` in ``values``)."""
    with pytest.raises(ValueError, match=r"state_dict is missing key\(s\) \['config'\]"):
        est.GroupEstimator(group_size=2).load_state_dict({"name": "group"})
    with pytest.raises(ValueError, match=r"state_dict is of estimator 'single_stream', not "
                                         r"'group'"):
        est.GroupEstimator(group_size=2).load_state_dict(est.SingleStreamEstimator().state_dict())
    e = est.SingleStreamEstimator()
    e.set_prior({"a": 0.5, "b": 0.25})
    good = e.state_dict()
    for key, value in (("alpha", math.nan), ("beta", -1.0), ("alpha", 0.0),
                       ("beta", math.inf)):
        bad = {**good, key: {**good[key], "b": value}}
        with pytest.raises(ValueError, match=r"state_dict holds a Beta parameter that is not a "
                                             r"finite number > 0 \(prompt 'b': "):
            est.SingleStreamEstimator().load_state_dict(bad)
    with pytest.raises(ValueError, match="drift_total is nan"):
        est.SingleStreamEstimator().load_state_dict({**good, "drift_total": math.nan})
    restored = est.SingleStreamEstimator()
    restored.load_state_dict(good)
    assert torch.equal(restored.values(["a", "b"]), e.values(["a", "b"]))


def test_numpy_integers_configure_the_estimators():
    """``group_size=np.int64(4)`` and ``prior_samples=np.int64(8)`` are the ints they hold (and
    stored as ints, which a checkpoint's config comparison reads). Catches ``isinstance(v,
    int)`` checks, which refused them."""
    import numpy as np

    g = est.GroupEstimator(group_size=np.int64(4))
    assert g.group_size == 4 and type(g.group_size) is int
    s = est.SingleStreamEstimator(prior_samples=np.int64(8), candidate_pool=np.int64(2),
                                  rho=np.float32(0.5))
    assert (s.prior_samples, s.candidate_pool) == (8, 2) and type(s.prior_samples) is int
    r = torch.tensor([1.0, 0.0, 0.0, 1.0])
    assert torch.equal(est.group_advantages(r, np.int64(2)), est.group_advantages(r, 2))
