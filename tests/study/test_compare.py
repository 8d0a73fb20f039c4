"""The study script's bookkeeping: runs, saved results, the paired statistics and the report,
on a 2-step, 1-seed run of the tiny task."""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import re
import statistics
import sys
from pathlib import Path

import pytest

from pepo.study import runs


@pytest.fixture(scope="module")
def study():
    from pepo.study import compare

    return compare


def test_paired_statistics_match_their_definition(study):
    base = [{"seed": s, "val_after": v} for s, v in enumerate([0.50, 0.60, 0.55, 0.70])]
    runs = [{"seed": s, "val_after": v} for s, v in enumerate([0.55, 0.60, 0.65, 0.72])]
    runs.append({"seed": 9, "val_after": 1.0})  # no baseline for seed 9: not paired
    p = study.paired(runs, base)
    d = [0.05, 0.0, 0.10, 0.02]
    t = statistics.mean(d) / (statistics.stdev(d) / math.sqrt(4))
    assert p["n"] == 4 and (p["wins"], p["ties"], p["losses"]) == (3, 1, 0)
    assert p["mean"] == pytest.approx(statistics.mean(d), abs=1e-12)
    assert p["t"] == pytest.approx(t, rel=1e-12)
    assert p["significant"] == (abs(t) > 3.182)  # df = 3
    assert study.paired(runs, []) is None


@pytest.mark.parametrize("t, significant", [(3.0, False), (3.5, True), (-3.5, True)])
def test_significance_is_at_students_t_with_n_minus_1_degrees_of_freedom(study, t, significant):
    """4 seeds: t = 3.0 lies between the 5% critical values of 4 (2.776) and 3 (3.182) degrees
    of freedom, t = 3.5 between those of 3 and 2 (4.303). Catches n degrees of freedom, a normal
    quantile (1.96) and a too-conservative table value."""
    spread = [-0.01, 0.0, 0.0, 0.01]
    se = statistics.stdev(spread) / 2
    base = [{"seed": i, "val_after": 0.5} for i in range(4)]
    runs = [{"seed": i, "val_after": 0.5 + x + t * se} for i, x in enumerate(spread)]
    p = study.paired(runs, base)
    assert p["t"] == pytest.approx(t, rel=1e-6) and p["significant"] is significant


def test_significance_between_the_old_tables_entries(study):
    """12 seeds, t = 2.21: above t(0.975, 11) = 2.201, below the 2.228 of 10 degrees of freedom
    that the old table's fallback used between its entries 10 and 15."""
    spread = [0.01 * (i - 5.5) for i in range(12)]
    se = statistics.stdev(spread) / math.sqrt(12)
    base = [{"seed": i, "val_after": 0.5} for i in range(12)]
    runs = [{"seed": i, "val_after": 0.5 + x + 2.21 * se} for i, x in enumerate(spread)]
    p = study.paired(runs, base)
    assert p["t"] == pytest.approx(2.21, rel=1e-6) and p["significant"]


@pytest.mark.parametrize("before, after", [
    ([0.5] * 3, [0.52] * 3),
    ([113 / 418, 84 / 418, 184 / 418], [114 / 418, 85 / 418, 185 / 418]),  # last bits differ
])
def test_differences_without_spread_are_not_tested(study, before, after):
    """Every seed the same gain: t would be infinite (or 1e14, where the accuracies are counts
    over 418 and the differences differ in their last bits); the cell says so instead."""
    base = [{"seed": i, "val_after": v} for i, v in enumerate(before)]
    runs = [{"seed": i, "val_after": v} for i, v in enumerate(after)]
    p = study.paired(runs, base)
    assert p["no_spread"] and not p["significant"]
    assert study._paired_cell(p) == f"{100 * p['mean']:+.1f}, no spread (3/0/0)"
    from pepo.study import power

    diffs = [a - b for a, b in zip(after, before)]
    assert math.isnan(power.paired(diffs)["p"])


@pytest.mark.slow
def test_two_step_one_seed_study(study, tmp_path, monkeypatch):
    from pepo.training.precision import cpu_model

    out, docs = tmp_path / "runs", tmp_path / "docs"
    argv = [
        "--tasks",
        "tiny",
        "--seeds",
        "0",
        "--only",
        "group",
        "--methods",
        "PEPO",
        "--steps",
        "2",
        "--out",
        str(out),
        "--docs",
        str(docs),
        "--discussion",
        "",
        "--set",
        "validation.samples=1",
        "val_dataset.size=4",
        "dump_rollouts_every=1",
        "prompts_per_step=2",
        "micro_batch_size=8",
        "--budgets",
        "0",
        "100",
        "--intervention-k",
        "1",
    ]
    calls = []
    real = runs.run_recipe  # the recipe in a child process; its summary read back
    monkeypatch.setattr(runs, "run_recipe",
                        lambda cfg, d, resume=False: calls.append(cfg) or real(cfg, d, resume))
    results = study.main(argv)
    # the baseline is always run; each run used its strategy, seed and the overrides
    assert [(c.strategy.name, c.seed, c.num_steps, c.val_dataset.size) for c in calls] == [
        ("uniform", 0, 2, 4), ("proximal_softmax", 0, 2, 4)]
    assert [r["method"] for r in results] == ["GRPO", "PEPO"]
    for r in results:
        saved = json.loads((study.run_dir(out, "tiny", "group", r["method"], 0)
                            / "result.json").read_text())
        assert saved == r and r["val_curve"][-1] == [2, r["val_after"]]
        assert r["val_curve"][0][0] == 0 and r["val_k"] == 1 and r["num_steps"] == 2
        assert r["val_problems"] == 4  # the prompts validated (not a config key every task has)
        # where it ran and at what precision (tiny trains in fp32), from the run's own log
        assert r["precision"] == "matmuls in the parameters' dtype: compute_dtype=fp32"
        assert r["cpu"] == cpu_model() and r["cpu"]
        assert Path(r["checkpoint"]).name == "step_2" and Path(r["checkpoint"]).is_dir()
    text = (docs / "results.md").read_text()
    grpo, pepo = results
    delta = 100 * (pepo["val_after"] - grpo["val_after"])
    assert f"| PEPO | 1 | {100 * pepo['val_before']:.1f} | {100 * pepo['val_after']:.1f} | " \
           f"{delta:+.1f} (" in text
    assert "| GRPO | 1 |" in text and "(baseline)" in text
    # the intervention table's end points: budget 0 = warm start, 100% = the GRPO checkpoint
    iv = json.loads((out / "tiny" / "intervention.json").read_text())["results"]
    assert iv["global"]["0.0"] == iv["proximal"]["0.0"]
    assert iv["global"]["1.0"] == iv["replacement"]["1.0"]
    assert "### Token intervention (tiny)" in text and "### Entropy structure of tiny" in text
    assert (docs / "images" / "comparison.png").stat().st_size > 0
    # finished runs are read back, not rerun
    calls.clear()
    assert study.main(argv) == results and calls == []
    # a report into other docs has the intervention's table too (read back, not regenerated)
    other = tmp_path / "docs2"
    argv2 = [a if a != str(docs) else str(other) for a in argv]
    assert study.main(argv2) == results and calls == []
    assert "### Token intervention (tiny)" in (other / "results.md").read_text()
    assert (other / "images" / "intervention_tiny" / "intervention.md").is_file()


