"""benchmarks/bench_paper_shape.py: its whole pipeline at the tiny shape on the CPU (one
command, as a GPU user runs it), and its Qwen3-1.7B checkpoint directory checked without
writing the weights."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "bench_paper_shape.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_paper_shape", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """One ``--tiny`` run of the script (2 steps per strategy), its JSON and its output."""
    out = tmp_path_factory.mktemp("paper_shape") / "tiny.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--tiny", "--steps", "2", "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


@pytest.mark.slow
def test_tiny_runs_complete_with_full_length_responses(tiny):
    """Catches: a run that stops before the asked steps (or reports step 1 of 2), a stop token
    or an EOS cutting the responses (random weights, stop tokens switched off: every rollout
    must be ``max_new_tokens`` long), and a batch other than prompts x group size."""
    res, _ = tiny
    assert res["partial"] is False
    s = res["settings"]
    rows = s["prompts_per_step"] * s["group_size"]
    assert s["steps"] == 2 and rows == s["rollouts_per_step"] == 8
    for key, strategy in (("grpo", "uniform"), ("pepo", "proximal_softmax")):
        run, rep = res[f"{key}_run"], res[key]
        assert run["strategy"] == strategy
        assert [h["step"] for h in run["steps"]] == [1, 2]
        assert rep["step"] == 2 and rep["step_time"] == run["steps"][-1]["step_time"]
        assert rep["response_len"] == s["max_new_tokens"] == 24
        assert rep["truncated"] == 1.0
        assert rep["response_tokens"] == rows * s["max_new_tokens"]
        assert math.isfinite(rep["loss"])


@pytest.mark.slow
def test_tiny_split_sums_within_the_step(tiny):
    """Catches: a split that double counts (the strategy's time, which runs inside the old
    log-probs' or the update's part, added beside them; the rewards outside generation), a part
    left out (zero), and a decode rate not computed from the generation's own time."""
    res, _ = tiny
    for key in ("grpo", "pepo"):
        r = res[key]
        parts = [r["gen_time"], r["logprob_time"], r["update_time"]]
        assert all(p > 0 for p in parts) and r["strategy_time"] > 0
        assert sum(parts) <= r["step_time"]
        # the strategy runs inside the old log-probs' part or the update's: never beside them
        assert r["strategy_time"] <= r["logprob_time"] + r["update_time"]
        assert r["strategy_calls"] == 1  # the old log-probs' pass (4 mini-batches)
        assert r["other_time"] == pytest.approx(r["step_time"] - sum(parts), abs=1e-9)
        assert 0 < r["reward_time"] < r["gen_time"]
        assert r["strategy_first_call_s"] > 0  # called (compiled on CUDA) before step 1
        assert r["decode_tokens_per_s"] == pytest.approx(
            r["response_tokens"] / (r["gen_time"] - r["reward_time"]))


@pytest.mark.slow
def test_tiny_pepo_weights_tokens_and_ratio_is_finite(tiny):
    """Catches: the PEPO run silently running GRPO (a strategy override not applied: its token
    advantages would equal the sequence advantage), a GRPO run that is not uniform, all-zero
    rewards (no successes: no advantage for PEPO to weight), and a ratio of the wrong runs."""
    res, _ = tiny
    assert res["grpo"]["token_adv_vs_uniform"] == 0.0
    assert res["pepo"]["token_adv_vs_uniform"] > 1e-4
    for key in ("grpo", "pepo"):
        accuracy = [h["accuracy"] for h in res[f"{key}_run"]["steps"]]
        assert all(0.0 < a < 1.0 for a in accuracy)  # the hashed verdict: mixed groups
    ratio = res["ratio"]["step_time"]
    assert math.isfinite(ratio) and ratio > 0
    assert ratio == pytest.approx(res["pepo"]["step_time"] / res["grpo"]["step_time"])
    t9 = res["paper_runtime_table9"]["Qwen3-1.7B"]
    assert t9["pepo_over_grpo"] == pytest.approx((31 * 60 + 54) / (31 * 60 + 32))


@pytest.mark.slow
def test_tiny_entropy_bench_agrees_with_naive(tiny):
    """Catches: a micro-benchmark that times two different computations (the chunked
    log-probs and entropies must equal the naive full-softmax ones, fp32 here) or no call."""
    res, out = tiny
    e = res["entropy_bench"]
    assert e["vocab"] == res["config"]["vocab_size"] and e["dim"] == res["config"]["hidden_size"]
    assert e["max_abs_diff_logprob"] < 1e-4 and e["max_abs_diff_entropy"] < 1e-4
    for impl in ("chunked", "naive"):
        assert e[impl]["forward_s"] > 0 and e[impl]["forward_backward_s"] > 0
        assert e[impl]["forward_peak_extra_gib"] is None  # CPU: no GPU memory to read
    assert res["checkpoint"]["check"]["tune_params"] == res["checkpoint"]["params"]
    assert "| step s |" in out and out.rstrip().splitlines()[-1].startswith("wall time")


def test_qwen3_1_7b_directory_matches_the_published_model(tmp_path):
    """The full-shape config and tokenizer, without writing 3.4 GB of weights. Catches: a
    config value off from Qwen3-1.7B (its published 1,720,574,976 parameters, 1,409,410,048
    without the tied embedding: a wrong intermediate size, head count or untied head changes
    them), Hugging Face key names that the recipe's loader does not map onto
    ``architecture_from_hf``'s model, and a tokenizer that is not 151,936 tokens with Qwen3's
    special tokens at their ids and the stop tokens ChatTokenizer reads."""
    from pepo.training.tokenizers import ChatTokenizer

    b = _bench()
    cfg = b.QWEN3_1_7B
    shapes = b.hf_shapes(cfg)
    total = sum(math.prod(s) for s in shapes.values())
    assert total == 1_720_574_976
    assert total - math.prod(shapes["model.embed_tokens.weight"]) == 1_409_410_048
    assert "lm_head.weight" not in shapes
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert b.check_shapes(tmp_path, shapes, max_seq_len=5120) == total
    assert b.build_tokenizer(tmp_path, cfg["vocab_size"]) == 151_936
    tok = ChatTokenizer(tmp_path, enable_thinking=True)
    assert tok.vocab_size == cfg["vocab_size"]
    assert tok.stop_tokens == [151645, 151643]  # <|im_end|>, <|endoftext|>
    assert tok.token_id("<think>") == 151667 and tok.token_id("</think>") == 151668
    ids = tok.encode_prompt("x")
    assert ids[0] == 151644 and tok.decode(ids, skip_special_tokens=False).endswith(
        "<|im_start|>assistant\n")
    assert tok.decode([7000, 151935]) == " w7000 w151935"


@pytest.mark.slow
def test_tiny_without_the_old_logprob_pass_counts_every_strategy_call(tmp_path):
    """``--mini-batches 1``: the update makes the old log-probs, and the strategy runs once a
    micro-batch (8 rows in micro-batches of 2: 4 calls). Catches the step's strategy time and
    part peaks taken from its last call alone (the count shows how many the figure sums)."""
    out = tmp_path / "one.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--tiny", "--steps", "1", "--mini-batches", "1", "--out",
         str(out)], cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
        text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text(encoding="utf-8"))
    for key in ("grpo", "pepo"):
        r = res[key]
        assert r["strategy_calls"] == res["settings"]["rollouts_per_step"] // 2 == 4
        assert 0 < r["strategy_time"] <= r["update_time"]
    assert "| strategy calls (1, or one a micro-batch in the update) | 4 | 4 |" in proc.stdout
