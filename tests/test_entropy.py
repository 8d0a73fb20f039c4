"""pepo.entropy against a naive full-softmax float64 reference."""

import pytest
import torch

import pepo.entropy
from pepo.entropy import logprobs_and_entropy, logprobs_and_entropy_from_hidden


@pytest.fixture(params=[4096, 7, None], ids=["one-vocab-block", "vocab-blocks-of-7",
                                              "gpu-path"])
def vocab_block(request, monkeypatch):
    """The CPU vocabulary block of both paths: the shipped size (one block for these
    vocabularies) and 7 columns (several blocks, the last one short, wherever V > 7), so that
    the tests also run the running maximum across blocks and the per-block target and
    gradient; and the other devices' path (one block, no exp floor: underflowed and masked
    terms zeroed in place), run here on the CPU."""
    if request.param is None:
        monkeypatch.setattr(pepo.entropy, "_cpu_path", lambda device: False)
    else:
        monkeypatch.setattr(pepo.entropy, "_CPU_VOCAB_BLOCK", request.param)
    return request.param


def ref(logits, targets, temperature=1.0):
    """Naive formula: log_softmax over the whole vocabulary in float64."""
    x = logits.double() / temperature
    logp = torch.log_softmax(x, dim=-1)
    p = logp.exp()
    ent = -torch.where(p > 0, p * logp, torch.zeros_like(p)).sum(-1)
    return logp.gather(-1, targets[..., None]).squeeze(-1), ent


def data(b=3, t=7, v=50, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(b, t, v, generator=g) * 3).to(dtype)
    targets = torch.randint(0, v, (b, t), generator=g)
    return logits, targets


@pytest.mark.parametrize("chunk", [1, 4, 5, 1024])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_values_and_gradient_match_naive(chunk, temperature, vocab_block):
    logits, targets = data()
    x = logits.clone().requires_grad_(True)
    lp, ent = logprobs_and_entropy(x, targets, chunk_size=chunk, temperature=temperature)
    r_lp, r_ent = ref(logits, targets, temperature)
    assert lp.shape == ent.shape == (3, 7) and lp.dtype == ent.dtype == torch.float32
    torch.testing.assert_close(lp.double(), r_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent.double(), r_ent, rtol=1e-5, atol=1e-5)
    assert not ent.requires_grad
    w = torch.randn(3, 7, generator=torch.Generator().manual_seed(1))
    (g,) = torch.autograd.grad((lp * w).sum(), x)
    xr = logits.double().requires_grad_(True)
    (gr,) = torch.autograd.grad((ref(xr, targets, temperature)[0] * w.double()).sum(), xr)
    torch.testing.assert_close(g.double(), gr, rtol=1e-5, atol=1e-6)


def test_gradcheck_float64(vocab_block):
    logits, targets = data(b=2, t=3, v=6)
    x = logits.double().requires_grad_(True)
    assert torch.autograd.gradcheck(
        lambda z: logprobs_and_entropy(z, targets, chunk_size=4, temperature=0.7)[0], (x,)
    )
    h = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda a, b: logprobs_and_entropy_from_hidden(a, b, targets, chunk_size=4)[0], (h, w)
    )


