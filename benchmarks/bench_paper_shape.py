"""The paper's shape on one GPU: Qwen3-1.7B's GRPO and PEPO steps at 2,048-token responses.

    python benchmarks/bench_paper_shape.py --out paper_shape.json     # one GPU, a few minutes
    python benchmarks/bench_paper_shape.py --tiny --out tiny.json     # the same pipeline on a CPU

Everything it needs is made in a scratch directory (``--workdir``, default a temporary one,
removed at the end):

1. a checkpoint directory of Qwen3-1.7B's exact shape (Hugging Face layout: ``config.json``
   with the published model's values, random bf16 weights in ``model.safetensors`` under
   Hugging Face's key names, drawn on the GPU when there is one) and a generated word-level
   tokenizer of its vocabulary size (151,936) with Qwen3's chat template and special tokens at
   their real ids, which ``pepo.training.tokenizers.ChatTokenizer`` loads;
2. DeepMath-103K-like data (a parquet in its published columns);
3. the recipe config ``qwen3_1_7b_pepo`` run in this process (``pepo_recipe.PEPORecipe``, the
   in-process engine), first a short warm-up run (it compiles torchao's AdamW step, one
   compilation per parameter shape, and warms up CUDA), then ``--steps`` steps with
   ``strategy.name=uniform`` (GRPO) and the same with ``strategy.name=proximal_softmax`` (PEPO),
   same seed. Random weights never stop on their own, and the stop tokens are switched off, so
   every response is ``--max-new-tokens`` long. With one step (the default) both runs draw the
   same prompts and seeds from the same weights, so they decode the same rollouts (up to the
   GPU's non-determinism) and their steps differ by the strategy alone; the warm-up run takes
   the first step's one-off costs that a second step per run would otherwise be needed for.
4. a micro-benchmark of ``pepo.entropy.logprobs_and_entropy_from_hidden`` at V = 151,936
   against the naive ``log_softmax`` over the whole logits, in time and memory.

What it changes in the recipe, for measuring only (instance attributes of this process's
recipe objects; the recipe's code is untouched):

* no checkpoint (about 10 GB of weights and optimizer state) and no Hugging Face export
  (3.4 GB) is written;
* the reward is the config's ``MathVerify`` (timed, as in training) with a synthetic verdict:
  a random policy answers nothing right, and all-zero rewards give zero advantages, so each
  response scores 1.0 or 0.0 by a hash of its text (about half succeed, as early in training);
* the strategy is called once before the first step on a batch of the step's shape, so that
  its one-off ``torch.compile`` on CUDA (``pepo._strategy``; ``PEPO_COMPILE=0`` turns it off)
  is reported apart (``strategy_first_call_s``) instead of inside the measured step;
* the old log-probs, the strategy call and each part's peak memory are read with a
  ``torch.cuda.synchronize()`` at the end of each part, so that the recipe's host-side timers
  (``gen_time``, ``logprob_time``, ``update_time``) hold the GPU work they launched, and the
  strategy's own time (``strategy_time``, between a synchronize before and one after each
  call, summed over the step's calls: one, or one a micro-batch where ``--mini-batches 1``
  leaves the old log-probs to the update; a part's peak is the largest of its calls') is
  measured.

Prints a markdown table at the end and writes every number to ``--out`` (JSON). Extra
``key=value`` arguments override the recipe config of every run (``generation.compile=true``).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import math
import platform
import shutil
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
for _name, _dir in (("pepo", ROOT / "src"), ("pepo_recipe", ROOT / "recipes")):
    if importlib.util.find_spec(_name) is None:  # a checkout run without installing pepo
        sys.path.insert(0, str(_dir))

import torch  # noqa: E402

# Qwen/Qwen3-1.7B's config.json (the published checkpoint's values)
QWEN3_1_7B = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 6144,
    "max_position_embeddings": 40960,
    "max_window_layers": 28,
    "num_attention_heads": 16,
    "num_hidden_layers": 28,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}
# Qwen3's special tokens at their ids in the real tokenizer
QWEN3_SPECIALS = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645,
                  "<think>": 151667, "</think>": 151668}
# the same architecture scaled down for a CPU (--tiny)
TINY = {**QWEN3_1_7B, "hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 2,
        "max_window_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "vocab_size": 512, "bos_token_id": 0, "eos_token_id": 2}
# Qwen3's chat template, cut to what the recipe uses (one user turn, thinking on or off)
QWEN_TEMPLATE = (
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)
# Table 9 of the paper: total wall-clock time of 500 steps on 2xH200 (ROLL), in minutes
PAPER_TABLE9 = {"Qwen3-1.7B": {"GRPO": 31 * 60 + 32, "PEPO": 31 * 60 + 54},
                "Qwen3-4B": {"GRPO": 43 * 60 + 25, "PEPO": 43 * 60 + 45}}
GIB = 2.0 ** 30


# ------------------------------------------------------------------ the checkpoint directory
def build_tokenizer(path: Path, vocab_size: int) -> int:
    """A word-level tokenizer of exactly ``vocab_size`` tokens with Qwen3's chat template.

    Text encodes one character a token; the other ids are filler words (`` w<id>``) that only
    a model emits. With the full vocabulary Qwen3's special tokens sit at their real ids;
    with a small one (``--tiny``) at the start. Returns the tokenizer's length."""
    import string

    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = list(dict.fromkeys(string.printable))
    specials = dict(QWEN3_SPECIALS)
    if max(specials.values()) >= vocab_size:
        specials = {t: i for i, t in enumerate(specials)}
    specials["<unk>"] = max(specials.values()) + 1  # full size: past Qwen3's 151,669 tokens
    if len(chars) + len(specials) > vocab_size:
        raise ValueError(f"vocab_size must be at least {len(chars) + len(specials)}, "
                         f"got {vocab_size}")
    vocab: dict[str, int] = dict(specials)
    taken = set(specials.values())
    free = (i for i in range(vocab_size) if i not in taken)
    for c in chars:
        vocab[c] = next(free)
    for i in free:
        vocab[f" w{i}"] = i
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([t for t in QWEN3_SPECIALS])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", unk_token="<unk>")
    fast.chat_template = QWEN_TEMPLATE
    fast.save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps({
        "bos_token_id": vocab["<|endoftext|>"], "do_sample": True,
        "eos_token_id": [vocab["<|im_end|>"], vocab["<|endoftext|>"]],
        "pad_token_id": vocab["<|endoftext|>"],
    }, indent=2), encoding="utf-8")
    return len(fast)


