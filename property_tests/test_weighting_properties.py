"""Properties of the weighting strategies (Prop. 1, the invariances the strategies promise, and
the orderings that tell a statistic from a constant)."""

import math

import torch
from hypothesis import assume, given
from hypothesis import strategies as st

import pepo.weighting as pw
from pepo._windows import reflect_index

WINDOWED = ["proximal_softmax", "window_average"]


@st.composite
def batches(draw, max_b=4, max_t=40, min_valid=0):
    b = draw(st.integers(1, max_b))
    t = draw(st.integers(1, max_t))
    mask_bits = draw(st.lists(st.booleans(), min_size=b * t, max_size=b * t))
    mask = torch.tensor(mask_bits, dtype=torch.bool).view(b, t)
    assume(int(mask.sum()) >= min_valid)
    ent = draw(st.lists(st.floats(0.0, 8.0, width=32), min_size=b * t, max_size=b * t))
    adv = draw(st.lists(st.floats(-3.0, 3.0, width=32), min_size=b, max_size=b))
    return torch.tensor(adv), torch.tensor(ent).view(b, t), mask


windows = st.integers(0, 20).map(lambda k: 2 * k + 1)
temperatures = st.sampled_from([0.25, 0.5, 1.0, 2.0])


@given(batches(), windows, temperatures, st.data())
def test_shift_invariance_prop1_i(batch, window, tau, data):
    """Adding any per-row constant to H leaves e and c unchanged. (A shifted H may be negative,
    which no entropy is: the check that refuses that is switched off to test the formula.)"""
    adv, ent, mask = batch
    delta = torch.tensor(
        data.draw(st.lists(st.floats(-20, 20, width=32), min_size=len(adv), max_size=len(adv)))
    )
    shifted = ent + delta[:, None]
    e0 = pw.proximal_entropy(ent, mask, window, tau)
    e1 = pw.proximal_entropy(shifted, mask, window, tau, validate=False)
    # fp32 rounding of H + δ perturbs each H by <= ulp(28) ~ 2e-6, i.e. e by ~4e-6/τ relative.
    torch.testing.assert_close(e1, e0, rtol=4e-5 / tau, atol=1e-9)
    s = pw.get_strategy("proximal_softmax", window=window, temperature=tau, apply_to="all")
    torch.testing.assert_close(s(adv, shifted, mask, validate=False), s(adv, ent, mask),
                               rtol=4e-5 / tau, atol=1e-5)


@given(batches(), windows, st.data())
def test_scale_invariance_of_the_linear_statistic(batch, window, data):
    """App. E's r = H / Σ_W H is the linear twin of Prop. 1(i): multiplying a row's entropies
    by any constant > 0 leaves r and window_average's weights unchanged."""
    adv, ent, mask = batch
    scale = torch.tensor(
        data.draw(
            st.lists(st.floats(0.015625, 64.0, width=32), min_size=len(adv), max_size=len(adv))
        )
    )
    scaled = ent * scale[:, None]
    r0 = pw.window_average_entropy(ent, mask, window)
    torch.testing.assert_close(
        pw.window_average_entropy(scaled, mask, window), r0, rtol=1e-5, atol=1e-7
    )
    s = pw.get_strategy("window_average", window=window, apply_to="all")
    torch.testing.assert_close(s(adv, scaled, mask), s(adv, ent, mask), rtol=1e-5, atol=1e-5)


