"""Decoders compared on a real pretrained model: pepo's in-process decoder, transformers'
``generate`` and vLLM, on the same model, prompts, sampling settings and number of tokens.

    python benchmarks/bench_decoders.py [--model smollm2 | --model-dir DIR] [--rows 32]
        [--new-tokens 64] [--repeats 3] [--decoders pepo transformers vllm]
        [--precision fp32 | bf16] [--compile]

Every row decodes exactly ``--new-tokens`` tokens (end-of-sequence ignored), at temperature 1
with no top-k/top-p, from the small-sums prompts of ``--config smollm2`` rendered with the model's
chat template. The decoders run back to back, ``--repeats`` rounds in turn (so a load change on
the machine hits all of them), after one warm-up each; the table gives the median generated
tokens/s and its ratio to pepo's decoder, measured in this one run. The vLLM engine is pepo's
colocated one (``generation.engine=vllm``; weights copied in from the trainer's model).
``--precision bf16`` runs every decoder in bf16: pepo's under ``torch.autocast`` as
``compute_dtype: bf16`` runs it (fp32 weights, the output head in fp32), transformers with a
bf16 model, vLLM with ``dtype: bfloat16``; pepo's fp32 decoder is then timed too, as the base.
``--compile`` adds pepo's decoder with ``generation.compile: true`` (its step through
``torch.compile``) at the same precision, and prints how long its first call (the compilation)
took.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from machine import cpu_name


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2", help="a packaged pretrained model")
    ap.add_argument("--model-dir", default=None, help="an HF checkpoint directory instead")
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--decoders", nargs="+", default=["pepo", "transformers", "vllm"],
                    choices=["pepo", "transformers", "vllm"])
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--compile", action="store_true",
                    help="also pepo's decoder with its step compiled (generation.compile)")
    args = ap.parse_args()
    bf16 = args.precision == "bf16"

    import transformers

    from pepo.tasks.problems import small_sums_dataset
    from pepo.training.engines import InProcessEngine
    from pepo.training.hf import from_hf
    from pepo.training.pretrained import pretrained_dir
    from pepo.training.tokenizers import ChatTokenizer

    model_dir = args.model_dir or pretrained_dir(args.model)
    tok = ChatTokenizer(model_dir)
    problems = small_sums_dataset(split="train")
    prompts = [tok.encode_prompt(problems[i % len(problems)].prompt) for i in range(args.rows)]
    seeds = torch.arange(args.rows, dtype=torch.int64)
    n_new = args.new_tokens
    ours = from_hf(model_dir, max_seq_len=max(map(len, prompts)) + n_new).eval()

    def pepo_at(compute_dtype, compile=False):
        engine = InProcessEngine(ours, compile=compile, compute_dtype=compute_dtype)

        def run() -> int:
            ro = engine.generate(prompts, max_new_tokens=n_new, pad_id=tok.pad_id,
                                 stop_tokens=[], temperature=1.0, top_p=1.0, seeds=seeds)
            return int(ro.mask.sum())
        return run

    hf = None
    if "transformers" in args.decoders:
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.bfloat16 if bf16 else torch.float32).eval()
        width = max(map(len, prompts))  # left padding, as generate expects
        ids = torch.tensor([[tok.pad_id] * (width - len(p)) + p for p in prompts])
        attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])

        def run_transformers() -> int:
            with torch.no_grad():
                out = hf.generate(input_ids=ids, attention_mask=attn, do_sample=True,
                                  temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=n_new,
                                  min_new_tokens=n_new, pad_token_id=tok.pad_id)
            return int(out[:, width:].numel())

    engine = None
    if "vllm" in args.decoders:
        from pepo.training.engines import VLLMEngine

        engine = VLLMEngine(ours, hf_dir=model_dir, dtype="bfloat16" if bf16 else "float32",
                            max_model_len=max(map(len, prompts)) + n_new,
                            kv_cache_memory_bytes=2**30, max_num_seqs=args.rows)

        def run_vllm() -> int:
            ro = engine.generate(prompts, max_new_tokens=n_new, pad_id=tok.pad_id,
                                 stop_tokens=[], temperature=1.0, top_p=1.0, seeds=seeds)
            return int(ro.mask.sum())

    runners = {"pepo": pepo_at(None)}
    if bf16:
        runners = {"pepo fp32": runners["pepo"], "pepo": pepo_at(torch.bfloat16)}
    if args.compile:
        runners["pepo compiled"] = pepo_at(torch.bfloat16 if bf16 else None, compile=True)
    if hf is not None:
        runners["transformers"] = run_transformers
    if engine is not None:
        runners["vllm"] = run_vllm
    rates: dict[str, list[float]] = {name: [] for name in runners}
    first: dict[str, float] = {}
    for name, fn in runners.items():  # warm-up (the compiled decoder compiles here)
        t0 = time.perf_counter()
        fn()
        first[name] = time.perf_counter() - t0
    for _ in range(args.repeats):
        for name, fn in runners.items():
            t0 = time.perf_counter()
            tokens = fn()
            dt = time.perf_counter() - t0
            if tokens != args.rows * n_new:
                raise RuntimeError(f"{name} generated {tokens} tokens, not {args.rows * n_new}")
            rates[name].append(tokens / dt)
    if engine is not None:
        engine.close()

    params = sum(p.numel() for p in ours.parameters())
    print(f"# {cpu_name()}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}, transformers {transformers.__version__}; "
          f"{params / 1e6:.1f}M parameters, {args.rows} rows x {n_new} new tokens (EOS ignored), "
          f"T = 1, prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens, "
          f"{args.precision}; "
          f"median of {args.repeats} rounds")
    if args.compile:
        print(f"# pepo compiled: first call (compilation and one decode) "
              f"{first['pepo compiled']:.0f} s, against {first['pepo']:.0f} s uncompiled")
    base = statistics.median(rates["pepo"])
    print("| decoder | generated tokens/s | vs pepo | rounds (tokens/s) |")
    print("|---|---:|---:|---|")
    for name, r in rates.items():
        med = statistics.median(r)
        print(f"| {name} | {med:.0f} | {med / base:.2f}x | {', '.join(f'{x:.0f}' for x in r)} |")


if __name__ == "__main__":
    main()
