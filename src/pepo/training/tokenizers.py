"""Text tokenizers for the recipe: a thin, uniform interface over Hugging Face ``tokenizers``.

The recipe needs five things from a tokenizer: ``encode``, ``decode``, the padding id, the stop
ids and the vocabulary size. :class:`TextTokenizer` gives them for any ``tokenizer.json`` (the
format every Hugging Face checkpoint ships), with the special tokens named in a
``tokenizer_config.json`` beside it (``pad_token``, ``eos_token``, optional ``stop_tokens``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional, Sequence, Union

from tokenizers import Tokenizer

__all__ = ["ChatTokenizer", "TextTokenizer", "load_tokenizer", "stop_token_ids", "token_list"]


class TextTokenizer:
    """Encode/decode text with a Hugging Face ``tokenizers.Tokenizer``.

    Args:
        tokenizer: the fast tokenizer.
        pad_token: padding token (must be in the vocabulary).
        eos_token: end-of-response token; generation stops on it.
        stop_tokens: further tokens that end a response.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        pad_token: str,
        eos_token: str,
        stop_tokens: Sequence[str] = (),
    ) -> None:
        self._tok = tokenizer
        self.pad_token, self.eos_token = pad_token, eos_token
        self.pad_id = self.token_id(pad_token, "pad_token")
        self.eos_id = self.token_id(eos_token, "eos_token")
        self.stop_tokens = [self.eos_id] + [
            self.token_id(t, "stop_tokens") for t in token_list("stop_tokens", stop_tokens)
            if t != eos_token
        ]

    def token_id(self, token: str, key: str = "token") -> int:
        """The id of ``token``; ``key`` names the config key in the error."""
        i = self._tok.token_to_id(token)
        if i is None:
            raise ValueError(f"{key}={token!r} is not in the tokenizer's vocabulary")
        return i

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added)."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_prompt(self, prompt: str) -> list[int]:
        """The ids the model is given for ``prompt`` (here: the text as it is)."""
        return self.encode(prompt)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> str:
        """The vocabulary string of one id (for per-token dumps and heatmaps)."""
        t = self._tok.id_to_token(int(i))
        return "" if t is None else t


