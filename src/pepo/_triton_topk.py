"""``global_topk``'s Triton kernels (:func:`pepo._triton.global_topk` launches them): the
scores written as one fp32 row with their counts, the threshold by a radix select over the
scores' order keys (the top byte's histogram, then a byte's or 12 bits' a pass) or read off
a sort of that row, and the selection applied; and :func:`f64`, the float64-by-its-bits
argument every kernel of :mod:`pepo._triton` reads. Imported by :mod:`pepo._triton` alone,
where Triton is installed.
"""

from __future__ import annotations

try:  # optional, as in pepo._triton (which imports this module only where Triton is)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where Triton is missing
    triton = None
    tl = None

if triton is not None:

    @triton.jit
    def f64(bits):
        """A float64 argument passed as its bits (Triton would round a Python float to fp32):
        an int64, or an int32 where the bits fit (Triton types small ints so)."""
        return bits.to(tl.int64).to(tl.float64, bitcast=True)

    @triton.jit
    def topk_prep_kernel(s_ptr, mask_ptr, flat_ptr, count_ptr, T,  # noqa: N803
                         s_sb, s_st, s_mb, s_mt,
                         RADIX: tl.constexpr, BLOCK: tl.constexpr):  # noqa: N803
        """The scores as one fp32 row for the sort (-inf where masked, -0.0 as +0.0); the
        numbers of valid tokens and of valid non-finite scores, added to ``count``; with
        ``RADIX`` also the histogram of the keys' top byte (``count[2:258]``)."""
        row = tl.program_id(0).to(tl.int64)
        tile = tl.program_id(1)
        col = tile.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = col < T
        valid = tl.load(mask_ptr + row * s_mb + col * s_mt, mask=inside, other=0) != 0
        v = tl.load(s_ptr + row * s_sb + col * s_st, mask=valid, other=0.0).to(tl.float32)
        topk_scores(v, valid, inside, flat_ptr + row * T + col, count_ptr, RADIX)

    @triton.jit
    def topk_scores(v, valid, inside, flat_ptr, count_ptr, RADIX: tl.constexpr):  # noqa: N803
        """A block of scores as the select reads them: stored at ``flat_ptr`` (-inf where
        masked, -0.0 as +0.0), the valid and the valid non-finite ones counted into
        ``count[0:2]``, with ``RADIX`` the keys' top byte into ``count[2:258]``."""
        v = tl.where(valid, v + 0.0, float("-inf"))
        tl.store(flat_ptr, v, mask=inside)
        bad = valid & ~((v == v) & (tl.abs(v) < float("inf")))
        tl.atomic_add(count_ptr, tl.sum(valid.to(tl.int32), axis=0).to(tl.int64))
        tl.atomic_add(count_ptr + 1, tl.sum(bad.to(tl.int32), axis=0).to(tl.int64))
        if RADIX:
            _add_histogram(count_ptr + 2, (_order_key(v) >> 24).to(tl.int32), inside, 256)

    @triton.jit
    def _order_key(v):
        """fp32 as a uint32 whose unsigned order is the floats' (-inf lowest, -0.0 < +0.0)."""
        b = v.to(tl.uint32, bitcast=True)
        return tl.where((b >> 31) != 0, b ^ 0xFFFFFFFF, b | 0x80000000)

    @triton.jit
    def _add_histogram(hist_ptr, digit, keep, BINS: tl.constexpr):  # noqa: N803
        """``digit``'s counts where ``keep``, added to ``BINS`` counts at ``hist_ptr``: a
        histogram of the program's block, then one atomic add a bin; over 256 bins one atomic
        add a key instead (a 4,096-bin ``tl.histogram`` takes every register a thread has)."""
        if BINS <= 256:
            h = tl.histogram(digit, BINS, mask=keep)
            tl.atomic_add(hist_ptr + tl.arange(0, BINS), h.to(tl.int64), mask=h > 0)
        else:
            tl.atomic_add(hist_ptr + digit, tl.full(digit.shape, 1, tl.int64), mask=keep)

    @triton.jit
    def _radix_level(hist_ptr, k, above, prefix, BITS: tl.constexpr):  # noqa: N803
        """The next ``BITS`` bits of the ``k``-th largest key, from their histogram (``2^BITS``
        counts at ``hist_ptr``), appended to ``prefix``; ``above`` plus the keys above it. The
        counts are read in slices of 256 from the top (radix12's apply kernel held two 4,096-count
        levels whole, with their cumulative sums: 226 registers a thread on sm_90, 158 so)."""
        SLICE: tl.constexpr = min(256, 1 << BITS)  # noqa: N806
        N: tl.constexpr = (1 << BITS) // SLICE  # noqa: N806
        need = k - above
        higher = tl.zeros((), dtype=tl.int64)  # the keys of the slices above this one
        digit = tl.zeros((), dtype=tl.int32)
        for i in tl.static_range(N):  # the largest digit with at least `need` keys at or above
            d = (N - 1 - i) * SLICE + tl.arange(0, SLICE)
            h = tl.load(hist_ptr + d).to(tl.int64)
            total = tl.sum(h, axis=0)
            at_least = higher + total - tl.cumsum(h, axis=0) + h  # keys of this digit or more
            digit = tl.maximum(digit, tl.max(tl.where(at_least >= need, d, 0), axis=0))
            higher += total
        for i in tl.static_range(N):
            d = i * SLICE + tl.arange(0, SLICE)
            h = tl.load(hist_ptr + d).to(tl.int64)
            above += tl.sum(tl.where(d > digit, h, 0), axis=0)
        return (prefix << BITS) | digit.to(tl.uint32), above

    @triton.jit
    def _radix_state(hist_ptr, count_ptr, q_bits, PASSES: tl.constexpr,  # noqa: N803
                     DIGIT: tl.constexpr):  # noqa: N803
        """After ``PASSES`` histograms (at ``hist_ptr``: the keys' top byte, 256 counts, then
        ``DIGIT`` bits a pass, ``2^DIGIT`` counts, each counting the keys whose higher bits are
        the chosen ones): the top ``8 + DIGIT · (PASSES - 1)`` bits of the ``k``-th largest key
        (``k`` as ``keep_count`` counts it), the keys above it among those and the valid
        count ``n``."""
        n = tl.load(count_ptr).to(tl.int64)
        k = n - tl.ceil((n - 1).to(tl.float64) * f64(q_bits)).to(tl.int64)
        prefix, above = _radix_level(hist_ptr, k, tl.zeros((), dtype=tl.int64),
                                     tl.zeros((), dtype=tl.uint32), 8)
        for p in tl.static_range(1, PASSES):
            prefix, above = _radix_level(hist_ptr + 256 + (p - 1) * (1 << DIGIT), k, above,
                                         prefix, DIGIT)
        return prefix, above, n

    @triton.jit
    def radix_hist_kernel(flat_ptr, count_ptr, N, q_bits,  # noqa: N803
                          PASS: tl.constexpr, DIGIT: tl.constexpr,  # noqa: N803
                          BLOCK: tl.constexpr):  # noqa: N803
        """The histogram of the keys' ``DIGIT`` bits after the top ``8 + DIGIT · (PASS - 1)``,
        over the keys whose higher bits are the ``k``-th largest key's, as the earlier passes
        chose them."""
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = i < N
        key = _order_key(tl.load(flat_ptr + i, mask=inside, other=float("-inf")))
        prefix, _, _ = _radix_state(count_ptr + 2, count_ptr, q_bits, PASS, DIGIT)
        done: tl.constexpr = 8 + DIGIT * (PASS - 1)  # the bits chosen before this pass
        match = inside & ((key >> (32 - done)) == prefix)
        digit = ((key >> (32 - done - DIGIT)) & ((1 << DIGIT) - 1)).to(tl.int32)
        _add_histogram(count_ptr + 2 + 256 + (PASS - 1) * (1 << DIGIT), digit, match,
                       1 << DIGIT)

    @triton.jit
    def topk_radix_apply_kernel(flat_ptr, count_ptr, adv_ptr, mask_ptr, out_ptr, T,  # noqa: N803
                                s_a, s_mb, s_mt, q_bits, SELECTED: tl.constexpr,  # noqa: N803
                                DIGIT: tl.constexpr, BLOCK: tl.constexpr):  # noqa: N803
        """:func:`topk_apply_kernel` with the threshold from the histograms (the top byte's,
        then ``24 / DIGIT`` passes'): the ``k``-th largest key itself, and ``N_selected`` the
        keys above it plus its ties."""
        row = tl.program_id(0).to(tl.int64)
        col = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = col < T
        passes: tl.constexpr = 24 // DIGIT
        threshold, above, n = _radix_state(count_ptr + 2, count_ptr, q_bits, 1 + passes, DIGIT)
        finite = tl.load(count_ptr + 1) == 0
        valid = tl.load(mask_ptr + row * s_mb + col * s_mt, mask=inside, other=0) != 0
        key = _order_key(tl.load(flat_ptr + row * T + col, mask=inside, other=float("-inf")))
        a = tl.load(adv_ptr + row * s_a).to(tl.float32)
        out = tl.where((key >= threshold) & (n > 0), a, a - a)  # a NaN/inf A stays NaN
        if SELECTED:
            last = count_ptr + 2 + 256 + (passes - 1) * (1 << DIGIT)  # the last histogram
            ties = tl.load(last + (threshold & ((1 << DIGIT) - 1)).to(tl.int32))
            scale = (n.to(tl.float64) / (above + ties).to(tl.float64)).to(tl.float32)
            out = out * tl.where(n > 0, scale, 1.0)
        out = tl.where(finite | (n == 0), out, float("nan"))
        tl.store(out_ptr + row * T + col, tl.where(valid, out, 0.0), mask=inside)

    @triton.jit
    def topk_apply_kernel(flat_ptr, ordered_ptr, count_ptr, adv_ptr,  # noqa: N803
                          mask_ptr, out_ptr, T, s_a, s_mb, s_mt, q_bits,
                          SELECTED: tl.constexpr, BLOCK: tl.constexpr):  # noqa: N803
        """``A_i`` where the score is at least the ``k``-th largest valid score (``k`` as
        :func:`pepo._topk.keep_count` counts it, ties included), 0 elsewhere; NaN at every
        valid token if a valid score is NaN or ±inf; with ``SELECTED`` times
        ``N_valid / N_selected``."""
        row = tl.program_id(0).to(tl.int64)
        col = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = col < T
        n = tl.load(count_ptr).to(tl.int64)
        finite = tl.load(count_ptr + 1) == 0
        q = f64(q_bits)
        k = n - tl.ceil((n - 1).to(tl.float64) * q).to(tl.int64)
        last = tl.maximum(n - 1, 0)
        threshold = tl.load(ordered_ptr + tl.maximum(k - 1, 0))
        valid = tl.load(mask_ptr + row * s_mb + col * s_mt, mask=inside, other=0) != 0
        v = tl.load(flat_ptr + row * T + col, mask=inside, other=float("-inf"))
        a = tl.load(adv_ptr + row * s_a).to(tl.float32)
        out = tl.where((v >= threshold) & (n > 0), a, a - a)  # a NaN/inf A stays NaN
        if SELECTED:  # N_selected: the last sorted index still >= the threshold, by bisection
            lo = tl.maximum(k - 1, 0)
            hi = last
            for _ in range(0, 32):
                mid = (lo + hi + 1) // 2
                up = tl.load(ordered_ptr + mid) >= threshold
                lo = tl.where(up, mid, lo)
                hi = tl.where(up, hi, mid - 1)
            scale = (n.to(tl.float64) / (lo + 1).to(tl.float64)).to(tl.float32)
            out = out * tl.where(n > 0, scale, 1.0)
        out = tl.where(finite | (n == 0), out, float("nan"))
        tl.store(out_ptr + row * T + col, tl.where(valid, out, 0.0), mask=inside)
