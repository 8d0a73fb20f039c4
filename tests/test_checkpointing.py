"""Atomic checkpoints: a crash while writing never leaves `latest` naming a broken directory."""

from __future__ import annotations

import pytest
import torch

import pepo.checkpointing as ck


def test_save_load_and_latest(tmp_path):
    m = torch.nn.Linear(3, 2)
    c = ck.AtomicCheckpointer(tmp_path, keep=2)
    assert c.latest() is None
    for step in (1, 2, 3):
        c.save(step, m, {"step": step, "rng": torch.get_rng_state()})
    assert c.latest().name == "step_3"
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_2", "step_3"]
    assert c.load_state(c.latest())["step"] == 3
    m2 = torch.nn.Linear(3, 2)
    ck.load_model_weights(m2, c.latest())
    assert torch.equal(m2.weight, m.weight)
    assert not list(tmp_path.glob(".tmp*"))


def test_crash_during_save_keeps_previous(tmp_path, monkeypatch):
    m = torch.nn.Linear(3, 2)
    c = ck.AtomicCheckpointer(tmp_path)
    c.save(1, m, {"step": 1})

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(ck.torch, "save", boom)
    with pytest.raises(OSError, match="disk full"):
        c.save(2, m, {"step": 2})
    assert c.latest().name == "step_1"
    assert not (tmp_path / "step_2").exists() and not list(tmp_path.glob(".tmp*"))


def test_mismatched_weights_are_refused(tmp_path):
    c = ck.AtomicCheckpointer(tmp_path)
    path = c.save(1, torch.nn.Linear(3, 2), {})
    with pytest.raises(ValueError, match="has shape \\[2(, 3)?\\], the model expects \\[4(, 3)?\\]"):
        ck.load_model_weights(torch.nn.Linear(3, 4), path)
    with pytest.raises(ValueError, match="has no model.safetensors"):
        ck.load_model_weights(torch.nn.Linear(3, 2), tmp_path)
