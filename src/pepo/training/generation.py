"""Batched sampling with a KV cache, temperature, top-k and top-p, for torchtune decoders.

torchtune 0.6.1's ``generate`` has top-k but no top-p and returns raw logits; RL rollouts need
nucleus sampling (the paper samples at temperature 0.6, top-p 0.6) and a per-row stop. Prompts
are left-padded; positions and the attention mask come from the padding (torchtune's own
helpers), so a row's tokens are what the same prompt alone would give.

Two decoders sample the same tokens for the same per-row seeds: the fast one (the default) runs
the model's own modules with its own KV cache, attending over the filled part of the cache only,
holding and reading each distinct prompt's keys and values once for all its rollouts (prefix
sharing), dropping finished rows from the batch and running the q/k/v and the MLP's gate/up
projections as one product each; the reference one runs the model's forward through
torchtune's KV cache with every row in lock-step to the end (what the fast one is tested and
benchmarked against, ``benchmarks/bench_decoder.py``).

The layout ``[left-padded prompt | response]`` is also what :func:`sequence_inputs` builds for
the training forward, so old and new log-probs see exactly the positions the sampler saw.
"""

from __future__ import annotations

import functools
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
from torchtune.generation import (
    get_causal_mask_from_padding_mask,
    get_position_ids_from_padding_mask,
)
from torchtune.modules.common_utils import local_kv_cache

from pepo.entropy import logprobs_and_entropy

__all__ = ["DECODERS", "Rollouts", "draw_seeds", "filter_logits", "generate", "pad_prompts",
           "row_uniforms", "row_uniforms_table", "sequence_inputs"]


@dataclass
class Rollouts:
    """Sampled responses of one batch.

    Attributes:
        prompt_tokens: ``[B, P]`` left-padded prompts.
        prompt_mask: ``[B, P]`` bool, True on real prompt tokens.
        tokens: ``[B, T]`` responses, right-padded with the pad id.
        mask: ``[B, T]`` bool, True on generated tokens up to and including the stop token.
        finished: ``[B]`` bool, True where a stop token ended the response (False: truncated).
        logprobs: ``[B, T]`` fp32 log-probability of each sampled token under the distribution
            it was drawn from (temperature-scaled, after top-k / top-p, renormalised), 0 at
            padding; the rollout engine's view of the behaviour policy (None if not recorded).
    """

    prompt_tokens: torch.Tensor
    prompt_mask: torch.Tensor
    tokens: torch.Tensor
    mask: torch.Tensor
    finished: torch.Tensor
    logprobs: Optional[torch.Tensor] = None


