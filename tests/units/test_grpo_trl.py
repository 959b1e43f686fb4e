"""The GRPO unit against TRL 1.16's ``GRPOTrainer`` (a test-only dependency): the same tiny
Llama, the same prompts and the same completions (TRL's ``rollout_func`` draws them from a fixed
seed; the unit gets what TRL got through a fixed generator), the same reward functions, float32
on the CPU. The loss and every metric agree within 1e-5 at each of 3 optimizer steps, and so do
the weights afterwards. TRL's own ``_prepare_inputs`` and ``compute_loss`` run each step; both
sides take the same AdamW step."""

from __future__ import annotations

import copy
import random
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.units.test_grpo import TRL_METRICS
from tests.units.test_preference_trl import (
    WORDS,
    assert_same_weights,
    make_bos_tokenizer,
    tiny_llama,
)
from units.grpo import GrpoOptions, GrpoTrainUnit, RewardFunctions
from units.reference import FrozenReference

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

NUM_STEPS = 3
NUM_GENERATIONS = 3
PROMPTS_PER_STEP = 2
MAX_COMPLETION_LENGTH = 6
LR = 1e-2
TOLERANCE = 1e-5
EOS = 2


def count_reward(completions: list[str], **kwargs: Any) -> list[float]:
    """How many times "the" appears."""
    return [float(text.split().count("the")) for text in completions]


def answer_reward(completions: list[str], answer: list[str], **kwargs: Any) -> list[float | None]:
    """1 if the completion holds the record's answer; None (not scored) for an empty one."""
    return [
        None if not text else float(a in text.split())
        for text, a in zip(completions, answer, strict=False)
    ]


def records(count: int) -> list[dict[str, str]]:
    rng = random.Random(5)
    return [
        {
            "prompt": " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 5))),
            "answer": rng.choice(["the", "a", "cat", "dog"]),
        }
        for _ in range(count)
    ]


@dataclass
class FixedRollouts:
    """TRL's ``rollout_func``: random word tokens, some ended by EOS, some cut at the maximum
    length; it records what it returned, which the unit's generator then replays."""

    tokenizer: Any
    calls: list[tuple[list[list[int]], list[list[int]]]] = field(default_factory=list)

    def __call__(self, prompts: list[str], trainer: Any) -> dict[str, Any]:
        rng = random.Random(len(self.calls))
        prompt_ids = [self.tokenizer(p)["input_ids"] for p in prompts]
        completions = []
        for _ in prompts:
            words = rng.choices(["the", "a", "cat", "dog", "sat"], k=MAX_COMPLETION_LENGTH)
            ids = self.tokenizer(" " + " ".join(words), add_special_tokens=False)["input_ids"]
            length = rng.randint(0, MAX_COMPLETION_LENGTH)
            completions.append([*ids[:length], EOS] if length < MAX_COMPLETION_LENGTH else ids)
        self.calls.append((prompt_ids, completions))
        return {"prompt_ids": prompt_ids, "completion_ids": completions, "logprobs": None}

    def generate(
        self, prompt_ids: list[list[int]], *, num_generations: int, step_nr: int
    ) -> list[list[int]]:
        expected, completions = self.calls.pop(0)
        assert [ids for ids in prompt_ids for _ in range(num_generations)] == expected
        return completions


@dataclass
class Prompts:
    prompts: list[Any]
    prompt_ids: list[list[int]]
    columns: dict[str, list[Any]]


CASES = {
    # TRL's default loss, with KL, clipping (clip-higher) and old log-probs: in make test.
    "dapo": {"loss_type": "dapo", "beta": 0.04, "num_iterations": 2, "epsilon_high": 0.28},
    "grpo": {"loss_type": "grpo", "beta": 0.0, "num_iterations": 1, "scale_rewards": "batch"},
    "bnpo": {"loss_type": "bnpo", "beta": 0.04, "num_iterations": 2, "scale_rewards": "none"},
    "dr_grpo": {"loss_type": "dr_grpo", "beta": 0.0, "num_iterations": 3},
}


