"""recipes.lm with task=dpo|simpo|orpo: runs from a Hugging Face directory and JSONL pairs, the
reference model (frozen, sharded as the policy, the base under LoRA, never checkpointed), the
metrics, export, and what DP=2 with accumulation and a kill -9 resume give.

The numbers against TRL are in tests/units/test_preference_trl.py."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from checkpoint import CheckpointManager
from gangs import Gangs
from recipes.lm import LMConfig, build_model, build_trainer, build_units, load_recipe_tokenizer
from runtime.cli.config import config_from_dict
from tests.conftest import (
    assert_ok,
    kill_9_after_first_checkpoint,
    main_in_process,
    read_jsonl,
    torchrun,
    torchrun_command,
)
from tests.recipes.test_lm import WORDS, last_model, make_hf_llama_dir, recipe_args
from units.preference import PAIR_METRICS, CpoTrainUnit, DpoTrainUnit, OrpoTrainUnit, SimpoTrainUnit
from units.reference import AdapterBaseReference, FrozenReference

transformers = pytest.importorskip("transformers")


def pair_records(count: int, seed: int) -> list[dict[str, str]]:
    rng = random.Random(seed)

    def phrase(low: int, high: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))

    return [
        {"prompt": phrase(2, 6), "chosen": phrase(1, 6), "rejected": phrase(1, 6)}
        for _ in range(count)
    ]


def write_pairs(path: Path, count: int, seed: int) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in pair_records(count, seed)))
    return path


def preference_config(model_dir: Path, train: Path, **sections: Any) -> dict[str, Any]:
    """A run's config as a dict: ``sections`` update its top-level keys and sections."""
    config: dict[str, Any] = {
        "task": "dpo",
        "model": {"hf_path": str(model_dir)},
        "data": {"train": str(train), "seq_len": 32, "batch_size": 4, "num_workers": 0},
        "optimizer": {"lr": 0.01, "warmup_steps": 1},
        "trainer": {
            "max_num_steps": 3,
            "publish_metrics_every_n_steps": 1,
            "gc_every_n_steps": None,
        },
    }
    for key, value in sections.items():
        config[key] = config.get(key, {}) | value if isinstance(value, dict) else value
    return config


def run_in_process(config: dict[str, Any], out: Path, gangs: Gangs | None = None) -> None:
    trainer = build_trainer(config_from_dict(LMConfig, config), out, gangs or Gangs.single())
    assert trainer.run() == 0


def train_records(out: Path) -> list[dict[str, Any]]:
    return [r for r in read_jsonl(out / "metrics" / "train.jsonl") if "loss" in r]


def assert_zero_rewards_first(records: list[dict[str, Any]]) -> None:
    first = records[0]
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"):
        assert first[name] == 0.0, name
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert records[-1]["rewards/margins"] != 0.0


def test_a_dpo_run_starts_at_zero_rewards_checkpoints_the_policy_alone_and_exports_it(
    tmp_path: Path,
) -> None:
    from runtime.cli.tools import main as runtime_main

    model_dir = make_hf_llama_dir(tmp_path / "model")
    train = write_pairs(tmp_path / "train.jsonl", 24, seed=1)
    valid = write_pairs(tmp_path / "valid.jsonl", 5, seed=2)
    out = tmp_path / "run"
    data = {"valid": str(valid)}
    trainer = {"validate_every_n_steps": 3, "checkpoint_every_n_steps": 3}
    run_in_process(preference_config(model_dir, train, data=data, trainer=trainer), out)

    records = train_records(out)
    assert [r["step_nr"] for r in records] == [1, 2, 3]
    assert all(set(PAIR_METRICS) <= r.keys() for r in records)
    assert_zero_rewards_first(records)
    (valid_record,) = read_jsonl(out / "metrics" / "valid.jsonl")
    assert {"loss", *PAIR_METRICS} <= valid_record.keys()

    # The checkpoint holds the policy: the model's keys, no reference beside them.
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    manager = CheckpointManager(out / "checkpoints", Gangs.single())
    state = manager.read_model_state(3)
    assert state.keys() == base.state_dict().keys()

    assert runtime_main(["export", str(out), str(tmp_path / "hf"), "--format", "hf"]) == 0
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
    for key in state:
        torch.testing.assert_close(exported[key], state[key], rtol=0, atol=0)
    assert any(not torch.equal(value, exported[key]) for key, value in base.state_dict().items())


