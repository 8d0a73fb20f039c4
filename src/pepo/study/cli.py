"""argparse types the study's commands share: a value checked before any work starts."""

from __future__ import annotations

import argparse
from typing import Callable

__all__ = ["count_arg", "window_arg"]


def _int_arg(text: str, ok: Callable[[int], bool], what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or not ok(value):
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
    return value


def window_arg(text: str) -> int:
    """An argparse type: a window ``W``, an odd int >= 1 (refused before any work starts)."""
    return _int_arg(text, lambda v: v >= 1 and v % 2 == 1, "an odd int >= 1")


def count_arg(text: str) -> int:
    """An argparse type: an int >= 0."""
    return _int_arg(text, lambda v: v >= 0, "an int >= 0")
