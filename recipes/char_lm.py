"""Train a small byte-level decoder-only transformer on a directory of text files.

By default the text is the running Python's standard library sources, so the recipe needs no
download; ``data.train`` (and ``data.valid``) take prepared datasets instead
(``python -m runtime prepare DIR --tokenizer bytes FILES...``). Run it with ``torchrun --standalone --nproc-per-node 2 -m recipes.char_lm OUTPUT_DIR``.
"""

from __future__ import annotations

import logging
import sysconfig
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel
from torcheval.metrics import Mean, Perplexity

from gangs import Gangs
from recipes.common import (
    FsdpSection,
    GangSection,
    OptimizerSection,
    TrainerSection,
    adamw_with_schedule,
    parallel_options,
    setup_recipe_gangs,
    summed_nll_loss,
    trainer_options,
)
from runtime import (
    DataReader,
    MapDataReader,
    SyncMode,
    Trainer,
    compile_loss,
    main,
    parallelize_model,
)
from runtime.data.text import PreparedDataReader, TextBatch
from trainkit_utils.arguments import check_not_negative, check_positive
from units import EvalUnit, TrainUnit

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------- config


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


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def load_corpus(config: DataSection) -> tuple[Tensor, Tensor]:
    """Read the text files into a train and a valid byte tensor, split by file deterministically."""
    root = config.data_dir or stdlib_dir()
    if not root.is_dir():
        raise ValueError(f"data.data_dir must be a directory of text files, but is {root}.")
    files = sorted(
        p
        for p in root.rglob("*")
        if p.suffix in (".py", ".txt") and p.is_file() and "site-packages" not in p.parts
    )
    chunks: dict[str, list[bytes]] = {"train": [], "valid": []}
    budget = {"train": config.max_train_bytes, "valid": config.max_valid_bytes}
    for file in files:
        relative = file.relative_to(root).as_posix()
        split = (
            "valid" if zlib.crc32(relative.encode()) % config.valid_every_nth_file == 0 else "train"
        )
        if budget[split] <= 0:
            if all(b <= 0 for b in budget.values()):
                break
            continue
        data = file.read_bytes()[: budget[split]]
        chunks[split].append(data)
        budget[split] -= len(data)
    train, valid = (_bytes_tensor(b"".join(chunks[split])) for split in ("train", "valid"))
    for name, tensor in (("train", train), ("valid", valid)):
        if tensor.numel() < 4 * (config.seq_len + 1):
            raise ValueError(
                f"{root} holds too little {name} text ({tensor.numel()} bytes) for data.seq_len "
                f"{config.seq_len}. Point data.data_dir at more text."
            )
    return train, valid


def _bytes_tensor(data: bytes) -> Tensor:
    # frombuffer rejects an empty buffer; an empty split is reported by the size check instead.
    if not data:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


class ByteWindows(torch.utils.data.Dataset[Tensor]):
    """Non-overlapping windows of ``seq_len + 1`` bytes: inputs and next-byte targets."""

    def __init__(self, data: Tensor, seq_len: int) -> None:
        self._data = data
        self._window = seq_len + 1

    def __len__(self) -> int:
        return (self._data.numel() - 1) // self._window

    def __getitem__(self, index: int) -> Tensor:
        start = index * self._window
        return self._data[start : start + self._window].long()


@dataclass
class LMBatch:
    inputs: Tensor
    targets: Tensor

    @property
    def batch_size(self) -> int:
        return self.inputs.size(0)

    @property
    def num_targets(self) -> int:
        return self.targets.numel()


def collate_windows(windows: list[Tensor]) -> LMBatch:
    stacked = torch.stack(windows)
    return LMBatch(inputs=stacked[:, :-1], targets=stacked[:, 1:])


# ----------------------------------------------------------------------------- model


class Attention(nn.Module):
    def __init__(self, dim: int, num_heads: int, dropout: float) -> None:
        super().__init__()
        self.head_dim = dim // num_heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.dropout = dropout

    def forward(self, x: Tensor) -> Tensor:
        batch, seq, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds only its own heads.
        q, k, v = (
            w(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
            for w in (self.wq, self.wk, self.wv)
        )
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, ffn_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, ffn_dim)
        self.w2 = nn.Linear(ffn_dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.gelu(self.w1(x)))


class Block(nn.Module):
    def __init__(self, config: ModelSection) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(config.dim)
        self.attn = Attention(config.dim, config.num_heads, config.dropout)
        self.ffn_norm = nn.LayerNorm(config.dim)
        self.ffn = FeedForward(config.dim, config.ffn_dim)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.drop(self.attn(self.attn_norm(x)))
        return x + self.drop(self.ffn(self.ffn_norm(x)))


class ByteTransformer(nn.Module):
    def __init__(self, config: ModelSection, max_seq_len: int, vocab_size: int = 256) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.embed = nn.Embedding(self.vocab_size, config.dim)
        self.pos = nn.Embedding(max_seq_len, config.dim)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.norm = nn.LayerNorm(config.dim)
        self.head = nn.Linear(config.dim, self.vocab_size, bias=False)

    def forward(self, tokens: Tensor) -> Tensor:
        positions = torch.arange(tokens.size(1), device=tokens.device)
        x = self.embed(tokens) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def tensor_parallel_plan(model: ByteTransformer) -> dict[str, ParallelStyle]:
    """Attention and MLP projections, Megatron-style: column-wise in, row-wise out."""
    plan: dict[str, ParallelStyle] = {}
    for i in range(len(model.blocks)):
        for name in ("wq", "wk", "wv"):
            plan[f"blocks.{i}.attn.{name}"] = ColwiseParallel()
        plan[f"blocks.{i}.attn.wo"] = RowwiseParallel()
        plan[f"blocks.{i}.ffn.w1"] = ColwiseParallel()
        plan[f"blocks.{i}.ffn.w2"] = RowwiseParallel()
    return plan


