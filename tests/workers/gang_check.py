"""Exercise every gang collective under ``torchrun``; each rank writes what it saw as JSON.

Usage: ``gang_check.py OUT TP_SIZE [DP_SHARD_SIZE]`` writes ``OUT/rank_R.json``;
``gang_check.py OUT --cases JSON`` checks several layouts of one launch (one torchrun start-up),
JSON mapping each case's name to ``[tp_size, dp_shard_size, torch path(, ep_size(, sp_size(,
pp_size)))]``, into
``OUT/NAME/rank_R.json``. The torch path is ``private`` or ``public`` (gangs.torch_versions).
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from gangs import (
    FakeGang,
    Gang,
    GangError,
    Gangs,
    ProcessGroupGang,
    ReduceOperation,
    setup_parallel_gangs,
    setup_root_gang,
)
from gangs.torch_versions import PRIVATE_APIS_ENV_VAR
from tests.workers.leave import leave

GANG_TIMEOUT = timedelta(minutes=14)
"""Not torch's default (30 minutes), so a group that did not get the gang's timeout shows."""


def _timeouts(*gangs_and_mesh: object) -> list[float]:
    """The collective timeout, in seconds, of each process group behind the gangs and the mesh
    dims (read from the CPU backend's options: torch has no public getter)."""
    groups = []
    for item in gangs_and_mesh:
        if isinstance(item, ProcessGroupGang):
            groups.append(item.as_process_group())
        elif item is not None and not isinstance(item, Gang):
            groups += [item[name].get_group() for name in item.mesh_dim_names]  # type: ignore[attr-defined]
    options = [g._get_backend(torch.device("cpu")).options for g in groups]
    return [o._timeout.total_seconds() for o in options]


def check(gangs: Gangs) -> dict[str, object]:
    """What this rank sees of ``gangs``: its ranks, every collective's result, its meshes."""
    root, dp, tp = gangs.root, gangs.dp, gangs.tp
    report: dict[str, object] = {
        "root": [root.rank, root.size],
        "dp": [dp.rank, dp.size],
        "tp": [tp.rank, tp.size],
        "dp_fake": isinstance(dp, FakeGang),
        "tp_fake": isinstance(tp, FakeGang),
    }

    value = torch.tensor([float(root.rank)])
    for gang_name, gang in (("root", root), ("dp", dp), ("tp", tp)):
        for op in ReduceOperation:
            reduced = value.clone() + 1
            gang.all_reduce(reduced, op)
            report[f"{gang_name}_{op.value}"] = reduced.item()
        members = torch.zeros(gang.size, 1)
        gang.all_gather(members, value)
        report[f"{gang_name}_members"] = members.flatten().tolist()
        listed = [torch.zeros(1) for _ in range(gang.size)]
        gang.all_gather_to_list(listed, value)
        report[f"{gang_name}_members_list"] = [t.item() for t in listed]
        report[f"{gang_name}_objects"] = gang.all_gather_objects({"rank": root.rank})

    broadcast = torch.tensor([float(root.rank)])
    root.broadcast(broadcast, source_rank=root.size - 1)
    report["broadcast_from_last"] = broadcast.item()
    objects: list[object] = [f"hello from {root.rank}", root.rank]
    root.broadcast_objects(objects, source_rank=0)
    report["broadcast_objects"] = objects

    sub = root.make_gang([0])
    report["make_gang_single"] = None if sub is None else [sub.rank, sub.size]
    try:
        root.make_gang([root.size])
    except GangError as ex:
        report["bad_ranks_error"] = str(ex)

    mesh = gangs.device_mesh if gangs.has_device_mesh else None
    report["mesh"] = None if mesh is None else [list(mesh.mesh_dim_names or ()), mesh.mesh.tolist()]
    if gangs.dp_shard_size is not None:
        report["dp_shard_size"] = gangs.dp_shard_size
        report["hsdp_mesh"] = gangs.hsdp_mesh.mesh.tolist()
        try:
            report["dp_mesh"] = gangs.dp_mesh.mesh.tolist()
        except GangError as ex:  # HSDP x TP off the private path (gangs.torch_versions)
            report["dp_mesh_error"] = str(ex)
    if gangs.ep.size > 1:
        for gang_name, gang in (("ep", gangs.ep), ("ep_replicas", gangs.ep_replicas)):
            members = torch.zeros(gang.size, 1)
            gang.all_gather(members, value)
            report[f"{gang_name}_members"] = members.flatten().tolist()
        report["ep_mesh"] = gangs.ep_mesh.mesh.tolist()
        expert_mesh = gangs.expert_mesh
        report["expert_mesh"] = [list(expert_mesh.mesh_dim_names or ()), expert_mesh.mesh.tolist()]
    if gangs.sp.size > 1:
        for gang_name, gang in (("sp", gangs.sp), ("dp_sp", gangs.dp_sp)):
            members = torch.zeros(gang.size, 1)
            gang.all_gather(members, value)
            report[f"{gang_name}_members"] = members.flatten().tolist()
        report["dp_sp_mesh"] = gangs.dp_sp_mesh.mesh.tolist()
        report["tp_mesh"] = gangs.tp_mesh.mesh.tolist()
        report["sp_timeouts"] = _timeouts(gangs.sp, gangs.dp_sp, gangs.tp_mesh)
    everyone = root.make_gang(list(range(root.size)))
    report["timeouts"] = _timeouts(root, gangs.dp, gangs.tp, everyone, mesh)
    root.barrier()
    return report


def main(output_dir: Path, cases: dict[str, tuple[Any, ...]]) -> None:
    root = setup_root_gang(timeout=GANG_TIMEOUT)
    for name, (tp_size, dp_shard_size, torch_path, *more) in cases.items():
        if torch_path is not None:
            os.environ[PRIVATE_APIS_ENV_VAR] = torch_path
        case_dir = output_dir / name
        case_dir.mkdir(parents=True, exist_ok=True)
        try:
            gangs = setup_parallel_gangs(
                root,
                tp_size=tp_size,
                dp_shard_size=dp_shard_size,
                ep_size=more[0] if more else 1,
                sp_size=more[1] if len(more) > 1 else 1,
                pp_size=more[2] if len(more) > 2 else 1,
            )
            report = check(gangs)
        except BaseException as ex:
            ex.add_note(f"(in gang_check.py's case {name})")
            raise
        (case_dir / f"rank_{root.rank}.json").write_text(json.dumps(report))
    leave(root)


if __name__ == "__main__":
    if sys.argv[2] == "--cases":
        main(Path(sys.argv[1]), json.loads(sys.argv[3]))
    else:
        shard_size = int(sys.argv[3]) if len(sys.argv) > 3 else None
        main(Path(sys.argv[1]), {".": (int(sys.argv[2]), shard_size, None)})
