"""Per-token advantage weighting: PEPO's proximal entropy and the baselines it is compared to.

Every strategy has one signature::

    strategy(advantages [B], entropies [B, T], mask bool [B, T], *, positive=None, groups=None)
        -> token_advantages [B, T]

The output is fp32, detached, and exactly 0 wherever ``mask`` is False. ``positive`` (bool
``[B]``) names the rollouts that count as successful: strategies with ``apply_to="positive"``
weight those rows only and leave the others at the uniform advantage (paper Sec. 4: weighting
applies to *positive-reward* rollouts). Without it, ``advantages > 0`` stands in, which is the
same thing for GRPO with binary rewards but not for SPO's batch-normalised advantages; the
recipe passes its reward's success flags. ``groups`` (integer ``[B]``, equal for the rollouts of
one prompt) is read only by strategies that compare the rollouts of a group (``gtpo``).
Strategies are built by name from a registry (:func:`get_strategy`), listed by
:func:`list_strategies`, and extended with :func:`register_strategy`.

Windows (``proximal_softmax``, ``window_average``, ``global_topk(score="proximal")``) run over
each row's *valid* tokens in order: positions where ``mask`` is False are dropped before the
window is applied, so a row with holes in its mask (tool-output spans, say) behaves exactly as
the compacted row, and whatever the padding holds (NaN included) never matters. The window is
centred, of odd size ``W``, and reflect-padded at each row's own ends exactly as
``numpy.pad(mode="reflect")`` does, repeatedly for rows shorter than ``W // 2`` (a row of one
token sees itself ``W`` times).

Implementation notes (deviations from the direct formulation, not from the math; the kernels
are in ``pepo._windows``):

* The windowed sums are computed in O(B·T) with a two-block scan, never holding a
  ``[B, T, W]`` tensor; each sum adds at most ``W`` terms, so it stays as accurate as the direct
  sum on 32k-token rows.
* Softmax numerators are shifted by each row's maximum where the temperature makes that exact
  for any real entropy (``τ >= 0.3``), else the exact log-domain path (``logcumsumexp``) runs;
  the choice reads no value. A row too wide for the shifted exp (entropies above 24 nats) is
  NaN unvalidated and redone on the log-domain path when validated.
* With ``validate=False`` nothing reads a tensor value on the host (``pepo._strategy``); on
  CUDA the built-in strategies run as Triton kernels (``pepo._triton``) where Triton is
  installed, else ``torch.compile``-d (:func:`set_compile`).
"""

from __future__ import annotations

import inspect
import math
import numbers
import typing
import warnings
from typing import Any, Callable, Optional

import torch

from pepo import _checks
from pepo import _windows as _w
from pepo._gtpo import NORMALIZE as GTPO_NORMALIZE
from pepo._gtpo import check_params as check_gtpo_params
from pepo._gtpo import gtpo_rewards, shaped, standardized
from pepo._strategy import Strategy, StrategyFn, compile_enabled, set_compile, validate_flag
from pepo._topk import global_count, select_top

__all__ = [
    "Strategy",
    "StrategyFn",
    "compile_enabled",
    "entropy_bonus",
    "get_strategy",
    "global_topk",
    "gtpo",
    "gtpo_rewards",
    "linear_proximal_entropy",
    "list_strategies",
    "normalize_to_length",
    "proximal_entropy",
    "proximal_softmax",
    "register_strategy",
    "set_compile",
    "uniform",
    "weight_rows",
    "window_average",
    "window_average_entropy",
]


