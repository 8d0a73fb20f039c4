"""Memory-safe log-probs and entropies of the taken tokens.

One forward of the rollout policy gives both ``old_logprobs`` and the entropies that weighting
needs, so weighting costs no extra model pass. With a vocabulary of 151,936 (Qwen3) the full
``[B, T, V]`` fp32 softmax of a 4k-token batch is tens of GB; these functions never hold more
than one ``[chunk_size, V]`` slice of it:

* :func:`logprobs_and_entropy` takes the logits the model already produced and processes them
  ``chunk_size`` rows at a time in fp32. Its backward recomputes the softmax per chunk
  (``∂ log p_y / ∂ z = (onehot_y - softmax(z)) / τ``) instead of saving it.
* :func:`logprobs_and_entropy_from_hidden` takes the final hidden states and the output
  projection instead, so the logits themselves are never materialised either; the gradient
  flows to the hidden states and the weight, again chunk by chunk.

Both make their statistics in one pass with a running maximum (``logsumexp = m + log s``,
``H = log s - t / s``). On a CPU each chunk also takes the vocabulary 4,096 columns at a time,
so its temporaries are ``[chunk_size, 4096]``, reused block after block, and the softmax's
exponents are clamped at -80 (the CPU's ``exp`` is slow where its result would be denormal);
elsewhere the vocabulary is one block.

Log-probs carry gradient; entropies are returned detached (they are importance signals, not
part of the objective). ``-inf`` logits (masked vocabulary entries) are safe: they have
probability 0, contribute 0 to the entropy and get gradient 0. A target whose logit is ``-inf``
gets the lowest finite fp32 log-prob instead of ``-inf``, a constant: no gradient flows from it.
A row of all ``-inf`` has no distribution, nor has a row with a NaN or ``+inf`` logit (including
logits that overflow after dividing by the temperature): its log-prob and entropy are NaN,
never a finite stand-in, so a non-finite check downstream sees it.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional

import torch

from pepo import _checks

__all__ = ["logprobs_and_entropy", "logprobs_and_entropy_from_hidden"]

_LOGPROB_FLOOR = torch.finfo(torch.float32).min


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for fp16/bf16/fp32 inputs; fp64 stays fp64 (for gradcheck and references)."""
    return torch.promote_types(dtype, torch.float32)


def _autocast_dtype(device_type: str) -> Optional[torch.dtype]:
    """The dtype ``torch.autocast`` casts matmuls to on ``device_type`` here, None when it is
    off (torch 1.13's functions and torch 2's alike)."""
    try:
        on = torch.is_autocast_enabled(device_type)  # torch >= 2.4
        return torch.get_autocast_dtype(device_type) if on else None
    except TypeError:  # torch < 2.4: per-device functions
        if device_type == "cpu":
            return torch.get_autocast_cpu_dtype() if torch.is_autocast_cpu_enabled() else None
        if device_type == "cuda":
            return torch.get_autocast_gpu_dtype() if torch.is_autocast_enabled() else None
        return None


