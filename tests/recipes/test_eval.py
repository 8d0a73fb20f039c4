"""`pepo_eval`: avg@k per benchmark in the paper's table layout."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

import pepo_eval
from pepo.training.config import find_config, register_resolvers
from pepo.training.evaluation import format_table
from tests import hf_fixtures as F


def test_the_mean_compares_only_the_benchmarks_every_row_has():
    """Catches each row's Mean over its own benchmarks (a row without AMC averaged fewer and
    easier benchmarks than the row beside it, with no word)."""
    from pepo.training.evaluation import format_tables

    table = format_tables([("a", {"AMC": 0.5, "MATH500": 0.25}), ("b", {"MATH500": 0.75})])
    assert table.splitlines()[2:4] == ["| a | 50.00 | 25.00 | 25.00 |", "| b | - | 75.00 | 75.00 |"]
    assert table.splitlines()[-1] == ("Mean averages the benchmarks every finished row has "
                                      "(MATH500); left out: AMC, which some rows lack.")
    table = format_tables([("a", {"AMC": 0.5}), ("b", {"MATH500": 0.75})])
    assert table.splitlines()[2:4] == ["| a | 50.00 | - | - |", "| b | - | 75.00 | - |"]
    assert "no Mean is given" in table.splitlines()[-1]
    assert format_tables([("a", {"AMC": 0.5, "MATH500": 0.25})]).splitlines()[-1] == (
        "| a | 50.00 | 25.00 | 37.50 |")  # one row: its own benchmarks, no note
    # an unfinished row (an evaluation stopped midway) does not narrow the others' Mean
    table = format_tables([("a", {"AMC": 0.5, "MATH500": 0.25}), ("b", {"MATH500": 0.75})],
                          unfinished=["b"])
    assert table.splitlines()[2:] == ["| a | 50.00 | 25.00 | 37.50 |", "| b | - | 75.00 | - |"]
    # every row unfinished (one evaluation stopped midway): each its own Mean, as before
    assert format_tables([("a", {"AMC": 0.5, "MATH500": 0.25})], unfinished=["a"]).splitlines()[
        2] == "| a | 50.00 | 25.00 | 37.50 |"


def test_problem_se_is_over_the_problems_shares():
    """Three problems at k = 2 with shares 1, 0.5, 0: mean 0.5, sample SD 0.5, SE 0.5/sqrt(3)
    (catches an SE over the 6 rollouts, 0.2236, or with the population SD, 0.2357)."""
    from pepo.training.evaluation import problem_se

    assert problem_se([True, True, False, True, False, False], 2) == pytest.approx(0.5 / 3 ** 0.5)
    assert problem_se([True, False], 2) is None  # one problem: no spread to measure
    with pytest.raises(ValueError, match="5 flags are not k=2"):
        problem_se([True] * 5, 2)
    with pytest.raises(ValueError, match="are not k=0"):
        problem_se([True] * 4, 0)


def test_format_table_paper_layout():
    table = format_table({"MATH500": 0.5, "AMC": 0.25, "AIME2025": 0.0, "AIME2024": 0.125}, "m")
    assert table.splitlines()[0] == "| Model | AIME2024 | AIME2025 | AMC | MATH500 | Mean |"
    assert table.splitlines()[2] == "| m | 12.50 | 0.00 | 25.00 | 50.00 | 21.88 |"


def test_eval_math_on_fixture_files(tmp_path, capsys):
    register_resolvers()
    model_dir = F.tiny_hf_qwen3(tmp_path / "qwen3")
    F.write_benchmarks(tmp_path / "data")
    cfg = OmegaConf.load(find_config("eval_math"))
    cfg = OmegaConf.merge(
        cfg,
        {
            "checkpoint_dir": str(model_dir),
            "data_dir": str(tmp_path / "data"),
            "output_dir": str(tmp_path / "out"),
            "device": "cpu",
            "dtype": "fp32",
            "model": {"max_seq_len": 512},
            "reward": {"workers": 1, "timeout": 2},
            "generation": {"max_new_tokens": 8},
            "benchmarks": {
                "AIME2024": {"k": 2},
                "AIME2025": {
                    "k": 2,
                    "dataset": {"path": str(tmp_path / "data" / "aime25.jsonl")},
                },  # JSONL works too
                "AMC": {"k": 2},
            },
        },
    )
    results = pepo_eval.eval_main(cfg)
    assert set(results) == {"AIME2024", "AIME2025", "AMC", "MATH500"}
    out = capsys.readouterr().out
    assert "| Model | AIME2024 | AIME2025 | AMC | MATH500 | Mean |" in out
    assert f"| {model_dir} | " in out  # labelled by the checkpoint_dir given
    folder = tmp_path / "out" / pepo_eval._results_dir(cfg, str(model_dir)).name
    saved = json.loads((folder / "eval_results.json").read_text())
    assert saved["results"] == results and saved["k"]["MATH500"] == 1
    assert saved["model"] == str(model_dir)
    assert (folder / "eval_results.md").read_text().startswith("| Model | AIME2024")
    assert (tmp_path / "out" / "eval_results.md").read_text().startswith("| Model | AIME2024")
    # every response is kept, k a problem in order, each with its own problem's answer, and the
    # standard error is over the problems' shares (catches the file not written, a problem's
    # answer taken from another, and an SE over rollouts or with the population SD)
    data = {n: pepo_eval.config.instantiate(cfg.benchmarks[n].dataset) for n in results}
    for name, problems in data.items():
        k = saved["k"][name]
        lines = (folder / "responses" / f"{name}.jsonl").read_text().splitlines()
        rows = [json.loads(line) for line in lines]
        assert len(rows) == k * len(problems)
        assert [(r["prompt"], r["answer"]) for r in rows] == [
            (p.prompt, p.answer) for p in problems for _ in range(k)]
        assert sum(r["success"] for r in rows) / len(rows) == pytest.approx(results[name])
        shares = [sum(r["success"] for r in rows[i:i + k]) / k for i in range(0, len(rows), k)]
        if len(shares) < 2:  # one problem: no spread to measure
            assert saved["benchmarks"][name]["se"] is None
            continue
        mean = sum(shares) / len(shares)
        sd = (sum((x - mean) ** 2 for x in shares) / (len(shares) - 1)) ** 0.5
        assert saved["benchmarks"][name]["se"] == pytest.approx(sd / len(shares) ** 0.5)
        assert all(r["truncated"] for r in rows)  # 8 new tokens: no response ends on its own


def test_a_trained_models_prompt_settings_are_compared_with_the_eval_tokenizers(tmp_path,
                                                                                caplog):
    """Training records how it rendered prompts (hf_model/pepo_prompt.json); an evaluation that
    renders them otherwise says so with the overrides that match (catches the file never read:
    the eval asked with thinking on and no system turn, in silence)."""
    register_resolvers()
    model_dir = F.tiny_hf_qwen3(tmp_path / "qwen3")
    (model_dir / "pepo_prompt.json").write_text(json.dumps(
        {"enable_thinking": False, "system_prompt": "Be brief.", "date_string": "26 Jul 2024"}))
    F.write_benchmarks(tmp_path / "data")
    cfg = OmegaConf.merge(OmegaConf.load(find_config("eval_math")), {
        "checkpoint_dir": str(model_dir), "data_dir": str(tmp_path / "data"),
        "output_dir": str(tmp_path / "out"), "device": "cpu", "dtype": "fp32",
        "model": {"max_seq_len": 512}, "reward": {"workers": 0},
        "generation": {"max_new_tokens": 8}})
    for n in ("AIME2024", "AIME2025", "AMC"):
        cfg.benchmarks.pop(n)
    setup = pepo_eval._setup(cfg)
    pepo_eval._close(setup["reward"], setup["engine"], setup["lock"])
    warned = [r.getMessage() for r in caplog.records if "pepo_prompt.json" in r.getMessage()]
    assert len(warned) == 1 and warned[0].endswith(
        "(enable_thinking=True, system_prompt=None): tokenizer.enable_thinking=false "
        "tokenizer.system_prompt=\"Be brief.\" asks as training did"), warned
    # a setting the template does not print is no difference (Qwen3's prints no date; catches
    # the settings compared rather than the prompts they render)
    from pepo.training.hf import prompt_differences
    from pepo.training.tokenizers import ChatTokenizer

    (model_dir / "pepo_prompt.json").write_text(json.dumps(
        {"enable_thinking": True, "system_prompt": None, "date_string": "1 Jan 2030"}))
    assert prompt_differences(ChatTokenizer(model_dir), model_dir) is None
    # not a record: nothing to compare (a JSON string would be searched for the keys)
    (model_dir / "pepo_prompt.json").write_text('"enable_thinking system_prompt"')
    assert prompt_differences(ChatTokenizer(model_dir), model_dir) is None
    # a template that refuses the recorded settings: they differ (no traceback)
    (model_dir / "pepo_prompt.json").write_text(json.dumps({"enable_thinking": False}))
    refusing = ChatTokenizer(model_dir)
    refusing.encode_prompt = lambda prompt: (_ for _ in ()).throw(RuntimeError("template"))
    assert "tokenizer.enable_thinking=false asks as training did" in prompt_differences(
        refusing, model_dir)


def test_responses_files_never_share_a_name():
    """Catches two benchmark names made one file name ('a b', 'a_b'), and a '/' in a name
    making a folder."""
    names = [pepo_eval._file_name(n) for n in ("a b", "a_b", "x/y", "MATH500", "..")]
    assert len(set(names)) == 5 and names[1] == "a_b.jsonl" and names[3] == "MATH500.jsonl"
    assert all("/" not in n and not n.startswith(".") for n in names)


def test_eval_config_errors(tmp_path):
    register_resolvers()
    cfg = OmegaConf.merge(OmegaConf.load(find_config("eval_math")), {
        "checkpoint_dir": str(tmp_path), "data_dir": str(tmp_path)})
    with pytest.raises(ValueError, match="benchmarks.AIME2024.dataset.path=.* does not exist"):
        pepo_eval.validate_eval_config(cfg)
    # the files the directory holds are named: a publisher's layout, not the config's names
    (tmp_path / "aime_2024_problems.parquet").write_bytes(b"")
    with pytest.raises(ValueError, match=r"aime24.parquet' does not exist; its directory holds "
                                         r"aime_2024_problems.parquet \(point the key at"):
        pepo_eval.validate_eval_config(cfg)


@pytest.mark.slow
def test_tune_run_pepo_eval_tiny(tmp_path):
    r = subprocess.run([sys.executable, "-m", "torchtune._cli.tune", "run", "pepo_eval",
                        "--config", "eval_tiny", "output_dir=out", "benchmarks.modsum_val.k=1",
                        "benchmarks.modsum_val.dataset.size=8"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "| Model | modsum_val | Mean |" in r.stdout
    assert "| tiny (base) | " in r.stdout
    assert (tmp_path / "out" / "tiny_base" / "eval_results.json").is_file()


def _tiny_eval_cfg(tmp_path, **overrides):
    register_resolvers()
    cfg = OmegaConf.load(find_config("eval_tiny"))
    return OmegaConf.merge(cfg, {"output_dir": str(tmp_path / "out"),
                                 "benchmarks": {"modsum_val": {"k": 1, "dataset": {"size": 4}}}},
                           overrides)


def test_eval_refuses_an_unwritable_or_file_output_dir_before_evaluating(tmp_path, monkeypatch):
    """Catches an evaluation that runs for hours and then fails to write its results."""
    (tmp_path / "f").write_text("x")
    called = []
    monkeypatch.setattr(pepo_eval, "avg_at_k", lambda *a, **k: called.append(1) or 0.5)
    with pytest.raises(ValueError, match="output_dir=.* cannot be a directory"):
        pepo_eval.eval_main(_tiny_eval_cfg(tmp_path, output_dir=str(tmp_path / "f" / "out")))
    assert not called


SMALL = {"embed_dim": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1,
         "intermediate_dim": 64}


def test_eval_never_overwrites_another_checkpoints_results(tmp_path, monkeypatch):
    """Catches two evaluations under one label silently replacing each other; the same
    checkpoint may be re-evaluated."""
    from tests.recipe_helpers import random_checkpoint

    monkeypatch.setattr(pepo_eval, "avg_at_k", lambda *a, **k: 0.5)
    first = _tiny_eval_cfg(tmp_path, model_name="mine")
    pepo_eval.eval_main(first)
    pepo_eval.eval_main(first)  # a rerun of the same checkpoint is fine
    other = random_checkpoint(tmp_path / "other")
    with pytest.raises(ValueError, match="holds the results of another evaluation labelled 'mine'"):
        pepo_eval.eval_main(_tiny_eval_cfg(tmp_path, checkpoint_dir=str(other), model=SMALL,
                                           model_name="mine"))
    saved = json.loads((tmp_path / "out" / "mine" / "eval_results.json").read_text())
    assert saved["checkpoint_dir"] == str(Path(first.checkpoint_dir).resolve())


def test_the_base_and_a_trained_checkpoint_share_one_output_dir_and_table(tmp_path, monkeypatch,
                                                                         capsys):
    """Catches an evaluation of the base model after a trained one being refused (one results
    file per output_dir), and both rows labelled alike (the config's model_name 'tiny' for
    both): each row is labelled by what was evaluated, a marker with the step it names."""
    from pepo.training.checkpointing import AtomicCheckpointer
    from tests.recipe_helpers import MODEL_OVERRIDES, random_checkpoint

    scores = iter([0.75, 0.25])
    monkeypatch.setattr(pepo_eval, "avg_at_k", lambda *a, **k: next(scores))
    run = tmp_path / "run"
    ckpt = random_checkpoint(tmp_path / "trained")
    from safetensors.torch import load_file
    AtomicCheckpointer(run / "checkpoints").save(7, load_file(str(ckpt / "model.safetensors")),
                                                 {"step": 7}, {"val_accuracy": 0.75})
    best = run / "checkpoints" / "best"
    marker = best if best.is_file() else run / "checkpoints" / "latest"
    trained = _tiny_eval_cfg(tmp_path, checkpoint_dir=str(marker), model=MODEL_OVERRIDES)
    pepo_eval.eval_main(trained)
    pepo_eval.eval_main(_tiny_eval_cfg(tmp_path))  # the base model, same output_dir
    out = capsys.readouterr().out
    table = (tmp_path / "out" / "eval_results.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| ") and "Model" not in line]
    step_dir = marker.read_text().strip()
    assert step_dir.startswith("step_")
    assert rows == [f"| {marker} ({step_dir}) | 75.00 | 75.00 |",
                    "| tiny (base) | 25.00 | 25.00 |"], table
    assert table.strip() in out  # the whole table is printed
    assert {p.name for p in (tmp_path / "out").iterdir() if p.is_dir()} >= {"tiny_base"}


def test_eval_refuses_an_output_dir_in_use_and_lets_go_of_its_own(tmp_path, monkeypatch):
    """Catches two evaluations (or a run and an evaluation) writing one directory at once, and
    an evaluation that keeps its directory locked after it ended or failed."""
    import os

    from pepo.training.run_lock import RunLock

    called = []
    monkeypatch.setattr(pepo_eval, "avg_at_k", lambda *a, **k: called.append(1) or 0.5)
    cfg = _tiny_eval_cfg(tmp_path)
    with RunLock(cfg.output_dir):
        with pytest.raises(ValueError, match=rf"in use by another run \(pid {os.getpid()} on "):
            pepo_eval.eval_main(cfg)
    assert not called
    pepo_eval.eval_main(cfg)  # free again: it runs, and leaves the directory free
    monkeypatch.setattr(pepo_eval, "avg_at_k", lambda *a, **k: 1 / 0)
    with pytest.raises(ZeroDivisionError):  # another label: the finished one would be kept
        pepo_eval.eval_main(_tiny_eval_cfg(tmp_path, model_name="fails"))
    RunLock(cfg.output_dir).release()  # a failed evaluation let go too


def test_eval_stop_tokens_reach_generation(tmp_path, monkeypatch):
    """Catches pepo_eval ignoring generation.stop_tokens."""
    seen = []
    monkeypatch.setattr(pepo_eval, "avg_at_k", lambda *a, **k: seen.append(k["stop_tokens"]) or 0.5)
    cfg = _tiny_eval_cfg(tmp_path, generation={"stop_tokens": ["+"]})
    pepo_eval.eval_main(cfg)
    from pepo.training.tokenizers import load_tokenizer
    tok = load_tokenizer(cfg.tokenizer.path)
    assert seen == [[*tok.stop_tokens, tok.token_id("+")]]


def test_eval_config_typo_is_one_line(tmp_path):
    with pytest.raises(ValueError,
                       match="unknown config key 'generation.top_pp'; "
                             "did you mean 'generation.top_p'"):
        pepo_eval.validate_eval_config(_tiny_eval_cfg(tmp_path, generation={"top_pp": 0.5}))


def _two_benchmarks(tmp_path, **overrides):
    """The tiny evaluation with a second benchmark (the same split, another seed)."""
    second = {"modsum_b": {"k": 1, "dataset": {"_component_": "pepo.tasks.problems.modsum_dataset",
                                               "size": 4, "split": "val", "seed": 1}}}
    return OmegaConf.merge(_tiny_eval_cfg(tmp_path, benchmarks=second), overrides)


def test_a_stopped_evaluation_keeps_its_finished_benchmarks_and_resumes(tmp_path, monkeypatch,
                                                                        capsys):
    """Catches results written only at the end (a Ctrl-C in the last benchmark lost hours), a
    rerun that samples again what it has, and an interruption shown as a traceback."""
    calls = []

    def first_then_stop(*a, **k):
        calls.append(a[2])
        if len(calls) == 2:
            raise KeyboardInterrupt
        return 0.5

    monkeypatch.setattr(pepo_eval, "avg_at_k", first_then_stop)
    cfg = _two_benchmarks(tmp_path)
    with pytest.raises(SystemExit) as stop:
        pepo_eval._main.__wrapped__(cfg)
    assert stop.value.code == 130
    err = capsys.readouterr().err
    assert err.startswith("interrupted: 1 benchmark(s) finished in this run; ") and \
        err.rstrip().endswith("eval_results.json keeps 1, and the same command evaluates the rest")
    saved = json.loads((tmp_path / "out" / "tiny_base" / "eval_results.json").read_text())
    assert saved["results"] == {"modsum_val": 0.5} and saved["complete"] is False
    monkeypatch.setattr(pepo_eval, "avg_at_k", lambda *a, **k: calls.append(a[2]) or 0.25)
    assert pepo_eval.eval_main(_two_benchmarks(tmp_path)) == {"modsum_val": 0.5,
                                                             "modsum_b": 0.25}
    assert len(calls) == 3  # the rerun sampled modsum_b only
    saved = json.loads((tmp_path / "out" / "tiny_base" / "eval_results.json").read_text())
    assert saved["complete"] is True and saved["results"] == {"modsum_val": 0.5,
                                                              "modsum_b": 0.25}
    # a benchmark whose k changed is sampled again; the other is kept
    changed = _two_benchmarks(tmp_path, benchmarks={"modsum_b": {"k": 2}})
    assert pepo_eval.eval_main(changed) == {"modsum_val": 0.5, "modsum_b": 0.25}
    assert len(calls) == 4
    # and so is one whose data changed under the same keys (a file rewritten at its path)
    real = pepo_eval.config.instantiate

    def other_problems(node, *a, **k):
        out = real(node, *a, **k)
        return out[1:] if node.get("seed") == 1 else out

    monkeypatch.setattr(pepo_eval.config, "instantiate", other_problems)
    assert pepo_eval.eval_main(changed) == {"modsum_val": 0.5, "modsum_b": 0.25}
    assert len(calls) == 5
    monkeypatch.setattr(pepo_eval.config, "instantiate", real)
    # a rerun with one benchmark keeps the other's result in the file
    assert pepo_eval.eval_main(_tiny_eval_cfg(tmp_path)) == {"modsum_val": 0.5}
    saved = json.loads((tmp_path / "out" / "tiny_base" / "eval_results.json").read_text())
    assert saved["results"] == {"modsum_val": 0.5, "modsum_b": 0.25} and len(calls) == 5


def test_results_under_other_settings_are_refused_not_replaced(tmp_path, monkeypatch):
    """Catches a rerun with another seed (or temperature, precision, reward...) silently
    replacing a label's results: only the checkpoint was compared."""
    monkeypatch.setattr(pepo_eval, "avg_at_k", lambda *a, **k: 0.5)
    pepo_eval.eval_main(_tiny_eval_cfg(tmp_path))
    with pytest.raises(ValueError, match=r"holds the results labelled 'tiny \(base\)' under other "
                                         r"settings: "
                                         r"generation.temperature \(1.0 -> 0.3\); seed \(0 -> 1\);"
                                         r" give this evaluation another model_name="):
        pepo_eval.eval_main(_tiny_eval_cfg(tmp_path, seed=1, generation={"temperature": 0.3}))
    saved = json.loads((tmp_path / "out" / "tiny_base" / "eval_results.json").read_text())
    assert saved["settings"]["seed"] == 0 and saved["settings"]["generation.temperature"] == 1.0
    assert saved["pepo_version"] and saved["benchmarks"]["modsum_val"]["problems"] == 4
    # what changes no number is no other setting: the batch, the verifier's workers, a default
    # written out, the GPU's index
    calls = []
    monkeypatch.setattr(pepo_eval, "avg_at_k", lambda *a, **k: calls.append(1) or 0.5)
    js = tmp_path / "out" / "tiny_base" / "eval_results.json"
    before = js.stat().st_mtime_ns
    pepo_eval.eval_main(_tiny_eval_cfg(tmp_path, batch_size=3, compute_dtype="fp32",
                                       generation={"top_k": None}))
    assert calls == []  # kept, not refused or sampled again
    assert js.stat().st_mtime_ns == before  # nor rewritten (the table orders rows by it)


