"""math-verify rewards on realistic responses; pathological ones cost at most the timeout."""

from __future__ import annotations

import gc
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

import pepo.tasks.rewards as R
from tests.proc_helpers import dead as _dead

QWEN3 = ("<think>\nOkay, so I need to find x. If 2x = 1 then x = 1/2... wait, let me double-check."
         "\n</think>\n\nWe solve $2x = 1$, so $x = \\frac{1}{2}$.\n\n**Final Answer**\n"
         "\\[\n\\boxed{\\dfrac{1}{2}}\n\\]")

CASES = [
    (QWEN3, "\\frac{1}{2}", 1.0),                  # DeepMath final_answer layout
    (QWEN3, "0.5", 1.0),                           # numerically equal
    (QWEN3, "1/3", 0.0),
    ("<think>\nthe answer might be \\boxed{7}", "7", 0.0),  # thinking never closed: no answer
    ("<think>I guess \\boxed{3}</think> The answer is \\boxed{4}.", "4", 1.0),  # after </think>
    ("<think>so x = 7? \\boxed{7}</think> The answer is 4.", "7", 0.0),  # not the thinking's
    ("The polar coordinates are $\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}$.",
     "\\left( 3, \\frac{\\pi}{2} \\right)", 1.0),  # MATH500 layout
    ("Therefore the remainder is \\boxed{34}.", "34", 1.0),  # DAPO ground_truth layout
    ("I give up.", "34", 0.0),
    ("", "34", 0.0),
]


@pytest.mark.parametrize("response, gold, expected", CASES)
def test_scores_in_main_thread(response, gold, expected):
    assert R.math_verify_score(response, gold, timeout=5) == expected


def test_pool_matches_main_thread():
    mv = R.MathVerify(timeout=5, workers=2)
    try:
        got = mv([c[0] for c in CASES], [c[1] for c in CASES])
    finally:
        mv.close()
    assert got == [c[2] for c in CASES]


PATHOLOGICAL = [
    "\\boxed{9^{9^{9^{9^{9^{9}}}}}}",
    "\\boxed{" + "\\frac{1}{" * 5000 + "2" + "}" * 5000 + "}",
    "\\boxed{" + "x+" * 200_000 + "1}",
]


def test_pathological_answers_cost_at_most_the_timeout():
    mv = R.MathVerify(timeout=1, workers=2, grace=0.5)
    try:
        mv(["\\boxed{1}"], ["1"])  # workers started
        t0 = time.monotonic()
        got = mv(PATHOLOGICAL + [QWEN3], ["1"] * len(PATHOLOGICAL) + ["1/2"])
        elapsed = time.monotonic() - t0
    finally:
        mv.close()
    assert got == [0.0] * len(PATHOLOGICAL) + [1.0]
    # 2 workers, 4 jobs: at most two rounds of the hard limit (2 x timeout + grace) each, 5 s;
    # 3x headroom for a loaded machine still fails an unbounded parse (minutes)
    assert elapsed < 3 * 2 * (2 * 1 + 0.5), elapsed


def _unchecked(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("MathVerify: ")]


def test_a_stuck_worker_is_killed_and_replaced(monkeypatch, caplog):
    real = R._score

    def sometimes_hangs(response, *args):
        if response == "HANG":
            time.sleep(60)  # like C-level arithmetic that SIGALRM cannot interrupt
        return real(response, *args)

    monkeypatch.setattr(R, "_score", sometimes_hangs)  # forked workers inherit it
    mv = R.MathVerify(timeout=1, workers=1, grace=0.5)
    try:
        t0 = time.monotonic()
        got = mv(["HANG", "\\boxed{2}"], ["2", "2"])
        elapsed = time.monotonic() - t0
        # catches the 0 given in silence, where it reads as a wrong answer
        assert _unchecked(caplog) == ["MathVerify: 1 of 2 responses scored 0 unchecked (0 at "
                                      "math-verify's 1 s timeout, 1 over the 2.5 s limit, 0 whose "
                                      "worker died 2 times); 0 timed out, 1 killed, 0 died so far"]
        assert got == [0.0, 1.0] and mv.killed == 1
        # the limit (2.5 s) plus a worker restart (< 1 s), with 3x headroom; the hang is 60 s
        assert elapsed < 3 * (2 * 1 + 0.5 + 1.0), elapsed
    finally:
        mv.close()


