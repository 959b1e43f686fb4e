"""The built-in units of causal language models: next-token cross entropy, for pretraining on
packed text and for SFT's masked targets alike.

:class:`LMTrainUnit` returns the cross entropy SUMMED over a micro-batch's targets with their
number, so the Trainer's normalization makes an update the mean over every target of the step.
A model may add an auxiliary loss (a mixture of experts' load balancing): the unit adds it
weighted by the micro-batch's targets, as a mean over the targets would hold it
(:class:`models.moe.MoeLMTrainUnit`).

A batch is anything with ``input_ids``, ``target_ids`` and ``num_targets``
(:class:`TokenBatch`); with ``document_ids`` and ``positions`` too, the model gets them (the
project's Llama keeps attention inside each packed document); with ``positions`` alone (a part of
each sequence under sequence parallelism) it gets them as ``position_ids``.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torcheval.metrics import Max, Mean

from units.pipeline import PipelineUnit, StageInputs, StageOutput, inferring_shapes
from units.unit import EvalUnit, TrainUnit

IGNORE_INDEX = -100
"""The target of a position that is not trained on (prompt, padding); ``cross_entropy``'s default."""


class TokenBatch(Protocol):
    input_ids: Tensor
    target_ids: Tensor
    num_targets: int


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
    positions = getattr(batch, "positions", None)
    if document_ids is not None:
        output = model(batch.input_ids, document_ids=document_ids, positions=positions)
    else:
        kwargs: dict[str, Any] = {}
        if positions is not None:
            # A part of each sequence (sequence parallelism): its positions in the whole one.
            kwargs["position_ids"] = positions
        if router_logits:
            kwargs["output_router_logits"] = True
        attention_mask = getattr(batch, "attention_mask", None)
        if attention_mask is not None:
            # Padded rows (GRPO's left-padded prompts): a Hugging Face model's mask.
            kwargs["attention_mask"] = attention_mask
        output = model(input_ids=batch.input_ids, **kwargs)
    if isinstance(output, Tensor):
        return output, None
    return output.logits, getattr(output, "aux_loss", None) if router_logits else None


def lm_stage_inputs(batch: TokenBatch) -> StageInputs:
    """A token batch as a pipeline takes it: the input ids to the first stage, the packed
    documents' ids and positions (if any) to every stage, the target ids to the loss."""
    kwargs: dict[str, Tensor] = {}
    document_ids = getattr(batch, "document_ids", None)
    if document_ids is not None:
        kwargs = {"document_ids": document_ids, "positions": batch.positions}  # type: ignore[attr-defined]
    return StageInputs(
        args=(batch.input_ids,),
        kwargs=kwargs,
        target=batch.target_ids,
        num_targets=batch.num_targets,
        target_padding=IGNORE_INDEX,
    )


