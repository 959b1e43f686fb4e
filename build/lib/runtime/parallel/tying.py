"""Parameters that several modules share, such as tied input and output embeddings.

A tie is one ``Parameter`` object held by two modules. Some steps of building a large model give
each module its own copy instead: ``Module.to_empty`` allocates a new tensor per module, and a
tensor-parallel style distributes the weight of the module it is applied to. The functions here
find the ties before such a step (:func:`shared_parameters`) and make each one a single
parameter again after it (:func:`retie`), for any model, not only those that know how to re-tie
themselves.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from torch import Tensor
from torch.nn import Module


@dataclass(frozen=True, kw_only=True)
class SharedParameter:
    """One parameter and every ``(module, attribute)`` that holds it, in module order."""

    names: tuple[str, ...]
    """The qualified names, from the model given to :func:`shared_parameters`."""
    owners: tuple[tuple[Module, str], ...]


def shared_parameters(model: Module) -> list[SharedParameter]:
    """The parameters of ``model`` that more than one module attribute holds."""
    found: dict[int, list[tuple[str, Module, str]]] = {}
    for module_name, module in model.named_modules():
        for name, param in module.named_parameters(recurse=False):
            qualified = f"{module_name}.{name}" if module_name else name
            found.setdefault(id(param), []).append((qualified, module, name))
    return [
        SharedParameter(
            names=tuple(name for name, _, _ in holders),
            owners=tuple((module, attr) for _, module, attr in holders),
        )
        for holders in found.values()
        if len(holders) > 1
    ]


def retie(shared: Iterable[SharedParameter], *, step: str) -> None:
    """Make each shared parameter's holders hold its first holder's parameter again.

    A holder whose parameter became different in kind (a shard of another placement or shape,
    say) cannot share it: that is a ``ValueError`` that names both and ``step``, the step that
    split them.
    """
    for tie in shared:
        first_module, first_attr = tie.owners[0]
        first = getattr(first_module, first_attr)
        for (module, attr), name in zip(tie.owners[1:], tie.names[1:], strict=True):
            param = getattr(module, attr)
            if param is first:
                continue
            if _layout(param) != _layout(first):
                raise ValueError(
                    f"'{tie.names[0]}' and '{name}' are one shared parameter (tied weights), "
                    f"but {step} made them {_layout(first)} and {_layout(param)}. Give both "
                    "modules the same tensor-parallel style, or leave both out of the plan so "
                    "the shared weight stays replicated."
                )
            setattr(module, attr, first)


def _layout(tensor: Tensor) -> str:
    from torch.distributed.tensor import DTensor

    shape = tuple(tensor.shape)
    if isinstance(tensor, DTensor):
        return f"a DTensor of shape {shape} placed {tensor.placements} over {tensor.device_mesh}"
    return f"a plain tensor of shape {shape}"