def _bounded(fn, seconds: float = 60.0):
    """``fn()`` in a daemon thread; fails the test instead of hanging when it never returns,
    and re-raises what it raised."""
    out: list = []
    errors: list = []

    def run():
        try:
            out.append(fn())
        except BaseException as e:  # handed to the test's thread
            errors.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    if errors:
        raise errors[0]
    assert out, f"the call did not return within {seconds} s"
    return out[0]


needs_proc = pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads /proc")


@needs_proc
def test_a_worker_killed_while_idle_is_replaced_and_its_job_scored(caplog):
    """Catches sending to the dead worker (BrokenPipeError crashes training), scoring its job 0
    instead of re-running it, or leaving the pool one worker short."""
    with R.MathVerify(timeout=5, workers=2) as mv:
        assert mv(["\\boxed{1}", "\\boxed{2}"], ["1", "2"]) == [1.0, 1.0]
        victim = mv.pids[0]
        os.kill(victim, signal.SIGKILL)  # like the OOM killer, between two training steps
        assert _dead(victim)
        got = _bounded(lambda: mv([c[0] for c in CASES], [c[1] for c in CASES]))
        assert _unchecked(caplog) == []  # its job was re-run and checked: nothing to report
        assert got == [c[2] for c in CASES]
        assert len(mv.pids) == 2 and victim not in mv.pids and mv.died == 1 and mv.killed == 0
        assert all(proc.is_alive() for proc, _ in mv._pool)


def test_a_worker_that_dies_under_a_job_is_replaced_and_the_job_rerun(monkeypatch, tmp_path,
                                                                     caplog):
    """Catches scoring 0 a job whose worker died under it (it must be re-run on the new
    worker), and re-running forever a job that kills every worker it reaches (it must score 0
    after two tries, without hanging)."""
    real = R._score
    once = tmp_path / "died-once"

    def dies(response, *args):
        if "DIE_ONCE" in response and not once.exists():
            once.touch()  # the file tells the re-run (in another process) not to die again
            os.kill(os.getpid(), signal.SIGKILL)
        if "DIE_ALWAYS" in response:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(response, *args)

    monkeypatch.setattr(R, "_score", dies)  # forked workers inherit it
    with R.MathVerify(timeout=5, workers=2) as mv:
        got = _bounded(lambda: mv(["DIE_ONCE \\boxed{5}", "\\boxed{6}",
                                   "DIE_ALWAYS \\boxed{7}"], ["5", "6", "7"]))
        assert _unchecked(caplog) == ["MathVerify: 1 of 3 responses scored 0 unchecked (0 at "
                                      "math-verify's 5 s timeout, 0 over the 11 s limit, 1 whose "
                                      "worker died 2 times); 0 timed out, 0 killed, 3 died so far"]
        assert got == [1.0, 1.0, 0.0]
        assert mv.died == 3 and len(mv.pids) == 2  # DIE_ONCE once, DIE_ALWAYS twice


@needs_proc
def test_close_is_idempotent_and_the_workers_end_with_their_owner():
    """Catches a second close() failing on closed pipes, a ``with`` block that leaves workers
    running, and an unreferenced MathVerify whose workers outlive it (no finalizer)."""
    with R.MathVerify(timeout=5, workers=2) as mv:
        mv(["\\boxed{1}"], ["1"])
        pids = mv.pids
    assert mv.pids == [] and all(_dead(p) for p in pids)
    mv.close()  # again: no error
    assert mv(["\\boxed{1}"], ["1"]) == [1.0]  # usable again: fresh workers
    pids = mv.pids
    mv.close()
    mv.close()
    assert all(_dead(p) for p in pids)

    mv = R.MathVerify(timeout=5, workers=1)
    mv(["\\boxed{1}"], ["1"])
    pids = mv.pids
    del mv
    gc.collect()
    assert all(_dead(p) for p in pids)


