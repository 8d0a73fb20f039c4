"""Centred windows over each row's valid tokens: the kernels behind :mod:`pepo.weighting`.

Every function here works on *cleaned* entropies: fp32, 0 where ``mask`` is False (see
:func:`clean`), so padding contents never reach the arithmetic.

* :class:`Rows` moves each row's valid values to the front (a row with holes in its mask then
  behaves exactly as the compacted row) and :meth:`Rows.expand` maps results back.
* :func:`padded_buffer` reflect-pads each compact row at its own ends, exactly as
  ``numpy.pad(mode="reflect")`` does, repeatedly for rows shorter than ``W // 2``.
* :func:`window_sum` / :func:`window_logsumexp` give every centred window's sum in O(B·T) with
  a two-block scan: split the padded row into blocks of ``W``; every window spans at most two
  adjacent blocks, so its sum is a suffix sum of the first block plus a prefix sum of the
  second. Each sum adds at most ``W`` terms, so it is as accurate as the direct sum at any row
  length (a global cumulative sum would lose digits to cancellation on 32k-token rows). No
  ``[B, T, W]`` tensor is created.
* :func:`proximal` is Eq. (6); :func:`window_average` its softmax-free counterpart
  ``H_t / Σ_{k∈W(t)} H_k`` (the ``window_average`` strategy's statistic).
"""

from __future__ import annotations

import contextlib
import math
import threading
from typing import Callable, Iterator, Optional

import torch

__all__: list[str] = []

# exp(-80) ~ 1.8e-35 is still a normal fp32 number; a row whose scaled entropies span more than
# this could underflow a whole window to 0 in the shifted-exp path.
EXP_SAFE_RANGE = 80.0

# The entropy of a distribution over V tokens is at most log V: 24 nats is a vocabulary of
# 2.6e10 tokens. Where EXP_SAFE_RANGE * τ covers this span the shifted exp is exact for every
# real entropy, so :func:`proximal` chooses its path from the temperature, on no value.
ENTROPY_SPAN = 24.0

# Entropies computed in fp32 can come out a few ulps below 0; the linear statistic treats
# values down to this as 0 and refuses anything more negative (an entropy is never negative).
NEGATIVE_TOLERANCE = 1e-4


def negative_entropy_message(minimum: float) -> str:
    return (f"entropies must be >= 0 (an entropy is never negative), got a valid value of "
            f"{float(minimum):.6g}")


