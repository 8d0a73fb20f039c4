"""Per-token advantage weighting: PEPO's proximal entropy and the baselines it is compared to.

Every strategy has one signature::

    strategy(advantages [B], entropies [B, T], mask bool [B, T]) -> token_advantages [B, T]

The output is fp32, detached, and exactly 0 wherever ``mask`` is False. Strategies are built by
name from a registry (:func:`get_strategy`), listed by :func:`list_strategies`, and extended
with :func:`register_strategy`.

Windows (``proximal_softmax``, ``window_average``, ``global_topk(score="proximal")``) run over
each row's *valid* tokens in order: positions where ``mask`` is False are dropped before the
window is applied, so a row with holes in its mask (tool-output spans, say) behaves exactly as
the compacted row, and whatever the padding holds (NaN included) never matters. The window is
centred, of odd size ``W``, and reflect-padded at each row's own ends exactly as
``numpy.pad(mode="reflect")`` does, repeatedly for rows shorter than ``W // 2`` (a row of one
token sees itself ``W`` times).

Implementation notes (deviations from the direct formulation, not from the math):

* The windowed sums are computed in O(B·T) with a two-block scan: split the padded row into
  blocks of ``W``; every window spans at most two adjacent blocks, so its sum is a suffix sum
  of the first block plus a prefix sum of the second. Each sum adds at most ``W`` positive
  terms, so it is as accurate as the direct sum at any row length (a global cumulative sum
  would lose digits to cancellation on 32k-token rows). No ``[B, T, W]`` tensor is created.
* Softmax numerators are shifted by each row's maximum. If a row's (temperature-scaled) range
  exceeds what fp32 ``exp`` can hold without underflow, the batch takes an exact log-domain
  path (``logcumsumexp``) instead; the result is the same, only slower.
"""

from __future__ import annotations

import inspect
import math
from typing import Any, Callable, Optional, Protocol

import torch
import torch.nn.functional as F

from pepo import _checks

__all__ = [
    "Strategy",
    "StrategyFn",
    "entropy_bonus",
    "get_strategy",
    "global_topk",
    "list_strategies",
    "proximal_entropy",
    "proximal_softmax",
    "register_strategy",
    "uniform",
    "window_average",
]

# exp(-80) ~ 1.8e-35 is still a normal fp32 number; a row whose scaled entropies span more than
# this could underflow a whole window to 0 in the shifted-exp path.
_EXP_SAFE_RANGE = 80.0


