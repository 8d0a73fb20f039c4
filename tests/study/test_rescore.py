"""The second scoring of the validations (``pepo.study.rescore``) and its section of the
real-model study's report."""

from __future__ import annotations

import gzip
import json

import pytest


def _dump(path, step, rows, gz=False):
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps({"step": step, "prompt_id": f"p{i}", "response": r, "answer": a,
                               "reward": 1.0 if s else 0.1, "success": s}) + "\n"
                   for i, (r, a, s) in enumerate(rows))
    if gz:
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(text)
    else:
        path.write_text(text, encoding="utf-8")


def test_stated_success_lets_the_stated_result_decide_and_falls_back_to_the_verifier():
    """Catches the first ``= n`` read instead of the last, ``= 3 + 4`` read as the result 3, and
    a response that states no result scored as a failure (or a success) instead of by the
    verifier's verdict."""
    from pepo.study.rescore import last_stated_result, stated_success

    assert last_stated_result("2 + 5 = 8, no: 2 + 5 = 7.") == 7.0
    assert last_stated_result("x = 7 and then y = 3 + 4") == 7.0
    assert last_stated_result("7 - 9 = -2") == -2.0
    assert last_stated_result("the answer is 7") is None
    # a bullet after the result is no operator (it made an earlier "= 5" the stated result);
    # thousands separators are one number (1,234 was read as 1); "3, 4" is not 34
    assert last_stated_result("2 + 3 = 5\n- then 5 + 14 = 19\n- so the answer is 19") == 19.0
    assert last_stated_result("1000 + 234 = 1,234.") == 1234.0
    assert last_stated_result("so x = 3, 4 + 5 = 9 - 1") == 3.0
    assert last_stated_result("8 - 1 =\n7") == 7.0
    assert stated_success("0 + 8 = 9. Adding 0 to 8 is easy.", "8", True) is False
    assert stated_success("13 + 16 = 29. This adds 13 and 16.", "29", False) is True
    assert stated_success("It is 8", "8", True) is True
    assert stated_success("It is 9", "8", False) is False
    assert stated_success("x = 2", "1/2", True) is True  # gold not a plain number: the verifier
    # Markdown bold closing after the result is not a product (it read "= 7**" as "7 * ...")
    assert last_stated_result("**3 + 4 = 7**") == 7.0
    assert last_stated_result("2 + 3 = 5. Then **5 + 2 = 7**.") == 7.0
    assert last_stated_result("so 2 = 3 * 4 and 6 = 2 *3") is None
    for power in ("x = 2**3", "x = 2 ** 3", "x = 2**(3)"):  # a power is still an operator
        assert last_stated_result(power) is None, power


def test_validation_curve_counts_each_dumped_validation_by_step(tmp_path):
    """Two validations (one gzipped, written in the other order): accuracy by the verifier (the
    dump's ``success``) and by the stated result, per step. Catches the ``reward`` read instead
    of ``success``, the steps mixed up, and a run without dumps given a curve."""
    from pepo.study.rescore import main, validation_curve

    run = tmp_path / "pepo" / "seed_2"
    _dump(run / "val_rollouts" / "step_000016.jsonl.gz", 16, [
        ("0 + 8 = 9. Adding 0 to 8.", "8", True),  # verifier yes, stated no
        ("13 + 16 = 29. This adds 13 and 16.", "29", False),  # verifier no, stated yes
        ("13 + 16 = 29", "29", True),
        ("It is 30", "29", False),
    ], gz=True)
    _dump(run / "val_rollouts" / "step_000000.jsonl", 0, [
        ("1 + 1 = 2", "2", True), ("1 + 1 = 3. So 2.", "2", True), ("no idea", "2", False),
    ])
    curve = validation_curve(run)
    assert curve == [[0, pytest.approx(2 / 3), pytest.approx(1 / 3), 3], [16, 0.5, 0.5, 4]]
    # a killed write's leftover and a step kept both plain and compressed: one entry a step
    (run / "val_rollouts" / "step_000032.jsonl.tmp").write_text('{"step": 32, "respo')
    _dump(run / "val_rollouts" / "step_000000.jsonl.gz", 0, [
        ("1 + 1 = 2", "2", True), ("1 + 1 = 3. So 2.", "2", True), ("no idea", "2", False),
    ], gz=True)
    assert validation_curve(run) == curve
    (run.parent / "seed_3").mkdir()
    assert validation_curve(run.parent / "seed_3") is None
    with pytest.raises(SystemExit, match="seed_3 has no validation dumps"):
        main([str(run.parent / "seed_3")])