def test_auto_precision_is_compared_as_what_it_chose(tmp_path, monkeypatch):
    """Catches compute_dtype=auto recorded as 'auto': a machine with bf16 units (bf16 samples)
    and one without (fp32) then share results."""
    from pepo.training import precision

    monkeypatch.setattr(pepo_eval, "avg_at_k", lambda *a, **k: 0.5)
    monkeypatch.setattr(precision, "cpu_bf16_units", lambda: ())
    pepo_eval.eval_main(_tiny_eval_cfg(tmp_path, compute_dtype="auto"))
    monkeypatch.setattr(precision, "cpu_bf16_units", lambda: ("amx_bf16",))
    with pytest.raises(ValueError, match=r"under other settings: compute_dtype_resolved "
                                         r"\('fp32' -> 'bf16'\)"):
        pepo_eval.eval_main(_tiny_eval_cfg(tmp_path, compute_dtype="auto"))


def test_weights_rewritten_at_the_same_path_are_evaluated_again(tmp_path, monkeypatch):
    """Catches a run's hf_model rewritten by a later run (the same path) answering with the
    earlier weights' numbers; and an earlier pepo's results file (no settings recorded) is
    evaluated again and replaced, as that pepo did."""
    import os

    from tests.recipe_helpers import MODEL_OVERRIDES, random_checkpoint

    calls = []
    monkeypatch.setattr(pepo_eval, "avg_at_k", lambda *a, **k: calls.append(1) or 0.5)
    ckpt = random_checkpoint(tmp_path / "ckpt")
    cfg = dict(checkpoint_dir=str(ckpt), model=MODEL_OVERRIDES, model_name="mine")
    pepo_eval.eval_main(_tiny_eval_cfg(tmp_path, **cfg))
    pepo_eval.eval_main(_tiny_eval_cfg(tmp_path, **cfg))
    assert len(calls) == 1
    weights = ckpt / "model.safetensors"
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    pepo_eval.eval_main(_tiny_eval_cfg(tmp_path, **cfg))
    assert len(calls) == 2
    js = tmp_path / "out" / "mine" / "eval_results.json"
    js.write_text(json.dumps({"model": "mine", "results": {"modsum_val": 0.1},
                              "checkpoint_dir": str(ckpt.resolve())}))
    pepo_eval.eval_main(_tiny_eval_cfg(tmp_path, **cfg))
    assert len(calls) == 3 and json.loads(js.read_text())["results"] == {"modsum_val": 0.5}
    js.write_text("{not json")
    with pytest.raises(ValueError, match=r"eval_results.json cannot be read as an evaluation's "
                                         r"results \(.*\); move or remove it$"):
        pepo_eval.eval_main(_tiny_eval_cfg(tmp_path, **cfg))


