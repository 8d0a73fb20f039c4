"""``prior_cache``: SPO's offline prior kept in a file, computed by the first run that needs it
and read by the next ones, without changing what any run does."""

from __future__ import annotations

import fcntl
import json

import pytest
import torch
from omegaconf import OmegaConf

import pepo_recipe
from pepo.training import prior_cache
from pepo.training.config import prior_fingerprint, validate_config
from tests.recipe_helpers import tiny_cfg


def setup_recipe(cfg):
    recipe = pepo_recipe.PEPORecipe(cfg)
    recipe.setup(cfg)
    return recipe


def state(recipe) -> tuple:
    ids = [p.id for p in recipe.train_data]
    return (recipe.estimator.values(ids), recipe.estimator.state_dict(),
            recipe.sample_rng.get_state(), recipe.rng.get_state())


def test_prior_is_written_then_read_and_the_run_is_the_same(tmp_path, monkeypatch):
    """Catches a cached prior that differs from a computed one, a read that still generates, and
    a prior whose draws move the training stream (the next draws would differ with a cache)."""
    cache = tmp_path / "prior.json"
    plain = tiny_cfg(tmp_path / "a", "tiny_spo", estimator={"prior_samples": 2})
    ckpt = plain.checkpoint_dir
    a = setup_recipe(plain)
    rollouts = []
    real = pepo_recipe.PEPORecipe._rollout
    monkeypatch.setattr(pepo_recipe.PEPORecipe, "_rollout",
                        lambda self, problems, seeds: rollouts.append(len(problems))
                        or real(self, problems, seeds))
    b = setup_recipe(tiny_cfg(tmp_path / "b", "tiny_spo", checkpoint_dir=ckpt,
                              estimator={"prior_samples": 2}, prior_cache=str(cache)))
    assert sum(rollouts) == 2 * len(b.train_data)  # computed: 2 rollouts of every prompt
    saved = json.loads(cache.read_text())
    ids = [p.id for p in a.train_data]
    assert [k for k, _ in saved["pass_rates"]] == ids
    assert saved["fingerprint"]["estimator.prior_samples"] == 2
    assert saved["fingerprint"]["checkpoint_dir"] == str(ckpt)
    rollouts.clear()
    c = setup_recipe(tiny_cfg(tmp_path / "c", "tiny_spo", checkpoint_dir=ckpt,
                              estimator={"prior_samples": 2}, prior_cache=str(cache),
                              strategy={"name": "uniform"}))
    assert rollouts == []  # read, not generated
    for other in (b, c):
        values, tracker, sample_rng, rng = state(other)
        want_values, want_tracker, want_sample_rng, want_rng = state(a)
        torch.testing.assert_close(values, want_values, rtol=0, atol=0)
        assert tracker == want_tracker
        assert torch.equal(sample_rng, want_sample_rng) and torch.equal(rng, want_rng)
    # the saved rates are the computed prior: p = (k + 1/2) / (n + 1) with k = rate * n
    rates = dict(saved["pass_rates"])
    want = torch.tensor([(rates[i] * 2 + 0.5) / 3 for i in ids])
    torch.testing.assert_close(a.estimator.values(ids), want, rtol=1e-6, atol=1e-6)
    for r in (a, b, c):
        r.cleanup()


def test_first_training_step_is_the_same_with_a_read_prior(tmp_path):
    """The step after a read prior samples the very tokens of a run that computed it."""
    cache = tmp_path / "prior.json"
    runs = []
    for name in ("a", "b", "c"):
        cfg = tiny_cfg(tmp_path / name, "tiny_spo", num_steps=1,
                       prior_cache=None if name == "a" else str(cache),
                       **({"checkpoint_dir": runs[0].checkpoint_dir} if runs else {}))
        runs.append(cfg)
        pepo_recipe.recipe_main(cfg, log_config=False)
    dumps = [[json.loads(line)["token_ids"] for line in
              (tmp_path / n / "run" / "rollouts" / "step_000001.jsonl").read_text().splitlines()]
             for n in ("a", "b", "c")]
    assert dumps[0] and dumps[0] == dumps[1] == dumps[2]


