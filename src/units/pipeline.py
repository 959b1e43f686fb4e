"""The interface a unit implements to train (or evaluate) under pipeline parallelism.

Under pipeline parallelism no rank holds the whole model: the first stage takes the batch's
inputs, the last stage computes the loss of each microbatch, and the ranks between pass
activations. The Trainer cannot call the unit's ``__call__`` there, so a unit that runs under
``gang.pp_size > 1`` also says, through :class:`PipelineUnit`:

- :meth:`~PipelineUnit.stage_inputs`: how a batch becomes the model's inputs (positional ones for
  the first stage, keyword ones for every stage), the loss's targets and their count;
- :meth:`~PipelineUnit.stage_loss`: the SUMMED loss of one microbatch of the last stage's
  output, as ``__call__`` would return it;
- :meth:`~PipelineUnit.record_loss`: what to record into the metric bag from a batch and its
  summed loss, which every rank receives (so every rank publishes the same metrics);
- optionally, :meth:`~PipelineUnit.stage_aux_loss` and :meth:`~PipelineUnit.record_aux_loss`:
  the part of the loss that is not the targets' (a mixture of experts' load balancing), sent to
  every rank with the loss and recorded apart.

What a stage computes only so that torch learns its activations' shapes counts for nothing
(:func:`inferring_shapes`).

The target count comes from the batch, which every stage reads, so the Trainer normalizes by the
step's targets exactly as without pipeline parallelism.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Generic, TypeVar, final

from torch import Tensor

BatchT_contra = TypeVar("BatchT_contra", contravariant=True)

StageOutput = Tensor | tuple[Tensor, ...]
"""What the last stage returns: its output (the logits), or that first and what else the loss
needs (a mixture of experts' load-balancing loss, :mod:`models.moe.routing`)."""


@final
@dataclass(frozen=True)
class StageInputs:
    """One batch as the pipeline takes it.

    ``args`` go to the first stage's ``forward``, ``kwargs`` to every stage's (both split into
    microbatches along dim 0), ``target`` to :meth:`PipelineUnit.stage_loss` on the last stage,
    split the same way. ``num_targets`` is the batch's target count (under pipeline
    parallelism the loss is a sum and the count is needed: None is refused).

    ``target_padding``: a target value that counts for nothing in the loss (the LM units'
    ``IGNORE_INDEX``). A batch whose size the microbatches do not divide (a last, shorter
    batch) is then padded with copies of its last example whose targets are all this value;
    without one such a batch is refused.
    """

    args: tuple[Tensor, ...]
    target: Tensor
    num_targets: int | None
    kwargs: dict[str, Tensor] = field(default_factory=dict)
    target_padding: int | float | None = None


class PipelineUnit(ABC, Generic[BatchT_contra]):
    """A mixin of :class:`~units.TrainUnit` or :class:`~units.EvalUnit` that runs under
    pipeline parallelism (see the module docstring)."""

    @abstractmethod
    def stage_inputs(self, batch: BatchT_contra) -> StageInputs:
        """The pipeline's inputs, targets and target count of ``batch``."""

    @abstractmethod
    def stage_loss(self, output: StageOutput, target: Tensor) -> Tensor:
        """The loss of one microbatch, SUMMED over its targets, from the last stage's
        ``output``; a 0-dim tensor."""

    @abstractmethod
    def record_loss(self, batch: BatchT_contra, loss: Tensor) -> None:
        """Record the metrics of ``batch`` whose summed loss is ``loss`` (detached, on every
        rank; without the auxiliary part, see :meth:`stage_aux_loss`)."""

    def stage_aux_loss(self) -> Tensor | None:
        """For a unit whose :meth:`stage_loss` adds an auxiliary loss (a mixture of experts'
        load balancing) to the targets' loss: that part of its losses since the last call,
        summed and detached, on the last stage's ranks; zero elsewhere. None (on every rank)
        for a unit without one. The Trainer asks once per micro-batch and sends it with the
        loss to every rank: :meth:`record_loss` gets the loss without it,
        :meth:`record_aux_loss` the part."""
        return None

    def record_aux_loss(self, batch: BatchT_contra, aux_loss: Tensor) -> None:
        """Record the auxiliary part ``aux_loss`` of the summed loss of ``batch`` (see
        :meth:`stage_aux_loss`; detached, on every rank)."""


PIPELINE_UNIT_HINT = (
    "subclass units.pipeline.PipelineUnit and implement stage_inputs, stage_loss and "
    "record_loss (units.lm.LMTrainUnit and LMEvalUnit do)"
)
"""What a unit must implement to run under pipeline parallelism, as refusals say it."""


_INFERRING_SHAPES = [False]


def inferring_shapes() -> bool:
    """Whether the pipeline runs a stage's forward (or the last stage's loss) only to learn the
    shapes of its activations: torch does that with real tensors before the first batch (and
    after the shapes change). What it computes trains nothing, so a unit or a model records
    nothing of it (a mixture of experts' loads, its auxiliary loss)."""
    return _INFERRING_SHAPES[0]


def set_inferring_shapes(value: bool) -> None:
    """Mark what runs from now on as :func:`inferring_shapes`, or no more (the pipeline does,
    around each such forward and loss)."""
    _INFERRING_SHAPES[0] = value