def test_the_table_says_where_its_rows_were_sampled_differently(tmp_path, monkeypatch):
    """Catches one table mixing avg@8 at temperature 1 with avg@1 at 0.3 in silence."""
    monkeypatch.setattr(pepo_eval, "avg_at_k", lambda *a, **k: 0.5)
    pepo_eval.eval_main(_tiny_eval_cfg(tmp_path, model_name="a"))
    table = (tmp_path / "out" / "eval_results.md").read_text()
    assert "different settings" not in table
    pepo_eval.eval_main(_tiny_eval_cfg(tmp_path, model_name="b", generation={"temperature": 0.3},
                                       benchmarks={"modsum_val": {"k": 2}}))
    note = (tmp_path / "out" / "eval_results.md").read_text().strip().splitlines()[-1]
    assert note == ("The rows were evaluated with different settings: benchmarks.modsum_val.k "
                    "(a: 1, b: 2); generation.temperature (a: 1.0, b: 0.3).")


def test_prompts_that_do_not_fit_and_an_empty_benchmark_are_refused_before_sampling(
        tmp_path, monkeypatch):
    """Catches a traceback after earlier benchmarks ran (the decoder's own check), and a
    benchmark silently evaluated on the prompts that fit."""
    from pepo.tasks.problems import modsum_dataset
    from pepo.training.config import asset_dir
    from pepo.training.tokenizers import load_tokenizer

    called = []
    monkeypatch.setattr(pepo_eval, "avg_at_k", lambda *a, **k: called.append(1) or 0.5)
    tok = load_tokenizer(asset_dir("tiny"))
    longest = max(len(tok.encode_prompt(p.prompt))
                  for p in modsum_dataset(size=4, split="val", seed=0))
    budget = 128 - longest  # the tiny model's max_seq_len: the longest prompt fits exactly
    with pytest.raises(ValueError, match=rf"^benchmarks.modsum_val: \d of 4 prompts \(the longest "
                                         rf"{longest} tokens\) do not fit 128 tokens with "
                                         rf"generation.max_new_tokens={budget + 1}; raise "):
        pepo_eval.eval_main(_tiny_eval_cfg(tmp_path, generation={"max_new_tokens": budget + 1}))
    pepo_eval.eval_main(_tiny_eval_cfg(tmp_path / "fits", generation={"max_new_tokens": budget}))
    assert called == [1]
    called.clear()
    monkeypatch.setattr(pepo_eval.config, "instantiate", _empty_datasets(pepo_eval.config))
    with pytest.raises(ValueError, match="^benchmarks.modsum_val: its dataset has no problems$"):
        pepo_eval.eval_main(_tiny_eval_cfg(tmp_path))
    assert not called


