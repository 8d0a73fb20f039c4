"""Process checks shared by the fault tests (Linux: they read /proc)."""

from __future__ import annotations

import time


def dead(pid: int, seconds: float = 10.0) -> bool:
    """Waits (bounded) until ``pid`` has exited (gone or a zombie); True if it did."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    return True
        except OSError:
            return True
        time.sleep(0.02)
    return False