def test_shards_split_the_runs(study, tmp_path, monkeypatch, capsys):
    ran = []
    monkeypatch.setattr(study, "run_one", lambda task, mode, label, *a: ran.append(label) or {})
    n = len(study.METHODS["single_stream"])
    for i in range(2):
        study.main(["--tasks", "tiny", "--seeds", "0", "--only", "single_stream", "--out",
                    str(tmp_path), "--shard", f"{i}/2"])
        # each shard counts its own share of the plan, and says it is a shard
        share = len(range(i, n, 2))
        assert capsys.readouterr().out.splitlines()[0] == (
            f"{share} run(s) planned (shard {i}/2), 0 finished, under {tmp_path}")
    assert sorted(ran) == sorted(label for label, _ in study.METHODS["single_stream"])
    assert len(set(ran)) == len(ran)


def test_the_reports_opening_paragraph_stands_apart_from_its_first_section(study):
    """A lost comma joined the opening paragraph's last string to the blank line after it: the
    first ``## task`` heading ran into the paragraph."""
    lines = study.report([], [], "python -m pepo.study.compare", {}).splitlines()
    assert lines[2].startswith("Produced by `python -m pepo.study.compare`")
    assert lines[2].endswith("(docs/performance.md measures the weighting's own cost).")
    assert lines[3] == ""


def test_help_gives_each_default_worth_saying():
    """``(default: ...)`` for a value, lists as typed on the command line, a 0 too (0 == False
    hid it), nothing for None, False or an empty list, and nothing added to a help that says
    its default itself."""
    import argparse

    from pepo.study.cli import DefaultsFormatter

    ap = argparse.ArgumentParser(prog="p", formatter_class=DefaultsFormatter)
    ap.add_argument("--seed", type=int, default=0, help="the seed")
    ap.add_argument("--seeds", nargs="+", default=[0, 1, 2], help="the seeds")
    ap.add_argument("--out", default=None, help="where")
    ap.add_argument("--prune", action="store_true", help="prune")
    ap.add_argument("--set", nargs="*", default=[], help="overrides")
    ap.add_argument("--shard", default=(0, 1), help="a shard (default: all of them)")
    ap.add_argument("--share", default="50%", help="a share")  # argparse formats help with %
    text = " ".join(ap.format_help().split())
    assert "the seed (default: 0)" in text and "the seeds (default: 0 1 2)" in text
    assert "a share (default: 50%)" in text
    for bare in ("where", "prune", "overrides"):
        assert f"{bare} (default" not in text
    assert text.count("(default:") == 4


@pytest.mark.parametrize("kind, good, bad", [
    ("window_arg", {"1": 1, "101": 101}, ["0", "4", "-3", "5.0", "x"]),
    ("count_arg", {"0": 0, "7": 7}, ["-1", "1.5", ""]),
    ("positive_arg", {"1": 1}, ["0", "-2"]),
    ("percent_arg", {"0": 0.0, "100": 100.0, "12.5": 12.5}, ["-0.1", "100.1", "nan"]),
    ("probability_arg", {"0": 0.0, "1": 1.0, "0.05": 0.05}, ["-0.01", "1.01", "nan"]),
    ("positive_number_arg", {"1e-6": 1e-6, "3": 3.0}, ["0", "-1", "inf", "nan"]),
    ("shard_arg", {"0/2": (0, 2), "1/2": (1, 2)}, ["2/2", "-1/2", "1", "a/b", "0/0"]),
])
def test_the_studys_option_types_take_their_range_and_refuse_the_rest_in_one_line(
        kind, good, bad):
    """Each type's edges: both ends of a closed range taken (a probability of 0, the 100th
    percentile), the value past each end refused, non-finite numbers refused (``inf`` as a
    learning rate, ``nan`` passing every comparison), the last shard ``N-1/N`` taken and
    ``N/N`` refused, with argparse's one-line error naming the value."""
    import argparse

    import pepo.study.cli as cli

    parse = getattr(cli, kind)
    for text, value in good.items():
        assert parse(text) == value
    for text in bad:
        shown = re.escape(repr(text))  # "5.0": its dot a dot, not any character
        with pytest.raises(argparse.ArgumentTypeError, match=rf"^must be .*, got {shown}$"):
            parse(text)


def test_max_runs_trains_that_many_per_call_and_the_last_call_reports(study, tmp_path, monkeypatch,
                                                                    capsys):
    """A fresh process per run (what a study with vLLM needs: its engine's memory adds up in one
    process): each call trains --max-runs runs, later calls read them back and go on. Each call
    says first what it plans (a study was silent until its first run ended)."""
    ran = []

    def fake(task, mode, label, strategy, seed, out, overrides):
        ran.append(label)
        r = {"task": task, "mode": mode, "method": label, "seed": seed, "val_after": 0.5}
        d = study.run_dir(out, task, mode, label, seed)
        d.mkdir(parents=True, exist_ok=True)
        (d / "result.json").write_text(json.dumps(r), encoding="utf-8")
        return r

    reported = []
    monkeypatch.setattr(study, "run_one", fake)
    monkeypatch.setattr(study, "run_diagnostics", lambda *a: reported.append("diag") or None)
    monkeypatch.setattr(study, "plot", lambda *a: None)
    monkeypatch.setattr(study, "report", lambda *a: "report")
    argv = ["--tasks", "tiny", "--seeds", "0", "--only", "single_stream", "--out", str(tmp_path),
            "--max-runs", "1", "--no-intervention"]
    n = len(study.METHODS["single_stream"])
    for call in range(1, n + 1):
        study.main(argv)
        assert capsys.readouterr().out.splitlines()[0] == (
            f"{n} run(s) planned, {call - 1} finished, under {tmp_path}")
        assert len(ran) == call and len(set(ran)) == call  # one new run per call
        assert (tmp_path / "results.md").is_file() == (call == n) == bool(reported)
    assert sorted(ran) == sorted(label for label, _ in study.METHODS["single_stream"])


def test_runs_of_other_settings_stop_the_report_before_any_section(study, tmp_path):
    """A finished run of 8 steps among runs of 2: --report-only refuses in one line naming it,
    before writing results.json or any section. Catches the check left to the report, after the
    sections (and their copies of every result) were written."""
    for label, _ in study.METHODS["group"][:2]:
        for seed in (0, 1):
            d = study.run_dir(tmp_path, "tiny", "group", label, seed)
            d.mkdir(parents=True)
            steps = 8 if (label, seed) == (study.METHODS["group"][1][0], 1) else 2
            (d / "result.json").write_text(json.dumps(
                {"task": "tiny", "mode": "group", "method": label, "seed": seed,
                 "val_after": 0.5, "num_steps": steps, "val_k": 1, "val_problems": 4}))
    with pytest.raises(SystemExit, match=r"error: run '.*' seed 1 has num_steps=8 where run "):
        study.main(["--tasks", "tiny", "--seeds", "0", "1", "--only", "group", "--out",
                    str(tmp_path), "--report-only", "--no-intervention"])
    assert not (tmp_path / "results.json").exists()


_FAKE_SUMMARY = {  # what a run's summary.json holds: 4 validation prompts, 2 steps
    "val_problems": 4,
    "history": [{"step": 0, "val_accuracy": 0.5}, {"step": 1, "step_time": 1.0},
                {"step": 2, "step_time": 3.0, "val_accuracy": 0.75}]}


