"""Sequence-level advantage estimators: group (GRPO) and single-stream (SPO).

Both return one advantage per rollout, ``[N]`` fp32, which any strategy of
:mod:`pepo.weighting` turns into token advantages unchanged.

* :func:`group_advantages` — GRPO, Eq. (1): ``A_i = (r_i - mean_g r) / (std_g r + eps)`` over
  contiguous groups of ``group_size`` rollouts of the same prompt. ``std`` is Bessel-corrected
  by default, as in TRL and verl. A group whose rewards are all equal gets advantages exactly 0
  (not ``0 / (0 + eps)`` rounding noise).
* :class:`SingleStreamEstimator` — SPO (Xu et al. 2025): one rollout per prompt, baseline from a
  per-prompt Beta tracker ``p = alpha / (alpha + beta)`` with KL-adaptive forgetting. Follows
  the reference implementation (verl ``recipe/spo``): prior ``alpha0 = N0 (k + 1/2) / (n + 1)``,
  ``beta0 = N0 (n - k + 1/2) / (n + 1)`` from ``k`` offline successes out of ``n``, with
  ``N0 = 1 / (1 - rho_min)``; advantages ``r - p`` normalised over the batch (mean and
  Bessel-corrected std); ``rho = clip(2^(-D / D_half), rho_min, rho_max)``; prioritised
  sampling weights ``sqrt(p (1 - p)) + 0.05``.
"""

from __future__ import annotations

import math
from typing import Any, Hashable, Iterable, Mapping, Optional, Sequence, Union

import torch

from pepo import _checks

__all__ = ["SingleStreamEstimator", "group_advantages"]


