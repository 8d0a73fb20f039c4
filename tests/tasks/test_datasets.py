"""Local math datasets in their published layouts → (prompt, gold answer)."""

from __future__ import annotations

import json

import pytest

from pepo.tasks.datasets import BOXED_TEMPLATE, load_math_dataset
from tests import hf_fixtures as F


def test_deepmath(tmp_path):
    path = F.write_parquet(tmp_path / "deepmath" / "train-00000.parquet", F.deepmath_rows(3))
    probs = load_math_dataset(tmp_path / "deepmath")  # a directory of shards
    assert [p.answer for p in probs] == ["1", "3", "5"]
    assert probs[1].prompt == BOXED_TEMPLATE.format(question="What is $1 + 2$?")
    assert probs[1].prompt.endswith("within \\boxed{}.")
    assert load_math_dataset(path, layout="deepmath", limit=2, template=None)[1].prompt == (
        "What is $1 + 2$?")


def test_dapo_strips_its_answer_format_instructions(tmp_path):
    path = F.write_parquet(tmp_path / "dapo.parquet", F.dapo_rows(3))
    probs = load_math_dataset(path, template=None)
    assert [(p.id, p.prompt, p.answer) for p in probs][2] == (
        "dapo-0002",
        "Compute $2 \\times 3$.",
        "6",
    )


@pytest.mark.parametrize("rows, answers, ids", [
    (F.math500_rows(), ["\\left( 3, \\frac{\\pi}{2} \\right)", "2"], ["test/precalculus/807.json",
                                                                     "test/prealgebra/1.json"]),
    (F.amc_rows(), ["142"], ["b-0"]),
    (F.aime24_rows(), ["104"], ["b-2024-I-1"]),
    (F.aime25_rows(), ["70"], ["b-0"]),
])
def test_benchmarks(tmp_path, rows, answers, ids):
    path = tmp_path / "b.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    probs = load_math_dataset(path)
    assert [p.answer for p in probs] == answers and [p.id for p in probs] == ids


def test_errors(tmp_path):
    with pytest.raises(ValueError, match=r"nope.parquet' does not exist$"):
        load_math_dataset(tmp_path / "nope.parquet")
    # a publisher's file name beside the missing one is named (MATH-500 ships test.jsonl)
    (tmp_path / "test.jsonl").write_text("", encoding="utf-8")
    with pytest.raises(ValueError, match=r"does not exist; its directory holds test.jsonl$"):
        load_math_dataset(tmp_path / "math500.parquet")
    # a file of another extension was read as JSON: "holds no rows", or a JSON error
    (tmp_path / "rows.txt").write_text(json.dumps(F.amc_rows()[0]) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"rows.txt is not a .parquet, .jsonl or .json file"):
        load_math_dataset(tmp_path / "rows.txt")
    with pytest.raises(ValueError, match="layout must be one of"):
        load_math_dataset(tmp_path, layout="gsm8k")
    bad = F.write_parquet(tmp_path / "bad.parquet", [{"text": "x"}])
    with pytest.raises(ValueError,
                       match="cannot tell the dataset layout from the columns \\['text'\\]"):
        load_math_dataset(bad)
    with pytest.raises(ValueError, match="bad.parquet: row 0: field 'prompt' is missing for the "
                                         "'dapo' layout \\(columns: \\['text'\\]\\)"):
        load_math_dataset(bad, layout="dapo")


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


AIME = {"id": 7, "problem": "Find $3 + 4$.", "answer": "7"}


@pytest.mark.parametrize("bad, field, problem", [
    ({"id": 1, "problem": "Find $1$."}, "answer", "missing"),  # AIME-style row without answer
    ({"id": 1, "answer": "1"}, "problem", "missing"),
    ({"id": 1, "problem": "Find $1$.", "answer": None}, "answer", "null"),
    ({"id": 1, "problem": None, "answer": "1"}, "problem", "null"),
    ({"id": 1, "problem": "Find $1$.", "answer": float("nan")}, "answer", "null \\(NaN\\)"),
    ({"id": 1, "problem": "Find $1$.", "answer": "  "}, "answer", "empty"),
    ({"id": 1, "Problem": 12, "answer": "1"}, "problem", "not text \\(int\\)"),
])
def test_a_row_without_prompt_or_answer_is_an_error(tmp_path, bad, field, problem):
    """Catches the reported bug: ``str(None)`` made "None" the prompt or the gold answer, and
    every reward of that problem 0 without a word. The error must name file, row, line, field."""
    path = _jsonl(tmp_path / "aime.jsonl", [AIME, bad, AIME])
    path.write_text(path.read_text().replace("\n", "\n\n", 1))  # a blank line: row 1 is line 3
    with pytest.raises(ValueError, match=f"aime.jsonl: row 1 \\(line 3\\): field '{field}' is "
                                         f"{problem} for the 'aime' layout"):
        load_math_dataset(path)


