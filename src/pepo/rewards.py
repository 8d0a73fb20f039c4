"""Verifiers that turn responses into rewards.

A reward function takes the decoded responses and the gold answers of one batch and returns one
float per response: ``fn(responses: list[str], answers: list[str]) -> list[float]``. The recipe
builds it from the config's ``reward`` component, so a custom verifier is one importable
callable.
"""

from __future__ import annotations

from typing import Optional, Sequence

__all__ = ["BoxedMatch", "boxed_match", "last_boxed"]


def last_boxed(text: str) -> Optional[str]:
    """Content of the last ``\\boxed{...}`` in ``text`` (braces balanced), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i = start + len("\\boxed{")
    depth = 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None


def boxed_match(responses: Sequence[str], answers: Sequence[str]) -> list[float]:
    """1.0 where the last boxed answer equals the gold answer (whitespace stripped), else 0.0.

    Exact string match suits the embedded task, whose answers are single digits; math answers
    need a symbolic verifier.
    """
    if len(responses) != len(answers):
        raise ValueError(f"{len(responses)} responses but {len(answers)} answers")
    out = []
    for r, a in zip(responses, answers):
        b = last_boxed(r)
        out.append(1.0 if b is not None and b.strip() == str(a).strip() else 0.0)
    return out


class BoxedMatch:
    """The config component for :func:`boxed_match` (``reward: {_component_: pepo.rewards.BoxedMatch}``)."""

    def __call__(self, responses: Sequence[str], answers: Sequence[str]) -> list[float]:
        return boxed_match(responses, answers)
