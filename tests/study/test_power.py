"""pepo.study.power against the formulas written out with printed t-table values."""

from __future__ import annotations

import json
import math
import random
import re
import statistics

import pytest

from pepo.study import power

# Student's t quantiles, 9 degrees of freedom (printed tables)
T9_975, T9_995, T9_80 = 2.262157, 3.249836, 0.883404
T9_95, T9_90 = 1.833113, 1.383029  # 9 df: the 0.95 and 0.90 quantiles
D = [0.05, -0.01, 0.03, 0.08, 0.00, 0.02, 0.06, -0.02, 0.04, 0.01]  # ten paired differences


def _reference(d, crit_two_sided, crit_power):
    n = len(d)
    mean = sum(d) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1))
    se = sd / math.sqrt(n)
    return mean, sd, mean - crit_two_sided * se, mean + crit_two_sided * se, (
        crit_two_sided + crit_power) * se


def test_one_comparison_is_the_textbook_t_interval():
    mean, sd, lo, hi, res = _reference(D, T9_975, T9_80)
    got = power.paired(D)
    assert got["mean"] == pytest.approx(mean, abs=1e-12)
    assert got["sd"] == pytest.approx(sd, rel=1e-9)  # n - 1, not n
    assert (got["lo"], got["hi"]) == (pytest.approx(lo, abs=1e-6), pytest.approx(hi, abs=1e-6))
    assert got["resolvable"] == pytest.approx(res, abs=1e-6)
    assert got["t"] == pytest.approx(mean / (sd / math.sqrt(10)), rel=1e-9)


def test_p_value_is_two_sided_at_the_table_value():
    # differences whose t statistic is exactly the 97.5% quantile: p = 0.05
    base = [x - statistics.fmean(D) for x in D]
    se = statistics.stdev(base) / math.sqrt(len(base))
    shifted = [x + T9_975 * se for x in base]
    assert power.paired(shifted)["p"] == pytest.approx(0.05, abs=1e-5)


def test_m_comparisons_widen_the_interval_to_bonferroni():
    # 5 comparisons: each interval at the 1 - 0.05 / (2 * 5) = 0.995 quantile
    mean, _, lo, hi, res = _reference(D, T9_995, T9_80)
    got = power.paired(D, m=5)
    assert (got["lo"], got["hi"]) == (pytest.approx(lo, abs=1e-6), pytest.approx(hi, abs=1e-6))
    assert got["resolvable"] == pytest.approx(res, abs=1e-6)
    assert got["hi"] - got["lo"] > power.paired(D)["hi"] - power.paired(D)["lo"]


def test_resolvable_difference_is_detected_with_about_its_power():
    """Monte Carlo at the resolvable difference paired() reports for differences of sd 1, n 10,
    one comparison. Catches that difference made with normal quantiles (1.96 + 0.84: detected
    about 70 % of the time at n 10, not 80 %)."""
    n, sd = 10, 1.0
    m0, s0 = statistics.fmean(D), statistics.stdev(D)
    res = power.paired([(x - m0) / s0 for x in D])["resolvable"]  # at sd 1
    assert res == pytest.approx((T9_975 + T9_80) * sd / math.sqrt(n), rel=1e-6)
    rng = random.Random(0)
    hits = 0
    sims = 3000
    for _ in range(sims):
        d = [rng.gauss(res, sd) for _ in range(n)]
        hits += power.paired(d)["p"] < 0.05
    # the t-quantile formula slightly undershoots the noncentral-t power of 0.8 (about 0.78)
    assert 0.74 < hits / sims < 0.84, hits / sims


def test_holm_adjustment():
    # sorted: 0.005*4 = 0.02, 0.01*3 = 0.03, 0.03*2 = 0.06, 0.04*1 = 0.04 -> 0.06 (monotone)
    assert power.holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert power.holm([0.5, 0.9]) == pytest.approx([1.0, 1.0])
    assert power.holm([]) == []
    # a NaN p (no spread) cannot be ordered: sorted() left [nan, 0.01, 0.04] as is and gave
    # [1, 1, 1], where 0.01 among three is at most 0.03
    for bad in (float("nan"), 1.5, -0.1):
        with pytest.raises(ValueError, match=f"must be numbers in \\[0, 1\\], got {bad}"):
            power.holm([bad, 0.01, 0.04])


