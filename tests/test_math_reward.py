"""math-verify rewards on realistic responses; pathological ones cost at most the timeout."""

from __future__ import annotations

import time

import pytest

import pepo.rewards as R

QWEN3 = ("<think>\nOkay, so I need to find x. If 2x = 1 then x = 1/2... wait, let me double-check."
         "\n</think>\n\nWe solve $2x = 1$, so $x = \\frac{1}{2}$.\n\n**Final Answer**\n"
         "\\[\n\\boxed{\\dfrac{1}{2}}\n\\]")

CASES = [
    (QWEN3, "\\frac{1}{2}", 1.0),                  # DeepMath final_answer layout
    (QWEN3, "0.5", 1.0),                           # numerically equal
    (QWEN3, "1/3", 0.0),
    ("<think>\nthe answer might be \\boxed{7}", "7", 0.0),  # thinking never closed: no answer
    ("<think>I guess \\boxed{3}</think> The answer is \\boxed{4}.", "4", 1.0),  # after </think>
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
    # 2 workers, 4 jobs: at most two rounds of the hard limit (2 x timeout + grace) each
    assert elapsed < 2 * (2 * 1 + 0.5) + 2.0, elapsed


def test_a_stuck_worker_is_killed_and_replaced(monkeypatch):
    real = R.math_verify_score

    def sometimes_hangs(response, *args):
        if response == "HANG":
            time.sleep(60)  # like C-level arithmetic that SIGALRM cannot interrupt
        return real(response, *args)

    monkeypatch.setattr(R, "math_verify_score", sometimes_hangs)  # forked workers inherit it
    mv = R.MathVerify(timeout=1, workers=1, grace=0.5)
    try:
        t0 = time.monotonic()
        got = mv(["HANG", "\\boxed{2}"], ["2", "2"])
        elapsed = time.monotonic() - t0
        assert got == [0.0, 1.0] and mv.killed == 1
        assert elapsed < 2 * 1 + 0.5 + 5.0, elapsed  # the limit, plus a worker restart
    finally:
        mv.close()


def test_bad_arguments():
    with pytest.raises(ValueError, match="timeout must be an int >= 1"):
        R.MathVerify(timeout=0.5)
    with pytest.raises(ValueError, match="2 responses but 1 answers"):
        R.MathVerify(workers=0)(["a", "b"], ["a"])
