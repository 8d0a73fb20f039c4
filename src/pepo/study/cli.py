"""The study's command-line pieces: argparse types its commands share (a value checked before
any work starts), and the command a report prints."""

from __future__ import annotations

import argparse
import shlex
import sys
from typing import Any, Callable, Optional

__all__ = ["DefaultsFormatter", "command_line", "count_arg", "percent_arg", "positive_arg",
           "positive_number_arg", "probability_arg", "shard_arg", "window_arg"]


class DefaultsFormatter(argparse.HelpFormatter):
    """``--help`` with each option's default where it has one worth saying (not None, False or
    empty), lists written as on the command line (``0 1 2``, not ``[0, 1, 2]``)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (default is None or default is False or default is argparse.SUPPRESS
                or default == [] or "(default" in text or not action.option_strings):
            return text
        if isinstance(default, (list, tuple)):
            default = " ".join(map(str, default))
        return f"{text} (default: {str(default).replace('%', '%%')})"


def _parsed(text: str, convert: Callable[[str], Any], ok: Callable[[Any], bool],
            what: str) -> Any:
    """``convert(text)`` when it converts and passes ``ok``; else argparse's one-line error."""
    try:
        value = convert(text)
    except ValueError:
        value = None
    if value is None or not ok(value):
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
    return value


def _int_arg(text: str, ok: Callable[[int], bool], what: str) -> int:
    return _parsed(text, int, ok, what)


def window_arg(text: str) -> int:
    """An argparse type: a window ``W``, an odd int >= 1 (refused before any work starts)."""
    return _int_arg(text, lambda v: v >= 1 and v % 2 == 1, "an odd int >= 1")


def count_arg(text: str) -> int:
    """An argparse type: an int >= 0."""
    return _int_arg(text, lambda v: v >= 0, "an int >= 0")


def positive_arg(text: str) -> int:
    """An argparse type: an int >= 1."""
    return _int_arg(text, lambda v: v >= 1, "an int >= 1")


def percent_arg(text: str) -> float:
    """An argparse type: a percentage in [0, 100]."""
    return _parsed(text, float, lambda v: 0 <= v <= 100, "a percentage in [0, 100]")


def probability_arg(text: str) -> float:
    """An argparse type: a probability in [0, 1]."""
    return _parsed(text, float, lambda v: 0 <= v <= 1, "a probability in [0, 1]")


def positive_number_arg(text: str) -> float:
    """An argparse type: a finite number > 0 (a learning rate, say)."""
    return _parsed(text, float, lambda v: 0 < v < float("inf"), "a finite number > 0")


def shard_arg(text: str) -> tuple[int, int]:
    """An argparse type: ``I/N``, the I-th of N shards (``0 <= I < N``)."""
    def shard(t: str) -> tuple[int, int]:
        i, n = (int(x) for x in t.split("/"))
        return i, n

    return _parsed(text, shard, lambda v: 0 <= v[0] < v[1], "I/N with 0 <= I < N (such as 0/2)")


def command_line(argv: Optional[list[str]]) -> str:
    """``pepo.study.compare``'s command without the options that only say where files go or
    how it ran (in any form argparse takes: ``--out DIR``, ``--out=DIR``, ``--disc FILE``)."""
    args = list(sys.argv[1:] if argv is None else argv)
    keep, skip = [], False
    for a in args:
        name = a.split("=", 1)[0]
        given = len(name) > 2 and name.startswith("--")  # an option, or its unique prefix

        def of(options: tuple[str, ...]) -> bool:
            return given and any(o.startswith(name) for o in options)

        if skip:
            skip = False
        elif of(("--out", "--docs", "--discussion", "--shard")):
            skip = "=" not in a
        elif not of(("--report-only",)):
            keep.append(a)
    return "python -m pepo.study.compare " + shlex.join(keep)  # "80/20, proximal score" quoted


# a strategy of the user's own is not a method of the study: where it runs instead
OWN_STRATEGY = ("a registered strategy of your own is not one of them: run it with `tune run "
                "pepo_recipe --config TASK 'imports=[MODULE]' strategy.name=NAME seed=S`, a run "
                "a seed (docs/recipe.md, extending pepo)")

# what the study sets for each of its runs, and the option that says it instead
FIXED = {"seed": "--seeds", "output_dir": "--out", "strategy.name": "--methods",
         "prior_cache": "--out", "validation.before_cache": "--out"}


def check_set(overrides: dict[str, Any]) -> None:
    """Refuses a ``--set`` the study cannot take: a key it sets for each run (:data:`FIXED`;
    ``seed=7`` made every seed the same run, counted as independent pairs), and validation
    switched off (the study compares validation accuracy).

    Raises:
        ValueError: naming the key (and the option that sets it).
    """
    _check_fixed(overrides)
    every = (overrides.get("validation") or {}).get("every") if isinstance(
        overrides.get("validation"), dict) else None
    if every is not None and (isinstance(every, bool) or not isinstance(every, int)
                              or every < 1):
        raise ValueError(f"--set validation.every={every!r}: the study compares validation "
                         f"accuracy, so validation must run (every >= 1)")


def _check_fixed(overrides: dict[str, Any], where: str = "") -> None:
    for key, value in overrides.items():
        full = f"{where}{key}"
        for fixed, option in FIXED.items():
            if full == fixed or (fixed.startswith(full + ".") and not isinstance(value, dict)):
                raise ValueError(f"--set {full}=...: the study sets {fixed} for each run "
                                 f"itself (give {option} instead" + (
                                     f"; {OWN_STRATEGY})" if option == "--methods" else ")"))
        if isinstance(value, dict):
            _check_fixed(value, full + ".")
