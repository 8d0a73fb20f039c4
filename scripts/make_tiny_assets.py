"""Builds an embedded task's tokenizer and warm-start checkpoint (``src/pepo/assets/<task>``).

    python scripts/make_tiny_assets.py [--task tiny|tiny_drift|tiny_reason] [--steps N]
        [--noise P] --out DIR     (a new DIR; --force writes over assets there, or over
                                   the shipped src/pepo/assets/<task> without --out)

1. A character-level ``tokenizer.json`` (Hugging Face ``tokenizers``, WordLevel over the task's
   alphabet) and its ``tokenizer_config.json``.
2. ``model.safetensors``: ``pepo.training.models.tiny_qwen3`` trained by supervised fine-tuning on
   worked solutions of the training split in which each step's result is replaced by a random digit
   with probability ``--noise``. The model learns the arithmetic but keeps that much
   probability on wrong digits, so sampled responses (temperature 1) succeed only part of the
   time while greedy ones mostly succeed: a starting point RL can visibly improve on, with its
   uncertainty on the decision tokens (the results), as in a real reasoning model.

Everything is seeded; the run takes a few minutes on 2 CPU cores (about 9 on a busy one) and
prints the pass rates of the result. The shipped assets were made by earlier versions of this
script, whose training loop differed: ``tiny`` with 1500 steps, ``tiny_drift`` with
``--steps 1200 --batch 32``, ``tiny_reason`` with the defaults (each file's metadata names its
steps). A rebuild gives a model of the same kind and pass rates close to the shipped one's, not
the same bytes, so the published figures stand on the shipped files.

``--task tiny_drift`` builds the second task's assets (``pepo.tasks.problems.drift_dataset``): a
larger model (4 layers, width 128, 320 positions) and noise that depends on the step, as a reasoning
model's uncertainty does: a ``*`` step's result is wrong with probability 0.12, a ``-`` step's
with 0.01, a ``+`` step's with 0.003, and every operand and operator is misread with probability
0.002 (the step then follows from what was read). The ``*`` steps sit early in the chain, so
entropy decays along a response and is higher on problems with many of them. About 25 minutes
on 2 cores at the default 2500 steps (the shipped asset: ``--steps 1200 --batch 32``).

``--task tiny_reason`` builds the reasoning-scale task's assets
(``pepo.tasks.problems.reason_dataset``, the drift model's size): a ``*`` result is redrawn at
random with probability 0.3 and a ``-`` result with 0.01 (the decision points), ``+`` results
and operands are never wrong, and the first 90 % of the steps carry two meaningless forks
(``noisy_solution``'s ``forks``): the order of a commutative step's operands and the separator
after the step. Most tokens are then certain, a fifth sit near ln 2 nats (the forks) and the
early ``*`` results are the most uncertain, the scale of a reasoning model's chain of thought.
About an hour on 2 cores (58 minutes for the shipped assets).
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

from pepo.study.cli import positive_arg, positive_number_arg, probability_arg
from pepo.tasks import apply_op, drift_dataset, modsum_dataset, reason_dataset
from pepo.tasks.rewards import boxed_match
from pepo.training.config import check_output_dir
from pepo.training.generation import generate
from pepo.training.models import tiny_qwen3
from pepo.training.tokenizers import load_tokenizer

ALPHABET = "0123456789+-= \nmodbxe\\{}"

# per task: alphabet, model, datasets, noise (result noise per operator, misreading), max length
TASKS = {
    "tiny": dict(
        alphabet=ALPHABET, model={}, data=modsum_dataset, steps=1500,
        noise={"+": 0.1, "-": 0.1}, read=0.0, max_new_tokens=64,
    ),
    "tiny_drift": dict(
        alphabet=ALPHABET + "*",  # the tiny task's ids unchanged, one more token
        model=dict(num_layers=4, embed_dim=128, intermediate_dim=384, max_seq_len=320),
        data=drift_dataset, steps=2500,
        noise={"*": 0.12, "-": 0.01, "+": 0.003}, read=0.002, max_new_tokens=232,
    ),
    "tiny_reason": dict(
        alphabet=ALPHABET + "*;",  # the drift task's ids unchanged, one more token
        model=dict(num_layers=4, embed_dim=128, intermediate_dim=384, max_seq_len=320),
        data=reason_dataset, steps=2500,
        noise={"*": 0.3, "-": 0.01, "+": 0.0}, read=0.0, forks=0.9, max_new_tokens=232,
    ),
}
SPECIALS = ["<|endoftext|>", "<|im_end|>", "<unk>"]


def build_tokenizer(out: Path, alphabet: str = ALPHABET) -> None:
    vocab = {t: i for i, t in enumerate(SPECIALS + list(alphabet))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIALS[:2])
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps({"pad_token": "<|endoftext|>", "eos_token": "<|im_end|>"}, indent=2) + "\n",
        encoding="utf-8",
    )


def noisy_solution(solution: str, rng: random.Random, noise, read: float = 0.0,
                   forks: float = 0.0) -> str:
    """Replaces each step's result digit with a random digit with probability ``noise`` (a
    float, or a dict operator -> probability); with probability ``read`` each operator and
    operand of a step is misread first (replaced at random) and the step follows from it.

    Later steps keep using the corrupted value, so a noisy solution stays self-consistent
    from the error on (as a model's own mistakes are) and its boxed answer is the final value.

    ``forks``: the fraction of the steps, from the start, that are written with two
    meaningless coin flips (``--task tiny_reason``): a ``+`` or ``*`` step's operands in either
    order (``4*7=8`` or ``7*4=8``), and the separator after the step (newline or ``;``). They
    change no value and no length.
    """
    lines = solution.split("\n")[:-1]
    acc = int(lines[0][0])
    out = []
    for i, line in enumerate(lines):
        op, d = line[1], int(line[2])
        if read > 0:
            if rng.random() < read:
                op = rng.choice([o for o in "+-*" if o != op])
            if rng.random() < read:
                d = rng.choice([x for x in range(10) if x != d])
        new = apply_op(acc, op, d)
        p = noise[op] if isinstance(noise, dict) else noise
        if rng.random() < p:
            new = rng.randrange(10)
        forked = i < forks * len(lines)
        a, b = (d, acc) if forked and op in "+*" and rng.random() < 0.5 else (acc, d)
        sep = ";" if forked and i < len(lines) - 1 and rng.random() < 0.5 else "\n"
        out.append(f"{a}{op}{b}={new}{sep}")
        acc = new
    return "".join(out) + f"\\boxed{{{acc}}}"


def pass_rate(model, tok, problems, temperature, samples=1, seed=0, max_new_tokens=64) -> float:
    gen = torch.Generator().manual_seed(seed)
    prompts = [tok.encode(p.prompt) for p in problems for _ in range(samples)]
    answers = [p.answer for p in problems for _ in range(samples)]
    r = generate(model, prompts, max_new_tokens=max_new_tokens, pad_id=tok.pad_id,
                 stop_tokens=tok.stop_tokens, temperature=temperature, generator=gen)
    texts = [tok.decode(t[m].tolist()) for t, m in zip(r.tokens, r.mask)]
    return sum(boxed_match(texts, answers)) / len(answers)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--task", choices=sorted(TASKS), default="tiny")
    ap.add_argument("--out", default=None,
                    help="default: src/pepo/assets/<task>, which holds the shipped assets the "
                         "published figures stand on: replacing them needs --force")
    ap.add_argument("--force", action="store_true",
                    help="write over assets already in --out (the shipped ones by default)")
    ap.add_argument("--steps", type=positive_arg, default=None,
                    help="default: 1500 (tiny), 2500 (tiny_drift, tiny_reason)")
    ap.add_argument("--batch", type=positive_arg, default=64)
    ap.add_argument("--lr", type=positive_number_arg, default=3e-3)
    ap.add_argument("--noise", type=probability_arg, default=None,
                    help="one result-noise probability for every operator (default: the task's)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    task = TASKS[args.task]
    steps = task["steps"] if args.steps is None else args.steps
    noise = task["noise"] if args.noise is None else args.noise
    shipped = Path(__file__).resolve().parents[1] / "src/pepo/assets" / args.task
    out = Path(args.out or shipped)
    if (out / "model.safetensors").is_file() and not args.force:
        ap.error(f"{out} holds assets already" + (
            " (the shipped ones the published figures stand on: a rebuild gives a model of the "
            "same kind, not the same bytes)" if out.resolve() == shipped else "")
            + ": give another --out, or --force to replace them")
    try:
        check_output_dir(out, "--out")
    except ValueError as e:
        ap.error(str(e))
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out, task["alphabet"])
    tok = load_tokenizer(out)

    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    model = tiny_qwen3(vocab_size=32, **task["model"])
    train = task["data"](20000, seed=1000 + args.seed, split="train")
    val = task["data"](128, seed=0, split="val")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=steps,
                                                pct_start=0.1)
    t0 = time.time()
    for step in range(1, steps + 1):
        batch = rng.sample(train, args.batch)
        seqs, plens = [], []
        for p in batch:
            pi = tok.encode(p.prompt)
            ri = tok.encode(noisy_solution(p.solution, rng, noise, task["read"],
                                          task.get("forks", 0.0))) + [tok.eos_id]
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
        if step % 100 == 0 or step == steps:
            print(f"step {step:5d}  loss {loss.item():.4f}  {time.time() - t0:6.1f}s", flush=True)

    model.eval()
    n = task["max_new_tokens"]
    sampled = pass_rate(model, tok, val, temperature=1.0, samples=4, max_new_tokens=n)
    greedy = pass_rate(model, tok, val, temperature=1e-4, max_new_tokens=n)
    print(f"validation pass rate: sampled (T=1, avg@4) {sampled:.3f}, greedy {greedy:.3f}")
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(out / "model.safetensors"),
              metadata={"builder": "pepo.training.models.tiny_qwen3", "task": args.task,
                        "model": json.dumps(task["model"]), "steps": str(steps),
                        "noise": json.dumps(noise), "read": str(task["read"]),
                        "forks": str(task.get("forks", 0.0)),
                        "batch": str(args.batch), "seed": str(args.seed)})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
