"""Train a small byte-level decoder-only transformer on a directory of text files.

By default the text is the running Python's standard library sources, so the recipe needs no
download; ``data.train`` (and ``data.valid``) take prepared datasets instead
(``python -m runtime prepare DIR --tokenizer bytes FILES...``). Run it with
``torchrun --standalone --nproc-per-node 2 -m recipes.char_lm OUTPUT_DIR``.
"""

from __future__ import annotations

from pathlib import Path

from recipes.char_lm.config import CharLMConfig
from recipes.char_lm.data import CharBatch, build_readers
from recipes.char_lm.model import (
    CharLMEvalUnit,
    CharLMTrainUnit,
    build_pipeline_model,
    flops_per_target,
)
from recipes.common import adamw_with_schedule, setup_recipe_gangs, trainer_options
from runtime import Trainer, compile_loss
from units.lm import summed_nll_loss


def recipe(config: CharLMConfig, output_dir: Path) -> Trainer[CharBatch]:
    gangs = setup_recipe_gangs(config)
    train_reader, valid_reader, vocab_size = build_readers(
        config.data, gangs, seed=config.trainer.seed
    )
    model, pipeline = build_pipeline_model(config, gangs, vocab_size)
    optimizer, lr_scheduler = adamw_with_schedule(
        model, config.optimizer, max_num_steps=config.trainer.max_num_steps
    )
    return Trainer(
        unit=CharLMTrainUnit(
            model, compile_loss(summed_nll_loss) if config.compile else summed_nll_loss
        ),
        data_reader=train_reader,
        optimizer=optimizer,
        lr_scheduler=lr_scheduler,
        valid_units=[CharLMEvalUnit(model)] if valid_reader is not None else [],
        valid_data_readers=[valid_reader] if valid_reader is not None else [],
        pipeline=pipeline,
        **trainer_options(
            config.trainer,
            output_dir=output_dir,
            gangs=gangs,
            wandb_project=config.wandb_project,
            init_from=config.init_from,
            validates=valid_reader is not None,
            flops_per_target=lambda: flops_per_target(model, config),
        ),
    )
