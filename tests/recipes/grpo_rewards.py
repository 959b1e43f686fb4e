"""Reward functions the GRPO recipe tests name by import path."""

from __future__ import annotations

from typing import Any


def _text(completion: Any) -> str:
    return completion if isinstance(completion, str) else completion[-1]["content"]


def says_answer(completions: list[Any], answer: list[str], **kwargs: Any) -> list[float]:
    """1 if the completion's first word is the record's answer."""
    return [float(_text(c).split()[:1] == [a]) for c, a in zip(completions, answer, strict=True)]


def short(completions: list[Any], completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
    """Fewer tokens score higher."""
    return [-len(ids) / 10 for ids in completion_ids]


def broken(completions: list[Any], **kwargs: Any) -> list[float]:
    raise KeyError("no such column")


def too_few(completions: list[Any], **kwargs: Any) -> list[float]:
    return [0.0]


def first_word_is_answer(completions: list[Any], answer: list[str], **kwargs: Any) -> list[float]:
    """The learning test's verifiable reward: 1 if the completion starts with the answer."""
    return [float(_text(c).split()[:1] == [a]) for c, a in zip(completions, answer, strict=True)]
