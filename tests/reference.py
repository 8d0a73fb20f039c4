"""Slow references written straight from the paper's formulas (float64, loops, numpy).

They share nothing with the vectorised code under test: compaction is a Python list
comprehension, reflect padding is ``numpy.pad(mode="reflect")``, windows are explicit loops.
"""

from __future__ import annotations

import math

import numpy as np
import torch


def valid_values(row: torch.Tensor, mask_row: torch.Tensor) -> np.ndarray:
    """The row's valid values, in order, as float64 (the row 'alone, unpadded')."""
    return np.array(
        [float(v) for v, m in zip(row.tolist(), mask_row.tolist()) if m], dtype=np.float64
    )


def scatter_back(values: np.ndarray, mask_row: torch.Tensor) -> np.ndarray:
    out = np.zeros(len(mask_row), dtype=np.float64)
    j = 0
    for t, m in enumerate(mask_row.tolist()):
        if m:
            out[t] = values[j]
            j += 1
    return out


def proximal_entropy_row(
    h: np.ndarray, window: int, temperature: float = 1.0, pad_mode: str = "reflect"
) -> np.ndarray:
    """Eq. (6): e_t = exp(H_t/τ) / Σ_{|k-t| <= W/2} exp(H_k/τ), reflect-padded (App. C)."""
    if len(h) == 0:
        return h.copy()
    half = window // 2
    x = h / temperature
    p = np.pad(x, half, mode=pad_mode)
    e = np.empty(len(h))
    for t in range(len(h)):
        win = [p[t + j] for j in range(window)]  # window centred on t: padded t .. t + 2 half
        m = max(win)  # shift for range safety; cancels in the ratio
        e[t] = math.exp(x[t] - m) / math.fsum(math.exp(w - m) for w in win)
    return e


def proximal_entropy_row_fast(h: np.ndarray, window: int, temperature: float = 1.0) -> np.ndarray:
    """Same as :func:`proximal_entropy_row`, vectorised in float64 for 32k-token rows."""
    half = window // 2
    x = h / temperature
    p = np.pad(x, half, mode="reflect")
    win = np.lib.stride_tricks.sliding_window_view(p, window)  # [L, W]
    m = win.max(axis=1)
    return np.exp(x - m) / np.exp(win - m[:, None]).sum(axis=1)


def window_average_row(h: np.ndarray, window: int) -> np.ndarray:
    """App. E's softmax-free statistic: r_t = H_t / Σ_{|k-t| <= W/2} H_k, 1/W where that is 0."""
    half = window // 2
    if len(h) == 0:
        return h.copy()
    p = np.pad(h, half, mode="reflect")
    out = np.empty(len(h))
    for t in range(len(h)):
        total = math.fsum(p[t + j] for j in range(window))
        out[t] = h[t] / total if total > 0 else 1.0 / window
    return out


def window_average_row_fast(h: np.ndarray, window: int) -> np.ndarray:
    """Same as :func:`window_average_row`, vectorised in float64 for 32k-token rows."""
    half = window // 2
    p = np.pad(h, half, mode="reflect")
    total = np.lib.stride_tricks.sliding_window_view(p, window).sum(axis=1)
    return np.where(total > 0, h / np.where(total > 0, total, 1.0), 1.0 / window)


def sum_preserving(w: np.ndarray) -> np.ndarray:
    """c_t = w_t / Σ w · T (Eq. 7); uniform when the row has no positive mass."""
    total = math.fsum(w)
    if len(w) == 0:
        return w.copy()
    if total <= 0:
        return np.ones_like(w)
    return w / total * len(w)


def proximal_entropy(
    entropies: torch.Tensor, mask: torch.Tensor, window: int, temperature: float = 1.0
) -> np.ndarray:
    rows = []
    for i in range(entropies.shape[0]):
        v = valid_values(entropies[i].double(), mask[i])
        rows.append(scatter_back(proximal_entropy_row(v, window, temperature), mask[i]))
    return np.stack(rows)


