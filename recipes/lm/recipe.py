"""Train or fine-tune a causal language model on your text files.

The model is a Hugging Face causal LM from a local directory (``model.hf_path=DIR``: its
``config.json``, safetensors and ``tokenizer.json``) or the project's own Llama-style model
(``model.name=llama_debug|llama_125m|llama_1b|llama_8b``). The data is JSONL, plain text or Parquet
(``data.train=``, ``data.valid=``, or ``data.mixture=[{path: ..., weight: ...}]``), tokenized in
worker processes and packed into sequences (``task=pretrain``), or prompt/response pairs with the loss
on the responses only (``task=sft``), or preference pairs (``task=dpo|simpo|orpo|cpo``, see
:mod:`units.preference`), or prompts for online RL with reward functions (``task=grpo``, see
:mod:`units.grpo` and :mod:`recipes.lm.grpo`). Run it with
``torchrun --standalone --nproc-per-node 8 -m recipes.lm OUTPUT_DIR --config model.hf_path=DIR
data.train=train.jsonl``; ``python -m runtime export OUTPUT_DIR DEST --format hf`` writes a
Hugging Face directory of the result. ``lora.rank=N`` fine-tunes LoRA adapters instead (peft; see
:mod:`models.lora`), which ``--format peft`` exports.

This module assembles the parts: the config (:mod:`recipes.lm.config`), the data
(:mod:`recipes.lm.data`), the model (:mod:`recipes.lm.model`) and the units
(:mod:`recipes.lm.units`; GRPO's reader and unit: :mod:`recipes.lm.grpo`) into a Trainer.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from gangs import Gangs
from models.hf import write_hf_files
from recipes.common import adamw_with_schedule, setup_recipe_gangs, trainer_options
from recipes.lm.config import LMConfig
from recipes.lm.data import (
    PreferenceData,
    build_readers,
    load_recipe_tokenizer,
    preference_data,
)
from recipes.lm.grpo import grpo_reader, grpo_unit
from recipes.lm.model import BuiltModel, bias_update, build_model, lora_trainer_options
from recipes.lm.units import PrecomputeContext, build_units
from runtime import DataReader, Trainer
from runtime.data.text import Tokenizer
from runtime.data.text.reference_logps import autocast_of
from units.preference import PREFERENCE_TASKS

log = logging.getLogger(__name__)


def recipe(config: LMConfig, output_dir: Path) -> Trainer[Any]:
    gangs = setup_recipe_gangs(config)
    return build_trainer(config, output_dir, gangs)


def build_trainer(config: LMConfig, output_dir: Path, gangs: Gangs) -> Trainer[Any]:
    """The recipe's Trainer on gangs already made (``config.gang`` must describe them)."""
    tokenizer = load_recipe_tokenizer(config)
    built = build_model(config, gangs, tokenizer)
    _describe(config, output_dir, gangs, tokenizer, built)
    pairs = preference_data(config, tokenizer) if config.task in PREFERENCE_TASKS else None
    train_reader, valid_reader = _readers(config, tokenizer, gangs, pairs)
    optimizer, lr_scheduler = adamw_with_schedule(
        built.model, config.optimizer, max_num_steps=config.trainer.max_num_steps
    )
    init_from = config.init_from
    if init_from is None and config.model.hf_path is not None and not config.model.from_scratch:
        init_from = config.model.hf_path
    options = trainer_options(
        config.trainer,
        output_dir=output_dir,
        gangs=gangs,
        wandb_project=config.wandb_project,
        init_from=init_from,
        flops_per_target=lambda: built.flops_per_token,
        validates=valid_reader is not None,
    )
    if built.lora is not None:
        assert init_from is not None  # LMConfig.validate: LoRA needs the base's weights
        options |= lora_trainer_options(built.lora, init_from)
        if gangs.root.rank == 0:
            built.lora.write_adapter_config(init_from, output_dir)
    precompute = None
    if pairs is not None:
        autocast = autocast_of(gangs.root.device, options["dtype"], options["amp"])
        precompute = PrecomputeContext(pairs, output_dir, init_from, autocast, tokenizer.eos_id)
    train_unit: Any
    if config.task == "grpo":
        train_unit, valid_unit = grpo_unit(config, gangs, tokenizer, built, init_from), None
    else:
        train_unit, valid_unit = build_units(
            config, gangs, tokenizer, built, init_from, precompute=precompute
        )
    if config.task in PREFERENCE_TASKS and valid_reader is not None:
        options["score_metric_name"] = "loss"
    if config.model.expert_bias_update_rate is not None:
        options["callbacks"] = [
            bias_update(config.model.expert_bias_update_rate, train_unit, gangs)
        ]
    trainer = Trainer(
        unit=train_unit,
        data_reader=train_reader,
        optimizer=optimizer,
        lr_scheduler=lr_scheduler,
        valid_units=[valid_unit] if valid_unit is not None and valid_reader is not None else [],
        valid_data_readers=[valid_reader] if valid_reader is not None else [],
        pipeline=built.pipeline,
        **options,
    )
    if config.task == "grpo":
        # The completions kept for num_iterations > 1, so that a resume reuses them.
        trainer.register_stateful("grpo_rollouts", train_unit)
    return trainer


def _readers(
    config: LMConfig, tokenizer: Tokenizer, gangs: Gangs, pairs: PreferenceData | None
) -> tuple[DataReader[Any], DataReader[Any] | None]:
    if config.task == "grpo":
        return grpo_reader(config, tokenizer, gangs), None
    return build_readers(config, tokenizer, gangs, pairs)


def _describe(
    config: LMConfig, output_dir: Path, gangs: Gangs, tokenizer: Tokenizer, built: BuiltModel
) -> None:
    """Log the model's size; rank 0 writes the Hugging Face files an export needs."""
    num_params = sum(p.numel() for p in built.model.parameters())
    log.info("Model: %s, %d parameters.", type(built.model).__name__, num_params)
    if gangs.root.rank == 0:
        write_hf_files(
            output_dir,
            config=built.hf_config,
            tokenizer_path=getattr(tokenizer, "path", None),
            model_dir=config.model.hf_path,
        )
