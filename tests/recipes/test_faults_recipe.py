"""The recipe under faults and bad input: each test names the defect it would catch.

Subprocess tests are bounded in time and kill only what they started (the trainer they launched
and the verifier workers it reported).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

import pepo_recipe
from tests.proc_helpers import dead
from tests.recipe_helpers import tiny_cfg

ROOT = Path(__file__).resolve().parents[2]
needs_proc = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")


def run(cfg):
    return pepo_recipe.recipe_main(cfg, log_config=False)


def losses(recipe):
    return [h["loss"] for h in recipe.history if "loss" in h]


def cli(monkeypatch, capsys, cfg, cfg_dir=None) -> str:
    """Runs ``tune run pepo_recipe`` on ``cfg`` (written to ``cfg_dir``, by default beside its
    output_dir) in this process; returns its exit message."""
    path = Path(cfg_dir or Path(cfg.output_dir).parent) / f"cfg_{time.monotonic_ns()}.yaml"
    path.write_text(OmegaConf.to_yaml(cfg))
    monkeypatch.setattr(sys, "argv", ["pepo_recipe", "--config", str(path)])
    with pytest.raises(SystemExit) as e:
        pepo_recipe._main()
    return str(e.value.code)


# ----------------------------------------------------------------- errors as one line


MISSING_DATA = {
    "_component_": "pepo.tasks.datasets.load_math_dataset",
    "path": "/nonexistent/x.parquet",
}


@pytest.mark.parametrize("override, message", [
    ({"dataset": MISSING_DATA}, "nonexistent"),
    ({"dataset": {"_component_": "pepo.tasks.problems.modsum_dataset", "sise": 3}}, "dataset: "),
    ({"generation": {"stop_tokens": ["<no such token>"]}}, "<no such token>"),
    ({"optimizer": {"lr": -1.0}}, "optimizer.lr must be a finite number > 0, got -1.0"),
    ({"num_stepz": 3}, "unknown config key 'num_stepz'; did you mean 'num_steps'"),
    ({"resume_from_checkpoint": True}, "holds no checkpoint"),
])
def test_bad_input_from_the_command_line_is_one_line(
    tmp_path, monkeypatch, capsys, override, message
):
    """Catches errors that surface as tracebacks after the model is built."""
    cfg = tiny_cfg(tmp_path, **{k: v for k, v in override.items() if k != "dataset"})
    if "dataset" in override:  # replaced whole, not merged into the bundled section
        cfg.dataset = override["dataset"]
    msg = cli(monkeypatch, capsys, cfg)
    assert msg.startswith("config error:") and message in msg and "\n" not in msg


def test_output_dir_under_a_file_is_refused_before_anything_is_built(tmp_path):
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(ValueError, match="output_dir=.* cannot be a directory: .*a_file is a file"):
        pepo_recipe.PEPORecipe(tiny_cfg(tmp_path, output_dir=str(tmp_path / "a_file" / "run")))


@pytest.mark.parametrize("case", ["dangling", "loop", "proc"])
def test_odd_output_paths_are_one_config_error_naming_the_link(tmp_path, monkeypatch, capsys, case):
    """A link to a scratch mount that is not mounted, a link loop and a place nothing can be
    created passed the old check (their parents exist and are writable) and crashed later."""
    if case == "dangling":
        (tmp_path / "scratch").symlink_to(tmp_path / "not_mounted" / "scratch")
        out, expected = tmp_path / "scratch" / "run", (
            f"{tmp_path / 'scratch'} is a symbolic link to {tmp_path / 'not_mounted' / 'scratch'}, "
            f"which does not exist")
    elif case == "loop":
        (tmp_path / "a").symlink_to("b")
        (tmp_path / "b").symlink_to("a")
        out, expected = (
            tmp_path / "a" / "run",
            f"{tmp_path / 'a'} is a symbolic link to b, which loops",
        )
    else:
        if not Path("/proc/self").is_dir():
            pytest.skip("no /proc here")
        out, expected = Path("/proc/pepo_no_such_dir/run"), "is not a writable directory: /proc/"
    msg = cli(monkeypatch, capsys, tiny_cfg(tmp_path / "w", output_dir=str(out)), cfg_dir=tmp_path)
    assert msg.startswith("config error: output_dir=") and expected in msg and "\n" not in msg
    assert not (tmp_path / "not_mounted").exists()  # nothing created through the link


def test_the_output_dir_check_leaves_nothing_behind(tmp_path, monkeypatch):
    import errno
    import tempfile

    from pepo.training.config import check_output_dir

    check_output_dir(tmp_path / "new" / "deep" / "run")
    assert list(tmp_path.iterdir()) == []  # probed, then removed: the run creates it
    with pytest.raises(ValueError, match=r"^config key '--out' is required$"):
        check_output_dir(None, "--out")  # not a directory named "None" probed
    (tmp_path / "ro").mkdir(mode=0o555)
    if os.access(tmp_path / "ro", os.W_OK):  # root writes anywhere: refuse as a read-only mount
        real = tempfile.mkstemp

        def mkstemp(*args, dir=None, **kwargs):
            if Path(dir).is_relative_to(tmp_path / "ro"):
                raise PermissionError(errno.EROFS, os.strerror(errno.EROFS), str(dir))
            return real(*args, dir=dir, **kwargs)

        monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    with pytest.raises(ValueError, match=r"output_dir=.*ro/run' is not a writable directory: .*ro"):
        check_output_dir(tmp_path / "ro" / "run")
    assert not (tmp_path / "ro" / "run").exists()  # the directory it made to probe is gone

def test_the_output_dir_check_survives_another_process_removing_the_directory(tmp_path,
                                                                              monkeypatch):
    """Two processes of one launch check the same new output_dir: the first's clean-up can
    remove the directory between the second's mkdir and its probe. The second must try again,
    not report an unwritable directory (a check without the retry raises here)."""
    import tempfile

    from pepo.training.config import check_output_dir

    real, calls = tempfile.mkstemp, []

    def racing(*a, dir, **k):
        calls.append(dir)
        if len(calls) == 1:  # the other process's clean-up happens now
            Path(dir).rmdir()
            Path(dir).parent.rmdir()
        return real(*a, dir=dir, **k)

    monkeypatch.setattr(tempfile, "mkstemp", racing)
    check_output_dir(tmp_path / "new" / "run")
    assert len(calls) == 2 and list(tmp_path.iterdir()) == []


def test_the_output_dir_check_survives_the_directory_removed_as_its_mkdir_finds_it(tmp_path,
                                                                                  monkeypatch):
    """The other side of the same race (a two-process run failed on it): another process creates
    the directory, this one's mkdir fails on it (EEXIST), and the other's clean-up removes it
    before mkdir looks at what it found, so ``exist_ok`` does not help. The check must try again;
    one that retries only a vanished directory at the probe reports "File exists" here."""
    import errno

    from pepo.training.config import check_output_dir

    target, real, raced = tmp_path / "new" / "run", os.mkdir, []

    def racing(path, *a, **k):
        if Path(path) == target and target.parent.is_dir() and not raced:
            raced.append(path)
            real(path, *a, **k)  # the other process makes it ...
            os.rmdir(path)  # ... and its clean-up removes it, after this mkdir failed on it
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(path))
        return real(path, *a, **k)

    monkeypatch.setattr(os, "mkdir", racing)
    check_output_dir(target)
    assert raced and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "override, message",
    [
        (
            {"distributed": {"cpu_offload": True}},
            "distributed.cpu_offload=true offloads from a GPU",
        ),
        ({"distributed": {"timeout_s": 0}}, "distributed.timeout_s must be a finite number > 0"),
        ({"distributed": {"mixed_precision": "fp8"}}, "distributed.mixed_precision must be"),
        (
            {"distributed": {"timeout": 5}},
            "unknown config key 'distributed.timeout'; did you mean 'distributed.timeout_s'",
        ),
    ],
)
def test_bad_distributed_settings_are_config_errors(tmp_path, override, message):
    with pytest.raises(ValueError, match=message):
        pepo_recipe.PEPORecipe(tiny_cfg(tmp_path, **override))


def test_a_batch_that_does_not_split_over_the_processes_is_refused(tmp_path):
    from pepo.training.config import check_world_size

    check_world_size(tiny_cfg(tmp_path, prompts_per_step=4, micro_batch_size=2), 2)
    with pytest.raises(ValueError, match="prompts_per_step=3 does not split over 2 processes"):
        check_world_size(tiny_cfg(tmp_path, prompts_per_step=3, micro_batch_size=2), 2)
    with pytest.raises(ValueError, match="micro_batch_size=4 does not divide a process's share"):
        check_world_size(tiny_cfg(tmp_path, prompts_per_step=2, micro_batch_size=4), 2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda_is_an_error_not_a_silent_cpu_run(tmp_path):
    with pytest.raises(ValueError, match="device='cuda' but CUDA is not available"):
        pepo_recipe.PEPORecipe(tiny_cfg(tmp_path, device="cuda"))


# ----------------------------------------------------------------- runs never lost


def test_a_fresh_run_refuses_checkpoints_without_a_marker(tmp_path):
    """Catches a fresh run that checks only ``latest`` and overwrites complete step dirs."""
    run(tiny_cfg(tmp_path, num_steps=2))
    (tmp_path / "run" / "checkpoints" / "latest").unlink()
    with pytest.raises(ValueError, match="already holds a run's checkpoints"):
        pepo_recipe.PEPORecipe(tiny_cfg(tmp_path, num_steps=2))


def test_resume_without_the_marker_continues_from_the_newest_step(tmp_path):
    full = run(tiny_cfg(tmp_path / "full", num_steps=3))
    run(tiny_cfg(tmp_path / "split", num_steps=2))
    (tmp_path / "split" / "run" / "checkpoints" / "latest").unlink()
    second = run(tiny_cfg(tmp_path / "split", num_steps=3, resume_from_checkpoint=True))
    assert second.step == 3
    torch.testing.assert_close(
        torch.tensor(losses(second)), torch.tensor(losses(full)), rtol=0, atol=1e-6
    )


def test_resume_falls_back_past_a_truncated_checkpoint(tmp_path):
    full = run(tiny_cfg(tmp_path / "full", num_steps=3))
    run(tiny_cfg(tmp_path / "split", num_steps=2))  # keeps step_1 and step_2
    newest = tmp_path / "split" / "run" / "checkpoints" / "step_2" / "model.safetensors"
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])
    with pytest.warns(UserWarning, match="step_2 is damaged"):
        second = run(tiny_cfg(tmp_path / "split", num_steps=3, resume_from_checkpoint=True))
    torch.testing.assert_close(
        torch.tensor(losses(second)), torch.tensor(losses(full)), rtol=0, atol=1e-6
    )


@pytest.mark.parametrize(
    "override, changed",
    [
        ({"strategy": {"name": "uniform"}}, r"strategy.name \('proximal_softmax' -> 'uniform'\)"),
        (
            {"estimator": {"group_size": 2}, "micro_batch_size": 2},
            r"estimator.group_size \(4 -> 2\)",
        ),
        ({"seed": 7}, r"seed \(0 -> 7\)"),
        (
            {"strategy": {"proximal_softmax": {"window": 3}}},
            r"strategy.proximal_softmax.window \(11 -> 3\)",
        ),
    ],
)
def test_resume_refuses_what_changes_the_experiment(tmp_path, override, changed):
    """Catches a resume that mixes two experiments in one run."""
    run(tiny_cfg(tmp_path, num_steps=1))
    recipe = pepo_recipe.PEPORecipe(
        tiny_cfg(tmp_path, num_steps=2, resume_from_checkpoint=True, **override)
    )
    with pytest.raises(ValueError, match="would change the experiment: .*" + changed):
        recipe.setup(tiny_cfg(tmp_path, num_steps=2, resume_from_checkpoint=True, **override))
    recipe.cleanup()


def test_a_fresh_run_does_not_append_to_an_earlier_runs_metrics(tmp_path):
    """A run killed before its first checkpoint leaves logs/metrics.txt; a fresh run in that
    output_dir (allowed: no checkpoint) appended to it, two "Step 1" lines of two runs."""
    logs = tmp_path / "run" / "logs"
    logs.mkdir(parents=True)
    (logs / "metrics.txt").write_text("Step 1 | loss:9.0 \nStep 2 | loss:8.0 \n",
                                      encoding="utf-8")
    run(tiny_cfg(tmp_path, num_steps=1))
    lines = (logs / "metrics.txt").read_text(encoding="utf-8").splitlines()
    assert [ln.split("|")[0].strip() for ln in lines] == ["Step 1"] and "loss:9.0 " not in lines[0]


def test_a_fresh_run_leaves_a_metrics_log_outside_its_output_dir_alone(tmp_path):
    """A log directory shared by several runs (outside output_dir) keeps the others' lines."""
    shared = tmp_path / "shared_logs"
    shared.mkdir()
    (shared / "metrics.txt").write_text("Step 1 | loss:9.0 \n", encoding="utf-8")
    cfg = tiny_cfg(tmp_path, num_steps=1)
    cfg.metric_logger.log_dir = str(shared)
    run(cfg)
    lines = (shared / "metrics.txt").read_text(encoding="utf-8").splitlines()
    assert len(lines) == 2 and "9.0" in lines[0]


