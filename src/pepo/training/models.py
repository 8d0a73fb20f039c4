"""Model builders on torchtune components.

torchtune 0.6.1 has no Qwen3. :func:`qwen3` builds the architecture from torchtune's modules:

* q/k RMSNorm per head **before** RoPE, as Hugging Face's Qwen3 does. torchtune's
  ``MultiHeadAttention`` applies its ``q_norm``/``k_norm`` *after* the positional embedding, so
  the norm is folded into the projection instead (:class:`HeadNormProjection`) and the
  attention's own norms stay unset.
* Hugging Face's "rotate half" RoPE (``Qwen2RotaryPositionalEmbeddings``), no q/k/v bias,
  ``head_dim`` free of ``embed_dim // num_heads`` (Qwen3-4B has 32 heads of 128 on 2560),
  optional tied embeddings.

:func:`tiny_qwen3` is the model of the embedded ``tiny`` recipe config.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn
from torchtune.models.qwen2._positional_embeddings import Qwen2RotaryPositionalEmbeddings
from torchtune.modules import (
    FeedForward,
    MultiHeadAttention,
    RMSNorm,
    TiedLinear,
    TransformerDecoder,
    TransformerSelfAttentionLayer,
)

__all__ = ["HeadNormProjection", "check_model", "check_state_matches", "head_weight", "qwen3",
           "tiny_qwen3"]


class HeadNormProjection(nn.Module):
    """A linear projection followed by RMSNorm over each head's ``head_dim`` features.

    Shape:
        x: ``[b, s, d_in]`` → ``[b, s, num_heads * head_dim]``.
    """

    def __init__(self, linear: nn.Linear, head_dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        if linear.out_features % head_dim:
            raise ValueError(
                f"projection width {linear.out_features} is not a multiple of head_dim={head_dim}"
            )
        self.linear = linear
        self.head_dim = head_dim
        self.norm = RMSNorm(head_dim, eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)  # [b, s, n * h_d]
        return self.norm(y.unflatten(-1, (-1, self.head_dim))).flatten(-2)


def qwen3(
    *,
    vocab_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    embed_dim: int,
    intermediate_dim: int,
    max_seq_len: int,
    head_dim: Optional[int] = None,
    norm_eps: float = 1e-6,
    rope_base: float = 1_000_000.0,
    tie_word_embeddings: bool = False,
) -> TransformerDecoder:
    """Builds a Qwen3 decoder (dense) from torchtune modules.

    Args:
        vocab_size: vocabulary size.
        num_layers: transformer layers.
        num_heads: query heads.
        num_kv_heads: key/value heads (GQA); must divide ``num_heads``.
        embed_dim: model width.
        intermediate_dim: SwiGLU hidden width.
        max_seq_len: longest sequence (prompt + response) the model will see.
        head_dim: per-head width; ``embed_dim // num_heads`` when None.
        norm_eps: RMSNorm epsilon (all norms, q/k norms included).
        rope_base: RoPE base period (Qwen3: 1e6).
        tie_word_embeddings: share the input embedding with the output projection.

    Returns:
        A ``TransformerDecoder`` whose forward gives logits ``[b, s, vocab_size]``.
    """
    for name, value in (
        ("vocab_size", vocab_size),
        ("num_layers", num_layers),
        ("num_heads", num_heads),
        ("num_kv_heads", num_kv_heads),
        ("embed_dim", embed_dim),
        ("intermediate_dim", intermediate_dim),
        ("max_seq_len", max_seq_len),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_kv_heads={num_kv_heads} must divide num_heads={num_heads}")
    head_dim = head_dim if head_dim is not None else embed_dim // num_heads
    if head_dim < 2 or head_dim % 2:
        raise ValueError(f"head_dim must be an even int >= 2 for RoPE, got {head_dim}")

    rope = Qwen2RotaryPositionalEmbeddings(dim=head_dim, max_seq_len=max_seq_len, base=rope_base)
    layers = nn.ModuleList()
    for _ in range(num_layers):
        attn = MultiHeadAttention(
            embed_dim=embed_dim,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            q_proj=HeadNormProjection(
                nn.Linear(embed_dim, num_heads * head_dim, bias=False), head_dim, norm_eps
            ),
            k_proj=HeadNormProjection(
                nn.Linear(embed_dim, num_kv_heads * head_dim, bias=False), head_dim, norm_eps
            ),
            v_proj=nn.Linear(embed_dim, num_kv_heads * head_dim, bias=False),
            output_proj=nn.Linear(num_heads * head_dim, embed_dim, bias=False),
            pos_embeddings=rope,
            max_seq_len=max_seq_len,
        )
        mlp = FeedForward(
            gate_proj=nn.Linear(embed_dim, intermediate_dim, bias=False),
            down_proj=nn.Linear(intermediate_dim, embed_dim, bias=False),
            up_proj=nn.Linear(embed_dim, intermediate_dim, bias=False),
        )
        layers.append(
            TransformerSelfAttentionLayer(
                attn=attn,
                mlp=mlp,
                sa_norm=RMSNorm(embed_dim, eps=norm_eps),
                mlp_norm=RMSNorm(embed_dim, eps=norm_eps),
            )
        )
    tok_embeddings = nn.Embedding(vocab_size, embed_dim)
    output = (
        TiedLinear(tok_embeddings)
        if tie_word_embeddings
        else nn.Linear(embed_dim, vocab_size, bias=False)
    )
    return TransformerDecoder(
        tok_embeddings=tok_embeddings,
        layers=layers,
        max_seq_len=max_seq_len,
        num_heads=num_heads,
        head_dim=head_dim,
        norm=RMSNorm(embed_dim, eps=norm_eps),
        output=output,
    )


def tiny_qwen3(
    vocab_size: int = 32,
    num_layers: int = 3,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    embed_dim: int = 96,
    intermediate_dim: int = 256,
    max_seq_len: int = 128,
    head_dim: Optional[int] = 32,
) -> TransformerDecoder:
    """The embedded task's model: Qwen3 architecture, tied embeddings, ~0.33M parameters.

    Heads of 32 (not ``embed_dim // num_heads = 24``): the smallest head size vLLM's CPU
    attention kernels take, so the same checkpoint runs in both rollout engines.
    """
    return qwen3(
        vocab_size=vocab_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        embed_dim=embed_dim,
        intermediate_dim=intermediate_dim,
        max_seq_len=max_seq_len,
        head_dim=head_dim,
        tie_word_embeddings=True,
    )


def check_state_matches(model: nn.Module, state: dict, source: Any) -> None:
    """Raises ``ValueError`` unless ``state`` has exactly ``model``'s keys and shapes
    (``source`` names where it came from)."""
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    if missing or unexpected:
        raise ValueError(
            f"{source} does not match the model: missing {missing[:5]}, unexpected "
            f"{unexpected[:5]} (a checkpoint of another model: load it with the config that "
            f"trained it, or one whose model section is that config's)"
        )
    for k, v in state.items():
        if v.shape != own[k].shape:
            raise ValueError(
                f"{source}: {k} has shape {list(v.shape)}, the model expects {list(own[k].shape)}"
            )


def head_weight(output: Any, *, required: bool = False) -> Optional[torch.Tensor]:
    """The ``[V, d]`` weight of an output head that is that one product and nothing else
    (torchtune's ``TiedLinear``, or an ``nn.Linear`` without bias); None for any other head (a
    bias, an adapter, a subclass: more than the product), or with ``required`` a ``ValueError``
    saying so (``logprobs_from_hidden`` multiplies by the weight alone)."""
    if type(output) is TiedLinear:
        return output.tied_module.weight
    if type(output) is nn.Linear and output.bias is None:
        return output.weight
    if not required:
        return None
    kind = type(output).__name__ + (" with a bias" if getattr(output, "bias", None) is not None
                                    else "")
    raise ValueError(
        f"logprobs_from_hidden=true needs an output head that is one matrix product (torchtune's "
        f"TiedLinear, or an nn.Linear without bias); this model's is a {kind}: set "
        f"logprobs_from_hidden=false"
    )


def check_model(model: Any, vocab_size: int, *, logprobs_from_hidden: bool) -> None:
    """A built model's fit to its run, checked before anything runs: the tokenizer's ids within
    its embedding and, with ``logprobs_from_hidden``, an output head :func:`head_weight` takes."""
    emb = model.tok_embeddings.num_embeddings
    if vocab_size > emb:
        raise ValueError(f"tokenizer has {vocab_size} tokens but the model embeds only {emb}")
    if logprobs_from_hidden:
        head_weight(model.output, required=True)
