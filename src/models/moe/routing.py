"""The load-balancing loss of a mixture of experts whose layers are split into pipeline stages.

``transformers`` computes the loss (Switch Transformer's, ``load_balancing_loss_func``) over the
router logits of every MoE layer of a forward pass at once: ``experts * sum_e T_e * P_e``, where
``T_e`` is the share of the top-k routings that go to expert ``e`` and ``P_e`` its mean routing
probability, both over every layer's tokens together. A product of means over all layers, it is
no sum of per-stage parts. So each stage adds its layers' *sums* to a ``[2, experts]`` tensor
passed to the next stage beside the hidden states (row 0: the routing probabilities summed per
expert, which carry the gradient back to every stage's routers; row 1: the top-k routings
counted per expert, which carry none), and the last stage computes the loss from the totals, in
the order and with the arithmetic of ``transformers``' own. The number of rows is the counts'
sum over top-k: no attention mask weighs them, as the stages run without one.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, final

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from models.moe.experts import router_aux_loss_coefficient, tokens_per_expert


@final
class RouterStatistics:
    """The routers of a stage's layers and the sums of their routings (see the module
    docstring). :meth:`begin` before the stage's layers run, :meth:`add` after them."""

    def __init__(
        self, *, routers: list[nn.Module], index: int, top_k: int, num_experts: int
    ) -> None:
        """``routers``: the router modules, whose output's element ``index`` is the logits of
        each token (``[tokens, num_experts]``); ``top_k``: the experts of each token."""
        self._routers = routers
        self._index = index
        self.top_k = top_k
        self.num_experts = num_experts
        self._logits: list[Tensor] = []
        self._handles: list[RemovableHandle] = []

    @staticmethod
    def of(model: Any, layers: Iterable[nn.Module]) -> RouterStatistics | None:
        """The statistics of the routers in ``layers`` of the ``transformers`` model ``model``,
        or None where the model trains without a load-balancing loss (a dense model, or
        DeepSeek-V3's bias balancing: :func:`~models.moe.router_aux_loss_coefficient`)."""
        recorder = getattr(type(model), "_can_record_outputs", None) or {}
        found = recorder.get("router_logits")
        if found is None or router_aux_loss_coefficient(model) == 0.0:
            return None
        kind, index = found.target_class, found.index
        every = [m for m in model.modules() if isinstance(m, kind)]
        routers = [m for layer in layers for m in layer.modules() if isinstance(m, kind)]
        return RouterStatistics(
            routers=routers,
            index=index,
            top_k=int(model.config.num_experts_per_tok),
            num_experts=int(every[0].weight.shape[0]),
        )

    def begin(self) -> None:
        """Forget logits kept since the last forward (an activation checkpoint's recomputation
        runs the routers again in the backward)."""
        if not self._handles:
            # Hooked at the first forward, not at construction: a rank's part over several
            # stages holds the same routers, but only the stages run.
            self._handles = [router.register_forward_hook(self._keep) for router in self._routers]
        self._logits.clear()

    def _keep(self, module: nn.Module, args: Any, output: Any) -> None:
        self._logits.append(output[self._index])

    def add(self, sums: Tensor | None, like: Tensor) -> Tensor:
        """``sums`` (None on the first stage: zeros on ``like``'s device) plus the routings of
        the layers that ran since :meth:`begin`, layer by layer."""
        if sums is None:
            sums = torch.zeros(2, self.num_experts, dtype=torch.float32, device=like.device)
        for logits in self._logits:
            probabilities = torch.nn.functional.softmax(logits, dim=-1)
            _, selected = torch.topk(probabilities, self.top_k, dim=-1)
            counts = tokens_per_expert(selected, self.num_experts, torch.float32)
            sums = sums + torch.stack([probabilities.float().sum(dim=0), counts])
        self._logits.clear()
        return sums

    def loss(self, sums: Tensor) -> Tensor:
        """The load-balancing loss of the totals ``sums`` over every layer."""
        rows = sums[1].sum() / self.top_k
        tokens, probabilities = sums[1] / rows, sums[0] / rows
        return torch.sum(tokens * probabilities.unsqueeze(0)) * self.num_experts
