"""Activation checkpointing: recompute chosen blocks' activations in the backward pass."""

from __future__ import annotations

import functools
from typing import Any

from torch.nn import Module
from torch.utils.checkpoint import checkpoint

from trainkit_utils.arguments import check_positive


def apply_activation_checkpointing(
    model: Module, *, block_types: tuple[type[Module], ...], every_n: int = 1
) -> int:
    """Checkpoint every ``every_n``-th module of ``block_types`` in ``model``; returns how many.

    A checkpointed block keeps only its input during the forward pass and recomputes its
    activations in the backward pass: less memory for one more forward of the block. The
    block's own ``forward`` is replaced (non-reentrant ``torch.utils.checkpoint``), so no
    wrapper module is inserted: parameter names, state dicts and checkpoints stay the same with
    and without it. It composes with DDP, FSDP2 (apply it before or after ``fully_shard``: FSDP2
    gathers the block's parameters again for the recomputation) and tensor parallelism.
    Dropout draws the same numbers in the recomputation (the RNG state is saved and restored).
    """
    check_positive("every_n", every_n)
    if not block_types:
        raise ValueError("block_types must name at least one module type, but is empty.")
    blocks = [module for module in model.modules() if isinstance(module, block_types)]
    chosen = blocks[every_n - 1 :: every_n]
    for block in chosen:
        if getattr(block, "_trainkit_checkpointed", False):
            continue
        block.forward = functools.partial(_checkpointed_forward, block.forward)  # type: ignore[method-assign]
        block._trainkit_checkpointed = True  # type: ignore[assignment]
    return len(chosen)


def _checkpointed_forward(forward: Any, *args: Any, **kwargs: Any) -> Any:
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)
