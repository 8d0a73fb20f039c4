"""Atomic checkpoints: a crash while writing never leaves `latest` naming a broken directory."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

import pepo.training.checkpointing as ck
from pepo.training.weights import load_model_weights


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
    load_model_weights(m2, c.latest())
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


def test_a_crash_while_a_step_is_saved_again_keeps_its_checkpoint(tmp_path, monkeypatch):
    """A step's checkpoint is saved again when its validation settles after a resume. Catches
    the old copy deleted before the new one is renamed into place: a crash between the two
    left ``latest`` naming nothing, and with ``keep=1`` no checkpoint at all."""
    import os

    m = torch.nn.Linear(3, 2)
    c = ck.AtomicCheckpointer(tmp_path, keep=1)
    c.save(1, m, {"step": 1})
    c.save(2, m, {"step": 2}, {"val_accuracy": 0.25})
    real = os.replace

    def killed(src, dst):  # the kill lands on the rename of the new copy
        if os.path.basename(str(src)).startswith(".tmp_step_2"):
            raise KeyboardInterrupt
        return real(src, dst)

    monkeypatch.setattr(ck.os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        c.save(2, m, {"step": 2}, {"val_accuracy": 0.5})
    monkeypatch.setattr(ck.os, "replace", real)
    path, state = c.load_latest()  # the old copy is put back
    assert path.name == "step_2" and state == {"step": 2}
    assert c.metadata(path)["val_accuracy"] == 0.25
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == [
        "latest", "step_2"]
    c.save(2, m, {"step": 2}, {"val_accuracy": 0.5})  # and the re-save then goes through
    assert c.metadata(c.latest())["val_accuracy"] == 0.5
    assert not [p for p in tmp_path.iterdir() if p.name.startswith((".tmp", ".replaced"))]
    # a crash after the new copy is in place: the old one is deleted, the new one kept
    (tmp_path / ".replaced_step_2").mkdir()
    assert c.load_latest()[0].name == "step_2" and not (tmp_path / ".replaced_step_2").exists()
    assert c.metadata(c.latest())["val_accuracy"] == 0.5


def test_two_ranks_mending_an_interrupted_re_save_at_once_both_go_on(tmp_path, monkeypatch):
    """Every rank of a torchrun launch looks for the checkpoint to resume: catches the rank
    that loses the race to put a moved-aside checkpoint back dying of FileNotFoundError."""
    import os

    m = torch.nn.Linear(3, 2)
    c = ck.AtomicCheckpointer(tmp_path, keep=1)
    c.save(2, m, {"step": 2})
    os.replace(tmp_path / "step_2", tmp_path / ".replaced_step_2")  # a kill mid re-save
    real = os.replace

    def other_rank_first(src, dst):
        real(src, dst)  # the other rank's rename lands first
        raise FileNotFoundError(2, "No such file or directory", str(src))

    monkeypatch.setattr(ck.os, "replace", other_rank_first)
    path, state = c.load_latest()
    assert path.name == "step_2" and state == {"step": 2}


def test_a_disk_filling_up_in_torch_save_is_reported_as_full(tmp_path, monkeypatch):
    """torch.save reports a full disk as a C++ stream error that names no cause, and deleting
    the partial checkpoint frees the space again. Catches the free space measured only after
    that clean-up (the recipe then printed a traceback, not the 'no space left ... resume'
    line naming the last intact checkpoint)."""
    import pepo.training.files as files
    from pepo.training.stopping import CheckpointFailed, checkpoint_failure

    m = torch.nn.Linear(3, 2)
    c = ck.AtomicCheckpointer(tmp_path)
    c.save(1, m, {"step": 1})
    real_usage = files.shutil.disk_usage

    def usage(path):  # full while the partial checkpoint takes the space
        free = 10 if list(tmp_path.glob(".tmp_step_*")) else 2**30
        return type("Usage", (), {"free": free, "total": real_usage(path).total})()

    def torch_save(obj, path):
        with open(path, "wb") as f:
            f.write(b"x" * 100)
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 828736")

    monkeypatch.setattr(files.shutil, "disk_usage", usage)
    monkeypatch.setattr(ck.torch, "save", torch_save)
    with pytest.raises(OSError) as raised:
        c.save(2, m, {"step": 2})
    failed = checkpoint_failure(raised.value, 2, tmp_path, c.marked())
    assert isinstance(failed, CheckpointFailed) and f"is {tmp_path / 'step_1'}" in str(failed)
    assert "unexpected pos" in str(raised.value) and not list(tmp_path.glob(".tmp*"))
    # a bug that is not a full disk keeps its own error
    monkeypatch.setattr(files.shutil, "disk_usage", real_usage)
    with pytest.raises(RuntimeError, match="unexpected pos"):
        c.save(2, m, {"step": 2})


def test_mismatched_weights_are_refused(tmp_path):
    c = ck.AtomicCheckpointer(tmp_path)
    path = c.save(1, torch.nn.Linear(3, 2), {})
    with pytest.raises(ValueError,
                       match="has shape \\[2(, 3)?\\], the model expects \\[4(, 3)?\\]"):
        load_model_weights(torch.nn.Linear(3, 4), path)
    with pytest.raises(ValueError, match="has no model.safetensors"):
        load_model_weights(torch.nn.Linear(3, 2), tmp_path)


def _three_steps(root):
    """Checkpoints step_1..3 of a Linear(3, 2), ``latest`` naming step_3."""
    m = torch.nn.Linear(3, 2)
    c = ck.AtomicCheckpointer(root, keep=3)
    for step in (1, 2, 3):
        c.save(step, m, {"step": step})
    return c


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # a copy or a write cut off half way


def test_marker_deleted_finds_the_newest_step(tmp_path):
    """Catches `latest()` answering "no checkpoint" when the marker is gone though complete
    step_* directories exist (the reported bug), and a scan that sorts names as strings
    (step_10 < step_9) or picks the oldest."""
    c = ck.AtomicCheckpointer(tmp_path, keep=5)
    for step in (2, 9, 10):
        c.save(step, torch.nn.Linear(3, 2), {"step": step})
    (tmp_path / "latest").unlink()
    assert c.latest().name == "step_10"
    assert c.load_latest()[1]["step"] == 10


@pytest.mark.parametrize("damaged", [
    ck.MODEL_FILE, ck.STATE_FILE, "missing " + ck.MODEL_FILE, "missing " + ck.STATE_FILE,
])
@pytest.mark.parametrize("with_marker", [True, False])
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous(tmp_path, damaged, with_marker):
    """Catches trusting the marker (or the newest directory) because its two files exist: a
    half-written model.safetensors or training_state.pt must be skipped, with a warning naming
    it, for step_2, by both latest() and load_latest()."""
    c = _three_steps(tmp_path)
    if damaged.startswith("missing "):
        (tmp_path / "step_3" / damaged.split()[1]).unlink()
    else:
        _truncate(tmp_path / "step_3" / damaged)
    if not with_marker:
        (tmp_path / "latest").unlink()
    with pytest.warns(ck.CheckpointWarning, match="step_3 is damaged"):
        assert c.latest().name == "step_2"
    with pytest.warns(ck.CheckpointWarning, match="step_3 is damaged"):
        path, state = c.load_latest()
    assert path.name == "step_2" and state == {"step": 2}


def test_a_state_file_damaged_inside_is_caught_at_load_time(tmp_path):
    """Catches a resume that stops at the cheap check: a training_state.pt of the right length
    whose pickle bytes are garbage passes the zip-directory test, but load_latest() must fail
    to unpickle it and fall back to step_2 rather than crash the resume."""
    c = _three_steps(tmp_path)
    state_file = tmp_path / "step_3" / ck.STATE_FILE
    raw = bytearray(state_file.read_bytes())
    start = raw.index(b"\x80\x02")  # the pickle (protocol 2) of data.pkl, the archive's first entry
    raw[start + 2 : start + 40] = b"X" * 38
    state_file.write_bytes(bytes(raw))
    assert c.latest().name == "step_3"  # the cheap check cannot see inside
    with pytest.warns(ck.CheckpointWarning, match="step_3 is damaged .*the CRC-32 of .*data.pkl"):
        path, state = c.load_latest()
    assert path.name == "step_2" and state["step"] == 2


def test_nothing_intact_means_no_checkpoint(tmp_path):
    """Catches returning a damaged directory when it is the only one left."""
    c = _three_steps(tmp_path)
    for step in (1, 2, 3):
        _truncate(tmp_path / f"step_{step}" / ck.MODEL_FILE)
    with pytest.warns(ck.CheckpointWarning):
        assert c.latest() is None
    with pytest.warns(ck.CheckpointWarning):
        assert c.load_latest() is None
    assert c.has_checkpoints()  # still: a fresh run must not start over them


@pytest.mark.parametrize("content", [
    "../../etc", "../outside", "/abs/step_1", "step_1/../step_2", "step_2/", "step_02", "step_-1",
    "step_x", "", "step_9",  # step_9: a valid name, but no such directory
])
def test_an_invalid_marker_is_ignored_with_a_warning(tmp_path, content):
    """Catches a marker that can make resume read outside checkpoints/ (``root / marker`` with
    ``../`` or an absolute path), or one naming a missing directory that ends the search: each
    must be ignored with a warning, and the newest step found by scanning."""
    c = _three_steps(tmp_path / "checkpoints")
    outside = tmp_path / "outside"  # a complete checkpoint outside root: never to be used
    ck.AtomicCheckpointer(tmp_path).save(7, torch.nn.Linear(3, 2), {"step": 7})
    (tmp_path / "step_7").rename(outside)
    (tmp_path / "checkpoints" / "latest").write_text(content + "\n")
    with pytest.warns(ck.CheckpointWarning, match="checkpoint marker .*latest .*ignored"):
        assert c.latest() == tmp_path / "checkpoints" / "step_3"


def test_symlinks_and_stale_temporaries_are_ignored(tmp_path):
    """Catches a scan that globs ``*step_*`` (a complete ``.tmp_step_9_*`` left by a crash
    before its rename would win), one that follows a ``step_8`` symlink out of root, a marker
    that is itself a symlink, and pruning that crashes on a stray ``step_notes`` directory."""
    root = tmp_path / "checkpoints"
    c = _three_steps(root)
    m = torch.nn.Linear(3, 2)
    stale = root / ".tmp_step_9_abc"
    stale.mkdir()
    save_file({k: v.contiguous() for k, v in m.state_dict().items()}, str(stale / ck.MODEL_FILE))
    torch.save({"step": 9}, stale / ck.STATE_FILE)
    ck.AtomicCheckpointer(tmp_path / "elsewhere").save(8, m, {"step": 8})
    (root / "step_8").symlink_to(tmp_path / "elsewhere" / "step_8", target_is_directory=True)
    (root / "step_notes").mkdir()
    (root / "latest").unlink()
    assert c.latest().name == "step_3"
    (root / "latest").symlink_to(tmp_path / "elsewhere" / "latest")
    with pytest.warns(ck.CheckpointWarning, match="is not a regular file"):
        assert c.latest().name == "step_3"
    (root / "latest").unlink()
    c.save(4, m, {"step": 4})  # saves (and prunes) with the strays present
    assert c.latest().name == "step_4" and (root / "step_notes").is_dir()
    assert (tmp_path / "elsewhere" / "step_8").is_dir()  # pruning never deletes through a link


def test_has_checkpoints(tmp_path):
    """Catches a check that only looks at the marker (a run whose marker was lost would be
    overwritten by a fresh start) or that counts stale temporaries as checkpoints."""
    c = ck.AtomicCheckpointer(tmp_path / "checkpoints")
    assert not c.has_checkpoints()  # no directory at all
    (tmp_path / "checkpoints" / ".tmp_step_1_x").mkdir(parents=True)
    assert not c.has_checkpoints()
    (tmp_path / "checkpoints" / "step_1").mkdir()
    assert c.has_checkpoints()
    (tmp_path / "checkpoints" / "step_1").rmdir()
    (tmp_path / "checkpoints" / "latest").write_text("step_1\n")
    assert c.has_checkpoints()


def test_bad_arguments(tmp_path):
    for keep in (0, 1.5, True):
        with pytest.raises(ValueError, match=f"keep must be an int >= 1, got {keep!r}"):
            ck.AtomicCheckpointer(tmp_path, keep=keep)
    with pytest.raises(ValueError, match="step must be an int >= 0, got -1"):
        ck.AtomicCheckpointer(tmp_path).save(-1, torch.nn.Linear(3, 2), {})


def test_checkpoints_are_as_readable_as_the_umask_allows(tmp_path):
    """Catches checkpoint directories and files left 0700/0600 (mkdtemp, safetensors), which a
    team on a shared file system cannot read or resume from."""
    import os
    import stat

    old = os.umask(0o022)
    try:
        checkpointer = ck.AtomicCheckpointer(tmp_path / "ckpt")
        path = checkpointer.save(1, {"w": torch.zeros(2)}, {"step": 1})
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o755
    for f in path.iterdir():
        assert stat.S_IMODE(f.stat().st_mode) == 0o644, f.name


def test_a_missing_checkpoint_dir_says_it_does_not_exist(tmp_path):
    from pepo.training.config import check_checkpoint_dir

    with pytest.raises(ValueError, match="does not exist"):
        check_checkpoint_dir(str(tmp_path / "nope"))
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        check_checkpoint_dir(str(tmp_path / "f"))


def _flip_a_bit(path, offset_from_end):
    raw = bytearray(path.read_bytes())
    raw[len(raw) - offset_from_end] ^= 0x10
    path.write_bytes(bytes(raw))


def _big_three_steps(root):
    """As _three_steps, with a state that holds a tensor (bytes to flip inside the zip)."""
    m = torch.nn.Linear(64, 64)
    c = ck.AtomicCheckpointer(root, keep=3)
    for step in (1, 2, 3):
        c.save(step, m, {"step": step, "buf": torch.arange(4096, dtype=torch.float32) * step})
    return c


def test_one_flipped_bit_in_the_state_file_is_caught_and_the_previous_checkpoint_used(tmp_path):
    """A flipped bit in training_state.pt resumed without a word (no CRC was checked)."""
    c = _big_three_steps(tmp_path)
    state_file = tmp_path / "step_3" / ck.STATE_FILE
    raw = state_file.read_bytes()
    data_at = raw.index((torch.arange(4096, dtype=torch.float32) * 3)[1000:1004].numpy().tobytes())
    _flip_a_bit(state_file, len(raw) - data_at)  # inside the tensor's bytes, not the pickle
    assert torch.load(state_file, weights_only=True)["step"] == 3  # torch itself loads it
    assert c.latest().name == "step_3"  # and the cheap check passes
    with pytest.warns(ck.CheckpointWarning,
                      match=r"step_3 is damaged \(training_state.pt: the CRC-32 of "):
        path, state = c.load_latest()
    assert path.name == "step_2" and state["step"] == 2


def test_one_flipped_bit_in_the_weights_is_caught_by_the_recorded_sha256(tmp_path):
    """model.safetensors has no checksum of its own: one flipped bit loaded silently."""
    c = _big_three_steps(tmp_path)
    _flip_a_bit(tmp_path / "step_3" / ck.MODEL_FILE, 100)  # inside the last tensor's data
    with pytest.warns(ck.CheckpointWarning,
                      match=r"step_3 is damaged \(the sha256 of model.safetensors differs"):
        path, _ = c.load_latest()
    assert path.name == "step_2"


def test_checksums_are_recorded_and_older_checkpoints_without_them_still_load(tmp_path):
    import hashlib
    import json
    import warnings

    c = _big_three_steps(tmp_path)
    sums = json.loads((tmp_path / "step_3" / ck.CHECKSUMS).read_text(encoding="utf-8"))
    assert sums == {n: hashlib.sha256((tmp_path / "step_3" / n).read_bytes()).hexdigest()
                    for n in (ck.MODEL_FILE, ck.STATE_FILE)}
    (tmp_path / "step_3" / ck.CHECKSUMS).unlink()  # as written before checksums existed
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert c.load_latest()[0].name == "step_3"
    (tmp_path / "step_3" / ck.CHECKSUMS).write_text("{not json", encoding="utf-8")
    with pytest.warns(ck.CheckpointWarning,
                      match=r"step_3 is damaged \(checksums.json is unreadable"):
        assert c.load_latest()[0].name == "step_2"


def test_the_best_checkpoint_is_kept_beside_the_newest_and_named_by_a_marker(tmp_path):
    import json

    m = torch.nn.Linear(3, 2)
    c = ck.AtomicCheckpointer(tmp_path, keep=1, best_metric="val_accuracy")
    for step, acc in [(1, 0.5), (2, 0.9), (3, 0.7), (4, 0.9), (5, None)]:
        c.save(step, m, {"step": step}, None if acc is None else {"val_accuracy": acc})
    # newest (5) and the best (2: the earliest of the two 0.9s), nothing else
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_2", "step_5"]
    assert (tmp_path / "best").read_text(encoding="utf-8").strip() == "step_2"
    assert c.best().name == "step_2" and c.latest().name == "step_5"
    assert json.loads((tmp_path / "step_2" / ck.METADATA).read_text()) == {
        "step": 2,
        "val_accuracy": 0.9,
    }
    assert ck.AtomicCheckpointer.metadata(tmp_path / "step_5") == {"step": 5}
    c.save(6, m, {"step": 6}, {"val_accuracy": 0.95})  # a new best replaces the old one
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_6"]
    assert (tmp_path / "best").read_text(encoding="utf-8").strip() == "step_6"


def test_without_a_best_metric_only_the_newest_are_kept(tmp_path):
    m = torch.nn.Linear(3, 2)
    c = ck.AtomicCheckpointer(tmp_path, keep=1)
    for step, acc in [(1, 0.9), (2, 0.1)]:
        c.save(step, m, {"step": step}, {"val_accuracy": acc})
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_2"]
    assert c.best() is None and not (tmp_path / "best").exists()


def test_a_checkpointer_without_a_best_metric_removes_a_best_marker_it_prunes(tmp_path):
    """A run that kept its best (step 1), resumed with ``keep_best=false``: pruning may delete
    step 1 then, but must not leave ``best`` naming a deleted directory (the old code did);
    a marker whose checkpoint is still there stays."""
    m = torch.nn.Linear(3, 2)
    ck.AtomicCheckpointer(tmp_path, keep=1, best_metric="val_accuracy").save(
        1, m, {"step": 1}, {"val_accuracy": 0.9})
    c = ck.AtomicCheckpointer(tmp_path, keep=2)
    c.save(2, m, {"step": 2})
    assert (tmp_path / "best").read_text(encoding="utf-8") == "step_1\n"  # step_1 still kept
    c.save(3, m, {"step": 3})
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_2", "step_3"]
    assert not (tmp_path / "best").exists()


def test_a_marker_path_names_its_checkpoint_directory(tmp_path):
    c = _three_steps(tmp_path)
    assert ck.resolve_marker(str(tmp_path / "latest")) == str(tmp_path / "step_3")
    assert ck.resolve_marker(tmp_path / "step_2") == tmp_path / "step_2"  # a directory: as is
    assert ck.resolve_marker(None) is None
    (tmp_path / "best").write_text("step_9\n", encoding="utf-8")
    with pytest.raises(ValueError,
                       match=r"best is a checkpoint marker, but it names 'step_9', not a "
                             r"step_<N> checkpoint directory"):
        ck.resolve_marker(str(tmp_path / "best"))
    assert c.latest().name == "step_3"


_MARK = 0.123456  # one weight's value, to find its four bytes in model.safetensors


def _damaged_exponent_run(root):
    """Checkpoints step_1..3 of a Linear(3, 2) under ``root``, each with weight[0, 0] = _MARK,
    ``best`` naming step_2; then step_2's and step_3's copy of that weight has its top exponent
    bit flipped (0.123456 -> about 4e37): a file safetensors still loads without a word."""
    import struct

    m = torch.nn.Linear(3, 2)
    with torch.no_grad():
        m.weight[0, 0] = _MARK
    c = ck.AtomicCheckpointer(root, keep=3, best_metric="val_accuracy")
    for step, acc in [(1, 0.1), (2, 0.9), (3, 0.5)]:
        c.save(step, m, {"step": step}, {"val_accuracy": acc})
    for step in (2, 3):
        f = root / f"step_{step}" / ck.MODEL_FILE
        raw = bytearray(f.read_bytes())
        at = raw.index(struct.pack("<f", _MARK))
        raw[at + 3] ^= 0x40  # little-endian float32: byte 3 holds the sign and 7 exponent bits
        f.write_bytes(bytes(raw))
    return c


def test_every_load_of_a_checkpoints_weights_checks_its_recorded_sha256(tmp_path):
    """Catches load_model_weights (the one function through which a run's starting weights,
    pepo_eval and the intervention study load a checkpoint) skipping checksums.json outside a
    resume: one flipped exponent bit loaded a weight of about 4e37 silently. A step directory,
    ``latest`` and ``best`` (resolved as the recipes resolve them) must each fail with one line
    naming the damaged file."""
    from safetensors.torch import load_file

    _damaged_exponent_run(tmp_path)
    w = load_file(str(tmp_path / "step_3" / ck.MODEL_FILE))["weight"][0, 0].item()
    assert 1e37 < w < 1e38  # the damage: safetensors itself loads the file
    for given, step in [(tmp_path / "step_3", 3), (tmp_path / "latest", 3),
                        (tmp_path / "best", 2)]:
        damaged = tmp_path / f"step_{step}" / ck.MODEL_FILE
        with pytest.raises(ValueError) as e:
            load_model_weights(torch.nn.Linear(3, 2), ck.resolve_marker(str(given)))
        assert str(e.value).startswith(f"{damaged} is damaged: its sha256 differs from the one "
                                       f"recorded in checksums.json"), str(e.value)
        assert "\n" not in str(e.value)
    m = torch.nn.Linear(3, 2)
    load_model_weights(m, tmp_path / "step_1")  # the intact one loads, and as saved
    assert m.weight[0, 0].item() == pytest.approx(_MARK, rel=1e-7)


def test_a_damaged_or_missing_checksums_file_when_loading_weights(tmp_path):
    """Catches a weight load that treats an unreadable checksums.json as "nothing to check"
    (it must refuse, naming the file it cannot check), and one that refuses a checkpoint
    written before checksums were recorded (no checksums.json: loads as before)."""
    _three_steps(tmp_path)
    (tmp_path / "step_3" / ck.CHECKSUMS).write_text("{not json", encoding="utf-8")
    with pytest.raises(ValueError, match=rf"^cannot check {tmp_path / 'step_3' / ck.MODEL_FILE}: "
                                         r"its checksums.json is unreadable \(JSONDecodeError"):
        load_model_weights(torch.nn.Linear(3, 2), tmp_path / "step_3")
    (tmp_path / "step_2" / ck.CHECKSUMS).write_text('{"model.safetensors": "ab"}', encoding="utf-8")
    with pytest.raises(ValueError, match=r"checksums.json is unreadable \(KeyError"):
        load_model_weights(torch.nn.Linear(3, 2), tmp_path / "step_2")
    (tmp_path / "step_1" / ck.CHECKSUMS).unlink()
    load_model_weights(torch.nn.Linear(3, 2), tmp_path / "step_1")


def test_a_nan_validation_score_never_becomes_best(tmp_path):
    """Catches best() taking NaN for a score (``math.isfinite`` dropped from its filter):
    ``max`` over tuples holding NaN returns whichever came first, and the scan lists the newest
    first, so step_2's NaN was named best and step_1, the one real best, pruned."""
    m = torch.nn.Linear(3, 2)
    c = ck.AtomicCheckpointer(tmp_path, keep=1, best_metric="val_accuracy")
    c.save(1, m, {"step": 1}, {"val_accuracy": 0.5})
    c.save(2, m, {"step": 2}, {"val_accuracy": float("nan")})
    assert ck.AtomicCheckpointer.metadata(tmp_path / "step_2")["val_accuracy"] != 0.5  # NaN kept
    assert c.best() == tmp_path / "step_1"
    assert (tmp_path / "best").read_text(encoding="utf-8") == "step_1\n"
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_1", "step_2"]
    only_nan = ck.AtomicCheckpointer(tmp_path / "nan", keep=1, best_metric="val_accuracy")
    for step in (1, 2):
        only_nan.save(step, m, {"step": step}, {"val_accuracy": float("nan")})
    assert only_nan.best() is None and not (tmp_path / "nan" / "best").exists()


