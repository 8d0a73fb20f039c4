"""pepo.study.analysis on synthetic rollouts whose structure is known."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from html.parser import HTMLParser

import pytest
import torch

import pepo.weighting as pw
from pepo.study import analysis as A


def write_dump(path, entropies, rewards=None, prompts=None, tokens=None, success=None,
               groups=None):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for i, h in enumerate(entropies):
            f.write(json.dumps({
                "step": 1, "prompt_id": prompts[i] if prompts else f"p{i}",
                "prompt": "q", "reward": rewards[i] if rewards else 1.0, "advantage": 0.5,
                "entropies": [float(x) for x in h],
                "tokens": tokens[i] if tokens else [f"t{t}" for t in range(len(h))],
                **({} if success is None else {"success": success[i]}),
                **({} if groups is None else {"group": groups[i]}),
            }) + "\n")
    return path


def trend_and_shift(n=64, T=400, seed=0):
    """H = per-sequence shift + a smooth decay over the sequence + positive noise."""
    g = torch.Generator().manual_seed(seed)
    shift = 2.0 * torch.rand(n, 1, generator=g)
    pos = torch.arange(T) / T
    return shift + 1.5 * (1 - pos) + 0.3 * torch.rand(n, T, generator=g)


def test_trend_shows_in_global_and_vanishes_from_proximal(tmp_path):
    h = trend_and_shift()
    r = A.load_dump(write_dump(tmp_path / "d.jsonl", h.tolist()))
    curves = A.positional_bias(r, windows=(21,), n_bins=10)
    g, p = curves["global"], curves["proximal_21"]
    assert g[0] > 0.25 and g[-1] < -0.25 and bool((g[1:] < g[:-1]).all())  # decays
    assert float(p.abs().max()) < 0.05  # flat: |s| * W/2 = 1.5/400 * 10 is small
    assert float(curves["window_average_21"].abs().max()) < 0.05  # windowing alone suffices


def ref_positional_curve(rows, n_bins):
    """Loop reference: each rollout's ``(x_t - mean_i) / mean_i`` (0 where its mean is 0),
    binned by ``floor(t / T_i * n_bins)`` and averaged over the tokens of all rollouts."""
    sums, counts = [0.0] * n_bins, [0] * n_bins
    for row in rows:
        mean = sum(row) / len(row)
        for t, x in enumerate(row):
            b = min(int(t / len(row) * n_bins), n_bins - 1)
            sums[b] += (x - mean) / mean if mean > 0 else 0.0
            counts[b] += 1
    return [s / max(c, 1) for s, c in zip(sums, counts)]


def test_positional_bias_matches_a_loop_reference(tmp_path):
    """Rows of other lengths and levels (one all zero): catches deviations taken from the pooled
    mean of all tokens instead of each rollout's own (the published global span of the mechanism
    dumps halves under it), a length-blind bin, or bins averaged per rollout."""
    g = torch.Generator().manual_seed(5)
    rows = [(level * torch.rand(n, generator=g)).tolist()
            for n, level in ((7, 0.3), (40, 3.0), (13, 1.0), (101, 0.05))] + [[0.0] * 9]
    r = A.load_dump(write_dump(tmp_path / "d.jsonl", rows))
    curves = A.positional_bias(r, windows=(5,), n_bins=6)
    torch.testing.assert_close(curves["global"].double(),
                               torch.tensor(ref_positional_curve(rows, 6), dtype=torch.float64),
                               rtol=1e-5, atol=1e-6)
    e = pw.proximal_entropy(r.entropies, r.mask, window=5)
    prox = [e[i, : len(row)].tolist() for i, row in enumerate(rows)]
    torch.testing.assert_close(curves["proximal_5"].double(),
                               torch.tensor(ref_positional_curve(prox, 6), dtype=torch.float64),
                               rtol=1e-5, atol=1e-6)


def test_proximal_entropy_mean_is_one_over_w_in_every_difficulty_group(tmp_path):
    h = trend_and_shift(n=48, T=300)
    # 6 prompts x 8 rollouts; pass counts 0, 1, 4, 5, 7, 8 -> hard, hard, moderate x2, easy x2
    passes = [0, 1, 4, 5, 7, 8]
    rewards = [1.0 if j < passes[i // 8] else 0.0 for i in range(48) for j in [i % 8]]
    prompts = [f"p{i // 8}" for i in range(48)]
    r = A.load_dump(write_dump(tmp_path / "d.jsonl", h.tolist(), rewards, prompts))
    table = A.difficulty_bias(r, window=101)
    assert set(table) == {"hard", "moderate", "easy"}
    assert [table[g]["rollouts"] for g in A.GROUPS] == [16, 16, 16]
    for g in A.GROUPS:
        assert abs(table[g]["proximal"] - 1 / 101) < 0.05 / 101, (g, table[g])
    # global entropy differs between groups here only through the random shifts
    assert len({round(table[g]["global"], 6) for g in A.GROUPS}) == 3


class _Balance(HTMLParser):
    VOID = {"meta", "br", "img", "hr", "link", "input"}

    def __init__(self):
        super().__init__()
        self.stack, self.errors = [], []

    def handle_starttag(self, tag, attrs):
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_endtag(self, tag):
        if not self.stack or self.stack.pop() != tag:
            self.errors.append(tag)


def test_heatmap_is_well_formed_and_escapes_tokens(tmp_path):
    toks = [["<script>", "alert('x')", "</script>", "a & b", '"q"']]
    r = A.load_dump(write_dump(tmp_path / "d.jsonl", [[0.1, 2.0, 0.3, 0.2, 1.0]], tokens=toks))
    page = A.heatmap_html(r, [0], window=3)
    assert "<script>" not in page and "&lt;script&gt;" in page and "a &amp; b" in page
    p = _Balance()
    p.feed(page)
    assert not p.errors and not p.stack
    assert page.startswith("<!DOCTYPE html>") and page.count('class="col"') == 2


def test_weight_mass_sums_to_one_and_uniform_follows_token_counts(tmp_path):
    h = trend_and_shift(n=16, T=100)
    r = A.load_dump(write_dump(tmp_path / "d.jsonl", h.tolist()))
    mass = A.weight_mass(r, window=11)
    for name, row in mass.items():
        assert abs(sum(row[f"decile_{d}"] for d in range(1, 11)) - 1) < 1e-5, name
    assert all(abs(mass["uniform (GRPO)"][f"decile_{d}"] - 0.1) < 1e-6 for d in range(1, 11))
    # 80/20 by global entropy follows the decaying trend: most of its weight is early
    topk = mass["global_topk (80/20)"]
    assert topk["decile_1"] > topk["decile_10"]
    # top20: uniform weights put exactly int(0.2 N) / N of the weight on any 20% of the tokens;
    # 80/20 keeps 20% of the tokens, so they hold all of it (continuous entropies: no ties)
    n = int(r.mask.sum())
    assert mass["uniform (GRPO)"]["top20"] == pytest.approx(int(0.2 * n) / n, abs=1e-6)
    assert topk["top20"] == pytest.approx(1.0, abs=1e-6)
    # a slow reference for PEPO's row: its weights, sorted by hand
    c = pw.get_strategy("proximal_softmax", window=11)(torch.ones(len(r)), r.entropies, r.mask)
    vals = sorted(c[r.mask].tolist(), reverse=True)
    ref = sum(vals[: int(0.2 * n)]) / sum(vals)
    assert mass["proximal_softmax (PEPO)"]["top20"] == pytest.approx(ref, rel=1e-5)
    # a colder softmax concentrates the weight: tau 0.5 > tau 1 > tau 2 > uniform
    shares = [mass[k]["top20"] for k in ("proximal_softmax, τ = 0.5", "proximal_softmax (PEPO)",
                                        "proximal_softmax, τ = 2", "uniform (GRPO)")]
    assert shares == sorted(shares, reverse=True) and len(set(shares)) == 4, shares


def test_weight_mass_selects_80_20_tokens_within_each_step(tmp_path):
    """global_topk's threshold is over one step's batch, as in training. Two steps of equal
    token counts, the first's entropies a hundredth of the second's: within each step 80/20
    keeps a fifth of its tokens, so the first step (moderate prompts) holds half the weight.
    Catches one threshold over the pooled dump (the first step would hold none of it)."""
    g = torch.Generator().manual_seed(0)
    low = (torch.rand(8, 50, generator=g) * 0.01).tolist()
    high = (torch.rand(8, 50, generator=g) + 1.0).tolist()
    path = write_dump(tmp_path / "d.jsonl", low + high,
                      rewards=[float(i % 2) for i in range(8)] + [1.0] * 8,
                      prompts=["a"] * 8 + ["b"] * 8)
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    for rec in recs[8:]:
        rec["step"] = 2
    path.write_text("".join(json.dumps(rec) + "\n" for rec in recs))
    mass = A.weight_mass(A.load_dump(path), window=11)
    topk = mass["global_topk (80/20)"]
    assert topk["moderate"] == pytest.approx(0.5, abs=1e-6)
    assert topk["easy"] == pytest.approx(0.5, abs=1e-6)
    assert mass["uniform (GRPO)"]["moderate"] == pytest.approx(0.5, abs=1e-6)


def test_entropy_profile_matches_its_definitions(tmp_path):
    rows = [[0.0, 0.005, 0.5, 2.0, 0.0], [1.0, 0.0, 0.02], [0.009, 0.3, 0.0, 0.0, 0.0, 4.0]]
    r = A.load_dump(write_dump(tmp_path / "d.jsonl", rows))
    prof = A.entropy_profile(r, windows=(3,))
    flat = sorted((x for row in rows for x in row), reverse=True)  # 14 tokens
    assert (prof["length_min"], prof["length_max"]) == (3, 6)
    assert prof["length_mean"] == pytest.approx(14 / 3)
    assert prof["near_deterministic_share"] == pytest.approx(
        sum(x < 0.01 for x in flat) / 14)  # 8 of 14
    assert prof["top20_entropy_share"] == pytest.approx(sum(flat[:2]) / sum(flat))  # int(2.8)
    assert prof["mean_entropy"] == pytest.approx(sum(flat) / 14)
    curves = A.positional_bias(r, (3,))  # rows of 3-6 tokens reach some of the 20 bins only
    seen = ~curves["global"].isnan()
    assert 0 < int(seen.sum()) < 20
    assert prof["global_span"] == pytest.approx(
        float(curves["global"][seen].max() - curves["global"][seen].min())
    )
    assert prof["proximal_3_max_abs"] == pytest.approx(
        float(curves["proximal_3"][seen].abs().max()))
    # 80th percentile, linear interpolation between sorted values (numpy's default): position
    # 0.8 * 13 = 10.4 in the ascending order
    asc = flat[::-1]
    assert prof["entropy_p80"] == pytest.approx(asc[10] + 0.4 * (asc[11] - asc[10]))
    # first / last tenth: the tokens with floor(10 t / T) = 0 or 9, pooled over the rollouts
    g = torch.Generator().manual_seed(1)
    long_rows = [torch.rand(T, generator=g).tolist() for T in (10, 23, 37)]
    prof2 = A.entropy_profile(
        A.load_dump(write_dump(tmp_path / "e.jsonl", long_rows)), windows=(3,)
    )
    first = [x for row in long_rows for t, x in enumerate(row) if 10 * t // len(row) == 0]
    last = [x for row in long_rows for t, x in enumerate(row) if 10 * t // len(row) == 9]
    assert len(first) == 1 + 3 + 4 and len(last) == 1 + 2 + 3
    assert prof2["first_tenth_entropy"] == pytest.approx(sum(first) / len(first))
    assert prof2["last_tenth_entropy"] == pytest.approx(sum(last) / len(last))
    assert prof2["first_over_last_tenth"] == pytest.approx(
        sum(first) / len(first) / (sum(last) / len(last)))
    assert "hard_share" not in prof  # one rollout per prompt: no difficulty groups


def test_difficulty_counts_the_dumps_success_flags(tmp_path):
    """Partial credit: a prompt whose rollouts all earn 0.1 but only one succeeds is hard, not
    easy. Catches the pass rate taken as ``reward > 0`` where the dump records ``success``."""
    h = trend_and_shift(n=16, T=30, seed=4)
    rewards = [1.0] + [0.1] * 7 + [1.0] * 8
    success = [True] + [False] * 7 + [True] * 8
    prompts = [f"p{i // 8}" for i in range(16)]
    r = A.load_dump(write_dump(tmp_path / "d.jsonl", h.tolist(), rewards, prompts,
                               success=success))
    table = A.difficulty_bias(r, window=5)
    assert {g: table[g]["rollouts"] for g in table} == {"hard": 8, "easy": 8}
    old = A.load_dump(write_dump(tmp_path / "e.jsonl", h.tolist(), rewards, prompts))
    assert {g: v["rollouts"] for g, v in A.difficulty_bias(old, window=5).items()} == {"easy": 16}


def test_two_groups_of_one_prompt_in_a_step_stay_apart(tmp_path):
    """A step that crosses an epoch's end can draw a prompt twice: catches its two groups read
    as one (1/8 and 7/8 successes made one moderate group of 16) where the dump records each
    row's group; a dump without the field falls back to the prompt, as documented."""
    h = trend_and_shift(n=16, T=30, seed=4)
    success = [True] + [False] * 7 + [True] * 7 + [False]
    kw = dict(rewards=[float(s) for s in success], prompts=["p7"] * 16, success=success)
    r = A.load_dump(write_dump(tmp_path / "d.jsonl", h.tolist(), **kw,
                               groups=[i // 8 for i in range(16)]))
    assert {g: v["rollouts"] for g, v in A.difficulty_bias(r, window=5).items()} == {
        "hard": 8, "easy": 8}
    old = A.load_dump(write_dump(tmp_path / "e.jsonl", h.tolist(), **kw))
    assert {g: v["rollouts"] for g, v in A.difficulty_bias(old, window=5).items()} == {
        "moderate": 16}


def test_entropy_profile_difficulty_numbers(tmp_path):
    """Group-mode dumps: each group's share of the rollouts and the hard / easy ratio of mean
    token entropy (over the group's tokens), from the definitions."""
    h = trend_and_shift(n=40, T=50, seed=3)
    passes = [0, 1, 4, 7, 8]  # 5 prompts x 8: hard, hard, moderate, easy, easy
    rewards = [1.0 if i % 8 < passes[i // 8] else 0.0 for i in range(40)]
    prompts = [f"p{i // 8}" for i in range(40)]
    r = A.load_dump(write_dump(tmp_path / "d.jsonl", h.tolist(), rewards, prompts))
    prof = A.entropy_profile(r, windows=(5,))
    assert (prof["hard_share"], prof["moderate_share"], prof["easy_share"]) == (0.4, 0.2, 0.4)
    hard, easy = h[:16].mean(), h[24:].mean()
    assert prof["hard_over_easy_entropy"] == pytest.approx(float(hard / easy), rel=1e-5)


@pytest.mark.slow
def test_command_writes_every_output(tmp_path):
    write_dump(tmp_path / "rollouts" / "step_000001.jsonl", trend_and_shift(n=32, T=256).tolist())
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "pepo.study.analysis", str(tmp_path / "rollouts"),
                        "--out", str(out), "--windows", "11", "31"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    for name in ("positional_bias.png", "positional_bias.csv", "difficulty_bias.md",
                 "heatmap.html", "weight_mass.csv", "weight_mass.md", "profile.md",
                 "profile.json"):
        assert (out / name).stat().st_size > 0, name
    header = (out / "positional_bias.csv").read_text().splitlines()[0]
    assert header.startswith("percentile_bin_center,global,proximal_11,window_average_11")
    bad = subprocess.run(
        [sys.executable, "-m", "pepo.study.analysis", str(tmp_path / "nope"), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode != 0 and "no rollout dump" in bad.stderr


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", r"d.jsonl:2: not valid JSON"),
        ("[1, 2]", r"d.jsonl:2: a record must be a JSON object, got list"),
        ('{"reward": 1.0}', r"d.jsonl:2: 'entropies' must be a list of numbers, got None"),
        (
            '{"entropies": [0.1, "x"], "reward": 1.0}',
            r"d.jsonl:2: 'entropies' must be a list of numbers",
        ),
        ('{"entropies": [0.1]}', r"d.jsonl:2: 'reward' must be a number, got None"),
        (
            '{"entropies": [0.1, 0.2], "reward": 0, "tokens": ["a"]}',
            r"d.jsonl:2: 'tokens' must be a list as long",
        ),
    ],
)
def test_malformed_records_are_one_line_errors_naming_file_and_line(tmp_path, line, message):
    """Catches KeyError/IndexError tracebacks (or a silent skip) on a malformed dump."""
    path = write_dump(tmp_path / "d.jsonl", [[0.1, 0.2]])
    with open(path, "a") as f:
        f.write(line + "\n")
    with pytest.raises(ValueError, match=message):
        A.load_dump(path)
    r = subprocess.run(
        [sys.executable, "-m", "pepo.study.analysis", str(path), "--out", str(tmp_path / "o")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "d.jsonl:2" in r.stderr


def test_pooled_runs_keep_their_groups_apart(tmp_path):
    """Two runs' dumps of the same step that drew the same prompt: pooled, each run's 8 rollouts
    are a group of their own (one all-correct run and one all-wrong: easy and hard), where one
    group of 16 would be moderate. Catches pooling that merges groups across runs."""
    h = trend_and_shift(n=8, T=20, seed=4)
    a = write_dump(tmp_path / "a" / "step_000001.jsonl", h.tolist(), [1.0] * 8, ["p"] * 8)
    b = write_dump(tmp_path / "b" / "step_000001.jsonl", h.tolist(), [0.0] * 8, ["p"] * 8)
    pooled = A.load_dump([a, tmp_path / "b"])
    assert len(pooled) == 16
    prof = A.entropy_profile(pooled, windows=(5,))
    assert (prof["hard_share"], prof["moderate_share"], prof["easy_share"]) == (0.5, 0.0, 0.5)
    merged = tmp_path / "merged.jsonl"
    merged.write_text(a.read_text() + b.read_text())
    assert A.entropy_profile(A.load_dump(merged), windows=(5,))["moderate_share"] == 1.0
    # the same two dumps in one directory, one of them gzipped: still two groups
    import gzip

    both = tmp_path / "both"
    both.mkdir()
    (both / "run_a_step_000001.jsonl").write_text(a.read_text())
    with gzip.open(both / "run_b_step_000001.jsonl.gz", "wt") as f:
        f.write(b.read_text())
    from_dir = A.load_dump(both)
    assert len(from_dir) == 16 and torch.equal(from_dir.entropies, pooled.entropies)
    prof = A.entropy_profile(from_dir, windows=(5,))
    assert (prof["hard_share"], prof["moderate_share"], prof["easy_share"]) == (0.5, 0.0, 0.5)
    # a file kept both plain and compressed (a restore decompresses beside the archive): once
    # (catches run b's 8 rollouts counted twice, a third group)
    (both / "run_b_step_000001.jsonl").write_text(b.read_text())
    assert torch.equal(A.load_dump(both).entropies, pooled.entropies)
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "pepo.study.analysis", str(a), str(b), "--out",
                        str(out), "--windows", "5"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert json.loads((out / "profile.json").read_text())["rollouts"] == 16.0


def test_the_study_window_sets_table_1_and_the_weights_not_the_largest(tmp_path):
    """``window`` is the W of the difficulty table and of the weight mass (proximal entropy's
    group mean is 1/W): catches ``window`` ignored in favour of the largest of ``windows``."""
    h = trend_and_shift(n=16, T=200)
    rewards = [1.0 if i % 8 < (3 if i < 8 else 8) else 0.0 for i in range(16)]
    prompts = [f"p{i // 8}" for i in range(16)]
    dump = write_dump(tmp_path / "d.jsonl", h.tolist(), rewards, prompts)
    files = A.run(dump, tmp_path / "out", windows=(5, 31), window=5)
    md = files["difficulty_md"].read_text()
    assert "W = 5)" in md
    moderate = next(line for line in md.splitlines() if line.startswith("| Moderate"))
    assert abs(float(moderate.split("|")[4]) - 1 / 5) < 0.01  # 1/31 = 0.032 with W = 31
    header = files["positional_csv"].read_text().splitlines()[0]
    assert "proximal_5" in header and "proximal_31" in header  # the curves keep every window
    with pytest.raises(ValueError, match="window must be >= 1, got 0"):
        A.run(dump, tmp_path / "out", windows=(5,), window=0)


def test_the_positional_figure_is_titled_and_its_windows_laid_out(tmp_path, monkeypatch):
    """The published positional figures carried no title (three were embedded back to back,
    told apart by their alt text only) and four windows in one row shrank their fonts. Catches
    ``--title`` not reaching the figure, no default title, and the layout: one row up to three
    windows, rows of two beyond (no panel left over)."""
    import matplotlib.figure

    figures = []
    save = matplotlib.figure.Figure.savefig
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig",
                        lambda self, *a, **k: (figures.append(self), save(self, *a, **k))[1])
    h = trend_and_shift(n=16, T=60)
    dump = write_dump(tmp_path / "d.jsonl", h.tolist(), [1.0, 0.0] * 8,
                      [f"p{i // 8}" for i in range(16)])
    A.main([str(dump), "--out", str(tmp_path / "a"), "--windows", "5", "11", "21", "--title",
            "tiny: step 10 of PEPO"])
    A.run(dump, tmp_path / "b", windows=(5, 11, 29, 101))
    (titled, default) = [f for f in figures if f._suptitle is not None]
    assert titled._suptitle.get_text() == "tiny: step 10 of PEPO"
    assert default._suptitle.get_text() == "positional bias of 16 rollouts"
    shown = [[ax.get_subplotspec().get_geometry()[:2] for ax in f.axes if ax.get_visible()]
             for f in (titled, default)]
    assert shown == [[(1, 3)] * 3, [(2, 2)] * 4]


@pytest.mark.parametrize("argv, message", [
    (["intervene", "--config", "tiny", "--replacement", "x", "--window", "4", "--out", "iv"],
     "argument --window: must be an odd int >= 1, got '4'"),
    (["d", "--out", "an", "--windows", "31", "4"],
     "argument --windows: must be an odd int >= 1, got '4'"),
    (["d", "--out", "an", "--heatmap-rollouts", "-1"],
     "argument --heatmap-rollouts: must be an int >= 0, got '-1'"),
])
def test_bad_windows_and_counts_are_refused_before_any_work(tmp_path, monkeypatch, capsys,
                                                            argv, message):
    """The intervention's --window was checked after its generations had started (16 s on
    tiny, minutes on a real model), a negative heatmap count not at all. Now argparse
    refuses them first: nothing is read, built or written."""
    from pepo.study.analysis import main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_short_and_empty_responses_leave_bins_missing_not_zero(tmp_path):
    """Responses shorter than the bins leave some bins with no token: catches those written as
    0 (a flat "no deviation" drawn, the span taken over fake zeros, the last tenth's entropy 0
    and its ratio Infinity, which strict JSON refuses), a group of empty responses dropped
    from Table 1, and a dump without a token failing with an IndexError."""
    def no_constants(name):
        raise ValueError(f"not JSON: {name}")

    h = [[0.5, 0.1, 0.9, 0.3, 0.2]] * 16  # 5 tokens: floor(t / 5 * 20) reaches 5 of 20 bins
    r = A.load_dump(write_dump(tmp_path / "short" / "d.jsonl", h))
    curve = A.positional_bias(r, (5,))["global"]
    assert int(curve.isnan().sum()) == 15 and not curve[[0, 4, 8, 12, 16]].isnan().any()
    prof = A.entropy_profile(r, (5,))
    assert prof["global_span"] == pytest.approx(float(curve[[0, 4, 8, 12, 16]].max()
                                                      - curve[[0, 4, 8, 12, 16]].min()))
    files = A.run(tmp_path / "short", tmp_path / "out", windows=(5,), heatmap_rollouts=1)
    saved = json.loads(files["profile_json"].read_text(), parse_constant=no_constants)
    assert saved["last_tenth_entropy"] is None and saved["first_over_last_tenth"] is None
    assert "| last_tenth_entropy | – |" in files["profile_md"].read_text()
    # a hard group of empty responses beside a moderate one: counted, its means missing
    ent = [[]] * 8 + [[0.4, 0.6, 0.2]] * 8
    success = [False] * 8 + [True] * 4 + [False] * 4
    prompts = ["a"] * 8 + ["b"] * 8
    r = A.load_dump(write_dump(tmp_path / "e" / "d.jsonl", ent, [float(s) for s in success],
                               prompts, success=success))
    table = A.difficulty_bias(r, window=5)
    assert table["hard"]["rollouts"] == 8 and math.isnan(table["hard"]["global"])
    assert A.entropy_profile(r, (5,))["hard_share"] == 0.5
    empty = write_dump(tmp_path / "none" / "d.jsonl", [[]] * 4)
    with pytest.raises(ValueError, match="its 4 rollouts hold no response token"):
        A.run(empty, tmp_path / "out2", windows=(5,))


def test_difficulty_means_pool_the_groups_tokens_not_the_padding(tmp_path):
    """Catches Table 1's means taken over the padded rows (padding read as entropy 0) or as a
    mean of per-rollout means: an easy group of responses of 6 and 2 tokens (mean entropy 1
    and 2), whose pooled global mean is 40 / 32 = 1.25 (1.5 as a mean of means, 0.83 over the
    padding); the proximal mean against Eq. (6) written out per token."""
    long, short = [1.0, 0.0, 2.0, 1.0, 0.5, 1.5], [4.0, 0.0]
    rows = [long, short] * 4 + [[0.5] * 6] * 8
    success = [True] * 8 + [False] * 8  # p0 easy (rows 0-7), p1 hard
    prompts = ["p0"] * 8 + ["p1"] * 8
    r = A.load_dump(write_dump(tmp_path / "d.jsonl", rows, [float(s) for s in success],
                               prompts, success=success))
    table = A.difficulty_bias(r, window=3)
    assert table["easy"]["global"] == pytest.approx((4 * 6 * 1.0 + 4 * 2 * 2.0) / 32)
    assert table["easy"]["tokens"] == 32

    def proximal(h, t):  # the window of 3 around t, reflect-padded at the row's ends
        idx = [-k if k < 0 else 2 * (len(h) - 1) - k if k >= len(h) else k
               for k in (t - 1, t, t + 1)]
        return math.exp(h[t]) / sum(math.exp(h[k]) for k in idx)

    ref = [proximal(h, t) for h in rows[:8] for t in range(len(h))]
    per_row = [sum(proximal(h, t) for t in range(len(h))) / len(h) for h in (long, short)]
    assert abs(sum(ref) / len(ref) - sum(per_row) / 2) > 0.01  # the case itself
    assert table["easy"]["proximal"] == pytest.approx(sum(ref) / len(ref), rel=1e-5)


def test_a_token_at_the_threshold_is_not_near_deterministic(tmp_path):
    """Catches ``H <= 0.01`` for the documented ``H < 0.01``: of 0.01, 0.5, 0.0 and 1.0 nats
    one token is near-deterministic, not two."""
    r = A.load_dump(write_dump(tmp_path / "d.jsonl", [[0.01, 0.5, 0.0, 1.0]]))
    assert A.entropy_profile(r, windows=(3,))["near_deterministic_share"] == 0.25


def test_one_dump_of_several_steps_keeps_each_steps_groups_apart(tmp_path):
    """Catches the step left out of the group key: one prompt drawn at two steps of one dump
    (all right at one, all wrong at the other) is an easy and a hard group, not one moderate
    group of 16."""
    h = trend_and_shift(n=16, T=20, seed=2)
    path = write_dump(tmp_path / "d.jsonl", h.tolist(), [1.0] * 8 + [0.0] * 8, ["p"] * 16)
    recs = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    for rec in recs[8:]:
        rec["step"] = 2
    path.write_text("".join(json.dumps(rec) + "\n" for rec in recs), encoding="utf-8")
    table = A.difficulty_bias(A.load_dump(path), window=5)
    assert {g: v["rollouts"] for g, v in table.items()} == {"hard": 8, "easy": 8}