def test_a_prior_made_under_other_settings_is_refused(tmp_path):
    cache = tmp_path / "prior.json"
    cfg = tiny_cfg(tmp_path / "a", "tiny_spo", prior_cache=str(cache))
    setup_recipe(cfg).cleanup()
    other = tiny_cfg(tmp_path / "b", "tiny_spo", checkpoint_dir=cfg.checkpoint_dir,
                     prior_cache=str(cache), seed=7, generation={"temperature": 0.5})
    with pytest.raises(ValueError, match=r"other settings: generation.temperature \(1.0 -> 0.5\), "
                                         r"seed \(0 -> 7\)"):
        setup_recipe(other)


def test_settings_that_do_not_change_the_prior_are_not_in_its_fingerprint(tmp_path):
    base = tiny_cfg(tmp_path, "tiny_spo", prior_cache="p.json")
    fp = prior_fingerprint(base)
    for key, value in (("generation.batch_size", 3), ("strategy.name", "uniform"),
                       ("estimator.rho_min", 0.5), ("num_steps", 9), ("output_dir", "x")):
        changed = base.copy()
        OmegaConf.update(changed, key, value)
        assert prior_fingerprint(changed) == fp, key
    assert {"seed", "checkpoint_dir", "estimator.prior_samples", "dataset.size",
            "generation.max_new_tokens", "reward._component_"} <= set(fp)


def test_read_prior_checks_the_file_and_the_prompts(tmp_path):
    path = tmp_path / "p.json"
    assert prior_cache.read_prior(path, {"seed": 0}, ["a"]) is None
    prior_cache.write_prior(path, {"seed": 0}, {"a": 0.5, "b": 1.0})
    assert prior_cache.read_prior(path, {"seed": 0}, ["b", "a"]) == {"a": 0.5, "b": 1.0}
    with pytest.raises(ValueError, match="holds 2 prompts but the dataset has 3 .*'c' is missing"):
        prior_cache.read_prior(path, {"seed": 0}, ["a", "b", "c"])
    with pytest.raises(ValueError, match="holds 2 prompts but the dataset has 1"):
        prior_cache.read_prior(path, {"seed": 0}, ["a"])
    path.write_text("{not json")
    with pytest.raises(ValueError, match="is not a prior cache file"):
        prior_cache.read_prior(path, {"seed": 0}, ["a"])
    with pytest.raises(ValueError, match="str or int prompt ids only"):
        prior_cache.write_prior(path, {}, {("a", 1): 0.5})


def test_lock_is_exclusive(tmp_path):
    path = tmp_path / "p.json"
    with prior_cache.locked(path):
        with open(f"{path}.lock", "a") as other:  # another open file: another holder
            with pytest.raises(BlockingIOError):
                fcntl.flock(other.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    with open(f"{path}.lock", "a") as other:  # released
        fcntl.flock(other.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)


def test_prior_cache_needs_an_offline_prior(tmp_path):
    with pytest.raises(ValueError, match="prior_cache='p.json' is set but estimator.name='group'"):
        validate_config(tiny_cfg(tmp_path, "tiny", prior_cache="p.json"))
    with pytest.raises(ValueError, match="prior_samples >= 1"):
        validate_config(tiny_cfg(tmp_path, "tiny_spo", prior_cache="p.json",
                                 estimator={"prior_samples": 0}))


def test_a_dead_writers_temp_file_is_removed_and_a_live_ones_kept(tmp_path, monkeypatch):
    """A writer killed between write and rename left cache.json.tmp<PID> forever."""
    import os
    import subprocess
    import sys

    path = tmp_path / "cache.json"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a pid that no longer runs
    (tmp_path / f"cache.json.tmp{dead.pid}").write_text("{half", encoding="utf-8")
    live = tmp_path / f"cache.json.tmp{os.getppid()}"  # a running process (pytest's parent)
    live.write_text("{being written", encoding="utf-8")
    other = tmp_path / "cache.json.tmpnotes"
    other.write_text("x", encoding="utf-8")
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd))[1])
    prior_cache.write_prior(path, {"seed": 0}, {"a": 0.5})
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["cache.json", live.name, other.name])
    assert len(synced) >= 1  # the data was fsynced before the rename
    assert prior_cache.read_prior(path, {"seed": 0}, ["a"]) == {"a": 0.5}