def _empty_datasets(config):
    real = config.instantiate

    def instantiate(node, *a, **k):
        out = real(node, *a, **k)
        return [] if str(node.get("_component_", "")).endswith("modsum_dataset") else out
    return instantiate


def test_avg_at_k_counts_the_truncated_responses(tmp_path):
    """Catches the count read from the wrong flag (finished, not truncated) or left out: the
    same rollouts sampled again give the count."""
    from pepo.tasks.problems import modsum_dataset
    from pepo.tasks.rewards import BoxedMatch
    from pepo.training.config import asset_dir
    from pepo.training.engines import build_engine
    from pepo.training.evaluation import avg_at_k, eval_generator, sample_and_score
    from pepo.training.generation import draw_seeds
    from pepo.training.models import tiny_qwen3
    from pepo.training.tokenizers import load_tokenizer
    from pepo.training.weights import load_model_weights

    model = tiny_qwen3()
    load_model_weights(model, asset_dir("tiny"))
    model.eval()
    engine, tok = build_engine("inprocess", model), load_tokenizer(asset_dir("tiny"))
    problems = list(modsum_dataset(size=6, split="val", seed=0))
    counts: dict = {}
    kw = dict(max_new_tokens=50, temperature=1.0, batch_size=64)  # responses of 40-58 tokens
    avg = avg_at_k(engine, tok, problems, 2, BoxedMatch(), generator=eval_generator(0),
                   counts=counts, **kw)
    rows = [p for p in problems for _ in range(2)]
    ro, rewards, _ = sample_and_score(engine, tok, rows, BoxedMatch(),
                                      stop_tokens=tok.stop_tokens,
                                      seeds=draw_seeds(eval_generator(0), len(rows)), **kw)
    want = int((~ro.finished).sum())
    assert 0 < want < len(rows), want  # both kinds, so a flipped flag fails
    assert counts == {"rollouts": 12, "correct": int((rewards > 0).sum()), "truncated": want}
    assert avg == pytest.approx(counts["correct"] / 12)


