"""Materialize a model built on the ``meta`` device: each rank allocates and initializes its own
shards, and the weights are a function of the seed alone, whatever the world layout.

A recipe builds its model under ``torch.device("meta")`` (no memory), applies tensor parallelism
and FSDP2, then calls :func:`materialize_model`. Each module that holds parameters or buffers is
initialized on its own: its tensors are swapped for plain CPU tensors of their *full* (global)
shape, its ``reset_parameters()`` (or ``init_fn``) runs under a CPU RNG seeded by ``(seed, the
module's qualified name)``, and each rank copies only its own slice into its shard
(``distribute_tensor(..., src_data_rank=None)`` slices locally, without communication, for any
placement: ``Shard``, ``_StridedShard`` of FSDP2 over TP, ``Replicate``).

Why per module and over the full shape: the values do not depend on how the tensor is split, nor
on which other modules exist or the order they are initialized in, and ``reset_parameters``
computes fan-in from the full shape (a TP shard would give the wrong fan-in). No seed checkpoint
(torchtitan's way) is needed. The cost: a rank holds one module's full tensors at a time (the
largest is usually the embedding or the output projection), and every rank draws every module's
random numbers (about a second per billion parameters on one CPU core), which is small next to
training and avoids any communication.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from itertools import chain

import torch
from torch import Tensor
from torch.nn import Module, Parameter
from torch.nn.parallel import DistributedDataParallel as DDP

from runtime.parallel.tying import retie, shared_parameters
from trainkit_utils.modules import InitFn

# Wrappers that torch inserts into qualified names; the seed must not depend on them.
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def materialize_model(
    model: Module, *, device: torch.device, seed: int, init_fn: InitFn | None = None
) -> None:
    """Allocate this rank's shards of a ``meta`` model on ``device`` and initialize them.

    ``init_fn`` defaults to each module's ``reset_parameters()``; a module that holds tensors but
    has neither is an error. Call it after tensor parallelism and FSDP2 and before DDP.

    A parameter that several modules share (tied embeddings) stays one parameter, initialized
    by the first module that holds it (in ``named_modules()`` order).
    """
    if isinstance(model, DDP):
        raise ValueError(
            "materialize_model needs the model before DDP wraps it (DDP broadcasts the weights at "
            "construction, which a meta model does not have). Materialize first, then apply DDP."
        )
    shared = shared_parameters(model)
    model.to_empty(device=device)
    retie(shared, step="materialize_model")
    initialized: set[int] = set()
    for name, module in model.named_modules():
        if any(id(t) not in initialized for _, t in _own_tensors(module)):
            _initialize_module(canonical_name(name), module, seed, init_fn, initialized)


def has_meta_tensors(model: Module) -> bool:
    """Whether any parameter or buffer of ``model`` is still on the ``meta`` device."""
    return any(t.is_meta for t in chain(model.parameters(), model.buffers()))


def canonical_name(name: str) -> str:
    """``name`` without the wrapper modules that activation checkpointing or compile insert."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def module_seed(seed: int, name: str) -> int:
    """A 63-bit seed derived from the run's seed and a module's qualified name."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _own_tensors(module: Module) -> Iterator[tuple[str, Tensor]]:
    """The parameters and buffers ``module`` holds itself (not its children's), by name."""
    yield from module.named_parameters(recurse=False)
    yield from module.named_buffers(recurse=False)


def _initialize_module(
    name: str, module: Module, seed: int, init_fn: InitFn | None, initialized: set[int]
) -> None:
    """Initialize ``module``'s own tensors but those in ``initialized`` (ids of tensors shared
    with a module before it, which gave them their values); add the ones it sets."""
    if init_fn is None and not callable(getattr(module, "reset_parameters", None)):
        raise ValueError(
            f"Module '{name}' ({type(module).__name__}) holds parameters or buffers but has no "
            "reset_parameters() method, so materialize_model cannot initialize it. Give it one, "
            "or pass init_fn=(lambda name, module: ...) that initializes it."
        )
    shards = dict(_own_tensors(module))
    full = {n: torch.empty(t.shape, dtype=t.dtype, device="cpu") for n, t in shards.items()}
    _swap_tensors(
        module,
        {
            n: Parameter(t, requires_grad=False) if isinstance(shards[n], Parameter) else t
            for n, t in full.items()
        },
    )
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(module_seed(seed, name))
            if init_fn is None:
                module.reset_parameters()  # type: ignore[operator]
            else:
                init_fn(name, module)
    finally:
        _swap_tensors(module, shards)
    with torch.no_grad():
        for tensor_name, shard in shards.items():
            if id(shard) not in initialized:
                copy_own_slice(shard, full[tensor_name])
                initialized.add(id(shard))


def _swap_tensors(module: Module, tensors: dict[str, Tensor]) -> None:
    # Module.__setattr__ keeps a name a parameter (it must be given a Parameter) or a buffer
    # (persistent or not, as it was).
    for tensor_name, tensor in tensors.items():
        setattr(module, tensor_name, tensor)


def copy_own_slice(shard: Tensor, full: Tensor) -> None:
    """Copy this rank's part of the full tensor ``full`` into ``shard`` (a DTensor or plain)."""
    # Imported here: DTensor takes a second to import, and only sharded models need it.
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(shard, DTensor):
        # src_data_rank=None: every rank slices the same full tensor itself; no scatter.
        local = distribute_tensor(full, shard.device_mesh, shard.placements, src_data_rank=None)
        shard.to_local().copy_(local.to_local())
    else:
        shard.copy_(full)
