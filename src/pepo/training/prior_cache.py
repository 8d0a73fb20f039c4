"""A file that keeps SPO's offline prior, so runs that share it compute it once.

The single-stream estimator's prior is ``prior_samples`` rollouts of every training prompt by the
initial policy (8 x the dataset in the paper's PESPO configs): the most expensive part of a
short run, and the same for every strategy compared on a seed. With ``prior_cache: PATH`` the
recipe reads the per-prompt pass rates from ``PATH`` when it exists and was made under the same
settings (:func:`pepo.training.config.prior_fingerprint`), and otherwise computes them and writes
``PATH`` atomically. Its rollouts are drawn from a generator of their own, so a run is the
same, token for token, whether its prior was computed or read.

Concurrent runs may share one ``PATH``: :func:`locked` (:mod:`pepo.training.run_lock`) makes the second wait for the first's
file instead of computing the prior again (an advisory ``fcntl`` lock on ``PATH.lock``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Hashable, Mapping, Optional, Sequence

from pepo.training.checkpointing import atomic_write_text
from pepo.training.config import experiment_changes
from pepo.training.run_lock import locked, process_gone

__all__ = ["locked", "read_prior", "write_prior"]

VERSION = 1


def write_prior(path: str | os.PathLike, fingerprint: Mapping[str, Any],
                rates: Mapping[Hashable, float]) -> Path:
    """Writes the pass ``rates`` (prompt id -> rate) and the ``fingerprint`` they were made
    under to ``path`` atomically (temp file, then rename)."""
    bad = [k for k in rates if not isinstance(k, (str, int)) or isinstance(k, bool)]
    if bad:
        raise ValueError(f"prior_cache stores str or int prompt ids only, got {bad[0]!r}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(path)
    text = json.dumps({"version": VERSION, "fingerprint": dict(fingerprint),
                       "pass_rates": [[k, float(v)] for k, v in rates.items()]})
    atomic_write_text(path, text, tmp=path.with_name(path.name + f".tmp{os.getpid()}"))
    return path


def _remove_stale_temps(path: Path) -> None:
    """Removes the ``PATH.tmp<PID>`` files of writers that died between write and rename (their
    process is gone); a live writer's file is left alone."""
    for tmp in path.parent.glob(path.name + ".tmp*"):
        pid = tmp.name[len(path.name) + 4:]
        if not pid.isdigit():
            continue
        if process_gone(int(pid)):
            tmp.unlink(missing_ok=True)


def read_prior(path: str | os.PathLike, fingerprint: Mapping[str, Any],
               prompt_ids: Sequence[Hashable]) -> Optional[dict[Hashable, float]]:
    """The pass rates kept in ``path`` (``None`` when there is no such file).

    Raises:
        ValueError: the file is not a prior cache, was made under other settings (naming each
            key that differs), or does not cover exactly ``prompt_ids``.
    """
    path = Path(path)
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        saved, pairs = data["fingerprint"], data["pass_rates"]
        if data.get("version") != VERSION:
            raise KeyError("version")
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"prior_cache={str(path)!r} is not a prior cache file ({e})") from None
    changed = experiment_changes(saved, dict(fingerprint))
    if changed:
        raise ValueError(
            f"prior_cache={str(path)!r} was made under other settings: {', '.join(changed)}; "
            f"delete it or point prior_cache elsewhere"
        )
    rates = {k: float(v) for k, v in pairs}
    if set(rates) != set(prompt_ids) or len(pairs) != len(rates):
        missing = [p for p in prompt_ids if p not in rates]
        raise ValueError(
            f"prior_cache={str(path)!r} holds {len(rates)} prompts but the dataset has "
            f"{len(set(prompt_ids))}" + (f" (e.g. {missing[0]!r} is missing)" if missing else "")
        )
    return rates
