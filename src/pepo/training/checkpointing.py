"""Atomic, resumable training checkpoints.

A checkpoint is a directory ``<root>/step_<N>/`` holding ``model.safetensors`` (the weights,
loadable without pickle) and ``training_state.pt`` (optimizer, LR schedule, data position, RNG
states, value tracker, metric history). It is written into a temporary sibling directory, fsynced,
renamed into place, and only then named by the ``<root>/latest`` marker (itself replaced
atomically). A crash at any moment leaves either the previous checkpoint or the new one as
``latest``, never a half-written one.

Finding the checkpoint to resume from does not trust the marker blindly: a marker that is gone
or names anything but a ``step_<N>`` directory of ``root`` is ignored (with a warning) and the
``step_<N>`` directories are scanned instead; a checkpoint found damaged (a file missing or
truncated, e.g. by a full disk or a copy interrupted outside this module) is skipped with a
warning naming it, for the next older one. Before a resume loads one, silent damage is looked
for too: the CRC-32 of every member of the state file's zip, and the sha256 of both files against
``checksums.json``, written with them. Every other load of a checkpoint's weights (a run's
starting weights, an evaluation, the intervention study: all through
:func:`pepo.training.weights.load_model_weights`) checks ``model.safetensors`` against
``checksums.json`` with :func:`verify_weights` and refuses a damaged file.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import shutil
import tempfile
import warnings
import zipfile
from pathlib import Path
from typing import Any, Mapping, Optional, Union

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from pepo.training.files import follow_umask, nearly_full, sha256_file
from pepo.training.files import fsync_dir as _fsync_dir
from pepo.training.files import write_durably as _write_file

__all__ = ["AtomicCheckpointer", "CheckpointWarning", "follow_umask", "resolve_marker",
           "verify_weights"]

MODEL_FILE = "model.safetensors"
STATE_FILE = "training_state.pt"
MARKER = "latest"
CHECKSUMS = "checksums.json"  # sha256 of MODEL_FILE and STATE_FILE, recorded at save time
METADATA = "metadata.json"  # {"step": N, and the metric a checkpoint was kept for, if any}
BEST_MARKER = "best"  # names the checkpoint with the best metric (when ``best_metric`` is set)
_STEP_NAME = re.compile(r"step_(0|[1-9][0-9]*)")  # exactly what save() writes
_REPLACED = ".replaced_"  # the prefix of a checkpoint moved aside while it is saved again
_MARKER_MAX_BYTES = 64  # a valid marker is "step_<N>\n"; never read an arbitrary big file


class CheckpointWarning(UserWarning):
    """A checkpoint or the ``latest`` marker was found damaged or invalid and was skipped."""


def atomic_write_text(path: Path, text: str, tmp: Optional[Path] = None) -> None:
    """Writes ``text`` to ``path`` atomically and durably: into ``tmp`` (default
    ``PATH.tmp``), fsynced, renamed over ``path``, the directory fsynced; ``tmp`` is removed
    when the write fails."""
    tmp = tmp or path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())  # the data is on disk before the name points at it
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def resolve_marker(path: Any) -> Any:
    """The checkpoint directory that ``path`` names when it is a run's ``checkpoints/latest`` or
    ``checkpoints/best`` marker file (so ``checkpoint_dir=RUN/checkpoints/best`` works wherever
    a checkpoint directory is asked for); anything else is returned unchanged.

    Raises:
        ValueError: a marker that does not name a ``step_<N>`` directory beside it.
    """
    if path is None:
        return path
    p = Path(str(path))
    if p.name not in (MARKER, BEST_MARKER) or not p.is_file():
        return path
    with open(p, "rb") as fh:
        text = fh.read(_MARKER_MAX_BYTES + 1).decode("utf-8", errors="replace").strip()
    target = p.parent / text
    if not _STEP_NAME.fullmatch(text) or not target.is_dir() or target.is_symlink():
        raise ValueError(f"{p} is a checkpoint marker, but it names {text[:_MARKER_MAX_BYTES]!r}, "
                         f"not a step_<N> checkpoint directory beside it")
    return str(target)


def _recorded_sums(path: Path) -> Optional[dict[str, str]]:
    """The sha256 digests checkpoint ``path`` recorded in ``checksums.json`` at save time, by
    file name; None when it has none (written before pepo recorded them).

    Raises:
        ValueError: ``checksums.json`` is unreadable or does not name both files.
    """
    sums_file = path / CHECKSUMS
    if not sums_file.is_file():
        return None
    try:
        sums = json.loads(sums_file.read_text(encoding="utf-8"))
        return {name: str(sums[name]) for name in (MODEL_FILE, STATE_FILE)}
    except (ValueError, KeyError, TypeError, OSError) as e:
        raise ValueError(f"{CHECKSUMS} is unreadable ({type(e).__name__}: "
                         f"{' '.join(str(e).split())})") from None


def verify_weights(path: Union[str, Path]) -> None:
    """Checks ``model.safetensors`` of checkpoint directory ``path`` against the sha256 that its
    ``checksums.json`` recorded when it was saved; a directory without ``checksums.json`` (a
    Hugging Face one, or a checkpoint from before pepo recorded them) has nothing to check.
    Reads the file in full. ``training_state.pt`` is not read: a resume checks it (see
    :meth:`AtomicCheckpointer.load_latest`).

    Raises:
        ValueError: (one line, naming the file) the weights differ from what was saved (a
            flipped bit, a partial copy), or ``checksums.json`` is unreadable.
    """
    path = Path(path)
    try:
        sums = _recorded_sums(path)
    except ValueError as e:
        raise ValueError(f"cannot check {path / MODEL_FILE}: its {e}; restore the checkpoint "
                         f"from a copy") from None
    if sums is None:
        return
    if not (path / MODEL_FILE).is_file():
        raise ValueError(f"{path} has no {MODEL_FILE}")
    if sha256_file(path / MODEL_FILE) != sums[MODEL_FILE]:
        raise ValueError(
            f"{path / MODEL_FILE} is damaged: its sha256 differs from the one recorded in "
            f"{CHECKSUMS} when it was saved (a flipped bit or an incomplete copy); restore it "
            f"from a copy, or load another checkpoint"
        )


def _step(path: Path) -> Optional[int]:
    """N of a ``step_<N>`` name, None for any other name."""
    m = _STEP_NAME.fullmatch(path.name)
    return int(m.group(1)) if m else None


class AtomicCheckpointer:
    """Writes and finds step checkpoints under ``root``; keeps the last ``keep`` of them.

    Args:
        root: the directory of the ``step_<N>`` checkpoints and the ``latest`` marker.
        keep: how many checkpoints to keep (int >= 1); older ones are deleted after a save.
        best_metric: also keep the checkpoint whose ``metadata.json`` holds the highest value of
            this metric (e.g. ``"val_accuracy"``; the earliest of equal ones), whatever its age,
            and name it in the ``best`` marker. None: keep the newest ``keep`` only.

    Raises:
        ValueError: ``keep`` is not an int >= 1.
    """

    def __init__(self, root: Union[str, Path], keep: int = 2,
                 best_metric: Optional[str] = None) -> None:
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be an int >= 1, got {keep!r}")
        self.root = Path(root)
        self.keep = keep
        self.best_metric = best_metric

    def save(self, step: int, model: Union[torch.nn.Module, Mapping[str, torch.Tensor]],
             state: dict[str, Any], metrics: Optional[Mapping[str, float]] = None) -> Path:
        """Writes checkpoint ``step`` atomically and points ``latest`` at it.

        ``model`` is a module or its (full) state dict; ``metrics`` (e.g. the step's validation
        accuracy) go into the checkpoint's ``metadata.json`` with the step.

        Raises:
            ValueError: ``step`` is not an int >= 0.
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        self.root.mkdir(parents=True, exist_ok=True)
        self._recover()
        for stale in self.root.glob(".tmp_step_*"):  # left by a crash during an earlier save
            shutil.rmtree(stale, ignore_errors=True)
        final = self.root / f"step_{step}"
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp_step_{step}_", dir=self.root))
        try:
            follow_umask(tmp)  # as readable as anything else the run writes
            sd = model.state_dict() if isinstance(model, torch.nn.Module) else model
            weights = {k: v.detach().contiguous().cpu() for k, v in sd.items()}
            _write_file(tmp / MODEL_FILE, lambda p: save_file(weights, str(p)))
            try:
                _write_file(tmp / STATE_FILE, lambda p: torch.save(state, p))
            except RuntimeError as e:
                # torch.save reports a full disk as a C++ stream error naming no cause: the free
                # space says it, measured before the partial files are deleted
                if nearly_full(tmp):
                    raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} ({e})") from e
                raise
            sums = {name: sha256_file(tmp / name) for name in (MODEL_FILE, STATE_FILE)}
            meta = {"step": step, **{k: float(v) for k, v in (metrics or {}).items()}}
            for name, data in ((CHECKSUMS, sums), (METADATA, meta)):
                _write_file(tmp / name, lambda p, d=data: p.write_text(
                    json.dumps(d, indent=1) + "\n", encoding="utf-8"))
            for f in (tmp / MODEL_FILE, tmp / STATE_FILE, tmp / CHECKSUMS, tmp / METADATA):
                follow_umask(f)
            _fsync_dir(tmp)
            # a re-save of this step (its validation settled after a resume): the old copy is
            # moved aside, not deleted, until the new one is in place (_recover puts it back
            # after a crash between the two renames)
            old = self.root / f"{_REPLACED}{final.name}"
            if final.exists():
                shutil.rmtree(old, ignore_errors=True)
                os.replace(final, old)
            os.replace(tmp, final)
            _fsync_dir(self.root)  # the new directory is durable before `latest` names it
            shutil.rmtree(old, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self._write_marker(MARKER, final.name)
        self._prune(keep_name=final.name)
        return final

    def _recover(self) -> None:
        """Finishes a re-save that a crash interrupted: a checkpoint moved aside whose new copy
        is missing is put back; one whose new copy is in place is deleted."""
        if not self.root.is_dir():
            return
        for old in self.root.glob(f"{_REPLACED}step_*"):
            final = self.root / old.name[len(_REPLACED):]
            if _step(final) is None or old.is_symlink():
                continue
            if final.is_dir():
                shutil.rmtree(old, ignore_errors=True)
            else:
                try:
                    os.replace(old, final)
                except OSError:  # another process (a rank of the same launch) put it back
                    if not final.is_dir():
                        raise

    def _prune(self, keep_name: str) -> None:
        best = self.best()
        for p in self._step_dirs()[self.keep :]:
            if p.name != keep_name and (best is None or p.name != best.name):
                shutil.rmtree(p, ignore_errors=True)
        if self.best_metric is not None:
            self._write_marker(BEST_MARKER, best.name if best is not None else None)
        else:  # an earlier run's marker of a step pruned now goes
            target = self._marker_text(BEST_MARKER)
            if target is not None and not (self.root / target).is_dir():
                self._write_marker(BEST_MARKER, None)

    def _marker_text(self, name: str) -> Optional[str]:
        """What marker ``name`` holds (None when it is missing or unreadable)."""
        try:
            return (self.root / name).read_text(encoding="utf-8").strip()[:_MARKER_MAX_BYTES]
        except (OSError, ValueError):
            return None

    def _write_marker(self, name: str, target: Optional[str]) -> None:
        """Points marker ``name`` at checkpoint ``target`` atomically (None: removes it)."""
        path = self.root / name
        if target is None:
            path.unlink(missing_ok=True)
            return
        atomic_write_text(path, target + "\n", tmp=self.root / f".{name}.tmp")

    @staticmethod
    def metadata(path: Union[str, Path]) -> dict[str, Any]:
        """The ``metadata.json`` of checkpoint ``path`` (``{}`` when it has none or it is
        unreadable)."""
        try:
            data = json.loads((Path(path) / METADATA).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def best(self) -> Optional[Path]:
        """The checkpoint with the highest ``best_metric`` (the earliest of equal ones), or
        None when no checkpoint records it (or ``best_metric`` is None)."""
        if self.best_metric is None:
            return None
        scored = []
        for p in self._step_dirs():
            value = self.metadata(p).get(self.best_metric)
            if (isinstance(value, (int, float)) and not isinstance(value, bool)
                    and math.isfinite(value)):  # NaN: max() would keep whichever came first
                scored.append((value, -_step(p), p))
        return max(scored)[2] if scored else None

    def _step_dirs(self) -> list[Path]:
        """The ``step_<N>`` directories of ``root``, newest first.

        Symbolic links are left out: a checkpoint is a directory this class wrote inside
        ``root``, and resuming must never read (nor pruning delete) anything outside it.
        """
        if not self.root.is_dir():
            return []
        found = [p for p in self.root.iterdir()
                 if _step(p) is not None and p.is_dir() and not p.is_symlink()]
        return sorted(found, key=_step, reverse=True)

    def marked(self) -> Optional[Path]:
        """The checkpoint directory the ``latest`` marker names: the last one written intact.
        None when there is no marker, or (with a warning) when it is invalid."""
        marker = self.root / MARKER
        if not marker.exists() and not marker.is_symlink():
            return None
        problem, text = None, ""
        if marker.is_symlink() or not marker.is_file():
            problem = "is not a regular file"
        else:
            with open(marker, "rb") as fh:
                raw = fh.read(_MARKER_MAX_BYTES + 1)
            text = raw.decode("utf-8", errors="replace").strip()
            if len(raw) > _MARKER_MAX_BYTES or not _STEP_NAME.fullmatch(text):
                problem = f"holds {text[:_MARKER_MAX_BYTES]!r}, not a step_<N> name"
            elif not (self.root / text).is_dir() or (self.root / text).is_symlink():
                problem = f"names {text}, which is not a checkpoint directory of {self.root}"
        if problem is not None:
            warnings.warn(
                f"checkpoint marker {marker} {problem}: ignored; scanning {self.root} for "
                f"step_<N> checkpoints instead", CheckpointWarning, stacklevel=4,
            )
            return None
        return self.root / text

    def _candidates(self) -> list[Path]:
        """Checkpoints to try, best first: the marker's, then the older ones newest first.

        Without a valid marker, every ``step_<N>`` directory, newest first. A directory newer
        than a valid marker's is left out: the marker is written last, so such a directory is
        from a save that did not finish.
        """
        self._recover()
        steps = self._step_dirs()
        marked = self.marked()
        if marked is None:
            return steps
        return [marked] + [p for p in steps if _step(p) < _step(marked)]

    @staticmethod
    def _damage(path: Path) -> Optional[str]:
        """What is wrong with checkpoint ``path``, or None when it looks intact.

        Cheap: reads the safetensors header (which also checks that the file is as long as the
        header says) and the zip directory at the end of the state file, not the tensors.
        """
        for name in (MODEL_FILE, STATE_FILE):
            if not (path / name).is_file():
                return f"{name} is missing"
        try:
            with safe_open(str(path / MODEL_FILE), framework="pt") as f:
                f.keys()
        except Exception as e:  # safetensors raises its own SafetensorError, or OSError
            return f"{MODEL_FILE} is unreadable ({e})"
        try:
            with zipfile.ZipFile(path / STATE_FILE) as z:
                if not any(n.endswith("/data.pkl") or n == "data.pkl" for n in z.namelist()):
                    return f"{STATE_FILE} is not a torch.save archive (no data.pkl)"
        except (zipfile.BadZipFile, OSError) as e:
            return f"{STATE_FILE} is unreadable ({e})"
        return None

    @staticmethod
    def _corruption(path: Path) -> Optional[str]:
        """What silent damage checkpoint ``path`` holds (a flipped bit), or None: every CRC-32 of
        the state file's zip, and the sha256 of both files against those recorded at save time
        (checkpoints written before pepo recorded them have only the CRCs checked). Reads both
        files in full: what a resume does once."""
        try:
            with zipfile.ZipFile(path / STATE_FILE) as z:
                bad = z.testzip()
        except (zipfile.BadZipFile, OSError, EOFError) as e:
            return f"{STATE_FILE} is unreadable ({e})"
        except Exception as e:  # zlib.error and friends from a damaged member
            return f"{STATE_FILE} does not decompress ({type(e).__name__}: {e})"
        if bad is not None:
            return f"{STATE_FILE}: the CRC-32 of {bad} does not match its data"
        try:
            expected = _recorded_sums(path)
        except ValueError as e:
            return str(e)
        for name, digest in (expected or {}).items():
            if sha256_file(path / name) != digest:
                return f"the sha256 of {name} differs from the one recorded when it was saved"
        return None

    def _skip(self, path: Path, why: str) -> None:
        warnings.warn(
            f"checkpoint {path} is damaged ({why}): skipped, trying an older one",
            CheckpointWarning, stacklevel=3,
        )

    def has_checkpoints(self) -> bool:
        """True when ``root`` holds a ``latest`` marker or any ``step_<N>`` entry, intact or not.

        What a fresh (non-resuming) run checks before it writes into ``root``: starting over
        would mix its checkpoints with an earlier run's, or prune them.
        """
        if not self.root.is_dir():
            return False
        marker = self.root / MARKER
        return (marker.exists() or marker.is_symlink()
                or any(_step(p) is not None for p in self.root.iterdir()))

    def latest(self) -> Optional[Path]:
        """The newest intact checkpoint directory, or None when there is none.

        The marker's checkpoint if it is intact, else the next older intact one; without a
        valid marker, the newest intact ``step_<N>`` directory. Each damaged checkpoint and an
        invalid marker are reported with a :class:`CheckpointWarning`. The check is cheap (see
        :meth:`load_latest` for one that also loads the training state).
        """
        for path in self._candidates():
            why = self._damage(path)
            if why is None:
                return path
            self._skip(path, why)
        return None

    def load_latest(self) -> Optional[tuple[Path, dict[str, Any]]]:
        """``(directory, training state)`` of the newest checkpoint whose state loads, or None.

        As :meth:`latest`, and a checkpoint whose ``training_state.pt`` fails to load (damage
        inside the file that the cheap check cannot see) is skipped with a warning too. What a
        resuming run calls; load the weights from the returned directory with
        :func:`pepo.training.weights.load_model_weights`.
        """
        for path in self._candidates():
            why = self._damage(path) or self._corruption(path)
            if why is None:
                try:
                    return path, self.load_state(path)
                except Exception as e:  # RuntimeError, EOFError, pickle errors, ...
                    why = f"{STATE_FILE} does not load ({type(e).__name__}: {e})"
            self._skip(path, why)
        return None

    @staticmethod
    def load_state(path: Union[str, Path]) -> dict[str, Any]:
        """The training state of checkpoint directory ``path`` (``weights_only`` unpickling)."""
        return torch.load(Path(path) / STATE_FILE, map_location="cpu", weights_only=True)
