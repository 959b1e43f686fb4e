"""GRPO's time per step, generation and training apart, against TRL 1.16's ``GRPOTrainer`` on
the same work: a small Llama from a config, 4 prompts a step, 8 completions each of at most 32
tokens (the EOS id never drawn, so every completion has 32), float32 on the CPU, one thread.

Usage: ``PYTHONPATH=src:. python -m benchmarks.grpo_step [--steps 6]``. Prints a Markdown table;
the first step of each side is a warm-up and is left out.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

PROMPTS, GENERATIONS, LENGTH = 4, 8, 32


def reward(completions: list[str], **kwargs: Any) -> list[float]:
    return [float(len(c)) for c in completions]


def model_and_tokenizer(directory: Path) -> tuple[Any, Any]:
    import transformers

    from tests.units.test_preference_trl import make_bos_tokenizer

    tokenizer = make_bos_tokenizer(directory / "tok")
    config = transformers.LlamaConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=128,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    # No EOS is ever drawn: every completion has LENGTH tokens on both sides.
    model.generation_config.suppress_tokens = [2]
    return model, tokenizer


def records(step: int) -> list[dict[str, str]]:
    words = ["the cat sat", "a dog ran far", "birds sang", "over green hills"]
    return [{"prompt": f"{words[(step + i) % 4]} {i}"} for i in range(PROMPTS)]


def ours(model: Any, tokenizer: Any, steps: int) -> tuple[list[float], list[float]]:
    from units.generation import TransformersGenerator
    from units.grpo import GrpoOptions, GrpoTrainUnit, RewardFunctions

    options = GrpoOptions(
        reward_functions=["reward"], num_generations=GENERATIONS, max_completion_length=LENGTH
    )
    generator = TransformersGenerator(
        model, max_completion_length=LENGTH, temperature=1.0, top_p=1.0, eos_ids=[2], pad_id=2,
        seed=0,
    )  # fmt: skip
    unit = GrpoTrainUnit(
        model, options, generator=generator, rewards=RewardFunctions.of({"reward": reward}),
        decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True), eos_ids=[2], pad_id=2,
    )  # fmt: skip
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    class Batch:
        def __init__(self, step: int) -> None:
            self.prompts = [r["prompt"] for r in records(step)]
            self.prompt_ids = [tokenizer(p)["input_ids"] for p in self.prompts]
            self.columns: dict[str, list[Any]] = {}

    generation, training = [], []
    for step in range(steps):
        unit.set_step_nr(step + 1)
        start = time.perf_counter()
        rollout = unit.rollout(Batch(step))
        middle = time.perf_counter()
        loss, count = unit.loss(rollout)
        (loss / count).backward()
        optimizer.step()
        optimizer.zero_grad()
        end = time.perf_counter()
        assert rollout.completion_ids.size(1) == LENGTH
        generation.append(middle - start)
        training.append(end - middle)
    return generation[1:], training[1:]


def trl_side(model: Any, tokenizer: Any, steps: int, directory: Path) -> tuple[list[float], ...]:
    import datasets
    import trl

    model.save_pretrained(directory / "model")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = trl.GRPOTrainer(
            model=str(directory / "model"),
            reward_funcs=[reward],
            args=trl.GRPOConfig(
                output_dir=str(directory / "trl"),
                report_to=[],
                use_cpu=True,
                bf16=False,
                per_device_train_batch_size=PROMPTS * GENERATIONS,
                num_generations=GENERATIONS,
                max_completion_length=LENGTH,
            ),
            train_dataset=datasets.Dataset.from_list(records(0)),
            processing_class=tokenizer,
        )
    policy = trainer.model
    policy.generation_config.suppress_tokens = [2]
    trainer.current_gradient_accumulation_steps = 1
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-4)
    policy.train()
    generation, training = [], []
    for step in range(steps):
        trainer._step = step
        start = time.perf_counter()
        inputs = trainer._prepare_inputs([r for r in records(step) for _ in range(GENERATIONS)])
        middle = time.perf_counter()
        loss = trainer.compute_loss(policy, inputs)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        end = time.perf_counter()
        assert inputs["completion_ids"].size(1) == LENGTH
        generation.append(middle - start)
        training.append(end - middle)
    return generation[1:], training[1:]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    steps = parser.parse_args().steps
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as name:
        directory = Path(name)
        model, tokenizer = model_and_tokenizer(directory)
        theirs = trl_side(copy.deepcopy(model), tokenizer, steps, directory)
        mine = ours(model, tokenizer, steps)
    print("| per step, median (s) | generation | training |")
    print("|---|---|---|")
    for label, (generation, training) in (("trainkit", mine), ("TRL 1.16", theirs)):
        print(
            f"| {label} | {statistics.median(generation):.3f} | {statistics.median(training):.3f} |"
        )


if __name__ == "__main__":
    main()
