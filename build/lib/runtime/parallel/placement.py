"""Where a model's tensors are: on the gang's device, or a clear error that says how to get
them there."""

from __future__ import annotations

from itertools import chain

import torch
from torch.nn import Module


def same_device(a: torch.device, b: torch.device) -> bool:
    """Whether ``a`` and ``b`` are one device (``cuda`` without an index is the current one)."""
    if a.type != b.type:
        return False
    if a.type != "cuda":
        return True
    current = torch.cuda.current_device() if torch.cuda.is_available() else 0
    return (a.index if a.index is not None else current) == (
        b.index if b.index is not None else current
    )


def check_model_device(model: Module, device: torch.device) -> None:
    """Raise ``ValueError`` unless every parameter and buffer of ``model`` is on ``device``."""
    for name, tensor in chain(model.named_parameters(), model.named_buffers()):
        if tensor.is_meta:
            raise ValueError(
                f"The model's '{name}' is still on the meta device. Materialize the model "
                f"first: materialize_model(model, device=gangs.root.device, seed=...)."
            )
        if not same_device(tensor.device, device):
            raise ValueError(
                f"The model's '{name}' is on {tensor.device}, but the gangs' device is "
                f"{device}. Put the model there before the Trainer gets it: "
                "apply_data_parallel(model, gangs) moves it, or model.to(gangs.root.device), "
                "or build it on meta and materialize_model(model, device=gangs.root.device)."
            )