def test_resume_allows_more_steps_and_other_logging(tmp_path):
    run(tiny_cfg(tmp_path, num_steps=1))
    more = run(tiny_cfg(tmp_path, num_steps=2, resume_from_checkpoint=True, dump_rollouts_every=0,
                        validation={"every": 1}, keep_checkpoints=3, micro_batch_size=2))
    assert more.step == 2


def test_resume_with_num_steps_at_or_below_the_checkpoint_is_refused(tmp_path):
    """Catches a resume that exits 0 having done nothing."""
    run(tiny_cfg(tmp_path, num_steps=2))
    for steps in (1, 2):
        recipe = pepo_recipe.PEPORecipe(
            tiny_cfg(tmp_path, num_steps=steps, resume_from_checkpoint=True)
        )
        with pytest.raises(ValueError,
                           match=f"is at step 2, and num_steps={steps} asks for no more"):
            recipe.setup(tiny_cfg(tmp_path, num_steps=steps, resume_from_checkpoint=True))
        recipe.cleanup()


# ----------------------------------------------------------------- non-finite values


def test_a_nan_logit_skips_the_optimizer_steps_it_reaches(tmp_path):
    """A NaN in the rollout policy's logits (step 1, row 0) makes that row's log-probs and
    entropies NaN; the step's mini-batch holding it is skipped and counted, the run goes on,
    and the weights stay finite. Catches log-prob 0 for a NaN row (a finite wrong value), and a
    strategy that raises on NaN entropies instead of letting the guard skip the step."""
    cfg = tiny_cfg(tmp_path, num_steps=2, ppo_mini_batches=2, micro_batch_size=4)
    recipe = pepo_recipe.PEPORecipe(cfg)
    recipe.setup(cfg)
    in_old_forward = []
    real = recipe._all_logprobs

    def old_logprobs(ro):
        in_old_forward.append(True)
        try:
            return real(ro)
        finally:
            in_old_forward.pop()

    poisoned = []

    def poison(module, args, output):
        if recipe.step == 1 and in_old_forward and not poisoned:
            poisoned.append(1)  # the first micro-batch only
            output = output.clone()
            output[0] = float("nan")  # row 0 of the rollout policy's forward at step 1
        return output

    recipe._all_logprobs = old_logprobs
    recipe.model.register_forward_hook(poison)
    before_bad = recipe.nonfinite_total
    recipe.run()
    h = [m for m in recipe.history if "loss" in m]
    assert before_bad == 0 and h[0]["nonfinite_skipped"] == 1  # one mini-batch of two skipped
    assert h[1]["nonfinite_skipped"] == 1 and torch.isfinite(torch.tensor(h[1]["loss"]))
    assert all(torch.isfinite(p).all() for p in recipe.model.parameters())