def test_a_failed_write_leaves_no_temp_file(tmp_path, monkeypatch):
    path = tmp_path / "cache.json"

    def boom(*a, **k):
        raise OSError(28, "No space left on device")

    import os

    monkeypatch.setattr(os, "fsync", boom)  # the temp file exists when the disk fills
    with pytest.raises(OSError, match="No space"):
        prior_cache.write_prior(path, {"seed": 0}, {"a": 0.5})
    assert list(tmp_path.iterdir()) == []


class _Counting:
    """An estimator stand-in: a prior of ``prior_samples`` rollouts per prompt (the mean of
    their rewards), with the calls recorded."""

    name = "counting"

    def __init__(self, prior_samples: int) -> None:
        self.prior_samples, self.prior, self.prepared = prior_samples, None, 0

    def prepare(self, ids, score):
        self.prepared += 1
        if not self.prior_samples:
            return {}
        n = self.prior_samples
        rewards = score([i for i in range(len(ids)) for _ in range(n)])
        self.prior = {pid: float(rewards[j * n:(j + 1) * n].mean()) for j, pid in enumerate(ids)}
        return self.prior

    def set_prior(self, rates):
        self.prior = dict(rates)


def test_prepare_estimator_computes_writes_then_reads_without_a_model(tmp_path):
    """The prior-cache protocol alone (no model, no recipe). Catches a second run that samples
    again although the file matches, a read prior that differs from the written one, a file
    read under another fingerprint, and an estimator without a prior that touches the file."""
    from pepo.training.distributed import Dist

    ids, path = ["a", "b", "c"], str(tmp_path / "prior.json")
    calls = []

    def score(indices):
        calls.append(list(indices))
        return torch.tensor([float(i % 2) for i in range(len(indices))])

    first = _Counting(2)
    assert prior_cache.prepare_estimator(first, ids, score, path=path, fingerprint={"seed": 0},
                                         dist=Dist("cpu", timeout_s=60)) == "written"
    assert calls == [[0, 0, 1, 1, 2, 2]] and first.prior == {"a": 0.5, "b": 0.5, "c": 0.5}
    second = _Counting(2)
    assert prior_cache.prepare_estimator(second, ids, score, path=path,
                                         fingerprint={"seed": 0}) == "read"
    assert len(calls) == 1 and second.prepared == 0 and second.prior == first.prior
    with pytest.raises(ValueError, match=r"made under other settings: seed \(0 -> 1\)"):
        prior_cache.prepare_estimator(_Counting(2), ids, score, path=path,
                                      fingerprint={"seed": 1})
    none = _Counting(0)
    other = str(tmp_path / "unused.json")
    assert prior_cache.prepare_estimator(none, ids, score, path=other) is None
    assert none.prepared == 1 and not (tmp_path / "unused.json").exists() and len(calls) == 1