def test_a_forced_layout_that_does_not_fit_is_an_error(tmp_path):
    """Catches ``layout=`` overriding detection and then reading absent columns as None
    (DeepMath rows read as AIME had answer "None"), and null values in the other layouts."""
    deepmath = F.write_parquet(tmp_path / "deepmath.parquet", F.deepmath_rows(2))
    with pytest.raises(ValueError, match="deepmath.parquet: row 0: field 'answer' is missing for "
                                         "the 'aime' layout"):
        load_math_dataset(deepmath, layout="aime")
    rows = F.dapo_rows(2)
    rows[1]["reward_model"]["ground_truth"] = None
    dapo = F.write_parquet(tmp_path / "dapo.parquet", rows)
    with pytest.raises(ValueError, match="dapo.parquet: row 1: field 'reward_model.ground_truth' "
                                         "is null"):
        load_math_dataset(dapo)
    rows = F.math500_rows()
    rows[0]["unique_id"] = None  # ids key the single-stream tracker: "None" would be shared
    math500 = _jsonl(tmp_path / "m.jsonl", rows)
    with pytest.raises(ValueError, match="m.jsonl: row 0 \\(line 1\\): field 'unique_id' is null"):
        load_math_dataset(math500)


def test_a_bad_shard_is_named(tmp_path):
    """Catches errors that give the dataset-wide row index but not the shard that holds it."""
    d = tmp_path / "deepmath"
    F.write_parquet(d / "train-00000.parquet", F.deepmath_rows(3))
    rows = F.deepmath_rows(2)
    rows[1]["final_answer"] = None
    F.write_parquet(d / "train-00001.parquet", rows)
    with pytest.raises(ValueError,
                       match="train-00001.parquet: row 1: field 'final_answer' is null"):
        load_math_dataset(d)


def test_skip_drops_bad_rows_with_one_warning(tmp_path):
    """Catches "skip" keeping the bad rows (as "None"), dropping good ones, or warning per row;
    and a dataset left empty by skipping passing silently."""
    first_bad = {"id": 0, "problem": "Find $0$."}  # also the first row: layout detection must
    rows = [first_bad, AIME, {"id": 2, "answer": 5},  # look past it
            {**AIME, "id": 3, "problem": "Find $2 + 5$."}]
    path = _jsonl(tmp_path / "a.jsonl", rows)
    with pytest.raises(ValueError, match="row 0 \\(line 1\\): field 'answer' is missing"):
        load_math_dataset(path)
    with pytest.warns(UserWarning, match="a.jsonl: skipped 2 rows with a missing, null or empty "
                                         "field \\(first: .*row 0 \\(line 1\\)") as record:
        probs = load_math_dataset(path, on_bad_row="skip", template=None)
    assert len(record) == 1
    assert [(p.id, p.prompt, p.answer) for p in probs] == [("a-7", "Find $3 + 4$.", "7"),
                                                           ("a-3", "Find $2 + 5$.", "7")]
    with pytest.warns(UserWarning, match="skipped 1 rows"):  # limit counts kept problems
        assert [p.id for p in load_math_dataset(path, on_bad_row="skip", limit=1)] == ["a-7"]
    only_bad = _jsonl(tmp_path / "b.jsonl", [first_bad, {"id": 2, "answer": 5}])
    with pytest.raises(ValueError, match="b.jsonl: no usable rows: all 2 have a missing"):
        load_math_dataset(only_bad, layout="aime", on_bad_row="skip")
    with pytest.raises(ValueError,
                       match="on_bad_row must be one of \\['error', 'skip'\\], got 'drop'"):
        load_math_dataset(path, on_bad_row="drop")


