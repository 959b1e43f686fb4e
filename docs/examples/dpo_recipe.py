"""DPO on your own preference pairs, composed from trainkit's installed packages only:

torchrun --standalone --nproc-per-node 2 dpo_recipe.py OUTPUT_DIR --config model_dir=DIR pairs=F
python -m runtime export OUTPUT_DIR DEST --format hf
"""

import json
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from checkpoint import CheckpointManager
from gangs import Gangs, setup_gangs
from models.blocks import decoder_layer_types
from models.hf import hf_model, write_hf_files
from runtime import MapDataReader, Trainer, load_initial_weights, main, parallelize_model
from runtime.data.text import (
    PreferenceBatch,
    PreferenceDataset,
    collate_preference_pairs,
    load_tokenizer,
)
from units.preference import DpoTrainUnit, PreferenceOptions
from units.reference import FrozenReference


@dataclass
class Config:
    model_dir: Path
    """A Hugging Face causal LM directory: config.json, safetensors, tokenizer.json."""
    pairs: Path
    """A JSONL file of {"prompt": ..., "chosen": ..., "rejected": ...} records."""
    max_len: int = 1024
    batch_size: int = 4
    lr: float = 5e-7
    beta: float = 0.1
    max_num_steps: int = 1000
    checkpoint_every_n_steps: int = 500
    publish_every_n_steps: int = 10


def sharded_model(model_dir: Path, gangs: Gangs, *, frozen: bool = False) -> torch.nn.Module:
    # Built on the meta device, so that each rank allocates its FSDP2 shards only.
    model, init_fn, _, _ = hf_model(model_dir)
    model.requires_grad_(not frozen)
    return parallelize_model(
        model, gangs, kind="fsdp", block_types=decoder_layer_types(model), init_fn=init_fn, seed=0
    )


def recipe(config: Config, output_dir: Path) -> Trainer[PreferenceBatch]:
    gangs = setup_gangs(force_process_group=True)  # FSDP2 needs a process group, even alone
    policy = sharded_model(config.model_dir, gangs)  # its weights: the Trainer's init_from
    # DPO's reference: a frozen second copy, sharded as the policy, with its initial weights.
    reference = sharded_model(config.model_dir, gangs, frozen=True)
    load_initial_weights(reference, config.model_dir, gangs=gangs)
    tokenizer_file = config.model_dir / "tokenizer.json"
    tokenizer = load_tokenizer(tokenizer_file)
    if gangs.root.rank == 0:  # what the export writes beside the weights: config and tokenizer
        hf_config = json.loads((config.model_dir / "config.json").read_text())
        write_hf_files(output_dir, config=hf_config, tokenizer_path=tokenizer_file)
    # The pairs as JSONL: a prepared dataset (python -m runtime prepare) holds packed text only.
    pairs = PreferenceDataset(config.pairs, tokenizer=tokenizer, max_len=config.max_len)
    reader = MapDataReader(
        dataset=pairs,
        batch_size=config.batch_size,
        gang=gangs.dp,
        collate=partial(collate_preference_pairs, pad_id=tokenizer.eos_id),
        shuffle=False,  # the dataset's order groups pairs of similar lengths: less padding
    )
    return Trainer(
        unit=DpoTrainUnit(policy, FrozenReference(reference), PreferenceOptions(beta=config.beta)),
        data_reader=reader,
        optimizer=torch.optim.AdamW(policy.parameters(), lr=config.lr),
        checkpoint_manager=CheckpointManager(output_dir / "checkpoints", gangs),
        gangs=gangs,
        init_from=config.model_dir,
        max_num_steps=config.max_num_steps,
        checkpoint_every_n_steps=config.checkpoint_every_n_steps,
        publish_metrics_every_n_steps=config.publish_every_n_steps,
        metrics_dir=output_dir / "metrics",
    )


if __name__ == "__main__":
    main(recipe, Config)
