"""One quick run of the benchmark cases whose tests run the suite end to end in ``make test``."""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import run_quick_benchmark

GPU_KEYS = ("G1-paired", "G2-llama", "G2-checkpoint")
"""The GPU cases: on a machine without CUDA each is skipped with one line saying why."""


@dataclass(frozen=True)
class QuickRun:
    result: subprocess.CompletedProcess[str]
    output_dir: Path
    cases: tuple[str, ...]

    def comparison(self, key: str) -> Any:
        """The comparison ``key`` of results.json."""
        comparisons = json.loads((self.output_dir / "results.json").read_text())["comparisons"]
        (found,) = [c for c in comparisons if c["key"] == key]
        return found


@pytest.fixture(scope="session")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> QuickRun:
    """``python -m benchmarks --quick --runs 1`` of W1 and W1-paired, and without CUDA the GPU
    cases (which then only record that they are skipped): one start-up of the suite for the
    tests of all of them. With CUDA the GPU cases are left to the CUDA suite."""
    cases = ("W1", "W1-paired", *(() if torch.cuda.is_available() else GPU_KEYS))
    output_dir = tmp_path_factory.mktemp("quick_benchmarks")
    return QuickRun(run_quick_benchmark(",".join(cases), output_dir), output_dir, cases)