def test_runs_held_by_another_process_are_left_to_it(study, tmp_path, monkeypatch, capsys):
    """Several processes on one plan: a run another process holds is skipped (and no report is
    written from a partial set); what a killed run left is removed before it runs again; the
    single-stream runs of a seed share one prior file, the group runs have none."""
    calls = []
    monkeypatch.setattr(runs, "run_recipe",
                        lambda cfg, d, resume=False: calls.append(cfg) or _FAKE_SUMMARY)
    out, docs = tmp_path / "runs", tmp_path / "docs"
    held = study.run_dir(out, "tiny", "single_stream", "SPO", 0)
    (held / "checkpoints" / "step_1").mkdir(parents=True)  # what a killed run left
    argv = ["--tasks", "tiny", "--seeds", "0", "--out", str(out), "--docs", str(docs),
            "--discussion", "", "--no-intervention"]
    with open(held / ".lock", "a") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)  # "another process"
        results = study.main(argv)
    assert "1 run(s) were taken by other processes" in capsys.readouterr().out
    assert not (docs / "results.md").exists()
    n_methods = len(study.METHODS["group"]) + len(study.METHODS["single_stream"])
    assert len(calls) == len(results) == n_methods - 1
    assert "SPO" not in [r["method"] for r in results if r["mode"] == "single_stream"]
    assert (held / "checkpoints" / "step_1").is_dir()  # untouched while held
    prior = str(out / "tiny" / "single_stream" / "prior_seed_0.json")
    assert {c.get("prior_cache") for c in calls if c.estimator.name == "single_stream"} == {prior}
    assert {c.get("prior_cache") for c in calls if c.estimator.name == "group"} == {None}
    r = results[0]
    assert (r["val_before"], r["val_after"], r["step_time_median"]) == (0.5, 0.75, 2.0)
    calls.clear()
    results = study.main(argv)  # the lock is free now: only the held run runs
    assert [c.output_dir for c in calls] == [str(held)]
    assert not (held / "checkpoints").exists()
    assert json.loads((held / "result.json").read_text())["val_after"] == 0.75
    assert len(results) == n_methods and (docs / "results.md").is_file()


def test_a_stopped_run_goes_on_from_its_checkpoint_and_one_finished_by_hand_is_read(
        study, tmp_path, monkeypatch, capsys):
    """A run the study started that stopped (Ctrl-C, SIGTERM) was removed and trained again
    from step 0, its checkpoints deleted, even after the user finished it by hand as the
    recipe's stop message says. Now: the same settings with an intact checkpoint resume
    (``resume_from_checkpoint=True``), also where --out is spelled another way; a closed run
    (``summary.json``) is read, not run; a leftover without an intact checkpoint is removed;
    a checkpoint or a finished run of other settings is refused, naming them, and kept.
    Catches each taken for another, and a directory of step_N names taken for a checkpoint."""
    import torch
    from omegaconf import OmegaConf

    from pepo.training.checkpointing import AtomicCheckpointer
    from pepo.training.reporting import write_summary

    calls = []
    monkeypatch.setattr(runs, "run_recipe",
                        lambda cfg, d, resume=False: calls.append(resume) or _FAKE_SUMMARY)
    out = tmp_path / "runs"
    argv = ["--tasks", "tiny", "--only", "group", "--methods", "GRPO", "--out", str(out),
            "--no-intervention", "--steps", "2", "--seeds"]
    overrides = {"num_steps": 2}

    def stopped(seed, other=None, intact=True):
        d = study.run_dir(out, "tiny", "group", "GRPO", seed)
        d.mkdir(parents=True)
        cfg = runs.run_config("tiny", "group", "GRPO", {"name": "uniform"}, seed, out, overrides)
        # written under --out spelled another way (relative to another directory)
        cfg.output_dir = str(Path(cfg.output_dir).relative_to(tmp_path.parent))
        OmegaConf.save(OmegaConf.merge(cfg, other or {}), d / "config.yaml")
        if intact:
            AtomicCheckpointer(d / "checkpoints").save(1, {"w": torch.zeros(2)}, {"step": 1})
        else:  # what a kill during the first checkpoint's write may leave
            (d / "checkpoints" / "step_1").mkdir(parents=True)
        return d

    d0, d1, d3 = stopped(0), stopped(1), stopped(3, intact=False)
    write_summary(d1, _FAKE_SUMMARY["history"], val_problems=4, num_steps=2, val_samples=8)
    results = study.main([*argv, "0", "1", "3"])
    assert calls == [True, False]  # seed 0 resumed, seed 1 read back, seed 3 started again
    assert [r["went_on"] for r in results] == ["resume", "closed", None]
    assert (d0 / "checkpoints" / "step_1").is_dir() and not (d3 / "checkpoints").exists()
    assert "seed 3: removed what a run without a checkpoint left" in capsys.readouterr().out
    assert results[1]["val_after"] == 0.75 and results[1]["val_problems"] == 4
    d4 = stopped(4, other={"num_steps": 3})
    with pytest.raises(SystemExit, match=r"seed_4 holds a stopped run of other settings: "
                                         r"num_steps \(3 -> 2\); give the same --steps"):
        study.main([*argv, "4"])
    assert (d4 / "checkpoints" / "step_1").is_dir()  # kept
    d5 = stopped(5)  # closed by hand with more steps (the recipe's advice to train further)
    write_summary(d5, _FAKE_SUMMARY["history"], val_problems=4, num_steps=5, val_samples=8)
    with pytest.raises(SystemExit, match=r"seed_5 holds a finished run of other settings: "
                                         r"num_steps \(5 -> 2\)"):
        study.main([*argv, "5"])
    assert calls == [True, False]


@pytest.mark.slow
def test_ctrl_c_stops_the_run_at_a_checkpoint_and_the_next_call_goes_on(tmp_path):
    """Ctrl-C of the study (SIGINT to its process group, as a terminal sends it), then SIGTERM
    to the group (a scheduler, ``timeout``): the run's child was killed by subprocess.run before
    it could save and the study ended in a traceback; a signal passed on as the same kind the
    child already had is its second, which stops it without the step's checkpoint. Now each
    stop leaves a checkpoint, the study says so in a line (exit 130, 143), and the next call
    resumes the run, its log appended. Catches the signal not passed on (the child trains to
    the end), the child killed, the same kind passed on, the traceback, a restart from step 0
    and a log started again."""
    import os
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "runs"
    cmd = [sys.executable, "-m", "pepo.study.compare", "--tasks", "tiny", "--only", "group",
           "--methods", "GRPO", "--seeds", "0", "--steps", "16", "--out", str(out),
           "--no-intervention", "--set", "validation.every=16", "dataset.size=64"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    d = out / "tiny" / "group" / "grpo" / "seed_0"
    stops = []
    for sig, code, after in ((signal.SIGINT, 130, 2), (signal.SIGTERM, 143, None)):
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=env, start_new_session=True)  # a group of its own
        after = after or stops[-1] + 2
        deadline = time.monotonic() + 300
        while not any(int(n) >= after for n in re.findall(
                r"pepo\[uniform\] step (\d+)/16:",
                (d / "recipe.log").read_text() if (d / "recipe.log").is_file() else "")):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.2)
        os.killpg(proc.pid, sig)  # the study and the run's child alike
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == code, err
        assert "Traceback" not in err and (sig == signal.SIGTERM or "goes on from its last "
                                           "checkpoint" in err.splitlines()[-1]), err
        stops.append(int((d / "checkpoints" / "latest").read_text().strip()[len("step_"):]))
        assert after <= stops[-1] < 16 and not (d / "result.json").exists(), stops
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    log = (d / "recipe.log").read_text()
    for stop in stops:
        assert f"Resumed from {d / 'checkpoints' / f'step_{stop}'} at step {stop}" in log
    assert "Ctrl-C: stopping after step" in log.split("Resumed from")[0]  # the first part kept
    assert json.loads((d / "result.json").read_text())["went_on"] == "resume"


