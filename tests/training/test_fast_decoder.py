"""The fast decoder against the reference decoder (torchtune's KV cache, lock-step rows).

Which wrong fast decoder would pass? One that ignores the left padding (the prompt-length mix
below), mixes up the grouped-query heads (models with 1, 2 and 4 query heads per key/value
head), reads a stale or misplaced cache column (every token after the first would differ), or
mishandles dropped rows (stop tokens that end most rows early, with the batch sizes the step
saw recorded), or draws a row's uniforms from the wrong step or row (tokens differ at once).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import pepo.training.fast_decoder as FD
import pepo.training.generation as G
from pepo.entropy import logprobs_and_entropy
from pepo.tasks.problems import drift_dataset, modsum_dataset
from pepo.training.config import asset_dir
from pepo.training.models import head_weight, tiny_qwen3
from pepo.training.tokenizers import load_tokenizer
from pepo.training.weights import load_model_weights


@pytest.fixture(autouse=True)
def generate_device(request, monkeypatch):
    """With ``pytest --generate-device cuda`` every ``G.generate`` call of these tests runs with
    its model moved to that device (and back), the rollouts returned where the model was, so the
    tests below check the decoders on a GPU. None, the default: they run on the CPU."""
    device = request.config.getoption("--generate-device")
    if device is None:
        return None
    real = G.generate

    def generate(model, prompts, *args, **kwargs):
        home = next(model.parameters()).device
        model.to(device)
        try:
            ro = real(model, prompts, *args, **kwargs)
        finally:
            model.to(home)
        assert ro.tokens.device.type == torch.device(device).type  # it did decode there
        return dataclasses.replace(ro, **{f.name: getattr(ro, f.name).to(home)
                                          for f in dataclasses.fields(ro)
                                          if isinstance(getattr(ro, f.name), torch.Tensor)})

    monkeypatch.setattr(G, "generate", generate)
    return device


def f64_tol(device) -> float:
    """The log-prob tolerance between decoders of a float64 model: 1e-12 on the CPU. Elsewhere
    float32's rounding: torchtune's RMSNorm computes in float32 whatever the model's dtype, and
    a GPU's reductions may round a row differently in a tensor of another shape (the decoders
    differed by 2^-20 = 9.5e-7 on an H200, with every token the same)."""
    return 1e-12 if device in (None, "cpu") else 2e-6


def assert_same_rollouts(fast, ref, *, min_rows=1.0, lp_tol=1e-4):
    """Row-wise identical tokens and masks on at least ``min_rows`` of the rows (a float
    reordering can flip a draw that sits on a boundary), log-probs within ``lp_tol`` there."""
    assert fast.tokens.shape[0] == ref.tokens.shape[0]
    w = max(fast.tokens.shape[1], ref.tokens.shape[1])
    pad = torch.nn.functional.pad

    def widen(x, value):
        return pad(x, (0, w - x.shape[1]), value=value)

    same = ((widen(fast.tokens, -1) == widen(ref.tokens, -1)).all(-1)
            & (widen(fast.mask, False) == widen(ref.mask, False)).all(-1))
    assert same.float().mean().item() >= min_rows, f"{int(same.sum())}/{len(same)} rows identical"
    m = widen(fast.mask, False)[same]
    gap = (widen(fast.logprobs, 0.0)[same] - widen(ref.logprobs, 0.0)[same])[m].abs().max()
    assert gap.item() <= lp_tol, gap.item()
    assert torch.equal(fast.finished[same], ref.finished[same])
    assert torch.equal(fast.prompt_tokens, ref.prompt_tokens)


def random_model(num_heads, num_kv_heads, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    m = tiny_qwen3(embed_dim=64, num_layers=2, num_heads=num_heads, num_kv_heads=num_kv_heads,
                   head_dim=16, intermediate_dim=96, max_seq_len=96).to(dtype)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.15)
    return m


def ragged_prompts(n, seed=0, vocab=32):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 12, (n,), generator=g).tolist()
    return [torch.randint(2, vocab, (k,), generator=g).tolist() for k in lengths]


@pytest.mark.parametrize("num_heads, num_kv_heads", [(2, 2), (4, 2), (4, 1)])
@pytest.mark.parametrize("sampling", [dict(), dict(temperature=0.7, top_k=5),
                                      dict(temperature=1.3, top_p=0.8)])
def test_fast_matches_reference_on_random_models(num_heads, num_kv_heads, sampling):
    model = random_model(num_heads, num_kv_heads)
    prompts = ragged_prompts(24)
    seeds = torch.arange(100, 124)
    kw = dict(max_new_tokens=40, pad_id=0, stop_tokens=[1, 2], seeds=seeds, **sampling)
    fast = G.generate(model, prompts, decoder="fast", **kw)
    ref = G.generate(model, prompts, decoder="reference", **kw)
    assert_same_rollouts(fast, ref, lp_tol=2e-5)
    assert 0 < int(fast.finished.sum()) < len(prompts)  # some rows stopped early, some did not


def test_fast_matches_reference_in_float64(generate_device):
    model = random_model(4, 2, dtype=torch.float64)
    prompts = ragged_prompts(16, seed=1)
    kw = dict(max_new_tokens=30, pad_id=0, stop_tokens=[1], seeds=torch.arange(16))
    assert_same_rollouts(G.generate(model, prompts, **kw),
                         G.generate(model, prompts, decoder="reference", **kw),
                         lp_tol=f64_tol(generate_device))


def test_finished_rows_leave_the_batch(monkeypatch):
    """Most rows stop within a few tokens: the step must see a shrinking batch, and the rows
    still decoding must come out as the reference's."""
    model = random_model(4, 2)
    prompts = ragged_prompts(32, seed=2)
    sizes = []
    real = FD.decode_step
    monkeypatch.setattr(FD, "decode_step", lambda plan, tok, *a: sizes.append(len(tok)) or
                        real(plan, tok, *a))
    kw = dict(max_new_tokens=40, pad_id=0, stop_tokens=list(range(2, 14)),
              seeds=torch.arange(32) + 7)
    fast = G.generate(model, prompts, **kw)
    ref = G.generate(model, prompts, decoder="reference", **kw)
    assert_same_rollouts(fast, ref, lp_tol=2e-5)
    assert sizes[0] < 32 and sizes[-1] < sizes[0], sizes  # compacted, more than once
    assert sizes == sorted(sizes, reverse=True)
    # the batch never holds many stopped rows: at most 1/8 of it beyond the live ones
    live = (fast.mask.sum(-1)[:, None] > torch.arange(1, len(sizes) + 1)).sum(0).tolist()
    assert all(n <= s and s <= max(n / FD._COMPACT_BELOW, n + 1) for n, s in zip(live, sizes))


