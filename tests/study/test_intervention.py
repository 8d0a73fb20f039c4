"""Token intervention (Sec. 5.5, Table 5): mixed decoding against a slow loop reference, the
position selection against a sort written from its definition, the end points of the table
(budget 0 = the base model's avg@k, every token replaced = the replacement model's) and the CLI."""

from __future__ import annotations

import csv
import math
import re

import pytest
import torch

from pepo.study import analysis
from pepo.study.intervention import intervene, mixed_generate, select_positions, token_metric
from pepo.tasks import modsum_dataset
from pepo.training.draws import inverse_cdf_sample
from pepo.training.evaluation import avg_at_k, eval_generator
from pepo.training.generation import draw_seeds, filter_logits, generate, row_uniforms
from pepo.training.models import tiny_qwen3
from tests.recipe_helpers import MODEL_OVERRIDES, random_checkpoint

V = 32
STOP = [1]
PAD = 0


def _model(seed: int, dtype=torch.float64, std: float = 0.3):
    torch.manual_seed(seed)
    m = tiny_qwen3(**MODEL_OVERRIDES).to(dtype)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() >= 2:
                torch.nn.init.normal_(p, std=std)
    return m.eval()


@pytest.fixture(scope="module")
def models():
    return _model(0), _model(1)


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, V, (int(torch.randint(2, 7, (1,), generator=g)),),
                          generator=g).tolist() for _ in range(n)]


@torch.no_grad()
def _reference(base, repl, prompt, replace_row, seed, max_new, temperature, top_p):
    """One row decoded by full forwards (no cache, no padding), token by token."""
    seq, toks, ents = list(prompt), [], []
    for t in range(max_new):
        x = torch.tensor([seq])
        zb = base(x)[0, -1]
        z = repl(x)[0, -1] if bool(replace_row[t]) else zb
        probs = filter_logits(z[None], temperature, None, top_p).softmax(-1)
        tok = int(inverse_cdf_sample(probs, row_uniforms(torch.tensor([seed]), t))[0])
        p = (zb.double() / temperature).softmax(-1)
        ents.append(float(-(p * p.clamp_min(1e-300).log()).sum()))
        toks.append(tok)
        seq.append(tok)
        if tok in STOP:
            break
    return toks, ents


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_mixed_generation_matches_a_token_by_token_reference(models, temperature, top_p):
    base, repl = models
    prompts = _prompts(5)
    max_new = 10
    seeds = draw_seeds(torch.Generator().manual_seed(3), len(prompts))
    g = torch.Generator().manual_seed(4)
    replace = torch.rand((len(prompts), max_new), generator=g) < 0.4
    ro = mixed_generate(base, repl, prompts, replace, seeds=seeds, max_new_tokens=max_new,
                        pad_id=PAD, stop_tokens=STOP, temperature=temperature, top_p=top_p)
    n_replaced_differs = 0
    for i, p in enumerate(prompts):
        toks, ents = _reference(base, repl, p, replace[i], int(seeds[i]), max_new,
                                temperature, top_p)
        n = int(ro.mask[i].sum())
        assert ro.tokens[i, :n].tolist() == toks
        torch.testing.assert_close(ro.entropies[i, :n].double(), torch.tensor(ents,
                                   dtype=torch.float64), rtol=1e-5, atol=1e-6)
        assert ro.replaced[i, :n].tolist() == replace[i, :n].tolist()
        # the replaced positions' tokens are not what the base alone would have drawn everywhere
        alone, _ = _reference(base, base, p, replace[i], int(seeds[i]), max_new, temperature,
                              top_p)
        n_replaced_differs += alone != toks
    assert n_replaced_differs > 0  # the replacement model was used


