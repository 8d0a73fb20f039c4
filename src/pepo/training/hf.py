"""Hugging Face checkpoints ↔ torchtune models (Qwen3 and Llama 3.x).

* :func:`from_hf` reads a local checkpoint directory (``config.json`` plus ``model.safetensors``
  or sharded ``model-*.safetensors`` with ``model.safetensors.index.json``) and returns the
  torchtune decoder with the weights loaded.
* :func:`save_hf` writes a model back in Hugging Face's layout, which ``transformers`` loads.

``config.json`` is read both as the published checkpoints have it (``rope_theta``,
``rope_scaling``) and as transformers 5.x writes it (``rope_parameters``).

Qwen3 uses :func:`pepo.training.models.qwen3` (rotate-half RoPE, so no weight permutation; q/k norms
under ``q_proj.norm``/``k_proj.norm``). Llama uses torchtune's ``llama3_2`` builder, whose
interleaved RoPE needs torchtune's q/k permutation (``torchtune.models.convert_weights``).
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import torch
from safetensors.torch import load_file, save_file
from torchtune.models import convert_weights
from torchtune.modules import TransformerDecoder

from pepo.training.files import follow_umask, fsync_dir, write_durably
from pepo.training.models import check_state_matches

__all__ = [
    "architecture_from_hf",
    "from_hf",
    "hf_config_of",
    "hf_to_tune_state",
    "is_hf_state",
    "load_hf_config",
    "load_hf_state",
    "prompt_differences",
    "read_safetensors",
    "read_tune_state",
    "save_hf",
    "tune_to_hf_state",
]

SUPPORTED = ("qwen3", "llama")


def load_hf_config(model_dir: Union[str, Path]) -> dict[str, Any]:
    """``config.json`` of ``model_dir``, with ``rope_theta`` / ``rope_scaling`` normalised.

    Raises:
        ValueError: no config.json, or an architecture other than Qwen3 / Llama.
    """
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"model_dir={str(model_dir)!r} has no config.json")
    cfg = json.loads(path.read_text(encoding="utf-8"))
    if cfg.get("model_type") not in SUPPORTED:
        raise ValueError(
            f"{path}: model_type={cfg.get('model_type')!r} is not supported; supported: "
            f"{list(SUPPORTED)}"
        )
    rope = cfg.get("rope_parameters") or {}
    theta = cfg.get("rope_theta", rope.get("rope_theta"))
    if theta is None:
        raise ValueError(f"{path} gives no rope_theta (nor rope_parameters.rope_theta)")
    scaling = cfg.get("rope_scaling")
    if scaling is None and rope.get("rope_type", "default") != "default":
        scaling = rope
    if isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type")) == "default":
        scaling = None  # spelled out: no scaling
    cfg["rope_theta"] = float(theta)
    cfg["rope_scaling"] = scaling
    return cfg


def _head_dim(cfg: dict[str, Any]) -> int:
    """The config's ``head_dim``, or transformers' default where it has none (128 for Qwen3,
    ``hidden_size / num_attention_heads`` for Llama)."""
    if cfg.get("head_dim"):
        return cfg["head_dim"]
    if cfg.get("model_type") == "qwen3":
        return 128
    return cfg["hidden_size"] // cfg["num_attention_heads"]


def architecture_from_hf(
    model_dir: Union[str, Path], max_seq_len: Optional[int] = None
) -> TransformerDecoder:
    """The torchtune decoder described by ``model_dir/config.json``, randomly initialised.

    Args:
        model_dir: checkpoint directory.
        max_seq_len: longest sequence the model will see (RoPE cache); the config's
            ``max_position_embeddings`` when None.
    """
    cfg = load_hf_config(model_dir)
    seq = max_seq_len or cfg["max_position_embeddings"]
    tied = bool(cfg.get("tie_word_embeddings", False))
    scaling = cfg["rope_scaling"]
    if cfg["model_type"] == "qwen3":
        if scaling not in (None, {}) and scaling.get("rope_type", scaling.get("type")) != "default":
            raise ValueError(f"Qwen3 rope_scaling {scaling} is not supported (only default RoPE)")
        from pepo.training.models import qwen3

        return qwen3(
            vocab_size=cfg["vocab_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=cfg["num_attention_heads"],
            num_kv_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
            embed_dim=cfg["hidden_size"],
            intermediate_dim=cfg["intermediate_size"],
            max_seq_len=seq,
            head_dim=_head_dim(cfg),
            norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_base=cfg["rope_theta"],
            tie_word_embeddings=tied,
        )
    from torchtune.models.llama3_2 import llama3_2

    if _head_dim(cfg) != cfg["hidden_size"] // cfg["num_attention_heads"]:
        raise ValueError(
            "Llama with head_dim != hidden_size / num_attention_heads is not supported")
    factor = 1
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type"))
        expected = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 8192}
        if kind != "llama3" or any(float(scaling.get(k, v)) != v for k, v in expected.items()):
            raise ValueError(
                f"Llama rope_scaling {scaling} is not supported: torchtune's Llama 3 RoPE "
                f"needs rope_type='llama3' with {expected}"
            )
        factor = scaling["factor"]
    return llama3_2(
        vocab_size=cfg["vocab_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=cfg["num_attention_heads"],
        num_kv_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
        embed_dim=cfg["hidden_size"],
        max_seq_len=seq,
        rope_base=cfg["rope_theta"],
        intermediate_dim=cfg["intermediate_size"],
        norm_eps=cfg.get("rms_norm_eps", 1e-6),  # LlamaConfig's default
        scale_factor=factor,
        tie_word_embeddings=tied,
    )


def read_safetensors(path: Union[str, Path]) -> dict[str, torch.Tensor]:
    """All tensors of one safetensors file.

    Raises:
        ValueError: the file is empty, truncated or not safetensors (naming it and the reason),
            instead of safetensors' own error from deep inside the load.
    """
    from safetensors import SafetensorError

    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as e:
        size = Path(path).stat().st_size if Path(path).is_file() else 0
        raise ValueError(
            f"{path} is not a readable safetensors file ({size} bytes: {e}); it is empty, "
            f"truncated or of another format"
        ) from None


def load_hf_state(model_dir: Union[str, Path]) -> dict[str, torch.Tensor]:
    """All tensors of a (possibly sharded) safetensors checkpoint, with HF key names."""
    d = Path(model_dir)
    index = d / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"]
                               .values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{index} is not a safetensors index (a JSON object whose "
                             f"weight_map maps each tensor to its file): {type(e).__name__}: "
                             f"{e}") from None
    elif (d / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise ValueError(
            f"model_dir={str(model_dir)!r} has neither model.safetensors nor "
            f"model.safetensors.index.json"
        )
    state: dict[str, torch.Tensor] = {}
    for f in files:
        if not (d / f).is_file():
            raise ValueError(f"{index} names {f}, which is missing")
        state.update(read_safetensors(d / f))
    return state


# torchtune's Llama mapping, with Qwen3's q/k norms and pepo's HeadNormProjection names
_QWEN3_FROM_HF = {
    **convert_weights._FROM_HF,
    "model.layers.{}.self_attn.q_proj.weight": "layers.{}.attn.q_proj.linear.weight",
    "model.layers.{}.self_attn.k_proj.weight": "layers.{}.attn.k_proj.linear.weight",
    "model.layers.{}.self_attn.q_norm.weight": "layers.{}.attn.q_proj.norm.scale",
    "model.layers.{}.self_attn.k_norm.weight": "layers.{}.attn.k_proj.norm.scale",
}
_QWEN3_TO_HF = {v: k for k, v in _QWEN3_FROM_HF.items() if v is not None}


def _map_key(key: str, mapping: dict[str, str]) -> str:
    m = re.search(r"\.(\d+)\.", key)
    if m:
        abstract = key.replace(m.group(0), ".{}.", 1)
        if abstract in mapping:
            return mapping[abstract].format(m.group(1))
    if key in mapping:
        return mapping[key]
    raise ValueError(f"unexpected checkpoint key {key!r}")


def read_tune_state(model_dir: Union[str, Path]) -> dict[str, torch.Tensor]:
    """The weights of an HF checkpoint directory under torchtune's key names (converted, and for
    Llama permuted, unless they are torchtune's already)."""
    cfg = load_hf_config(model_dir)
    state = load_hf_state(model_dir)
    return hf_to_tune_state(state, cfg) if is_hf_state(state) else state


