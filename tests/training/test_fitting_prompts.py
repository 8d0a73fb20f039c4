"""Which prompts the recipe keeps: those whose tokens fit the sequence limit with the response
budget (:func:`pepo.training.engines.fitting_prompts`)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pepo.training.engines import fitting_prompts


class WordTokenizer:
    """One token per word."""

    def encode_prompt(self, prompt: str) -> list[int]:
        return list(range(len(prompt.split())))


def problems(*lengths: int) -> list:
    return [SimpleNamespace(prompt=" ".join(["w"] * n), id=i) for i, n in enumerate(lengths)]


def test_keeps_prompts_within_the_limit_less_the_response_budget():
    """limit 10 with 4 new tokens leaves 6 prompt tokens: the 6-token prompt stays, the 7-token
    one goes, with one warning that counts it. Catches the budget taken as the whole limit (the
    7-token prompt kept) or as ``<`` (the 6-token prompt dropped)."""
    warned = []
    kept = fitting_prompts(problems(3, 6, 7, 12), "dataset", WordTokenizer(), 10, 4, 10,
                           warned.append)
    assert [p.id for p in kept] == [0, 1]
    assert warned == ["dataset: dropped 2 of 4 prompts longer than 6 tokens (the model's "
                      "max_seq_len=10 - generation.max_new_tokens)"]


def test_names_vllms_limit_where_it_is_below_the_models():
    """A limit below the model's max_seq_len is vLLM's max_model_len, and the error names it.
    Catches the message naming the model's limit whatever set it."""
    warned = []
    kept = fitting_prompts(problems(2, 4), "val_dataset", WordTokenizer(), 8, 4, 64,
                           warned.append)
    assert [p.id for p in kept] == [0, 1] and warned == []  # 4 = 8 - 4 fits: nothing to say
    with pytest.raises(ValueError, match=r"^no prompt of val_dataset fits "
                       r"generation.vllm.max_model_len=8 with generation.max_new_tokens=4$"):
        fitting_prompts(problems(5, 9), "val_dataset", WordTokenizer(), 8, 4, 64, warned.append)


def test_a_dataset_smaller_than_a_steps_draw_is_refused():
    """Prompts are drawn without replacement (docs/recipe.md): catches a dataset with fewer
    prompts (that fit) than a step draws accepted, so that every step held some prompt twice
    (group mode: counts {24, 24, 16} over 3 prompts; SPO: 11 of 50 prompts repeated)."""
    fit = (WordTokenizer(), 10, 4, 10, [].append)
    assert len(fitting_prompts(problems(1, 2, 3, 4), "dataset", *fit, per_step=(2, 2))) == 4
    with pytest.raises(ValueError, match=r"^dataset has 3 prompts, fewer than the 4 a step "
                       r"draws \(prompts_per_step=4\): a step would hold some prompt twice"):
        fitting_prompts(problems(1, 2, 3), "dataset", *fit, per_step=(4, 1))
    with pytest.raises(ValueError, match=r"^dataset has 3 prompts that fit, fewer than the 6 a "
                       r"step draws \(prompts_per_step=3 x estimator.candidate_pool=2\)"):
        fitting_prompts(problems(1, 2, 3, 9), "dataset", *fit, per_step=(3, 2))
