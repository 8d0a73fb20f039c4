"""pepo.training.models.qwen3 against a loop-free reference written from Hugging Face's Qwen3
formulas: q/k RMSNorm per head *before* rotate-half RoPE, GQA, SwiGLU, pre-norm residuals, tied
head."""

from __future__ import annotations

import pytest
import torch

from pepo.training.models import qwen3


def rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x, pos, base):  # x [b, h, s, d], rotate-half convention
    d = x.shape[-1]
    inv = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos[:, None].double() * inv[None]  # [s, d/2]
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def reference_logits(model, tokens, n_heads, n_kv, head_dim, base):
    sd = {k: v.double() for k, v in model.state_dict().items()}
    h = sd["tok_embeddings.weight"][tokens]  # [b, s, d]
    b, s, _ = h.shape
    pos = torch.arange(s)
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    for i in range(len(model.layers)):
        p = f"layers.{i}."
        x = rms(h, sd[p + "sa_norm.scale"])
        q = (x @ sd[p + "attn.q_proj.linear.weight"].T).view(b, s, n_heads, head_dim)
        k = (x @ sd[p + "attn.k_proj.linear.weight"].T).view(b, s, n_kv, head_dim)
        v = (x @ sd[p + "attn.v_proj.weight"].T).view(b, s, n_kv, head_dim)
        q = rms(q, sd[p + "attn.q_proj.norm.scale"]).transpose(1, 2)  # norm, then RoPE
        k = rms(k, sd[p + "attn.k_proj.norm.scale"]).transpose(1, 2)
        q, k = rope(q, pos, base), rope(k, pos, base)
        k = k.repeat_interleave(n_heads // n_kv, 1)
        v = v.transpose(1, 2).repeat_interleave(n_heads // n_kv, 1)
        att = (q @ k.transpose(-1, -2)) / head_dim**0.5
        att = att.masked_fill(~causal, float("-inf")).softmax(-1)
        o = (att @ v).transpose(1, 2).reshape(b, s, n_heads * head_dim)
        h = h + o @ sd[p + "attn.output_proj.weight"].T
        x = rms(h, sd[p + "mlp_norm.scale"])
        gate = torch.nn.functional.silu(x @ sd[p + "mlp.w1.weight"].T)
        h = h + (gate * (x @ sd[p + "mlp.w3.weight"].T)) @ sd[p + "mlp.w2.weight"].T
    h = rms(h, sd["norm.scale"])
    return h @ sd["tok_embeddings.weight"].T


@pytest.mark.parametrize("n_heads, n_kv, head_dim", [(4, 2, 8), (2, 2, 24)])
def test_qwen3_matches_reference(n_heads, n_kv, head_dim):
    torch.manual_seed(0)
    m = qwen3(vocab_size=40, num_layers=2, num_heads=n_heads, num_kv_heads=n_kv, embed_dim=32,
              intermediate_dim=48, max_seq_len=64, head_dim=head_dim, rope_base=10_000.0,
              tie_word_embeddings=True)
    with torch.no_grad():  # randomise every norm: a norm/RoPE ordering bug hides behind unit scales
        for name, p in m.named_parameters():
            p.copy_(1 + 0.5 * torch.randn_like(p) if "norm" in name else 0.3 * torch.randn_like(p))
    tokens = torch.randint(0, 40, (2, 11))
    got = m(tokens)
    ref = reference_logits(m, tokens, n_heads, n_kv, head_dim, 10_000.0)
    torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-4)


def test_qwen3_rejects_bad_shapes():
    with pytest.raises(ValueError, match="num_kv_heads=3 must divide num_heads=4"):
        qwen3(vocab_size=8, num_layers=1, num_heads=4, num_kv_heads=3, embed_dim=16,
              intermediate_dim=8, max_seq_len=8)
    with pytest.raises(ValueError, match="head_dim must be an even int"):
        qwen3(vocab_size=8, num_layers=1, num_heads=2, num_kv_heads=1, embed_dim=16,
              intermediate_dim=8, max_seq_len=8, head_dim=5)


@pytest.mark.parametrize("name, value", [("num_layers", 2.0), ("embed_dim", "32"),
                                         ("vocab_size", True), ("max_seq_len", 0)])
def test_qwen3_refuses_a_size_that_is_not_a_positive_int(name, value):
    """A YAML ``2.0``, a quoted ``"32"`` or a ``true`` is refused in one line naming the key:
    catches only ``< 1`` checked (torchtune's modules then fail deep inside with a TypeError
    naming none of them), and a bool taken for an int (``true`` built a model of one layer)."""
    sizes = dict(vocab_size=8, num_layers=1, num_heads=2, num_kv_heads=1, embed_dim=16,
                 intermediate_dim=8, max_seq_len=8)
    with pytest.raises(ValueError, match=rf"^{name} must be a positive int, got {value!r}$"):
        qwen3(**{**sizes, name: value})


def test_a_head_norm_over_a_width_that_is_no_whole_number_of_heads_is_refused():
    """Catches the check left out: ``unflatten`` would fail at the first forward with a view
    error, far from the config that set the sizes."""
    from pepo.training.models import HeadNormProjection

    with pytest.raises(ValueError, match=r"^projection width 40 is not a multiple of head_dim=16"):
        HeadNormProjection(torch.nn.Linear(8, 40, bias=False), 16)
    assert HeadNormProjection(torch.nn.Linear(8, 48, bias=False), 16)(torch.ones(1, 2, 8)).shape \
        == (1, 2, 48)
