"""The in-process decoder against the machine's bounds, on the embedded tasks' shipped models.

    python benchmarks/bench_decoder.py [--configs tiny tiny_drift] [--rows 64 256]
        [--repeats 3] [--compile] [--no-reference] [--device cpu]

For each config and batch of ``--rows`` rollouts (the config's prompts, 8 rollouts each, the
config's sampling settings and response limit, one seed per rollout) it decodes with
``pepo.training.generation.generate``: the reference decoder (torchtune's KV cache, every row in
lock-step to the end), the fast decoder (the default), and with ``--compile`` the fast decoder's
step through ``torch.compile`` (its compilation time is printed apart). They run back to back,
``--repeats`` rounds in turn after a warm-up, so a change of load hits all of them; the table
gives median generated tokens/s, and the share of rows each decoder sampled exactly as the
reference decoder did (same seeds: the same tokens are expected, but for the rare draw a float
reordering flips).

Two bounds, measured in the same run:

* **matmul bound**: 2 x parameters FLOP per generated token at the FLOP/s this machine's GEMMs
  reach on the decode step's shapes, timed alone: every linear layer of the model applied to
  ``[rows, d_in]`` inputs, and the products as the fast decoder runs them (q/k/v and the MLP's
  gate and up projections stacked into one each); the faster of the two sets gives the bound.
  It leaves out attention.
* **roofline**: the matmul bound's time plus reading the KV cache once per decoding step (what
  attention cannot avoid: ``2 x layers x kv_heads x head_dim`` values per cached position, the
  prompt's positions once per prompt with a row still decoding and each row's response
  positions). Each step's read is timed at the read bandwidth this machine shows for a tensor of
  that step's working set (its KV read plus the model's weights), interpolated between sizes
  measured in this run (4-256 MB): a cache that fits the processor's caches is read faster than
  one that streams from memory, and the bound takes the faster rate where it applies.

Ratios are within this one run; the machine line says where it ran. With ``--device cuda``
the decoders run on the GPU (timed between synchronisations) and the bounds, which are this
CPU's, are left out.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F
from machine import cpu_name
from omegaconf import OmegaConf
from torchtune import config as tt_config

import pepo.training.generation as G
from pepo.training.config import find_config, register_resolvers
from pepo.training.fast_decoder import FastPlan
from pepo.training.weights import load_model_weights


def load(config: str, rows: int, device: str = "cpu"):
    """Model (on ``device``), prompts (8 rollouts of each) and generate() keywords of
    ``config``."""
    register_resolvers()
    cfg = OmegaConf.load(find_config(config))
    model = tt_config.instantiate(cfg.model)
    load_model_weights(model, cfg.checkpoint_dir)
    model.eval().to(device)
    tok = tt_config.instantiate(cfg.tokenizer)
    data = tt_config.instantiate(cfg.dataset)
    prompts = [tok.encode_prompt(data[i // 8].prompt) for i in range(rows)]
    g = cfg.generation
    kw = dict(max_new_tokens=int(g.max_new_tokens), pad_id=tok.pad_id,
              stop_tokens=list(tok.stop_tokens), temperature=float(g.temperature),
              top_k=g.get("top_k"), top_p=float(g.top_p), seeds=torch.arange(rows) * 7919 + 1)
    return model, prompts, kw


def linear_weights(model: torch.nn.Module) -> list[torch.Tensor]:
    """Every linear weight of the model, and a tied output head's (the embedding)."""
    weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    if not isinstance(model.output, torch.nn.Linear):  # tied: the embedding is the head's weight
        weights.append(model.tok_embeddings.weight)
    return weights


