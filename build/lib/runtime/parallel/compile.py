"""Compile a model block by block with ``torch.compile`` (torchtitan's way), and a loss."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch
from torch.nn import Module

LossT = TypeVar("LossT", bound=Callable[..., Any])


def compile_blocks(
    model: Module, *, block_types: tuple[type[Module], ...], **compile_options: Any
) -> int:
    """``block.compile()`` every module of ``block_types`` in ``model``; returns how many.

    One compiled graph per block rather than one for the model: blocks of the same shape share
    the compiled code (compile time grows with the block's size, not the depth), the graph
    breaks FSDP2's per-block hooks and DDP's bucketing need fall between the blocks, and names
    and state dicts stay the same (``Module.compile`` compiles in place, without a wrapper).
    Apply it last: after tensor parallelism, activation checkpointing and FSDP2 or DDP. On CPU,
    inductor builds C++ with the machine's compiler, which the first steps wait for.
    """
    if not block_types:
        raise ValueError("block_types must name at least one module type, but is empty.")
    blocks = [module for module in model.modules() if isinstance(module, block_types)]
    for block in blocks:
        block.compile(**compile_options)
    return len(blocks)


def compile_loss(loss_fn: LossT, **compile_options: Any) -> LossT:
    """``torch.compile(loss_fn)``: fuses e.g. the final projection's cross entropy."""
    return cast(LossT, torch.compile(loss_fn, **compile_options))
