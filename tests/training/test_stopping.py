"""How a run stops early (pepo.training.stopping), without a model or a recipe: the stop-signal
protocol, the non-finite step guard and a full disk's checkpoint error."""

from __future__ import annotations

import errno
import logging
import os
import signal
from pathlib import Path

import pytest
import torch

from pepo.training.stopping import (
    CheckpointFailed,
    NonFiniteError,
    NonFiniteGuard,
    StopSignals,
    TrainingStopped,
    checkpoint_failure,
)


def _signals(step=0, latest=None):
    state = {"step": step}
    return StopSignals(lambda: state["step"], lambda: latest), state


def test_a_signal_before_the_first_step_stops_at_once():
    """Catches a stop request that waits for a step that has not begun (the opening
    validation can take minutes): the first signal raises, with the signal's exit code."""
    s, _ = _signals()
    with pytest.raises(TrainingStopped, match="^stopped by Ctrl-C before the first training "
                                              "step: nothing was trained and no checkpoint was "
                                              "written$") as e:
        s.handle(signal.SIGINT)
    assert e.value.exit_code == 130
    resumed, _ = _signals(step=3, latest=Path("ckpt/step_3"))  # a resumed run's validation
    with pytest.raises(TrainingStopped, match=r"^stopped by SIGTERM before step 4: nothing more "
                                              r"was trained .* still ckpt/step_3$") as e:
        resumed.handle(signal.SIGTERM)
    assert e.value.exit_code == 143


def test_while_stepping_the_first_signal_asks_and_a_second_of_its_kind_stops(caplog):
    """Catches a first signal that stops mid-step (losing the step), a second one that is
    ignored, and a stop message naming another signal than the one received."""
    s, state = _signals(latest=None)
    s.stepping, state["step"] = True, 5
    log = logging.getLogger("test_stopping")
    s._log = log
    with caplog.at_level(logging.WARNING, logger="test_stopping"):
        s.handle(signal.SIGINT)
    assert s.requested and s.received == [signal.SIGINT]
    assert "Ctrl-C: stopping after step 5 and its checkpoint" in caplog.text
    s.handle(signal.SIGTERM)  # another kind: still the stop after the step
    with pytest.raises(TrainingStopped, match="^a second Ctrl-C stopped the run during step 5; "
                                              "no checkpoint was written yet$") as e:
        s.handle(signal.SIGINT)
    assert e.value.exit_code == 130
    with pytest.raises(TrainingStopped, match=r"^stopped by Ctrl-C at step 5; its checkpoint is "
                                              r"in run/checkpoints \(resume with") as e:
        s.check(Path("run/checkpoints"))
    assert e.value.exit_code == 130


def test_a_stop_another_rank_asked_for_reports_sigterm():
    state = {"step": 2}
    s = StopSignals(lambda: state["step"], lambda: None, any_rank=lambda mine: True)
    s.check(Path("x"))  # no vote yet: nothing happens
    assert s.vote() and not s.requested  # another rank got the signal
    with pytest.raises(TrainingStopped, match="^stopped by SIGTERM at step 2") as e:
        s.check(Path("x"))
    assert e.value.exit_code == 143


def test_a_signal_during_the_vote_is_kept_for_the_next_one():
    """The ranks' vote is a collective, where a rank waits for the others; a signal handled as
    it returns was lost when the vote's result overwrote the request (a two-process run told
    to stop at step 2 trained to the end). Catches that overwrite, and a rank that stops alone
    on a request the others did not vote on (it would leave them waiting in a collective)."""
    s, state = _signals()
    s.stepping, state["step"] = True, 2

    def vote_then_signal(mine: bool) -> bool:
        s.handle(signal.SIGTERM)  # arrives while this rank waits in the collective
        return mine  # every rank voted False

    s._any_rank = vote_then_signal
    assert not s.vote() and s.requested
    assert not s.stopping  # several processes: only what all agreed on stops them
    s.check(Path("x"))
    s._any_rank = lambda mine: mine
    assert s.vote() and s.stopping  # the next step's vote carries it
    one, state = _signals()  # one process: a signal after the vote stops after the checkpoint
    one.stepping = True
    assert not one.vote()
    one.handle(signal.SIGTERM)
    assert one.stopping


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_the_handlers_are_installed_for_the_run_and_restored_after(signum):
    """Catches handlers left installed after the run (a later Ctrl-C in the same process would
    raise TrainingStopped), a real signal that does not reach the protocol, and the protocol
    installed for SIGTERM only (a Ctrl-C during a step then raised KeyboardInterrupt mid-step,
    losing the step and its checkpoint, instead of asking for a stop after it)."""
    before = signal.getsignal(signum)
    s, _ = _signals()
    s.stepping = True
    with s:
        assert signal.getsignal(signum) == s.handle
        os.kill(os.getpid(), signum)
    assert s.requested and s.received == [signum]
    assert signal.getsignal(signum) == before


