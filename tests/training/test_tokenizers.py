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
