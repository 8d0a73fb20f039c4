"""Batch-global top-k selection for ``global_topk`` (80/20): the threshold over every valid token
of the batch, and of every rank of a process group, never per row."""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.nn.functional as F

__all__: list[str] = []


def select_top(
    scores: torch.Tensor, mask: torch.Tensor, q: float, process_group: Optional[Any]
) -> tuple[torch.Tensor, int]:
    """Tokens with ``score >= quantile_q(valid scores)`` over the batch (and all ranks).

    Returns the ``[B, T]`` bool selection and the global valid count.
    """
    flat = torch.where(mask, scores.float(), -math.inf).reshape(-1)  # [B*T]
    n = global_count(mask, process_group)
    if n == 0:
        return torch.zeros_like(mask), 0
    # torch.quantile's linear interpolation puts the threshold between sorted[floor(q(n-1))] and
    # sorted[ceil(q(n-1))]; `s >= threshold` then keeps exactly the elements from sorted index
    # ceil(q(n-1)) up, i.e. the k largest with ties at the k-th included.
    k = n - math.ceil(q * (n - 1))
    if process_group is None:
        threshold = flat.kthvalue(flat.numel() - k + 1).values
    else:
        import torch.distributed as dist

        k_local = min(k, flat.numel())
        top = flat.topk(k_local).values if k_local > 0 else flat.new_empty(0)
        if k_local < k:
            top = F.pad(top, (0, k - k_local), value=-math.inf)
        gathered = [torch.empty_like(top) for _ in range(dist.get_world_size(process_group))]
        dist.all_gather(gathered, top, group=process_group)
        everything = torch.cat(gathered)
        threshold = everything.kthvalue(everything.numel() - k + 1).values
    return mask & (scores.float() >= threshold), n


def global_count(flags: torch.Tensor, process_group: Optional[Any]) -> int:
    """Number of True entries of ``flags``, summed over the ranks of ``process_group``."""
    total = flags.sum().reshape(1)
    if process_group is not None:
        import torch.distributed as dist

        dist.all_reduce(total, group=process_group)
    return int(total)