def hf_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """The checkpoint's tensors as transformers' ``Qwen3ForCausalLM`` names them (built on the
    meta device: no memory), without ``lm_head.weight`` when the embedding is tied."""
    import transformers

    hf_cfg = transformers.Qwen3Config(**{k: v for k, v in cfg.items()
                                         if k not in ("architectures", "model_type")})
    with torch.device("meta"):
        model = transformers.Qwen3ForCausalLM(hf_cfg)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()
              if "rotary_emb" not in k}
    if cfg["tie_word_embeddings"]:
        shapes.pop("lm_head.weight", None)
    return shapes


def build_checkpoint(path: Path, cfg: dict[str, Any], device: torch.device,
                     seed: int = 0) -> dict[str, Any]:
    """``config.json``, random bf16 ``model.safetensors`` (N(0, 0.02) matrices, unit norms,
    drawn on ``device``), the tokenizer and ``generation_config.json``. Returns what was
    built: parameter count, bytes, seconds."""
    from safetensors.torch import save_file

    t0 = time.perf_counter()
    path.mkdir(parents=True, exist_ok=True)
    tok_len = build_tokenizer(path, cfg["vocab_size"])
    t_tok = time.perf_counter() - t0
    (path / "config.json").write_text(json.dumps(cfg, indent=2), encoding="utf-8")
    gen = torch.Generator(device=device).manual_seed(seed)
    state = {}
    for name, shape in hf_shapes(cfg).items():
        if name.endswith("norm.weight"):
            w = torch.ones(shape, dtype=torch.bfloat16, device=device)
        else:
            w = torch.randn(shape, generator=gen, dtype=torch.bfloat16, device=device) * 0.02
        state[name] = w.cpu()
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    params = sum(v.numel() for v in state.values())
    return {"params": params, "bytes": params * 2, "tokenizer_len": tok_len,
            "tokenizer_s": t_tok, "seconds": time.perf_counter() - t0}