def test_limit(tmp_path):
    """Catches ``rows[:limit] if limit else rows`` (limit=0 returned everything) and negative
    limits slicing from the end (-1 dropped the last row)."""
    path = F.write_parquet(tmp_path / "d.parquet", F.deepmath_rows(4))
    assert load_math_dataset(path, limit=0) == []
    assert [p.answer for p in load_math_dataset(path, limit=3)] == ["1", "3", "5"]
    assert len(load_math_dataset(path, limit=10)) == 4
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match=f"limit must be None or an int >= 0, got {bad!r}"):
            load_math_dataset(path, limit=bad)
    rows = [AIME, {**AIME, "id": 8, "problem": "Find $1 + 6$."},  # a bad row after the limit is
            {"id": 9, "problem": "x"}]  # never read
    assert len(load_math_dataset(_jsonl(tmp_path / "l.jsonl", rows), limit=2)) == 2


def test_unreadable_files_are_named(tmp_path):
    """Catches raw JSONDecodeError / UnicodeDecodeError escaping without the file (and, for
    JSONL, the line), a locale-dependent decoding, and a JSON row that is not an object."""
    jl = tmp_path / "broken.jsonl"
    jl.write_text(json.dumps(AIME) + "\n\n" + '{"problem": "x", "answer": \n')
    with pytest.raises(ValueError, match="broken.jsonl: line 3 is not valid JSON"):
        load_math_dataset(jl)
    js = tmp_path / "broken.json"
    js.write_text('[\n  {"problem": "x",\n   "answer": }\n]')
    with pytest.raises(ValueError, match="broken.json is not valid JSON \\(.* at line 3, column"):
        load_math_dataset(js)
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(json.dumps(AIME).encode() + b"\n"
                      + '{"problem": "caf\xe9", "answer": "1"}\n'.encode("latin-1"))
    with pytest.raises(ValueError, match="latin.jsonl: line 2 is not UTF-8 text"):
        load_math_dataset(latin)
    latin_json = tmp_path / "latin.json"
    latin_json.write_bytes('[{"problem": "caf\xe9", "answer": "1"}]'.encode("latin-1"))
    with pytest.raises(ValueError, match="latin.json is not UTF-8 text"):
        load_math_dataset(latin_json)
    bom = tmp_path / "bom.jsonl"  # a UTF-8 byte-order mark (Windows editors) is fine
    bom.write_bytes(b"\xef\xbb\xbf" + json.dumps(AIME).encode() + b"\n")
    assert load_math_dataset(bom)[0].answer == "7"
    lists = tmp_path / "lists.jsonl"
    lists.write_text(json.dumps(AIME) + "\n" + json.dumps(["x", "1"]) + "\n")
    with pytest.raises(ValueError, match="lists.jsonl: line 2 must be a JSON object"):
        load_math_dataset(lists)
    scalar = tmp_path / "scalar.json"
    scalar.write_text("3")
    with pytest.raises(ValueError, match="scalar.json must hold a JSON list of rows"):
        load_math_dataset(scalar)
    not_parquet = tmp_path / "x.parquet"
    not_parquet.write_text("hello")
    with pytest.raises(ValueError, match="x.parquet: not a readable Parquet file"):
        load_math_dataset(not_parquet)


def test_a_template_without_the_question_is_refused(tmp_path):
    """Catches a template that silently drops the question (every prompt identical)."""
    path = _jsonl(tmp_path / "a.jsonl", [AIME])
    with pytest.raises(ValueError, match="template must contain \\{question\\}"):
        load_math_dataset(path, template="Solve it step by step.")