def shared_prompts(n, seed):
    """``n`` prompts, each repeated 1-5 times, in shuffled order (the rollouts of a group)."""
    g = torch.Generator().manual_seed(seed)
    reps = torch.randint(1, 6, (n,), generator=g).tolist()
    rows = [p for p, r in zip(ragged_prompts(n, seed=seed), reps) for _ in range(r)]
    return [rows[i] for i in torch.randperm(len(rows), generator=g)]


@pytest.mark.parametrize("dtype, lp_tol", [(torch.float32, 2e-5), (torch.float64, 1e-12)])
def test_rows_of_one_prompt_share_its_cache(monkeypatch, dtype, lp_tol, generate_device):
    """The prompt's keys and values are held once per distinct prompt, rows are placed among
    their prompt's rows in any order, and a prompt leaves the cache with its last row; the
    tokens are still the reference's. Catches a row reading another prompt's columns or
    another row's slot (the tokens would differ at once)."""
    model = random_model(4, 2, dtype=dtype)
    prompts = shared_prompts(9, seed=8)
    distinct = len({tuple(p) for p in prompts})
    seen = []
    real = FD.decode_step

    def spy(plan, tok, pos, prompt_k, *a):
        seen.append((len(tok), prompt_k[0].shape[0]))
        return real(plan, tok, pos, prompt_k, *a)

    monkeypatch.setattr(FD, "decode_step", spy)
    kw = dict(max_new_tokens=40, pad_id=0, stop_tokens=list(range(2, 8)),
              seeds=torch.arange(len(prompts)) + 3)
    fast = G.generate(model, prompts, **kw)
    ref = G.generate(model, prompts, decoder="reference", **kw)
    if dtype is torch.float64:
        lp_tol = f64_tol(generate_device)
    assert_same_rollouts(fast, ref, lp_tol=lp_tol)
    assert len(prompts) > distinct + 5 and seen[0][1] == distinct
    assert seen[-1][1] < distinct and seen[-1][0] < seen[0][0]  # prompts left with their rows
    assert all(u <= b for b, u in seen)


