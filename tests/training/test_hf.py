"""Parity with transformers: tiny random Qwen3 and Llama 3.2 checkpoints built and saved here."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from pepo.training.hf import from_hf, load_hf_config, save_hf


def randomise(model):
    with torch.no_grad():  # random norms too: a q/k-norm-vs-RoPE ordering bug hides behind ones
        for name, p in model.named_parameters():
            p.copy_(1 + 0.3 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))


def qwen3_dir(tmp_path, tied=True, eps=1e-6):
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(
        vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,  # 4 x 16 != 48
        max_position_embeddings=256, rope_theta=1_000_000.0, tie_word_embeddings=tied,
        rms_norm_eps=eps,
    )
    m = transformers.Qwen3ForCausalLM(cfg).eval()
    randomise(m)
    m.save_pretrained(tmp_path)
    return m


def llama_dir(tmp_path):
    torch.manual_seed(1)
    cfg = transformers.LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rope_theta=500_000.0, tie_word_embeddings=True, rms_norm_eps=1e-5,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    )
    m = transformers.LlamaForCausalLM(cfg).eval()
    randomise(m)
    m.save_pretrained(tmp_path)
    return m


TOKENS = torch.randint(0, 96, (2, 37), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("build", [qwen3_dir, lambda p: qwen3_dir(p, tied=False),
                                   lambda p: qwen3_dir(p, eps=1e-3), llama_dir],
                         ids=["qwen3-tied", "qwen3-untied", "qwen3-eps", "llama3.2"])
def test_logits_match_transformers(tmp_path, build):
    """The models of both architectures give transformers' logits (qwen3-eps: catches the
    config's ``rms_norm_eps`` not passed to the Qwen3 builder, whose default is Qwen3's)."""
    hf = build(tmp_path)
    ours = from_hf(tmp_path)
    with torch.no_grad():
        ref = hf(TOKENS).logits
        got = ours(TOKENS)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("build", [qwen3_dir, llama_dir], ids=["qwen3", "llama3.2"])
def test_save_hf_round_trips_through_transformers(tmp_path, build):
    build(tmp_path / "src")
    ours = from_hf(tmp_path / "src")
    with torch.no_grad():
        for p in ours.parameters():  # a trained model differs from its source
            p.add_(0.01 * torch.randn_like(p))
    save_hf(ours, tmp_path / "out", source_dir=tmp_path / "src")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        torch.testing.assert_close(back(TOKENS).logits, ours(TOKENS), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("source, trained", [(torch.bfloat16, "fp32"), (torch.float32, "bf16")])
def test_the_export_loads_at_the_dtype_it_was_trained_in(tmp_path, source, trained):
    """A model trained in fp32 from a bf16 checkpoint: config.json said bfloat16 (the source's)
    over fp32 tensors, so from_pretrained's dtype="auto" loaded it in bf16, 4e-3 off the
    trained model's logits; and the reverse. Catches config.json copied unchanged."""
    hf = qwen3_dir(tmp_path / "src")
    hf.to(source).save_pretrained(tmp_path / "src")
    ours = from_hf(tmp_path / "src", dtype=trained)
    save_hf(ours, tmp_path / "out", source_dir=tmp_path / "src")
    want = {"fp32": torch.float32, "bf16": torch.bfloat16}[trained]
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert back.dtype == want
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["dtype"] == str(want).removeprefix("torch.")
    assert {k: v for k, v in cfg.items() if k != "dtype"} == {
        k: v for k, v in json.loads((tmp_path / "src" / "config.json").read_text()).items()
        if k != "dtype"}  # the rest as the source's


def test_an_interrupted_export_leaves_the_earlier_one_or_none(tmp_path, monkeypatch):
    """Catches an export written in place: a failure after the weights (here, copying the
    config) left a complete-looking ``out`` with the new weights and no config, or a truncated
    one; now ``out`` is the earlier export, whole, and no temporary directory stays."""
    import pepo.training.hf as hf_mod

    qwen3_dir(tmp_path / "src")
    ours = from_hf(tmp_path / "src")
    out = tmp_path / "out"
    save_hf(ours, out, source_dir=tmp_path / "src")
    first = (out / "model.safetensors").read_bytes()
    with torch.no_grad():
        for p in ours.parameters():
            p.add_(1.0)

    def failing(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(hf_mod.shutil, "copy2", failing)
    with pytest.raises(OSError, match="No space left"):
        save_hf(ours, out, source_dir=tmp_path / "src")
    assert (out / "model.safetensors").read_bytes() == first and (out / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]
    monkeypatch.undo()
    save_hf(ours, out, source_dir=tmp_path / "src")  # the next export replaces it whole
    assert (out / "model.safetensors").read_bytes() != first


def test_the_export_stops_and_prompts_as_training_did(tmp_path):
    """hf_model/ copied checkpoint_dir's tokenizer and generation_config.json unchanged: a
    tokenizer.path elsewhere, generation.stop_tokens and the template's settings training used
    (enable_thinking off, a system prompt) were lost, so the export prompted and stopped
    otherwise. Now: the tokenizer's own files, every training stop token in eos_token_id, and
    pepo_prompt.json, whose settings render the training prompt's ids with apply_chat_template.
    Catches the source's files copied, the stop tokens dropped, and a record that differs."""
    from pepo.training.tokenizers import ChatTokenizer, stop_token_ids
    from tests.hf_fixtures import build_tokenizer

    qwen3_dir(tmp_path / "src")
    (tmp_path / "src" / "chat_template.jinja").write_text("{{ 'not the template' }}")
    build_tokenizer(tmp_path / "tok")
    tok = ChatTokenizer(tmp_path / "tok", enable_thinking=False, system_prompt="Be brief.")
    stops = stop_token_ids(tok, ["<|im_start|>"])
    save_hf(from_hf(tmp_path / "src"), tmp_path / "out", source_dir=tmp_path / "src",
            tokenizer=tok, stop_tokens=stops)
    gen = json.loads((tmp_path / "out" / "generation_config.json").read_text())
    source = json.loads((tmp_path / "src" / "generation_config.json").read_text())
    assert set(stops) <= set(gen["eos_token_id"]) and len(set(stops)) > 1
    assert {k: v for k, v in gen.items() if k != "eos_token_id"} == {
        k: v for k, v in source.items() if k != "eos_token_id"}
    prompt = json.loads((tmp_path / "out" / "pepo_prompt.json").read_text())
    assert prompt == {"enable_thinking": False, "system_prompt": "Be brief.",
                      "date_string": "26 Jul 2024"}
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    ids = hf_tok.apply_chat_template(
        [{"role": "system", "content": prompt["system_prompt"]},
         {"role": "user", "content": "What is 2+3?"}], tokenize=True,
        add_generation_prompt=True, enable_thinking=prompt["enable_thinking"],
        return_dict=False)
    assert list(ids) == tok.encode_prompt("What is 2+3?")
    save_hf(from_hf(tmp_path / "src"), tmp_path / "plain", source_dir=tmp_path / "src")
    assert (tmp_path / "plain" / "generation_config.json").read_bytes() == (
        tmp_path / "src" / "generation_config.json").read_bytes()  # no stop tokens: as it was
    assert not (tmp_path / "plain" / "pepo_prompt.json").exists()


def test_published_config_layout_is_read(tmp_path):
    qwen3_dir(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    theta = (cfg.pop("rope_parameters", None) or {}).get("rope_theta", 1_000_000.0)
    cfg["rope_theta"], cfg["rope_scaling"] = theta, None  # as Qwen/Qwen3-4B's config.json has it
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert load_hf_config(tmp_path)["rope_theta"] == 1_000_000.0
    hf = transformers.Qwen3ForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(
            from_hf(tmp_path)(TOKENS), hf(TOKENS).logits, rtol=1e-4, atol=1e-4
        )


def test_sharded_checkpoint(tmp_path):
    hf = qwen3_dir(tmp_path / "one")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    with torch.no_grad():
        torch.testing.assert_close(from_hf(tmp_path / "sharded")(TOKENS), hf(TOKENS).logits,
                                   rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("spelled", [{"rope_type": "default"}, {"type": "default"}])
def test_a_llama_config_spelling_out_default_rope_is_read(tmp_path, spelled):
    """Older transformers write ``rope_scaling: {"rope_type": "default"}`` (no scaling): catches
    the Llama path refusing it (it accepted only llama3 scaling) while Qwen3's took it."""
    torch.manual_seed(2)
    cfg = transformers.LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rope_theta=10_000.0, tie_word_embeddings=True, rms_norm_eps=1e-5)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    randomise(hf)
    hf.save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    written.pop("rope_parameters", None)
    written["rope_theta"], written["rope_scaling"] = 10_000.0, spelled
    (tmp_path / "config.json").write_text(json.dumps(written))
    with torch.no_grad():
        torch.testing.assert_close(from_hf(tmp_path)(TOKENS), hf(TOKENS).logits,
                                   rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("index", ['{"metadata": {}}', "[]", "not json", '{"weight_map": 3}'])
def test_a_broken_shard_index_is_one_error_naming_it(tmp_path, index):
    """Catches a ``KeyError: 'weight_map'`` (or a JSON traceback) from a bad index file."""
    from pepo.training.hf import load_hf_state

    (tmp_path / "model.safetensors.index.json").write_text(index)
    with pytest.raises(ValueError, match=r"model.safetensors.index.json is not a safetensors "
                                         r"index"):
        load_hf_state(tmp_path)


def test_errors_name_the_problem(tmp_path):
    with pytest.raises(ValueError, match="has no config.json"):
        from_hf(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="model_type='gpt2' is not supported"):
        from_hf(tmp_path)


@pytest.mark.parametrize(
    "content", [b"", b'\x08\x00\x00\x00\x00\x00\x00\x00{"a":1', b"not safetensors at all"]
)
def test_an_unreadable_weights_file_is_one_value_error_naming_it(tmp_path, content):
    from pepo.training.models import tiny_qwen3
    from pepo.training.weights import load_model_weights

    (tmp_path / "model.safetensors").write_bytes(content)
    with pytest.raises(ValueError, match=r"model\.safetensors is not a readable safetensors file "
                                         rf"\({len(content)} bytes"):
        load_model_weights(tiny_qwen3(), tmp_path)


@pytest.mark.parametrize("build, field", [(llama_dir, "rms_norm_eps"), (qwen3_dir, "head_dim")])
def test_a_field_the_config_leaves_out_takes_transformers_default(tmp_path, build, field):
    """A config.json without rms_norm_eps (Llama: 1e-6) or head_dim (Qwen3: 128, not hidden /
    heads) is read with transformers' defaults: catches pepo's own (1e-5; 64 / 2 = 32)."""
    build(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    if field == "head_dim":  # a model of Qwen3's default head_dim, its config without it
        cfg.update(hidden_size=64, num_attention_heads=2, num_key_value_heads=1)
        cfg.pop("head_dim")
        (tmp_path / "config.json").write_text(json.dumps(cfg))
        torch.manual_seed(2)
        hf = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.from_pretrained(tmp_path)).eval()
        assert hf.model.layers[0].self_attn.q_proj.weight.shape == (2 * 128, 64)
        randomise(hf)
        hf.save_pretrained(tmp_path / "b")
        (tmp_path / "b" / "config.json").write_text(json.dumps(cfg))
        tmp_path = tmp_path / "b"
    else:
        cfg.pop(field)
        (tmp_path / "config.json").write_text(json.dumps(cfg))
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ours = from_hf(tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(ours(TOKENS), ref(TOKENS).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_the_config_read_off_a_model_builds_the_same_model_in_transformers(tmp_path, tied):
    """``hf_config_of`` is the config a vLLM engine is built from for a model not loaded from a
    checkpoint: transformers built from it, with the model's weights, gives the model's logits.
    Built with no setting at its default (heads of 20, not 64 / 4 = 16; GQA; eps 1e-5; RoPE base
    10,000), so each field read off the wrong module, or written as a constant, shows: catches
    the head size as embed_dim / num_heads, the kv heads as the query heads, the norm's eps or
    the RoPE base as a default, the tie lost."""
    from safetensors.torch import save_file

    from pepo.training.hf import hf_config_of, tune_to_hf_state
    from pepo.training.models import qwen3

    torch.manual_seed(0)
    model = qwen3(vocab_size=96, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=64,
                  intermediate_dim=72, max_seq_len=64, head_dim=20, norm_eps=1e-5,
                  rope_base=10_000.0, tie_word_embeddings=tied).eval()
    randomise(model)
    cfg = hf_config_of(model)
    assert (cfg["head_dim"], cfg["num_key_value_heads"], cfg["intermediate_size"]) == (20, 2, 72)
    assert (cfg["rms_norm_eps"], cfg["rope_theta"], cfg["tie_word_embeddings"]) == (
        1e-5, 10_000.0, tied)
    (tmp_path / "config.json").write_text(json.dumps(cfg), encoding="utf-8")
    state = tune_to_hf_state({k: v.contiguous() for k, v in model.state_dict().items()}, cfg)
    if tied:
        state.pop("lm_head.weight", None)
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    tokens = TOKENS[:, :30]
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, model(tokens), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="reads pepo.training.models.qwen3 decoders only"):
        hf_config_of(_torchtune_llama())


def _torchtune_llama():
    from torchtune.models.llama3_2 import llama3_2

    return llama3_2(vocab_size=96, num_layers=1, num_heads=4, num_kv_heads=2, embed_dim=64,
                    max_seq_len=64, intermediate_dim=72)


def test_a_tied_checkpoint_that_stores_its_head_loads(tmp_path):
    """Some tied checkpoints store ``lm_head.weight`` beside the embedding (a copy of it):
    catches it kept as a key the tied model has no place for (a state mismatch)."""
    from safetensors.torch import load_file, save_file

    hf = qwen3_dir(tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    assert "lm_head.weight" not in state  # transformers leaves it out: added here
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with torch.no_grad():
        torch.testing.assert_close(from_hf(tmp_path)(TOKENS), hf(TOKENS).logits, rtol=1e-4,
                                   atol=1e-4)


def test_max_seq_len_sets_the_rope_cache_over_the_configs_length(tmp_path):
    """Catches ``max_seq_len`` ignored for the config's ``max_position_embeddings`` (256): a
    model asked for 320 positions runs a sequence of 300 tokens, and one asked for 64 is built
    for 64 (the RoPE cache the trainer sizes to its prompt and response lengths)."""
    qwen3_dir(tmp_path)
    long = torch.randint(0, 96, (1, 300), generator=torch.Generator().manual_seed(1))
    model = from_hf(tmp_path, max_seq_len=320)
    assert model.max_seq_len == 320
    with torch.no_grad():
        assert model(long).shape == (1, 300, 96)
    assert from_hf(tmp_path, max_seq_len=64).max_seq_len == 64
    assert from_hf(tmp_path).max_seq_len == 256


@pytest.mark.parametrize("eos, stops, want", [(7, [5], [7, 5]), ([2, 7], [7, 5, 5], [2, 7, 5]),
                                              (None, [5], [5])])
def test_the_exports_stop_tokens_keep_the_sources_eos_first(tmp_path, eos, stops, want):
    """``eos_token_id`` of the export: the source's own stop tokens, then each of training's
    not among them, once. Catches the source's eos replaced by training's stop tokens (a model
    that stopped on ``<|endoftext|>`` would no longer), or a stop token listed twice."""
    qwen3_dir(tmp_path / "src")
    (tmp_path / "src" / "generation_config.json").write_text(
        json.dumps({"eos_token_id": eos, "temperature": 0.6}), encoding="utf-8")
    save_hf(from_hf(tmp_path / "src"), tmp_path / "out", source_dir=tmp_path / "src",
            stop_tokens=stops)
    gen = json.loads((tmp_path / "out" / "generation_config.json").read_text(encoding="utf-8"))
    assert gen == {"eos_token_id": want, "temperature": 0.6}


def test_an_older_configs_torch_dtype_is_the_exports_dtype_too(tmp_path):
    """A config.json written by transformers 4.x says ``torch_dtype`` (which older readers of
    the export go by): catches only ``dtype`` set, ``torch_dtype`` left at the source's bf16
    over fp32 tensors."""
    qwen3_dir(tmp_path / "src")
    cfg = json.loads((tmp_path / "src" / "config.json").read_text(encoding="utf-8"))
    cfg["torch_dtype"] = cfg["dtype"] = "bfloat16"
    (tmp_path / "src" / "config.json").write_text(json.dumps(cfg), encoding="utf-8")
    save_hf(from_hf(tmp_path / "src", dtype="fp32"), tmp_path / "out",
            source_dir=tmp_path / "src")
    out = json.loads((tmp_path / "out" / "config.json").read_text(encoding="utf-8"))
    assert (out["dtype"], out["torch_dtype"]) == ("float32", "float32")