def write_data(path: Path, n: int, seed: int = 0) -> Path:
    """``n`` DeepMath-103K-like rows (its columns: question, final_answer, difficulty, topic,
    r1_solution_1..3): linear equations of a few dozen words, integer answers."""
    import random

    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b, x = rng.randint(2, 40), rng.randint(1, 500), rng.randint(-50, 50)
        q = (f"Let $f(x) = {a}x + {b}$. A sequence is defined by $u_0 = {i}$ and "
             f"$u_{{n+1}} = f(u_n) - {a}u_n$. Find the value of $x$ for which "
             f"$f(x) = {a * x + b}$, and give it as an integer.")
        rows.append({"question": q, "final_answer": str(x), "difficulty": 1.0 + i % 9,
                     "topic": "Mathematics -> Algebra -> Linear Equations",
                     "r1_solution_1": "...", "r1_solution_2": "...", "r1_solution_3": "..."})
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def check_shapes(path: Path, shapes: dict[str, tuple[int, ...]], max_seq_len: int) -> int:
    """Raises unless tensors of ``shapes`` (Hugging Face names) are, once converted by the
    recipe's loader (``pepo.training.hf.hf_to_tune_state``), exactly the state of the model
    ``pepo.training.hf.architecture_from_hf`` builds from ``path/config.json`` (on the meta
    device: no memory). Returns the model's parameter count."""
    from pepo.training.hf import architecture_from_hf, hf_to_tune_state, load_hf_config

    with torch.device("meta"):
        model = architecture_from_hf(path, max_seq_len=max_seq_len)
    meta = {k: torch.empty(s, device="meta") for k, s in shapes.items()}
    state = hf_to_tune_state(meta, load_hf_config(path))
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in state.items()}
    if expected != got:
        diff = sorted(set(expected.items()) ^ set(got.items()))[:6]
        raise ValueError(f"{path}: the weights do not match architecture_from_hf: {diff}")
    return sum(v.numel() for v in model.state_dict().values())


def check_checkpoint(path: Path, max_seq_len: int) -> dict[str, Any]:
    """What the recipe does with the directory: :func:`check_shapes` on the shapes in
    ``model.safetensors``'s header, and the chat tokenizer (``ChatTokenizer``) against the
    embedding. Raises on any mismatch."""
    from safetensors import safe_open

    from pepo.training.tokenizers import ChatTokenizer

    with safe_open(str(path / "model.safetensors"), framework="pt", device="cpu") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    params = check_shapes(path, shapes, max_seq_len)
    vocab = json.loads((path / "config.json").read_text(encoding="utf-8"))["vocab_size"]
    tok = ChatTokenizer(path, enable_thinking=True)
    ids = tok.encode_prompt("What is $1+1$?")
    if tok.vocab_size != vocab:
        raise ValueError(f"tokenizer has {tok.vocab_size} tokens, the model embeds {vocab}")
    return {"tune_params": params, "tokenizer_vocab": tok.vocab_size,
            "stop_tokens": tok.stop_tokens, "example_prompt_tokens": len(ids)}


def prompt_lengths(ckpt: Path, data: Path) -> dict[str, Any]:
    """The data's prompts as the recipe gives them to the model (chat template, boxed-answer
    instruction): count and token lengths."""
    from pepo.tasks.datasets import load_math_dataset
    from pepo.training.tokenizers import ChatTokenizer

    tok = ChatTokenizer(ckpt, enable_thinking=True)
    lengths = [len(tok.encode_prompt(p.prompt)) for p in load_math_dataset(data)]
    return {"rows": len(lengths), "prompt_tokens_mean": statistics.mean(lengths),
            "prompt_tokens_max": max(lengths)}


# ----------------------------------------------------------------------- the recipe runs
class HashedVerdict:
    """The config's reward, called and timed as in training, with a synthetic verdict: 1.0 for
    a response whose CRC-32 is odd, else 0.0 (about half of each group)."""

    def __init__(self, inner: Callable) -> None:
        self.inner, self.seconds = inner, 0.0

    def __call__(self, responses: Sequence[str], answers: Sequence[str]) -> list[float]:
        t0 = time.perf_counter()
        self.inner(responses, answers)
        self.seconds += time.perf_counter() - t0
        return [float(zlib.crc32(r.encode("utf-8")) & 1) for r in responses]

    def close(self) -> None:
        close = getattr(self.inner, "close", None)
        if callable(close):
            close()