@pytest.mark.slow
def test_a_failed_run_raises_with_the_end_of_its_log(study, tmp_path):
    """The recipe runs in a child process: a run that fails (here a config the recipe refuses)
    raises naming the run and quoting its log, instead of reading a summary that is not there.
    Catches an exit code ignored (a missing summary.json would be the only sign)."""
    from omegaconf import OmegaConf

    study.register_resolvers()
    cfg = OmegaConf.load(study.find_config("tiny"))
    cfg = OmegaConf.merge(cfg, {"output_dir": str(tmp_path), "num_steps": 0})
    with pytest.raises(RuntimeError, match=r"failed \(exit code 1\).*\n.*num_steps"):
        runs.run_recipe(cfg, tmp_path)
    assert (tmp_path / "recipe.log").is_file() and not (tmp_path / "summary.json").exists()


def test_summary_round_trip_and_a_missing_summary(tmp_path):
    """write_summary / read_summary keep the history and the facts; reading a run that did not
    finish names the file."""
    from pepo.training.reporting import read_summary, write_summary

    history = [{"step": 0, "val_accuracy": 0.25}, {"step": 1, "step_time": 1.5, "loss": -0.1}]
    write_summary(tmp_path, history, val_problems=3)
    assert read_summary(tmp_path) == {"history": history, "val_problems": 3}
    with pytest.raises(FileNotFoundError, match="summary.json does not exist"):
        read_summary(tmp_path / "nowhere")


def test_window_ablation_runs_only_when_named_and_prune_keeps_the_first_grpo(
        study, tmp_path, monkeypatch):
    """The optional labels (PEPO at W = 11 / 29 / 101) join the plan only when --methods names
    them, with their window; --prune removes every finished run's checkpoints and exported model
    except the first seed's GRPO. Catches an ablation run in every default plan, a window that
    never reaches the strategy, and a prune that deletes the intervention's replacement."""
    calls = []

    def fake_recipe(cfg, d, resume=False):
        calls.append(cfg)
        for name in ("checkpoints/step_2", "hf_model"):
            (d / name).mkdir(parents=True)
        return _FAKE_SUMMARY

    monkeypatch.setattr(runs, "run_recipe", fake_recipe)
    out = tmp_path / "runs"
    base = ["--tasks", "tiny", "--only", "group", "--out", str(out), "--no-intervention"]
    with pytest.raises(SystemExit, match="^error: no finished run of tiny under .*: run the "
                                         "study \\(without --report-only\\) first$"):
        study.main([*base, "--seeds", "0", "--methods", "PEPO", "--report-only"])
    assert calls == [] and not out.exists()  # it trained nothing and wrote no empty report
    study.main([*base, "--seeds", "3", "--methods", "PEPO", "--shard", "0/1"])
    assert [c.strategy.name for c in calls] == ["uniform", "proximal_softmax"]  # no W runs
    calls.clear()
    study.main([*base, "--seeds", "0", "1", "--methods", "PEPO, W = 29", "--prune",
                "--shard", "0/2"])  # a shard: no report, only the runs
    study.main([*base, "--seeds", "0", "1", "--methods", "PEPO, W = 29", "--prune",
                "--shard", "1/2"])
    ran = sorted((c.seed, c.strategy.name, c.strategy.proximal_softmax.window
                  if c.strategy.name == "proximal_softmax" else None) for c in calls)
    assert ran == [(0, "proximal_softmax", 29), (0, "uniform", None),
                   (1, "proximal_softmax", 29), (1, "uniform", None)]
    kept = {(label, s): study.run_dir(out, "tiny", "group", label, s) / "hf_model"
            for label in ("GRPO", "PEPO, W = 29") for s in (0, 1)}
    assert {k for k, p in kept.items() if p.exists()} == {("GRPO", 0)}
    assert (study.run_dir(out, "tiny", "group", "PEPO, W = 29", 1) / "result.json").is_file()
    # runs an earlier call finished (without --prune) are pruned by a call that reads them
    for p in kept.values():
        p.mkdir(exist_ok=True)
    calls.clear()
    study.main([*base, "--seeds", "0", "1", "--methods", "PEPO, W = 29", "--prune"])
    assert calls == [] and {k for k, p in kept.items() if p.exists()} == {("GRPO", 0)}
    for p in kept.values():
        p.mkdir(exist_ok=True)
    study.main([*base, "--seeds", "0", "1", "--methods", "PEPO, W = 29", "--prune",
                "--report-only"])  # reads only: deletes nothing
    assert all(p.exists() for p in kept.values())
    with pytest.raises(SystemExit, match="'PEPO W=7' is not a method"):
        study.main([*base, "--seeds", "0", "--methods", "PEPO W=7"])


def test_powered_sections_pair_by_seed_and_copy_every_result(study, tmp_path):
    """The real-model task's report: simultaneous intervals against GRPO for the main methods
    (the ablation in its own tables, on its seeds: against GRPO and against PEPO at the config's
    W), every result JSON copied under docs. Catches the ablation's Δ taken against GRPO in both
    tables, or its seeds unpaired."""
    from pepo.study import power

    def r(method, seed, after):
        return {"task": "smollm2_steps", "mode": "group", "method": method, "seed": seed,
                "val_before": 0.23, "val_after": after}

    rows = [r("GRPO", s, 0.40 + 0.01 * s) for s in range(4)]
    rows += [r("PEPO", s, 0.42 + 0.01 * s + 0.005 * (s % 2)) for s in range(4)]
    rows += [r("GTPO", s, 0.38 + 0.02 * s) for s in range(4)]
    rows += [r("PEPO, W = 101", s, 0.45 - 0.01 * s) for s in range(2)]
    text = study.powered_sections("smollm2_steps", rows, tmp_path)
    assert len(list((tmp_path / "images" / "smollm2_steps_study" / "results").glob("*.json"))) == 14
    main = power.comparisons(rows, "GRPO", ["PEPO", "GTPO"])  # m = 2: the ablation is apart
    line = next(x for x in text.splitlines() if x.startswith("| PEPO |"))
    v = main["PEPO"]
    assert f"{100 * v['mean']:+.1f} [{100 * v['lo']:+.1f}, {100 * v['hi']:+.1f}]" in line
    abl = text.split("PEPO's window")[1]
    w = power.comparisons([x for x in rows if x["seed"] < 2], "GRPO", ["PEPO", "PEPO, W = 101"])
    line = next(x for x in abl.splitlines() if x.startswith("| PEPO, W = 101 |"))
    assert f"[{100 * w['PEPO, W = 101']['lo']:+.1f}, " in line and "seeds [0, 1]" in abl
    # then each window against PEPO at the config's W, paired on the same seeds: +3.0 and +0.5
    vs = text.split("PEPO's window against PEPO at the config's W")[1]
    line = next(x for x in vs.splitlines() if x.startswith("| PEPO, W = 101 |"))
    v = power.comparisons([x for x in rows if x["seed"] < 2], "PEPO", ["PEPO, W = 101"])
    assert f"{100 * v['PEPO, W = 101']['mean']:+.1f} [" in line and "+1.8 [" in line
    assert "| − PEPO | +3.0 | +0.5 |" in vs


