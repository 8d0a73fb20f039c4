"""Sequence-level advantage estimators: group (GRPO) and single-stream (SPO).

Both return one advantage per rollout, ``[N]`` fp32, which any strategy of
:mod:`pepo.weighting` turns into token advantages unchanged.

Both implement one *step interface*, the :class:`Estimator` protocol, so a training loop
reads the same in either mode (the recipe has no mode checks)::

    est.prepare(prompt_ids, score)                 # once, before training (SPO's offline prior:
                                                   # est.prior_samples rollouts per prompt)
    est.set_prior(pass_rates)                      # or the prior prepare() returned, from a file
    picked = est.choose(pool_ids, k, generator)    # k prompts out of a candidate pool
    # ... generate est.rollouts_per_prompt responses for each picked prompt, score them ...
    adv = est.advantages(rollout_prompt_ids, rewards)       # [N]
    # ... token weights, policy update; if est.needs_drift, measure the policy's drift ...
    est.observe(rollout_prompt_ids, rewards, drift)         # after the update
    est.state_dict() / est.load_state_dict(...)             # exact resume

:func:`build_estimator` makes either from a name and keyword arguments (the recipe's
``estimator`` config section); :func:`register_estimator` adds another to the same registry, as
:func:`pepo.weighting.register_strategy` does for strategies.

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
  sampling weights ``sqrt(p (1 - p)) + 0.05``. The prior, ``N0``, ``D_half = 0.06`` and
  ``rho_max = 0.96`` are exactly the SPO authors' own implementation. Where pepo differs is
  ``D(x)``: the SPO code re-scores prompt ``x``'s last response under the current policy and
  takes the mean |Δ log-prob|; pepo keeps a running total of each step's policy drift (the
  batch's mean |Δ log-prob| across the update) and, per prompt, the total at its last visit,
  and takes their difference: the drift summed since the visit, without storing or re-scoring
  old responses. A prompt's first visit after the prior therefore counts all the drift since
  :meth:`~SingleStreamEstimator.set_prior`, and usually forgets down to ``rho_min``; the SPO
  code, with no earlier response to re-score, has ``D = 0`` there and keeps ``rho_max`` of the
  prior (``alpha0 = 4`` and reward 1 give pepo's ``0.875 * 4 + 1 = 4.5`` once the drift
  reaches ``rho_min``, the SPO code's ``0.96 * 4 + 1 = 4.84``).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Any, Optional, Protocol, Union, runtime_checkable

import torch

from pepo import _checks
from pepo._group import group_advantages
from pepo.sampling import check_k, prioritized_sample

__all__ = [
    "ESTIMATORS",
    "Estimator",
    "GroupEstimator",
    "PromptIds",
    "ScoreFn",
    "SingleStreamEstimator",
    "build_estimator",
    "estimator_parameters",
    "group_advantages",
    "list_estimators",
    "register_estimator",
]


PromptIds = Union[Sequence[Hashable], torch.Tensor]
# score(indices) -> rewards [len(indices)]: the rewards of one fresh rollout of each prompt
# ``prompt_ids[i]`` (indices repeat for several rollouts of one prompt).
ScoreFn = Callable[[list[int]], torch.Tensor]


@runtime_checkable
class Estimator(Protocol):
    """The step interface every estimator implements (see the module docstring).

    Attributes:
        name: the registry name.
        rollouts_per_prompt: rollouts generated for each chosen prompt (laid out contiguously).
        candidate_pool: :meth:`choose` picks ``k`` prompts out of ``candidate_pool * k``.
        needs_drift: whether :meth:`observe` needs the step's policy drift.
        prior_samples: rollouts of every prompt :meth:`prepare` draws before training (0: no
            offline prior; :meth:`set_prior` then takes none).
    """

    # read-only protocol members: a plain attribute or a property satisfies each
    @property
    def name(self) -> str: ...
    @property
    def rollouts_per_prompt(self) -> int: ...
    @property
    def candidate_pool(self) -> int: ...
    @property
    def needs_drift(self) -> bool: ...
    @property
    def prior_samples(self) -> int: ...

    def prepare(self, prompt_ids: PromptIds, score: ScoreFn) -> dict[Hashable, float]:
        """Samples the offline prior (``prior_samples`` rollouts of each prompt, scored by
        ``score``), sets it and returns it (pass rate per prompt id; empty without one)."""

    def set_prior(self, pass_rates: Mapping[Hashable, float]) -> None:
        """Sets a prior :meth:`prepare` returned (read back from a cache)."""

    def choose(self, prompt_ids: PromptIds, k: int, generator: torch.Generator) -> list[int]:
        """Indices of ``k`` prompts out of the candidate pool ``prompt_ids``."""

    def advantages(self, prompt_ids: PromptIds, rewards: torch.Tensor) -> torch.Tensor:
        """Sequence advantages ``[N]`` fp32 of rollouts of ``prompt_ids`` with ``rewards``."""

    def observe(self, prompt_ids: PromptIds, rewards: torch.Tensor,
                drift: Optional[float] = None) -> None:
        """Learns from a finished step (after the update; ``drift`` when ``needs_drift``)."""

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps: tensors, Python numbers and strings, lists and plain dicts
        (a resume reads it with ``torch.load(weights_only=True)``)."""

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores a :meth:`state_dict` (on resume); refuses another estimator's."""


