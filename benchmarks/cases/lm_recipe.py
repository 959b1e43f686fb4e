"""The LM recipe: its data path against pre-tokenized tensors, and its step against a hand loop."""

from __future__ import annotations

import importlib.util

from benchmarks.cases.base import STEP_TIME, SuiteSettings
from benchmarks.runner import Comparison, Contender

KEY = "lm"
MODULE = "benchmarks.lm_recipe_worker"
TEXT = "recipe, JSONL tokenized by 2 workers"
TENSORS = "recipe, pre-tokenized tensors"
HAND = "hand-written loop, pre-tokenized tensors"


def _missing_transformers() -> str | None:
    if importlib.util.find_spec("transformers") is not None:
        return None
    return "transformers is not installed (pip install -e '.[hf]')"


def _contender(name: str, feed: str, loop: str, settings: SuiteSettings) -> Contender:
    args = ("--feed", feed, "--loop", loop, *(("--quick",) if settings.quick else ()))
    return Contender(name=name, module=MODULE, args=args, skip_reason=_missing_transformers())


def comparisons(settings: SuiteSettings) -> list[Comparison]:
    title = "Hugging Face Llama, 2 layers of 128, 4 x 256 tokens a step, 1 process"
    return [
        Comparison(
            key=f"{KEY}-data",
            title=f"{title}: the data path",
            baseline=TENSORS,
            metrics=(STEP_TIME,),
            contenders=(
                _contender(TENSORS, "tensors", "recipe", settings),
                _contender(TEXT, "text", "recipe", settings),
            ),
            notes=(
                "Goal: the text path's step takes at most 1/0.97 of the pre-tokenized one's: "
                "tokenizing in worker processes stays off the training process.",
            ),
        ),
        Comparison(
            key=f"{KEY}-step",
            title=f"{title}: the recipe's step",
            baseline=HAND,
            metrics=(STEP_TIME,),
            contenders=(
                _contender(HAND, "tensors", "hand", settings),
                _contender(TENSORS, "tensors", "recipe", settings),
            ),
            notes=("Goal: at most 1.03x of the hand-written loop (clipping in both).",),
        ),
    ]
