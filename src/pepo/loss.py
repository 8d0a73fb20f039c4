"""The clipped surrogate of Eq. (2)/(8) with token-level normalisation.

``loss = -(1/N) Σ_{i,t valid} min(ρ_{i,t} Â_{i,t}, clip(ρ_{i,t}, 1-ε_l, 1+ε_h) Â_{i,t})`` with
``ρ = exp(logprobs - old_logprobs)`` and ``N`` the number of valid tokens of the *whole* batch
(``num_tokens``). Passing the full batch's ``N`` to every micro-batch makes the micro-batch
losses sum to the full-batch loss, so gradient accumulation reproduces the full-batch gradient
exactly; dividing each micro-batch by its own count would not.

Eq. (2) as printed divides by one prompt group's tokens (``Σ_j T_j`` over its ``G`` rollouts);
summed over a batch's groups, dividing by the whole batch's count instead is DAPO's token mean
(verl's default ``loss_agg_mode: token-mean``, the design notes' choice). It weighs a group by
its share of the batch's tokens, where a per-group mean would weigh every group alike.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Union

import torch

from pepo import _checks

__all__ = [
    "ClippedPolicyLoss",
    "check_clip_range",
    "clipped_policy_loss",
    "policy_loss_metrics",
    "truncated_is_weights",
]


def _check(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float,
    eps_high: float,
) -> None:
    for name, t in (("logprobs", logprobs), ("old_logprobs", old_logprobs),
                    ("advantages", advantages)):
        _checks.check_tensor(name, t)
        _checks.check_float(name, t)
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [B, T], got {_checks.format_shape(logprobs)}")
    for name, t in (("old_logprobs", old_logprobs), ("advantages", advantages)):
        if t.shape != logprobs.shape:
            raise ValueError(
                f"{name} must be [B, T]={_checks.format_shape(logprobs)} like logprobs, got "
                f"{_checks.format_shape(t)}"
                + (
                    "; expand sequence-level advantages with a strategy from pepo.weighting"
                    if name == "advantages" and t.dim() == 1
                    else ""
                )
            )
    _checks.check_bool_mask("mask", mask, logprobs.shape)
    _checks.check_same_device(logprobs=logprobs, old_logprobs=old_logprobs,
                              advantages=advantages, mask=mask)
    check_clip_range(eps_low, eps_high)


def _same_layout(logprobs: Any, old_logprobs: Any, advantages: Any, mask: Any,
                 is_weights: Any) -> bool:
    """The shapes and dtypes :func:`_check` (and the ``is_weights`` check) ask for, in one
    expression: the unvalidated call's check (the full checks run only to word the error)."""
    return (isinstance(logprobs, torch.Tensor) and isinstance(old_logprobs, torch.Tensor)
            and isinstance(advantages, torch.Tensor) and isinstance(mask, torch.Tensor)
            and logprobs.dim() == 2 and old_logprobs.shape == logprobs.shape
            and advantages.shape == logprobs.shape and mask.shape == logprobs.shape
            and mask.dtype == torch.bool and logprobs.is_floating_point()
            and old_logprobs.device == advantages.device == mask.device == logprobs.device
            and old_logprobs.is_floating_point() and advantages.is_floating_point()
            and (is_weights is None or (isinstance(is_weights, torch.Tensor)
                                        and is_weights.shape == logprobs.shape
                                        and is_weights.is_floating_point()
                                        and is_weights.device == logprobs.device)))


def check_clip_range(eps_low: Any, eps_high: Any) -> None:
    """The rule for the clip range ``[1 - eps_low, 1 + eps_high]``: ``0 <= eps_low < 1`` (the
    floor must stay > 0) and ``eps_high`` finite and ``>= 0``. The recipe's config validation
    applies the same function.

    Raises:
        ValueError: naming the bad value.
    """
    for name, eps in (("eps_low", eps_low), ("eps_high", eps_high)):
        _checks.check_nonnegative(name, eps)
    if eps_low >= 1:
        raise ValueError(f"eps_low must be < 1 (the ratio floor 1 - eps_low must be > 0), got "
                         f"{eps_low}")