@pytest.mark.parametrize("shared", [False, True])
def test_fast_mixed_decoder_matches_the_lock_step_one(models, shared):
    """Both models decoded by pepo's fast decoder (finished rows dropped from both caches) give
    what torchtune's lock-step caches give, entropies included; with ``shared`` each prompt
    is sampled 3 times (avg@k), so both caches share each prompt's columns among its rows."""
    from pepo.training.fast_decoder import FastPlan
    from pepo.training.generation import decode

    base, repl = models
    assert FastPlan.of(base) is not None and FastPlan.of(repl) is not None  # fast path taken
    prompts = [p for p in _prompts(8, seed=5) for _ in range(3)] if shared else _prompts(24, seed=5)
    max_new = 30
    seeds = draw_seeds(torch.Generator().manual_seed(6), len(prompts))
    replace = torch.rand((len(prompts), max_new), generator=torch.Generator().manual_seed(7)) < 0.3
    ro = mixed_generate(base, repl, prompts, replace, seeds=seeds, max_new_tokens=max_new,
                        pad_id=PAD, stop_tokens=STOP + [2, 3, 4], temperature=0.8)
    pt, _, out, lp, valid, done, ent = decode(  # plans None: the reference decoder
        [base, repl], None, prompts, max_new_tokens=max_new, pad_id=PAD,
        stop_tokens=STOP + [2, 3, 4], seeds=seeds, generator=None, temperature=0.8,
        top_k=None, top_p=1.0, replace=replace, entropies=True)
    assert torch.equal(ro.prompt_tokens, pt)
    w = ro.tokens.shape[1]
    assert int(valid.sum(-1).max()) == w and 0 < int(done.sum()) < len(prompts)
    assert torch.equal(ro.tokens, out[:, :w]) and torch.equal(ro.mask, valid[:, :w])
    assert torch.equal(ro.finished, done)
    torch.testing.assert_close(ro.logprobs, lp[:, :w], rtol=0, atol=1e-10)  # float64 models
    torch.testing.assert_close(ro.entropies, ent[:, :w], rtol=0, atol=1e-6)


def test_empty_and_full_masks_reproduce_each_model(models):
    base, repl = models
    prompts = _prompts(6, seed=1)
    seeds = draw_seeds(torch.Generator().manual_seed(5), len(prompts))
    kw = dict(max_new_tokens=12, pad_id=PAD, stop_tokens=STOP, temperature=1.0)
    for model, fill in ((base, False), (repl, True)):
        want = generate(model, prompts, seeds=seeds, **kw)
        got = mixed_generate(base, repl, prompts, torch.full((6, 12), fill), seeds=seeds, **kw)
        assert torch.equal(got.tokens, want.tokens) and torch.equal(got.mask, want.mask)
        torch.testing.assert_close(got.logprobs, want.logprobs)
    with pytest.raises(ValueError, match=r"replace must be a bool \[B, max_new_tokens\]"):
        mixed_generate(base, repl, prompts, torch.zeros((6, 11), dtype=torch.bool), seeds=seeds,
                       **kw)
    with pytest.raises(ValueError, match="seeds must be"):
        mixed_generate(base, repl, prompts, None, seeds=seeds[:3], **kw)


def _select_reference(metric, mask, budget, width):
    out = torch.zeros((mask.shape[0], width), dtype=torch.bool)
    for i in range(mask.shape[0]):
        valid = [t for t in range(mask.shape[1]) if mask[i, t]]
        if budget >= 1:
            out[i] = True
            continue
        k = math.ceil(budget * len(valid) - 1e-9)
        for t in sorted(valid, key=lambda t: (-float(metric[i, t]), t))[:k]:
            out[i, t] = True
    return out


@pytest.mark.parametrize("budget", [0.0, 0.05, 0.1, 0.3, 0.5, 0.99, 1.0])
def test_selected_positions_are_the_top_budget_fraction(budget):
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([1, 7, 20, 13, 20])
    mask = torch.arange(20)[None] < lengths[:, None]
    metric = torch.randint(0, 4, (5, 20), generator=g).float()  # many ties
    got = select_positions(metric, mask, budget, width=24)
    assert torch.equal(got, _select_reference(metric, mask, budget, 24))
    if budget < 1:
        assert got.sum(-1).tolist() == [math.ceil(budget * n - 1e-9) for n in lengths.tolist()]


def test_the_whole_budget_is_selected_on_the_metrics_device():
    """On a GPU the metric and the mask are CUDA tensors (the meta device stands in for one
    here). Catches a CPU mask returned for the whole budget. (A CPU ``arange`` scattered into
    the CUDA ranks failed every intervention on a GPU at its first budget between 0 and 1; the
    meta device takes that mix, so no test here can catch it: the ranks are now the order's
    inverse permutation, which makes no tensor of its own.)"""
    mask = torch.ones(2, 5, dtype=torch.bool, device="meta")
    got = select_positions(torch.rand(2, 5, device="meta"), mask, 1.0, width=6)
    assert got.device.type == "meta" and tuple(got.shape) == (2, 6)