def test_cached_value_computes_once_and_names_a_changed_setting(tmp_path):
    """Catches a cache that is never read (computed twice), one read across other settings, a
    file written by a process told not to write (not the main rank), and a bad file accepted."""
    path, calls = str(tmp_path / "v.json"), []

    def compute():
        calls.append(1)
        return 0.375

    fp = {"seed": 3, "generation.temperature": 0.7}
    assert prior_cache.cached_value(None, fp, compute) == (0.375, False)
    assert prior_cache.cached_value(str(tmp_path / "w.json"), fp, compute, write=False) == (
        0.375, False)
    assert not (tmp_path / "w.json").exists()
    assert prior_cache.cached_value(path, fp, compute) == (0.375, False)
    assert prior_cache.cached_value(path, fp, lambda: pytest.fail("recomputed")) == (0.375, True)
    assert len(calls) == 3
    with pytest.raises(ValueError, match=r"generation.temperature \(0.7 -> 1.0\)"):
        prior_cache.cached_value(path, {**fp, "generation.temperature": 1.0}, compute)
    (tmp_path / "bad.json").write_text("[1, 2]", encoding="utf-8")
    with pytest.raises(ValueError, match="is not a cached value file"):
        prior_cache.cached_value(str(tmp_path / "bad.json"), fp, compute)


class _Rank:
    """A rank of a multi-process run, as cached_value sees it: rank 0's object comes back from
    the gather (``rank0``, what rank 0 found; this rank's own view is not used)."""

    def __init__(self, rank, rank0=None):
        self.is_main, self.rank0, self.sent = rank == 0, rank0, []

    def gather_objects(self, obj):
        self.sent.append(obj)
        return [obj if self.is_main else self.rank0, obj]


def test_cached_value_takes_rank_0s_answer_on_every_rank(tmp_path):
    """Each rank looked for the file itself: a rank that found it (a node-local path of an
    earlier run, a file written between two ranks' looks) skipped the collective validation
    the others ran, and their collectives went out of step. Catches a rank deciding on its own
    view either way, a rank other than 0 writing, and rank 0's refusal raised on rank 0 alone."""
    fp = {"seed": 3}
    here, absent = tmp_path / "v.json", str(tmp_path / "nowhere.json")
    prior_cache.cached_value(str(here), fp, lambda: 0.25)  # a file on this node only
    rank0 = _Rank(0)
    assert prior_cache.cached_value(str(here), fp, lambda: 0.0, dist=rank0) == (0.25, True)
    assert rank0.sent == [("value", 0.25)]
    # rank 1 does not see the file rank 0 read: it takes rank 0's value, computes nothing
    assert prior_cache.cached_value(absent, fp, lambda: pytest.fail("computed"),
                                    dist=_Rank(1, ("value", 0.25))) == (0.25, True)
    # rank 1 sees a file rank 0 did not: it computes with the others, and writes nothing
    assert prior_cache.cached_value(str(here), fp, lambda: 0.5, dist=_Rank(1)) == (0.5, False)
    other = tmp_path / "other.json"
    assert prior_cache.cached_value(str(other), fp, lambda: 0.5, dist=_Rank(1)) == (0.5, False)
    assert not other.exists()
    with pytest.raises(ValueError, match="made under other settings: seed"):
        prior_cache.cached_value(absent, fp, lambda: 0.0, dist=_Rank(1, (
            "error", f"validation.before_cache={str(here)!r} was made under other settings: "
                     f"seed (3 -> 4)")))