def grouped_prompts(n, r, seed):
    """``n`` prompts, each repeated ``r`` times side by side (a group's rollouts, in order)."""
    return [p for p in ragged_prompts(n, seed=seed) for _ in range(r)]


def _llama(**extra):
    from torchtune.models.llama3_2 import llama3_2

    return llama3_2(vocab_size=32, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=64,
                    max_seq_len=96, intermediate_dim=96, **extra)


def _qwen2():
    from torchtune.models.qwen2._component_builders import qwen2

    return qwen2(vocab_size=32, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=64,
                 intermediate_dim=96, max_seq_len=96)


def _llama_with_qk_norm():
    """torchtune's own ``q_norm``/``k_norm`` (applied after the rotary embedding)."""
    from torchtune.modules import RMSNorm

    m = _llama()
    for layer in m.layers:
        layer.attn.q_norm, layer.attn.k_norm = RMSNorm(16), RMSNorm(16)
    return m


class _OwnRotary(torch.nn.Module):
    """A rotary module the decoder does not know (no cache it can read): it must be called."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x, input_pos=None):
        return self.inner(x, input_pos=input_pos)


def _qwen3_with_own_rotary():
    m = random_model(4, 2)
    for layer in m.layers:  # one instance per layer
        layer.attn.pos_embeddings = _OwnRotary(layer.attn.pos_embeddings)
    return m


ARCHITECTURES = {
    # name: (builder, RoPE form, fused q/k/v, head norms before RoPE, q/k norms after RoPE)
    "qwen3": (lambda: random_model(4, 2), "half", True, True, False),
    "llama3_2": (_llama, "pairs", True, False, False),
    "qwen2 (q/k/v biases)": (_qwen2, "half", True, False, False),
    "llama with q/k norms": (_llama_with_qk_norm, "pairs", True, False, True),
    "qwen3 with its own rotary module": (_qwen3_with_own_rotary, "module", True, True, False),
}


@pytest.mark.parametrize("fuse", [True, False])
@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_every_architecture_decodes_as_the_reference(arch, fuse, monkeypatch):
    """The decode step's fused products, rotary tables and head norms (:class:`FD._Fused`) on
    each form torchtune decoders take, and with fusion off (the modules one by one): the plan
    must take the path named (a fusion that silently never applies would pass the comparison
    alone), and the tokens must be the reference's."""
    build, rope, qkv, head_norm, qk_norm = ARCHITECTURES[arch]
    if not fuse:
        monkeypatch.setattr(FD, "_FUSE_MAX_BYTES", 0)
    torch.manual_seed(1)
    model = build()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("scale"):  # norm scales away from 1, so a scale mixed up shows
                p.uniform_(0.5, 1.5)
            elif p.dim() >= 2:
                p.normal_(0, 0.15)
            else:  # biases
                p.normal_(0, 0.1)
    plan = FD.FastPlan.of(model)
    assert plan.rope == rope
    assert all((f.qkv is not None) == (qkv and fuse) for f in plan.fused)
    assert all((f.up is not None) == fuse for f in plan.fused)
    assert all((f.head_norm is not None) == (head_norm and fuse) for f in plan.fused)
    assert all((f.qk_norm is not None) == qk_norm for f in plan.fused)
    if arch.startswith("qwen2"):
        assert plan.fused[0].qkv_bias is not None or not fuse
    prompts = grouped_prompts(5, 3, seed=10)
    kw = dict(max_new_tokens=30, pad_id=0, stop_tokens=[1, 2], temperature=0.9,
              seeds=torch.arange(len(prompts)) * 3 + 1)
    fast = G.generate(model, prompts, **kw)
    ref = G.generate(model, prompts, decoder="reference", **kw)
    assert_same_rollouts(fast, ref, lp_tol=2e-5)
    assert int(fast.mask.sum()) > 3 * len(prompts)