def test_length_curves_come_from_the_result_or_the_run_summary(study, tmp_path):
    """The response-length table: the mean over seeds at the first, middle and last step; a
    result without its curve (written before results carried one) reads the run's summary.json.
    Catches a curve taken from the wrong run, or the mean over steps instead of over seeds."""
    from pepo.training.reporting import write_summary

    out = tmp_path / "runs"

    def r(method, seed, lens=None):
        row = {"task": "smollm2_steps", "mode": "group", "method": method, "seed": seed,
               "val_before": 0.2, "val_after": 0.3 + 0.01 * seed, "checkpoint": "/runs/x"}
        if lens is not None:
            row["len_curve"] = [[i + 1, x] for i, x in enumerate(lens)]
        return row

    rows = [r("GRPO", 0, [100, 90, 80]), r("GRPO", 1, [120, 110, 100]),
            r("PEPO", 0, [100, 50, 30]), r("PEPO", 1)]
    d = study.run_dir(out, "smollm2_steps", "group", "PEPO", 1)
    d.mkdir(parents=True)
    write_summary(d, [{"step": 0, "val_accuracy": 0.2}] + [
        {"step": i + 1, "response_len": x} for i, x in enumerate([110, 70, 40])], val_problems=9)
    text = study.powered_sections("smollm2_steps", rows, tmp_path / "docs", out)
    assert "| GRPO | 2 | 110.0 | 100.0 (step 2) | 90.0 (step 3) |" in text
    assert "| PEPO | 2 | 105.0 | 60.0 (step 2) | 35.0 (step 3) |" in text
    saved = json.loads((tmp_path / "docs" / "images" / "smollm2_steps_study" / "results"
                        / "pepo_seed_1.json").read_text())
    assert saved["len_curve"] == [[1, 110], [2, 70], [3, 40]] and "checkpoint" not in saved
    assert saved["precision"] is None  # no log to read it from
    assert (tmp_path / "docs" / "images" / "smollm2_steps_study" / "lengths.png").is_file()


def test_mechanism_pools_seeds_and_takes_one_warm_start_dump_per_seed(study, tmp_path):
    """Table 1 / Fig. 2 before and after training: the step-1 rollouts of a seed are the same for
    every method, so they count once (GRPO's, else another method's); the last step's are pooled
    over the seeds per method; the proximal column uses the config's W (mean 1/W = 0.2 for
    smollm2_steps's W = 5). Catches duplicated warm-start rollouts, one seed's dump only, and
    the largest window used for Table 1."""
    from tests.study.test_analysis import trend_and_shift, write_dump

    out = tmp_path / "runs"
    rows = []
    for seed in (0, 1):
        for method in ("GRPO", "PEPO"):
            rows.append({"task": "smollm2_steps", "mode": "group", "method": method,
                         "seed": seed, "num_steps": 3, "val_before": 0.2, "val_after": 0.3})
            d = study.run_dir(out, "smollm2_steps", "group", method, seed) / "rollouts"
            # 2 prompts x 8: pass counts 3 and 8 (moderate, easy); GRPO seed 0 dumped no step 1
            rewards = [1.0 if i % 8 < (3 if i < 8 else 8) else 0.0 for i in range(16)]
            for step in (1, 3):
                if (method, seed, step) != ("GRPO", 0, 1):
                    write_dump(d / f"step_{step:06d}.jsonl",
                               trend_and_shift(n=16, T=60, seed=seed).tolist(), rewards,
                               [f"p{i // 8}" for i in range(16)])
    assert study.mechanism_sections("smollm2_steps", rows, tmp_path / "nothing", tmp_path) is None
    text = study.mechanism_sections("smollm2_steps", rows, out, tmp_path / "docs")
    assert "(W = 5)" in text and "before training (step 1), 2 runs" in text
    assert "after training, GRPO (step 3), 2 runs" in text
    assert "| rollouts | 32 | 32 | 32 |" in text  # 16 per seed, each seed once
    table = [x for x in text.splitlines() if x.startswith("| before training (step 1) |")]
    assert [x.split("|")[2].strip() for x in table] == ["moderate", "easy"]
    assert all(x.split("|")[3].strip() == "16" for x in table)  # 8 per seed, each seed once
    assert all(abs(float(x.split("|")[5]) - 0.2) < 0.01 for x in table)
    mech = tmp_path / "docs" / "images" / "smollm2_steps_study" / "mechanism"
    for stage in ("before", "after_grpo", "after_pepo"):
        assert (mech / stage / "positional_bias.png").is_file()
        assert (mech / stage / "heatmap.html").is_file()
    # the kept dumps reproduce a stage's numbers on their own
    from pepo.study import analysis

    kept = sorted(p.name for p in (mech / "before" / "rollouts").iterdir())
    assert kept == ["grpo_seed_1_step_000001.jsonl.gz", "pepo_seed_0_step_000001.jsonl.gz"]
    again = analysis.entropy_profile(analysis.load_dump(mech / "before" / "rollouts"), (5,))
    saved = json.loads((mech / "before" / "profile.json").read_text())
    assert again["hard_share"] == saved["hard_share"] and again["rollouts"] == 32
    assert again["mean_entropy"] == pytest.approx(saved["mean_entropy"], rel=1e-6)


def test_diagnostics_use_the_configs_window(study, tmp_path):
    """The entropy-structure section of a task without the powered study (tiny: W = 11) gives
    its difficulty table and weight mass at the W its strategies trained with. Catches the
    largest of the curves' windows (21) used instead, as the published tiny tables once were,
    and a printed command that would not reproduce them."""
    from tests.study.test_analysis import trend_and_shift, write_dump

    out = tmp_path / "runs"
    rows = [{"task": "tiny", "mode": "group", "method": "PEPO", "seed": 0, "num_steps": 10}]
    d = study.run_dir(out, "tiny", "group", "PEPO", 0) / "rollouts"
    rewards = [1.0 if i % 8 < 3 else 0.0 for i in range(16)]
    write_dump(d / "step_000010.jsonl", trend_and_shift(n=16, T=60).tolist(), rewards,
               [f"p{i // 8}" for i in range(16)])
    text = study.run_diagnostics("tiny", rows, out, tmp_path / "docs", (5, 21))
    assert "--windows 5 11 21 --window 11 --out" in text
    table = text[text.index("by prompt difficulty"):]
    assert "W = 11)" in table.splitlines()[0]
    row = next(x for x in table.splitlines() if x.startswith("| Moderate |"))
    assert abs(float(row.split("|")[4]) - 1 / 11) < 0.01  # proximal entropy's mean is 1/W
    assert "proximal_11_max_abs" in text and "proximal_5_max_abs" in text


def test_the_reported_command_can_be_pasted(study):
    """The report's command quotes a label with spaces and drops where files went: catches a
    plain join ("--methods 80/20, proximal score" is three arguments in a shell) and a machine
    path left in the docs."""
    import shlex

    from pepo.study.cli import command_line

    cmd = command_line(["--tasks", "smollm2_steps", "--methods", "80/20, proximal score",
                        "GTPO", "--out", "/runs/x", "--report-only", "--docs", "/d"])
    assert cmd == ("python -m pepo.study.compare --tasks smollm2_steps --methods "
                   "'80/20, proximal score' GTPO")
    assert shlex.split(cmd)[5:] == ["--methods", "80/20, proximal score", "GTPO"]
    # the forms argparse also takes: --opt=VALUE and a unique prefix (the report read
    # "--out=/tmp/st/runs ... --report --docs=/tmp/st/docs": pasted, it trained nothing)
    cmd = command_line(["--tasks", "tiny", "--out=/runs/x", "--report", "--docs=/d", "--disc",
                        "notes.md", "--shard=0/2", "--sh", "1/2", "--seeds", "0"])
    assert cmd == "python -m pepo.study.compare --tasks tiny --seeds 0"