def test_without_a_checkpoint_recording_the_metric_there_is_no_best_marker(tmp_path):
    """Catches a ``best`` marker written (or left) when no checkpoint records the metric: one
    pointed at a step with no score (the first, step 0), or a stale one kept because nothing
    replaced it. It must be removed, and best() must be None."""
    m = torch.nn.Linear(3, 2)
    c = ck.AtomicCheckpointer(tmp_path, keep=2, best_metric="val_accuracy")
    c.save(0, m, {"step": 0})
    c.save(1, m, {"step": 1}, {"loss": 0.3})  # a metric, not the best_metric
    assert c.best() is None and not (tmp_path / "best").exists()
    (tmp_path / "best").write_text("step_0\n", encoding="utf-8")  # stale, e.g. a deleted score
    c.save(2, m, {"step": 2})
    assert c.best() is None and not (tmp_path / "best").exists()
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_1", "step_2"]


@pytest.mark.parametrize("marked_damaged", [False, True])
def test_checkpoints_newer_than_a_valid_marker_are_not_preferred(tmp_path, marked_damaged):
    """Catches candidates that ignore a valid ``latest`` marker and take the newest directory
    (step_3 here, from a save that crashed after its rename but before the marker moved), or
    that fall back from a damaged marked checkpoint to a newer one: the marker names the last
    complete save, so step_2 (or, damaged, step_1) is what resumes, without any warning about
    step_3."""
    import warnings

    c = _three_steps(tmp_path)
    (tmp_path / "latest").write_text("step_2\n", encoding="utf-8")
    want = "step_2"
    if marked_damaged:
        _truncate(tmp_path / "step_2" / ck.MODEL_FILE)
        want = "step_1"
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert c.latest().name == want
        path, state = c.load_latest()
    assert path.name == want and state == {"step": int(want[-1])}
    assert not [w for w in seen if "step_3" in str(w.message)]
    assert len(seen) == (2 if marked_damaged else 0)  # damaged step_2, once per call