def _runs(method, seeds, after, before=0.3):
    return [{"method": method, "seed": s, "val_after": a, "val_before": before}
            for s, a in zip(seeds, after)]


def test_comparisons_pair_by_seed_not_by_position():
    base = _runs("GRPO", [0, 1, 2, 3], [0.40, 0.50, 0.60, 0.70])
    # listed in another order, seed 4 has no baseline, seed 3 is missing
    other = _runs("PEPO", [2, 0, 4, 1], [0.63, 0.42, 0.99, 0.55])
    comps = power.comparisons(base + other, "GRPO", ["PEPO"])
    assert comps["PEPO"]["n"] == 3
    assert comps["PEPO"]["mean"] == pytest.approx((0.03 + 0.02 + 0.05) / 3)
    assert (comps["PEPO"]["wins"], comps["PEPO"]["losses"]) == (3, 0)
    assert comps["PEPO"]["p_holm"] == pytest.approx(comps["PEPO"]["p"])  # m = 1


def test_a_label_without_paired_seeds_leaves_the_family(tmp_path):
    """A label with fewer than 2 paired seeds (none: a method the runs do not include; one) is
    not a comparison: the intervals and Holm's p are both for the labels tested. Catches the
    intervals corrected for every label named (m = 3 here, Holm over 1), or for every label
    with a paired seed (m = 2)."""
    base = _runs("GRPO", range(10), [0.4] * 10)
    pepo = _runs("PEPO", range(10), [0.4 + d for d in D])
    once = _runs("80/20", [3], [0.5])
    labels = ["PEPO", "GTPO", "80/20"]
    comps = power.comparisons(base + pepo + once, "GRPO", labels)
    assert comps["GTPO"] == {"n": 0} and comps["80/20"] == {"n": 1}
    one = power.paired(D, m=1)
    assert comps["PEPO"]["m"] == 1
    assert (comps["PEPO"]["lo"], comps["PEPO"]["hi"]) == (pytest.approx(one["lo"]),
                                                          pytest.approx(one["hi"]))
    assert comps["PEPO"]["p_holm"] == pytest.approx(one["p"])
    text = power.report(base + pepo + once, "GRPO", labels, tmp_path, "img", "t")
    assert "p (Holm, 1 comparison)" in text
    both = power.comparisons(base + pepo + _runs("GTPO", range(10), [0.41] * 10), "GRPO",
                             ["PEPO", "GTPO"])
    assert both["PEPO"]["m"] == 2 and both["PEPO"]["lo"] < comps["PEPO"]["lo"]


def test_report_table_and_forest_plot(tmp_path):
    seeds = list(range(10))
    results = _runs("GRPO", seeds, [0.4 + 0.01 * s for s in seeds])
    results += _runs("PEPO", seeds, [0.4 + 0.01 * s + d for s, d in zip(seeds, D)])
    results += _runs("80/20", seeds, [0.4 + 0.01 * s - 0.5 * d for s, d in zip(seeds, D)])
    text = power.report(results, "GRPO", ["PEPO", "80/20"], tmp_path, "img", "t")
    assert (tmp_path / "forest.png").stat().st_size > 1000
    pepo = power.paired(D, m=2)
    row = next(line for line in text.splitlines() if line.startswith("| PEPO |"))
    assert f"{100 * pepo['mean']:+.1f} [{100 * pepo['lo']:+.1f}, {100 * pepo['hi']:+.1f}] |" in row
    assert "| 10 |" in row and "7/1/2" in row and "paired seeds" not in text
    # a seed the baseline lacks: the seeds column counts 11 runs, Δ says it is over 10
    extra = _runs("PEPO", [10], [0.9])
    text = power.report(results + extra, "GRPO", ["PEPO", "80/20"], tmp_path, "img", "t")
    row = next(line for line in text.splitlines() if line.startswith("| PEPO |"))
    assert "| 11 |" in row and f"{100 * pepo['hi']:+.1f}] over 10 paired seeds |" in row