def load_tokenizer(path: Union[str, Path]) -> TextTokenizer:
    """Loads ``tokenizer.json`` and ``tokenizer_config.json`` from the directory ``path``.

    Raises:
        ValueError: the directory or one of the two files is missing, or a special token is not
            in the vocabulary.
    """
    d = Path(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if not (d / name).is_file():
            raise ValueError(f"tokenizer path {str(d)!r} has no {name}")
    cfg = json.loads((d / "tokenizer_config.json").read_text(encoding="utf-8"))
    return TextTokenizer(
        Tokenizer.from_file(str(d / "tokenizer.json")),
        pad_token=cfg["pad_token"],
        eos_token=cfg["eos_token"],
        stop_tokens=cfg.get("stop_tokens", ()),
    )


class ChatTokenizer:
    """A checkpoint's own tokenizer and chat template, through ``transformers``.

    ``encode_prompt`` renders the prompt as one user turn with the model's chat template and the
    generation prompt (Qwen3's ``enable_thinking`` passed through). Stop tokens are the
    tokenizer's eos plus every ``eos_token_id`` of ``generation_config.json`` (Qwen3:
    ``<|im_end|>`` and ``<|endoftext|>``; Llama 3: ``<|eot_id|>``, ``<|eom_id|>`` and
    ``<|end_of_text|>``).

    Args:
        path: a local checkpoint or tokenizer directory.
        enable_thinking: Qwen3's thinking mode (ignored by templates without it).
        system_prompt: optional system turn.
        stop_tokens: further stop strings (tokens of the vocabulary).
        date_string: the date a template that prints one writes into every prompt (Llama
            3.1–3.3's system turn says "Today Date: ..."): fixed, so that a prompt is the same
            whatever day it is encoded (training, validation caches, evaluation); the default
            is the templates' own fallback. None: today's date, as transformers gives it.
    """

    def __init__(
        self,
        path: Union[str, Path],
        enable_thinking: bool = True,
        system_prompt: Optional[str] = None,
        stop_tokens: Sequence[str] = (),
        date_string: Optional[str] = "26 Jul 2024",
    ) -> None:
        from transformers import AutoTokenizer

        if date_string is not None and not isinstance(date_string, str):
            raise ValueError(f"date_string must be a string or None, got {date_string!r}")

        if not Path(path).is_dir():
            raise ValueError(f"tokenizer path {str(path)!r} is not a directory")
        self._tok = AutoTokenizer.from_pretrained(str(path))
        if self._tok.chat_template is None:
            raise ValueError(f"the tokenizer in {str(path)!r} has no chat template")
        self.enable_thinking = enable_thinking
        self.system_prompt = system_prompt
        self.date_string = date_string
        self.eos_id = self._tok.eos_token_id
        if self.eos_id is None:
            raise ValueError(f"the tokenizer in {str(path)!r} has no eos token")
        pad = self._tok.pad_token_id
        self.pad_id = self.eos_id if pad is None else pad
        stops = [self.eos_id]
        gen = Path(path) / "generation_config.json"
        if gen.is_file():
            extra = json.loads(gen.read_text(encoding="utf-8")).get("eos_token_id")
            stops += [] if extra is None else extra if isinstance(extra, list) else [extra]
        stops += [self.token_id(t, "stop_tokens") for t in token_list("stop_tokens", stop_tokens)]
        self.stop_tokens = list(dict.fromkeys(int(t) for t in stops))
        self.path = str(path)
        # the thinking markers stay in decoded text where a tokenizer marks them special (Qwen3
        # does not): a reward that reads the answer after "</think>" would otherwise score a
        # response cut off inside its thinking as a whole answer
        special = set(self._tok.all_special_ids) | {
            i for i, t in self._tok.added_tokens_decoder.items() if t.special}
        think = {self._tok.convert_tokens_to_ids(t) for t in ("<think>", "</think>")
                 if t in self._tok.get_vocab()}
        self._skipped = special - think if think & special else None

    def token_id(self, token: str, key: str = "token") -> int:
        i = self._tok.convert_tokens_to_ids(token)
        # SmolLM2's unk token is <|endoftext|>: a token of the vocabulary all the same
        if i is None or (i == self._tok.unk_token_id and token != self._tok.unk_token):
            raise ValueError(f"{key}={token!r} is not in the tokenizer's vocabulary")
        return int(i)

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False)

    def encode_prompt(self, prompt: str) -> list[int]:
        messages = ([{"role": "system", "content": self.system_prompt}]
                    if self.system_prompt else [])
        messages.append({"role": "user", "content": prompt})
        text = self._tok.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True,
            enable_thinking=self.enable_thinking,
            **({} if self.date_string is None else {"date_string": self.date_string}),
        )
        return self.encode(text)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of ``ids``; ``skip_special_tokens`` leaves out special tokens but the
        thinking markers."""
        if skip_special_tokens and self._skipped is not None:
            kept = [i for i in ids if int(i) not in self._skipped]
            return self._tok.decode(kept, skip_special_tokens=False)
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> str:
        return self._tok.decode([int(i)])


def token_list(key: str, tokens: Any) -> list[str]:
    """``tokens`` as a list of token strings; one string is refused (iterated, it would be its
    characters, each a token of a byte-level vocabulary)."""
    if isinstance(tokens, str) or not all(isinstance(t, str) for t in tokens):
        raise ValueError(f"{key} must be a list of tokens (strings), got {tokens!r}")
    return list(tokens)


def stop_token_ids(tokenizer: Any, extra: Optional[Sequence[str]] = None) -> list[int]:
    """The ids that end a response: the tokenizer's own stop tokens, then the config's
    ``generation.stop_tokens`` (``extra``), without repeats. Training and evaluation both use
    this, so a response ends at the same tokens in both.

    Raises:
        ValueError: an extra stop token that is not in the vocabulary.
    """
    ids = list(tokenizer.stop_tokens)
    extra = token_list("generation.stop_tokens", extra or ())
    ids += [tokenizer.token_id(t, "generation.stop_tokens") for t in extra]
    return list(dict.fromkeys(int(i) for i in ids))
