"""Verifiers that turn responses into rewards.

A reward function takes the decoded responses and the gold answers of one batch and returns one
float per response: ``fn(responses: list[str], answers: list[str]) -> list[float]``. The recipe
builds it from the config's ``reward`` component, so a custom verifier is one importable
callable.
"""

from __future__ import annotations

import ctypes
import logging
import math
import multiprocessing
import multiprocessing.connection
import numbers
import os
import re
import signal
import sys
import threading
import time
import weakref
from typing import Any, Optional, Sequence

from pepo import _extras

__all__ = ["BoxedMatch", "MathVerify", "boxed_match", "final_answer_text", "last_boxed",
           "math_verify_score"]


def last_boxed(text: str) -> Optional[str]:
    """Content of the last ``\\boxed{...}`` in ``text`` (braces balanced), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i = start + len("\\boxed{")
    depth = 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None


def boxed_match(responses: Sequence[str], answers: Sequence[str]) -> list[float]:
    """1.0 where the last boxed answer equals the gold answer (whitespace stripped), else 0.0.

    Exact string match suits the embedded task, whose answers are single digits; math answers
    need a symbolic verifier.
    """
    if len(responses) != len(answers):
        raise ValueError(f"{len(responses)} responses but {len(answers)} answers")
    out = []
    for r, a in zip(responses, answers):
        b = last_boxed(r)
        out.append(1.0 if b is not None and b.strip() == str(a).strip() else 0.0)
    return out


class BoxedMatch:
    """The config component for :func:`boxed_match`
    (``reward: {_component_: pepo.tasks.rewards.BoxedMatch}``)."""

    def __call__(self, responses: Sequence[str], answers: Sequence[str]) -> list[float]:
        return boxed_match(responses, answers)


def final_answer_text(response: str, think_end: str = "</think>", max_chars: int = 4000) -> str:
    """The part of a response that holds its answer.

    Text after the last ``think_end`` when there is one; nothing when its block (``<think>``
    for ``</think>``) was opened and never closed (a response truncated mid-thought has given
    no answer); otherwise, and always with ``think_end`` None or ``""``, the whole response.
    Only the last ``max_chars`` characters are kept: answers come at the end, and a huge LaTeX
    blob must not reach the parser whole. A Unicode minus (U+2212) reads as ``-``, and a number
    whose groups of three digits are set apart by a space (``10\\,080``) as one number. A chat
    template that opens the block in the prompt (Qwen3's Thinking-2507 models, the R1
    distills) leaves no ``<think>`` in the response, so a response truncated mid-thought is then
    read whole, and so is any truncated response without the block: math-verify may find a
    number in it (``pepo_eval`` reports the share of truncated responses).
    """
    if think_end and think_end in response:
        response = response.rsplit(think_end, 1)[1]
    elif think_end and think_end.startswith("</") and "<" + think_end[2:] in response:
        return ""
    return _digit_groups(response[-max_chars:].replace("\u2212", "-"))


# A space between groups of three digits (``10\,080``, SI's style; ``10\ 080``, ``10~080``, a
# thin or plain space) is part of the number, but math-verify reads it as arithmetic (``10\,080``
# is 90): it is dropped, gold and response alike. Only a whole number written so is joined: 1 to
# 3 digits not after a letter, digit, ``.``, ``^``, ``/`` or a digit's ``:`` (``2023 100``, ``x^2
# 100``, ``1/2 100`` and ``12:30 100`` stay apart), then groups of 3; after a decimal point,
# groups of 3 and a last of 1 to 3 not followed by another decimal point (``1.250 2.500`` is two
# numbers). The separators math-verify reads itself (``10,080``, ``10{,}080``, ``10,\!080``) are
# left to it.
_SPACE = r"(?:\\[,;: ]|~|[ \u2009\u202f\u00a0])"
_GROUPED = re.compile(rf"(?<![\w.^/])(?<!\d:)\d{{1,3}}(?:{_SPACE}\d{{3}})+(?!\d)"
                      rf"|(?<=\d\.)\d{{3}}(?:{_SPACE}\d{{3}})*{_SPACE}\d{{1,3}}(?!\d|\.\d)")
_SPACES = re.compile(_SPACE)


def _digit_groups(text: str) -> str:
    return _GROUPED.sub(lambda m: _SPACES.sub("", m.group()), text)


def _gold(answer: str, timeout: int) -> list:
    from math_verify import parse

    answer = _digit_groups(answer)
    text = answer if ("\\boxed" in answer or "$" in answer) else f"${answer}$"
    parsed = parse(text, parsing_timeout=timeout)
    return parsed if parsed else parse(f"\\boxed{{{answer}}}", parsing_timeout=timeout)


def _written_number(expr: Any) -> bool:
    """Whether math-verify's parse is a number as written (``x = 18`` counts by its right side),
    not an expression such as ``9 + 9`` that only evaluates to one."""
    if getattr(expr, "is_Relational", False) is True:
        expr = getattr(expr, "rhs", None)
    return getattr(expr, "is_Number", False) is True


def math_verify_score(
    response: str, answer: str, timeout: int = 5, think_end: str = "</think>",
    max_chars: int = 4000, number_only: bool = False,
) -> float:
    """1.0 when math-verify finds the response's final answer equal to ``answer`` (gold first).

    math-verify compares expressions by their value, so a response that ends on the question's
    own expression ("9 + 9 = ?") is scored correct for the answer 18. With ``number_only`` the
    final answer must be a number as written (an integer, a decimal, a ``\\frac`` of integers:
    sympy's ``is_Number``), which is what an arithmetic task asks for.

    Several ``\\boxed{}`` answers are read together as a set (math-verify's rule for problems
    with several answers): ``\\boxed{5}`` twice scores as 5, but an intermediate ``\\boxed{3}``
    before a final ``\\boxed{5}`` is ``{3, 5}`` and scores 0 against 5, where a last-box rule
    (verl's ``last_boxed_only_string``) would score 1.

    Runs math-verify's own SIGALRM timeouts, so call it from a main thread (the
    :class:`MathVerify` workers do). Any error, and a math-verify timeout, scores 0.
    """
    return _score(response, answer, timeout, think_end, max_chars, number_only)[0]


class _Timeouts(logging.Filter):
    """Counts math-verify's own timeouts, which it logs and answers as "no match" (a score of
    0 that reads as a wrong answer), and keeps their lines (with up to 4,000 characters of the
    response) off the console: :class:`MathVerify` reports the count. It is the loggers' first
    filter; on a logger the user silenced by its level it puts the level at WARNING for the
    call, so that a timeout is still counted, and lets nothing else through (``logging.disable``
    and a disabled logger make no record: their timeouts go uncounted)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.shown: dict[str, bool] = {}  # logger name -> whether its records reach handlers

    def filter(self, record: logging.LogRecord) -> bool:
        if str(record.msg).startswith("Timeout during"):
            self.count += 1
            return False
        return self.shown.get(record.name, True)


