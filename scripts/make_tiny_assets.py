"""Builds the embedded task's tokenizer and warm-start checkpoint (``src/pepo/assets/tiny``).

    python scripts/make_tiny_assets.py [--steps N] [--noise P] [--out DIR]

1. A character-level ``tokenizer.json`` (Hugging Face ``tokenizers``, WordLevel over the task's
   alphabet) and its ``tokenizer_config.json``.
2. ``model.safetensors``: ``pepo.models.tiny_qwen3`` trained by supervised fine-tuning on worked
   solutions of the training split in which each step's result is replaced by a random digit
   with probability ``--noise``. The model learns the arithmetic but keeps that much
   probability on wrong digits, so sampled responses (temperature 1) succeed only part of the
   time while greedy ones mostly succeed: a starting point RL can visibly improve on, with its
   uncertainty on the decision tokens (the results), as in a real reasoning model.

Everything is seeded; the run takes a few minutes on 2 CPU cores and prints the pass rates of
the result.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

from pepo.generation import generate
from pepo.models import tiny_qwen3
from pepo.rewards import boxed_match
from pepo.tasks import modsum_dataset
from pepo.tokenizers import load_tokenizer

ALPHABET = "0123456789+-= \nmodbxe\\{}"
SPECIALS = ["<|endoftext|>", "<|im_end|>", "<unk>"]


def build_tokenizer(out: Path) -> None:
    vocab = {t: i for i, t in enumerate(SPECIALS + list(ALPHABET))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIALS[:2])
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps({"pad_token": "<|endoftext|>", "eos_token": "<|im_end|>"}, indent=2) + "\n"
    )


def noisy_solution(solution: str, rng: random.Random, noise: float) -> str:
    """Replaces each step's result digit with a random digit with probability ``noise``.

    Later steps keep using the corrupted value, so a noisy solution stays self-consistent
    from the error on (as a model's own mistakes are) and its boxed answer is the final value.
    """
    lines = solution.split("\n")[:-1]
    acc = int(lines[0][0])
    out = []
    for line in lines:
        op, d = line[1], int(line[2])
        new = (acc + d) % 10 if op == "+" else (acc - d) % 10
        if rng.random() < noise:
            new = rng.randrange(10)
        out.append(f"{acc}{op}{d}={new}")
        acc = new
    return "\n".join(out) + f"\n\\boxed{{{acc}}}"


def pass_rate(model, tok, problems, temperature, samples=1, seed=0) -> float:
    gen = torch.Generator().manual_seed(seed)
    prompts = [tok.encode(p.prompt) for p in problems for _ in range(samples)]
    answers = [p.answer for p in problems for _ in range(samples)]
    r = generate(model, prompts, max_new_tokens=64, pad_id=tok.pad_id, stop_tokens=tok.stop_tokens,
                 temperature=temperature, generator=gen)
    texts = [tok.decode(t[m].tolist()) for t, m in zip(r.tokens, r.mask)]
    return sum(boxed_match(texts, answers)) / len(answers)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "src/pepo/assets/tiny"))
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--noise", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out)
    tok = load_tokenizer(out)

    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    model = tiny_qwen3(vocab_size=32)
    train = modsum_dataset(20000, seed=1000 + args.seed, split="train")
    val = modsum_dataset(128, seed=0, split="val")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.steps,
                                                pct_start=0.1)
    t0 = time.time()
    for step in range(1, args.steps + 1):
        batch = rng.sample(train, args.batch)
        seqs, plens = [], []
        for p in batch:
            pi = tok.encode(p.prompt)
            ri = tok.encode(noisy_solution(p.solution, rng, args.noise)) + [tok.eos_id]
            seqs.append(pi + ri)
            plens.append(len(pi))
        width = max(map(len, seqs))
        ids = torch.full((len(seqs), width), tok.pad_id)
        loss_mask = torch.zeros((len(seqs), width), dtype=torch.bool)
        for i, (s, pl) in enumerate(zip(seqs, plens)):
            ids[i, : len(s)] = torch.tensor(s)
            loss_mask[i, pl : len(s)] = True
        logits = model(ids[:, :-1])  # [B, S-1, V]
        tgt_mask = loss_mask[:, 1:]
        loss = torch.nn.functional.cross_entropy(logits[tgt_mask], ids[:, 1:][tgt_mask])
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 100 == 0 or step == args.steps:
            print(f"step {step:5d}  loss {loss.item():.4f}  {time.time() - t0:6.1f}s", flush=True)

    model.eval()
    sampled = pass_rate(model, tok, val, temperature=1.0, samples=4)
    greedy = pass_rate(model, tok, val, temperature=1e-4)
    print(f"validation pass rate: sampled (T=1, avg@4) {sampled:.3f}, greedy {greedy:.3f}")
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(out / "model.safetensors"),
              metadata={"builder": "pepo.models.tiny_qwen3", "steps": str(args.steps),
                        "noise": str(args.noise), "seed": str(args.seed)})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