@pytest.mark.parametrize("kwargs, message", [
    ({"timeout": 0.5}, "timeout must be an int >= 1, got 0.5"),
    ({"timeout": 0}, "timeout must be an int >= 1, got 0"),
    ({"timeout": True}, "timeout must be an int >= 1, got True"),
    ({"workers": -1}, "workers must be an int >= 0, got -1"),
    ({"workers": 1.5}, "workers must be an int >= 0, got 1.5"),
    ({"grace": -0.5}, "grace must be a finite number of seconds >= 0, got -0.5"),
    ({"grace": float("nan")}, "grace must be a finite number of seconds >= 0, got nan"),
    ({"grace": "1"}, "grace must be a finite number of seconds >= 0, got '1'"),
    ({"max_chars": 0}, "max_chars must be an int >= 1, got 0"),
    ({"think_end": 3}, "think_end must be a string or None, got 3"),
    ({"number_only": "yes"}, "number_only must be true or false, got 'yes'"),
])
def test_bad_constructor_arguments(kwargs, message):
    """Catches the unchecked ``grace < 0`` that made every response time out and score 0, and
    the like for each other parameter."""
    with pytest.raises(ValueError, match=re.escape(message)):
        R.MathVerify(**kwargs)


def test_grace_zero_and_no_think_end_still_score():
    """Catches ``grace=0`` or ``think_end=None`` being accepted but mis-handled (every score 0)."""
    with R.MathVerify(timeout=5, workers=1, grace=0, think_end=None) as mv:
        assert mv(["\\boxed{4}", "\\boxed{3}"], ["4", "4"]) == [1.0, 0.0]


def test_think_end_and_max_chars_reach_the_scorer():
    """Another ``think_end`` and a small ``max_chars``, through a worker: catches the worker
    given the defaults instead of the verifier's settings, and the first ``max_chars``
    characters kept instead of the last (answers come at the end)."""
    responses = [
        "The answer: \\boxed{3} </reasoning> hmm, I was still thinking",  # no answer after it
        "\\boxed{9} " + "y" * 300,  # its box is not within the last 200 characters
        "x" * 5000 + " so \\boxed{7}",  # its box is
        "<reasoning>\\boxed{1}</reasoning> \\boxed{2}",
    ]
    with R.MathVerify(timeout=5, workers=1, think_end="</reasoning>", max_chars=200) as mv:
        assert mv(responses, ["3", "9", "7", "2"]) == [0.0, 0.0, 1.0, 1.0]
    assert R.final_answer_text("ab" * 10, max_chars=3) == "bab"


def test_the_think_block_rule_follows_think_end():
    """``think_end=None`` reads the whole response, also where it mentions ``<think>`` (it read
    nothing: score 0); another marker's own unclosed block gives no answer, a ``<think>`` in its
    text does not; a Unicode minus is a minus. Catches the ``<think>`` check hard-coded and the
    U+2212 left to the parser (which finds no number)."""
    text = "<think>..</think>\nThe answer is \\boxed{5}."
    assert R.final_answer_text("Mention <think> here, \\boxed{5}", think_end=None).endswith("{5}")
    assert R.final_answer_text("<reasoning> cut off", think_end="</reasoning>") == ""
    assert R.final_answer_text("tags <think> aside, \\boxed{5}", think_end="</reasoning>") != ""
    assert R.final_answer_text("<think> cut off") == ""  # the default marker's block
    assert R.final_answer_text("so x = \u22125") == "so x = -5"
    mv = R.MathVerify(workers=0, think_end=None)
    assert mv([text, "result: \u22125"], ["5", "-5"]) == [1.0, 1.0]


