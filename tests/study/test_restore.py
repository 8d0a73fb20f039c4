"""Putting a study's published per-run results back under a study directory
(``pepo.study.restore``), so that ``pepo.study.compare`` goes on from them."""

from __future__ import annotations

import json
import re

import pytest


def _result(method, seed, after):
    return {"task": "smollm2_steps", "mode": "group", "method": method, "seed": seed,
            "val_curve": [[0, 0.2], [16, after]], "val_before": 0.2, "val_after": after,
            "val_k": 2, "val_problems": 209, "num_steps": 16,
            "len_curve": [[1, 80.0], [16, 20.0]], "stated_curve": [[0, 0.2, 0.25, 418]],
            "checkpoint": "/somewhere/checkpoints/step_16"}


def _publish(folder, rows):
    from pepo.study.compare import slug
    from pepo.study.power import write_result

    folder.mkdir(parents=True, exist_ok=True)
    for r in rows:
        write_result(r, folder / f"{slug(r['method'])}_seed_{r['seed']}.json")


def test_restored_results_are_the_runs_compare_reads_back(tmp_path):
    """Catches a result written under the label instead of compare's directory name (the
    ``80/20, proximal score`` slug), under the wrong seed, or changed on the way (a key dropped):
    compare would train those runs again."""
    from pepo.study.compare import run_dir, saved_result
    from pepo.study.restore import restore

    rows = [_result("GRPO", 0, 0.45), _result("80/20, proximal score", 3, 0.31),
            _result("PEPO", 1, 0.50)]
    _publish(tmp_path / "results", rows)
    out = tmp_path / "study"
    assert restore(tmp_path / "results", out) == (3, 0)
    for r in rows:
        published = {k: v for k, v in r.items() if k != "checkpoint"}
        assert saved_result(run_dir(out, r["task"], "group", r["method"], r["seed"])) == published
    assert saved_result(run_dir(out, "smollm2_steps", "group", "PEPO", 0)) is None
    assert not list(out.rglob("*.tmp"))
    # a second call finds them there and writes nothing
    assert restore(tmp_path / "results", out) == (0, 3)


def test_a_different_result_already_there_is_kept_and_named(tmp_path):
    """Catches a restore that overwrites a run finished on this machine with the published one
    (work lost), passes over the disagreement in silence, or stops half-way through."""
    from pepo.study.compare import run_dir
    from pepo.study.restore import restore

    _publish(tmp_path / "results", [_result("GTPO", 2, 0.40), _result("GRPO", 2, 0.44)])
    d = run_dir(tmp_path / "study", "smollm2_steps", "group", "GTPO", 2)
    d.mkdir(parents=True)
    mine = _result("GTPO", 2, 0.41)
    (d / "result.json").write_text(json.dumps(mine), encoding="utf-8")
    with pytest.raises(ValueError, match="another result for GTPO seed 2"):
        restore(tmp_path / "results", tmp_path / "study")
    assert json.loads((d / "result.json").read_text(encoding="utf-8")) == mine
    # nothing else was written either: the disagreement is settled before any write
    assert not run_dir(tmp_path / "study", "smollm2_steps", "group", "GRPO", 2).exists()


def test_bad_files_are_named_and_nothing_is_written(tmp_path):
    """Catches an unknown method label restored to a directory compare never reads (the run
    trained again in silence), a file without the keys compare reads, and a bad file found
    after the good ones were already written."""
    from pepo.study.restore import main, restore

    _publish(tmp_path / "results", [_result("GRPO", 0, 0.45), _result("PEPO, W = 7", 0, 0.5)])
    out = tmp_path / "study"
    with pytest.raises(ValueError, match=r"method 'PEPO, W = 7' is not one of mode 'group'"):
        restore(tmp_path / "results", out)
    assert not out.exists()

    bad = tmp_path / "bad"
    bad.mkdir()
    r = _result("GRPO", 0, 0.45)
    del r["val_after"]
    (bad / "grpo_seed_0.json").write_text(json.dumps(r), encoding="utf-8")
    with pytest.raises(ValueError, match="grpo_seed_0.json: not a result JSON, missing val_after"):
        restore(bad, out)
    (bad / "grpo_seed_0.json").write_text("[1, 2]", encoding="utf-8")
    with pytest.raises(ValueError, match="not a result JSON"):
        restore(bad, out)

    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match="no result JSONs"):
        main([str(tmp_path / "empty"), "--out", str(out)])
    with pytest.raises(SystemExit, match="is not a folder"):
        main([str(tmp_path / "nowhere"), "--out", str(out)])


