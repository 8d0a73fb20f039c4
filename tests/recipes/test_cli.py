"""`tune run pepo_recipe` as a user types it, from a directory outside the repository."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

TUNE = [sys.executable, "-m", "torchtune._cli.tune", "run", "pepo_recipe"]


def tune(tmp_path, *args):
    return subprocess.run([*TUNE, *args], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.slow
def test_tune_run_tiny_one_step(tmp_path):
    r = tune(tmp_path, "--config", "tiny", "num_steps=1", "output_dir=out", "validation.samples=1",
             "val_dataset.size=4", "strategy.name=global_topk")
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout + r.stderr
    assert "pepo[global_topk]" in out and "tok_s=" in out  # the progress bar
    assert "Validation accuracy (avg@1):" in out and "before ->" in out
    assert (tmp_path / "out" / "training_curves.png").is_file()
    assert (tmp_path / "out" / "logs" / "metrics.txt").is_file()
    again = tune(tmp_path, "--config", "tiny", "num_steps=1", "output_dir=out")
    assert again.returncode != 0 and "Traceback" not in again.stderr
    assert "already holds a run's checkpoints; pass resume_from_checkpoint=True" in again.stderr


@pytest.mark.parametrize("args, message", [
    (["--config", "no_such_config"], "neither a file nor a bundled config; bundled configs: ["),
    (["--config", "tyny"], "neither a file nor a bundled config; did you mean 'tiny'? bundled"),
    (["--config", "tiny", "strategy.name=nope"], "config error: strategy.name='nope': unknown"),
    # torchtune's own parser raised a ValueError traceback for these
    (["--config", "tiny", "num_steps", "5"],
     "error: 'num_steps': after --config, each override is key=value (such as num_steps=5"),
    (["--config", "tiny", "--num_steps=5"], "error: '--num_steps=5': after --config, each"),
])
@pytest.mark.slow
def test_tune_run_bad_config_is_one_clear_line(tmp_path, args, message):
    r = tune(tmp_path, *args)
    assert r.returncode != 0
    assert message in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
def test_list_and_copy_a_config_then_run_the_copy(tmp_path):
    """`python -m pepo.configs ls / cp`: the torchtune habit for pepo's configs; the copy runs,
    and cp never overwrites."""
    ls = subprocess.run([sys.executable, "-m", "pepo.configs", "ls"], cwd=tmp_path,
                        capture_output=True, text=True, timeout=120)
    assert ls.returncode == 0, ls.stderr
    names = {
        line.split()[0] for line in ls.stdout.split("configs:")[1].splitlines() if line.strip()
    }
    from pepo.training.config import list_configs
    assert names == set(list_configs()) and "pepo_recipe" in ls.stdout.split("configs:")[0]
    cp = [sys.executable, "-m", "pepo.configs", "cp", "tiny", "mine.yaml"]
    first = subprocess.run(cp, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert first.returncode == 0 and "tune run pepo_recipe --config mine.yaml" in first.stdout
    (tmp_path / "mine.yaml").write_text((tmp_path / "mine.yaml").read_text().replace(
        "num_steps: 60", "num_steps: 1"))
    again = subprocess.run(cp, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert again.returncode == 2 and "never overwrites" in again.stderr
    assert "num_steps: 1\n" in (tmp_path / "mine.yaml").read_text()  # the edit survived
    r = tune(tmp_path, "--config", "mine.yaml", "output_dir=out", "validation.every=0")
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "out" / "checkpoints" / "latest").read_text().strip() == "step_1"


def test_cp_where_it_cannot_write_is_one_line(tmp_path, monkeypatch, capsys):
    """A directory it may not write in (or a full disk) was a PermissionError traceback."""
    import importlib.util
    import shutil

    path = Path(__file__).resolve().parents[2] / "recipes" / "configs" / "__main__.py"
    spec = importlib.util.spec_from_file_location("pepo_configs_main", path)
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)

    def denied(src, dst):
        raise PermissionError(13, "Permission denied", str(dst))

    monkeypatch.setattr(shutil, "copyfile", denied)
    assert cli.main(["cp", "tiny", str(tmp_path / "mine.yaml")]) == 2
    err = capsys.readouterr().err
    assert err == f"error: cannot write {tmp_path / 'mine.yaml'}: Permission denied\n"


def test_config_summaries_are_whole_sentences(tmp_path):
    """``ls`` showed each config's first comment line, cut mid-sentence ("minutes on a") where
    the sentence went on. Catches the first line alone, a cut at an abbreviation's period
    ("Sec. 5.1"), and a sentence run into the next paragraph."""
    from pepo.configs.__main__ import _summary

    f = tmp_path / "c.yaml"
    f.write_text("# PEPO on the drift task (Sec. 4, App. C.1): minutes on a\n"
                 "# laptop CPU, no downloads. More after.\n#\n# tune run ...\nname: x\n",
                 encoding="utf-8")
    assert _summary(f) == ("PEPO on the drift task (Sec. 4, App. C.1): minutes on a laptop CPU, "
                           "no downloads")
    f.write_text("# a sentence without its period\n#\n# the next paragraph.\n", encoding="utf-8")
    assert _summary(f) == "a sentence without its period"
