"""Each program that loads a pepo checkpoint's weights refuses one whose model.safetensors no
longer has the sha256 recorded in its checksums.json: pepo_eval, a new run's starting weights
(``checkpoint_dir``) and the intervention study's ``--base`` / ``--replacement``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

import pepo_eval
import pepo_recipe
from pepo.study import analysis
from pepo.training.checkpointing import MODEL_FILE, AtomicCheckpointer
from pepo.training.config import find_config, register_resolvers
from pepo.training.models import tiny_qwen3
from tests.recipe_helpers import MODEL_OVERRIDES, random_checkpoint, tiny_cfg

TINY = {"_component_": "pepo.training.models.tiny_qwen3", **MODEL_OVERRIDES}


def _run_with_a_damaged_best(tmp_path: Path) -> tuple[Path, Path]:
    """``RUN/checkpoints`` of the tiny test model, step_1 intact and step_2 (named by both
    ``latest`` and ``best``) with one flipped bit inside its weights; and that damaged file."""
    torch.manual_seed(0)
    model = tiny_qwen3(**MODEL_OVERRIDES)
    root = tmp_path / "run" / "checkpoints"
    c = AtomicCheckpointer(root, keep=2, best_metric="val_accuracy")
    c.save(1, model, {"step": 1}, {"val_accuracy": 0.5})
    c.save(2, model, {"step": 2}, {"val_accuracy": 0.7})
    damaged = root / "step_2" / MODEL_FILE
    raw = bytearray(damaged.read_bytes())
    raw[-100] ^= 0x40  # inside the last tensor's data: the file still loads
    damaged.write_bytes(bytes(raw))
    return root, damaged


def _refused(e: pytest.ExceptionInfo, damaged: Path) -> bool:
    msg = str(e.value)
    return msg.startswith(f"{damaged} is damaged: its sha256 differs") and "\n" not in msg


def test_pepo_eval_refuses_a_damaged_checkpoint(tmp_path, monkeypatch):
    """Catches pepo_eval loading checkpoint_dir=RUN/checkpoints/best (and latest) without
    checking checksums.json: it scored the damaged weights without a word."""
    root, damaged = _run_with_a_damaged_best(tmp_path)
    monkeypatch.setattr(pepo_eval, "avg_at_k", lambda *a, **k: pytest.fail("evaluated"))
    register_resolvers()
    for marker in ("best", "latest"):
        cfg = OmegaConf.merge(OmegaConf.load(find_config("eval_tiny")), {
            "output_dir": str(tmp_path / f"eval_{marker}"), "model": TINY,
            "checkpoint_dir": str(root / marker),
            "benchmarks": {"modsum_val": {"k": 1, "dataset": {"size": 2}}}})
        with pytest.raises(ValueError) as e:
            pepo_eval.eval_main(cfg)
        assert _refused(e, damaged), str(e.value)


def test_a_run_refuses_damaged_starting_weights(tmp_path):
    """Catches a new run starting from checkpoint_dir=RUN/checkpoints/best without checking
    checksums.json (it trained from the damaged weights); refused in setup, before a step."""
    root, damaged = _run_with_a_damaged_best(tmp_path / "old")
    cfg = tiny_cfg(tmp_path, checkpoint_dir=str(root / "best"), num_steps=1)
    with pytest.raises(ValueError) as e:
        pepo_recipe.recipe_main(cfg, log_config=False)
    assert _refused(e, damaged), str(e.value)
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize("which", ["--replacement", "--base"])
def test_the_intervention_refuses_a_damaged_checkpoint(tmp_path, which):
    """Catches the intervention study loading --replacement or --base (here
    RUN/checkpoints/best) without checking checksums.json; one line, before any sampling."""
    root, damaged = _run_with_a_damaged_best(tmp_path)
    intact = random_checkpoint(tmp_path / "intact")
    register_resolvers()
    c = OmegaConf.load(find_config("tiny"))
    c.model, c.checkpoint_dir = TINY, str(intact)
    OmegaConf.save(c, tmp_path / "cfg.yaml")
    args = {"--replacement": str(intact), "--base": str(intact), which: str(root / "best")}
    with pytest.raises(SystemExit) as e:
        analysis.main(["intervene", "--config", str(tmp_path / "cfg.yaml"),
                       *[x for kv in args.items() for x in kv], "--budgets", "0", "--k", "1",
                       "--problems", "1", "--out", str(tmp_path / "out")])
    msg = str(e.value)
    assert msg.startswith(f"error: {damaged} is damaged: its sha256 differs") and "\n" not in msg
