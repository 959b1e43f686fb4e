"""Datasets mixed by weight: which dataset each packed sequence of an epoch comes from."""

from __future__ import annotations

import bisect
import itertools
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, final


@final
@dataclass(frozen=True)
class TextSource:
    """A dataset: one or more paths or globs of data files, and its weight in a mixture."""

    path: str | Path | Sequence[str | Path]
    weight: float = 1.0

    def __post_init__(self) -> None:
        if not self.weight > 0:
            raise ValueError(
                f"The weight of the dataset {self.path} must be greater than zero, but is "
                f"{self.weight} instead."
            )

    @property
    def paths(self) -> list[str]:
        if isinstance(self.path, (str, Path)):
            return [str(self.path)]
        return [str(path) for path in self.path]


def parse_mixture(entries: Sequence[Mapping[str, Any]]) -> list[TextSource]:
    """The sources of a config's ``mixture=[{path: ..., weight: ...}, ...]``."""
    sources = []
    for nr, entry in enumerate(entries):
        unknown = set(entry) - {"path", "weight"}
        if "path" not in entry or unknown:
            raise ValueError(
                f"Entry {nr} of the data mixture is {dict(entry)}, but each entry needs a 'path' "
                "and may have a 'weight' (default 1.0), nothing else."
            )
        sources.append(TextSource(path=entry["path"], weight=float(entry.get("weight", 1.0))))
    if not sources:
        raise ValueError("The data mixture is empty. Give at least one {path, weight} entry.")
    return sources


@final
class MixtureSampler:
    """Draws the dataset of each sequence with probability proportional to its weight.

    A draw depends only on the seed, the data epoch and the sequence's number, so it needs no
    state to resume. Every sequence is full, so the ratios of tokens are those of the weights.
    """

    def __init__(self, weights: Sequence[float], *, seed: int) -> None:
        total = sum(weights)
        self._bounds = list(itertools.accumulate(weight / total for weight in weights))
        self._seed = seed

    def choose(self, *, epoch: int, sequence_nr: int) -> int:
        if len(self._bounds) == 1:
            return 0
        draw = random.Random(f"{self._seed}/{epoch}/{sequence_nr}").random()
        return min(bisect.bisect_right(self._bounds, draw), len(self._bounds) - 1)
