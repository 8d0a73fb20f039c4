"""File helpers the checkpoints and the exported models share: content digests, permissions
and durable writes."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Union

__all__ = ["follow_umask", "fsync_dir", "nearly_full", "sha256_file", "weights_digest",
           "write_durably"]


def sha256_file(path: Union[str, Path]) -> str:
    """The hex SHA-256 of the file at ``path``, read in 4 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


_DIGESTS: dict[tuple, str] = {}  # weights_digest's, by directory and its files' sizes and times


def weights_digest(checkpoint_dir: Union[str, Path]) -> str:
    """A digest of the weight files of ``checkpoint_dir`` (their names and contents; not a
    pepo checkpoint's training state): what a cache of numbers made from them is kept under,
    so that other weights written to the same path are never read back as these. Read once per
    process while the files keep their sizes and modification times."""
    files = [f for f in sorted(Path(checkpoint_dir).iterdir())
             if f.is_file() and f.suffix in WEIGHT_SUFFIXES and f.name != "training_state.pt"]
    key = (str(Path(checkpoint_dir).resolve()),
           *((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files))
    if key not in _DIGESTS:
        h = hashlib.sha256()
        for f in files:
            h.update(f"{f.name}:{sha256_file(f)};".encode())
        _DIGESTS[key] = h.hexdigest()[:16]
    return _DIGESTS[key]


def follow_umask(path: Union[str, Path]) -> None:
    """Gives ``path`` the permissions a plain ``open``/``mkdir`` would (``0o666``/``0o777``
    less the umask). ``mkdtemp`` makes directories 0700 and safetensors writes files 0600, which
    a team on a shared file system cannot read or resume from."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, (0o777 if Path(path).is_dir() else 0o666) & ~mask)


def fsync_dir(path: Union[str, Path]) -> None:
    """fsyncs directory ``path`` (its entries are durable), where the platform allows it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # directories cannot be opened on some platforms
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(path: Path, write: Callable[[Path], Any]) -> None:
    """``write(path)``, then fsyncs the file it wrote."""
    write(path)
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def nearly_full(where: Union[str, Path]) -> bool:
    """Whether less than 1 MiB is left on the file system of ``where`` (False when that cannot
    be read): how a failed write whose error says nothing of why (torch.save's C++ stream
    errors) is told to be the disk filling up. Measure it before the failed write's partial
    files are deleted, which frees their space again."""
    try:
        return shutil.disk_usage(where).free < 2**20
    except OSError:
        return False