@pytest.mark.parametrize("with_valid", [True, False], ids=["valid", "no_valid"])
def test_precomputed_reference_logps_give_the_same_steps_and_are_reused_on_resume(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, with_valid: bool
) -> None:
    import recipes.lm.units

    model_dir = make_hf_llama_dir(tmp_path / "model")
    train = write_pairs(tmp_path / "train.jsonl", 16, seed=1)
    data = {"valid": str(write_pairs(tmp_path / "valid.jsonl", 5, seed=2)) if with_valid else None}
    trainer = {"max_num_steps": 2, "validate_every_n_steps": 2, "checkpoint_every_n_steps": 2}
    config = preference_config(model_dir, train, data=data, trainer=trainer)
    run_in_process(config, tmp_path / "each_step")
    precomputed = preference_config(
        model_dir, train, data=data, trainer=trainer, preference={"precompute_reference": True}
    )
    out = tmp_path / "precomputed"
    run_in_process(precomputed, out)
    runs = ("train", "valid") if with_valid else ("train",)
    assert {p.name for p in (out / "reference_logps").iterdir()} == {f"{r}.pt" for r in runs}
    assert (out / "metrics" / "valid.jsonl").exists() == with_valid

    names = ["loss", *PAIR_METRICS]
    for run in runs:
        expected = read_jsonl(tmp_path / "each_step" / "metrics" / f"{run}.jsonl")
        for mine, theirs in zip(
            read_jsonl(out / "metrics" / f"{run}.jsonl"), expected, strict=True
        ):
            assert {n: mine[n] for n in names} == pytest.approx(
                {n: theirs[n] for n in names}, abs=1e-6
            )

    def no_reference(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the resumed run built a reference model")

    monkeypatch.setattr(recipes.lm.units, "build_reference", no_reference)
    precomputed["trainer"] |= {"max_num_steps": 3}
    run_in_process(precomputed, out)
    assert train_records(out)[-1]["step_nr"] == 3


def built_units(config: dict[str, Any], gangs: Gangs) -> tuple[Any, Any]:
    lm_config = config_from_dict(LMConfig, config)
    tokenizer = load_recipe_tokenizer(lm_config)
    built = build_model(lm_config, gangs, tokenizer)
    init_from = lm_config.model.hf_path
    return built, build_units(lm_config, gangs, tokenizer, built, init_from)[0]


def test_the_dpo_reference_is_a_frozen_model_with_the_policys_weights_and_placement(
    tmp_path: Path,
) -> None:
    from runtime.training.initial_weights import load_initial_weights

    model_dir = make_hf_llama_dir(tmp_path / "model")
    config = preference_config(model_dir, tmp_path / "x", data_parallel="ddp")
    gangs = Gangs.single()
    built, unit = built_units(config, gangs)
    load_initial_weights(built.model, model_dir, gangs=gangs)
    assert isinstance(unit, DpoTrainUnit) and isinstance(unit.reference, FrozenReference)
    reference = unit.reference.model
    assert reference is not built.model and not reference.training
    assert not any(p.requires_grad for p in reference.parameters())
    policy = dict(built.model.named_parameters())
    for name, param in reference.named_parameters():
        assert (param.dtype, param.device) == (policy[name].dtype, policy[name].device)
        assert torch.equal(param, policy[name]), name


@pytest.mark.parametrize(
    ("task", "unit_type"),
    [("simpo", SimpoTrainUnit), ("orpo", OrpoTrainUnit), ("cpo", CpoTrainUnit)],
)
def test_simpo_orpo_and_cpo_build_no_reference(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, task: str, unit_type: type
) -> None:
    import recipes.lm.units

    model_dir = make_hf_llama_dir(tmp_path / "model")
    config = config_from_dict(LMConfig, preference_config(model_dir, tmp_path / "x", task=task))
    tokenizer = load_recipe_tokenizer(config)
    built = build_model(config, Gangs.single(), tokenizer)

    def no_second_model(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"task={task} built a second model")

    monkeypatch.setattr(recipes.lm.units, "build_model", no_second_model)
    unit, valid_unit = build_units(config, Gangs.single(), tokenizer, built, model_dir)
    assert type(unit) is unit_type and not hasattr(unit, "reference")
    assert valid_unit.model is built.model


def test_fsdp2_with_bf16_parameters_shards_the_reference_as_the_policy(
    tmp_path: Path, gangs_with_mesh_of_one: Gangs
) -> None:
    from torch.distributed.fsdp import FSDPModule

    model_dir = make_hf_llama_dir(tmp_path / "model")
    train = write_pairs(tmp_path / "train.jsonl", 12, seed=1)
    config = preference_config(
        model_dir,
        train,
        data_parallel="fsdp",
        fsdp={"param_dtype": "bfloat16"},
        trainer={"max_num_steps": 2},
    )
    built, unit = built_units(config, gangs_with_mesh_of_one)
    reference = unit.reference.model
    assert isinstance(reference, FSDPModule) and isinstance(built.model, FSDPModule)
    policy_blocks = [type(m) for m in built.model.modules() if isinstance(m, FSDPModule)]
    assert [type(m) for m in reference.modules() if isinstance(m, FSDPModule)] == policy_blocks
    out = tmp_path / "run"
    run_in_process(config, out, gangs_with_mesh_of_one)
    # The reference computes in the policy's bf16: the first rewards are exactly 0.
    assert_zero_rewards_first(train_records(out))


def test_under_lora_the_reference_is_the_base_with_the_adapters_disabled(tmp_path: Path) -> None:
    pytest.importorskip("peft")
    from recipes.lm.model import lora_trainer_options
    from runtime.cli.tools import main as runtime_main
    from runtime.data.text import PreferenceBatch
    from runtime.training.initial_weights import load_initial_weights

    model_dir = make_hf_llama_dir(tmp_path / "model")
    train = write_pairs(tmp_path / "train.jsonl", 12, seed=1)
    config = preference_config(model_dir, train, lora={"rank": 4, "dropout": 0.1})
    built, unit = built_units(config, Gangs.single())
    assert isinstance(unit.reference, AdapterBaseReference)
    assert unit.reference.model is built.model  # no second copy
    load_initial_weights(
        built.model, lora_trainer_options(built.lora, model_dir)["init_from"], gangs=Gangs.single()
    )
    with torch.no_grad():  # trained adapters: the policy is no longer its base
        for name, param in built.model.named_parameters():
            if ".lora_B." in name:
                torch.nn.init.normal_(param)
    flags = {name: p.requires_grad for name, p in built.model.named_parameters()}
    tokens = torch.randint(3, 10, (2, 6))
    batch = PreferenceBatch(input_ids=tokens, target_ids=tokens, num_pairs=1)
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    built.model.eval()
    with torch.no_grad():
        expected = base(tokens).logits
        assert not torch.allclose(built.model(tokens).logits, expected)
    torch.testing.assert_close(unit.reference.logits(batch), expected)
    assert {name: p.requires_grad for name, p in built.model.named_parameters()} == flags

    out = tmp_path / "run"
    run_in_process(config, out)
    assert_zero_rewards_first(train_records(out))
    assert runtime_main(["export", str(out), str(tmp_path / "peft"), "--format", "peft"]) == 0
    assert (tmp_path / "peft" / "adapter_config.json").is_file()


def accumulation_run(directory: Path, *, dp_size: int, write: bool = True) -> dict[str, Any]:
    """A DPO run of 2 steps of 8 pairs each, as 2 micro-batches of 2 pairs on each of 2 ranks
    (``dp_size=2``) or one micro-batch of 8 on one process; its valid set, 5 pairs, does not
    divide over 2 ranks. ``write``: make the model and the pairs in ``directory`` first."""
    if write:
        make_hf_llama_dir(directory / "model")
        write_pairs(directory / "train.jsonl", 40, seed=3)
        write_pairs(directory / "valid.jsonl", 5, seed=4)
    batch_size, num_accumulate = (2, 2) if dp_size == 2 else (8, 1)
    data = {
        "valid": str(directory / "valid.jsonl"),
        "batch_size": batch_size,
        "num_accumulate": num_accumulate,
    }
    trainer = {"max_num_steps": 2, "validate_every_n_steps": 2, "checkpoint_every_n_steps": 2}
    return preference_config(
        directory / "model", directory / "train.jsonl", data=data, trainer=trainer
    )


def test_dp_2_with_accumulation_takes_the_steps_of_one_process_with_the_whole_batch(
    tmp_path: Path, two_rank_checks: Path
) -> None:
    two_ranks = two_rank_checks / "preference_dp"
    one = tmp_path / "one"
    run_in_process(accumulation_run(two_ranks, dp_size=1, write=False), one)

    names = ["loss", *PAIR_METRICS]
    for mine, theirs in zip(train_records(one), train_records(two_ranks / "run"), strict=True):
        assert mine["num_targets"] == theirs["num_targets"] == 8
        for name in names:
            assert mine[name] == pytest.approx(theirs[name], abs=1e-5), (mine["step_nr"], name)
    (valid_one,) = read_jsonl(one / "metrics" / "valid.jsonl")
    (valid_two,) = read_jsonl(two_ranks / "run" / "metrics" / "valid.jsonl")
    for name in names:
        assert valid_one[name] == pytest.approx(valid_two[name], abs=1e-5), name
    states = [
        CheckpointManager(out / "checkpoints", Gangs.single()).read_model_state(2)
        for out in (one, two_ranks / "run")
    ]
    for key, value in states[0].items():
        torch.testing.assert_close(value, states[1][key], atol=1e-5, rtol=0)


@pytest.mark.slow
@pytest.mark.distributed
def test_a_dpo_run_under_ddp_resumes_bitwise_after_kill_9(tmp_path: Path) -> None:
    """The resumed run builds its reference again from model.hf_path: the same rewards, losses
    and weights as a run never stopped, across a data epoch's end."""
    model_dir = make_hf_llama_dir(tmp_path / "model")
    train = write_pairs(tmp_path / "train.jsonl", 40, seed=5)
    config = (
        "task=dpo", f"model.hf_path={model_dir}", f"data.train={train}", "data.seq_len=32",
        "data.batch_size=2", "data.num_workers=0", "optimizer.lr=0.01",
        "trainer.max_num_steps=12", "trainer.publish_metrics_every_n_steps=1",
        "trainer.checkpoint_every_n_steps=4", "trainer.keep_last_n_checkpoints=null",
    )  # fmt: skip
    reference = tmp_path / "reference"
    assert_ok(torchrun(2, *recipe_args(reference, *config), timeout=600))

    out = tmp_path / "killed"
    killed_at = kill_9_after_first_checkpoint(torchrun_command(2, recipe_args(out, *config)), out)
    assert max(killed_at) < 12
    assert_ok(torchrun(2, *recipe_args(out, *config), timeout=600))

    names = ["step_nr", "loss", *PAIR_METRICS]
    expected = {r["step_nr"]: r for r in train_records(reference)}
    for record in train_records(out)[-4:]:
        assert {n: record[n] for n in names} == {n: expected[record["step_nr"]][n] for n in names}
    expected_state, actual_state = last_model(reference), last_model(out)
    assert expected_state.keys() == actual_state.keys()
    for key in expected_state:
        assert torch.equal(expected_state[key], actual_state[key]), key


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize(
    ("layout", "batch_size"),
    [
        pytest.param(("gang.tp_size=2",), 4, id="tp"),
        pytest.param(("data_parallel=fsdp",), 2, id="fsdp2"),
        pytest.param(
            ("data_parallel=fsdp", "preference.precompute_reference=true"), 2, id="precomputed"
        ),
    ],
)
def test_tp_and_fsdp2_on_two_ranks_take_the_dpo_steps_of_one_process(
    tmp_path: Path, layout: tuple[str, ...], batch_size: int
) -> None:
    """The reference is split by the same TP plan or sharded by the same FSDP2 units as the
    policy: the first rewards are 0, and the steps are those of one process with the whole
    batch. The valid set (5 pairs) leaves a rank without a batch, whose stand-in forwards keep
    the policy's and the reference's collectives in step."""
    model_dir = make_hf_llama_dir(tmp_path / "model")
    train = write_pairs(tmp_path / "train.jsonl", 24, seed=6)
    valid = write_pairs(tmp_path / "valid.jsonl", 5, seed=7)
    one = tmp_path / "one"
    trainer = {"validate_every_n_steps": 3, "checkpoint_every_n_steps": 3}
    run_in_process(
        preference_config(model_dir, train, data={"valid": str(valid)}, trainer=trainer), one
    )
    two = tmp_path / "two"
    config = (
        "task=dpo", f"model.hf_path={model_dir}", f"data.train={train}", f"data.valid={valid}",
        "trainer.validate_every_n_steps=3", "trainer.checkpoint_every_n_steps=3", "data.seq_len=32",
        f"data.batch_size={batch_size}", "data.num_workers=0", "optimizer.lr=0.01",
        "optimizer.warmup_steps=1", "trainer.max_num_steps=3",
        "trainer.publish_metrics_every_n_steps=1", "trainer.gc_every_n_steps=null", *layout,
    )  # fmt: skip
    assert_ok(torchrun(2, *recipe_args(two, *config), timeout=600))

    assert_zero_rewards_first(train_records(two))
    for mine, theirs in zip(train_records(one), train_records(two), strict=True):
        for name in ["loss", *PAIR_METRICS]:
            assert mine[name] == pytest.approx(theirs[name], abs=1e-4), (mine["step_nr"], name)
    (valid_one,) = read_jsonl(one / "metrics" / "valid.jsonl")
    (valid_two,) = read_jsonl(two / "metrics" / "valid.jsonl")
    for name in ["loss", *PAIR_METRICS]:
        assert valid_one[name] == pytest.approx(valid_two[name], abs=1e-4), name
    expected, actual = last_model(one), last_model(two)
    for key, value in expected.items():
        torch.testing.assert_close(actual[key], value, atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        ({"preference": {"label_smoothing": 0.1}}, "applies to task=dpo with loss_type=robust"),
        ({"preference": {"beta": 0}}, "preference.beta must be greater than zero"),
        (
            {"task": "orpo", "preference": {"precompute_reference": True}},
            "precompute_reference applies to task=dpo",
        ),
        ({"preference": {"loss_type": "exo"}}, "loss_type"),
        ({"task": "simpo", "preference": {"loss_type": "ipo"}}, "loss_type applies to task=dpo,"),
        (
            {"task": "simpo", "data": {"mixture": [{"path": "x", "weight": 1}], "train": None}},
            "task=simpo reads one dataset",
        ),
    ],
)
def test_a_preference_config_that_cannot_work_is_refused(
    tmp_path: Path, sections: dict[str, Any], message: str
) -> None:
    model_dir = make_hf_llama_dir(tmp_path / "model")
    config = preference_config(model_dir, tmp_path / "x", **sections)
    with pytest.raises(ValueError, match=message):
        config_from_dict(LMConfig, config)


