"""Sampling filters against loop references; KV-cached decoding against full forwards."""

from __future__ import annotations

import math

import pytest
import torch

import pepo.training.draws as D
import pepo.training.generation as G
from pepo.entropy import logprobs_and_entropy
from pepo.training.models import tiny_qwen3


def ref_filter(logits, temperature, top_k, top_p):
    """Per row: scale, keep the top-k, then the smallest prefix of sorted probs reaching top_p."""
    out = []
    for row in logits.double() / temperature:
        keep = set(range(row.numel()))
        order = sorted(range(row.numel()), key=lambda v: -row[v].item())
        if top_k is not None:
            keep = set(order[:top_k])
        probs = torch.softmax(torch.tensor([row[v].item() if v in keep else -math.inf
                                            for v in range(row.numel())]), 0)
        cum, nucleus = 0.0, set()
        for v in order:
            if v not in keep:
                continue
            if cum >= top_p:
                break
            nucleus.add(v)
            cum += probs[v].item()
        out.append([row[v].item() if v in nucleus else -math.inf for v in range(row.numel())])
    return torch.tensor(out)


@pytest.mark.parametrize("temperature, top_k, top_p", [
    (1.0, None, 1.0), (0.6, None, 0.6), (1.0, 3, 1.0), (0.7, 5, 0.9), (2.0, None, 0.05),
    (1.0, None, 0.999999), (1.0, 16, 1.0), (1.0, 17, 0.9),  # top-k of all but one, and of all
])
def test_filter_logits_matches_reference(temperature, top_k, top_p):
    torch.manual_seed(0)
    logits = torch.randn(6, 17) * 3
    got = G.filter_logits(logits, temperature, top_k, top_p)
    ref = ref_filter(logits, temperature, top_k, top_p).float()
    assert torch.equal(torch.isinf(got), torch.isinf(ref))
    finite = torch.isfinite(ref)
    torch.testing.assert_close(got[finite], ref[finite], rtol=1e-6, atol=1e-6)
    assert bool(torch.isfinite(got).any(-1).all())  # the most likely token always survives


def test_top_p_stops_where_the_mass_before_a_token_reaches_it_exactly():
    """Two equally likely tokens and ``top_p=0.5``: the first already holds 0.5, so the nucleus
    is one token (Hugging Face's ``TopPLogitsWarper`` keeps one too). Catches the mass before a
    token compared with ``>`` (both kept: the boundary case, which random logits never hit)."""
    got = G.filter_logits(torch.tensor([[0.0, 0.0], [0.0, 0.0]]), top_p=0.5)
    assert torch.isfinite(got).sum(-1).tolist() == [1, 1]
    quarters = torch.tensor([[0.0, 0.0, 0.0, 0.0]])  # 0.25 each: 0.5 is reached after two
    assert torch.isfinite(G.filter_logits(quarters, top_p=0.5)).sum().item() == 2


def test_the_inverse_cdf_draw_scales_the_uniform_by_the_rows_mass():
    """fp32 softmax rows sum to 1 within an ulp or so, not exactly: a uniform above a row's sum
    fell past its last token of non-zero probability, onto padding of probability 0. Catches
    the uniform compared with the cumulative sum unscaled (each row drawn as if of mass 1)."""
    probs = torch.tensor([[0.5, 0.4999, 0.0], [1.0, 3.0, 0.0], [0.0, 0.25, 0.25]])
    u = torch.tensor([0.99995, 0.5, 0.0])
    # row 0: 0.99995 of 0.9999 is in the second token's share; row 1: 2 of 4 in the second's;
    # row 2: 0 lies before the first token of non-zero probability
    assert D.inverse_cdf_sample(probs, u).tolist() == [1, 1, 1]
    draws = D.inverse_cdf_sample(probs[[1]].expand(4000, 3), torch.rand(4000, dtype=torch.float64,
                                 generator=torch.Generator().manual_seed(0)))
    assert abs(draws.float().mean().item() - 0.75) < 0.03  # 3 of 4: binomial sd 0.007


