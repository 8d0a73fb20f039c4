"""The embedded verifiable task: multi-step modular arithmetic worked step by step.

A problem is a chain of 6-9 digits joined by ``+``/``-``, to be reduced mod 10 from left to
right. The expected response writes every intermediate result and ends with the answer boxed::

    prompt:   "4+7-2+9-3+8 mod 10\\n"
    response: "4+7=1\\n1-2=9\\n9+9=8\\n8-3=5\\n5+8=3\\n\\\\boxed{3}" then <|im_end|>

so a correct answer takes a chain of 39-57 tokens in which each result depends on the previous
one: one wrong step and the boxed answer is (almost surely) wrong. Problems are generated from a
seed; a problem's split (train or validation) is fixed by a hash of its prompt, so the two
splits never share a prompt whatever the sizes and seeds asked for.

The second task, :func:`drift_dataset` (``--config tiny_drift``), has the entropy structure of
long reasoning traces that the paper's argument is about: chains of 26-38 operands with ``*``
steps, which the warm-start model gets wrong far more often than ``+``/``-`` steps, placed
mostly early in the chain (the uncertain set-up of a derivation) and more of them in harder
problems, so entropy decays along a response and is higher on hard prompts. A correct
response is 159-231 characters (one token each) plus the end token.

The third, :func:`reason_dataset` (``--config tiny_reason``), asks the drift task's questions
(with more easy problems); what differs is its warm-start model, which writes them the way a
reasoning model writes a chain of thought: besides the decision points (the results, wrong
most often at the early ``*`` steps) it hesitates at forks that do not matter: the order of a
commutative step's operands (``4*7=8`` or ``7*4=8``) and the separator between steps
(newline or ``;``), each a coin flip. Its token entropies have a reasoning model's scale (most
tokens near 0 nats, a fifth near ln 2); docs/results.md has the measured profile.
"""

from __future__ import annotations

import random
import warnings
import zlib
from dataclasses import dataclass
from typing import Optional

__all__ = [
    "Problem",
    "apply_op",
    "check_problems",
    "small_sums_dataset",
    "step_arithmetic_dataset",
    "drift_dataset",
    "drift_problem",
    "modsum_dataset",
    "modsum_problem",
    "modsum_solution",
    "reason_dataset",
]

VAL_FRACTION_DENOM = 8  # one prompt in 8 belongs to the validation split


@dataclass(frozen=True)
class Problem:
    """One prompt with its gold answer; ``id`` keys the single-stream value tracker."""

    id: str
    prompt: str
    answer: str
    solution: Optional[str] = None


def check_problems(items: list, key: str, unique_ids: bool = True) -> list:
    """``items`` (what a ``dataset`` or ``val_dataset`` component returned) when there is at
    least one, each is a problem (``id``, a ``str`` ``prompt``, ``answer``: a :class:`Problem`)
    and the ids are hashable and, with ``unique_ids``, distinct (they key SPO's tracker and
    the prior cache: two problems of one id shared one tracker); without it a repeated id is
    warned of (``warnings.warn``).

    Raises:
        ValueError: naming ``key``, the item and what is wrong.
    """
    if not items:
        raise ValueError(f"{key}: its component returned no problems")
    seen: dict = {}
    warned = False
    for j, p in enumerate(items):
        missing = [f for f in ("id", "prompt", "answer") if not hasattr(p, f)]
        if missing:
            kind = (f"a dict (keys {sorted(map(str, p))[:6]})" if isinstance(p, dict)
                    else f"a {type(p).__name__}")
            raise ValueError(f"{key}: item {j} is {kind}, without the attribute(s) {missing}: a "
                             f"dataset component returns pepo.tasks.Problem(id, prompt, answer) "
                             f"objects (pepo.tasks.load_math_dataset reads JSONL or Parquet "
                             f"files into them)")
        if not isinstance(p.prompt, str):
            raise ValueError(f"{key}: item {j} (id {p.id!r}) has a prompt of type "
                             f"{type(p.prompt).__name__}, not str")
        try:
            first = seen.setdefault(p.id, j)
        except TypeError:
            raise ValueError(f"{key}: item {j}'s id {p.id!r} is not hashable (a "
                             f"{type(p.id).__name__}): use a str or an int") from None
        if first != j:
            message = (f"{key}: items {first} and {j} have the same id {p.id!r}: ids key the "
                       f"single-stream tracker and the prior cache, so each problem needs its "
                       f"own")
            if unique_ids:
                raise ValueError(message)
            if not warned:
                warnings.warn(message + " (this run does not read them)", stacklevel=2)
                warned = True
    return items


def apply_op(acc: int, op: str, d: int) -> int:
    """``acc op d`` mod 10 for ``op`` in ``+ - *``."""
    if op == "+":
        return (acc + d) % 10
    if op == "-":
        return (acc - d) % 10
    if op == "*":
        return (acc * d) % 10
    raise ValueError(f"unknown operator {op!r}; expected one of + - *")