# Each preference option set away from its default, with the tasks that read it.
_OPTIONS_AND_TASKS: dict[str, tuple[str, set[str]]] = {
    "beta": ("0.2", {"dpo", "simpo", "orpo", "cpo"}),
    "loss_type": ("hinge", {"dpo"}),
    "label_smoothing": ("0.1", {"simpo", "cpo"}),
    "simpo_gamma": ("0.3", {"simpo"}),
    "cpo_alpha": ("0.5", {"cpo"}),
    "precompute_reference": ("true", {"dpo"}),
    "prompt_field": ("question", {"dpo", "simpo", "orpo", "cpo"}),
    "chosen_field": ("good", {"dpo", "simpo", "orpo", "cpo"}),
    "rejected_field": ("bad", {"dpo", "simpo", "orpo", "cpo"}),
}


@pytest.mark.parametrize(
    ("task", "option"),
    [
        (task, option)
        for option, (_, tasks) in _OPTIONS_AND_TASKS.items()
        for task in ("pretrain", "sft", "dpo", "simpo", "orpo", "cpo")
        if task not in tasks
    ],
)
def test_an_option_the_task_ignores_is_refused_in_one_line_with_exit_2(
    tmp_path: Path, task: str, option: str
) -> None:
    from recipes.lm import recipe

    model_dir = make_hf_llama_dir(tmp_path / "model")
    value = _OPTIONS_AND_TASKS[option][0]
    args = (
        str(tmp_path / "run"), "--config", f"task={task}", f"model.hf_path={model_dir}",
        f"data.train={tmp_path / 'train.jsonl'}", f"preference.{option}={value}",
    )  # fmt: skip
    result = main_in_process(recipe, LMConfig, args)
    assert result.returncode == 2
    (line,) = result.stderr.splitlines()
    assert f"preference.{option} applies to task=" in line
    assert f"the task is {task}, which ignores it" in line