class LMTrainUnit(TrainUnit[TokenBatch], PipelineUnit[TokenBatch]):
    """The summed cross entropy, published as ``nll_loss``; with ``aux_loss_coefficient``, plus
    that times the model's auxiliary loss (asked for as ``output_router_logits``), published as
    ``router_aux_loss``."""

    def __init__(self, model: nn.Module, *, aux_loss_coefficient: float = 0.0) -> None:
        super().__init__(model)
        self.metric_bag.register_metric("nll_loss", Mean(), persistent=False)
        self.metric_bag.register_metric("num_bad_lines", Max(), persistent=False)
        self.aux_loss_coefficient = aux_loss_coefficient
        self._aux_parts: list[Tensor] = []
        """Under pipeline parallelism, the last stage's auxiliary losses (:meth:`stage_loss`)."""
        if aux_loss_coefficient:
            self.metric_bag.register_metric("router_aux_loss", Mean(), persistent=False)

    def forward(self, batch: TokenBatch) -> tuple[Tensor, Tensor | None]:
        """The logits of ``batch`` and the model's auxiliary loss (None without one)."""
        return logits_and_aux_loss(self.model, batch, router_logits=self.aux_loss_coefficient > 0)

    def __call__(self, batch: TokenBatch) -> tuple[Tensor, int | None]:
        # The reader's count of skipped lines (data.skip_bad_lines), published with the metrics.
        self.metric_bag.num_bad_lines.update(torch.tensor(getattr(batch, "num_bad_lines", 0)))
        logits, aux_loss = self.forward(batch)
        loss = summed_nll_loss(logits, batch.target_ids)
        self.record_loss(batch, loss.detach())
        if aux_loss is not None:
            # The model's mean auxiliary loss, weighted like a mean over the targets: the
            # Trainer divides the sum by the step's targets.
            loss = loss + self.aux_loss_coefficient * batch.num_targets * aux_loss.float()
            self.metric_bag.router_aux_loss.update(aux_loss.detach(), weight=batch.num_targets)
        return loss, batch.num_targets

    def stage_inputs(self, batch: TokenBatch) -> StageInputs:
        self.metric_bag.num_bad_lines.update(torch.tensor(getattr(batch, "num_bad_lines", 0)))
        # A micro-batch's auxiliary parts start afresh, whatever a failed one left.
        self._aux_parts.clear()
        return lm_stage_inputs(batch)

    def stage_loss(self, output: StageOutput, target: Tensor) -> Tensor:
        """The summed cross entropy of a pipeline microbatch; with ``aux_loss_coefficient`` and
        a last stage that returns ``(logits, aux_loss)``, plus the auxiliary loss weighted by
        the microbatch's targets, as :meth:`__call__` weighs a micro-batch's."""
        logits, aux_loss = (output[0], output[1]) if isinstance(output, tuple) else (output, None)
        loss = summed_nll_loss(logits, target)
        if aux_loss is None or not self.aux_loss_coefficient:
            return loss
        # Counted on the device: no host sync inside the schedule.
        num_targets = (target != IGNORE_INDEX).sum()
        aux_part = self.aux_loss_coefficient * num_targets * aux_loss.float()
        if not inferring_shapes():
            self._aux_parts.append(aux_part.detach())
        return loss + aux_part

    def stage_aux_loss(self) -> Tensor | None:
        if not self.aux_loss_coefficient:
            return None
        parts, self._aux_parts = self._aux_parts, []
        return torch.stack(parts).sum() if parts else torch.zeros(())

    def record_loss(self, batch: TokenBatch, loss: Tensor) -> None:
        # A micro-batch of an SFT run may hold no response token; its mean is left out.
        weight = max(batch.num_targets, 1)
        self.metric_bag.nll_loss.update(loss / weight, weight=batch.num_targets)

    def record_aux_loss(self, batch: TokenBatch, aux_loss: Tensor) -> None:
        # The mean of the microbatches' auxiliary losses, weighted by their targets.
        weight = max(batch.num_targets, 1) * self.aux_loss_coefficient
        self.metric_bag.router_aux_loss.update(aux_loss / weight, weight=batch.num_targets)


class LMEvalUnit(EvalUnit[TokenBatch], PipelineUnit[TokenBatch]):
    """The mean cross entropy over the valid targets, as ``nll_loss``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.metric_bag.register_metric("nll_loss", Mean())

    def __call__(self, batch: TokenBatch) -> None:
        # A batch without targets still runs: under sequence parallelism its forward takes part
        # in the all-to-alls of the SP ranks that hold targets (record_loss leaves it out).
        self.record_loss(batch, summed_nll_loss(logits_of(self.model, batch), batch.target_ids))

    def stage_inputs(self, batch: TokenBatch) -> StageInputs:
        return lm_stage_inputs(batch)

    def stage_loss(self, output: StageOutput, target: Tensor) -> Tensor:
        return summed_nll_loss(output[0] if isinstance(output, tuple) else output, target)

    def record_loss(self, batch: TokenBatch, loss: Tensor) -> None:
        if batch.num_targets > 0:
            self.metric_bag.nll_loss.update(loss / batch.num_targets, weight=batch.num_targets)
