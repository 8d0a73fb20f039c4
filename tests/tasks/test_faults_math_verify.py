"""MathVerify's worker processes die with the process that owns them, however it ends.

Each test runs a small trainer stand-in in a subprocess: it builds ``MathVerify(workers=2)``,
scores one batch, prints its worker PIDs, and then ends (normally, by SIGTERM, by SIGKILL, or by
SIGKILL while a worker is deep in C-level arithmetic). The workers must be gone within a few
seconds. Every wait is bounded, and the test kills only the subprocess it started and the
worker PIDs that subprocess reported (checked against their start times, so a reused PID is
never touched).
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import pytest

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/stat").exists(), reason="reads process states from /proc (Linux)"
)

STARTUP_S = 120.0  # importing math-verify (sympy) on a loaded 2-core machine
DEATH_S = 5.0  # how long orphaned workers may outlive their parent

TRAINER = r"""
import sys, time
import pepo.tasks.rewards as R

mode = sys.argv[1]
if mode == "busy":
    real = R._score

    def score(response, *args):
        if response == "BUSY":
            n = 10 ** 8
            return float(7 ** n > 0)  # minutes of big-int arithmetic, deaf to signals
        return real(response, *args)

    R._score = score  # the forked workers inherit it
mv = R.MathVerify(timeout=120 if mode == "busy" else 5, workers=2)
assert mv(["\\boxed{2}", "\\boxed{3}"], ["2", "2"]) == [1.0, 0.0]
print("PIDS", *mv.pids, flush=True)
if mode == "exit":
    sys.exit(0)  # no close(): the owner just ends
if mode == "busy":
    mv(["BUSY"], ["1"])  # blocks; the test kills this process meanwhile
time.sleep(300)
"""


def _stat(pid: int) -> Optional[tuple[str, str]]:
    """``(state, start time)`` of ``pid`` from /proc, or None when there is no such process."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()  # the command name may contain spaces
    return fields[0], fields[19]


def _alive(pid: int, start: str) -> bool:
    """True while ``pid`` is the process that had start time ``start`` and is not a zombie."""
    st = _stat(pid)
    return st is not None and st[1] == start and st[0] not in ("Z", "X")


def _read_pids(proc: subprocess.Popen) -> list[int]:
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + STARTUP_S
    try:
        while time.monotonic() < deadline:
            if sel.select(timeout=deadline - time.monotonic()):
                line = proc.stdout.readline()
                if not line:
                    break  # the subprocess ended before printing its workers
                if line.startswith("PIDS "):
                    return [int(p) for p in line.split()[1:]]
    finally:
        sel.close()
    proc.kill()
    _, err = proc.communicate(timeout=30)
    pytest.fail(f"the trainer stand-in printed no worker PIDs; stderr:\n{err[-3000:]}")


def _run_and_end(mode: str, end) -> tuple[list[int], list[int]]:
    """Starts the stand-in, ends it with ``end(proc)``; returns (worker PIDs, those still alive
    ``DEATH_S`` seconds later). Leftover workers are killed before returning."""
    proc = subprocess.Popen(
        [sys.executable, "-c", TRAINER, mode],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    starts: dict[int, str] = {}
    try:
        pids = _read_pids(proc)
        for pid in pids:
            st = _stat(pid)
            assert st is not None, f"worker {pid} is not running"
            starts[pid] = st[1]
        end(proc)
        proc.wait(timeout=30)
        deadline = time.monotonic() + DEATH_S
        while time.monotonic() < deadline and any(_alive(p, s) for p, s in starts.items()):
            time.sleep(0.05)
        return pids, [p for p, s in starts.items() if _alive(p, s)]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        for pid, start in starts.items():  # a failing run must not leave orphans behind
            if _alive(pid, start):
                os.kill(pid, signal.SIGKILL)
        proc.stdout.close()
        proc.stderr.close()


def test_workers_die_when_the_owner_gets_sigterm():
    """Catches workers blocked in ``recv()`` while they (or their siblings) still hold the
    parent's pipe ends: no EOF ever arrives, and they run on as orphans (the original bug)."""
    pids, alive = _run_and_end("sleep", lambda p: p.send_signal(signal.SIGTERM))
    assert len(pids) == 2 and alive == []


def test_workers_die_when_the_owner_gets_sigkill():
    """Catches cleanup that only runs in Python (atexit, ``__del__``, a SIGTERM handler): a
    SIGKILLed owner runs none of it, so only EOF / the parent-death signal can end the workers."""
    pids, alive = _run_and_end("sleep", lambda p: p.kill())
    assert len(pids) == 2 and alive == []


def test_a_busy_worker_dies_when_the_owner_gets_sigkill():
    """Catches a worker that only notices its parent's death between jobs (EOF on ``recv``, a
    ``getppid()`` poll, a Python-level signal handler): one inside C-level arithmetic never
    reaches that check. Only a parent-death SIGKILL ends it in time."""
    if not sys.platform.startswith("linux"):
        pytest.skip("PR_SET_PDEATHSIG is Linux only")

    def end(proc):
        time.sleep(1.0)  # let a worker pick up the BUSY job
        proc.kill()

    pids, alive = _run_and_end("busy", end)
    assert len(pids) == 2 and alive == []


def test_workers_die_when_the_owner_exits_without_close():
    """Catches non-daemon workers with no atexit / finalizer close: the interpreter would wait
    for them at exit (or leave them behind)."""
    pids, alive = _run_and_end("exit", lambda p: None)
    assert len(pids) == 2 and alive == []