def test_the_report_gives_holms_p_not_the_raw_one(tmp_path):
    """Two comparisons: the p column is Holm's (the smaller raw p doubled here), which the
    header promises. Catches the raw p printed under that header."""
    seeds = list(range(10))
    results = _runs("GRPO", seeds, [0.4] * 10)
    results += _runs("PEPO", seeds, [0.4 + d for d in D])
    results += _runs("80/20", seeds, [0.4 + 0.3 * d for d in D[::-1]])
    text = power.report(results, "GRPO", ["PEPO", "80/20"], tmp_path, "img", "t")
    comps = power.comparisons(results, "GRPO", ["PEPO", "80/20"])
    raw = [comps[k]["p"] for k in ("PEPO", "80/20")]
    for k, adjusted in zip(("PEPO", "80/20"), power.holm(raw)):
        row = next(line for line in text.splitlines() if line.startswith(f"| {k} |"))
        assert f"| {power._fmt_p(adjusted)} |" in row
    assert power._fmt_p(power.holm(raw)[0]) != power._fmt_p(raw[0])  # the test can tell


def test_a_holm_p_below_alpha_beside_an_interval_holding_0_is_named(tmp_path):
    """Two comparisons: one clear, one at t = 2.3 (raw p 0.047): Holm's p stays 0.047 < 0.05,
    while its Bonferroni interval (t at 1 - 0.05/4) holds 0. Catches the report printing the
    two verdicts without a word, and a note where they agree."""
    seeds = list(range(10))
    base = [x - statistics.fmean(D) for x in D]
    se = statistics.stdev(base) / math.sqrt(len(base))
    results = (_runs("GRPO", seeds, [0.4] * 10)
               + _runs("PEPO", seeds, [0.4 + x + 8 * se for x in base])
               + _runs("80/20", seeds, [0.4 + x + 2.3 * se for x in base]))
    comps = power.comparisons(results, "GRPO", ["PEPO", "80/20"])
    c = comps["80/20"]
    assert c["p_holm"] < 0.05 and c["lo"] < 0 < c["hi"]  # the case itself
    text = power.report(results, "GRPO", ["PEPO", "80/20"], tmp_path, "img", "t")
    assert "80/20: Holm's p is below 0.05 while the simultaneous interval" in text
    assert "PEPO: Holm" not in text and "PEPO, 80/20:" not in text


def test_differences_without_spread_are_not_testable(tmp_path):
    """Every seed +2 points: no p of 0 and no interval of zero width; the other comparison's
    Holm p counts it as a comparison made (p = 1 in the order)."""
    got = power.paired([0.02, 0.02, 0.02])
    assert math.isnan(got["p"]) and math.isnan(got["lo"]) and math.isnan(got["resolvable"])
    seeds = list(range(10))
    results = (_runs("GRPO", seeds, [0.4] * 10) + _runs("PEPO", seeds, [0.4 + d for d in D])
               + _runs("80/20", seeds, [0.42] * 10))
    comps = power.comparisons(results, "GRPO", ["PEPO", "80/20"])
    assert math.isnan(comps["80/20"]["p_holm"]) and comps["PEPO"]["m"] == 2
    assert comps["PEPO"]["p_holm"] == pytest.approx(power.holm([comps["PEPO"]["p"], 1.0])[0])
    text = power.report(results, "GRPO", ["PEPO", "80/20"], tmp_path, "img", "t")
    row = next(line for line in text.splitlines() if line.startswith("| 80/20 |"))
    assert "+2.0 on every seed: no spread, not testable" in row and "nan" not in text


