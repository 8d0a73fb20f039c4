"""A tiny random Qwen3 checkpoint in Hugging Face format with a locally built chat tokenizer,
and small dataset files in the published layouts of DeepMath-103K, DAPO-Math-17K, MATH500,
AMC and AIME."""

from __future__ import annotations

import json
import string
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch

QWEN_TEMPLATE = (  # Qwen3's template, cut to what the recipe uses
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<unk>"]


def build_tokenizer(path: Path, think_special: bool = False, unk: str = "<unk>"):
    """A character-level tokenizer with Qwen3's special tokens and chat template; its thinking
    markers are added tokens that are not special, as Qwen3's are (``think_special``: special,
    as some other checkpoints have them). ``unk``: its unknown token (SmolLM2's is
    ``<|endoftext|>``)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = list(dict.fromkeys(string.printable))
    vocab = {t: i for i, t in enumerate(SPECIALS + chars)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=unk))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIALS[:5] if think_special else SPECIALS[:3])
    if not think_special:
        tok.add_tokens(SPECIALS[3:5])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", unk_token=unk)
    fast.chat_template = QWEN_TEMPLATE
    fast.save_pretrained(path)
    return fast


def tiny_hf_qwen3(path: Path, seed: int = 0, *, hidden: int = 32, head_dim: int = 16,
                  layers: int = 1, tied: bool = True, std: float = 0.0,
                  max_positions: int = 512) -> Path:
    """A tiny random Qwen3 in Hugging Face format. ``std > 0`` redraws the matrices with that
    std (large weights make argmax never a near-tie, for greedy comparisons)."""
    import transformers

    path.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(path)
    torch.manual_seed(seed)
    cfg = transformers.Qwen3Config(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
        head_dim=head_dim, max_position_embeddings=max_positions, tie_word_embeddings=tied,
    )
    model = transformers.Qwen3ForCausalLM(cfg)
    if std > 0:
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() >= 2:
                    p.normal_(0, std)
    model.generation_config.eos_token_id = [tok.convert_tokens_to_ids("<|im_end|>"),
                                            tok.convert_tokens_to_ids("<|endoftext|>")]
    model.save_pretrained(path)
    return path


def write_parquet(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def deepmath_rows(n: int = 8) -> list[dict]:
    return [{"question": f"What is ${i} + {i + 1}$?", "final_answer": str(2 * i + 1),
             "difficulty": 1.0 + i % 3, "topic": "Mathematics -> Algebra",
             "r1_solution_1": "...", "r1_solution_2": "...", "r1_solution_3": "..."}
            for i in range(n)]


def dapo_rows(n: int = 8) -> list[dict]:
    prefix = ("Solve the following math problem step by step. The last line of your response "
              "should be of the form Answer: $Answer (without quotes) where $Answer is the "
              "answer to the problem.\n\n")
    suffix = '\n\nRemember to put your answer on its own line after "Answer:".'
    return [{"data_source": "math_dapo",
             "prompt": [{"content": f"{prefix}Compute ${i} \\times 3$.{suffix}", "role": "user"}],
             "ability": "MATH",
             "reward_model": {"ground_truth": str(3 * i), "style": "rule-lighteval/MATH_v2"},
             "extra_info": {"index": f"dapo-{i:04d}"}} for i in range(n)]


def math500_rows() -> list[dict]:
    return [{"problem": "Convert the point $(0,3)$ to polar coordinates.",
             "solution": "...", "answer": "\\left( 3, \\frac{\\pi}{2} \\right)",
             "subject": "Precalculus", "level": 2, "unique_id": "test/precalculus/807.json"},
            {"problem": "What is $1+1$?", "solution": "...", "answer": "2",
             "subject": "Prealgebra", "level": 1, "unique_id": "test/prealgebra/1.json"}]


def amc_rows() -> list[dict]:
    return [{"id": 0, "problem": "Find $2\\cdot 71$.", "answer": 142.0,
             "url": "https://artofproblemsolving.com/wiki/index.php/2022_AMC_12A_Problems"}]


def aime24_rows() -> list[dict]:  # Maxwell-Jia/AIME_2024
    return [{"ID": "2024-I-1", "Problem": "Find $100 + 4$.", "Solution": "...", "Answer": 104}]


def aime25_rows() -> list[dict]:  # yentinglin/aime_2025
    return [{"id": 0, "problem": "Find $70 + 0$.", "answer": "70", "solution": "...",
             "url": "https://artofproblemsolving.com", "year": 2025}]


def write_benchmarks(root: Path) -> dict[str, Path]:
    paths = {
        "math500": write_parquet(root / "math500.parquet", math500_rows()),
        "amc": write_parquet(root / "amc.parquet", amc_rows()),
        "aime24": write_parquet(root / "aime24.parquet", aime24_rows()),
    }
    root.mkdir(parents=True, exist_ok=True)
    paths["aime25"] = root / "aime25.jsonl"
    paths["aime25"].write_text("".join(json.dumps(r) + "\n" for r in aime25_rows()))
    return paths


def tiny_hf_llama(path: Path, seed: int = 0) -> Path:
    import transformers

    path.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(path)
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
        tie_word_embeddings=True, rope_theta=500_000.0,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    )
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return path
