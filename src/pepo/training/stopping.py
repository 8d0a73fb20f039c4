"""How a training run stops early: stop signals, non-finite steps and a full disk.

* :class:`StopSignals` owns the SIGTERM / Ctrl-C (SIGINT) handlers while a run trains.
  SIGTERM is what ``timeout``, Slurm preemption and ``docker stop`` send. Before the first
  training step (the opening validation) a signal stops the run at once: nothing was trained
  and nothing is lost. From the first step on, the first signal asks for a stop after the
  current step and its checkpoint; a second of the same kind stops at once, naming the last
  checkpoint. Every stop is a :class:`TrainingStopped` whose ``exit_code`` is what a process
  killed by the signal reports (130 for SIGINT, 143 for SIGTERM).
* :class:`NonFiniteGuard` skips optimizer steps with a non-finite loss or gradient and raises
  :class:`NonFiniteError` after ``max_nonfinite_steps`` in a row.
* :func:`checkpoint_failure` turns a failed checkpoint write into :class:`CheckpointFailed`
  when the disk is full (naming the last intact checkpoint), and returns None for other errors.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import threading
from pathlib import Path
from typing import Any, Callable, Optional

from pepo.training.files import nearly_full

__all__ = [
    "CheckpointFailed",
    "NonFiniteError",
    "NonFiniteGuard",
    "StopSignals",
    "TrainingStopped",
    "checkpoint_failure",
    "out_of_space",
    "signal_name",
]


class TrainingStopped(BaseException):
    """Raised when SIGTERM or Ctrl-C (SIGINT) stopped the run: at a step boundary after its
    checkpoint, or at once on a second signal of the same kind. ``exit_code`` is what a process
    killed by that signal reports (143 for SIGTERM, 130 for SIGINT). Not an ``Exception``, as
    ``KeyboardInterrupt`` is not: raised from a signal handler anywhere, it must not be taken
    for that code's own failure (a verifier's error scored 0, a kernel's fallback)."""

    def __init__(self, message: str, exit_code: int = 143) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def signal_name(signum: Optional[int]) -> tuple[str, int]:
    """How a stop signal is named to the user, and the exit code a process killed by it reports
    (SIGTERM's for None: a stop another rank asked for)."""
    return ("Ctrl-C", 130) if signum == signal.SIGINT else ("SIGTERM", 143)


class StopSignals:
    """The stop-signal protocol of a training loop (see the module docstring).

    Args:
        step: the loop's current step (0 before the first).
        latest: the last checkpoint on disk, or None.
        log: where the first signal's warning goes.

    Use as a context manager around the loop (the handlers are installed from the main thread
    only, and the previous ones restored on exit); set :attr:`stepping` when the first training
    step starts; call :meth:`check` at each step boundary after any checkpoint.
    """

    def __init__(self, step: Callable[[], int], latest: Callable[[], Optional[Path]],
                 log: Optional[logging.Logger] = None,
                 any_rank: Optional[Callable[[bool], bool]] = None) -> None:
        self._step, self._latest, self._log = step, latest, log
        self._any_rank = any_rank  # None: one process
        self.requested = False  # a signal reached this process
        self.agreed = False  # the last vote: some rank was asked to stop
        self.received: list[int] = []  # in the order received
        self.stepping = False  # True from the first training step of this process on
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self.handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def handle(self, signum: int, frame: Any = None) -> None:
        """The signal handler."""
        name, code = signal_name(signum)
        step = self._step()
        if not self.stepping:
            # before the first step (the opening validation): nothing to finish or save, so stop
            # at once; every process of a torchrun job gets the terminal's Ctrl-C, and torchrun
            # stops the others when one exits
            self.received.append(signum)
            raise TrainingStopped(self._stopped_before_training(name, step), exit_code=code)
        if signum in self.received:
            latest = self._latest()
            where = (f"the last checkpoint is {latest} (resume with resume_from_checkpoint=True)"
                     if latest else "no checkpoint was written yet")
            raise TrainingStopped(f"a second {name} stopped the run during step {step}; "
                                  f"{where}", exit_code=code)
        self.received.append(signum)
        self.requested = True
        if self._log is not None:
            self._log.warning(f"{name}: stopping after step {step} and its checkpoint ({name} "
                              f"again stops at once)")

    def _stopped_before_training(self, name: str, step: int) -> str:
        if step == 0:
            return (f"stopped by {name} before the first training step: nothing was trained "
                    f"and no checkpoint was written")
        return (f"stopped by {name} before step {step + 1}: nothing more was trained and "
                f"no checkpoint was written; the last checkpoint is still {self._latest()}")

    def vote(self) -> bool:
        """Whether the run stops after this step: True on every rank when a signal reached
        some rank (``any_rank``, a collective, so that every rank stops together). A signal
        that arrives during the vote is not lost: it is this process's request until the next
        vote."""
        self.agreed = (self._any_rank(self.requested) if self._any_rank is not None
                       else self.requested)
        return self.agreed

    @property
    def stopping(self) -> bool:
        """Whether :meth:`check` raises: the ranks agreed to stop (one process: also a signal
        that came after the vote, during the step's checkpoint)."""
        return self.agreed or (self._any_rank is None and self.requested)

    def check(self, where: Path) -> None:
        """Raises :class:`TrainingStopped` when the run stops (:attr:`stopping`; call it after
        the step's checkpoint, in ``where``), named after the first signal this process got
        (on a rank that got none, another rank's: SIGTERM's exit code)."""
        if not self.stopping:
            return
        name, code = signal_name(self.received[0] if self.received else None)
        raise TrainingStopped(
            f"stopped by {name} at step {self._step()}; its checkpoint is in {where} (resume "
            f"with resume_from_checkpoint=True)", exit_code=code)


