"""A recipe's named presets (``--preset NAME``, ``runtime.cli.presets``): the files of
``recipes/lm/configs/`` load as configs, apply before --config-file and --config, and an
unknown name is one line and exit status 2."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from recipes.lm import LMConfig, recipe
from runtime.cli.config import config_to_dict, load_config
from runtime.cli.presets import recipe_presets
from tests.conftest import main_in_process

REQUIRED = ("model.name=llama_debug", "data.train=train.jsonl")


def _flat(data: dict[str, object], prefix: str = "") -> dict[str, object]:
    flat: dict[str, object] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            flat |= _flat(value, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def test_the_lm_recipe_ships_its_presets_beside_it() -> None:
    presets = recipe_presets(recipe)
    assert set(presets) == {"dpo", "fsdp_bf16", "sft"}
    assert all(
        path.parent == Path(recipe.__code__.co_filename).parent / "configs"
        for path in presets.values()
    )


@pytest.mark.parametrize("name", ["dpo", "fsdp_bf16", "sft"])
def test_every_preset_is_a_valid_config_that_sets_what_its_file_says(name: str) -> None:
    path = recipe_presets(recipe)[name]
    config = load_config(LMConfig, config_files=[path], overrides=REQUIRED)
    effective = _flat(config_to_dict(config))
    for key, value in _flat(yaml.safe_load(path.read_text())).items():
        assert effective[key] == value, key


def test_presets_merge_in_order_and_config_overrides_win() -> None:
    args = ["--preset", "sft", "--preset", "fsdp_bf16", "--config", *REQUIRED, "optimizer.lr=0.001"]
    result = main_in_process(recipe, LMConfig, [*args, "--dump-config"])
    assert result.returncode == 0, result.stderr
    dumped = yaml.safe_load(result.stdout)
    assert dumped["task"] == "sft"
    assert dumped["fsdp"]["param_dtype"] == "bfloat16"
    assert dumped["data"]["seq_len"] == 2048
    assert dumped["optimizer"]["lr"] == 0.001


def test_an_unknown_preset_is_one_line_naming_the_choices_with_exit_2(tmp_path: Path) -> None:
    result = main_in_process(recipe, LMConfig, [str(tmp_path / "run"), "--preset", "ppo"])
    assert result.returncode == 2
    (line,) = result.stderr.splitlines()
    assert "invalid choice: 'ppo'" in line and "'dpo', 'fsdp_bf16', 'sft'" in line, line
    assert not (tmp_path / "run").exists()