def proximal_entropy(
    entropies: torch.Tensor,
    mask: torch.Tensor,
    window: int = 101,
    temperature: float = 1.0,
    *,
    validate: bool = True,
    check_finite: Optional[bool] = None,
) -> torch.Tensor:
    """Proximal entropy, Eq. (6), with the softmax temperature of Appendix F.3.

    ``e_{i,t} = exp(H_{i,t}/τ) / Σ_{k ∈ W(t)} exp(H_{i,k}/τ)`` with ``W(t)`` the ``window``
    valid tokens of row ``i`` centred on ``t`` (reflect-padded at the row's ends).

    Args:
        entropies: per-token entropies ``H``; any float dtype (computed in fp32).
        mask: True at valid (generated) tokens.
        window: odd window size ``W >= 1`` (paper: 101).
        temperature: softmax temperature ``τ > 0`` (paper: 1.0).
        validate: raise if ``entropies`` holds NaN/inf or a value below ``-1e-4`` at a valid
            position (one host sync; fp32 rounding's slightly negative entropies pass). With
            False the call reads no value on the host, and a NaN/inf reaches the output as NaN.
        check_finite: deprecated name of ``validate``.

    Shape:
        entropies: ``[B, T]``; mask: ``[B, T]`` bool; returns ``[B, T]`` fp32, 0 where mask
        is False. Detached.

    Raises:
        ValueError: on bad shapes, dtypes, hyper-parameters or non-finite valid entropies.
    """
    validate = validate_flag(validate, check_finite)
    entropies, mask = _checks.check_entropies_mask(entropies, mask)
    window = _checks.check_window(window)
    temperature = _checks.check_temperature(temperature)
    with torch.no_grad():
        clean = _w.clean(entropies.detach(), mask)
        e = _w.proximal(clean, mask, window, temperature)
        if validate and not _checks.check_finite_clean(entropies=clean, output=e):
            with _w.exact_windows():  # rows too wide for the shifted exp (entropies > 24 nats)
                e = _w.proximal(clean, mask, window, temperature)
        return e


def window_average_entropy(
    entropies: torch.Tensor,
    mask: torch.Tensor,
    window: int = 101,
    *,
    validate: bool = True,
    check_finite: Optional[bool] = None,
) -> torch.Tensor:
    """The ``window_average`` strategy's statistic, Eq. (6) without its softmax (this library's
    reading of App. E's windowed-average diagnostic): ``r_t = H_t / Σ_{k∈W(t)} H_k``.

    Same windows as :func:`proximal_entropy` (each row's valid tokens, centred, reflect-padded);
    ``r_t = 1/W`` where the window's entropies sum to 0. Like ``e``, ``r`` is relative to the
    window: scaling a row's entropies by a constant leaves it unchanged, and a slow trend
    cancels, so it is flat over position where ``H`` decays.

    Args:
        entropies: per-token entropies ``H >= 0`` (values down to ``-1e-4``, fp32 rounding of
            near-zero entropies, count as 0).
        mask: True at valid (generated) tokens.
        window: odd window size ``W >= 1``.
        validate: raise if ``entropies`` holds NaN/inf or a value below ``-1e-4`` at a valid
            position (one host sync; fp32 rounding's slightly negative entropies pass). With
            False the call reads no value on the host: a NaN/inf reaches the output as NaN and
            negative entropies count as 0.
        check_finite: deprecated name of ``validate``.

    Shape:
        entropies: ``[B, T]``; mask: ``[B, T]`` bool; returns ``[B, T]`` fp32, 0 where mask
        is False. Detached.

    Raises:
        ValueError: on bad shapes, dtypes, window, non-finite or negative valid entropies.
    """
    validate = validate_flag(validate, check_finite)
    entropies, mask = _checks.check_entropies_mask(entropies, mask)
    window = _checks.check_window(window)
    with torch.no_grad():
        clean = _w.clean(entropies.detach(), mask)
        if validate:
            _checks.check_finite_clean(entropies=clean)
        return _w.window_average(clean, mask, window)


def linear_proximal_entropy(entropies: torch.Tensor, mask: torch.Tensor, window: int = 101, *,
                            validate: bool = True, check_finite: Optional[bool] = None
                            ) -> torch.Tensor:
    """Deprecated alias of :func:`window_average_entropy` (the same function under its old
    name, the same keywords), with a ``FutureWarning``. It goes away in 0.3."""
    warnings.warn("pepo.weighting.linear_proximal_entropy is deprecated: use "
                  "pepo.weighting.window_average_entropy (the same function)", FutureWarning,
                  stacklevel=2)
    return window_average_entropy(entropies, mask, window, validate=validate
                                  if check_finite is None else bool(check_finite))