def test_selection_rejects_bad_budgets_and_shapes():
    mask = torch.ones((2, 4), dtype=torch.bool)
    with pytest.raises(ValueError, match="budget must be a fraction in"):
        select_positions(torch.zeros(2, 4), mask, 1.5, 4)
    with pytest.raises(ValueError, match="differ"):
        select_positions(torch.zeros(2, 5), mask, 0.5, 5)
    with pytest.raises(ValueError, match="unknown metric 'local'"):
        token_metric("local", torch.zeros(2, 4), mask)


class _Tok:
    """Digits-only stand-in: ids 3.. are the characters of the modsum alphabet."""

    pad_id, eos_id, stop_tokens = PAD, 1, [1]
    chars = "0123456789+-= \nmodbxe\\{}*"

    def encode_prompt(self, s):
        return [3 + self.chars.index(c) for c in s]

    def decode(self, ids):
        return "".join(self.chars[i - 3] if 3 <= i < 3 + len(self.chars) else "" for i in ids)


def _digit_share(texts, answers):
    return [float(sum(c.isdigit() for c in t) / max(1, len(t)) > 0.3) for t in texts]


def test_budget_zero_is_the_base_model_and_full_budget_the_replacement(models):
    base, repl = models
    problems = modsum_dataset(6, split="val")
    kw = dict(max_new_tokens=10, temperature=1.0, stop_tokens=STOP)
    generations = []
    res = intervene(base, repl, _Tok(), problems, _digit_share, budgets=[0.0, 0.2, 1.0],
                    metrics=["global", "proximal"], k=3, window=5, seed=11,
                    progress=lambda: generations.append(1), **kw)
    # base, every token replaced, and one run per metric at 20%: nothing generated twice
    assert len(generations) == 4
    want_base = avg_at_k(
        base, _Tok(), problems, 3, _digit_share, generator=eval_generator(11), **kw
    )
    want_repl = avg_at_k(
        repl, _Tok(), problems, 3, _digit_share, generator=eval_generator(11), **kw
    )
    assert res["global"][0.0] == res["proximal"][0.0] == want_base
    assert res["global"][1.0] == res["proximal"][1.0] == res["replacement"][1.0] == want_repl
    assert want_base != want_repl  # the end points can tell the models apart
    with pytest.raises(ValueError, match="budgets are fractions"):
        intervene(base, repl, _Tok(), problems, _digit_share, budgets=[20], k=1, **kw)


def test_table_prints_a_dash_for_an_error_bar_it_cannot_estimate(tmp_path):
    """A NaN standard error (one problem, or an accuracy of 0 or 100 %) prints as "–", never as
    "± 0.0" (which claims an exact figure) or "± nan"; the plot takes it too."""
    from pepo.study.intervention import write_table

    res = {"global": {0.0: 0.5, 0.5: 0.0}, "proximal": {0.0: 0.5, 0.5: 0.25},
           "se": {"global": {0.0: 0.1, 0.5: math.nan}, "proximal": {0.0: 0.1, 0.5: 0.05}},
           "paired": {0.0: [0.0, 0.0], 0.5: [0.25, math.nan]}}
    files = write_table(res, tmp_path, k=2)
    md = files["md"].read_text(encoding="utf-8")
    assert "| Global Entropy | 50.0 ± 10.0 | 0.0 ± – |" in md
    assert "| Proximal − Global (paired) | +0.0 ± 0.0 | +25.0 ± – |" in md
    assert "nan" not in md and files["png"].stat().st_size > 0


