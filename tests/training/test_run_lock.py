"""File locks: ``locked`` (shared caches) and ``RunLock`` (one run per output directory) are
exclusive, the holder record is rewritten whole, and another user's live process is alive."""

from __future__ import annotations

import fcntl
import json
import os
import threading
import time

import pytest
import torch

from pepo.training import prior_cache, run_lock
from pepo.training.run_lock import LOCK_FILE, RunLock, locked, process_gone


def _shared_probe(lock_file) -> bool:
    """Whether a shared lock on ``lock_file`` can be taken now (through another open file, so
    another holder): an exclusive holder blocks it, a shared one does not."""
    with open(lock_file, "a") as f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(f.fileno(), fcntl.LOCK_UN)
        return True


def test_locked_is_exclusive(tmp_path):
    """Catches ``locked`` taking a shared lock (LOCK_SH for LOCK_EX): two writers of one cache
    entry would then both hold it. An exclusive probe cannot tell the two apart (a shared holder
    blocks it too); a shared probe and a second ``locked`` can."""
    path = tmp_path / "entry"
    acquired = threading.Event()

    def second():
        with locked(path):
            acquired.set()

    with locked(path):
        assert not _shared_probe(f"{path}.lock")
        t = threading.Thread(target=second, daemon=True)
        t.start()
        assert not acquired.wait(0.3)  # the second holder waits for the first
    assert acquired.wait(10)  # and gets it once the first is done
    t.join(10)
    assert _shared_probe(f"{path}.lock")  # released


def test_run_lock_is_exclusive(tmp_path):
    """Catches a RunLock that a shared lock would pass (LOCK_SH for LOCK_EX)."""
    with RunLock(tmp_path):
        assert not _shared_probe(tmp_path / LOCK_FILE)
    assert _shared_probe(tmp_path / LOCK_FILE)


def test_the_holder_record_is_rewritten_whole(tmp_path):
    """Catches a holder record written over the old one without truncating it first: a longer
    record left by an earlier holder (a long command line) kept its tail after the new, shorter
    one, so the file was no longer one JSON object and a second run's message said "its
    details are not written yet" instead of naming the holder."""
    old = {"pid": 1, "host": "elsewhere", "started": "2020-01-01T00:00:00+00:00",
           "command": "x" * 400}
    (tmp_path / LOCK_FILE).write_text(json.dumps(old) + "\n", encoding="utf-8")
    with RunLock(tmp_path):
        text = (tmp_path / LOCK_FILE).read_text(encoding="utf-8")
        assert text.endswith("}\n") and text.count("\n") == 1, text[-80:]
        assert json.loads(text)["pid"] == os.getpid()
        with pytest.raises(ValueError, match=rf"in use by another run \(pid {os.getpid()} on "):
            RunLock(tmp_path)


def _kill_raising(monkeypatch, pid, error):
    """``os.kill(pid, 0)`` raises ``error`` for ``pid`` (any other call goes to the real one)."""
    real = os.kill

    def kill(p, sig):
        if p == pid:
            raise error(1, "simulated")
        return real(p, sig)

    monkeypatch.setattr(run_lock.os, "kill", kill)


def test_another_users_live_process_is_not_gone(monkeypatch):
    """Catches taking PermissionError from ``os.kill(pid, 0)`` (a live process this user may
    not signal: another user's) for a dead one, e.g. catching OSError. Simulated: the tests run
    as root, which may signal anything."""
    _kill_raising(monkeypatch, 4242, PermissionError)
    assert process_gone(4242) is False
    _kill_raising(monkeypatch, 4242, ProcessLookupError)
    assert process_gone(4242) is True
    monkeypatch.undo()
    assert process_gone(os.getpid()) is False
    assert process_gone(2**70) is True  # cannot be a pid (OverflowError)


def test_a_live_writers_temporary_file_is_left_alone(tmp_path, monkeypatch):
    """Catches the prior cache removing the temporary file of a writer that is alive but not
    ours to signal (it would lose that writer's rename), through process_gone."""
    path = tmp_path / "p.json"
    leftover = tmp_path / "p.json.tmp4242"
    leftover.write_text("{}", encoding="utf-8")
    _kill_raising(monkeypatch, 4242, PermissionError)
    prior_cache.write_prior(path, {"seed": 0}, {"a": 0.5})
    assert leftover.exists()
    _kill_raising(monkeypatch, 4242, ProcessLookupError)  # the writer died before its rename
    prior_cache.write_prior(path, {"seed": 0}, {"a": 0.5})
    assert not leftover.exists()


