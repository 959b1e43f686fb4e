"""What the recipes share: the config sections every recipe has, and how they become a Trainer.

A recipe owns its model and data; the gang, optimizer, FSDP2 and trainer sections, the learning
rate schedule and the Trainer's keyword arguments are the same for all of them, so they live here.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal, Protocol, TypedDict, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from checkpoint import CheckpointManager
from gangs import Gangs, setup_gangs
from runtime import DataParallelKind, LossSpikeGuard, PatienceEarlyStopper, TorchProfiler
from runtime.data.text import IGNORE_INDEX


@dataclass
class GangSection:
    tp_size: int = 1
    """Tensor-parallel ranks that split each layer (1: no tensor parallelism)."""
    dp_shard_size: int | None = None
    """HSDP: shard over this many DP ranks (a node), replicate across the groups of them."""
    timeout_minutes: int = 15
    """How long a collective may wait before the run fails, naming the ranks that hung."""


@dataclass
class FsdpSection:
    """FSDP2/HSDP mixed precision; ignored by DDP. None: the parameters' own dtype."""

    param_dtype: Literal["float32", "bfloat16", "float16"] | None = None
    """The dtype the blocks' parameters are gathered and computed in."""
    reduce_dtype: Literal["float32", "bfloat16", "float16"] | None = None
    """The dtype gradients are reduced in across the DP gang."""


@dataclass
class OptimizerSection:
    """AdamW with a linear warmup, then a cosine decay to a tenth of the peak learning rate."""

    lr: float = 3e-3
    """The peak learning rate, reached after the warmup."""
    weight_decay: float = 0.01
    """AdamW's decoupled weight decay."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW's moving-average factors of the gradient and of its square."""
    warmup_steps: int = 20
    """Steps over which the learning rate rises linearly to lr."""


@dataclass
class LossSpikeSection:
    """Loss-spike rollback, off unless ``enabled`` (see docs/reliability.md): a step whose loss
    exceeds ``factor`` times the running median of the last ``window`` steps (or is NaN) rolls
    the run back to the checkpoint before it and skips its data, plus ``margin`` steps."""

    enabled: bool = False
    """Watch the loss for spikes and roll back on one."""
    window: int = 100
    """The trailing steps whose median loss a step is compared with."""
    min_history: int = 20
    """Steps the window must hold before a finite loss can count as a spike."""
    factor: float | None = 3.0
    """A loss above this many times the median is a spike (None: not by this rule)."""
    num_deviations: float | None = None
    """A loss above the median plus this many deviations (1.4826 MAD) is a spike (None: off)."""
    margin: int = 0
    """Steps of data skipped past the spike, besides the spike's own."""
    lookback: int = 0
    """Steps before the spike where it may have begun; their checkpoints are marked unhealthy."""
    cool_lr_steps: int = 0
    """Steps after a rollback trained with the learning rate times ``cool_lr_factor``."""
    cool_lr_factor: float = 0.1
    """The learning rate's factor for ``cool_lr_steps`` steps after a rollback."""
    max_rollbacks: int = 3
    """Rollbacks allowed within ``rollback_window`` steps; one more spike stops the run (exit 1)."""
    rollback_window: int = 1000
    """The steps over which ``max_rollbacks`` counts."""
    check_every_step: bool = False
    """Check after every step (one host read per step), not only at publishes and checkpoints."""

    def guard(self) -> LossSpikeGuard | None:
        return self._build() if self.enabled else None

    def validate(self) -> None:
        self._build()

    def _build(self) -> LossSpikeGuard:
        return LossSpikeGuard(
            window=self.window,
            min_history=self.min_history,
            factor=self.factor,
            num_deviations=self.num_deviations,
            margin=self.margin,
            lookback=self.lookback,
            cool_lr_steps=self.cool_lr_steps,
            cool_lr_factor=self.cool_lr_factor,
            max_rollbacks=self.max_rollbacks,
            rollback_window=self.rollback_window,
            check_every_step=self.check_every_step,
        )


