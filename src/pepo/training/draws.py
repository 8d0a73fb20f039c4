"""Drawing one token per row: the sampling filters (temperature, top-k, top-p), counter-based
per-row uniforms, and the inverse-CDF draw both in-process decoders
(:mod:`pepo.training.generation`, :mod:`pepo.training.fast_decoder`) sample with.

A row's uniforms are a function of its seed and the decoding step only, so a row samples the
same tokens whatever batch, decoder or process decodes it. Without seeds, the decoders draw the
rows' seeds from the caller's generator (:func:`draw_seeds`), once for the whole batch.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["draw_seeds", "draw_token", "filter_logits", "inverse_cdf_sample", "row_uniforms",
           "row_uniforms_table"]


def filter_logits(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    top_p: float = 1.0,
) -> torch.Tensor:
    """Temperature-scaled fp32 logits with tokens outside the top-k / nucleus set to ``-inf``.

    Top-k keeps every token whose logit is at least the k-th largest, so more than k where
    logits tie there (as Hugging Face's ``TopKLogitsWarper`` does). Top-p keeps the smallest set
    of most likely tokens whose probability reaches ``top_p`` (always at least the most likely
    one), after top-k, as Hugging Face and vLLM do.

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

    Seeds are meant to be :func:`draw_seeds`' (random in ``[0, 2^31 - 1)``). Small integers
    are not: the seed and the step go through the same hash, so seed ``2a`` at step ``b`` and
    seed ``2b`` at step ``a`` share the top 27 bits of their uniforms (rows seeded 0, 1, 2, ...
    draw correlated streams). The hash is kept as it is because it fixes every recorded run's
    draws.

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
    hi = _mix32(_nonzero(key ^ _mix32(2 * steps), steps, 0))
    lo = _mix32(_nonzero(key ^ _mix32(2 * steps + 1), steps, 1))
    return ((hi >> 5) * 2**26 + (lo >> 6)).double() / 2.0**53


def _nonzero(x: torch.Tensor, steps: torch.Tensor, half: int) -> torch.Tensor:
    """``x = key ^ _mix32(2 * step + half)`` with its zeros replaced by a hash of the step.

    ``x`` is 0 exactly when the seed equals ``2 * step + half`` (``_mix32`` is a bijection that
    fixes 0), so without this, seed ``2t`` would draw ``u < 2^-27`` at step ``t``: the lowest
    token id of non-zero probability (``"!"``, or an end-of-text token), for every even seed below
    twice the response length. The replacement changes no other (seed, step) pair's draw."""
    return torch.where(x == 0, _mix32((2 * steps + half) ^ 0x9E3779B9) | 1, x)


def draw_seeds(generator: torch.Generator, n: int) -> torch.Tensor:
    """``n`` per-rollout sampling seeds from ``generator`` (``[n]`` int64, on the CPU)."""
    return torch.randint(0, 2**31 - 1, (n,), generator=generator,
                         device=generator.device).cpu()


def inverse_cdf_sample(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw of one token per row with uniforms ``u``; tokens of probability 0 are
    never drawn. Shape: probs ``[B, V]``, u ``[B]`` -> ``[B]`` int64."""
    cdf = probs.double().cumsum(-1)  # [B, V]
    x = (u.to(cdf.device) * cdf[:, -1])[:, None]  # [B, 1]
    return torch.searchsorted(cdf, x, right=True).squeeze(-1).clamp_max(probs.shape[-1] - 1)


def draw_token(logits: torch.Tensor, u: torch.Tensor, temperature: float,
               top_k: Optional[int], top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row from ``logits`` ``[b, V]`` after the filters, and its log-probability
    under the filtered distribution: the inverse-CDF draw with the row uniforms ``u`` ``[b]``
    (:func:`row_uniforms`)."""
    probs = filter_logits(logits, temperature, top_k, top_p).softmax(-1)
    tok = inverse_cdf_sample(probs, u).to(logits.device)  # [b]
    return tok, probs.gather(1, tok[:, None]).squeeze(1).log()