@pytest.mark.parametrize("kw, msg", [({"temperature": 0.0}, "temperature"),
                                     ({"top_p": 0.0}, "top_p"), ({"top_k": 0}, "top_k")])
def test_filter_logits_rejects_bad_values(kw, msg):
    with pytest.raises(ValueError, match=msg):
        G.filter_logits(torch.zeros(1, 4), **kw)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = tiny_qwen3(embed_dim=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_dim=64)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.1)
    return m


PROMPTS = [[5, 6, 7, 8, 9], [3, 4], [10, 11, 12, 13, 14, 15, 16]]


def test_kv_cached_sampling_sees_full_forward_distribution(model, monkeypatch):
    seen = []
    real = G.filter_logits
    # the draws module's own name: both decoders draw through pepo.training.draws.draw_token
    monkeypatch.setattr(D, "filter_logits", lambda x, *a: seen.append(x.clone()) or real(x, *a))
    ro = G.generate(model, PROMPTS, max_new_tokens=10, pad_id=0, stop_tokens=[1],
                    generator=torch.Generator().manual_seed(0))
    cached = torch.stack(seen, 1).log_softmax(-1)  # [B, T, V]
    seq = torch.cat([ro.prompt_tokens, ro.tokens], 1)
    attn, pos = G.sequence_inputs(ro.prompt_mask, ro.tokens.shape[1])
    P = ro.prompt_tokens.shape[1]
    full = model(seq, mask=attn, input_pos=pos)[:, P - 1 : -1].log_softmax(-1)
    torch.testing.assert_close(cached[ro.mask], full[ro.mask], rtol=1e-4, atol=1e-4)


def assert_rows_match_unpadded(model, ro, prompts):
    """Each row's log-probs in the padded batch equal those of the row alone, unpadded."""
    seq = torch.cat([ro.prompt_tokens, ro.tokens], 1)
    attn, pos = G.sequence_inputs(ro.prompt_mask, ro.tokens.shape[1])
    P = ro.prompt_tokens.shape[1]
    lp, _ = logprobs_and_entropy(model(seq, mask=attn, input_pos=pos)[:, P - 1 : -1], ro.tokens)
    for i, p in enumerate(prompts):
        r = ro.tokens[i][ro.mask[i]]
        alone = model(torch.tensor([p + r.tolist()]))  # plain causal, no padding
        lp_i, _ = logprobs_and_entropy(alone[:, len(p) - 1 : -1], r[None])
        torch.testing.assert_close(lp_i[0], lp[i][ro.mask[i]], rtol=1e-5, atol=1e-5)


def test_padded_rows_equal_unpadded_rows(model):
    ro = G.generate(model, PROMPTS, max_new_tokens=10, pad_id=0, stop_tokens=[1],
                    generator=torch.Generator().manual_seed(1))
    assert_rows_match_unpadded(model, ro, PROMPTS)


def test_stop_tokens_end_rows_and_are_kept(model):
    # a stop set of every id: each row stops at its first token
    ro = G.generate(model, PROMPTS, max_new_tokens=8, pad_id=0, stop_tokens=list(range(32)),
                    generator=torch.Generator().manual_seed(0))
    assert ro.tokens.shape == (3, 1) and bool(ro.mask.all()) and bool(ro.finished.all())
    ro = G.generate(model, PROMPTS, max_new_tokens=8, pad_id=0, stop_tokens=[],
                    generator=torch.Generator().manual_seed(0))
    assert ro.tokens.shape == (3, 8) and bool(ro.mask.all()) and not bool(ro.finished.any())


def test_generation_is_reproducible_from_the_generator(model):
    a = G.generate(model, PROMPTS, max_new_tokens=8, pad_id=0, stop_tokens=[1],
                   generator=torch.Generator().manual_seed(3))
    b = G.generate(model, PROMPTS, max_new_tokens=8, pad_id=0, stop_tokens=[1],
                   generator=torch.Generator().manual_seed(3))
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.mask, b.mask)
    assert not model.caches_are_setup()


