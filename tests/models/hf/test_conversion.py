"""Per-expert Hugging Face files load into the stacked experts of ``transformers`` 5 models as
``from_pretrained`` loads them, and export writes them back as ``save_pretrained`` does."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from gangs import Gangs
from models.hf.conversion import ConvertedCheckpoint, checkpoint_state
from runtime.training.initial_weights import InitialWeightsError, load_initial_weights
from tests.recipes.families import (
    FAMILY_BY_NAME,
    GPT_OSS,
    MOE_FAMILIES,
    Family,
    make_family_dir,
)

transformers = pytest.importorskip("transformers")


def saved_keys(directory: Path) -> list[str]:
    with safe_open(str(directory / "model.safetensors"), framework="pt") as file:
        return list(file.keys())


def meta_model(directory: Path) -> torch.nn.Module:
    config = transformers.AutoConfig.from_pretrained(directory)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("family", [pytest.param(f, id=f.slug) for f in MOE_FAMILIES])
def test_a_per_expert_directory_loads_as_from_pretrained_loads_it(
    tmp_path: Path, family: Family
) -> None:
    """The files hold one tensor per expert (Mixtral's under its own names); the model built on
    meta and loaded by ``load_initial_weights`` equals ``from_pretrained``'s, tensor by tensor."""
    directory = make_family_dir(family, tmp_path)
    keys = saved_keys(directory)
    assert any(".experts.0." in key for key in keys), keys
    assert not any(key.endswith("experts.gate_up_proj") for key in keys)

    model = meta_model(directory).to_empty(device="cpu")
    loaded = load_initial_weights(model, directory, gangs=Gangs.single())
    assert not loaded.skipped_keys or all("rotary" in k for k in loaded.skipped_keys)
    reference = transformers.AutoModelForCausalLM.from_pretrained(directory)
    expected = reference.state_dict()
    assert model.state_dict().keys() == expected.keys()
    for key, value in model.state_dict().items():
        assert torch.equal(value, expected[key]), key


def test_a_stacked_expert_directory_loads_as_from_pretrained_loads_it(tmp_path: Path) -> None:
    """gpt-oss's files hold its experts stacked, with biases: they load as they are."""
    directory = make_family_dir(GPT_OSS, tmp_path)
    assert "model.layers.0.mlp.experts.gate_up_proj_bias" in saved_keys(directory)
    model = meta_model(directory).to_empty(device="cpu")
    load_initial_weights(model, directory, gangs=Gangs.single())
    expected = transformers.AutoModelForCausalLM.from_pretrained(directory).state_dict()
    assert model.state_dict().keys() == expected.keys()
    for key, value in model.state_dict().items():
        assert torch.equal(value, expected[key]), key


def test_the_experts_are_stacked_in_the_order_of_their_numbers(tmp_path: Path) -> None:
    """Expert 10 comes after expert 9 (a natural order, not the files' string order)."""
    family = FAMILY_BY_NAME["Qwen3-MoE"]
    config = family.config(19)
    config.num_experts = 12
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    model = meta_model(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as file:
        source = {key: file.get_tensor(key) for key in file.keys()}  # noqa: SIM118
    view = ConvertedCheckpoint(source, model, model.state_dict())
    key = "model.layers.1.mlp.experts.down_proj"
    assert view.sources_of(key) == [
        f"model.layers.1.mlp.experts.{i}.down_proj.weight" for i in range(12)
    ]
    assert torch.equal(view[key][10], source["model.layers.1.mlp.experts.10.down_proj.weight"])
    gate_up = view["model.layers.1.mlp.experts.gate_up_proj"]
    gate = source["model.layers.1.mlp.experts.11.gate_proj.weight"]
    up = source["model.layers.1.mlp.experts.11.up_proj.weight"]
    assert torch.equal(gate_up[11], torch.cat([gate, up]))


def test_a_missing_expert_is_named_in_the_error(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    directory = make_family_dir(FAMILY_BY_NAME["OLMoE"], tmp_path / "model")
    with safe_open(str(directory / "model.safetensors"), framework="pt") as file:
        source = {key: file.get_tensor(key) for key in file.keys()}  # noqa: SIM118
    del source["model.layers.0.mlp.experts.3.up_proj.weight"]
    save_file(source, str(directory / "model.safetensors"), metadata={"format": "pt"})
    model = meta_model(directory).to_empty(device="cpu")
    with pytest.raises(InitialWeightsError) as error:
        load_initial_weights(model, directory, gangs=Gangs.single())
    assert "model.layers.0.mlp.experts.gate_up_proj" in str(error.value)


def test_export_writes_the_keys_save_pretrained_writes(tmp_path: Path) -> None:
    for family in MOE_FAMILIES:
        directory = make_family_dir(family, tmp_path / family.slug)
        reference = transformers.AutoModelForCausalLM.from_pretrained(directory)
        written = checkpoint_state(meta_model(directory), reference.state_dict())
        with safe_open(str(directory / "model.safetensors"), framework="pt") as file:
            assert sorted(written) == sorted(file.keys()), family.name
            for key in file.keys():  # noqa: SIM118
                assert torch.equal(written[key], file.get_tensor(key)), (family.name, key)


def test_a_dense_model_keeps_its_keys() -> None:
    state = {"weight": torch.ones(2)}
    assert checkpoint_state(torch.nn.Linear(2, 1), state) == state
