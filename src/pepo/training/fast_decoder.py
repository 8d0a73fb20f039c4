"""pepo's fast in-process decoder: a torchtune decoder's own modules, run with its own KV cache.

It samples the tokens the reference decoder (:func:`pepo.training.generation.generate` with
``decoder="reference"``: torchtune's KV cache, every row in lock-step to the end) samples for
the same per-row seeds, and it is faster because it attends over the filled part of the cache
only, holds and reads each distinct prompt's keys and values once for all its rollouts (prefix
sharing), drops finished rows from the batch and runs the q/k/v and the MLP's gate/up
projections as one product each in models of at most 256 MiB of parameters (larger ones keep
their own products, since the fused weights are copies; ``benchmarks/bench_decoder.py`` has the
figures).

:func:`pepo.training.generation.generate` (the default ``decoder="fast"``) and
:func:`pepo.training.generation.decode` are the usual entries; here are
:meth:`FastPlan.of` (how a model is read, or None for one the decoder cannot read),
:func:`generate_fast` (the decoder on left-padded prompts, for one model or the token
intervention's two) and :func:`decode_step` / :func:`compiled_step` (one step).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
from torchtune.generation import (
    get_causal_mask_from_padding_mask,
    get_position_ids_from_padding_mask,
)

from pepo.entropy import logprobs_and_entropy
from pepo.training.draws import draw_token, row_uniforms_table
from pepo.training.models import head_weight as weight_of_head
from pepo.training.precision import no_autocast

__all__ = ["FastPlan", "compiled_step", "decode_step", "generate_fast"]


@dataclass
class FastPlan:
    """A torchtune decoder read as the modules :func:`generate_fast` calls in its own order:
    ``layers`` are its ``TransformerSelfAttentionLayer``s (unwrapped from activation
    checkpointing), whose norms, attention projections and MLP the decoder calls one by one.

    ``fused`` holds, per layer, the projections the decode step runs as one matrix product
    (:class:`_Fused`), and ``rope`` how it applies the rotary embedding (:func:`_rope_tables`).
    Fused weights are copies: a plan is a snapshot of the model's weights, built per
    :func:`generate` call. A plan built under ``torch.autocast`` holds them in autocast's
    dtype, the cast autocast would otherwise make of them at every step (it caches its casts
    of the model's own parameters, not of copies); it is used under the same autocast.
    """

    embed: torch.nn.Module
    layers: list
    norm: torch.nn.Module
    output: Callable
    num_heads: int
    num_kv_heads: int
    head_dim: int
    fused: list = field(default_factory=list)
    rope: Optional[str] = None
    head_weight: Optional[torch.Tensor] = None

    @classmethod
    def of(cls, model: torch.nn.Module) -> Optional["FastPlan"]:
        """The plan, or None for a model whose forward the fast decoder cannot reproduce."""
        from torchtune.modules import (
            MultiHeadAttention,
            TransformerDecoder,
            TransformerSelfAttentionLayer,
        )

        if type(model) is not TransformerDecoder or model.output_hidden_states:
            return None
        if model.caches_are_setup() or _has_sharded_parameters(model):
            return None
        layers = [getattr(layer, "_checkpoint_wrapped_module", layer) for layer in model.layers]
        shape = None
        for layer in layers:
            attn = getattr(layer, "attn", None)
            if (type(layer) is not TransformerSelfAttentionLayer
                    or type(attn) is not MultiHeadAttention):
                return None
            if shape not in (None, (attn.num_heads, attn.num_kv_heads, attn.head_dim)):
                return None
            shape = (attn.num_heads, attn.num_kv_heads, attn.head_dim)
        fuse = sum(p.numel() * p.element_size() for p in model.parameters()) <= _FUSE_MAX_BYTES
        return cls(model.tok_embeddings, layers, model.norm, model.output, *shape,
                   fused=[_Fused.of(layer, fuse) for layer in layers],
                   rope=_rope_kind([layer.attn.pos_embeddings for layer in layers]),
                   head_weight=weight_of_head(model.output))


# The decode step runs the q/k/v projections, and the MLP's gate and up projections, as one
# matrix product each when the model's parameters take at most this many bytes: the copies of
# the weights this needs are then small, and the small products' per-call cost is what is saved.
_FUSE_MAX_BYTES = 256 * 2**20


@dataclass
class _Fused:
    """One layer's products as the decode step runs them: ``qkv`` (``[(n_h + 2 n_kv) h_d, d]``
    and its bias) the three attention projections in one, ``up`` (``[2 I, d]``, bias) the
    MLP's gate and up projections in one, and the per-head RMSNorms of queries and keys as one
    norm over the ``n_h + n_kv`` heads side by side with their scales ``[n_h + n_kv, h_d]``:
    ``head_norm`` where they come before the rotary embedding (inside the projections,
    :class:`pepo.training.models.HeadNormProjection`, Qwen3), ``qk_norm`` where after it
    (torchtune's ``q_norm``/``k_norm``). None where the layer's modules are called one by one
    instead. Each gives the values the modules give (the same dot products, the same
    element-wise ops on the same elements)."""

    qkv: Optional[torch.Tensor] = None
    qkv_bias: Optional[torch.Tensor] = None
    head_norm: Optional[torch.Tensor] = None
    head_norm_eps: float = 0.0
    qk_norm: Optional[torch.Tensor] = None
    qk_norm_eps: float = 0.0
    up: Optional[torch.Tensor] = None
    up_bias: Optional[torch.Tensor] = None

    @classmethod
    def of(cls, layer, fuse: bool) -> "_Fused":
        from torchtune.modules import FeedForward

        from pepo.training.models import HeadNormProjection

        f, attn, mlp = cls(), layer.attn, layer.mlp
        q, k = attn.q_proj, attn.k_proj
        with torch.no_grad():
            if fuse and type(q) is type(k) is HeadNormProjection:
                f.head_norm, f.head_norm_eps = _cat_norms(q.norm, k.norm, attn)
                if f.head_norm is not None:
                    f.qkv, f.qkv_bias = _cat_linear([q.linear, k.linear, attn.v_proj])
            elif fuse:
                f.qkv, f.qkv_bias = _cat_linear([q, k, attn.v_proj])
            if fuse and type(mlp) is FeedForward and mlp.w3 is not None:
                f.up, f.up_bias = _cat_linear([mlp.w1, mlp.w3])
            if attn.q_norm is not None and attn.k_norm is not None:
                f.qk_norm, f.qk_norm_eps = _cat_norms(attn.q_norm, attn.k_norm, attn)
        device_type = next(layer.parameters()).device.type
        if torch.is_autocast_enabled(device_type):  # the products' operands, cast once
            low = torch.get_autocast_dtype(device_type)  # (autocast leaves float64 alone)
            f.qkv, f.qkv_bias, f.up, f.up_bias = (
                w if w is None or w.dtype == torch.float64 else w.to(low)
                for w in (f.qkv, f.qkv_bias, f.up, f.up_bias))
        return f


def _cat_norms(qn, kn, attn) -> tuple[Optional[torch.Tensor], float]:
    """The scales of two per-head RMSNorms of equal epsilon, one row per query head then per
    key/value head (``[n_h + n_kv, h_d]``), and the epsilon; ``(None, 0.0)`` otherwise."""
    from torchtune.modules import RMSNorm

    if (type(qn) is not RMSNorm or type(kn) is not RMSNorm or qn.eps != kn.eps
            or qn.scale.shape != (attn.head_dim,) or kn.scale.shape != (attn.head_dim,)):
        return None, 0.0
    return torch.cat([qn.scale.expand(attn.num_heads, -1),
                      kn.scale.expand(attn.num_kv_heads, -1)]), qn.eps


def _cat_linear(modules) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """The weights (and biases) of plain ``nn.Linear`` modules stacked along their outputs, or
    ``(None, None)`` when one is not a plain linear layer or only some have a bias."""
    if any(type(m) is not torch.nn.Linear for m in modules):
        return None, None
    biases = [m.bias for m in modules]
    if any(b is None for b in biases) and any(b is not None for b in biases):
        return None, None
    w = torch.cat([m.weight for m in modules])
    return w, None if biases[0] is None else torch.cat(biases)


def _rope_kind(ropes: list) -> Optional[str]:
    """How the decode step applies the layers' rotary embedding: from the module's cache once
    per step for all layers when every layer holds the same module (as torchtune's builders
    make them), in ``"half"`` (Qwen2's rotate-half) or ``"pairs"`` form (Llama's interleaved
    pairs); otherwise ``"module"`` (each layer's module, queries and keys in one call), or None
    when no layer has one."""
    from torchtune.models.llama3_1._position_embeddings import Llama3ScaledRoPE
    from torchtune.models.qwen2._positional_embeddings import Qwen2RotaryPositionalEmbeddings
    from torchtune.modules import RotaryPositionalEmbeddings

    first = ropes[0]
    if any(r is not first for r in ropes):
        return "module"
    if first is None:
        return None
    if type(first) is Qwen2RotaryPositionalEmbeddings:
        return "half"
    if type(first) in (RotaryPositionalEmbeddings, Llama3ScaledRoPE):
        return "pairs"
    return "module"


def _has_sharded_parameters(model: torch.nn.Module) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch without distributed tensors
        return False
    return any(isinstance(p, DTensor) for p in model.parameters())


def _project(attn, h: torch.Tensor, pos: torch.Tensor):
    """q ``[b, n_h, s, h_d]``, k and v ``[b, n_kv, s, h_d]`` of ``h`` ``[b, s, d]``, as
    torchtune's ``MultiHeadAttention.forward`` computes them (RoPE, then the optional norms)."""
    b, s, _ = h.shape
    q = attn.q_proj(h).view(b, s, attn.num_heads, attn.head_dim)
    k = attn.k_proj(h).view(b, s, -1, attn.head_dim)
    v = attn.v_proj(h).view(b, s, -1, attn.head_dim)
    if attn.pos_embeddings is not None:
        q = attn.pos_embeddings(q, input_pos=pos)
        k = attn.pos_embeddings(k, input_pos=pos)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if attn.q_norm is not None:
        q = attn.q_norm(q)
    if attn.k_norm is not None:
        k = attn.k_norm(k)
    return q, k, v


def _rope_tables(plan: FastPlan, pos: torch.Tensor, dtype: torch.dtype):
    """What the rotary embedding needs at positions ``pos`` ``[b, 1]``, read from the module's
    cache once per step for every layer: ``(cos, sin)``, ``[b, 1, h_d]`` for ``"half"`` and
    ``[b, 1, h_d / 2]`` for ``"pairs"``; ``pos`` itself otherwise."""
    if plan.rope == "half":
        rows = plan.layers[0].attn.pos_embeddings.cache[pos[:, 0]][:, None]  # [b, 1, 2 h_d]
        return rows[..., : plan.head_dim].to(dtype), rows[..., plan.head_dim :].to(dtype)
    if plan.rope == "pairs":
        rows = plan.layers[0].attn.pos_embeddings.cache[pos[:, 0]][:, None]  # [b, 1, h_d/2, 2]
        return rows[..., 0], rows[..., 1]
    return pos


def _rope(plan: FastPlan, attn, x: torch.Tensor, tables) -> torch.Tensor:
    """The rotary embedding of ``x`` ``[b, H, h_d]`` (query and key heads side by side: every
    head is rotated alike), with the element-wise ops of the module's forward."""
    if plan.rope == "half":  # in x's dtype, as the module: bf16 q/k under autocast
        cos, sin = (t.to(x.dtype) for t in tables)
        half = x.shape[-1] // 2
        return (x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin).type_as(x)
    if plan.rope == "pairs":
        xs = x.float().reshape(*x.shape[:-1], -1, 2)
        x0, x1 = xs[..., 0], xs[..., 1]
        c, s = tables
        return torch.stack([x0 * c - x1 * s, x1 * c + x0 * s], -1).flatten(2).type_as(x)
    if attn.pos_embeddings is None:
        return x
    return attn.pos_embeddings(x[:, None], input_pos=tables)[:, 0]


def _head_rms_norm(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """torchtune's ``RMSNorm`` over the last dim of ``x`` ``[b, H, h_d]`` with one scale row
    per head (``scale`` ``[H, h_d]``): fp32 inside, ``x``'s dtype out."""
    y = torch.nn.functional.rms_norm(x.float(), (x.shape[-1],), eps=eps) * scale
    return y.to(x.dtype)


def _qkv(plan: FastPlan, attn, f: _Fused, h: torch.Tensor, tables):
    """q ``[b, n_h, h_d]``, k and v ``[b, n_kv, h_d]`` of one token per row (``h`` ``[b, d]``),
    as torchtune's ``MultiHeadAttention.forward`` computes them (RoPE, then the optional
    norms), with the fused products of ``f`` where there are."""
    b = h.shape[0]
    n_h, n_kv, hd = plan.num_heads, plan.num_kv_heads, plan.head_dim
    if f.qkv is not None:
        qkv = torch.nn.functional.linear(h, f.qkv, f.qkv_bias)
        qk, v = qkv[:, : (n_h + n_kv) * hd], qkv[:, (n_h + n_kv) * hd :]
        qk = qk.reshape(b, n_h + n_kv, hd)
        if f.head_norm is not None:
            qk = _head_rms_norm(qk, f.head_norm, f.head_norm_eps)
    else:
        qk = torch.cat([attn.q_proj(h), attn.k_proj(h)], -1).view(b, n_h + n_kv, hd)
        v = attn.v_proj(h)
    qk = _rope(plan, attn, qk, tables)
    if f.qk_norm is not None:
        qk = _head_rms_norm(qk, f.qk_norm, f.qk_norm_eps)
    q, k = qk[:, :n_h], qk[:, n_h:]
    if f.qk_norm is None:  # torchtune's own norms, if any, one by one
        q = q if attn.q_norm is None else attn.q_norm(q)
        k = k if attn.k_norm is None else attn.k_norm(k)
    return q, k, v.reshape(b, n_kv, hd)


def _mlp(mlp, f: _Fused, h: torch.Tensor) -> torch.Tensor:
    """The layer's MLP on ``h`` ``[b, d]``: ``w2(act(w1 h) * w3 h)`` with ``w1`` and ``w3`` as
    one product where fused."""
    if f.up is None:
        return mlp(h)
    gu = torch.nn.functional.linear(h, f.up, f.up_bias)
    i = gu.shape[-1] // 2
    return mlp.w2(mlp.activation(gu[:, :i]) * gu[:, i:])


def _head(plan: FastPlan, x: torch.Tensor) -> torch.Tensor:
    """fp32 logits of the final hidden states ``x``, the output head outside autocast
    (:func:`pepo.training.precision.no_autocast`).

    On a CPU an fp32 head runs as ``W · xᵀ`` (``[V, d] x [d, b]``), transposed back: with a
    few rows and a large vocabulary the BLAS takes that form at 1.5-1.8x the rate of
    ``x · Wᵀ`` (SmolLM2's ``[32, 576] x [576, 49152]`` on a 2-core Zen 3: 25-29 against 43 ms).
    The values are those of the module's product to fp32 rounding (bit for bit there at 32
    rows), and the decodes measured drew the same tokens (docs/performance.md)."""
    with no_autocast(x.device):
        h = plan.norm(x)
        w = plan.head_weight
        if w is not None and h.device.type == "cpu" and h.dtype == w.dtype == torch.float32:
            flat = h.reshape(-1, h.shape[-1])
            return (w @ flat.t()).t().contiguous().view(*h.shape[:-1], w.shape[0])
        return plan.output(h).float()


def decode_step(plan: FastPlan, tok: torch.Tensor, pos: torch.Tensor, prompt_k: list,
                 prompt_v: list, cache_k: list, cache_v: list, prompt_bias: torch.Tensor,
                 slot_u: torch.Tensor, slot_r: torch.Tensor, r_max: int, n: int) -> torch.Tensor:
    """One decoding step of ``b`` rows: the new tokens ``tok`` ``[b]`` at positions ``pos``
    ``[b, 1]`` go into response column ``n - 1`` of every layer's response cache (``cache_k``,
    ``[b, n_kv, T, h_d]``), each row attending over its prompt's columns and its response
    columns ``0 .. n-1``. Returns the next logits ``[b, V]`` fp32.

    The prompts' keys and values are held once per distinct prompt (``prompt_k``,
    ``[U, n_kv, P, h_d]``), not once per row: row ``i`` reads prompt ``slot_u[i]``, where it is
    the ``slot_r[i]``-th of at most ``r_max`` rows. The queries of one prompt's rows, and the
    heads that share a key/value head, form one query block, so each (prompt, key/value head)
    is one matrix product over the prompt's columns and each (row, key/value head) one over its
    response columns; ``prompt_bias`` ``[U * n_kv, 1, P]`` is 0, or -inf on left padding. The
    two parts share one softmax: softmax(q·kᵀ/√h_d + bias)·v over ``[prompt | response]``, as
    ``scaled_dot_product_attention`` computes it, with no copy of either cache. With
    ``r_max == 1`` (no prompt shared) the prompt cache is in row order and read directly.

    The rows are ``[b, d]`` throughout (one token each); the projections run fused where the
    plan has them (:class:`_Fused`) and the rotary tables are read once for all layers.
    """
    b = tok.shape[0]
    x = plan.embed(tok)  # [b, d]
    tables = _rope_tables(plan, pos, x.dtype)
    for layer, f, pk, pv, ck, cv in zip(plan.layers, plan.fused, prompt_k, prompt_v, cache_k,
                                        cache_v):
        q, k, v = _qkv(plan, layer.attn, f, layer.sa_norm(x), tables)
        ck[:, :, n - 1 : n] = k[:, :, None]
        cv[:, :, n - 1 : n] = v[:, :, None]
        a = _attend(q, pk, pv, ck[:, :, :n], cv[:, :, :n], prompt_bias, slot_u, slot_r, r_max)
        x = x + layer.sa_scale(layer.attn.output_proj(a.to(q.dtype).reshape(b, -1)))
        x = x + layer.mlp_scale(_mlp(layer.mlp, f, layer.mlp_norm(x)))
    return _head(plan, x)


def _attend(q: torch.Tensor, pk: torch.Tensor, pv: torch.Tensor, ck: torch.Tensor,
            cv: torch.Tensor, prompt_bias: torch.Tensor, slot_u: torch.Tensor,
            slot_r: torch.Tensor, r_max: int) -> torch.Tensor:
    """One layer's attention output ``[b * n_kv, group, h_d]`` for :func:`decode_step`: the
    queries ``q`` ``[b, n_h, h_d]`` over their prompts' keys and values (``pk``, ``pv``) and
    their filled response columns (``ck``, ``cv``, ``[b, n_kv, n, h_d]``). On a CPU in fp32
    outside autocast, as the trainer's attention
    (:func:`pepo.training.precision.cpu_attention_in_fp32`); elsewhere as given."""
    if q.device.type != "cpu":
        return _attend_in(q, pk, pv, ck, cv, prompt_bias, slot_u, slot_r, r_max)
    with no_autocast(q.device):
        q, pk, pv, ck, cv, prompt_bias = (_at_least_fp32(t)
                                          for t in (q, pk, pv, ck, cv, prompt_bias))
        return _attend_in(q, pk, pv, ck, cv, prompt_bias, slot_u, slot_r, r_max)


def _at_least_fp32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _attend_in(q: torch.Tensor, pk: torch.Tensor, pv: torch.Tensor, ck: torch.Tensor,
               cv: torch.Tensor, prompt_bias: torch.Tensor, slot_u: torch.Tensor,
               slot_r: torch.Tensor, r_max: int) -> torch.Tensor:
    """:func:`_attend` in the dtypes given (and autocast's, where it is on)."""
    b, hd = q.shape[0], q.shape[-1]
    u, n_kv, plen = pk.shape[:3]
    n = ck.shape[2]
    group = q.shape[1] // n_kv
    shared = r_max > 1  # else the prompt cache is in row order (slot_u = 0..b-1, slot_r = 0)
    q = q.reshape(b, n_kv, group, hd)
    if shared:
        blocks = q.new_zeros(u, n_kv, r_max, group, hd)  # each prompt's rows side by side
        blocks[slot_u, :, slot_r] = q
    else:
        blocks = q
    s_prompt = torch.baddbmm(prompt_bias, blocks.reshape(u * n_kv, r_max * group, hd),
                             pk.transpose(-1, -2).reshape(u * n_kv, hd, plen),
                             alpha=hd ** -0.5)  # [u * n_kv, r_max * group, P]
    if shared:
        s_prompt = s_prompt.view(u, n_kv, r_max, group, plen)[slot_u, :, slot_r]
    s_resp = torch.bmm(q.reshape(b * n_kv, group, hd),
                       ck.transpose(-1, -2).reshape(b * n_kv, hd, n)) * hd ** -0.5
    # an fp32 softmax (as scaled_dot_product_attention's) also of bf16 scores (autocast)
    scores = torch.cat([s_prompt.reshape(b * n_kv, group, plen), s_resp], -1)
    w = scores.softmax(-1, dtype=torch.promote_types(scores.dtype, torch.float32)).to(pv.dtype)
    if shared:
        w_blocks = w.new_zeros(u, n_kv, r_max, group, plen)
        w_blocks[slot_u, :, slot_r] = w[..., :plen].reshape(b, n_kv, group, plen)
        a = torch.bmm(w_blocks.view(u * n_kv, r_max * group, plen),
                      pv.reshape(u * n_kv, plen, hd))
        a = a.view(u, n_kv, r_max, group, hd)[slot_u, :, slot_r].reshape(b * n_kv, group, hd)
    else:
        a = torch.bmm(w[..., :plen], pv.reshape(b * n_kv, plen, hd))
    return a + torch.bmm(w[..., plen:], cv.reshape(b * n_kv, n, hd))


@functools.cache
def compiled_step() -> Callable:
    """:func:`decode_step` through ``torch.compile`` (dynamic shapes: the batch shrinks and the
    cache fills as decoding goes on), built on first use. The first two steps, and steps with
    at most two rows or one prompt left, run eagerly: a size of 0 or 1 would make the compiler
    specialise on it and compile the step again for each such value. Sizes that happen to be
    equal (64 rows and a 64-token limit) are not taken to be one symbol ("duck sizing"), which
    would compile the step again once they differ."""
    from torch.fx.experimental import _config as shape_config

    compiled = torch.compile(decode_step, dynamic=True)

    def step(plan, tok, pos, prompt_k, *rest):
        n = rest[-1]
        if n <= 2 or tok.shape[0] <= 2 or prompt_k[0].shape[0] <= 1:
            return decode_step(plan, tok, pos, prompt_k, *rest)
        with shape_config.patch(use_duck_shape=False):
            return compiled(plan, tok, pos, prompt_k, *rest)

    return step


# Compact the batch (drop finished rows from it and from the KV cache) once at most this share
# of its rows is still decoding: each compaction copies the cache once, about what one decoding
# step reads, so it pays back within a few steps.
_COMPACT_BELOW = 0.875


class _FastCache:
    """One model's KV cache for the fast decoder. The prompts' keys and values are computed and
    held once per distinct prompt (``[U, n_kv, P, h_d]`` per layer: the rollouts of one prompt
    share them), the responses' per row (``[b, n_kv, T, h_d]``), one column per decoding step.
    The rows can be narrowed to a subset (:meth:`keep`) as rows finish; prompts with no row left
    are dropped with them."""

    def __init__(self, plan: FastPlan, prompt_tokens: torch.Tensor, prompt_mask: torch.Tensor,
                 max_new_tokens: int, step: Callable) -> None:
        bsz, plen = prompt_tokens.shape
        device = prompt_tokens.device
        n_kv, hd = plan.num_kv_heads, plan.head_dim
        group = plan.num_heads // n_kv
        dtype = next(plan.embed.parameters()).dtype
        self.plan, self.step = plan, step
        # the distinct prompts (padding included in the comparison), and each row's
        key = prompt_tokens.masked_fill(~prompt_mask, -1)
        distinct, self.prompt_of = torch.unique(key, dim=0, return_inverse=True)  # [U, P], [B]
        u = distinct.shape[0]
        first = torch.full((u,), bsz, dtype=torch.long, device=device).scatter_reduce(
            0, self.prompt_of, torch.arange(bsz, device=device), "amin")
        tokens, mask = prompt_tokens[first], prompt_mask[first]  # [U, P]
        # a response token's position continues its prompt's (as get_position_ids_from_padding_mask)
        self.start = prompt_mask.sum(1).to(torch.int)  # [B]
        # the left padding as an additive bias on the scores, [U, 1, P]
        self.prompt_bias = torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill(
            ~mask, float("-inf"))[:, None, :]
        self.prompt_k, self.prompt_v = [], []
        # prefill: each distinct prompt once, under its causal, padding-aware mask
        positions = get_position_ids_from_padding_mask(mask)  # [U, P]
        causal = get_causal_mask_from_padding_mask(mask)[:, None]  # [U, 1, P, P]
        x = plan.embed(tokens)
        cpu = device.type == "cpu"  # attention in fp32 there (_attend)
        for layer in plan.layers:
            q, k, v = _project(layer.attn, layer.sa_norm(x), positions)
            out_dtype = q.dtype
            if cpu:
                q, k, v = _at_least_fp32(q), _at_least_fp32(k), _at_least_fp32(v)
            self.prompt_k.append(k.contiguous())
            self.prompt_v.append(v.contiguous())
            if group > 1:
                k = k.repeat_interleave(group, dim=1)
                v = v.repeat_interleave(group, dim=1)
            with no_autocast(device) if cpu else contextlib.nullcontext():
                a = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=causal)
            a = a.to(out_dtype).transpose(1, 2).reshape(u, plen, -1)
            x = x + layer.sa_scale(layer.attn.output_proj(a))
            x = x + layer.mlp_scale(layer.mlp(layer.mlp_norm(x)))
        self.logits = _head(plan, x[:, -1:])[:, 0][self.prompt_of]  # [B, V]
        self.cache_k = [torch.empty((bsz, n_kv, max_new_tokens, hd), dtype=dtype, device=device)
                        for _ in plan.layers]
        self.cache_v = [torch.empty_like(c) for c in self.cache_k]
        self._layout()

    def _layout(self) -> None:
        """Drops the prompts no row reads any more and places each row among its prompt's rows
        (``slot_r``, ``r_max``). A few host syncs (the counts), at the start and per compaction
        only."""
        active, self.prompt_of = torch.unique(self.prompt_of, return_inverse=True)
        if active.numel() < self.prompt_bias.shape[0]:
            self.prompt_k = [c[active] for c in self.prompt_k]
            self.prompt_v = [c[active] for c in self.prompt_v]
            self.prompt_bias = self.prompt_bias[active]
        counts = torch.bincount(self.prompt_of, minlength=active.numel())
        order = torch.argsort(self.prompt_of, stable=True)
        first_of = counts.cumsum(0) - counts  # [U]: where each prompt's rows start in `order`
        self.slot_r = torch.empty_like(self.prompt_of)
        self.slot_r[order] = (torch.arange(order.numel(), device=order.device)
                              - first_of[self.prompt_of[order]])  # 0 everywhere when r_max == 1
        self.r_max = int(counts.max())
        rows = torch.arange(order.numel(), device=order.device)
        if self.r_max == 1 and not torch.equal(self.prompt_of, rows):  # row order: read directly
            self.prompt_k = [c[self.prompt_of] for c in self.prompt_k]
            self.prompt_v = [c[self.prompt_of] for c in self.prompt_v]
            self.prompt_bias = self.prompt_bias[self.prompt_of]
            self.prompt_of = rows
        # [U * n_kv, 1, P]
        self.bias = self.prompt_bias.repeat_interleave(self.plan.num_kv_heads, 0)

    def keep(self, idx: torch.Tensor) -> None:
        """Narrows the cache to the rows ``idx`` (in that order)."""
        self.start, self.prompt_of = self.start[idx], self.prompt_of[idx]
        self.cache_k = [c[idx] for c in self.cache_k]
        self.cache_v = [c[idx] for c in self.cache_v]
        self._layout()

    def advance(self, tok: torch.Tensor, t: int) -> torch.Tensor:
        """Feeds response token ``t`` of each row (``[b]``); returns the next logits ``[b, V]``."""
        self.logits = self.step(
            self.plan, tok, (self.start + t)[:, None], self.prompt_k, self.prompt_v,
            self.cache_k, self.cache_v, self.bias, self.prompt_of, self.slot_r, self.r_max, t + 1)
        return self.logits


def generate_fast(plans: Sequence[FastPlan], prompt_tokens: torch.Tensor,
                  prompt_mask: torch.Tensor, max_new_tokens: int, pad_id: int,
                  stops: torch.Tensor, seeds: torch.Tensor, *, temperature: float,
                  top_k: Optional[int], top_p: float, compile: bool = False,
                  replace: Optional[torch.Tensor] = None, entropies: bool = False,
                  progress: Optional[Callable[[int], Any]] = None):
    """The fast decoder: the model's own modules in torchtune's order (:class:`_FastCache`, a
    cache each step attends over up to its filled length only; grouped-query heads read their
    shared key/value head in place, never expanded), with finished rows dropped from the batch
    (:data:`_COMPACT_BELOW`). The step is :func:`decode_step`, or with ``compile``
    :func:`compiled_step`'s form of it. Row ``i``'s
    uniforms are ``row_uniforms(seeds[i], t)`` as in the reference decoder, so it draws the
    same tokens.

    With two plans (the token intervention's base and replacement models), position ``t`` of
    row ``i`` is drawn from the second model's logits where ``replace[i, t]`` (``[B, T]``
    bool) and from the first's elsewhere; ``entropies`` also returns the first model's entropy
    at every drawn position; ``progress`` as in :func:`generate`. Returns tokens, log-probs,
    valid mask ``[B, T]``, finished ``[B]`` and the entropies ``[B, T]`` (None unless asked).
    """
    bsz = prompt_tokens.shape[0]
    device = prompt_tokens.device
    step = compiled_step() if compile else decode_step
    caches = [_FastCache(p, prompt_tokens, prompt_mask, max_new_tokens, step) for p in plans]
    uniforms = row_uniforms_table(seeds, max_new_tokens).to(device)  # [B, T] float64
    out = torch.full((bsz, max_new_tokens), pad_id, dtype=torch.long, device=device)
    out_lp = torch.zeros((bsz, max_new_tokens), dtype=torch.float32, device=device)
    ent = torch.zeros((bsz, max_new_tokens), dtype=torch.float32, device=device) if entropies \
        else None
    steps = torch.zeros(bsz, dtype=torch.long, device=device)  # tokens decoded per row
    done = torch.zeros(bsz, dtype=torch.bool, device=device)
    rows = torch.arange(bsz, device=device)  # the original row of each row of the batch
    live = torch.ones(bsz, dtype=torch.bool, device=device)  # not yet stopped, per batch row
    reported = 0  # rows passed to ``progress``
    for t in range(max_new_tokens):
        logits = caches[0].logits
        if len(caches) > 1:
            logits = torch.where(replace[rows, t, None], caches[1].logits.to(logits.dtype), logits)
        tok, lp = draw_token(logits, uniforms[rows, t], temperature, top_k, top_p)
        if ent is not None:
            _, h = logprobs_and_entropy(caches[0].logits, tok, temperature=temperature)
            ent[rows, t] = torch.where(live, h, 0.0)
        tok = torch.where(live, tok, pad_id)
        out[rows, t] = tok
        out_lp[rows, t] = torch.where(live, lp, 0.0)
        steps[rows] += live.long()
        stopped = live & torch.isin(tok, stops)
        done[rows] |= stopped
        live = live & ~stopped
        n_live = int(live.sum())
        last = n_live == 0 or t + 1 == max_new_tokens
        if progress is not None:
            finished = bsz if last else bsz - n_live  # rows dropped earlier count as finished
            progress(finished - reported)
            reported = finished
        if last:
            break
        if n_live <= _COMPACT_BELOW * live.shape[0]:
            keep = live.nonzero().squeeze(-1)
            rows, live, tok = rows[keep], live[keep], tok[keep]
            for c in caches:
                c.keep(keep)
        for c in caches:
            c.advance(tok, t)
    valid = torch.arange(max_new_tokens, device=device) < steps[:, None]
    return out, out_lp, valid, done, ent
