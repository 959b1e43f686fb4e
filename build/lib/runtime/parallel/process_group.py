"""Whether torch.distributed is up: asked before importing DDP, FSDP2 or DTensor, which a
single-process run spares (seconds), since no model can be any of them without a process group."""

from __future__ import annotations

import torch.distributed as dist


def process_group_exists() -> bool:
    """Whether the default process group exists (DDP, FSDP2 and DTensor all need one)."""
    return dist.is_available() and dist.is_initialized()