def _instrument(recipe: Any, cuda: bool) -> dict[str, float]:
    """Per-part peak memory, the strategy's time, and a synchronize at the end of each part
    (see the module docstring); each step's metrics get them. Returns a dict whose
    ``run_peak`` holds the peak allocated before the last reset (the parts reset the peak)."""
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    part: dict[str, float] = {}
    run = {"run_peak": 0.0}

    def peak_of(name: str, fn: Callable) -> Callable:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if cuda:
                sync()
                run["run_peak"] = max(run["run_peak"], torch.cuda.max_memory_allocated())
                torch.cuda.reset_peak_memory_stats()
            out = fn(*args, **kwargs)
            sync()
            if cuda:  # the largest of the part's calls (one a step, or one a micro-batch)
                key = f"peak_mem_{name}_gib"
                part[key] = max(part.get(key, 0.0), torch.cuda.max_memory_allocated() / GIB)
            return out
        return wrapped

    recipe._generate = peak_of("gen", recipe._generate)
    recipe._all_logprobs = peak_of("logprob", recipe._all_logprobs)
    recipe._update = peak_of("update", recipe._update)
    strategy = recipe.strategy

    def timed_strategy(advantages, entropies, mask, **kwargs):
        sync()  # the forward's queued work is not the strategy's (one call a micro-batch where
        t0 = time.perf_counter()  # the update makes the old log-probs)
        out = strategy(advantages, entropies, mask, **kwargs)
        sync()
        part["strategy_time"] = part.get("strategy_time", 0.0) + time.perf_counter() - t0
        part["strategy_calls"] = part.get("strategy_calls", 0) + 1
        # how far the token advantages are from uniform ones (0 for GRPO), outside the timer
        uniform = torch.where(mask, advantages[:, None].to(out.dtype), 0.0)
        gap = float((torch.where(mask, out, 0.0) - uniform).abs().max())
        part["token_adv_vs_uniform"] = max(part.get("token_adv_vs_uniform", 0.0), gap)
        return out

    recipe.strategy = timed_strategy
    reward = recipe.reward_fn = HashedVerdict(recipe.reward_fn)
    step = recipe.train_step

    def train_step() -> dict[str, float]:
        part.clear()
        reward.seconds = 0.0
        m = step()
        m.update(part)
        m["reward_time"] = reward.seconds
        return m

    recipe.train_step = train_step
    # no checkpoint, no Hugging Face export: the measurement is the steps
    recipe.save_checkpoint = lambda step, metrics=None: None
    recipe.hf_source = None
    return run


