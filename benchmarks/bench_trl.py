"""Step time of pepo's TRL adapter against plain ``GRPOTrainer``: the same model, data and seed,
interleaved in one run (so machine noise hits both alike), as ratios of medians.

    python benchmarks/bench_trl.py [--rounds 5] [--steps 4] [--hidden 256] [--layers 4] [--lr 1e-4]

Each round trains a fresh copy of one random Qwen3 for ``--steps`` optimizer steps with each
trainer in turn and records the mean seconds per step TRL measured (``step_time``: generation,
scoring, the adapter's weighting and the update), and the CPU seconds the process spent in the
same steps (``time.process_time``), which other processes on a busy machine disturb less. Needs
TRL (``pip install trl==1.16.0``). ``--lr 0`` keeps the weights, so every trainer of a round
samples the same completions and the ratios hold the adapter's cost alone (with training, each
strategy's model soon samples completions of other lengths, and so other step times).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time
from importlib.resources import files

import torch
import transformers
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

from pepo.integrations.trl import PepoGRPOTrainer
from pepo.tasks import modsum_dataset


def reward(completions, answer, **kwargs):
    return [float(next((ch for ch in c if ch.isdigit()), None) == a)
            for c, a in zip(completions, answer)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--completion-length", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-4)
    a = ap.parse_args()

    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(files("pepo") / "assets" / "tiny" / "tokenizer.json"),
        eos_token="<|im_end|>", pad_token="<|endoftext|>")
    torch.manual_seed(0)
    base = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        vocab_size=len(tok), hidden_size=a.hidden, intermediate_size=2 * a.hidden,
        num_hidden_layers=a.layers, num_attention_heads=4, num_key_value_heads=2,
        head_dim=a.hidden // 4, tie_word_embeddings=True, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id))
    data = Dataset.from_list([{"prompt": p.prompt, "answer": p.answer}
                              for p in modsum_dataset(256, seed=0)])
    variants = {
        "GRPOTrainer": (GRPOTrainer, {}),
        "pepo uniform": (PepoGRPOTrainer, {"pepo_strategy": "uniform"}),
        "pepo proximal_softmax": (PepoGRPOTrainer, {"pepo_strategy": "proximal_softmax"}),
        "pepo global_topk": (PepoGRPOTrainer, {"pepo_strategy": "global_topk"}),
        "pepo gtpo": (PepoGRPOTrainer, {"pepo_strategy": "gtpo"}),
    }
    times: dict[str, list[float]] = {k: [] for k in variants}
    cpu: dict[str, list[float]] = {k: [] for k in variants}
    params = sum(p.numel() for p in base.parameters()) / 1e6
    print(f"{torch.get_num_threads()} threads; model {params:.2f}M parameters; 32 completions x "
          f"{a.completion_length} tokens a step")
    for r in range(a.rounds):
        for name, (cls, kw) in variants.items():
            with tempfile.TemporaryDirectory() as out:
                args = GRPOConfig(
                    output_dir=out, per_device_train_batch_size=32, num_generations=8,
                    max_completion_length=a.completion_length, max_steps=a.steps,
                    learning_rate=a.lr, beta=0.0, logging_steps=1, report_to="none",
                    use_cpu=True, bf16=False, save_strategy="no", disable_tqdm=True, seed=r)
                trainer = cls(model=copy.deepcopy(base), reward_funcs=reward, args=args,
                              train_dataset=data, processing_class=tok, **kw)
                step_cpu: list[float] = []
                training_step = trainer.training_step

                def timed(*args_, _step=training_step, _cpu=step_cpu, **kwargs_):
                    start = time.process_time()
                    out = _step(*args_, **kwargs_)
                    _cpu.append(time.process_time() - start)
                    return out

                trainer.training_step = timed  # one micro-batch a step here
                trainer.train()
                steps = [x["step_time"] for x in trainer.state.log_history if "step_time" in x]
                times[name].append(statistics.mean(steps[1:] or steps))  # first step warms up
                cpu[name].append(statistics.mean(step_cpu[1:] or step_cpu))
        print(f"round {r + 1}/{a.rounds}: " + ", ".join(
            f"{k} {v[-1]:.3f} s ({cpu[k][-1]:.3f} s CPU)" for k, v in times.items()), flush=True)
    for clock, table in (("wall", times), ("CPU", cpu)):
        ref = statistics.median(table["GRPOTrainer"])
        uni = statistics.median(table["pepo uniform"])
        print(f"\nmedian {clock} s/step, ratio to plain GRPOTrainer and to pepo uniform:")
        for name, v in table.items():
            med = statistics.median(v)
            print(f"  {name:24s} {med:.3f} s/step  {med / ref:.3f}x  {med / uni:.3f}x")
        per_round = [t / u for t, u in zip(table["pepo global_topk"], table["pepo uniform"])]
        print(f"global_topk / uniform per round ({clock}): "
              + ", ".join(f"{r:.3f}" for r in per_round))


if __name__ == "__main__":
    main()