def test_a_repeated_question_is_one_problem_and_ids_stay_unique(tmp_path):
    """A dataset that repeats its rows (each with an id of its own, as DAPO's copies) gives one
    problem per question and answer, with one warning (SPO would track each copy apart and roll
    each into its prior); the same question with another answer is another problem. Files of
    one directory numbered alike (aime24 and aime25, ids from 0) keep every question under an
    id of its own (SPO merged them into one tracker). Catches either left as it was."""
    rows = [{**AIME, "id": f"u{i}"} for i in range(5)] + [{**AIME, "id": "u9", "answer": "8"}]
    with pytest.warns(UserWarning, match=r"4 rows repeat an earlier row's question and answer; "
                                         r"each question is one problem \(2 in all\)"):
        probs = load_math_dataset(_jsonl(tmp_path / "r.jsonl", rows), template=None)
    assert [(p.id, p.answer) for p in probs] == [("r-u0", "7"), ("r-u9", "8")]
    d = tmp_path / "aime"
    d.mkdir()
    _jsonl(d / "aime24.jsonl", [AIME, {"id": 8, "problem": "Find $4 + 4$.", "answer": "8"}])
    _jsonl(d / "aime25.jsonl", [{**AIME, "problem": "Find $5 + 2$."}])
    with pytest.warns(UserWarning, match=r"1 ids name two different questions \(first: "
                                         r"'aime-7'\); the later ones are made unique"):
        probs = load_math_dataset(d, template=None)
    assert [p.id for p in probs] == ["aime-7", "aime-8", "aime-7#row2"]
    assert len({p.prompt for p in probs}) == 3


def test_dapo_reads_the_user_turn_after_a_system_message(tmp_path):
    """verl-format files often open with a system message. Catches ``prompt[0]`` read blindly:
    every problem's prompt was the system text."""
    rows = F.dapo_rows(2)
    for r in rows:
        r["prompt"] = [{"role": "system", "content": "You are a helpful assistant."}, *r["prompt"]]
    probs = load_math_dataset(_jsonl(tmp_path / "d.jsonl", rows), template=None)
    assert [p.prompt for p in probs] == ["Compute $0 \\times 3$.", "Compute $1 \\times 3$."]


def test_a_worked_solution_is_no_final_answer(tmp_path):
    """GSM8K's rows (question, answer = solution ending '#### 72') were read as the aime layout,
    the whole solution the gold answer. Catches that detection; a short answer still is aime."""
    gsm = {"question": "Natalia sold 48 clips in April and half as many in May. How many?",
           "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72"}
    with pytest.raises(ValueError, match="cannot tell the dataset layout"):
        load_math_dataset(_jsonl(tmp_path / "gsm.jsonl", [gsm]))
    short = {"question": "Find $3 + 4$.", "answer": " 7 "}
    assert load_math_dataset(_jsonl(tmp_path / "q.jsonl", [short]))[0].answer == "7"


def test_answers_that_are_not_one_value_are_bad_rows(tmp_path):
    """Catches str() of a list or a bool made a gold answer ('[1, 2]' math-verify may read as
    an interval, 'True'), and an integral float kept as '3.0' outside the amc layout."""
    for bad, kind in (([1, 2], "list"), (True, "bool")):
        row = {"question": "Q?", "final_answer": bad}
        with pytest.raises(ValueError, match=f"field 'final_answer' is not a single answer "
                                             f"\\({kind}\\) for the 'deepmath' layout"):
            load_math_dataset(_jsonl(tmp_path / f"{kind}.jsonl", [row]))
    for bad in ("Infinity", "-Infinity", "1e400"):  # JSON numbers Python reads as +-inf
        f = tmp_path / "inf.jsonl"
        f.write_text('{"question": "Q?", "final_answer": %s}\n' % bad, encoding="utf-8")
        with pytest.raises(ValueError, match=r"field 'final_answer' is not a finite number "
                                             r"\(-?inf\)"):
            load_math_dataset(f)  # "inf" as text: an answer no response can match
    ok = load_math_dataset(_jsonl(tmp_path / "f.jsonl", [{"question": "Q?", "final_answer": 3.0},
                                                         {"question": "R?", "final_answer": 2.5}]))
    assert [p.answer for p in ok] == ["3", "2.5"]


def test_a_directory_reads_each_file_in_its_own_layout_and_names_what_it_skips(tmp_path):
    """A benchmark directory of AIME and MATH-500 files: each file's layout from its own columns
    (the first file's was applied to all: MATH-500's unique_id lost). Upper-case suffixes are
    read; compressed files are named in a warning instead of dropped in silence."""
    d = tmp_path / "bench"
    d.mkdir()
    _jsonl(d / "a_aime.jsonl", [AIME])
    _jsonl(d / "b_math500.JSONL", F.math500_rows())
    (d / "c.jsonl.gz").write_bytes(b"\x1f\x8b")
    with pytest.warns(UserWarning, match=r"1 file\(s\) not read .*: c.jsonl.gz"):
        probs = load_math_dataset(d)
    assert [p.id for p in probs] == ["bench-7", "test/precalculus/807.json",
                                     "test/prealgebra/1.json"]


