"""The study's methods (:mod:`pepo.study.compare` runs them, :mod:`pepo.study.power` tests
them as one family): each mode's method labels with their strategy sections, the baseline
first, and the optional ones, which run only when named; and where a run of one lives."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

__all__ = ["METHODS", "MODES", "OPTIONAL", "RESULT_KEYS", "check_settings", "methods",
           "read_result", "run_dir", "saved_result", "slug", "style"]

METHODS = {
    "group": [
        ("GRPO", {"name": "uniform"}),
        ("80/20", {"name": "global_topk"}),
        ("80/20, proximal score", {"name": "global_topk", "global_topk": {"score": "proximal"}}),
        ("Entropy Adv.", {"name": "entropy_bonus"}),
        ("PEPO", {"name": "proximal_softmax"}),
        ("window_average", {"name": "window_average"}),
        ("GTPO", {"name": "gtpo"}),
        # App. F.3's temperature sweep of PEPO (the paper's grid: 0.5, 1, 2)
        ("PEPO, τ = 0.5", {"name": "proximal_softmax", "proximal_softmax": {"temperature": 0.5}}),
        ("PEPO, τ = 2", {"name": "proximal_softmax", "proximal_softmax": {"temperature": 2.0}}),
    ],
    "single_stream": [
        ("SPO", {"name": "uniform"}),
        ("S-80/20", {"name": "global_topk"}),
        ("S-Entropy Adv.", {"name": "entropy_bonus"}),
        ("PESPO", {"name": "proximal_softmax"}),
    ],
}
# run only where ``--methods`` names them: PEPO's window ablation (the paper's Table 6), at the
# windows of the real-model study (about 10 % and 25 % of its responses' mean length, and the
# paper's 101; its W = 5 is the config's PEPO)
OPTIONAL = {
    "group": [(f"PEPO, W = {w}", {"name": "proximal_softmax", "proximal_softmax": {"window": w}})
              for w in (11, 29, 101)],
    "single_stream": [],
}
MODES = ("group", "single_stream")

# One look per method in every figure (matplotlib keywords): Okabe and Ito's colour-blind-safe
# palette, and a line style and marker of its own, so that GRPO and PEPO differ in colour, dash
# and marker, in greyscale and for a colour-blind reader alike. A baseline is black and dashed;
# each mode's counterpart of a method shares its look (the modes are drawn in separate panels).
_BLUE, _SKY, _GREEN, _ORANGE, _RED, _PURPLE = (
    "#0072B2", "#56B4E9", "#009E73", "#E69F00", "#D55E00", "#CC79A7")
_STYLES = {
    "GRPO": ("black", "--", "o"), "SPO": ("black", "--", "o"),
    "80/20": (_RED, "-.", "s"), "S-80/20": (_RED, "-.", "s"),
    "80/20, proximal score": (_RED, ":", "D"),
    "Entropy Adv.": (_ORANGE, "-.", "^"), "S-Entropy Adv.": (_ORANGE, "-.", "^"),
    "PEPO": (_BLUE, "-", "v"), "PESPO": (_BLUE, "-", "v"),
    "window_average": (_GREEN, "-", "P"),
    "GTPO": (_PURPLE, "--", "X"),
    "PEPO, τ = 0.5": (_SKY, ":", "<"), "PEPO, τ = 2": (_SKY, "--", ">"),
    "PEPO, W = 11": (_BLUE, ":", "d"), "PEPO, W = 29": (_BLUE, "--", "h"),
    "PEPO, W = 101": (_BLUE, "-.", "*"),
}


def style(label: str) -> dict[str, Any]:
    """The matplotlib keywords (``color``, ``linestyle``, ``marker``, ``linewidth``) of method
    ``label`` in every figure; a label of no method's is grey."""
    color, linestyle, marker = _STYLES.get(label, ("gray", "-", "."))
    return {"color": color, "linestyle": linestyle, "marker": marker,
            "linewidth": 2.2 if label in ("PEPO", "PESPO") else 1.4}


def methods(mode: str) -> list[tuple[str, dict]]:
    """Every method label of ``mode`` with its strategy: the default plan's, then the optional."""
    return METHODS[mode] + OPTIONAL[mode]


def slug(label: str) -> str:
    label = label.replace("τ", "tau")
    return "".join(c if c.isascii() and c.isalnum() else "_" for c in label).strip("_").lower()


def run_dir(out: Path, task: str, mode: str, label: str, seed: int) -> Path:
    return out / task / mode / slug(label) / f"seed_{seed}"


# what every run's result JSON holds (compare writes more)
RESULT_KEYS = ("task", "mode", "method", "seed", "val_curve", "val_before", "val_after")


def read_result(path: Path, required: tuple[str, ...] = RESULT_KEYS) -> dict:
    """One run's result JSON (``result.json``, or a published copy), checked.

    Raises:
        ValueError: it is not JSON, not an object, or lacks one of the ``required`` keys,
            naming the file.
    """
    try:
        r = json.loads(Path(path).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not a result JSON ({e})") from None
    except OSError as e:  # a directory of that name, a file it may not read
        raise ValueError(f"{path}: cannot be read ({e.strerror or e})") from None
    if not isinstance(r, dict):
        raise ValueError(f"{path}: not a result JSON (a {type(r).__name__}, not an object)")
    missing = [k for k in required if k not in r]
    if missing:
        raise ValueError(f"{path}: not a result JSON, missing {', '.join(missing)}")
    return r


def saved_result(d: Path) -> Optional[dict]:
    """The result a finished run saved in ``d`` (:func:`read_result`, with the keys a study
    pairs and compares runs by), or None."""
    done = d / "result.json"
    return read_result(done, ("task", "mode", "method", "seed", "val_after")) if done.is_file() \
        else None


def check_settings(saved: dict, overrides: dict[str, Any], d: Path) -> dict:
    """``saved`` (the result in run directory ``d``) when it was made with ``overrides`` (its
    ``--steps`` and ``--set``; a result that records none passes).

    Raises:
        ValueError: it records other overrides.
    """
    if saved.get("overrides", overrides) != overrides:
        raise ValueError(f"{d} finished with --steps/--set {saved['overrides']}, and this call "
                         f"asks {overrides}: give the same, or another --out")
    return saved