def multiplicative(
    advantages, entropies, mask, weights_row, apply_to: str, positive=None
) -> np.ndarray:
    """Â_{i,t} = c_{i,t} A_i on weighted rows; A_i on every token of the others.

    With apply_to='positive' the weighted rows are those flagged in ``positive`` (default
    A_i > 0, the strategies' default); with 'all' every row.
    """
    out = np.zeros(tuple(mask.shape))
    for i in range(mask.shape[0]):
        a = float(advantages[i])
        v = valid_values(entropies[i].double(), mask[i])
        flagged = (a > 0) if positive is None else bool(positive[i])
        if apply_to == "positive" and not flagged:
            c = np.ones_like(v)
        else:
            c = sum_preserving(weights_row(v))
        out[i] = scatter_back(c * a, mask[i])
    return out


def entropy_bonus(advantages, entropies, mask, alpha, kappa) -> np.ndarray:
    out = np.zeros(tuple(mask.shape))
    for i in range(mask.shape[0]):
        a = float(advantages[i])
        for t in range(mask.shape[1]):
            if mask[i, t]:
                out[i, t] = a + min(alpha * float(entropies[i, t]), abs(a) / kappa)
    return out


def global_topk(advantages, scores, mask, fraction) -> np.ndarray:
    """80/20 as TRL writes it, threshold = torch.quantile(valid scores, 1 - fraction), keep >=,
    but in float64: TRL's quantile of fp32 scores can keep one token fewer or more."""
    valid = torch.tensor(
        [
            float(scores[i, t])
            for i in range(mask.shape[0])
            for t in range(mask.shape[1])
            if mask[i, t]
        ],
        dtype=torch.float64,
    )
    out = np.zeros(tuple(mask.shape))
    if len(valid) == 0:
        return out
    thr = float(torch.quantile(valid, 1 - fraction))
    for i in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            if mask[i, t] and float(scores[i, t]) >= thr:
                out[i, t] = float(advantages[i])
    return out


def gtpo_rewards(entropies, mask, positive, groups, alpha1, alpha2, eps) -> np.ndarray:
    """GTPO, Eqs. 3 and 5, literally: for each group, each side and each valid-token index t,
    the side's rollouts that have a t-th valid token share ``α2 · count`` in proportion to H
    (successes) or 1/(H + eps) (failures); plus ``α1``, signed by the outcome."""
    b = mask.shape[0]
    rows = [valid_values(entropies[i], mask[i]) for i in range(b)]
    shaped = [np.zeros(len(r)) for r in rows]
    for g in set(int(x) for x in groups):
        for success in (True, False):
            members = [i for i in range(b) if int(groups[i]) == g and bool(positive[i]) == success]
            longest = max((len(rows[i]) for i in members), default=0)
            for t in range(longest):
                active = [i for i in members if len(rows[i]) > t]
                score = {i: rows[i][t] if success else 1.0 / (rows[i][t] + eps) for i in active}
                total = sum(score.values())
                for i in active:
                    share = score[i] / total if total > 0 else 1.0 / len(active)
                    term = alpha1 + alpha2 * share * len(active)
                    shaped[i][t] = term if success else -term
    return (
        np.stack([scatter_back(shaped[i], mask[i]) for i in range(b)])
        if b
        else np.zeros(tuple(mask.shape))
    )


def gtpo(entropies, mask, positive, groups, alpha1, alpha2, eps, normalize) -> np.ndarray:
    """GTPO's token advantages: the shaped rewards standardised (population std + 1e-6) over
    the group's valid tokens ("group") or over each side's ("side"); 0 for groups whose
    rollouts all succeeded or all failed."""
    r = gtpo_rewards(entropies, mask, positive, groups, alpha1, alpha2, eps)
    out = np.zeros(r.shape)
    b = mask.shape[0]
    for g in set(int(x) for x in groups):
        members = [i for i in range(b) if int(groups[i]) == g]
        if len({bool(positive[i]) for i in members}) < 2:
            continue
        units = (
            [members]
            if normalize == "group"
            else [
                [i for i in members if bool(positive[i])],
                [i for i in members if not bool(positive[i])],
            ]
        )
        for unit in units:
            values = [r[i, t] for i in unit for t in range(mask.shape[1]) if mask[i, t]]
            if not values:
                continue
            mean = sum(values) / len(values)
            std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
            for i in unit:
                for t in range(mask.shape[1]):
                    if mask[i, t]:
                        out[i, t] = (r[i, t] - mean) / (std + 1e-6)
    return out