def test_a_json_object_without_data_is_named(tmp_path):
    """A single-object .json file was read as zero rows ('holds no rows'), and inside a
    directory contributed nothing in silence."""
    one = tmp_path / "one.json"
    one.write_text(json.dumps(AIME))
    with pytest.raises(ValueError, match=r"one.json holds one JSON object with keys "
                                         r"\['answer', 'id', 'problem'\], not rows"):
        load_math_dataset(one)
    wrapped = tmp_path / "wrapped.json"
    wrapped.write_text(json.dumps({"data": [AIME]}))
    assert load_math_dataset(wrapped)[0].answer == "7"


@pytest.mark.parametrize("template, field", [("{question} \\boxed{}", "{}"),
                                             ("{question} {x}", "{x}")])
def test_a_template_with_another_field_is_refused(tmp_path, template, field):
    """Catches an IndexError / KeyError from str.format at the first row instead of one line
    naming the template and the fix (a literal brace written twice)."""
    path = _jsonl(tmp_path / "a.jsonl", [AIME])
    with pytest.raises(ValueError, match=f"template's only field is .question., got "
                                         f"{field.replace('{', '.').replace('}', '.')}"):
        load_math_dataset(path, template=template)
    assert load_math_dataset(path, template="{question} \\boxed{{}}")[0].prompt.endswith(
        "\\boxed{}")


def test_parquet_files_are_read_for_the_layouts_columns_only(tmp_path, monkeypatch):
    """DeepMath-103K carries three long R1 solutions per row: reading every column made Python
    strings of all of them. Catches the whole table read (the spy sees which columns), and a
    file of unknown columns read without them (its error must still name them)."""
    import pyarrow.parquet as pq

    rows = [{**r, "r1_solution_1": "x" * 1000} for r in F.deepmath_rows(2)]
    path = F.write_parquet(tmp_path / "dm.parquet", rows)
    asked = []
    real = pq.read_table
    monkeypatch.setattr(pq, "read_table", lambda f, columns=None, **kw: asked.append(columns)
                        or real(f, columns=columns, **kw))
    assert [p.answer for p in load_math_dataset(path)] == ["1", "3"]
    assert asked and "r1_solution_1" not in asked[0] and {"question", "final_answer"} <= set(
        asked[0])


def test_a_small_float_gold_is_written_as_a_number_math_verify_reads(tmp_path):
    """A float gold answer below 1e-4 was written ``str(x)``, ``1e-05``, which math-verify reads
    as 1·e - 5 (Euler's number), so the correct ``\\boxed{0.00001}`` scored 0 with no warning
    (the gold parses to something). Positional notation keeps the value; integral floats lose
    their ``.0`` as before, other floats keep their digits."""
    from pepo.tasks.rewards import MathVerify

    answers = [1e-05, 2.5e-07, 0.5, 142.0, -0.000325]
    rows = [{**F.amc_rows()[0], "id": i, "problem": f"Find {i}.", "answer": a}
            for i, a in enumerate(answers)]
    probs = load_math_dataset(F.write_parquet(tmp_path / "amc.parquet", rows))
    assert [p.answer for p in probs] == ["0.00001", "0.00000025", "0.5", "142", "-0.000325"]
    verify = MathVerify(workers=0)
    right = ["\\boxed{0.00001}", "\\boxed{2.5 \\times 10^{-7}}", "\\boxed{\\frac{1}{2}}",
             "\\boxed{142}", "\\boxed{-0.000325}"]
    assert verify(right, [p.answer for p in probs]) == [1.0] * 5
    assert verify(["\\boxed{0.0001}"], [probs[0].answer]) == [0.0]


