"""Triton kernels for strategies on CUDA: ``entropy_bonus`` in one launch where the eager
formula takes six, PEPO's ``proximal_softmax`` and ``window_average`` in three, where
``torch.compile``'s call costs more (at the paper's batch sizes a strategy's call is bound by
its launches, not by the GPU's work). Imported only for CUDA
tensors, and only where Triton is installed; the pure-PyTorch body in :mod:`pepo.weighting`
stays the reference the tests compare with and the path on CPUs.

``TRITON_INTERPRET=1`` in the environment before the first import runs these kernels on CPU
tensors (Triton's interpreter), which is how the tests check them without a GPU.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Optional

import torch

try:  # optional: the core imports torch alone
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where Triton is missing
    triton = None
    tl = None

__all__ = ["available", "entropy_bonus", "windowed"]

_BLOCK = 1024
_TILE = 256  # tokens per program of the window kernel: W loads each, from L1/L2


def available() -> bool:
    """Whether Triton imported (the kernels below can run)."""
    return triton is not None


if triton is not None:

    @triton.jit
    def _entropy_bonus_kernel(adv_ptr, ent_ptr, mask_ptr, out_ptr, T,  # noqa: N803
                              s_a, s_eb, s_et, s_mb, s_mt, alpha, inv_kappa,
                              BLOCK: tl.constexpr):  # noqa: N803
        row = tl.program_id(0).to(tl.int64)
        col = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = col < T
        valid = tl.load(mask_ptr + row * s_mb + col * s_mt, mask=inside, other=0) != 0
        # masked entropies are never read: their contents (NaN included) go no further
        h = tl.load(ent_ptr + row * s_eb + col * s_et, mask=valid, other=0.0).to(tl.float32)
        a = tl.load(adv_ptr + row * s_a).to(tl.float32)
        cap = tl.abs(a) * inv_kappa  # as CUDA's eager a / κ and inductor: a * fl32(1/κ)
        bonus = tl.minimum(alpha * h, cap, propagate_nan=tl.PropagateNan.ALL)
        bonus = tl.where(tl.abs(h) == float("inf"), float("nan"), bonus)  # the cap hides no inf
        tl.store(out_ptr + row * T + col, tl.where(valid, a + bonus, 0.0), mask=inside)

    @triton.jit
    def _compact_kernel(ent_ptr, mask_ptr, x_ptr, pos_ptr, len_ptr, shift_ptr, wide_ptr, T,  # noqa: N803
                        s_eb, s_et, s_mb, s_mt, scale, wide_range,
                        PROXIMAL: tl.constexpr, BLOCK: tl.constexpr):  # noqa: N803
        """One program a row: its valid values moved to the front (``x``, times ``scale``), each
        column's index there (``pos``), the row's length; for the softmax, its shift (the
        largest cleaned value, padding zeros included, times ``scale``) and whether its range
        is wider than the shifted exp holds."""
        row = tl.program_id(0).to(tl.int64)
        count = tl.zeros((), dtype=tl.int32)
        hi = tl.full((), float("-inf"), tl.float32)
        lo = tl.full((), float("inf"), tl.float32)
        nan = tl.zeros((), dtype=tl.int32)
        for start in range(0, T, BLOCK):
            col = start + tl.arange(0, BLOCK)
            inside = col < T
            valid = tl.load(mask_ptr + row * s_mb + col * s_mt, mask=inside, other=0) != 0
            h = tl.load(ent_ptr + row * s_eb + col * s_et, mask=valid, other=0.0).to(tl.float32)
            if not PROXIMAL:  # the window average counts a valid value below 0 as 0
                h = tl.where(h < 0.0, 0.0, h)  # (NaN < 0 is False: a NaN stays)
            pos = tl.cumsum(valid.to(tl.int32), axis=0) + count - 1
            tl.store(x_ptr + row * T + pos, h * scale, mask=valid)
            tl.store(pos_ptr + row * T + col, tl.maximum(pos, 0), mask=inside)
            count += tl.sum(valid.to(tl.int32), axis=0)
            nan += tl.sum((h != h).to(tl.int32), axis=0)
            hi = tl.maximum(hi, tl.max(tl.where(inside, h, float("-inf")), axis=0))
            lo = tl.minimum(lo, tl.min(tl.where(inside, h, float("inf")), axis=0))
        tl.store(len_ptr + row, count)
        if PROXIMAL:
            tl.store(shift_ptr + row, tl.where(nan > 0, float("nan"), hi * scale))
            tl.store(wide_ptr + row, ((hi - lo) > wide_range).to(tl.int8))

    @triton.jit
    def _window_kernel(x_ptr, pos_ptr, len_ptr, shift_ptr, wide_ptr, mask_ptr, e_ptr,  # noqa: N803
                       part_ptr, T, n_tiles, s_mb, s_mt, W, inv_w,
                       PROXIMAL: tl.constexpr, TILE: tl.constexpr):  # noqa: N803
        """Each valid token's windowed statistic over its row's compact values, reflected at
        the row's ends as ``numpy.pad(mode="reflect")``: ``exp(x_t - m) / Σ_W exp(x_k - m)``
        (Eq. 6, ``x = H/τ``, ``m`` the row's shift) or ``x_t / Σ_W x_k`` (``1/W`` where the
        window sums to 0); 0 at masked tokens. Also each tile's sum, for the row's total."""
        row = tl.program_id(0).to(tl.int64)
        tile = tl.program_id(1)
        col = tile.to(tl.int64) * TILE + tl.arange(0, TILE)
        inside = col < T
        valid = tl.load(mask_ptr + row * s_mb + col * s_mt, mask=inside, other=0) != 0
        p = tl.load(pos_ptr + row * T + col, mask=valid, other=0)
        n = tl.maximum(tl.load(len_ptr + row), 1)
        period = tl.maximum(2 * (n - 1), 1)
        base = x_ptr + row * T
        shift = 0.0
        if PROXIMAL:
            shift = tl.load(shift_ptr + row)
        half = W // 2
        acc = tl.zeros((TILE,), dtype=tl.float32)
        for d in range(0, W):
            j = (p + (d - half)) % period
            j = tl.where(j < 0, j + period, j)  # a C remainder keeps the sign
            j = tl.where(j > n - 1, period - j, j)
            v = tl.load(base + j, mask=valid, other=0.0)
            if PROXIMAL:
                v = tl.exp(v - shift)
            acc += v
        x = tl.load(base + p, mask=valid, other=0.0)
        if PROXIMAL:
            e = tl.exp(x - shift) / acc
            e = tl.where(tl.load(wide_ptr + row) != 0, float("nan"), e)
        else:
            e = tl.where(acc > 0.0, x / tl.where(acc > 0.0, acc, 1.0),
                         tl.where(acc == 0.0, inv_w, float("nan")))
        e = tl.where(valid, e, 0.0)
        tl.store(e_ptr + row * T + col, e, mask=inside)
        tl.store(part_ptr + row * n_tiles + tile, tl.sum(e, axis=0))

    @triton.jit
    def _weight_kernel(e_ptr, part_ptr, len_ptr, adv_ptr, pos_flag_ptr, mask_ptr, out_ptr,  # noqa: N803
                       T, n_tiles, s_a, s_p, s_mb, s_mt,
                       ALL_ROWS: tl.constexpr, TILE: tl.constexpr):  # noqa: N803
        """``c = e · (T_i / Σ_t e)`` (1 where the row has no mass, NaN where its sum is NaN),
        then ``c A`` on the weighted rows and ``A`` on the others; 0 at masked tokens."""
        row = tl.program_id(0).to(tl.int64)
        col = tl.program_id(1).to(tl.int64) * TILE + tl.arange(0, TILE)
        inside = col < T
        total = tl.zeros((), dtype=tl.float32)
        for start in range(0, n_tiles, TILE):
            k = start + tl.arange(0, TILE)
            total += tl.sum(tl.load(part_ptr + row * n_tiles + k, mask=k < n_tiles, other=0.0),
                            axis=0)
        length = tl.load(len_ptr + row).to(tl.float32)
        valid = tl.load(mask_ptr + row * s_mb + col * s_mt, mask=inside, other=0) != 0
        e = tl.load(e_ptr + row * T + col, mask=inside, other=0.0)
        ok = total > 0.0
        c = tl.where(ok, e * (length / tl.where(ok, total, 1.0)),
                     tl.where(total != total, float("nan"), 1.0))
        a = tl.load(adv_ptr + row * s_a).to(tl.float32)
        if ALL_ROWS:
            w = c * a
        else:
            w = tl.where(tl.load(pos_flag_ptr + row * s_p) != 0, c * a, a)
        tl.store(out_ptr + row * T + col, tl.where(valid, w, 0.0), mask=inside)


def entropy_bonus(adv: torch.Tensor, ent: torch.Tensor, mask: torch.Tensor, alpha: float,
                  inv_kappa: float) -> torch.Tensor:
    """``A_i + min(α H_{i,t}, |A_i| · inv_kappa)`` at valid tokens, 0 elsewhere, ``[B, T]``
    fp32, in one launch, on the tensors' device; an inf entropy gives NaN, as in
    :func:`pepo.weighting.entropy_bonus` (whose ``inv_kappa`` is ``1/κ`` rounded to fp32).
    ``adv`` is ``[B]`` fp32; ``ent`` ``[B, T]`` of any float dtype and any strides; ``mask``
    ``[B, T]`` bool."""
    b, t = ent.shape
    out = torch.empty((b, t), dtype=torch.float32, device=ent.device)
    if b and t:
        grid = (b, triton.cdiv(t, _BLOCK))
        args = (adv, ent, mask, out, t, adv.stride(0), ent.stride(0), ent.stride(1),
                mask.stride(0), mask.stride(1), float(alpha), float(inv_kappa))
        if ent.is_cuda and ent.device.index != torch.cuda.current_device():
            with torch.cuda.device(ent.device):  # Triton launches on the current device
                _entropy_bonus_kernel[grid](*args, BLOCK=_BLOCK)
        else:
            _entropy_bonus_kernel[grid](*args, BLOCK=_BLOCK)
    return out


def windowed(adv: torch.Tensor, ent: torch.Tensor, mask: torch.Tensor,
             positive: Optional[torch.Tensor], window: int, temperature: Optional[float],
             wide_range: float = math.inf) -> torch.Tensor:
    """``proximal_softmax`` (``temperature`` given: Eq. 6's ``e``) or ``window_average``
    (``temperature=None``: ``H_t / Σ_W H_k``) as :mod:`pepo.weighting` computes them, in three
    launches: each row compacted, every token's window, then Eq. 7's ``c = e / Σ e · T_i`` and
    ``c A`` on the rows flagged ``positive`` (every row where it is None), ``A`` on the others.

    The softmax shifts each row by its largest ``H/τ`` and gives NaN on a row whose range
    exceeds ``wide_range`` (the PyTorch body's rule); ``[B, T]`` fp32, 0 where ``mask`` is
    False. ``adv`` is ``[B]`` fp32; ``ent`` ``[B, T]`` of any float dtype and any strides."""
    b, t = ent.shape
    out = torch.zeros((b, t), dtype=torch.float32, device=ent.device)
    if not (b and t):
        return out
    proximal = temperature is not None
    scale = 1.0 / temperature if proximal else 1.0
    n_tiles = triton.cdiv(t, _TILE)
    x = torch.empty((b, t), dtype=torch.float32, device=ent.device)
    pos = torch.empty((b, t), dtype=torch.int32, device=ent.device)
    e = torch.empty((b, t), dtype=torch.float32, device=ent.device)
    part = torch.empty((b, n_tiles), dtype=torch.float32, device=ent.device)
    lengths = torch.empty(b, dtype=torch.int32, device=ent.device)
    shift = torch.empty(b, dtype=torch.float32, device=ent.device)
    wide = torch.empty(b, dtype=torch.int8, device=ent.device)
    flags = adv if positive is None else positive
    with _on(ent.device):
        _compact_kernel[(b,)](ent, mask, x, pos, lengths, shift, wide, t, ent.stride(0),
                              ent.stride(1), mask.stride(0), mask.stride(1), float(scale),
                              float(wide_range), PROXIMAL=proximal, BLOCK=_BLOCK)
        _window_kernel[(b, n_tiles)](x, pos, lengths, shift, wide, mask, e, part, t, n_tiles,
                                     mask.stride(0), mask.stride(1), int(window),
                                     1.0 / window, PROXIMAL=proximal, TILE=_TILE)
        _weight_kernel[(b, n_tiles)](e, part, lengths, adv, flags, mask, out, t, n_tiles,
                                     adv.stride(0), flags.stride(0), mask.stride(0),
                                     mask.stride(1), ALL_ROWS=positive is None, TILE=_TILE)
    return out


def _on(device: torch.device) -> Any:
    """Triton launches on the current CUDA device: make it the tensors' one."""
    if device.type == "cuda" and device.index != torch.cuda.current_device():
        return torch.cuda.device(device)
    return contextlib.nullcontext()
