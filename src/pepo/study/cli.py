"""argparse types the study's commands share: a value checked before any work starts."""

from __future__ import annotations

import argparse

__all__ = ["count_arg", "window_arg"]


def window_arg(text: str) -> int:
    """An argparse type: a window ``W``, an odd int >= 1 (refused before any work starts)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1 or value % 2 == 0:
        raise argparse.ArgumentTypeError(f"must be an odd int >= 1, got {text!r}")
    return value


def count_arg(text: str) -> int:
    """An argparse type: an int >= 0."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an int >= 0, got {text!r}")
    return value