def test_rotary_tables_rotate_as_the_modules_do():
    """The step's rotary embedding from per-step tables equals each module's forward, bit for
    bit, on query and key heads side by side (every head is rotated alike), also for bf16
    heads (q/k under autocast) with the tables made in the fp32 embedding's dtype, as the
    decoder makes them: catches the half-rotation done in fp32 where the module's (Qwen's)
    casts its tables to the heads' dtype, a rollout/trainer gap on every sampled token."""
    for model in (random_model(4, 2), _llama()):
        plan = FD.FastPlan.of(model)
        rope = plan.layers[0].attn.pos_embeddings
        pos = torch.randint(0, 90, (7, 1))
        tables = FD._rope_tables(plan, pos, torch.float32)
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(7, 6, 16).to(dtype)
            want = rope(x[:, None], input_pos=pos)[:, 0]
            got = FD._rope(plan, plan.layers[0].attn, x, tables)
            assert got.dtype == dtype and torch.equal(got, want), (plan.rope, dtype)


def test_the_head_runs_as_one_product_of_its_weight_on_a_cpu():
    """A head the plan can read (torchtune's ``TiedLinear``, a bias-free ``nn.Linear``) runs in
    fp32 on a CPU as ``W · xᵀ`` transposed back, without calling the module: the module's
    logits to fp32 rounding, in its shape. Catches the tied weight not found (the faster product
    never runs), a product of the wrong orientation or without its transpose (other logits, or
    ``[V, b]``), and a bias dropped (a head with one, or of another kind, is called as it is;
    so is a float64 head)."""
    model = tiny_qwen3(vocab_size=50, num_layers=1).eval()
    plan = FD.FastPlan.of(model)
    assert plan.head_weight is model.tok_embeddings.weight
    x = torch.randn(3, 1, 96)
    with torch.no_grad():
        want = model.output(model.norm(x))
        called = []

        def recorded(plan):
            def output(h):
                called.append(h.dtype)
                return plan.output(h)
            return dataclasses.replace(plan, output=output)

        got = FD._head(recorded(plan), x)
        assert called == [] and got.shape == (3, 1, 50) and got.is_contiguous()
        torch.testing.assert_close(got, want)
        plan64 = FD.FastPlan.of(tiny_qwen3(vocab_size=50, num_layers=1).double().eval())
        FD._head(recorded(plan64), x.double())
        assert called == [torch.float64]
    lin = torch.nn.Linear(96, 50, bias=False)
    assert head_weight(lin) is lin.weight
    assert head_weight(torch.nn.Linear(96, 50)) is None
    assert head_weight(torch.nn.Sequential(lin)) is None
    from torchtune.modules import TiedLinear

    class ScaledHead(TiedLinear):  # a subclass does more than the product: not read through
        def __call__(self, x):
            return 2 * super().__call__(x)

    emb = torch.nn.Embedding(50, 96)
    assert head_weight(TiedLinear(emb)) is emb.weight
    assert head_weight(ScaledHead(emb)) is None


def test_a_row_samples_the_same_alone_and_in_any_batch():
    """With the paper's kind of filters: also catches ``batch_size``'s pieces decoded with the
    default sampling settings instead of the caller's."""
    model = random_model(4, 2)
    prompts = ragged_prompts(12, seed=3)
    seeds = torch.arange(12) * 31 + 5
    kw = dict(max_new_tokens=30, pad_id=0, stop_tokens=[1, 2, 3], temperature=0.7, top_k=5,
              top_p=0.8)
    whole = G.generate(model, prompts, seeds=seeds, **kw)
    split = G.generate(model, prompts, seeds=seeds, batch_size=5, **kw)
    perm = torch.randperm(12, generator=torch.Generator().manual_seed(0))
    shuffled = G.generate(model, [prompts[i] for i in perm], seeds=seeds[perm], **kw)
    for i in range(12):
        alone = G.generate(model, [prompts[i]], seeds=seeds[i : i + 1], **kw)
        n = int(alone.mask.sum())
        for batch, row in ((whole, i), (split, i), (shuffled, int((perm == i).nonzero()))):
            assert int(batch.mask[row].sum()) == n
            assert torch.equal(batch.tokens[row, :n], alone.tokens[0, :n])
            torch.testing.assert_close(batch.logprobs[row, :n], alone.logprobs[0, :n],
                                       rtol=0, atol=2e-5)


