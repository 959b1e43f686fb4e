"""The tensor-parallel plan of a Hugging Face model: its config's ``base_model_tp_plan`` as
torch's parallel styles, layer by layer."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
)

_HF_TP_STYLES: dict[str, Callable[[], ParallelStyle]] = {
    "colwise": ColwiseParallel,
    "rowwise": RowwiseParallel,
    # Fused projections (Phi-3's qkv_proj) and projections a full-width norm follows (OLMo-2):
    # the output is gathered, and the next rowwise layer takes the whole input and splits it.
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
    "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
    "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
    # A per-head norm (Qwen3's q_norm and k_norm) sees this rank's heads only: its weight becomes
    # a replicated DTensor and its input one sharded over the heads, so the weight's gradient is
    # summed over the TP ranks.
    "replicated_with_grad_allreduce": lambda: SequenceParallel(
        sequence_dim=-2, use_local_output=True
    ),
}
# Styles that leave the module whole on every rank: nothing to do.
_HF_TP_UNSPLIT = frozenset({"replicate", "embedding_rowwise", "embedding_colwise"})


def hf_tensor_parallel_plan(model: nn.Module, hf_config_object: Any) -> dict[str, ParallelStyle]:
    """The config's ``base_model_tp_plan`` as torch's parallel styles; empty without one."""
    plan: dict[str, ParallelStyle] = {}
    prefix = getattr(model, "base_model_prefix", "model")
    for pattern, style in (getattr(hf_config_object, "base_model_tp_plan", None) or {}).items():
        # The stacked experts of a mixture stay whole over TP: each TP rank runs them on its
        # (replicated) tokens, and expert parallelism splits them over the DP ranks instead.
        # (transformers' "packed_colwise" splits the gate and up halves of one tensor apart,
        # which no public parallel style does.)
        if style in _HF_TP_UNSPLIT or "experts" in pattern.split("."):
            continue
        if style not in _HF_TP_STYLES:
            raise ValueError(
                f"{type(model).__name__}'s base_model_tp_plan splits {pattern} as '{style}', which "
                f"this recipe cannot do (it knows {', '.join(sorted(_HF_TP_STYLES))}). "
                "Use gang.tp_size=1: DDP, FSDP2 and HSDP train it."
            )
        for i in range(hf_config_object.num_hidden_layers):
            plan[f"{prefix}.{pattern.replace('*', str(i))}"] = _HF_TP_STYLES[style]()
    return plan
