"""Argument checks shared by the public functions.

Every public entry point validates its tensors here so that bad input fails with a
``ValueError`` that names the offending argument, its shape and what was expected, instead of
broadcasting silently (``[B] * [B, 1]`` gives ``[B, B]``) or producing NaN later.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Optional

import torch

from pepo import _windows

__all__: list[str] = []


def format_shape(t: torch.Tensor) -> str:
    """``t``'s shape as the messages write it: ``[4, 1]``."""
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def is_int(value: Any) -> bool:
    """An integer (a NumPy one too: ``numbers.Integral``), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value: Any) -> bool:
    """A real number (a NumPy one too: ``numbers.Real``), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_tensor(name: str, value: Any) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def check_float(name: str, t: torch.Tensor) -> None:
    if not t.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")


def check_bool_mask(name: str, mask: Any, shape: torch.Size) -> torch.Tensor:
    mask = check_tensor(name, mask)
    if mask.dtype != torch.bool:
        raise ValueError(
            f"{name} must have dtype torch.bool (True = valid token), got {mask.dtype}; "
            f"convert with `{name}.bool()` if it holds 0/1 values"
        )
    if mask.shape != shape:
        raise ValueError(
            f"{name} must have the same shape as the tensor it masks "
            f"[{', '.join(map(str, shape))}], got {format_shape(mask)}"
        )
    return mask


