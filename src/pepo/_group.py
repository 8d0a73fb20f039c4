"""GRPO's group advantages, Eq. (1), behind :func:`pepo.estimators.group_advantages` (public
there; this module keeps ``pepo.estimators`` within the project's file length)."""

from __future__ import annotations

import math

import torch

from pepo import _checks

__all__ = ["group_advantages"]


def group_advantages(
    rewards: torch.Tensor,
    group_size: int,
    *,
    normalize_std: bool = True,
    unbiased: bool = True,
    eps: float = 1e-6,
    validate: bool = True,
) -> torch.Tensor:
    """GRPO advantages, Eq. (1), for rollouts laid out in contiguous groups.

    Args:
        rewards: rewards ``r``; rollouts ``g*G .. g*G + G - 1`` answer the same prompt.
        group_size: ``G >= 2`` rollouts per prompt.
        normalize_std: divide by the group's std (GRPO); False gives Dr. GRPO's ``r - mean``.
        unbiased: Bessel-corrected std (``torch.std`` default, as TRL and verl use).
        eps: added to the std (verl: 1e-6, TRL: 1e-4).
        validate: refuse non-finite rewards and advantages that overflow, in one host sync.
            With False the call reads no value on the host (a GPU never waits on it): a
            non-finite reward makes its group's advantages NaN.

    Shape:
        rewards: ``[N]`` with ``N % G == 0``; returns ``[N]`` fp32 (fp64 for fp64 rewards).

    Raises:
        ValueError: bad shape, ``G < 2``, ``N`` not a multiple of ``G``, non-finite rewards,
            advantages that overflow the output dtype (only without ``normalize_std``).
    """
    rewards = _checks.check_tensor("rewards", rewards)
    validate = _checks.check_flag("validate", validate)
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be [N], got {_checks.format_shape(rewards)}")
    if not _checks.is_int(group_size) or group_size < 2:
        raise ValueError(
            f"group_size must be an int >= 2 (GRPO needs several rollouts per prompt; use "
            f"SingleStreamEstimator for one), got {group_size!r}"
        )
    group_size, n = int(group_size), rewards.shape[0]
    if n % group_size != 0:
        raise ValueError(
            f"rewards has {n} entries, not a multiple of group_size={group_size}"
        )
    _checks.check_nonnegative("eps", eps)
    _checks.check_flag("normalize_std", normalize_std)
    _checks.check_flag("unbiased", unbiased)
    out_dtype = torch.promote_types(rewards.dtype, torch.float32)  # fp64 stays fp64
    r = rewards.detach().to(out_dtype).view(-1, group_size)  # [N/G, G]
    # Scaled by a power of two per group (exact: the same numbers as unscaled wherever those do
    # not overflow), so that rewards near the dtype's limit do not overflow the mean or the std
    # (which gave a silent 0 advantage); fp64 is not used, as not every device has it.
    amax = r.abs().amax(dim=1, keepdim=True)  # [N/G, 1]
    # 2^(e-1) for |r|max = m 2^e, m in [0.5, 1): |r|/scale < 2 (a power in the rewards' dtype;
    # torch.ldexp overflowed for float64 exponents above 127 before torch 2)
    scale = torch.full_like(amax, 2.0).pow((torch.frexp(amax)[1] - 1).to(amax.dtype))
    scale = torch.where(amax > 0, scale, 1.0)
    rs = r / scale
    centred = rs - rs.mean(dim=1, keepdim=True)
    if normalize_std:
        std = rs.std(dim=1, keepdim=True, unbiased=unbiased)
        centred = centred / (std + eps / scale)
    else:
        centred = centred * scale
    degenerate = (r.amax(dim=1) == r.amin(dim=1))[:, None]  # [N/G, 1]
    # a non-finite reward makes its whole group NaN (an inf group is otherwise "degenerate")
    finite = torch.isfinite(r).all(dim=1, keepdim=True)
    out = torch.where(finite, torch.where(degenerate, 0.0, centred), math.nan).reshape(-1)
    if not validate:
        return out
    bad, ok = torch.stack([(~torch.isfinite(r)).sum().to(out_dtype),
                           torch.isfinite(out).all().to(out_dtype)]).tolist()  # one sync
    if bad:
        raise ValueError(_checks.nonfinite_message("rewards", rewards).split(";")[0])
    if not ok:
        raise ValueError(
            f"the advantages r - mean overflow {out_dtype} (rewards from "
            f"{float(r.min()):.4g} to {float(r.max()):.4g}); scale the rewards down or "
            f"use normalize_std=True"
        )
    return out