def test_workers_0_off_the_main_thread_is_an_error_not_zeros():
    """math-verify's SIGALRM timeout raises outside the main thread, and the score swallowed it:
    every response scored 0. Catches that silent 0."""
    seen = []

    def score():
        try:
            seen.append(R.MathVerify(workers=0)(["\\boxed{12}"], ["12"]))
        except RuntimeError as e:
            seen.append(str(e))

    t = threading.Thread(target=score)
    t.start()
    t.join()
    assert "main thread only" in seen[0]
    assert R.MathVerify(workers=0)(["\\boxed{12}"], ["12"]) == [1.0]


def test_bad_arguments():
    with pytest.raises(ValueError, match="2 responses but 1 answers"):
        R.MathVerify(workers=0)(["a", "b"], ["a"])


# An arithmetic task's responses: (response, gold, score by value, score with number_only)
ARITHMETIC = [
    ("9 + 9 = ?", "18", 1.0, 0.0),          # the question restated: equal by value only
    ("The answer is 9 + 9.", "18", 1.0, 0.0),
    ("\\boxed{9+9}", "18", 1.0, 0.0),
    ("9 + 9 = 18", "18", 1.0, 1.0),         # math-verify reads the last side
    ("To add 9 and 9, count on: the answer is 18.", "18", 1.0, 1.0),
    ("17 - 9 = 8.", "8", 1.0, 1.0),
    ("3 - 5 = -2", "-2", 1.0, 1.0),         # a negative number is a number
    ("9 - 9 = 0", "0", 1.0, 1.0),           # so is zero (sympy's Zero)
    ("The answer is 18.0", "18", 1.0, 1.0),  # a decimal
    ("$x = \\frac{3}{4}$", "0.75", 1.0, 1.0),  # a fraction of integers, as an equation
    ("$x = 9 + 9$", "18", 1.0, 0.0),        # an equation whose right side is the question
    ("9 + 9 = 17", "18", 0.0, 0.0),         # wrong stays wrong
    ("19 = 9", "18", 0.0, 0.0),
]


@pytest.mark.parametrize("response, gold, by_value, number", ARITHMETIC)
def test_number_only_refuses_an_expression_equal_to_the_answer(response, gold, by_value, number):
    """The reward hack a policy found on ``smollm2_steps``: ending on the question's expression.
    Catches ``number_only`` ignored (the restated question scores 1), and a check that refuses
    numbers too (negative numbers, zero, decimals, fractions score 0)."""
    assert R.math_verify_score(response, gold, timeout=5) == by_value
    assert R.math_verify_score(response, gold, timeout=5, number_only=True) == number


def test_number_only_reaches_the_workers():
    """Catches the flag kept on the object but not sent with the job (the workers score by
    value)."""
    cases = ARITHMETIC[:4]
    with R.MathVerify(timeout=5, workers=1, number_only=True) as mv:
        assert mv([c[0] for c in cases], [c[1] for c in cases]) == [c[3] for c in cases]