def _ids(prompt_ids: PromptIds) -> list[Hashable]:
    if isinstance(prompt_ids, torch.Tensor):
        if prompt_ids.dim() != 1:
            raise ValueError(f"prompt_ids must be [N], got {_checks.format_shape(prompt_ids)}")
        return prompt_ids.tolist()
    if isinstance(prompt_ids, (str, bytes)):
        raise ValueError("prompt_ids must be a sequence of ids, got a single string")
    return list(prompt_ids)


def _per_id(rewards: Any, n: int) -> torch.Tensor:
    rewards = torch.as_tensor(rewards)
    if rewards.dim() != 1 or rewards.shape[0] != n:
        raise ValueError(f"rewards must be [N]=[{n}] (one per prompt id), got "
                         f"{_checks.format_shape(rewards)}")
    return rewards


def _rewards(rewards: Any, n: int) -> torch.Tensor:
    r = _per_id(rewards, n).detach().double().cpu()
    if not torch.isfinite(r).all() or (r < 0).any() or (r > 1).any():
        raise ValueError(f"rewards must lie in [0, 1] for the Beta tracker, got values in "
                         f"[{r.min().item()}, {r.max().item()}]")
    return r


def _check_config(own: Mapping[str, Any], state: Mapping[str, Any], what: str, name: str,
                  keys: tuple[str, ...] = ()) -> None:
    """Refuses a state of another estimator than ``name``, one missing one of ``keys`` or its
    ``config``, and one whose hyper-parameters differ from the configured ones (a resume that
    silently switched them would mix two experiments)."""
    if state.get("name", name) != name:
        raise ValueError(f"state_dict is of estimator {state.get('name')!r}, not {name!r}")
    missing = {"config", *keys} - set(state)
    if missing:
        raise ValueError(f"state_dict is missing key(s) {sorted(missing)}")
    saved = state["config"]
    diff = {k: (saved.get(k), v) for k, v in own.items() if saved.get(k) != v}
    diff.update({k: (v, None) for k, v in saved.items() if k not in own})
    if diff:
        details = ", ".join(f"{k}: saved {a!r}, configured {b!r}"
                            for k, (a, b) in sorted(diff.items()))
        raise ValueError(f"{what} state_dict was saved with other hyper-parameters ({details})")