def filtered_logprob(logits, tok, temperature, top_k, top_p):
    """log p(tok) of one position's sampling distribution, in float64, from the definitions:
    softmax of ``logits / T`` over the ``top_k`` largest (ties at the k-th kept), then over the
    fewest most likely of those whose mass reaches ``top_p`` (the one crossing it kept),
    renormalised; -inf for a token outside that set."""
    x = logits.double() / temperature
    kept = list(range(len(x)))
    if top_k is not None:
        kth = sorted(x.tolist(), reverse=True)[top_k - 1]
        kept = [v for v in kept if x[v] >= kth]
    if top_p < 1.0:
        p = torch.softmax(x[kept], 0)
        mass, nucleus = 0.0, []
        for j in sorted(range(len(kept)), key=lambda j: -float(p[j])):
            if mass >= top_p:
                break
            nucleus.append(kept[j])
            mass += float(p[j])
        kept = nucleus
    if tok not in kept:
        return float("-inf")
    return float(x[tok] - torch.logsumexp(x[kept], 0))


@pytest.mark.parametrize("temperature, top_k, top_p", [
    (0.8, None, 1.0), (0.6, None, 0.6), (1.0, 5, 1.0), (0.7, 5, 0.8)])
def test_recorded_logprobs_match_a_fresh_forward(temperature, top_k, top_p):
    """Each recorded log-prob is the sampled token's under the distribution it was drawn from
    (temperature, then top-k / top-p, renormalised), recomputed from a fresh forward by
    :func:`filtered_logprob`: catches a log-prob taken before the filters (what the engine /
    trainer gap and the truncated IS weights would then miss), or at the wrong temperature."""
    model = random_model(4, 2)
    prompts = ragged_prompts(20, seed=4)
    ro = G.generate(model, prompts, max_new_tokens=30, pad_id=0, stop_tokens=[1, 2, 3, 4],
                    temperature=temperature, top_k=top_k, top_p=top_p, seeds=torch.arange(20))
    seq = torch.cat([ro.prompt_tokens, ro.tokens], 1)
    attn, pos = G.sequence_inputs(ro.prompt_mask, ro.tokens.shape[1])
    P = ro.prompt_tokens.shape[1]
    with torch.no_grad():
        logits = model(seq, mask=attn, input_pos=pos)[:, P - 1 : -1]
    rows, cols = ro.mask.nonzero(as_tuple=True)
    want = torch.tensor([filtered_logprob(logits[i, t], int(ro.tokens[i, t]), temperature,
                                          top_k, top_p) for i, t in zip(rows, cols)],
                        dtype=torch.float64)
    assert bool(torch.isfinite(want).all())  # every sampled token is inside its filtered set
    torch.testing.assert_close(ro.logprobs[ro.mask].double(), want, rtol=0, atol=2e-5)
    assert bool((ro.logprobs[~ro.mask] == 0).all())
    unfiltered, _ = logprobs_and_entropy(logits / temperature, ro.tokens)
    gap = (ro.logprobs - unfiltered)[ro.mask].mean()
    if top_k is None and top_p == 1.0:
        assert float(gap.abs()) < 2e-5
    else:  # the filters renormalise: the comparison above can tell the two apart
        assert float(gap) > 0.01


