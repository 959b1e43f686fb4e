"""Wrap a model for data and tensor parallelism over the gangs."""

from __future__ import annotations

import weakref
from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, Literal

import torch
from torch.nn import Module, Parameter
from torch.nn.parallel import DistributedDataParallel as DDP

from gangs import Gangs
from gangs.torch_versions import private_apis_refused, private_apis_supported
from runtime.parallel.materialize import has_meta_tensors
from runtime.parallel.sparse_embeddings import sparse_parameters
from runtime.parallel.tying import retie, shared_parameters

if TYPE_CHECKING:
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.tensor.parallel import ParallelStyle

# FSDP2 and tensor parallelism import DTensor, which takes a second: each function imports what
# it applies, so a run without them never pays for it.

DataParallelKind = Literal["ddp", "fsdp", "hsdp"]

_FSDP_PARAM_DTYPES: weakref.WeakKeyDictionary[Module, torch.dtype] = weakref.WeakKeyDictionary()
"""The ``param_dtype`` each model was sharded with: FSDP2 has no public getter of its policy."""


def fsdp_param_dtype(model: Module) -> torch.dtype | None:
    """The dtype :func:`apply_data_parallel` had FSDP2 compute ``model`` in, if it gave one."""
    return _FSDP_PARAM_DTYPES.get(model)


def apply_tensor_parallel(model: Module, gangs: Gangs, plan: Mapping[str, ParallelStyle]) -> Module:
    """Shard the submodules named in ``plan`` over the TP gang; a no-op when TP is off."""
    if gangs.tp.size == 1:
        return model
    from torch.distributed.tensor.parallel import parallelize_module

    shared = shared_parameters(model)
    model = parallelize_module(model, gangs.tp_mesh, dict(plan))
    # A style distributes the weight of its own module only, which unties a shared one.
    retie(shared, step="the tensor-parallel plan")
    return model