def _score(response: str, answer: str, timeout: int, think_end: str, max_chars: int,
           number_only: bool) -> tuple[float, bool, bool]:
    """The score; whether math-verify's timeout scored it 0; and whether the gold answer (where
    it was parsed) held no expression math-verify reads (``{12``: nearly every response to it
    scores 0)."""
    timeouts = _Timeouts()  # on math-verify's loggers for this call only
    loggers = [logging.getLogger(f"math_verify.{m}") for m in ("parser", "grader")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        timeouts.shown[logger.name] = logger.isEnabledFor(logging.WARNING)
        if not timeouts.shown[logger.name]:
            logger.setLevel(logging.WARNING)
        logger.filters.insert(0, timeouts)  # before a user's filter that might drop the record
    bad_gold = False
    try:
        from math_verify import parse, verify

        text = final_answer_text(response, think_end, max_chars)
        if not text.strip():
            return 0.0, False, False
        pred = parse(text, parsing_timeout=timeout)
        if not pred or (number_only and not _written_number(pred[0])):
            return 0.0, timeouts.count > 0, False
        gold = _gold(str(answer), timeout)
        bad_gold = all(isinstance(g, str) for g in gold) and not timeouts.count
        score = 1.0 if verify(gold, pred, timeout_seconds=timeout) else 0.0
    except Exception:  # a verifier failure is a wrong answer, never a crashed run
        score = 0.0
    finally:
        for logger, level in zip(loggers, levels):
            logger.removeFilter(timeouts)
            logger.setLevel(level)
    return score, score == 0.0 and timeouts.count > 0, bad_gold


# Parent-side pipe ends of every live worker of every MathVerify in this process. A forked
# worker closes its inherited copies of them: while any copy stays open, a worker whose parent
# died would wait in recv() forever instead of seeing EOF.
_PARENT_ENDS: "weakref.WeakSet[Any]" = weakref.WeakSet()
_PARENT_ENDS_LOCK = threading.Lock()  # MathVerify objects may spawn from several threads
_LIVENESS_S = 1.0  # how often an idle worker checks that its parent still exists
_MAX_TRIES = 2  # a job whose worker dies under it is re-run once, then scores 0
_log = logging.getLogger(__name__)
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _kill_on_parent_death() -> None:
    """Asks Linux to SIGKILL this process when the thread that forked it exits.

    SIGKILL rather than a catchable signal: a worker deep in C-level arithmetic runs no Python
    signal handler, and it is exactly the worker that would otherwise outlive the trainer.
    Elsewhere (or if prctl is unavailable) the EOF and ``getppid()`` checks of the worker loop
    remain.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _worker_main(conn: Any, parent_pid: int, inherited: list, die_with_parent: bool) -> None:
    """A worker's entry point: drops what it must not hold from its parent, then serves jobs."""
    for c in inherited:
        c.close()
    # Ctrl-C reaches the whole process group; the owner handles it and closes its workers. The
    # trainer's own SIGTERM handler (inherited through fork) must not run in a worker.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if die_with_parent:
        _kill_on_parent_death()
    if os.getppid() != parent_pid:  # the parent died before the death signal was armed
        return
    _worker_loop(conn, parent_pid)


def _worker_loop(conn: Any, parent_pid: int) -> None:
    while True:
        try:
            # A timed poll rather than a blocking recv: the parent's death is noticed even when
            # no EOF comes (a process the trainer forked later may hold the other pipe end).
            while not conn.poll(_LIVENESS_S):
                if os.getppid() != parent_pid:
                    return
            job = conn.recv()
        except (EOFError, OSError):  # the parent is gone
            return
        if job is None:
            return
        result = _score(*job)
        try:
            conn.send(result)
        except OSError:
            return


def _close_pool(pool: list, owner_pid: int) -> None:
    """Stops the workers in ``pool`` (asks, then kills after 2 s) and empties it.

    Does nothing in a process other than ``owner_pid``: a forked copy of the trainer that exits
    through atexit must not shut down the trainer's workers.
    """
    if os.getpid() != owner_pid:
        return
    for _, conn in pool:
        try:
            conn.send(None)
        except OSError:  # already dead
            pass
    deadline = time.monotonic() + 2.0
    for proc, conn in pool:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
        if proc.is_alive():  # busy with a long job
            proc.kill()
            proc.join(timeout=5)
        conn.close()
        with _PARENT_ENDS_LOCK:
            _PARENT_ENDS.discard(conn)
    pool.clear()


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


class MathVerify:
    """Math answers checked by ``math-verify``, in worker processes with a hard timeout.

    math-verify's timeouts use SIGALRM, which works only in a main thread and cannot interrupt
    long C-level arithmetic (``9^{9^{9^9}}`` as a Python int). Each response therefore goes to
    a persistent worker process, which runs math-verify in its main thread; a worker that has
    not answered ``2 * timeout + grace`` seconds after it got the response (parse and verify
    may each take ``timeout``) is killed and replaced, and that response scores 0. A worker
    that died on its own (OOM killer, a stray signal) is replaced too, and its response is
    re-run once on the new worker (scoring 0 if that one dies too). math-verify's own timeout
    (its SIGALRM, at ``timeout``) also scores 0: math-verify answers "no match" there, and the
    line it logs is kept off the console. A call that scored any response 0 unchecked (killed,
    died, or at math-verify's timeout) says so in one logged warning (a log line, not a Python
    warning: one made an error by ``-W error`` would crash the training step it reports on); a
    gold answer that holds nothing math-verify reads (``{12``: nearly every response to it scores
    0) is warned of the first time it is met. A pathological
    response costs at most that time and never stalls or crashes training. ``workers=0`` checks
    in the calling thread instead (no hard kill; for debugging).

    The workers die with their owner: on :meth:`close`, on leaving a ``with`` block, when the
    object is garbage-collected, at interpreter exit, and when the owning process is killed
    (SIGTERM or SIGKILL): idle workers see EOF or their parent's PID change within
    about a second, and on Linux a worker forked from the main thread is also SIGKILLed by the
    kernel the moment its parent dies, even in the middle of a job.

    Args:
        timeout: math-verify's parse and verify timeouts (seconds, int >= 1).
        workers: worker processes (int >= 0).
        grace: extra seconds (>= 0) before a worker is killed.
        think_end: the end-of-thinking marker; the answer is looked for after it (None or
            ``""``: the whole response).
        max_chars: only the last ``max_chars`` (>= 1) characters of the answer part are parsed.
        number_only: the final answer must be a number as written, not an expression equal to
            the gold answer (see :func:`math_verify_score`); for arithmetic tasks, where
            restating the question would otherwise be rewarded.

    Raises:
        ValueError: a parameter of the wrong type or out of range.

    Attributes:
        killed: workers killed for exceeding the time limit.
        died: workers found dead (between or during jobs) and replaced.
        timed_out: responses math-verify's own timeout scored 0 (it answers "no match").
    """

    def __init__(self, timeout: int = 5, workers: int = 2, grace: float = 1.0,
                 think_end: Optional[str] = "</think>", max_chars: int = 4000,
                 number_only: bool = False) -> None:
        # signal.alarm, behind math-verify's timeouts, takes whole seconds
        _check_int("timeout", timeout, 1)
        _check_int("workers", workers, 0)
        _check_int("max_chars", max_chars, 1)
        if (isinstance(grace, bool) or not isinstance(grace, numbers.Real)
                or not math.isfinite(grace) or grace < 0):
            raise ValueError(f"grace must be a finite number of seconds >= 0, got {grace!r}")
        if think_end is not None and not isinstance(think_end, str):
            raise ValueError(f"think_end must be a string or None, got {think_end!r}")
        if not isinstance(number_only, bool):
            raise ValueError(f"number_only must be true or false, got {number_only!r}")
        self.timeout, self.workers, self.grace = timeout, workers, float(grace)
        self.think_end, self.max_chars = think_end or "", max_chars
        self.number_only = number_only
        _extras.require("pepo.tasks.MathVerify", modules=("math_verify",))
        import math_verify  # noqa: F401  (imported once here, inherited by forked workers)

        # fork: a spawned worker would re-import the launching script (`tune run`'s __main__)
        # and torch with it. The workers never touch torch, so forking a process with torch
        # threads (or CUDA) is safe for them.
        methods = multiprocessing.get_all_start_methods()
        self._ctx = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
        self._pool: list[tuple[Any, Any]] = []
        self.killed = 0
        self.died = 0
        self.timed_out = 0
        self._bad_golds: set[str] = set()
        # Runs on close(), on garbage collection and at interpreter exit; it holds the pool
        # list, not self, so it does not keep the object alive.
        self._owner_pid = os.getpid()
        self._finalizer = weakref.finalize(self, _close_pool, self._pool, self._owner_pid)

    @property
    def pids(self) -> list[int]:
        """Process ids of the current workers (empty before the first call and after close)."""
        return [proc.pid for proc, _ in self._pool]

    def __enter__(self) -> "MathVerify":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _spawn(self) -> tuple[Any, Any]:
        parent, child = self._ctx.Pipe()
        forked = self._ctx.get_start_method() == "fork"
        # A spawned child inherits no pipe ends (and passing them would duplicate them into it).
        with _PARENT_ENDS_LOCK:
            inherited = [parent, *_PARENT_ENDS] if forked else []
        # PR_SET_PDEATHSIG fires when the forking *thread* exits: armed only for workers forked
        # by the main thread, which lives as long as the process.
        die_with_parent = threading.current_thread() is threading.main_thread()
        proc = self._ctx.Process(
            target=_worker_main, args=(child, os.getpid(), inherited, die_with_parent),
            daemon=True,
        )
        proc.start()
        child.close()
        with _PARENT_ENDS_LOCK:
            _PARENT_ENDS.add(parent)
        return proc, parent

    def _fill(self) -> None:
        """Starts missing workers and replaces those that died since the last call."""
        for slot, (proc, _) in enumerate(self._pool):
            if not proc.is_alive():
                self._replace(slot)
                self.died += 1
        while len(self._pool) < self.workers:
            self._pool.append(self._spawn())

    def __call__(self, responses: Sequence[str], answers: Sequence[str]) -> list[float]:
        if len(responses) != len(answers):
            raise ValueError(f"{len(responses)} responses but {len(answers)} answers")
        jobs = [(r, str(a), self.timeout, self.think_end, self.max_chars, self.number_only)
                for r, a in zip(responses, answers)]
        if self.workers == 0:
            if threading.current_thread() is not threading.main_thread():
                raise RuntimeError("MathVerify(workers=0) scores in this process with math-"
                                   "verify's SIGALRM timeouts, which work in the main thread "
                                   "only (elsewhere every score was 0): call it from the main "
                                   "thread, or use workers >= 1")
            return self._report([_score(*j) for j in jobs], jobs, 0, 0)
        self._fill()
        results: list[tuple[float, bool, bool]] = [(0.0, False, False)] * len(jobs)
        tries = [0] * len(jobs)
        todo = list(range(len(jobs)))[::-1]
        busy: dict[int, tuple[int, float]] = {}  # worker slot -> (job index, start time)
        limit = 2 * self.timeout + self.grace  # parse and verify may each take `timeout`
        lost_slow = lost_died = 0  # responses scored 0 unchecked: over the limit, died twice
        while todo or busy:
            for slot in range(len(self._pool)):
                if slot in busy or not todo:
                    continue
                i = todo.pop()
                tries[i] += 1
                try:
                    self._pool[slot][1].send(jobs[i])
                except OSError:  # died while idle (BrokenPipeError): replace, try it again
                    self._replace(slot)
                    self.died += 1
                    if tries[i] < _MAX_TRIES:
                        todo.append(i)
                    else:
                        lost_died += 1
                    continue
                busy[slot] = (i, time.monotonic())
            if not busy:
                continue
            conns = {self._pool[s][1]: s for s in busy}
            wait = max(0.0, min(start + limit for _, start in busy.values()) - time.monotonic())
            for conn in multiprocessing.connection.wait(list(conns), timeout=wait):
                slot = conns[conn]
                i = busy.pop(slot)[0]
                try:
                    results[i] = conn.recv()
                except (EOFError, OSError):  # the worker died under the job: re-run it once
                    self._replace(slot)
                    self.died += 1
                    if tries[i] < _MAX_TRIES:
                        todo.append(i)
                    else:
                        lost_died += 1
            now = time.monotonic()
            for slot, (i, start) in list(busy.items()):
                if now - start > limit:  # the job's own fault: no re-run, it stays at 0
                    self._replace(slot)
                    self.killed += 1
                    lost_slow += 1
                    del busy[slot]
        return self._report(results, jobs, lost_slow, lost_died)

    def _report(self, results: list[tuple[float, bool, bool]], jobs: list[tuple],
                lost_slow: int, lost_died: int) -> list[float]:
        """The scores; a warning for those scored 0 unchecked and for gold answers met for the
        first time that hold nothing math-verify reads (a silent 0 reads as a wrong answer)."""
        timed_out = sum(r[1] for r in results)
        self.timed_out += timed_out
        if lost_slow or lost_died or timed_out:
            limit = 2 * self.timeout + self.grace
            _log.warning(f"MathVerify: {lost_slow + lost_died + timed_out} of {len(jobs)} "
                         f"responses scored 0 unchecked ({timed_out} at math-verify's "
                         f"{self.timeout} s timeout, {lost_slow} over the {limit:g} s limit, "
                         f"{lost_died} whose worker died {_MAX_TRIES} times); {self.timed_out} "
                         f"timed out, {self.killed} killed, {self.died} died so far")
        bad = sorted({jobs[i][1] for i, r in enumerate(results) if r[2]} - self._bad_golds)
        if bad:
            self._bad_golds.update(bad)
            _log.warning(f"MathVerify: {len(bad)} gold answer(s) hold no expression math-verify "
                         f"reads, so nearly every response to them scores 0: "
                         f"{', '.join(repr(b) for b in bad[:3])}{', ...' if len(bad) > 3 else ''}"
                         f" ({len(self._bad_golds)} so far)")
        return [float(r[0]) for r in results]

    def _replace(self, slot: int) -> None:
        proc, conn = self._pool[slot]
        proc.kill()
        proc.join(timeout=5)
        conn.close()
        with _PARENT_ENDS_LOCK:
            _PARENT_ENDS.discard(conn)
        self._pool[slot] = self._spawn()

    def close(self) -> None:
        """Stops the worker processes. Safe to call more than once; a later call starts new
        workers."""
        _close_pool(self._pool, self._owner_pid)
