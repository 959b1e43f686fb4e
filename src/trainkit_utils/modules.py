"""What every package says of a model: the module inside its DDP wrapper, the signature of the
functions that initialize a model's modules, and the ties a pipeline part records."""

from __future__ import annotations

from collections.abc import Callable, Iterable

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


_SPLIT_TIES = "_trainkit_split_ties"


def record_split_ties(part: Module, ties: Iterable[Iterable[str]]) -> None:
    """Remember, on ``part`` (a pipeline rank's part of a model), the whole model's ties (its
    parameters that several modules hold) by the names of each. A part holds a tie under its
    own stages' names only, and where the other holders are on another rank it holds a copy of
    its own: the pipeline keeps the copies equal, and the initial weights see every name."""
    object.__setattr__(part, _SPLIT_TIES, tuple(tuple(names) for names in ties))


def split_ties(part: Module) -> list[tuple[str, ...]]:
    """The ties :func:`record_split_ties` recorded on ``part`` (or the module inside its DDP
    wrapper), each as all its names in the whole model; none for a module that is no part."""
    return list(getattr(unwrap_model(part), _SPLIT_TIES, ()))