# --------------------------------------------------------------------------------------------
# Registry
# --------------------------------------------------------------------------------------------

_REGISTRY: dict[str, Callable[..., StrategyFn]] = {}
_BUILTIN: dict[str, Callable[..., StrategyFn]] = {}  # set at the end of this module
def register_strategy(
    name: str, *, overwrite: bool = False
) -> Callable[[Callable[..., StrategyFn]], Callable[..., StrategyFn]]:
    """Decorator registering a strategy factory under ``name``.

    The factory takes the strategy's hyper-parameters as keyword arguments, validates them,
    and returns ``fn(advantages [B] fp32, entropies [B, T] fp32 (0 where mask is False),
    mask [B, T] bool) -> [B, T]``. A ``fn`` that declares a parameter named ``positive`` also
    receives the bool ``[B]`` success flags, one named ``groups`` the ``[B]`` prompt-group ids
    (see :class:`Strategy`); a ``fn`` that takes ``**kwargs`` receives both, as keywords
    (``groups`` is None when the caller passed none). Only a ``groups`` parameter without a
    default makes the strategy require groups (:attr:`Strategy.needs_groups`).
    :func:`get_strategy` wraps it in a :class:`Strategy` that validates inputs and zeroes
    masked positions, so a factory needs neither.

    A ``name`` already registered is refused (naming its factory) unless ``overwrite=True``,
    or unless the factory is the same function defined again (the same module and qualified
    name: a notebook cell run twice, ``importlib.reload``), which replaces it.

    Example::

        @register_strategy("late_boost")
        def late_boost(scale: float = 2.0):
            def fn(advantages, entropies, mask):
                pos = mask.cumsum(1) / mask.sum(1, keepdim=True).clamp_min(1)
                return advantages[:, None] * (1 + (scale - 1) * pos)
            return fn
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"strategy name must be a non-empty str, got {name!r}")

    def decorator(factory: Callable[..., StrategyFn]) -> Callable[..., StrategyFn]:
        _checks.check_registration("strategy", name, _REGISTRY.get(name), factory, overwrite)
        _REGISTRY[name] = factory
        return factory

    return decorator


def list_strategies() -> list[str]:
    """Names of all registered strategies, sorted."""
    return sorted(_REGISTRY)


def strategy_parameters(name: str) -> Optional[list[str]]:
    """The hyper-parameter names of strategy ``name`` (None when its factory takes any).

    Raises:
        ValueError: unknown name (the message lists the registered names).
    """
    if name not in _REGISTRY:
        close = _checks.close_name(name, list_strategies())
        paper = _checks.paper_name_hint("strategy", name)
        hint = f"{paper}; " if paper else f"did you mean {close!r}? " if close else ""
        raise ValueError(f"unknown strategy {name!r}; {hint}registered strategies: "
                         f"{list_strategies()}")
    params = inspect.signature(_REGISTRY[name]).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return [p.name for p in params]


def get_strategy(name: str, **params: Any) -> Strategy:
    """Builds the strategy ``name`` with hyper-parameters ``params``.

    Raises:
        ValueError: unknown name (the message lists the registered names), unknown parameter
            (the message lists the valid ones) or a bad parameter value.
    """
    valid = strategy_parameters(name)
    factory = _REGISTRY[name]
    unknown = [k for k in params if valid is not None and k not in valid]
    if unknown:
        raise ValueError(
            f"strategy {name!r} got unknown parameter(s) {unknown}; valid parameters: {valid}"
        )
    builtin = _BUILTIN.get(name) is factory  # the built-ins check their own parameters
    if not builtin:
        _check_annotated(name, factory, params)
    try:  # a missing argument, or a value the factory cannot take (its TypeError)
        bound = inspect.signature(factory).bind(**params)
        bound.apply_defaults()
        fn = factory(**params)
    except TypeError as e:
        raise ValueError(f"strategy {name!r}: {e}") from e
    return Strategy(name, dict(bound.arguments), fn, builtin=builtin)


# what a registered factory's parameter annotated with these types accepts (a bool is no number:
# `gain: true` in a config was taken as 1)
_ANNOTATED = {float: (numbers.Real, "a number"), int: (numbers.Integral, "an integer"),
              bool: (bool, "true or false"), str: (str, "a string")}


def _check_annotated(name: str, factory: Callable[..., Any], params: dict[str, Any]) -> None:
    """A value of the wrong kind for a parameter annotated ``float``, ``int``, ``bool`` or
    ``str`` (the kinds a config writes) is one line naming it; other annotations, and names
    that do not resolve, are the factory's own to check."""
    try:
        hints = typing.get_type_hints(factory)
    except Exception:  # a forward reference the factory's module cannot resolve
        return
    for key, value in params.items():
        kind = _ANNOTATED.get(hints.get(key))  # type: ignore[arg-type]
        if kind is not None and not (isinstance(value, kind[0]) and (
                kind[0] is bool or not isinstance(value, bool))):
            raise ValueError(f"strategy {name!r}: {key} must be {kind[1]} (annotated "
                             f"{hints[key].__name__}), got {value!r}")