def apply_data_parallel(
    model: Module,
    gangs: Gangs,
    *,
    kind: DataParallelKind = "ddp",
    fsdp_units: tuple[type[Module], ...] = (),
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    find_unused_parameters: bool = False,
    static_graph: bool = False,
    gradient_as_bucket_view: bool = False,
    expert_params: Collection[Parameter] = (),
) -> Module:
    """Replicate (DDP), shard (FSDP2) or shard-and-replicate (HSDP) ``model`` over the DP gang
    (over DP x SP, :attr:`gangs.Gangs.dp_sp`, with sequence parallelism: SP ranks hold the same
    parameters, and the gradients of their parts of the sequences add up).

    A model that is not on the meta device is moved to ``gangs.root.device`` first, on one
    process too.

    A no-op on a DP gang of one, but for one process with a DeviceMesh
    (``setup_gangs(force_process_group=True)``, which the recipes ask for with
    ``data_parallel=fsdp`` or ``hsdp``): FSDP2 and HSDP shard it over the mesh of size 1, so its
    parameters are DTensors and the mixed precision below applies as on many processes. Without
    a mesh one process stays unsharded, and asking it for mixed precision is a ``ValueError``.
    With FSDP2 and HSDP, each submodule whose type is in ``fsdp_units``
    becomes its own shard unit (its parameters are gathered only around its own forward and
    backward), then the whole model. A parameter that several modules share (tied input and
    output embeddings) is sharded once: every module that holds it must sit in one unit (the
    root, for tied embeddings), else a ``ValueError`` says so. HSDP shards within ``dp_shard``
    and replicates across ``dp_replicate`` (``setup_gangs(dp_shard_size=...)``). Apply tensor
    parallelism first; only FSDP2 and HSDP compose with it.

    ``param_dtype`` and ``reduce_dtype`` are FSDP2's mixed precision (``MixedPrecisionPolicy``):
    the dtype parameters are gathered in and the forward and backward compute in, and the dtype
    gradients are reduced in. The sharded parameters and the optimizer stay in their own dtype.

    ``find_unused_parameters``, ``static_graph`` and ``gradient_as_bucket_view`` are passed to
    DDP. DDP leaves out the weights of embeddings with ``sparse=True`` (it sums sparse gradients
    where it averages dense ones): they are broadcast from DP rank 0 here, and the Trainer
    reduces their gradients (see :mod:`runtime.training.sparse_gradients`). Only torch's private
    API can make DDP leave them out: off the tested torch versions (:mod:`gangs.torch_versions`)
    a sparse embedding under DDP is a clear error.

    ``expert_params``: parameters already sharded over the EP gang (expert parallelism). DDP
    leaves them alone (through the same private API as sparse embeddings): their own layer
    reduces their gradients over their replicas. FSDP2 and HSDP shard each module that holds
    them over their replicas (``gangs.expert_mesh["ep_replicate"]``), where there are any.
    """
    if kind not in ("ddp", "fsdp", "hsdp"):
        raise ValueError(f"kind must be 'ddp', 'fsdp' or 'hsdp', but is '{kind}' instead.")
    if kind == "ddp" and (param_dtype is not None or reduce_dtype is not None):
        raise ValueError(
            f"param_dtype ({param_dtype}) and reduce_dtype ({reduce_dtype}) are FSDP2 options, "
            "but kind is 'ddp'. Use kind='fsdp' or 'hsdp', or autocast (Trainer amp=True)."
        )
    ddp_options = {
        "find_unused_parameters": find_unused_parameters,
        "static_graph": static_graph,
        "gradient_as_bucket_view": gradient_as_bucket_view,
    }
    if kind != "ddp" and any(ddp_options.values()):
        raise ValueError(
            f"{', '.join(k for k, v in ddp_options.items() if v)} are DDP options, but kind is "
            f"'{kind}'. Leave them out, or use kind='ddp'."
        )
    if kind != "ddp":
        # Checked on one process too, so a layout that cannot work fails before a long launch.
        _check_ties_in_one_unit(model, fsdp_units)
    if not has_meta_tensors(model):
        # The model leaves on the gangs' device whatever the layout (a no-op when it is there).
        model.to(gangs.root.device)
    if gangs.dp_sp.size == 1 and not _shards_alone(kind, gangs):
        mixed_precision = param_dtype is not None or reduce_dtype is not None
        if mixed_precision and gangs.root.size == 1:
            raise ValueError(
                f"param_dtype ({param_dtype}) and reduce_dtype ({reduce_dtype}) are FSDP2's "
                "mixed precision, which needs a DeviceMesh, but this process runs alone "
                "without one. Make the gangs with setup_gangs(force_process_group=True) to "
                "shard with FSDP2 on one process, or use autocast (Trainer amp=True)."
            )
        return model
    if kind != "ddp":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = gangs.hsdp_mesh if kind == "hsdp" else gangs.dp_sp_mesh
        policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
        ignored = _shard_experts(model, gangs, expert_params, policy) or None
        for module in model.modules():
            if isinstance(module, fsdp_units):
                fully_shard(module, mesh=mesh, mp_policy=policy, ignored_params=ignored)
        fully_shard(model, mesh=mesh, mp_policy=policy, ignored_params=ignored)
        if param_dtype is not None:
            _FSDP_PARAM_DTYPES[model] = param_dtype
        return model
    return _wrap_ddp(model, gangs, ddp_options, expert_params)


def _shard_experts(
    model: Module,
    gangs: Gangs,
    expert_params: Collection[Parameter],
    policy: MixedPrecisionPolicy,
) -> set[Parameter]:
    """FSDP2 units of the modules that hold ``expert_params``, sharded over the experts'
    replicas; the expert parameters the model's other units must leave alone (all of them when
    each EP gang holds the only copy of its experts: nothing is left to shard them over).

    FSDP2 shards them on dim 1: EP has split dim 0 (the experts) already, so each rank keeps
    whole rows of its own experts and no strided sharding is needed."""
    experts = set(expert_params)
    if not experts or gangs.ep_replicas.size == 1:
        return experts
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    mesh = gangs.expert_mesh["ep_replicate"]
    for name, module in model.named_modules():
        own = list(module.parameters(recurse=False))
        if not any(param in experts for param in own):
            continue
        if not all(param in experts for param in own):
            raise ValueError(
                f"{name} holds experts and other parameters, but FSDP2 shards the experts over "
                "their replicas as a unit of their own. Keep the experts' weights in a module "
                "of their own (as transformers' MoE layers do)."
            )
        fully_shard(module, mesh=mesh, mp_policy=policy, shard_placement_fn=lambda _: Shard(1))
    return set()