class GroupEstimator:
    """GRPO's group advantages behind the step interface (see the module docstring).

    Each chosen prompt gets ``group_size`` rollouts, laid out contiguously; advantages are
    :func:`group_advantages`. There is no state beyond the hyper-parameters.

    Args:
        group_size: rollouts per prompt ``G >= 2``.
        normalize_std, unbiased, eps: as in :func:`group_advantages`.
    """

    name = "group"
    candidate_pool = 1
    needs_drift = False
    prior_samples = 0  # no offline prior

    def __init__(
        self, group_size: int = 8, *, normalize_std: bool = True, unbiased: bool = True,
        eps: float = 1e-6,
    ) -> None:
        if not _checks.is_int(group_size) or group_size < 2:
            raise ValueError(
                f"group_size must be an int >= 2 (advantages are relative to the group; use "
                f"SingleStreamEstimator for one rollout per prompt), got {group_size!r}"
            )
        self.group_size = int(group_size)
        self.normalize_std = _checks.check_flag("normalize_std", normalize_std)
        self.unbiased = _checks.check_flag("unbiased", unbiased)
        self.eps = _checks.check_nonnegative("eps", eps)

    @property
    def rollouts_per_prompt(self) -> int:
        """``group_size``: every chosen prompt gets a group."""
        return self.group_size

    def prepare(self, prompt_ids: PromptIds, score: ScoreFn) -> dict[Hashable, float]:
        """Nothing to prepare: group advantages need no prior."""
        return {}

    def set_prior(self, pass_rates: Mapping[Hashable, float]) -> None:
        """Takes only the empty prior :meth:`prepare` returns (group advantages use none)."""
        if pass_rates:
            raise ValueError(f"the group estimator takes no offline prior (its advantages are "
                             f"relative to each group), got pass rates of {len(pass_rates)} "
                             f"prompts")

    def choose(self, prompt_ids: PromptIds, k: int, generator: torch.Generator) -> list[int]:
        """The first ``k`` candidates, in order (the pool is already a shuffled draw)."""
        return list(range(min(check_k(k), len(_ids(prompt_ids)))))

    def advantages(self, prompt_ids: PromptIds, rewards: torch.Tensor) -> torch.Tensor:
        """Group advantages of rollouts in contiguous groups. Shape: ``[N]`` -> ``[N]``."""
        ids = _ids(prompt_ids)
        g, rewards = self.group_size, _per_id(rewards, len(ids))
        if any(len(set(ids[i : i + g])) != 1 for i in range(0, len(ids), g)):
            raise ValueError(
                f"group mode needs rollouts in contiguous groups of {g} with one prompt id each, "
                f"got prompt ids {ids[: 2 * g]}{' ...' if len(ids) > 2 * g else ''}"
            )
        return group_advantages(
            rewards, g, normalize_std=self.normalize_std, unbiased=self.unbiased, eps=self.eps
        )

    def observe(self, prompt_ids: PromptIds, rewards: torch.Tensor,
                drift: Optional[float] = None) -> None:
        """Nothing to learn after a step."""

    def _config(self) -> dict[str, Any]:
        return {"group_size": self.group_size, "normalize_std": self.normalize_std,
                "unbiased": self.unbiased, "eps": self.eps}

    def state_dict(self) -> dict[str, Any]:
        """No learnt state: the name and configuration, which a resume checks."""
        return {"name": self.name, "config": self._config()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Checks that ``state`` is this estimator's, with this configuration."""
        _check_config(self._config(), {"name": None, **state}, "GroupEstimator", self.name)


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
    * :meth:`observe` is the step interface's update: ``D(x)`` is the policy drift since the
      prompt's last visit (:meth:`drift_since_last_visit`), then this step's drift is added to
      the running total (:meth:`add_drift`).
    * :meth:`sampling_weights` gives ``sqrt(p (1 - p)) + sampling_eps`` for prioritised sampling,
      which :meth:`choose` uses to draw a step's prompts from a candidate pool.

    Args:
        prior_pass_rates: optional offline pass-rate estimate per prompt id (in ``[0, 1]``),
            e.g. from ``prior_samples`` rollouts of the initial policy.
        prior_samples: the number of offline rollouts ``n`` behind each prior pass rate; also
            how many rollouts of each prompt :meth:`prepare` draws (0: no offline prior).
        rho_min, rho_max: clip range of the adaptive forgetting factor.
        d_half: the policy change at which the adaptive ``rho`` halves the old evidence.
        rho: constant forgetting factor used by :meth:`update` without ``kl`` (and by
            :meth:`observe` when ``adaptive_forgetting`` is False).
        sampling_eps: exploration floor of the sampling weights.
        normalize: normalise advantages over the batch (SPO's default).
        eps: added to the batch std.
        candidate_pool: :meth:`choose` draws ``k`` prompts out of a pool of
            ``candidate_pool * k`` candidates (1: take the pool as it is).
        adaptive_forgetting: :meth:`observe` forgets by the policy drift since each prompt's
            last visit (SPO); False: the constant ``rho``.

    Prompts without a prior start at the Jeffreys prior ``alpha = beta = 1/2``.

    Rewards must lie in ``reward_range``, ``[0, 1]``: the tracker counts them as successes.
    """

    name = "single_stream"
    rollouts_per_prompt = 1
    reward_range = (0.0, 1.0)  # optional for an estimator: the rewards it can take

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
        candidate_pool: int = 1,
        adaptive_forgetting: bool = True,
    ):
        for key, value in (("rho_min", rho_min), ("rho_max", rho_max), ("rho", rho),
                           ("d_half", d_half), ("sampling_eps", sampling_eps), ("eps", eps)):
            if not _checks.is_real(value) or not math.isfinite(value):
                raise ValueError(f"{key} must be a finite number, got {value!r}")
        if not (0.0 < rho_min <= rho_max <= 1.0):
            raise ValueError(
                f"need 0 < rho_min <= rho_max <= 1, got rho_min={rho_min}, rho_max={rho_max}"
            )
        if not (0.0 < rho <= 1.0):
            raise ValueError(f"rho must be in (0, 1], got {rho}")
        for key, value in (("prior_samples", prior_samples), ("candidate_pool", candidate_pool)):
            low = 0 if key == "prior_samples" else 1
            if not _checks.is_int(value) or value < low:
                raise ValueError(f"{key} must be an int >= {low}, got {value!r}")
        _checks.check_positive("d_half", d_half)
        if sampling_eps < 0:
            raise ValueError(f"sampling_eps must be >= 0, got {sampling_eps}")
        if eps < 0:
            raise ValueError(f"eps must be >= 0, got {eps}")
        self.prior_samples = int(prior_samples)
        self.rho_min = float(rho_min)
        self.rho_max = float(rho_max)
        self.d_half = float(d_half)
        self.rho = float(rho)
        self.sampling_eps = float(sampling_eps)
        self.normalize = _checks.check_flag("normalize", normalize)
        self.eps = float(eps)
        self.candidate_pool = int(candidate_pool)
        self.adaptive_forgetting = _checks.check_flag("adaptive_forgetting", adaptive_forgetting)
        self._alpha: dict[Hashable, float] = {}
        self._beta: dict[Hashable, float] = {}
        self.drift_total = 0.0
        self._last_visit: dict[Hashable, float] = {}
        if prior_pass_rates:
            self.set_prior(prior_pass_rates)

    @property
    def needs_drift(self) -> bool:
        """Whether :meth:`observe` needs the step's policy drift."""
        return self.adaptive_forgetting

    @property
    def prior_weight(self) -> float:
        """``N0 = 1 / (1 - rho_min)``: the effective sample size of an offline prior, the
        steady-state evidence of the tracker at the strongest forgetting."""
        return 1.0 / (1.0 - self.rho_min) if self.rho_min < 1.0 else float(self.prior_samples)

    def set_prior(self, pass_rates: Mapping[Hashable, float]) -> None:
        """Sets (or resets) the tracker of each given prompt from its offline pass rate."""
        n, n0 = self.prior_samples, self.prior_weight
        if n < 1:
            raise ValueError("set_prior needs prior_samples >= 1 (the rollouts behind each rate)")
        for pid, p in pass_rates.items():
            p = float(p)
            if not (0.0 <= p <= 1.0):
                raise ValueError(f"prior pass rate of prompt {pid!r} must be in [0, 1], got {p}")
            k = p * n
            self._alpha[pid] = n0 * (k + 0.5) / (n + 1)
            self._beta[pid] = n0 * (n - k + 0.5) / (n + 1)
            self._last_visit[pid] = self.drift_total

    def prepare(self, prompt_ids: PromptIds, score: ScoreFn,
                chunk_rollouts: int = 256) -> dict[Hashable, float]:
        """SPO's offline prior: ``prior_samples`` rollouts of every prompt, scored by ``score``
        (``chunk_rollouts`` at a time); each prompt's prior is its mean reward. Returns the
        pass rates set (:meth:`set_prior` takes them back); nothing happens when
        ``prior_samples`` is 0."""
        n = self.prior_samples
        if n == 0:
            return {}
        ids = _ids(prompt_ids)
        per_call = max(1, chunk_rollouts // n)
        rates: dict[Hashable, float] = {}
        for start in range(0, len(ids), per_call):
            idx = list(range(start, min(start + per_call, len(ids))))
            rewards = _rewards(score([i for i in idx for _ in range(n)]), len(idx) * n)
            for j, i in enumerate(idx):
                rates[ids[i]] = float(rewards[j * n : (j + 1) * n].mean())
        self.set_prior(rates)
        return rates

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

        Raises:
            ValueError: one rollout with ``normalize=True`` (its centred advantage is always 0:
                such a step would train on nothing).

        Shape:
            prompt_ids: ``[N]``; rewards: ``[N]``; returns ``[N]`` fp32 on ``rewards``' device.
        """
        ids = _ids(prompt_ids)
        device = rewards.device if isinstance(rewards, torch.Tensor) else torch.device("cpu")
        r = _rewards(rewards, len(ids))
        a = r - self.values(ids).double()
        if self.normalize and a.numel() == 1:
            raise ValueError("SPO's batch normalisation needs at least 2 rollouts (one rollout's "
                             "centred advantage is always 0); pass more, or normalize=False")
        if self.normalize and a.numel() > 0:
            a = a - a.mean()
            if a.numel() > 1:  # equal advantages stay 0 (with eps = 0 they were 0 / 0)
                scale = a.std() + self.eps
                a = torch.where(scale > 0, a / scale, torch.zeros_like(a))
        return a.float().to(device)

    def forgetting(self, kl: Any) -> torch.Tensor:
        """``rho = clip(2^(-D / d_half), rho_min, rho_max)``. Shape: ``[N]`` -> ``[N]`` fp64."""
        d = torch.as_tensor(kl).detach().double().cpu()
        if d.dim() != 1:
            raise ValueError(f"kl must be [N], got {_checks.format_shape(d)}")
        if not torch.isfinite(d).all() or (d < 0).any():
            raise ValueError(f"kl must be finite and >= 0, got {d.tolist()}")
        return torch.pow(2.0, -d / self.d_half).clamp(self.rho_min, self.rho_max)

    def update(self, prompt_ids: PromptIds, rewards: Any, kl: Optional[Any] = None) -> None:
        """Folds a batch of rewards into the trackers.

        Args:
            prompt_ids: the prompt of each rollout (repeats are applied in order).
            rewards: rewards in ``[0, 1]``.
            kl: optional per-rollout policy change ``D`` since the prompt's last visit
                (:meth:`drift_since_last_visit` gives it); without it the constant ``rho`` is
                used.

        Each prompt's last visit is recorded at the current drift total.

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
            self._last_visit[pid] = self.drift_total

    def add_drift(self, drift: float) -> None:
        """Adds one step's policy drift (mean |Δ log-prob| across its update) to the total."""
        self.drift_total += _checks.check_nonnegative("drift", drift)

    def drift_since_last_visit(self, prompt_ids: PromptIds) -> torch.Tensor:
        """``D(x)``: the drift total now minus at the prompt's last visit (prior or update);
        a prompt never seen counts from the start. A prompt repeated in ``prompt_ids`` (a pool
        across an epoch's end) has drift 0 at its later rows: :meth:`update` applies the rows
        in order, so the earlier row is its last visit, under the same policy. Shape: ``[N]``
        fp64."""
        seen: set[Hashable] = set()
        out = []
        for pid in _ids(prompt_ids):
            out.append(0.0 if pid in seen else self.drift_total - self._last_visit.get(pid, 0.0))
            seen.add(pid)
        return torch.tensor(out, dtype=torch.float64).clamp_min(0.0)

    def observe(self, prompt_ids: PromptIds, rewards: Any, drift: Optional[float] = None) -> None:
        """The step interface's update, after the policy update.

        The rewards were sampled from the policy before this step's update, so the forgetting
        uses the drift up to that policy (:meth:`drift_since_last_visit`); then ``drift``, the
        change this step's update made, joins the total for later visits.

        Args:
            prompt_ids, rewards: this step's rollouts (``[N]``).
            drift: this step's policy drift; required with ``adaptive_forgetting``.
        """
        if not self.adaptive_forgetting:
            self.update(prompt_ids, rewards)
            return
        if drift is None:
            raise ValueError("adaptive forgetting needs the step's policy drift (drift=None)")
        self.update(prompt_ids, rewards, kl=self.drift_since_last_visit(prompt_ids))
        self.add_drift(drift)

    def sampling_weights(self, prompt_ids: PromptIds) -> torch.Tensor:
        """Unnormalised prioritised-sampling weights ``sqrt(p (1 - p)) + sampling_eps``.

        Prompts the tracker is unsure about (``p`` near 1/2) are drawn more often; pass the
        weights to ``torch.multinomial`` (normalisation is implied). Shape: ``[N]`` fp32.
        """
        p = self.values(prompt_ids).double()
        return (torch.sqrt(p * (1 - p)) + self.sampling_eps).float()

    def choose(self, prompt_ids: PromptIds, k: int, generator: torch.Generator) -> list[int]:
        """SPO's prioritised sampling: ``k`` indices into ``prompt_ids`` drawn without
        replacement with probability ∝ :meth:`sampling_weights`."""
        return prioritized_sample(self.sampling_weights(prompt_ids), k, generator)

    def __len__(self) -> int:
        return len(self._alpha)

    def _config(self) -> dict[str, Any]:
        return {
            "prior_samples": self.prior_samples,
            "rho_min": self.rho_min,
            "rho_max": self.rho_max,
            "d_half": self.d_half,
            "rho": self.rho,
            "sampling_eps": self.sampling_eps,
            "normalize": self.normalize,
            "eps": self.eps,
            "candidate_pool": self.candidate_pool,
            "adaptive_forgetting": self.adaptive_forgetting,
        }

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume exactly (trackers, drift bookkeeping, hyper-parameters)."""
        return {
            "name": self.name,
            "alpha": dict(self._alpha),
            "beta": dict(self._beta),
            "drift_total": self.drift_total,
            "last_visit": dict(self._last_visit),
            "config": self._config(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores a :meth:`state_dict`.

        Raises:
            ValueError: missing keys, or hyper-parameters other than this estimator's (the
                configured ones are never silently replaced).
        """
        _check_config(self._config(), state, "SingleStreamEstimator", self.name,
                      ("alpha", "beta", "drift_total", "last_visit"))
        if set(state["alpha"]) != set(state["beta"]):
            raise ValueError("state_dict alpha and beta track different prompt ids")
        alpha, beta = ({k: float(v) for k, v in state[s].items()} for s in ("alpha", "beta"))
        bad = [(k, v) for k, v in (*alpha.items(), *beta.items()) if not 0 < v < math.inf]
        if bad or not math.isfinite(float(state["drift_total"])):
            raise ValueError(f"state_dict holds a Beta parameter that is not a finite number > 0 "
                             f"(prompt {bad[0][0]!r}: {bad[0][1]})" if bad else
                             f"state_dict's drift_total is {state['drift_total']}")
        self._alpha, self._beta = alpha, beta
        self.drift_total = float(state["drift_total"])
        self._last_visit = {k: float(v) for k, v in state["last_visit"].items()}

    def known(self, prompt_ids: Iterable[Hashable]) -> list[bool]:
        """Whether each prompt has a tracker (prior or visits)."""
        return [pid in self._alpha for pid in prompt_ids]


# name -> factory (a class or a function) of an object implementing :class:`Estimator`
ESTIMATORS: dict[str, Callable[..., Estimator]] = {}


def register_estimator(name: str, *, overwrite: bool = False
                       ) -> Callable[[Callable[..., Estimator]], Callable[..., Estimator]]:
    """Decorator registering an estimator factory under ``name`` (as
    :func:`pepo.weighting.register_strategy` does for strategies): its keyword arguments are
    what the ``estimator`` config section may set, and :func:`build_estimator` refuses what it
    returns unless that implements the whole :class:`Estimator` protocol. ``overwrite``: as
    :func:`pepo.weighting.register_strategy`'s.

    Example::

        @register_estimator("leave_one_out")
        class LeaveOneOut(GroupEstimator):
            name = "leave_one_out"
            ...
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"estimator name must be a non-empty str, got {name!r}")

    def decorator(factory: Callable[..., Estimator]) -> Callable[..., Estimator]:
        _checks.check_registration("estimator", name, ESTIMATORS.get(name), factory, overwrite)
        ESTIMATORS[name] = factory
        return factory

    return decorator


register_estimator("group")(GroupEstimator)
register_estimator("single_stream")(SingleStreamEstimator)


def list_estimators() -> list[str]:
    """Names of all registered estimators, sorted."""
    return sorted(ESTIMATORS)


def estimator_parameters(name: str) -> list[str]:
    """The keyword arguments of estimator ``name`` (what its config section may set)."""
    if name not in ESTIMATORS:
        close = _checks.close_name(name, sorted(ESTIMATORS))
        hint = _checks.paper_name_hint("estimator", name) or (close and f"did you mean {close!r}?")
        raise ValueError(f"estimator name must be one of {sorted(ESTIMATORS)}, got {name!r}"
                         + (f" ({hint})" if hint else ""))
    return [p for p in inspect.signature(ESTIMATORS[name]).parameters if p != "prior_pass_rates"]


_MEMBERS = ("name", "rollouts_per_prompt", "candidate_pool", "needs_drift", "prior_samples",
            "prepare", "set_prior", "choose", "advantages", "observe", "state_dict",
            "load_state_dict")


def build_estimator(name: str, **kwargs: Any) -> Estimator:
    """The estimator ``name`` (``"group"``, ``"single_stream"`` or a registered one) with
    ``kwargs``.

    Raises:
        ValueError: unknown name or keyword (the message lists the valid ones), bad values, or a
            registered factory whose result lacks part of the :class:`Estimator` protocol.
    """
    valid = estimator_parameters(name)
    unknown = sorted(set(kwargs) - set(valid))
    if unknown:
        raise ValueError(f"unknown {name} estimator key(s) {unknown}; valid: {sorted(valid)}")
    try:
        made = ESTIMATORS[name](**kwargs)
    except TypeError as e:  # a missing argument, or a value it cannot take
        raise ValueError(f"estimator {name!r}: {e}") from e
    missing = [m for m in _MEMBERS if not hasattr(made, m)]
    if missing:
        raise ValueError(f"estimator {name!r} does not implement the Estimator protocol: "
                         f"it has no {missing}")
    return made