@pytest.mark.slow
@contextlib.contextmanager
def _study_with_a_stand_in_run(tmp_path, on_sigterm: str = ""):
    """A study of one run whose recipe is a stand-in that writes its pid to ``child.pid``, runs
    ``on_sigterm`` (Python lines) on a SIGTERM and sleeps; yields ``(study process, run pid)``
    once the run started, and kills both when done."""
    import os
    import signal
    import subprocess
    import time

    fake = tmp_path / "fake"
    fake.mkdir()
    handler = ("import signal, sys\ndef stop(*_):\n" + "".join(
        f"    {line}\n" for line in on_sigterm.splitlines()) + "    sys.exit(143)\n"
        "signal.signal(signal.SIGTERM, stop)\n") if on_sigterm else ""
    (fake / "pepo_recipe.py").write_text(
        "import os, pathlib, time\n" + handler +
        "pathlib.Path(os.environ['CHILD_PID_FILE']).write_text(str(os.getpid()))\n"
        "time.sleep(120)\n", encoding="utf-8")
    pid_file = tmp_path / "child.pid"
    env = {**os.environ, "CHILD_PID_FILE": str(pid_file),
           "PYTHONPATH": os.pathsep.join([str(fake), *filter(None, [os.environ.get(
               "PYTHONPATH")])])}
    proc = subprocess.Popen([sys.executable, "-m", "pepo.study.compare", "--tasks", "tiny",
                             "--only", "group", "--methods", "GRPO", "--seeds", "0",
                             "--out", str(tmp_path / "out")], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    child = None
    try:
        deadline = time.monotonic() + 120
        while not pid_file.is_file() or not pid_file.read_text(encoding="utf-8"):
            assert proc.poll() is None, "the study ended before starting its run"
            assert time.monotonic() < deadline, "the run never started"
            time.sleep(0.2)
        child = int(pid_file.read_text(encoding="utf-8"))
        yield proc, child
    finally:
        proc.kill()
        if child is not None:
            try:
                os.kill(child, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_a_terminated_study_takes_its_training_run_with_it(tmp_path):
    """``kill`` (SIGTERM: a scheduler's, a stop script's) of a running study ends the recipe run
    it started too, instead of leaving an orphan that trains on with nobody to record its
    result. Catches the default SIGTERM action (the study dies, its child lives on). The recipe
    is replaced by a stand-in that writes its pid and sleeps."""
    import os
    import signal

    with _study_with_a_stand_in_run(tmp_path) as (study, child):
        study.send_signal(signal.SIGTERM)
        assert study.wait(timeout=60) == 128 + signal.SIGTERM
        with pytest.raises(ProcessLookupError):  # killed and reaped by the study
            os.kill(child, 0)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_study_killed_outright_stops_its_run_and_leaves_a_live_run_alone(study, tmp_path,
                                                                           monkeypatch):
    """``kill -9`` of a study left its recipe run training with nobody to record it, and the
    next call removed that live run's files (its lock file too) and started a second recipe in
    the same directory. Catches the child not told when its parent dies (a stand-in recipe
    writes a file on the SIGTERM it gets), a run directory whose run lock a live process holds
    cleaned up or trained in, and one whose run stops within the wait refused."""
    import os
    import threading
    import time

    from pepo.study import runs
    from pepo.training.run_lock import RunLock

    term = tmp_path / "child.pid.term"
    with _study_with_a_stand_in_run(tmp_path, f"open({str(term)!r}, 'w').close()") as (
            proc, _):
        proc.kill()
        proc.wait(timeout=30)
        deadline = time.monotonic() + 30
        while not term.exists():
            assert time.monotonic() < deadline, "the run was not stopped with its study"
            time.sleep(0.1)
    d = study.run_dir(tmp_path / "out2", "tiny", "group", "GRPO", 0)
    d.mkdir(parents=True)
    (d / "recipe.log").write_text("step 1\n")
    holder = RunLock(d)  # a recipe still running there, which does not stop
    try:
        monkeypatch.setattr(runs, "LIVE_RUN_WAIT_S", 1.0)
        with pytest.raises(ValueError, match=rf"^{d} is still in use by a recipe run \(pid "
                                             rf"{os.getpid()} on .*\) after 1 s, one a study "
                                             r"killed outright left"):
            runs.run_one("tiny", "group", "GRPO", {"name": "uniform"}, 0, tmp_path / "out2", {})
        assert (d / "recipe.log").read_text() == "step 1\n"
        threading.Timer(0.5, holder.release).start()  # one that stops after its step
        runs._check_no_live_run(d, wait_s=30)
        assert (d / "recipe.log").read_text() == "step 1\n"
    finally:
        holder.release()


def _finished(study, out, label, seed, **extra):
    """A finished run's result.json (what --report-only reads)."""
    d = study.run_dir(out, "tiny", "group", label, seed)
    d.mkdir(parents=True, exist_ok=True)
    r = {"task": "tiny", "mode": "group", "method": label, "seed": seed, "val_before": 0.5,
         "val_after": 0.5 + 0.1 * seed + (0.05 if label != "GRPO" else 0.0), "num_steps": 2,
         "val_k": 1, "val_problems": 4, "step_time_median": 1.0,
         "val_curve": [[0, 0.5], [2, 0.6]], **extra}
    (d / "result.json").write_text(json.dumps(r), encoding="utf-8")
    return r


@pytest.mark.parametrize("argv, message", [
    (["--seeds", "0", "0", "1"], "--seeds gives 0 more than once"),
    (["--tasks", "tiny", "tiny"], "--tasks gives tiny more than once"),
    (["--shard", "3/2"], "--shard: must be I/N with 0 <= I < N"),
    (["--shard", "0/0"], "--shard: must be I/N"),
    (["--shard", "1"], "--shard: must be I/N"),
    (["--steps", "0"], "--steps: must be an int >= 1"),
    (["--seeds", "-1"], "--seeds: must be an int >= 0"),
    (["--budgets", "500"], r"--budgets: must be a percentage in \[0, 100\]"),
    (["--intervention-k", "0"], "--intervention-k: must be an int >= 1"),
    (["--max-runs", "0"], "--max-runs: must be an int >= 1"),
])
def test_bad_study_options_are_refused_before_any_run(study, tmp_path, monkeypatch, capsys,
                                                      argv, message):
    """Each was accepted: a repeated seed counted as two paired seeds (the t test with their
    degrees of freedom), a shard past the last ran nothing and exited 0 (0/0 a traceback),
    --steps 0 and --budgets 500 failed after hours of training."""
    monkeypatch.setattr(study, "run_one", lambda *a: pytest.fail("a run started"))
    with pytest.raises(SystemExit) as e:
        study.main(["--out", str(tmp_path), *argv])
    assert e.value.code == 2
    assert re.search(message, capsys.readouterr().err)


def test_runs_finished_under_other_settings_are_not_reused(study, tmp_path, monkeypatch):
    """A finished run records its --steps/--set; a call asking others refuses in one line
    (it printed the new command over the old runs' numbers). Results without the record
    (published ones) are read as before."""
    monkeypatch.setattr(study, "run_one", lambda *a: pytest.fail("a run started"))
    _finished(study, tmp_path, "GRPO", 0, overrides={"num_steps": 60})
    argv = ["--tasks", "tiny", "--seeds", "0", "--only", "group", "--methods", "GRPO",
            "--out", str(tmp_path), "--report-only", "--no-intervention"]
    with pytest.raises(SystemExit, match=r"finished with --steps/--set \{'num_steps': 60\}, and "
                                         r"this call asks \{'optimizer': \{'lr': 1\}, "
                                         r"'num_steps': 120\}: give the same, or another --out"):
        study.main([*argv, "--steps", "120", "--set", "optimizer.lr=1"])
    assert [r["seed"] for r in study.main([*argv, "--steps", "60"])] == [0]
    _finished(study, tmp_path, "GRPO", 0)  # no record: read whatever this call asks
    assert len(study.main([*argv, "--steps", "120"])) == 1


def test_report_only_names_missing_runs_and_the_paired_seeds(study, tmp_path, capsys):
    """Two of three GRPO seeds finished: the report warns that a planned run has no result
    and PEPO's Δ says it pairs 2 seeds (its "seeds" column counts 3; the Δ and the "after"
    columns then cover other seeds, silently before)."""
    for seed in (0, 1, 2):
        _finished(study, tmp_path, "PEPO", seed)
    for seed in (0, 1):
        _finished(study, tmp_path, "GRPO", seed)
    study.main(["--tasks", "tiny", "--seeds", "0", "1", "2", "--only", "group", "--methods",
                "PEPO", "--out", str(tmp_path), "--report-only", "--no-intervention"])
    assert "warning: 1 planned run(s) have no result" in capsys.readouterr().out
    text = (tmp_path / "results.md").read_text(encoding="utf-8")
    (row,) = [line for line in text.splitlines() if line.startswith("| PEPO | 3 |")]
    assert "(2/0/0), 2 paired seeds |" in row


def test_the_intervention_is_made_again_for_other_settings(study, tmp_path, monkeypatch):
    """intervention.json keeps the budgets, k and replacement it was made with: other ones
    run it again (the old table was kept under the new command); a restored result without a
    checkpoint gets no intervention (it raised KeyError)."""
    calls = []

    def fake(argv):
        calls.append(argv)
        dest = Path(argv[argv.index("--out") + 1])
        dest.mkdir(parents=True, exist_ok=True)
        (dest / "intervention.md").write_text("table", encoding="utf-8")
        return {"global": {0.0: 0.5}}

    monkeypatch.setattr(study.intervention, "main", fake)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    grpo = _finished(study, tmp_path, "GRPO", 0, checkpoint=str(ckpt))
    args = (grpo["task"], [grpo], tmp_path, tmp_path)
    assert study.run_intervention(*args, [0, 10], 1) is not None and len(calls) == 1
    assert study.run_intervention(*args, [0, 10], 1) is not None and len(calls) == 1
    study.run_intervention(*args, [0, 30, 50], 2)
    assert len(calls) == 2 and calls[-1][calls[-1].index("--k") + 1] == "2"
    restored = {k: v for k, v in grpo.items() if k != "checkpoint"}
    assert study.run_intervention(grpo["task"], [restored], tmp_path, tmp_path, [0], 1) is None


def test_a_bad_set_is_refused_before_the_first_run(study, tmp_path, monkeypatch):
    """--set foo=1 and --set generation.temperature=-1 passed until the first run failed (a
    traceback, after the earlier runs' hours in a resumed study); each is one line naming the
    method and the key, and nothing runs."""
    monkeypatch.setattr(study, "run_one", lambda *a: pytest.fail("a run started"))
    argv = ["--tasks", "tiny", "--seeds", "0", "--only", "group", "--out", str(tmp_path)]
    with pytest.raises(SystemExit, match=r"error: tiny group GRPO: unknown config key 'foo'"):
        study.main([*argv, "--set", "foo=1"])
    with pytest.raises(SystemExit, match=r"error: tiny group GRPO: generation.temperature "):
        study.main([*argv, "--set", "generation.temperature=-1"])


def test_what_the_study_sets_itself_and_unplanned_methods_are_refused(study, tmp_path,
                                                                      monkeypatch):
    """Catches ``--set seed=7`` merged over each run's seed (every seed the same run, counted
    as independent pairs; also ``output_dir``, ``strategy.name``, the caches), a --methods
    naming only methods outside the modes asked for (only the baseline trained and reported,
    in silence), and a misspelt --discussion dropped from the report in silence."""
    monkeypatch.setattr(study, "run_one", lambda *a: pytest.fail("a run started"))
    argv = ["--tasks", "tiny", "--seeds", "0", "1", "--only", "group", "--out", str(tmp_path)]
    for bad, key, option in (("seed=7", "seed", "--seeds"),
                             ("output_dir=/x", "output_dir", "--out"),
                             ("strategy.name=uniform", "strategy.name", "--methods"),
                             ("strategy=uniform", "strategy.name", "--methods"),
                             ("validation.before_cache=v.json", "validation.before_cache",
                              "--out"), ("prior_cache=p.json", "prior_cache", "--out")):
        own = ("; a registered strategy of your own is not one of them: run it with `tune run "
               "pepo_recipe --config TASK 'imports=[MODULE]' strategy.name=NAME seed=S`, a run "
               "a seed (docs/recipe.md, extending pepo)" if option == "--methods" else "")
        with pytest.raises(SystemExit, match=rf"^error: --set {bad.split('=')[0]}=\.\.\.: the "
                           rf"study sets {key} for each run itself \(give {option} instead"
                           rf"{re.escape(own)}\)$"):
            study.main([*argv, "--set", bad])
    with pytest.raises(SystemExit, match=r"^error: --methods 'my_strategy' is not a method of "
                                         r"the study; known: .*; a registered strategy of your "
                                         r"own is not one of them"):
        study.main([*argv, "--methods", "my_strategy"])
    for given, shown in (("0", "0"), ("true", "True")):  # True is 1 to Python, not a count
        with pytest.raises(SystemExit, match=rf"^error: --set validation.every={shown}: the "
                                             r"study compares validation accuracy"):
            study.main([*argv, "--set", f"validation.every={given}"])
    with pytest.raises(SystemExit, match=r"^error: --methods 'PESPO' is not a method of the "
                       r"tasks and modes asked for \(tiny; group\)$"):
        study.main([*argv, "--methods", "PESPO"])
    with pytest.raises(SystemExit, match=r"^error: --discussion .*nope.md: no such file$"):
        study.main([*argv, "--discussion", str(tmp_path / "nope.md"), "--report-only"])
    from pepo.study.cli import check_set

    check_set({"strategy": {"proximal_softmax": {"window": 5}}, "validation": {"every": 2},
               "num_steps": 3})  # the rest of a section is the user's to set


def test_a_result_json_that_is_not_one_is_named(study, tmp_path):
    """An empty or cut-short result.json (a full disk, an edit) was a JSONDecodeError or
    KeyError traceback from --report-only. Catches it not named in one line."""
    out = tmp_path / "runs"
    d = study.run_dir(out, "tiny", "group", "GRPO", 0)
    d.mkdir(parents=True)
    argv = ["--tasks", "tiny", "--only", "group", "--seeds", "0", "--out", str(out),
            "--no-intervention", "--report-only"]
    for text, shown in (("", r"not a result JSON \(Expecting value"),
                        ('{"task": "tiny"}', "not a result JSON, missing mode, method, seed")):
        (d / "result.json").write_text(text)
        with pytest.raises(SystemExit, match=rf"^error: {d / 'result.json'}: {shown}"):
            study.main(argv)


def test_each_method_keeps_its_look_and_the_figure_shows_the_spread(study, tmp_path,
                                                                  monkeypatch):
    """A method's colour came from matplotlib's cycle in the order of the methods that had
    results, so PEPO was purple in one published figure and red in another; the curves were
    means without the spread the text reports; a mode without results got an empty panel; the
    figures relied on colour alone (GRPO and PEPO merge for a colour-blind reader). Catches
    each: the same look for a method whichever others ran, a dash and marker of its own, a
    band of mean ± SD over the seeds (in %), and one panel per mode that has results."""
    import matplotlib.figure

    figures = []
    save = matplotlib.figure.Figure.savefig
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig",
                        lambda self, *a, **k: (figures.append(self), save(self, *a, **k))[1])
    curves = {"GRPO": (0.4, [0.50, 0.60, 0.55]), "80/20": (0.4, [0.45, 0.40, 0.50]),
              "PEPO": (0.4, [0.60, 0.70, 0.62])}

    def results(labels):
        return [{"task": "tiny", "mode": "group", "method": m, "seed": s, "val_k": 4,
                 "val_curve": [[0, curves[m][0]], [10, end]]}
                for m in labels for s, end in enumerate(curves[m][1])]

    study.plot(results(["GRPO", "PEPO"]), ["tiny"], tmp_path / "a.png")
    study.plot(results(["GRPO", "80/20", "PEPO"]), ["tiny"], tmp_path / "b.png")
    looks = []
    for fig in figures:
        (ax,) = fig.axes  # the single-stream mode has no results: no panel
        assert ax.get_ylabel() == "validation avg@4 (%)"
        looks.append({line.get_label().split(" (")[0]: (line.get_color(), line.get_linestyle(),
                                                      line.get_marker())
                      for line in ax.get_lines()})
        bands = {tuple(round(y, 6) for y in sorted({v[1] for v in c.get_paths()[0].vertices}))
                 for c in ax.collections}
        for m in looks[-1]:  # each band spans mean ± SD at each step, in %
            ends = [100 * v for v in curves[m][1]]
            mean, sd = statistics.fmean(ends), statistics.stdev(ends)
            assert tuple(round(y, 6) for y in sorted({40.0, mean - sd, mean + sd})) in bands
    assert looks[0]["PEPO"] == looks[1]["PEPO"] and looks[0]["GRPO"] == looks[1]["GRPO"]
    assert len({look[1:] for look in looks[1].values()}) == 3  # dash and marker differ too
    assert len({look[0] for look in looks[1].values()}) == 3


def test_paired_pairs_by_seed_not_by_position(study):
    """Catches compare's ``paired`` zipping the runs with the baseline by position: runs listed
    in another order than the baseline's, then a baseline seed missing."""
    base = [{"seed": 1, "val_after": 0.60}, {"seed": 0, "val_after": 0.50},
            {"seed": 2, "val_after": 0.70}]
    runs_ = [{"seed": 0, "val_after": 0.55}, {"seed": 2, "val_after": 0.72},
             {"seed": 1, "val_after": 0.61}]
    p = study.paired(runs_, base)
    d = [0.05, 0.02, 0.01]
    assert p["n"] == 3 and p["mean"] == pytest.approx(statistics.mean(d))
    assert p["sd"] == pytest.approx(statistics.stdev(d))
    p = study.paired(sorted(runs_, key=lambda r: r["seed"]), [base[1], base[2]])
    assert p["n"] == 2 and p["mean"] == pytest.approx((0.05 + 0.02) / 2)


def test_the_table_gives_mean_and_sample_sd_and_the_mean_step_time(study):
    """Catches the table's 'mean ± sample SD over seeds' given as a median or with the
    population SD, and s/step 'averaged over the seeds' given as their median: accuracies 10,
    20, 60 (mean 30, median 20, sample SD 26.5, population SD 21.6), step times 1, 2, 6 s."""
    def r(seed, after, step_time):
        return {"task": "tiny", "mode": "group", "method": "GRPO", "seed": seed, "val_k": 4,
                "val_problems": 40, "num_steps": 2, "val_before": 0.1, "val_after": after,
                "step_time_median": step_time}

    text = study.report([r(0, 0.1, 1.0), r(1, 0.2, 2.0), r(2, 0.6, 6.0)], ["tiny"], "cmd", {})
    row = next(x for x in text.splitlines() if x.startswith("| GRPO |"))
    assert row == "| GRPO | 3 | 10.0 ± 0.0 | 30.0 ± 26.5 | (baseline) | 3.00 |"


def test_the_window_ablation_pairs_on_the_ablations_seeds(study, tmp_path):
    """Catches the window ablation's tables reading every seed of GRPO and PEPO where their
    heading names the ablation's seeds (0 and 1 of 0-3): its PEPO row is the comparison over
    those two seeds, not the main table's four."""
    from pepo.study import power

    def r(method, seed, after):
        return {"task": "smollm2_steps", "mode": "group", "method": method, "seed": seed,
                "val_before": 0.23, "val_after": after}

    rows = [r("GRPO", s, 0.40 + 0.01 * s) for s in range(4)]
    rows += [r("PEPO", s, 0.42 + 0.03 * s * s) for s in range(4)]
    rows += [r("PEPO, W = 101", s, 0.45 - 0.01 * s) for s in range(2)]
    text = study.powered_sections("smollm2_steps", rows, tmp_path)
    abl = text.split("PEPO's window against GRPO")[1].split("PEPO's window against PEPO")[0]
    assert "(seeds [0, 1])" in abl and "| GRPO | 2 |" in abl and "| PEPO | 2 |" in abl
    v = power.comparisons([x for x in rows if x["seed"] < 2], "GRPO",
                          ["PEPO", "PEPO, W = 101"])["PEPO"]
    line = next(x for x in abl.splitlines() if x.startswith("| PEPO |"))
    assert f"{100 * v['mean']:+.1f} [{100 * v['lo']:+.1f}, {100 * v['hi']:+.1f}]" in line


def test_the_intervention_replaces_with_the_lowest_seeds_grpo(study, tmp_path, monkeypatch):
    """Catches the intervention's replacement taken from the first GRPO result listed (or the
    highest seed) rather than the lowest seed's checkpoint, the one ``--prune`` keeps."""
    seen = []

    def fake(argv):
        seen.append(argv)
        dest = Path(argv[argv.index("--out") + 1])
        dest.mkdir(parents=True, exist_ok=True)
        (dest / "intervention.md").write_text("| table |\n", encoding="utf-8")
        return {}

    monkeypatch.setattr(study.intervention, "main", fake)
    results = []
    for seed in (3, 1, 2):
        (tmp_path / f"ck{seed}").mkdir()
        results.append({"task": "tiny", "mode": "group", "method": "GRPO", "seed": seed,
                        "checkpoint": str(tmp_path / f"ck{seed}")})
    (tmp_path / "tiny").mkdir()
    text = study.run_intervention("tiny", results, tmp_path, tmp_path / "docs", [0.0, 0.1], 2)
    assert seen[0][seen[0].index("--replacement") + 1] == str(tmp_path / "ck1")
    assert "the final GRPO checkpoint of seed 1" in text


def test_a_runs_result_is_its_first_and_last_validation_and_median_step(tmp_path):
    """Catches a run's result taking the best validation (0.60 at step 2) as ``val_after``
    rather than the last (0.50), another than step 0's as ``val_before``, or the mean step time
    (3.75 s, pulled by one slow step) for the median (2.5 s)."""
    from omegaconf import OmegaConf

    from pepo.study.methods import run_dir
    from pepo.training.reporting import write_summary

    d = run_dir(tmp_path, "tiny", "group", "PEPO", 0)
    d.mkdir(parents=True)
    write_summary(d, [{"step": 0, "val_accuracy": 0.30},
                      {"step": 1, "step_time": 1.0},
                      {"step": 2, "step_time": 2.0, "val_accuracy": 0.60},
                      {"step": 3, "step_time": 9.0, "val_accuracy": 0.20},
                      {"step": 4, "step_time": 3.0, "val_accuracy": 0.50}], val_problems=9)
    cfg = OmegaConf.create({"output_dir": str(d), "num_steps": 4, "validation": {"samples": 2}})
    r = runs._run("tiny", "group", "PEPO", 0, tmp_path, {}, cfg, how="closed")
    assert (r["val_before"], r["val_after"]) == (0.30, 0.50)
    assert r["val_curve"] == [[0, 0.30], [2, 0.60], [3, 0.20], [4, 0.50]]
    assert r["step_time_median"] == 2.5 and (r["val_k"], r["val_problems"]) == (2, 9)
    assert json.loads((d / "result.json").read_text(encoding="utf-8")) == r  # saved whole