def _ratio_terms(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float,
    eps_high: float,
    true_ratio: bool = False,
) -> tuple[Optional[torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(ratio, log_ratio, unclipped, clipped)``; ``ratio`` (the metrics') only with
    ``true_ratio``: the loss needs the ratio with zero-advantage tokens at 1 alone."""
    log_ratio = torch.where(mask, logprobs.float() - old_logprobs.float(), 0.0)  # [B, T]
    ratio = torch.exp(log_ratio) if true_ratio else None  # [B, T]
    adv = torch.where(mask, advantages.float(), 0.0)  # [B, T]
    # A token of zero advantage adds 0 to the loss and to its gradient whatever its ratio: its
    # ratio is taken at 1 there (exp of a log-ratio above ~88 is inf, and 0 * inf is a NaN
    # that spoiled the whole mini-batch)
    live = torch.exp(torch.where(adv != 0, log_ratio, 0.0))  # [B, T]
    unclipped = -adv * live
    clipped = -adv * torch.clamp(live, 1.0 - eps_low, 1.0 + eps_high)
    return ratio, log_ratio, unclipped, clipped


def clipped_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    num_tokens: Optional[Union[int, torch.Tensor]] = None,
    is_weights: Optional[torch.Tensor] = None,
    *,
    validate: bool = True,
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
        is_weights: optional per-token importance weights (constants, e.g.
            :func:`truncated_is_weights`) multiplying each token's clipped term: the
            correction for rollouts sampled by an engine whose probabilities differ from the
            trainer's. A float tensor of values >= 0 (its values are not read on the host: a
            negative weight would flip its token's term).
        validate: also check the clip range and that ``advantages`` and ``is_weights`` carry
            no grad. Shapes, dtypes and the mask's dtype are checked either way (a ``[B]``
            ``advantages`` would otherwise broadcast silently); no value is read on the host
            either way.

    Shape:
        logprobs, old_logprobs, advantages, mask: ``[B, T]``; returns a 0-dim fp32 tensor.

    Raises:
        ValueError: mismatched shapes, non-bool mask, advantages that require grad, bad eps.
    """
    validate = _checks.check_flag("validate", validate)
    checked = validate or not _same_layout(logprobs, old_logprobs, advantages, mask, is_weights)
    if checked:
        _check(logprobs, old_logprobs, advantages, mask, eps_low, eps_high)
    if validate and advantages.requires_grad:
        raise ValueError(
            "advantages require grad; token advantages are constants of the objective, "
            "pass advantages.detach() (pepo.weighting strategies already return detached tensors)"
        )
    _, _, unclipped, clipped = _ratio_terms(
        logprobs, old_logprobs, advantages, mask, eps_low, eps_high
    )
    per_token = torch.maximum(unclipped, clipped)  # [B, T]
    if is_weights is not None and checked:
        _checks.check_tensor("is_weights", is_weights)
        _checks.check_float("is_weights", is_weights)  # a bool or int weight truncates
        if is_weights.shape != logprobs.shape:
            raise ValueError(f"is_weights must be [B, T]={_checks.format_shape(logprobs)} like "
                             f"logprobs, "
                             f"got {_checks.format_shape(is_weights)}")
        _checks.check_same_device(logprobs=logprobs, is_weights=is_weights)
        if validate and is_weights.requires_grad:
            raise ValueError("is_weights require grad; importance weights are constants, pass "
                             "is_weights.detach()")
    if is_weights is not None:
        per_token = per_token * is_weights.float()
    per_token = torch.where(mask, per_token, 0.0)
    denom: Union[torch.Tensor, float]
    if num_tokens is None:
        denom = mask.sum().clamp_min(1).float()
    elif isinstance(num_tokens, torch.Tensor):
        if num_tokens.numel() != 1:
            raise ValueError(f"num_tokens must be a scalar, got shape "
                             f"{_checks.format_shape(num_tokens)}")
        n = num_tokens.reshape(()).float()
        # 0 (an empty batch) divides by 1 and gives loss 0; a negative count is a caller's bug
        # that a host sync would be needed to raise on, so it makes the loss NaN instead
        denom = torch.where(n < 0, math.nan, n.clamp_min(1))
    else:
        if not _checks.is_int(num_tokens) or num_tokens < 0:
            raise ValueError(f"num_tokens must be an int >= 0, got {num_tokens!r}")
        denom = float(max(num_tokens, 1))  # 0 (an empty batch): loss 0, as a 0-dim tensor gives
    return per_token.sum() / denom


class ClippedPolicyLoss:
    """:func:`clipped_policy_loss` with its clip range bound: the recipe's ``loss`` component
    (``loss._component_``, this one by default), built with the config's ``loss.eps_low`` and
    ``loss.eps_high``.

    Another loss, or another aggregation of the same per-token terms (a sequence mean, a
    constant normaliser), is a config change: a component taking ``eps_low`` and
    ``eps_high`` whose result is called as this one is,
    ``loss(logprobs, old_logprobs, advantages, mask, num_tokens=..., is_weights=...)`` -> a
    0-dim tensor, with ``num_tokens`` the whole mini-batch's valid-token count (the recipe
    accumulates gradients over micro-batches and ranks by summing the calls' results).

    Raises:
        ValueError: a clip range :func:`check_clip_range` refuses.
    """

    def __init__(self, eps_low: float = 0.2, eps_high: float = 0.28) -> None:
        check_clip_range(eps_low, eps_high)
        self.eps_low, self.eps_high = float(eps_low), float(eps_high)

    def __call__(self, logprobs: torch.Tensor, old_logprobs: torch.Tensor,
                 advantages: torch.Tensor, mask: torch.Tensor, *,
                 num_tokens: Optional[Union[int, torch.Tensor]] = None,
                 is_weights: Optional[torch.Tensor] = None,
                 validate: bool = True) -> torch.Tensor:
        """:func:`clipped_policy_loss` with the bound clip range. Shape and ``validate``: as
        there."""
        return clipped_policy_loss(logprobs, old_logprobs, advantages, mask,
                                   eps_low=self.eps_low, eps_high=self.eps_high,
                                   num_tokens=num_tokens, is_weights=is_weights,
                                   validate=validate)

    def __repr__(self) -> str:
        return f"ClippedPolicyLoss(eps_low={self.eps_low}, eps_high={self.eps_high})"


def _extreme(x: torch.Tensor) -> torch.Tensor:
    """The smallest entry of ``x``, +inf for an empty ``x`` (``amin`` refuses one: a batch of no
    rows or columns)."""
    return torch.cat([x.reshape(-1), x.new_full((1,), math.inf)]).amin()


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
        logprobs, old_logprobs, advantages, mask, eps_low, eps_high, true_ratio=True
    )
    assert ratio is not None  # true_ratio=True (a Python check: no host sync)
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
        "ratio_min": torch.where(any_valid, _extreme(torch.where(mask, ratio, math.inf)), 1.0),
        "ratio_max": torch.where(any_valid, -_extreme(torch.where(mask, -ratio, math.inf)), 1.0),
        "approx_kl": mean(ratio - 1.0 - log_ratio),
        "weighted_fraction": mean(adv != 0),
        "num_tokens": n,
    }


@torch.no_grad()
def truncated_is_weights(
    old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor, cap: float
) -> torch.Tensor:
    """Truncated importance-sampling weights ``min(π_old / μ, cap)`` per token.

    ``μ`` is the rollout engine's probability of the sampled token (the distribution it was
    actually drawn from) and ``π_old`` the trainer's for the same policy; they differ by kernel
    numerics (vLLM vs the training forward) and, with top-k/top-p, by the truncation. Weighting
    each token's loss by the capped ratio corrects the gradient for that mismatch (as verl's
    and TRL's ``vllm_importance_sampling_cap`` do); the cap bounds the variance. Where ``μ`` is
    a top-p/top-k filtered distribution and ``π_old`` the full one, the ratio of a sampled token
    is about the filter's kept mass (below 1, least where entropy is high): the weights then
    scale the loss by the truncation more than they correct the numerics.

    Shape:
        old_logprobs, rollout_logprobs, mask: ``[B, T]``; returns ``[B, T]`` fp32, detached,
        0 where mask is False.
    """
    for name, t in (("old_logprobs", old_logprobs), ("rollout_logprobs", rollout_logprobs)):
        _checks.check_float(name, _checks.check_tensor(name, t))
    if old_logprobs.dim() != 2:
        raise ValueError(f"old_logprobs must be [B, T], got {_checks.format_shape(old_logprobs)}")
    if rollout_logprobs.shape != old_logprobs.shape:
        raise ValueError(f"rollout_logprobs must be [B, T]={_checks.format_shape(old_logprobs)} "
                         f"like "
                         f"old_logprobs, got {_checks.format_shape(rollout_logprobs)}")
    _checks.check_bool_mask("mask", mask, old_logprobs.shape)
    _checks.check_same_device(old_logprobs=old_logprobs, rollout_logprobs=rollout_logprobs,
                              mask=mask)
    cap = _checks.check_positive("cap", cap)
    log_ratio = torch.where(mask, old_logprobs.float() - rollout_logprobs.float(), 0.0)
    return torch.where(mask, torch.exp(log_ratio).clamp(max=cap), 0.0)
