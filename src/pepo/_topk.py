"""Batch-global top-k selection for ``global_topk`` (80/20): the threshold over every valid token
of the batch, and of every rank of a process group, never per row.

Nothing here reads a value on the host: counts stay on the device, the number of tokens to keep
is computed there, and the threshold is read off a descending sort of the batch (one process;
on a CPU a ``topk`` of the shape's bound, :func:`full_sort`) or found by a bisection over the
scores' bit patterns, one ``all_reduce`` of a count per bit (a process group, where the ranks'
batches differ in size).
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

__all__: list[str] = []


def keep_count(n: torch.Tensor, q: float) -> torch.Tensor:
    """How many of ``n`` scores ``s >= torch.quantile(s, q)`` keeps, on the device (int64).

    ``torch.quantile``'s linear interpolation puts the threshold between ``sorted[floor(q(n-1))]``
    and ``sorted[ceil(q(n-1))]``; ``s >= threshold`` then keeps exactly the elements from sorted
    index ``ceil(q(n-1))`` up: the ``k = n - ceil(q(n-1))`` largest, ties at the k-th included.
    ``q(n-1)`` is one float64 product, as in Python. ``k`` never decreases as ``n`` grows.
    """
    return n - torch.ceil((n - 1).double() * q).long()


def full_sort(scores: torch.Tensor) -> bool:
    """Whether the threshold comes from a full sort (on CUDA) rather than a ``topk`` of the
    shape's bound (elsewhere): whichever is faster on the device; both select the same."""
    return scores.is_cuda


def _keep_count_int(n: int, q: float) -> int:
    return n - math.ceil(q * (n - 1))


def order_keys(scores: torch.Tensor) -> torch.Tensor:
    """int64 keys in ``[0, 2^32)`` ordered as the fp32 ``scores`` (``-0.0`` as ``+0.0``, NaN
    above ``+inf``)."""
    bits = (scores.float() + 0.0).view(torch.int32)  # + 0.0 turns -0.0 into +0.0
    keys = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # negatives: reverse their order
    return keys.long() + 2**31


def select_top(
    scores: torch.Tensor, mask: torch.Tensor, q: float, process_group: Optional[Any]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens with ``score >= quantile_q(valid scores)`` over the batch (and all ranks).

    Returns the ``[B, T]`` bool selection and the global valid count (a 0-dim int64 tensor).
    """
    n = global_count(mask, process_group)
    k = keep_count(n, q)
    if process_group is not None:
        keys = torch.where(mask, order_keys(scores), -1)  # masked keys count for nothing
        threshold = torch.zeros((), dtype=torch.long, device=keys.device)
        import torch.distributed as dist

        for bit in range(31, -1, -1):  # the largest key with >= k keys at or above it
            candidate = threshold + (1 << bit)
            count = (keys >= candidate).sum().reshape(1)  # gloo reduces 1-dim tensors
            dist.all_reduce(count, group=process_group)
            threshold = torch.where(count[0] >= k, candidate, threshold)
        return mask & (keys >= threshold) & (n > 0), n
    flat = torch.where(mask, scores.float(), -math.inf).reshape(-1)  # [B*T]
    if flat.numel() == 0:
        return torch.zeros_like(mask), n
    if full_sort(flat):
        # a full sort: on an H100 at [256, 4096] 182 µs compiled, against 326 µs for the topk
        # below and 254-293 µs for torch.quantile (benchmarks/bench_weighting_variants.py)
        ordered = torch.sort(flat, descending=True).values  # [B*T]
    else:
        # k <= k(B*T), a bound from the shape alone (k never decreases as n grows): on 2 CPU
        # cores at [256, 4096] a topk of that many takes 25 ms, a full sort 85 ms
        ordered = flat.topk(_keep_count_int(flat.numel(), q), sorted=True).values
    threshold = ordered.gather(0, (k - 1).clamp(0, ordered.numel() - 1).reshape(1))  # no read
    return mask & (scores.float() >= threshold) & (n > 0), n


def global_count(flags: torch.Tensor, process_group: Optional[Any]) -> torch.Tensor:
    """Number of True entries of ``flags``, summed over the ranks of ``process_group``: a 0-dim
    int64 tensor on ``flags``' device."""
    total = flags.sum().reshape(1)  # gloo reduces 1-dim tensors
    if process_group is not None:
        import torch.distributed as dist

        dist.all_reduce(total, group=process_group)
    return total[0]