def test_a_parquet_file_of_unknown_layout_names_all_its_columns(tmp_path):
    """Only the columns a layout reads are read from Parquet (test above), so the layout error
    named ``['Answer']`` for a file of ``Question`` / ``Answer`` / ``Solution``: the column to
    rename was not in the message. It names the file's columns (as a JSONL file's error does)."""
    rows = [{"Question": "Find $1 + 1$.", "Answer": 2, "Solution": "..."}]
    path = F.write_parquet(tmp_path / "q.parquet", rows)
    with pytest.raises(ValueError, match=r"columns \['Answer', 'Question', 'Solution'\] of row 0"):
        load_math_dataset(path)
    # the same for a bad row of a forced layout (DeepMath reads question / final_answer)
    with pytest.raises(ValueError, match=r"'deepmath' layout \(columns: \['Answer', 'Question', "
                                         r"'Solution'\]\)"):
        load_math_dataset(path, layout="deepmath")


def test_a_json_lines_file_named_json_says_so(tmp_path):
    """``datasets.Dataset.to_json`` writes JSON lines by default; such a file named ``.json``
    failed with "Extra data at line 2" alone. Its message now says what to rename; a JSON
    document broken in another way does not get the hint."""
    lines = _jsonl(tmp_path / "math500.json", [AIME, {**AIME, "id": 8, "problem": "Find 2."}])
    with pytest.raises(ValueError, match=r"Extra data at line 2, column 1\) \(JSON lines, as "
                                         r"datasets' to_json writes\? name the file .jsonl\)"):
        load_math_dataset(lines)
    broken = tmp_path / "broken.json"
    broken.write_text('[{"problem": "x", "answer": }]')
    with pytest.raises(ValueError, match=r"is not valid JSON \([^)]*\)$"):
        load_math_dataset(broken)
    assert len(load_math_dataset(lines.rename(tmp_path / "math500.jsonl"))) == 2


def test_a_float32_gold_is_read_as_the_number_it_stores(tmp_path):
    """A float32 answer column (a file written from numpy float32) gave the float64 of its bits:
    ``1e-05`` became ``0.000009999999747378752`` and ``0.1`` ``0.10000000149011612``, so the
    right ``\\boxed{0.00001}`` scored 0. The shortest decimal that rounds to the float32 is
    read; float64 columns keep their value to the last digit (``0.1 + 0.2``)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pepo.tasks.rewards import MathVerify

    answers = [1e-05, 0.1, 142.0, 3.3333333, None]
    path = tmp_path / "amc.parquet"
    pq.write_table(pa.table({"id": list(range(5)), "problem": [f"Find {i}." for i in range(5)],
                             "answer": pa.array(answers, pa.float32())}), path)
    probs = load_math_dataset(path, on_bad_row="skip")
    assert [p.answer for p in probs] == ["0.00001", "0.1", "142", "3.3333333"]
    assert MathVerify(workers=0)(["\\boxed{0.00001}"], [probs[0].answer]) == [1.0]
    pq.write_table(pa.table({"id": [0], "problem": ["Find 0."],
                             "answer": pa.array([0.1 + 0.2], pa.float64())}), path)
    assert load_math_dataset(path)[0].answer == "0.30000000000000004"


def test_amc_ids_are_the_files_own_and_dapo_reads_the_first_user_turn(tmp_path):
    """AMC rows named by their ``id`` column (100, 101), not by their row (0, 1): catches the
    column ignored (results and dumps that no longer join with the published ids, and ids that
    move when the file is reordered). A DAPO chat prompt with a later user turn (a follow-up)
    is the first user turn's problem, as the loader documents: catches the last one read."""
    rows = [{**F.amc_rows()[0], "id": 100 + i, "problem": f"Find {i} + 1."} for i in range(2)]
    probs = load_math_dataset(F.write_parquet(tmp_path / "amc.parquet", rows), name="amc")
    assert [p.id for p in probs] == ["amc-100", "amc-101"]
    dapo = F.dapo_rows(1)
    dapo[0]["prompt"] = [*dapo[0]["prompt"], {"role": "assistant", "content": "Let me see."},
                         {"role": "user", "content": "Now compute $9 \\times 9$."}]
    (prob,) = load_math_dataset(_jsonl(tmp_path / "d.jsonl", dapo), template=None)
    assert prob.prompt == "Compute $0 \\times 3$." and "9 \\times 9" not in prob.prompt