def is_hf_state(state: dict[str, torch.Tensor]) -> bool:
    """True when the keys are Hugging Face's (``model.…`` / ``lm_head.…``)."""
    return any(k.startswith(("model.", "lm_head.")) for k in state)


def hf_to_tune_state(state: dict[str, torch.Tensor],
                     cfg: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Renames (and for Llama permutes) an HF state dict into torchtune's keys."""
    heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads") or heads
    tied = bool(cfg.get("tie_word_embeddings", False))
    state = {k: v for k, v in state.items() if "rotary_emb.inv_freq" not in k}
    if tied:
        state.pop("lm_head.weight", None)  # tied: the embedding is the head
    if cfg["model_type"] == "llama":
        return convert_weights.hf_to_tune(state, num_heads=heads, num_kv_heads=kv,
                                          dim=cfg["hidden_size"], head_dim=_head_dim(cfg))
    return {_map_key(k, _QWEN3_FROM_HF): v for k, v in state.items()}


def tune_to_hf_state(state: dict[str, torch.Tensor],
                     cfg: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The inverse of :func:`hf_to_tune_state`."""
    heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads") or heads
    if cfg["model_type"] == "llama":
        return convert_weights.tune_to_hf(dict(state), num_heads=heads, num_kv_heads=kv,
                                          dim=cfg["hidden_size"], head_dim=_head_dim(cfg))
    return {_map_key(k, _QWEN3_TO_HF): v for k, v in state.items()}


def from_hf(
    model_dir: Union[str, Path],
    dtype: Union[str, torch.dtype] = torch.float32,
    max_seq_len: Optional[int] = None,
) -> TransformerDecoder:
    """Builds the torchtune model of a local HF checkpoint and loads its weights.

    Args:
        model_dir: directory with ``config.json`` and the safetensors weights.
        dtype: parameter dtype (``torch.bfloat16`` or ``"bf16"`` for training on GPUs).
        max_seq_len: RoPE cache length; the config's ``max_position_embeddings`` when None.

    Returns:
        The model; its forward gives logits ``[b, s, vocab_size]``.
    """
    if isinstance(dtype, str):
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "float32": torch.float32,
                 "bfloat16": torch.bfloat16}[dtype]
    model = architecture_from_hf(model_dir, max_seq_len=max_seq_len)
    state = read_tune_state(model_dir)
    check_state_matches(model, state, model_dir)
    model.load_state_dict(state)
    return model.to(dtype)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "chat_template.jinja")
PROMPT_FILE = "pepo_prompt.json"  # the chat template's settings training rendered prompts with


def prompt_differences(tokenizer: Any, model_dir: Union[str, Path]) -> Optional[str]:
    """One line saying how ``tokenizer`` (a :class:`pepo.training.tokenizers.ChatTokenizer`)
    renders prompts otherwise than the training that exported ``model_dir`` did, as its
    ``pepo_prompt.json`` records, with the overrides that render them alike; None where they
    agree, where there is no record, or for another tokenizer."""
    path = Path(model_dir) / PROMPT_FILE
    if not hasattr(tokenizer, "enable_thinking") or not path.is_file():
        return None
    try:
        recorded = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        return f"{path} cannot be read ({e}): prompts may be rendered otherwise than in training"
    keys = [k for k in ("enable_thinking", "system_prompt", "date_string")
            if isinstance(recorded, dict) and k in recorded
            and recorded[k] != getattr(tokenizer, k, None)]
    if not keys:
        return None
    if hasattr(tokenizer, "encode_prompt"):  # a setting the template ignores is no difference
        trained = copy.copy(tokenizer)  # (Llama's enable_thinking, "" or None)
        for k in keys:
            setattr(trained, k, recorded[k])
        probe = "What is 1 + 1?"
        try:
            if trained.encode_prompt(probe) == tokenizer.encode_prompt(probe):
                return None
        except Exception:  # a template that refuses the recorded settings: they differ
            pass
    here = ", ".join(f"{k}={getattr(tokenizer, k, None)!r}" for k in keys)
    fix = " ".join(f"tokenizer.{k}={json.dumps(recorded[k])}" for k in keys)
    return (f"{path} records that training rendered its prompts otherwise than this tokenizer "
            f"({here}): {fix} asks as training did")


def save_hf(
    model: Union[torch.nn.Module, dict[str, torch.Tensor]],
    out_dir: Union[str, Path],
    source_dir: Union[str, Path],
    tokenizer: Any = None,
    stop_tokens: Sequence[int] = (),
) -> Path:
    """Writes ``model`` (a module or its full state dict, torchtune key names) as an HF
    checkpoint: ``source_dir``'s config.json and model.safetensors.

    Tokenizer and generation files are copied along (the tokenizer's from ``tokenizer.path``
    when a :class:`pepo.training.tokenizers.ChatTokenizer` is given, else from
    ``source_dir``), so ``out_dir`` loads with ``AutoModelForCausalLM.from_pretrained`` and
    ``AutoTokenizer.from_pretrained``. ``generation_config.json`` stops on every token training
    stopped on (``stop_tokens``, added to its ``eos_token_id``), and with a ``ChatTokenizer``
    ``pepo_prompt.json`` records how training rendered prompts (``enable_thinking``,
    ``system_prompt``, ``date_string``), which ``apply_chat_template`` must be given to render
    them the same way.

    The directory is written whole beside ``out_dir``, fsynced, and renamed into place: an
    interrupted or failed export leaves no ``out_dir`` that looks complete (an earlier one is
    replaced only once the new one is written).
    """
    cfg = load_hf_config(source_dir)
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    sd = model.state_dict() if isinstance(model, torch.nn.Module) else model
    state = {k: v.detach().contiguous().cpu() for k, v in sd.items()}
    hf = tune_to_hf_state(state, cfg)
    if cfg.get("tie_word_embeddings"):
        hf.pop("lm_head.weight", None)
    for stale in out.parent.glob(f".tmp_{out.name}_*"):  # left by an interrupted export
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp_{out.name}_", dir=out.parent))
    try:
        follow_umask(tmp)
        write_durably(tmp / "model.safetensors",
                    lambda p: save_file(hf, str(p), metadata={"format": "pt"}))
        write_durably(tmp / "config.json", lambda p: p.write_text(
            json.dumps(_config_for(Path(source_dir) / "config.json", hf), indent=2) + "\n",
            encoding="utf-8"))
        words = Path(getattr(tokenizer, "path", None) or source_dir)
        for name in TOKENIZER_FILES:
            if (words / name).is_file():
                write_durably(tmp / name, lambda p, n=name: shutil.copy2(words / n, p))
        source_gen = Path(source_dir) / "generation_config.json"
        generation = _generation_config(source_gen, stop_tokens)
        if generation is not None:
            write_durably(tmp / source_gen.name, lambda p: p.write_text(
                json.dumps(generation, indent=2) + "\n", encoding="utf-8"))
        elif source_gen.is_file():  # as it is
            write_durably(tmp / source_gen.name, lambda p: shutil.copy2(source_gen, p))
        if hasattr(tokenizer, "enable_thinking"):
            prompt = {k: getattr(tokenizer, k, None)
                      for k in ("enable_thinking", "system_prompt", "date_string")}
            write_durably(tmp / PROMPT_FILE, lambda p: p.write_text(
                json.dumps(prompt, indent=2) + "\n", encoding="utf-8"))
        follow_umask(tmp / "model.safetensors")
        fsync_dir(tmp)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
        fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _generation_config(path: Path, stop_tokens: Sequence[int]) -> Optional[dict[str, Any]]:
    """The generation config at ``path`` (or none) with every one of ``stop_tokens`` in its
    ``eos_token_id``; None where they are there already (the file is copied as it is)."""
    cfg = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    eos = cfg.get("eos_token_id")
    eos = [] if eos is None else eos if isinstance(eos, list) else [eos]
    stops = list(dict.fromkeys([*eos, *(int(t) for t in stop_tokens)]))
    if stops == eos:
        return None
    cfg["eos_token_id"] = stops
    return cfg


def _config_for(source: Path, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """``source``'s config.json with its dtype (``dtype``, and ``torch_dtype`` where it has one)
    that of the ``tensors`` written beside it: a model trained in fp32 from a bf16 checkpoint
    would otherwise load in bf16 (``from_pretrained``'s ``dtype="auto"``, vLLM's ``auto``)."""
    cfg = json.loads(source.read_text(encoding="utf-8"))
    floating = {t.dtype for t in tensors.values() if t.is_floating_point()}
    if len(floating) == 1:
        name = str(floating.pop()).removeprefix("torch.")
        cfg["dtype"] = name
        if "torch_dtype" in cfg:
            cfg["torch_dtype"] = name
    return cfg


def hf_config_of(model: TransformerDecoder) -> dict[str, Any]:
    """A Hugging Face ``config.json`` (as a dict) describing a
    :func:`pepo.training.models.qwen3` model, read off its modules, for tools that need one (a
    vLLM engine for a model that was not loaded from a Hugging Face checkpoint).

    Raises:
        ValueError: the model is not a ``pepo.training.models.qwen3`` decoder (other
            architectures carry settings, such as Llama's RoPE scaling, that the modules do not
            show: use their checkpoint's config.json).
    """
    from torchtune.modules import TiedLinear

    from pepo.training.models import HeadNormProjection

    attn = model.layers[0].attn
    if not isinstance(attn.q_proj, HeadNormProjection):
        raise ValueError("hf_config_of reads pepo.training.models.qwen3 decoders only; pass the "
                         "checkpoint's config.json for other architectures")
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": model.tok_embeddings.num_embeddings,
        "hidden_size": attn.embed_dim,
        "intermediate_size": model.layers[0].mlp.w1.out_features,
        "num_hidden_layers": len(model.layers),
        "num_attention_heads": attn.num_heads,
        "num_key_value_heads": attn.num_kv_heads,
        "head_dim": attn.head_dim,
        "max_position_embeddings": model.max_seq_len,
        "rms_norm_eps": model.norm.eps,
        "rope_theta": float(attn.pos_embeddings.base),
        "rope_scaling": None,
        "tie_word_embeddings": isinstance(model.output, TiedLinear),
        "hidden_act": "silu",
        "attention_bias": False,
        "torch_dtype": "float32",
    }
