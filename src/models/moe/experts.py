"""Mixture-of-experts models: the router's load-balancing loss, and expert parallelism over the
DP ranks.

A ``transformers`` MoE model computes its load-balancing loss (Switch Transformer's, over every
MoE layer of the forward pass) when it is asked for the router logits, and adds
``router_aux_loss_coef`` times it to its mean cross entropy. The unit
(:class:`models.moe.MoeLMTrainUnit`) returns a loss SUMMED over the targets, which the Trainer
divides by the step's targets over accumulation and DP; so the unit adds
``coefficient * num_targets * aux_loss`` to its sum. The update then holds
the micro-batches' load-balancing losses weighted by their targets, with the coefficient's share
in every layout: no more with more ranks, no less with more accumulation.

Expert parallelism (``gang.ep_size=N``): the stacked experts of every MoE layer become DTensors
sharded on their first dim over the EP gang (N consecutive DP ranks), so each rank holds
``experts / N`` of them and a checkpoint holds them at their global shape. The router runs on
each rank's own tokens as before; each token-expert pair is sent to the rank of its expert and
its result back, with ``all_to_all_single`` and uneven splits. Where the DP size is a multiple
of N, each expert has replicas (the ranks N apart): DDP leaves the experts alone and
:class:`_ExpertGradients` sums their gradients over the replicas; FSDP2 and HSDP shard them
over the replicas on their second dim (``runtime.parallel.wrapping``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn

from gangs import Gangs, ReduceOperation
from trainkit_utils.modules import unwrap_model


def router_aux_loss_coefficient(model: nn.Module) -> float:
    """The weight of the model's load-balancing loss: its config's ``router_aux_loss_coef``
    where its forward can give the router logits; 0.0 for a dense model, or a family that
    balances without one (DeepSeek-V3's correction bias)."""
    config: Any = getattr(unwrap_model(model), "config", None)
    coefficient = getattr(config, "router_aux_loss_coef", None)
    if coefficient is None or not hasattr(config, "output_router_logits"):
        return 0.0
    return float(coefficient)


# ------------------------------------------------------------------------- expert parallelism


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with uneven splits; its gradient goes back the way it came."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, rows: Tensor, out_splits: list[int], in_splits: list[int], group: Any
    ) -> Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = rows.new_empty((sum(out_splits), *rows.shape[1:]))
        dist.all_to_all_single(out, rows.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:  # type: ignore[override]
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


class _ExpertGradients(torch.autograd.Function):
    """Identity forward; backward: an expert's gradient scaled for the Trainer's DP average, and
    summed over the experts' replicas unless FSDP2 does that.

    The Trainer scales every gradient for a DP average (DDP and FSDP2 average the dense ones),
    but an expert's gradient already holds the contributions of every rank of its EP gang
    (their tokens came to it): summed over its replicas, it must be divided by the DP size (DP x
    SP under sequence parallelism, whose ranks hold different tokens and over which the Trainer
    averages). FSDP2, which shards the experts over their replicas, averages over them (divides
    by that size / EP size), so here it is divided by the EP size only. Reducing per micro-batch is exact:
    the sum is linear, so it commutes with accumulation."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, weight: Tensor, gangs: Gangs, reduced_by_fsdp: bool
    ) -> Tensor:
        ctx.gangs, ctx.reduced_by_fsdp = gangs, reduced_by_fsdp
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:  # type: ignore[override]
        gangs: Gangs = ctx.gangs
        if ctx.reduced_by_fsdp:
            return grad / gangs.ep.size, None, None
        grad = grad.contiguous()
        if gangs.ep_replicas.size > 1:
            gangs.ep_replicas.all_reduce(grad, ReduceOperation.SUM)
        return grad / gangs.dp_sp.size, None, None


def _all_to_all(rows: Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> Tensor:
    """:class:`_AllToAll` applied (``Function.apply`` is untyped)."""
    out: Tensor = _AllToAll.apply(rows, out_splits, in_splits, group)  # type: ignore[no-untyped-call]
    return out


def _expert_gradients(weight: Tensor, gangs: Gangs, fsdp: bool) -> Tensor:
    """:class:`_ExpertGradients` applied (``Function.apply`` is untyped)."""
    out: Tensor = _ExpertGradients.apply(weight, gangs, fsdp)  # type: ignore[no-untyped-call]
    return out


@dataclass(frozen=True)
class _StackedExperts:
    """One layout of stacked experts: the names of its ``[experts, ...]`` weights, and how one
    expert computes the rows routed to it from its slices of them."""

    weights: tuple[str, ...]
    compute: Callable[[nn.Module, list[Tensor], Tensor], Tensor]


def _swiglu(module: nn.Module, weights: list[Tensor], rows: Tensor) -> Tensor:
    """Qwen3-MoE, Mixtral, OLMoE, Qwen2-MoE, DeepSeek-V3: ``gate_up_proj`` is ``[2 x
    intermediate, hidden]`` an expert, gate rows first; no biases."""
    gate_up, down = weights
    gate, up = nn.functional.linear(rows, gate_up).chunk(2, dim=-1)
    act_fn = cast(Callable[[Tensor], Tensor], module.act_fn)
    return nn.functional.linear(act_fn(gate) * up, down)


def _gpt_oss(module: nn.Module, weights: list[Tensor], rows: Tensor) -> Tensor:
    """gpt-oss: ``gate_up_proj`` is ``[hidden, 2 x intermediate]`` (input first) with gate and
    up interleaved, clamped by the module's own gate, and every projection has a bias."""
    gate_up, gate_up_bias, down, down_bias = weights
    apply_gate = cast(Callable[[Tensor], Tensor], module._apply_gate)
    gated = apply_gate(rows @ gate_up + gate_up_bias)
    return gated @ down + down_bias


_SWIGLU = _StackedExperts(("gate_up_proj", "down_proj"), _swiglu)
_GPT_OSS = _StackedExperts(
    ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"), _gpt_oss
)


def _layout_of(module: nn.Module) -> _StackedExperts | None:
    names = {name for name, _ in module.named_parameters(recurse=False)}
    if names == set(_SWIGLU.weights) and hasattr(module, "act_fn"):
        layout = _SWIGLU
    elif names == set(_GPT_OSS.weights) and hasattr(module, "_apply_gate"):
        layout = _GPT_OSS
    else:
        return None
    stacked = all(getattr(module, name).dim() == 3 for name in ("gate_up_proj", "down_proj"))
    return layout if stacked else None


def tokens_per_expert(index: Tensor, count: int, dtype: torch.dtype) -> Tensor:
    """How many of the routings ``index`` (expert numbers, any shape) go to each expert."""
    flat = index.reshape(-1)
    # scatter_add_, not bincount: bincount sizes its output on the host (a sync on CUDA).
    counts = torch.zeros(count, dtype=dtype, device=flat.device)
    return counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=dtype))


