"""pepo.training.files (content digests, durable writes, the full-disk test) and
pepo.training.weights (one loader for both checkpoint formats)."""

from __future__ import annotations

import copy
import os
import shutil

import pytest
import torch

import pepo.training.files as files
from pepo.training.files import nearly_full, weights_digest, write_durably
from pepo.training.weights import load_model_weights


def _weights_dir(path, content=b"weights"):
    path.mkdir(parents=True, exist_ok=True)
    (path / "model.safetensors").write_bytes(content)
    return path


def test_the_weights_digest_covers_weight_files_only_and_their_names(tmp_path):
    """The digest is what a cache of numbers made from the weights is kept under: it must
    change when a weight file does and nowhere else. Catches a pepo checkpoint's
    ``training_state.pt`` (the optimizer's state, rewritten by every resume; not the weights)
    hashed in, a config, a log or a checksum file hashed in (a cache thrown away for nothing),
    and file names left out (the same bytes under another file name are another checkpoint:
    a shard of a sharded one, say)."""
    d = _weights_dir(tmp_path / "a")
    base = weights_digest(d)
    assert len(base) == 16 and int(base, 16) >= 0
    (d / "training_state.pt").write_bytes(b"optimizer, step 1")
    (d / "config.json").write_text("{}", encoding="utf-8")
    (d / "checksums.json").write_text("{}", encoding="utf-8")
    (d / "notes.txt").write_text("a log", encoding="utf-8")
    assert weights_digest(d) == base
    (d / "training_state.pt").write_bytes(b"optimizer, step 2 (a resumed run)")
    assert weights_digest(d) == base
    (d / "model.safetensors").write_bytes(b"weights, trained further")
    assert weights_digest(d) != base
    # the same bytes under another name
    e = tmp_path / "b"
    e.mkdir()
    (e / "model-00001-of-00001.safetensors").write_bytes(b"weights")
    assert weights_digest(e) != base
    (e / "model-00001-of-00001.safetensors").rename(e / "model.safetensors")
    assert weights_digest(e) == base  # names and bytes alike: the directory's path is no part


def test_write_durably_fsyncs_the_file_it_wrote(tmp_path, monkeypatch):
    """Catches the fsync left out: a checkpoint renamed into place before its bytes reach the
    disk can be empty after a power cut, with ``latest`` naming it."""
    synced = []
    real = os.fsync

    def fsync(fd):
        synced.append(os.fstat(fd).st_ino)
        real(fd)

    monkeypatch.setattr(files.os, "fsync", fsync)
    path = tmp_path / "state.pt"
    write_durably(path, lambda p: p.write_bytes(b"state"))
    assert path.read_bytes() == b"state" and synced == [path.stat().st_ino]


@pytest.mark.parametrize("free, full", [(2**20 - 1, True), (2**20, False), (2**19, True),
                                        (2**30, False)])
def test_nearly_full_is_under_one_mib_free(tmp_path, monkeypatch, free, full):
    """Catches another threshold (a disk with 100 KiB left is full to torch.save; 1 KiB is
    too little to tell), and the boundary taken the other way."""
    usage = shutil._ntuple_diskusage(2**40, 2**40 - free, free)
    monkeypatch.setattr(files.shutil, "disk_usage", lambda p: usage)
    assert nearly_full(tmp_path) is full


def test_nearly_full_is_false_where_the_free_space_cannot_be_read(tmp_path, monkeypatch):
    """A file system that will not say (a gone directory, a stale NFS handle) is no proof of a
    full disk: catches True, which would report any C++ stream error as 'no space left'."""
    def unreadable(path):
        raise OSError(116, "Stale file handle")

    monkeypatch.setattr(files.shutil, "disk_usage", unreadable)
    assert nearly_full(tmp_path) is False
    assert nearly_full(tmp_path / "gone") is False


def test_a_hugging_face_directory_loads_through_the_same_call(tmp_path):
    """``load_model_weights`` on a directory with ``config.json`` converts Hugging Face's
    names; catches that branch skipped (a Hugging Face checkpoint with one
    ``model.safetensors`` read as pepo's own: every key missing)."""
    from pepo.training.hf import from_hf
    from tests.training.test_hf import qwen3_dir

    qwen3_dir(tmp_path)
    want = from_hf(tmp_path)
    model = copy.deepcopy(want)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    load_model_weights(model, tmp_path)
    for (name, got), ref in zip(model.state_dict().items(), want.state_dict().values()):
        assert torch.equal(got, ref), name


def test_a_state_with_a_key_the_model_lacks_is_refused_naming_it(tmp_path):
    """A checkpoint of a bigger model (one layer more) holds every key of the smaller one:
    catches only missing keys checked (it failed in load_state_dict with a RuntimeError
    listing every key, not the one-line error naming the checkpoint)."""
    from safetensors.torch import save_file

    state = {k: v.clone() for k, v in torch.nn.Linear(3, 2).state_dict().items()}
    save_file({**state, "extra.weight": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"does not match the model: missing \[\], unexpected "
                                         r"\['extra.weight'\]"):
        load_model_weights(torch.nn.Linear(3, 2), tmp_path)