def test_a_wait_for_a_shared_cache_is_said_and_bounded(tmp_path):
    """A run waiting for another to finish a shared cache (the SPO prior, a converted model)
    sat silent, and on several processes rank 0 waited without limit while the others' gather
    timed out with no word of the lock. Catches the note not given, given at every poll, not
    naming the holder, and a ``timeout_s`` not honoured (or honoured with the lock free)."""
    path = tmp_path / "prior.json"
    notes, got = [], []
    with locked(path):
        with pytest.raises(ValueError, match=rf"^{path} is being written by another process "
                                             rf"\(pid {os.getpid()} on .*\); this one waited"):
            with locked(path, timeout_s=0.3, note=notes.append, poll_s=0.05):
                pass
        assert notes == [f"waiting for another process to finish writing {path} (pid "
                         f"{os.getpid()} on {run_lock.socket.gethostname()})"]

        def waiter():
            with locked(path, note=notes.append, poll_s=0.05):
                got.append(True)

        t = threading.Thread(target=waiter, daemon=True)
        t.start()
        deadline = time.monotonic() + 10
        while len(notes) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)  # polls more after its note
        assert got == [] and len(notes) == 2
    t.join(10)
    assert got == [True] and len(notes) == 2  # once, however long the wait
    with locked(path, timeout_s=0.0, note=notes.append):  # free: no wait, no note
        assert len(notes) == 2


def test_the_prior_gives_up_on_a_held_lock_before_the_other_ranks_time_out(tmp_path,
                                                                           monkeypatch):
    """On several processes rank 0 waits for another run's prior at most 0.9 of
    ``distributed.timeout_s`` (the other ranks wait for its answer in a collective bounded by
    it), with a line naming the holder and what to do. Catches the wait unbounded there, bound
    by another fraction, and a bound put on a run of one process (which may wait as long as it
    takes)."""
    import logging
    import types

    from pepo.estimators import SingleStreamEstimator

    asked = []
    real = prior_cache.locked

    def spy(path, **kwargs):
        asked.append(kwargs["timeout_s"])
        return real(path, **kwargs)

    monkeypatch.setattr(prior_cache, "locked", spy)
    path = tmp_path / "prior.json"
    dist = types.SimpleNamespace(is_main=True, enabled=True, timeout_s=0.5,
                                 gather_objects=lambda x: [x])
    est = SingleStreamEstimator(prior_samples=1)
    logger = logging.getLogger("test_prior_lock")
    errors = []

    def rank0():
        try:
            prior_cache.prepare_estimator(est, ["a"], lambda idx: torch.ones(len(idx)),
                                          path=path, dist=dist, log=logger)
        except ValueError as e:
            errors.append(str(e))

    with locked(path):  # in a thread: a wait without its bound fails here, and does not hang
        t = threading.Thread(target=rank0, daemon=True)
        t.start()
        t.join(30)
    assert asked == [pytest.approx(0.45)]
    assert len(errors) == 1 and errors[0].startswith(f"{path} is being written by another "
                                                     f"process (pid {os.getpid()} on ")
    assert errors[0].endswith("gives up: run again once it is written, or raise "
                              "distributed.timeout_s")
    one = types.SimpleNamespace(is_main=True, enabled=False, timeout_s=0.01,
                                gather_objects=lambda x: [x])
    prior_cache.prepare_estimator(est, ["a"], lambda idx: torch.ones(len(idx)), path=path,
                                  dist=one)
    assert asked[-1] is None  # one process: no bound


def test_a_wait_with_a_timeout_gives_up_on_time_whatever_the_poll(tmp_path):
    """Catches the last sleep of a bounded wait taken whole (``poll_s``) instead of
    what is left of ``timeout_s``: rank 0 then gives up after the other ranks' collective timed
    out (the bound is 0.9 of ``distributed.timeout_s``), the very failure the bound prevents."""
    path = tmp_path / "prior.json"
    with locked(path):
        start = time.monotonic()
        with pytest.raises(ValueError, match="gives up"):
            with locked(path, timeout_s=0.2, poll_s=30.0):
                pass
        assert time.monotonic() - start < 5.0


def test_the_shared_lock_names_its_holder_alone(tmp_path):
    """The lock file of a shared cache is opened for appending: catches the holder
    line added after the last holder's instead of replacing it, so that a waiting run named a
    holder long gone (the file's first line)."""
    path = tmp_path / "prior.json"
    lock = tmp_path / "prior.json.lock"
    lock.write_text("pid 1 on elsewhere\n", encoding="utf-8")
    with locked(path):
        assert lock.read_text(encoding="utf-8") == (
            f"pid {os.getpid()} on {run_lock.socket.gethostname()}\n")
    with locked(path):  # and again, by the next holder
        assert lock.read_text(encoding="utf-8").count("\n") == 1


def test_abandon_removes_only_a_directory_it_created_and_left_empty(tmp_path):
    """A run refused before writing anything leaves no directory behind,
    but only one its lock created and holding nothing else: catches a directory the user made
    beforehand removed, and the lock file of a directory another process wrote into removed
    (a run waiting on that file and a third one locking a new file would both go on)."""
    new = tmp_path / "new"
    RunLock(new).abandon()
    assert not new.exists()
    made = tmp_path / "made"
    made.mkdir()
    RunLock(made).abandon()
    assert made.is_dir() and [p.name for p in made.iterdir()] == [LOCK_FILE]
    shared = tmp_path / "shared"
    lock = RunLock(shared)
    (shared / "metrics.jsonl").write_text("{}\n", encoding="utf-8")
    lock.abandon()
    assert sorted(p.name for p in shared.iterdir()) == sorted([LOCK_FILE, "metrics.jsonl"])
