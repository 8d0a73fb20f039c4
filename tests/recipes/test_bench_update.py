"""benchmarks/bench_update.py: the FLOPs and GEMM shapes it measures the update against, and
its table on a tiny checkpoint."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "bench_update.py"

SMOLLM2 = {"hidden_size": 576, "intermediate_size": 1536, "vocab_size": 49152,
           "num_attention_heads": 9, "num_key_value_heads": 3, "num_hidden_layers": 30}
QWEN3_1_7B = {"hidden_size": 2048, "intermediate_size": 6144, "vocab_size": 151936,
              "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
              "num_hidden_layers": 28}


def _shapes():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from bench_update import gemm_shapes
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return gemm_shapes


def reference_flops(cfg: dict, tokens: int, response_tokens: int) -> float:
    """6 x (each layer's projection weights x every token + the head's x the response tokens):
    the update's forward and backward products, the head only where log-probs are taken."""
    d, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = cfg.get("head_dim") or d // cfg["num_attention_heads"]
    q = d * cfg["num_attention_heads"] * hd
    kv = d * cfg["num_key_value_heads"] * hd
    layer = q + kv + kv + q + d * f + d * f + f * d  # q, k, v, o, gate, up, down
    return 6.0 * (cfg["num_hidden_layers"] * layer * tokens + v * d * response_tokens)


@pytest.mark.parametrize("cfg", [SMOLLM2, QWEN3_1_7B], ids=["smollm2", "qwen3-1.7b"])
@pytest.mark.parametrize(("rows", "seq", "prompt"), [(8, 88, 47), (2, 12, 8), (16, 2304, 256)])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_flops_are_the_layers_on_every_token_and_the_head_on_the_responses(cfg, rows, seq,
                                                                            prompt, device):
    """Catches the head counted on every token (the prompt's too: 568 GFLOP instead of 504 at
    SmolLM2's 8 x 88 with 47-token prompts), a last vocabulary block (151,936 = 37 x 4,096 +
    384) counted whole or not at all, response rows over 1,024 counted once, and a product
    shape other than the one the head runs (1,024 rows at most; 4,096 columns on a CPU)."""
    shapes = _shapes()(cfg, rows * seq, rows * (seq - prompt), device)
    got = sum(6 * count * m * k * n for _, m, k, n, count in shapes)
    want = reference_flops(cfg, rows * seq, rows * (seq - prompt))
    assert math.isclose(got, want, rel_tol=1e-12)
    (head,) = [s for s in shapes if s[0] == "head"]
    assert head[1] == min(rows * (seq - prompt), 1024) and head[2] == cfg["hidden_size"]
    assert head[3] == (4096 if device == "cpu" else cfg["vocab_size"])


def test_table_on_a_tiny_checkpoint(tmp_path):
    """End to end on a one-layer checkpoint: the printed GFLOP are the reference's, and every
    precision asked for has its two rows (the recipe's mask, plain causal attention) with a
    positive time and a share of the bound that is the printed bound over the printed time."""
    from tests.hf_fixtures import tiny_hf_llama

    model = tiny_hf_llama(tmp_path / "m")
    res = subprocess.run([sys.executable, str(SCRIPT), "--model-dir", str(model), "--rows", "2",
                          "--seq", "12", "--prompt", "5", "--repeats", "1", "--precisions",
                          "fp32", "bf16"], capture_output=True, text=True, timeout=300,
                         cwd=ROOT, env={"OMP_NUM_THREADS": "1", "PATH": "",
                                        "PYTHONPATH": f"{ROOT / 'src'}"})
    assert res.returncode == 0, res.stderr[-3000:]
    import json

    cfg = json.loads((model / "config.json").read_text(encoding="utf-8"))
    m = re.search(r"parameters: (\S+) GFLOP", res.stdout)
    flops = reference_flops(cfg, 24, 14)
    assert m and math.isclose(float(m[1]), flops / 1e9, rel_tol=1e-3)  # 4 digits printed
    rows = [r for r in res.stdout.splitlines() if r.startswith("| fp32 |") or
            r.startswith("| bf16 |")]
    assert len(rows) == 4
    for r in rows:
        cells = [c.strip() for c in r.strip("|").split("|")]
        t, rate, bound = float(cells[2]), float(cells[3]), float(cells[4])
        share = float(cells[5].rstrip(" %"))
        assert t > 0 and bound > 0
        assert math.isclose(rate, flops / t / 1e9, rel_tol=0.01)  # 3-4 digits printed
        assert abs(share - 100 * bound / t) <= 0.5 + 100 * bound / t * 0.01