def test_a_restored_study_gives_the_same_mechanism_tables(tmp_path):
    """The published dumps go back to the runs they came from: the mechanism tables computed
    from the restored directory equal the published ones. Catches a dump restored gzipped
    (compare reads ``step_N.jsonl``), under another method, seed or step, or not at all; and
    a restore that leaves the dumps out when given the study's folder."""
    from pepo.study.compare import mechanism_sections, run_dir
    from pepo.study.power import write_result
    from pepo.study.restore import main
    from tests.study.test_analysis import trend_and_shift, write_dump

    out, docs = tmp_path / "runs", tmp_path / "docs"
    rows = []
    for seed in (0, 1):
        for method in ("GRPO", "PEPO"):
            r = {**_result(method, seed, 0.3), "num_steps": 3}
            rows.append(r)
            d = run_dir(out, "smollm2_steps", "group", method, seed) / "rollouts"
            rewards = [1.0 if i % 8 < (3 if i < 8 else 8) else 0.0 for i in range(16)]
            for step in (1, 3):
                write_dump(d / f"step_{step:06d}.jsonl",
                           trend_and_shift(n=16, T=60, seed=10 * seed + step).tolist(), rewards,
                           [f"p{i // 8}" for i in range(16)])
    published = mechanism_sections("smollm2_steps", rows, out, docs)
    study = docs / "images" / "smollm2_steps_study"
    (study / "results").mkdir(parents=True)
    for r in rows:
        write_result(r, study / "results" / f"{r['method'].lower()}_seed_{r['seed']}.json")

    again = tmp_path / "again"
    main([str(study), "--out", str(again)])
    pepo3 = run_dir(again, "smollm2_steps", "group", "PEPO", 1) / "rollouts" / "step_000003.jsonl"
    original = run_dir(out, "smollm2_steps", "group", "PEPO", 1) / "rollouts" / "step_000003.jsonl"
    assert pepo3.read_bytes() == original.read_bytes()
    # step 1 is published once per seed (GRPO's), so only those come back
    assert sorted(p.relative_to(again).as_posix() for p in again.rglob("step_*.jsonl")) == [
        f"smollm2_steps/group/{m}/seed_{s}/rollouts/step_{n:06d}.jsonl"
        for m, s, n in [("grpo", 0, 1), ("grpo", 0, 3), ("grpo", 1, 1), ("grpo", 1, 3),
                        ("pepo", 0, 3), ("pepo", 1, 3)]]
    assert mechanism_sections("smollm2_steps", rows, again, tmp_path / "docs2") == published


def test_a_dump_of_an_unknown_method_is_named(tmp_path):
    """Catches a dump whose name does not parse, or names no method, restored somewhere
    compare never reads, and the good dumps before it written all the same."""
    import gzip

    from pepo.study.restore import restore_dumps

    d = tmp_path / "mechanism" / "before" / "rollouts"
    d.mkdir(parents=True)
    for name in ("grpo_seed_0_step_000001.jsonl.gz", "ppo_seed_0_step_000001.jsonl.gz"):
        with gzip.open(d / name, "wt", encoding="utf-8") as f:
            f.write("{}\n")
    with pytest.raises(ValueError, match="ppo_seed_0_step_000001.jsonl.gz: not a published dump"):
        restore_dumps(tmp_path / "mechanism", tmp_path / "out", "smollm2_steps")
    assert not (tmp_path / "out").exists()