def test_cli_writes_the_table(tmp_path, capsys):
    base = random_checkpoint(tmp_path / "base", seed=0)
    repl = random_checkpoint(tmp_path / "repl", seed=1)
    cfg = tmp_path / "cfg.yaml"
    from omegaconf import OmegaConf

    from pepo.training.config import find_config, register_resolvers

    register_resolvers()
    c = OmegaConf.load(find_config("tiny"))
    c.model = {"_component_": "pepo.training.models.tiny_qwen3", **MODEL_OVERRIDES}
    c.checkpoint_dir = str(base)
    c.generation.max_new_tokens = 8
    OmegaConf.save(c, cfg)
    out = tmp_path / "out"
    analysis.main(["intervene", "--config", str(cfg), "--replacement", str(repl), "--budgets",
                   "0", "10", "100", "--k", "2", "--problems", "3", "--window", "5",
                   "--out", str(out)])
    rows = list(csv.DictReader(open(out / "intervention.csv")))
    table = {(r["metric"], r["budget_percent"]): float(r["avg@2"]) for r in rows}
    assert set(table) == {(m, b) for m in ("global", "proximal", "proximal - global")
                          for b in ("0", "10", "100")} | {("replacement", "100")}
    assert table[("global", "0")] == table[("proximal", "0")]
    assert table[("global", "100")] == table[("replacement", "100")]
    assert table[("proximal - global", "10")] == pytest.approx(
        table[("proximal", "10")] - table[("global", "10")], abs=2e-6)
    # NaN where no sample differs (a random model scores 0 everywhere): "–" in the table
    assert all(r["se"] != "" and not float(r["se"]) < 0 for r in rows)
    assert (out / "intervention.png").stat().st_size > 0
    md = (out / "intervention.md").read_text()
    assert "| Global Entropy |" in md and "| Proximal − Global (paired) |" in md and " ± " in md
    # the same command again reads every generation back from out/cells.json
    capsys.readouterr()
    analysis.main(["intervene", "--config", str(cfg), "--replacement", str(repl), "--budgets",
                   "0", "10", "100", "--k", "2", "--problems", "3", "--window", "5",
                   "--out", str(out)])
    printed = capsys.readouterr().out
    assert "resuming" in printed and "generation 1/" not in printed
    assert str(tmp_path) not in (out / "cells.json").read_text()  # no paths written down
    # cells scored by another reward are not read back as this one's (catches a cache keyed
    # without the reward: the verifier's number_only changed every score on smollm2_steps)
    c.reward = {"_component_": "pepo.tasks.rewards.MathVerify", "workers": 0,
                "number_only": True}
    OmegaConf.save(c, cfg)
    with pytest.raises(SystemExit, match=r"holds an intervention with reward=.*BoxedMatch"):
        analysis.main(["intervene", "--config", str(cfg), "--replacement", str(repl),
                       "--budgets", "0", "10", "100", "--k", "2", "--problems", "3",
                       "--window", "5", "--out", str(out)])
    for bad, message in ((["--budgets", "150"], r"--budgets: must be a percentage in \[0, 100\]"),
                         (["--batch-size", "0"], "--batch-size: must be an int >= 1"),
                         (["--k", "0"], "--k: must be an int >= 1")):  # before any model loads
        capsys.readouterr()
        with pytest.raises(SystemExit) as e:
            analysis.main(["intervene", "--config", str(cfg), "--replacement", str(repl),
                           *bad, "--out", str(out)])
        assert e.value.code == 2 and re.search(message, capsys.readouterr().err)
    with pytest.raises(SystemExit, match="--replacement="):
        analysis.main(["intervene", "--config", str(cfg), "--replacement", str(tmp_path),
                       "--out", str(out)])
    # an eval config (no val_dataset to sample), a file that is not YAML: one line each
    # (catches omegaconf's ConfigAttributeError and yaml's ParserError tracebacks)
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("a: [1, 2\n")
    for config, message in (("eval_tiny", r"is not a training config with validation prompts: "
                                          r"it has no val_dataset"),
                            (str(bad_yaml), r"bad.yaml is not a YAML config: while parsing")):
        with pytest.raises(SystemExit, match=rf"^error: --config .*{message}"):
            analysis.main(["intervene", "--config", config, "--replacement", str(repl),
                           "--out", str(out)])


