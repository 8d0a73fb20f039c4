"""pepo.loss against a loop reference of Eq. (2)/(8)."""

import math

import pytest
import torch

from pepo.loss import clipped_policy_loss, policy_loss_metrics


def ref_loss(lp, old, adv, mask, eps_low, eps_high, n=None):
    total, count = 0.0, 0
    for i in range(lp.shape[0]):
        for t in range(lp.shape[1]):
            if not mask[i, t]:
                continue
            ratio = torch.exp(lp[i, t].double() - old[i, t].double()).item()
            a = float(adv[i, t])
            clipped = min(max(ratio, 1 - eps_low), 1 + eps_high)
            total += -min(ratio * a, clipped * a)
            count += 1
    return total / (n if n is not None else count)


def batch(seed=0, b=4, t=9):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=g) * 3
    lp = old + torch.randn(b, t, generator=g) * 0.4  # ratios both inside and outside the clip
    adv = torch.randn(b, t, generator=g)
    mask = torch.rand(b, t, generator=g) > 0.3
    return lp, old, adv, mask


@pytest.mark.parametrize("eps_low,eps_high", [(0.2, 0.28), (0.1, 0.1), (0.0, 0.5)])
def test_loss_matches_reference(eps_low, eps_high):
    lp, old, adv, mask = batch()
    got = clipped_policy_loss(lp, old, adv, mask, eps_low, eps_high)
    assert got.dtype == torch.float32 and got.dim() == 0
    assert got.item() == pytest.approx(
        ref_loss(lp, old, adv, mask, eps_low, eps_high), rel=1e-5, abs=1e-7
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs_are_upcast(dtype):
    """bf16/fp16 log-probs and advantages give the float64 reference of their values: catches
    the ratio computed in the inputs' dtype (a bf16 loss 3e-3 off)."""
    lp, old, adv, mask = (x.to(dtype) if x.is_floating_point() else x for x in batch(seed=5))
    got = clipped_policy_loss(lp, old, adv, mask)
    assert got.dtype == torch.float32
    want = ref_loss(lp.float(), old.float(), adv.float(), mask, 0.2, 0.28)
    assert got.item() == pytest.approx(want, rel=1e-5, abs=1e-7)


def test_hand_worked():
    # ratio e^0.5 = 1.6487 > 1.28, A = 1: min(1.6487, 1.28) = 1.28 -> loss -1.28
    # ratio 1, A = -2: -(-2) = 2.  Mean over 2 tokens: (-1.28 + 2) / 2 = 0.36
    lp = torch.tensor([[0.5, 0.0]])
    old = torch.zeros(1, 2)
    adv = torch.tensor([[1.0, -2.0]])
    got = clipped_policy_loss(lp, old, adv, torch.ones(1, 2, dtype=torch.bool))
    assert got.item() == pytest.approx(0.36, rel=1e-6)


def test_micro_batches_sum_to_full_batch_loss_and_gradient():
    lp, old, adv, mask = batch(seed=1, b=8, t=12)
    lp = lp.clone().requires_grad_(True)
    full = clipped_policy_loss(lp, old, adv, mask)
    (g_full,) = torch.autograd.grad(full, lp)
    n = mask.sum()
    parts = [
        clipped_policy_loss(
            lp[s : s + 2], old[s : s + 2], adv[s : s + 2], mask[s : s + 2], num_tokens=n
        )
        for s in range(0, 8, 2)
    ]
    total = sum(parts)
    (g_acc,) = torch.autograd.grad(total, lp)
    torch.testing.assert_close(total, full, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(g_acc, g_full, rtol=1e-6, atol=1e-8)
    # Normalising each micro-batch by its own count would not match (the trap this avoids).
    own = (
        sum(
            clipped_policy_loss(lp[s : s + 2], old[s : s + 2], adv[s : s + 2], mask[s : s + 2])
            for s in range(0, 8, 2)
        )
        / 4
    )
    assert abs(own.item() - full.item()) > 1e-4


def test_padding_never_leaks_into_loss_or_gradient():
    lp, old, adv, mask = batch(seed=2)
    lp = torch.where(mask, lp, float("nan")).requires_grad_(True)
    old = torch.where(mask, old, float("inf"))
    adv = torch.where(mask, adv, float("nan"))
    loss = clipped_policy_loss(lp, old, adv, mask)
    loss.backward()
    assert torch.isfinite(loss)
    assert torch.isfinite(lp.grad).all()
    assert lp.grad[~mask].eq(0).all()


def test_a_zero_advantage_token_adds_nothing_whatever_its_ratio():
    """A token the strategy gave no weight (an all-equal group, the 80 % global_topk zeroes)
    whose log-ratio is beyond exp's range (~88): catches 0 * inf, a NaN loss and gradient that
    made the whole mini-batch a skipped step. A weighted token's huge ratio stays what Eq. (2)
    makes it."""
    lp = torch.tensor([[-0.5, -1.0, -2.0]], requires_grad=True)
    old = torch.tensor([[-95.0, -1.2, -2.1]])
    adv = torch.tensor([[0.0, 1.0, -0.5]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    loss = clipped_policy_loss(lp, old, adv, mask)
    loss.backward()
    want = ref_loss(lp.detach()[:, 1:], old[:, 1:], adv[:, 1:], mask[:, 1:], 0.2, 0.28, n=3)
    assert loss.item() == pytest.approx(want, rel=1e-6)
    assert lp.grad[0, 0].item() == 0.0 and torch.isfinite(lp.grad).all()
    m = policy_loss_metrics(lp.detach(), old, adv, mask)
    assert m["ratio_max"].item() == math.inf  # the diagnostics still see the true ratio
    hot = clipped_policy_loss(lp.detach(), old, torch.tensor([[-1.0, 1.0, -0.5]]), mask)
    assert hot.item() == math.inf  # A < 0 keeps the unclipped ratio: a non-finite step


def test_metrics_read_only_valid_ratios_and_the_right_side_of_the_clip():
    """Catches ``ratio_min``/``ratio_max`` over padding too (its ratio is exp(0) = 1: a batch
    whose valid ratios are all above 1 reported a minimum of 1), and ``eps_low``/``eps_high``
    swapped in the clip fractions (a ratio of 1.25 with A > 0 is inside [0.95, 1.7])."""
    lp = torch.tensor([[0.3, 0.2, 5.0], [0.25, 0.1, -9.0]])
    mask = torch.tensor([[True, True, False], [True, True, False]])
    m = policy_loss_metrics(lp, torch.zeros(2, 3), torch.ones(2, 3), mask)
    assert m["ratio_min"].item() == pytest.approx(math.exp(0.1), rel=1e-6)
    assert m["ratio_max"].item() == pytest.approx(math.exp(0.3), rel=1e-6)
    # each side on its own: a ratio clipped on one side and one on the other would sum to the
    # same count with the clip range swapped
    for ratio, a, want in ((1.25, 1.0, 0.0), (0.9, -1.0, 0.5)):
        lp = torch.tensor([[math.log(ratio), 0.0]])
        m = policy_loss_metrics(lp, torch.zeros(1, 2), torch.tensor([[a, 1.0]]),
                                torch.ones(1, 2, dtype=torch.bool), eps_low=0.05, eps_high=0.7)
        assert m["clip_fraction"].item() == want, ratio
        side = "clip_fraction_low" if a < 0 else "clip_fraction_high"
        assert m[side].item() == want, ratio


def test_importance_weights_are_constants_and_never_read_at_padding():
    """Catches weights' padding multiplied in before the mask (a NaN weight there made the loss
    NaN), weights that carry grad accepted, and ``truncated_is_weights`` returning a tensor
    attached to the graph of its inputs."""
    from pepo.loss import truncated_is_weights

    lp, old, adv, mask = batch(seed=9)
    w = torch.where(mask, torch.rand(mask.shape), float("nan"))
    loss = clipped_policy_loss(lp, old, adv, mask, is_weights=w)
    want = clipped_policy_loss(lp, old, adv, mask, is_weights=torch.where(mask, w, 0.0))
    assert torch.isfinite(loss) and loss.item() == want.item()
    with pytest.raises(ValueError, match="^is_weights require grad"):
        clipped_policy_loss(lp, old, adv, mask, is_weights=w.clone().requires_grad_(True))
    old_g = old.clone().requires_grad_(True)
    tis = truncated_is_weights(old_g, old - 0.1, mask, cap=2.0)
    assert not tis.requires_grad and tis.grad_fn is None


def test_empty_batches_give_zero_loss_and_neutral_metrics():
    """A rank's share can be empty: no rows, no columns, or no valid token with a count of 0
    given as an int or a tensor. Catches ``amin`` of an empty tensor (a RuntimeError from the
    metrics) and an int 0 refused where the 0-dim tensor 0 is taken."""
    for shape in ((0, 3), (3, 0), (0, 0)):
        z = torch.zeros(shape)
        none = torch.zeros(shape, dtype=torch.bool)
        m = policy_loss_metrics(z, z, z, none)
        assert m["ratio_min"].item() == m["ratio_max"].item() == 1.0, shape
        assert m["clip_fraction"].item() == 0.0 and int(m["num_tokens"]) == 0, shape
        assert clipped_policy_loss(z, z, z, none).item() == 0.0, shape
    lp, old, adv, mask = batch(seed=3)
    none = torch.zeros_like(mask)
    assert clipped_policy_loss(lp, old, adv, none, num_tokens=0).item() == 0.0
    assert clipped_policy_loss(lp, old, adv, none, num_tokens=torch.tensor(0)).item() == 0.0


def test_tensors_on_two_devices_are_refused_naming_them():
    """Catches torch's own error (which names no argument) or, with a meta tensor, data that
    silently go nowhere."""
    from pepo.entropy import logprobs_and_entropy, logprobs_and_entropy_from_hidden

    lp, old, adv, mask = batch()
    with pytest.raises(ValueError, match=r"mask \(meta\) must be on the same device"):
        clipped_policy_loss(lp, old, adv, mask.to("meta"))
    with pytest.raises(ValueError, match=r"is_weights \(meta\) must be on the same device"):
        clipped_policy_loss(lp, old, adv, mask, is_weights=torch.ones(4, 9, device="meta"))
    with pytest.raises(ValueError, match=r"old_logprobs \(meta\).* must be on the same device"):
        policy_loss_metrics(lp, old.to("meta"), adv, mask)
    hidden, targets = torch.randn(2, 3, 4), torch.randint(0, 7, (2, 3))
    with pytest.raises(ValueError, match=r"weight \(meta\).* must be on the same device"):
        logprobs_and_entropy_from_hidden(hidden, torch.randn(7, 4, device="meta"), targets)
    with pytest.raises(ValueError, match=r"targets \(meta\) must be on the same device"):
        logprobs_and_entropy(torch.randn(2, 3, 7), targets.to("meta"))


def test_all_masked_gives_zero_loss_and_no_update():
    lp, old, adv, mask = batch(seed=3)
    lp = lp.requires_grad_(True)
    loss = clipped_policy_loss(lp, old, adv, torch.zeros_like(mask))
    loss.backward()
    assert loss.item() == 0.0 and lp.grad.eq(0).all()


def test_errors():
    lp, old, adv, mask = batch()
    with pytest.raises(ValueError, match="advantages require grad"):
        clipped_policy_loss(lp, old, adv.requires_grad_(True), mask)
    with pytest.raises(ValueError,
                       match=r"advantages must be \[B, T\]=\[4, 9\] like logprobs, got \[4\]; "
                             r"expand"):
        clipped_policy_loss(lp, old, adv[:, 0].detach(), mask)
    with pytest.raises(ValueError, match="mask must have dtype torch.bool"):
        clipped_policy_loss(lp, old, adv.detach(), mask.long())
    with pytest.raises(ValueError, match="eps_low must be < 1"):
        clipped_policy_loss(lp, old, adv.detach(), mask, eps_low=1.0)
    with pytest.raises(ValueError, match="num_tokens must be an int >= 0"):
        clipped_policy_loss(lp, old, adv.detach(), mask, num_tokens=2.5)



def test_unvalidated_calls_still_refuse_a_bad_layout():
    """``validate=False`` skips the clip range and gradient checks, not the layout: catches a
    ``[B]`` ``advantages`` (or a ``[B, 1]`` ``is_weights``) broadcast over ``[B, T]`` into a
    wrong loss, which the unvalidated path returned before (a sequence-level -1.0)."""
    lp, old, adv, mask = batch()
    adv = adv.detach()
    with pytest.raises(ValueError, match=r"advantages must be \[B, T\]=\[4, 9\] like logprobs, "
                                         r"got \[4\]; expand"):
        clipped_policy_loss(lp, old, adv[:, 0], mask, validate=False)
    with pytest.raises(ValueError, match=r"old_logprobs must be \[B, T\]=\[4, 9\]"):
        clipped_policy_loss(lp, old[:, :1], adv, mask, validate=False)
    with pytest.raises(ValueError, match="mask must have dtype torch.bool"):
        clipped_policy_loss(lp, old, adv, mask.float(), validate=False)
    with pytest.raises(ValueError, match="logprobs must be a floating-point"):
        clipped_policy_loss(lp.long(), old, adv, mask, validate=False)
    with pytest.raises(ValueError, match=r"is_weights must be \[B, T\]=\[4, 9\] like logprobs, "
                                         r"got \[4, 1\]"):
        clipped_policy_loss(lp, old, adv, mask, is_weights=torch.ones(4, 1), validate=False)
    # what validate=False does skip: Python checks of the clip range and of gradients
    w = torch.rand(4, 9)
    want = clipped_policy_loss(lp, old, adv, mask, is_weights=w)
    got = clipped_policy_loss(lp, old, adv.requires_grad_(True), mask,
                              is_weights=w.requires_grad_(True), validate=False)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_metrics():
    lp = torch.tensor([[0.5, 0.0, -0.5, 0.1]])
    old = torch.zeros(1, 4)
    adv = torch.tensor([[1.0, 0.0, -1.0, 2.0]])
    mask = torch.tensor([[True, True, True, False]])
    m = policy_loss_metrics(lp, old, adv, mask)
    r = torch.exp(torch.tensor([0.5, 0.0, -0.5]))
    # token 0: ratio 1.65 > 1.28 with A > 0 -> clipped (high);
    # token 2: ratio 0.61 < 0.8, A < 0 -> clipped (low)
    assert m["clip_fraction"].item() == pytest.approx(2 / 3)
    assert m["clip_fraction_high"].item() == pytest.approx(1 / 3)
    assert m["clip_fraction_low"].item() == pytest.approx(1 / 3)
    assert m["ratio_mean"].item() == pytest.approx(r.mean().item(), rel=1e-6)
    assert m["ratio_min"].item() == pytest.approx(r.min().item(), rel=1e-6)
    assert m["ratio_max"].item() == pytest.approx(r.max().item(), rel=1e-6)
    assert m["approx_kl"].item() == pytest.approx((r - 1 - r.log()).mean().item(), rel=1e-5)
    assert m["weighted_fraction"].item() == pytest.approx(2 / 3)
    assert int(m["num_tokens"]) == 3


def test_metrics_of_a_batch_without_valid_tokens():
    """A micro-batch of padding only (a rank can get one): every mean 0, ratio min and max 1,
    whatever the padding holds. Catches the min/max guards left out (+inf and -inf logged) and
    means divided by 0 (NaN)."""
    lp = torch.tensor([[0.5, float("nan")], [-3.0, 2.0]])
    m = policy_loss_metrics(lp, torch.zeros(2, 2), torch.ones(2, 2),
                            torch.zeros(2, 2, dtype=torch.bool))
    assert m["ratio_min"].item() == 1.0 and m["ratio_max"].item() == 1.0
    for k in ("clip_fraction", "clip_fraction_low", "clip_fraction_high", "ratio_mean",
              "approx_kl", "weighted_fraction", "num_tokens"):
        assert m[k].item() == 0, k


@pytest.mark.parametrize("eps_low, eps_high, want", [
    (0.2, 0.28, [True, False, True, False, False, False]),
    (0.05, 0.7, [False, False, True, False, False, True]),
])
def test_clip_fraction_counts_only_active_clips(eps_low, eps_high, want):
    """Tokens outside the clip range on the harmless side (ratio above 1 + eps_high with A < 0,
    below 1 - eps_low with A > 0) keep the unclipped term: they are not clipped. A metric that
    counted `clipped != unclipped`, or any ratio outside the range, would count them; the second
    clip range catches one that ignores ``eps_low``/``eps_high`` for the defaults."""
    log_r = torch.tensor(
        [[0.5, 0.5, -0.5, -0.5, 0.1, -0.1]]
    )  # ratios 1.65, 1.65, 0.61, 0.61, 1.11, 0.90
    adv = torch.tensor([[1.0, -1.0, -1.0, 1.0, 1.0, -2.0]])
    mask = torch.ones_like(adv, dtype=torch.bool)
    m = policy_loss_metrics(log_r, torch.zeros_like(log_r), adv, mask, eps_low, eps_high)
    # from Eq. (2) token by token: the clipped term is active when it is the larger loss
    active = []
    for lr, a in zip(log_r[0].double().tolist(), adv[0].double().tolist()):
        r = math.exp(lr)
        active.append(-a * min(max(r, 1 - eps_low), 1 + eps_high) > -a * r)
    assert active == want
    high = sum(a and lr > 0 for a, lr in zip(active, log_r[0].tolist()))
    assert m["clip_fraction"].item() == pytest.approx(sum(active) / len(active))
    assert m["clip_fraction_high"].item() == pytest.approx(high / 6)
    assert m["clip_fraction_low"].item() == pytest.approx((sum(active) - high) / 6)


def ref_loss_float64(lp, old, adv, mask, eps_low, eps_high, n):
    """Eq. (2)/(8) as a float64 loop over tokens, differentiable by autograd."""
    total = lp.new_zeros((), dtype=torch.float64)
    for i in range(lp.shape[0]):
        for t in range(lp.shape[1]):
            if mask[i, t]:
                ratio = torch.exp(lp[i, t] - old[i, t].double())
                a = float(adv[i, t])
                clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high)
                total = total - torch.minimum(ratio * a, clipped * a)
    return total / n


@pytest.mark.parametrize("eps_low,eps_high", [(0.2, 0.28), (0.1, 0.5)])
def test_gradient_matches_autograd_of_a_float64_loop_reference(eps_low, eps_high):
    """Catches a wrong gradient anywhere in the clip logic: min/max swapped, a clip that
    passes gradient, or a missing one. Tokens are placed in every region (the assertions
    below check each is populated): inside the clip range, and outside it on both sides with
    each sign of the advantage, where the gradient must be exactly 0 only when the clipped
    term is the active one (ratio above 1 + eps_high with A > 0, below 1 - eps_low with
    A < 0)."""
    g = torch.Generator().manual_seed(5)
    b, t = 6, 40
    old = -torch.rand(b, t, generator=g) * 2
    log_ratio = (torch.rand(b, t, generator=g) - 0.5) * 1.6  # ratios in [0.45, 2.2]
    adv = torch.randn(b, t, generator=g)
    mask = torch.rand(b, t, generator=g) > 0.2
    lp = (old + log_ratio).clone().requires_grad_(True)
    n = 53  # the full batch's count when this is one micro-batch of it
    loss = clipped_policy_loss(lp, old, adv, mask, eps_low, eps_high, num_tokens=n)
    (grad,) = torch.autograd.grad(loss, lp)
    lp64 = (old + log_ratio).double().requires_grad_(True)
    ref = ref_loss_float64(lp64, old, adv, mask, eps_low, eps_high, n)
    (ref_grad,) = torch.autograd.grad(ref, lp64)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-5, abs=1e-7)
    torch.testing.assert_close(grad.double(), ref_grad, rtol=1e-5, atol=1e-7)
    ratio = log_ratio.exp()
    clipped_high = mask & (ratio > 1 + eps_high) & (adv > 0)
    clipped_low = mask & (ratio < 1 - eps_low) & (adv < 0)
    free_high = (
        mask & (ratio > 1 + eps_high) & (adv < 0)
    )  # unclipped term is the min: gradient flows
    free_low = mask & (ratio < 1 - eps_low) & (adv > 0)
    inside = mask & (ratio > 1 - eps_low) & (ratio < 1 + eps_high)
    for region in (clipped_high, clipped_low, free_high, free_low, inside):
        assert int(region.sum()) >= 3
    assert grad[clipped_high | clipped_low].eq(0).all()
    assert grad[free_high | free_low | inside].ne(0).all()
    # d(-ρ A / n)/d lp = -ρ A / n where the unclipped term is active
    active = free_high | free_low | inside
    torch.testing.assert_close(grad[active], (-ratio * adv / n)[active], rtol=1e-5, atol=1e-8)
    assert grad[~mask].eq(0).all()


def test_negative_token_count_never_gives_a_finite_loss():
    """Catches a negative num_tokens silently clamped to 1: an int raises, a tensor (no host
    sync) gives NaN."""
    lp, old, adv, mask = batch()
    with pytest.raises(ValueError, match="num_tokens must be an int >= 0, got -5"):
        clipped_policy_loss(lp, old, adv, mask, num_tokens=-5)
    assert torch.isnan(clipped_policy_loss(lp, old, adv, mask, num_tokens=torch.tensor(-5)))
    assert (
        clipped_policy_loss(lp, old, adv, torch.zeros_like(mask), num_tokens=torch.tensor(0)) == 0
    )


def test_truncated_is_weights_and_weighted_loss_match_a_loop_reference():
    """Catches a ratio taken the wrong way round (rollout / trainer), a cap applied from below,
    weights that leak into padding, and a loss that ignores its is_weights."""
    from pepo.loss import truncated_is_weights

    lp, old, adv, mask = batch(seed=7, b=5, t=11)
    g = torch.Generator().manual_seed(8)
    rollout = old + torch.randn(old.shape, generator=g) * 0.5  # engine log-probs, some far off
    w = truncated_is_weights(old, rollout, mask, cap=2.0)
    for i in range(5):
        for t in range(11):
            expected = (
                min(math.exp(float(old[i, t]) - float(rollout[i, t])), 2.0) if mask[i, t] else 0.0
            )
            assert float(w[i, t]) == pytest.approx(expected, rel=1e-6, abs=1e-7)
    assert (w[mask] == 2.0).any() and (w[mask] < 1.0).any()  # both the cap and ratios < 1 occur
    # the weighted loss: each token's clipped term times its weight, over all valid tokens
    total = 0.0
    for i in range(5):
        for t in range(11):
            if mask[i, t]:
                ratio = math.exp(float(lp[i, t]) - float(old[i, t]))
                a = float(adv[i, t])
                total += -min(ratio * a, min(max(ratio, 0.8), 1.28) * a) * float(w[i, t])
    got = clipped_policy_loss(lp, old, adv, mask, is_weights=w)
    assert got.item() == pytest.approx(total / int(mask.sum()), rel=1e-5, abs=1e-7)
    assert got.item() != pytest.approx(clipped_policy_loss(lp, old, adv, mask).item(), rel=1e-3)
    with pytest.raises(ValueError, match="cap must be a finite number > 0"):
        truncated_is_weights(old, rollout, mask, cap=0.0)


def test_the_loss_component_is_clipped_policy_loss_with_its_clip_range_bound():
    """Catches a component that drops the configured clip range (the defaults 0.2/0.28 would
    be used: a ratio of 1.5 is clipped differently at eps_high 0.1) or the call's num_tokens
    and is_weights."""
    from pepo.loss import ClippedPolicyLoss, clipped_policy_loss

    g = torch.Generator().manual_seed(0)
    old = -torch.rand(3, 5, generator=g)
    lp = old + torch.tensor([0.4, -0.4, 0.0, 0.1, -0.1]).expand(3, 5)  # ratios up to 1.49
    adv, mask = torch.randn(3, 5, generator=g), torch.rand(3, 5, generator=g) > 0.3
    w = torch.rand(3, 5, generator=g)
    loss = ClippedPolicyLoss(eps_low=0.05, eps_high=0.1)
    got = loss(lp, old, adv, mask, num_tokens=40, is_weights=w)
    want = clipped_policy_loss(lp, old, adv, mask, eps_low=0.05, eps_high=0.1, num_tokens=40,
                               is_weights=w)
    assert torch.equal(got, want)
    assert not torch.equal(got, clipped_policy_loss(lp, old, adv, mask, num_tokens=40,
                                                    is_weights=w))
    with pytest.raises(ValueError, match="eps_low must be < 1"):
        ClippedPolicyLoss(eps_low=1.0)
    # validate= passes through: advantages that require grad are refused by default and taken
    # as they are without the check (the component had no switch: a call with it was a
    # TypeError)
    live = adv.clone().requires_grad_(True)
    with pytest.raises(ValueError, match="advantages require grad"):
        loss(lp, old, live, mask, num_tokens=40)
    unchecked = loss(lp, old, live, mask, num_tokens=40, validate=False)
    assert torch.equal(unchecked.detach(), clipped_policy_loss(
        lp, old, adv, mask, eps_low=0.05, eps_high=0.1, num_tokens=40))


def test_approx_kl_is_k3_on_an_asymmetric_log_ratio():
    """``mean(ρ - 1 - log ρ)`` at one token of log-ratio 0.5: e^0.5 - 1.5. The metrics' test
    used log-ratios 0.5, 0, -0.5, whose logs sum to 0, so the log term's sign could not show."""
    m = policy_loss_metrics(torch.tensor([[0.5]]), torch.zeros(1, 1), torch.ones(1, 1),
                            torch.ones(1, 1, dtype=torch.bool))
    assert m["approx_kl"].item() == pytest.approx(math.exp(0.5) - 1.5, rel=1e-6)


def test_the_loss_components_default_clip_range_is_the_papers():
    """``ClippedPolicyLoss()`` clips at 1 + 0.28 (App. C.1): a ratio of e^0.25 = 1.284 with
    A = 1 gives -1.28. Catches a default eps_high of 0.2 (-1.20)."""
    from pepo.loss import ClippedPolicyLoss

    loss = ClippedPolicyLoss()(torch.tensor([[0.25]]), torch.zeros(1, 1), torch.ones(1, 1),
                               torch.ones(1, 1, dtype=torch.bool))
    assert loss.item() == pytest.approx(-1.28, rel=1e-6)


def test_importance_weights_must_be_float_tensors_of_one_layout():
    """``is_weights`` and ``truncated_is_weights``' inputs get the checks the other tensors
    get. Catches bool / int weights accepted (a bool weight is a mask, an int one truncates
    the capped ratios to 0 or 1), a ``[B]`` ``old_logprobs`` broadcast by
    ``truncated_is_weights``, and a device mix reported by torch naming no argument."""
    from pepo.loss import truncated_is_weights

    lp, old, adv, mask = batch()
    adv = adv.detach()
    for dtype in (torch.bool, torch.long):
        w = torch.ones(4, 9, dtype=dtype)
        with pytest.raises(ValueError, match=f"is_weights must be a floating-point tensor, got "
                                             f"dtype {dtype}"):
            clipped_policy_loss(lp, old, adv, mask, is_weights=w)
        with pytest.raises(ValueError, match="is_weights must be a floating-point tensor"):
            clipped_policy_loss(lp, old, adv, mask, is_weights=w, validate=False)
    with pytest.raises(ValueError, match=r"old_logprobs must be \[B, T\], got \[4\]"):
        truncated_is_weights(old[:, 0], old[:, 0], mask[:, 0], cap=2.0)
    with pytest.raises(ValueError, match="rollout_logprobs must be a floating-point tensor"):
        truncated_is_weights(old, old.long(), mask, cap=2.0)
    with pytest.raises(ValueError, match=r"old_logprobs \(cpu\), rollout_logprobs \(meta\), "
                                         r"mask \(cpu\) must be on the same device"):
        truncated_is_weights(old, old.to("meta"), mask, cap=2.0)


@pytest.mark.parametrize("flag", [None, "false", 0])
def test_validate_must_be_a_bool(flag):
    """Catches ``if not validate``: ``validate=None`` silently skipped the checks."""
    from pepo.estimators import group_advantages

    lp, old, adv, mask = batch()
    with pytest.raises(ValueError, match=r"validate must be True or False, got "):
        clipped_policy_loss(lp, old, adv.detach(), mask, validate=flag)
    with pytest.raises(ValueError, match=r"validate must be True or False, got "):
        group_advantages(torch.tensor([1.0, math.nan]), 2, validate=flag)


def test_numpy_token_count():
    """``num_tokens=np.int64(n)`` (a count summed with NumPy) is the int it holds. Catches an
    ``isinstance(num_tokens, int)`` check, which refused it."""
    import numpy as np

    lp, old, adv, mask = batch()
    n = int(mask.sum()) + 3
    assert torch.equal(clipped_policy_loss(lp, old, adv.detach(), mask, num_tokens=np.int64(n)),
                       clipped_policy_loss(lp, old, adv.detach(), mask, num_tokens=n))
