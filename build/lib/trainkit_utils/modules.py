"""What every package says of a model: the module inside its DDP wrapper, and the signature of
the functions that initialize a model's modules."""

from __future__ import annotations

from collections.abc import Callable

from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel as DDP

InitFn = Callable[[str, Module], None]
"""``init_fn(qualified_name, module)``: initializes ``module``'s own tensors in place.

Called with ``module``'s tensors swapped for full-size CPU tensors, under ``torch.no_grad()`` and
a CPU RNG already seeded for this module, so it may use ``torch.nn.init`` freely.
"""


def unwrap_model(model: Module) -> Module:
    """The user's module inside a DDP wrapper (FSDP2 and TP modify the module in place)."""
    return model.module if isinstance(model, DDP) else model
