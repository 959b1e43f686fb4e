"""The world layout a checkpoint was saved by, and whether this run may load it."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from checkpoint.errors import CheckpointLayoutError
from gangs import Gangs

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorldLayout:
    world_size: int
    dp_size: int
    tp_size: int

    @staticmethod
    def of(gangs: Gangs) -> WorldLayout:
        return WorldLayout(world_size=gangs.root.size, dp_size=gangs.dp.size, tp_size=gangs.tp.size)

    @staticmethod
    def of_manifest(manifest: Mapping[str, Any]) -> WorldLayout:
        return WorldLayout(
            world_size=int(manifest["world_size"]),
            dp_size=int(manifest["dp_size"]),
            tp_size=int(manifest["tp_size"]),
        )

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    def __str__(self) -> str:
        processes = "1 process" if self.world_size == 1 else f"{self.world_size} processes"
        return f"{processes} (dp_size {self.dp_size} x tp_size {self.tp_size})"


def needs_reshard(
    saved: WorldLayout, now: WorldLayout, *, step_dir: Path, step_nr: int, reshard: bool
) -> bool:
    """Whether a checkpoint of ``saved`` must be resharded into ``now``; an error if not allowed."""
    if saved == now:
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
