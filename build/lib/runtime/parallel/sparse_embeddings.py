"""Embeddings built with ``sparse=True``: which parameters they are, and the check that DDP
leaves them to the Trainer, which reduces their gradients itself
(:mod:`runtime.training.sparse_gradients`)."""

from __future__ import annotations

from torch import Tensor
from torch.nn import Embedding, EmbeddingBag, Module

from runtime.parallel.process_group import process_group_exists


def sparse_parameters(model: Module) -> dict[str, Tensor]:
    """The parameters of ``model`` whose gradients are sparse, by name: the weights of
    embeddings built with ``sparse=True``."""
    found: dict[str, Tensor] = {}
    for name, module in model.named_modules():
        if isinstance(module, (Embedding, EmbeddingBag)) and module.sparse:
            found[f"{name}.weight" if name else "weight"] = module.weight
    return found


def check_sparse_outside_ddp(model: Module) -> None:
    """Raise if ``model`` is DDP that reduces sparse gradients itself (it sums them where it
    averages dense ones, and the step would reduce them a second time)."""
    if not process_group_exists():
        return
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model, DistributedDataParallel):
        return
    ignored = set(getattr(model, "parameters_to_ignore", ()))
    reduced = sorted(set(sparse_parameters(model.module)) - ignored)
    if reduced:
        raise ValueError(
            f"The DDP model reduces the sparse gradients of {', '.join(reduced)}, which the "
            "Trainer reduces itself. Wrap the model with runtime.apply_data_parallel, which "
            "leaves sparse embeddings out of DDP."
        )
