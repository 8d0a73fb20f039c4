"""Data parallelism on CPU (gloo): the recipe under torchrun equals the recipe in one process.

The multi-process runs are subprocesses (``python -m torch.distributed.run``, what
``tune run --nproc_per_node N`` starts), bounded in time; the one-process references run in
this process. Tolerances: the processes sum gradients in another order (FSDP's reduce-scatter)
and run smaller batched matmuls than one process, so values agree to float32 rounding (weights
to 1e-6), while every sampled token and every reward must be identical.
"""

from __future__ import annotations

import json
import os
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
from tests.recipe_helpers import tiny_cfg

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed")


def torchrun(cfg, nproc: int, tmp: Path, timeout: float = 300.0, **env) -> subprocess.Popen:
    path = tmp / f"cfg_{nproc}_{time.monotonic_ns()}.yaml"
    path.write_text(OmegaConf.to_yaml(cfg, resolve=True))
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
         "-m", "tests.trainer_driver", str(path)],
        cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **env},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def finish(proc: subprocess.Popen, timeout: float = 300.0) -> str:
    try:
        _, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
    return err


def dump(run_dir: Path, step: int) -> list[dict]:
    return [
        json.loads(x)
        for x in (run_dir / "rollouts" / f"step_{step:06d}.jsonl").read_text().splitlines()
    ]


def final_weights(run_dir: Path, step: int) -> dict:
    return load_file(str(run_dir / "checkpoints" / f"step_{step}" / "model.safetensors"))


def assert_same_run(one: Path, two: Path, steps: int) -> None:
    """Same rollouts and rewards; token advantages, losses and gradient norms to rounding (a
    gradient averaged over the ranks instead of summed halves its norm); weights to 1e-5.

    Not to 1e-6: AdamW moves a weight by ``lr · g / (|g| + eps)`` at its first step, so where a
    gradient element lands near ``eps`` (1e-8) a rounding difference of 1e-11 in it moves the
    weight by ~3e-6 at ``lr = 1e-2`` (one element of 2,048 at seed 0 of the single-stream test,
    after a change of the entropies' rounding only)."""
    for step in range(1, steps + 1):
        a, b = dump(one, step), dump(two, step)
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert x["prompt_id"] == y["prompt_id"] and x["token_ids"] == y["token_ids"]
            assert x["reward"] == y["reward"]
            torch.testing.assert_close(torch.tensor(y["token_advantages"]),
                                       torch.tensor(x["token_advantages"]), rtol=1e-5, atol=1e-6)
    sa = torch.load(one / "checkpoints" / f"step_{steps}" / "training_state.pt", weights_only=True)
    sb = torch.load(two / "checkpoints" / f"step_{steps}" / "training_state.pt", weights_only=True)
    la = torch.tensor([h["loss"] for h in sa["history"] if "loss" in h])
    lb = torch.tensor([h["loss"] for h in sb["history"] if "loss" in h])
    assert len(la) == steps
    torch.testing.assert_close(lb, la, rtol=1e-4, atol=1e-6)
    ga = torch.tensor([h["grad_norm"] for h in sa["history"] if "grad_norm" in h])
    gb = torch.tensor([h["grad_norm"] for h in sb["history"] if "grad_norm" in h])
    assert len(ga) == steps
    torch.testing.assert_close(gb, ga, rtol=1e-4, atol=1e-7)
    wa, wb = final_weights(one, steps), final_weights(two, steps)
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=0, atol=1e-5, msg=k)


def small_cfg(tmp: Path, name: str = "tiny", **overrides):
    return tiny_cfg(tmp, name, num_steps=3, save_every=1, dump_rollouts_every=1, **overrides)


