"""Prompt sampling with an exactly resumable position.

:class:`PromptSampler` walks a fresh seeded permutation of the dataset each epoch; its state is
``(epoch, position)``, so a resumed run draws the same prompts as an uninterrupted one.
:func:`prioritized_sample` is SPO's prioritised sampling: from a candidate pool, draw without
replacement with probability proportional to the tracker's weights ``sqrt(p(1-p)) + eps``.
"""

from __future__ import annotations

import operator
from typing import Any

import torch

__all__ = ["PromptSampler", "check_k", "prioritized_sample"]


class PromptSampler:
    """Epoch-wise shuffled indices into a dataset of ``size`` items."""

    def __init__(self, size: int, seed: int = 0) -> None:
        size = _integer("size", size, "an int (the dataset's items)")
        if size < 1:
            raise ValueError(f"cannot sample from an empty dataset (size={size})")
        self.size, self.seed = size, _integer("seed", seed, "an int")
        self.epoch, self.position = 0, 0

    def _perm(self, epoch: int) -> list[int]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.size, generator=g).tolist()

    def next(self, k: int) -> list[int]:
        """The next ``k`` indices (``k >= 1``), crossing into the next epoch's permutation when
        needed."""
        k = check_k(k)
        out: list[int] = []
        while len(out) < k:
            perm = self._perm(self.epoch)
            take = min(k - len(out), self.size - self.position)
            out.extend(perm[self.position : self.position + take])
            self.position += take
            if self.position == self.size:
                self.epoch, self.position = self.epoch + 1, 0
        return out

    def state_dict(self) -> dict[str, Any]:
        """The position (``epoch``, ``position``) and the dataset's ``size`` it is for."""
        return {"epoch": self.epoch, "position": self.position, "size": self.size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Goes back to a :meth:`state_dict`'s position; refuses one of another dataset size."""
        if state["size"] != self.size:
            raise ValueError(
                f"sampler state is for a dataset of {state['size']} items, this one has "
                f"{self.size}"
            )
        epoch, position = state["epoch"], state["position"]
        if any(isinstance(v, bool) or not isinstance(v, int) for v in (epoch, position)) \
                or epoch < 0 or not 0 <= position < self.size:
            raise ValueError(f"sampler state (epoch={epoch!r}, position={position!r}) is not a "
                             f"place in a dataset of {self.size} items")
        self.epoch, self.position = epoch, position


def _integer(name: str, value: Any, what: str) -> int:
    """``value`` as an int (a numpy integer too, as ``operator.index`` takes it), not a bool."""
    try:
        if not isinstance(value, bool):
            return operator.index(value)
    except TypeError:
        pass
    raise ValueError(f"{name} must be {what}, got {value!r}")


def check_k(k: object) -> int:
    """How many prompts to choose: an int >= 1 (0 was torch's error, a negative an empty
    choice)."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be an int >= 1 (prompts to choose), got {k!r}")
    return k


def prioritized_sample(
    weights: torch.Tensor, k: int, generator: torch.Generator
) -> list[int]:
    """``k`` indices drawn without replacement with probability ∝ ``weights`` (``[N]``, > 0).

    When ``k >= N`` every index is returned (in a random order).
    """
    check_k(k)
    if weights.ndim != 1 or weights.numel() == 0:
        raise ValueError(f"weights must be a non-empty [N] tensor, got {list(weights.shape)}")
    if not bool(torch.isfinite(weights).all()) or bool((weights <= 0).any()):
        raise ValueError("sampling weights must be finite and > 0")
    k = min(k, weights.numel())
    return torch.multinomial(weights.double(), k, replacement=False, generator=generator).tolist()
