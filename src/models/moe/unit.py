"""The next-token unit of a ``transformers`` mixture of experts: the LM unit with the model's
load-balancing loss and its experts' load metrics."""

from __future__ import annotations

from torch import Tensor, nn

from gangs import Gang
from models.moe.experts import expert_modules, router_aux_loss_coefficient
from models.moe.load import ExpertLoad
from trainkit_utils.modules import unwrap_model
from units.lm import LMTrainUnit, TokenBatch


class MoeLMTrainUnit(LMTrainUnit):
    """:class:`units.lm.LMTrainUnit` plus ``router_aux_loss_coef`` times the model's
    load-balancing loss (published as ``router_aux_loss``), and the tokens each expert received
    (``moe_tokens_*_layer_N``, :mod:`models.moe.load`). On a dense model it is the LM unit.

    ``pp_gang``: under pipeline parallelism ``model`` is a rank's part
    (:mod:`models.pipeline`), whose last stage computes the load-balancing loss
    (:mod:`models.moe.routing`). Each rank counts its own layers' routings and registers every
    stage's layers' metrics, which a publish sums over the PP gang: every rank publishes the
    same values. Learning the other stages' layers takes one gather over the PP gang, here."""

    def __init__(self, model: nn.Module, *, pp_gang: Gang | None = None) -> None:
        super().__init__(model, aux_loss_coefficient=router_aux_loss_coefficient(model))
        inner = unwrap_model(model)
        experts = expert_modules(inner)
        pipelined = pp_gang is not None and pp_gang.size > 1
        self.expert_load = ExpertLoad(experts) if experts or pipelined else None
        if self.expert_load is None:
            return
        if pp_gang is None or not pipelined:
            self.expert_load.register(self.metric_bag)
            return
        stages: list[list[tuple[int, int]]] = pp_gang.all_gather_objects(self.expert_load.layers)
        self.expert_load.register(self.metric_bag, stages=[layer for s in stages for layer in s])
        self.expert_load.record_after_layers(inner)

    def forward(self, batch: TokenBatch) -> tuple[Tensor, Tensor | None]:
        if self.expert_load is None:
            return super().forward(batch)
        self.expert_load.begin()
        output = super().forward(batch)
        self.expert_load.record()
        return output


def is_mixture_of_experts(model: nn.Module, pp_gang: Gang | None = None) -> bool:
    """Whether ``model`` has stacked experts or a load-balancing loss to train with; under
    pipeline parallelism (``pp_gang``), whether any stage's part has (one gather)."""
    inner = unwrap_model(model)
    found = bool(expert_modules(inner)) or router_aux_loss_coefficient(inner) > 0
    if pp_gang is None or pp_gang.size == 1:
        return found
    return any(pp_gang.all_gather_objects(found))
