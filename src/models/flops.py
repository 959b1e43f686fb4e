"""The training FLOPs of a causal LM per token, for the Trainer's ``mfu``."""

from __future__ import annotations

from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

from torch import nn

from models.moe.experts import expert_modules, num_experts


def flops_per_token(model: nn.Module, hf: Mapping[str, Any], seq_len: int) -> float:
    """Forward and backward FLOPs per token, as PaLM (appendix B) and torchtitan count them:
    6 per parameter that multiplies (an embedding's lookup does not; tied to the output layer,
    it does; of a mixture of experts, only the top-k experts a token is routed to), plus
    attention's scores and weighted sum, 12 * layers * hidden size * seq_len.

    Counted on the model before it is wrapped or sharded (the whole parameters)."""
    # A transformers model's config names depth and width alike in every family (GPT-2's
    # config.json says n_layer and n_embd); the recipe's own model has only ``hf``.
    sizes = getattr(model, "config", None) or SimpleNamespace(**hf)
    multiplying = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    lookups = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)} - multiplying
    num_params = sum(p.numel() for p in model.parameters() if id(p) not in lookups)
    # A token meets only the experts it is routed to: top-k of each layer's experts.
    for _, experts in expert_modules(model):
        share = getattr(sizes, "num_experts_per_tok", 1) / num_experts(experts)
        stacked = sum(getattr(experts, name).numel() for name in ("gate_up_proj", "down_proj"))
        num_params -= round(stacked * (1 - share))
    attention = 12.0 * sizes.num_hidden_layers * sizes.hidden_size * seq_len
    return float(6.0 * num_params + attention)
