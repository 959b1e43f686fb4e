"""recipes.lm with LoRA (peft): the adapters train under DDP and FSDP2, the checkpoints hold the
adapters and their optimizer state only, a resume after kill -9 is bitwise, and the exports load
with ``from_pretrained`` (merged) and ``PeftModel.from_pretrained`` (the adapters)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from checkpoint.dcp_io import load_whole
from gangs import Gangs
from recipes.lm import LMConfig, build_model, load_recipe_tokenizer
from runtime.cli.tools import main as export_main
from tests.conftest import (
    assert_ok,
    kill_9_after_first_checkpoint,
    make_toy_trainer,
    run_python,
    torchrun,
    torchrun_command,
)
from tests.recipes.test_lm import (
    TINY_TRAINING,
    last_model,
    losses,
    make_hf_llama_dir,
    recipe_args,
    repeated,
    write_jsonl,
)

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

LORA = ("lora.rank=4", "lora.alpha=8", "lora.target_modules=[q_proj, v_proj, down_proj]")


def lora_config(model_dir: Path, train: Path, *extra: str) -> tuple[str, ...]:
    return (
        *TINY_TRAINING,
        *LORA,
        f"model.hf_path={model_dir}",
        f"data.train={train}",
        "optimizer.lr=0.05",
        *extra,
    )


def adapted_reference(model_dir: Path, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """The trained model: the base with peft's adapters, loaded with a checkpoint's adapters."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    peft.inject_adapter_in_model(config, model)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected
    assert all("lora_" not in key for key in missing)
    return model.eval()


def directory_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("nproc", "layout"),
    [
        (2, ("data_parallel=fsdp",)),
        pytest.param(
            4, ("data_parallel=hsdp", "gang.dp_shard_size=2"), id="hsdp", marks=pytest.mark.slow
        ),
    ],
    ids=["fsdp2", "hsdp"],
)
def test_lora_sharded_trains_the_adapters_and_exports_them(
    tmp_path: Path, nproc: int, layout: tuple[str, ...]
) -> None:
    model_dir = make_hf_llama_dir(tmp_path / "model")
    train = write_jsonl(tmp_path / "train.jsonl", [{"text": s} for s in repeated(200, seed=2)])
    out = tmp_path / "run"
    config = lora_config(
        model_dir, train, *layout, "trainer.max_num_steps=8", "trainer.checkpoint_every_n_steps=8"
    )
    assert_ok(torchrun(nproc, *recipe_args(out, *config), timeout=600))
    values = losses(out)
    assert len(values) == 8 and values[-1] < values[0], values

    # The checkpoint holds the adapters and their optimizer state; the frozen base is left out.
    step_dir = out / "checkpoints" / "step_8"
    state = last_model(out)
    assert state and all(".lora_A." in key or ".lora_B." in key for key in state)
    assert set(load_whole(step_dir / "optimizer")["state"]) == set(state)
    excluded = json.loads((step_dir / "manifest.json").read_text())["excluded"]
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    assert {key.replace(".base_layer", "") for key in excluded} == set(base)
    assert any(value.abs().sum() > 0 for key, value in state.items() if ".lora_B." in key)

    merged_dir, adapter_dir = tmp_path / "merged", tmp_path / "adapter"
    for destination, format in ((merged_dir, "hf"), (adapter_dir, "peft")):
        assert export_main(["export", str(out), str(destination), "--format", format]) == 0
    assert {p.name for p in adapter_dir.iterdir()} == {
        "adapter_config.json",
        "adapter_model.safetensors",
    }
    merged = transformers.AutoModelForCausalLM.from_pretrained(merged_dir).eval()
    with_adapter = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(model_dir), adapter_dir
    ).eval()
    reference = adapted_reference(model_dir, state)
    tokens = torch.randint(0, merged.config.vocab_size, (2, 16))
    with torch.no_grad():
        expected = reference(tokens).logits
        torch.testing.assert_close(with_adapter(tokens).logits, expected, rtol=0, atol=0)
        torch.testing.assert_close(merged(tokens).logits, expected, rtol=1e-5, atol=1e-5)
        # The adapters changed what the model computes.
        assert not torch.allclose(base_logits(model_dir, tokens), expected, atol=1e-3)


def base_logits(model_dir: Path, tokens: torch.Tensor) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    logits: torch.Tensor = model(tokens).logits
    return logits


@pytest.mark.slow
@pytest.mark.distributed
def test_a_lora_run_under_ddp_resumes_bitwise_after_kill_9(tmp_path: Path) -> None:
    model_dir = make_hf_llama_dir(tmp_path / "model")
    train = write_jsonl(tmp_path / "train.jsonl", [{"text": s} for s in repeated(300, seed=2)])
    config = lora_config(
        model_dir, train, "data_parallel=ddp", "lora.dropout=0.1", "trainer.max_num_steps=12",
        "model.activation_checkpointing=true",
        "trainer.checkpoint_every_n_steps=4", "trainer.keep_last_n_checkpoints=null",
    )  # fmt: skip
    reference = tmp_path / "reference"
    assert_ok(torchrun(2, *recipe_args(reference, *config), timeout=600))

    out = tmp_path / "killed"
    killed_at = kill_9_after_first_checkpoint(torchrun_command(2, recipe_args(out, *config)), out)
    assert max(killed_at) < 12
    assert_ok(torchrun(2, *recipe_args(out, *config), timeout=600))

    assert losses(out)[-1] == losses(reference)[-1]
    expected, actual = last_model(reference), last_model(out)
    assert expected.keys() == actual.keys()
    for key in expected:
        assert torch.equal(expected[key], actual[key]), key


