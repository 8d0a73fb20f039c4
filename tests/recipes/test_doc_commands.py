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
    (r"my_config|my_strategies|my_module", "a file of the user's own"),
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


@pytest.mark.parametrize("doc, must_run", [
    ("README.md", ["--config tiny_spo", "pepo_eval", "output_dir=pepo_runs/tiny_80_20",
                   "--nproc_per_node 2", "pepo.study.analysis pepo_runs/tiny/rollouts",
                   "intervene"]),
    ("docs/recipe.md", ["--config tiny_drift", "output_dir=pepo_runs/tiny_80_20_proximal"]),
    ("docs/distributed.md", ["--nproc_per_node 2"]),
])
def test_a_documents_commands_run_in_order_in_one_directory(tmp_path, doc, must_run):
    todo = [c for c in commands(doc) if runnable(c)]
    for needle in must_run:
        assert any(needle in c for c in todo), (needle, todo)
    for cmd in todo:
        out = subprocess.run(shrunk(cmd), cwd=tmp_path, capture_output=True, text=True,
                             timeout=600)
        assert out.returncode == 0, f"{doc}: `{cmd}` failed:\n{out.stderr[-3000:]}"