def step_weights(model: torch.nn.Module) -> list[torch.Tensor]:
    """The weights of the products the fast decoder's step runs: the fused q/k/v and gate/up
    stacks where its plan has them, the other linear layers as they are."""
    plan = FastPlan.of(model)
    parts = set()  # the weights inside a stack
    for layer, f in zip(plan.layers, plan.fused):
        attn, mlp = layer.attn, layer.mlp
        if f.qkv is not None:
            for m in (attn.q_proj, attn.k_proj, attn.v_proj):
                parts.add(id(getattr(m, "linear", m).weight))  # Qwen3: inside a HeadNormProjection
        if f.up is not None:
            parts.update({id(mlp.w1.weight), id(mlp.w3.weight)})
    stacks = [w for f in plan.fused for w in (f.qkv, f.up) if w is not None]
    return [w for w in linear_weights(model) if id(w) not in parts] + stacks


def gemm_rate(weights: list[torch.Tensor], rows: int, seconds: float = 1.0) -> float:
    """FLOP/s of ``weights`` each applied to ``[rows, d_in]``, timed back to back."""
    xs = {w.shape[1]: torch.randn(rows, w.shape[1], dtype=w.dtype) for w in weights}
    flop = 2 * rows * sum(w.numel() for w in weights)

    def step() -> None:
        for w in weights:
            F.linear(xs[w.shape[1]], w)

    with torch.no_grad():
        for _ in range(10):
            step()
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            step()
            n += 1
    return flop * n / (time.perf_counter() - t0)


BANDWIDTH_SIZES_MB = (4, 8, 16, 32, 64, 128, 256)