def test_the_seed_chooses_the_evaluations_samples(tmp_path, monkeypatch):
    """``seed=0`` and ``seed=1`` sample with different generators (seeds averaged over are
    independent samples). Catches the config's seed not passed
    on (every seed the same responses: N copies of one number averaged as N) and
    ``eval_generator`` ignoring its seed."""
    seen = {}

    def spy(*args, **kwargs):
        g = kwargs["generator"]
        seen.setdefault(run, []).append((g.initial_seed(), torch.rand(4, generator=g)))
        return 0.5

    monkeypatch.setattr(pepo_eval, "avg_at_k", spy)
    for run in (0, 1):
        pepo_eval.eval_main(_tiny_eval_cfg(tmp_path, seed=run,
                                           output_dir=str(tmp_path / f"o{run}")))
    (s0, d0), (s1, d1) = seen[0][0], seen[1][0]
    assert s0 != s1 and not torch.equal(d0, d1)


def test_long_labels_keep_their_ends_in_the_results_folder(tmp_path):
    """Labels are checkpoint paths as given, and two runs' paths share their start: catches the
    folder cut to the label's first 100 characters (two runs' results in one folder, the second
    refused as another checkpoint's) instead of its last 100."""
    cfg = OmegaConf.create({"output_dir": str(tmp_path)})
    root = "/data/experiments/" + "qwen3_1_7b_deepmath_" * 6
    a = pepo_eval._results_dir(cfg, root + "run_a/hf_model")
    b = pepo_eval._results_dir(cfg, root + "run_b/hf_model")
    assert a != b and a.name.endswith("run_a_hf_model") and len(a.name) <= 100
    assert pepo_eval._results_dir(cfg, "tiny (base)").name == "tiny_base"


