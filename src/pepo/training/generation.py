"""Batched sampling with a KV cache, temperature, top-k and top-p, for torchtune decoders.

torchtune 0.6.1's ``generate`` has top-k but no top-p and returns raw logits; RL rollouts need
nucleus sampling (the paper samples at temperature 0.6, top-p 0.6) and a per-row stop. Prompts
are left-padded; positions and the attention mask come from the padding (torchtune's own
helpers), so a row's tokens are what the same prompt alone would give.

Two decoders sample the same tokens for the same per-row seeds: the fast one (the default,
:mod:`pepo.training.fast_decoder`) runs the model's own modules with its own KV cache, attending
over the filled part of the cache only, holding and reading each distinct prompt's keys and
values once for all its rollouts (prefix sharing), dropping finished rows from the batch and
running the q/k/v and the MLP's gate/up projections as one product each (for models of at most
256 MiB of parameters); the reference one (here) runs the model's forward through torchtune's KV
cache with every row in lock-step to the end (what the fast one is tested and benchmarked
against, ``benchmarks/bench_decoder.py``). Both draw their tokens with
:mod:`pepo.training.draws`, whose names (:func:`filter_logits`, :func:`row_uniforms`,
:func:`draw_seeds`, ...) import from here too.

The layout ``[left-padded prompt | response]`` is also what :func:`sequence_inputs` builds for
the training forward, so old and new log-probs see exactly the positions the sampler saw.
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
from torchtune.generation import (
    get_causal_mask_from_padding_mask,
    get_position_ids_from_padding_mask,
)
from torchtune.modules.common_utils import local_kv_cache

from pepo.entropy import logprobs_and_entropy
from pepo.training.draws import (
    draw_seeds,
    draw_token,
    filter_logits,
    row_uniforms,
    row_uniforms_table,
)
from pepo.training.fast_decoder import FastPlan, generate_fast
from pepo.training.precision import fp32_head

__all__ = ["DECODERS", "Rollouts", "decode", "draw_seeds", "filter_logits", "generate",
           "pad_prompts", "row_uniforms", "row_uniforms_table", "sequence_inputs"]


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

    @staticmethod
    def empty(device: Optional[torch.device] = None) -> "Rollouts":
        """No rows: what a process whose share of a batch is empty samples (fewer rollouts
        than processes), having taken part in the engine's collectives."""
        def zeros(dtype: torch.dtype, *shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        return Rollouts(zeros(torch.long, 0, 1), zeros(torch.bool, 0, 1), zeros(torch.long, 0, 1),
                        zeros(torch.bool, 0, 1), zeros(torch.bool, 0), zeros(torch.float32, 0, 1))


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
        generator: RNG for the rows' seeds (:func:`draw_seeds`; seed it for reproducible
            rollouts) when no ``seeds`` are given, drawn once for all prompts before any split
            into ``batch_size`` pieces, so that either decoder samples the same tokens from it
            in any batch; an unseeded draw where it is None too.
        batch_size: decode at most this many rows at once (the KV cache grows with it); the
            pieces are merged into one :class:`Rollouts`.
        seeds: one seed per prompt (``[B]`` int64, :func:`draw_seeds`): each row's tokens are
            drawn with its own counter-based uniforms (:func:`row_uniforms`), so a row samples
            the same response whatever batch it is decoded in. The recipe always passes them.
        decoder: ``"fast"`` (the default: :func:`pepo.training.fast_decoder.generate_fast`, its
            own KV cache that attends over the filled part only, one copy of each distinct
            prompt's keys and values for all its rows, finished rows dropped from the batch) or
            ``"reference"``
            (torchtune's KV cache, every row in lock-step to the end: the decoder the fast one is
            tested against). With the same ``seeds`` both sample the same tokens, up to float
            rounding where a row's probabilities sit on a draw's boundary. A model the fast
            decoder cannot read (not a plain torchtune decoder of self-attention layers, or
            FSDP-sharded parameters outside :class:`pepo.training.distributed.unsharded`)
            decodes with the reference one.
        compile: run the fast decoder's step (:func:`pepo.training.fast_decoder.decode_step`)
            through ``torch.compile`` (compiled once per process, for any batch and cache
            length). It fuses the step's small element-wise ops; the first call pays the
            compilation (tens of seconds on a CPU), so it pays off on long runs only.
            ``docs/performance.md`` has the figures.
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
    plan = FastPlan.of(model) if decoder == "fast" else None
    if seeds is None:
        seeds = _seeds(generator, len(prompts))
    if batch_size is not None and len(prompts) > batch_size:
        parts = [
            generate(model, prompts[i : i + batch_size], max_new_tokens=max_new_tokens,
                     pad_id=pad_id, stop_tokens=stop_tokens, temperature=temperature,
                     top_k=top_k, top_p=top_p, generator=generator, decoder=decoder,
                     compile=compile, seeds=seeds[i : i + batch_size],
                     progress=progress)
            for i in range(0, len(prompts), batch_size)
        ]
        return _cat(parts, pad_id)
    prompt_tokens, prompt_mask, out, out_lp, valid, done, _ = decode(
        [model], None if plan is None else [plan], prompts, max_new_tokens=max_new_tokens,
        pad_id=pad_id, stop_tokens=stop_tokens, seeds=seeds, generator=generator,
        compile=compile, temperature=temperature, top_k=top_k, top_p=top_p, progress=progress)
    return Rollouts(prompt_tokens=prompt_tokens, prompt_mask=prompt_mask, tokens=out,
                    mask=valid, finished=done, logprobs=out_lp)


def _seeds(generator: Optional[torch.Generator], n: int) -> torch.Tensor:
    """``n`` rows' seeds from ``generator`` (:func:`draw_seeds`), or unseeded where it is None."""
    if generator is not None:
        return draw_seeds(generator, n)
    return torch.randint(0, 2**31 - 1, (n,))


def decode(models: Sequence[torch.nn.Module], plans: Optional[Sequence[FastPlan]],
           prompts: Sequence[Sequence[int]], *, max_new_tokens: int, pad_id: int,
           stop_tokens: Sequence[int], seeds: Optional[torch.Tensor],
           generator: Optional[torch.Generator], temperature: float, top_k: Optional[int],
           top_p: float, compile: bool = False, replace: Optional[torch.Tensor] = None,
           entropies: bool = False, progress: Optional[Callable[[int], Any]] = None):
    """What :func:`generate` and the token intervention's ``mixed_generate`` share: left-pads
    the prompts, checks every model's ``max_seq_len``, decodes with the models in eval mode
    (the fast decoder with ``plans``, one :meth:`FastPlan.of` per model; the reference decoder
    when ``plans`` is None) and trims the outputs to the longest response. ``replace`` and
    ``entropies`` as in :func:`pepo.training.fast_decoder.generate_fast`, ``compile`` and
    ``progress`` as in :func:`generate` (``compile`` applies to the fast decoder); without
    ``seeds`` the rows' seeds are drawn from ``generator``. Returns prompt tokens and mask
    ``[B, P]``, tokens, log-probs and valid mask ``[B, T]``, finished ``[B]`` and the entropies
    (None unless asked)."""
    device = next(models[0].parameters()).device
    if seeds is None:
        seeds = _seeds(generator, len(prompts))
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
            out, out_lp, valid, done, ent = generate_fast(
                plans, prompt_tokens, prompt_mask, max_new_tokens, pad_id, stops, seeds,
                compile=compile, **sample)
        else:
            out, out_lp, valid, done, ent = _generate_reference(
                models, prompt_tokens, prompt_mask, max_new_tokens, pad_id, stops, seeds,
                **sample)
    finally:
        for m, mode in zip(models, modes):
            m.train(mode)
    width = int(valid.sum(-1).max())
    return (prompt_tokens, prompt_mask, out[:, :width], out_lp[:, :width], valid[:, :width],
            done, None if ent is None else ent[:, :width])


def _generate_reference(models, prompt_tokens, prompt_mask, max_new_tokens, pad_id, stops,
                        seeds, *, temperature, top_k, top_p, replace=None,
                        entropies=False, progress=None):
    """The decoder through torchtune's KV caches (``local_kv_cache``): every row decodes in
    lock-step until all have stopped, attending over the whole preallocated cache. One or two
    models, ``replace`` and ``entropies`` as in
    :func:`pepo.training.fast_decoder.generate_fast`. Returns tokens,
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
            dtype = next(m.parameters()).dtype
            if torch.is_autocast_enabled(device.type) and dtype.is_floating_point:
                dtype = torch.get_autocast_dtype(device.type)  # k/v of autocast's products
            stack.enter_context(local_kv_cache(
                m, batch_size=bsz, device=device, dtype=dtype,
                decoder_max_seq_len=plen + max_new_tokens))
            stack.enter_context(fp32_head(m))  # fp32 logits under autocast, as the trainer's
        logits = [m(prompt_tokens, input_pos=positions[:, :plen],
                    mask=attn_mask[:, :plen])[:, -1] for m in models]  # each [B, V]
        for t in range(max_new_tokens):
            z = logits[0] if len(models) == 1 else torch.where(
                replace[:, t, None], logits[1].to(logits[0].dtype), logits[0])
            tok, lp = draw_token(z, row_uniforms(seeds, t), temperature, top_k, top_p)
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