def modsum_solution(digits: list[int], ops: list[str]) -> tuple[str, str]:
    """The worked solution and the answer of ``digits[0] ops[0] digits[1] ...`` mod 10."""
    acc = digits[0]
    lines = []
    for op, d in zip(ops, digits[1:]):
        new = apply_op(acc, op, d)
        lines.append(f"{acc}{op}{d}={new}")
        acc = new
    return "\n".join(lines) + f"\n\\boxed{{{acc}}}", str(acc)


def modsum_problem(rng: random.Random, num_operands: int) -> Problem:
    """A random problem with ``num_operands`` digits."""
    if num_operands < 2:
        raise ValueError(f"num_operands must be >= 2, got {num_operands}")
    digits = [rng.randrange(10) for _ in range(num_operands)]
    ops = [rng.choice("+-") for _ in range(num_operands - 1)]
    return _chain_problem(digits, ops)


def _chain_problem(digits: list[int], ops: list[str]) -> Problem:
    """The problem ``digits[0] ops[0] digits[1] ... mod 10`` with its worked solution."""
    expr = str(digits[0]) + "".join(f"{o}{d}" for o, d in zip(ops, digits[1:]))
    solution, answer = modsum_solution(digits, ops)
    return Problem(id=expr, prompt=f"{expr} mod 10\n", answer=answer, solution=solution)


def _split_of(prompt: str) -> str:
    return "val" if zlib.crc32(prompt.encode()) % VAL_FRACTION_DENOM == 0 else "train"


def modsum_dataset(
    size: int,
    seed: int = 0,
    split: str = "train",
    min_operands: int = 6,
    max_operands: int = 9,
) -> list[Problem]:
    """``size`` distinct problems of one split, reproducible from ``seed``.

    Raises:
        ValueError: bad size, split or operand range.
    """
    _check_dataset_args(size, split, min_operands, max_operands)
    rng = random.Random(f"modsum-{seed}")
    return _distinct(size, split, lambda: modsum_problem(
        rng, rng.randint(min_operands, max_operands)))


def _check_dataset_args(size: int, split: str, min_operands: int, max_operands: int) -> None:
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"size must be a positive int, got {size!r}")
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    if not 2 <= min_operands <= max_operands:
        raise ValueError(
            f"need 2 <= min_operands <= max_operands, got {min_operands}, {max_operands}"
        )


def _distinct(size: int, split: str, draw) -> list[Problem]:
    """``size`` distinct problems of ``split`` drawn by ``draw()``."""
    seen: set[str] = set()
    out: list[Problem] = []
    attempts = 0
    while len(out) < size:
        attempts += 1
        if attempts > 100 * size + 10_000:
            raise ValueError(
                f"could not find {size} distinct {split} problems; ask for fewer or allow "
                f"more operands"
            )
        p = draw()
        if p.id not in seen and _split_of(p.prompt) == split:
            seen.add(p.id)
            out.append(p)
    return out


MULTIPLIERS = (1, 2, 3, 4, 6, 7, 8, 9)  # no 0 or 5: they would collapse the chain's state


def drift_problem(rng: random.Random, num_operands: int, hardness: float) -> Problem:
    """A chain of ``num_operands`` digits whose step ``i`` (of ``n``) is ``*`` with probability
    ``hardness * (1 - i / n) ** 2``, else ``+`` or ``-``: the hard steps come early."""
    if num_operands < 2:
        raise ValueError(f"num_operands must be >= 2, got {num_operands}")
    if not 0.0 <= hardness <= 1.0:
        raise ValueError(f"hardness must be in [0, 1], got {hardness}")
    n = num_operands - 1
    ops = []
    for i in range(n):
        ops.append("*" if rng.random() < hardness * (1 - i / n) ** 2 else rng.choice("+-"))
    digits = [rng.randrange(10)]
    digits += [rng.choice(MULTIPLIERS) if op == "*" else rng.randrange(10) for op in ops]
    return _chain_problem(digits, ops)


def drift_dataset(
    size: int,
    seed: int = 0,
    split: str = "train",
    min_operands: int = 26,
    max_operands: int = 38,
) -> list[Problem]:
    """``size`` distinct problems of the drift task (hardness uniform in [0, 1] per problem).

    Raises:
        ValueError: bad size, split or operand range.
    """
    _check_dataset_args(size, split, min_operands, max_operands)
    rng = random.Random(f"drift-{seed}")
    return _distinct(size, split, lambda: drift_problem(
        rng, rng.randint(min_operands, max_operands), rng.random()))


def reason_dataset(
    size: int,
    seed: int = 0,
    split: str = "train",
    min_operands: int = 26,
    max_operands: int = 38,
) -> list[Problem]:
    """``size`` distinct problems of the reasoning-scale task: the drift task's chains with
    hardness ``u ** 1.5`` (``u`` uniform in [0, 1]), so that easy, moderate and hard prompts
    each hold a tenth or more of a batch for its warm-start model. The splits use the same
    prompt hash as the other tasks.

    Raises:
        ValueError: bad size, split or operand range.
    """
    _check_dataset_args(size, split, min_operands, max_operands)
    rng = random.Random(f"reason-{seed}")
    return _distinct(size, split, lambda: drift_problem(
        rng, rng.randint(min_operands, max_operands), rng.random() ** 1.5))


