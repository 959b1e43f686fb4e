"""The repeated blocks of a model, the units that sharding, activation checkpointing and
compilation apply to one at a time."""

from __future__ import annotations

from torch import nn

from models.llama import DecoderLayer, Llama


def decoder_layer_types(model: nn.Module) -> tuple[type[nn.Module], ...]:
    """The decoder layer classes of ``model``: FSDP2's unit, checkpointed and compiled one at a
    time (``runtime.parallelize_model``'s ``block_types``). The project's Llama names its own;
    a ``transformers`` model names them in ``_no_split_modules``."""
    if isinstance(model, Llama):
        return (DecoderLayer,)
    names = set(getattr(model, "_no_split_modules", None) or ())
    types = tuple({type(m) for m in model.modules() if type(m).__name__ in names})
    if not types:
        raise ValueError(
            f"{type(model).__name__} names no decoder layer class (_no_split_modules), so it "
            "cannot be sharded layer by layer."
        )
    return types
