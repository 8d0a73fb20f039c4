"""GTPO's arithmetic (Tan et al. 2025, arXiv 2508.04349) behind ``pepo.weighting``'s ``gtpo``
strategy: the entropy-shaped token rewards (Eqs. 3 and 5, :func:`gtpo_rewards`, public through
``pepo.weighting``) and their standardisation within prompt groups (Eq. 6). The strategy's
readings and deviations are in :func:`pepo.weighting.gtpo`'s docstring."""

from __future__ import annotations

import math
from typing import Any

import torch

from pepo import _checks
from pepo import _windows as _w

__all__ = ["gtpo_rewards"]


NORMALIZE = ("group", "side")


def gtpo_rewards(
    entropies: torch.Tensor,
    mask: torch.Tensor,
    positive: torch.Tensor,
    groups: torch.Tensor,
    alpha1: float = 1.0,
    alpha2: float = 0.1,
    eps: float = 1e-8,
    *,
    validate: bool = True,
) -> torch.Tensor:
    """GTPO's entropy-shaped token rewards (Tan et al. 2025, arXiv 2508.04349, Eqs. 3 and 5).

    Within each prompt group, at each response position ``t``:

    * a successful rollout ``i`` (``positive``, the set ``O+``) gets
      ``r̃_{i,t} = α1 + α2 · H_{i,t} / Σ_{k ∈ O+_t} H_{k,t} · d_t``;
    * a failed rollout ``j`` (``O-``) gets
      ``r̃_{j,t} = -α1 - α2 · (1/H_{j,t}) / Σ_{k ∈ O-_t} (1/H_{k,t}) · h_t``,

    where ``O+_t`` / ``O-_t`` are the group's successful / failed rollouts that have a token at
    ``t`` and ``d_t`` / ``h_t`` their numbers. ``1/H`` is ``1/(H + eps)`` (the paper's Remark
    2.1). The outcome reward is binary: ``r = 1`` for success, ``-1`` for failure. So each side's
    shaped rewards at ``t`` sum to ``±(α1 + α2) · d_t`` (``h_t``): with ``α1 + α2 = 1`` the total
    reward is conserved (the paper's Prop. 2.2). Where every active ``O+`` entropy at ``t`` is 0
    the entropy term is split evenly (``1/d_t`` each), which keeps that sum.

    Position ``t`` counts a row's *valid* tokens, as the windows of the other strategies do: a
    row with holes in its mask gets the rewards of the compacted row.

    Args:
        entropies: ``[B, T]`` token entropies (anything at masked positions).
        mask: ``[B, T]`` bool, True on valid tokens.
        positive: ``[B]`` bool, the successful rollouts.
        groups: ``[B]`` integer, equal for the rollouts of one prompt.
        alpha1: the outcome reward's share ``α1`` (>= 0; GTPO's default 1.0).
        alpha2: the entropy term's share ``α2`` (>= 0, not both 0; GTPO's default 0.1).
        eps: ``ε`` of ``1/(H + ε)`` (> 0).
        validate: raise if the valid entropies hold NaN/inf or a value below ``-1e-4`` (log
            probabilities passed as entropies), in one host sync, as the other strategies'
            entropy functions do; ``False`` reads no value on the host (a NaN or inf entropy
            then turns its side's rewards at its position NaN, in its group).

    Returns:
        ``[B, T]`` fp32, 0 where ``mask`` is False.

    Raises:
        ValueError: bad shapes or dtypes, a bad ``alpha1``, ``alpha2`` or ``eps``, or (with
            ``validate``) bad entropies.
    """
    entropies, mask = _checks.check_entropies_mask(entropies, mask)
    b = torch.empty(mask.shape[0], device=mask.device)
    positive = _checks.check_row_flags("positive", positive, b)
    groups = _checks.check_row_ids("groups", groups, b)
    alpha1, alpha2, eps = check_params(alpha1, alpha2, eps)
    ent = _w.clean(entropies.detach(), mask)
    if _checks.check_flag("validate", validate):
        _checks.check_finite_clean(entropies=ent)
    with torch.no_grad():
        return shaped(ent, mask, positive, groups, alpha1, alpha2, eps).float()


def check_params(alpha1: Any, alpha2: Any, eps: Any) -> tuple[float, float, float]:
    for name, v in (("alpha1", alpha1), ("alpha2", alpha2)):
        _checks.check_nonnegative(name, v)
    if alpha1 == 0 and alpha2 == 0:
        raise ValueError("alpha1 and alpha2 are both 0: every shaped reward would be 0")
    return float(alpha1), float(alpha2), _checks.check_positive("eps", eps)