def group_advantages(
    rewards: torch.Tensor,
    group_size: int,
    *,
    normalize_std: bool = True,
    unbiased: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """GRPO advantages, Eq. (1), for rollouts laid out in contiguous groups.

    Args:
        rewards: rewards ``r``; rollouts ``g*G .. g*G + G - 1`` answer the same prompt.
        group_size: ``G >= 2`` rollouts per prompt.
        normalize_std: divide by the group's std (GRPO); False gives Dr. GRPO's ``r - mean``.
        unbiased: Bessel-corrected std (``torch.std`` default, as TRL and verl use).
        eps: added to the std (verl: 1e-6, TRL: 1e-4).

    Shape:
        rewards: ``[N]`` with ``N % G == 0``; returns ``[N]`` fp32.

    Raises:
        ValueError: bad shape, ``G < 2``, ``N`` not a multiple of ``G``, non-finite rewards.
    """
    rewards = _checks.check_tensor("rewards", rewards)
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be [N], got {_checks._shape(rewards)}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 2:
        raise ValueError(
            f"group_size must be an int >= 2 (GRPO needs several rollouts per prompt; use "
            f"SingleStreamEstimator for one), got {group_size!r}"
        )
    n = rewards.shape[0]
    if n % group_size != 0:
        raise ValueError(
            f"rewards has {n} entries, not a multiple of group_size={group_size}"
        )
    if eps < 0 or not math.isfinite(eps):
        raise ValueError(f"eps must be a finite number >= 0, got {eps}")
    r = rewards.detach().float().view(-1, group_size)  # [N/G, G]
    bad = int((~torch.isfinite(r)).sum())
    if bad:
        raise ValueError(_checks.nonfinite_message("rewards", bad).split(";")[0])
    centred = r - r.mean(dim=1, keepdim=True)
    if normalize_std:
        std = r.std(dim=1, keepdim=True, unbiased=unbiased)
        centred = centred / (std + eps)
    degenerate = (r.amax(dim=1) == r.amin(dim=1))[:, None]  # [N/G, 1]
    return torch.where(degenerate, 0.0, centred).reshape(-1)


PromptIds = Union[Sequence[Hashable], torch.Tensor]


def _ids(prompt_ids: PromptIds) -> list[Hashable]:
    if isinstance(prompt_ids, torch.Tensor):
        if prompt_ids.dim() != 1:
            raise ValueError(f"prompt_ids must be [N], got {_checks._shape(prompt_ids)}")
        return prompt_ids.tolist()
    if isinstance(prompt_ids, (str, bytes)):
        raise ValueError("prompt_ids must be a sequence of ids, got a single string")
    return list(prompt_ids)


def _rewards(rewards: Any, n: int) -> torch.Tensor:
    rewards = torch.as_tensor(rewards)
    if rewards.dim() != 1 or rewards.shape[0] != n:
        raise ValueError(
            f"rewards must be [N]=[{n}] (one per prompt id), got {_checks._shape(rewards)}"
        )
    r = rewards.detach().double().cpu()
    if not torch.isfinite(r).all() or (r < 0).any() or (r > 1).any():
        raise ValueError(
            f"rewards must lie in [0, 1] for the Beta tracker, got values in "
            f"[{r.min().item()}, {r.max().item()}]"
        )
    return r


class SingleStreamEstimator:
    """SPO's per-prompt value tracker and advantage estimator (Xu et al. 2025).

    For each prompt ``x`` it keeps a Beta posterior ``(alpha, beta)`` of the pass rate,
    ``p(x) = alpha / (alpha + beta)``.

    * :meth:`advantages` gives ``A = r - p(x)`` with the *pre-update* ``p``, normalised over the
      batch: ``(A - mean A) / (std A + eps)``.
    * :meth:`update` folds the new rewards in with forgetting:
      ``alpha <- rho alpha + r``, ``beta <- rho beta + (1 - r)``, where
      ``rho = clip(2^(-D / d_half), rho_min, rho_max)`` from the per-prompt policy change ``D``
      (``kl``), or the constant ``rho`` when no ``kl`` is given.
    * :meth:`sampling_weights` gives ``sqrt(p (1 - p)) + sampling_eps`` for prioritised sampling.

    Args:
        prior_pass_rates: optional offline pass-rate estimate per prompt id (in ``[0, 1]``),
            e.g. from ``prior_samples`` rollouts of the initial policy.
        prior_samples: the number of offline rollouts ``n`` behind each prior pass rate.
        rho_min, rho_max: clip range of the adaptive forgetting factor.
        d_half: the policy change at which the adaptive ``rho`` halves the old evidence.
        rho: constant forgetting factor used when :meth:`update` gets no ``kl``.
        sampling_eps: exploration floor of the sampling weights.
        normalize: normalise advantages over the batch (SPO's default).
        eps: added to the batch std.

    Prompts without a prior start at the Jeffreys prior ``alpha = beta = 1/2``.
    """

    def __init__(
        self,
        prior_pass_rates: Optional[Mapping[Hashable, float]] = None,
        *,
        prior_samples: int = 8,
        rho_min: float = 0.875,
        rho_max: float = 0.96,
        d_half: float = 0.06,
        rho: float = 0.96,
        sampling_eps: float = 0.05,
        normalize: bool = True,
        eps: float = 1e-8,
    ):
        if not (0.0 < rho_min <= rho_max <= 1.0):
            raise ValueError(
                f"need 0 < rho_min <= rho_max <= 1, got rho_min={rho_min}, rho_max={rho_max}"
            )
        if not (0.0 < rho <= 1.0):
            raise ValueError(f"rho must be in (0, 1], got {rho}")
        if isinstance(prior_samples, bool) or not isinstance(prior_samples, int) or prior_samples < 1:
            raise ValueError(f"prior_samples must be an int >= 1, got {prior_samples!r}")
        _checks.check_positive("d_half", d_half)
        if sampling_eps < 0:
            raise ValueError(f"sampling_eps must be >= 0, got {sampling_eps}")
        self.prior_samples = prior_samples
        self.rho_min = float(rho_min)
        self.rho_max = float(rho_max)
        self.d_half = float(d_half)
        self.rho = float(rho)
        self.sampling_eps = float(sampling_eps)
        self.normalize = bool(normalize)
        self.eps = float(eps)
        self._alpha: dict[Hashable, float] = {}
        self._beta: dict[Hashable, float] = {}
        if prior_pass_rates:
            self.set_prior(prior_pass_rates)

    @property
    def prior_weight(self) -> float:
        """``N0 = 1 / (1 - rho_min)``: the effective sample size of an offline prior, the
        steady-state evidence of the tracker at the strongest forgetting."""
        return 1.0 / (1.0 - self.rho_min) if self.rho_min < 1.0 else float(self.prior_samples)

    def set_prior(self, pass_rates: Mapping[Hashable, float]) -> None:
        """Sets (or resets) the tracker of each given prompt from its offline pass rate."""
        n, n0 = self.prior_samples, self.prior_weight
        for pid, p in pass_rates.items():
            p = float(p)
            if not (0.0 <= p <= 1.0):
                raise ValueError(f"prior pass rate of prompt {pid!r} must be in [0, 1], got {p}")
            k = p * n
            self._alpha[pid] = n0 * (k + 0.5) / (n + 1)
            self._beta[pid] = n0 * (n - k + 0.5) / (n + 1)

    def _ab(self, pid: Hashable) -> tuple[float, float]:
        return self._alpha.get(pid, 0.5), self._beta.get(pid, 0.5)

    def values(self, prompt_ids: PromptIds) -> torch.Tensor:
        """Tracked pass rates ``p = alpha / (alpha + beta)``. Shape: ``[N]`` fp32."""
        ps = []
        for pid in _ids(prompt_ids):
            a, b = self._ab(pid)
            ps.append(a / (a + b))
        return torch.tensor(ps, dtype=torch.float32)

    def advantages(self, prompt_ids: PromptIds, rewards: torch.Tensor) -> torch.Tensor:
        """``A = r - p`` (tracker before this batch's update), normalised over the batch.

        Shape:
            prompt_ids: ``[N]``; rewards: ``[N]``; returns ``[N]`` fp32 on ``rewards``' device.
        """
        ids = _ids(prompt_ids)
        device = rewards.device if isinstance(rewards, torch.Tensor) else torch.device("cpu")
        r = _rewards(rewards, len(ids))
        a = r - self.values(ids).double()
        if self.normalize and a.numel() > 0:
            a = a - a.mean()
            if a.numel() > 1:
                a = a / (a.std() + self.eps)
        return a.float().to(device)

    def forgetting(self, kl: Any) -> torch.Tensor:
        """``rho = clip(2^(-D / d_half), rho_min, rho_max)``. Shape: ``[N]`` -> ``[N]`` fp64."""
        d = torch.as_tensor(kl).detach().double().cpu()
        if d.dim() != 1:
            raise ValueError(f"kl must be [N], got {_checks._shape(d)}")
        if not torch.isfinite(d).all() or (d < 0).any():
            raise ValueError(f"kl must be finite and >= 0, got {d.tolist()}")
        return torch.pow(2.0, -d / self.d_half).clamp(self.rho_min, self.rho_max)

    def update(self, prompt_ids: PromptIds, rewards: Any, kl: Optional[Any] = None) -> None:
        """Folds a batch of rewards into the trackers.

        Args:
            prompt_ids: the prompt of each rollout (repeats are applied in order).
            rewards: rewards in ``[0, 1]``.
            kl: optional per-rollout policy change ``D`` since the prompt's last visit (the
                reference code uses the mean absolute log-prob change of the prompt's previous
                response); without it the constant ``rho`` is used.

        Shape:
            prompt_ids, rewards, kl: ``[N]``.
        """
        ids = _ids(prompt_ids)
        r = _rewards(rewards, len(ids)).tolist()
        if kl is None:
            rhos = [self.rho] * len(ids)
        else:
            rho_t = self.forgetting(kl)
            if rho_t.shape[0] != len(ids):
                raise ValueError(
                    f"kl must be [N]=[{len(ids)}] (one per prompt id), got [{rho_t.shape[0]}]"
                )
            rhos = rho_t.tolist()
        for pid, ri, rho in zip(ids, r, rhos):
            a, b = self._ab(pid)
            self._alpha[pid] = rho * a + ri
            self._beta[pid] = rho * b + (1.0 - ri)

    def sampling_weights(self, prompt_ids: PromptIds) -> torch.Tensor:
        """Unnormalised prioritised-sampling weights ``sqrt(p (1 - p)) + sampling_eps``.

        Prompts the tracker is unsure about (``p`` near 1/2) are drawn more often; pass the
        weights to ``torch.multinomial`` (normalisation is implied). Shape: ``[N]`` fp32.
        """
        p = self.values(prompt_ids).double()
        return (torch.sqrt(p * (1 - p)) + self.sampling_eps).float()

    def __len__(self) -> int:
        return len(self._alpha)

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume exactly (trackers and hyper-parameters)."""
        return {
            "alpha": dict(self._alpha),
            "beta": dict(self._beta),
            "config": {
                "prior_samples": self.prior_samples,
                "rho_min": self.rho_min,
                "rho_max": self.rho_max,
                "d_half": self.d_half,
                "rho": self.rho,
                "sampling_eps": self.sampling_eps,
                "normalize": self.normalize,
                "eps": self.eps,
            },
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        missing = {"alpha", "beta", "config"} - set(state)
        if missing:
            raise ValueError(f"state_dict is missing key(s) {sorted(missing)}")
        if set(state["alpha"]) != set(state["beta"]):
            raise ValueError("state_dict alpha and beta track different prompt ids")
        for key, value in state["config"].items():
            setattr(self, key, value)
        self._alpha = {k: float(v) for k, v in state["alpha"].items()}
        self._beta = {k: float(v) for k, v in state["beta"].items()}

    def known(self, prompt_ids: Iterable[Hashable]) -> list[bool]:
        """Whether each prompt has a tracker (prior or visits)."""
        return [pid in self._alpha for pid in prompt_ids]
