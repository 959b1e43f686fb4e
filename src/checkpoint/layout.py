"""The world layout a checkpoint was saved by, and whether this run may load it."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from torch.nn import Module

from checkpoint.errors import CheckpointLayoutError
from gangs import Gangs

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorldLayout:
    world_size: int
    dp_size: int
    tp_size: int
    dp_shard_size: int | None = None
    """The DP ranks each parameter is sharded over: 1 replicated (DDP), the DP size with FSDP2,
    the shard group with HSDP; None when unknown (a manifest from before it was recorded)."""

    @staticmethod
    def of(gangs: Gangs, model: Module | None = None) -> WorldLayout:
        return WorldLayout(
            world_size=gangs.root.size,
            dp_size=gangs.dp.size,
            tp_size=gangs.tp.size,
            dp_shard_size=None if model is None else _dp_shard_size(model),
        )

    @staticmethod
    def of_manifest(manifest: Mapping[str, Any]) -> WorldLayout:
        shard_size = manifest.get("dp_shard_size")
        return WorldLayout(
            world_size=int(manifest["world_size"]),
            dp_size=int(manifest["dp_size"]),
            tp_size=int(manifest["tp_size"]),
            dp_shard_size=None if shard_size is None else int(shard_size),
        )

    def as_dict(self) -> dict[str, int]:
        return {key: value for key, value in asdict(self).items() if value is not None}

    def places_ranks_like(self, other: WorldLayout) -> bool:
        """Whether ``other`` has the same world, DP and TP sizes: then every rank's state fits."""
        return (self.world_size, self.dp_size, self.tp_size) == (
            other.world_size,
            other.dp_size,
            other.tp_size,
        )

    def __str__(self) -> str:
        processes = "1 process" if self.world_size == 1 else f"{self.world_size} processes"
        # The rest of the world is sequence parallelism (SP ranks share a DP rank).
        sp_size = self.world_size // (self.dp_size * self.tp_size)
        sp = f" x sp_size {sp_size}" if sp_size > 1 else ""
        return f"{processes} (dp_size {self.dp_size}{sp} x tp_size {self.tp_size})"

    def describe_sharding(self) -> str:
        if self.dp_shard_size is None or self.dp_shard_size == 1:
            return "parameters replicated over the DP ranks" if self.dp_size > 1 else "no DP"
        if self.dp_shard_size == self.dp_size:
            return f"parameters sharded over all {self.dp_size} DP ranks (FSDP2)"
        if self.dp_shard_size > self.dp_size:  # sequence parallelism: over DP x SP
            return f"parameters sharded over all {self.dp_shard_size} DP x SP ranks (FSDP2)"
        return (
            f"parameters sharded over {self.dp_shard_size} DP ranks and replicated "
            f"{self.dp_size // self.dp_shard_size} times (HSDP)"
        )


def _dp_shard_size(model: Module) -> int:
    """How many DP ranks the first parameter is sharded over: its DTensor's ``Shard`` placements
    on mesh dimensions other than ``tp``."""
    # Loaded already whenever a parameter can be one: DCP's state dicts and FSDP2 import it.
    from torch.distributed.tensor import DTensor

    for param in model.parameters():
        if not isinstance(param, DTensor):
            continue
        mesh = param.device_mesh
        names = mesh.mesh_dim_names or ()
        size = 1
        for dim, placement in enumerate(param.placements):
            if placement.is_shard() and (dim >= len(names) or names[dim] != "tp"):
                size *= mesh.size(dim)
        return size
    return 1


def needs_reshard(
    saved: WorldLayout, now: WorldLayout, *, step_dir: Path, step_nr: int, reshard: bool
) -> bool:
    """Whether a checkpoint of ``saved`` must be resharded into ``now``; an error if not allowed."""
    if saved.places_ranks_like(now):
        _warn_if_sharded_otherwise(saved, now, step_nr)
        return False
    if not reshard:
        raise CheckpointLayoutError(
            f"The checkpoint of step {step_nr} in {step_dir.parent} was saved by {saved}, but "
            f"this run has {now}. "
            f"Resume with {saved.world_size} processes and tp_size {saved.tp_size} for a "
            "bit-exact resume, or pass reshard_on_resume=True to the Trainer to reshard the "
            "model, optimizer and data position into this layout."
        )
    log.warning("Resharding the checkpoint of step %d, saved by %s, into %s.", step_nr, saved, now)
    return True


def _warn_if_sharded_otherwise(saved: WorldLayout, now: WorldLayout, step_nr: int) -> None:
    """DDP, FSDP2 and HSDP reduce gradients in different orders: switching between them loads
    every state as it is, but the run is no longer bit-identical to an uninterrupted one."""
    if None in (saved.dp_shard_size, now.dp_shard_size) or saved.dp_shard_size == now.dp_shard_size:
        return
    log.warning(
        "The checkpoint of step %d was saved with %s; this run has %s. It resumes, but the "
        "gradients are reduced in another order, so the run is no longer bit-identical to an "
        "uninterrupted one. Resume with the data parallelism of the saving run for that.",
        step_nr,
        saved.describe_sharding(),
        now.describe_sharding(),
    )
