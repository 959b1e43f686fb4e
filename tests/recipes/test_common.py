"""What the recipes share: the precision they train in by default."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from recipes.common import TrainerSection, precision_options

CUDA = torch.device("cuda", 0)  # never touched: only its type decides


@pytest.fixture(autouse=True)
def keep_matmul_precision() -> Iterator[None]:
    previous = torch.get_float32_matmul_precision()
    yield
    torch.set_float32_matmul_precision(previous)


def test_cuda_trains_in_bf16_autocast_with_tf32_and_a_cpu_in_float32() -> None:
    torch.set_float32_matmul_precision("highest")
    assert precision_options(TrainerSection(), torch.device("cpu")) == {
        "dtype": torch.float32,
        "amp": False,
    }
    assert torch.get_float32_matmul_precision() == "highest"
    assert precision_options(TrainerSection(), CUDA) == {"dtype": torch.bfloat16, "amp": True}
    assert torch.get_float32_matmul_precision() == "high"


@pytest.mark.parametrize(
    ("section", "expected", "matmuls"),
    [
        (TrainerSection(amp=False), {"dtype": torch.float32, "amp": False}, "high"),
        (TrainerSection(amp=False, tf32=False), {"dtype": torch.float32, "amp": False}, "highest"),
        (TrainerSection(dtype="float16"), {"dtype": torch.float16, "amp": True}, "high"),
    ],
)
def test_the_config_overrides_the_cuda_defaults(
    section: TrainerSection, expected: dict[str, object], matmuls: str
) -> None:
    assert precision_options(section, CUDA) == expected
    assert torch.get_float32_matmul_precision() == matmuls


def test_a_cpu_run_autocasts_when_told() -> None:
    section = TrainerSection(amp=True)
    assert precision_options(section, torch.device("cpu")) == {"dtype": torch.bfloat16, "amp": True}