def check_batch(
    advantages: Any, entropies: Any, mask: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Checks the ``(advantages [B], entropies [B, T], mask bool [B, T])`` triple."""
    entropies = check_tensor("entropies", entropies)
    if entropies.dim() != 2:
        raise ValueError(f"entropies must be [B, T], got {format_shape(entropies)}")
    check_float("entropies", entropies)
    b = entropies.shape[0]
    advantages = check_tensor("advantages", advantages)
    if advantages.dim() != 1 or advantages.shape[0] != b:
        raise ValueError(
            f"advantages must be [B]=[{b}] (one per sequence, matching entropies "
            f"{format_shape(entropies)}), got {format_shape(advantages)}"
        )
    check_float("advantages", advantages)
    mask = check_bool_mask("mask", mask, entropies.shape)
    if advantages.device != entropies.device or mask.device != entropies.device:
        raise ValueError(
            f"advantages ({advantages.device}), entropies ({entropies.device}) and mask "
            f"({mask.device}) must be on the same device"
        )
    return advantages, entropies, mask


def check_same_device(**tensors: torch.Tensor) -> None:
    """One device for every tensor (named by its keyword): a mix is refused naming each
    (torch's own error names no argument, and a meta tensor's data silently go nowhere)."""
    devices = {t.device for t in tensors.values()}
    if len(devices) > 1:
        listed = ", ".join(f"{name} ({t.device})" for name, t in tensors.items())
        raise ValueError(f"{listed} must be on the same device")


def check_entropies_mask(entropies: Any, mask: Any) -> tuple[torch.Tensor, torch.Tensor]:
    entropies = check_tensor("entropies", entropies)
    if entropies.dim() != 2:
        raise ValueError(f"entropies must be [B, T], got {format_shape(entropies)}")
    check_float("entropies", entropies)
    mask = check_bool_mask("mask", mask, entropies.shape)
    if mask.device != entropies.device:
        raise ValueError(
            f"entropies ({entropies.device}) and mask ({mask.device}) must be on the same device"
        )
    return entropies, mask


# The window kernels hold [B, >= 2W] buffers, so the window is capped: 2^16 + 1 covers the whole
# of any 32k-token response from every position, at 0.5 MB per row per buffer.
MAX_WINDOW = 65_537


def check_window(window: Any) -> int:
    if not is_int(window):
        raise ValueError(f"window must be an odd int >= 1, got {window!r}")
    window = int(window)
    if window < 1 or window % 2 == 0:
        raise ValueError(f"window must be an odd int >= 1, got {window}")
    if window > MAX_WINDOW:
        raise ValueError(
            f"window must be <= {MAX_WINDOW} (it spans the longest responses there are, and its "
            f"buffers grow with it), got {window}"
        )
    return window


def check_flag(name: str, value: Any) -> bool:
    """``value`` if it is a bool: a string such as ``"false"`` (a quoted YAML value) or ``0``
    would pass a truth test as the other setting."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value


def check_nonnegative(name: str, value: Any) -> float:
    """``value`` as a float, if it is a finite number >= 0 (a bool is refused)."""
    if not is_real(value) or not 0 <= value < math.inf:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return float(value)


def check_positive(name: str, value: Any) -> float:
    if not is_real(value):
        raise ValueError(f"{name} must be a positive number, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value}")
    return float(value)


# Outside this range fp32 cannot hold H / τ faithfully (entropies reach log V ~ 12): below it
# the rounding of H / τ costs the windows' softmax up to 1e-4 of e and more (measured against a
# float64 loop at entropies up to 12: 2.8e-5 at 0.03, 1.0e-4 at 0.01, 2.1e-4 at 1e-3, 5.5e-2 at
# 1e-5), above it every H / τ rounds to the same value.
TEMPERATURE_RANGE = (0.05, 1e6)


def check_temperature(value: Any, name: str = "temperature") -> float:
    value = check_positive(name, value)
    lo, hi = TEMPERATURE_RANGE
    if not lo <= value <= hi:
        raise ValueError(
            f"{name} must be in [{lo:g}, {hi:g}] (fp32 holds H/{name} faithfully there), got "
            f"{value}")
    return value


def _check_per_row(name: str, t: Any, rows: torch.Tensor, integer: bool, what: str) -> torch.Tensor:
    """A ``[B]`` tensor with one ``what`` per row of ``rows`` (``[B]``), on its device: bool, or
    (``integer``) of an integer dtype."""
    t = check_tensor(name, t)
    b = rows.shape[0]
    if integer and (t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool):
        raise ValueError(
            f"{name} must have an integer dtype (one {what} per rollout), got {t.dtype}")
    if not integer and t.dtype != torch.bool:
        raise ValueError(
            f"{name} must have dtype torch.bool (one {what} per rollout), got {t.dtype}")
    if t.dim() != 1 or t.shape[0] != b:
        raise ValueError(
            f"{name} must be [B]=[{b}] (one {what} per rollout), got {format_shape(t)}")
    if t.device != rows.device:
        raise ValueError(f"{name} ({t.device}) must be on the advantages' device ({rows.device})")
    return t


def check_row_flags(name: str, flags: Any, rows: torch.Tensor) -> torch.Tensor:
    """A bool ``[B]`` tensor with one flag per row of ``rows`` (``[B]``), on its device."""
    return _check_per_row(name, flags, rows, integer=False, what="flag")


def check_row_ids(name: str, ids: Any, rows: torch.Tensor) -> torch.Tensor:
    """An integer ``[B]`` tensor with one id per row of ``rows`` (``[B]``), on its device."""
    return _check_per_row(name, ids, rows, integer=True, what="group id")


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")
    return value


def nonfinite_message(name: str, t: torch.Tensor) -> str:
    """``t``'s NaN/inf values (0 where masked), the first one's position and value named; only
    ever built on failure (it reads the tensor on the host)."""
    bad = ~torch.isfinite(t)
    at = bad.nonzero()
    first = [int(i) for i in at[0]] if len(at) else [0] * t.dim()
    place = ", ".join(map(str, first))
    where = (f" at valid (mask=True) positions, the first [{place}]" if t.dim() == 2
             else f", the first at [{place}]" if t.dim() != 1 else f", the first at index {place}")
    value = float(t[tuple(first)]) if len(at) else math.nan
    return (f"{name} holds {int(bad.sum())} NaN/inf value(s){where} ({value}); fix the "
            f"producer, or pass validate=False to skip this check")


def check_finite_clean(
    *, output: Optional[torch.Tensor] = None, **tensors: torch.Tensor
) -> bool:
    """Raises if a tensor (already 0 at masked positions) holds NaN/inf, or if ``entropies``
    holds a value below ``-NEGATIVE_TOLERANCE`` (an entropy is never negative: one rule for
    every strategy). Returns whether ``output`` (computed from these inputs; None: not checked)
    is finite everywhere, for the caller to redo or refuse.

    One host sync: a sum per tensor is cheaper than an isfinite pass; the counts are taken only
    on failure."""
    stats = [t.sum() for t in tensors.values()]
    ent = tensors.get("entropies")
    if ent is not None:
        stats.append(ent.amin() if ent.numel() else ent.new_zeros(()))
    if output is not None:  # its sum: 40x cheaper than isfinite().all() on a CPU
        stats.append(output.sum())
    values: list[float] = torch.stack([x.float() for x in stats]).tolist()
    inputs_ok = all(math.isfinite(x) for x in values[: len(tensors)]) and (
        ent is None or values[len(tensors)] >= -_windows.NEGATIVE_TOLERANCE)
    if not inputs_ok:
        for name, t in tensors.items():
            if not bool(torch.isfinite(t).all()):
                raise ValueError(nonfinite_message(name, t))
        if ent is not None and values[len(tensors)] < -_windows.NEGATIVE_TOLERANCE:
            raise ValueError(_windows.negative_entropy_message(values[len(tensors)]))
        # else only a sum of finite values overflowed: the inputs are fine
    # a sum of finite values can overflow: only then is every element looked at (a second read)
    return output is None or math.isfinite(values[-1]) or bool(torch.isfinite(output).all())


def overflow_message(name: str, out: torch.Tensor, adv: torch.Tensor) -> str:
    return (
        f"strategy {name!r} turned finite inputs into {int((~torch.isfinite(out)).sum())} "
        f"non-finite token advantages (|A| up to {float(adv.abs().max()):.4g}): the weighted "
        f"advantages overflow float32; scale the rewards or advantages down"
    )


def check_registration(kind: str, name: str, old: Any, new: Any, overwrite: bool) -> None:
    """Refuses registering ``new`` under a ``name`` that ``old`` holds (a ``kind``: strategy,
    estimator), naming it, unless ``overwrite`` or ``new`` is ``old`` defined again (the same
    function or class of the same module: a notebook cell run twice, ``importlib.reload``)."""
    if old is None or overwrite:
        return
    where = (getattr(old, "__module__", None), getattr(old, "__qualname__", None))
    if where != (getattr(new, "__module__", 0), getattr(new, "__qualname__", 0)):
        raise ValueError(f"{kind} {name!r} is already registered (by {where[0]}.{where[1]}); "
                         f"pass overwrite=True to replace it")


# what the paper calls its methods, as newcomers type them (lower case, letters and digits only)
_PAPER_NAMES = {
    "strategy": {"pepo": ("PEPO", "'proximal_softmax'"), "grpo": ("GRPO", "'uniform'"),
                 "pespo": ("PESPO", "'proximal_softmax' with the single_stream estimator"),
                 "8020": ("80/20", "'global_topk'"),
                 "entropyadv": ("Entropy Adv.", "'entropy_bonus'"),
                 "entropyadvantage": ("Entropy Adv.", "'entropy_bonus'"),
                 "spo": ("SPO", "the single_stream estimator with strategy 'uniform'")},
    "estimator": {"grpo": ("GRPO", "'group'"), "spo": ("SPO", "'single_stream'"),
                  "pespo": ("PESPO", "'single_stream' with strategy 'proximal_softmax'")},
}


def close_name(name: Any, names: list[str]) -> Optional[str]:
    """The registered name closest to ``name`` (``GTPO`` and ``Single-Stream`` too), or None."""
    import difflib

    for guess in (str(name), str(name).lower().replace("-", "_").replace(" ", "_")):
        close = difflib.get_close_matches(guess, names, n=1)
        if close:
            return close[0]
    return None


def paper_name_hint(kind: str, name: Any) -> str:
    """``"the paper's PEPO is 'proximal_softmax'"`` where an unknown ``kind`` (strategy or
    estimator) ``name`` is what the paper calls a method, else ``""``."""
    key = "".join(c for c in str(name).lower() if c.isalnum())
    paper = _PAPER_NAMES[kind].get(key)
    return f"the paper's {paper[0]} is {paper[1]}" if paper else ""
