"""The two layers: the core imports with torch alone, and everything above it says which extra
to install instead of failing deep inside with a bare ``No module named ...``.

Each check runs in a fresh interpreter whose imports of the recipe stack (and of numpy, vLLM,
TRL and verl) are refused by an import hook, so it holds whatever this environment has
installed.
"""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import pepo
from pepo import _extras

BLOCKED = (*_extras.RECIPE_MODULES, "numpy", "vllm", "trl", "verl", "pyarrow", "scipy")

# The core: every plain module at the top of the package. A new module there is core by where it
# sits, and must import with torch alone.
CORE = sorted(f"pepo.{m.name}" for m in pkgutil.iter_modules(pepo.__path__) if not m.ispkg)
TASKS = ["pepo.tasks", "pepo.tasks.problems", "pepo.tasks.datasets", "pepo.tasks.rewards"]

PRELUDE = textwrap.dedent(f"""
    import importlib.abc, json, sys

    BLOCKED = {BLOCKED!r}

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ModuleNotFoundError(f"No module named {{name!r}} (blocked)", name=name)
            return None

    sys.meta_path.insert(0, Block())
""")


def run_blocked(code: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(code)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_core_lists_the_modules_the_docs_name():
    # catches a core module moved into a subpackage (or the listing above reading the wrong path)
    for name in ("pepo.weighting", "pepo.estimators", "pepo.loss", "pepo.entropy", "pepo.sampling"):
        assert name in CORE
    assert not {"pepo.training", "pepo.study", "pepo.tasks"} & set(CORE)


def test_core_and_tasks_import_and_run_with_torch_alone():
    out = run_blocked(f"""
        import importlib
        for name in {CORE + TASKS!r}:
            importlib.import_module(name)
        import torch
        import pepo.estimators as est
        import pepo.weighting as pw
        from pepo.entropy import logprobs_and_entropy
        from pepo.loss import clipped_policy_loss

        logits = torch.randn(4, 6, 11)
        tokens = torch.randint(0, 11, (4, 6))
        mask = torch.ones(4, 6, dtype=torch.bool)
        lp, ent = logprobs_and_entropy(logits, tokens)
        adv = est.group_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0]), group_size=2)
        tok = pw.get_strategy("proximal_softmax", window=3)(adv, ent, mask)
        loss = clipped_policy_loss(lp, lp, tok, mask)
        heavy = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
        print(json.dumps({{"loss": loss.item(), "sum": tok.sum().item(), "heavy": heavy,
                           "strategies": pw.list_strategies()}}))
    """)
    assert out["heavy"] == []
    # ratio 1: the loss is -sum(token advantages) / tokens (the strategy preserves each row's sum)
    assert out["loss"] == pytest.approx(-out["sum"] / 24, abs=1e-6)
    assert "proximal_softmax" in out["strategies"] and "global_topk" in out["strategies"]


@pytest.mark.parametrize("module", ["pepo.training", "pepo.training.engines", "pepo.study",
                                    "pepo.study.analysis", "pepo_recipe", "pepo_eval"])
def test_recipe_layer_names_the_extra(module):
    out = run_blocked(f"""
        import importlib
        try:
            importlib.import_module({module!r})
        except ImportError as e:
            print(json.dumps({{"type": type(e).__name__, "msg": str(e), "name": e.name}}))
        else:
            print(json.dumps({{"type": None}}))
    """)
    assert out["type"] == "ImportError", out  # not the bare ModuleNotFoundError of a dependency
    assert 'pip install "pepo[recipe]"' in out["msg"]
    assert "missing: torchtune, torchao, transformers" in out["msg"]
    assert out["name"] == "torchtune"


def test_math_verify_reward_names_the_extra():
    out = run_blocked("""
        from pepo.tasks import MathVerify, boxed_match
        assert boxed_match(["\\\\boxed{7}"], ["7"]) == [1.0]  # the plain verifier needs nothing
        try:
            MathVerify(workers=0)
        except ImportError as e:
            print(json.dumps({"msg": str(e)}))
    """)
    assert 'pip install "pepo[recipe]"' in out["msg"] and "math_verify" in out["msg"]


def test_extras_list_matches_pyproject():
    """_extras.RECIPE_MODULES names the recipe extra's packages (import names)."""
    text = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    start = text.index("recipe = [")
    block = text[start:text.index("]", start)]
    dists = [line.split('"')[1] for line in block.splitlines() if line.strip().startswith('"')]
    names = [d.split("=")[0].split(">")[0].split("<")[0].replace("-", "_") for d in dists]
    assert sorted(n for n in names if n != "torch") == sorted(_extras.RECIPE_MODULES)