def first_strategy_call(recipe: Any, rows: int, width: int, cuda: bool) -> float:
    """Calls the run's strategy once on a batch of the step's shape, dtypes and keywords (as
    ``train_step`` calls it) and returns the seconds: on CUDA the built-in strategies are
    ``torch.compile``-d at their first call (``pepo._strategy``), once per run, which would
    otherwise land in the measured step's ``strategy_time``."""
    dev = recipe._device
    g = torch.Generator(device=dev).manual_seed(0)
    adv = torch.randn(rows, generator=g, device=dev)
    ent = torch.rand(rows, width, generator=g, device=dev) * 2
    mask = torch.ones(rows, width, dtype=torch.bool, device=dev)
    positive = torch.arange(rows, device=dev) % 2 == 0
    groups = torch.arange(rows, device=dev) // recipe.estimator.rollouts_per_prompt
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    recipe.strategy(adv, ent, mask, positive=positive, groups=groups,
                    process_group=recipe.dist.group, validate=False)
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def run_recipe(cfg: Any, cuda: bool, label: str) -> dict[str, Any]:
    """Sets up and runs the recipe on ``cfg`` in this process; its metrics per step."""
    import pepo_recipe

    if cuda:
        torch.cuda.synchronize()
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    recipe = pepo_recipe.PEPORecipe(cfg)
    try:
        recipe.setup(cfg)
        recipe.stop_tokens = []  # random weights: every response runs to max_new_tokens
    except BaseException:
        recipe.cleanup()
        raise
    setup_s = time.perf_counter() - t0
    rows = recipe.prompts_per_step * recipe.estimator.rollouts_per_prompt
    first_call_s = first_strategy_call(recipe, rows, recipe.gen_kwargs["max_new_tokens"], cuda)
    peaks = _instrument(recipe, cuda)
    t1 = time.perf_counter()
    recipe.run()
    out = {
        "label": label,
        "strategy": recipe.strategy_name,
        "rollouts_per_step": rows,
        "setup_s": setup_s,
        "strategy_first_call_s": first_call_s,
        "run_s": time.perf_counter() - t1,
        "steps": [dict(h) for h in recipe.history if "loss" in h],
    }
    if cuda:
        out["peak_mem_gib"] = max(peaks["run_peak"], torch.cuda.max_memory_allocated()) / GIB
        out["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / GIB
        out["allocated_before_gib"] = before / GIB
    del recipe
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return out


def recipe_cfg(args: argparse.Namespace, ckpt: Path, data: Path, out_dir: Path, *,
               strategy: str, steps: int, max_new_tokens: int, overrides: list[str]) -> Any:
    from omegaconf import OmegaConf

    from pepo.training.config import find_config, register_resolvers

    register_resolvers()
    rows = args.prompts * args.group_size
    name = ROOT / "recipes" / "configs" / "qwen3_1_7b_pepo.yaml"  # this checkout's config
    cfg = OmegaConf.merge(OmegaConf.load(find_config(str(name) if name.is_file()
                                                     else "qwen3_1_7b_pepo")), {
        "checkpoint_dir": str(ckpt), "train_data": str(data), "output_dir": str(out_dir),
        "device": args.device, "dtype": args.dtype, "num_steps": steps,
        "prompts_per_step": args.prompts, "estimator": {"group_size": args.group_size},
        "micro_batch_size": args.micro_batch, "ppo_mini_batches": args.mini_batches,
        "strategy": {"name": strategy},
        "generation": {"max_new_tokens": max_new_tokens, "batch_size": rows},
        "model": {"max_seq_len": args.max_seq_len},
        "reward": {"workers": args.reward_workers},
        "validation": {"every": 0}, "save_every": 0, "dump_rollouts_every": 0, "plot": False,
    }, OmegaConf.from_dotlist(overrides))
    if args.tiny:  # torchao's AdamW compiles its step: minutes on a small CPU
        cfg.optimizer = {"_component_": "torch.optim.AdamW", "lr": 1e-6, "weight_decay": 0.0}
    return cfg


def summarize_run(run: dict[str, Any], cuda: bool) -> dict[str, Any]:
    """The reported step (the last) of a run: its split, decode rate and memory."""
    s = run["steps"][-1]
    tokens = s["response_len"] * run["rollouts_per_step"]
    decode_s = s["gen_time"] - s["reward_time"]
    # the step's parts; the strategy runs inside the old log-probs' part (or inside the update's
    # when that pass is skipped), so its time is within them, not beside them
    parts = ("gen_time", "logprob_time", "update_time")
    out = {
        "step": len(run["steps"]),
        "step_time": s["step_time"],
        **{p: s[p] for p in parts},
        "strategy_time": s["strategy_time"],  # summed over its calls in the step
        "strategy_calls": s["strategy_calls"],
        "reward_time": s["reward_time"],
        "other_time": s["step_time"] - sum(s[p] for p in parts),
        "response_tokens": tokens,
        "response_len": s["response_len"],
        "truncated": s["truncated"],
        "decode_tokens_per_s": tokens / decode_s if decode_s > 0 else float("nan"),
        "token_adv_vs_uniform": s["token_adv_vs_uniform"],
        "loss": s["loss"],
        "accuracy": s["accuracy"],
        "strategy_first_call_s": run["strategy_first_call_s"],
    }
    if cuda:
        out.update({k: s[k] for k in ("peak_mem_gen_gib", "peak_mem_logprob_gib",
                                      "peak_mem_update_gib")})
        out["peak_mem_gib"] = run["peak_mem_gib"]
    return out


# ------------------------------------------------------------- the log-prob micro-benchmark
def naive_logprobs_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                           temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole ``[N, V]`` logits in fp32, ``log_softmax``, gather, ``-sum(p log p)``."""
    logits = (hidden @ weight.t()).float() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(-1, targets[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


def _time(fn: Callable[[], Any], cuda: bool, repeats: int, warmup: int = 2) -> list[float]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return times


def _peak_extra(fn: Callable[[], Any], cuda: bool) -> Optional[float]:
    """GiB allocated by ``fn`` at its peak beyond what was allocated before it (CUDA only)."""
    if not cuda:
        fn()
        return None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / GIB


def bench_entropy(device: torch.device, dtype: torch.dtype, tokens: int, dim: int, vocab: int,
                  chunk: int, repeats: int, temperature: float = 0.6) -> dict[str, Any]:
    from pepo.entropy import logprobs_and_entropy_from_hidden

    cuda = device.type == "cuda"
    g = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(tokens, dim, generator=g, device=device, dtype=dtype)
    weight = (torch.randn(vocab, dim, generator=g, device=device, dtype=dtype) * 0.02)
    targets = torch.randint(0, vocab, (tokens,), generator=g, device=device)
    impls = {
        "chunked": lambda h, w: logprobs_and_entropy_from_hidden(
            h, w, targets, chunk_size=chunk, temperature=temperature),
        "naive": lambda h, w: naive_logprobs_entropy(h, w, targets, temperature),
    }
    out: dict[str, Any] = {"tokens": tokens, "dim": dim, "vocab": vocab, "chunk_size": chunk,
                           "dtype": str(dtype).replace("torch.", ""), "repeats": repeats}
    results = {}
    for name, f in impls.items():
        def fwd(f=f):
            with torch.no_grad():
                return f(hidden, weight)

        h = hidden.detach().requires_grad_(True)
        w = weight.detach().requires_grad_(True)

        def fwd_bwd(f=f, h=h, w=w):
            lp, ent = f(h, w)
            (lp.sum() + ent.sum()).backward()
            h.grad = w.grad = None

        results[name] = fwd()
        out[name] = {
            "forward_s": statistics.median(_time(fwd, cuda, repeats)),
            "forward_backward_s": statistics.median(_time(fwd_bwd, cuda, repeats)),
            "forward_peak_extra_gib": _peak_extra(fwd, cuda),
            "forward_backward_peak_extra_gib": _peak_extra(fwd_bwd, cuda),
        }
    (lp_c, ent_c), (lp_n, ent_n) = results["chunked"], results["naive"]
    out["max_abs_diff_logprob"] = float((lp_c - lp_n).abs().max())
    out["max_abs_diff_entropy"] = float((ent_c - ent_n).abs().max())
    return out


# ------------------------------------------------------------------------------- report
def _fmt(x: Any, spec: str) -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def table(res: dict[str, Any]) -> str:
    g, p = res["grpo"], res["pepo"]
    lines = [
        f"## {res['model']} shape, {res['device_name']}: GRPO and PEPO, step {g['step']} of "
        f"each run ({res['settings']['rollouts_per_step']} rollouts of "
        f"{res['settings']['max_new_tokens']} tokens)",
        "",
        "| per step | GRPO (uniform) | PEPO (proximal_softmax) | PEPO / GRPO |",
        "|---|---:|---:|---:|",
    ]

    def row(label: str, key: str, scale: float = 1.0, spec: str = ".2f") -> None:
        a, b = g.get(key), p.get(key)
        ratio = b / a if a not in (None, 0) and b is not None else None
        lines.append(f"| {label} | {_fmt(None if a is None else a * scale, spec)} | "
                     f"{_fmt(None if b is None else b * scale, spec)} | "
                     f"{_fmt(ratio, '.4f')} |")

    row("step s", "step_time")
    row("generation s (decode + rewards)", "gen_time")
    row("of which rewards s", "reward_time")
    row("old log-probs s", "logprob_time")
    row("strategy ms (within old log-probs, or update when that pass is skipped: its calls "
        "summed)", "strategy_time", 1e3, ".1f")
    row("strategy calls (1, or one a micro-batch in the update)", "strategy_calls", 1.0, ".0f")
    row("update s", "update_time")
    row("other s (estimator, metrics)", "other_time", 1.0, ".3f")
    row("strategy's first call s (compiles on CUDA; once per run, before step 1)",
        "strategy_first_call_s", 1.0, ".2f")
    row("decode tokens/s (generation - rewards)", "decode_tokens_per_s", 1.0, ",.0f")
    row("response tokens", "response_tokens", 1.0, ",.0f")
    row("peak GPU memory GiB, generation", "peak_mem_gen_gib")
    row("peak GPU memory GiB, old log-probs", "peak_mem_logprob_gib")
    row("peak GPU memory GiB, update", "peak_mem_update_gib")
    row("peak GPU memory GiB, whole run", "peak_mem_gib")
    r = res["ratio"]
    lines += ["",
              f"PEPO/GRPO step time: {r['step_time']:.4f} ({(r['step_time'] - 1) * 100:+.2f} %); "
              f"the strategy's own share of PEPO's step: {r['strategy_share_pepo'] * 100:.3f} %. "
              f"Paper, Table 9 (500 steps, 2xH200): "
              + ", ".join(f"{m} {v['pepo_over_grpo']:.4f} "
                          f"({(v['pepo_over_grpo'] - 1) * 100:+.2f} %)"
                          for m, v in res["paper_runtime_table9"].items()) + "."]
    e = res.get("entropy_bench")
    if e:
        c, n = e["chunked"], e["naive"]
        lines += ["",
                  f"## logprobs_and_entropy_from_hidden: {e['tokens']} tokens, D={e['dim']}, "
                  f"V={e['vocab']:,}, {e['dtype']}, chunk {e['chunk_size']} (median of "
                  f"{e['repeats']})",
                  "",
                  "| | chunked from hidden | naive log_softmax | chunked / naive |",
                  "|---|---:|---:|---:|"]
        for label, key, scale in (("forward ms", "forward_s", 1e3),
                                  ("forward + backward ms", "forward_backward_s", 1e3),
                                  ("forward, peak extra GiB", "forward_peak_extra_gib", 1.0),
                                  ("forward + backward, peak extra GiB",
                                   "forward_backward_peak_extra_gib", 1.0)):
            a, b = c[key], n[key]
            lines.append(f"| {label} | {_fmt(None if a is None else a * scale, '.2f')} | "
                         f"{_fmt(None if b is None else b * scale, '.2f')} | "
                         f"{_fmt(a / b if a is not None and b else None, '.3f')} |")
        lines.append(f"| max abs diff (log-prob / entropy) | "
                     f"{e['max_abs_diff_logprob']:.2e} / {e['max_abs_diff_entropy']:.2e} | | |")
    lines += ["", f"wall time {res['wall_s']:.0f} s (checkpoint "
              f"{res['checkpoint']['seconds']:.1f} s, warm-up run "
              f"{res.get('warmup', {}).get('total_s', 0):.0f} s)"]
    return "\n".join(lines)


def _save(path: Optional[Path], res: dict[str, Any]) -> None:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(res, indent=2, default=str), encoding="utf-8")


# --------------------------------------------------------------------------------- main
def parse_args(argv: Optional[list[str]] = None) -> tuple[argparse.Namespace, list[str]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true",
                    help="a 2-layer Qwen3 with a 512-token vocabulary, fp32, short responses "
                         "(the whole pipeline on a CPU in well under a minute)")
    ap.add_argument("--out", type=Path, default=None, help="the JSON file to write")
    ap.add_argument("--workdir", type=Path, default=None,
                    help="where the checkpoint, data and runs go (default: a temporary "
                         "directory, removed at the end)")
    ap.add_argument("--device", default=None, help="default: cuda when there is one, else cpu")
    ap.add_argument("--steps", type=int, default=1, help="steps per run; the last is reported")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="default 2048 (tiny: 24)")
    ap.add_argument("--prompts", type=int, default=None, help="prompts per step (default 4)")
    ap.add_argument("--group-size", type=int, default=None, help="rollouts per prompt "
                    "(default 8, the paper's G; tiny: 4)")
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--mini-batches", type=int, default=4)
    ap.add_argument("--warmup-tokens", type=int, default=16,
                    help="response length of the warm-up run (0: no warm-up run)")
    ap.add_argument("--layers", type=int, default=None,
                    help="override the number of layers (e.g. 1 to check the full-width "
                         "checkpoint cheaply with --build-only)")
    ap.add_argument("--build-only", action="store_true",
                    help="build and check the checkpoint, tokenizer and data, run nothing")
    ap.add_argument("--entropy-tokens", type=int, default=None, help="default 4096 (tiny: 256)")
    ap.add_argument("--repeats", type=int, default=5, help="timed calls of the micro-benchmark")
    args, overrides = ap.parse_known_args(argv)
    bad = [o for o in overrides if "=" not in o or o.startswith("-")]
    if bad:
        ap.error(f"unrecognized arguments: {' '.join(bad)}")
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    tiny = args.tiny
    args.max_new_tokens = args.max_new_tokens or (24 if tiny else 2048)
    args.prompts = args.prompts or (2 if tiny else 4)
    args.group_size = args.group_size or (4 if tiny else 8)
    args.entropy_tokens = args.entropy_tokens or (256 if tiny else 4096)
    args.dtype = "fp32" if tiny else "bf16"
    args.reward_workers = 1 if tiny else 8
    args.max_seq_len = 512 + args.max_new_tokens  # prompts are about 250 tokens (res["data"])
    if args.steps < 1:
        ap.error(f"--steps must be >= 1, got {args.steps}")
    return args, overrides


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    args, overrides = parse_args(argv)
    from machine import cpu_name

    t_start = time.perf_counter()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    shape = dict(TINY if args.tiny else QWEN3_1_7B)
    if args.layers:
        shape["num_hidden_layers"] = shape["max_window_layers"] = args.layers
    res: dict[str, Any] = {
        "model": ("tiny Qwen3" if args.tiny else "Qwen3-1.7B")
                 + (f" ({args.layers} layers)" if args.layers else ""),
        "device_name": torch.cuda.get_device_name(device) if cuda else cpu_name(),
        "host": cpu_name(), "torch": torch.__version__, "python": platform.python_version(),
        "config": shape, "partial": True,
    }
    tmp = None
    work = args.workdir
    if work is None:
        tmp = tempfile.TemporaryDirectory(prefix="pepo_paper_shape_")
        work = Path(tmp.name)
    try:
        ckpt, data = work / "checkpoint", work / "data" / "deepmath.parquet"
        res["checkpoint"] = build_checkpoint(ckpt, shape, device)
        write_data(data, n=64)
        res["checkpoint"]["check"] = check_checkpoint(ckpt, args.max_seq_len)
        res["data"] = prompt_lengths(ckpt, data)
        print(f"checkpoint: {res['checkpoint']['params'] / 1e6:,.1f} M parameters "
              f"({res['checkpoint']['bytes'] / GIB:.2f} GiB) in "
              f"{res['checkpoint']['seconds']:.1f} s", flush=True)
        if args.build_only:
            res["partial"] = False
            res["wall_s"] = time.perf_counter() - t_start
            _save(args.out, res)
            return res
        rows = args.prompts * args.group_size
        res["settings"] = {"prompts_per_step": args.prompts, "group_size": args.group_size,
                           "rollouts_per_step": rows, "max_new_tokens": args.max_new_tokens,
                           "micro_batch_size": args.micro_batch,
                           "ppo_mini_batches": args.mini_batches, "steps": args.steps,
                           "dtype": args.dtype, "overrides": overrides,
                           "warmup_tokens": args.warmup_tokens}
        if args.warmup_tokens:
            t0 = time.perf_counter()
            cfg = recipe_cfg(args, ckpt, data, work / "runs" / "warmup", strategy="uniform",
                             steps=1, max_new_tokens=args.warmup_tokens, overrides=overrides)
            res["warmup"] = run_recipe(cfg, cuda, "warm-up")
            res["warmup"]["total_s"] = time.perf_counter() - t0
            print(f"warm-up: {res['warmup']['total_s']:.1f} s", flush=True)
            _save(args.out, res)
        for key, strategy in (("grpo", "uniform"), ("pepo", "proximal_softmax")):
            cfg = recipe_cfg(args, ckpt, data, work / "runs" / key, strategy=strategy,
                             steps=args.steps, max_new_tokens=args.max_new_tokens,
                             overrides=overrides)
            run = run_recipe(cfg, cuda, key)
            res[f"{key}_run"] = run
            res[key] = summarize_run(run, cuda)
            print(f"{key}: step {res[key]['step_time']:.2f} s, generation "
                  f"{res[key]['gen_time']:.2f} s, {res[key]['decode_tokens_per_s']:,.0f} "
                  f"tokens/s", flush=True)
            _save(args.out, res)
        g, p = res["grpo"], res["pepo"]
        res["ratio"] = {k: p[k] / g[k] for k in ("step_time", "gen_time", "logprob_time",
                                                  "update_time", "strategy_time")
                        if g[k] > 0}
        res["ratio"]["strategy_share_pepo"] = p["strategy_time"] / p["step_time"]
        res["paper_runtime_table9"] = {m: {**v, "pepo_over_grpo": v["PEPO"] / v["GRPO"]}
                               for m, v in PAPER_TABLE9.items()}
        _save(args.out, res)
        res["entropy_bench"] = bench_entropy(
            device, torch.bfloat16 if cuda else torch.float32, args.entropy_tokens,
            shape["hidden_size"], shape["vocab_size"], chunk=1024 if not args.tiny else 64,
            repeats=args.repeats)
        res["partial"] = False
        res["wall_s"] = time.perf_counter() - t_start
        _save(args.out, res)
        print(table(res), flush=True)
        return res
    finally:
        if tmp is not None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
