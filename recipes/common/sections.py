"""The config sections every recipe has: gangs, FSDP2, the optimizer and the trainer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from runtime import LossSpikeGuard
from runtime.parallel.pipeline import check_pipeline


@dataclass
class GangSection:
    tp_size: int = 1
    """Tensor-parallel ranks that split each layer (1: no tensor parallelism)."""
    dp_shard_size: int | None = None
    """HSDP: shard over this many DP ranks (a node), replicate across the groups of them."""
    timeout_minutes: int = 15
    """How long a collective may wait before the run fails, naming the ranks that hung."""
    pp_size: int = 1
    """Pipeline stages that split the model by layers, the outermost dim (1: no pipeline)."""


@dataclass
class PipelineSection:
    """Pipeline parallelism's options, read with ``gang.pp_size`` > 1 (see docs/large-models.md)."""

    schedule: Literal["gpipe", "1f1b", "interleaved_1f1b", "zbv", "dualpipev"] = "1f1b"
    """torch.distributed.pipelining's schedule; interleaved_1f1b, zbv and dualpipev hold
    several stages per rank."""
    num_microbatches: int | None = None
    """Microbatches each batch is split into (None: the fewest the schedule takes, gang.pp_size,
    or twice that for zbv and dualpipev); it must divide data.batch_size."""
    stages_per_rank: int = 1
    """Stages each rank holds: 2 or more for interleaved_1f1b, exactly 2 for zbv and dualpipev."""
    split: list[int] | None = None
    """The decoder layers of each stage, in order (None: balanced)."""

    def microbatches(self, pp_size: int) -> int:
        """``num_microbatches``, or the fewest the schedule takes with ``pp_size`` ranks."""
        if self.num_microbatches is not None:
            return self.num_microbatches
        return pp_size * (2 if self.schedule in ("zbv", "dualpipev") else 1)

    def check(self, pp_size: int, batch_size: int | None, *, compile: bool = False) -> None:
        """Refuse, in one line, a pipeline that cannot run (with ``pp_size`` > 1); ``compile``:
        the recipe's ``compile``."""
        if pp_size <= 1:
            return
        check_pipeline(
            self.schedule,
            pp_size=pp_size,
            stages_per_rank=self.stages_per_rank,
            num_microbatches=self.microbatches(pp_size),
            batch_size=batch_size,
        )
        if compile and self.schedule in ("zbv", "dualpipev"):
            # torch refuses a torch.compile wrapper under them; blocks compiled in place get
            # through its check, then fail mid-step (AOTAutograd's donated buffers forbid the
            # retain_graph of the split backward).
            raise ValueError(
                f"pipeline.schedule={self.schedule} splits each backward into an input and a "
                "weight pass, which torch cannot run through compiled blocks. Use "
                "compile=false, or 1f1b or interleaved_1f1b with compile=true."
            )


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