def test_the_cli_uses_the_configs_device_and_dtype_and_keys_its_cache_on_the_weights(
        tmp_path, monkeypatch, capsys):
    """Catches models always built on the CPU in fp32 (a paper config's ``device: cuda``,
    ``dtype: bf16`` ran a 4B model on the CPU in silence), and cells kept under the
    checkpoints' paths (other weights written to the same path were read back as the old
    ones' cells: 62.5 % where a fresh run gave 53.1 %)."""
    from omegaconf import OmegaConf

    import pepo.study.intervention as iv
    from pepo.training.config import find_config, register_resolvers

    register_resolvers()
    base = random_checkpoint(tmp_path / "base", seed=0)
    repl = random_checkpoint(tmp_path / "repl", seed=1)
    c = OmegaConf.load(find_config("tiny"))
    c.model = {"_component_": "pepo.training.models.tiny_qwen3", **MODEL_OVERRIDES}
    c.checkpoint_dir = str(base)
    c.generation.max_new_tokens = 4
    cfg, out = tmp_path / "cfg.yaml", tmp_path / "out"
    args = ["intervene", "--config", str(cfg), "--replacement", str(repl), "--budgets", "0",
            "50", "--k", "1", "--problems", "2", "--window", "5", "--out", str(out)]
    seen = []

    def recording(base_model, repl_model, *a, **k):
        seen.append({p.dtype for m in (base_model, repl_model) for p in m.parameters()})
        return real(base_model, repl_model, *a, **k)

    real = iv.intervene
    monkeypatch.setattr(iv, "intervene", recording)
    c.dtype = "bf16"
    OmegaConf.save(c, cfg)
    analysis.main(args)
    assert seen == [{torch.bfloat16}]
    c.dtype = "fp32"
    OmegaConf.save(c, cfg)
    with pytest.raises(SystemExit, match=r"holds an intervention with dtype='torch.bfloat16'"):
        analysis.main(args)  # cells sampled in bf16 are not an fp32 run's
    c.dtype = "bf16"
    OmegaConf.save(c, cfg)
    random_checkpoint(tmp_path / "repl", seed=2)  # other weights at the same path
    with pytest.raises(SystemExit, match=r"holds an intervention with replacement="):
        analysis.main(args)
    if not torch.cuda.is_available():
        c.device = "cuda"
        OmegaConf.save(c, cfg)
        with pytest.raises(SystemExit, match=r"device='cuda' but CUDA is not available"):
            analysis.main([*args[:-1], str(tmp_path / "out2")])


def test_each_metric_ranks_by_its_own_statistic(models, monkeypatch):
    """The positions of metric m are chosen from m of the base rollouts' entropies (W as given)."""
    import pepo.study.intervention as iv
    from pepo import weighting

    base, repl = models
    seen = []
    real = iv.select_positions
    monkeypatch.setattr(
        iv,
        "select_positions",
        lambda s, mk, b, w: seen.append((s.clone(), mk.clone(), b)) or real(s, mk, b, w),
    )
    problems = modsum_dataset(4, split="val")
    kw = dict(max_new_tokens=10, temperature=1.0, stop_tokens=STOP)
    intervene(base, repl, _Tok(), problems, _digit_share, budgets=[0.0, 0.3], k=2, window=5,
              seed=2, **kw)
    prompts = [_Tok().encode_prompt(p.prompt) for p in problems for _ in range(2)]
    seeds = draw_seeds(eval_generator(2), len(prompts))
    ro = mixed_generate(base, None, prompts, None, seeds=seeds, pad_id=PAD, **kw)
    (g, gm, gb), (p, pm, pb) = seen
    assert gb == pb == 0.3 and torch.equal(gm, ro.mask) and torch.equal(pm, ro.mask)
    torch.testing.assert_close(g, torch.where(ro.mask, ro.entropies, 0.0))
    torch.testing.assert_close(p, weighting.proximal_entropy(ro.entropies, ro.mask, window=5))
    assert not torch.allclose(g, p)


