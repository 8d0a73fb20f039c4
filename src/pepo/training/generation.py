"""Batched sampling with a KV cache, temperature, top-k and top-p, for torchtune decoders.

torchtune 0.6.1's ``generate`` has top-k but no top-p and returns raw logits; RL rollouts need
nucleus sampling (the paper samples at temperature 0.6, top-p 0.6) and a per-row stop. Prompts
are left-padded so every row decodes in lock-step through torchtune's KV cache; positions and
the attention mask come from the padding (torchtune's own helpers), so a row's tokens are what
the same prompt alone would give.

The layout ``[left-padded prompt | response]`` is also what :func:`sequence_inputs` builds for
the training forward, so old and new log-probs see exactly the positions the sampler saw.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torchtune.generation import (
    get_causal_mask_from_padding_mask,
    get_position_ids_from_padding_mask,
)
from torchtune.modules.common_utils import local_kv_cache

__all__ = ["Rollouts", "draw_seeds", "filter_logits", "generate", "pad_prompts", "row_uniforms",
           "sequence_inputs"]


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
    key = _mix32(seeds.long())
    hi = _mix32(key ^ _mix32(torch.full_like(key, 2 * step)))
    lo = _mix32(key ^ _mix32(torch.full_like(key, 2 * step + 1)))
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
        batch_size: decode at most this many rows at once (the KV cache grows with it); the
            pieces are merged into one :class:`Rollouts`.
        seeds: one seed per prompt (``[B]`` int64, :func:`draw_seeds`): each row's tokens are
            drawn with its own counter-based uniforms (:func:`row_uniforms`), so a row samples
            the same response whatever batch it is decoded in. The recipe always passes them.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if seeds is not None and (seeds.dim() != 1 or seeds.shape[0] != len(prompts)):
        raise ValueError(f"seeds must be [B]=[{len(prompts)}] (one per prompt), got "
                         f"{list(seeds.shape)}")
    if batch_size is not None and len(prompts) > batch_size:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        parts = [
            generate(model, prompts[i : i + batch_size], max_new_tokens=max_new_tokens,
                     pad_id=pad_id, stop_tokens=stop_tokens, temperature=temperature,
                     top_k=top_k, top_p=top_p, generator=generator,
                     seeds=None if seeds is None else seeds[i : i + batch_size])
            for i in range(0, len(prompts), batch_size)
        ]
        return _cat(parts, pad_id)
    device = next(model.parameters()).device
    prompt_tokens, prompt_mask = pad_prompts(prompts, pad_id, device)
    bsz, plen = prompt_tokens.shape
    total = plen + max_new_tokens
    max_seq_len = getattr(model, "max_seq_len", None)
    if max_seq_len is not None and total > max_seq_len:
        raise ValueError(
            f"prompt length {plen} + max_new_tokens {max_new_tokens} = {total} exceeds the "
            f"model's max_seq_len={max_seq_len}"
        )
    attn_mask, positions = sequence_inputs(prompt_mask, max_new_tokens)  # [B,S,S], [B,S]
    stops = torch.as_tensor(list(stop_tokens), dtype=torch.long, device=device)
    out = torch.full((bsz, max_new_tokens), pad_id, dtype=torch.long, device=device)
    out_lp = torch.zeros((bsz, max_new_tokens), dtype=torch.float32, device=device)
    valid = torch.zeros((bsz, max_new_tokens), dtype=torch.bool, device=device)
    done = torch.zeros(bsz, dtype=torch.bool, device=device)
    dtype = next(model.parameters()).dtype
    was_training = model.training
    model.eval()
    try:
        with local_kv_cache(
            model, batch_size=bsz, device=device, dtype=dtype, decoder_max_seq_len=total
        ):
            logits = model(
                prompt_tokens, input_pos=positions[:, :plen], mask=attn_mask[:, :plen]
            )[:, -1]  # [B, V]
            for t in range(max_new_tokens):
                probs = filter_logits(logits, temperature, top_k, top_p).softmax(-1)
                if seeds is None:
                    tok = torch.multinomial(probs, 1, generator=generator).squeeze(-1)  # [B]
                else:
                    tok = _sample(probs, row_uniforms(seeds, t)).to(device)  # [B]
                out_lp[:, t] = torch.where(done, 0.0, probs.gather(1, tok[:, None]).squeeze(1).log())
                tok = torch.where(done, pad_id, tok)
                out[:, t] = tok
                valid[:, t] = ~done
                done = done | torch.isin(tok, stops)
                if t + 1 == max_new_tokens or bool(done.all()):
                    break
                pos = plen + t
                logits = model(
                    tok[:, None],
                    input_pos=positions[:, pos : pos + 1],
                    mask=attn_mask[:, pos : pos + 1],
                )[:, -1]
    finally:
        model.train(was_training)
    width = int(valid.sum(-1).max())
    return Rollouts(
        prompt_tokens=prompt_tokens,
        prompt_mask=prompt_mask,
        tokens=out[:, :width],
        mask=valid[:, :width],
        finished=done,
        logprobs=out_lp[:, :width],
    )


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