class _Rank:
    """A rank of a multi-process resume: rank 0's object comes back from the gather, and
    ``others_failed`` is what the other ranks said to ``any``."""

    def __init__(self, rank, rank0=None, others_failed=False):
        self.enabled, self.is_main = True, rank == 0
        self.rank0, self.others_failed = rank0, others_failed

    def gather_objects(self, obj):
        return [obj if self.is_main else self.rank0, obj]

    def any(self, flag):
        return bool(flag) or self.others_failed


def test_every_rank_resumes_from_the_checkpoint_rank_0_chose(tmp_path):
    """Each rank chose its own checkpoint, falling back to an older one on any error of its own
    (a read that failed on one node): ranks went on from different steps, their weights mixed.
    Catches a rank other than 0 choosing (its newest, step 2, where rank 0 chose step 1), a
    rank that cannot load the chosen state carrying on, rank 0's refusal raised on rank 0 only,
    and rank 0 carrying on when another rank failed."""
    from pepo.training.resume import agreed_checkpoint

    root = tmp_path / "checkpoints"
    ckpt = ck.AtomicCheckpointer(root, keep=3)
    for step in (1, 2):
        ckpt.save(step, {"w": torch.full((2,), float(step))}, {"step": step})
    kw = {"experiment": {}, "num_steps": 4, "warn": lambda msg: None, "closed": False}
    path, state = agreed_checkpoint(ckpt, _Rank(1, (str(root / "step_1"), None)), **kw)
    assert path == root / "step_1" and state["step"] == 1
    path, state = agreed_checkpoint(ckpt, _Rank(0), **kw)  # rank 0: the newest intact one
    assert path == root / "step_2" and state["step"] == 2
    with pytest.raises(ValueError, match="is at step 2, and num_steps=2 asks for no more"):
        agreed_checkpoint(ckpt, _Rank(1, (None, "step_2 is at step 2, and num_steps=2 asks for "
                                                "no more; raise num_steps to train further")),
                          **kw)
    with pytest.raises(ValueError, match=r"step_7: its training state does not load here"):
        agreed_checkpoint(ckpt, _Rank(1, (str(root / "step_7"), None)), **kw)
    with pytest.raises(ValueError, match=r"another process could not load .*step_2"):
        agreed_checkpoint(ckpt, _Rank(0, others_failed=True), **kw)