def test_validation_before_training_is_read_and_the_run_is_the_same(tmp_path, monkeypatch):
    """validation.before_cache: the second run of a seed reads the first's validation before
    training (one validation fewer) and trains exactly as without it: the same step-0 accuracy,
    the same rollouts. Catches a read that moves the training stream, a cache never read, and
    one refused for a setting that does not change the validation (generation.batch_size)."""
    cache = tmp_path / "val.json"
    calls = []
    real = pepo_recipe.PEPORecipe.validate
    monkeypatch.setattr(pepo_recipe.PEPORecipe, "validate",
                        lambda self: calls.append(self.step) or real(self))
    runs = []
    for name in ("a", "b", "c"):
        cfg = tiny_cfg(tmp_path / name, num_steps=1, validation={
            "every": 1, "before_cache": None if name == "a" else str(cache)},
            **({"checkpoint_dir": runs[0].checkpoint_dir} if runs else {}),
            # c decodes 3 rows at a time: a RUN key, which the validation cache ignores
            **({"generation": {"batch_size": 3}} if name == "c" else {}))
        runs.append(cfg)
        calls.clear()
        pepo_recipe.recipe_main(cfg, log_config=False)
        assert calls == ([1] if name == "c" else [0, 1])  # c reads step 0's
    saved = json.loads(cache.read_text())
    assert saved["fingerprint"]["validation.samples"] == 2 and "seed" in saved["fingerprint"]
    assert "generation.batch_size" not in saved["fingerprint"]
    hist = [json.loads((tmp_path / n / "run" / "summary.json").read_text())["history"]
            for n in "abc"]
    assert hist[0][0] == hist[1][0] == hist[2][0] and hist[0][0]["step"] == 0
    assert saved["value"] == hist[0][0]["val_accuracy"]
    dumps = [[json.loads(line)["token_ids"] for line in
              (tmp_path / n / "run" / "rollouts" / "step_000001.jsonl").read_text().splitlines()]
             for n in "abc"]
    assert dumps[0] == dumps[1] == dumps[2]
    # a cache an earlier pepo wrote, which recorded such a setting: read all the same
    saved["fingerprint"]["generation.batch_size"] = 7
    cache.write_text(json.dumps(saved))
    calls.clear()
    pepo_recipe.recipe_main(tiny_cfg(tmp_path / "d", num_steps=1, validation={
        "every": 1, "before_cache": str(cache)}, checkpoint_dir=runs[0].checkpoint_dir),
        log_config=False)
    assert calls == [1]