class StrategyFn(Protocol):
    def __call__(
        self, advantages: torch.Tensor, entropies: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor: ...


# --------------------------------------------------------------------------------------------
# Window machinery
# --------------------------------------------------------------------------------------------


def _reflect_index(j: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Maps positions ``j`` (any integer, broadcast against ``lengths``) into ``[0, L)``.

    Matches ``numpy.pad(mode="reflect")``, which for pads longer than the row reflects again:
    the padded row is periodic with period ``2 (L - 1)``; a row of length 1 repeats itself.
    Empty rows (``L = 0``) map everything to 0, a harmless in-bounds index.
    """
    lengths = lengths.clamp_min(1)
    period = (2 * (lengths - 1)).clamp_min(1)
    j = torch.remainder(j, period)
    return torch.where(j > lengths - 1, period - j, j)


class _Rows:
    """A batch with each row's valid values moved to the front.

    Attributes:
        x: ``[B, T]`` fp32; row ``i`` holds its ``L_i`` valid values in order, then values no
            valid token's window reaches.
        lengths: ``[B]`` int64, ``L_i``.
        pos: ``[B, T]`` int64, for each original position the index of its value in ``x``;
            ``None`` when every mask is already a prefix (``x`` is then the input as given).
    """

    def __init__(self, clean: torch.Tensor, mask: torch.Tensor, is_prefix: bool):
        self.lengths = mask.sum(dim=1)  # [B]
        if is_prefix:
            self.x = clean
            self.pos = None
        else:
            b, t = mask.shape
            pos = mask.long().cumsum(dim=1) - 1  # [B, T]
            buf = clean.new_zeros(b, t + 1)  # column t is a sink for masked positions
            buf.scatter_(1, torch.where(mask, pos, t), clean)
            self.x = buf[:, :t]
            self.pos = pos.clamp_min(0)

    def expand(self, compact: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Maps a ``[B, T]`` result on compact positions back to the original positions."""
        out = compact if self.pos is None else compact.gather(1, self.pos)
        return torch.where(mask, out, 0.0)


def _clean(entropies: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """fp32 copy with 0 at masked positions: padding contents (NaN included) go no further."""
    return torch.where(mask, entropies.float(), 0.0)


def _analyse(
    clean: torch.Tensor, mask: torch.Tensor, temperature: Optional[float]
) -> tuple[bool, bool, Optional[torch.Tensor]]:
    """One host sync: is every mask a prefix, does some row exceed the safe exp range, and
    each row's maximum of ``H/τ`` (``[B]``, the exp shift).

    The range is taken over whole rows, padding zeros included: an over-estimate, so the exact
    log path is taken whenever the shifted exp could underflow (and a little more often).
    """
    flags = [(mask[:, 1:] > mask[:, :-1]).any()]  # a valid token after a masked one
    hi = None
    if temperature is not None:
        lo, hi = torch.aminmax(clean, dim=1)
        flags.append(((hi - lo) > _EXP_SAFE_RANGE * temperature).any())
        hi = hi / temperature
    values = torch.stack(flags).tolist()
    return not values[0], (bool(values[1]) if temperature is not None else False), hi


def _padded_buffer(x: torch.Tensor, lengths: torch.Tensor, window: int, scale: float) -> torch.Tensor:
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
    if scale != 1.0:
        torch.mul(x, scale, out=mid)
    else:
        mid.copy_(x)
    if half:
        offs = torch.arange(half, device=x.device)  # [h]
        lengths = lengths[:, None]
        left = _reflect_index(offs[None, :] - half, lengths)  # [B, h]
        buf[:, :half] = mid.gather(1, left)
        right_j = lengths + offs[None, :]  # [B, h]: row positions L .. L + h - 1
        buf.scatter_(1, right_j + half, mid.gather(1, _reflect_index(right_j, lengths)))
    return buf


def _block_scans(buf: torch.Tensor, window: int, scan: Callable[[torch.Tensor], torch.Tensor]):
    b = buf.shape[0]
    blocks = buf.view(b, -1, window)  # [B, nb, W]
    prefix = scan(blocks)
    suffix = scan(blocks.flip(-1)).flip(-1)
    return prefix, suffix


def _window_sum(buf: torch.Tensor, window: int, t: int) -> torch.Tensor:
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


def _window_logsumexp(buf: torch.Tensor, window: int, t: int) -> torch.Tensor:
    """Log-domain twin of :func:`_window_sum`: ``logsumexp(buf[:, s : s + W])``."""
    b = buf.shape[0]
    prefix, suffix = _block_scans(buf, window, lambda z: torch.logcumsumexp(z, -1))
    prefix[..., window - 1] = -math.inf
    prefix, suffix = prefix.view(b, -1), suffix.view(b, -1)
    return torch.logaddexp(suffix[:, :t], prefix[:, window - 1 : window - 1 + t])


def _proximal_compact(
    rows: _Rows, window: int, temperature: float, exact_log: bool, shift: torch.Tensor
) -> torch.Tensor:
    """Eq. (6) on compact rows: ``e_t = exp(H_t/τ) / Σ_{k∈W(t)} exp(H_k/τ)``. ``[B, T]``.

    ``shift`` (``[B]``, at least each row's largest ``H/τ``) keeps ``exp`` from overflowing; the
    softmax is invariant to it. The exact path works in log space and ignores it.
    """
    half = window // 2
    t = rows.x.shape[1]
    buf = _padded_buffer(rows.x, rows.lengths, window, 1.0 / temperature)  # [B, nb*W]
    if exact_log:
        x = buf[:, half : half + t]
        return torch.exp(x - _window_logsumexp(buf, window, t))
    buf.sub_(shift[:, None]).exp_()
    return buf[:, half : half + t] / _window_sum(buf, window, t)


def _proximal(clean: torch.Tensor, mask: torch.Tensor, window: int, temperature: float) -> torch.Tensor:
    """Proximal entropy of cleaned (fp32, 0 where masked) entropies. ``[B, T]``, 0 where masked."""
    if mask.numel() == 0:
        return torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    is_prefix, exact_log, shift = _analyse(clean, mask, temperature)
    rows = _Rows(clean, mask, is_prefix)
    return rows.expand(_proximal_compact(rows, window, temperature, exact_log, shift), mask)


def _check_finite_clean(**tensors: torch.Tensor) -> None:
    """Raises if a tensor (already 0 at masked positions) holds NaN/inf. One host sync: a sum
    per tensor is cheaper than an isfinite pass; the count is taken only on failure."""
    sums = torch.stack([t.sum() for t in tensors.values()])
    if bool(torch.isfinite(sums).all()):
        return
    for name, t in tensors.items():
        bad = int((~torch.isfinite(t)).sum())
        if bad:
            raise ValueError(_checks.nonfinite_message(name, bad))


def proximal_entropy(
    entropies: torch.Tensor,
    mask: torch.Tensor,
    window: int = 101,
    temperature: float = 1.0,
    *,
    check_finite: bool = True,
) -> torch.Tensor:
    """Proximal entropy, Eq. (6), with the softmax temperature of Appendix F.3.

    ``e_{i,t} = exp(H_{i,t}/τ) / Σ_{k ∈ W(t)} exp(H_{i,k}/τ)`` with ``W(t)`` the ``window``
    valid tokens of row ``i`` centred on ``t`` (reflect-padded at the row's ends).

    Args:
        entropies: per-token entropies ``H``; any float dtype (computed in fp32).
        mask: True at valid (generated) tokens.
        window: odd window size ``W >= 1`` (paper: 101).
        temperature: softmax temperature ``τ > 0`` (paper: 1.0).
        check_finite: raise if ``entropies`` holds NaN/inf at a valid position (one host
            sync, which this function needs anyway).

    Shape:
        entropies: ``[B, T]``; mask: ``[B, T]`` bool; returns ``[B, T]`` fp32, 0 where mask
        is False. Detached.

    Raises:
        ValueError: on bad shapes, dtypes, hyper-parameters or non-finite valid entropies.
    """
    entropies, mask = _checks.check_entropies_mask(entropies, mask)
    window = _checks.check_window(window)
    temperature = _checks.check_positive("temperature", temperature)
    with torch.no_grad():
        clean = _clean(entropies.detach(), mask)
        if check_finite:
            _check_finite_clean(entropies=clean)
        return _proximal(clean, mask, window, temperature)


def _window_mean(clean: torch.Tensor, mask: torch.Tensor, window: int) -> torch.Tensor:
    if mask.numel() == 0:
        return torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    is_prefix, _, _ = _analyse(clean, mask, None)
    rows = _Rows(clean, mask, is_prefix)
    buf = _padded_buffer(rows.x, rows.lengths, window, 1.0)
    return rows.expand(_window_sum(buf, window, rows.x.shape[1]) / window, mask)


# --------------------------------------------------------------------------------------------
# Registry
# --------------------------------------------------------------------------------------------

_REGISTRY: dict[str, Callable[..., StrategyFn]] = {}


class Strategy:
    """A weighting strategy bound to its hyper-parameters; call it on a batch.

    ``strategy(advantages, entropies, mask)`` validates its inputs (shapes, bool mask, finite
    values at valid positions), runs the strategy in fp32 without autograd, and returns
    ``[B, T]`` fp32 token advantages, detached, 0 where ``mask`` is False.
    """

    def __init__(self, name: str, params: dict[str, Any], fn: StrategyFn):
        self.name = name
        self.params = dict(params)
        self._fn = fn

    def __call__(
        self,
        advantages: torch.Tensor,
        entropies: torch.Tensor,
        mask: torch.Tensor,
        *,
        check_finite: bool = True,
    ) -> torch.Tensor:
        """Token advantages for one batch.

        Args:
            advantages: sequence-level advantages ``A_i``.
            entropies: per-token entropies ``H_{i,t}`` (any float dtype; fp32 inside).
            mask: True at valid (generated) tokens.
            check_finite: raise ``ValueError`` if ``advantages`` or the valid entropies hold
                NaN/inf (one host sync). With False a NaN input gives NaN output.

        Shape:
            advantages: ``[B]``; entropies, mask: ``[B, T]``; returns ``[B, T]`` fp32.
        """
        advantages, entropies, mask = _checks.check_batch(advantages, entropies, mask)
        with torch.no_grad():
            adv = advantages.detach().float()
            ent = _clean(entropies.detach(), mask)
            if check_finite:
                _check_finite_clean(advantages=adv, entropies=ent)
            out = self._fn(adv, ent, mask)
            if not isinstance(out, torch.Tensor) or out.shape != mask.shape:
                got = _checks._shape(out) if isinstance(out, torch.Tensor) else type(out).__name__
                raise ValueError(
                    f"strategy {self.name!r} returned {got}, expected "
                    f"{_checks._shape(mask)} (the shape of mask)"
                )
            return torch.where(mask, out.float(), 0.0)

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in self.params.items())
        return f"Strategy({self.name!r}{', ' if params else ''}{params})"


def register_strategy(
    name: str, *, overwrite: bool = False
) -> Callable[[Callable[..., StrategyFn]], Callable[..., StrategyFn]]:
    """Decorator registering a strategy factory under ``name``.

    The factory takes the strategy's hyper-parameters as keyword arguments, validates them,
    and returns ``fn(advantages [B] fp32, entropies [B, T] fp32 (0 where mask is False),
    mask [B, T] bool) -> [B, T]``. :func:`get_strategy` wraps it in a :class:`Strategy` that
    validates inputs and zeroes masked positions, so a factory needs neither.

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
        if name in _REGISTRY and not overwrite:
            raise ValueError(
                f"strategy {name!r} is already registered; pass overwrite=True to replace it"
            )
        _REGISTRY[name] = factory
        return factory

    return decorator


def list_strategies() -> list[str]:
    """Names of all registered strategies, sorted."""
    return sorted(_REGISTRY)


def get_strategy(name: str, **params: Any) -> Strategy:
    """Builds the strategy ``name`` with hyper-parameters ``params``.

    Raises:
        ValueError: unknown name (the message lists the registered names), unknown parameter
            (the message lists the valid ones) or a bad parameter value.
    """
    if name not in _REGISTRY:
        raise ValueError(f"unknown strategy {name!r}; registered strategies: {list_strategies()}")
    factory = _REGISTRY[name]
    sig = inspect.signature(factory)
    accepts_any = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
    unknown = [k for k in params if k not in sig.parameters]
    if unknown and not accepts_any:
        raise ValueError(
            f"strategy {name!r} got unknown parameter(s) {unknown}; "
            f"valid parameters: {list(sig.parameters)}"
        )
    bound = sig.bind(**params)
    bound.apply_defaults()
    return Strategy(name, dict(bound.arguments), factory(**params))


# --------------------------------------------------------------------------------------------
# Strategies
# --------------------------------------------------------------------------------------------


@register_strategy("uniform")
def uniform() -> StrategyFn:
    """GRPO: ``Â_{i,t} = A_i`` on every valid token (Eq. 2)."""

    def fn(advantages: torch.Tensor, entropies: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return advantages[:, None].expand(mask.shape)

    return fn


@register_strategy("proximal_softmax")
def proximal_softmax(
    window: int = 101, temperature: float = 1.0, apply_to: str = "positive"
) -> StrategyFn:
    """PEPO, Eq. (7): ``Â_{i,t} = c_{i,t} A_i`` with ``c_{i,t} = e_{i,t} / Σ_k e_{i,k} · T_i``.

    ``e`` is the proximal entropy of Eq. (6) (:func:`proximal_entropy`), so ``Σ_t c_{i,t} =
    T_i``: the total advantage of each row equals GRPO's. With ``apply_to="positive"`` (the
    paper's default) rows with ``A_i <= 0`` keep the uniform advantage; ``"all"`` weights every
    row (Table 8's "continuous weighting on all rollouts").
    """
    window = _checks.check_window(window)
    temperature = _checks.check_positive("temperature", temperature)
    apply_to = _checks.check_choice("apply_to", apply_to, ("positive", "all"))

    def fn(advantages: torch.Tensor, entropies: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        e = _proximal(entropies, mask, window, temperature)  # [B, T]
        c = _normalise_to_length(e, mask)  # [B, T]
        return _apply(advantages, c, apply_to)

    return fn


@register_strategy("window_average")
def window_average(window: int = 101, apply_to: str = "positive") -> StrategyFn:
    """Windowed mean of entropy, normalised to preserve each row's sum (Appendix E's ablation).

    ``m_{i,t} = (1/W) Σ_{k ∈ W(t)} H_{i,k}``, ``c_{i,t} = m_{i,t} / mean_t(m_{i,·})``,
    ``Â_{i,t} = c_{i,t} A_i``. A row whose mean ``m`` is not > 0 (all-zero entropies) keeps
    uniform weights. ``apply_to`` as in ``proximal_softmax``.
    """
    window = _checks.check_window(window)
    apply_to = _checks.check_choice("apply_to", apply_to, ("positive", "all"))

    def fn(advantages: torch.Tensor, entropies: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        m = _window_mean(entropies, mask, window)  # [B, T]
        c = _normalise_to_length(m, mask)
        return _apply(advantages, c, apply_to)

    return fn


@register_strategy("entropy_bonus")
def entropy_bonus(alpha: float = 0.4, kappa: float = 2.0) -> StrategyFn:
    """Entropy advantage of Cheng et al. (2025): ``Â_{i,t} = A_i + min(α H_{i,t}, |A_i| / κ)``.

    Applied to every row whatever the sign of ``A_i``; the clip ``|A_i|/κ`` keeps the bonus
    from flipping a negative advantage's sign (``κ > 1``) and makes it vanish when ``A_i = 0``.
    """
    alpha = _checks.check_positive("alpha", alpha)
    kappa = _checks.check_positive("kappa", kappa)

    def fn(advantages: torch.Tensor, entropies: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        a = advantages[:, None]  # [B, 1]
        return a + torch.minimum(alpha * entropies, a.abs() / kappa)

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
    ``s >= torch.quantile(s_valid, q)`` would (ties included) but is computed with
    ``kthvalue``/``topk``, so it works above 2^24 tokens and on bf16 input.

    ``normalize="all_tokens"`` (default) leaves the selected advantages as ``A_i``: the loss
    divides by all valid tokens, as in the paper's Eq. (2). ``"selected_tokens"`` scales them
    by ``N_valid / N_selected`` so that a token-mean over all tokens equals a token-mean over
    the selected tokens only, the normalisation of the official 80/20 code.
    """
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)):
        raise ValueError(f"fraction must be a number in (0, 1], got {fraction!r}")
    if not (0.0 < fraction <= 1.0):
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    score = _checks.check_choice("score", score, ("entropy", "proximal"))
    window = _checks.check_window(window)
    temperature = _checks.check_positive("temperature", temperature)
    normalize = _checks.check_choice("normalize", normalize, ("all_tokens", "selected_tokens"))
    q = 1.0 - float(fraction)

    def fn(advantages: torch.Tensor, entropies: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if score == "proximal":
            s = _proximal(entropies, mask, window, temperature)
        else:
            s = entropies
        selected, n_valid = _select_top(s, mask, q, process_group)
        out = torch.where(selected, advantages[:, None], 0.0)
        if normalize == "selected_tokens":
            n_selected = _global_count(selected, process_group)
            if n_selected > 0:
                out = out * (n_valid / n_selected)
        return out

    return fn


def _select_top(
    scores: torch.Tensor, mask: torch.Tensor, q: float, process_group: Optional[Any]
) -> tuple[torch.Tensor, int, int]:
    """Tokens with ``score >= quantile_q(valid scores)`` over the batch (and all ranks).

    Returns the ``[B, T]`` bool selection and the global valid count.
    """
    flat = torch.where(mask, scores.float(), -math.inf).reshape(-1)  # [B*T]
    n = _global_count(mask, process_group)
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


def _global_count(flags: torch.Tensor, process_group: Optional[Any]) -> int:
    """Number of True entries of ``flags``, summed over the ranks of ``process_group``."""
    total = flags.sum().reshape(1)
    if process_group is not None:
        import torch.distributed as dist

        dist.all_reduce(total, group=process_group)
    return int(total)


def _normalise_to_length(w: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``c_t = w_t / Σ_k w_k · T_i`` per row (so ``Σ_t c_t = T_i``); rows with no positive total
    mass get ``c = 1``. ``w`` is 0 at masked positions."""
    lengths = mask.sum(dim=1, keepdim=True).float()  # [B, 1]
    total = w.sum(dim=1, keepdim=True)  # [B, 1]
    ok = total > 0
    return torch.where(ok, w * (lengths / torch.where(ok, total, 1.0)), 1.0)


def _apply(advantages: torch.Tensor, c: torch.Tensor, apply_to: str) -> torch.Tensor:
    a = advantages[:, None]  # [B, 1]
    weighted = c * a
    if apply_to == "positive":
        return torch.where(a > 0, weighted, a)
    return weighted
