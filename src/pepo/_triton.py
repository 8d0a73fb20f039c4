"""Triton kernels for strategies on CUDA: ``entropy_bonus`` in one launch where the eager
formula takes six, PEPO's ``proximal_softmax`` and ``window_average`` in three, ``global_topk``
in six with either score (a radix select, no sort; its kernels in :mod:`pepo._triton_topk`),
``gtpo`` in three, where ``torch.compile``'s call costs
more (at the paper's batch sizes a strategy's call is bound by its launches, not by the GPU's
work). Imported only for CUDA tensors, and only where Triton is installed; the pure-PyTorch
bodies in :mod:`pepo.weighting` stay the reference the tests compare with and the path on CPUs.

``TRITON_INTERPRET=1`` in the environment before the first import runs these kernels on CPU
tensors (Triton's interpreter), which is how the tests check them without a GPU.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import struct
from typing import Any, Optional

import torch

try:  # optional: the core imports torch alone
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where Triton is missing
    triton = None
    tl = None

__all__ = ["available", "entropy_bonus", "global_topk", "gtpo", "windowed"]

_BLOCK = 1024


def _hist_setting(text: str) -> tuple[int, int]:
    """``PEPO_TOPK_HIST`` ("BLOCKxWARPS": scores and warps a program of the radix select's
    histogram passes) as two ints; ``ValueError`` naming the value where it is not one (a block
    is a ``tl.arange`` length: a power of two, at least one 256-count histogram, at most 2^16)."""
    m = re.fullmatch(r"(\d+)x(\d+)", text.strip(), re.IGNORECASE | re.ASCII)
    block, warps = (int(m[1]), int(m[2])) if m else (0, 0)
    if warps not in (1, 2, 4, 8, 16, 32) or not 256 <= block <= 2**16 or block & (block - 1):
        raise ValueError(f"PEPO_TOPK_HIST={text!r}: expected BLOCKxWARPS, BLOCK a power of two "
                         f"from 256 to 65536 and WARPS one of 1, 2, 4, 8, 16, 32 (default 4096x8)")
    return block, warps


# the radix select's three histogram passes: 8 us each on an H200 at 2^20 scores with 4,096
# scores and 8 warps a program, 13 with 1,024 and 4 (1,024 programs adding into one histogram):
# `bench_weighting_variants.py --radix-blocks`, docs/performance.md. A bad value is global_topk's
# error (as PEPO_TOPK_SELECT's), not every kernel's at import.
_HIST = os.environ.get("PEPO_TOPK_HIST", "4096x8")
try:
    _HIST_BLOCK, _HIST_WARPS = _hist_setting(_HIST)
except ValueError:
    _HIST_BLOCK = _HIST_WARPS = 0
_TILE = 256  # tokens per program of the window kernel: W loads each, from L1/L2
# global_topk's threshold: "radix" (a select over the scores' bytes: the top byte's histogram
# with the scores, three passes more, no sort; 6 launches and 42 us of GPU time against the
# sort's 10 and 97 on an H200, docs/performance.md), "radix12" (the top byte, then two passes
# of 12 bits, an atomic add a key: one launch fewer; untimed) or "sort" (one torch.sort of the
# batch)
_TOPK_SELECT = os.environ.get("PEPO_TOPK_SELECT", "radix")
_TOPK_DIGITS = {"radix": 8, "radix12": 12, "sort": 0}  # bits a histogram pass after the top
_CHUNK = 2048  # columns per program of the windowed compaction (a multiple of _BLOCK: no overlap)


def available() -> bool:
    """Whether Triton imported (the kernels below can run)."""
    return triton is not None


if triton is not None:
    from pepo._triton_topk import f64 as _f64
    from pepo._triton_topk import radix_hist_kernel as _radix_hist_kernel
    from pepo._triton_topk import topk_apply_kernel as _topk_apply_kernel
    from pepo._triton_topk import topk_prep_kernel as _topk_prep_kernel
    from pepo._triton_topk import topk_radix_apply_kernel as _topk_radix_apply_kernel
    from pepo._triton_topk import topk_scores as _topk_scores

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
        # slightly negative entropies (fp32 rounding) count as 0; NaN stays NaN
        bonus = tl.minimum(alpha * tl.where(h < 0.0, 0.0, h), cap,
                           propagate_nan=tl.PropagateNan.ALL)
        bonus = tl.where(tl.abs(h) == float("inf"), float("nan"), bonus)  # the cap hides no inf
        tl.store(out_ptr + row * T + col, tl.where(valid, a + bonus, 0.0), mask=inside)

    @triton.jit
    def _row_block(ent_ptr, mask_ptr, row, start, T, s_eb, s_et, s_mb, s_mt,
                   BLOCK: tl.constexpr):  # noqa: N803
        """Columns ``start ..`` of a row: the columns (int64), which are inside the row, which
        are valid, and the entropies as fp32, 0 where masked (read beside the mask, not after
        it: a row's loop then waits on no load for another)."""
        col = (start + tl.arange(0, BLOCK)).to(tl.int64)
        inside = col < T
        valid = tl.load(mask_ptr + row * s_mb + col * s_mt, mask=inside, other=0) != 0
        h = tl.load(ent_ptr + row * s_eb + col * s_et, mask=inside, other=0.0).to(tl.float32)
        return col, inside, valid, tl.where(valid, h, 0.0)

    @triton.jit
    def _to_front(x_ptr, pos_ptr, row, T, col, inside, valid, value, count):  # noqa: N803
        """Stores a block's valid ``value`` at the row's next compact places (``count`` are
        taken) and each column's compact index; returns the new count."""
        pos = tl.cumsum(valid.to(tl.int32), axis=0) + count - 1
        tl.store(x_ptr + row * T + pos, value, mask=valid)
        tl.store(pos_ptr + row * T + col, tl.maximum(pos, 0), mask=inside)
        return count + tl.sum(valid.to(tl.int32), axis=0)

    @triton.jit
    def _tile(mask_ptr, pos_ptr, row, tile, T, s_mb, s_mt, TILE: tl.constexpr):  # noqa: N803
        """A tile of a row's columns: the columns, which are inside the row, which are valid,
        and each valid one's compact index (from :func:`_to_front`)."""
        col = tile.to(tl.int64) * TILE + tl.arange(0, TILE)
        inside = col < T
        valid = tl.load(mask_ptr + row * s_mb + col * s_mt, mask=inside, other=0) != 0
        return col, inside, valid, tl.load(pos_ptr + row * T + col, mask=valid, other=0)

    @triton.jit
    def _compact_kernel(ent_ptr, mask_ptr, x_ptr, pos_ptr, len_ptr, stat_ptr,  # noqa: N803
                        count_ptr, T, n_chunks, n_counts, s_eb, s_et, s_mb, s_mt, scale,
                        PROXIMAL: tl.constexpr, ZERO: tl.constexpr,  # noqa: N803
                        BLOCK: tl.constexpr, CHUNK: tl.constexpr):  # noqa: N803
        """One program a chunk of a row: its valid values moved to their compact places
        (``x``, times ``scale``; the valid tokens before the chunk counted from the mask), each
        column's index there (``pos``), the row's length (by its last chunk); for the softmax,
        the chunk's largest and smallest cleaned value (padding zeros included) and its number
        of NaNs, for :func:`_row_shift`. Long rows so run on many programs, not one. With
        ``ZERO`` (a power of two, at least ``n_counts``) the first program also zeroes
        ``global_topk``'s ``n_counts`` counts, which the window kernel then adds to."""
        row = tl.program_id(0).to(tl.int64)
        chunk = tl.program_id(1)
        if ZERO > 0:  # by the first program alone
            k = tl.arange(0, ZERO)
            tl.store(count_ptr + k, tl.zeros((ZERO,), dtype=tl.int64),
                     mask=(k < n_counts) & (row == 0) & (chunk == 0))
        first = chunk.to(tl.int64) * CHUNK
        count = tl.zeros((), dtype=tl.int32)
        for start in range(0, first, 4 * BLOCK):  # the valid tokens before the chunk
            col = start + tl.arange(0, 4 * BLOCK).to(tl.int64)
            m = tl.load(mask_ptr + row * s_mb + col * s_mt, mask=col < first, other=0)
            count += tl.sum((m != 0).to(tl.int32), axis=0)
        hi = tl.full((), float("-inf"), tl.float32)
        lo = tl.full((), float("inf"), tl.float32)
        nan = tl.zeros((), dtype=tl.int32)
        for start in range(first, tl.minimum(first + CHUNK, T), BLOCK):
            col, inside, valid, h = _row_block(ent_ptr, mask_ptr, row, start, T, s_eb, s_et,
                                               s_mb, s_mt, BLOCK)
            if not PROXIMAL:  # the window average counts a valid value below 0 as 0
                h = tl.where(h < 0.0, 0.0, h)  # (NaN < 0 is False: a NaN stays)
            count = _to_front(x_ptr, pos_ptr, row, T, col, inside, valid, h * scale, count)
            nan += tl.sum((h != h).to(tl.int32), axis=0)
            hi = tl.maximum(hi, tl.max(tl.where(inside, h, float("-inf")), axis=0))
            lo = tl.minimum(lo, tl.min(tl.where(inside, h, float("inf")), axis=0))
        if chunk == n_chunks - 1:
            tl.store(len_ptr + row, count)
        if PROXIMAL:
            at = stat_ptr + (row * n_chunks + chunk) * 3
            tl.store(at, hi)
            tl.store(at + 1, lo)
            tl.store(at + 2, nan.to(tl.float32))

    @triton.jit
    def _row_shift(stat_ptr, row, n_chunks, scale, wide_range):  # noqa: N803
        """A row's softmax shift from its chunks' figures: its largest cleaned value times
        ``scale`` (NaN where it holds a NaN), and whether its range is wider than
        ``wide_range`` (the shifted exp would underflow)."""
        hi = tl.full((), float("-inf"), tl.float32)
        lo = tl.full((), float("inf"), tl.float32)
        nan = tl.zeros((), dtype=tl.float32)
        for start in range(0, n_chunks, 64):
            k = start + tl.arange(0, 64)
            at = stat_ptr + (row * n_chunks + k) * 3
            inside = k < n_chunks
            hi = tl.maximum(hi, tl.max(tl.load(at, mask=inside, other=float("-inf")), axis=0))
            lo = tl.minimum(lo, tl.min(tl.load(at + 1, mask=inside, other=float("inf")), axis=0))
            nan += tl.sum(tl.load(at + 2, mask=inside, other=0.0), axis=0)
        return tl.where(nan > 0, float("nan"), hi * scale), (hi - lo) > wide_range

    @triton.jit
    def _window_sum(base, p, valid, W, steps, n, period, shift,  # noqa: N803
                    PROXIMAL: tl.constexpr, ONCE: tl.constexpr, TILE: tl.constexpr):  # noqa: N803
        """The sum over each token's window of its row's compact values (their exps, shifted,
        for the softmax), the indices reflected at the row's ends: with two comparisons where
        the row is at least half a window long (``ONCE``), by a remainder otherwise. ``steps``
        is ``W``, or 0 for a tile without a valid token (its sums are never read)."""
        half = W // 2
        acc = tl.zeros((TILE,), dtype=tl.float32)
        for d in range(0, steps):
            j = p + (d - half)
            if ONCE:
                j = tl.where(j < 0, -j, j)
            else:
                j = j % period
                j = tl.where(j < 0, j + period, j)  # a C remainder keeps the sign
            j = tl.where(j > n - 1, period - j, j)
            v = tl.load(base + j, mask=valid, other=0.0)
            if PROXIMAL:
                v = tl.exp(v - shift)
            acc += v
        return acc

    @triton.jit
    def _window_kernel(x_ptr, pos_ptr, len_ptr, stat_ptr, mask_ptr, e_ptr,  # noqa: N803
                       part_ptr, count_ptr, T, n_tiles, n_chunks, s_mb, s_mt, W, inv_w, scale,
                       wide_range, PROXIMAL: tl.constexpr, TOPK: tl.constexpr,  # noqa: N803
                       TILE: tl.constexpr):  # noqa: N803
        """Each valid token's windowed statistic over its row's compact values, reflected at
        the row's ends as ``numpy.pad(mode="reflect")``: ``exp(x_t - m) / Σ_W exp(x_k - m)``
        (Eq. 6, ``x = H/τ``, ``m`` the row's shift) or ``x_t / Σ_W x_k`` (``1/W`` where the
        window sums to 0); 0 at masked tokens. Also each tile's sum, for the row's total. With
        ``TOPK`` (1: a sort follows, 2: the radix select) what :func:`_topk_prep_kernel` does
        instead, in this launch: -inf at masked tokens, no tile sums, the valid and non-finite
        counts added to ``count`` and with 2 the keys' top-byte histogram."""
        row = tl.program_id(0).to(tl.int64)
        tile = tl.program_id(1)
        col, inside, valid, p = _tile(mask_ptr, pos_ptr, row, tile, T, s_mb, s_mt, TILE)
        n = tl.maximum(tl.load(len_ptr + row), 1)
        period = tl.maximum(2 * (n - 1), 1)
        base = x_ptr + row * T
        shift = 0.0
        wide = False
        if PROXIMAL:
            shift, wide = _row_shift(stat_ptr, row, n_chunks, scale, wide_range)
        # a tile of padding alone (a short row's tail) skips its W loads: its tokens are all 0
        steps = tl.where(tl.max(valid.to(tl.int32), axis=0) > 0, W, 0)
        if W // 2 <= n - 1:  # one reflection at most: no remainder (the usual row, and faster)
            acc = _window_sum(base, p, valid, W, steps, n, period, shift, PROXIMAL, True, TILE)
        else:  # a row shorter than half a window reflects again and again
            acc = _window_sum(base, p, valid, W, steps, n, period, shift, PROXIMAL, False, TILE)
        x = tl.load(base + p, mask=valid, other=0.0)
        if PROXIMAL:
            e = tl.exp(x - shift) / acc
            e = tl.where(wide, float("nan"), e)
        else:
            e = tl.where(acc > 0.0, x / tl.where(acc > 0.0, acc, 1.0),
                         tl.where(acc == 0.0, inv_w, float("nan")))
            e = tl.where(acc == float("inf"), float("nan"), e)  # an inf in the window: NaN
        if TOPK > 0:
            _topk_scores(e, valid, inside, e_ptr + row * T + col, count_ptr, TOPK == 2)
        else:
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

    @triton.jit
    def _gtpo_rows_kernel(ent_ptr, mask_ptr, pos_flag_ptr, group_ptr, x_ptr, pos_ptr,  # noqa: N803
                          len_ptr, side_ptr, group_list_ptr, count_ptr, B, T, s_eb, s_et, s_mb,
                          s_mt, s_p, s_g, eps_bits, BLOCK: tl.constexpr):  # noqa: N803
        """One program a row: the rows of its group and of its side (group and outcome) as
        lists, its group's size and successes, and its Eq. 3/5 values (``H`` on a success,
        ``1/(H + eps)`` on a failure, NaN for an inf entropy, float64) moved to the front."""
        row = tl.program_id(0).to(tl.int64)
        eps = _f64(eps_bits)
        g = tl.load(group_ptr + row * s_g).to(tl.int64)
        win = tl.load(pos_flag_ptr + row * s_p) != 0
        n_group = tl.zeros((), dtype=tl.int32)
        n_side = tl.zeros((), dtype=tl.int32)
        n_pos = tl.zeros((), dtype=tl.int32)
        for start in range(0, B, BLOCK):
            j = start + tl.arange(0, BLOCK)
            inside = j < B
            same = (tl.load(group_ptr + j.to(tl.int64) * s_g, mask=inside, other=0).to(tl.int64)
                    == g) & inside
            flag = tl.load(pos_flag_ptr + j.to(tl.int64) * s_p, mask=inside, other=0) != 0
            side = same & (flag == win)
            at = tl.cumsum(same.to(tl.int32), axis=0) + n_group - 1
            tl.store(group_list_ptr + row * B + at, j.to(tl.int32), mask=same)
            at = tl.cumsum(side.to(tl.int32), axis=0) + n_side - 1
            tl.store(side_ptr + row * B + at, j.to(tl.int32), mask=side)
            n_group += tl.sum(same.to(tl.int32), axis=0)
            n_side += tl.sum(side.to(tl.int32), axis=0)
            n_pos += tl.sum((same & flag).to(tl.int32), axis=0)
        tl.store(count_ptr + row * 3, n_group)
        tl.store(count_ptr + row * 3 + 1, n_side)
        tl.store(count_ptr + row * 3 + 2, n_pos)
        count = tl.zeros((), dtype=tl.int32)
        for start in range(0, T, BLOCK):
            col, inside, valid, h = _row_block(ent_ptr, mask_ptr, row, start, T, s_eb, s_et,
                                               s_mb, s_mt, BLOCK)
            h = h.to(tl.float64)
            hc = tl.where(h < 0.0, 0.0, h)  # as the eager path: NaN stays NaN, -inf is NaN below
            v = tl.where(win, hc, 1.0 / (hc + eps))
            v = tl.where(tl.abs(h) == float("inf"), float("nan"), v)
            count = _to_front(x_ptr, pos_ptr, row, T, col, inside, valid, v, count)
        tl.store(len_ptr + row, count)

    @triton.jit
    def _gtpo_shape_kernel(x_ptr, pos_ptr, len_ptr, side_ptr, count_ptr, pos_flag_ptr,  # noqa: N803
                           mask_ptr, r_ptr, part_ptr, B, T, n_tiles, s_p, s_mb, s_mt, alpha1_bits,
                           alpha2_bits, SIDE: tl.constexpr, TILE: tl.constexpr):  # noqa: N803
        """Eqs. 3 and 5 at each valid token (float64; 0 where masked): the token's share of its
        side's values at its position, times the side's rows there; each tile's sums of the
        rewards and of their squares, for the standardisation. By side, the sums are of
        ``r ∓ (α1 + α2)``, each side's mean, so that ``E[r²] - mean²`` cancels nothing."""
        row = tl.program_id(0).to(tl.int64)
        tile = tl.program_id(1)
        col, inside, valid, p = _tile(mask_ptr, pos_ptr, row, tile, T, s_mb, s_mt, TILE)
        total = tl.zeros((TILE,), dtype=tl.float64)
        active = tl.zeros((TILE,), dtype=tl.float64)
        bad = tl.zeros((TILE,), dtype=tl.int32)
        n_side = tl.load(count_ptr + row * 3 + 1)
        for m in range(0, n_side):
            j = tl.load(side_ptr + row * B + m).to(tl.int64)
            on = valid & (p < tl.load(len_ptr + j))
            v = tl.load(x_ptr + j * T + p, mask=on, other=0.0)
            finite = (v == v) & (tl.abs(v) < float("inf"))
            bad += (on & ~finite).to(tl.int32)
            total += tl.where(finite, v, 0.0)
            active += on.to(tl.float64)
        total = tl.where(bad > 0, float("nan"), total)  # NaN stays NaN, never uniform
        x = tl.load(x_ptr + row * T + p, mask=valid, other=0.0)
        share = tl.where(total > 0.0, x / tl.where(total > 0.0, total, 1.0) * active,
                         tl.where(total != total, float("nan"), 1.0))
        sign = tl.where(tl.load(pos_flag_ptr + row * s_p) != 0, 1.0, -1.0).to(tl.float64)
        alpha1 = _f64(alpha1_bits)
        alpha2 = _f64(alpha2_bits)
        r = tl.where(valid, sign * (alpha1 + alpha2 * share), 0.0)
        tl.store(r_ptr + row * T + col, r, mask=inside)
        if SIDE:
            r = tl.where(valid, r - sign * (alpha1 + alpha2), 0.0)
        tl.store(part_ptr + (row * n_tiles + tile) * 2, tl.sum(r, axis=0))
        tl.store(part_ptr + (row * n_tiles + tile) * 2 + 1, tl.sum(r * r, axis=0))

    @triton.jit
    def _gtpo_standardize_kernel(r_ptr, part_ptr, len_ptr, list_ptr, count_ptr, mask_ptr,  # noqa: N803
                                 pos_flag_ptr, out_ptr, B, T, n_tiles, s_p, s_mb, s_mt,
                                 alpha_bits, SIDE: tl.constexpr, TILE: tl.constexpr):  # noqa: N803
        """Eq. 6: the rewards less their mean over the group's (or side's) valid tokens, over
        their population std + 1e-6; 0 in a group that all succeeded or all failed."""
        row = tl.program_id(0).to(tl.int64)
        col = tl.program_id(1).to(tl.int64) * TILE + tl.arange(0, TILE)
        inside = col < T
        if SIDE:
            n_unit = tl.load(count_ptr + row * 3 + 1)
        else:
            n_unit = tl.load(count_ptr + row * 3)
        tokens = tl.zeros((), dtype=tl.float64)
        s1 = tl.zeros((), dtype=tl.float64)
        s2 = tl.zeros((), dtype=tl.float64)
        for m in range(0, n_unit):
            j = tl.load(list_ptr + row * B + m).to(tl.int64)
            tokens += tl.load(len_ptr + j).to(tl.float64)
            for start in range(0, n_tiles, TILE):
                k = start + tl.arange(0, TILE)
                at = part_ptr + (j * n_tiles + k) * 2
                s1 += tl.sum(tl.load(at, mask=k < n_tiles, other=0.0), axis=0)
                s2 += tl.sum(tl.load(at + 1, mask=k < n_tiles, other=0.0), axis=0)
        tokens = tl.maximum(tokens, 1.0)
        mean = s1 / tokens
        std = tl.sqrt(tl.maximum(s2 / tokens - mean * mean, 0.0))
        if SIDE:  # the sums were of r less the side's mean ±(α1 + α2)
            mean += tl.where(tl.load(pos_flag_ptr + row * s_p) != 0, 1.0, -1.0) * _f64(alpha_bits)
        n_group = tl.load(count_ptr + row * 3)
        n_pos = tl.load(count_ptr + row * 3 + 2)
        mixed = (n_pos > 0) & (n_pos < n_group)
        valid = tl.load(mask_ptr + row * s_mb + col * s_mt, mask=inside, other=0) != 0
        r = tl.load(r_ptr + row * T + col, mask=inside, other=0.0)
        x = (r - mean) / (std + 1e-6)
        out = tl.where(valid, tl.where(mixed, x, x - x), 0.0)  # a NaN stays NaN, unmixed too
        tl.store(out_ptr + row * T + col, out.to(tl.float32), mask=inside)


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
        with _on(ent.device):
            _entropy_bonus_kernel[(b, triton.cdiv(t, _BLOCK))](
                adv, ent, mask, out, t, adv.stride(0), ent.stride(0), ent.stride(1),
                mask.stride(0), mask.stride(1), float(alpha), float(inv_kappa), BLOCK=_BLOCK)
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
    out = torch.empty((b, t), dtype=torch.float32, device=ent.device)  # all of it written
    if not (b and t):
        return out
    e, part, lengths = _window_stats(ent, mask, window, temperature, wide_range)
    flags = adv if positive is None else positive
    with _on(ent.device):
        _weight_kernel[(b, part.shape[1])](e, part, lengths, adv, flags, mask, out, t,
                                           part.shape[1], adv.stride(0), flags.stride(0),
                                           mask.stride(0), mask.stride(1),
                                           ALL_ROWS=positive is None, TILE=_TILE)
    return out


def _window_stats(ent: torch.Tensor, mask: torch.Tensor, window: int,
                  temperature: Optional[float], wide_range: float,
                  counts: Optional[torch.Tensor] = None, radix: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every valid token's windowed statistic (``[B, T]`` fp32, 0 where masked), the sums of
    its tiles (``[B, tiles]``) and the rows' lengths (``[B]`` int32): two launches. Given
    ``global_topk``'s ``counts`` (uninitialised: they are zeroed here), the statistic is the
    select's input instead (-inf where masked, no tile sums; see :func:`_topk_scores`)."""
    b, t = ent.shape
    proximal = temperature is not None
    scale = 1.0 / temperature if temperature is not None else 1.0
    n_tiles = triton.cdiv(t, _TILE)
    x = torch.empty((b, t), dtype=torch.float32, device=ent.device)
    pos = torch.empty((b, t), dtype=torch.int32, device=ent.device)
    e = torch.empty((b, t), dtype=torch.float32, device=ent.device)
    part = torch.empty((b, n_tiles), dtype=torch.float32, device=ent.device)
    lengths = torch.empty(b, dtype=torch.int32, device=ent.device)
    n_chunks = triton.cdiv(t, _CHUNK)
    stat = torch.empty((b, n_chunks, 3) if proximal else (1,), dtype=torch.float32,
                       device=ent.device)
    with _on(ent.device):
        n_counts = 0 if counts is None else counts.numel()
        count_arg = lengths if counts is None else counts  # without counts: a pointer unread
        _compact_kernel[(b, n_chunks)](ent, mask, x, pos, lengths, stat, count_arg, t, n_chunks,
                                       n_counts, ent.stride(0), ent.stride(1), mask.stride(0),
                                       mask.stride(1), float(scale), PROXIMAL=proximal,
                                       ZERO=triton.next_power_of_2(n_counts) if n_counts else 0,
                                       BLOCK=_BLOCK, CHUNK=_CHUNK)
        _window_kernel[(b, n_tiles)](x, pos, lengths, stat, mask, e, part, count_arg, t, n_tiles,
                                     n_chunks, mask.stride(0), mask.stride(1), int(window),
                                     1.0 / window, float(scale), float(wide_range),
                                     PROXIMAL=proximal,
                                     TOPK=0 if counts is None else 1 + bool(radix), TILE=_TILE)
    return e, part, lengths


def global_topk(adv: torch.Tensor, ent: torch.Tensor, mask: torch.Tensor, q: float,
                selected_tokens: bool, window: int = 0,
                temperature: Optional[float] = None, wide_range: float = math.inf
                ) -> torch.Tensor:
    """``global_topk`` in one process as :mod:`pepo.weighting` computes it: ``A_i`` at the
    valid tokens whose score is ``>= torch.quantile(valid scores, q)`` (ties included), 0
    elsewhere; the score is the entropy, or with ``temperature`` given Eq. 6's proximal entropy.
    No value is read on the host. The scores are written as one fp32 row with their counts (by
    a launch of their own after the counts' zeroing, or for the proximal score by the window
    kernels, which zero the counts too); the threshold is found by a radix select (the order
    keys histogrammed a byte at a time: the top byte with the scores, three passes more; with
    ``PEPO_TOPK_SELECT=radix12`` two passes of 12 bits), or with ``PEPO_TOPK_SELECT=sort`` read
    off one ``torch.sort`` of that row; one launch applies it. With ``selected_tokens`` the
    selected advantages are scaled by ``N_valid / N_selected``. ``[B, T]`` fp32."""
    b, t = ent.shape
    out = torch.empty((b, t), dtype=torch.float32, device=ent.device)  # all of it written
    if not (b and t):
        return out
    n_tiles = triton.cdiv(t, _BLOCK)
    digit = _TOPK_DIGITS.get(_TOPK_SELECT)
    if digit is None:
        raise ValueError(f"PEPO_TOPK_SELECT={_TOPK_SELECT!r}: expected 'radix' (the default), "
                         f"'radix12' or 'sort'")
    radix = digit > 0
    if radix and not _HIST_BLOCK:
        _hist_setting(_HIST)  # raises, naming the value
    # valid, non-finite valid; with radix, the keys' top byte's histogram and each pass's
    # int64: a batch of 2^31 valid tokens or more would wrap an int32 count
    n_counts = 2 + (256 + 24 // digit * 2**digit if radix else 0)
    if temperature is None:
        counts = torch.zeros(n_counts, dtype=torch.int64, device=ent.device)
        flat = torch.empty((b, t), dtype=torch.float32, device=ent.device)
        with _on(ent.device):
            _topk_prep_kernel[(b, n_tiles)](ent, mask, flat, counts, t, ent.stride(0),
                                            ent.stride(1), mask.stride(0), mask.stride(1),
                                            RADIX=radix, BLOCK=_BLOCK)
    else:  # the window kernel writes the select's input and counts (zeroed by the compaction)
        counts = torch.empty(n_counts, dtype=torch.int64, device=ent.device)
        flat = _window_stats(ent, mask, window, temperature, wide_range, counts, radix)[0]
    with _on(ent.device):
        if radix:
            for p in range(1, 1 + 24 // digit):
                _radix_hist_kernel[(triton.cdiv(b * t, _HIST_BLOCK),)](
                    flat, counts, b * t, _bits(q), PASS=p, DIGIT=digit, BLOCK=_HIST_BLOCK,
                    num_warps=_HIST_WARPS)
            _topk_radix_apply_kernel[(b, n_tiles)](flat, counts, adv, mask, out, t,
                                                   adv.stride(0), mask.stride(0),
                                                   mask.stride(1), _bits(q),
                                                   SELECTED=bool(selected_tokens), DIGIT=digit,
                                                   BLOCK=_BLOCK)
            return out
        ordered = torch.sort(flat.view(-1), descending=True).values
        _topk_apply_kernel[(b, n_tiles)](flat, ordered, counts, adv, mask, out, t,
                                         adv.stride(0), mask.stride(0), mask.stride(1),
                                         _bits(q), SELECTED=bool(selected_tokens),
                                         BLOCK=_BLOCK)
    return out


def gtpo(ent: torch.Tensor, mask: torch.Tensor, positive: torch.Tensor, groups: torch.Tensor,
         alpha1: float, alpha2: float, eps: float, side: bool) -> torch.Tensor:
    """GTPO's token advantages as :mod:`pepo._gtpo` computes them (Eqs. 3, 5 and 6, float64,
    ``[B, T]`` fp32 out) in three launches: each row's group and side as lists and its values
    compacted; the shaped rewards with each tile's sums; their standardisation over the group
    (``side=False``) or the side. The standardisation's variance is ``E[r²] - mean²`` in
    float64, where the PyTorch body takes a second pass."""
    b, t = ent.shape
    out = torch.empty((b, t), dtype=torch.float32, device=ent.device)  # all of it written
    if not (b and t):
        return out
    dev = ent.device
    n_tiles = triton.cdiv(t, _TILE)
    x = torch.empty((b, t), dtype=torch.float64, device=dev)
    r = torch.empty((b, t), dtype=torch.float64, device=dev)
    pos = torch.empty((b, t), dtype=torch.int32, device=dev)
    lists = torch.empty((2, b, b), dtype=torch.int32, device=dev)  # side's rows, group's rows
    counts = torch.empty((b, 3), dtype=torch.int32, device=dev)  # group, side, successes
    lengths = torch.empty(b, dtype=torch.int32, device=dev)
    part = torch.empty((b, n_tiles, 2), dtype=torch.float64, device=dev)
    with _on(dev):
        _gtpo_rows_kernel[(b,)](ent, mask, positive, groups, x, pos, lengths, lists[0], lists[1],
                                counts, b, t, ent.stride(0), ent.stride(1), mask.stride(0),
                                mask.stride(1), positive.stride(0), groups.stride(0),
                                _bits(eps), BLOCK=_BLOCK)
        _gtpo_shape_kernel[(b, n_tiles)](x, pos, lengths, lists[0], counts, positive, mask, r,
                                         part, b, t, n_tiles, positive.stride(0),
                                         mask.stride(0), mask.stride(1), _bits(alpha1),
                                         _bits(alpha2), SIDE=bool(side), TILE=_TILE)
        _gtpo_standardize_kernel[(b, n_tiles)](r, part, lengths, lists[0] if side else lists[1],
                                               counts, mask, positive, out, b, t, n_tiles,
                                               positive.stride(0), mask.stride(0),
                                               mask.stride(1), _bits(alpha1 + alpha2),
                                               SIDE=bool(side), TILE=_TILE)
    return out


def _bits(x: float) -> int:
    """A float64's bits as a Python int, for a kernel's :func:`_f64` (exact, where a Python
    float argument would reach the kernel rounded to fp32)."""
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _on(device: torch.device) -> Any:
    """Triton launches on the current CUDA device: make it the tensors' one."""
    if device.type == "cuda" and device.index != torch.cuda.current_device():
        return torch.cuda.device(device)
    return contextlib.nullcontext()
