"""The command blocks of the README and the docs, run as written, in order, each document in one
fresh directory (a new user's session), shrunk to a few steps by overrides appended to each.

Commands that need what a new user does not have here (a model or dataset path, a module of
their own, the real SmolLM2 package, a GPU, pip) are left out by the rules in ``SKIP``; the test
checks that the commands it does run include the ones each document is about, so a rule that
grows too wide fails it.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from pepo.training.engines import vllm_available

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent

# (pattern, why it cannot run here)
SKIP = [
    (r"\.\.\.|/models/|/data/|\$", "placeholders for the user's paths"),
    (r"my_config|my_strategies|my_estimators|my_module", "a file of the user's own"),
    (
        r"--config smollm2|eval_smollm2",
        "the real model: tests/training/test_pretrained.py runs a step",
    ),
    (r"qwen3|llama3|eval_math", "the paper's models and datasets"),
    (r"^pip |^pytest|^python benchmarks", "installs, the test suite, benchmarks"),
]

SHRINK_RUN = ["num_steps=2", "save_every=1", "validation.every=1", "validation.samples=1",
              "val_dataset.size=4", "dataset.size=64", "dump_rollouts_every=1", "plot=false"]
SHRINK_GROUP = ["prompts_per_step=2", "micro_batch_size=4"]
SHRINK_SPO = ["prompts_per_step=16", "micro_batch_size=4", "estimator.prior_samples=1"]


def commands(doc: str) -> list[str]:
    """The shell commands of ``doc``'s bash blocks, continuation lines joined, comments cut."""
    text = (ROOT / doc).read_text(encoding="utf-8")
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0].strip() if not line.lstrip().startswith("#") else ""
            if line:
                out.append(" ".join(line.split()))
    return out


def runnable(cmd: str) -> bool:
    if not (cmd.startswith("tune run") or cmd.startswith("python -m pepo")):
        return False
    if "generation.engine=vllm" in cmd and not vllm_available():
        return False
    return not any(re.search(p, cmd) for p, _ in SKIP)


def shrunk(cmd: str) -> list[str]:
    args = shlex.split(cmd)
    if args[:2] == ["tune", "run"]:
        args[0] = str(BIN / "tune")
        if "pepo_recipe" in args:
            config = args[args.index("--config") + 1]
            args += SHRINK_RUN + (SHRINK_SPO if config.endswith("_spo") else SHRINK_GROUP)
        elif "pepo_eval" in args:
            args += ["benchmarks.modsum_val.k=1", "benchmarks.modsum_val.dataset.size=4"]
    elif args[:2] == ["python", "-m"]:
        args[0] = sys.executable
        if "intervene" in args:
            args += ["--k", "1", "--problems", "4"]
    return args


def run_dirs(cmd: str) -> tuple[set[str], str | None]:
    """The run directories ``cmd`` touches, and the one it writes: its ``output_dir=``, or its
    config's default ``pepo_runs/<config>``."""
    named = set(re.findall(r"pepo_runs/[\w.-]+", cmd))
    out = re.search(r"output_dir=(pepo_runs/[\w.-]+)", cmd)
    config = re.search(r"--config (\S+)", cmd)
    written = out.group(1) if out else f"pepo_runs/{config.group(1)}" if config else None
    return named | ({written} if written else set()), written


def run_fresh(cmds: list[str]) -> set[str]:
    """The commands of ``cmds`` that touch no run directory an earlier one wrote: they run as
    they would in a fresh directory (a command written twice is not, if the second resumes)."""
    dirs = [run_dirs(c) for c in cmds]
    written = [{w for _, w in dirs[:i] if w} for i in range(len(cmds))]
    return set(cmds) - {c for c, (touched, _), w in zip(cmds, dirs, written) if touched & w}


def read_later(cmds: list[str]) -> set[str]:
    """The commands of ``cmds`` whose run directory a later one touches."""
    dirs = [run_dirs(c) for c in cmds]
    return {c for i, (c, (_, writes)) in enumerate(zip(cmds, dirs))
            if writes and any(writes in touched for touched, _ in dirs[i + 1:])}


def shared_with_readme(cmds: list[str]) -> set[str]:
    """The commands of a document's ``cmds`` the README's test runs as they would run there: run
    fresh in both documents, and read by no later command of ``cmds``."""
    readme = [c for c in commands("README.md") if runnable(c)]
    return run_fresh(readme) & run_fresh(cmds) - read_later(cmds)


def test_only_commands_that_stand_on_their_own_are_shared():
    """Catches a rule that would leave out a command whose outcome depends on its document or
    that a later command depends on: one reading an earlier run's checkpoint, one resuming the
    default ``pepo_runs/<config>`` an earlier run wrote, a command written twice (the second
    resumes), and a run whose directory a later command reads."""
    cmds = ["tune run pepo_recipe --config tiny",
            "tune run pepo_eval --config eval_tiny checkpoint_dir=pepo_runs/tiny/checkpoints/best",
            "tune run pepo_recipe --config tiny_spo output_dir=pepo_runs/spo",
            "tune run pepo_recipe --config tiny_drift",
            "tune run pepo_recipe --config tiny_spo output_dir=pepo_runs/spo_again",
            "tune run pepo_recipe --config tiny_drift strategy.name=uniform",
            "tune run pepo_recipe --config tiny"]
    assert run_fresh(cmds) == {cmds[2], cmds[3], cmds[4]}
    assert read_later(cmds) == {cmds[0], cmds[3]}
    readme = [c for c in commands("README.md") if runnable(c)]
    assert "tune run pepo_recipe --config tiny" in run_fresh(readme)
    assert "tune run pepo_recipe --config tiny" in read_later(readme)  # pepo_eval reads it


@pytest.mark.parametrize("doc, must_run", [
    ("README.md", ["--config tiny_spo", "pepo_eval", "output_dir=pepo_runs/tiny_80_20",
                   "--nproc_per_node 2", "pepo.study.analysis pepo_runs/tiny/rollouts",
                   "intervene"]),
    ("docs/recipe.md", ["--config tiny_drift", "output_dir=pepo_runs/tiny_80_20_proximal"]),
    ("docs/distributed.md", ["--nproc_per_node 2"]),
])
@pytest.mark.slow
def test_a_documents_commands_run_in_order_in_one_directory(tmp_path, doc, must_run):
    """A command another document shares with the README (``shared_with_readme``) is not run
    again: the README's test runs it."""
    todo = [c for c in commands(doc) if runnable(c)]
    for needle in must_run:
        assert any(needle in c for c in todo), (needle, todo)
    if doc != "README.md":
        shared = shared_with_readme(todo)
        todo = [c for c in todo if c not in shared]
    for cmd in todo:
        out = subprocess.run(shrunk(cmd), cwd=tmp_path, capture_output=True, text=True,
                             timeout=600)
        assert out.returncode == 0, f"{doc}: `{cmd}` failed:\n{out.stderr[-3000:]}"