@pytest.mark.parametrize(
    "case",
    [
        "dapo",
        pytest.param("grpo", marks=pytest.mark.slow),
        pytest.param("bnpo", marks=pytest.mark.slow),
        pytest.param("dr_grpo", marks=pytest.mark.slow),
    ],
)
def test_grpo_matches_trl_grpo_trainer(tmp_path: Path, case: str) -> None:
    options: dict[str, Any] = {"temperature": 0.7, "epsilon": 0.1, **CASES[case]}
    data = records(NUM_STEPS * PROMPTS_PER_STEP)
    hf_tokenizer = make_bos_tokenizer(tmp_path / "tok")
    policy = tiny_llama(hf_tokenizer.vocab_size)
    mine, reference = copy.deepcopy(policy), copy.deepcopy(policy).requires_grad_(False)
    # TRL builds its reference from the policy's path.
    policy.save_pretrained(tmp_path / "model")
    rollouts = FixedRollouts(hf_tokenizer)
    weights = [1.0, 0.5]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = trl.GRPOTrainer(
            model=str(tmp_path / "model"),
            reward_funcs=[count_reward, answer_reward],
            args=trl.GRPOConfig(
                output_dir=str(tmp_path / "trl"),
                report_to=[],
                use_cpu=True,
                bf16=False,
                per_device_train_batch_size=PROMPTS_PER_STEP * NUM_GENERATIONS,
                num_generations=NUM_GENERATIONS,
                max_completion_length=MAX_COMPLETION_LENGTH,
                reward_weights=weights,
                **options,
            ),
            train_dataset=datasets.Dataset.from_list(data),
            processing_class=hf_tokenizer,
            rollout_func=rollouts,
        )
    trainer.current_gradient_accumulation_steps = 1
    policy = trainer.model
    theirs = []
    optimizer = torch.optim.AdamW(policy.parameters(), lr=LR)
    policy.train()
    for step in range(NUM_STEPS):
        trainer._step = step
        trainer._metrics["train"].clear()
        step_records = data[step * PROMPTS_PER_STEP : (step + 1) * PROMPTS_PER_STEP]
        inputs = trainer._prepare_inputs([r for r in step_records for _ in range(NUM_GENERATIONS)])
        loss = trainer.compute_loss(policy, inputs)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        metrics = {name: values[-1] for name, values in trainer._metrics["train"].items()}
        theirs.append({"loss": loss.item(), **metrics})

    unit = GrpoTrainUnit(
        mine,
        GrpoOptions(
            reward_functions=["count_reward", "answer_reward"],
            reward_weights=weights,
            num_generations=NUM_GENERATIONS,
            max_completion_length=MAX_COMPLETION_LENGTH,
            **options,
        ),
        generator=rollouts,
        rewards=RewardFunctions.of(
            {"count_reward": count_reward, "answer_reward": answer_reward}, weights
        ),
        decode=lambda ids: hf_tokenizer.decode(ids, skip_special_tokens=True),
        eos_ids=[EOS],
        pad_id=EOS,
        reference=FrozenReference(reference) if options["beta"] > 0 else None,
    )
    ours = []
    optimizer = torch.optim.AdamW(mine.parameters(), lr=LR)
    for step in range(NUM_STEPS):
        step_records = data[step * PROMPTS_PER_STEP : (step + 1) * PROMPTS_PER_STEP]
        batch = Prompts(
            [r["prompt"] for r in step_records],
            [hf_tokenizer(r["prompt"])["input_ids"] for r in step_records],
            {"answer": [r["answer"] for r in step_records]},
        )
        unit.set_step_nr(step + 1)
        loss, count = unit(batch)
        assert count is not None
        (loss / count).backward()
        optimizer.step()
        optimizer.zero_grad()
        metrics = unit.metric_bag.sync_and_compute(_single_gang())
        unit.metric_bag.reset_non_persistent_metrics()
        ours.append({"loss": loss.item() / count, **metrics})

    compared = 0
    for step, (mine_step, trl_step) in enumerate(zip(ours, theirs, strict=True)):
        for name, value in trl_step.items():
            if name in mine_step:
                assert mine_step[name] == pytest.approx(value, abs=TOLERANCE), (step, name)
                compared += 1
    names = {name for step in theirs for name in step if name in ours[0]}
    expected = {
        *TRL_METRICS,
        "rewards/count_reward/mean",
        "rewards/answer_reward/mean",
    } | ({"kl"} if options["beta"] > 0 else set())
    assert expected <= names, expected - names
    # On-policy the clipped loss is 0 in value (the advantages sum to 0), not in gradient.
    initial = reference.state_dict()
    assert any(not torch.equal(initial[k], v) for k, v in mine.state_dict().items())
    if options["num_iterations"] > 1:
        assert any(step["clip_ratio/region_mean"] > 0 for step in theirs)
    assert compared >= NUM_STEPS * 5
    assert_same_weights(mine, policy)


def _single_gang() -> Any:
    from gangs import FakeGang

    return FakeGang()
