"""The paths a run writes, checked before any work: an output directory that is, or can be
created as, a writable directory; a file (a cache) that can be written where it is named."""

from __future__ import annotations

import errno
import os
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["check_file_target", "check_output_dir"]


def check_output_dir(path: Any, key: str = "output_dir") -> None:
    """Raises ``ValueError`` unless ``path`` is, or can be created as, a writable directory.

    The check creates what is missing and writes a probe file (then removes both), so that what
    only the attempt reveals, such as a symbolic link to a scratch mount that is not mounted, a
    link loop, a read-only file system or a place nothing can be created (``/proc``), is one line
    here instead of a traceback once the run has started."""
    if path is None:
        raise ValueError(f"config key {key!r} is required")
    p = Path(os.path.abspath(str(path)))
    for a in (p, *p.parents):
        if a.is_symlink():
            try:
                a.resolve(strict=True)
            except (OSError, RuntimeError) as e:  # 3.11 raises RuntimeError for a loop
                loop = isinstance(e, RuntimeError) or getattr(e, "errno", None) == errno.ELOOP
                raise ValueError(
                    f"{key}={str(path)!r}: {a} is a symbolic link to {os.readlink(a)}, which "
                    + ("loops back on itself" if loop else "does not exist (not mounted yet?)")
                ) from None
    existing = next(a for a in (p, *p.parents) if a.exists())
    if not existing.is_dir():
        raise ValueError(f"{key}={str(path)!r} cannot be a directory: {existing} is a file")
    missing = [a for a in (p, *p.parents) if not a.exists()]
    try:
        for attempt in range(5):
            try:
                p.mkdir(parents=True, exist_ok=True)
                fd, probe = tempfile.mkstemp(prefix=".pepo_probe_", dir=p)
                break
            except (FileNotFoundError, FileExistsError) as e:
                # the processes of one torchrun launch check one path at once: one's clean-up below
                # can remove the directory before another's probe, or as another's mkdir finds it
                if attempt == 4 or (type(e) is FileExistsError and p.is_file()):
                    raise
                time.sleep(0.01 * (attempt + 1))
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        where = e.filename or existing
        raise ValueError(f"{key}={str(path)!r} is not a writable directory: {where}: "
                         f"{e.strerror or e}") from None
    finally:
        for a in missing:  # deepest first: leave nothing behind (the run creates it later)
            try:
                a.rmdir()
            except OSError:
                break


def check_file_target(path: Any, key: str) -> None:
    """Raises ``ValueError`` unless ``path`` (the value of config key ``key``; None: nothing to
    check) names a file that can be written: not a directory, in a directory that is, or can be
    created as, a writable one. A cache is written after the work it keeps: a path it cannot be
    written to would lose that work."""
    if path is None:
        return
    p = Path(os.path.abspath(str(path)))
    if p.is_dir():
        raise ValueError(f"{key}={str(path)!r} is a directory; {key} names a file (e.g. "
                         f"{str(Path(str(path)) / (key.rsplit('.', 1)[-1] + '.json'))!r})")
    try:
        check_output_dir(p.parent, key)
    except ValueError as e:
        raise ValueError(f"{key}={str(path)!r} cannot be written: {e}") from None
