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
    """A batch with each row's valid values moved to the front (``compact``).

    Attributes:
        x: ``[B, T]`` fp32, row ``i`` holds its ``L_i`` valid values in order, then 0.
        lengths: ``[B]`` int64, ``L_i``.
        pos: ``[B, T]`` int64, for each original position the index of its value in ``x``;
            ``None`` when every mask is already a prefix (then ``x`` is aligned as given).
    """

    def __init__(self, values: torch.Tensor, mask: torch.Tensor, is_prefix: bool):
        self.lengths = mask.sum(dim=1)  # [B]
        values = torch.where(mask, values.float(), 0.0)  # [B, T]
        if is_prefix:
            self.x = values
            self.pos = None
        else:
            b, t = mask.shape
            pos = mask.long().cumsum(dim=1) - 1  # [B, T]
            sink = torch.full_like(pos, t)
            buf = values.new_zeros(b, t + 1)
            buf.scatter_(1, torch.where(mask, pos, sink), values)
            self.x = buf[:, :t]
            self.pos = pos.clamp_min(0)

    def expand(self, compact: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Maps a ``[B, T]`` result on compact positions back to the original positions."""
        out = compact if self.pos is None else compact.gather(1, self.pos)
        return torch.where(mask, out, 0.0)

    def valid(self) -> torch.Tensor:
        t = self.x.shape[1]
        return torch.arange(t, device=self.x.device) < self.lengths[:, None]  # [B, T]


def _is_prefix_mask(mask: torch.Tensor) -> torch.Tensor:
    """0-dim bool tensor: every row's valid tokens form a prefix (right padding only)."""
    lengths = mask.sum(dim=1, keepdim=True)
    return (mask == (torch.arange(mask.shape[1], device=mask.device) < lengths)).all()


def _reflect_pad(x: torch.Tensor, lengths: torch.Tensor, half: int) -> torch.Tensor:
    """``[B, T]`` compact rows -> ``[B, T + 2 half]`` with each row reflect-padded at its ends.

    Padded position ``p`` holds row value ``reflect(p - half, L_i)`` for ``p < L_i + 2 half``;
    later positions are unspecified (no window of a valid token reaches them).
    """
    if half == 0:
        return x
    device = x.device
    padded = F.pad(x, (half, half))  # [B, T + 2h]
    offs = torch.arange(half, device=device)  # [h]
    left_src = _reflect_index(offs[None, :] - half, lengths[:, None])  # [B, h]
    padded[:, :half] = x.gather(1, left_src)
    right_j = lengths[:, None] + offs[None, :]  # [B, h], positions L..L+h-1 in row coordinates
    right_src = _reflect_index(right_j, lengths[:, None])
    padded.scatter_(1, right_j + half, x.gather(1, right_src))
    return padded


def _window_sum(padded: torch.Tensor, window: int, t: int) -> torch.Tensor:
    """``S[:, s] = padded[:, s : s + window].sum(-1)`` for ``s < t``, in O(B·T) (two-block scan)."""
    b, lp = padded.shape
    nb = -(-lp // window)
    if nb * window != lp:
        padded = F.pad(padded, (0, nb * window - lp))
    blocks = padded.view(b, nb, window)
    prefix = blocks.cumsum(-1).view(b, -1)  # [B, nb*W]
    suffix = blocks.flip(-1).cumsum(-1).flip(-1).view(b, -1)  # [B, nb*W]
    head = suffix[:, :t]
    # A window starting on a block boundary is that block alone; otherwise it ends in the next
    # block, whose prefix up to the window's end completes it.
    starts_block = (torch.arange(t, device=padded.device) % window) == 0  # [T]
    return torch.where(starts_block, head, head + prefix[:, window - 1 : window - 1 + t])


def _window_logsumexp(padded: torch.Tensor, window: int, t: int) -> torch.Tensor:
    """Log-domain twin of :func:`_window_sum`: ``logsumexp(padded[:, s : s + window])``."""
    b, lp = padded.shape
    nb = -(-lp // window)
    if nb * window != lp:
        padded = F.pad(padded, (0, nb * window - lp), value=-math.inf)
    blocks = padded.view(b, nb, window)
    prefix = torch.logcumsumexp(blocks, -1).view(b, -1)
    suffix = torch.logcumsumexp(blocks.flip(-1), -1).flip(-1).view(b, -1)
    head = suffix[:, :t]
    starts_block = (torch.arange(t, device=padded.device) % window) == 0
    return torch.where(
        starts_block, head, torch.logaddexp(head, prefix[:, window - 1 : window - 1 + t])
    )


def _proximal_compact(rows: _Rows, window: int, temperature: float, exact_log: bool) -> torch.Tensor:
    """Eq. (6) on compact rows: ``e_t = exp(H_t/τ) / Σ_{k∈W(t)} exp(H_k/τ)``. ``[B, T]``."""
    half = window // 2
    t = rows.x.shape[1]
    x = rows.x / temperature if temperature != 1.0 else rows.x  # [B, T]
    padded = _reflect_pad(x, rows.lengths, half)  # [B, T + 2h]
    if exact_log:
        lse = _window_logsumexp(padded, window, t)  # [B, T]
        return torch.exp(x - lse)
    valid = rows.valid()
    row_max = torch.where(valid, x, -math.inf).amax(dim=1, keepdim=True)  # [B, 1]
    row_max = torch.where(torch.isfinite(row_max), row_max, 0.0)  # empty rows
    ex = torch.exp(padded - row_max)  # [B, T + 2h]
    return ex[:, half : half + t] / _window_sum(ex, window, t)


def _prepare(
    entropies: torch.Tensor,
    mask: torch.Tensor,
    temperature: float,
    check_finite: bool,
    need_range: bool,
) -> tuple[_Rows, bool]:
    """One host sync: non-finite check, prefix-mask test and the fp32 exp range test."""
    flags = [_is_prefix_mask(mask)]
    ent = entropies.float()
    if check_finite:
        flags.append((~torch.isfinite(ent) & mask).sum())
    if need_range:
        safe = torch.where(mask, ent, 0.0)
        hi = torch.where(mask, safe, -math.inf).amax(dim=1)
        lo = torch.where(mask, safe, math.inf).amin(dim=1)
        spread = torch.where(mask.any(dim=1), hi - lo, 0.0) / temperature
        # NaN spread (non-finite input with check_finite=False) counts as unsafe.
        flags.append(~(spread <= _EXP_SAFE_RANGE).all())
    values = torch.stack([f.to(torch.int64) for f in flags]).tolist()
    if check_finite and values[1] > 0:
        raise ValueError(_checks.nonfinite_message("entropies", values[1]))
    rows = _Rows(ent, mask, is_prefix=bool(values[0]))
    return rows, bool(values[-1]) if need_range else False


def _proximal(
    entropies: torch.Tensor, mask: torch.Tensor, window: int, temperature: float, check_finite: bool
) -> torch.Tensor:
    if mask.numel() == 0:
        return torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    rows, exact_log = _prepare(entropies, mask, temperature, check_finite, need_range=True)
    return rows.expand(_proximal_compact(rows, window, temperature, exact_log), mask)


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
        return _proximal(entropies.detach(), mask, window, temperature, check_finite)


def _window_mean(entropies: torch.Tensor, mask: torch.Tensor, window: int) -> torch.Tensor:
    if mask.numel() == 0:
        return torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    rows, _ = _prepare(entropies, mask, 1.0, check_finite=False, need_range=False)
    half = window // 2
    t = rows.x.shape[1]
    padded = _reflect_pad(rows.x, rows.lengths, half)
    return rows.expand(_window_sum(padded, window, t) / window, mask)


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
            ent = entropies.detach()
            if check_finite:
                bad = torch.stack(
                    [(~torch.isfinite(adv)).sum(), (~torch.isfinite(ent) & mask).sum()]
                ).tolist()
                if bad[0]:
                    raise ValueError(_checks.nonfinite_message("advantages", bad[0]))
                if bad[1]:
                    raise ValueError(_checks.nonfinite_message("entropies", bad[1]))
            ent = torch.where(mask, ent.float(), 0.0)
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
        e = _proximal(entropies, mask, window, temperature, check_finite=False)  # [B, T]
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
            s = _proximal(entropies, mask, window, temperature, check_finite=False)
        else:
            s = entropies
        selected, n_valid, n_selected = _select_top(s, mask, q, process_group)
        out = torch.where(selected, advantages[:, None], 0.0)
        if normalize == "selected_tokens" and n_selected > 0:
            out = out * (n_valid / n_selected)
        return out

    return fn


def _select_top(
    scores: torch.Tensor, mask: torch.Tensor, q: float, process_group: Optional[Any]
) -> tuple[torch.Tensor, int, int]:
    """Tokens with ``score >= quantile_q(valid scores)`` over the batch (and all ranks).

    Returns the ``[B, T]`` bool selection, the global valid count and the global selected count.
    """
    flat = torch.where(mask, scores.float(), -math.inf).reshape(-1)  # [B*T]
    n_local = int(mask.sum())
    if process_group is None:
        n = n_local
    else:
        import torch.distributed as dist

        world = dist.get_world_size(process_group)
        counts = [torch.zeros(1, dtype=torch.int64, device=flat.device) for _ in range(world)]
        dist.all_gather(counts, torch.tensor([n_local], device=flat.device), group=process_group)
        n = int(sum(int(c) for c in counts))
    if n == 0:
        return torch.zeros_like(mask), 0, 0
    # torch.quantile's linear interpolation puts the threshold between sorted[floor(q(n-1))] and
    # sorted[ceil(q(n-1))]; `s >= threshold` then keeps exactly the elements from sorted index
    # ceil(q(n-1)) up, i.e. the k largest with ties at the k-th included.
    k = n - math.ceil(q * (n - 1))
    if process_group is None:
        threshold = flat.kthvalue(flat.numel() - k + 1).values
    else:
        k_local = min(k, flat.numel())
        top = flat.topk(k_local).values if k_local > 0 else flat.new_empty(0)
        if k_local < k:
            top = F.pad(top, (0, k - k_local), value=-math.inf)
        gathered = [torch.empty_like(top) for _ in range(dist.get_world_size(process_group))]
        dist.all_gather(gathered, top, group=process_group)
        everything = torch.cat(gathered)
        threshold = everything.kthvalue(everything.numel() - k + 1).values
    selected = mask & (scores.float() >= threshold)
    n_selected = int(selected.sum())
    if process_group is not None:
        total = torch.tensor([n_selected], device=flat.device)
        dist.all_reduce(total, group=process_group)
        n_selected = int(total)
    return selected, n, n_selected


def _normalise_to_length(w: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``c_t = w_t / Σ_k w_k · T_i`` per row (so ``Σ_t c_t = T_i``); rows with no positive total
    mass get ``c = 1``. ``w`` is 0 at masked positions."""
    lengths = mask.sum(dim=1, keepdim=True).float()  # [B, 1]
    total = w.sum(dim=1, keepdim=True)  # [B, 1]
    ok = total > 0
    scale = torch.where(ok, lengths / torch.where(ok, total, 1.0), 1.0)
    return torch.where(ok, w * scale, 1.0)


def _apply(advantages: torch.Tensor, c: torch.Tensor, apply_to: str) -> torch.Tensor:
    a = advantages[:, None]  # [B, 1]
    weighted = c * a
    if apply_to == "positive":
        return torch.where(a > 0, weighted, a)
    return weighted
