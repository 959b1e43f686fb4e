"""Set up the root gang from the ``torchrun`` environment and split it into DP and TP gangs.

One process needs no process group (its gangs are fake: :class:`FakeGang`), except to shard with
FSDP2 or HSDP, which shard over a ``DeviceMesh``: ``force_process_group=True`` then makes a
process group of this one rank and a mesh of size 1, so that FSDP2's mixed precision and its
sharded (DTensor) checkpoints are the same on one process as on many.

With HSDP the whole DP gang spans two mesh dims. On the tested torch versions (see
:mod:`gangs.torch_versions`) the private ``DeviceMesh._flatten`` makes them one ``dp`` dim,
whose group is the DP gang's and whose mesh FSDP2 takes beside TP. Otherwise public
``torch.distributed`` makes the DP groups, and :attr:`Gangs.dp_mesh` wraps this rank's
(``DeviceMesh.from_group``), which FSDP2 takes only without TP: it needs the DP and TP meshes
cut from one root mesh.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from datetime import timedelta
from typing import Final, final

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from gangs.gang import FakeGang, Gang, GangError, ProcessGroupGang
from gangs.launch import LaunchBarrier
from gangs.torch_versions import private_apis_refused, private_apis_supported


@final
class Gangs:
    """The gangs of one process: all processes (``root``), its DP, TP and PP gangs.

    Ranks are laid out as ``root_rank = dp_rank * tp.size + tp_rank``: a TP gang is a run of
    consecutive ranks (on one machine when ``tp.size`` divides the processes per node), and a DP
    gang strides across them. With HSDP the DP ranks are further laid out as
    ``dp_rank = replicate_rank * dp_shard_size + shard_rank``: a shard group is a run of
    consecutive DP ranks (one node), and replicas stride across nodes. With pipeline parallelism
    the stages are outermost: ``root_rank = pp_rank * (dp.size * tp.size) + dp_rank * tp.size +
    tp_rank``, and the DP and TP gangs are those within one stage.
    """

    def __init__(
        self,
        *,
        root: Gang,
        dp: Gang,
        tp: Gang,
        device_mesh: DeviceMesh | None = None,
        ep: Gang | None = None,
        ep_replicas: Gang | None = None,
        expert_mesh: DeviceMesh | None = None,
        sp: Gang | None = None,
        dp_sp: Gang | None = None,
        dp_sp_mesh: DeviceMesh | None = None,
        pp: Gang | None = None,
    ) -> None:
        self._root = root
        self._pp = pp or FakeGang(device=root.device)
        self._dp = dp
        self._tp = tp
        self._sp = sp or FakeGang(device=root.device)
        self._dp_sp = dp_sp or (dp if self._sp.size == 1 else None)
        if self._dp_sp is None or self._dp_sp.size != dp.size * self._sp.size:
            raise GangError(
                f"The DP x SP gang must hold the DP gang ({dp.size}) times the SP gang "
                f"({self._sp.size}). Make the gangs with setup_gangs(sp_size=...)."
            )
        self._dp_sp_mesh = dp_sp_mesh
        # Experts split over the ranks that hold different tokens: DP x SP.
        tokens = self._dp_sp
        self._ep = ep or FakeGang(device=root.device)
        self._ep_replicas = ep_replicas or (tokens if self._ep.size == 1 else None)
        if self._ep_replicas is None or self._ep.size * self._ep_replicas.size != tokens.size:
            raise GangError(
                f"The EP gang ({self._ep.size}) times its replicas' gang must make up the DP "
                f"x SP gang ({tokens.size}). Make the gangs with setup_gangs(ep_size=...)."
            )
        self._device_mesh = device_mesh
        self._dp_mesh = None if device_mesh is None else _whole_dp_mesh(device_mesh, dp)
        self._expert_mesh = expert_mesh
        self._ep_mesh = None if expert_mesh is None else expert_mesh["ep"]

    @property
    def root(self) -> Gang:
        return self._root

    @property
    def dp(self) -> Gang:
        """The data-parallel gang: the ranks that see different data (all of them with HSDP)."""
        return self._dp

    @property
    def tp(self) -> Gang:
        """The tensor-parallel gang: the ranks that share a batch and shard the layers."""
        return self._tp

    @property
    def pp(self) -> Gang:
        """The pipeline-parallel gang: the ranks that hold the stages of one model replica, in
        stage order (the outermost mesh dim; size 1: no pipeline parallelism)."""
        return self._pp

    @property
    def sp(self) -> Gang:
        """The sequence-parallel gang: consecutive ranks (beside TP) that read the same batch and
        each keep ``1 / sp.size`` of every sequence (size 1: no SP)."""
        return self._sp

    @property
    def dp_sp(self) -> Gang:
        """The ranks whose losses and gradients add up: the DP gang times the SP gang (the DP
        gang itself without SP). DDP and FSDP2 reduce gradients over it; the Trainer sums
        target counts and the units' metrics over it."""
        assert self._dp_sp is not None  # __init__
        return self._dp_sp

    @property
    def dp_sp_mesh(self) -> DeviceMesh:
        """The 1-D mesh of :attr:`dp_sp`, that FSDP2 shards over (:attr:`dp_mesh` without SP)."""
        if self._dp_sp_mesh is None:
            return self.dp_mesh
        return self._dp_sp_mesh["dp_sp"]

    @property
    def ep(self) -> Gang:
        """The expert-parallel gang: DP ranks that split the experts of each MoE layer among them
        and send each other the tokens for them (consecutive DP ranks; size 1: no EP)."""
        return self._ep

    @property
    def ep_replicas(self) -> Gang:
        """The DP ranks that hold the same experts (one per EP gang, striding across them):
        their expert gradients add up. The whole DP gang without EP."""
        assert self._ep_replicas is not None  # __init__
        return self._ep_replicas

    @property
    def expert_mesh(self) -> DeviceMesh:
        """The ``("ep_replicate", "ep", "tp")`` mesh of the experts (``"pp"`` first under
        pipeline parallelism: each stage's own): a view of the DP ranks in which ``ep`` is the EP
        gang and ``ep_replicate`` its replicas. Experts are sharded over
        ``ep``, and FSDP2 shards them further over ``ep_replicate``, which needs both dims cut
        from one mesh."""
        if self._expert_mesh is None:
            raise GangError(
                "An expert mesh needs an EP gang of two or more processes. Make the gangs with "
                "setup_gangs(ep_size=N) under torchrun."
            )
        return self._expert_mesh

    @property
    def ep_mesh(self) -> DeviceMesh:
        """The 1-D ``("ep",)`` mesh of the EP gang, over which expert weights are sharded."""
        if self._ep_mesh is None:
            if not isinstance(self._ep, ProcessGroupGang):
                raise GangError(
                    "An EP mesh needs an EP gang of two or more processes. Make the gangs "
                    "with setup_gangs(ep_size=N) under torchrun."
                )
            self._ep_mesh = DeviceMesh.from_group(
                self._ep.as_process_group(), self._root.device.type, mesh_dim_names=("ep",)
            )
        return self._ep_mesh

    @property
    def device_mesh(self) -> DeviceMesh:
        """The ``("dp", "tp")`` mesh, ``("dp_replicate", "dp_shard", "tp")`` with HSDP, or
        ``("dp", "sp", "tp")`` with SP."""
        if self._device_mesh is None:
            raise GangError(
                "A DeviceMesh needs torch.distributed, but this process runs alone (WORLD_SIZE is "
                "1) without a process group. Pass force_process_group=True to setup_gangs for "
                "FSDP2 on one process, or launch with torchrun and --nproc-per-node 2 or more."
            )
        return self._device_mesh

    @property
    def has_device_mesh(self) -> bool:
        """Whether the gangs span processes, so that :attr:`device_mesh` exists."""
        return self._device_mesh is not None

    @property
    def dp_mesh(self) -> DeviceMesh:
        """The 1-D mesh of the whole DP gang (HSDP's two DP dims flattened into one).

        Off the tested torch versions an HSDP layout with TP has none (see the module
        docstring): a :class:`GangError` that points to ``kind="hsdp"``.
        """
        mesh = self.device_mesh
        if self._dp_mesh is None:
            raise GangError(
                "FSDP2 over the whole DP gang of an HSDP layout with tensor parallelism needs "
                f"the private DeviceMesh._flatten, {private_apis_refused()}. Use kind='hsdp' for "
                f"this {mesh.mesh_dim_names} mesh, or leave out dp_shard_size."
            )
        return self._dp_mesh

    @property
    def tp_mesh(self) -> DeviceMesh:
        # Under SP, the TP dim of the mesh that FSDP2's dp_sp dim is cut from: FSDP2 composes
        # with TP only over two dims of one mesh.
        if self._dp_sp_mesh is not None:
            return self._dp_sp_mesh["tp"]
        return self.device_mesh["tp"]

    @property
    def dp_shard_size(self) -> int | None:
        """How many DP ranks shard one replica with HSDP; ``None`` without HSDP."""
        if self._device_mesh is None or _HSDP_DIMS[1] not in (
            self._device_mesh.mesh_dim_names or ()
        ):
            return None
        return self._device_mesh[_HSDP_DIMS[1]].size()

    @property
    def hsdp_mesh(self) -> DeviceMesh:
        """The 2-D ``("dp_replicate", "dp_shard")`` mesh that HSDP's ``fully_shard`` takes."""
        if self.dp_shard_size is None:
            raise GangError(
                "HSDP needs a (dp_replicate, dp_shard) mesh, but these gangs have none. Pass "
                "dp_shard_size to setup_gangs (e.g. the number of processes per node)."
            )
        return self.device_mesh[_HSDP_DIMS]

    def __repr__(self) -> str:
        shard = "" if self.dp_shard_size is None else f", dp_shard={self.dp_shard_size}"
        ep = "" if self.ep.size == 1 else f", ep={self.ep.size}"
        sp = "" if self.sp.size == 1 else f", sp={self.sp.size}"
        pp = "" if self.pp.size == 1 else f"pp={self.pp.size}, "
        return (
            f"Gangs(root={self.root.size}, {pp}dp={self.dp.size}{shard}{ep}{sp}, tp={self.tp.size})"
        )

    @staticmethod
    def single(device: torch.device | None = None) -> Gangs:
        """Gangs of one process, for tests and single-process tools."""
        gang = FakeGang(device=device)
        return Gangs(root=gang, dp=gang, tp=gang)

    @staticmethod
    def of(root: Gang, dp: Gang | None = None, tp: Gang | None = None) -> Gangs:
        """Gangs from a root gang and optional DP and TP gangs (DP defaults to root, TP to none)."""
        gangs = Gangs(root=root, dp=dp or root, tp=tp or FakeGang(device=root.device))
        if gangs.dp.size * gangs.tp.size != gangs.root.size:
            raise ValueError(
                f"The DP gang ({gangs.dp.size}) times the TP gang ({gangs.tp.size}) must make up "
                f"the root gang ({gangs.root.size})."
            )
        return gangs


