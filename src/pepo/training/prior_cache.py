"""A file that keeps SPO's offline prior, so runs that share it compute it once.

The single-stream estimator's prior is ``prior_samples`` rollouts of every training prompt by the
initial policy (8 x the dataset in the paper's PESPO configs): the most expensive part of a
short run, and the same for every strategy compared on a seed. With ``prior_cache: PATH`` the
recipe reads the per-prompt pass rates from ``PATH`` when it exists and was made under the same
settings (:func:`pepo.training.config.prior_fingerprint`), and otherwise computes them and writes
``PATH`` atomically. Its rollouts are drawn from a generator of their own, so a run is the
same, token for token, whether its prior was computed or read.

Concurrent runs may share one ``PATH``: :func:`locked` (:mod:`pepo.training.run_lock`) makes
the second wait for the first's file instead of computing the prior again (an advisory
``fcntl`` lock on ``PATH.lock``).

:func:`prepare_estimator` is the whole protocol the recipe runs before its first step, for
any estimator (one without an offline prior prepares nothing and reads no file).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Callable, Hashable, Mapping, Optional, Sequence

from pepo.training.checkpointing import atomic_write_text
from pepo.training.config import VAL_BEFORE_IGNORES, recipe_changes
from pepo.training.files import weights_digest
from pepo.training.run_lock import locked, process_gone
from pepo.training.schema import PRIOR_IGNORES

__all__ = ["cached_value", "checked_fingerprint", "input_digests", "locked", "prepare_estimator",
           "read_prior", "write_prior"]

VERSION = 1
_log = logging.getLogger(__name__)
_UNCHECKED: set[str] = set()  # files of an earlier pepo read without their inputs checked
INPUTS = "inputs."  # the fingerprint's keys of what the config names but does not hold


def problems_digest(problems: Sequence[Any]) -> str:
    """A digest of a dataset's problems, in order: every field of a dataclass (pepo's
    :class:`pepo.tasks.problems.Problem`), else ``id``, ``prompt`` and ``answer``."""
    h = hashlib.sha256()
    for p in problems:
        fields = dataclasses.asdict(p) if dataclasses.is_dataclass(p) else {
            k: getattr(p, k, None) for k in ("id", "prompt", "answer")}
        h.update(json.dumps(fields, sort_keys=True, default=str).encode("utf-8") + b"\n")
    return h.hexdigest()[:16]


def input_digests(path: Optional[str], checkpoint_dir: str,
                  **datasets: Sequence[Any]) -> dict[str, str]:
    """With a cache ``path``: digests of what the config's keys name but do not hold, for its
    fingerprint: the initial weights' files (``inputs.weights``) and each of ``datasets``'
    problems (``inputs.<name>``, e.g. ``inputs.val_dataset``). Weights written again to
    ``checkpoint_dir``, or a data file edited in place, are then other settings, never the
    cache's numbers read back. Without ``path``: nothing (nothing is read)."""
    if not path:
        return {}
    return {f"{INPUTS}weights": weights_digest(checkpoint_dir),
            **{f"{INPUTS}{name}": problems_digest(data) for name, data in datasets.items()}}


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
    pairs = _load(path, fingerprint, "pass_rates", "prior_cache", "a prior cache file",
                  PRIOR_IGNORES)
    rates = {k: float(v) for k, v in pairs}
    if set(rates) != set(prompt_ids) or len(pairs) != len(rates):
        missing = [p for p in prompt_ids if p not in rates]
        raise ValueError(
            f"prior_cache={str(path)!r} holds {len(rates)} prompts but the dataset has "
            f"{len(set(prompt_ids))}" + (f" (e.g. {missing[0]!r} is missing)" if missing else "")
        )
    return rates


