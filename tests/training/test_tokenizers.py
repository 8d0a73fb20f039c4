"""pepo.training.tokenizers on the embedded task's tokenizer, and ChatTokenizer on a
checkpoint's (tests/hf_fixtures.py)."""

import json

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


def test_a_vocabulary_token_that_is_the_unk_token_is_a_stop_token(tmp_path):
    """SmolLM2's unk token is <|endoftext|>: it was refused as a stop token ('not in the
    tokenizer's vocabulary'), being the unk id. Catches that, and a string outside the
    vocabulary accepted as the unk id."""
    from pepo.training.tokenizers import ChatTokenizer, stop_token_ids
    from tests.hf_fixtures import SPECIALS, build_tokenizer

    build_tokenizer(tmp_path, unk="<|endoftext|>")
    tok = ChatTokenizer(tmp_path)
    assert tok._tok.unk_token == "<|endoftext|>"
    end = SPECIALS.index("<|endoftext|>")
    assert stop_token_ids(tok, ["<|endoftext|>"]) == [tok.eos_id, end]
    with pytest.raises(ValueError, match="'<nope>' is not in the tokenizer's vocabulary"):
        stop_token_ids(tok, ["<nope>"])


def test_a_null_eos_in_generation_config_leaves_the_tokenizers_eos(tmp_path):
    """generation_config.json's "eos_token_id": null was int(None), a TypeError; an id 0 is a
    stop token all the same (catches a falsy test that drops it)."""
    from pepo.training.tokenizers import ChatTokenizer
    from tests.hf_fixtures import build_tokenizer

    build_tokenizer(tmp_path)
    gen = tmp_path / "generation_config.json"
    for eos, extra in ((None, []), (0, [0]), ([0, 2], [0])):
        gen.write_text(json.dumps({"eos_token_id": eos}), encoding="utf-8")
        tok = ChatTokenizer(tmp_path)
        assert tok.eos_id != 0 and tok.stop_tokens == [tok.eos_id, *extra]


@pytest.mark.parametrize("think_special", [False, True])
def test_decoded_responses_keep_the_thinking_markers(tmp_path, think_special):
    """The text a reward reads keeps <think> and </think>, special tokens or not (Qwen3's are
    not; the test fixture's were): a response cut off inside its thinking then has no answer
    for a verifier that reads after </think>, where its thinking was scored as one. Catches the
    markers skipped as special tokens, and other special tokens (the stop) kept."""
    from pepo.tasks.rewards import final_answer_text
    from pepo.training.tokenizers import ChatTokenizer
    from tests.hf_fixtures import build_tokenizer

    build_tokenizer(tmp_path, think_special=think_special)
    tok = ChatTokenizer(tmp_path)
    special = tok._tok.convert_tokens_to_ids("<think>") in tok._tok.all_special_ids or any(
        t.special for t in tok._tok.added_tokens_decoder.values() if t.content == "<think>")
    assert special == think_special
    stop = tok._tok.convert_tokens_to_ids("<|im_end|>")
    done = tok.encode("<think>\nso \\boxed{5}</think>\n\\boxed{5}") + [stop]
    cut = tok.encode("<think>\n2 + 3 = \\boxed{5}, or")
    assert tok.decode(done) == "<think>\nso \\boxed{5}</think>\n\\boxed{5}"
    assert tok.decode(cut) == "<think>\n2 + 3 = \\boxed{5}, or"
    assert tok.decode(done, skip_special_tokens=False).endswith("<|im_end|>")
    # what MathVerify parses: the answer after </think>, none in a cut-off thought
    assert final_answer_text(tok.decode(done)) == "\n\\boxed{5}"
    assert final_answer_text(tok.decode(cut)) == ""


def test_a_tokenizer_directory_is_read_whole(tmp_path):
    """``load_tokenizer`` on a ``tokenizer.json`` of three words, two added special tokens and a
    post-processor that puts ``<s>`` first, with ``stop_tokens`` in ``tokenizer_config.json``.
    Catches the config's stop tokens ignored, the eos repeated among them, the added tokens left
    out of ``vocab_size`` (the model's head would be built too small for them), the
    post-processor's ``<s>`` added to every encoded prompt and response, an id outside the
    vocabulary as ``None`` in a per-token dump, and a missing ``tokenizer_config.json`` as a
    ``FileNotFoundError`` traceback."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    tok = Tokenizer(models.WordLevel({"a": 0, "b": 1, "<unk>": 2}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<s>", "</s>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 3)])
    tok.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ValueError, match=r"^tokenizer path .* has no tokenizer_config.json$"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"pad_token": "<unk>", "eos_token": "</s>", "stop_tokens": ["</s>", "b"]}),
        encoding="utf-8")
    t = load_tokenizer(tmp_path)
    assert (t.pad_id, t.eos_id, t.stop_tokens) == (2, 4, [4, 1])
    assert t.vocab_size == 5
    assert t.encode("a b") == t.encode_prompt("a b") == [0, 1]
    assert t.decode([3, 0, 4]) == "a" and t.decode([3, 0], skip_special_tokens=False) == "<s> a"
    assert t.id_to_token(1) == "b" and t.id_to_token(99) == ""


def test_a_checkpoints_tokenizer_is_checked_for_what_the_recipe_needs(tmp_path):
    """``ChatTokenizer``: a ``date_string`` that is not a string (YAML reads ``20240726`` as a
    number) and a tokenizer without a chat template are refused in one line; one without a pad
    token pads with its eos. Catches each check left out (the template's absence was a
    traceback from transformers at the first prompt) and the pad id read as None."""
    from transformers import AutoTokenizer

    from pepo.training.tokenizers import ChatTokenizer
    from tests.hf_fixtures import build_tokenizer

    build_tokenizer(tmp_path / "chat")
    with pytest.raises(ValueError, match=r"^date_string must be a string or None, got 20240726$"):
        ChatTokenizer(tmp_path / "chat", date_string=20240726)
    tok = ChatTokenizer(tmp_path / "chat")
    assert tok.pad_id == tok.token_id("<|endoftext|>") != tok.eos_id
    plain = AutoTokenizer.from_pretrained(str(tmp_path / "chat"))
    plain.pad_token = None
    plain.save_pretrained(str(tmp_path / "no_pad"))
    assert ChatTokenizer(tmp_path / "no_pad").pad_id == tok.eos_id
    plain.chat_template = None
    plain.save_pretrained(str(tmp_path / "no_template"))
    with pytest.raises(ValueError, match=r"^the tokenizer in .*no_template' has no chat "
                                         r"template$"):
        ChatTokenizer(tmp_path / "no_template")