_HSDP_DIMS = ("dp_replicate", "dp_shard")


def _is_hsdp(mesh: DeviceMesh) -> bool:
    return _HSDP_DIMS[0] in (mesh.mesh_dim_names or ())


def _flat_dp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The DP dims of ``mesh`` as one dim named ``dp`` (private API with HSDP)."""
    if _is_hsdp(mesh):
        # Kept by Gangs rather than sliced from the root mesh later, which torch deprecates.
        return mesh[_HSDP_DIMS]._flatten("dp")
    return mesh["dp"]


def _whole_dp_mesh(mesh: DeviceMesh, dp: Gang) -> DeviceMesh | None:
    """The 1-D mesh of the whole DP gang ``dp`` of ``mesh``; None where no public API makes one
    that FSDP2 takes (HSDP with TP, off the private path)."""
    if not _is_hsdp(mesh) or private_apis_supported():
        return _flat_dp_mesh(mesh)
    if mesh["tp"].size() > 1:
        return None
    # Without TP the DP gang is every rank; alone, a FakeGang, and the world is its group.
    group = dp.as_process_group() if isinstance(dp, ProcessGroupGang) else dist.group.WORLD
    assert group is not None
    return DeviceMesh.from_group(group, mesh.device_type, mesh_dim_names=("dp",))


def _public_dp_gang(mesh: DeviceMesh, root: Gang, timeout: timedelta | None) -> Gang:
    """This rank's whole DP gang of the HSDP ``mesh``, its process group made with public APIs.

    ``new_group`` must be called by every rank for every group in one order, so each rank makes
    all of them: one per TP rank, its members in DP rank order (``replicate * shard_size +
    shard``, the order of the flattened mesh).
    """
    tp_size = mesh["tp"].size()
    pp_size = mesh["pp"].size() if "pp" in (mesh.mesh_dim_names or ()) else 1
    # [stage][dp rank][tp rank] -> one member list per stage and TP rank
    by_stage = mesh.mesh.reshape(pp_size, -1, tp_size).transpose(1, 2)
    members: list[list[int]] = by_stage.reshape(-1, by_stage.shape[-1]).tolist()
    if len(members[0]) == 1:
        return FakeGang(device=root.device)
    mine: dist.ProcessGroup | None = None
    for ranks in members:
        group = dist.new_group(ranks, timeout=timeout)
        if root.rank in ranks:
            mine = group
    assert mine is not None, members
    return ProcessGroupGang(mine, device=root.device, timeout=timeout)


def _set_timeout(group: dist.ProcessGroup, timeout: timedelta | None) -> None:
    """Give ``group``'s future collectives ``timeout`` (None: leave torch's default)."""
    if timeout is not None:
        group.set_timeout(timeout)


def default_device() -> torch.device:
    """The device of this process: ``cuda:LOCAL_RANK`` when CUDA is present, otherwise the CPU."""
    if torch.cuda.is_available():
        local_rank = _int_env("LOCAL_RANK", 0)
        if local_rank >= torch.cuda.device_count():
            raise GangError(
                f"LOCAL_RANK is {local_rank}, but this machine has only "
                f"{torch.cuda.device_count()} CUDA devices. Lower --nproc-per-node."
            )
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def setup_root_gang(
    device: torch.device | None = None,
    timeout: timedelta = timedelta(minutes=15),
    *,
    force_process_group: bool = False,
) -> Gang:
    """Return the gang of all processes: a :class:`FakeGang` when ``WORLD_SIZE`` is 1, unless
    ``force_process_group``: then a :class:`ProcessGroupGang` over a default process group of
    this rank alone (gloo on a CPU, nccl beside gloo on CUDA), which its ``close()`` destroys."""
    if device is None:
        device = default_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if _int_env("WORLD_SIZE", 1) == 1:
        if force_process_group:
            return ProcessGroupGang.init_default(device=device, timeout=timeout, alone=True)
        return FakeGang(device=device)
    launch = LaunchBarrier.from_environment(timeout)
    if launch is not None:
        # A rank that failed before this point is not coming; learn that here, where waiting
        # is interruptible and the reason is readable, not inside the group's rendezvous.
        launch.wait("process group", timeout)
    return ProcessGroupGang.init_default(device=device, timeout=timeout)


def setup_parallel_gangs(
    root: Gang,
    *,
    tp_size: int = 1,
    dp_shard_size: int | None = None,
    ep_size: int = 1,
    sp_size: int = 1,
    pp_size: int = 1,
) -> Gangs:
    """Split ``root`` into DP and TP gangs with a DeviceMesh over them.

    The mesh is ``("dp", "tp")``; with ``dp_shard_size`` (HSDP) it is ``("dp_replicate",
    "dp_shard", "tp")`` and :attr:`Gangs.dp` is still the whole DP gang. A root gang of one
    process gets a mesh (of size 1) only when it has a process group.

    ``ep_size`` (expert parallelism) takes runs of ``ep_size`` consecutive DP ranks as EP gangs
    (:attr:`Gangs.ep`); the DP ranks that hold the same experts are :attr:`Gangs.ep_replicas`.

    ``sp_size`` (sequence parallelism) makes the mesh ``("dp", "sp", "tp")``: runs of
    ``sp_size`` consecutive TP groups are SP gangs (:attr:`Gangs.sp`), which read the same
    batches, so the DP size (the data shards) is ``processes / (sp_size * tp_size)``. Their
    gradients add up over :attr:`Gangs.dp_sp`, a second ``("dp_sp", "tp")`` mesh of the same
    ranks made with the public ``DeviceMesh`` constructor. SP composes with FSDP2, DDP, TP and
    EP (whose gangs are then runs of consecutive DP x SP ranks), not yet with HSDP.

    ``pp_size`` (pipeline parallelism) adds ``pp`` as the outermost mesh dim, ``("pp", <the DP
    dims>, "tp")``: a stage's ranks are a run of ``root.size / pp_size`` consecutive ranks, and
    :attr:`Gangs.pp` strides across the stages. The DP, TP and EP gangs are those of one stage.
    It composes with DDP, FSDP2, HSDP, TP and EP, not yet with SP.
    """
    dp_size = _check_sizes(
        root.size,
        tp_size=tp_size,
        sp_size=sp_size,
        ep_size=ep_size,
        dp_shard_size=dp_shard_size,
        pp_size=pp_size,
    )
    if root.size == 1 and not isinstance(root, ProcessGroupGang):
        return Gangs(root=root, dp=root, tp=root)

    shape: tuple[int, ...]
    names: tuple[str, ...]
    if sp_size > 1:
        shape, names = (dp_size, sp_size, tp_size), ("dp", "sp", "tp")
    elif dp_shard_size is None:
        shape, names = (dp_size, tp_size), ("dp", "tp")
    else:
        shape = (dp_size // dp_shard_size, dp_shard_size, tp_size)
        names = ("dp_replicate", "dp_shard", "tp")
    if pp_size > 1:
        shape, names = (pp_size, *shape), ("pp", *names)
    try:
        mesh = init_device_mesh(root.device.type, shape, mesh_dim_names=names)
    except (RuntimeError, ValueError) as ex:
        raise GangError(f"The {shape} device mesh cannot be made: {ex}") from ex

    timeout = root.timeout if isinstance(root, ProcessGroupGang) else None
    for name in names:
        # The mesh's groups get torch's default timeout (30 minutes), not the root gang's;
        # FSDP2 and TP run their collectives on them.
        _set_timeout(mesh[name].get_group(), timeout)

    if dp_shard_size is None or private_apis_supported():
        dp = _gang_of(_flat_dp_mesh(mesh), root, timeout)
    else:
        dp = _public_dp_gang(mesh, root, timeout)
    expert_mesh = _expert_mesh(mesh, ep_size, timeout) if ep_size > 1 else None
    dp_sp_mesh = _dp_sp_mesh(mesh, timeout) if sp_size > 1 else None
    return Gangs(
        root=root,
        dp=dp,
        tp=_gang_of(mesh["tp"], root, timeout),
        device_mesh=mesh,
        ep=None if expert_mesh is None else _gang_of(expert_mesh["ep"], root, timeout),
        ep_replicas=(
            None if expert_mesh is None else _gang_of(expert_mesh["ep_replicate"], root, timeout)
        ),
        expert_mesh=expert_mesh,
        sp=None if dp_sp_mesh is None else _gang_of(mesh["sp"], root, timeout),
        dp_sp=None if dp_sp_mesh is None else _gang_of(dp_sp_mesh["dp_sp"], root, timeout),
        dp_sp_mesh=dp_sp_mesh,
        pp=_gang_of(mesh["pp"], root, timeout) if pp_size > 1 else None,
    )


def _dp_sp_mesh(mesh: DeviceMesh, timeout: timedelta | None) -> DeviceMesh:
    """The ``(..., "dp_sp", "tp")`` view of the ``(..., "dp", "sp", "tp")`` ``mesh``: the DP and
    SP dims as one, over which gradients add up, TP beside it, and any dims before DP (a
    pipeline's) kept. One mesh of its own (public API, every rank makes every group in one
    order) rather than the private ``_flatten``."""
    names = tuple(mesh.mesh_dim_names or ())
    lead = names[: names.index("dp")]
    shape = mesh.mesh.shape
    ranks = mesh.mesh.reshape(*shape[: len(lead)], -1, shape[-1])
    dp_sp_mesh = DeviceMesh(mesh.device_type, ranks, mesh_dim_names=(*lead, "dp_sp", "tp"))
    for name in ("dp_sp", "tp"):
        _set_timeout(dp_sp_mesh[name].get_group(), timeout)
    return dp_sp_mesh


def _check_sizes(
    world_size: int,
    *,
    tp_size: int,
    sp_size: int,
    ep_size: int,
    dp_shard_size: int | None,
    pp_size: int = 1,
) -> int:
    """The DP size of ``world_size`` processes with these sizes, or a :class:`GangSizeError`
    that names the sizes that would fit. With pipeline stages the other sizes divide the
    processes of one stage."""
    if pp_size > 1 and sp_size > 1:
        raise GangSizeError(
            f"{{pp_size}} ({pp_size}) and {{sp_size}} ({sp_size}) do not compose yet: they are "
            "not built within pipeline stages. Set one of them to 1."
        )
    _check_divides("pp_size", pp_size, world_size, f"the number of processes ({world_size})")
    world = world_size // pp_size
    if sp_size > 1 and dp_shard_size is not None:
        raise GangSizeError(
            f"{{sp_size}} {sp_size} does not compose with {{dp_shard_size}} {dp_shard_size} "
            "(HSDP) yet. Either leave out {dp_shard_size} (FSDP2), or set {sp_size} to 1."
        )
    _check_divides("tp_size", tp_size, world, _the_processes(world_size, pp_size))
    _check_divides(
        "sp_size",
        sp_size,
        world // tp_size,
        f"the processes over TP ({world // tp_size} = {world} processes / {{tp_size}} {tp_size})",
    )
    dp_size = world // (tp_size * sp_size)
    over = f" / {{sp_size}} {sp_size}" if sp_size > 1 else ""
    of_a_stage = "" if pp_size == 1 else " of a stage"
    the_dp_size = (
        f"the DP size ({dp_size} = {world} processes{of_a_stage} / {{tp_size}} {tp_size}{over})"
    )
    if sp_size > 1:
        # Experts split over the ranks that hold different tokens: DP x SP.
        _check_divides(
            "ep_size",
            ep_size,
            dp_size * sp_size,
            f"the DP x SP size ({dp_size * sp_size} = {world} processes / {{tp_size}} {tp_size})",
        )
    else:
        _check_divides("ep_size", ep_size, dp_size, the_dp_size)
    if dp_shard_size is not None:
        _check_divides("dp_shard_size", dp_shard_size, dp_size, the_dp_size)
    return dp_size


def _the_processes(world_size: int, pp_size: int) -> str:
    """The processes of one pipeline stage, as a size message names them."""
    if pp_size == 1:
        return f"the number of processes ({world_size})"
    return (
        f"the processes of a stage ({world_size // pp_size} = {world_size} / {{pp_size}} {pp_size})"
    )


class GangSizeError(GangError):
    """A gang size that does not fit the processes, with the sizes that would.

    The message names the sizes as :func:`setup_parallel_gangs`' arguments; a caller that took
    them from its own settings gets the message naming those with :meth:`naming` (the recipes'
    command line: ``gang.ep_size``).
    """

    def __init__(self, template: str) -> None:
        self.template = template
        super().__init__(self.naming({}))

    def naming(self, names: Mapping[str, str]) -> str:
        """The message with each size argument called by its name in ``names`` (by default its
        own name)."""
        return self.template.format_map({arg: names.get(arg, arg) for arg in GANG_SIZE_ARGUMENTS})


GANG_SIZE_ARGUMENTS: Final = ("tp_size", "dp_shard_size", "ep_size", "sp_size", "pp_size")
"""The arguments of :func:`setup_parallel_gangs` a :class:`GangSizeError` may name."""


def _check_divides(argument: str, size: int, total: int, what: str) -> None:
    """``size`` (the value of ``argument``) must be a positive divisor of ``total``, described by
    ``what``; the error lists the divisors."""
    if size > 0 and total % size == 0:
        return
    divisors = ", ".join(str(n) for n in range(1, total + 1) if total % n == 0)
    raise GangSizeError(f"{{{argument}}} is {size}, but must divide {what}. Use one of {divisors}.")


def _gang_of(dim_mesh: DeviceMesh, root: Gang, timeout: timedelta | None) -> Gang:
    """The gang of this rank along one mesh dim (a fake one for a dim of size 1)."""
    if dim_mesh.size() == 1:
        return FakeGang(device=root.device)
    group = dim_mesh.get_group()
    _set_timeout(group, timeout)
    return ProcessGroupGang(group, device=root.device, timeout=timeout)


def _expert_mesh(mesh: DeviceMesh, ep_size: int, timeout: timedelta | None) -> DeviceMesh:
    """The ``("ep_replicate", "ep", "tp")`` view of ``mesh``: its ranks by DP rank (by DP x SP
    rank with SP), then TP rank, with each run of ``ep_size`` consecutive such ranks an EP gang;
    with pipeline stages ``("pp", "ep_replicate", "ep", "tp")``, each stage's DP ranks split its
    own experts. One mesh, not groups of its own, because FSDP2 shards a DTensor over a second dim only of the mesh that holds the first.
    Every rank makes every group, in one order (the public ``DeviceMesh`` constructor)."""
    tp_size = mesh.mesh.shape[-1]
    # [replica][ep rank][tp rank], within each pipeline stage: a stage's experts are its own.
    lead: tuple[str, ...] = ("pp",) if "pp" in (mesh.mesh_dim_names or ()) else ()
    stages = mesh.mesh.shape[:1] if lead else ()
    ranks = mesh.mesh.reshape(*stages, -1, ep_size, tp_size)
    names = (*lead, "ep_replicate", "ep", "tp")
    expert_mesh = DeviceMesh(mesh.device_type, ranks, mesh_dim_names=names)
    for name in names:
        _set_timeout(expert_mesh[name].get_group(), timeout)
    return expert_mesh


def setup_gangs(
    *,
    tp_size: int = 1,
    dp_shard_size: int | None = None,
    device: torch.device | None = None,
    timeout: timedelta = timedelta(minutes=15),
    force_process_group: bool = False,
    ep_size: int = 1,
    sp_size: int = 1,
    pp_size: int = 1,
) -> Gangs:
    """:func:`setup_root_gang` and :func:`setup_parallel_gangs` in one call.

    ``force_process_group``: on one process too, a process group and a DeviceMesh of size 1,
    which FSDP2 and HSDP shard over (``apply_data_parallel`` then shards on one process as on
    many). Close the root gang (or destroy the default process group) when done.
    """
    group_made_here = force_process_group and not dist.is_initialized()
    root = setup_root_gang(device, timeout, force_process_group=force_process_group)
    try:
        return setup_parallel_gangs(
            root,
            tp_size=tp_size,
            dp_shard_size=dp_shard_size,
            ep_size=ep_size,
            sp_size=sp_size,
            pp_size=pp_size,
        )
    except BaseException:
        if group_made_here and root.size == 1:
            root.close()  # nothing else holds this rank's group yet
        raise


def _int_env(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise GangError(f"{name} must be an integer, but is '{value}' instead.") from None
