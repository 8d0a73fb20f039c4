"""Every study command checks where it will write before any work: one `error:` line, nothing
computed (the destination below is under a regular file, so it can never be a directory)."""

from __future__ import annotations

import pytest

from pepo.study import analysis, compare, intervention
from pepo.training.config import asset_dir


@pytest.fixture
def bad_out(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    return str(blocker / "out")


def refuse(fn, argv):
    with pytest.raises(SystemExit) as e:
        fn(argv)
    return str(e.value.code)


def test_diagnostics_check_out_first(bad_out, monkeypatch, tmp_path):
    monkeypatch.setattr(analysis, "run", lambda *a, **k: pytest.fail("read the dump first"))
    msg = refuse(analysis.main, [str(tmp_path / "rollouts"), "--out", bad_out])
    assert msg.startswith("error: --out=") and "is a file" in msg and "\n" not in msg


def test_intervention_checks_out_before_loading_or_sampling(bad_out, monkeypatch):
    monkeypatch.setattr(intervention, "intervene", lambda *a, **k: pytest.fail("sampled first"))
    import pepo.training.weights as weights
    monkeypatch.setattr(weights, "load_model_weights", lambda *a, **k: pytest.fail("loaded first"))
    msg = refuse(analysis.main, ["intervene", "--config", "tiny", "--replacement",
                                 asset_dir("tiny"), "--out", bad_out])
    assert msg.startswith("error: --out=") and "is a file" in msg


def test_the_study_checks_out_docs_and_validation_before_training(bad_out, monkeypatch, tmp_path):
    monkeypatch.setattr(compare, "run_one", lambda *a, **k: pytest.fail("trained first"))
    base = ["--tasks", "tiny", "--seeds", "0", "--only", "group", "--methods", "PEPO"]
    assert "--out=" in refuse(compare.main, base + ["--out", bad_out])
    assert "--docs=" in refuse(compare.main, base + ["--out", str(tmp_path / "o"),
                                                     "--docs", bad_out])
    msg = refuse(compare.main, base + ["--out", str(tmp_path / "o"), "--set",
                                       "validation.every=0"])
    assert "validation.every=0" in msg and "every >= 1" in msg


def test_the_study_runs_smollm2_in_group_mode_only(monkeypatch, tmp_path):
    planned = []
    monkeypatch.setattr(compare, "run_one", lambda task, mode, label, *a: planned.append(
        (task, mode, label)))  # None: "taken by another process", so no report is written
    compare.main(["--tasks", "smollm2", "--seeds", "0", "--methods", "PEPO",
                  "--out", str(tmp_path / "o")])
    assert planned == [("smollm2", "group", "GRPO"), ("smollm2", "group", "PEPO")]