def _problem_se_reference(success: list[float], k: int) -> float:
    """SD of the per-problem means over sqrt(number of problems), from the definition."""
    means = [sum(success[j * k:(j + 1) * k]) / k for j in range(len(success) // k)]
    n = len(means)
    mu = sum(means) / n
    return math.sqrt(sum((m - mu) ** 2 for m in means) / (n - 1) / n)


def _sampling_se_reference(success: list[float], k: int) -> float:
    """Var(avg@k | problems) = sum_j Var(mean of problem j's k samples) / N^2, each estimated
    with the unbiased sample variance of its k samples."""
    n = len(success) // k
    total = 0.0
    for j in range(n):
        ys = success[j * k:(j + 1) * k]
        mu = sum(ys) / k
        total += sum((y - mu) ** 2 for y in ys) / (k - 1) / k
    return math.sqrt(total) / n


def test_standard_errors_of_the_cells_and_of_the_paired_difference(models, tmp_path):
    """A cell's SE is the sampling's on these problems (catches the problems' spread counted as
    noise, rows grouped by sample instead of by problem); the paired difference's is over the
    per-problem differences (catches rows taken as independent); the difference is proximal
    minus global on the same rows, 0 at the shared end points."""
    from pepo.study.intervention import problem_se, sampling_se

    # rows 0-2 are problem 0's samples: per-problem means 1, 0, 1/3; grouping by sample gives
    # means 1/3, 1/3, 2/3 and other values for both
    s = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0])
    assert problem_se(s, 3) == pytest.approx(_problem_se_reference(s.tolist(), 3), rel=1e-12)
    assert sampling_se(s, 3) == pytest.approx(_sampling_se_reference(s.tolist(), 3), rel=1e-12)
    assert sampling_se(s, 3) == pytest.approx(math.sqrt(1 / 3 / 3) / 3)  # problem 2 only
    t = s.reshape(3, 3).T.reshape(-1)  # the same rows, grouped by sample
    assert problem_se(t, 3) != pytest.approx(problem_se(s, 3))
    assert sampling_se(t, 3) != pytest.approx(sampling_se(s, 3))
    assert problem_se(s, 3) != pytest.approx(float(s.std() / 3))  # rows as independent
    # one problem, or the same mean on every problem: no spread to measure (0 claimed an exact
    # difference)
    assert math.isnan(problem_se(torch.tensor([1.0, 0.0, 1.0, 0.0]), 4))
    assert math.isnan(problem_se(torch.zeros(8), 4))  # every problem's difference 0: no spread
    assert sampling_se(torch.tensor([1.0, 0.0, 0.0, 1.0]), 1) == pytest.approx(0.25)  # binomial
    # 0 or 100 %, or no sample differing from its problem's others: the plug-in's 0 is no
    # error bar (0/836 has a 95 % upper bound of 0.46 %)
    for k, s in ((1, torch.zeros(836)), (1, torch.ones(209)), (2, torch.tensor([1.0, 1, 0, 0]))):
        assert math.isnan(sampling_se(s, k))

    base, repl = models
    problems = modsum_dataset(6, split="val")
    kw = dict(max_new_tokens=10, temperature=1.0, stop_tokens=STOP)
    res = intervene(base, repl, _Tok(), problems, _digit_share, budgets=[0.0, 0.3, 1.0],
                    k=3, window=5, seed=4, cache=tmp_path / "cells.json", **kw)
    prompts = [_Tok().encode_prompt(p.prompt) for p in problems for _ in range(3)]
    ro = mixed_generate(base, None, prompts, None,
                        seeds=draw_seeds(eval_generator(4), len(prompts)), pad_id=PAD, **kw)
    texts = [_Tok().decode(t[m].tolist()) for t, m in zip(ro.tokens, ro.mask)]
    base_success = _digit_share(texts, None)
    assert 0 < sum(base_success) < len(base_success)  # a spread for the SE to measure
    assert res["se"]["global"][0.0] == pytest.approx(_sampling_se_reference(base_success, 3))
    assert res["se"]["proximal"][0.0] == res["se"]["global"][0.0]
    assert res["paired"][0.0] == [0.0, 0.0] and res["paired"][1.0] == [0.0, 0.0]
    assert res["paired"][0.3][0] == pytest.approx(res["proximal"][0.3] - res["global"][0.3])
    assert set(res["se"]) == {"global", "proximal", "replacement"}
    import json

    cells = json.loads((tmp_path / "cells.json").read_text())["cells"]
    assert cells["base"] == base_success  # the rows the cache keeps are the base model's
    d = [p - g for p, g in zip(cells["proximal@0.3"], cells["global@0.3"])]
    assert any(d)  # the rankings differ somewhere, so the paired SE has something to measure
    assert res["paired"][0.3][1] == pytest.approx(_problem_se_reference(d, 3))