@pytest.mark.parametrize("change, message", [
    ({"num_steps": 8}, "run 'PEPO' seed 2 has num_steps=8 where run 'GRPO' seed 0 has 40"),
    ({"mode": "single_stream"}, "has mode='single_stream' where"),
    # scored on another validation set: avg@4 instead of avg@2, 40 prompts instead of 43
    ({"val_k": 4}, "run 'PEPO' seed 2 has val_k=4 where run 'GRPO' seed 0 has 2"),
    ({"val_problems": 40}, "run 'PEPO' seed 2 has val_problems=40 where run 'GRPO' seed 0 has 43"),
    ({"task": "tiny"}, "run 'PEPO' seed 2 has task='tiny' where run 'GRPO' seed 0 has 't'"),
    ({"val_after": float("nan")}, "run 'PEPO' seed 2: val_after is nan, not a finite accuracy"),
    # a second copy of PEPO's seed 1 (a copied result file): counted as a fifth pair before
    ({"seed": 1}, "run 'PEPO' seed 1 has two results"),
    # compare's --set: another learning rate in a hand-assembled results folder
    ({"overrides": {"optimizer": {"lr": 1e-6}}},
     "run 'PEPO' seed 2 has overrides={'optimizer': {'lr': 1e-06}} where run 'GRPO' seed 1 has "
     "{}"),
])
def test_runs_of_other_settings_or_without_an_accuracy_are_refused(change, message):
    """Catches each refusal missing: a run of 8 steps read into a 40-step study, a single-stream
    run beside group runs, one scored on another validation set or of another task (a settings
    key dropped from the comparison), a NaN accuracy (statistics.stdev failed on it with an
    AttributeError), one method's seed twice, a run of other ``--set`` overrides than the first
    run that records them (a result without the key, of an older pepo or restored from
    docs/images, is not compared on them: published results continued with ``--set`` compare)."""
    results = [{**r, "task": "t", "mode": "group", "num_steps": 40, "val_k": 2,
                "val_problems": 43} for r in _runs("GRPO", range(4), [0.4, 0.5, 0.6, 0.5])
               + _runs("PEPO", range(4), [0.45, 0.5, 0.65, 0.5])]
    for r in results[1:4]:  # GRPO seed 0 and PEPO have no overrides key, GRPO seeds 1-3 {}
        r["overrides"] = {}
    results[6] = {**results[6], **change}  # PEPO, seed 2
    with pytest.raises(ValueError, match=re.escape(message)):
        power.comparisons(results, "GRPO", ["PEPO"])


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="at least 2"):
        power.paired([0.1])
    with pytest.raises(ValueError, match="m .*0"):
        power.paired(D, m=0)
    with pytest.raises(ValueError, match="alpha"):
        power.paired(D, alpha=1.5)


def test_cli_collects_a_study_without_machine_paths(tmp_path, capsys):
    """``python -m pepo.study.power RUNS``: every finished run is read and copied under
    ``--out/results`` without its checkpoint path; the copies alone reproduce the report.
    Catches a copy of result.json as it is (a path of the machine that ran it)."""
    import json

    seeds = list(range(4))
    runs = tmp_path / "runs"
    for r in _runs("GRPO", seeds, [0.4 + 0.01 * s for s in seeds]) + _runs(
            "PEPO", seeds, [0.42 + 0.01 * s + D[s] for s in seeds]):
        d = runs / "smollm2_steps" / "group" / r["method"].lower() / f"seed_{r['seed']}"
        d.mkdir(parents=True)
        (d / "result.json").write_text(json.dumps(
            {**r, "checkpoint": str(d / "checkpoints" / "step_16"),
             "overrides": {"num_steps": 16, "prior_cache": str(tmp_path / "p.json")}}))
    text = power.main([str(runs), "--out", str(tmp_path / "report")])
    copies = sorted((tmp_path / "report" / "results").glob("*.json"))
    assert [c.name for c in copies][:2] == ["grpo_seed_0.json", "grpo_seed_1.json"]
    assert len(copies) == 8 and not any(str(tmp_path) in c.read_text() for c in copies)
    assert json.loads(copies[0].read_text())["overrides"] == {"num_steps": 16,
                                                              "prior_cache": "<a path>"}
    again = power.main([str(tmp_path / "report" / "results"), "--out", str(tmp_path / "r2")])
    row = next(x for x in text.splitlines() if x.startswith("| PEPO |"))
    assert row in again.splitlines()
    # single-stream runs beside them are not read into the group comparison, and compare with
    # SPO by default; a baseline without runs is refused in one line
    for r in _runs("SPO", seeds, [0.3] * 4) + _runs("PESPO", seeds, [0.3 + x for x in D[:4]]):
        d = runs / "smollm2_steps" / "single_stream" / r["method"].lower() / f"seed_{r['seed']}"
        d.mkdir(parents=True)
        (d / "result.json").write_text(json.dumps({**r, "mode": "single_stream"}))
    assert row in power.main([str(runs), "--out", str(tmp_path / "r3")]).splitlines()
    single = power.main([str(runs), "--mode", "single_stream", "--out", str(tmp_path / "r4")])
    assert "Δ vs SPO" in single and "| PESPO | 4 |" in single and "PEPO" not in single
    with pytest.raises(SystemExit, match="--base 'GRPO' has no runs here; methods found: "
                                         "PESPO, SPO"):
        power.main([str(runs), "--mode", "single_stream", "--base", "GRPO", "--out",
                    str(tmp_path / "r5")])