def _load(path: Path, fingerprint: Mapping[str, Any], field: str, key: str, kind: str,
          leave_out: tuple[str, ...] = ()) -> Any:
    """``field`` of the cache file ``path`` made under ``fingerprint``; errors name the config
    ``key`` that points at it and, for another fingerprint, each setting that differs (but for
    those under ``leave_out``, which the fingerprint leaves out)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        saved, payload = data["fingerprint"], data[field]
        if data.get("version") != VERSION:
            raise KeyError("version")
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{key}={str(path)!r} is not {kind} ({e})") from None
    if not any(k.startswith(INPUTS) for k in saved) and any(k.startswith(INPUTS)
                                                             for k in fingerprint):
        # an earlier pepo kept no input digests: matched on the rest
        fingerprint = {k: v for k, v in fingerprint.items() if not k.startswith(INPUTS)}
        if str(path) not in _UNCHECKED:  # once (setup checks a validation cache, then reads it)
            _UNCHECKED.add(str(path))
            _log.warning(f"{key}={str(path)!r} was written by an earlier pepo, which did not "
                         f"record the weights and data it was made from: read unchecked (delete "
                         f"it to have it made again)")
    changed = recipe_changes(saved, dict(fingerprint), leave_out)
    if changed:
        raise ValueError(f"{key}={str(path)!r} was made under other settings: "
                         f"{', '.join(changed)}; delete it or point {key} elsewhere")
    return payload


def checked_fingerprint(path: Optional[str], fingerprint: Mapping[str, Any], checkpoint_dir: str,
                        what: str = "validation.before_cache",
                        **datasets: Sequence[Any]) -> dict[str, Any]:
    """``fingerprint`` with :func:`input_digests`, checked against the file at ``path`` when
    there is one: a cache made under other settings is refused before any work is done.

    Raises:
        ValueError: the file is not such a cache, or was made under other settings.
    """
    full = {**fingerprint, **input_digests(path, checkpoint_dir, **datasets)}
    if path and Path(path).is_file():
        _load(Path(path), full, "value", what, "a cached value file", VAL_BEFORE_IGNORES)
    return full


def cached_value(path: Optional[str], fingerprint: Mapping[str, Any],
                 compute: Callable[[], float], what: str = "validation.before_cache",
                 write: bool = True, dist: Any = None) -> tuple[float, bool]:
    """``(value, read)``: the number kept in ``path`` when it was made under ``fingerprint``,
    else ``compute()``, written to ``path`` atomically (when ``write``). No ``path``: always
    computed.

    With several processes (``dist``, a :class:`pepo.training.distributed.Dist`) every rank
    calls this and takes rank 0's answer: whether the file is there is not a rank's own view
    (a node-local path, a file that appears between two ranks' looks), since ``compute`` is
    collective; only rank 0 writes.

    Raises:
        ValueError: the file is not such a cache, or was made under other settings (naming each
            key that differs), on every rank.
    """
    if not path:
        return compute(), False
    p = Path(path)
    main = dist is None or dist.is_main
    found = None
    if main and p.is_file():
        try:
            found = ("value", float(_load(p, fingerprint, "value", what, "a cached value file",
                                          VAL_BEFORE_IGNORES)))
        except ValueError as e:
            found = ("error", str(e))
    if dist is not None:
        found = dist.gather_objects(found)[0]
    if found is not None:
        if found[0] == "error":
            raise ValueError(found[1])
        return found[1], True
    value = float(compute())
    if write and main:
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
            _remove_stale_temps(p)
            atomic_write_text(p, json.dumps({"version": VERSION, "fingerprint": dict(fingerprint),
                                             "value": value}),
                              tmp=p.with_name(p.name + f".tmp{os.getpid()}"))
        except OSError as e:  # the value is computed: the run goes on with it
            _unwritten(what, p, e)
    return value, False


def _unwritten(key: str, path: Path, error: OSError) -> None:
    _log.warning(f"{key}={str(path)!r} could not be written ({error}): the run goes on with the "
                 f"value it computed, and a later run computes it again")


class _Progress:
    """Counts the prior's rollouts and logs its start, every tenth of it, and its end (SPO's
    offline prior can take minutes before the first step)."""

    def __init__(self, estimator: Any, prompts: int, log: Optional[logging.Logger]) -> None:
        self.estimator, self.prompts, self.log = estimator, prompts, log
        self.total = int(estimator.prior_samples) * prompts
        self.count, self.reward, self.shown, self.t0 = 0, 0.0, 0, time.perf_counter()

    def wrap(self, score: Callable[[list[int]], Any]) -> Callable[[list[int]], Any]:
        def counted(indices: list[int]) -> Any:
            log, total = self.log, self.total
            if self.count == 0 and total and log is not None:
                log.info(f"Estimator {self.estimator.name!r}: sampling its offline prior, "
                         f"{total} rollouts ({total // self.prompts} per prompt) before step 1")
            rewards = score(indices)
            self.count += len(indices)
            self.reward += float(rewards.sum())
            if total and log is not None and self.count < total and \
                    10 * self.count // total > self.shown:  # every tenth
                self.shown = 10 * self.count // total
                log.info(f"  prior: {self.count}/{total} rollouts "
                         f"({time.perf_counter() - self.t0:.0f}s)")
            return rewards

        return counted

    def done(self) -> None:
        if self.count and self.log is not None:
            self.log.info(
                f"Estimator {self.estimator.name!r} prepared on {self.count} rollouts of "
                f"{self.prompts} prompts, mean reward {self.reward / self.count:.3f} "
                f"({time.perf_counter() - self.t0:.1f}s)"
            )


def prepare_estimator(estimator: Any, prompt_ids: Sequence[Hashable],
                      score: Callable[[list[int]], Any], *, path: Optional[str] = None,
                      fingerprint: Optional[Mapping[str, Any]] = None, dist: Any = None,
                      log: Optional[logging.Logger] = None) -> Optional[str]:
    """Whatever ``estimator`` (:class:`pepo.estimators.Estimator`) needs before training: its
    offline prior, computed through ``score`` (indices into ``prompt_ids`` -> rewards) or, with
    ``path``, read from that prior cache when it exists and matches ``fingerprint``, else
    computed and written there.

    With several processes (``dist``, a :class:`pepo.training.distributed.Dist`) every rank
    calls this: rank 0 holds the file lock, reads or writes the file and decides, and every
    rank takes its answer (``score`` is collective: each rank generates its share). ``log``
    (rank 0's logger, or None) gets the progress lines.

    Returns:
        ``"read"`` or ``"written"`` with ``path``, else None.
    """
    main = dist is None or dist.is_main
    progress = _Progress(estimator, len(prompt_ids), log if main else None)
    score = progress.wrap(score)
    outcome = None
    if path is None or estimator.prior_samples < 1:
        estimator.prepare(prompt_ids, score)
    else:
        # another run writing the same prior: say so, and on several processes give up
        # before the others' collective wait (distributed.timeout_s) ends in a bare timeout
        wait = dict(note=log.info if log is not None else None, timeout_s=(
            0.9 * dist.timeout_s if dist is not None and dist.enabled else None),
            then=": run again once it is written, or raise distributed.timeout_s")
        with locked(path, **wait) if main else contextlib.nullcontext():
            found = read_prior(path, fingerprint or {}, prompt_ids) if main else None
            if dist is not None:
                found = dist.gather_objects(found)[0]
            if found is not None:
                estimator.set_prior(found)
                outcome = "read"
                if main and log is not None:
                    log.info(f"Estimator prior read from {path} ({len(found)} prompts)")
            else:
                rates = estimator.prepare(prompt_ids, score)
                outcome = "written"
                if main:
                    try:
                        write_prior(path, fingerprint or {}, rates)
                    except OSError as e:  # the prior is computed: the run goes on with it
                        _unwritten("prior_cache", Path(path), e)
                        outcome = None
                    else:
                        if log is not None:
                            log.info(f"Estimator prior written to {path}")
    progress.done()
    return outcome
