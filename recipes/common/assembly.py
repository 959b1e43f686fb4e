"""How the shared config sections become the parts of a Trainer: the gangs, the data-parallel
layout, the optimizer and its schedule, and the Trainer's keyword arguments."""

from __future__ import annotations

import math
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal, Protocol, TypedDict, cast

import torch
from torch import nn

from checkpoint import CheckpointManager
from gangs import Gangs, setup_gangs
from models.pipeline import split_model
from recipes.common.sections import (
    FsdpSection,
    GangSection,
    OptimizerSection,
    PipelineSection,
    TrainerSection,
)
from runtime import DataParallelKind, PatienceEarlyStopper, TorchProfiler
from runtime.parallel.pipeline import Pipeline, stage_ids


class ParallelConfig(Protocol):
    """The parts of a recipe's config that choose its data-parallel layout."""

    gang: GangSection
    data_parallel: Literal["auto", "ddp", "fsdp", "hsdp"]


def shards_parameters(config: ParallelConfig) -> bool:
    """Whether ``config`` asks for FSDP2 or HSDP, on any number of processes: ``fsdp``,
    ``hsdp``, or ``auto`` with ``gang.dp_shard_size`` (``auto`` with TP needs several)."""
    return config.data_parallel in ("fsdp", "hsdp") or (
        config.data_parallel == "auto" and config.gang.dp_shard_size is not None
    )


def setup_recipe_gangs(config: ParallelConfig) -> Gangs:
    """The gangs of ``config.gang``. FSDP2 and HSDP get a process group and a DeviceMesh on one
    process too, so that ``data_parallel=fsdp`` means FSDP2 (its mixed precision, its sharded
    checkpoints) on one GPU as on many; the recipe's ``main`` destroys the group on every exit."""
    return setup_gangs(
        tp_size=config.gang.tp_size,
        dp_shard_size=config.gang.dp_shard_size,
        timeout=timedelta(minutes=config.gang.timeout_minutes),
        force_process_group=shards_parameters(config),
        # Expert parallelism, in recipes whose gang section has it (recipes.lm).
        ep_size=getattr(config.gang, "ep_size", 1),
        pp_size=config.gang.pp_size,
        # Sequence parallelism, in recipes whose gang section has it (recipes.lm).
        sp_size=getattr(config.gang, "sp_size", 1),
    )


class PipelineSplit:
    """A model split for pipeline parallelism: this rank's stages, its part (the module it
    trains: see :mod:`models.pipeline`) and the stages' ids. Split on meta, parallelize the part,
    then make the :meth:`pipeline`."""

    def __init__(
        self,
        model: nn.Module,
        gangs: Gangs,
        section: PipelineSection,
        split: Callable[..., tuple[list[nn.Module], nn.Module]] = split_model,
    ) -> None:
        """``split``: :func:`models.pipeline.split_model`'s signature, for a model of the
        recipe's own (built with :func:`models.pipeline.split_by_layers`)."""
        self.ids = stage_ids(
            section.schedule,
            pp_rank=gangs.pp.rank,
            pp_size=gangs.pp.size,
            stages_per_rank=section.stages_per_rank,
        )
        num_stages = gangs.pp.size * section.stages_per_rank
        self.stages, self.part = split(model, self.ids, num_stages, section.split)
        if not any(True for _ in self.part.parameters()):
            raise ValueError(
                f"PP rank {gangs.pp.rank} holds stages {self.ids} without any weight (their "
                f"layers by pipeline.split: {section.split}). Give every rank a layer."
            )
        self._gangs = gangs
        self._section = section

    def pipeline(self) -> Pipeline:
        """The pipeline over the stages, once the part is materialized."""
        return Pipeline(
            stages=self.stages,
            part=self.part,
            ids=self.ids,
            gangs=self._gangs,
            schedule=self._section.schedule,
            num_microbatches=self._section.microbatches(self._gangs.pp.size),
        )


def data_parallel_kind(config: ParallelConfig, gangs: Gangs) -> DataParallelKind:
    """``auto``: HSDP with gang.dp_shard_size, else FSDP2 with TP or with pipeline stages over
    DP ranks, else DDP."""
    if config.data_parallel != "auto":
        return config.data_parallel
    if config.gang.dp_shard_size is not None:
        return "hsdp"
    return "fsdp" if gangs.tp.size > 1 or (gangs.pp.size > 1 and gangs.dp.size > 1) else "ddp"


class CheckpointingOptions(Protocol):
    """The activation checkpointing switches of a recipe's model section."""

    @property
    def activation_checkpointing(self) -> bool: ...
    @property
    def activation_checkpointing_every_n(self) -> int: ...


class BuildConfig(ParallelConfig, Protocol):
    """The parts of a recipe's config that say how its model is sharded and wrapped."""

    fsdp: FsdpSection
    trainer: TrainerSection
    compile: bool

    @property
    def model(self) -> CheckpointingOptions: ...


