"""Rollout engines compared on one config: generation throughput and step time.

    python benchmarks/bench_engines.py [--config tiny] [--steps 10] [--engines inprocess vllm]
        [key=value ...]

Runs the recipe for ``--steps`` steps with each engine (same seed, no validation, no
checkpoints) in this process, one after the other, and prints per engine: rollouts per step,
generated tokens per second of the step's generation part (``gen_time``: decoding and the
rewards, the same reward function for every engine), median step time, the median
engine/trainer log-prob gap, and the engine's start-up time (set-up). The first step is left out
of the medians (warm-up). Measured in one invocation on one machine: compare the ratios, not
the absolute numbers, across machines. Extra ``key=value`` arguments override the config
(``generation.vllm.dtype=bfloat16``, ``device=cuda``, ...).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from machine import cpu_name
from omegaconf import OmegaConf

import pepo_recipe
from pepo.training.config import find_config, register_resolvers


def run(config: str, engine: str, steps: int, out: Path, overrides: list[str]) -> dict:
    register_resolvers()
    cfg = OmegaConf.merge(
        OmegaConf.load(find_config(config)),
        {"output_dir": str(out / engine), "num_steps": steps, "validation": {"every": 0},
         "save_every": 0, "dump_rollouts_every": 0, "plot": False,
         "generation": {"engine": engine}},
        OmegaConf.from_dotlist(overrides),
    )
    recipe = pepo_recipe.PEPORecipe(cfg)
    t0 = time.perf_counter()
    recipe.setup(cfg)
    setup_s = time.perf_counter() - t0
    recipe.run()
    hist = [h for h in recipe.history if "loss" in h][1:]  # leave out the warm-up step
    rollouts = recipe.prompts_per_step * recipe.estimator.rollouts_per_prompt
    tokens = [h["response_len"] * rollouts for h in hist]
    return {
        "engine": engine,
        "rollouts_per_step": rollouts,
        "gen_tokens_per_s": statistics.median(t / h["gen_time"] for t, h in zip(tokens, hist)),
        "gen_time": statistics.median(h["gen_time"] for h in hist),
        "step_time": statistics.median(h["step_time"] for h in hist),
        "logprob_gap": statistics.median(h["rollout_logprob_gap"] for h in hist),
        "setup_s": setup_s,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="tiny")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--engines", nargs="+", default=["inprocess", "vllm"])
    args, overrides = ap.parse_known_args()
    print(f"# {cpu_name()}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}, config {args.config}, {args.steps} steps "
          f"(medians over steps 2..{args.steps})")
    with tempfile.TemporaryDirectory() as tmp:
        results = [run(args.config, e, args.steps, Path(tmp), overrides) for e in args.engines]
    base = results[0]
    print("| engine | rollouts/step | generated tokens/s (of generation + rewards) | "
          "generation s/step | step s | log-prob gap | set-up s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r['engine']} | {r['rollouts_per_step']} | {r['gen_tokens_per_s']:.0f} "
              f"({r['gen_tokens_per_s'] / base['gen_tokens_per_s']:.2f}×) | {r['gen_time']:.3f} | "
              f"{r['step_time']:.3f} ({r['step_time'] / base['step_time']:.2f}×) | "
              f"{r['logprob_gap']:.1e} | {r['setup_s']:.1f} |")


if __name__ == "__main__":
    main()