def test_seed_table_puts_each_run_under_its_seed(tmp_path):
    """A study in progress, seed by seed. Catches a value written in its list position instead of
    its seed's column (runs listed out of order, a seed missing), a difference taken against the
    wrong run, and a missing run shown as a number."""
    results = _runs("GRPO", [2, 0, 1], [0.30, 0.10, 0.20]) + _runs("PEPO", [1, 0], [0.25, 0.12])
    results += _runs("80/20", [3], [0.5])
    text = power.seed_table(results, ["GRPO", "PEPO", "80/20", "GTPO"])
    rows = text.splitlines()
    assert rows[0] == "| method | seed 0 | seed 1 | seed 2 | seed 3 |"
    assert rows[2] == "| GRPO | 10.0 | 20.0 | 30.0 | – |"
    assert rows[3] == "| PEPO | 12.0 | 25.0 | – | – |"
    assert rows[4] == "| − GRPO | +2.0 | +5.0 | – | – |"
    assert rows[5] == "| 80/20 | – | – | – | 50.0 |"
    assert rows[6] == "| − GRPO | – | – | – | – |"
    assert len(rows) == 7  # GTPO ran no seed: no row
    assert power.seed_table(results, ["GTPO"]) == ""
    report = power.report(results, "GRPO", ["PEPO"], tmp_path, "img", "t")
    assert "| PEPO | 12.0 | 25.0 | – |" in report  # the report carries it


def test_cli_family_is_the_studys_methods_as_its_report_tests_them(tmp_path, capsys):
    """By default the family is the study's methods found (an optional ablation beside them,
    here PEPO at W = 11, made the published report's 5 comparisons 8); a --methods label
    with no runs is refused (dropping it silently shrank the family)."""
    import json

    from pepo.study.compare import slug

    seeds = list(range(4))
    runs = tmp_path / "runs"
    for r in (_runs("GRPO", seeds, [0.4 + 0.01 * s for s in seeds])
              + _runs("PEPO", seeds, [0.42 + 0.01 * s + D[s] for s in seeds])
              + _runs("80/20", seeds, [0.40 + 0.01 * s - D[s] for s in seeds])
              + _runs("PEPO, W = 11", seeds, [0.41 + 0.01 * s for s in seeds])):
        d = runs / "smollm2_steps" / "group" / slug(r["method"]) / f"seed_{r['seed']}"
        d.mkdir(parents=True)
        (d / "result.json").write_text(json.dumps(r))
    text = power.main([str(runs), "--out", str(tmp_path / "a")])
    assert "2 comparisons" in text and "W = 11" not in text
    assert "not in this family (name them with --methods to test them): PEPO, W = 11" in \
        capsys.readouterr().out
    named = power.main([str(runs), "--out", str(tmp_path / "b"), "--methods", "PEPO", "80/20",
                        "PEPO, W = 11"])
    assert "3 comparisons" in named and "| PEPO, W = 11 |" in named
    with pytest.raises(SystemExit, match="--methods 'Pepo' has no runs here"):
        power.main([str(runs), "--out", str(tmp_path / "c"), "--methods", "PEPO", "Pepo"])
    # the baseline among --methods was compared with itself: a comparison more, wider intervals
    with pytest.raises(SystemExit, match="--methods names the baseline 'GRPO'"):
        power.main([str(runs), "--out", str(tmp_path / "c"), "--methods", "GRPO", "PEPO"])
    for bad in (["--alpha", "0"], ["--alpha", "1.5"], ["--methods", "PEPO", "PEPO"]):
        with pytest.raises(SystemExit) as e:
            power.main([str(runs), "--out", str(tmp_path / "d"), *bad])
        assert e.value.code == 2


@pytest.mark.parametrize("n, m", [(10, 5), (5, 3), (5, 8), (10, 1)])
def test_exact_power_of_the_resolvable_difference_by_simulation(n, m):
    """The noncentral t's power at the resolvable difference, against a simulation of the
    paired t test itself (10,000 studies): catches a power computed one-sided, at the
    uncorrected level, or with the normal approximation (which says 0.8 everywhere)."""
    from scipy import stats

    rng = random.Random(n * 100 + m)
    crit = stats.t.ppf(1 - 0.05 / (2 * m), n - 1)
    delta = crit + stats.t.ppf(0.8, n - 1)  # in units of sd / sqrt(n), sd = 1
    hits = 0
    for _ in range(10000):
        d = [rng.gauss(delta / math.sqrt(n), 1.0) for _ in range(n)]
        hits += abs(statistics.fmean(d) / (statistics.stdev(d) / math.sqrt(n))) > crit
    exact = power.exact_power(n, m)
    assert abs(hits / 10000 - exact) < 0.017  # binomial sd 0.0042: four of them
    assert exact < 0.8