def _shards_alone(kind: DataParallelKind, gangs: Gangs) -> bool:
    """Whether FSDP2 or HSDP shards a process that runs alone: over the mesh of one that
    ``setup_gangs(force_process_group=True)`` made. (A DP gang of one beside TP on several
    processes is left as it is.)"""
    return kind != "ddp" and gangs.root.size == 1 and gangs.has_device_mesh


def _check_ties_in_one_unit(model: Module, fsdp_units: tuple[type[Module], ...]) -> None:
    """FSDP2 shards a shared parameter once, in the unit of the first module that holds it: the
    other holders must sit in that unit too, or they would see it sharded in their forward."""
    unit_of = {"": ""}  # module name -> the name of the unit that holds it ("": the root)
    for name, module in model.named_modules():
        if name:
            inside = unit_of[name.rpartition(".")[0]]
            unit_of[name] = name if isinstance(module, fsdp_units) else inside
    for tie in shared_parameters(model):
        units = {unit_of[name.rpartition(".")[0]] for name in tie.names}
        if len(units) > 1:
            raise ValueError(
                f"{' and '.join(repr(n) for n in tie.names)} are one shared parameter (tied "
                f"weights), but fsdp_units puts their modules in different FSDP units "
                f"({', '.join(repr(u or '<root>') for u in sorted(units))}), and FSDP2 shards "
                "a parameter in one unit only. Choose fsdp_units so that one unit holds all "
                "of them: with tied embeddings, leave the embedding and the output projection "
                "out of fsdp_units (the root unit then holds both)."
            )


def _wrap_ddp(
    model: Module, gangs: Gangs, options: dict[str, bool], expert_params: Collection[Parameter]
) -> Module:
    if gangs.tp.size > 1:
        # DDP does not handle DTensor parameters (their state dict entries are lost).
        raise ValueError(
            "DDP does not compose with tensor parallelism. Use kind='fsdp' (FSDP2) when the TP "
            f"gang has more than one process (it has {gangs.tp.size})."
        )
    _leave_sparse_out_of_ddp(model, gangs, expert_params)
    device_ids = [gangs.dp.device.index] if gangs.dp.device.type == "cuda" else None
    return DDP(
        model,
        device_ids=device_ids,
        process_group=gangs.dp_sp.as_process_group(),
        find_unused_parameters=options["find_unused_parameters"],
        static_graph=options["static_graph"],
        gradient_as_bucket_view=options["gradient_as_bucket_view"],
    )


def _leave_sparse_out_of_ddp(
    model: Module, gangs: Gangs, expert_params: Collection[Parameter] = ()
) -> None:
    """Have DDP ignore the sparse embeddings of ``model``, and start them equal on every DP rank
    (DDP's own broadcast skips what it ignores); and the ``expert_params``, which start equal
    (they are initialized from the seed, or loaded)."""
    sparse = sparse_parameters(model)
    experts = {id(p) for p in expert_params}
    expert_names = [name for name, p in model.named_parameters() if id(p) in experts]
    if not sparse and not expert_names:
        return
    if not sparse:
        if not private_apis_supported():
            raise ValueError(
                "DDP can leave the experts out only through a private torch API, "
                f"{private_apis_refused()}. Use data_parallel=fsdp with expert parallelism."
            )
        DDP._set_params_and_buffers_to_ignore_for_model(model, expert_names)  # type: ignore[no-untyped-call]
        return
    # No public API makes DDP ignore a parameter: only this private setter, so only on the
    # torch versions it is tested with (see gangs.torch_versions), and no fallback elsewhere.
    if not private_apis_supported():
        raise ValueError(
            f"DDP can leave the sparse embeddings {', '.join(sparse)} out only through a private "
            f"torch API, {private_apis_refused()}. Use sparse=False for them, or a tested torch "
            "version."
        )
    DDP._set_params_and_buffers_to_ignore_for_model(model, [*sparse, *expert_names])  # type: ignore[no-untyped-call]
    with torch.no_grad():
        for param in sparse.values():
            gangs.dp_sp.broadcast(param.data, source_rank=0)