def clean(entropies: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """fp32 copy with 0 at masked positions: padding contents (NaN included) go no further."""
    return torch.where(mask, entropies.float(), 0.0)


def reflect_index(j: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Maps positions ``j`` (any integer, broadcast against ``lengths``) into ``[0, L)``.

    Matches ``numpy.pad(mode="reflect")``, which for pads longer than the row reflects again:
    the padded row is periodic with period ``2 (L - 1)``; a row of length 1 repeats itself.
    Empty rows (``L = 0``) map everything to 0, a harmless in-bounds index.
    """
    lengths = lengths.clamp_min(1)
    period = (2 * (lengths - 1)).clamp_min(1)
    j = torch.remainder(j, period)
    return torch.where(j > lengths - 1, period - j, j)


class Rows:
    """A batch with each row's valid values moved to the front.

    Attributes:
        x: ``[B, T]`` fp32; row ``i`` holds its ``L_i`` valid values in order, then values no
            valid token's window reaches.
        lengths: ``[B]`` int64, ``L_i``.
        pos: ``[B, T]`` int64, for each original position the index of its value in ``x``.

    The compaction runs whatever the mask (a prefix mask included): deciding that it could be
    skipped would read the mask on the host.
    """

    def __init__(self, clean: torch.Tensor, mask: torch.Tensor):
        self.lengths = mask.sum(dim=1)  # [B]
        b, t = mask.shape
        pos = mask.long().cumsum(dim=1) - 1  # [B, T]
        buf = clean.new_zeros(b, t + 1)  # column t is a sink for masked positions
        buf.scatter_(1, torch.where(mask, pos, t), clean)
        self.x = buf[:, :t]
        self.pos = pos.clamp_min(0)

    def expand(self, compact: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Maps a ``[B, T]`` result on compact positions back to the original positions."""
        return torch.where(mask, compact.gather(1, self.pos), 0.0)


def padded_buffer(x: torch.Tensor, lengths: torch.Tensor, window: int,
                  scale: float) -> torch.Tensor:
    """``[B, T]`` compact rows (times ``scale``) -> ``[B, nb * W]`` reflect-padded at their ends.

    Position ``p`` holds ``scale * x[reflect(p - half, L_i)]`` for ``p < L_i + 2 half``; later
    positions hold values no valid token's window reaches. The width is rounded up to a
    multiple of ``W`` for the block scan.
    """
    b, t = x.shape
    half = window // 2
    nb = -(-(t + 2 * half) // window)
    buf = x.new_zeros(b, nb * window)
    mid = buf[:, half : half + t]
    # copy, then scale in place: at torch.mul(x, scale, out=mid) torch.compile broke its graph
    # (an out= view), and inductor then fixed the buffer's size to the first batch's shape
    mid.copy_(x)
    if scale != 1.0:
        mid.mul_(scale)
    if half:
        offs = torch.arange(half, device=x.device)  # [h]
        lengths = lengths[:, None]
        left = reflect_index(offs[None, :] - half, lengths)  # [B, h]
        buf[:, :half] = mid.gather(1, left)
        right_j = lengths + offs[None, :]  # [B, h]: row positions L .. L + h - 1
        buf.scatter_(1, right_j + half, mid.gather(1, reflect_index(right_j, lengths)))
    return buf


def _block_scans(buf: torch.Tensor, window: int, scan_fn: Callable[[torch.Tensor], torch.Tensor]):
    b = buf.shape[0]
    blocks = buf.view(b, -1, window)  # [B, nb, W]
    prefix = scan_fn(blocks)
    suffix = scan_fn(blocks.flip(-1)).flip(-1)
    return prefix, suffix


def window_sum(buf: torch.Tensor, window: int, t: int) -> torch.Tensor:
    """``S[:, s] = buf[:, s : s + W].sum(-1)`` for ``s < t``, in O(B·T) (two-block scan).

    ``buf``'s width must be a multiple of ``W`` and at least ``t + W - 1``.
    """
    b = buf.shape[0]
    prefix, suffix = _block_scans(buf, window, lambda z: z.cumsum(-1))
    # A window starting on a block boundary is that block alone; any other window ends inside
    # the next block, whose prefix completes it. Zeroing each block's full-block prefix (the
    # one a boundary-aligned window would add twice) makes one addition serve both cases.
    prefix[..., window - 1] = 0.0
    prefix, suffix = prefix.view(b, -1), suffix.view(b, -1)
    return suffix[:, :t] + prefix[:, window - 1 : window - 1 + t]


def window_logsumexp(buf: torch.Tensor, window: int, t: int) -> torch.Tensor:
    """Log-domain twin of :func:`window_sum`: ``logsumexp(buf[:, s : s + W])``."""
    b = buf.shape[0]
    prefix, suffix = _block_scans(buf, window, lambda z: torch.logcumsumexp(z, -1))
    prefix[..., window - 1] = -math.inf
    prefix, suffix = prefix.view(b, -1), suffix.view(b, -1)
    return torch.logaddexp(suffix[:, :t], prefix[:, window - 1 : window - 1 + t])


def proximal_compact(
    rows: Rows, window: int, temperature: float, exact_log: bool,
    shift: Optional[torch.Tensor],
) -> torch.Tensor:
    """Eq. (6) on compact rows: ``e_t = exp(H_t/τ) / Σ_{k∈W(t)} exp(H_k/τ)``. ``[B, T]``.

    ``shift`` (``[B]``, at least each row's largest ``H/τ``) keeps ``exp`` from overflowing; the
    softmax is invariant to it. The exact path works in log space and ignores it.
    """
    half = window // 2
    t = rows.x.shape[1]
    buf = padded_buffer(rows.x, rows.lengths, window, 1.0 / temperature)  # [B, nb*W]
    if exact_log:
        x = buf[:, half : half + t]
        return torch.exp(x - window_logsumexp(buf, window, t))
    assert shift is not None, "the exp path needs each row's shift"
    buf.sub_(shift[:, None]).exp_()
    return buf[:, half : half + t] / window_sum(buf, window, t)


def _empty(mask: torch.Tensor) -> torch.Tensor:
    return torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)


_LOCAL = threading.local()  # .exact: inside exact_windows, in this thread (torch.compile
# guards on it as on a global)


@contextlib.contextmanager
def exact_windows() -> Iterator[None]:
    """Within it, :func:`proximal` takes the log-domain path at every temperature: the redo of a
    call whose rows were too wide for the shifted exp (see :func:`proximal`). Per thread: a
    redo in one thread leaves the path of another thread's calls as it was (a module global
    was left set when two threads' redos overlapped)."""
    before = getattr(_LOCAL, "exact", False)
    _LOCAL.exact = True
    try:
        yield
    finally:
        _LOCAL.exact = before


def _exact() -> bool:
    """Whether this thread is inside :func:`exact_windows`."""
    return getattr(_LOCAL, "exact", False)


def proximal(clean: torch.Tensor, mask: torch.Tensor, window: int,
             temperature: float) -> torch.Tensor:
    """Proximal entropy (Eq. 6) of cleaned entropies. ``[B, T]``, 0 where masked.

    Reads no value on the host. The path is chosen from the temperature alone: where
    ``EXP_SAFE_RANGE * τ`` covers ``ENTROPY_SPAN`` (every entropy of a real vocabulary) the
    shifted exp, else the exact log-domain path. A row whose ``H/τ`` range exceeds what the
    shifted exp holds (entropies above ``ENTROPY_SPAN`` nats, which no vocabulary has) comes out
    NaN rather than imprecise; the validating callers then redo the call inside
    :func:`exact_windows`, which gives the exact values.
    """
    if mask.numel() == 0:
        return _empty(mask)
    rows = Rows(clean, mask)
    if _exact() or EXP_SAFE_RANGE * temperature < ENTROPY_SPAN:
        return rows.expand(proximal_compact(rows, window, temperature, True, None), mask)
    lo, hi = torch.aminmax(clean, dim=1)  # [B] each, padding zeros included (an over-estimate)
    e = proximal_compact(rows, window, temperature, False, hi / temperature)
    wide = (hi - lo) > EXP_SAFE_RANGE * temperature  # [B]
    return rows.expand(torch.where(wide[:, None], math.nan, e), mask)


def window_average(clean: torch.Tensor, mask: torch.Tensor, window: int) -> torch.Tensor:
    """``r_t = H_t / Σ_{k∈W(t)} H_k`` of cleaned entropies, ``1/W`` where the window sums to 0.

    ``[B, T]``, 0 where masked. Reads no value on the host: valid entropies below 0 count as 0
    here, and the validating callers refuse those below ``-NEGATIVE_TOLERANCE``.
    """
    if mask.numel() == 0:
        return _empty(mask)
    rows = Rows(clean.clamp_min(0.0), mask)
    t = rows.x.shape[1]
    total = window_sum(padded_buffer(rows.x, rows.lengths, window, 1.0), window, t)  # [B, T]
    positive = total > 0
    empty = torch.where(total == 0, 1.0 / window, math.nan)  # a NaN total stays NaN
    r = torch.where(positive, rows.x / torch.where(positive, total, 1.0), empty)
    r = torch.where(torch.isinf(total), math.nan, r)  # an inf in the window: NaN, never x/inf = 0
    return rows.expand(r, mask)
