"""The clipped surrogate of Eq. (2)/(8) with token-level normalisation.

``loss = -(1/N) Σ_{i,t valid} min(ρ_{i,t} Â_{i,t}, clip(ρ_{i,t}, 1-ε_l, 1+ε_h) Â_{i,t})`` with
``ρ = exp(logprobs - old_logprobs)`` and ``N`` the number of valid tokens of the *whole* batch
(``num_tokens``). Passing the full batch's ``N`` to every micro-batch makes the micro-batch
losses sum to the full-batch loss, so gradient accumulation reproduces the full-batch gradient
exactly; dividing each micro-batch by its own count would not.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Union

import torch

from pepo import _checks

__all__ = ["check_clip_range", "clipped_policy_loss", "policy_loss_metrics"]


def _check(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float,
    eps_high: float,
) -> None:
    for name, t in (("logprobs", logprobs), ("old_logprobs", old_logprobs), ("advantages", advantages)):
        _checks.check_tensor(name, t)
        _checks.check_float(name, t)
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [B, T], got {_checks._shape(logprobs)}")
    for name, t in (("old_logprobs", old_logprobs), ("advantages", advantages)):
        if t.shape != logprobs.shape:
            raise ValueError(
                f"{name} must be [B, T]={_checks._shape(logprobs)} like logprobs, got "
                f"{_checks._shape(t)}"
                + (
                    "; expand sequence-level advantages with a strategy from pepo.weighting"
                    if name == "advantages" and t.dim() == 1
                    else ""
                )
            )
    _checks.check_bool_mask("mask", mask, logprobs.shape)
    check_clip_range(eps_low, eps_high)


def check_clip_range(eps_low: Any, eps_high: Any) -> None:
    """The rule for the clip range ``[1 - eps_low, 1 + eps_high]``: ``0 <= eps_low < 1`` (the
    floor must stay > 0) and ``eps_high`` finite and ``>= 0``. The recipe's config validation
    applies the same function.

    Raises:
        ValueError: naming the bad value.
    """
    for name, eps in (("eps_low", eps_low), ("eps_high", eps_high)):
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (0 <= eps < math.inf):
            raise ValueError(f"{name} must be a finite number >= 0, got {eps!r}")
    if eps_low >= 1:
        raise ValueError(f"eps_low must be < 1 (the ratio floor 1 - eps_low must be > 0), got {eps_low}")


def _ratio_terms(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float,
    eps_high: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    log_ratio = torch.where(mask, logprobs.float() - old_logprobs.float(), 0.0)  # [B, T]
    ratio = torch.exp(log_ratio)  # [B, T]
    adv = torch.where(mask, advantages.float(), 0.0)  # [B, T]
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    return ratio, log_ratio, unclipped, clipped


def clipped_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    num_tokens: Optional[Union[int, torch.Tensor]] = None,
) -> torch.Tensor:
    """Clipped policy-gradient loss (to minimise), token-level mean, Eq. (2)/(8).

    Args:
        logprobs: log-probs of the taken tokens under the current policy (with grad).
        old_logprobs: the same under the rollout policy (no grad needed).
        advantages: token advantages ``Â`` from a :mod:`pepo.weighting` strategy; must not
            require grad (weights are constants of the objective).
        mask: True at valid (generated) tokens; padding never contributes, whatever it holds.
        eps_low, eps_high: clip range ``[1 - eps_low, 1 + eps_high]`` (DAPO's clip-higher;
            paper: 0.2 / 0.28).
        num_tokens: the denominator ``Σ_j T_j``. Pass the whole batch's valid-token count
            when this call sees one micro-batch of it; default: this call's valid tokens.
            An int or a 0-dim tensor (no host sync either way); a batch with no valid tokens
            gives loss 0. A negative int raises; a negative tensor gives a NaN loss.

    Shape:
        logprobs, old_logprobs, advantages, mask: ``[B, T]``; returns a 0-dim fp32 tensor.

    Raises:
        ValueError: mismatched shapes, non-bool mask, advantages that require grad, bad eps.
    """
    _check(logprobs, old_logprobs, advantages, mask, eps_low, eps_high)
    if advantages.requires_grad:
        raise ValueError(
            "advantages require grad; token advantages are constants of the objective, "
            "pass advantages.detach() (pepo.weighting strategies already return detached tensors)"
        )
    _, _, unclipped, clipped = _ratio_terms(
        logprobs, old_logprobs, advantages, mask, eps_low, eps_high
    )
    per_token = torch.where(mask, torch.maximum(unclipped, clipped), 0.0)  # [B, T]
    if num_tokens is None:
        denom = mask.sum().clamp_min(1).float()
    elif isinstance(num_tokens, torch.Tensor):
        if num_tokens.numel() != 1:
            raise ValueError(f"num_tokens must be a scalar, got shape {_checks._shape(num_tokens)}")
        n = num_tokens.reshape(()).float()
        # 0 (an empty batch) divides by 1 and gives loss 0; a negative count is a caller's bug
        # that a host sync would be needed to raise on, so it makes the loss NaN instead
        denom = torch.where(n < 0, math.nan, n.clamp_min(1))
    else:
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 1:
            raise ValueError(f"num_tokens must be an int >= 1, got {num_tokens!r}")
        denom = float(num_tokens)
    return per_token.sum() / denom


@torch.no_grad()
def policy_loss_metrics(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
) -> dict[str, torch.Tensor]:
    """Diagnostics of the clipped objective, as 0-dim tensors (no host sync; call ``.item()``
    when logging).

    Returns:
        ``clip_fraction`` (share of valid tokens whose clipped term is active),
        ``clip_fraction_low`` / ``clip_fraction_high`` (ratio below ``1 - eps_low`` with
        ``Â < 0`` / above ``1 + eps_high`` with ``Â > 0``), ``ratio_mean``, ``ratio_min``,
        ``ratio_max``, ``approx_kl`` (``mean(ρ - 1 - log ρ)``, k3 estimator),
        ``weighted_fraction`` (share of valid tokens with ``Â != 0``), ``num_tokens``.
        Means are over valid tokens; an empty batch gives 0 (and ratio min/max 1).
    """
    _check(logprobs, old_logprobs, advantages, mask, eps_low, eps_high)
    ratio, log_ratio, unclipped, clipped = _ratio_terms(
        logprobs, old_logprobs, advantages, mask, eps_low, eps_high
    )
    n = mask.sum()
    denom = n.clamp_min(1).float()
    adv = torch.where(mask, advantages.float(), 0.0)

    def mean(x: torch.Tensor) -> torch.Tensor:
        return torch.where(mask, x.float(), 0.0).sum() / denom

    low = mask & (ratio < 1.0 - eps_low) & (adv < 0)
    high = mask & (ratio > 1.0 + eps_high) & (adv > 0)
    any_valid = n > 0
    return {
        "clip_fraction": mean(clipped > unclipped),
        "clip_fraction_low": mean(low),
        "clip_fraction_high": mean(high),
        "ratio_mean": mean(ratio),
        "ratio_min": torch.where(any_valid, torch.where(mask, ratio, math.inf).amin(), 1.0),
        "ratio_max": torch.where(any_valid, torch.where(mask, ratio, -math.inf).amax(), 1.0),
        "approx_kl": mean(ratio - 1.0 - log_ratio),
        "weighted_fraction": mean(adv != 0),
        "num_tokens": n,
    }
