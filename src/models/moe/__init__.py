"""Mixtures of experts: the load-balancing loss, expert parallelism over the DP ranks, the
experts' load metrics, aux-loss-free balancing, the load-balancing loss over pipeline stages, and
the LM unit that trains them."""

from __future__ import annotations

from models.moe.experts import (
    apply_expert_parallel,
    expert_modules,
    router_aux_loss_coefficient,
    tokens_per_expert,
)
from models.moe.load import ExpertBiasUpdate, ExpertLoad, ExpertTokens, correction_biases
from models.moe.routing import RouterStatistics
from models.moe.unit import MoeLMTrainUnit, is_mixture_of_experts

__all__ = [
    "ExpertBiasUpdate",
    "ExpertLoad",
    "ExpertTokens",
    "MoeLMTrainUnit",
    "RouterStatistics",
    "apply_expert_parallel",
    "correction_biases",
    "expert_modules",
    "is_mixture_of_experts",
    "router_aux_loss_coefficient",
    "tokens_per_expert",
]