def test_the_report_pairs_the_rescored_runs_by_seed(tmp_path):
    """The report's section: each method against GRPO with the final accuracy by the stated
    result, ``before`` from the seed's step-0 dump. Catches the verifier's accuracy reported
    instead, a run whose dump is not its last validation kept, a method with one paired
    seed given an interval."""
    from pepo.study import power, rescore

    def r(method, seed, after, stated, before=None):
        curve = ([[0, 0.2, before, 418]] if before is not None else []) + [
            [16, after, stated, 418]]
        return {"task": "smollm2_steps", "mode": "group", "method": method, "seed": seed,
                "val_before": 0.2, "val_after": after, "val_curve": [[0, 0.2], [16, after]],
                "stated_curve": curve}

    rows = [r("GRPO", s, 0.40 + 0.01 * s, 0.45 + 0.02 * s, before=0.25) for s in range(3)]
    rows += [r("PEPO", s, 0.50 + 0.01 * s, 0.48 + 0.01 * s * s) for s in range(3)]
    rows.append(r("PEPO", 3, 0.5, 0.9))  # no GRPO on seed 3: not paired
    bad = r("GTPO", 0, 0.5, 0.6)
    bad["stated_curve"][-1][1] = 0.49  # its dump does not give its logged accuracy
    rows += [bad, r("GTPO", 1, 0.5, 0.6)]
    rows.append(r("PEPO, W = 11", 0, 0.5, 0.1))  # an ablation's run: not in the table below
    scored = rescore.stated_results(rows)
    assert ("GTPO", 0) not in {(x["method"], x["seed"]) for x in scored}
    assert {x["val_before"] for x in scored if x["seed"] < 3} == {0.25}
    text = rescore.stated_section("smollm2_steps", rows, ["GRPO", "PEPO", "GTPO"],
                                  tmp_path / "stated")
    v = power.comparisons(scored, "GRPO", ["PEPO", "GTPO"])["PEPO"]
    assert v["m"] == 1  # GTPO has one paired seed: a family of 1
    d = [0.48 - 0.45, 0.49 - 0.47, 0.52 - 0.49]
    assert v["mean"] == pytest.approx(sum(d) / 3, abs=1e-12)
    line = next(x for x in text.splitlines() if x.startswith("| PEPO |"))
    assert f"{100 * v['mean']:+.1f} [{100 * v['lo']:+.1f}, {100 * v['hi']:+.1f}]" in line
    assert "| GTPO | 1 | 25.0 | 60.0 | (1 paired seed(s)) |" in text  # no interval from one seed
    assert "p (Holm, 1 comparison)" in text  # GTPO, with one paired seed, is not tested
    assert "| GRPO | 3 | 25.0 ± 0.0 | 47.0 ± 2.0 |" in text
    # the shifts of the table's runs (-2.0 to +40.0 points), not the ablation's -40.0
    assert "moves a run's final accuracy by -2.0 to +40.0 points" in text
    assert (tmp_path / "stated" / "forest.png").is_file()
    assert rescore.stated_section("smollm2_steps", rows[:3], ["GRPO", "PEPO"], tmp_path) is None


def test_a_dump_that_cannot_be_read_is_named_in_one_line(tmp_path):
    """A truncated ``.jsonl.gz``, a ``.gz`` that is not gzip, a cut-off JSON line and bytes that
    are not UTF-8 were EOFError / BadGzipFile / JSONDecodeError / UnicodeDecodeError tracebacks
    (or an error naming no file) in rescore's and the analysis' readers. Catches any of them
    getting through, or the file not named."""
    import re

    from pepo.study import analysis
    from pepo.study.rescore import main, read_rows

    whole = gzip.compress(b'{"step": 0, "entropies": [0.5], "reward": 1.0}\n' * 2000)
    flipped = bytearray(whole)
    flipped[10] ^= 0xFF  # a corrupted deflate block: zlib.error, not an OSError
    cases = {"cut.jsonl.gz": (whole[: len(whole) // 2], "EOFError"),
             "flipped.jsonl.gz": (bytes(flipped), "error"),
             "plain.jsonl.gz": (b'{"step": 0}\n', "BadGzipFile"),
             "line.jsonl": (b'{"step": 0}\n{"step": 0, "resp', "line.jsonl:2: not valid JSON"),
             "latin.jsonl": (b'{"step": 0, "response": "\xff"}\n', "UnicodeDecodeError")}
    for name, (data, shown) in cases.items():
        f = tmp_path / name
        f.write_bytes(data)
        where = re.escape(str(f))
        with pytest.raises(ValueError, match=rf"^{where}.*{shown}|^{where}:2: not valid JSON"):
            read_rows(f)
        if name != "line.jsonl":  # the analysis names a line's error with its own checks
            with pytest.raises(ValueError, match=rf"^{where}: cannot be read as a rollout dump "
                                                 rf"\(\w*{shown}"):
                analysis.load_dump(f)
    run = tmp_path / "run"
    (run / "val_rollouts").mkdir(parents=True)
    (run / "val_rollouts" / "step_000000.jsonl.gz").write_bytes(whole[:100])
    with pytest.raises(SystemExit, match=r"^error: .*step_000000.jsonl.gz: cannot be read"):
        main([str(run)])


def test_no_section_without_a_method_of_two_paired_seeds(tmp_path):
    """Catches the section written for a method with one seed paired with GRPO (its docstring:
    None when no method has 2): GRPO on seeds 0 and 1, PEPO on seed 0 alone."""
    from pepo.study import rescore

    def r(method, seed, after, stated):
        return {"task": "smollm2_steps", "mode": "group", "method": method, "seed": seed,
                "val_before": 0.2, "val_after": after, "val_curve": [[0, 0.2], [16, after]],
                "stated_curve": [[0, 0.2, 0.25, 418], [16, after, stated, 418]]}

    rows = [r("GRPO", 0, 0.4, 0.45), r("GRPO", 1, 0.41, 0.47), r("PEPO", 0, 0.5, 0.48)]
    assert rescore.stated_section("smollm2_steps", rows, ["GRPO", "PEPO"], tmp_path) is None
    rows.append(r("PEPO", 1, 0.52, 0.5))  # a second paired seed: the section
    assert rescore.stated_section("smollm2_steps", rows, ["GRPO", "PEPO"], tmp_path) is not None
