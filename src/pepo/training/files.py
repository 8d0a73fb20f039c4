"""File helpers the checkpoints and the converted models share: content digests and
permissions."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Union

__all__ = ["follow_umask", "sha256_file"]


def sha256_file(path: Union[str, Path]) -> str:
    """The hex SHA-256 of the file at ``path``, read in 4 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def follow_umask(path: Union[str, Path]) -> None:
    """Gives ``path`` the permissions a plain ``open``/``mkdir`` would (``0o666``/``0o777``
    less the umask). ``mkdtemp`` makes directories 0700 and safetensors writes files 0600, which
    a team on a shared file system cannot read or resume from."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, (0o777 if Path(path).is_dir() else 0o666) & ~mask)
