"""The training update against the machine's matmul limit, in fp32 and in bf16.

    python benchmarks/bench_update.py [--model smollm2 | --model-dir DIR] [--rows 8]
        [--seq 140] [--repeats 5] [--precisions fp32 bf16 bf16w] [--save-logits-mib 512]

First the CPU's (or GPU's) measured matmul rate at each GEMM shape of one micro-batch of the
update (``--rows`` sequences of ``--seq`` tokens: the projections of every layer on every
token, and the output head on the response tokens alone, ``--seq - --prompt`` a row, in the
shape it runs: up to 1,024 rows, on a CPU 4,096 vocabulary columns at a time; forward shapes,
the backward runs the same products transposed), in each precision. Then the bound: the time
those GEMMs would take at the measured rates, three times over (forward, and the two products
of the backward), i.e. about 6 x (the layers' parameters x tokens + the head's x response
tokens) FLOPs. Then the
update of one micro-batch, timed, and its achieved rate against the bound, two ways: as the
recipe runs it (``pepo.training.step.policy_logprobs``: the ``[b, S, S]`` attention mask and
positions of the rows, the log-probs taken from the hidden states in chunks as
``logprobs_from_hidden: true``, their logits kept for the backward within
``--save-logits-mib``, on a CPU the attention in fp32 as the recipe runs it; then the clipped
loss and the backward), and the same with the
model's plain causal attention (no mask passed), which shows what the explicit mask costs.
Precisions: ``fp32``; ``bf16``, the recipe's ``compute_dtype: bf16`` (``torch.autocast`` over
fp32 master weights; the output head's logits in fp32, so its bound counts the head's forward
at the fp32 rate and its two gradient products at the bf16 one); ``bf16w``, bf16 parameters
without autocast (what ``dtype: bf16`` trains, with a stochastic-rounding optimizer). Every
figure is the median of ``--repeats`` after one warm-up, measured in this run.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from machine import cpu_name


def _median_time(fn, repeats: int, device: torch.device) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


HEAD_ROWS = 1024  # the rows of one head product (the recipe's chunk_size, passed below)
CPU_VOCAB_BLOCK = 4096  # the vocabulary columns of one on a CPU (pepo.entropy's, its docstring)


def gemm_shapes(cfg: dict, tokens: int, response_tokens: int, device_type: str
                ) -> list[tuple[str, int, int, int, float]]:
    """``(name, M, K, N, count)`` of one forward's matrix products, ``count`` per forward: the
    layers' on every token, the head's on the response tokens (the log-probs' positions) in the
    blocks it runs, the count fractional where the last block is smaller."""
    d, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or d // heads
    layers = cfg["num_hidden_layers"]
    rows = min(response_tokens, HEAD_ROWS)
    cols = min(v, CPU_VOCAB_BLOCK) if device_type == "cpu" else v
    return [
        ("q, o", tokens, d, heads * hd, 2 * layers),
        ("k, v", tokens, d, kv * hd, 2 * layers),
        ("gate, up", tokens, d, f, 2 * layers),
        ("down", tokens, f, d, layers),
        ("head", rows, d, cols, response_tokens / rows * v / cols),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2", help="a packaged pretrained model")
    ap.add_argument("--model-dir", default=None, help="an HF checkpoint directory instead")
    ap.add_argument("--rows", type=int, default=8, help="sequences per micro-batch")
    ap.add_argument("--seq", type=int, default=140, help="tokens per sequence (prompt + response)")
    ap.add_argument("--prompt", type=int, default=45, help="prompt tokens of each sequence")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--precisions", nargs="+", default=["fp32", "bf16", "bf16w"],
                    choices=["fp32", "bf16", "bf16w"])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--save-logits-mib", type=float, default=512,
                    help="the recipe's save_logits_mib (smollm2's 512; 0: the head's logits made "
                    "again in the backward)")
    args = ap.parse_args()
    if args.rows < 1 or args.seq <= args.prompt or args.prompt < 1 or args.repeats < 1:
        raise SystemExit(f"need rows >= 1, seq > prompt >= 1 and repeats >= 1; got "
                         f"rows={args.rows} seq={args.seq} prompt={args.prompt} "
                         f"repeats={args.repeats}")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device")

    from pepo.entropy import logprobs_and_entropy_from_hidden
    from pepo.loss import clipped_policy_loss
    from pepo.training.generation import Rollouts
    from pepo.training.hf import architecture_from_hf, load_hf_config
    from pepo.training.precision import cpu_attention_in_fp32, cpu_bf16_units
    from pepo.training.pretrained import pretrained_dir
    from pepo.training.step import policy_logprobs, saves_logits

    model_dir = args.model_dir or pretrained_dir(args.model)
    cfg = load_hf_config(model_dir)
    tokens = args.rows * args.seq
    shapes = gemm_shapes(cfg, tokens, args.rows * (args.seq - args.prompt), device.type)
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "bf16w": torch.bfloat16}
    units = cpu_bf16_units() if device.type == "cpu" else ()
    print(f"machine: {cpu_name() if device.type == 'cpu' else torch.cuda.get_device_name()}, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}"
          + (f", bf16 units: {', '.join(units) or 'none'}" if device.type == "cpu" else ""))
    print(f"model: {model_dir} ({cfg['num_hidden_layers']} layers, d={cfg['hidden_size']}); "
          f"micro-batch {args.rows} x {args.seq} = {tokens} tokens\n")

    rates: dict[str, dict[str, float]] = {p: {} for p in args.precisions}
    print("| GEMM [M, K] x [K, N] | per forward | " + " | ".join(
        f"{p} GFLOP/s" for p in args.precisions) + " |")
    print("|---|---:|" + "---:|" * len(args.precisions))
    for name, m, k, n, count in shapes:
        row = []
        for p in args.precisions:
            a = torch.randn(m, k, device=device, dtype=dtypes[p])
            b = torch.randn(k, n, device=device, dtype=dtypes[p])
            t = _median_time(lambda: a @ b, args.repeats, device)
            rates[p][name] = 2 * m * k * n / t / 1e9
            row.append(f"{rates[p][name]:.0f}")
        print(f"| {name}: [{m}, {k}] x [{k}, {n}] | {count:.4g} | " + " | ".join(row) + " |")

    model = architecture_from_hf(model_dir, max_seq_len=args.seq).to(device)
    if device.type == "cpu":  # as the recipe does
        cpu_attention_in_fp32(model)
    params = sum(p.numel() for p in model.parameters())
    g = torch.Generator().manual_seed(0)
    seq = torch.randint(0, cfg["vocab_size"], (args.rows, args.seq), generator=g).to(device)
    targets = seq[:, args.prompt:]
    mask = torch.ones_like(targets, dtype=torch.bool)
    old_lp = torch.full(targets.shape, -2.0, device=device)
    adv = torch.randn(targets.shape, generator=g).to(device)
    plen = args.prompt
    ro = Rollouts(prompt_tokens=seq[:, :plen],
                  prompt_mask=torch.ones_like(seq[:, :plen], dtype=torch.bool),
                  tokens=targets, mask=mask, finished=torch.ones(args.rows, dtype=torch.bool))
    rows = torch.arange(args.rows)

    # the responses' fp32 logits kept for the backward as the recipe keeps them
    save = saves_logits(targets.numel(), cfg["vocab_size"], args.save_logits_mib)

    def head_of(model):  # the output head as the recipe's, over the model's own causal mask
        def head(h: torch.Tensor):
            out = model.output
            weight = getattr(out, "tied_module", out).weight  # [V, D]
            return logprobs_and_entropy_from_hidden(model.norm(h)[:, plen - 1 : -1], weight,
                                                    targets, chunk_size=1024, temperature=1.0,
                                                    save_logits=save)
        return head

    models = {"fp32": model, "bf16": model}
    if "bf16w" in args.precisions:
        models["bf16w"] = copy.deepcopy(model).to(torch.bfloat16)

    def update(precision: str, recipe: bool) -> None:
        model = models[precision]
        model.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
            if recipe:
                lp, _ = policy_logprobs(model, ro, rows, chunk_size=1024, temperature=1.0,
                                        from_hidden=True, save_logits_mib=args.save_logits_mib)
            else:
                model.unembed = head_of(model)
                try:
                    lp, _ = model(seq)
                finally:
                    del model.unembed
            loss = clipped_policy_loss(lp.float(), old_lp, adv, mask, num_tokens=mask.sum())
        loss.backward()

    def seconds(p: str, name: str, m: int, k: int, n: int, count: float) -> float:
        """The forward's and the backward's two products of one shape at ``p``'s rates; the
        recipe's bf16 makes the head's logits in fp32 (its two gradient products in bf16)."""
        one = count * 2 * m * k * n / 1e9
        if p == "bf16" and name == "head" and "fp32" in rates:
            return one / rates["fp32"][name] + 2 * one / rates[p][name]
        return 3 * one / rates[p][name]

    flops = sum(6 * count * m * k * n for _, m, k, n, count in shapes)
    print(f"\n{params / 1e6:.1f}M parameters: {flops / 1e9:.4g} GFLOP per micro-batch update "
          f"(the products above, forward + backward: 6 x the layers' parameters x {tokens} "
          f"tokens + 6 x the head's x {args.rows * (args.seq - args.prompt)} response tokens)\n")
    print("| precision | attention | update s | achieved GFLOP/s | GEMM bound s | of the bound |")
    print("|---|---|---:|---:|---:|---:|")
    for p in args.precisions:
        bound = sum(seconds(p, *shape) for shape in shapes)
        for recipe in (True, False):
            t = _median_time(lambda: update(p, recipe), args.repeats, device)
            how = "the recipe's mask" if recipe else "causal, no mask"
            print(f"| {p} | {how} | {t:.3g} | {flops / t / 1e9:.4g} | {bound:.3g} | "
                  f"{100 * bound / t:.0f} % |")


if __name__ == "__main__":
    main()