@given(batches(), windows, st.floats(-0.05, 0.05))
def test_trend_invariance_prop1_ii(batch, window, slope):
    """Adding a linear trend s·t to H changes log e by at most |s|·(W // 2).

    Every term of the window sum is multiplied by exp(s (k - t)) with |k - t| <= W // 2 (also
    for reflected positions), so this is an exact bound, not only first order.
    """
    _, ent, mask = batch
    pos = (mask.long().cumsum(1) - 1).clamp_min(0).float()  # position among valid tokens
    e0 = pw.proximal_entropy(ent, mask, window)
    e1 = pw.proximal_entropy(ent + slope * pos, mask, window, validate=False)  # may be < 0
    ratio = torch.where(mask, (e1 / torch.where(mask, e0, 1.0)).log().abs(), 0.0)
    assert float(ratio.max()) <= abs(slope) * (window // 2) + 1e-4


@given(batches(), windows, temperatures, st.sampled_from(["positive", "all"]))
def test_weight_sum_preservation(batch, window, tau, apply_to):
    """Σ_t Â_{i,t} = T_i A_i for proximal_softmax and window_average."""
    adv, ent, mask = batch
    for name, params in (("proximal_softmax", {"temperature": tau}), ("window_average", {})):
        out = pw.get_strategy(name, window=window, apply_to=apply_to, **params)(adv, ent, mask)
        expected = adv * mask.sum(1)
        torch.testing.assert_close(
            out.sum(1), expected, rtol=2e-5, atol=2e-5 * float(mask.sum(1).max().clamp_min(1))
        )


strategy_specs = st.sampled_from(
    [
        ("uniform", {}),
        ("entropy_bonus", {}),
        ("proximal_softmax", {"window": 5}),
        ("proximal_softmax", {"window": 101, "apply_to": "all"}),
        ("window_average", {"window": 7}),
        ("global_topk", {"fraction": 0.2}),
        ("global_topk", {"fraction": 0.3, "score": "proximal", "window": 9}),
    ]
)


@given(batches(), strategy_specs, st.data())
def test_padding_contents_never_matter(batch, spec, data):
    adv, ent, mask = batch
    junk = data.draw(st.sampled_from([float("nan"), float("inf"), -float("inf"), 1e30, -7.0]))
    s = pw.get_strategy(spec[0], **spec[1])
    dirty = torch.where(mask, ent, torch.tensor(junk))
    assert torch.equal(s(adv, dirty, mask), s(adv, ent, mask))


@given(batches(max_t=30), strategy_specs, st.integers(0, 10))
def test_masked_equals_sliced(batch, spec, extra):
    """Each row of a padded batch equals the same row alone and unpadded (compacted).

    Global top-k is excluded per row (its threshold is over the batch), so it is checked on a
    one-row batch, where the two must also agree.
    """
    adv, ent, mask = batch
    s = pw.get_strategy(*spec[:1], **spec[1])
    if spec[0] == "global_topk":
        adv, ent, mask = adv[:1], ent[:1], mask[:1]
    padded_out = s(
        adv,
        torch.nn.functional.pad(ent, (0, extra), value=float("nan")),
        torch.nn.functional.pad(mask, (0, extra)),
    )
    for i in range(len(adv)):
        row = ent[i][mask[i]][None]
        alone = s(adv[i : i + 1], row, torch.ones_like(row, dtype=torch.bool))
        torch.testing.assert_close(
            padded_out[i][torch.nn.functional.pad(mask, (0, extra))[i]],
            alone[0],
            rtol=1e-6,
            atol=1e-6,
        )


@given(batches(), strategy_specs, st.randoms(use_true_random=False))
def test_row_permutation_equivariance(batch, spec, rnd):
    adv, ent, mask = batch
    perm = list(range(len(adv)))
    rnd.shuffle(perm)
    perm = torch.tensor(perm)
    s = pw.get_strategy(spec[0], **spec[1])
    torch.testing.assert_close(
        s(adv[perm], ent[perm], mask[perm]), s(adv, ent, mask)[perm], rtol=1e-6, atol=1e-6
    )


@given(
    batches(min_valid=1),
    st.floats(0.01, 1.0),
    st.floats(0.01, 1.0),
    st.sampled_from(["entropy", "proximal"]),
)
def test_topk_monotone_in_fraction(batch, f1, f2, score):
    adv, ent, mask = batch
    lo, hi = sorted((f1, f2))
    ones = torch.ones_like(adv)
    sel_lo = (
        pw.get_strategy("global_topk", fraction=lo, score=score, window=5)(ones, ent, mask) != 0
    )
    sel_hi = (
        pw.get_strategy("global_topk", fraction=hi, score=score, window=5)(ones, ent, mask) != 0
    )
    assert not (sel_lo & ~sel_hi).any()
    n = int(mask.sum())
    assert int(sel_lo.sum()) >= n - math.ceil((1 - lo) * (n - 1))  # at least k (ties add more)


@given(batches(min_valid=1), st.floats(0.01, 0.5), st.sampled_from(["entropy", "proximal"]))
def test_topk_keeps_the_highest_scores_and_no_more_than_its_share(batch, fraction, score):
    """Every kept token scores at least every dropped one, and with distinct scores at most
    ``n - floor((1 - f)(n - 1))`` are kept (torch.quantile's linear rule keeps
    ``n - ceil(...)``). Catches keeping every token (the monotonicity test above holds for it)
    or the lowest ones."""
    adv, ent, mask = batch
    s = (ent if score == "entropy" else pw.proximal_entropy(ent, mask, window=5))[mask]
    n = len(s)
    assume(n >= 3 and len(torch.unique(s)) == n)
    kept = pw.get_strategy("global_topk", fraction=fraction, score=score, window=5)(
        torch.ones_like(adv), ent, mask)[mask] != 0
    assert kept.any()
    if (~kept).any():
        assert float(s[kept].min()) >= float(s[~kept].max())
    assert int(kept.sum()) <= n - math.floor((1 - fraction) * (n - 1))


@given(batches(min_valid=2), windows.filter(lambda w: w > 1), temperatures,
       st.floats(0.5, 2.0), st.data())
def test_raising_a_tokens_entropy_raises_its_weight(batch, window, tau, bump, data):
    """e_t = exp(H_t / τ) / Σ_{k ∈ W(t)} exp(H_k / τ) grows with H_t and no other token's e
    grows; r_t = H_t / Σ_W H likewise (its other entropies kept > 0); a token already the
    whole of its window in fp32 stays so, up to a few ulp. Catches a statistic that ignores H (a
    constant 1/W passes the shift, scale, trend and sum properties). A token of a short row is
    several of its window's positions (reflect padding), so "the whole of its window" is e = c/W
    ... 1/copies: the share it tends to, c the positions its window holds of it."""
    _, ent, mask = batch
    rows = [i for i in range(len(mask)) if int(mask[i].sum()) >= 2]
    assume(rows)
    i = data.draw(st.sampled_from(rows))
    valid = torch.nonzero(mask[i]).flatten().tolist()
    t = data.draw(st.sampled_from(valid))
    j, length, half = valid.index(t), len(valid), window // 2
    copies = sum(int(reflect_index(torch.tensor(j + d), torch.tensor(length))) == j
                 for d in range(-half, half + 1))
    for stat, base in ((lambda h: pw.proximal_entropy(h, mask, window, tau), ent),
                       (lambda h: pw.window_average_entropy(h, mask, window), ent + 0.25)):
        raised = base.clone()
        raised[i, t] += bump
        before, after = stat(base), stat(raised)
        # fp32 rounding of exp(H / tau): a few ulp of the largest H / tau
        tol = 8 * 2.0 ** -23 * max(1.0, float(raised[mask].abs().max()) / tau)
        assert float(after[i, t]) >= float(before[i, t]) * (1 - tol)
        if float(before[i, t]) * copies < 0.99:  # not already the whole of its window in fp32
            assert float(after[i, t]) > float(before[i, t])
        others = mask.clone()
        others[i, t] = False
        assert bool((after[others] <= before[others] * (1 + 1e-5) + 1e-9).all())


@given(batches(), windows, temperatures)
def test_proximal_entropy_bounds(batch, window, tau):
    """0 < e <= 1, and e = 1/W exactly when the window is constant."""
    _, ent, mask = batch
    e = pw.proximal_entropy(ent, mask, window, tau)
    assert (e[mask] > 0).all() and (e[mask] <= 1 + 1e-6).all()
    const = pw.proximal_entropy(torch.full_like(ent, 0.3), mask, window, tau)
    torch.testing.assert_close(
        const[mask], torch.full_like(const[mask], 1 / window), rtol=1e-5, atol=0
    )


# ---------------------------------------------------------------------------------------- GTPO


@st.composite
def grouped_batches(draw, max_b=8, max_t=24):
    """A batch with group ids (a few groups, rows in any order) and success flags."""
    adv, ent, mask = draw(batches(max_b=max_b, max_t=max_t))
    b = len(adv)
    groups = torch.tensor(draw(st.lists(st.integers(-3, 3), min_size=b, max_size=b)))
    positive = torch.tensor(draw(st.lists(st.booleans(), min_size=b, max_size=b)))
    return adv, ent, mask, positive, groups


gtpo_specs = st.sampled_from([{}, {"normalize": "side"}, {"alpha1": 0.9, "alpha2": 0.1},
                              {"alpha1": 0.0, "alpha2": 1.0, "eps": 1e-3}])


@given(grouped_batches(), gtpo_specs, st.integers(0, 6), st.data())
def test_gtpo_padding_and_holes_never_matter(batch, params, extra, data):
    """Padding contents, extra padding columns and holes in the mask leave every valid token's
    advantage as in the compacted batch (positions count valid tokens)."""
    adv, ent, mask, positive, groups = batch
    s = pw.get_strategy("gtpo", **params)
    base = s(adv, ent, mask, positive=positive, groups=groups)
    # spread each row's valid tokens over a wider row with junk in the holes
    t = mask.shape[1] + extra
    wide_ent = torch.full((len(adv), t), float("nan"))
    wide_mask = torch.zeros(len(adv), t, dtype=torch.bool)
    for i in range(len(adv)):
        vals = ent[i][mask[i]]
        cols = sorted(data.draw(st.permutations(range(t)))[: len(vals)])
        wide_ent[i, cols] = vals
        wide_mask[i, cols] = True
    wide = s(adv, wide_ent, wide_mask, positive=positive, groups=groups)
    for i in range(len(adv)):
        torch.testing.assert_close(wide[i][wide_mask[i]], base[i][mask[i]], rtol=1e-6, atol=1e-6)
        assert (wide[i][~wide_mask[i]] == 0).all()


@given(grouped_batches(), gtpo_specs, st.randoms(use_true_random=False))
def test_gtpo_row_order_and_group_labels_do_not_matter(batch, params, rnd):
    adv, ent, mask, positive, groups = batch
    s = pw.get_strategy("gtpo", **params)
    base = s(adv, ent, mask, positive=positive, groups=groups)
    perm = list(range(len(adv)))
    rnd.shuffle(perm)
    perm = torch.tensor(perm)
    relabel = groups * 1000 - 7  # any one-to-one renaming of the groups
    out = s(adv[perm], ent[perm], mask[perm], positive=positive[perm], groups=relabel[perm])
    torch.testing.assert_close(out, base[perm], rtol=1e-6, atol=1e-6)


@given(grouped_batches(), st.floats(0.0, 1.0), st.sampled_from([1e-8, 1e-3]))
def test_gtpo_rewards_conserve_each_side_at_each_position(batch, alpha2, eps):
    """Prop. 2.2: at every position the shaped rewards of a group's active successes sum to
    (α1 + α2)·d_t, its failures' to -(α1 + α2)·h_t; with α1 + α2 = 1, the outcome rewards."""
    _, ent, mask, positive, groups = batch
    alpha1 = 1.0 - alpha2
    r = pw.gtpo_rewards(ent, mask, positive, groups, alpha1, alpha2, eps).double()
    index = mask.long().cumsum(1) - 1
    for g in groups.unique().tolist():
        for success in (True, False):
            rows = (groups == g) & (positive == success)
            for t in range(mask.shape[1]):
                at_t = mask & (index == t) & rows[:, None]
                n = int(at_t.sum())
                if n:
                    expected = n if success else -n
                    assert abs(float(r[at_t].sum()) - expected) < 1e-5 * n


@given(grouped_batches(), gtpo_specs)
def test_gtpo_standardises_what_it_promises(batch, params):
    """Over each group with both outcomes ("group") or each side of it ("side"), the valid
    token advantages have mean 0 and population std 1 (up to the 1e-6 added to the std);
    groups with one outcome get 0."""
    adv, ent, mask, positive, groups = batch
    s = pw.get_strategy("gtpo", **params)
    out = s(adv, ent, mask, positive=positive, groups=groups).double()
    r = pw.gtpo_rewards(ent, mask, positive, groups, params.get("alpha1", 1.0),
                        params.get("alpha2", 0.1), params.get("eps", 1e-8)).double()
    for g in groups.unique().tolist():
        rows = groups == g
        if positive[rows].all() or not positive[rows].any():
            assert (out[rows] == 0).all()
            continue
        units = (
            [rows]
            if params.get("normalize", "group") == "group"
            else [rows & positive, rows & ~positive]
        )
        for unit in units:
            sel = mask & unit[:, None]
            if not sel.any():
                continue
            a, x = out[sel], r[sel]
            std = float(x.std(unbiased=False))
            assert abs(float(a.mean())) < 1e-5
            assert abs(float(a.std(unbiased=False)) - std / (std + 1e-6)) < 1e-4


@given(grouped_batches(), st.sampled_from([{}, {"alpha1": 0.9, "alpha2": 0.1},
                                           {"alpha1": 0.5, "alpha2": 2.0, "eps": 1e-3}]))
def test_gtpo_group_centre_and_when_it_keeps_the_outcome_sign(batch, params):
    """normalize="group" centres a group's shaped rewards on their token mean, which is exactly
    ``c = (α1 + α2)(N+ − N−)/(N+ + N−)`` (N± the group's successful / failed valid tokens).
    Successes' rewards are >= α1 and failures' <= −α1, so where |c| < α1 every success token gets
    a positive advantage and every failure token a negative one (docs/strategies.md). Catches a
    shaping that loses Prop. 2.2's per-position sums (the mean identity), and a normalisation
    that flips a sign the docs say is kept (per-side standardisation, for one)."""
    adv, ent, mask, positive, groups = batch
    alpha1, alpha2 = params.get("alpha1", 1.0), params.get("alpha2", 0.1)
    out = pw.get_strategy("gtpo", **params)(adv, ent, mask, positive=positive, groups=groups)
    r = pw.gtpo_rewards(ent, mask, positive, groups, alpha1, alpha2, params.get("eps", 1e-8))
    for g in groups.unique().tolist():
        rows = groups == g
        if positive[rows].all() or not positive[rows].any():
            continue
        succ, fail = mask & (rows & positive)[:, None], mask & (rows & ~positive)[:, None]
        n_pos, n_neg = int(succ.sum()), int(fail.sum())
        if n_pos + n_neg == 0:
            continue
        c = (alpha1 + alpha2) * (n_pos - n_neg) / (n_pos + n_neg)
        assert abs(float(r[succ | fail].double().mean()) - c) < 1e-5 * (1 + abs(c))
        if alpha1 - abs(c) > 1e-3:
            assert (out[succ] > 0).all() and (out[fail] < 0).all()
