"""Verifiers that turn responses into rewards.

A reward function takes the decoded responses and the gold answers of one batch and returns one
float per response: ``fn(responses: list[str], answers: list[str]) -> list[float]``. The recipe
builds it from the config's ``reward`` component, so a custom verifier is one importable
callable.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import time
from typing import Any, Optional, Sequence

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
    """The config component for :func:`boxed_match` (``reward: {_component_: pepo.rewards.BoxedMatch}``)."""

    def __call__(self, responses: Sequence[str], answers: Sequence[str]) -> list[float]:
        return boxed_match(responses, answers)


def final_answer_text(response: str, think_end: str = "</think>", max_chars: int = 4000) -> str:
    """The part of a response that holds its answer.

    Text after the last ``think_end`` when there is one; nothing when a ``<think>`` block was
    opened and never closed (a response truncated mid-thought has given no answer); otherwise the
    whole response. Only the last ``max_chars`` characters are kept: answers come at the end,
    and a huge LaTeX blob must not reach the parser whole.
    """
    if think_end and think_end in response:
        response = response.rsplit(think_end, 1)[1]
    elif "<think>" in response:
        return ""
    return response[-max_chars:]


def _gold(answer: str, timeout: int) -> list:
    from math_verify import parse

    text = answer if ("\\boxed" in answer or "$" in answer) else f"${answer}$"
    parsed = parse(text, parsing_timeout=timeout)
    return parsed if parsed else parse(f"\\boxed{{{answer}}}", parsing_timeout=timeout)


def math_verify_score(
    response: str, answer: str, timeout: int = 5, think_end: str = "</think>",
    max_chars: int = 4000,
) -> float:
    """1.0 when math-verify finds the response's final answer equal to ``answer`` (gold first).

    Runs math-verify's own SIGALRM timeouts, so call it from a main thread (the
    :class:`MathVerify` workers do). Any error scores 0.
    """
    try:
        from math_verify import parse, verify

        text = final_answer_text(response, think_end, max_chars)
        if not text.strip():
            return 0.0
        pred = parse(text, parsing_timeout=timeout)
        if not pred:
            return 0.0
        return 1.0 if verify(_gold(str(answer), timeout), pred, timeout_seconds=timeout) else 0.0
    except Exception:  # a verifier failure is a wrong answer, never a crashed run
        return 0.0


def _worker_loop(conn: Any) -> None:
    while True:
        job = conn.recv()
        if job is None:
            return
        conn.send(math_verify_score(*job))


class MathVerify:
    """Math answers checked by ``math-verify``, in worker processes with a hard timeout.

    math-verify's timeouts use SIGALRM, which works only in a main thread and cannot interrupt
    long C-level arithmetic (``9^{9^{9^9}}`` as a Python int). Each response therefore goes to
    a persistent worker process, which runs math-verify in its main thread; a worker that has
    not answered ``timeout + grace`` seconds after it got the response is killed and replaced,
    and that response scores 0. A pathological response costs at most that time and never
    stalls or crashes training. ``workers=0`` checks in the calling thread instead (no hard
    kill; for debugging).

    Args:
        timeout: math-verify's parse and verify timeouts (seconds, int).
        workers: worker processes.
        grace: extra seconds before a worker is killed.
        think_end: the end-of-thinking marker; the answer is looked for after it.
        max_chars: only the last ``max_chars`` characters of the answer part are parsed.
    """

    def __init__(self, timeout: int = 5, workers: int = 2, grace: float = 1.0,
                 think_end: str = "</think>", max_chars: int = 4000) -> None:
        if not isinstance(timeout, int) or timeout < 1:
            raise ValueError(f"timeout must be an int >= 1 (seconds), got {timeout!r}")
        if not isinstance(workers, int) or workers < 0:
            raise ValueError(f"workers must be an int >= 0, got {workers!r}")
        self.timeout, self.workers, self.grace = timeout, workers, grace
        self.think_end, self.max_chars = think_end, max_chars
        import math_verify  # noqa: F401  (imported once here, inherited by forked workers)

        # fork: a spawned worker would re-import the launching script (`tune run`'s __main__)
        # and torch with it. The workers never touch torch, so forking a process with torch
        # threads (or CUDA) is safe for them.
        methods = multiprocessing.get_all_start_methods()
        self._ctx = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
        self._pool: list[tuple[Any, Any]] = []
        self.killed = 0

    def _spawn(self) -> tuple[Any, Any]:
        parent, child = self._ctx.Pipe()
        proc = self._ctx.Process(target=_worker_loop, args=(child,), daemon=True)
        proc.start()
        child.close()
        return proc, parent

    def __call__(self, responses: Sequence[str], answers: Sequence[str]) -> list[float]:
        if len(responses) != len(answers):
            raise ValueError(f"{len(responses)} responses but {len(answers)} answers")
        jobs = [(r, str(a), self.timeout, self.think_end, self.max_chars)
                for r, a in zip(responses, answers)]
        if self.workers == 0:
            return [math_verify_score(*j) for j in jobs]
        while len(self._pool) < self.workers:
            self._pool.append(self._spawn())
        scores = [0.0] * len(jobs)
        todo = list(range(len(jobs)))[::-1]
        busy: dict[int, tuple[int, float]] = {}  # worker slot -> (job index, start time)
        limit = 2 * self.timeout + self.grace  # parse and verify may each take `timeout`
        while todo or busy:
            for slot in range(len(self._pool)):
                if slot not in busy and todo:
                    i = todo.pop()
                    self._pool[slot][1].send(jobs[i])
                    busy[slot] = (i, time.monotonic())
            conns = {self._pool[s][1]: s for s in busy}
            wait = max(0.0, min(start + limit for _, start in busy.values()) - time.monotonic())
            for conn in multiprocessing.connection.wait(list(conns), timeout=wait):
                slot = conns[conn]
                try:
                    scores[busy[slot][0]] = float(conn.recv())
                except (EOFError, OSError):  # the worker died: score 0, replace it
                    self._replace(slot)
                del busy[slot]
            now = time.monotonic()
            for slot, (i, start) in list(busy.items()):
                if now - start > limit:
                    self._replace(slot)
                    del busy[slot]  # scores[i] stays 0
        return scores

    def _replace(self, slot: int) -> None:
        proc, conn = self._pool[slot]
        proc.kill()
        proc.join(timeout=5)
        conn.close()
        self.killed += 1
        self._pool[slot] = self._spawn()

    def close(self) -> None:
        """Stops the worker processes."""
        for proc, conn in self._pool:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
            proc.join(timeout=2)
            if proc.is_alive():
                proc.kill()
            conn.close()
        self._pool = []

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
