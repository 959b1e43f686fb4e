"""The CUDA suite's marks and launch helpers. Every test here is marked ``cuda`` and skipped
where no CUDA device is; the 2-GPU tests also where fewer than two are.

Run it with ``make test-gpu`` (``pytest -m cuda tests/cuda``). Figures the tests measure (GB/s,
blocking times) are printed and recorded as junit properties (``record_property``).
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO_ROOT, run_python, torchrun

CUDA_SUITE = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here"),
]
"""``pytestmark`` of every module of the suite."""

TWO_GPUS = pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (nccl); fewer here"
)

CUDA_RUN = str(Path(__file__).with_name("cuda_run.py").relative_to(REPO_ROOT))

# Small enough to train in seconds, large enough to learn something about Python source; the
# same slice of the stdlib as the CPU tests of the recipe.
CHAR_LM_TINY = (
    "data.max_train_bytes=200000",
    "data.max_valid_bytes=20000",
    "data.seq_len=64",
    "data.batch_size=16",
    "model.dim=64",
    "model.num_heads=4",
    "model.ffn_dim=256",
    "model.num_layers=2",
    "trainer.publish_metrics_every_n_steps=10",
    "trainer.validate_every_n_steps=30",
    "trainer.checkpoint_every_n_steps=30",
    "optimizer.warmup_steps=5",
)


def run_cuda_run(
    out: Path, *overrides: str, nproc: int = 1, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """``cuda_run.py OUT --config OVERRIDES`` in one process, or under torchrun for ``nproc``."""
    args = (str(out), "--config", *overrides) if overrides else (str(out),)
    if nproc == 1:
        return run_python(CUDA_RUN, *args, timeout=timeout)
    return torchrun(nproc, CUDA_RUN, *args, timeout=timeout)


def run_char_lm(
    out: Path, *overrides: str, nproc: int = 1, timeout: float = 600
) -> subprocess.CompletedProcess[str]:
    """The char-LM recipe on ``nproc`` GPUs with :data:`CHAR_LM_TINY` and ``overrides``."""
    return torchrun(
        nproc,
        "-m",
        "recipes.char_lm",
        str(out),
        "--config",
        *CHAR_LM_TINY,
        *overrides,
        timeout=timeout,
    )


def load_params(out: Path) -> dict[str, torch.Tensor]:
    params: dict[str, torch.Tensor] = torch.load(out / "params.pt", weights_only=True)
    return params


def report(
    record_property: Callable[[str, object], None], name: str, value: float, unit: str
) -> None:
    """Record a measured figure for the junit report, and print it (``make test-gpu`` shows the
    output of passed tests)."""
    record_property(name, value)
    print(f"\n[cuda figure] {name}: {value:.4g} {unit}", flush=True)