def read_bandwidths(sizes_mb=BANDWIDTH_SIZES_MB) -> list[tuple[int, float]]:
    """``(bytes, bytes/s)`` of a sum over a float32 tensor of each size, at least 2 GB read per
    size after a warm-up (the tensor is then as warm in the caches as it will get)."""
    curve = []
    for mb in sizes_mb:
        x = torch.ones(mb * 250_000)
        nbytes = x.numel() * 4
        x.sum()
        x.sum()
        k = max(5, 2_000_000_000 // nbytes)
        t0 = time.perf_counter()
        for _ in range(k):
            x.sum()
        curve.append((nbytes, k * nbytes / (time.perf_counter() - t0)))
    return curve


def bandwidth_at(curve: list[tuple[int, float]], nbytes: float) -> float:
    """The read bandwidth for a working set of ``nbytes``: linear in log(size) between the two
    measured sizes around it, the nearest measured one outside them."""
    return float(np.interp(math.log(max(nbytes, 1.0)), [math.log(n) for n, _ in curve],
                           [r for _, r in curve]))


def kv_step_bytes(model: torch.nn.Module, ro: G.Rollouts) -> torch.Tensor:
    """Bytes of K and V each decoding step must read (``[T]``, step ``t`` feeding response
    token ``t``): the (padded) prompt columns once per prompt that still has a row decoding (its
    rollouts share them), and the ``t`` response columns of each row still decoding."""
    attn = model.layers[0].attn
    per_position = 2 * len(model.layers) * attn.num_kv_heads * attn.head_dim * \
        next(model.parameters()).element_size()
    plen = ro.prompt_tokens.shape[1]
    lengths = ro.mask.sum(-1)  # tokens per row: the row decodes at steps 0 .. length - 1
    _, prompt_of = torch.unique(ro.prompt_tokens, dim=0, return_inverse=True)
    longest = torch.zeros(int(prompt_of.max()) + 1, dtype=lengths.dtype).scatter_reduce(
        0, prompt_of, lengths, "amax")  # steps during which the prompt is read
    t = torch.arange(ro.mask.shape[1])
    rows = (lengths[None, :] > t[:, None]).sum(-1)  # rows decoding at step t
    prompts = (longest[None, :] > t[:, None]).sum(-1)
    return (prompts * plen + rows * t) * per_position


def kv_seconds(model: torch.nn.Module, ro: G.Rollouts, curve) -> float:
    """The time to read :func:`kv_step_bytes`, each step at the bandwidth of its working set
    (its KV read plus the model's weights, which every step reads too)."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return sum(b / bandwidth_at(curve, b + weights) for b in kv_step_bytes(model, ro).tolist()
               if b > 0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", nargs="+", default=["tiny", "tiny_drift"])
    ap.add_argument("--rows", nargs="+", type=int, default=[64, 256])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--compile", action="store_true", help="also the compiled decode step")
    ap.add_argument("--no-reference", action="store_true",
                    help="skip the reference decoder (no speed-up column)")
    ap.add_argument("--device", default="cpu", help="where the decoders run (cpu, cuda)")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type not in ("cpu", "cuda"):
        ap.error(f"--device {args.device}: cpu or cuda")
    on_cpu = device.type == "cpu"
    if on_cpu:
        curve = read_bandwidths()
        bws = ", ".join(f"{n / 1e6:.0f} MB {r / 1e9:.0f}" for n, r in curve)
        where = f"read bandwidth GB/s by size: {bws}"
    else:
        where = f"decoding on {torch.cuda.get_device_name(device)}; bounds left out"
    print(f"# {cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}; "
          f"{where}; medians of {args.repeats} rounds")
    decoders = ([] if args.no_reference else ["reference"]) + ["fast"] + \
        (["compiled"] if args.compile else [])
    print("| config | rows | decoder | generated tokens/s | vs reference | rows = reference | "
          "matmul bound tok/s | of matmul bound | roofline tok/s | of roofline |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|")

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for name in args.configs:
        for rows in args.rows:
            model, prompts, kw = load(name, rows, args.device)
            params = sum(p.numel() for p in model.parameters())

            def run(decoder: str) -> tuple[G.Rollouts, float]:
                sync()
                t0 = time.perf_counter()
                ro = G.generate(model, prompts, decoder="reference" if decoder == "reference"
                                else "fast", compile=decoder == "compiled", **kw)
                sync()
                return ro, time.perf_counter() - t0

            compile_s = None
            for d in decoders:  # warm-up (and the compilation)
                _, seconds = run(d)
                if d == "compiled" and compile_s is None:
                    compile_s = seconds
            rates: dict[str, list[float]] = {d: [] for d in decoders}
            last: dict[str, G.Rollouts] = {}
            for _ in range(args.repeats):
                for d in decoders:
                    last[d], seconds = run(d)
                    rates[d].append(int(last[d].mask.sum()) / seconds)
            ro = last[decoders[-1]]
            tokens = int(ro.mask.sum())
            if on_cpu:
                rate = max(gemm_rate(linear_weights(model), rows),
                           gemm_rate(step_weights(model), rows))
                bound = rate / (2 * params)
                roof = tokens / (tokens / bound + kv_seconds(model, ro, curve))
            base = statistics.median(rates["reference"]) if "reference" in rates else None
            for d in decoders:
                med = statistics.median(rates[d])
                vs = f"{med / base:.2f}x" if base else "-"
                same = f"{same_rows(last[d], last['reference']):.1%}" if base else "-"
                label = d
                if d == "compiled":  # compiled once per process, for every shape
                    label += (f" (compiled in {compile_s:.0f} s)" if compile_s >= 1 else
                              " (compiled above)")
                bounds = (f"{bound:.0f} ({rate / 1e9:.0f} GFLOP/s) | {med / bound:.0%} | "
                          f"{roof:.0f} | {med / roof:.0%}" if on_cpu else "- | - | - | -")
                print(f"| {name} ({params / 1e6:.2f}M, {tokens / rows:.0f} tokens/row) | {rows} | "
                      f"{label} | {med:.0f} | {vs} | {same} | {bounds} |", flush=True)


def same_rows(a: G.Rollouts, b: G.Rollouts) -> float:
    """The share of rows whose tokens and mask are the same in ``a`` and ``b``."""
    w = max(a.tokens.shape[1], b.tokens.shape[1])

    def widen(x: torch.Tensor, value) -> torch.Tensor:
        return F.pad(x, (0, w - x.shape[1]), value=value)

    same = ((widen(a.tokens, -1) == widen(b.tokens, -1)).all(-1)
            & (widen(a.mask, False) == widen(b.mask, False)).all(-1))
    return same.float().mean().item()


if __name__ == "__main__":
    main()