def test_exact_power_is_a_number_for_every_study_size():
    """Catches the lower tail read from scipy's ``nct.cdf(-crit, n - 1, nc)``, which is NaN at
    some sizes (3 seeds and the study's 5 comparisons among them): the report printed "nan%".
    Every size up to 30 seeds and 12 comparisons gives a power in (0, 1), and where scipy's
    form is a number it is the same (a check by simulation of four sizes is above)."""
    from scipy import stats

    for n in range(2, 31):
        for m in range(1, 13):
            got = power.exact_power(n, m)
            assert 0 < got < 1, (n, m, got)
            crit = float(stats.t.ppf(1 - 0.05 / (2 * m), n - 1))
            nc = crit + float(stats.t.ppf(0.8, n - 1))
            lower = float(stats.nct.cdf(-crit, n - 1, nc))
            if not math.isnan(lower):
                assert got == pytest.approx(float(stats.nct.sf(crit, n - 1, nc)) + lower,
                                            rel=1e-12, abs=1e-15), (n, m)


def test_cli_bad_input_is_one_line(tmp_path):
    """A study directory without the --task asked (the default smollm2_steps on a tiny study)
    read its top-level results.json (a list) and raised AttributeError; a JSON that is not a
    result (a run's summary.json) KeyError; an --out that is a file NotADirectoryError. Catches
    each as a traceback instead of one line naming it."""
    import json

    runs = tmp_path / "runs"
    d = runs / "tiny" / "group" / "grpo" / "seed_0"
    d.mkdir(parents=True)
    (runs / "results.json").write_text("[]")
    (runs / "tiny_spo" / "single_stream").mkdir(parents=True)  # a study of one mode only
    with pytest.raises(SystemExit, match=r"^error: --task 'smollm2_steps' has no runs under the "
                                         r"study directory .*; its tasks: tiny, tiny_spo$"):
        power.main([str(runs), "--out", str(tmp_path / "a")])
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "summary.json").write_text(json.dumps({"history": [], "val_problems": 4}))
    with pytest.raises(SystemExit, match=r"summary.json: not a result JSON, missing method, "
                                         r"seed, val_after$"):
        power.main([str(docs), "--out", str(tmp_path / "b")])
    (docs / "summary.json").write_text('{"method": "GRPO", "se')
    with pytest.raises(SystemExit, match=r"summary.json: not a result JSON \(Unterminated"):
        power.main([str(docs), "--out", str(tmp_path / "b")])
    (docs / "summary.json").unlink()
    (docs / "a.json").mkdir()  # a directory of a result's name
    with pytest.raises(SystemExit, match=r"a.json: cannot be read \(Is a directory\)$"):
        power.main([str(docs), "--out", str(tmp_path / "b")])
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit, match=r"--out=.*file' cannot be a directory"):
        power.main([str(runs), "--task", "tiny", "--out", str(tmp_path / "file")])


def test_paired_uses_the_alpha_and_power_it_is_given():
    """Catches ``alpha`` or ``power`` ignored for the defaults (every other test gives 0.05 and
    0.8): at alpha 0.10 the interval is the textbook one of t_0.95, the resolvable difference
    at power 0.9 adds t_0.90; alpha 0.10 over 2 comparisons is alpha 0.05 over 1."""
    se = statistics.stdev(D) / math.sqrt(len(D))
    got = power.paired(D, alpha=0.10, power=0.9)
    assert got["lo"] == pytest.approx(statistics.fmean(D) - T9_95 * se, abs=1e-6)
    assert got["hi"] == pytest.approx(statistics.fmean(D) + T9_95 * se, abs=1e-6)
    assert got["resolvable"] == pytest.approx((T9_95 + T9_90) * se, abs=1e-6)
    two, one = power.paired(D, m=2, alpha=0.10), power.paired(D)
    assert (two["lo"], two["hi"]) == (pytest.approx(one["lo"]), pytest.approx(one["hi"]))