def test_the_settings_record_the_devices_type_not_its_index(tmp_path):
    """``cuda:1`` samples as ``cuda`` does: catches the index recorded (an evaluation resumed
    on another GPU refused as other settings)."""
    cfg = _tiny_eval_cfg(tmp_path)
    typed = pepo_eval.validate_eval_config(cfg)
    assert pepo_eval._settings(cfg, typed)["device"] == "cpu"
    cfg.device = "cuda:1"
    assert pepo_eval._settings(cfg, typed)["device"] == "cuda"


def test_every_weight_file_is_recorded_and_nothing_else(tmp_path):
    """Catches the weights of a checkpoint saved as ``.bin``, ``.pt`` or ``.pth`` (and pepo's
    ``training_state.pt``) left out of the record that tells a rewritten checkpoint apart, and
    other files (a README, a folder) counted in."""
    for name, size in (("model.safetensors", 3), ("pytorch_model.bin", 5), ("training_state.pt",
                       7), ("w.pth", 2), ("README.md", 4), ("config.json", 6)):
        (tmp_path / name).write_bytes(b"x" * size)
    (tmp_path / "sub.pt").mkdir()
    got = pepo_eval._weights(tmp_path)
    assert [(n, s) for n, s, _ in got] == [("model.safetensors", 3), ("pytorch_model.bin", 5),
                                            ("training_state.pt", 7), ("w.pth", 2)]
    assert all(t == (tmp_path / n).stat().st_mtime_ns for n, _, t in got)