def _write_problems(path, answer: str) -> None:
    rows = [{"problem": f"What is {i} + {i}?", "answer": answer if i == 0 else str(2 * i)}
            for i in range(16)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def _perturb_weights(checkpoint_dir) -> None:
    """Other weights written to the same path (a model trained again into its directory)."""
    from safetensors.torch import load_file, save_file

    f = checkpoint_dir / "model.safetensors"
    weights = load_file(str(f))
    name = sorted(weights)[0]
    weights[name] = weights[name] + 0.5
    save_file(weights, str(f))


class _Stop(Exception):
    pass


def _val_before(cfg, out) -> tuple[float, bool]:
    """The recipe's validation before training with ``cfg`` (its ``validate`` a stand-in
    returning 0.25): the accuracy it logged and whether it validated (not read)."""
    recipe = setup_recipe(OmegaConf.merge(cfg, {"output_dir": str(out), "prior_cache": None}))
    calls = []
    recipe.validate = lambda: calls.append(1) or 0.25

    def stop():
        raise _Stop

    recipe.train_step = stop
    try:
        with pytest.raises(_Stop):
            recipe.train()
    finally:
        recipe.cleanup()
    return recipe.history[0]["val_accuracy"], bool(calls)


def test_caches_are_kept_under_the_weights_and_data_not_only_their_paths(tmp_path):
    """A prior cache and a validation-before cache read back after the weights at
    ``checkpoint_dir`` or the data file were written again in place (the config unchanged) are
    other settings: refused, naming ``inputs.weights`` / ``inputs.dataset``, where they were
    read as the old numbers. Catches a fingerprint of the config alone, a digest of the wrong
    data (the train set for validation), and one of file times instead of contents (the same
    bytes written again are still read)."""
    from pathlib import Path

    data = tmp_path / "train.jsonl"
    _write_problems(data, "0")
    prior, val = tmp_path / "prior.json", tmp_path / "val.json"
    dataset = {"_component_": "pepo.tasks.datasets.load_math_dataset", "path": str(data)}
    cfg = tiny_cfg(tmp_path / "a", "tiny_spo", prior_cache=str(prior),
                   validation={"every": 1, "before_cache": str(val)})
    cfg.dataset = dataset  # in place of the generated one (a merge would keep its keys)
    ckpt = Path(cfg.checkpoint_dir)
    setup_recipe(cfg).cleanup()
    assert {"inputs.weights", "inputs.dataset"} <= set(
        json.loads(prior.read_text())["fingerprint"])
    assert _val_before(cfg, tmp_path / "v1") == (0.25, True)
    assert {"inputs.weights", "inputs.val_dataset"} <= set(
        json.loads(val.read_text())["fingerprint"])
    setup_recipe(OmegaConf.merge(cfg, {"output_dir": str(tmp_path / "b")})).cleanup()  # read
    assert _val_before(cfg, tmp_path / "v2") == (0.25, False)

    weights = ckpt / "model.safetensors"  # the same bytes written again: the same weights
    weights.write_bytes(weights.read_bytes())
    setup_recipe(OmegaConf.merge(cfg, {"output_dir": str(tmp_path / "c")})).cleanup()

    _write_problems(data, "7")  # one answer edited in place
    with pytest.raises(ValueError, match=r"prior_cache=.* other settings: inputs\.dataset "):
        setup_recipe(OmegaConf.merge(cfg, {"output_dir": str(tmp_path / "d")}))
    assert _val_before(cfg, tmp_path / "v3") == (0.25, False)  # the val set is not this file
    _write_problems(data, "0")

    _perturb_weights(ckpt)
    with pytest.raises(ValueError, match=r"other settings: inputs\.weights \("):
        setup_recipe(OmegaConf.merge(cfg, {"output_dir": str(tmp_path / "e")}))
    # the validation cache is checked in setup, before the prior's rollouts and any training
    computed = []
    real = pepo_recipe.PEPORecipe._prepare_estimator
    pepo_recipe.PEPORecipe._prepare_estimator = lambda self: computed.append(1) or real(self)
    try:
        with pytest.raises(ValueError, match=r"before_cache=.* other settings: inputs\.weights "):
            setup_recipe(OmegaConf.merge(cfg, {"output_dir": str(tmp_path / "v4"),
                                               "prior_cache": None}))
    finally:
        pepo_recipe.PEPORecipe._prepare_estimator = real
    assert computed == []


def test_a_cache_an_earlier_pepo_wrote_without_input_digests_is_still_read(tmp_path, caplog):
    """Files written before the digests were kept (every published study's caches) match on
    the settings they recorded; catches a refusal of each of them for ``inputs.*
    ('<unset>' -> ...)``, and a digest compared against a file that has one (the other test)."""
    path = tmp_path / "v.json"
    fp = {"seed": 3}
    path.write_text(json.dumps({"version": prior_cache.VERSION, "fingerprint": fp,
                                "value": 0.5}), encoding="utf-8")
    with_inputs = {**fp, "inputs.weights": "ab", "inputs.val_dataset": "cd"}
    with caplog.at_level("WARNING"):
        assert prior_cache.cached_value(str(path), with_inputs, lambda: 0.0) == (0.5, True)
    assert any("written by an earlier pepo" in m and "read unchecked" in m
               for m in caplog.messages)  # said once, not silently
    with pytest.raises(ValueError, match=r"seed \(3 -> 4\)"):
        prior_cache.cached_value(str(path), {**with_inputs, "seed": 4}, lambda: 0.0)
    path.write_text(json.dumps({"version": prior_cache.VERSION, "value": 0.5,
                                "fingerprint": {**fp, "inputs.weights": "ab"}}), encoding="utf-8")
    with pytest.raises(ValueError, match=r"inputs\.val_dataset \('<unset>' -> 'cd'\)"):
        prior_cache.cached_value(str(path), with_inputs, lambda: 0.0)


def test_a_cache_that_cannot_be_written_warns_and_keeps_the_computed_value(
        tmp_path, monkeypatch, caplog):
    """A write that fails after the work (a full disk, a directory gone) is a warning and the
    run goes on with what it computed. Catches the write's ``OSError`` raised out of the
    prior's minutes of rollouts (or the validation before training), losing them."""
    import logging

    def full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(prior_cache, "atomic_write_text", full)
    path = tmp_path / "v.json"
    with caplog.at_level(logging.WARNING):
        value, read = prior_cache.cached_value(str(path), {"seed": 0}, lambda: 0.25)
    assert (value, read) == (0.25, False) and not path.exists()
    assert "validation.before_cache=" in caplog.text and "No space left" in caplog.text
    monkeypatch.setattr(prior_cache, "write_prior", full)
    est = _Counting(2)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        outcome = prior_cache.prepare_estimator(
            est, ["a", "b"], lambda idx: torch.ones(len(idx)), path=str(tmp_path / "p.json"),
            fingerprint={"seed": 0})
    assert outcome is None and est.prior == {"a": 1.0, "b": 1.0}
    assert "prior_cache=" in caplog.text and "the run goes on" in caplog.text


def test_a_digest_of_problems_that_are_not_dataclasses_covers_their_answers():
    """Catches a digest of a custom dataset's problems (objects with ``id``,
    ``prompt`` and ``answer`` that are not :class:`pepo.tasks.problems.Problem`) that leaves
    the answers out: a data file whose answers were corrected in place would then read back the
    prior and validation made under the old answers."""
    import hashlib
    import json
    from types import SimpleNamespace

    from pepo.training.prior_cache import problems_digest

    rows = [SimpleNamespace(id="q0", prompt="What is 1 + 1?", answer="2"),
            SimpleNamespace(id="q1", prompt="What is 2 + 2?", answer="4")]
    edited = [rows[0], SimpleNamespace(id="q1", prompt="What is 2 + 2?", answer="5")]
    assert problems_digest(rows) != problems_digest(edited)
    h = hashlib.sha256()
    for r in rows:  # one JSON object a line, the three fields by name
        h.update((json.dumps({"answer": r.answer, "id": r.id, "prompt": r.prompt})
                  + "\n").encode("utf-8"))
    assert problems_digest(rows) == h.hexdigest()[:16]


def test_a_prior_file_that_names_a_prompt_twice_is_refused(tmp_path):
    """Catches a prior cache whose pass rates name one prompt twice (a file
    edited or merged by hand) read as the last of the two: it does not cover the dataset's
    prompts one for one."""
    path = tmp_path / "p.json"
    prior_cache.write_prior(path, {"seed": 0}, {"a": 0.5, "b": 1.0})
    data = json.loads(path.read_text())
    data["pass_rates"].append(["a", 0.0])
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="holds 2 prompts but the dataset has 2"):
        prior_cache.read_prior(path, {"seed": 0}, ["a", "b"])