class ParallelOptions(TypedDict):
    """``parallelize_model``'s keyword arguments that come from the shared config sections."""

    kind: DataParallelKind
    seed: int
    param_dtype: torch.dtype | None
    reduce_dtype: torch.dtype | None
    compile: bool
    activation_checkpointing_every_n: int | None


def parallel_options(config: BuildConfig, gangs: Gangs) -> ParallelOptions:
    """``parallelize_model``'s keyword arguments from ``config``: the layout, seed, FSDP2 mixed
    precision, compilation and activation checkpointing."""
    return {
        "kind": data_parallel_kind(config, gangs),
        "seed": config.trainer.seed,
        "param_dtype": dtype_of(config.fsdp.param_dtype),
        "reduce_dtype": dtype_of(config.fsdp.reduce_dtype),
        "compile": config.compile,
        "activation_checkpointing_every_n": (
            config.model.activation_checkpointing_every_n
            if config.model.activation_checkpointing
            else None
        ),
    }


def dtype_of(name: str | None) -> torch.dtype | None:
    return None if name is None else cast(torch.dtype, getattr(torch, name))


def warmup_cosine(warmup_steps: int, total_steps: int) -> Callable[[int], float]:
    """Linear warmup, then cosine decay to a tenth of the peak learning rate."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))

    return factor


def adamw_with_schedule(
    model: nn.Module, config: OptimizerSection, *, max_num_steps: int
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=config.lr, betas=config.betas, weight_decay=config.weight_decay
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, warmup_cosine(config.warmup_steps, max_num_steps)
    )
    return optimizer, scheduler


def precision_options(t: TrainerSection, device: torch.device) -> dict[str, Any]:
    """The Trainer's ``dtype`` and ``amp``: bf16 autocast with TF32 on CUDA unless the config says
    otherwise, float32 on a CPU. Sets torch's float32 matmul precision on CUDA (``tf32``)."""
    cuda = device.type == "cuda"
    amp = cuda if t.amp is None else t.amp
    dtype = t.dtype or ("bfloat16" if amp else "float32")
    if cuda:
        torch.set_float32_matmul_precision("high" if t.tf32 else "highest")
    return {"dtype": getattr(torch, dtype), "amp": amp}


def trainer_options(
    t: TrainerSection,
    *,
    output_dir: Path,
    gangs: Gangs,
    wandb_project: str | None,
    init_from: Path | None,
    flops_per_target: Callable[[], float],
    validates: bool = True,
) -> dict[str, Any]:
    """The Trainer's keyword arguments that come from the trainer section and OUTPUT_DIR.

    Without validation (``validates=False``) nothing ranks checkpoints or stops early.
    """
    early_stopper = (
        PatienceEarlyStopper(
            t.early_stop_patience, min_delta=t.early_stop_min_delta, lower_better=True
        )
        if t.early_stop_patience is not None and validates
        else None
    )
    profiler = (
        TorchProfiler(
            t.profile_skip_steps, t.profile_record_steps, output_dir / "profile", gangs.root
        )
        if t.profile
        else None
    )
    options: dict[str, Any] = {
        "checkpoint_manager": CheckpointManager(output_dir / "checkpoints", gangs),
        "gangs": gangs,
        **precision_options(t, gangs.root.device),
        "max_num_steps": t.max_num_steps,
        "max_num_data_epochs": t.max_num_data_epochs,
        "validate_every_n_steps": t.validate_every_n_steps if validates else None,
        "validate_at_start": t.validate_at_start and validates,
        "checkpoint_every_n_steps": t.checkpoint_every_n_steps,
        "keep_last_n_checkpoints": t.keep_last_n_checkpoints,
        "keep_best_n_checkpoints": t.keep_best_n_checkpoints if validates else None,
        "keep_checkpoint_every_n_steps": t.keep_checkpoint_every_n_steps,
        "async_checkpoint": t.async_checkpoint,
        "reshard_on_resume": t.reshard_on_resume,
        "score_metric_name": "nll_loss" if validates else None,
        "lower_better": True,
        "early_stopper": early_stopper,
        "publish_metrics_every_n_steps": t.publish_metrics_every_n_steps,
        "tb_dir": output_dir / "tb",
        "metrics_dir": output_dir / "metrics",
        "wandb_project": wandb_project,
        "wandb_dir": output_dir,
        "max_gradient_norm": t.max_gradient_norm,
        "profiler": profiler,
        "seed": t.seed,
        "init_from": init_from,
        "nan_policy": t.nan_policy,
        "loss_spike_guard": t.loss_spike.guard(),
        "max_consecutive_skipped_steps": t.max_consecutive_skipped_steps,
        "gc_every_n_steps": t.gc_every_n_steps,
        # On CUDA the Trainer knows the peak of common devices, so mfu needs only the FLOPs.
        "flops_per_target": (
            flops_per_target() if t.device_peak_flops or gangs.root.device.type == "cuda" else None
        ),
        "device_peak_flops": t.device_peak_flops,
    }
    return options