def test_a_truncated_dump_is_named_and_leaves_no_temporary(tmp_path):
    """Catches gzip's EOFError as a traceback naming no file, and the half-written
    ``.jsonl.tmp`` it left beside the run's dumps."""
    import gzip

    from pepo.study.restore import restore_dumps

    d = tmp_path / "mechanism" / "before" / "rollouts"
    d.mkdir(parents=True)
    whole = gzip.compress(b'{"step": 1}\n' * 2000)
    (d / "grpo_seed_0_step_000001.jsonl.gz").write_bytes(whole[: len(whole) // 2])
    with pytest.raises(ValueError, match=r"grpo_seed_0_step_000001.jsonl.gz: cannot be "
                                         r"decompressed \(EOFError"):
        restore_dumps(tmp_path / "mechanism", tmp_path / "out", "smollm2_steps")
    assert not list((tmp_path / "out").rglob("*.tmp"))


def test_a_dump_there_already_gzipped_or_not_is_kept(tmp_path):
    """A run that dumped its rollouts compressed (``step_N.jsonl.gz``, as the recipe may) has
    them: catches the published dump written beside it as ``step_N.jsonl`` (two dumps of one
    step, pooled twice by the mechanism tables)."""
    import gzip

    from pepo.study.compare import run_dir
    from pepo.study.restore import restore_dumps

    d = tmp_path / "mechanism" / "before" / "rollouts"
    d.mkdir(parents=True)
    for seed in (0, 1):
        with gzip.open(d / f"grpo_seed_{seed}_step_000001.jsonl.gz", "wt", encoding="utf-8") as f:
            f.write('{"step": 1}\n')
    run = run_dir(tmp_path / "out", "smollm2_steps", "group", "GRPO", 0) / "rollouts"
    run.mkdir(parents=True)
    (run / "step_000001.jsonl.gz").write_bytes(gzip.compress(b'{"step": 1, "mine": 1}\n'))
    assert restore_dumps(tmp_path / "mechanism", tmp_path / "out", "smollm2_steps") == (1, 1)
    assert sorted(p.name for p in run.iterdir()) == ["step_000001.jsonl.gz"]


def test_results_of_two_tasks_beside_one_mechanism_folder_are_refused(tmp_path, capsys):
    """A mechanism folder's dumps carry no task: catches them restored under whichever task
    came first when the results folder holds two tasks' runs."""
    from pepo.study.restore import main

    study = tmp_path / "study"
    _publish(study / "results", [_result("GRPO", 0, 0.4),
                                 {**_result("PEPO", 0, 0.5), "task": "smollm2_other"}])
    (study / "mechanism" / "before" / "rollouts").mkdir(parents=True)
    with pytest.raises(SystemExit, match="results of several tasks \\(smollm2_other, "
                                         "smollm2_steps\\) beside one mechanism/ folder"):
        main([str(study), "--out", str(tmp_path / "out")])


def test_every_published_result_is_named_by_its_methods_slug():
    """The published studies' files (``docs/images/*/results``) and every run directory of
    theirs are named ``slug(method)``: a change to ``slug`` makes ``restore`` and ``compare``
    look for other names, and a published study is run again from scratch. Catches ``τ``
    written as ``_`` (the τ-sweep's two methods then differ by their value alone), and two
    methods of one mode sharing a directory."""
    import json
    from pathlib import Path

    from pepo.study.methods import MODES, methods, slug

    root = Path(__file__).resolve().parents[2] / "docs" / "images"
    published = sorted(root.glob("*/results/*_seed_*.json"))
    assert len(published) >= 100
    for path in published:
        r = json.loads(path.read_text(encoding="utf-8"))
        assert path.name == f"{slug(r['method'])}_seed_{r['seed']}.json", path
    assert slug("PEPO, τ = 0.5") == "pepo__tau___0_5" and slug("80/20") == "80_20"
    for mode in MODES:
        names = [slug(label) for label, _ in methods(mode)]
        assert len(set(names)) == len(names), mode


@pytest.mark.parametrize("text, why", [
    ("5", r"not a result JSON \(a int, not an object\)"),
    ('["task", "mode"]', r"not a result JSON \(a list, not an object\)"),
    ('{"task": "tiny"}', r"not a result JSON, missing mode, method, seed, val_curve"),
    ("{", r"not a result JSON \(Expecting"),
])
def test_a_result_file_that_is_not_one_is_named_in_one_line(tmp_path, text, why):
    """Catches the object check left out: a number failed with a TypeError naming no file
    (``in`` on an int), and a list of the key names passed as a result."""
    from pepo.study.methods import read_result

    path = tmp_path / "result.json"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}: {why}"):
        read_result(path)
