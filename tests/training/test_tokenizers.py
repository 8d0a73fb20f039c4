"""pepo.training.tokenizers on the embedded task's tokenizer."""

import pytest

from pepo.training.config import asset_dir
from pepo.training.tokenizers import load_tokenizer


def test_tokenizer_specials():
    tok = load_tokenizer(asset_dir("tiny"))
    assert tok.stop_tokens == [tok.eos_id] and tok.pad_id != tok.eos_id
    assert tok.decode([tok.eos_id, tok.encode("5")[0]]) == "5"
    with pytest.raises(ValueError, match="has no tokenizer.json"):
        load_tokenizer("/nonexistent")
    with pytest.raises(ValueError, match="'<nope>' is not in the tokenizer's vocabulary"):
        tok.token_id("<nope>", "generation.stop_tokens")


def test_stop_tokens_given_as_one_string_are_refused():
    """Catches a string iterated as its characters: ``"box"`` made b, o and x stop tokens (each
    in a byte-level vocabulary), ending every response after a letter, scored 0 in silence.
    A list of tokens still works."""
    from pepo.training.tokenizers import TextTokenizer, stop_token_ids

    tok = load_tokenizer(asset_dir("tiny"))
    msg = "generation.stop_tokens must be a list of tokens (strings), got '5'"
    with pytest.raises(ValueError, match=f"^{msg}$".replace("(", r"\(").replace(")", r"\)")):
        stop_token_ids(tok, "5")
    assert stop_token_ids(tok, ["5"]) == [tok.eos_id, tok.token_id("5")]
    with pytest.raises(ValueError, match=r"^stop_tokens must be a list of tokens"):
        TextTokenizer(tok._tok, pad_token=tok.pad_token, eos_token=tok.eos_token,
                      stop_tokens="5")