def test_a_benchmarks_digest_covers_its_answers(tmp_path):
    """A data file whose answers were corrected under the same prompts is another benchmark:
    catches the digest over the encoded prompts alone (the old avg@k kept)."""
    from pepo.tasks.problems import modsum_dataset
    from pepo.training.config import asset_dir
    from pepo.training.tokenizers import load_tokenizer

    tok = load_tokenizer(asset_dir("tiny"))
    problems = list(modsum_dataset(size=3, split="val", seed=0))
    fixed = [type(p)(**{**vars(p), "answer": str(p.answer) + "0"}) if i == 1 else p
             for i, p in enumerate(problems)]
    one = pepo_eval._check_benchmarks({"b": problems}, tok, 512, 8)
    assert one == pepo_eval._check_benchmarks({"b": list(problems)}, tok, 512, 8)
    assert one != pepo_eval._check_benchmarks({"b": fixed}, tok, 512, 8)


def test_the_saved_truncation_share_and_standard_error_are_over_rollouts_and_successes(
        tmp_path, monkeypatch):
    """k = 2 over 4 problems: 2 of 8 responses truncated is 25 % (catches a share over the 4
    problems, 50 %); the standard error is over the success flags, not the rewards (a format
    reward of 0.1 for a wrong answer: catches the rewards read)."""
    from pepo.training.evaluation import problem_se

    success = [True, True, True, False, False, False, True, False]

    def spy(*a, counts, records, **k):
        counts.update(rollouts=8, correct=4, truncated=2)
        records += [{"success": s, "reward": 1.0 if s else 0.1} for s in success]
        return 0.5

    monkeypatch.setattr(pepo_eval, "avg_at_k", spy)
    pepo_eval.eval_main(_tiny_eval_cfg(tmp_path, benchmarks={"modsum_val": {"k": 2}}))
    saved = json.loads((tmp_path / "out" / "tiny_base" / "eval_results.json").read_text(
        encoding="utf-8"))["benchmarks"]["modsum_val"]
    assert saved["truncated"] == 0.25 and saved["problems"] == 4
    assert saved["se"] == pytest.approx(problem_se(success, 2))
    assert saved["se"] != pytest.approx(problem_se([1.0 if s else 0.1 for s in success], 2))


