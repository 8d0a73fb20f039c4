"""Atomic, resumable training checkpoints.

A checkpoint is a directory ``<root>/step_<N>/`` holding ``model.safetensors`` (the weights,
loadable without pickle) and ``training_state.pt`` (optimizer, LR schedule, data position, RNG
states, value tracker, metric history). It is written into a temporary sibling directory, fsynced,
renamed into place, and only then named by the ``<root>/latest`` marker (itself replaced
atomically). A crash at any moment leaves either the previous checkpoint or the new one as
``latest``, never a half-written one.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Optional, Union

import torch
from safetensors.torch import load_file, save_file

__all__ = ["AtomicCheckpointer", "load_model_weights"]

MODEL_FILE = "model.safetensors"
STATE_FILE = "training_state.pt"


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # directories cannot be opened on some platforms
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(path: Path, write) -> None:
    write(path)
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def load_model_weights(model: torch.nn.Module, checkpoint_dir: Union[str, Path]) -> None:
    """Loads the weights of ``checkpoint_dir`` into ``model`` (strict).

    Either this module's own ``model.safetensors`` (torchtune key names), or a Hugging Face
    checkpoint (``config.json`` with ``model.safetensors`` or sharded files), converted by
    :mod:`pepo.hf`.

    Raises:
        ValueError: no weights, or keys or shapes that do not match the model.
    """
    d = Path(checkpoint_dir)
    if (d / "config.json").is_file():
        from pepo import hf

        cfg = hf.load_hf_config(d)
        state = hf.load_hf_state(d)
        if hf.is_hf_state(state):
            state = hf.hf_to_tune_state(state, cfg)
        path = d
    else:
        path = d / MODEL_FILE
        if not path.is_file():
            raise ValueError(f"checkpoint_dir={str(checkpoint_dir)!r} has no {MODEL_FILE}")
        state = load_file(str(path))
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    if missing or unexpected:
        raise ValueError(
            f"{path} does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    for k, v in state.items():
        if v.shape != own[k].shape:
            raise ValueError(
                f"{path}: {k} has shape {list(v.shape)}, the model expects {list(own[k].shape)}"
            )
    model.load_state_dict(state)


class AtomicCheckpointer:
    """Writes and finds step checkpoints under ``root``; keeps the last ``keep`` of them."""

    def __init__(self, root: Union[str, Path], keep: int = 2) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.root = Path(root)
        self.keep = keep

    def save(self, step: int, model: torch.nn.Module, state: dict[str, Any]) -> Path:
        """Writes checkpoint ``step`` atomically and points ``latest`` at it."""
        self.root.mkdir(parents=True, exist_ok=True)
        for stale in self.root.glob(".tmp_step_*"):  # left by a crash during an earlier save
            shutil.rmtree(stale, ignore_errors=True)
        final = self.root / f"step_{step}"
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp_step_{step}_", dir=self.root))
        try:
            weights = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
            _write_file(tmp / MODEL_FILE, lambda p: save_file(weights, str(p)))
            _write_file(tmp / STATE_FILE, lambda p: torch.save(state, p))
            _fsync_dir(tmp)
            if final.exists():  # a re-run of this step after a resume
                shutil.rmtree(final)
            os.replace(tmp, final)
            _fsync_dir(self.root)  # the new directory is durable before `latest` names it
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        marker_tmp = self.root / ".latest.tmp"
        marker_tmp.write_text(final.name + "\n")
        with open(marker_tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(marker_tmp, self.root / "latest")
        _fsync_dir(self.root)
        self._prune(keep_name=final.name)
        return final

    def _prune(self, keep_name: str) -> None:
        steps = sorted(
            (p for p in self.root.glob("step_*") if p.is_dir()),
            key=lambda p: int(p.name.split("_")[1]),
        )
        for p in steps[: -self.keep]:
            if p.name != keep_name:
                shutil.rmtree(p, ignore_errors=True)

    def latest(self) -> Optional[Path]:
        """The directory ``latest`` names, or None when there is no complete checkpoint."""
        marker = self.root / "latest"
        if not marker.is_file():
            return None
        path = self.root / marker.read_text().strip()
        if not (path / MODEL_FILE).is_file() or not (path / STATE_FILE).is_file():
            raise ValueError(f"checkpoint marker {marker} names {path}, which is incomplete")
        return path

    @staticmethod
    def load_state(path: Union[str, Path]) -> dict[str, Any]:
        """The training state of checkpoint directory ``path``."""
        return torch.load(Path(path) / STATE_FILE, map_location="cpu", weights_only=True)