def _no_autocast(device_type: str) -> Any:
    """A context with autocast off on ``device_type``: the statistics stay in fp32 (CPU autocast
    would run ``linalg.vecdot`` in bf16), and the matmuls run in the dtype chosen on entry."""
    if device_type in ("cpu", "cuda"):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def _chunked(
    rows: torch.Tensor,
    chunk: int,
    stats: Callable[[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Runs ``stats(start, end)`` over row chunks of ``rows`` and stacks the three results."""
    n = rows.shape[0]
    out = [rows.new_empty(n, dtype=_compute_dtype(rows.dtype)) for _ in range(3)]
    for s in range(0, n, chunk):
        e = min(s + chunk, n)
        out[0][s:e], out[1][s:e], out[2][s:e] = stats(s, e)
    return out[0], out[1], out[2]


class _FromLogits(torch.autograd.Function):
    """Each chunk's statistics in fp32 (:func:`_blocked_stats`), the vocabulary in blocks of
    ``_CPU_VOCAB_BLOCK`` columns on a CPU and as one block elsewhere; the backward recomputes
    each block's softmax (:func:`_softmax_grad_`) instead of saving it."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, chunk: int,  # type: ignore[override]
                temperature: float):
        blocks = _vocab_blocks(logits.device, logits.shape[-1])
        dt = _compute_dtype(logits.dtype)
        with _no_autocast(logits.device.type):
            lp, ent, lse = _chunked(logits, chunk, lambda s, e: _blocked_stats(
                lambda a, b: _logits_block(logits[s:e], a, b, temperature), targets[s:e],
                blocks, dt))
        ctx.save_for_backward(logits, targets, lse, lp)
        ctx.chunk, ctx.temperature, ctx.blocks = chunk, temperature, blocks
        ctx.mark_non_differentiable(ent)
        return lp, ent

    @staticmethod
    def backward(ctx: Any, g_lp: torch.Tensor, g_ent: Optional[torch.Tensor]):  # type: ignore[override]
        logits, targets, lse, lp = ctx.saved_tensors
        grad = torch.empty_like(logits)
        g_lp = _unfloored(g_lp.to(lse.dtype), lp)
        with _no_autocast(logits.device.type):
            for s in range(0, logits.shape[0], ctx.chunk):
                e = min(s + ctx.chunk, logits.shape[0])
                for a, b in ctx.blocks:
                    grad[s:e, a:b] = _softmax_grad_(
                        _logits_block(logits[s:e], a, b, ctx.temperature), targets[s:e],
                        lse[s:e], g_lp[s:e], a, b, ctx.temperature)
        return grad, None, None, None


# Vocabulary columns per block on a CPU. One block's fp32 logits ([rows, 4096]) are reused from
# block to block, where whole-vocabulary passes ran at the memory's speed and took a fresh
# [rows, V] allocation each (forward and backward from the hidden states of 4,096 rows at
# V = 151,936: 9.6 s and 234 MiB against 15.8 s and 2.5 GiB; docs/performance.md). Other
# devices take the whole vocabulary as one block.
_CPU_VOCAB_BLOCK = 4096


# On a CPU the vectorised exp is ~35x slower where its result would be denormal (arguments below
# about -87), and most of a language model's vocabulary lies that far below the largest logit
# once divided by a sampling temperature. So on a CPU the softmax's shifted logits are clamped
# to this floor first: a term below it counts as e^-80 < 2e-35 of the largest term (which is 1)
# in the sums, and as 0 in the gradient.
_CPU_EXP_FLOOR = -80.0


def _cpu_path(device: torch.device) -> bool:
    """Whether ``device`` takes the CPU's path: vocabulary blocks and the ``exp`` floor (the
    tests also run the other devices' path on a CPU through this)."""
    return device.type == "cpu"


def _softmax_terms_(x: torch.Tensor) -> torch.Tensor:
    """``exp(x)`` of a block's shifted logits (``x <= 0``), with ``x`` changed in place so that
    ``exp(x) * x`` is finite and 0 where the term is (``0 · log 0 = 0``: masked vocabulary
    entries, underflow). On a CPU, ``x`` is clamped to ``_CPU_EXP_FLOOR``."""
    if _cpu_path(x.device):
        return torch.exp(x.clamp_min_(_CPU_EXP_FLOOR))
    e = torch.exp(x)
    x.masked_fill_(e == 0, 0.0)
    return e


def _exp_(x: torch.Tensor) -> torch.Tensor:
    """``exp`` in place (``x <= 0``) for the gradient; on a CPU, 0 below ``_CPU_EXP_FLOOR``
    (a masked vocabulary entry gets exactly zero gradient)."""
    if not _cpu_path(x.device):
        return x.exp_()
    low = x < _CPU_EXP_FLOOR
    return x.clamp_min_(_CPU_EXP_FLOOR).exp_().masked_fill_(low, 0.0)


def _vocab_blocks(device: torch.device, vocab: int) -> list[tuple[int, int]]:
    size = max(1, min(_CPU_VOCAB_BLOCK, vocab) if _cpu_path(device) else vocab)
    return [(a, min(a + size, vocab)) for a in range(0, vocab, size)]


def _hidden_block(h: torch.Tensor, weight: torch.Tensor, a: int, b: int, temperature: float,
                  ) -> torch.Tensor:
    """``(h @ weight[a:b].T) / τ`` in the statistics' dtype, a fresh tensor."""
    x = h @ weight[a:b].t()
    x = x.to(_compute_dtype(x.dtype))  # fp32 (fp64 stays), a copy only for half dtypes
    return x.div_(temperature) if temperature != 1.0 else x


def _logits_block(z: torch.Tensor, a: int, b: int, temperature: float) -> torch.Tensor:
    """``z[:, a:b] / τ`` in the statistics' dtype, a fresh tensor (the callers change it in
    place)."""
    x = z[:, a:b].to(_compute_dtype(z.dtype), copy=True)
    return x.div_(temperature) if temperature != 1.0 else x


def _in_block(targets: torch.Tensor, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Which ``targets`` fall in columns ``a..b``, and their columns there ``[n, 1]`` (clamped
    into the block for the others, whose entries the caller discards)."""
    return (targets >= a) & (targets < b), (targets - a).clamp(0, b - a - 1)[:, None]


def _unfloored(g: torch.Tensor, lp: torch.Tensor) -> torch.Tensor:
    """The log-probs' gradient ``g`` with 0 where the log-prob is the floor (a target of logit
    ``-inf``): the floor is a constant, so nothing flows back from it."""
    return torch.where(lp == _LOGPROB_FLOOR, 0.0, g)


def _softmax_grad_(x: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, g: torch.Tensor,
                   a: int, b: int, temperature: float) -> torch.Tensor:
    """``g · ∂ log p_target / ∂ z = g (onehot - softmax(z/τ)) / τ`` on columns ``a..b``, made
    in place of ``x`` (that block of ``z/τ``, a fresh tensor), with the CPU's exp floor
    (:func:`_exp_`)."""
    _exp_(x.sub_(lse[:, None])).mul_(-g[:, None])
    inside, col = _in_block(targets, a, b)
    x.scatter_add_(1, col, torch.where(inside, g, 0.0)[:, None])
    return x.div_(temperature) if temperature != 1.0 else x


def _blocked_stats(
    block: Callable[[int, int], torch.Tensor], targets: torch.Tensor,
    blocks: list[tuple[int, int]], dt: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row ``(log p_target, entropy, logsumexp)`` of the logits ``z/τ`` whose columns
    ``a..b`` ``block(a, b)`` makes (``[n, b - a]`` in ``dt``, a fresh tensor), the vocabulary
    taken block by block with a running maximum ``m``: ``s = Σ exp(z/τ - m)``,
    ``t = Σ exp(z/τ - m)(z/τ - m)``, so that ``logsumexp = m + log s`` and the entropy
    ``-Σ p log p = log s - t / s``.

    A row with no distribution (all -inf, or any NaN or +inf logit) gives NaN outputs, never
    finite stand-ins, so that a caller's finite check catches it; its logsumexp is 0 where it
    is -inf, which keeps its gradient finite."""
    n = targets.shape[0]
    m = torch.full((n,), float("-inf"), dtype=dt, device=targets.device)
    s, t, z_target = (torch.zeros(n, dtype=dt, device=targets.device) for _ in range(3))
    for a, b in blocks:
        x = block(a, b)  # [n, b - a]
        inside, col = _in_block(targets, a, b)
        z_target = torch.where(inside, x.gather(1, col).squeeze(1), z_target)
        new_m = torch.maximum(m, x.amax(dim=1))  # NaN and +inf stay: such a row is broken
        shift = torch.where(torch.isfinite(new_m), new_m, 0.0)
        e = _softmax_terms_(x.sub_(shift[:, None]))
        decay = torch.exp(m - shift)  # 0 while m is -inf
        # m = -inf: nothing before (or only clamped -inf terms, on a CPU), decay 0
        carried = torch.where(m > float("-inf"), s * (m - shift), 0.0)
        t = decay * (t + carried) + torch.linalg.vecdot(e, x)
        s = decay * s + e.sum(dim=1)
        m = new_m
    log_s = torch.log(s)
    lse = m + log_s
    broken = ~torch.isfinite(m)
    lp = torch.where(broken, float("nan"), (z_target - lse).clamp_min(_LOGPROB_FLOOR))
    entropy = torch.where(broken, float("nan"), log_s - t / s)
    return lp, entropy, torch.where(m == float("-inf"), 0.0, lse)


class _FromHidden(torch.autograd.Function):
    """Each chunk's logits are made in the parameters' dtype (``weight.dtype``), in the forward
    and again in the backward (unless ``save`` kept the forward's), always outside autocast, so
    the backward's softmax is the forward's; the gradient's two products run in ``gmm``,
    autocast's dtype when it is on. On a CPU the vocabulary is taken in blocks of
    ``_CPU_VOCAB_BLOCK`` columns (:func:`_blocked_stats`; the backward writes each block's rows
    of the weight's gradient)."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor,  # type: ignore[override]
                targets: torch.Tensor, chunk: int, temperature: float, gmm: torch.dtype,
                save: bool):
        blocks = _vocab_blocks(hidden.device, weight.shape[0])
        dt = _compute_dtype(weight.dtype)
        kept: Optional[dict] = {} if save else None  # (row, column) of a block: its z/τ

        def block(s: int, e: int, a: int, b: int) -> torch.Tensor:
            x = _hidden_block(hidden[s:e], weight, a, b, temperature)
            if kept is not None:  # a copy: _blocked_stats changes x in place
                kept[s, a] = x.clone()
            return x

        with _no_autocast(hidden.device.type):
            lp, ent, lse = _chunked(hidden, chunk, lambda s, e: _blocked_stats(
                lambda a, b: block(s, e, a, b), targets[s:e], blocks, dt))
        ctx.save_for_backward(hidden, weight, targets, lse, lp)
        ctx.chunk, ctx.temperature, ctx.gmm, ctx.blocks = chunk, temperature, gmm, blocks
        ctx.kept = kept
        ctx.mark_non_differentiable(ent)
        return lp, ent

    @staticmethod
    def backward(ctx: Any, g_lp: torch.Tensor, g_ent: Optional[torch.Tensor]):  # type: ignore[override]
        hidden, weight, targets, lse, lp = ctx.saved_tensors
        kept, ctx.kept = ctx.kept, None
        g_lp = _unfloored(g_lp.to(lse.dtype), lp)
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        cast = ctx.gmm != weight.dtype  # autocast: the gradient's products in its dtype
        acc = lse.dtype  # each block's share of a gradient is summed in fp32 (fp64)
        # every element is written below (the first block or chunk assigns, the rest add),
        # unless there is no row at all
        new = torch.empty if hidden.shape[0] else torch.zeros
        several = len(ctx.blocks) > 1  # else one product per chunk, in hidden's dtype as is
        grad_h = (new(hidden.shape, dtype=acc if several else hidden.dtype,
                      device=hidden.device) if need_h else None)
        grad_w = new(weight.shape, dtype=acc, device=weight.device) if need_w else None
        with _no_autocast(hidden.device.type):
            # one block (a GPU): the weight cast once, as a Linear head's backward would
            w_all = weight.to(ctx.gmm) if cast and need_h and not several else None
            for s in range(0, hidden.shape[0], ctx.chunk):
                e = min(s + ctx.chunk, hidden.shape[0])
                h, tg, g = hidden[s:e], targets[s:e], g_lp[s:e]
                h_w = (h.to(ctx.gmm) if cast else h.to(acc)) if need_w else None
                for a, b in ctx.blocks:
                    # the forward's block where it was kept (taken: _softmax_grad_ changes it,
                    # so a second backward recomputes it), else made again
                    x = kept.pop((s, a)) if kept else _hidden_block(h, weight, a, b,
                                                                    ctx.temperature)
                    gz = _softmax_grad_(x, tg, lse[s:e], g, a, b, ctx.temperature)
                    if grad_h is not None:
                        w = (w_all if w_all is not None
                             else weight[a:b].to(ctx.gmm) if cast else weight[a:b])
                        if a == 0:
                            grad_h[s:e] = gz.to(w.dtype) @ w
                        else:
                            grad_h[s:e] += gz.to(w.dtype) @ w
                    if grad_w is None or h_w is None:
                        continue
                    if cast:  # a [b - a, D] product in gmm, added in fp32
                        if s == 0:
                            grad_w[a:b] = gz.t().to(ctx.gmm) @ h_w
                        else:
                            grad_w[a:b] += gz.t().to(ctx.gmm) @ h_w
                    else:  # in place: no [b - a, D] temporary (all of V on a GPU)
                        if s == 0:
                            torch.mm(gz.t(), h_w, out=grad_w[a:b])
                        else:
                            grad_w[a:b].addmm_(gz.t(), h_w)
        return ((grad_h.to(hidden.dtype) if grad_h is not None else None),
                (grad_w.to(weight.dtype) if grad_w is not None else None),
                None, None, None, None, None)


def _check_targets(targets: Any, lead: torch.Size, vocab: int) -> torch.Tensor:
    targets = _checks.check_tensor("targets", targets)
    if targets.shape != lead:
        raise ValueError(
            f"targets must be [{', '.join(map(str, lead))}] (the logits' leading dims), got "
            f"{_checks.format_shape(targets)}"
        )
    if targets.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
        raise ValueError(f"targets must be an integer tensor of token ids, got {targets.dtype}")
    if targets.numel():
        lo, hi = torch.stack([targets.min(), targets.max()]).tolist()
        if lo < 0 or hi >= vocab:
            raise ValueError(
                f"targets must be token ids in [0, {vocab}), got values in [{lo}, {hi}]; "
                f"replace ignore indices such as -100 at padded positions with a valid id "
                f"(e.g. 0) and mask them out downstream"
            )
    return targets.long()


def _check_chunk(chunk_size: Any, temperature: Any) -> tuple[int, float]:
    if not _checks.is_int(chunk_size) or chunk_size < 1:
        raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}")
    return int(chunk_size), _checks.check_positive("temperature", temperature)


def logprobs_and_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    chunk_size: int = 1024,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of ``targets`` and entropies of the distributions ``softmax(logits / τ)``.

    ``logprob_t = z_{t, y_t}/τ - logsumexp(z_t/τ)``, ``H_t = -Σ_v p_{t,v} log p_{t,v}`` (Eq. 3).
    A row with no distribution (all logits -inf, or a NaN or +inf logit) gives NaN for both.
    Left out of the loss (``torch.where``), an all ``-inf`` row gets zero gradient; a row with a
    NaN or ``+inf`` logit gets NaN gradient there, as ``log_softmax`` gives, so a non-finite
    check of the gradient sees it. ``-inf`` entries in a row that has others are masked
    vocabulary.

    Args:
        logits: next-token logits, any float dtype (fp32 inside each chunk).
        targets: the taken tokens (ids in ``[0, V)``).
        chunk_size: rows (tokens) per chunk; peak extra memory is a few ``[chunk_size, V]``
            fp32 tensors (``[chunk_size, 4096]`` on a CPU), beside the gradient of the logits.
        temperature: divide the logits by ``τ`` first (use the sampling temperature so the
            log-probs are those of the sampling distribution).

    Shape:
        logits: ``[..., V]``; targets: ``[...]``; returns ``(logprobs, entropies)``, each
        ``[...]`` fp32 (fp64 for fp64 logits). ``logprobs`` carries gradient to ``logits``;
        ``entropies`` is detached.
    """
    logits = _checks.check_tensor("logits", logits)
    _checks.check_float("logits", logits)
    if logits.dim() < 2:
        raise ValueError(f"logits must be [..., V], got {_checks.format_shape(logits)}")
    chunk_size, temperature = _check_chunk(chunk_size, temperature)
    lead, vocab = logits.shape[:-1], logits.shape[-1]
    _checks.check_same_device(logits=logits, targets=_checks.check_tensor("targets", targets))
    targets = _check_targets(targets, lead, vocab)
    lp, ent = _FromLogits.apply(
        logits.reshape(-1, vocab), targets.reshape(-1), chunk_size, temperature
    )
    return lp.view(lead), ent.view(lead)


def logprobs_and_entropy_from_hidden(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    chunk_size: int = 1024,
    temperature: float = 1.0,
    save_logits: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`logprobs_and_entropy` of ``logits = hidden @ weight.T``, never materialising them
    (unless ``save_logits``).

    Args:
        hidden: final (normed) hidden states.
        weight: the output projection (``lm_head.weight``, or the tied embedding).
        targets, chunk_size, temperature: as in :func:`logprobs_and_entropy` (on a CPU the
            temporaries are ``[chunk_size, 4096]``: the vocabulary is taken in blocks).
        save_logits: keep the forward's fp32 logits (``[N, V]``, block by block) for the
            backward instead of making them again there: one of the head's four matrix
            products fewer, for that much memory held from the forward to the backward. Only
            where a gradient will be taken; the numbers are the same either way.

    Shape:
        hidden: ``[..., D]``; weight: ``[V, D]``; targets: ``[...]``; returns two ``[...]``
        fp32 tensors (fp64 for fp64 inputs). Gradient flows to ``hidden`` and ``weight``.

    Under ``torch.autocast`` the logits are still made in the parameters' dtype: bf16 logits
    are rounded to 1/16-1/8 at a language model's top logits, an error the log-probs would
    carry. The backward's two products (the gradients of ``hidden`` and ``weight``) run in
    autocast's dtype, as autocast would run a ``Linear`` head's; they are 2 of the head's 3.
    """
    hidden = _checks.check_tensor("hidden", hidden)
    weight = _checks.check_tensor("weight", weight)
    _checks.check_float("hidden", hidden)
    _checks.check_float("weight", weight)
    if hidden.dim() < 2:
        raise ValueError(f"hidden must be [..., D], got {_checks.format_shape(hidden)}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"weight must be [V, D] with D={hidden.shape[-1]} (hidden's last dim), got "
            f"{_checks.format_shape(weight)}"
        )
    if weight.dtype != hidden.dtype:
        raise ValueError(f"hidden ({hidden.dtype}) and weight ({weight.dtype}) must share a dtype")
    chunk_size, temperature = _check_chunk(chunk_size, temperature)
    lead, dim = hidden.shape[:-1], hidden.shape[-1]
    _checks.check_same_device(hidden=hidden, weight=weight,
                              targets=_checks.check_tensor("targets", targets))
    targets = _check_targets(targets, lead, weight.shape[0])
    # under torch.autocast the gradient's products run in its dtype; the logits never do
    gmm = _autocast_dtype(hidden.device.type) or weight.dtype
    if not isinstance(save_logits, bool):
        raise ValueError(f"save_logits must be a bool, got {save_logits!r}")
    save = save_logits and torch.is_grad_enabled() and (hidden.requires_grad
                                                        or weight.requires_grad)
    lp, ent = _FromHidden.apply(
        hidden.reshape(-1, dim), weight, targets.reshape(-1), chunk_size, temperature, gmm, save
    )
    return lp.view(lead), ent.view(lead)
