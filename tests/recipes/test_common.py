"""What the recipes share: the precision they train in by default, the loss-spike switches, and
which layouts make a process group on one process."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from recipes.char_lm import CharLMConfig
from recipes.common import TrainerSection, precision_options, shards_parameters
from recipes.lm import LMConfig
from runtime import ConfigError, LossSpikeGuard
from runtime.cli.config import load_config

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


@pytest.mark.parametrize("config_class", [CharLMConfig, LMConfig])
def test_the_recipes_switch_the_loss_spike_guard_on_from_the_config(
    config_class: type[CharLMConfig] | type[LMConfig],
) -> None:
    # The LM recipe needs a model and data; the char LM has its own.
    model = ["model.name=llama_debug", "data.train=a.txt"] if config_class is LMConfig else []
    assert load_config(config_class, overrides=model).trainer.loss_spike.guard() is None
    config = load_config(
        config_class,
        overrides=[*model, "trainer.loss_spike.enabled=true", "trainer.loss_spike.margin=50"],
    )
    assert config.trainer.loss_spike.guard() == LossSpikeGuard(margin=50)


def test_a_bad_loss_spike_option_is_a_config_error_naming_it() -> None:
    with pytest.raises(
        ConfigError,
        match=r"section 'trainer\.loss_spike' is invalid: margin must be 0 or more, but is -1",
    ):
        load_config(CharLMConfig, overrides=["trainer.loss_spike.margin=-1"])


@pytest.mark.parametrize(
    ("overrides", "shards"),
    [
        ([], False),
        (["data_parallel=ddp"], False),
        (["data_parallel=fsdp"], True),
        (["data_parallel=hsdp", "gang.dp_shard_size=1"], True),
        (["gang.dp_shard_size=1"], True),  # auto picks HSDP
    ],
)
def test_fsdp2_and_hsdp_ask_for_a_process_group_on_one_process_too(
    overrides: list[str], shards: bool
) -> None:
    for config_class in (CharLMConfig, LMConfig):
        extra = ["model.name=llama_debug", "data.train=x.txt"] if config_class is LMConfig else []
        assert (
            shards_parameters(load_config(config_class, overrides=[*extra, *overrides])) is shards
        )