def _audit_script():
    """``scripts/audit_number_answers.py`` as a module (scripts/ is not a package)."""
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "scripts" / "audit_number_answers.py"
    spec = importlib.util.spec_from_file_location("audit_number_answers", script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_audit_script_counts_rewards_given_by_value_only(tmp_path, capsys):
    """``scripts/audit_number_answers.py`` over a run's dumps (one plain, one gzipped step).
    Catches counting the unrewarded rollouts, counting a correct number as by value, and a step
    read from the wrong file."""
    import gzip
    import json

    mod = _audit_script()
    run = tmp_path / "gtpo" / "seed_1"
    (run / "rollouts").mkdir(parents=True)
    step1 = [("9 + 9 = ?", "18", 1.0), ("9 + 9 = 18", "18", 1.0), ("9 + 9 = ?", "18", 0.0)]
    step2 = [("17 - 9 = ?", "8", 1.0), ("The answer is 9 + 9.", "18", 1.0), ("19", "18", 0.0)]
    lines = [json.dumps({"step": 1, "response": r, "answer": a, "reward": w}) for r, a, w in step1]
    (run / "rollouts" / "step_000001.jsonl").write_text("\n".join(lines) + "\n")
    with gzip.open(run / "rollouts" / "step_000002.jsonl.gz", "wt", encoding="utf-8") as f:
        f.writelines(json.dumps({"step": 2, "response": r, "answer": a, "reward": w}) + "\n"
                     for r, a, w in step2)
    assert mod.audit(run) == [(1, 3, 2, 1), (2, 3, 2, 2)]
    # a step kept plain and compressed, and a killed write's leftover: each step counted once
    # (the copy was counted twice, the leftover a JSONDecodeError)
    with gzip.open(run / "rollouts" / "step_000001.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    (run / "rollouts" / "step_000003.jsonl.tmp").write_text('{"step": 3, "respo')
    assert mod.audit(run) == [(1, 3, 2, 1), (2, 3, 2, 2)]
    mod.main([str(run)])
    row = capsys.readouterr().out.splitlines()[-1]
    assert row.startswith("| gtpo/seed_1 | step 1: 1 of 2 rewarded |") and "3 of 4 (75 %)" in row
    with pytest.raises(SystemExit, match="no run given has a rollouts/ directory"):
        mod.main([str(tmp_path)])
    # a run without dumps among others (a restored study's) is left out, not the end of it
    (tmp_path / "80_20" / "seed_0").mkdir(parents=True)
    mod.main([str(tmp_path / "80_20" / "seed_0"), str(run)])
    out = capsys.readouterr()
    assert "80_20/seed_0: no rollouts/ directory; left out" in out.err
    assert out.out.splitlines()[-1] == row


def test_the_audit_script_compares_the_last_stated_result_with_the_reward(tmp_path, capsys):
    """The columns for math-verify's last-number reading. Catches reading the first ``= n``
    instead of the last, taking ``= 3 + 4`` as the stated result 3, and swapping the rewarded
    and unrewarded counts; a response with no ``= n`` counts in neither."""
    import json

    mod = _audit_script()
    assert mod.last_stated_result("2 + 5 = 8, no: 2 + 5 = 7.") == 7.0
    assert mod.last_stated_result("x = 7 and then y = 3 + 4") == 7.0
    assert mod.last_stated_result("x = 34 + 1") is None
    assert mod.last_stated_result("7 - 9 = -2") == -2.0
    assert mod.last_stated_result("the answer is 7") is None
    rows = [
        ("0 + 8 = 9. Adding 0 to 8 is easy.", "8", 1.0),  # rewarded, stated another result
        ("0 + 8 = 8", "8", 1.0),
        ("It is 8", "8", 1.0),  # no stated result
        ("13 + 16 = 29. This adds 13 and 16.", "29", 0.0),  # unrewarded, stated the answer
        ("13 + 16 = 28", "29", 0.0),
        ("13 = 13 and then 13 + 16 = 29 + 0 is 30", "29", 0.0),  # last result: 13
    ]
    run = tmp_path / "grpo" / "seed_0"
    (run / "rollouts").mkdir(parents=True)
    (run / "rollouts" / "step_000001.jsonl").write_text("".join(
        json.dumps({"step": 1, "response": r, "answer": a, "reward": w}) + "\n"
        for r, a, w in rows), encoding="utf-8")
    assert mod.stated(run) == (3, 1, 3, 1)
    mod.main([str(run)])
    row = capsys.readouterr().out.splitlines()[-1]
    assert row.endswith("| 1 of 3 (33 %) | 1 of 3 (33 %) |"), row
    # --validation reads val_rollouts/ (validation.dump), and only it
    val = tmp_path / "pepo" / "seed_0"
    (val / "val_rollouts").mkdir(parents=True)
    (run / "rollouts" / "step_000001.jsonl").rename(val / "val_rollouts" / "step_000001.jsonl")
    mod.main(["--validation", str(val)])
    assert capsys.readouterr().out.splitlines()[-1].endswith("| 1 of 3 (33 %) | 1 of 3 (33 %) |")
    with pytest.raises(SystemExit, match="has a rollouts/ directory"):
        mod.main([str(val)])
    with pytest.raises(SystemExit, match="has a val_rollouts/ directory"):
        mod.main(["--validation", str(run)])


def test_several_boxed_answers_are_read_as_a_set_as_documented():
    """Pins what math_verify_score's docstring says of several boxes (math-verify reads them as
    one set): a repeated final box scores, an intermediate box before the final one does not.
    Catches the docstring going stale when math-verify or the extraction changes."""
    assert R.math_verify_score("so \\boxed{5}.\nCheck: \\boxed{5}", "5") == 1.0
    assert R.math_verify_score("first \\boxed{3}\nfinal \\boxed{5}", "5") == 0.0
    assert R.math_verify_score("first \\boxed{3}\nfinal \\boxed{5}", "3, 5") == 1.0


@pytest.mark.parametrize("response, gold, expected", [
    ("\\boxed{10\\,080}", "10080", 1.0),  # SI's thin space: math-verify alone reads 10 + 80
    ("\\boxed{10080}", "10\\,080", 1.0),  # the same in the gold answer
    ("\\boxed{0}", "1\\,000", 0.0),  # math-verify alone reads that gold as 1 * 0 and gives 1
    ("\\boxed{1\\,000\\,000}", "1000000", 1.0),  # every group
    ("\\boxed{10\\ 080}", "10080", 1.0),
    ("\\boxed{10~080}", "10080", 1.0),
    ("The answer is 10 080.", "10080", 1.0),
    ("\\boxed{3.141\\,592}", "3.141592", 1.0),
    ("\\boxed{12\\,34}", "1234", 0.0),  # not a group of three: left to math-verify
    ("\\boxed{10,\\!080}", "10080", 1.0),  # math-verify's own separators stay its own
    ("\\boxed{x^2 100}", "x^{2100}", 0.0),  # an exponent's digit is no number's first group
    ("\\boxed{a_1 234}", "a_{1234}", 0.0),  # nor a subscript's
    ("The answer is 1.250 2.500", "1.2502", 0.0),  # two decimals, not one
])
def test_digit_groups_separated_by_a_space_are_one_number(response, gold, expected):
    """Catches the space left in (math-verify reads ``10\\,080`` as arithmetic), dropped on one
    side only, or dropped between digits that are not a group of three."""
    assert R.math_verify_score(response, gold, timeout=5) == expected


@pytest.mark.parametrize("text", ["In 2023 100 students", "1234 567", "12:30 100", "x_1 234",
                                  "1.5 000", "\\frac{1}{2}\\,000", "12\\,34", "10 0801",
                                  "1/2 100", "0.125 0.25"])
def test_only_a_whole_number_written_in_groups_is_joined(text):
    """Catches a join after any digit (the first group has 1 to 3 digits and starts a number)."""
    assert R.final_answer_text(text) == text


def test_a_number_after_a_words_colon_is_joined():
    """Catches every colon taken for a time's (only a digit's colon is)."""
    assert R.final_answer_text("Answer:1\\,000") == "Answer:1000"


TOWER = "\\boxed{9^{9^{9^{9^{9^{9}}}}}}"  # math-verify's own 1 s timeout ends its comparison


@pytest.mark.parametrize("workers", [0, 1])
@pytest.mark.parametrize("silenced", [False, True])
def test_math_verify_timeouts_are_counted_and_reported(workers, silenced, caplog, capfd):
    """math-verify answers "no match" at its own timeout and logs a bare line: catches that 0
    given in silence (no count, no warning; the old code's), the raw line (up to 4,000
    characters of the response) left to reach the console (in this process: a worker's goes
    to the log capture it inherits; the next test runs one outside pytest), and a timeout
    uncounted where the user silenced math-verify's loggers (no record is made)."""
    if silenced:
        logging.getLogger("math_verify").setLevel(logging.ERROR)
    try:
        _timeouts_counted(workers, caplog, capfd)
    finally:
        logging.getLogger("math_verify").setLevel(logging.NOTSET)
    assert logging.getLogger("math_verify.grader").level == logging.NOTSET  # as it was


def test_a_workers_timeout_line_stays_off_the_console():
    """Outside pytest (whose log capture a forked worker inherits) a worker's timeout line
    reaches stderr through logging's last resort: catches the filter letting it through."""
    script = ("import logging, pepo.tasks.rewards as R\n"
              "logging.basicConfig(level=logging.WARNING)\n"
              f"with R.MathVerify(timeout=1, workers=1) as mv: print(mv([{TOWER!r}], ['1']))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.stdout.strip() == "[0.0]", done.stderr
    assert "1 at math-verify's 1 s timeout" in done.stderr
    assert "Timeout during" not in done.stderr


def test_the_timeout_filter_comes_first_and_lets_nothing_through_a_silenced_logger(caplog):
    """Catches the filter added after a user's filter that drops the record (the timeout then
    goes uncounted), and a silenced logger's other records let through while its level is
    lowered for the call."""
    grader = logging.getLogger("math_verify.grader")
    drop_all = logging.Filter("nothing")  # passes no record
    grader.addFilter(drop_all)
    try:
        with R.MathVerify(timeout=1, workers=0) as mv:
            assert mv([TOWER], ["1"]) == [0.0] and mv.timed_out == 1
    finally:
        grader.removeFilter(drop_all)
    f = R._Timeouts()
    f.shown["math_verify.parser"] = False
    other = logging.LogRecord("math_verify.parser", logging.WARNING, "", 0, "a note", None, None)
    assert f.filter(other) is False and f.count == 0
    f.shown["math_verify.parser"] = True
    assert f.filter(other) is True


def _timeouts_counted(workers, caplog, capfd):
    with R.MathVerify(timeout=1, workers=workers) as mv:
        assert mv([TOWER, "\\boxed{2}"], ["1", "2"]) == [0.0, 1.0]
        assert mv.timed_out == 1 and mv.killed == 0 and mv.died == 0
        assert _unchecked(caplog) == [
            "MathVerify: 1 of 2 responses scored 0 unchecked (1 at math-verify's 1 s timeout, 0 "
            "over the 3 s limit, 0 whose worker died 2 times); 1 timed out, 0 killed, 0 died so "
            "far"]
    assert not [r for r in caplog.records if r.getMessage().startswith("Timeout during")]
    assert "Timeout during" not in capfd.readouterr().err
    # the filter is on math-verify's loggers for a scoring's time only (a user's own
    # math-verify calls keep their lines)
    assert all(not logging.getLogger(f"math_verify.{m}").filters for m in ("parser", "grader"))


@pytest.mark.parametrize("workers", [0, 1])
def test_a_gold_answer_math_verify_cannot_read_is_warned_of_once(workers, caplog):
    """Catches every response to an unreadable gold answer scored 0 in silence, the warning
    repeated at each call, and a readable gold answer ('12', 'Yes') warned of."""
    with R.MathVerify(timeout=5, workers=workers) as mv:
        assert mv(["\\boxed{12}"] * 3 + ["\\boxed{2}"], ["{12", "12", "Yes", "\\frac{1}{2"]) == [
            0.0, 1.0, 0.0, 0.0]
        assert _unchecked(caplog) == [
            "MathVerify: 2 gold answer(s) hold no expression math-verify reads, so nearly every "
            "response to them scores 0: '\\\\frac{1}{2', '{12' (2 so far)"]
        caplog.clear()
        assert mv(["\\boxed{12}", "x"], ["{12", "{13"]) == [0.0, 0.0]  # '{13': never parsed
        assert _unchecked(caplog) == []


def test_the_answer_is_read_after_the_last_think_end():
    """A response that closes its thinking twice (a second ``<think>`` block after a first
    answer) is scored on what follows the last ``</think>``: catches the text after the first
    one read, where both boxes are found and math-verify reads them as a set ({3, 4}), so the
    right final answer 4 scored 0."""
    text = "<think>a</think> so \\boxed{3} <think>wait, no</think> so \\boxed{4}"
    assert R.final_answer_text(text) == " so \\boxed{4}"
    assert R.final_answer_text("a</think>b</think>c") == "c"
    mv = R.MathVerify(workers=0)
    assert mv([text, text], ["4", "3"]) == [1.0, 0.0]
