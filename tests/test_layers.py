"""The two layers: the core imports with torch alone, and everything above it says which extra
to install instead of failing deep inside with a bare ``No module named ...``.

Each check runs in a fresh interpreter whose imports of the recipe stack (and of numpy, vLLM,
TRL and verl) are refused by an import hook, so it holds whatever this environment has
installed.
"""

from __future__ import annotations

import ast
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


SRC = Path(pepo.__file__).resolve().parent
RECIPES = Path(__file__).resolve().parents[1] / "recipes"
SUBPACKAGES = {"tasks", "training", "study", "integrations"}
STDLIB = set(sys.stdlib_module_names) | {"__future__"}


def imported(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth (lazy imports inside functions included),
    as dotted names; ``from pepo import training`` also counts as ``pepo.training``."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: relative import (pepo imports absolutely)"
            out.add(node.module)
            if node.module == "pepo":
                out.update(f"pepo.{a.name}" for a in node.names)
    return out


def layer_violations(path: Path, layer: str) -> list[str]:
    """The imports of ``path`` that its layer may not make (docs/architecture.md's table)."""
    bad = []
    for name in sorted(imported(path)):
        top, _, rest = name.partition(".")
        sub = (rest.split(".")[0] or None) if top == "pepo" else None
        if layer == "core":
            ok = top in STDLIB or top == "torch" or (top == "pepo" and sub not in SUBPACKAGES)
        elif layer == "tasks":
            # math-verify and pyarrow (Parquet files) are imported lazily, where they are used
            ok = top in STDLIB or top in ("math_verify", "pyarrow") or (
                top == "pepo" and sub in (None, "tasks", "_extras"))
        elif layer == "training":
            ok = not (sub in ("study", "integrations") or top in ("pepo_recipe", "pepo_eval"))
        elif layer == "recipes":
            ok = sub not in ("study", "integrations")
        elif layer == "study":
            ok = sub != "integrations"
        else:  # integrations: the core and the framework it adapts
            ok = sub not in ("training", "study") and top not in ("pepo_recipe", "pepo_eval")
        if not ok:
            bad.append(f"{path.relative_to(path.parents[1])} ({layer}) imports {name}")
    return bad


def test_imports_point_down_the_layers():
    files = [(p, "core") for p in SRC.glob("*.py")]
    files += [(p, sub) for sub in SUBPACKAGES for p in (SRC / sub).glob("*.py")]
    files += [(p, "recipes") for p in RECIPES.glob("*.py")]
    assert {layer for _, layer in files} == {"core", *SUBPACKAGES, "recipes"}, files
    bad = [v for path, layer in files for v in layer_violations(path, layer)]
    assert bad == []


def test_layer_check_catches_an_upward_import(tmp_path):
    # the rules above, applied to files that break them (a check that passes everything fails)
    (tmp_path / "core").mkdir()
    cases = {
        "core": "def f():\n    from pepo.training import engines\n",
        "tasks": "import torch\n",
        "training": "from pepo import study\n",
        "study": "import pepo.integrations.trl\n",
        "integrations": "from pepo.training.config import x\n",
    }
    for layer, code in cases.items():
        path = tmp_path / "core" / f"{layer}.py"
        path.write_text(code)
        assert len(layer_violations(path, layer)) == 1, layer
    clean = tmp_path / "core" / "clean.py"
    clean.write_text("import math\nimport torch\nfrom pepo import _checks\nimport pepo.loss\n")
    assert layer_violations(clean, "core") == []


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
