"""Local math datasets in their published layouts → (prompt, gold answer)."""

from __future__ import annotations

import json

import pytest

from pepo.datasets import BOXED_TEMPLATE, load_math_dataset
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
    assert [(p.id, p.prompt, p.answer) for p in probs][2] == ("dapo-0002", "Compute $2 \\times 3$.", "6")


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
    with pytest.raises(ValueError, match="does not exist"):
        load_math_dataset(tmp_path / "nope.parquet")
    with pytest.raises(ValueError, match="layout must be one of"):
        load_math_dataset(tmp_path, layout="gsm8k")
    bad = F.write_parquet(tmp_path / "bad.parquet", [{"text": "x"}])
    with pytest.raises(ValueError, match="cannot tell the dataset layout from the columns \\['text'\\]"):
        load_math_dataset(bad)
    with pytest.raises(ValueError, match="row 0 does not have the 'dapo' layout"):
        load_math_dataset(bad, layout="dapo")
