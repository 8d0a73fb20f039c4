"""Text files are written and read as UTF-8 whatever the locale: a rollout dump with non-ASCII
tokens, the diagnostics on it and an evaluation table, in a process whose locale is plain ASCII
(``LC_ALL=C`` without Python's UTF-8 coercion, as on many cluster nodes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r'''
import codecs, locale, sys
from pathlib import Path
ENCODING = locale.getpreferredencoding(False)
assert codecs.lookup(ENCODING).name == "ascii", ENCODING
from pepo.training.reporting import write_rollouts
from pepo.training.evaluation import write_results
from pepo.study import analysis

out = Path(sys.argv[1])
tokens = ["Soit", " \u03c4", " \u2265", " 0", ",", " donc", " x\u00b2", " =", " 4", "<|im_end|>"]
records = []
for i in range(8):
    n = 6 + i % 4
    ent = [0.1 * ((i + t) % 5) for t in range(n)]
    records.append({"step": 1, "prompt_id": f"p{i // 4}",
                    "prompt": "R\u00e9soudre x\u00b2 = 4 \u2014 x ?", "answer": "2",
                    "response": "".join(tokens[:n]), "token_ids": list(range(n)),
                    "tokens": tokens[:n], "entropies": ent, "reward": float(i % 2),
                    "success": bool(i % 2), "advantage": 1.0 if i % 2 else -1.0,
                    "token_advantages": [1.0] * n, "token_weights": [1.0] * n,
                    "strategy": "proximal_softmax"})
dump = write_rollouts(out / "rollouts" / "step_000001.jsonl", records)
analysis.run(dump, out / "analysis", windows=[3], heatmap_rollouts=2)
write_results({"r\u00e9sultat": 0.5}, out / "eval", "mod\u00e8le \u03c4")
print("done")
'''


@pytest.mark.slow
def test_dumps_diagnostics_and_tables_under_an_ascii_locale(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LC_", "PYTHONIOENCODING"))}
    env.update(LC_ALL="C", LANG="C", PYTHONUTF8="0", PYTHONCOERCECLOCALE="0",
               PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]))
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], env=env,
                          capture_output=True, timeout=300)
    assert proc.returncode == 0, proc.stderr.decode("utf-8", "replace")[-3000:]
    rows = [json.loads(line) for line in
            (tmp_path / "rollouts" / "step_000001.jsonl").read_text(encoding="utf-8").splitlines()]
    assert rows[0]["tokens"][1] == " \u03c4" and rows[0]["prompt"].startswith("R\u00e9soudre")
    assert "\u03c4" in (tmp_path / "analysis" / "heatmap.html").read_text(encoding="utf-8")
    table = (tmp_path / "eval" / "eval_results.md").read_text(encoding="utf-8")
    assert "mod\u00e8le \u03c4" in table
    assert not list(tmp_path.rglob("*.tmp"))


def test_every_text_read_and_write_names_its_encoding():
    """The static half: no `open`, `read_text` or `write_text` in the package, the recipes or
    the scripts leaves the encoding to the locale (binary modes aside)."""
    import ast

    bad = []
    for path in [*(ROOT / "src").rglob("*.py"), *(ROOT / "recipes").glob("*.py"),
                 *(ROOT / "scripts").glob("*.py"), *(ROOT / "benchmarks").glob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
            if name not in ("open", "read_text", "write_text"):
                continue
            if isinstance(f, ast.Attribute) and name == "open":
                continue  # os.open, zipfile.ZipFile.open, ...: not text files
            modes = [a.value for a in node.args[1:2] if isinstance(a, ast.Constant)]
            modes += [k.value.value for k in node.keywords
                      if k.arg == "mode" and isinstance(k.value, ast.Constant)]
            if any("b" in str(m) for m in modes):
                continue
            if not any(k.arg == "encoding" for k in node.keywords):
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno} {name}(...)")
    assert not bad, "text I/O without encoding=:\n" + "\n".join(bad)
