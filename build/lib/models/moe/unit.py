"""The next-token unit of a ``transformers`` mixture of experts: the LM unit with the model's
load-balancing loss and its experts' load metrics."""

from __future__ import annotations

from torch import Tensor, nn

from models.moe.experts import expert_modules, router_aux_loss_coefficient
from models.moe.load import ExpertLoad
from trainkit_utils.modules import unwrap_model
from units.lm import LMTrainUnit, TokenBatch


class MoeLMTrainUnit(LMTrainUnit):
    """:class:`units.lm.LMTrainUnit` plus ``router_aux_loss_coef`` times the model's
    load-balancing loss (published as ``router_aux_loss``), and the tokens each expert received
    (``moe_tokens_*_layer_N``, :mod:`models.moe.load`). On a dense model it is the LM unit."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model, aux_loss_coefficient=router_aux_loss_coefficient(model))
        experts = expert_modules(unwrap_model(model))
        self.expert_load = ExpertLoad(experts) if experts else None
        if self.expert_load is not None:
            self.expert_load.register(self.metric_bag)

    def forward(self, batch: TokenBatch) -> tuple[Tensor, Tensor | None]:
        if self.expert_load is None:
            return super().forward(batch)
        self.expert_load.begin()
        output = super().forward(batch)
        self.expert_load.record()
        return output


def is_mixture_of_experts(model: nn.Module) -> bool:
    """Whether ``model`` has stacked experts or a load-balancing loss to train with."""
    inner = unwrap_model(model)
    return bool(expert_modules(inner)) or router_aux_loss_coefficient(inner) > 0