def num_experts(module: nn.Module) -> int:
    """The number of experts of a stacked-experts module (its weights' first dim)."""
    return int(cast(Tensor, module.gate_up_proj).shape[0])


def expert_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The stacked-experts modules of a ``transformers`` MoE model, by name: ``gate_up_proj``
    and ``down_proj`` of shape ``[experts, ...]``, with gpt-oss's biases or without any."""
    return [(name, module) for name, module in model.named_modules() if _layout_of(module)]


def apply_expert_parallel(model: nn.Module, gangs: Gangs) -> list[nn.Parameter]:
    """Shard the experts of ``model`` (built on meta) over ``gangs.ep`` on their first dim, and
    route each token to its experts' rank; the expert parameters, which DDP and FSDP2 must
    leave alone. A no-op without EP (``gangs.ep.size == 1``)."""
    if gangs.ep.size == 1:
        return []
    from torch.distributed.tensor import Shard, distribute_tensor

    modules = [module for _, module in expert_modules(model)]
    if not modules:
        raise ValueError(
            f"gang.ep_size is {gangs.ep.size}, but {type(model).__name__} has no stacked experts "
            "to split. Use gang.ep_size=1 for a dense model."
        )
    counts = {num_experts(module) for module in modules}
    if any(count % gangs.ep.size for count in counts):
        count = max(counts)
        ranks = gangs.dp_sp.size  # the ranks with different tokens: DP (x SP)
        fits = [str(n) for n in range(1, count + 1) if count % n == 0 and ranks % n == 0]
        raise ValueError(
            f"gang.ep_size is {gangs.ep.size}, but must divide the number of experts of every "
            f"MoE layer ({count}) and the DP size ({ranks}). Use one of {', '.join(fits)}."
        )
    params = []
    for module in modules:
        layout = _layout_of(module)
        assert layout is not None  # expert_modules
        for name in layout.weights:
            full = getattr(module, name)
            sharded = distribute_tensor(full.data, gangs.ep_mesh, [Shard(0)])
            param = nn.Parameter(sharded, requires_grad=full.requires_grad)
            setattr(module, name, param)
            params.append(param)
        module.forward = partial(_dispatched_forward, module, layout, gangs)
    return params


def _dispatched_forward(
    module: nn.Module,
    layout: _StackedExperts,
    gangs: Gangs,
    hidden: Tensor,
    top_k_index: Tensor,
    top_k_weights: Tensor,
) -> Tensor:
    """The experts of ``transformers``' eager forward, with the tokens sent to the ranks of
    their experts and the results sent back (``all_to_all_single``, uneven splits)."""
    from torch.distributed.fsdp import FSDPModule  # loaded already: EP runs under torchrun

    ep, group = gangs.ep.size, gangs.ep.as_process_group()
    num_total = num_experts(module)
    num_local = num_total // ep
    num_per_token = top_k_index.shape[-1]
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)  # by expert, so by the rank that holds it
    token_of = order // num_per_token
    counts = tokens_per_expert(flat, num_total, torch.int64)
    # received[s * num_local + j]: the rows rank s sends to this rank's j-th expert.
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=group)
    received_by_rank = received.view(ep, num_local)
    # The one host sync of the dispatch: the split sizes all_to_all_single takes.
    sizes = torch.cat(
        [counts.view(ep, num_local).sum(1), received_by_rank.sum(1), received_by_rank.sum(0)]
    ).tolist()
    send_splits, receive_splits, per_expert = sizes[:ep], sizes[ep : 2 * ep], sizes[2 * ep :]
    rows = _all_to_all(hidden[token_of], receive_splits, send_splits, group)
    # The rows came by source rank, then expert; group them by expert.
    local_expert = torch.arange(num_local, device=hidden.device).repeat(ep)
    expert_of_row = torch.repeat_interleave(
        local_expert, received_by_rank.reshape(-1), output_size=sum(receive_splits)
    )
    by_expert = torch.argsort(expert_of_row, stable=True)
    fsdp = isinstance(module, FSDPModule)
    weights = [
        _expert_gradients(getattr(module, name).to_local(), gangs, fsdp).to(hidden.dtype)
        for name in layout.weights
    ]
    outputs = []
    for j, chunk in enumerate(torch.split(rows[by_expert], per_expert)):
        outputs.append(layout.compute(module, [weight[j] for weight in weights], chunk))
    computed = torch.cat(outputs)[torch.argsort(by_expert)]
    back = _all_to_all(computed, send_splits, receive_splits, group)
    weighted = back * top_k_weights.reshape(-1)[order, None]
    final = torch.zeros_like(hidden)
    return final.index_add_(0, token_of, weighted.to(hidden.dtype))