def test_a_stop_says_how_many_benchmarks_the_file_keeps_earlier_ones_included(tmp_path,
                                                                             monkeypatch,
                                                                             capsys):
    """A second evaluation stopped in its first new benchmark: the file still keeps the one the
    first evaluation finished. Catches the count of this run's benchmarks alone ("none is
    kept", where one is)."""
    monkeypatch.setattr(pepo_eval, "avg_at_k", lambda *a, **k: 0.5)
    pepo_eval.eval_main(_tiny_eval_cfg(tmp_path))

    def stop(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(pepo_eval, "avg_at_k", stop)
    with pytest.raises(SystemExit):
        pepo_eval._main.__wrapped__(_two_benchmarks(tmp_path))
    err = capsys.readouterr().err
    assert err.startswith("interrupted: 0 benchmark(s) finished in this run; ")
    assert err.rstrip().endswith("eval_results.json keeps 1, and the same command evaluates "
                                 "the rest")


def test_the_evaluated_models_attention_runs_in_fp32_on_a_cpu(tmp_path, monkeypatch):
    """As in training (docs/recipe.md, compute_dtype): catches the evaluation's model left
    without it, so a bf16 evaluation on a CPU samples otherwise than training validated."""
    seen = []
    real = pepo_eval.cpu_attention_in_fp32
    monkeypatch.setattr(pepo_eval, "cpu_attention_in_fp32",
                        lambda model: seen.append(real(model)) or seen[-1])
    monkeypatch.setattr(pepo_eval, "avg_at_k", lambda *a, **k: 0.5)
    pepo_eval.eval_main(_tiny_eval_cfg(tmp_path))
    assert seen == [3]  # the tiny model's three attention layers