# ----------------------------------------------------------------------------- units


def inputs_and_targets(batch: LMBatch | TextBatch) -> tuple[Tensor, Tensor]:
    """The windows of the stdlib corpus come as LMBatch, those of prepared data as TextBatch."""
    if isinstance(batch, TextBatch):
        return batch.input_ids, batch.target_ids
    return batch.inputs, batch.targets


class CharLMTrainUnit(TrainUnit[LMBatch | TextBatch]):
    def __init__(
        self, model: nn.Module, loss_fn: Callable[[Tensor, Tensor], Tensor] = summed_nll_loss
    ) -> None:
        super().__init__(model)
        self._loss_fn = loss_fn
        self.metric_bag.register_metric("nll_loss", Mean(), persistent=False)

    def __call__(self, batch: LMBatch | TextBatch) -> tuple[Tensor, int | None]:
        inputs, targets = inputs_and_targets(batch)
        loss = self._loss_fn(self.model(inputs), targets)
        self.metric_bag.nll_loss.update(loss.detach() / batch.num_targets, weight=batch.num_targets)
        return loss, batch.num_targets


class CharLMEvalUnit(EvalUnit[LMBatch | TextBatch]):
    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.metric_bag.register_metric("nll_loss", Mean())
        self.metric_bag.register_metric("perplexity", Perplexity())

    def __call__(self, batch: LMBatch | TextBatch) -> None:
        inputs, targets = inputs_and_targets(batch)
        logits = self.model(inputs).float()
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        self.metric_bag.nll_loss.update(loss, weight=batch.num_targets)
        self.metric_bag.perplexity.update(logits, targets)


# ---------------------------------------------------------------------------- recipe


def build_model(config: CharLMConfig, gangs: Gangs, vocab_size: int = 256) -> nn.Module:
    """Build on meta, then shard, wrap and initialize (``parallelize_model``).

    The initial weights depend on ``trainer.seed`` alone, not on the layout: every module is
    initialized from a generator seeded by the seed and its name (see ``materialize_model``).
    """
    with torch.device("meta" if config.model.meta_init else gangs.root.device):
        model = ByteTransformer(config.model, config.data.seq_len, vocab_size)
    return parallelize_model(
        model,
        gangs,
        **parallel_options(config, gangs),
        block_types=(Block,),
        tp_plan=tensor_parallel_plan(model),
    )


CharBatch = LMBatch | TextBatch


def build_readers(
    config: DataSection, gangs: Gangs, *, seed: int
) -> tuple[DataReader[CharBatch], DataReader[CharBatch] | None, int]:
    """The train and valid readers, and the vocabulary size their tokens need."""
    if config.train is not None:
        train = PreparedDataReader(
            sources=config.train,
            seq_len=config.seq_len,
            batch_size=config.batch_size,
            gang=gangs.dp,
            num_accumulate=config.num_accumulate,
            seed=seed,
        )
        valid = None
        if config.valid is not None:
            valid = PreparedDataReader(
                sources=config.valid,
                seq_len=config.seq_len,
                batch_size=config.batch_size,
                gang=gangs.dp,
            ).for_evaluation()
        return train, valid, train.vocab_size
    train_bytes, valid_bytes = load_corpus(config)
    log.info("Corpus: %d train bytes, %d valid bytes.", train_bytes.numel(), valid_bytes.numel())
    train_windows: DataReader[CharBatch] = MapDataReader(
        dataset=ByteWindows(train_bytes, config.seq_len),
        batch_size=config.batch_size,
        collate=collate_windows,
        gang=gangs.dp,
        num_accumulate=config.num_accumulate,
        seed=seed,
    )
    valid_windows: DataReader[CharBatch] = MapDataReader(
        dataset=ByteWindows(valid_bytes, config.seq_len),
        batch_size=config.batch_size,
        collate=collate_windows,
        gang=gangs.dp,
        shuffle=False,
        drop_remainder=False,
        sync_mode=SyncMode.UNTIL_LAST,
    )
    return train_windows, valid_windows, 256


def recipe(config: CharLMConfig, output_dir: Path) -> Trainer[CharBatch]:
    gangs = setup_recipe_gangs(config)
    train_reader, valid_reader, vocab_size = build_readers(
        config.data, gangs, seed=config.trainer.seed
    )
    model = build_model(config, gangs, vocab_size)
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


def flops_per_target(model: nn.Module, config: CharLMConfig) -> float:
    """Forward and backward FLOPs per predicted byte: 6 per parameter, plus attention's scores
    and weighted sum (12 * layers * dim * seq_len)."""
    num_params = sum(p.numel() for p in model.parameters())
    m = config.model
    return 6.0 * num_params + 12.0 * m.num_layers * m.dim * config.data.seq_len


if __name__ == "__main__":
    main(recipe, CharLMConfig)
