"""`pepo_eval`: avg@k per benchmark in the paper's table layout."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

import pepo_eval
from pepo.evaluation import format_table
from pepo.recipe_config import find_config, register_resolvers
from tests import hf_fixtures as F


def test_format_table_paper_layout():
    table = format_table({"MATH500": 0.5, "AMC": 0.25, "AIME2025": 0.0, "AIME2024": 0.125}, "m")
    assert table.splitlines()[0] == "| Model | AIME2024 | AIME2025 | AMC | MATH500 | Mean |"
    assert table.splitlines()[2] == "| m | 12.50 | 0.00 | 25.00 | 50.00 | 21.88 |"


def test_eval_math_on_fixture_files(tmp_path, capsys):
    register_resolvers()
    model_dir = F.tiny_hf_qwen3(tmp_path / "qwen3")
    F.write_benchmarks(tmp_path / "data")
    cfg = OmegaConf.load(find_config("eval_math"))
    cfg = OmegaConf.merge(cfg, {
        "checkpoint_dir": str(model_dir), "data_dir": str(tmp_path / "data"),
        "output_dir": str(tmp_path / "out"), "device": "cpu", "dtype": "fp32",
        "model": {"max_seq_len": 512}, "reward": {"workers": 1, "timeout": 2},
        "generation": {"max_new_tokens": 8},
        "benchmarks": {"AIME2024": {"k": 2}, "AIME2025": {
            "k": 2, "dataset": {"path": str(tmp_path / "data" / "aime25.jsonl")}},  # JSONL works too
            "AMC": {"k": 2}},
    })
    results = pepo_eval.eval_main(cfg)
    assert set(results) == {"AIME2024", "AIME2025", "AMC", "MATH500"}
    out = capsys.readouterr().out
    assert "| Model | AIME2024 | AIME2025 | AMC | MATH500 | Mean |" in out
    saved = json.loads((tmp_path / "out" / "eval_results.json").read_text())
    assert saved["results"] == results and saved["k"]["MATH500"] == 1
    assert (tmp_path / "out" / "eval_results.md").read_text().startswith("| Model | AIME2024")


def test_eval_config_errors(tmp_path):
    register_resolvers()
    cfg = OmegaConf.merge(OmegaConf.load(find_config("eval_math")), {
        "checkpoint_dir": str(tmp_path), "data_dir": str(tmp_path)})
    with pytest.raises(ValueError, match="benchmarks.AIME2024.dataset.path=.* does not exist"):
        pepo_eval.validate_eval_config(cfg)


def test_tune_run_pepo_eval_tiny(tmp_path):
    r = subprocess.run([sys.executable, "-m", "torchtune._cli.tune", "run", "pepo_eval",
                        "--config", "eval_tiny", "output_dir=out", "benchmarks.modsum_val.k=1",
                        "benchmarks.modsum_val.dataset.size=8"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "| Model | modsum_val | Mean |" in r.stdout
    assert (tmp_path / "out" / "eval_results.json").is_file()