def _shipped(task):
    path = asset_dir(task)
    if task == "tiny_drift":
        model = tiny_qwen3(num_layers=4, embed_dim=128, intermediate_dim=384, max_seq_len=320)
        data, new = drift_dataset(size=64, split="train", seed=0), 232
    else:
        model = tiny_qwen3()
        data, new = modsum_dataset(size=64, split="train", seed=0), 64
    load_model_weights(model, path)
    tok = load_tokenizer(path)
    prompts = [tok.encode_prompt(data[i // 8].prompt) for i in range(64)]  # 8 prompts x 8
    return model, prompts, dict(max_new_tokens=new, pad_id=tok.pad_id, stop_tokens=tok.stop_tokens)


@pytest.mark.parametrize("task", ["tiny", "tiny_drift"])
def test_fast_matches_reference_on_the_shipped_models(task):
    model, prompts, kw = _shipped(task)
    seeds = torch.arange(64) * 7919 + 13
    fast = G.generate(model, prompts, seeds=seeds, **kw)
    ref = G.generate(model, prompts, seeds=seeds, decoder="reference", **kw)
    assert_same_rollouts(fast, ref, min_rows=0.99, lp_tol=1e-4)
    assert int(fast.mask.sum()) > 64 * 20  # real responses, not a row of stop tokens


def test_uniform_table_is_row_uniforms_column_by_column():
    seeds = torch.tensor([0, 1, 2**31 - 2, 123456789])
    table = G.row_uniforms_table(seeds, 50)
    for t in (0, 1, 17, 49):
        assert torch.equal(table[:, t], G.row_uniforms(seeds, t))
    assert table.dtype == torch.float64 and bool(((table >= 0) & (table < 1)).all())


def test_a_model_the_fast_decoder_cannot_read_uses_the_reference():
    class Wrapped(torch.nn.Module):  # not a torchtune TransformerDecoder itself
        def __init__(self, inner):
            super().__init__()
            self.inner = inner
            self.max_seq_len = inner.max_seq_len

        def forward(self, *a, **k):
            return self.inner(*a, **k)

        def setup_caches(self, *a, **k):
            return self.inner.setup_caches(*a, **k)

        def caches_are_enabled(self):
            return self.inner.caches_are_enabled()

        def caches_are_setup(self):
            return self.inner.caches_are_setup()

        def reset_caches(self):
            return self.inner.reset_caches()

    model = random_model(4, 2)
    assert FD.FastPlan.of(Wrapped(model)) is None and FD.FastPlan.of(model) is not None
    prompts = ragged_prompts(6, seed=5)
    kw = dict(max_new_tokens=12, pad_id=0, stop_tokens=[1], seeds=torch.arange(6))
    wrapped = G.generate(Wrapped(model), prompts, **kw)
    assert_same_rollouts(wrapped, G.generate(model, prompts, decoder="reference", **kw),
                         lp_tol=0.0)  # the reference path itself: bit for bit


def test_bad_decoder_name_is_refused():
    with pytest.raises(ValueError, match="decoder must be one of"):
        G.generate(random_model(2, 2), [[3]], max_new_tokens=2, pad_id=0, stop_tokens=[],
                   decoder="fastest")


@pytest.mark.slow
def test_compiled_step_samples_what_the_eager_step_samples(monkeypatch):
    """``compile=True`` must decode through the compiled step (counted: a flag that is ignored
    would pass the comparison alone) and sample what the eager step samples."""
    model = random_model(4, 2)
    prompts = ragged_prompts(12, seed=6)
    kw = dict(max_new_tokens=20, pad_id=0, stop_tokens=[1, 2, 3], seeds=torch.arange(12))
    compiled, calls = FD.compiled_step(), []
    monkeypatch.setattr(FD, "compiled_step",
                        lambda: lambda *a: calls.append(1) or compiled(*a))
    assert_same_rollouts(G.generate(model, prompts, compile=True, **kw),
                         G.generate(model, prompts, **kw), lp_tol=2e-5)
    assert len(calls) >= 5  # one call per decoding step after the first token


def test_generation_compile_reaches_the_decoder(monkeypatch):
    """``generation.compile`` travels config -> build_engine -> TorchtuneEngine -> generate;
    a per-call value wins over the engine's."""
    import pepo.training.engines as E

    seen = []
    monkeypatch.setattr(E, "generate", lambda model, prompts, **kw: seen.append(kw["compile"]))
    model = random_model(2, 2)
    E.build_engine("inprocess", model, compile=True).generate([[3]], max_new_tokens=1)
    E.build_engine("inprocess", model).generate([[3]], max_new_tokens=1)
    E.build_engine("inprocess", model, compile=True).generate([[3]], compile=False)
    assert seen == [True, False, False]
    with pytest.raises(ValueError, match="generation.compile must be true or false"):
        E.build_engine("inprocess", model, compile="yes")
    with pytest.raises(ValueError, match="takes no options"):
        E.build_engine("inprocess", model, dtype="float32")


@pytest.mark.parametrize("decoder", ["fast", "reference"])
def test_progress_counts_each_row_once_as_it_finishes(decoder):
    """Catches a progress callback that is never called, counts rows that are still decoding
    (or dropped rows twice), or misses the rows cut off at ``max_new_tokens``: after decode step
    ``t`` the rows reported are exactly those whose response is at most ``t + 1`` tokens long,
    and the calls add up to the batch, with or without ``batch_size`` pieces."""
    model = random_model(4, 2)
    prompts = ragged_prompts(24, seed=3)
    kw = dict(max_new_tokens=40, pad_id=0, stop_tokens=[1, 2], seeds=torch.arange(24),
              decoder=decoder)
    calls: list[int] = []
    ro = G.generate(model, prompts, progress=calls.append, **kw)
    lengths = ro.mask.sum(-1)
    assert 0 < int(ro.finished.sum()) < len(prompts)  # stopped rows and rows cut off at 40
    cumulative = torch.tensor(calls).cumsum(0)
    expected = torch.stack([(lengths <= t + 1).sum() for t in range(len(calls))])
    assert len(calls) == ro.tokens.shape[1] == int(lengths.max())  # one call per decode step
    assert torch.equal(cumulative, expected), (cumulative.tolist(), expected.tolist())
    pieces: list[int] = []
    split = G.generate(model, prompts, progress=pieces.append, batch_size=7, **kw)
    assert sum(pieces) == len(prompts) and min(pieces) >= 0
    assert torch.equal(split.tokens[:, : ro.tokens.shape[1]], ro.tokens)  # it changes nothing


def _old_uniforms(seed: int, step: int) -> float:
    """The counter-based uniform as first written (lowbias32, scalar Python): the reference the
    non-degenerate pairs must still match, so recorded rollouts keep their tokens."""
    def mix(x: int) -> int:
        x &= 0xFFFFFFFF
        x ^= x >> 16
        x = (x * 0x7FEB352D) & 0xFFFFFFFF
        x ^= x >> 15
        x = (x * 0x846CA68B) & 0xFFFFFFFF
        return x ^ (x >> 16)
    key = mix(seed)
    hi, lo = mix(key ^ mix(2 * step)), mix(key ^ mix(2 * step + 1))
    return ((hi >> 5) * 2**26 + (lo >> 6)) / 2.0**53


def test_small_seeds_draw_no_near_zero_uniform_at_their_own_step():
    # seed 2t at step t once hashed to exactly 0 (u < 2^-27, the lowest token id of non-zero
    # probability): every even seed below twice the response length had one forced draw
    T = 64
    seeds = torch.arange(2 * T + 2)
    table = G.row_uniforms_table(seeds, T)  # [2T+2, T]
    own = table[2 * torch.arange(T), torch.arange(T)]  # seed 2t at step t
    assert float(own.min()) > 1e-3, own.min()
    # over all 8,320 small (seed, step) pairs: as many tiny draws as a uniform gives (~0.8)
    assert int((table < 1e-4).sum()) <= 4
    # low half's degenerate pairs (seed 2t+1 at step t) get random low bits, not zeros
    odd = table[2 * torch.arange(T) + 1, torch.arange(T)] * 2.0**53
    assert int((odd % 2**26 == 0).sum()) == 0


def test_uniforms_unchanged_away_from_the_degenerate_pairs():
    # recorded runs draw their seeds from [0, 2^31): their draws must not move
    g = torch.Generator().manual_seed(5)
    seeds = G.draw_seeds(g, 40)
    table = G.row_uniforms_table(seeds, 30)
    for i in range(0, 40, 7):
        for t in (0, 3, 29):
            assert float(table[i, t]) == _old_uniforms(int(seeds[i]), t)
    assert float(G.row_uniforms(torch.tensor([7]), 2)) == _old_uniforms(7, 2)
