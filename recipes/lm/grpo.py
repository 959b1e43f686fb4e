"""``task=grpo`` in ``recipes.lm``: the prompts' reader and the GRPO unit, with its generator
(the policy's own ``generate``), its reward functions and, with ``grpo.beta > 0``, the frozen
reference that DPO uses too (the base with the adapters disabled under LoRA)."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

from torch.distributed.tensor import DTensor

from gangs import Gangs
from recipes.lm.config import LMConfig
from recipes.lm.model import BuiltModel
from recipes.lm.units import build_reference
from runtime import DataReader, MapDataReader, SyncMode
from runtime.data.repeat import RepeatingDataReader
from runtime.data.text import PromptDataset, Tokenizer, collate_prompts
from units.generation import TransformersGenerator
from units.grpo import GrpoTrainUnit, RewardFunctions
from units.reference import ModelReference


def grpo_reader(config: LMConfig, tokenizer: Tokenizer, gangs: Gangs) -> DataReader[Any]:
    """``data.batch_size`` prompts a micro-batch on each DP rank, shuffled each epoch, each
    step's served ``grpo.num_iterations`` times (the unit reuses its completions); a prompt
    longer than ``data.seq_len - grpo.max_completion_length`` tokens is left out."""
    data = config.data
    assert data.train is not None
    dataset = PromptDataset(
        data.train,
        tokenizer=tokenizer,
        max_prompt_len=data.seq_len - config.grpo.max_completion_length,
        prompt_field=config.grpo.prompt_field,
        skip_bad_lines=data.skip_bad_lines,
    )
    reader = MapDataReader(
        dataset=dataset,
        batch_size=data.batch_size,
        collate=partial(collate_prompts, num_bad_lines=dataset.num_bad_lines),
        gang=gangs.dp,
        num_accumulate=data.num_accumulate,
        shuffle=True,
        seed=config.trainer.seed,
        drop_remainder=True,
        sync_mode=SyncMode.UNTIL_FIRST,
    )
    num_iterations = config.grpo.num_iterations
    return reader if num_iterations == 1 else RepeatingDataReader(reader, num_iterations)


def grpo_unit(
    config: LMConfig,
    gangs: Gangs,
    tokenizer: Tokenizer,
    built: BuiltModel,
    init_from: Path | None,
) -> GrpoTrainUnit:
    options = config.grpo
    rewards = RewardFunctions(options.reward_functions, options.reward_weights)
    eos_ids = _eos_ids(tokenizer, built.hf_config)
    pad_id = tokenizer.eos_id
    special = {*eos_ids, pad_id, tokenizer.bos_id}
    generator = TransformersGenerator(
        built.model,
        max_completion_length=options.max_completion_length,
        temperature=options.temperature,
        top_p=options.top_p,
        eos_ids=eos_ids,
        pad_id=pad_id,
        seed=config.trainer.seed,
        # A sharded model's forwards are collectives: every rank runs as many (FSDP2, TP).
        synced=any(isinstance(p, DTensor) for p in built.model.parameters()),
    )
    reference = None
    if options.beta > 0:
        reference = build_reference(config, gangs, tokenizer, built, init_from)
        assert isinstance(reference, ModelReference)
    return GrpoTrainUnit(
        built.model,
        options,
        generator=generator,
        rewards=rewards,
        # As TRL decodes: without special tokens.
        decode=lambda ids: tokenizer.decode([i for i in ids if i not in special]),
        eos_ids=eos_ids,
        pad_id=pad_id,
        reference=reference,
        dp_gang=gangs.dp,
        max_num_steps=config.trainer.max_num_steps,
    )


def _eos_ids(tokenizer: Tokenizer, hf_config: dict[str, Any]) -> list[int]:
    """The tokenizer's EOS and those of the model's config (a chat model ends turns with its
    own)."""
    ids = [tokenizer.eos_id]
    configured = hf_config.get("eos_token_id")
    for token in configured if isinstance(configured, list) else [configured]:
        if isinstance(token, int) and token not in ids:
            ids.append(token)
    return ids