def test_without_seeds_each_row_draws_the_same_in_any_batch_and_decoder(model):
    """Without ``seeds`` the rows' seeds come from the generator, once before any split, for
    either decoder. Catches the reference decoder drawing from the generator itself
    (``torch.multinomial``: its tokens then depend on ``batch_size`` and differ from the fast
    decoder's for the same generator) and seeds drawn per piece of the batch."""
    kw = dict(max_new_tokens=8, pad_id=0, stop_tokens=[1], temperature=0.9, top_p=0.95)
    prompts = PROMPTS + [[8]]
    runs = [G.generate(model, prompts, generator=torch.Generator().manual_seed(5),
                       decoder=decoder, batch_size=bs, **kw)
            for decoder in ("reference", "fast") for bs in (None, 1, 3)]
    runs.append(G.generate(model, prompts, decoder="reference",
                           seeds=D.draw_seeds(torch.Generator().manual_seed(5), 4), **kw))
    base = runs[0]
    assert base.mask.sum() > 8  # rows of several tokens: draws that could differ
    for ro in runs[1:]:
        assert torch.equal(ro.tokens, base.tokens) and torch.equal(ro.mask, base.mask)
        torch.testing.assert_close(ro.logprobs, base.logprobs, rtol=1e-5, atol=1e-5)


def test_masks_are_prefixes_and_padding_is_pad(model):
    ro = G.generate(model, PROMPTS * 4, max_new_tokens=12, pad_id=0, stop_tokens=[1, 2, 3],
                    generator=torch.Generator().manual_seed(0))
    lengths = ro.mask.sum(-1, keepdim=True)
    assert torch.equal(ro.mask, torch.arange(ro.mask.shape[1]) < lengths)
    assert bool((ro.tokens[~ro.mask] == 0).all())


def test_too_long_is_refused(model):
    with pytest.raises(ValueError, match="exceeds the model's max_seq_len"):
        G.generate(model, PROMPTS, max_new_tokens=1000, pad_id=0, stop_tokens=[1])


def test_batched_generation_merges_into_one_padded_batch(model):
    prompts = PROMPTS * 3
    ro = G.generate(model, prompts, max_new_tokens=10, pad_id=0, stop_tokens=[1, 2],
                    generator=torch.Generator().manual_seed(0), batch_size=4)
    assert ro.tokens.shape[0] == 9 and ro.prompt_tokens.shape[1] == max(map(len, prompts))
    assert torch.equal(ro.prompt_mask.sum(-1), torch.tensor([len(p) for p in prompts]))
    assert_rows_match_unpadded(model, ro, prompts)  # the merged batch is still exact
    # a piece of shorter prompts is re-left-padded to the batch's width (right-padding it
    # counts the same tokens, but puts padding between a prompt and its response)
    prompts = [[5, 9, 17, 4, 3], [8, 2], [8], [20, 21]]
    ro = G.generate(model, prompts, max_new_tokens=4, pad_id=0, stop_tokens=[1, 2],
                    generator=torch.Generator().manual_seed(0), batch_size=2)
    ids, mask = G.pad_prompts(prompts, 0)
    assert torch.equal(ro.prompt_tokens, ids) and torch.equal(ro.prompt_mask, mask)


@pytest.mark.parametrize("top_k, top_p", [(1, 1.0), (None, 1e-6), (1, 1e-6)])
def test_greedy_limits_of_the_sampler_give_the_argmax(model, top_k, top_p):
    """``top_k=1`` or a tiny ``top_p`` leaves only the most likely token: sampling must give the
    argmax at every step, whatever the generator draws. Catches a filter that keeps the second
    token or samples from the unfiltered distribution."""
    torch.manual_seed(3)
    prompts = [[5, 9, 17, 4], [8, 2], [20, 21, 22]]
    ro = G.generate(model, prompts, max_new_tokens=10, pad_id=0, stop_tokens=[], temperature=1.3,
                    top_k=top_k, top_p=top_p, generator=torch.Generator().manual_seed(11))
    for i, p in enumerate(prompts):
        seq = list(p)
        for t in range(10):
            with torch.no_grad():
                logits = model(torch.tensor([seq]))[0, -1]
            assert int(ro.tokens[i, t]) == int(logits.argmax()), (i, t)
            seq.append(int(ro.tokens[i, t]))