@pytest.mark.slow
def test_a_lora_checkpoint_is_a_fraction_of_a_full_one(tmp_path: Path) -> None:
    """The size on disk of a step's checkpoint, LoRA against full fine-tuning of one model."""
    model_dir = make_hf_llama_dir(
        tmp_path / "model", hidden_size=128, intermediate_size=256, num_hidden_layers=4
    )
    train = write_jsonl(tmp_path / "train.jsonl", [{"text": s} for s in repeated(100, seed=2)])
    sizes = {}
    for name, extra in (("full", ()), ("lora", LORA)):
        out = tmp_path / name
        config = (
            *TINY_TRAINING,
            *extra,
            f"model.hf_path={model_dir}",
            f"data.train={train}",
            "trainer.max_num_steps=2",
            "trainer.checkpoint_every_n_steps=2",
        )
        assert_ok(run_python(*recipe_args(out, *config), timeout=300))
        sizes[name] = directory_bytes(out / "checkpoints" / "step_2")
    weights = (model_dir / "model.safetensors").stat().st_size
    print(
        f"\ncheckpoint of one step: full fine-tuning {sizes['full'] / 1024:.0f} KiB, LoRA "
        f"{sizes['lora'] / 1024:.0f} KiB ({100 * sizes['lora'] / sizes['full']:.1f}%); "
        f"the model's weights: {weights / 1024:.0f} KiB"
    )
    # Full: the weights and two Adam moments. LoRA: the adapters, their moments, the trainer state.
    assert sizes["full"] > 2.5 * weights
    assert sizes["lora"] < 0.1 * sizes["full"]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"model": {"name": "llama_debug"}}, "lora.rank adapts the weights of a Hugging Face"),
        ({"model": {"from_scratch": True}}, "lora.rank adapts the weights of a Hugging Face"),
        ({"gang": {"tp_size": 2}}, "not tensor parallelism, but gang.tp_size is 2"),
        ({"lora": {"rank": 0}}, "lora.rank"),
        ({"lora": {"target_modules": []}}, "lora.target_modules is empty"),
    ],
)
def test_a_lora_config_that_cannot_work_is_refused_with_the_fix(
    tmp_path: Path, changes: dict[str, dict[str, object]], message: str
) -> None:
    from runtime.cli.config import ConfigError, config_from_dict

    (tmp_path / "config.json").write_text("{}")
    data: dict[str, dict[str, object]] = {
        "model": {"hf_path": str(tmp_path)},
        "data": {"train": "train.jsonl"},
        "lora": {"rank": 4},
    }
    for section, values in changes.items():
        data[section] = data.get(section, {}) | values
    if "name" in data["model"]:
        del data["model"]["hf_path"]
    with pytest.raises(ConfigError, match=message):
        config_from_dict(LMConfig, data)


def test_target_modules_that_match_no_layer_name_the_linear_layers() -> None:
    from models.lora import LoraSection, apply_lora

    config = transformers.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1,
    )  # fmt: skip
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    with pytest.raises(ValueError, match=r"\['wq'\] names no layer .* down_proj, gate_proj"):
        apply_lora(model, LoraSection(rank=2, target_modules=["wq"]), lambda name, module: None)


def test_the_adapted_model_starts_as_its_base(tmp_path: Path) -> None:
    """Built on meta and materialized by the recipe, then the base loaded from init_from under
    the adapted names: B is zero and A is not, so the logits are the base model's."""
    from recipes.lm.model import lora_trainer_options
    from runtime.cli.config import config_from_dict
    from runtime.training.initial_weights import load_initial_weights

    model_dir = make_hf_llama_dir(tmp_path / "model")
    config = config_from_dict(
        LMConfig,
        {"model": {"hf_path": str(model_dir)}, "data": {"train": "x"}, "lora": {"rank": 4}},
    )
    gangs = Gangs.single()
    built = build_model(config, gangs, load_recipe_tokenizer(config))
    assert built.lora is not None
    source = lora_trainer_options(built.lora, model_dir)["init_from"]
    loaded = load_initial_weights(built.model, source, gangs=gangs)
    assert sorted(loaded.skipped_keys) == sorted(
        name for name, param in built.model.named_parameters() if param.requires_grad
    )
    for name, param in built.model.named_parameters():
        assert param.requires_grad == (".lora_" in name), name
        if ".lora_B." in name:
            assert not param.any(), name
        elif ".lora_A." in name:
            assert param.abs().min() > 0, name
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tokens = torch.randint(0, base.config.vocab_size, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(built.model.eval()(tokens).logits, base(tokens).logits)


def test_exporting_adapters_of_a_run_without_lora_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    make_toy_trainer(tmp_path, checkpoint_every_n_steps=1).run()
    destination = tmp_path / "adapter"
    assert export_main(["export", str(tmp_path), str(destination), "--format", "peft"]) == 2
    assert "it is not a LoRA run, so it has no adapters to export" in capsys.readouterr().err
    assert not destination.exists()
