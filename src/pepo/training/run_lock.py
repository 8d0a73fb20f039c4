"""File locks: one run per output directory (:class:`RunLock`), and :func:`locked`, the
blocking lock that shared caches (the SPO prior, converted pretrained models) are written under.

One run per output directory: an exclusive lock held for the run's whole life.

Two runs started on one ``output_dir`` (a job submitted twice, a scheduler retry, two terminals)
would both pass the "already holds checkpoints" check before either saves, then interleave their
metrics, dumps and checkpoints, and each save would prune and sweep the other's. A run therefore
holds an advisory ``fcntl.flock`` on ``output_dir/.pepo.lock`` from before that check until it
ends; a second run gets a ``ValueError`` naming the directory and the holder (pid, host, start
time, command). The kernel drops the lock when its process dies, however it dies, so a SIGKILLed
run never blocks the next one, and what the lock file still says about a dead holder is ignored.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Union

__all__ = ["LOCK_FILE", "RunLock", "holder", "locked", "process_gone"]

LOCK_FILE = ".pepo.lock"


def process_gone(pid: int) -> bool:
    """Whether no process ``pid`` runs on this machine (another user's counts as running; a
    number that cannot be a pid counts as gone): what removing a dead writer's leftovers asks."""
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return True
    except PermissionError:  # alive, another user's
        pass
    return False


@contextlib.contextmanager
def locked(path: Union[str, os.PathLike], *, timeout_s: Optional[float] = None,
           note: Optional[Callable[[str], None]] = None, poll_s: float = 1.0,
           then: str = "") -> Iterator[None]:
    """Holds an exclusive advisory lock on ``path + '.lock'`` (created) while in the block,
    waiting for another holder to finish first.

    Args:
        timeout_s: wait at most this long (None: as long as it takes).
        note: told once, in one line naming the holder, when the lock is held by another
            process (a run that waits in silence looks hung).
        poll_s: how often a wait with ``timeout_s`` or ``note`` tries again.
        then: what to do after ``timeout_s``, ending the message.

    Raises:
        ValueError: the lock was still held after ``timeout_s``, naming the holder.
    """
    lock = Path(f"{path}.lock")
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a+", encoding="utf-8") as f:
        start = time.monotonic()
        while True:
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | (
                    fcntl.LOCK_NB if timeout_s is not None or note is not None else 0))
                break
            except OSError as e:
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise
            f.seek(0)
            holder = f.read().strip() or "its details are not written yet"
            waited = time.monotonic() - start
            if timeout_s is not None and waited >= timeout_s:
                raise ValueError(f"{path} is being written by another process ({holder}); this "
                                 f"one waited {waited:.0f} s for it and gives up{then}")
            if note is not None:
                note(f"waiting for another process to finish writing {path} ({holder})")
                note = None
            time.sleep(poll_s if timeout_s is None else min(poll_s, timeout_s - waited))
        try:
            f.truncate(0)
            f.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
            f.flush()
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def holder(directory: Union[str, Path]) -> str:
    """Who holds (or last held) ``directory``'s run lock, from its record: pid, host, start
    time and command."""
    try:
        info: dict[str, Any] = json.loads((Path(directory) / LOCK_FILE).read_text(
            encoding="utf-8"))
        return (f"pid {info['pid']} on {info['host']}, started {info['started']}: "
                f"{info.get('command', '')}".rstrip(": "))
    except (OSError, ValueError, KeyError, TypeError):
        return "its details are not written yet"


class RunLock:
    """Holds ``directory/.pepo.lock`` exclusively until :meth:`release` or process exit.

    Args:
        directory: the output directory (created if missing).
        key: the config key or option that named it, for the message (``output_dir``, ``--out``).

    Raises:
        ValueError: another live process holds the directory.
    """

    def __init__(self, directory: Union[str, Path], key: str = "output_dir") -> None:
        self.directory = Path(directory)
        self.created = not self.directory.exists()  # by this lock: abandon() may remove it
        self.directory.mkdir(parents=True, exist_ok=True)
        self.path = self.directory / LOCK_FILE
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            raise ValueError(
                f"{key}={str(directory)!r} is in use by another run ({self._holder()}); wait for "
                f"it to finish, or choose another {key}"
            ) from None
        self._fd: Optional[int] = fd
        info = {"pid": os.getpid(), "host": socket.gethostname(),
                "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                "command": " ".join(sys.argv)[:500]}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode("utf-8"), 0)

    def _holder(self) -> str:
        return holder(self.directory)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Drops the lock (idempotent). The file stays: removing it would let a third run lock a
        new file while a second one waits on the old."""
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    close = release

    def abandon(self) -> None:
        """Drops the lock of a run refused before it wrote anything: where this lock created the
        directory and nothing but the lock file is in it, both are removed (a refused run
        leaves no directory behind); otherwise as :meth:`release`."""
        self.release()
        if self.created and [p.name for p in self.directory.iterdir()] == [LOCK_FILE]:
            self.path.unlink(missing_ok=True)
            with contextlib.suppress(OSError):  # another process wrote into it meanwhile
                self.directory.rmdir()

    def __enter__(self) -> "RunLock":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def __del__(self) -> None:
        try:
            self.release()
        except Exception:  # interpreter shutdown
            pass