# ----------------------------------------------------------------- signals and kills


def _write_cfg(tmp_path: Path, **overrides) -> Path:
    cfg = tiny_cfg(tmp_path, reward={"_component_": "tests.recipe_helpers.VerifiedDigitReward"},
                   save_every=1, keep_checkpoints=2, **overrides)
    path = tmp_path / "cfg.yaml"
    path.write_text(OmegaConf.to_yaml(cfg, resolve=True))
    return path


def _env(tmp_path: Path, **extra) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
            "PEPO_TEST_WORKER_PIDS": str(tmp_path / "worker_pids"), **extra}


def _wait_for(path: Path, lines: int, proc: subprocess.Popen, seconds: float = 120.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if path.is_file() and len(path.read_text().split()) >= lines:
            return
        if proc.poll() is not None:
            return
        time.sleep(0.01)
    proc.kill()
    raise AssertionError(f"no progress within {seconds} s")


def _worker_pids(tmp_path: Path) -> set[int]:
    f = tmp_path / "worker_pids"
    return {int(x) for x in f.read_text().split()} if f.is_file() else set()


@pytest.mark.slow
@needs_proc
def test_sigterm_stops_after_the_step_with_a_checkpoint_and_no_orphans(tmp_path):
    """Catches verifier workers that outlive a SIGTERMed trainer, and a trainer that dies
    without its last step's checkpoint (or hangs)."""
    cfg = _write_cfg(tmp_path, num_steps=500)
    progress = tmp_path / "progress"
    proc = subprocess.Popen([sys.executable, "-m", "tests.trainer_driver", str(cfg)], cwd=ROOT,
                            env=_env(tmp_path, PEPO_TEST_PROGRESS=str(progress)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(progress, 2, proc)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, err[-2000:]
    assert "stopped by SIGTERM at step" in err
    done = int(progress.read_text().split()[-1])
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text().strip() == f"step_{done}"
    assert done < 500
    pids = _worker_pids(tmp_path)
    assert pids and all(dead(pid, 10) for pid in pids)


@pytest.mark.slow
@needs_proc
def test_killed_at_random_points_the_run_resumes_exactly_and_leaves_no_processes(tmp_path):
    """Ten SIGKILLs: six at random moments after a random step (some land inside checkpoint
    writes), four inside the checkpoint writer's phases (after the weights file, after the
    state file, after the directory rename, after the marker rename). Each time the run is
    restarted as a user would (resuming when checkpoints exist). The final weights and every
    step's loss must equal an uninterrupted run's, and no verifier worker may survive."""
    steps = 40
    rng = random.Random(1234)
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "killed"
    ref_dir.mkdir()
    run_dir.mkdir()
    subprocess.run(
        [sys.executable, "-m", "tests.trainer_driver", str(_write_cfg(ref_dir, num_steps=steps))],
        cwd=ROOT,
        env=_env(ref_dir),
        check=True,
        timeout=300,
        capture_output=True,
    )
    cfg = _write_cfg(run_dir, num_steps=steps)
    plan = [("random", None)] * 6 + [("write", 1), ("write", 2), ("rename", 1), ("rename", 2)]
    rng.shuffle(plan)
    kills = 0
    latest = run_dir / "run" / "checkpoints" / "latest"
    for kind, n in plan + [("finish", None)]:
        if latest.is_file() and latest.read_text().strip() == f"step_{steps}":
            break  # a kill that landed after the last checkpoint: the run is complete
        progress = run_dir / "progress"
        progress.unlink(missing_ok=True)
        extra = {"PEPO_TEST_PROGRESS": str(progress)}
        if kind in ("write", "rename"):
            extra["PEPO_TEST_KILL"] = f"{kind}:{n}"
        proc = subprocess.Popen([sys.executable, "-m", "tests.trainer_driver", str(cfg)], cwd=ROOT,
                                env=_env(run_dir, **extra), stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
        try:
            if kind == "random":
                _wait_for(progress, rng.randint(1, 2), proc)
                time.sleep(rng.uniform(0.0, 0.03))  # into the checkpoint write, or past it
                proc.kill()
            _, err = proc.communicate(timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()
        if proc.returncode == -signal.SIGKILL:
            kills += 1
        else:  # "finish", or the run ended before the kill landed
            assert proc.returncode == 0, err[-3000:]
    assert latest.read_text().strip() == f"step_{steps}"
    assert kills >= 10
    ref = load_file(str(ref_dir / "run" / "checkpoints" / f"step_{steps}" / "model.safetensors"))
    got = load_file(str(run_dir / "run" / "checkpoints" / f"step_{steps}" / "model.safetensors"))
    for k in ref:
        assert torch.equal(ref[k], got[k]), k
    ref_state = torch.load(ref_dir / "run" / "checkpoints" / f"step_{steps}" / "training_state.pt",
                           weights_only=True)
    got_state = torch.load(run_dir / "run" / "checkpoints" / f"step_{steps}" / "training_state.pt",
                           weights_only=True)
    assert [h.get("loss") for h in got_state["history"]] == [
        h.get("loss") for h in ref_state["history"]
    ]
    pids = _worker_pids(run_dir) | _worker_pids(ref_dir)
    assert len(pids) >= 10 and all(dead(pid, 10) for pid in pids)


# ----------------------------------------------------------------- one run per output_dir


@pytest.mark.slow
@needs_proc
@pytest.mark.parametrize("second_resumes", [False, True])
def test_a_second_run_on_a_live_runs_output_dir_is_refused(tmp_path, monkeypatch, capsys,
                                                          second_resumes):
    """Catches two runs interleaving in one output_dir: both would pass the checkpoint check
    before either saved, then mix metrics, dumps and checkpoints. The second gets one config
    error naming the holder; the first finishes with one metrics line per step and its own
    checkpoints."""
    steps = 12
    cfg_path = _write_cfg(tmp_path, num_steps=steps)
    progress = tmp_path / "progress"
    holder = subprocess.Popen([sys.executable, "-m", "tests.trainer_driver", str(cfg_path)],
                              cwd=ROOT, env=_env(tmp_path, PEPO_TEST_PROGRESS=str(progress)),
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(progress, 2, holder)  # it has saved: a resume would find checkpoints
        assert holder.poll() is None, "the first run ended before the second could start"
        second = OmegaConf.load(cfg_path)
        second.seed = 1  # another experiment, as a double submission with a changed seed
        second.resume_from_checkpoint = second_resumes
        msg = cli(monkeypatch, capsys, second)
        _, err = holder.communicate(timeout=300)
    finally:
        if holder.poll() is None:
            holder.kill()
    run_dir = tmp_path / "run"
    assert msg.startswith(f"config error: output_dir={str(run_dir)!r} is in use by another run "
                          f"(pid {holder.pid} on "), msg
    assert "\n" not in msg
    assert holder.returncode == 0, err[-2000:]
    metric_steps = [int(line.split()[1]) for line in
                    (run_dir / "logs" / "metrics.txt").read_text().splitlines()
                    if line.startswith("Step ") and "loss:" in line]
    assert metric_steps == list(range(1, steps + 1))
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step_{steps}"
    # and the directory is free again once its run has ended
    again = OmegaConf.load(cfg_path)
    again.num_steps = steps + 1
    again.resume_from_checkpoint = True
    assert run(again).step == steps + 1


def test_the_lock_dies_with_its_process(tmp_path):
    from pepo.training.run_lock import RunLock

    code = ("import sys, time; from pepo.training.run_lock import RunLock; "
            "lock = RunLock(sys.argv[1]); print('held', flush=True); time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "out")], cwd=ROOT,
                            env=_env(tmp_path), stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        with pytest.raises(ValueError, match=rf"in use by another run \(pid {proc.pid} on "):
            RunLock(tmp_path / "out")
        proc.kill()
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    with RunLock(tmp_path / "out") as lock:  # a SIGKILLed holder blocks nothing
        assert lock.held
        with pytest.raises(ValueError, match=rf"pid {os.getpid()} on "):
            RunLock(tmp_path / "out", key="--out")
    assert not lock.held
    RunLock(tmp_path / "out").release()


# ----------------------------------------------------------------- diagnostics are not work


def test_a_diagnostic_that_cannot_be_written_warns_once_and_training_goes_on(tmp_path, monkeypatch,
                                                                            caplog):
    """Catches a full disk during a rollout dump or the curves killing the run and losing every
    step since the last checkpoint."""
    import errno
    import logging

    from pepo.training import closing

    calls = []

    def full(path, records):
        calls.append(path)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(pepo_recipe, "write_rollouts", full)
    monkeypatch.setattr(closing, "plot_curves", lambda *a, **k: full(a[1], None))
    cfg = tiny_cfg(tmp_path, num_steps=3, dump_rollouts_every=1, save_every=3, plot=True)
    with caplog.at_level(logging.WARNING):
        recipe = run(cfg)
    assert recipe.step == 3 and len(calls) == 4  # three dumps tried, then the curves
    warnings = [r.getMessage() for r in caplog.records if "could not write" in r.getMessage()]
    assert len(warnings) == 2, warnings  # once per kind
    assert "rollout dump" in warnings[0] and "step_000001.jsonl" in warnings[0]
    assert "No space left on device" in warnings[0] and "training curves" in warnings[1]
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text().strip() == "step_3"


def test_a_failed_dump_leaves_no_temporary_file(tmp_path):
    from pepo.training.reporting import write_rollouts

    with pytest.raises(TypeError):
        write_rollouts(tmp_path / "step_000001.jsonl", [{"ok": 1}, {"bad": object()}])
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
@needs_proc
@pytest.mark.parametrize("presses", [1, 2])
def test_ctrl_c_stops_like_sigterm_in_one_line_and_loses_nothing(tmp_path, presses):
    """Catches Ctrl-C ending in a KeyboardInterrupt traceback without a checkpoint of the step.
    Once: the step finishes, is checkpointed, one line says so, exit 130. Twice: it stops at
    once and names the last checkpoint. The signal goes to the process group, as a terminal
    sends it, so the verifier workers get it too (and must survive the first)."""
    cfg = _write_cfg(tmp_path, num_steps=500)
    progress = tmp_path / "progress"
    # steps of a second or more, so that the second press lands inside the step
    proc = subprocess.Popen([sys.executable, "-m", "tests.trainer_driver", str(cfg)], cwd=ROOT,
                            env=_env(tmp_path, PEPO_TEST_PROGRESS=str(progress),
                                     PEPO_TEST_STEP_SLEEP="1"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        _wait_for(progress, 2, proc)
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        time.sleep(0.3)  # inside step 3 (its first second is the sleep)
        os.killpg(proc.pid, signal.SIGINT)
        if presses == 2:
            time.sleep(0.2)
            os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-2000:]
    latest = (tmp_path / "run" / "checkpoints" / "latest").read_text().strip()
    done = int(progress.read_text().split()[-1])
    if presses == 1:
        assert "stopped by Ctrl-C at step" in err
        assert latest == f"step_{done}"  # the step it was in is finished and saved
    else:
        assert "a second Ctrl-C stopped the run during step" in err
        assert f"the last checkpoint is {tmp_path / 'run' / 'checkpoints' / latest}" in err
        assert latest == f"step_{done}"  # the last finished step; the interrupted one is not
    assert len([line for line in err.splitlines() if "Ctrl-C" in line]) == 2, err[-2000:]
    assert _worker_pids(tmp_path) and all(dead(pid, 10) for pid in _worker_pids(tmp_path))


@pytest.mark.slow
@needs_proc
def test_ctrl_c_during_the_opening_validation_trains_nothing_and_writes_nothing(tmp_path):
    """Catches a stop request that is only looked at after a training step: Ctrl-C during the
    validation before training must not train step 1 and write its checkpoint (as it did, 100 s
    later on SmolLM2), but stop at once, in one line that says nothing was trained or saved."""
    cfg = _write_cfg(tmp_path, num_steps=500, validation={"every": 1, "samples": 1})
    progress, validating = tmp_path / "progress", tmp_path / "validating"
    proc = subprocess.Popen([sys.executable, "-m", "tests.trainer_driver", str(cfg)], cwd=ROOT,
                            env=_env(tmp_path, PEPO_TEST_PROGRESS=str(progress),
                                     PEPO_TEST_VALIDATION_SLEEP=f"30:{validating}"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not validating.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert proc.poll() is None and validating.exists(), proc.communicate()[1][-2000:]
        sent = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)  # as a terminal sends it: the workers get it too
        _, err = proc.communicate(timeout=60)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err[-2000:]
    assert took < 20, f"{took:.1f} s: the validation's 30 s sleep was not interrupted"
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-2000:]
    lines = [line for line in err.splitlines() if "Ctrl-C" in line]
    assert len(lines) == 1 and ("stopped by Ctrl-C before the first training step: nothing was "
                                "trained and no checkpoint was written") in lines[0], err[-2000:]
    assert not progress.exists()  # no step ran
    checkpoints = tmp_path / "run" / "checkpoints"
    assert not checkpoints.exists() or not any(checkpoints.iterdir())
    assert all(dead(pid, 10) for pid in _worker_pids(tmp_path))


@pytest.mark.parametrize("how", ["enospc", "cpp_stream_error", "safetensors"])
def test_a_full_disk_at_a_checkpoint_is_one_line_naming_the_last_intact_one(tmp_path, monkeypatch,
                                                                           capsys, how):
    """Catches ~50 lines of C++ stream errors that never say 'no space' when the disk fills
    during a checkpoint write; the state stays safe (temporaries removed, `latest` intact).
    safetensors reports a full disk as its own error (not an OSError, nor a RuntimeError), as
    it did on a full tmpfs: it escaped as a traceback."""
    import errno
    import shutil as sh

    import pepo.training.checkpointing as ckpt_mod

    real_write = ckpt_mod._write_file
    calls = [0]
    per_checkpoint = 4  # model.safetensors, training_state.pt, checksums.json, metadata.json

    def filling(path, write):
        calls[0] += 1
        if calls[0] > 2 * per_checkpoint:  # the first two checkpoints fit
            if how == "enospc":
                raise OSError(errno.ENOSPC, "No space left on device", str(path))
            if how == "safetensors":  # its message, from a write to a full tmpfs
                from safetensors import SafetensorError

                raise SafetensorError("Error while serializing: I/O error: No space left on "
                                      "device (os error 28)")
            monkeypatch.setattr(sh, "disk_usage", lambda p: sh._ntuple_diskusage(10**9, 10**9, 0))
            raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 64 vs 0")
        return real_write(path, write)

    monkeypatch.setattr(ckpt_mod, "_write_file", filling)
    cfg = tiny_cfg(tmp_path, num_steps=5, save_every=1)
    msg = cli(monkeypatch, capsys, cfg)
    root = tmp_path / "run" / "checkpoints"
    assert msg.startswith(f"error: could not write the checkpoint of step 3 in {root}: no space "
                          f"left on device; the last intact checkpoint is {root / 'step_2'}"), msg
    assert "resume_from_checkpoint=True" in msg and "\n" not in msg
    assert (root / "latest").read_text().strip() == "step_2"
    assert not list(root.glob(".tmp_step_*"))


def test_a_checkpoint_error_that_is_not_space_keeps_its_traceback(tmp_path, monkeypatch):
    import pepo.training.checkpointing as ckpt_mod

    def broken(path, write):
        raise RuntimeError("a bug, not a full disk")

    monkeypatch.setattr(ckpt_mod, "_write_file", broken)
    with pytest.raises(RuntimeError, match="a bug, not a full disk"):
        run(tiny_cfg(tmp_path, num_steps=1, save_every=1))


@pytest.mark.parametrize("value, shown", [
    (None, "returned None (NoneType) for response"),
    ("x", "returned 'x' (str) for response"),
    (1e300, "returned 1e+300 for response"),
    (float("nan"), "returned nan for response"),
])
def test_a_bad_reward_return_is_one_line_naming_the_component(
    tmp_path, monkeypatch, capsys, value, shown
):
    cfg = tiny_cfg(tmp_path)
    cfg.reward = OmegaConf.create({"_component_": "tests.recipe_helpers.BadReward", "value": value})
    msg = cli(monkeypatch, capsys, cfg)
    assert msg.startswith("error: reward tests.recipe_helpers.BadReward returned") and shown in msg
    assert "\n" not in msg and "inf" not in msg.replace("1e+300", "")


@pytest.mark.parametrize("prior", [0, 2])
def test_single_stream_rewards_outside_0_1_are_one_line_naming_the_component(
    tmp_path, monkeypatch, capsys, prior
):
    """SPO's Beta tracker counts rewards as successes. A reward of -1 was a ValueError traceback
    at step 1 without a prior (the estimator's own check, naming no component), a config error
    naming none with one. Catches the range unchecked on either path (training, the prior)."""
    cfg = tiny_cfg(tmp_path, "tiny_spo", num_steps=1)
    cfg.estimator.prior_samples = prior
    cfg.reward = OmegaConf.create({"_component_": "tests.recipe_helpers.BadReward", "value": -1.0})
    msg = cli(monkeypatch, capsys, cfg)
    where = "error: " if prior == 0 else "config error: "  # training, or the prior in setup
    assert msg.startswith(f"{where}reward tests.recipe_helpers.BadReward returned -1.0 for "
                          f"response "), msg
    assert "the single_stream estimator takes rewards in [0, 1]" in msg and "\n" not in msg


def test_non_finite_stop_is_one_line_saying_no_checkpoint_was_written(
    tmp_path, monkeypatch, capsys
):
    """Catches the stop as a traceback, and a message naming a checkpoint directory that was
    never created (save_every=0, stopped at step 1)."""
    import pepo.loss

    real = pepo.loss.clipped_policy_loss
    monkeypatch.setattr(pepo.loss, "clipped_policy_loss",
                        lambda *a, **k: real(*a, **k) * float("nan"))
    msg = cli(monkeypatch, capsys, tiny_cfg(tmp_path, num_steps=3, save_every=0,
                                            max_nonfinite_steps=2))
    assert msg == ("error: 2 optimizer steps in a row had a non-finite loss or gradient "
                   "(max_nonfinite_steps=2); stopping at step 1. No checkpoint was written "
                   "before it."), msg


def test_a_metric_logger_whose_package_is_missing_is_one_config_error(
    tmp_path, monkeypatch, capsys
):
    """TensorBoardLogger without tensorboard was a ModuleNotFoundError traceback, then a second
    one from the logger's __del__."""
    import importlib.util

    if importlib.util.find_spec("tensorboard") is not None:
        pytest.skip("tensorboard is installed here")
    cfg = tiny_cfg(tmp_path)
    cfg.metric_logger = OmegaConf.create({
        "_component_": "torchtune.training.metric_logging.TensorBoardLogger",
        "log_dir": str(tmp_path / "tb")})
    msg = cli(monkeypatch, capsys, cfg)
    assert msg == (
        "config error: metric_logger: torchtune.training.metric_logging.TensorBoardLogger "
        "needs the 'tensorboard' package, which is not installed: pip install tensorboard"
    )
    assert "Exception ignored" not in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_the_output_dir_check_retries_where_a_third_process_made_the_directory_again(
        tmp_path, monkeypatch):
    """Three processes: one's clean-up removes the directory under this one's probe, and a third
    makes it again before this one looks. A check that counts a probe's FileNotFoundError as
    genuine wherever the directory exists gives up here ("No such file or directory")."""
    import errno
    import tempfile

    from pepo.training.config import check_output_dir

    real, calls = tempfile.mkstemp, []

    def racing(*a, dir, **k):
        calls.append(dir)
        if len(calls) == 1:
            Path(dir).rmdir()  # the second process's clean-up ...
            Path(dir).mkdir()  # ... and the third's mkdir, before this one looks
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(dir))
        return real(*a, dir=dir, **k)

    monkeypatch.setattr(tempfile, "mkstemp", racing)
    check_output_dir(tmp_path / "new" / "run")
    assert len(calls) == 2 and list(tmp_path.iterdir()) == []