# --------------------------------------------------------------------------------------------
# Strategies
# --------------------------------------------------------------------------------------------


@register_strategy("uniform")
def uniform() -> StrategyFn:
    """GRPO: ``Â_{i,t} = A_i`` on every valid token (Eq. 2)."""

    def fn(advantages: torch.Tensor, entropies: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return torch.where(mask, advantages.unsqueeze(1), 0.0)  # cheaper to call than [:, None]

    # one kernel: the entropies are not read (no cleaning), the output is already fp32 and
    # masked (no final where), and there is nothing for torch.compile to fuse
    fn.reads_entropies = fn.masked_output = fn.compile = False  # type: ignore[attr-defined]
    fn.masked_output = fn.row_local = True  # type: ignore[attr-defined]
    return fn


_APPLY_TO = ("positive", "all")


@register_strategy("proximal_softmax")
def proximal_softmax(
    window: int = 101, temperature: float = 1.0, apply_to: str = "positive"
) -> StrategyFn:
    """PEPO, Eq. (7): ``Â_{i,t} = c_{i,t} A_i`` with ``c_{i,t} = e_{i,t} / Σ_k e_{i,k} · T_i``.

    ``e`` is the proximal entropy of Eq. (6) (:func:`proximal_entropy`), so ``Σ_t c_{i,t} =
    T_i``: the total advantage of each row equals GRPO's. With ``apply_to="positive"`` (the
    paper's default) only the rows flagged ``positive`` (successful rollouts) are weighted and
    the others keep the uniform advantage; ``"all"`` weights every row (the weighting ablation's
    "continuous weighting on all rollouts", the paper's Table 12). ``window`` (an odd number of
    tokens, the paper's 101) and ``temperature`` (``τ > 0``, the paper's 1.0; Table 13's
    ablation) are :func:`proximal_entropy`'s.
    """
    window = _checks.check_window(window)
    temperature = _checks.check_temperature(temperature)
    apply_to = _checks.check_choice("apply_to", apply_to, _APPLY_TO)

    def fn(advantages, entropies, mask, positive):
        e = _w.proximal(entropies, mask, window, temperature)  # [B, T]
        return _apply(advantages, _normalize(e, mask), apply_to, positive)

    if _w.EXP_SAFE_RANGE * temperature >= _w.ENTROPY_SPAN:  # the body's shifted-exp path
        def kernel(advantages, entropies, mask, positive):  # the same in three launches (CUDA)
            import pepo._triton as _triton

            return _triton.windowed(advantages, entropies, mask,
                                    positive if apply_to == "positive" else None, window,
                                    temperature, _w.EXP_SAFE_RANGE * temperature)

        fn.triton = kernel  # type: ignore[attr-defined]
    fn.row_local = True  # type: ignore[attr-defined]
    return fn


@register_strategy("window_average")
def window_average(window: int = 101, apply_to: str = "positive") -> StrategyFn:
    """PEPO's windowing without its softmax: this library's own strategy, its reading of App. E.

    App. E plots "a simple windowed average of token entropies without the softmax" as a
    diagnostic (it flattens the positional trend as proximal entropy does) and neither writes
    this ratio nor trains with it; the weighting below is pepo's.

    ``r_{i,t} = H_{i,t} / Σ_{k ∈ W(t)} H_{i,k}`` (:func:`window_average_entropy`; ``1/W`` where
    the window sums to 0), ``c_{i,t} = r_{i,t} / Σ_k r_{i,k} · T_i``, ``Â_{i,t} = c_{i,t} A_i``.
    Like PEPO's ``e`` the statistic is relative to its window, so it carries no slow positional
    trend and no per-row scale; the softmax's emphasis on local peaks is gone, and so is its
    invariance to a constant shift (Prop. 1(i)): adding 1 nat to every entropy of a row, as a
    harder prompt may, flattens ``r`` toward ``1/W``, where ``e`` is unchanged. A row whose ``r``
    are all 0 keeps ``c = 1``. ``apply_to`` as in ``proximal_softmax``.
    """
    window = _checks.check_window(window)
    apply_to = _checks.check_choice("apply_to", apply_to, _APPLY_TO)

    def fn(advantages, entropies, mask, positive):
        r = _w.window_average(entropies, mask, window)  # [B, T]
        return _apply(advantages, _normalize(r, mask), apply_to, positive)

    def kernel(advantages, entropies, mask, positive):  # the same in three launches (CUDA)
        import pepo._triton as _triton

        return _triton.windowed(advantages, entropies, mask,
                                positive if apply_to == "positive" else None, window, None)

    fn.triton = kernel  # type: ignore[attr-defined]
    fn.row_local = True  # type: ignore[attr-defined]
    return fn


@register_strategy("entropy_bonus")
def entropy_bonus(alpha: float = 0.4, kappa: float = 2.0) -> StrategyFn:
    """Entropy advantage of Cheng et al. (2025): ``Â_{i,t} = A_i + min(α H_{i,t}, |A_i| / κ)``.

    Applied to every row whatever the sign of ``A_i``; the clip ``|A_i|/κ`` with ``κ > 1``
    keeps a negative advantage negative (``κ <= 1`` could flip or zero it, so it is refused) and
    makes the bonus vanish when ``A_i = 0``.
    """
    alpha = _checks.check_positive("alpha", alpha)
    kappa = _checks.check_positive("kappa", kappa)
    if kappa <= 1.0:
        raise ValueError(
            f"kappa must be > 1 (the bonus is capped at |A|/kappa, so kappa <= 1 can turn a "
            f"negative advantage into 0 or a positive one), got {kappa}"
        )

    # the Triton kernel's |A|/κ is |A| · fl32(1/κ), as CUDA's eager division by a scalar and
    # inductor compute it (a CPU divides, which differs by an ulp for some κ)
    inv_kappa = float(torch.tensor(1.0) / torch.tensor(kappa, dtype=torch.float32))

    def fn(advantages: torch.Tensor, entropies: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        a = advantages[:, None]  # [B, 1]
        # fp32 rounding's slightly negative entropies count as 0 (a bonus on an A = 0 row)
        bonus = torch.minimum(alpha * entropies.clamp_min(0.0), a.abs() / kappa)
        return a + torch.where(torch.isinf(entropies), math.nan, bonus)  # the cap must not hide inf

    def kernel(advantages: torch.Tensor, entropies: torch.Tensor,
               mask: torch.Tensor) -> torch.Tensor:  # the same, in one launch (CUDA, Triton)
        import pepo._triton as _triton

        return _triton.entropy_bonus(advantages, entropies, mask, alpha, inv_kappa)

    fn.triton = kernel  # type: ignore[attr-defined]
    fn.row_local = True  # type: ignore[attr-defined]
    return fn


@register_strategy("global_topk")
def global_topk(
    fraction: float = 0.2,
    score: str = "entropy",
    window: int = 101,
    temperature: float = 1.0,
    normalize: str = "all_tokens",
    process_group: Optional[Any] = None,
) -> StrategyFn:
    """80/20 (Wang et al. 2025): ``Â_{i,t} = A_i · 1[s_{i,t} >= τ_q]``, Eq. (4).

    ``s`` is the global entropy (``score="entropy"``) or the proximal entropy of Eq. (6)
    (``score="proximal"``, Table 3's drop-in, with ``window`` and ``temperature``). The
    threshold ``τ_q`` is the ``q = 1 - fraction`` quantile over *all* valid tokens passed in
    (and over every rank of ``process_group``), never per row. It selects exactly the tokens
    ``s >= torch.quantile(s_valid.double(), q)`` would (ties included; an fp32 quantile's
    rounding can keep one token fewer or more) but is computed on the device (a
    sort, a ``topk`` or a bisection across ranks; no value is read on the host), so it works
    above 2^24 tokens and on bf16 input.

    ``normalize="all_tokens"`` (default) leaves the selected advantages as ``A_i``: the loss
    divides by all valid tokens, as in the paper's Eq. (2). ``"selected_tokens"`` scales them
    by ``N_valid / N_selected`` so that a token-mean over all tokens equals a token-mean over
    the selected tokens only, the normalisation of the official 80/20 code.
    """
    if not _checks.is_real(fraction):
        raise ValueError(f"fraction must be a number in (0, 1], got {fraction!r}")
    if not (0.0 < fraction <= 1.0):
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    score = _checks.check_choice("score", score, ("entropy", "proximal"))
    window = _checks.check_window(window)
    temperature = _checks.check_temperature(temperature)
    normalize = _checks.check_choice("normalize", normalize, ("all_tokens", "selected_tokens"))
    if process_group is not None and not callable(getattr(process_group, "size", None)):
        raise ValueError(f"process_group must be a torch.distributed ProcessGroup or None, got "
                         f"{process_group!r}")
    q = 1.0 - float(fraction)

    def fn(advantages: torch.Tensor, entropies: torch.Tensor, mask: torch.Tensor,
           process_group: Optional[Any] = process_group) -> torch.Tensor:  # call's, or bound
        if score == "proximal":
            s = _w.proximal(entropies, mask, window, temperature)
        else:
            s = entropies
        selected, n_valid = select_top(s, mask, q, process_group)
        # A - A: 0 at the unselected tokens, NaN for a NaN/inf advantage (kept even where none
        # of its row's tokens is selected: never a finite guess)
        out = torch.where(selected, advantages[:, None], (advantages - advantages)[:, None])
        # the threshold is over the whole batch: a NaN/inf score anywhere (on any rank) makes
        # all of it NaN
        nonfinite = ~torch.isfinite(torch.where(mask, s, 0.0))
        out = torch.where(global_count(nonfinite, process_group) == 0, out, math.nan)
        if normalize == "selected_tokens":
            n_selected = global_count(selected, process_group)  # on the device: no sync
            scale = n_valid.double() / n_selected.clamp_min(1).double()
            out = out * torch.where(n_selected > 0, scale, 1.0).float()
        return out

    def kernel(advantages: torch.Tensor, entropies: torch.Tensor, mask: torch.Tensor,
               process_group: Optional[Any] = None) -> torch.Tensor:  # six launches, no sort
        import pepo._triton as _triton

        return _triton.global_topk(advantages, entropies, mask, q,
                                   normalize == "selected_tokens", window,
                                   temperature if score == "proximal" else None,
                                   _w.EXP_SAFE_RANGE * temperature)

    # one process (a bound group bisects across ranks), the softmax's shifted-exp path
    if process_group is None and (score == "entropy" or
                                  _w.EXP_SAFE_RANGE * temperature >= _w.ENTROPY_SPAN):
        fn.triton = kernel  # type: ignore[attr-defined]
    return fn


@register_strategy("gtpo")
def gtpo(alpha1: float = 1.0, alpha2: float = 0.1, normalize: str = "group",
         eps: float = 1e-8) -> StrategyFn:
    """GTPO (Tan et al. 2025, arXiv 2508.04349): entropy-shaped token rewards, standardised.

    The shaped rewards ``r̃`` are :func:`gtpo_rewards` (Eqs. 3 and 5: a successful rollout's
    token weighted by its entropy relative to the group's successful rollouts active at the
    same position, a failed rollout's by its inverse entropy relative to the failed ones).
    The token advantages standardise them (Eq. 6), with population std and ``1e-6`` added to
    it as in :func:`pepo.estimators.group_advantages`:

    * ``normalize="group"`` (default): ``Â = (r̃ - mean) / (std + 1e-6)`` over all valid tokens
      of the prompt's group;
    * ``normalize="side"``: over the group's ``O+`` tokens and its ``O-`` tokens separately.

    Deviations and readings (the equations as independent public re-implementations state
    them; the reading of Eq. 6 is pepo's):

    * ``"side"`` is Eq. 6 as written there. With a binary outcome it subtracts ``α1·r`` exactly
      (each side's mean is ``±(α1 + α2)``), so no outcome signal is left: on both sides the
      higher-entropy tokens get the positive advantages. The default therefore standardises
      over the whole group, which keeps the entropy shaping within each side and, unless one
      side holds nearly all of the group's tokens, the success/failure sign (GRPO's). We did
      not find the GTPO authors' code to compare this step with.
    * What ``"group"`` keeps, exactly: its centre, the mean over the group's valid tokens, is
      ``c = (α1 + α2)(N+ − N−)/(N+ + N−)`` (``N±``: the valid tokens of the group's successes
      and failures). Successes' shaped rewards are ``>= α1`` and failures' ``<= −α1``, so every
      token keeps its outcome's sign when ``|c| < α1``, i.e. when neither side holds more than
      ``(2α1 + α2) / (2(α1 + α2))`` of the tokens (95.5 % at the defaults). Past that, the
      larger side's low-share tokens flip: 7 successes of 100 tokens and 1 failure of 2 give
      ``c ≈ 1.094``, and the success tokens under ``(c − α1)/α2 ≈ 0.94`` times their position's
      mean success entropy get negative advantages (46 % of them with entropies uniform in
      [0, 2)).
    * The outcome is the success flag (``positive``), not the raw reward: ``r = ±1``.
    * A group whose rollouts all succeeded or all failed gets advantage 0 on every token, as
      GRPO's do (the paper builds on DAPO, whose dynamic sampling drops such groups).
    * ``advantages`` is not read: GTPO builds its own from the rewards.

    Needs ``groups=`` (the prompt group of each rollout) when called, and group mode in the
    recipe (a single-stream "group" of one rollout is always all-success or all-failure).
    ``alpha1``, ``alpha2`` and ``eps`` are :func:`gtpo_rewards`'s.
    """
    alpha1, alpha2, eps = check_gtpo_params(alpha1, alpha2, eps)
    normalize = _checks.check_choice("normalize", normalize, GTPO_NORMALIZE)

    def fn(advantages, entropies, mask, positive, groups):
        r = shaped(entropies, mask, positive, groups, alpha1, alpha2, eps)  # [B, T] f64
        return standardized(r, mask, positive, groups, normalize)

    def kernel(advantages, entropies, mask, positive, groups):  # three launches (CUDA)
        import pepo._triton as _triton

        return _triton.gtpo(entropies, mask, positive, groups, alpha1, alpha2, eps,
                            normalize == "side")

    fn.triton = kernel  # type: ignore[attr-defined]
    return fn


def normalize_to_length(weights: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Scales each row's weights so they sum to its length: ``c_t = w_t / Σ_k w_k · T_i``.

    The step every length-preserving strategy shares (PEPO's Eq. 7, ``window_average``): the
    row's total advantage stays GRPO's ``T_i A_i``. Rows with no positive total mass get
    ``c = 1`` (uniform), rows whose total is NaN get NaN (never silently uniform).

    Args:
        weights: ``[B, T]`` non-negative weights, 0 at masked positions (use
            ``torch.where(mask, w, 0)``).
        mask: ``[B, T]`` bool, True on valid tokens.

    Returns:
        ``[B, T]`` float: ``c``, on valid tokens (masked positions get 0 where the row has mass).

    Raises:
        ValueError: shapes that differ, weights that are not a float tensor, a mask that is not
            bool, tensors on two devices. The values are not read on the host (a strategy calls
            this on its sync-free path): a negative weight is not refused.
    """
    weights = _checks.check_tensor("weights", weights)
    if weights.dim() != 2:
        raise ValueError(f"weights must be [B, T], got {_checks.format_shape(weights)}")
    _checks.check_float("weights", weights)
    _checks.check_bool_mask("mask", mask, weights.shape)
    _checks.check_same_device(weights=weights, mask=mask)
    return _normalize(weights, mask)


def _normalize(weights: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """:func:`normalize_to_length` without its checks (the strategies' inputs are checked)."""
    lengths = mask.sum(dim=1, keepdim=True).float()  # [B, 1]
    total = weights.sum(dim=1, keepdim=True)  # [B, 1]
    ok = total > 0
    fallback = torch.where(torch.isnan(total), math.nan, 1.0)  # NaN stays NaN, never uniform
    return torch.where(ok, weights * (lengths / torch.where(ok, total, 1.0)), fallback)


def weight_rows(advantages: torch.Tensor, c: torch.Tensor,
                positive: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Token advantages ``c_{i,t} A_i`` on the weighted rows, ``A_i`` on the others.

    The paper weights successful rollouts only (``apply_to="positive"``; Table 12): pass
    ``positive`` (bool ``[B]``) to weight those rows and leave the rest uniform, or None to
    weight every row.

    Args:
        advantages: ``[B]`` sequence advantages.
        c: ``[B, T]`` per-token weights (e.g. from :func:`normalize_to_length`).
        positive: ``[B]`` bool, or None.

    Raises:
        ValueError: shapes that do not fit together, tensors that are not float, on two
            devices, or ``positive`` that is not bool.
    """
    for name, t in (("advantages", advantages), ("c", c)):
        _checks.check_float(name, _checks.check_tensor(name, t))
    if advantages.dim() != 1 or c.dim() != 2 or c.shape[0] != advantages.shape[0]:
        raise ValueError(f"advantages must be [B] and c [B, T], got "
                         f"{_checks.format_shape(advantages)} and {_checks.format_shape(c)}")
    _checks.check_same_device(advantages=advantages, c=c)
    return _weight(advantages, c, positive)


def _weight(advantages: torch.Tensor, c: torch.Tensor,
            positive: Optional[torch.Tensor]) -> torch.Tensor:
    """:func:`weight_rows` without the checks of ``advantages`` and ``c``."""
    a = advantages[:, None]  # [B, 1]
    weighted = c * a
    if positive is None:
        return weighted
    positive = _checks.check_row_flags("positive", positive, advantages)
    return torch.where(positive[:, None], weighted, a)


def _apply(advantages: torch.Tensor, c: torch.Tensor, apply_to: str,
           positive: torch.Tensor) -> torch.Tensor:
    """``c A`` on the weighted rows (all, or those flagged ``positive``), ``A`` on the rest."""
    return _weight(advantages, c, positive if apply_to == "positive" else None)


_BUILTIN = dict(_REGISTRY)  # the strategies registered above: the ones compiled on CUDA