def test_a_cache_file_of_another_format_version_is_refused(tmp_path):
    """Catches the version of a cache file left unchecked: a file of another
    format (or none) read as if it were this one's."""
    for version in (prior_cache.VERSION + 1, None):
        path = tmp_path / f"p{version}.json"
        prior_cache.write_prior(path, {"seed": 0}, {"a": 0.5})
        data = json.loads(path.read_text())
        data["version"] = version
        path.write_text(json.dumps(data))
        with pytest.raises(ValueError, match=r"is not a prior cache file \('version'\)"):
            prior_cache.read_prior(path, {"seed": 0}, ["a"])
        v = tmp_path / f"v{version}.json"
        prior_cache.cached_value(str(v), {"seed": 0}, lambda: 0.5)
        data = json.loads(v.read_text())
        data["version"] = version
        v.write_text(json.dumps(data))
        with pytest.raises(ValueError, match=r"is not a cached value file \('version'\)"):
            prior_cache.cached_value(str(v), {"seed": 0}, lambda: 0.5)


def test_an_earlier_pepos_cache_is_warned_of_once_per_file(tmp_path, caplog):
    """Setup checks a validation cache and then reads it: catches the warning
    about an unchecked earlier file given at every look (twice a run, and again each
    validation)."""
    path = tmp_path / "v.json"
    path.write_text(json.dumps({"version": prior_cache.VERSION, "fingerprint": {"seed": 3},
                                "value": 0.5}), encoding="utf-8")
    fp = {"seed": 3, "inputs.weights": "ab"}
    with caplog.at_level("WARNING"):
        for _ in range(3):
            assert prior_cache.cached_value(str(path), fp, lambda: 0.0) == (0.5, True)
    assert sum("written by an earlier pepo" in m for m in caplog.messages) == 1


