import importlib.util
import os
import re
import shutil

import pytest
import torch

from pepo import _extras


def _share_the_cores() -> None:
    """Under ``pytest -n N`` (pytest-xdist) each worker, and every process its tests start, gets
    its share of the cores as torch threads (``OMP_NUM_THREADS``, unless already set): N
    processes each running torch on every core oversubscribe them, and on 2 cores two such
    processes ran 8-16x slower than one."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers <= 1 or "OMP_NUM_THREADS" in os.environ:
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = max(1, (cores or 1) // workers)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)


_share_the_cores()
# The core install (torch alone) runs the core's tests: tests/*.py and property_tests/. The
# layers above it are tested where the recipe extra is installed (the TRL adapter's tests build
# their model with the recipe's test fixtures, so they go with them).
RECIPE_MISSING = _extras.missing(_extras.RECIPE_MODULES)
collect_ignore = []
if RECIPE_MISSING:
    collect_ignore += ["tasks", "training", "recipes", "study", "integrations/test_trl.py"]
# An adapter's tests run where its framework is installed, and must run where
# PEPO_REQUIRE_TRL=1 / PEPO_REQUIRE_VERL=1 (CI's environments for them) say so.
FRAMEWORKS_MISSING = [
    name
    for name in ("trl", "verl")
    if importlib.util.find_spec(name) is None
    and os.environ.get(f"PEPO_REQUIRE_{name.upper()}") != "1"
]
collect_ignore += [f"integrations/test_{name}.py" for name in FRAMEWORKS_MISSING]
# The Triton kernels run on a GPU, or on a CPU under Triton's interpreter (TRITON_INTERPRET=1,
# as CI runs them): where neither can run, their tests are not collected.
TRITON_CANNOT_RUN = importlib.util.find_spec("triton") is None or not (
    torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1")
if TRITON_CANNOT_RUN:
    collect_ignore += ["test_triton_kernels.py", "test_triton_topk.py"]
# ...and they compile for a GPU wherever Triton is installed, except under the interpreter
# (which replaces the compiled kernels)
TRITON_CANNOT_COMPILE = (importlib.util.find_spec("triton") is None
                         or os.environ.get("TRITON_INTERPRET") == "1")
if TRITON_CANNOT_COMPILE:
    collect_ignore += ["test_triton_compile.py"]


# A user's torch.compile around the core, on a CPU: torch 1.13 has none, and inductor needs a
# C++ compiler (its CXX, else c++ / g++ / clang++)
if not hasattr(torch, "compile") or not any(
        shutil.which(c) for c in (os.environ.get("CXX", "c++"), "g++", "clang++")):
    collect_ignore += ["test_user_compile.py"]


def pytest_addoption(parser):
    parser.addoption(
        "--generate-device", default=None,
        help="run the decoders of tests/training/test_fast_decoder.py on this device (e.g. "
             "cuda): each generate() call moves its model there and back")


# PEPO_NO_SKIPS=1 (CI's recipe stage, which runs the README's test command): a test or a module
# skipped for any reason but a missing GPU (its reason names CUDA or a GPU) fails the run, as the
# other stages' checks do (pytest -q lists no skip: a new one would pass unseen). Counted where
# the reports arrive (xdist's controller); files left out by collect_ignore above are not skips.
_BAD_SKIPS: list = []


def _note_skip(report) -> None:
    if (os.environ.get("PEPO_NO_SKIPS") != "1" or not report.skipped
            or os.environ.get("PYTEST_XDIST_WORKER")):
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    if not re.search(r"cuda|gpu", reason, re.IGNORECASE):
        _BAD_SKIPS.append(f"{report.nodeid}: {reason}")


def pytest_runtest_logreport(report):
    _note_skip(report)


def pytest_collectreport(report):
    _note_skip(report)


def pytest_sessionfinish(session, exitstatus):
    if _BAD_SKIPS:
        print("\nPEPO_NO_SKIPS=1, and tests were skipped for another reason than a missing GPU:\n"
              + "\n".join(_BAD_SKIPS))
        session.exitstatus = 1


def pytest_collection_modifyitems(config, items):
    """The tests marked ``slow`` (whole runs in subprocesses, 8 s to 2.5 minutes each) first: a
    stable sort, so each keeps its place among its kind and the tests sharing a module's
    fixture stay together. Under ``pytest -n`` (work stealing, below) the workers start on them
    and end together on the quick ones, where a long test dealt out late can keep one worker
    busy alone."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``pytest -n`` schedules by work stealing (``--dist worksteal``) where pytest-xdist's
    default would deal the tests out in fixed chunks (``--dist load``, which cannot be told
    apart from asking for it): a worker that runs out takes half of another's queue. Other
    ``--dist`` modes are left to pytest-xdist."""
    if config.getoption("dist") != "load":
        return None
    from xdist.scheduler import WorkStealingScheduling

    return WorkStealingScheduling(config, log)


def pytest_report_header(config):
    lines = []
    if RECIPE_MISSING:
        lines.append(f"pepo: the recipe extra is not installed (missing "
                     f"{', '.join(RECIPE_MISSING)}): collecting the core's tests only")
    if FRAMEWORKS_MISSING:
        lines.append(f"pepo: not installed, their adapters' tests not collected: "
                     f"{', '.join(FRAMEWORKS_MISSING)}")
    if TRITON_CANNOT_RUN:
        lines.append("pepo: Triton's kernels cannot run here (no Triton, or neither a GPU nor "
                     "TRITON_INTERPRET=1): tests/test_triton_kernels.py and "
                     "test_triton_topk.py not collected")
    return lines or None


def ragged_batch(
    lengths, t_max, *, holes=False, seed=0, dtype=torch.float32, scale=2.0, pad_value=float("nan")
):
    """A [B, T] batch of entropies in [0, scale) with the given valid counts per row.

    With ``holes`` the valid tokens are scattered (sorted random positions) instead of forming
    a prefix. Padding holds ``pad_value`` (NaN by default) so any leak shows.
    """
    g = torch.Generator().manual_seed(seed)
    b = len(lengths)
    ent = torch.rand(b, t_max, generator=g) * scale
    mask = torch.zeros(b, t_max, dtype=torch.bool)
    for i, n in enumerate(lengths):
        if holes:
            pos = torch.randperm(t_max, generator=g)[:n]
            mask[i, pos] = True
        else:
            mask[i, :n] = True
    ent = torch.where(mask, ent, torch.tensor(pad_value)).to(dtype)
    adv = torch.randn(b, generator=g)
    return adv, ent, mask


@pytest.fixture
def make_batch():
    return ragged_batch
