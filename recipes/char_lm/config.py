"""The config of ``recipes.char_lm``."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from recipes.common import (
    FsdpSection,
    GangSection,
    OptimizerSection,
    PipelineSection,
    TrainerSection,
)
from trainkit_utils.arguments import check_not_negative, check_positive


@dataclass
class DataSection:
    data_dir: Path | None = None
    """Text files to train on (``*.py`` and ``*.txt``, recursively); default: the stdlib."""
    max_train_bytes: int = 4_000_000
    """Bytes of text read for training, at most."""
    max_valid_bytes: int = 200_000
    """Bytes of text read for validation, at most."""
    seq_len: int = 128
    """Bytes per training sequence (the context length)."""
    batch_size: int = 16
    """Sequences per micro-batch on each DP rank."""
    num_accumulate: int = 1
    """Micro-batches whose gradients add up to one optimizer step."""
    valid_every_nth_file: int = 20
    """Every file whose path hashes to 0 modulo this is a validation file."""
    train: str | None = None
    """A prepared dataset's directory to train on instead of data_dir's files."""
    valid: str | None = None
    """With train: a prepared dataset's directory to validate on (null: no validation)."""


@dataclass
class ModelSection:
    dim: int = 128
    """The width of the residual stream."""
    num_layers: int = 2
    """Transformer blocks."""
    num_heads: int = 4
    """Attention heads per block; dim must be a multiple of it."""
    ffn_dim: int = 512
    """The hidden width of each block's feed-forward layer."""
    dropout: float = 0.0
    """Dropout after attention and feed-forward, in training only."""
    meta_init: bool = True
    """Build on the meta device and materialize each rank's shards only (false: build whole)."""
    activation_checkpointing: bool = False
    """Recompute the blocks' activations in the backward pass: less memory, more compute."""
    activation_checkpointing_every_n: int = 1
    """With activation_checkpointing: checkpoint every n-th block only."""


@dataclass
class CharLMConfig:
    gang: GangSection = field(default_factory=GangSection)
    data: DataSection = field(default_factory=DataSection)
    model: ModelSection = field(default_factory=ModelSection)
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    trainer: TrainerSection = field(default_factory=TrainerSection)
    fsdp: FsdpSection = field(default_factory=FsdpSection)
    pipeline: PipelineSection = field(default_factory=PipelineSection)
    data_parallel: Literal["auto", "ddp", "fsdp", "hsdp"] = "auto"
    """``auto``: HSDP with gang.dp_shard_size, else FSDP2 with TP, else DDP."""
    compile: bool = False
    """torch.compile each block and the loss (slow first steps; on CPU it needs a C++ compiler)."""
    init_from: Path | None = None
    """Start a fresh run from these weights: an export file or another run's checkpoint dir."""
    wandb_project: str | None = None
    """Also publish the metrics to this Weights & Biases project."""

    def validate(self) -> None:
        # Checked here, before any division by them and before the corpus is read.
        for name, value in (
            ("gang.tp_size", self.gang.tp_size),
            ("gang.timeout_minutes", self.gang.timeout_minutes),
            ("data.seq_len", self.data.seq_len),
            ("data.valid_every_nth_file", self.data.valid_every_nth_file),
            ("model.dim", self.model.dim),
            ("model.num_layers", self.model.num_layers),
            ("model.num_heads", self.model.num_heads),
            ("model.ffn_dim", self.model.ffn_dim),
        ):
            check_positive(name, value)
        check_not_negative("optimizer.warmup_steps", self.optimizer.warmup_steps)
        check_positive("gang.pp_size", self.gang.pp_size)
        if self.gang.pp_size > 1:
            self.pipeline.check(self.gang.pp_size, self.data.batch_size, compile=self.compile)
        check_not_negative("data.max_train_bytes", self.data.max_train_bytes)
        check_not_negative("data.max_valid_bytes", self.data.max_valid_bytes)
        if self.model.dim % self.model.num_heads != 0:
            raise ValueError(
                f"model.dim ({self.model.dim}) must be a multiple of model.num_heads "
                f"({self.model.num_heads})."
            )
        if self.model.num_heads % self.gang.tp_size != 0:
            raise ValueError(
                f"model.num_heads ({self.model.num_heads}) must be a multiple of gang.tp_size "
                f"({self.gang.tp_size}), since each TP rank computes whole heads."
            )
        if self.data_parallel == "hsdp" and self.gang.dp_shard_size is None:
            raise ValueError(
                "data_parallel is 'hsdp', but gang.dp_shard_size is not set. Set it to the number "
                "of DP ranks that shard one replica (e.g. the processes per node)."
            )
        mixed_precision = self.fsdp.param_dtype is not None or self.fsdp.reduce_dtype is not None
        if mixed_precision and self.data_parallel == "ddp":
            raise ValueError(
                "fsdp.param_dtype and fsdp.reduce_dtype need data_parallel 'fsdp' or 'hsdp', "
                "but it is 'ddp'. Use trainer.amp=true for mixed precision with DDP."
            )


# ------------------------------------------------------------------------------ data