def test_the_priors_progress_is_logged_each_tenth_with_the_true_count(tmp_path, caplog):
    """The offline prior's rollouts scored 2 at a time, 40 in all: catches
    a progress line at every call (not each tenth), and a count of calls for a count of
    rollouts (lines and the closing line's numbers wrong)."""
    import logging

    ids = [f"p{j}" for j in range(10)]

    class Chunked(_Counting):
        def prepare(self, ids, score):
            idx = [i for i in range(len(ids)) for _ in range(self.prior_samples)]
            rewards = torch.cat([score(idx[s:s + 2]) for s in range(0, len(idx), 2)])
            self.prior = {pid: float(rewards[j * 4:(j + 1) * 4].mean())
                          for j, pid in enumerate(ids)}
            return self.prior

    log = logging.getLogger("test_prior_progress")
    with caplog.at_level(logging.INFO, logger="test_prior_progress"):
        prior_cache.prepare_estimator(Chunked(4), ids, lambda idx: torch.tensor(
            [float(i % 2) for i in idx]), path=str(tmp_path / "p.json"), log=log)
    lines = [m for m in caplog.messages if m.startswith("  prior: ")]
    # a line each tenth (every second call): 4, 8, ..., 36 of 40; 40 is the closing line's
    assert [m.split(" rollouts")[0] for m in lines] == [
        f"  prior: {n}/40" for n in range(4, 40, 4)]
    done = [m for m in caplog.messages if "prepared on" in m]
    # rewards: index i's 4 rollouts each score i % 2, so half the prompts score 1
    assert len(done) == 1 and "prepared on 40 rollouts of 10 prompts, mean reward 0.500" in done[0]


def test_every_rank_takes_rank_0s_prior(tmp_path):
    """Rank 1 never looks at the file (rank 0 holds the lock and reads it): it
    must take rank 0's answer from the gather. Catches a rank taking its own (None) and
    computing the prior alone while rank 0 reads it (its collective rollouts then wait for
    ranks that never join), or the reverse."""
    import types

    rates = {"a": 0.25, "b": 0.75}
    rank1 = types.SimpleNamespace(is_main=False, enabled=True, timeout_s=60,
                                  gather_objects=lambda mine: [rates, mine])
    est = _Counting(2)
    assert prior_cache.prepare_estimator(
        est, ["a", "b"], lambda idx: pytest.fail("rank 1 computed the prior"),
        path=str(tmp_path / "nowhere.json"), fingerprint={"seed": 0}, dist=rank1) == "read"
    assert est.prior == rates and est.prepared == 0
    assert not (tmp_path / "nowhere.json").exists()  # only rank 0 writes or reads


def test_bool_prompt_ids_are_refused_by_write_prior(tmp_path):
    """``True`` is an int to ``isinstance`` but not a prompt id (it is the id
    ``1`` to a dict, and ``true`` in the file): catches it written."""
    with pytest.raises(ValueError, match="str or int prompt ids only, got True"):
        prior_cache.write_prior(tmp_path / "p.json", {}, {True: 0.5})
    assert not (tmp_path / "p.json").exists()