def test_a_killed_intervention_resumes_from_its_cache(models, tmp_path):
    """Finished generations are read back, not run again (a second call generates nothing; a
    removed cell is the only one generated), with the same table; another setting is refused."""
    import json

    base, repl = models
    problems = modsum_dataset(5, split="val")
    kw = dict(max_new_tokens=10, temperature=1.0, stop_tokens=STOP, budgets=[0.0, 0.2, 0.5],
              k=2, window=5, seed=3)
    cache = tmp_path / "cells.json"
    calls = []
    first = intervene(base, repl, _Tok(), problems, _digit_share, cache=cache,
                      settings={"base": "a"}, progress=lambda: calls.append(1), **kw)
    assert len(calls) == 2 + 2 * 2
    calls.clear()
    again = intervene(base, repl, _Tok(), problems, _digit_share, cache=cache,
                      settings={"base": "a"}, progress=lambda: calls.append(1), **kw)
    assert calls == [] and again == first
    saved = json.loads(cache.read_text())
    del saved["cells"]["proximal@0.5"]
    cache.write_text(json.dumps(saved))
    again = intervene(base, repl, _Tok(), problems, _digit_share, cache=cache,
                      settings={"base": "a"}, progress=lambda: calls.append(1), **kw)
    assert calls == [1] and again == first
    with pytest.raises(ValueError, match="holds an intervention with base='a', not 'b'"):
        intervene(base, repl, _Tok(), problems, _digit_share, cache=cache,
                  settings={"base": "b"}, **kw)
    with pytest.raises(ValueError, match="with k=2, not 3"):
        intervene(base, repl, _Tok(), problems, _digit_share, cache=cache,
                  settings={"base": "a"}, **{**kw, "k": 3})


def test_the_models_run_at_the_given_compute_dtype(models, monkeypatch):
    """Every generation runs under autocast to ``compute_dtype`` (and under none without it):
    catches the setting being ignored."""
    import pepo.study.intervention as iv

    base, repl = models
    seen = []
    real = iv.mixed_generate
    monkeypatch.setattr(iv, "mixed_generate", lambda *a, **k: seen.append(
        (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))) or real(*a, **k))
    problems = modsum_dataset(2, split="val")
    kw = dict(max_new_tokens=4, temperature=1.0, stop_tokens=STOP, budgets=[0.0, 0.5], k=1)
    iv.intervene(base, repl, _Tok(), problems, _digit_share, compute_dtype=torch.bfloat16, **kw)
    assert len(seen) == 4 and all(s == (True, torch.bfloat16) for s in seen)
    seen.clear()
    iv.intervene(base, repl, _Tok(), problems, _digit_share, **kw)
    assert len(seen) == 4 and not any(on for on, _ in seen)


def test_the_paired_difference_is_proximal_minus_global(models, tmp_path):
    """Catches the paired difference's sign flipped (global - proximal): the cells at 30 % set
    apart through the cache (proximal all right, global all wrong) give +1, not -1. The
    generated data of the test above gives a mean difference of 0, where a flip cannot show."""
    import json

    base, repl = models
    problems = modsum_dataset(4, split="val")
    kw = dict(budgets=[0.0, 0.3], k=2, window=5, seed=4, max_new_tokens=10, temperature=1.0,
              stop_tokens=STOP, cache=tmp_path / "cells.json")
    intervene(base, repl, _Tok(), problems, _digit_share, **kw)
    saved = json.loads((tmp_path / "cells.json").read_text(encoding="utf-8"))
    n = len(saved["cells"]["base"])
    saved["cells"]["proximal@0.3"] = [1.0] * n
    saved["cells"]["global@0.3"] = [0.0] * n
    (tmp_path / "cells.json").write_text(json.dumps(saved), encoding="utf-8")
    res = intervene(base, repl, _Tok(), problems, _digit_share, **kw)
    assert (res["proximal"][0.3], res["global"][0.3]) == (1.0, 0.0)
    assert res["paired"][0.3][0] == pytest.approx(1.0)
