"""Text tokenizers for the recipe: a thin, uniform interface over Hugging Face ``tokenizers``.

The recipe needs five things from a tokenizer: ``encode``, ``decode``, the padding id, the stop
ids and the vocabulary size. :class:`TextTokenizer` gives them for any ``tokenizer.json`` (the
format every Hugging Face checkpoint ships), with the special tokens named in a
``tokenizer_config.json`` beside it (``pad_token``, ``eos_token``, optional ``stop_tokens``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence, Union

from tokenizers import Tokenizer

__all__ = ["TextTokenizer", "load_tokenizer"]


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
            self.token_id(t, "stop_tokens") for t in stop_tokens if t != eos_token
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
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    return TextTokenizer(
        Tokenizer.from_file(str(d / "tokenizer.json")),
        pad_token=cfg["pad_token"],
        eos_token=cfg["eos_token"],
        stop_tokens=cfg.get("stop_tokens", ()),
    )
