"""The model of ``recipes.char_lm``: a small byte-level decoder-only transformer, its
tensor-parallel plan, and its units."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel
from torcheval.metrics import Mean, Perplexity

from gangs import Gangs
from models.pipeline import split_by_layers
from recipes.char_lm.config import CharLMConfig, ModelSection
from recipes.char_lm.data import LMBatch
from recipes.common import PipelineSplit, parallel_options
from runtime import parallelize_model
from runtime.data.text import TextBatch
from runtime.parallel.pipeline import Pipeline
from units import EvalUnit, TrainUnit
from units.lm import IGNORE_INDEX, summed_nll_loss
from units.pipeline import PipelineUnit, StageInputs


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


class ByteTransformerStage(nn.Module):
    """The part of a :class:`ByteTransformer` pipeline stages hold, under its names: the token
    and position embeddings on the first stage, the norm and head on the last."""

    def __init__(
        self, model: ByteTransformer, layers: Sequence[int], first: bool, last: bool
    ) -> None:
        super().__init__()
        self.first, self.last = first, last
        if first:
            self.embed, self.pos = model.embed, model.pos
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in layers})
        if last:
            self.norm, self.head = model.norm, model.head

    def forward(self, x: Tensor) -> Tensor:
        if self.first:
            positions = torch.arange(x.size(1), device=x.device)
            x = self.embed(x) + self.pos(positions)
        for block in self.blocks.values():
            x = block(x)
        return self.head(self.norm(x)) if self.last else x


def split_byte_transformer(
    model: ByteTransformer, stage_ids: Sequence[int], num_stages: int, split: Sequence[int] | None
) -> tuple[list[nn.Module], nn.Module]:
    """The stages ``stage_ids`` of ``model`` and the rank's part (see :mod:`models.pipeline`)."""
    return split_by_layers(
        model,
        stage_ids,
        num_stages,
        split,
        num_layers=len(model.blocks),
        make_stage=ByteTransformerStage,
    )


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


def build_model(config: CharLMConfig, gangs: Gangs, vocab_size: int = 256) -> nn.Module:
    """Build on meta, then shard, wrap and initialize (``parallelize_model``).

    The initial weights depend on ``trainer.seed`` alone, not on the layout: every module is
    initialized from a generator seeded by the seed and its name (see ``materialize_model``).
    """
    return build_pipeline_model(config, gangs, vocab_size)[0]


def build_pipeline_model(
    config: CharLMConfig, gangs: Gangs, vocab_size: int = 256
) -> tuple[nn.Module, Pipeline | None]:
    """:func:`build_model`, and with ``gang.pp_size`` > 1 this rank's part of it (under the
    whole model's names) and the pipeline over its stages."""
    with torch.device("meta" if config.model.meta_init else gangs.root.device):
        model = ByteTransformer(config.model, config.data.seq_len, vocab_size)
    plan = tensor_parallel_plan(model)
    split = None
    if gangs.pp.size > 1:
        split = PipelineSplit(model, gangs, config.pipeline, split_byte_transformer)
        model = split.part  # type: ignore[assignment]
    model = parallelize_model(
        model,
        gangs,
        **parallel_options(config, gangs),
        block_types=(Block,),
        tp_plan=plan,
        pipeline_stages=() if split is None else split.stages,
    )
    return model, None if split is None else split.pipeline()


def flops_per_target(model: nn.Module, config: CharLMConfig) -> float:
    """Forward and backward FLOPs per predicted byte: 6 per parameter, plus attention's scores
    and weighted sum (12 * layers * dim * seq_len)."""
    num_params = sum(p.numel() for p in model.parameters())
    m = config.model
    return 6.0 * num_params + 12.0 * m.num_layers * m.dim * config.data.seq_len


def inputs_and_targets(batch: LMBatch | TextBatch) -> tuple[Tensor, Tensor]:
    """The windows of the stdlib corpus come as LMBatch, those of prepared data as TextBatch."""
    if isinstance(batch, TextBatch):
        return batch.input_ids, batch.target_ids
    return batch.inputs, batch.targets


def _stage_inputs(batch: LMBatch | TextBatch) -> StageInputs:
    inputs, targets = inputs_and_targets(batch)
    return StageInputs(
        args=(inputs,),
        target=targets,
        num_targets=batch.num_targets,
        target_padding=IGNORE_INDEX,
    )


class CharLMTrainUnit(TrainUnit[LMBatch | TextBatch], PipelineUnit[LMBatch | TextBatch]):
    def __init__(
        self, model: nn.Module, loss_fn: Callable[[Tensor, Tensor], Tensor] = summed_nll_loss
    ) -> None:
        super().__init__(model)
        self._loss_fn = loss_fn
        self.metric_bag.register_metric("nll_loss", Mean(), persistent=False)

    def __call__(self, batch: LMBatch | TextBatch) -> tuple[Tensor, int | None]:
        inputs, targets = inputs_and_targets(batch)
        loss = self._loss_fn(self.model(inputs), targets)
        self.record_loss(batch, loss.detach())
        return loss, batch.num_targets

    def stage_inputs(self, batch: LMBatch | TextBatch) -> StageInputs:
        return _stage_inputs(batch)

    def stage_loss(self, output: Tensor, target: Tensor) -> Tensor:
        return self._loss_fn(output, target)

    def record_loss(self, batch: LMBatch | TextBatch, loss: Tensor) -> None:
        self.metric_bag.nll_loss.update(loss / batch.num_targets, weight=batch.num_targets)


class CharLMEvalUnit(EvalUnit[LMBatch | TextBatch], PipelineUnit[LMBatch | TextBatch]):
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

    def stage_inputs(self, batch: LMBatch | TextBatch) -> StageInputs:
        return _stage_inputs(batch)

    def stage_loss(self, output: Tensor, target: Tensor) -> Tensor:
        return summed_nll_loss(output, target)

    def record_loss(self, batch: LMBatch | TextBatch, loss: Tensor) -> None:
        # Only the last stage has the logits: perplexity is exp of the summed loss over the
        # targets, which is what torcheval's Perplexity accumulates from them.
        self.metric_bag.nll_loss.update(loss / batch.num_targets, weight=batch.num_targets)
        perplexity = self.metric_bag.perplexity
        perplexity.sum_log_probs += loss.to(perplexity.sum_log_probs)
        perplexity.num_total += batch.num_targets
