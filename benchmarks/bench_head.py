"""The output head's product both ways, at the row counts of a decode step.

    python benchmarks/bench_head.py [--vocab 49152] [--dim 576] [--rows 32 8 1] [--calls 20]
        [--repeats 7]

The in-process decoder makes its fp32 logits on a CPU as ``W · xᵀ`` (``[V, d] x [d, b]``),
transposed back and made contiguous (``pepo.training.fast_decoder._head``), where the module
computes ``x · Wᵀ`` (``nn.Linear``). The defaults are SmolLM2-135M's head (``[b, 576] x
[576, 49152]``). For each row count the two products alternate, ``--repeats`` rounds of
``--calls`` calls each after a warm-up; the table gives the medians per call, their ratio
measured in this run, and how far the two results differ (0 where they agree to the bit).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch
from machine import cpu_name


def per_call(fn: Callable[[], torch.Tensor], calls: int) -> float:
    """Seconds per call of ``fn``, over ``calls`` calls."""
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--dim", type=int, default=576)
    ap.add_argument("--rows", type=int, nargs="+", default=[32, 8, 1])
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    for name in ("vocab", "dim", "calls", "repeats"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if min(args.rows) < 1:
        ap.error(f"--rows must be at least 1, got {min(args.rows)}")

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(args.vocab, args.dim, generator=gen) * 0.02
    print(f"# {cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}; "
          f"head [{args.vocab}, {args.dim}] fp32, medians of {args.repeats} x {args.calls} calls")
    print("| rows | x · Wᵀ ms | W · xᵀ ms | ratio | max abs difference |")
    print("|---:|---:|---:|---:|---:|")
    for rows in args.rows:
        x = torch.randn(rows, args.dim, generator=gen)

        def module() -> torch.Tensor:
            return x @ w.t()

        def transposed() -> torch.Tensor:
            return (w @ x.t()).t().contiguous()

        module(), transposed()
        a, b = [], []
        for _ in range(args.repeats):
            a.append(per_call(module, args.calls))
            b.append(per_call(transposed, args.calls))
        ma, mb = statistics.median(a), statistics.median(b)
        diff = (module() - transposed()).abs().max().item()
        print(f"| {rows} | {ma * 1e3:.3g} | {mb * 1e3:.3g} | {mb / ma:.2f}x | {diff:.1e} |")


if __name__ == "__main__":
    main()