def test_minus_inf_logits_are_safe(vocab_block):
    logits, targets = data(v=20)
    logits[..., 10:] = float("-inf")  # a masked vocabulary half
    targets = targets % 10
    logits[0, 0, :] = float("-inf")  # a fully masked row: no distribution, so NaN, zero gradient
    x = logits.clone().requires_grad_(True)
    lp, ent = logprobs_and_entropy(x, targets, chunk_size=4)
    torch.where(torch.isnan(lp), 0.0, lp).sum().backward()
    assert torch.isnan(lp[0, 0]) and torch.isnan(ent[0, 0])  # not -3.4e38 and -0: finite lies
    rest = torch.ones_like(lp, dtype=torch.bool)
    rest[0, 0] = False
    assert torch.isfinite(lp[rest]).all() and torch.isfinite(ent[rest]).all()
    assert torch.isfinite(x.grad).all() and (x.grad[0, 0] == 0).all()
    r_lp, r_ent = ref(logits[rest].double().requires_grad_(True), targets[rest])
    torch.testing.assert_close(lp[rest].double(), r_lp.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent[rest].double(), r_ent, rtol=1e-5, atol=1e-5)
    assert x.grad[..., 10:][1:].eq(0).all()
    r_lp, r_ent = ref(logits[1:, :, :10], targets[1:])  # same as the unmasked half alone
    torch.testing.assert_close(lp[1:].double(), r_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent[1:].double(), r_ent, rtol=1e-5, atol=1e-5)


