"""benchmarks/gpu_figures.sh --quick: the GPU figures' one command runs each of its steps on a
CPU and leaves each step's figures where its header says; and bench_weighting_variants.py
--host, the host's cost around a strategy call."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_figures.sh"
NAMES = {"uniform", "entropy_bonus", "global_topk", "global_topk(proximal)", "window_average",
         "proximal_softmax", "gtpo"}


def _run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           **(env or {})}
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_quick_run_writes_every_steps_figures(tmp_path):
    """Catches a step left out or writing elsewhere (a missing file, or one file too many for
    a device call to bring back), the radix run not made (its table absent), and a failing step
    that the script would hide (exit status 0 with "failed" in its output)."""
    out = tmp_path / "figures"
    proc = _run(str(out), "--quick")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "failed" not in proc.stdout and f"done: {out}/" in proc.stdout
    for select in ("sort", "radix"):
        rows = json.loads((out / f"weighting_{select}.json").read_text(encoding="utf-8"))
        assert {r["strategy"] for r in rows} == NAMES
        assert all(r["validate_false_us"] > 0 for r in rows)
        assert "| proximal_softmax |" in (out / f"weighting_{select}.md").read_text(
            encoding="utf-8")
    assert any(r.get("profile") == "global_topk"
               for r in json.loads((out / "profile.json").read_text(encoding="utf-8")))
    assert (out / "kernel_tests.txt").read_text(encoding="utf-8").startswith("torch ")
    # what one device call brings back: at most 8 files (7 without the paper's shape)
    assert sorted(p.name for p in out.iterdir()) == [
        "kernel_tests.txt", "profile.json", "profile.md", "weighting_radix.json",
        "weighting_radix.md", "weighting_sort.json", "weighting_sort.md"]


def test_a_failing_step_fails_the_command_and_the_next_steps_still_run(tmp_path):
    """With a ``torch`` that cannot import first on the path every step fails: each is named,
    the later ones still run, and the command exits 1. Catches a script that stops at the first
    failure (``set -e``) or hides failures behind ``tee``'s exit status; an unknown option is
    refused with exit 2, not ignored."""
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "torch.py").write_text("raise ImportError('no torch here')\n", encoding="utf-8")
    out = tmp_path / "figures"
    proc = _run(str(out), "--quick", env={"PYTHONPATH": str(broken)})
    assert proc.returncode == 1, proc.stdout[-3000:]
    for name in ("strategies, global_topk by sort", "strategies, global_topk by radix",
                 "profiles"):
        assert f"== {name} failed (exit 1)" in proc.stdout
    assert "== profiles (" in proc.stdout
    assert ("failed: strategies, global_topk by sort; strategies, global_topk by radix; "
            "profiles (see their logs") in proc.stdout  # the kernel tests skip: no torch
    proc = _run(str(out), "--quik")
    assert proc.returncode == 2 and "unknown option --quik" in proc.stderr


def test_host_costs_cover_every_strategy(tmp_path):
    """``bench_weighting_variants.py --host --quick``: one row per strategy and the four timings
    of ``uniform``, every one a positive time. Catches a strategy left out of the table, and a
    ``uniform`` that no longer returns what its direct formulation returns (the script checks
    that before timing it)."""
    out = tmp_path / "host.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "bench_weighting_variants.py", "--host", "--quick",
                           "--out", str(out)], cwd=ROOT / "benchmarks", env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = json.loads(out.read_text(encoding="utf-8"))
    assert {r["host_strategy"] for r in rows if "host_strategy" in r} == NAMES - {
        "global_topk(proximal)"}
    assert all(r["wrapper_us"] > 0 and r["wrapper_bare_us"] > 0
               for r in rows if "host_strategy" in r)
    assert len([r for r in rows if "host_uniform" in r and r["us"] > 0]) == 4


def test_radix_blocks_says_it_needs_a_gpu_on_a_cpu(tmp_path):
    """``--radix-blocks`` times Triton kernels on CUDA only: on a CPU it stops with one line
    saying so and writes no figures (catches a mode that times the CPU's strategies and prints
    them as the kernels' settings)."""
    if torch.cuda.is_available():
        pytest.skip("on a GPU the mode runs: gpu_figures.sh's machine")
    out = tmp_path / "radix.json"
    proc = subprocess.run([sys.executable, "bench_weighting_variants.py", "--radix-blocks",
                           "--out", str(out)], cwd=ROOT / "benchmarks",
                          env={**os.environ, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "it needs a CUDA GPU" in proc.stderr
    assert not out.exists()


@pytest.mark.parametrize("bad", ["radix16/4096x8", "sort/4096x8", "4096", "radix12/"])
def test_radix_blocks_names_a_bad_setting(tmp_path, bad):
    """A setting ``--radix-blocks`` cannot run (a select other than the radix ones, no
    ``BLOCKxWARPS``) is one line naming it before any child starts, on any machine (catches a
    name passed to a child that fails with a traceback after minutes of the others)."""
    proc = subprocess.run([sys.executable, "bench_weighting_variants.py", "--radix-blocks",
                           "4096x8", bad, "--out", str(tmp_path / "r.json")],
                          cwd=ROOT / "benchmarks", env={**os.environ, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and f"--radix-blocks {bad}: expected" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_radix_settings_run_under_their_environment():
    """Each ``--radix-blocks`` setting's child runs under the select and histogram it names
    (catches ``radix12/...`` run as the default three byte passes, the comparison then a
    setting against itself)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import bench_weighting_variants as bwv
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    assert bwv.radix_env("radix12/16384x8") == {"PEPO_TOPK_SELECT": "radix12",
                                                "PEPO_TOPK_HIST": "16384x8"}
    assert bwv.radix_env("4096x8") == {"PEPO_TOPK_SELECT": "radix", "PEPO_TOPK_HIST": "4096x8"}
    assert bwv.RADIX_SETTINGS[0] == "4096x8"  # the reference: the default's setting
    for bad in ("radix16/4096x8", "4096", "radix12/"):
        with pytest.raises(ValueError, match=f"--radix-blocks {bad}: expected"):
            bwv.radix_env(bad)


@pytest.mark.slow
@pytest.mark.skipif(not any(shutil.which(c) for c in (os.environ.get("CXX", "c++"), "g++",
                                                      "clang++")),
                    reason="inductor on a CPU needs a C++ compiler")
def test_overhead_compiles_each_setting_afresh(tmp_path):
    """``--overhead`` (a CPU's inductor at the quick shape): every compile setting has its row,
    and each guard setting's filter was consulted. Catches the settings compiled over frames
    Dynamo had cached under the default one (the filter then never runs, and the "tensor guards
    only" and "no guards" rows time the default again), and without a reset before each
    strategy, one strategy's unguarded frame run for the next (an output check fails)."""
    out = tmp_path / "overhead.json"
    proc = subprocess.run([sys.executable, "bench_weighting_variants.py", "--overhead", "--quick",
                           "--out", str(out)], cwd=ROOT / "benchmarks",
                          env={**os.environ, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = {r["compile_setting"]: r for r in json.loads(out.read_text(encoding="utf-8"))}
    assert list(rows) == ["default (the library's)", "tensor guards only", "no guards",
                          "C++ wrapper"], proc.stdout[-2000:]
    assert all(len(r["us"]) == 4 and min(r["us"]) > 0 for r in rows.values())
    assert rows["tensor guards only"]["guard_filter_calls"] > 0
    assert rows["no guards"]["guard_filter_calls"] > 0