@dataclass
class TrainerSection:
    max_num_steps: int = 300
    """Optimizer steps to train for; the learning-rate decay ends here too."""
    max_num_data_epochs: int | None = None
    """Stop after this many passes over the training data (None: no limit)."""
    publish_metrics_every_n_steps: int = 10
    """How often train metrics reach the logs, metrics/*.jsonl, TensorBoard and W&B."""
    validate_every_n_steps: int = 100
    """How often the valid set is scored (when the recipe has one)."""
    validate_at_start: bool = False
    """Validate once before the first step too (a baseline score)."""
    checkpoint_every_n_steps: int = 100
    """How often a checkpoint is written to OUTPUT_DIR/checkpoints."""
    keep_last_n_checkpoints: int | None = 2
    """The newest this many checkpoints are kept; older ones go unless kept as the best."""
    keep_best_n_checkpoints: int | None = 1
    """This many checkpoints with the lowest validation loss are kept too."""
    keep_checkpoint_every_n_steps: int | None = None
    """Keep the checkpoints of its multiples for good: permanent snapshots retention never deletes."""
    async_checkpoint: bool = False
    """Write checkpoints in the background: the step waits only for the copy to memory."""
    reshard_on_resume: bool = False
    """Resume from checkpoints of another world layout (not bit-exact; see the README)."""
    early_stop_patience: int | None = None
    """Stop after this many validations in a row without a lower validation loss."""
    early_stop_min_delta: float = 0.0
    """How much lower the validation loss must be to count as an improvement."""
    max_gradient_norm: float | None = 1.0
    """Clip the gradients' total norm to this (None: no clipping)."""
    dtype: Literal["float32", "bfloat16", "float16"] | None = None
    """With ``amp``, the forward runs in this dtype; float16 also turns on loss scaling. None:
    bfloat16 with ``amp``, float32 without."""
    amp: bool | None = None
    """Autocast the forward to ``dtype``. None: on with CUDA (bf16, what an H100 is fast at), off
    on a CPU, whose runs stay in float32."""
    tf32: bool = True
    """On CUDA, float32 matmuls (those outside autocast, or all of them with ``amp=false``) run
    on TF32 tensor cores: torch.set_float32_matmul_precision("high")."""
    seed: int = 2
    """Seeds the model's initialization, data order and dropout; the same seed repeats a run."""
    profile: bool = False
    """Trace ``profile_record_steps`` steps after ``profile_skip_steps`` to OUTPUT_DIR/profile."""
    profile_skip_steps: int = 10
    """With profile: steps to run before the trace starts."""
    profile_record_steps: int = 3
    """With profile: steps to trace."""
    nan_policy: Literal["error", "skip"] = "error"
    """``error`` stops at a NaN or infinite loss or gradient norm; ``skip`` skips such steps."""
    max_consecutive_skipped_steps: int = 10
    """With nan_policy=skip: fail after this many skipped steps in a row."""
    gc_every_n_steps: int | None = 50
    """Python's garbage collection runs on every rank after the same steps (None: automatic)."""
    loss_spike: LossSpikeSection = field(default_factory=LossSpikeSection)
    device_peak_flops: float | None = None
    """The device's peak FLOP/s in the training dtype, to publish ``mfu`` (e.g. 312e12: A100 bf16);
    on CUDA, None means the Trainer's table of common devices (H100, A100, ...)."""


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
    )


def data_parallel_kind(config: ParallelConfig, gangs: Gangs) -> DataParallelKind:
    """``auto``: HSDP with gang.dp_shard_size, else FSDP2 with TP, else DDP."""
    if config.data_parallel != "auto":
        return config.data_parallel
    if config.gang.dp_shard_size is not None:
        return "hsdp"
    return "fsdp" if gangs.tp.size > 1 else "ddp"


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


def summed_nll_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Cross entropy summed over the targets, computed in float32; ``IGNORE_INDEX`` targets
    (prompts, padding) count for nothing."""
    return F.cross_entropy(
        logits.flatten(0, 1).float(),
        targets.flatten(),
        reduction="sum",
        ignore_index=IGNORE_INDEX,
    )


def logits_of(model: nn.Module, batch: Any) -> Tensor:
    """The logits of a batch, from the project's model or from a Hugging Face model's output."""
    return logits_and_aux_loss(model, batch, router_logits=False)[0]


def logits_and_aux_loss(
    model: nn.Module, batch: Any, *, router_logits: bool
) -> tuple[Tensor, Tensor | None]:
    """The logits of a batch and, with ``router_logits``, the MoE model's load-balancing loss."""
    document_ids = getattr(batch, "document_ids", None)
    if document_ids is not None:
        output = model(batch.input_ids, document_ids=document_ids, positions=batch.positions)
    elif router_logits:
        output = model(input_ids=batch.input_ids, output_router_logits=True)
    else:
        output = model(input_ids=batch.input_ids)
    if isinstance(output, Tensor):
        return output, None
    return output.logits, getattr(output, "aux_loss", None) if router_logits else None


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