def test_exact_power_uses_the_alpha_and_power_it_is_given():
    """Catches ``alpha`` or ``power`` ignored in :func:`power.exact_power`: the level is
    ``alpha / m`` (alpha 0.10 over 2 comparisons is 0.05 over 1), and a nominal power of 0.9
    is about 0.9 in fact at 10 seeds, well above the 0.8 one."""
    assert power.exact_power(10, 2, alpha=0.10) == pytest.approx(power.exact_power(10, 1))
    assert power.exact_power(10, 1, power=0.9) == pytest.approx(0.899, abs=2e-3)
    assert power.exact_power(10, 1, power=0.9) > power.exact_power(10, 1) + 0.05


def test_the_reports_power_paragraph_gives_medians_and_the_familys_exact_power(tmp_path):
    """Catches the paragraph under the table giving the mean SD or the mean resolvable
    difference for the median (three comparisons of SD 1.3, 2.6 and 7.7 points: median 2.6,
    mean 3.9), or the exact power at one comparison's level (78 % at 4 seeds) rather than the
    family's corrected level (75 % for 3 comparisons)."""
    seeds = range(4)
    pattern = [-0.015, -0.005, 0.005, 0.015]
    results = _runs("GRPO", seeds, [0.4] * 4)
    for label, scale in (("PEPO", 1), ("80/20", 2), ("GTPO", 6)):
        results += _runs(label, seeds, [0.5 + scale * x for x in pattern])
    labels = ["PEPO", "80/20", "GTPO"]
    text = power.report(results, "GRPO", labels, tmp_path, "img", "t")
    comps = power.comparisons(results, "GRPO", labels)
    sds = sorted(v["sd"] for v in comps.values())
    res = sorted(v["resolvable"] for v in comps.values())
    assert statistics.mean(sds) > 1.4 * sds[1]  # the case itself: mean and median apart
    assert f"(median {100 * sds[1]:.1f})" in text
    assert f"difference of about {100 * res[1]:.1f} points" in text
    assert power.exact_power(4, 3) < power.exact_power(4, 1) - 0.02
    assert f"noncentral t is {power.exact_power(4, 3):.0%})" in text


def test_a_raw_p_below_alpha_under_a_holm_p_above_it_is_not_named(tmp_path):
    """Catches the row naming Holm's p as below 0.05 where only the raw p is: raw p about
    0.03 and 0.04, Holm's p both about 0.07, each interval holding 0."""
    seeds = list(range(10))
    base = [x - statistics.fmean(D) for x in D]
    se = statistics.stdev(base) / math.sqrt(len(base))
    results = (_runs("GRPO", seeds, [0.4] * 10)
               + _runs("PEPO", seeds, [0.4 + x + 2.5 * se for x in base])
               + _runs("80/20", seeds, [0.4 + x + 2.4 * se for x in base]))
    comps = power.comparisons(results, "GRPO", ["PEPO", "80/20"])
    assert all(v["p"] < 0.05 <= v["p_holm"] and v["lo"] <= 0 for v in comps.values())
    text = power.report(results, "GRPO", ["PEPO", "80/20"], tmp_path, "img", "t")
    assert "Holm's p is below" not in text


def test_cli_on_a_folder_of_both_modes_reads_the_mode_asked(tmp_path):
    """Catches the folder of published result JSONs (not a study directory) read without
    filtering by ``--mode``: group runs in a single-stream report."""
    folder = tmp_path / "results"
    folder.mkdir()
    rows = [{**r, "task": "smollm2_steps", "mode": "group"}
            for r in _runs("GRPO", range(4), [0.4] * 4)
            + _runs("PEPO", range(4), [0.4 + x for x in D[:4]])]
    rows += [{**r, "task": "smollm2_steps", "mode": "single_stream"}
             for r in _runs("SPO", range(4), [0.3] * 4)
             + _runs("PESPO", range(4), [0.3 + x for x in D[4:8]])]
    for r in rows:
        (folder / f"{r['mode']}_{r['method']}_seed_{r['seed']}.json").write_text(
            json.dumps(r), encoding="utf-8")
    text = power.main([str(folder), "--mode", "single_stream", "--out", str(tmp_path / "o")])
    assert "| PESPO | 4 |" in text and "GRPO" not in text and "PEPO |" not in text
