"""What DPO and GRPO measure the policy against: the reference's log-probabilities of each completion.

- :class:`FrozenReference`: a model of its own, frozen, built and sharded as the policy is;
- :class:`AdapterBaseReference`: under LoRA, the policy with its peft adapters disabled;
- :class:`PrecomputedReference`: values computed once before training
  (``runtime.data.text.reference_logps``), looked up by each batch's ``pair_ids``.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from trainkit_utils.modules import unwrap_model
from units.lm import IGNORE_INDEX, logits_of


class PairBatch(Protocol):
    """``num_pairs`` pairs as ``2 * num_pairs`` rows, the chosen then the rejected ones:
    ``target_ids`` is the next token on completion positions and ``IGNORE_INDEX`` elsewhere
    (``runtime.data.text.PairBatch`` is one)."""

    input_ids: Tensor
    target_ids: Tensor
    num_pairs: int
    num_bad_lines: int
    num_dropped: int
    pair_ids: Tensor | None


class ModelInputs(Protocol):
    """What a model's forward reads of a batch: its token ids (and, where rows are padded, an
    ``attention_mask``)."""

    @property
    def input_ids(self) -> Tensor: ...


class SequenceLogps(NamedTuple):
    """Per row of a batch (chosen rows, then rejected rows): the summed log-probability of the
    completion tokens and their number."""

    sums: Tensor
    counts: Tensor

    def means(self) -> Tensor:
        return self.sums / self.counts.clamp(min=1)


def sequence_logps(logits: Tensor, target_ids: Tensor) -> SequenceLogps:
    """The completion log-probabilities of each row, in float32 (padding and prompt count 0)."""
    per_token = -F.cross_entropy(
        logits.flatten(0, 1).float(),
        target_ids.flatten(),
        reduction="none",
        ignore_index=IGNORE_INDEX,
    ).view(target_ids.shape)
    return SequenceLogps(per_token.sum(-1), (target_ids != IGNORE_INDEX).sum(-1))


class Reference(ABC):
    """The frozen model DPO measures the policy against: the log-probabilities of a batch."""

    @abstractmethod
    def logps(self, batch: PairBatch) -> Tensor:
        """The reference's log-probability of each row's completion (chosen rows, then
        rejected), without gradient."""


class ModelReference(Reference):
    """A reference that runs a model on each batch."""

    @abstractmethod
    def logits(self, batch: ModelInputs) -> Tensor:
        """The reference's logits of ``batch``, computed without gradient."""

    def logps(self, batch: PairBatch) -> Tensor:
        return sequence_logps(self.logits(batch), batch.target_ids).sums


class FrozenReference(ModelReference):
    """A model of its own, with no parameter that requires a gradient, in eval mode."""

    def __init__(self, model: nn.Module) -> None:
        trainable = [name for name, p in model.named_parameters() if p.requires_grad]
        if trainable:
            raise ValueError(
                f"A reference model must be frozen, but {len(trainable)} of its parameters "
                f"require a gradient ({', '.join(trainable[:3])}). Call requires_grad_(False)."
            )
        self.model = model.eval()

    def logits(self, batch: ModelInputs) -> Tensor:
        with torch.no_grad():
            return logits_of(self.model, batch)


class AdapterBaseReference(ModelReference):
    """The policy's base model: the policy run with its peft adapters disabled, no second copy."""

    def __init__(self, policy: nn.Module) -> None:
        # Past the DDP wrapper: a forward without gradient needs none of its bookkeeping.
        self.model = unwrap_model(policy)

    def logits(self, batch: ModelInputs) -> Tensor:
        with torch.no_grad(), adapters_disabled(self.model):
            return logits_of(self.model, batch)


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Run ``model`` without its peft adapters; every parameter's ``requires_grad`` comes back
    as it was (peft's switch sets it on the adapters' weights)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [module for module in model.modules() if isinstance(module, BaseTunerLayer)]
    if not layers:
        raise ValueError(f"{type(model).__name__} has no peft adapter to disable.")
    flags = [(param, param.requires_grad) for param in model.parameters()]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)
        for param, requires_grad in flags:
            param.requires_grad_(requires_grad)


class PrecomputedReference(Reference):
    """The reference's log-probabilities of every pair of one dataset, ``[num_pairs, 2]``
    (chosen, rejected), looked up by each batch's ``pair_ids``."""

    def __init__(self, table: Tensor) -> None:
        self.table = table

    def logps(self, batch: PairBatch) -> Tensor:
        if batch.pair_ids is None:
            raise ValueError(
                "Precomputed reference log-probabilities need each batch's pair_ids; "
                "collate the pairs with collate_preference_pairs."
            )
        if self.table.device != batch.pair_ids.device:
            self.table = self.table.to(batch.pair_ids.device)
        rows = self.table[batch.pair_ids]
        return torch.cat([rows[:, 0], rows[:, 1]])
