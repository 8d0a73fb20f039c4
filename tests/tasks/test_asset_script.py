"""``scripts/make_tiny_assets.py``'s training data: the noisy, forked solutions the warm-start
models are fine-tuned on (the script itself trains for minutes; its outputs ship in
``src/pepo/assets``)."""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import pytest

from pepo.tasks import apply_op, drift_dataset, reason_dataset

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "make_tiny_assets.py"


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("make_tiny_assets", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _steps(text: str) -> list[tuple[str, str, str, str, str]]:
    """``(a, op, b, result, separator)`` per step of a response (6 characters a step)."""
    body = text[: text.index("\\boxed")]
    assert len(body) % 6 == 0, text
    return [tuple(body[i : i + 6][k] for k in (0, 1, 2, 4, 5)) for i in range(0, len(body), 6)]


def test_without_noise_or_forks_the_solution_is_the_canonical_one(script):
    for p in drift_dataset(50, seed=3):
        assert script.noisy_solution(p.solution, random.Random(0), 0.0) == p.solution


def test_forks_change_no_value_and_no_length(script):
    """``forks=0.9``: in the first 90% of the steps a + or * step's operands come in either
    order and the separator is a newline or ';', each a fair coin; nothing else changes: the
    same results, the same answer, the same length. The last 10% are written canonically."""
    rng = random.Random(0)
    swaps = {"+": [0, 0], "*": [0, 0]}  # [swapped, could have been]
    seps = [0, 0]  # [';', could have been]
    for p in reason_dataset(300, seed=1):
        text = script.noisy_solution(p.solution, rng, 0.0, 0.0, forks=0.9)
        assert len(text) == len(p.solution)
        assert text.endswith(f"\\boxed{{{p.answer}}}")
        canon = _steps(p.solution)
        got = _steps(text)
        n = len(canon)
        for i, ((a, op, b, res, sep), (ga, gop, gb, gres, gsep)) in enumerate(zip(canon, got)):
            assert (gop, gres) == (op, res) and int(res) == apply_op(int(a), op, int(b))
            forked = i < 0.9 * n
            if (ga, gb) != (a, b):
                assert forked and op in "+*" and (ga, gb) == (b, a), (i, n, text)
            if op in "+*" and a != b and forked:
                swaps[op][0] += (ga, gb) == (b, a)
                swaps[op][1] += 1
            if gsep == ";":
                assert forked and i < n - 1, (i, n, text)
            else:
                assert gsep == "\n"
            if forked and i < n - 1:
                seps[0] += gsep == ";"
                seps[1] += 1
    for k, (hit, total) in [*swaps.items(), ("sep", seps)]:
        # a fair coin: within 4 standard deviations of half
        assert abs(hit - total / 2) < 4 * (total / 4) ** 0.5, (k, hit, total)


def test_noise_falls_on_the_results_at_the_operators_rates(script):
    """``noise`` per operator: a result is redrawn uniformly with that probability (so wrong
    with 0.9 of it); later steps continue from the written value."""
    rng = random.Random(1)
    noise = {"*": 0.3, "-": 0.05, "+": 0.0}
    wrong = {o: [0, 0] for o in noise}
    for p in reason_dataset(300, seed=2):
        text = script.noisy_solution(p.solution, rng, noise, 0.0, forks=0.9)
        acc = int(p.id[0])
        for a, op, b, res, _ in _steps(text):
            other = int(b) if int(a) == acc else int(a)  # the operand read from the prompt
            wrong[op][0] += int(res) != apply_op(acc, op, other)
            wrong[op][1] += 1
            acc = int(res)
        assert text.endswith(f"\\boxed{{{acc}}}")
    assert wrong["+"][0] == 0
    for op in "*-":
        hit, total = wrong[op]
        p = 0.9 * noise[op]
        assert abs(hit - p * total) < 4 * (total * p * (1 - p)) ** 0.5, (op, hit, total)


def test_the_shipped_assets_are_not_overwritten_by_default(script, capsys, tmp_path):
    """The default ``--out`` is ``src/pepo/assets/<task>``, which holds the shipped assets the
    published figures stand on (a rebuild is not the same bytes): catches a run without
    ``--out`` writing over them (or with ``--out`` naming them, or any earlier build), an
    ``--out`` that is a file as a FileExistsError traceback, and ``--steps 0`` or ``--lr -1``
    silently training (the full default; torch's ValueError)."""
    import pytest

    shipped = SCRIPT.parents[1] / "src" / "pepo" / "assets" / "tiny" / "model.safetensors"
    before = shipped.stat().st_mtime_ns
    earlier = tmp_path / "built"
    earlier.mkdir()
    (earlier / "model.safetensors").write_bytes(b"an earlier build")
    (tmp_path / "file").write_text("")
    for argv, shown in (([], "(the shipped ones"), (["--out", str(shipped.parent)], "(the shipped"),
                        (["--out", str(earlier)], "holds assets already: give another --out, or "
                                                  "--force"),
                        (["--out", str(tmp_path / "file")], "cannot be a directory")):
        with pytest.raises(SystemExit) as e:
            script.main(["--task", "tiny", *argv])
        assert e.value.code == 2 and shown in capsys.readouterr().err
    assert (earlier / "model.safetensors").read_bytes() == b"an earlier build"
    for bad, flag in ((["--steps", "0"], "--steps"), (["--noise", "1.5"], "--noise"),
                      (["--batch", "-1"], "--batch"), (["--lr", "-1"], "--lr")):
        with pytest.raises(SystemExit) as e:
            script.main(["--task", "tiny", "--out", "unused", *bad])
        assert e.value.code == 2 and flag in capsys.readouterr().err
    assert shipped.stat().st_mtime_ns == before