def members(groups: torch.Tensor, positive: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two ``[B, B]`` bool matrices: rows ``i`` and ``j`` answer the same prompt; rows ``i`` and
    ``j`` answer the same prompt and share an outcome (``positive``). Group sums become matrix
    products over these, so that nothing is renumbered, indexed by value or read on the host."""
    group = groups[:, None] == groups[None, :]
    return group, group & (positive[:, None] == positive[None, :])


def _rows_sum(member: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``[B]``: for each row, the sum of ``x`` (``[B]``) over the rows ``member`` pairs it with;
    a NaN/inf stays within those rows (a ``where``, not ``0 * x``)."""
    return torch.where(member, x[None, :], 0.0).sum(dim=1)


def shaped(ent: torch.Tensor, mask: torch.Tensor, positive: torch.Tensor, groups: torch.Tensor,
           alpha1: float, alpha2: float, eps: float) -> torch.Tensor:
    """Eqs. 3 and 5 in float64: ``[B, T]``, 0 where ``mask`` is False.

    Position ``t`` is a row's ``t``-th valid token: each row's valid values are moved to the
    front, and the sums over a side's rows at every position are one product with the
    ``[B, B]`` same-group-and-outcome matrix (a non-finite value counted apart, so that it
    turns its own group's rows NaN and no other's)."""
    raw = ent.double()
    h = raw.clamp_min(0.0)  # fp32 rounding's slightly negative entropies are 0
    # what each token contributes to its side's share: H on O+, 1/(H + eps) on O-; an inf
    # entropy (-inf too) must reach the output as NaN (1/inf would be a finite 0)
    val = torch.where(positive[:, None], h, 1.0 / (h + eps))
    val = torch.where(torch.isinf(raw), math.nan, val)
    rows = _w.Rows(torch.where(mask, val, 0.0), mask)  # [B, T] compact, 0 past each length
    t = mask.shape[1]
    present = (torch.arange(t, device=mask.device)[None, :] < rows.lengths[:, None]).float()
    _, side = members(groups, positive)
    bad = ~torch.isfinite(rows.x)
    s = side.double() @ torch.where(bad, 0.0, rows.x)  # [B, T]: the sum over the row's side at t
    # counts in fp32 (exact below 2^24 rows), a third of the float64 products' cost
    s = torch.where(side.float() @ bad.float() > 0, math.nan, s)  # NaN stays NaN, never uniform
    c = (side.float() @ present).double()  # [B, T]: how many of the side's rows have a token
    uniform = torch.where(torch.isnan(s), math.nan, 1.0)
    share_x_count = torch.where(s > 0, rows.x / torch.where(s > 0, s, 1.0) * c, uniform)
    sign = (positive.double() * 2 - 1)[:, None]  # +1 on O+, -1 on O-
    return rows.expand(sign * (alpha1 + alpha2 * share_x_count), mask)


def standardized(r: torch.Tensor, mask: torch.Tensor, positive: torch.Tensor,
                 groups: torch.Tensor, normalize: str) -> torch.Tensor:
    """Eq. 6: the shaped rewards ``r`` ``[B, T]`` (float64, :func:`shaped`) standardised over each
    group's valid tokens (``normalize="group"``) or over each side of it (``"side"``), with
    population std plus ``1e-6``; 0 in a group whose rollouts all succeeded or all failed (NaN
    there too where its values are: a NaN/inf entropy is never turned into a finite 0).
    Returns ``[B, T]`` fp32."""
    group, side = members(groups, positive)
    n_rows = group.sum(dim=1)  # [B]: the rollouts of the row's group
    n_pos = (group & positive[None, :]).sum(dim=1)
    mixed = (n_pos > 0) & (n_pos < n_rows)  # [B]: the row's group has both outcomes
    unit = group if normalize == "group" else side
    tokens = _rows_sum(unit, mask.sum(1).double()).clamp_min(1.0)  # [B]
    mean = _rows_sum(unit, r.sum(1)) / tokens
    dev = torch.where(mask, r - mean[:, None], 0.0)
    std = (_rows_sum(unit, (dev * dev).sum(1)) / tokens).sqrt()
    out = dev / (std[:, None] + 1e-6)
    return torch.where(mixed[:, None], out, out - out).float()