def test_a_target_of_minus_inf_logit_gets_the_lowest_finite_logprob(vocab_block):
    """The module's rule: a taken token whose logit is -inf (masked after sampling) gets the
    lowest finite fp32 log-prob, not -inf (the loss's ratio exp(-inf - -inf) would be NaN);
    the row's entropy, the other log-probs and the gradient stay finite and exact. Catches the
    floor's clamp left out (both paths share the statistics it is in)."""
    logits, targets = data(v=20)
    logits[..., 10:] = float("-inf")
    targets = targets % 10
    targets[1, 2] = 15  # a masked column, in a row that has finite ones
    x = logits.clone().requires_grad_(True)
    lp, ent = logprobs_and_entropy(x, targets, chunk_size=4)
    lp.sum().backward()
    assert lp[1, 2].item() == torch.finfo(torch.float32).min
    rest = torch.ones_like(lp, dtype=torch.bool)
    rest[1, 2] = False
    r_lp, r_ent = ref(logits[..., :10], targets % 10)
    torch.testing.assert_close(lp[rest].double(), r_lp[rest], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent.double(), r_ent, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(x.grad).all()
    # the floor is a constant: no gradient from that token (it had g/τ at its masked column
    # and -g·p/τ on the row's others), the other rows' gradients the reference's
    assert (x.grad[1, 2] == 0).all()
    r_x = logits[..., :10].double().requires_grad_(True)
    r_lp, _ = ref(r_x, targets % 10)
    r_lp[rest].sum().backward()
    torch.testing.assert_close(x.grad[..., :10].double(), r_x.grad, rtol=1e-5, atol=1e-6)


def test_bf16_logits_computed_in_fp32(vocab_block):
    logits, targets = data(dtype=torch.bfloat16)
    x = logits.clone().requires_grad_(True)
    lp, ent = logprobs_and_entropy(x, targets, chunk_size=8)
    r_lp, r_ent = ref(logits.float(), targets)  # the same bf16 values, exact arithmetic
    torch.testing.assert_close(lp.double(), r_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent.double(), r_ent, rtol=1e-5, atol=1e-5)
    lp.sum().backward()
    assert x.grad.dtype == torch.bfloat16


@pytest.mark.parametrize("chunk", [3, 1024])
def test_hidden_variant_matches_naive(chunk, vocab_block):
    g = torch.Generator().manual_seed(4)
    h = torch.randn(2, 5, 8, generator=g)
    w = torch.randn(40, 8, generator=g)
    targets = torch.randint(0, 40, (2, 5), generator=g)
    hh, ww = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    lp, ent = logprobs_and_entropy_from_hidden(hh, ww, targets, chunk_size=chunk, temperature=0.8)
    hr, wr = h.double().requires_grad_(True), w.double().requires_grad_(True)
    r_lp, r_ent = ref(hr @ wr.t(), targets, 0.8)
    torch.testing.assert_close(lp.double(), r_lp.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent.double(), r_ent.detach(), rtol=1e-5, atol=1e-5)
    lp.sum().backward()
    r_lp.sum().backward()
    torch.testing.assert_close(hh.grad.double(), hr.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ww.grad.double(), wr.grad, rtol=1e-5, atol=1e-5)


def _blocks_case(block):
    """12 rows over V = 20 as ``h @ w.T`` (float64) whose row i peaks at column i, so that the
    largest logits lie in different blocks of ``block`` columns; row 5's logits are all equal;
    targets on both edges of the blocks."""
    g = torch.Generator().manual_seed(8)
    v, n = 20, 12
    h = torch.randn(n, 6, generator=g, dtype=torch.float64)
    w = torch.randn(v, 6, generator=g, dtype=torch.float64)
    w[torch.arange(n) % v] += 4 * h / h.norm(dim=1, keepdim=True)  # row i peaks at column i
    h[5] = 0.0  # all logits equal
    targets = torch.tensor([0, block - 1, block, min(2 * block - 1, v - 1), v - 1, 3, 19, 10,
                            block % v, 1, 2, 13])
    return h, w, targets, g


@pytest.mark.parametrize("block", [1, 5, 7])
def test_hidden_variant_across_vocabulary_blocks(block, monkeypatch):
    """Blocks of 1, 5 and 7 columns over V = 20 against the float64 reference, with every row's
    largest logit placed in a different block (the running maximum must rescale the sums it
    carries: catches a sum not rescaled when a later block raises the maximum) and targets on
    both edges of each block (catches a target gathered from the wrong block, or dropped when
    it is a block's first or last column). One row's logits are all equal (entropy log 20)."""
    monkeypatch.setattr(pepo.entropy, "_CPU_VOCAB_BLOCK", block)
    h, w, targets, g = _blocks_case(block)
    n = h.shape[0]
    hh, ww = h.float().requires_grad_(True), w.float().requires_grad_(True)
    lp, ent = logprobs_and_entropy_from_hidden(hh, ww, targets, chunk_size=5, temperature=0.7)
    hr, wr = h.float().double().requires_grad_(True), w.float().double().requires_grad_(True)
    r_lp, r_ent = ref(hr @ wr.t(), targets, 0.7)
    torch.testing.assert_close(lp.double(), r_lp.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent.double(), r_ent.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent[5].double(), torch.tensor(20.0).log().double())
    gout = torch.randn(n, generator=g)
    (lp * gout).sum().backward()
    (r_lp * gout.double()).sum().backward()
    torch.testing.assert_close(hh.grad.double(), hr.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ww.grad.double(), wr.grad, rtol=1e-5, atol=1e-5)
    # the blocked backward in float64, at a temperature, over several row chunks
    assert torch.autograd.gradcheck(
        lambda a, b: logprobs_and_entropy_from_hidden(a, b, targets[:5], chunk_size=2,
                                                      temperature=0.7)[0],
        (h[:5].clone().requires_grad_(True), w.clone().requires_grad_(True)))


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("block", [5, 4096])
def test_hidden_variant_with_saved_logits(block, autocast, monkeypatch):
    """``save_logits=True`` keeps the forward's logits for the backward: log-probs, entropies
    and both gradients equal to the recomputing path's (to the bit: the same products) and
    within 1e-5 of float64, over 3 row chunks and 4 vocabulary blocks (catches a kept block
    used for another chunk or block); each block's product is made once, where the recomputing
    path makes it twice (catches the parameter ignored); a second backward through the same
    graph gives the same gradients (catches the kept blocks, which the first backward changes in
    place, used again); under ``no_grad`` or with no input requiring grad nothing is kept
    (catches the logits held where no backward will free them)."""
    monkeypatch.setattr(pepo.entropy, "_CPU_VOCAB_BLOCK", block)
    h, w, targets, g = _blocks_case(5)
    h, w = h.float(), w.float()
    gout = torch.randn(h.shape[0], generator=g)
    made = []
    product = pepo.entropy._hidden_block
    monkeypatch.setattr(pepo.entropy, "_hidden_block",
                        lambda *a: made.append(a[2]) or product(*a))
    results = {}
    for save in (False, True):
        hh, ww = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
        made.clear()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            lp, ent = logprobs_and_entropy_from_hidden(hh, ww, targets, chunk_size=5,
                                                       temperature=0.7, save_logits=save)
            forward = len(made)
            (lp * gout).sum().backward(retain_graph=True)
            first = hh.grad.clone(), ww.grad.clone()
            hh.grad = ww.grad = None
            (lp * gout).sum().backward()
        results[save] = lp, ent, *first
        torch.testing.assert_close((hh.grad, ww.grad), first, rtol=0, atol=0)
        blocks = -(-20 // min(block, 20))
        assert forward == 3 * blocks  # 12 rows in chunks of 5, V = 20
        # the first backward makes the products again unless they were kept; the second always
        assert len(made) == forward + (0 if save else forward) + forward
    for a, b in zip(results[False], results[True]):
        assert torch.equal(a, b)
    hr, wr = h.double().requires_grad_(True), w.double().requires_grad_(True)
    r_lp, r_ent = ref(hr @ wr.t(), targets, 0.7)
    (r_lp * gout.double()).sum().backward()
    lp, ent, gh, gw = results[True]
    torch.testing.assert_close(lp.double(), r_lp.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent.double(), r_ent.detach(), rtol=1e-5, atol=1e-5)
    tol = 2e-2 if autocast else 1e-5  # the gradient's products in bf16 under autocast
    assert _rel(gh, hr.grad) < tol and _rel(gw, wr.grad) < tol
    kept = []
    apply = pepo.entropy._FromHidden.apply
    monkeypatch.setattr(pepo.entropy._FromHidden, "apply",
                        lambda *a: kept.append(a[-1]) or apply(*a))
    with torch.no_grad():
        logprobs_and_entropy_from_hidden(h.requires_grad_(True), w, targets, save_logits=True)
    logprobs_and_entropy_from_hidden(h.detach(), w, targets, save_logits=True)
    logprobs_and_entropy_from_hidden(h.requires_grad_(True), w, targets, save_logits=True)
    assert kept == [False, False, True]
    with pytest.raises(ValueError, match="save_logits must be a bool, got 'yes'"):
        logprobs_and_entropy_from_hidden(h, w, targets, save_logits="yes")


@pytest.mark.parametrize("block", [1, 5, 7])
def test_logits_variant_across_vocabulary_blocks(block, monkeypatch):
    """:func:`logprobs_and_entropy` on the same logits, in blocks of 1, 5 and 7 columns, against
    the float64 reference: values and the logits' gradient, and a float64 gradcheck at a
    temperature over several row chunks (catches a block's gradient written to the wrong
    columns, the target's one-hot term added in the wrong block, and sums not rescaled)."""
    monkeypatch.setattr(pepo.entropy, "_CPU_VOCAB_BLOCK", block)
    h, w, targets, g = _blocks_case(block)
    z = (h.float() @ w.float().t()).double()
    x = z.float().requires_grad_(True)
    lp, ent = logprobs_and_entropy(x, targets, chunk_size=5, temperature=0.7)
    zr = z.clone().requires_grad_(True)
    r_lp, r_ent = ref(zr, targets, 0.7)
    torch.testing.assert_close(lp.double(), r_lp.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent.double(), r_ent.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent[5].double(), torch.tensor(20.0).log().double())
    gout = torch.randn(h.shape[0], generator=g)
    (lp * gout).sum().backward()
    (r_lp * gout.double()).sum().backward()
    torch.testing.assert_close(x.grad.double(), zr.grad, rtol=1e-5, atol=1e-6)
    assert torch.autograd.gradcheck(
        lambda a: logprobs_and_entropy(a, targets[:5], chunk_size=2, temperature=0.7)[0],
        (z[:5].clone().requires_grad_(True),))


def test_logits_variant_far_below_the_maximum(vocab_block):
    """Logits spread over ~300 nats with targets among the lowest: log-probs down to about
    -250, entropies and the gradient match the float64 reference (catches the CPU's exp floor
    applied to the target's logit or to the logsumexp)."""
    g = torch.Generator().manual_seed(10)
    z = (torch.randn(9, 8, generator=g, dtype=torch.float64)
         @ (torch.randn(30, 8, generator=g, dtype=torch.float64) * 12).t()).float()
    targets = z.argmin(dim=1)
    targets[:3] = z[:3].argmax(dim=1)
    x = z.clone().requires_grad_(True)
    lp, ent = logprobs_and_entropy(x, targets, chunk_size=4, temperature=0.6)
    zr = z.double().requires_grad_(True)
    r_lp, r_ent = ref(zr, targets, 0.6)
    assert r_lp.min() < -150
    torch.testing.assert_close(lp.double(), r_lp.detach(), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(ent.double(), r_ent.detach(), rtol=1e-5, atol=1e-5)
    lp.sum().backward()
    r_lp.sum().backward()
    # fp32 rounding of z/τ near the logsumexp (~330 here), where p_target ≈ 1 cancels the
    # one-hot: relative to the largest gradient (1/τ), as in the hidden-state test above
    torch.testing.assert_close(x.grad.double(), zr.grad, rtol=1e-5,
                               atol=1e-5 * float(zr.grad.abs().max()))


def test_hidden_variant_masked_vocabulary(vocab_block):
    """Weight rows whose logits overflow to -inf (a vocabulary masked through the head) have
    probability 0: they add 0 to the entropy and get zero gradient, and the other columns match
    the reference of the unmasked vocabulary alone. Columns 0-6 are all masked, a whole first
    block at blocks of 7: catches a sum carried out of such a block as 0 · (-inf) = NaN (on a
    CPU its clamped terms make the sum positive while the maximum is still -inf), and -inf
    terms unclamped and unmasked in the entropy's sum."""
    g = torch.Generator().manual_seed(9)
    h = torch.rand(6, 4, generator=g) + 1.0  # positive: -3e38 weights overflow to -inf, not NaN
    w = torch.randn(20, 4, generator=g)
    keep = torch.ones(20, dtype=torch.bool)
    keep[[0, 1, 2, 3, 4, 5, 6, 8, 9, 19]] = False
    w[~keep] = -3e38
    targets = torch.tensor([7, 10, 12, 14, 17, 18])
    assert torch.isneginf(h @ w.t())[:, ~keep].all()
    ww = w.clone().requires_grad_(True)
    lp, ent = logprobs_and_entropy_from_hidden(h, ww, targets, temperature=0.9)
    kept = torch.cumsum(keep, 0) - 1  # the targets' columns in the unmasked vocabulary
    r_lp, r_ent = ref(h.double() @ w[keep].double().t(), kept[targets], 0.9)
    torch.testing.assert_close(lp.double(), r_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent.double(), r_ent, rtol=1e-5, atol=1e-5)
    lp.sum().backward()
    assert torch.isfinite(ww.grad).all() and (ww.grad[~keep] == 0).all()


def test_hidden_variant_logits_far_below_the_maximum(vocab_block):
    """Logits spread over ~300 nats (a trained model's vocabulary lies far below its top logit,
    more so at a temperature below 1), with targets among the lowest: the log-probs (down to
    about -250), entropies and gradients match the float64 reference. Catches the CPU's exp
    floor (terms below -80 taken as e^-80) applied to the target's logit or to the logsumexp
    rather than to the softmax terms alone (log-probs of -80 instead of -250)."""
    g = torch.Generator().manual_seed(10)
    h = torch.randn(9, 8, generator=g, dtype=torch.float64)
    w = torch.randn(30, 8, generator=g, dtype=torch.float64) * 12
    h, w = h.float(), w.float()
    z = h @ w.t()
    targets = z.argmin(dim=1)
    targets[:3] = z[:3].argmax(dim=1)
    assert (z.amax(1) - z.amin(1)).min() > 100 * 0.6
    hh, ww = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    lp, ent = logprobs_and_entropy_from_hidden(hh, ww, targets, chunk_size=4, temperature=0.6)
    hr, wr = h.double().requires_grad_(True), w.double().requires_grad_(True)
    r_lp, r_ent = ref(hr @ wr.t(), targets, 0.6)
    assert r_lp.min() < -150
    torch.testing.assert_close(lp.double(), r_lp.detach(), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(ent.double(), r_ent.detach(), rtol=1e-5, atol=1e-5)
    lp.sum().backward()
    r_lp.sum().backward()
    # fp32 rounding of gradients up to ~120, which cancel where p_target ≈ 1: relative to the
    # largest (the code before vocabulary blocks and the exp floor was off by 6e-4 here too)
    for ours, exact in ((hh.grad, hr.grad), (ww.grad, wr.grad)):
        torch.testing.assert_close(ours.double(), exact, rtol=1e-5,
                                   atol=1e-5 * float(exact.abs().max()))


def test_hidden_variant_without_rows(vocab_block):
    """No token at all: empty outputs and zero gradients (catches the gradients' buffers left
    unwritten, hence uninitialised, when no chunk runs)."""
    h = torch.randn(0, 4, requires_grad=True)
    w = torch.randn(20, 4, requires_grad=True)
    lp, ent = logprobs_and_entropy_from_hidden(h, w, torch.zeros(0, dtype=torch.long))
    assert lp.shape == ent.shape == (0,)
    (lp.sum() + (w * 0).sum()).backward()
    assert h.grad.shape == (0, 4) and w.grad.eq(0).all()


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.double() - ref).norm() / ref.norm())


@pytest.mark.parametrize("chunk", [3, 1024])
def test_hidden_variant_under_autocast(chunk, vocab_block):
    """Under ``torch.autocast`` (CPU, bf16: the recipe's ``compute_dtype: bf16``) the logits
    stay fp32: log-probs and entropies within 1e-5 of float64 statistics of the fp32 inputs
    (catches logits left to autocast, rounded to bf16: errors of 1e-2 here, and the entropy's
    ``vecdot`` run in bf16). The gradients come from bf16 products of the exact softmax
    gradient: within 1 % of float64 (the backward runs inside autocast here too: catches a
    recompute of the logits that autocast turns bf16 against the forward's fp32 normaliser)."""
    g = torch.Generator().manual_seed(5)
    h = torch.randn(4, 6, 16, generator=g) * 2
    w = torch.randn(64, 16, generator=g)
    targets = torch.randint(0, 64, (4, 6), generator=g)
    hh, ww = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    hr, wr = h.double().requires_grad_(True), w.double().requires_grad_(True)
    r_lp, r_ent = ref(hr @ wr.t(), targets, 0.8)
    gout = torch.randn(4, 6, generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp, ent = logprobs_and_entropy_from_hidden(hh, ww, targets, chunk_size=chunk,
                                                   temperature=0.8)
        assert lp.dtype == ent.dtype == torch.float32
        (lp * gout).sum().backward()
    torch.testing.assert_close(lp.double(), r_lp.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent.double(), r_ent.detach(), rtol=1e-5, atol=1e-5)
    (r_lp * gout.double()).sum().backward()
    assert hh.grad.dtype == ww.grad.dtype == torch.float32
    assert _rel(hh.grad, hr.grad) < 1e-2, _rel(hh.grad, hr.grad)
    assert _rel(ww.grad, wr.grad) < 1e-2, _rel(ww.grad, wr.grad)
    # bf16 products they are: not the fp32 gradients (which the same call outside autocast gives)
    h32, w32 = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    lp32, _ = logprobs_and_entropy_from_hidden(h32, w32, targets, chunk_size=chunk,
                                               temperature=0.8)
    (lp32 * gout).sum().backward()
    assert _rel(h32.grad, hr.grad) < 1e-5 < _rel(hh.grad, hr.grad)


def test_logits_variant_under_autocast_keeps_fp32_statistics(vocab_block):
    """``logprobs_and_entropy`` of bf16 logits inside CPU autocast: the entropy sum stays fp32
    (catches ``vecdot`` run by autocast in bf16), against float64 of the same logits."""
    g = torch.Generator().manual_seed(6)
    x = (torch.randn(8, 300, generator=g) * 4).to(torch.bfloat16)
    targets = torch.randint(0, 300, (8,), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp, ent = logprobs_and_entropy(x, targets, temperature=0.7)
    r_lp, r_ent = ref(x.double(), targets, 0.7)
    torch.testing.assert_close(lp.double(), r_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent.double(), r_ent, rtol=1e-5, atol=1e-5)


def _saved_bytes(fn):
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(saved)


def test_autograd_saves_no_softmax_sized_tensor():
    # A naive log_softmax saves its [N, V] fp32 output; the chunked function saves only its
    # inputs and two fp32 per row (the logsumexp and the log-prob).
    n, v = 64, 1000
    logits = torch.randn(n, v, requires_grad=True)
    targets = torch.randint(0, v, (n,))
    naive = _saved_bytes(lambda: torch.log_softmax(logits, -1).gather(1, targets[:, None]))
    ours = _saved_bytes(lambda: logprobs_and_entropy(logits, targets, chunk_size=8))
    assert naive >= n * v * 4
    assert ours <= n * v * 4 + n * 8 + 2 * n * 4  # logits (a reference), targets, lse, lp
    h = torch.randn(n, 32, requires_grad=True)
    w = torch.randn(v, 32, requires_grad=True)
    ours_h = _saved_bytes(lambda: logprobs_and_entropy_from_hidden(h, w, targets, chunk_size=8))
    assert ours_h <= (n * 32 + v * 32) * 4 + n * 8 + 2 * n * 4  # no [N, V] at all


def test_errors():
    logits, targets = data()
    with pytest.raises(ValueError,
                       match=r"targets must be token ids in \[0, 50\), got values in \[-100"):
        t = targets.clone()
        t[0, 0] = -100
        logprobs_and_entropy(logits, t)
    with pytest.raises(ValueError, match=r"targets must be \[3, 7\]"):
        logprobs_and_entropy(logits, targets[:, :3])
    with pytest.raises(ValueError, match="chunk_size must be an int >= 1"):
        logprobs_and_entropy(logits, targets, chunk_size=0)
    with pytest.raises(ValueError, match=r"weight must be \[V, D\] with D=8"):
        logprobs_and_entropy_from_hidden(
            torch.randn(2, 8), torch.randn(5, 7), torch.zeros(2, dtype=torch.long)
        )


def _poisoned(chunk):
    """Logits [2, 9, 12] with NaN, +inf, mixed ±inf and all -inf rows placed on both sides of
    chunk boundaries (flattened rows chunk-1 and chunk), returned with their flat row indices."""
    logits, targets = data(b=2, t=9, v=12, seed=3)
    flat = logits.view(-1, 12)
    bad = {chunk - 1: ("nan", 5), chunk: ("+inf", 0), 11: ("±inf", 2)}
    for row, (kind, col) in bad.items():
        if kind == "nan":
            flat[row, col] = float("nan")
        elif kind == "+inf":
            flat[row, col] = float("inf")
        else:
            flat[row, col] = float("inf")
            flat[row, col + 1] = float("-inf")
    flat[14] = float("-inf")  # fully masked row: no distribution either
    targets.view(-1)[chunk] = 3  # not the +inf entry: the old guard gave it log p = z_3 ≈ finite
    return logits, targets, sorted(bad), 14


@pytest.mark.parametrize("chunk", [4, 5, 8])
def test_nan_and_plus_inf_logits_give_nan_not_a_finite_value(chunk, vocab_block):
    """Catches the all--inf guard (``lse = 0`` where it is not finite) also catching NaN and
    +inf rows: their log-prob came out as the raw logit (0 for p = 1), a finite wrong value that
    silently enters the loss. Every other row, on either side of a chunk boundary, must still
    match the float64 reference."""
    logits, targets, bad, masked = _poisoned(chunk)
    x = logits.clone().requires_grad_(True)
    lp, ent = logprobs_and_entropy(x, targets, chunk_size=chunk)
    lp, ent = lp.view(-1), ent.view(-1)
    assert torch.isnan(lp[bad]).all() and torch.isnan(ent[bad]).all()
    assert torch.isnan(lp[masked]) and torch.isnan(ent[masked])
    good = [r for r in range(18) if r not in bad and r != masked]
    xr = logits.view(-1, 12)[good].double().requires_grad_(True)
    r_lp, r_ent = ref(xr, targets.view(-1)[good])
    torch.testing.assert_close(lp[good].double(), r_lp.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent[good].double(), r_ent, rtol=1e-5, atol=1e-5)
    # gradient: the reference's on good rows, finite on the masked row, non-finite on bad ones
    (grad,) = torch.autograd.grad(lp.sum(), x)
    grad = grad.view(-1, 12)
    (r_grad,) = torch.autograd.grad(r_lp.sum(), xr)
    torch.testing.assert_close(grad[good].double(), r_grad, rtol=1e-5, atol=1e-6)
    assert torch.isfinite(grad[masked]).all()
    assert not torch.isfinite(grad[bad]).all(dim=-1).any()


@pytest.mark.parametrize("chunk", [3, 1024])
def test_hidden_variant_gives_nan_for_nan_and_overflowing_logits(chunk, vocab_block):
    """Catches the same guard in the hidden-state path: a NaN hidden state, or one whose logits
    overflow to +inf, must give NaN, and its neighbours the float64 reference."""
    g = torch.Generator().manual_seed(5)
    h = torch.randn(2, 4, 8, generator=g)
    w = torch.randn(16, 8, generator=g)
    targets = torch.randint(0, 16, (2, 4), generator=g)
    flat = h.view(-1, 8)
    flat[2, 0] = float("nan")  # row 2: last row of the first chunk of 3
    flat[3] = 1e38  # row 3: first row of the second chunk; logits overflow to ±inf
    lp, ent = logprobs_and_entropy_from_hidden(h, w, targets, chunk_size=chunk)
    lp, ent = lp.view(-1), ent.view(-1)
    assert torch.isinf(flat[3] @ w.t()).any()
    assert torch.isnan(lp[[2, 3]]).all() and torch.isnan(ent[[2, 3]]).all()
    good = [0, 1, 4, 5, 6, 7]
    r_lp, r_ent = ref(flat[good].double() @ w.double().t(), targets.view(-1)[good])
    torch.testing.assert_close(lp[good].double(), r_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent[good].double(), r_ent, rtol=1e-5, atol=1e-5)


def test_a_large_vocabulary_of_small_probabilities_keeps_its_entropy():
    """100,000 logits 25 nats below the top one: each holds e^-25 of the mass, together 1.4e-6,
    and they carry the whole entropy (3.6e-5 nats). Catches a CPU exp floor that drops terms
    above e^-80 (a floor at -20 gave 4.3e-3)."""
    z = torch.full((1, 100_000), -25.0)
    z[0, 0] = 0.0
    p = torch.softmax(z.double(), -1)
    want = -(p * p.log()).sum().item()
    _, ent = logprobs_and_entropy(z, torch.zeros(1, dtype=torch.long))
    assert abs(ent.item() - want) < 5e-6  # fp32 rounding of the top token's log: 1.4e-6