def test_non_finite_guard_counts_and_stops_after_too_many_in_a_row():
    """Catches a count that a finite step does not reset, and a stop after the wrong number."""
    g = NonFiniteGuard(max_in_a_row=2)
    nan, one = torch.tensor(float("nan")), torch.tensor(1.0)
    assert not g.finite(nan, one)
    g.skipped(1, nan, one, lambda: pytest.fail("read before the stop"))  # a warning only
    assert g.finite(one, one) and (g.total, g.in_a_row) == (1, 0)
    assert not g.finite(one, torch.tensor(float("inf")))
    g.skipped(2, one, one, lambda: pytest.fail("read before the stop"))
    assert not g.finite(nan, one)
    with pytest.raises(NonFiniteError, match=r"^2 optimizer steps in a row had a non-finite loss "
                                             r"or gradient \(max_nonfinite_steps=2\); stopping "
                                             r"at step 3. The last checkpoint is ckpts/step_2.$"):
        g.skipped(3, nan, one, lambda: Path("ckpts/step_2"))
    assert (g.total, g.in_a_row) == (3, 2)
    # none written yet (save_every=0, the first steps): not a directory that does not exist
    with pytest.raises(NonFiniteError, match=r"at step 4. No checkpoint was written before it.$"):
        g.skipped(4, nan, one, lambda: None)


def test_a_full_disk_is_a_checkpoint_error_naming_the_last_intact_one(tmp_path, monkeypatch):
    """Catches a full disk reported as a traceback, and another error (a bug) swallowed as a
    full disk."""
    full = OSError(errno.ENOSPC, "No space left on device")
    got = checkpoint_failure(full, 7, tmp_path, tmp_path / "step_5")
    assert isinstance(got, CheckpointFailed)
    assert str(got) == (f"could not write the checkpoint of step 7 in {tmp_path}: no space left "
                        f"on device; the last intact checkpoint is {tmp_path / 'step_5'}: free "
                        f"some space and resume with resume_from_checkpoint=True")
    first = checkpoint_failure(full, 1, tmp_path, None)
    assert str(first).endswith("no checkpoint was written before it: free some space and "
                               "start again")
    assert checkpoint_failure(RuntimeError("a bug"), 7, tmp_path, None) is None
    # torch.save's C++ error says nothing: a disk with less than 1 MiB left is taken as full
    import pepo.training.files as files

    monkeypatch.setattr(files.shutil, "disk_usage", lambda p: type("U", (), {"free": 10})())
    assert isinstance(checkpoint_failure(RuntimeError("stream"), 7, tmp_path, None),
                      CheckpointFailed)


def test_a_stop_is_not_taken_for_the_interrupted_codes_own_failure(monkeypatch):
    """A second Ctrl-C raised inside the verifier (MathVerify(workers=0) scores in-process) was
    caught by its ``except Exception`` as a failed check and scored 0: the stop was lost and
    the step went on. Catches TrainingStopped derived from Exception (RuntimeError, as it was)."""
    import sys
    import types

    from pepo.tasks.rewards import math_verify_score

    def parse(*a, **k):
        raise TrainingStopped("a second Ctrl-C stopped the run during step 3", exit_code=130)

    monkeypatch.setitem(sys.modules, "math_verify",
                        types.SimpleNamespace(parse=parse, verify=lambda *a, **k: True))
    with pytest.raises(TrainingStopped, match="a second Ctrl-C"):
        math_verify_score("the answer is 4", "4")
    assert not issubclass(TrainingStopped, Exception)


def test_a_full_quota_and_a_full_disk_named_in_another_errors_message_are_a_full_disk(
        tmp_path):
    """Catches EDQUOT (a full quota: the usual full disk on a cluster's
    shared file system) reported as a traceback, and a full disk that safetensors reports as
    its own error whose message names it (``No space left on device``) taken for a bug; the
    directory written to has room (``nearly_full`` says no), so only the error tells."""
    from pepo.training.files import nearly_full

    assert not nearly_full(tmp_path)
    quota = OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))
    assert isinstance(checkpoint_failure(quota, 3, tmp_path, None), CheckpointFailed)
    wrapped = RuntimeError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, '
                           f'message: "{os.strerror(errno.ENOSPC)}" }})')
    assert isinstance(checkpoint_failure(wrapped, 3, tmp_path, None), CheckpointFailed)
    quota_text = RuntimeError(f"write failed: {os.strerror(errno.EDQUOT)}")
    assert isinstance(checkpoint_failure(quota_text, 3, tmp_path, None), CheckpointFailed)
    assert checkpoint_failure(OSError(errno.EACCES, "Permission denied"), 3, tmp_path,
                              None) is None
