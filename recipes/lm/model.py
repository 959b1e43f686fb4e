"""The model of ``recipes.lm``: a Hugging Face directory's or the project's Llama, with LoRA and
expert parallelism as the config asks, built on meta and parallelized."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gangs import Gangs
from models.blocks import decoder_layer_types
from models.flops import flops_per_token
from models.hf import hf_model
from models.llama import Llama, hf_config, llama_args, tensor_parallel_plan
from models.lora import LoraAdapters, apply_lora
from models.moe import (
    ExpertBiasUpdate,
    MoeLMTrainUnit,
    apply_expert_parallel,
    correction_biases,
    expert_modules,
)
from recipes.common import PipelineSplit, parallel_options
from recipes.lm.config import LMConfig
from runtime import InitSource, parallelize_model
from runtime.data.text import Tokenizer
from runtime.parallel.pipeline import Pipeline
from runtime.parallel.sequence import apply_sequence_parallel
from trainkit_utils.modules import unwrap_model
from units import TrainUnit
from units.lm import LMTrainUnit


@dataclass
class BuiltModel:
    model: nn.Module
    block_types: tuple[type[nn.Module], ...]
    flops_per_token: float
    hf_config: dict[str, Any]
    lora: LoraAdapters | None = None
    pipeline: Pipeline | None = None
    """The pipeline over this rank's stages with gang.pp_size > 1; ``model`` is its part."""


def build_model(
    config: LMConfig, gangs: Gangs, tokenizer: Tokenizer, *, frozen: bool = False
) -> BuiltModel:
    """Build on meta, then shard, wrap and initialize (``parallelize_model``); tied input and
    output embeddings stay one weight in every layout. ``frozen``: no parameter requires a
    gradient (a reference model), no LoRA and no DDP wrapper."""
    if config.model.hf_path is not None:
        model, init_fn, plan, hf = hf_model(config.model.hf_path, tp=gangs.tp.size > 1)
    else:
        assert config.model.name is not None
        args = llama_args(
            config.model.name, vocab_size=tokenizer.vocab_size, max_seq_len=config.data.seq_len
        )
        with torch.device("meta"):
            model = Llama(args)
        init_fn, plan = model.init_module, tensor_parallel_plan(model)
        hf = hf_config(args, bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id)
    block_types = decoder_layer_types(model)
    if gangs.tp.size > 1 and not plan:
        raise ValueError(
            f"{type(model).__name__} has no tensor parallel plan (its config has no "
            f"base_model_tp_plan that splits a layer), but gang.tp_size is {gangs.tp.size}. "
            "Use gang.tp_size=1: DDP, FSDP2 and HSDP train it."
        )
    lora = None
    if frozen:
        model.requires_grad_(False)
    elif config.lora.rank is not None:
        lora, init_fn = apply_lora(model, config.lora, init_fn)
    flops = flops_per_token(model, hf, config.data.seq_len)
    model = whole = apply_sequence_parallel(model, gangs, config.data.seq_len)
    split = None
    if gangs.pp.size > 1 and not frozen:
        # This rank keeps its stages' part of the model, under the whole model's names.
        split = PipelineSplit(model, gangs, config.pipeline)
        model = split.part
    # On the part only: a stage's DP ranks split the experts of its own layers (a stage of
    # dense layers alone has none, where other stages have).
    dense_stage = split is not None and not expert_modules(model) and bool(expert_modules(whole))
    expert_params = [] if dense_stage else apply_expert_parallel(model, gangs)
    model = parallelize_model(
        model,
        gangs,
        **parallel_options(config, gangs),
        block_types=block_types,
        tp_plan=plan,
        init_fn=init_fn,
        expert_params=expert_params,
        pipeline_stages=() if split is None else split.stages,
    )
    pipeline = None if split is None else split.pipeline()
    return BuiltModel(model, block_types, flops, hf, lora, pipeline)


def bias_update(rate: float, unit: TrainUnit[Any], gangs: Gangs) -> ExpertBiasUpdate:
    """The aux-loss-free load balancing of ``model.expert_bias_update_rate``."""
    if not isinstance(unit, LMTrainUnit):
        raise ValueError(
            f"model.expert_bias_update_rate ({rate}) balances the experts of task=pretrain or "
            "task=sft runs. Leave it unset (null) for a preference task."
        )
    load = unit.expert_load if isinstance(unit, MoeLMTrainUnit) else None
    biases = correction_biases(unwrap_model(unit.model))
    # Under pipeline parallelism each stage moves the biases of its own layers (none on a
    # stage of dense layers), from its own counts: the model has them if any stage has.
    found = bool(biases) if gangs.pp.size == 1 else any(gangs.pp.all_gather_objects(bool(biases)))
    if load is None or not found:
        raise ValueError(
            f"model.expert_bias_update_rate ({rate}) moves the correction bias of a mixture of "
            f"experts' routers (DeepSeek-V3's), but {type(unwrap_model(unit.model)).__name__} "
            "has none. Leave it unset (null)."
        )
    # The load over every rank's tokens: DP (x SP).
    return ExpertBiasUpdate(load, biases, gangs.dp_sp, rate)


def lora_trainer_options(lora: LoraAdapters, base: Path) -> dict[str, Any]:
    """The Trainer's ``init_from`` (the base weights ``base`` holds, under the adapted model's
    names) and ``checkpoint_exclude`` (the frozen base, loaded from ``base`` again on resume)."""
    source = InitSource(base, rename=lora.base_rename, skip=list(lora.adapter_patterns))
    return {"init_from": source, "checkpoint_exclude": list(lora.frozen)}
