"""A tiny Llama written as a GGUF file the way llama.cpp's converter writes SmolLM2's: byte-level
BPE vocabulary (``tokenizer.ggml.model = gpt2``) with a ChatML template, q/k rows in llama.cpp's
RoPE order, 2-D weights quantised (Q4_1, the embedding Q8_0), norms in F32.

:func:`tiny_llama_gguf` also returns the reference transformers model whose weights are exactly
what the file de-quantises to, so a reader of the file can be checked against it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2, as in SmolLM2
CHATML = (  # SmolLM2's template: a default system turn unless the messages bring one
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a tiny test model.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CORPUS = [
    "What is 7 + 5? Explain briefly, then give the answer.",
    "7 + 5 = 12. The answer is 12.", "Adding the numbers gives the sum.",
    "system user assistant You are a tiny test model.",
] * 20


def build_bpe():
    """A byte-level BPE tokenizer (``tokenizers``) with SmolLM2's special tokens at 0, 1, 2."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute``: HF's rotate-half q/k rows to GGML's RoPE order."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def tiny_llama_gguf(directory: Path, seed: int = 0, name: str = "tiny.Q4_1.gguf"):
    """Writes ``directory/name`` and returns ``(path, reference_model, bpe_tokenizer)``."""
    import gguf
    import transformers
    from gguf.quants import dequantize, quantize

    directory.mkdir(parents=True, exist_ok=True)
    bpe = build_bpe()
    vocab = bpe.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    assert tokens[:3] == SPECIALS
    merges = [" ".join(m) if isinstance(m, (list, tuple)) else m
              for m in __import__("json").loads(bpe.to_str())["model"]["merges"]]
    heads, kv_heads, hidden, inter, layers = 4, 2, 64, 128, 2
    cfg = transformers.LlamaConfig(
        vocab_size=len(tokens), hidden_size=hidden, intermediate_size=inter,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=hidden // heads, max_position_embeddings=256, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.manual_seed(seed)
    ref = transformers.LlamaForCausalLM(cfg).eval()
    Q41, Q80, F32 = (gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q8_0,
                     gguf.GGMLQuantizationType.F32)

    w = gguf.GGUFWriter(str(directory / name), "llama")
    w.add_name("tiny llama")
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(100000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(hidden // heads)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)

    def put(gguf_name: str, param: torch.nn.Parameter, qtype, n_head: int = 0) -> None:
        """Writes the parameter (quantised) and sets the reference to what it de-quantises to."""
        with torch.no_grad():
            if param.dim() == 1:  # norms: random, so a swapped or offset norm shows
                param.uniform_(0.5, 1.5)
            else:
                param.normal_(0, 0.3)
            value = param.numpy().astype(np.float32)
            stored = _permute(value, n_head) if n_head else value
            if qtype == F32:
                w.add_tensor(gguf_name, stored)
                return
            q = quantize(stored, qtype)
            w.add_tensor(gguf_name, q, raw_dtype=qtype)
            back = dequantize(q, qtype).reshape(stored.shape)
            if n_head:  # undo the permutation: rows are quantised independently
                back = _permute_back(back, n_head)
            param.copy_(torch.from_numpy(np.ascontiguousarray(back)))

    m = ref.model
    put("token_embd.weight", m.embed_tokens.weight, Q80)
    put("output_norm.weight", m.norm.weight, F32)
    for i, layer in enumerate(m.layers):
        put(f"blk.{i}.attn_norm.weight", layer.input_layernorm.weight, F32)
        put(f"blk.{i}.ffn_norm.weight", layer.post_attention_layernorm.weight, F32)
        put(f"blk.{i}.attn_q.weight", layer.self_attn.q_proj.weight, Q41, n_head=heads)
        put(f"blk.{i}.attn_k.weight", layer.self_attn.k_proj.weight, Q41, n_head=kv_heads)
        put(f"blk.{i}.attn_v.weight", layer.self_attn.v_proj.weight, Q41)
        put(f"blk.{i}.attn_output.weight", layer.self_attn.o_proj.weight, Q41)
        put(f"blk.{i}.ffn_gate.weight", layer.mlp.gate_proj.weight, Q41)
        put(f"blk.{i}.ffn_up.weight", layer.mlp.up_proj.weight, Q41)
        put(f"blk.{i}.ffn_down.weight", layer.mlp.down_proj.weight, Q41)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert ref.lm_head.weight.data_ptr() == m.embed_tokens.weight.data_ptr()  # still tied
    return directory / name, ref, bpe


def _permute_back(w: np.ndarray, n_head: int) -> np.ndarray:
    return (w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))