@pytest.mark.slow
def test_two_processes_equal_one_in_group_mode(tmp_path):
    """Catches anything rank-dependent in the step: rollouts seeded per rank, advantages or a
    loss normaliser from the rank's half only, gradients averaged instead of summed, a
    global_topk threshold per rank (the strategy here is 80/20 on the proximal score)."""
    strategy = {"name": "global_topk", "global_topk": {"fraction": 0.3, "score": "proximal"}}
    kw = dict(strategy=strategy, prompts_per_step=4, micro_batch_size=2)
    one = pepo_recipe.recipe_main(small_cfg(tmp_path / "one", **kw), log_config=False)
    err = finish(torchrun(small_cfg(tmp_path / "two", **kw), 2, tmp_path))
    assert (tmp_path / "two" / "run" / "checkpoints" / "latest").is_file(), err[-3000:]
    assert one.dist.world_size == 1
    assert_same_run(tmp_path / "one" / "run", tmp_path / "two" / "run", 3)


@pytest.mark.slow
def test_two_processes_equal_one_in_single_stream_mode_and_trackers_agree(tmp_path):
    """The SPO tracker (values, drift bookkeeping) must be identical on both ranks and equal to
    one process's: catches a tracker updated with a rank's rewards only, or a drift measured
    on a rank's half of the batch. With ``logprobs_from_hidden``: catches the chunked head
    reading the tied weight outside the model's forward, where FSDP2 holds a rank's shard of
    it."""
    kw = dict(micro_batch_size=2, logprobs_from_hidden=True)
    one = pepo_recipe.recipe_main(small_cfg(tmp_path / "one", "tiny_spo", **kw), log_config=False)
    err = finish(torchrun(small_cfg(tmp_path / "two", "tiny_spo", **kw), 2, tmp_path))
    run = tmp_path / "two" / "run"
    assert (run / "estimator_rank1.pt").is_file(), err[-3000:]
    r0 = torch.load(run / "estimator_rank0.pt", weights_only=True)
    r1 = torch.load(run / "estimator_rank1.pt", weights_only=True)
    assert r0 == r1  # bitwise: every rank folds in the same gathered batch
    ref = one.estimator.state_dict()
    assert r0["alpha"].keys() == ref["alpha"].keys()
    for pid in ref["alpha"]:
        assert r0["alpha"][pid] == pytest.approx(ref["alpha"][pid], rel=1e-6)
        assert r0["beta"][pid] == pytest.approx(ref["beta"][pid], rel=1e-6)
    assert r0["drift_total"] == pytest.approx(ref["drift_total"], rel=1e-4)
    assert_same_run(tmp_path / "one" / "run", run, 3)


@pytest.mark.slow
def test_stopped_two_process_run_resumes_exactly_with_two_and_with_one(tmp_path):
    """SIGTERM to torchrun mid-run: every rank stops after the same step with one checkpoint;
    resuming it with 2 processes, or with 1, ends where an uninterrupted run ends. Catches a
    checkpoint of rank 0's shard only, optimizer state that does not reshard, RNG or sampler
    state that is per rank."""
    steps = 6
    cfg = lambda d: tiny_cfg(d, num_steps=steps, save_every=1, keep_checkpoints=10,  # noqa: E731
                             dump_rollouts_every=1, micro_batch_size=2)
    ref = pepo_recipe.recipe_main(cfg(tmp_path / "ref"), log_config=False)
    progress = tmp_path / "progress"
    proc = torchrun(cfg(tmp_path / "two"), 2, tmp_path, PEPO_TEST_PROGRESS=str(progress))
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if progress.is_file() and len(progress.read_text().split()) >= 2:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    err = finish(proc)
    run = tmp_path / "two" / "run"
    stopped = int((run / "checkpoints" / "latest").read_text().strip().split("_")[1])
    assert 2 <= stopped < steps, err[-3000:]
    # what docs/distributed.md tells a requeue script: the job's status is torchrun's (not the
    # ranks' 143), so decide from the `latest` marker, which names a complete checkpoint
    assert proc.returncode not in (0, 143), (proc.returncode, err[-3000:])
    assert (run / "checkpoints" / f"step_{stopped}" / "checksums.json").is_file()
    # a copy of the stopped run resumes with one process
    import shutil

    shutil.copytree(tmp_path / "two", tmp_path / "one_after_two")
    err = finish(torchrun(cfg(tmp_path / "two"), 2, tmp_path))
    assert (run / "checkpoints" / "latest").read_text().strip() == f"step_{steps}", err[-3000:]
    one = pepo_recipe.recipe_main(
        OmegaConf.merge(cfg(tmp_path / "one_after_two"), {"resume_from_checkpoint": True}),
        log_config=False)
    assert one.step == steps
    ref_w = final_weights(tmp_path / "ref" / "run", steps)
    for run_dir in (run, tmp_path / "one_after_two" / "run"):
        got = final_weights(run_dir, steps)
        for k in ref_w:
            torch.testing.assert_close(got[k], ref_w[k], rtol=0, atol=1e-6, msg=(str(run_dir), k))
    assert ref.step == steps