class NonFiniteError(RuntimeError):
    """Raised after ``max_nonfinite_steps`` consecutive optimizer steps with a non-finite loss
    or gradient."""


class NonFiniteGuard:
    """Counts optimizer steps skipped for a non-finite loss or gradient norm: ``total`` over
    the run and ``in_a_row`` (both checkpointed)."""

    def __init__(self, max_in_a_row: int, log: Optional[logging.Logger] = None) -> None:
        self.max_in_a_row, self.log = max_in_a_row, log
        self.total = 0
        self.in_a_row = 0

    def finite(self, loss: Any, grad_norm: Any) -> bool:
        """Whether the optimizer may step (one host sync); otherwise counts the skip."""
        import torch

        if bool(torch.isfinite(loss) & torch.isfinite(grad_norm)):
            self.in_a_row = 0
            return True
        self.total += 1
        self.in_a_row += 1
        return False

    def skipped(self, step: int, loss: Any, grad_norm: Any,
                last: Callable[[], Optional[Path]]) -> None:
        """Warns about a skipped step; raises :class:`NonFiniteError` after too many in a row,
        naming ``last()`` (the last checkpoint written, asked for then only) or saying there is
        none."""
        if self.log is not None:
            self.log.warning(
                f"step {step}: non-finite loss ({float(loss)}) or gradient norm "
                f"({float(grad_norm)}); optimizer step skipped ({self.in_a_row} in a row)"
            )
        if self.in_a_row >= self.max_in_a_row:
            at = last()
            raise NonFiniteError(
                f"{self.in_a_row} optimizer steps in a row had a non-finite loss or "
                f"gradient (max_nonfinite_steps={self.max_in_a_row}); stopping at step "
                f"{step}. " + (f"The last checkpoint is {at}." if at is not None else
                               "No checkpoint was written before it.")
            )


class CheckpointFailed(RuntimeError):
    """A checkpoint could not be written (a full disk); the message names the last intact one."""


def out_of_space(error: BaseException, where: Path) -> bool:
    """Whether a failed write was the disk filling up: ENOSPC/EDQUOT (an OSError's, or named
    in another error's message, as safetensors' own error does), or (torch.save's C++ stream
    errors say nothing about why) less than 1 MiB left where it was writing."""
    full = (errno.ENOSPC, errno.EDQUOT)
    if isinstance(error, OSError) and error.errno in full:
        return True
    if any(os.strerror(code) in str(error) for code in full):
        return True
    return nearly_full(where)


def checkpoint_failure(error: BaseException, step: int, root: Path,
                       latest: Optional[Path]) -> Optional[CheckpointFailed]:
    """The :class:`CheckpointFailed` to raise for ``error`` (writing step ``step``'s checkpoint
    in ``root``) when the disk is full, naming ``latest``, the last intact checkpoint; None for
    any other error (a bug keeps its traceback)."""
    if not out_of_space(error, root):
        return None
    return CheckpointFailed(
        f"could not write the checkpoint of step {step} in {root}: no space left on device; "
        + (f"the last intact checkpoint is {latest}: free some space and resume with "
           f"resume_from_checkpoint=True" if latest else
           "no checkpoint was written before it: free some space and start again")
    )

