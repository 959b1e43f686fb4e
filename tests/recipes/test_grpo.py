"""recipes.lm with task=grpo: text and chat prompts from JSONL, generation by the policy,
reward functions by import path, the metrics, and the configs and reward functions that stop a
run in one line.

The numbers against TRL are in tests/units/test_grpo_trl.py."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from checkpoint import CheckpointManager
from gangs import Gangs
from recipes.lm import LMConfig, build_trainer, recipe
from runtime.cli.config import config_from_dict
from tests.conftest import (
    WORDS,
    assert_ok,
    kill_9_after_first_checkpoint,
    main_in_process,
    read_jsonl,
    torchrun,
    torchrun_command,
)
from tests.recipes.test_lm import last_model, make_hf_llama_dir, recipe_args
from tests.units.test_grpo import TRL_METRICS
from units.reference import AdapterBaseReference

pytest.importorskip("transformers")

REWARDS = "tests.recipes.grpo_rewards"
METRICS = {*TRL_METRICS, "rewards/says_answer/mean"}


def write_prompts(path: Path, count: int, *, chat: bool = False) -> Path:
    rng = random.Random(0)
    records = []
    for _ in range(count):
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 5)))
        records.append(
            {
                "prompt": [{"role": "user", "content": prompt}] if chat else prompt,
                "answer": rng.choice(WORDS),
            }
        )
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def grpo_args(out: Path, model_dir: Path, train: Path, *config: str) -> list[str]:
    return [
        str(out), "--config", "task=grpo", f"model.hf_path={model_dir}", f"data.train={train}",
        "data.seq_len=24", "data.batch_size=2", "data.num_workers=0",
        f"grpo.reward_functions=[{REWARDS}:says_answer, {REWARDS}:short]",
        "grpo.reward_weights=[1.0, 0.1]", "grpo.num_generations=3",
        "grpo.max_completion_length=6", "optimizer.lr=0.01", "trainer.max_num_steps=3",
        "trainer.publish_metrics_every_n_steps=1", "trainer.gc_every_n_steps=null", *config,
    ]  # fmt: skip


def assert_one_error_line(stderr: str, message: str) -> None:
    """One ``error:`` line with ``message`` and no traceback (progress bars of the model's
    loading may come before it)."""
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], stderr[-3000:]
    assert "Traceback" not in stderr


def run(args: list[str]) -> Any:
    return main_in_process(recipe, LMConfig, args)


def test_a_grpo_run_generates_scores_and_publishes_trls_metrics(tmp_path: Path) -> None:
    model_dir = make_hf_llama_dir(tmp_path / "model")
    train = write_prompts(tmp_path / "train.jsonl", 8)
    out = tmp_path / "run"
    result = run(grpo_args(out, model_dir, train, "grpo.beta=0.04", "grpo.num_iterations=2"))
    assert result.returncode == 0, result.stderr[-3000:]
    records = [r for r in read_jsonl(out / "metrics" / "train.jsonl") if "loss" in r]
    assert [r["step_nr"] for r in records] == [1, 2, 3]
    for record in records:
        assert METRICS | {"kl", "rewards/short/mean"} <= record.keys()
        assert 1 <= record["completions/mean_length"] <= 6
    assert records[0]["kl"] == 0.0 and records[1]["kl"] > 0.0


def test_chat_prompts_are_rendered_with_the_template_and_get_chat_completions(
    tmp_path: Path,
) -> None:
    model_dir = make_hf_llama_dir(tmp_path / "model")
    config_path = model_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    config["chat_template"] = (
        "{{ bos_token }}{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}assistant {% endif %}"
    )
    config_path.write_text(json.dumps(config))
    train = write_prompts(tmp_path / "train.jsonl", 4, chat=True)
    out = tmp_path / "run"
    result = run(grpo_args(out, model_dir, train, "trainer.max_num_steps=1"))
    assert result.returncode == 0, result.stderr[-3000:]
    (record,) = [r for r in read_jsonl(out / "metrics" / "train.jsonl") if "loss" in r]
    assert record.keys() >= METRICS


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (("task=sft",), "applies to task=grpo, but the task is sft, which ignores it"),
        (("grpo.num_generations=1",), "grpo.num_generations must be at least 2"),
        (("grpo.reward_functions=[]",), "grpo.reward_functions is empty"),
        (("grpo.reward_weights=[1.0]",), "grpo.reward_weights has 1 weights for 2"),
        (("grpo.loss_type=ppo",), "loss_type"),
        (("grpo.max_completion_length=30",), "must exceed grpo.max_completion_length"),
        (
            (f"grpo.reward_functions=[{REWARDS}:nothing]", "grpo.reward_weights=null"),
            f"Reward function {REWARDS}:nothing: {REWARDS} has no function nothing",
        ),
        (
            ("grpo.reward_functions=[no_colon]", "grpo.reward_weights=null"),
            'named "package.module:function"',
        ),
    ],
)
def test_a_grpo_config_that_cannot_work_is_refused_in_one_line_with_exit_2(
    tmp_path: Path, config: tuple[str, ...], message: str
) -> None:
    model_dir = make_hf_llama_dir(tmp_path / "model")
    train = write_prompts(tmp_path / "train.jsonl", 4)
    result = run(grpo_args(tmp_path / "run", model_dir, train, *config))
    assert result.returncode == 2, result.stderr[-3000:]
    assert_one_error_line(result.stderr, message)


@pytest.mark.parametrize(
    ("function", "message"),
    [
        ("broken", f"The reward function {REWARDS}:broken raised KeyError: 'no such column'"),
        ("too_few", f"The reward function {REWARDS}:too_few returned 1 scores for 6"),
    ],
)
def test_a_reward_function_that_fails_stops_the_run_in_one_line(
    tmp_path: Path, function: str, message: str
) -> None:
    model_dir = make_hf_llama_dir(tmp_path / "model")
    train = write_prompts(tmp_path / "train.jsonl", 4)
    config = (f"grpo.reward_functions=[{REWARDS}:{function}]", "grpo.reward_weights=null")
    result = run(grpo_args(tmp_path / "run", model_dir, train, *config))
    assert result.returncode == 1
    assert_one_error_line(result.stderr, message)


def accumulation_run(
    directory: Path,
    *,
    dp_size: int,
    write: bool = True,
    scale_rewards: str = "group",
    loss_type: str = "dapo",
) -> dict[str, Any]:
    """A run (dapo unless ``loss_type`` says otherwise) with KL and two iterations a batch: 2
    steps of 4 prompts each, as 2
    micro-batches of 1 prompt on each of 2 ranks (``dp_size=2``) or one micro-batch of 4 on one
    process. ``scale_rewards=batch`` takes the std over a micro-batch on every rank, so the two
    ranks then read one micro-batch of 2 prompts each. ``write``: make the model and the
    prompts in ``directory`` first."""
    if write:
        make_hf_llama_dir(directory / "model")
        write_prompts(directory / "train.jsonl", 16)
    batch_size, num_accumulate = (1, 2) if dp_size == 2 else (4, 1)
    if dp_size == 2 and scale_rewards == "batch":
        batch_size, num_accumulate = 2, 1
    return {
        "task": "grpo",
        "model": {"hf_path": str(directory / "model")},
        "data": {
            "train": str(directory / "train.jsonl"),
            "seq_len": 24,
            "batch_size": batch_size,
            "num_accumulate": num_accumulate,
            "num_workers": 0,
        },
        "grpo": {
            "reward_functions": [f"{REWARDS}:says_answer", f"{REWARDS}:short"],
            "num_generations": 3,
            "max_completion_length": 6,
            "beta": 0.04,
            "num_iterations": 2,
            "scale_rewards": scale_rewards,
            "loss_type": loss_type,
        },
        "optimizer": {"lr": 0.01},
        "trainer": {
            "max_num_steps": 2,
            "checkpoint_every_n_steps": 2,
            "publish_metrics_every_n_steps": 1,
            "gc_every_n_steps": None,
        },
    }


def run_in_process(config: dict[str, Any], out: Path, gangs: Gangs | None = None) -> None:
    trainer = build_trainer(config_from_dict(LMConfig, config), out, gangs or Gangs.single())
    assert trainer.run() == 0


@pytest.mark.parametrize("scale_rewards", ["group", "batch"])
def test_dp_2_with_accumulation_takes_the_steps_of_one_process_with_the_whole_batch(
    tmp_path: Path, two_rank_checks: Path, scale_rewards: str
) -> None:
    """The same completions (seeded by step and prompt), and under dapo the same normalization:
    the all-reduced token count of the step is TRL's global one. ``batch``: the rewards' std
    is taken over both ranks."""
    two_ranks = two_rank_checks / "grpo_dp"
    config = accumulation_run(two_ranks, dp_size=1, write=False, scale_rewards=scale_rewards)
    assert_same_steps(config, tmp_path / "one", two_ranks / f"run_{scale_rewards}")


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo"])
def test_dp_2_with_accumulation_equals_one_process_for_each_exact_loss_type(
    tmp_path_factory: pytest.TempPathFactory, grpo_loss_types_dp2: Path, loss_type: str
) -> None:
    """``grpo`` returns per-sequence means with the sequences as the count, ``dr_grpo`` sums
    over a fixed ``batch x max_completion_length``: both are exact at any DP size and
    accumulation, as dapo is (``bnpo``'s micro-batch mean is not, by its definition)."""
    config = accumulation_run(grpo_loss_types_dp2, dp_size=1, write=False, loss_type=loss_type)
    one = tmp_path_factory.mktemp(f"one_{loss_type}")
    assert_same_steps(config, one, grpo_loss_types_dp2 / f"run_loss_{loss_type}")


@pytest.fixture(scope="module")
def grpo_loss_types_dp2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One two-rank launch that trains a run of each of grpo and dr_grpo."""
    out = tmp_path_factory.mktemp("grpo_loss_types")
    assert_ok(torchrun(2, "tests/workers/grpo_dp.py", str(out), "grpo", "dr_grpo", timeout=600))
    return out


def assert_same_steps(config: dict[str, Any], one: Path, two: Path) -> None:
    """``config`` run in this process into ``one`` takes the steps (metrics within 1e-5, the
    same target counts, weights within 1e-5) of the two-rank run in ``two``."""
    run_in_process(config, one)
    records = [
        [r for r in read_jsonl(out / "metrics" / "train.jsonl") if "loss" in r]
        for out in (one, two)
    ]
    for mine, theirs in zip(*records, strict=True):
        assert mine["num_targets"] == theirs["num_targets"]
        for name in METRICS | {"kl"}:
            assert mine[name] == pytest.approx(theirs[name], abs=1e-5), (mine["step_nr"], name)
    states = [
        CheckpointManager(out / "checkpoints", Gangs.single()).read_model_state(2)
        for out in (one, two)
    ]
    for key, value in states[0].items():
        torch.testing.assert_close(value, states[1][key], atol=1e-5, rtol=0)


def train_records(out: Path) -> list[dict[str, Any]]:
    return [r for r in read_jsonl(out / "metrics" / "train.jsonl") if "loss" in r]


def test_under_lora_the_reference_is_the_base_with_the_adapters_disabled(tmp_path: Path) -> None:
    pytest.importorskip("peft")
    model_dir = make_hf_llama_dir(tmp_path / "model")
    train = write_prompts(tmp_path / "train.jsonl", 8)
    config = accumulation_run(tmp_path, dp_size=1, write=False)
    config["model"]["hf_path"] = str(model_dir)
    config["data"]["train"] = str(train)
    config["lora"] = {"rank": 4, "target_modules": ["q_proj", "v_proj"]}
    trainer = build_trainer(config_from_dict(LMConfig, config), tmp_path / "run", Gangs.single())
    unit: Any = trainer._unit
    assert isinstance(unit.reference, AdapterBaseReference)
    assert trainer.run() == 0
    records = train_records(tmp_path / "run")
    assert records[0]["kl"] == 0.0 and records[1]["kl"] > 0.0


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize(
    ("layout", "batch_size"),
    [pytest.param("data_parallel=fsdp", 2, id="fsdp2"), pytest.param("gang.tp_size=2", 4, id="tp")],
)
def test_fsdp2_and_tp_on_two_ranks_take_the_steps_of_one_process(
    tmp_path: Path, layout: str, batch_size: int
) -> None:
    """The sharded policy generates (every rank runs as many forwards; the TP ranks of a DP
    rank draw the same tokens from the same seed), the reference is sharded as the policy is,
    and the steps are those of one process with the whole batch."""
    config = accumulation_run(tmp_path, dp_size=1)
    one = tmp_path / "one"
    run_in_process(config, one)
    data, grpo = config["data"], config["grpo"]
    two = tmp_path / "two"
    args = (
        "task=grpo", f"model.hf_path={tmp_path / 'model'}", f"data.train={data['train']}",
        "data.seq_len=24", f"data.batch_size={batch_size}", "data.num_workers=0", layout,
        f"grpo.reward_functions=[{', '.join(grpo['reward_functions'])}]",
        "grpo.num_generations=3", "grpo.max_completion_length=6", "grpo.beta=0.04",
        "grpo.num_iterations=2", "optimizer.lr=0.01", "trainer.max_num_steps=2",
        "trainer.checkpoint_every_n_steps=2", "trainer.publish_metrics_every_n_steps=1",
        "trainer.gc_every_n_steps=null",
    )  # fmt: skip
    assert_ok(torchrun(2, *recipe_args(two, *args), timeout=600))
    for mine, theirs in zip(train_records(one), train_records(two), strict=True):
        for name in METRICS | {"kl"}:
            assert mine[name] == pytest.approx(theirs[name], abs=1e-4), (mine["step_nr"], name)
    expected, actual = last_model(one), last_model(two)
    for key, value in expected.items():
        torch.testing.assert_close(actual[key], value, atol=1e-4, rtol=0)


@pytest.mark.slow
@pytest.mark.distributed
def test_a_grpo_run_under_ddp_resumes_bitwise_after_kill_9(tmp_path: Path) -> None:
    """Checkpoints every 3 steps with 2 iterations a batch: the resume lands between the two
    steps of one batch of completions, which the checkpoint holds; the completions after it
    are drawn again from the step and the prompt."""
    model_dir = make_hf_llama_dir(tmp_path / "model")
    train = write_prompts(tmp_path / "train.jsonl", 12)
    config = (
        "task=grpo", f"model.hf_path={model_dir}", f"data.train={train}", "data.seq_len=24",
        "data.batch_size=1", "data.num_workers=0",
        f"grpo.reward_functions=[{REWARDS}:says_answer, {REWARDS}:short]",
        "grpo.num_generations=3", "grpo.max_completion_length=6", "grpo.beta=0.04",
        "grpo.num_iterations=2", "optimizer.lr=0.01", "trainer.max_num_steps=9",
        "trainer.publish_metrics_every_n_steps=1", "trainer.checkpoint_every_n_steps=3",
        "trainer.keep_last_n_checkpoints=null",
    )  # fmt: skip
    reference = tmp_path / "reference"
    assert_ok(torchrun(2, *recipe_args(reference, *config), timeout=600))

    out = tmp_path / "killed"
    killed_at = kill_9_after_first_checkpoint(torchrun_command(2, recipe_args(out, *config)), out)
    assert max(killed_at) < 9
    assert_ok(torchrun(2, *recipe_args(out, *config), timeout=600))

    names = ["step_nr", *sorted(METRICS | {"kl"})]
    expected = {r["step_nr"]: r for r in train_records(reference)}
    for record in train_records(out)[-3:]:
        assert {n: record[n] for n in names} == {n: expected[record["step_nr"]][n] for n in names}
    expected_state, actual_state = last_model(reference), last_model(out)
    for key in expected_state:
        assert torch.equal(expected_state[key], actual_state[key]), key


LEARNING_STEPS = 40


def learning_run(directory: Path, *, steps: int = LEARNING_STEPS) -> list[dict[str, Any]]:
    """A tiny Llama learns to answer with the word its prompt names ("cat cat" -> "cat"):
    4 prompts a step, 8 completions each of at most 2 tokens, the default dapo loss."""
    model_dir = make_hf_llama_dir(directory / "model")
    words = ["cat", "dogs", "birds", "hills"]
    records = [{"prompt": f"{w} {w}", "answer": w} for w in words] * 4
    train = directory / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in records))
    config = accumulation_run(directory, dp_size=1, write=False)
    config["model"]["hf_path"] = str(model_dir)
    config["data"]["train"] = str(train)
    config["grpo"] = {
        "reward_functions": [f"{REWARDS}:first_word_is_answer"],
        "num_generations": 8,
        "max_completion_length": 2,
    }
    config["optimizer"] = {"lr": 0.02}
    config["trainer"] = {
        "max_num_steps": steps,
        "checkpoint_every_n_steps": steps,
        "publish_metrics_every_n_steps": 1,
        "gc_every_n_steps": None,
    }
    run_in_process(config, directory / "run")
    return train_records(directory / "run")


@pytest.mark.slow
def test_the_mean_reward_rises_on_a_verifiable_task(tmp_path: Path) -> None:
    """About 30 s of CPU: docs/rl.md plots its curve (scripts/grpo_reward_curve.py)."""
    rewards = [r["reward"] for r in learning_run(tmp_path)]
    first, last = sum(rewards[:8]) / 8, sum(rewards[-8:]) / 8
    assert last > first + 0.3, rewards