def pad_prompts(
    prompts: Sequence[Sequence[int]], pad_id: int, device: Optional[torch.device] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pads token lists into ``[B, P]`` ids and a ``[B, P]`` bool mask of real tokens."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.bool)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.as_tensor(list(p), dtype=torch.long)
        mask[i, width - len(p) :] = True
    return ids.to(device), mask.to(device)


def filter_logits(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    top_p: float = 1.0,
) -> torch.Tensor:
    """Temperature-scaled fp32 logits with tokens outside the top-k / nucleus set to ``-inf``.

    Top-p keeps the smallest set of most likely tokens whose probability reaches ``top_p``
    (always at least the most likely one), after top-k, as Hugging Face and vLLM do.

    Shape:
        logits: ``[B, V]`` → ``[B, V]``.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1 or None, got {top_k}")
    x = logits.float() / temperature
    if top_k is not None and top_k < x.shape[-1]:
        kth = torch.topk(x, top_k, dim=-1).values[:, -1:]  # [B, 1]
        x = torch.where(x < kth, float("-inf"), x)
    if top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        probs = sorted_x.softmax(-1)
        # drop a token when the mass strictly before it already reaches top_p
        drop_sorted = (probs.cumsum(-1) - probs) >= top_p  # [B, V]
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = torch.where(drop, float("-inf"), x)
    return x


_M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (lowbias32, C. Wellons) on int64 tensors holding uint32 values.

    The products can pass 2^63 and wrap; their low 32 bits, which are all that is kept, are
    exact either way.
    """
    x = x & _M32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def row_uniforms(seeds: torch.Tensor, step: int) -> torch.Tensor:
    """One uniform number in ``[0, 1)`` per row for decoding step ``step``, a function of the
    row's seed and the step only (counter-based, 53 bits).

    A row's draws therefore do not depend on which other rows share its batch, on how the batch
    is split, or on which process decodes it: what makes rollouts independent of the number of
    processes and of ``batch_size``.

    Shape: seeds ``[B]`` int64 in ``[0, 2^31)``; returns ``[B]`` float64.
    """
    return _uniforms(seeds.long()[:, None], torch.tensor([step]))[:, 0]


def row_uniforms_table(seeds: torch.Tensor, steps: int) -> torch.Tensor:
    """:func:`row_uniforms` for steps ``0 .. steps-1`` at once: ``[B, steps]`` float64, column
    ``t`` equal to ``row_uniforms(seeds, t)``."""
    return _uniforms(seeds.long()[:, None], torch.arange(steps))


def _uniforms(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """``[B, 1]`` seeds and ``[T]`` steps to ``[B, T]`` uniforms (:func:`row_uniforms`)."""
    key = _mix32(seeds)
    steps = steps.to(seeds.device, torch.long)[None, :]
    hi = _mix32(key ^ _mix32(2 * steps))
    lo = _mix32(key ^ _mix32(2 * steps + 1))
    return ((hi >> 5) * 2**26 + (lo >> 6)).double() / 2.0**53


def draw_seeds(generator: torch.Generator, n: int) -> torch.Tensor:
    """``n`` per-rollout sampling seeds from ``generator`` (``[n]`` int64, on the CPU)."""
    return torch.randint(0, 2**31 - 1, (n,), generator=generator,
                         device=generator.device).cpu()


def _sample(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw of one token per row with uniforms ``u``; tokens of probability 0 are
    never drawn. Shape: probs ``[B, V]``, u ``[B]`` -> ``[B]`` int64."""
    cdf = probs.double().cumsum(-1)  # [B, V]
    x = (u.to(cdf.device) * cdf[:, -1])[:, None]  # [B, 1]
    return torch.searchsorted(cdf, x, right=True).squeeze(-1).clamp_max(probs.shape[-1] - 1)


def sequence_inputs(
    prompt_mask: torch.Tensor, response_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention mask ``[B, S, S]`` and positions ``[B, S]`` for ``[prompt | response]`` rows.

    Left padding is masked out of every key and positions count real tokens only, as in
    torchtune's ``generate``.
    """
    full = torch.nn.functional.pad(prompt_mask, (0, response_len), value=True)  # [B, S]
    return get_causal_mask_from_padding_mask(full), get_position_ids_from_padding_mask(full)


DECODERS = ("fast", "reference")


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    pad_id: int,
    stop_tokens: Sequence[int],
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    top_p: float = 1.0,
    generator: Optional[torch.Generator] = None,
    batch_size: Optional[int] = None,
    seeds: Optional[torch.Tensor] = None,
    decoder: str = "fast",
    compile: bool = False,
    progress: Optional[Callable[[int], Any]] = None,
) -> Rollouts:
    """Samples one response per prompt (repeat prompts for several samples).

    Decoding stops for a row at its first stop token (kept in the response and in ``mask``) or
    after ``max_new_tokens``; the loop ends when every row has stopped.

    Args:
        model: a torchtune ``TransformerDecoder`` without KV caches set up.
        prompts: token id lists.
        max_new_tokens: response length limit.
        pad_id: padding id.
        stop_tokens: ids that end a response.
        temperature, top_k, top_p: sampling filters (:func:`filter_logits`).
        generator: RNG for the draws (seed it for reproducible rollouts), when no ``seeds``.
            The fast decoder draws each row's seed from it (:func:`draw_seeds`); the reference
            decoder draws the tokens from it with ``torch.multinomial``.
        batch_size: decode at most this many rows at once (the KV cache grows with it); the
            pieces are merged into one :class:`Rollouts`.
        seeds: one seed per prompt (``[B]`` int64, :func:`draw_seeds`): each row's tokens are
            drawn with its own counter-based uniforms (:func:`row_uniforms`), so a row samples
            the same response whatever batch it is decoded in. The recipe always passes them.
        decoder: ``"fast"`` (the default: :func:`_generate_fast`, its own KV cache that attends
            over the filled part only, one copy of each distinct prompt's keys and values for
            all its rows, finished rows dropped from the batch) or ``"reference"``
            (torchtune's KV cache, every row in lock-step to the end: the decoder the fast one is
            tested against). With the same ``seeds`` both sample the same tokens, up to float
            rounding where a row's probabilities sit on a draw's boundary. A model the fast
            decoder cannot read (not a plain torchtune decoder of self-attention layers, or
            FSDP-sharded parameters outside :class:`pepo.training.distributed.unsharded`)
            decodes with the reference one.
        compile: run the fast decoder's step (:func:`_decode_step`) through ``torch.compile``
            (compiled once per process, for any batch and cache length). It fuses the step's
            small element-wise ops; the first call pays the compilation (tens of seconds on a
            CPU), so it pays off on long runs only. ``docs/performance.md`` has the figures.
        progress: called with the number of rows that finished (a stop token or
            ``max_new_tokens``) since its last call, as rows finish; the calls add up to
            ``len(prompts)``. For progress bars (the recipe's validation, ``pepo_eval``).
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if decoder not in DECODERS:
        raise ValueError(f"decoder must be one of {list(DECODERS)}, got {decoder!r}")
    if seeds is not None and (seeds.dim() != 1 or seeds.shape[0] != len(prompts)):
        raise ValueError(f"seeds must be [B]=[{len(prompts)}] (one per prompt), got "
                         f"{list(seeds.shape)}")
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    plan = _FastPlan.of(model) if decoder == "fast" else None
    if plan is not None and seeds is None:
        seeds = (draw_seeds(generator, len(prompts)) if generator is not None
                 else torch.randint(0, 2**31 - 1, (len(prompts),)))
    if batch_size is not None and len(prompts) > batch_size:
        parts = [
            generate(model, prompts[i : i + batch_size], max_new_tokens=max_new_tokens,
                     pad_id=pad_id, stop_tokens=stop_tokens, temperature=temperature,
                     top_k=top_k, top_p=top_p, generator=generator, decoder=decoder,
                     compile=compile, seeds=None if seeds is None else seeds[i : i + batch_size],
                     progress=progress)
            for i in range(0, len(prompts), batch_size)
        ]
        return _cat(parts, pad_id)
    prompt_tokens, prompt_mask, out, out_lp, valid, done, _ = _decode(
        [model], None if plan is None else [plan], prompts, max_new_tokens=max_new_tokens,
        pad_id=pad_id, stop_tokens=stop_tokens, seeds=seeds, generator=generator,
        step=_compiled_step() if compile else _decode_step, temperature=temperature,
        top_k=top_k, top_p=top_p, progress=progress)
    return Rollouts(prompt_tokens=prompt_tokens, prompt_mask=prompt_mask, tokens=out,
                    mask=valid, finished=done, logprobs=out_lp)


def _decode(models, plans, prompts, *, max_new_tokens, pad_id, stop_tokens, seeds, generator,
            step, temperature, top_k, top_p, replace=None, entropies=False, progress=None):
    """What :func:`generate` and the token intervention's ``mixed_generate`` share: left-pads
    the prompts, checks every model's ``max_seq_len``, decodes with the models in eval mode
    (the fast decoder with ``plans``, one per model; the reference decoder when ``plans`` is
    None) and trims the outputs to the longest response. ``replace`` and ``entropies`` as in
    :func:`_generate_fast`, ``progress`` as in :func:`generate`. Returns prompt tokens and mask
    ``[B, P]``, tokens, log-probs and valid mask ``[B, T]``, finished ``[B]`` and the entropies
    (None unless asked)."""
    device = next(models[0].parameters()).device
    prompt_tokens, prompt_mask = pad_prompts(prompts, pad_id, device)
    plen = prompt_tokens.shape[1]
    total = plen + max_new_tokens
    for m in models:
        max_seq_len = getattr(m, "max_seq_len", None)
        if max_seq_len is not None and total > max_seq_len:
            raise ValueError(
                f"prompt length {plen} + max_new_tokens {max_new_tokens} = {total} exceeds the "
                f"model's max_seq_len={max_seq_len}"
            )
    stops = torch.as_tensor(list(stop_tokens), dtype=torch.long, device=device)
    sample = dict(temperature=temperature, top_k=top_k, top_p=top_p, replace=replace,
                  entropies=entropies, progress=progress)
    modes = [m.training for m in models]
    try:
        for m in models:
            m.eval()
        if plans is not None:
            out, out_lp, valid, done, ent = _generate_fast(
                plans, prompt_tokens, prompt_mask, max_new_tokens, pad_id, stops, seeds,
                step=step, **sample)
        else:
            out, out_lp, valid, done, ent = _generate_reference(
                models, prompt_tokens, prompt_mask, max_new_tokens, pad_id, stops, seeds,
                generator, **sample)
    finally:
        for m, mode in zip(models, modes):
            m.train(mode)
    width = int(valid.sum(-1).max())
    return (prompt_tokens, prompt_mask, out[:, :width], out_lp[:, :width], valid[:, :width],
            done, None if ent is None else ent[:, :width])


def _draw(logits: torch.Tensor, u: Optional[torch.Tensor], generator: Optional[torch.Generator],
          temperature: float, top_k: Optional[int], top_p: float
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row from ``logits`` ``[b, V]`` after the filters, and its log-probability
    under the filtered distribution: inverse-CDF with the uniforms ``u`` ``[b]``, or
    ``torch.multinomial`` with ``generator`` when ``u`` is None."""
    probs = filter_logits(logits, temperature, top_k, top_p).softmax(-1)
    if u is None:
        tok = torch.multinomial(probs, 1, generator=generator).squeeze(-1)  # [b]
    else:
        tok = _sample(probs, u).to(logits.device)  # [b]
    return tok, probs.gather(1, tok[:, None]).squeeze(1).log()


def _generate_reference(models, prompt_tokens, prompt_mask, max_new_tokens, pad_id, stops,
                        seeds, generator, *, temperature, top_k, top_p, replace=None,
                        entropies=False, progress=None):
    """The decoder through torchtune's KV caches (``local_kv_cache``): every row decodes in
    lock-step until all have stopped, attending over the whole preallocated cache. One or two
    models, ``replace`` and ``entropies`` as in :func:`_generate_fast`. Returns tokens,
    log-probs, valid mask ``[B, T]``, finished ``[B]`` and the entropies (or None)."""
    bsz, plen = prompt_tokens.shape
    device = prompt_tokens.device
    attn_mask, positions = sequence_inputs(prompt_mask, max_new_tokens)  # [B,S,S], [B,S]
    out = torch.full((bsz, max_new_tokens), pad_id, dtype=torch.long, device=device)
    out_lp = torch.zeros((bsz, max_new_tokens), dtype=torch.float32, device=device)
    ent = torch.zeros((bsz, max_new_tokens), dtype=torch.float32, device=device) if entropies \
        else None
    valid = torch.zeros((bsz, max_new_tokens), dtype=torch.bool, device=device)
    done = torch.zeros(bsz, dtype=torch.bool, device=device)
    reported = 0  # rows passed to ``progress``
    with ExitStack() as stack:
        for m in models:
            stack.enter_context(local_kv_cache(
                m, batch_size=bsz, device=device, dtype=next(m.parameters()).dtype,
                decoder_max_seq_len=plen + max_new_tokens))
        logits = [m(prompt_tokens, input_pos=positions[:, :plen],
                    mask=attn_mask[:, :plen])[:, -1] for m in models]  # each [B, V]
        for t in range(max_new_tokens):
            z = logits[0] if len(models) == 1 else torch.where(
                replace[:, t, None], logits[1].to(logits[0].dtype), logits[0])
            u = None if seeds is None else row_uniforms(seeds, t)
            tok, lp = _draw(z, u, generator, temperature, top_k, top_p)
            if ent is not None:
                _, h = logprobs_and_entropy(logits[0].float(), tok, temperature=temperature)
                ent[:, t] = torch.where(done, 0.0, h)
            out_lp[:, t] = torch.where(done, 0.0, lp)
            tok = torch.where(done, pad_id, tok)
            out[:, t] = tok
            valid[:, t] = ~done
            done = done | torch.isin(tok, stops)
            last = t + 1 == max_new_tokens or bool(done.all())
            if progress is not None:
                finished = bsz if last else int(done.sum())
                progress(finished - reported)
                reported = finished
            if last:
                break
            pos = plen + t
            logits = [m(tok[:, None], input_pos=positions[:, pos : pos + 1],
                        mask=attn_mask[:, pos : pos + 1])[:, -1] for m in models]
    return out, out_lp, valid, done, ent


@dataclass
class _FastPlan:
    """A torchtune decoder read as the modules :func:`_generate_fast` calls in its own order:
    ``layers`` are its ``TransformerSelfAttentionLayer``s (unwrapped from activation
    checkpointing), whose norms, attention projections and MLP the decoder calls one by one.

    ``fused`` holds, per layer, the projections the decode step runs as one matrix product
    (:class:`_Fused`), and ``rope`` how it applies the rotary embedding (:func:`_rope_tables`).
    Fused weights are copies: a plan is a snapshot of the model's weights, built per
    :func:`generate` call.
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

    @classmethod
    def of(cls, model: torch.nn.Module) -> Optional["_FastPlan"]:
        """The plan, or None for a model whose forward the fast decoder cannot reproduce."""
        from torchtune.modules import (MultiHeadAttention, TransformerDecoder,
                                       TransformerSelfAttentionLayer)

        if type(model) is not TransformerDecoder or model.output_hidden_states:
            return None
        if model.caches_are_setup() or _has_sharded_parameters(model):
            return None
        layers = [getattr(layer, "_checkpoint_wrapped_module", layer) for layer in model.layers]
        shape = None
        for layer in layers:
            attn = getattr(layer, "attn", None)
            if type(layer) is not TransformerSelfAttentionLayer or type(attn) is not MultiHeadAttention:
                return None
            if shape not in (None, (attn.num_heads, attn.num_kv_heads, attn.head_dim)):
                return None
            shape = (attn.num_heads, attn.num_kv_heads, attn.head_dim)
        fuse = sum(p.numel() * p.element_size() for p in model.parameters()) <= _FUSE_MAX_BYTES
        return cls(model.tok_embeddings, layers, model.norm, model.output, *shape,
                   fused=[_Fused.of(layer, fuse) for layer in layers],
                   rope=_rope_kind([layer.attn.pos_embeddings for layer in layers]))


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


def _rope_tables(plan: _FastPlan, pos: torch.Tensor, dtype: torch.dtype):
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


def _rope(plan: _FastPlan, attn, x: torch.Tensor, tables) -> torch.Tensor:
    """The rotary embedding of ``x`` ``[b, H, h_d]`` (query and key heads side by side: every
    head is rotated alike), with the element-wise ops of the module's forward."""
    if plan.rope == "half":
        cos, sin = tables
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


def _qkv(plan: _FastPlan, attn, f: _Fused, h: torch.Tensor, tables):
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


def _decode_step(plan: _FastPlan, tok: torch.Tensor, pos: torch.Tensor, prompt_k: list,
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
    n_kv, hd = plan.num_kv_heads, plan.head_dim
    group = plan.num_heads // n_kv
    u, plen = prompt_k[0].shape[0], prompt_k[0].shape[2]
    shared = r_max > 1  # else the prompt cache is in row order (slot_u = 0..b-1, slot_r = 0)
    x = plan.embed(tok)  # [b, d]
    tables = _rope_tables(plan, pos, x.dtype)
    for layer, f, pk, pv, ck, cv in zip(plan.layers, plan.fused, prompt_k, prompt_v, cache_k,
                                        cache_v):
        q, k, v = _qkv(plan, layer.attn, f, layer.sa_norm(x), tables)
        ck[:, :, n - 1 : n] = k[:, :, None]
        cv[:, :, n - 1 : n] = v[:, :, None]
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
                           ck[:, :, :n].transpose(-1, -2).reshape(b * n_kv, hd, n)) * hd ** -0.5
        w = torch.cat([s_prompt.reshape(b * n_kv, group, plen), s_resp], -1).softmax(-1)
        if shared:
            w_blocks = w.new_zeros(u, n_kv, r_max, group, plen)
            w_blocks[slot_u, :, slot_r] = w[..., :plen].reshape(b, n_kv, group, plen)
            a = torch.bmm(w_blocks.view(u * n_kv, r_max * group, plen),
                          pv.reshape(u * n_kv, plen, hd))
            a = a.view(u, n_kv, r_max, group, hd)[slot_u, :, slot_r].reshape(b * n_kv, group, hd)
        else:
            a = torch.bmm(w[..., :plen], pv.reshape(b * n_kv, plen, hd))
        a = a + torch.bmm(w[..., plen:], cv[:, :, :n].reshape(b * n_kv, n, hd))
        x = x + layer.sa_scale(layer.attn.output_proj(a.reshape(b, -1)))
        x = x + layer.mlp_scale(_mlp(layer.mlp, f, layer.mlp_norm(x)))
    return plan.output(plan.norm(x)).float()


@functools.cache
def _compiled_step() -> Callable:
    """:func:`_decode_step` through ``torch.compile`` (dynamic shapes: the batch shrinks and the
    cache fills as decoding goes on), built on first use. The first two steps, and steps with
    at most two rows or one prompt left, run eagerly: a size of 0 or 1 would make the compiler
    specialise on it and compile the step again for each such value. Sizes that happen to be
    equal (64 rows and a 64-token limit) are not taken to be one symbol ("duck sizing"), which
    would compile the step again once they differ."""
    from torch.fx.experimental import _config as shape_config

    compiled = torch.compile(_decode_step, dynamic=True)

    def step(plan, tok, pos, prompt_k, *rest):
        n = rest[-1]
        if n <= 2 or tok.shape[0] <= 2 or prompt_k[0].shape[0] <= 1:
            return _decode_step(plan, tok, pos, prompt_k, *rest)
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

    def __init__(self, plan: _FastPlan, prompt_tokens: torch.Tensor, prompt_mask: torch.Tensor,
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
        for layer in plan.layers:
            q, k, v = _project(layer.attn, layer.sa_norm(x), positions)
            self.prompt_k.append(k.contiguous())
            self.prompt_v.append(v.contiguous())
            if group > 1:
                k = k.repeat_interleave(group, dim=1)
                v = v.repeat_interleave(group, dim=1)
            a = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=causal)
            x = x + layer.sa_scale(layer.attn.output_proj(a.transpose(1, 2).reshape(u, plen, -1)))
            x = x + layer.mlp_scale(layer.mlp(layer.mlp_norm(x)))
        self.logits = plan.output(plan.norm(x[:, -1:])).float()[:, 0][self.prompt_of]  # [B, V]
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
        self.bias = self.prompt_bias.repeat_interleave(self.plan.num_kv_heads, 0)  # [U * n_kv, 1, P]

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


def _generate_fast(plans: Sequence[_FastPlan], prompt_tokens, prompt_mask, max_new_tokens,
                   pad_id, stops, seeds, *, step, temperature, top_k, top_p,
                   replace: Optional[torch.Tensor] = None, entropies: bool = False,
                   progress: Optional[Callable[[int], Any]] = None):
    """The fast decoder: the model's own modules in torchtune's order (:class:`_FastCache`, a
    cache each step attends over up to its filled length only; grouped-query heads read their
    shared key/value head in place, never expanded), with finished rows dropped from the batch
    (:data:`_COMPACT_BELOW`). ``step`` is :func:`_decode_step` or its compiled form. Row ``i``'s
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
        tok, lp = _draw(logits, uniforms[rows, t], None, temperature, top_k, top_p)
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


def _cat(parts: Sequence[Rollouts], pad_id: int) -> Rollouts:
    """Rollouts of several generate calls as one batch (prompts re-left-padded, responses
    re-right-padded)."""
    plen = max(r.prompt_tokens.shape[1] for r in parts)
    tlen = max(r.tokens.shape[1] for r in parts)
    pad = torch.nn.functional.pad

    def left(x: torch.Tensor, value) -> torch.Tensor:
        return pad(x, (plen - x.shape[1], 0), value=value)

    def right(x: torch.Tensor, value) -> torch.Tensor:
        return pad(x, (0, tlen - x.shape[1]), value=value)

    return Rollouts(
        prompt_tokens=torch.cat([left(r.prompt_tokens, pad_id) for r in parts]),
        prompt_mask=torch.cat([left(r.prompt_mask, False) for r in parts]),
        tokens=torch.cat([right(r.tokens, pad_id) for r in parts]),
        mask=torch.cat([right(r.mask, False) for r in parts]),
        finished=torch.cat([r.finished for r in parts]),
        logprobs=(torch.cat([right(r.logprobs, 0.0) for r in parts])
                  if all(r.logprobs is not None for r in parts) else None),
    )