@pytest.mark.slow
def test_a_failing_rank_stops_the_job_with_its_error(tmp_path):
    """Rank 1 raises at step 2 while rank 0 waits for it in a collective: the job must end
    with rank 1's error, in bounded time, not hang until the collective times out."""
    t0 = time.monotonic()
    cfg = tiny_cfg(tmp_path, num_steps=4, micro_batch_size=2, distributed={"timeout_s": 600})
    proc = torchrun(cfg, 2, tmp_path, PEPO_TEST_FAIL_RANK="1")
    err = finish(proc, timeout=240)
    assert proc.returncode != 0
    assert "injected failure on rank 1 at step 2" in err
    assert time.monotonic() - t0 < 200  # well below the 600 s collective timeout


@pytest.mark.slow
def test_a_config_error_under_torchrun_is_printed_once(tmp_path):
    """Each process printed the same `config error:` line (then torchrun's summary)."""
    cfg = tiny_cfg(tmp_path, num_steps=1)
    cfg.optimizer.lr = -1.0
    path = tmp_path / "bad.yaml"
    path.write_text(OmegaConf.to_yaml(cfg, resolve=True), encoding="utf-8")
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         "-m", "pepo_recipe", "--config", str(path)],
        cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    err = finish(proc, timeout=180)
    assert proc.returncode != 0
    lines = [x for x in err.splitlines() if x.startswith("config error:")]
    assert lines == ["config error: optimizer.lr must be a finite number > 0, got -1.0"], err[
        -3000:
    ]


@pytest.mark.parametrize("code, status", [(0, 0), (143, 143), ("error: the disk", 1)])
def test_a_finished_rank_exits_with_its_output_and_without_teardown(tmp_path, code, status):
    """The end of a multi-process run (pepo_recipe._main, the trainer driver): Python's buffered
    output and log lines are written, the status is the run's, and the interpreter's teardown
    (where gloo's worker threads can abort the process: terminate called without an active
    exception) does not run, as an atexit handler shows. Catches a sys.exit (the teardown runs),
    a lost unflushed line, and a message given as the status."""
    script = (
        "import atexit, logging, sys\n"
        "from pepo.training.distributed import exit_without_teardown\n"
        "logging.basicConfig(stream=sys.stderr, level=logging.INFO)\n"
        "atexit.register(lambda: print('TEARDOWN', flush=True))\n"
        "print('the summary line')\n"  # stdout is a pipe: block-buffered, not yet written
        "logging.getLogger('pepo').info('the log line')\n"
        f"exit_without_teardown({code!r})\n"
        "print('after')\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=ROOT, timeout=120, env={  # stdout block-buffered, as in a pipe
                              **{k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"},
                              "PYTHONPATH": str(ROOT / "src")})
    assert proc.returncode == status
    assert proc.stdout == "the summary line\n"
    assert "the log line" in proc.stderr and "TEARDOWN" not in proc.stdout + proc.stderr
    assert (code in proc.stderr) if isinstance(code, str) else "error" not in proc.stderr