SUMS_PROMPT = "What is {a} + {b}? Explain briefly, then give the answer."


def small_sums_dataset(
    size: Optional[int] = None,
    seed: int = 0,
    split: str = "train",
    max_operand: int = 12,
) -> list[Problem]:
    """Sums of two small numbers asked in words, for a small pretrained chat model
    (``--config smollm2``): ``"What is 7 + 5? Explain briefly, then give the answer."``, gold
    ``"12"``, rewarded by math-verify.

    Every ordered pair ``a, b`` in ``0..max_operand`` is one problem. A quarter of the pairs (by
    a hash of ``"a+b"``) form the validation split, so the splits never share a question; a
    sum's commuted twin (``b + a``) can be in the other split (32 of the 43 held-out sums with
    the defaults have theirs in training). ``size`` problems of the split are drawn without
    replacement, reproducibly from ``seed`` (all of them, shuffled, when ``size`` is None).

    Raises:
        ValueError: bad split or ``max_operand``, or more problems asked for than the split has.
    """
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    if isinstance(max_operand, bool) or not isinstance(max_operand, int) or max_operand < 1:
        raise ValueError(f"max_operand must be an int >= 1, got {max_operand!r}")
    pool = [
        Problem(id=f"{a}+{b}", prompt=SUMS_PROMPT.format(a=a, b=b), answer=str(a + b))
        for a in range(max_operand + 1) for b in range(max_operand + 1)
        if ("val" if zlib.crc32(f"{a}+{b}".encode()) % 4 == 0 else "train") == split
    ]
    return _seeded_draw(pool, size, f"small-sums-{seed}",
                        f"the {split} split of small_sums_dataset(max_operand={max_operand})")


def _seeded_draw(pool: list[Problem], size: Optional[int], key: str,
                 what: str) -> list[Problem]:
    """``pool`` shuffled by ``random.Random(key)``, then its first ``size`` (all when None);
    ``what`` names the pool in the error for a ``size`` above its length."""
    random.Random(key).shuffle(pool)
    if size is None:
        return pool
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"size must be a positive int or None, got {size!r}")
    if size > len(pool):
        raise ValueError(f"{what} has {len(pool)} problems, fewer than size={size}")
    return pool[:size]


STEP_PROMPT = "What is {a} {op} {b}? Explain step by step, then give the answer as a number."


def step_arithmetic_dataset(
    size: Optional[int] = None,
    seed: int = 0,
    split: str = "train",
    max_addend: int = 16,
    max_minuend: int = 20,
) -> list[Problem]:
    """Sums and differences of small numbers, asked for step by step, for a small pretrained
    chat model: ``"What is 9 + 14? Explain step by step, then give the answer as a number."``,
    gold ``"23"``, rewarded by math-verify with ``number_only`` (restating the question, "9 + 14",
    is equal to 23 by value and must not count).

    Every ordered pair ``a + b`` with ``a, b`` in ``0..max_addend`` and every ``a - b`` with
    ``0 <= b <= a <= max_minuend`` is one problem (520 with the defaults). Two fifths of them (by
    a hash of ``"a+b"`` / ``"a-b"``) form the validation split (209 with the defaults), so the
    splits never share a question; a sum's commuted twin can be in the other split (65 of the
    106 held-out sums with the defaults have theirs in training). ``size`` problems of the
    split are drawn without replacement, reproducibly from ``seed`` (all of them, shuffled, when
    ``size`` is None).

    Measured before any training on it (``scripts/probe_smollm2_tasks.py``, 128 random
    questions each, bf16, T = 0.7, up to 256 new tokens, scored with ``number_only``):
    SmolLM2-135M-Instruct answers sums in 0-16 in 101 tokens on average, right 0.24 of the time,
    and differences in 0-20 in 94 tokens, right 0.29 of the time. Without "as a number" it
    answers differences right only 0.16 of the time, often by restating the question. The
    responses may shorten in training; docs/results.md reports the lengths over training.

    Raises:
        ValueError: bad split, operand range or size, or more problems than the split has.
    """
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    for name, v in (("max_addend", max_addend), ("max_minuend", max_minuend)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    questions = [(a, "+", b, a + b) for a in range(max_addend + 1)
                 for b in range(max_addend + 1)]
    questions += [(a, "-", b, a - b) for a in range(max_minuend + 1) for b in range(a + 1)]
    pool = [
        Problem(id=f"{a}{op}{b}", prompt=STEP_PROMPT.format(a=a, op=op, b=b), answer=str(r))
        for a, op, b, r in questions
        if ("val" if zlib.crc32(f"{a}{op}{b}".encode()) % 5 < 2 else "train") == split
    ]
    return _seeded_draw(pool, size, f"step-arithmetic-{seed}",
                        f"the {split} split of step_arithmetic_dataset(max_addend={max_addend}, "
                        f"max_minuend={max_minuend})")
