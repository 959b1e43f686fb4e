"""Checkpoint integrity under ``torchrun``; each rank writes what it saw as JSON.

``shares OUT``: save a sync and an async checkpoint over all ranks, then verify, load, and load
again after damaging a file of rank 1's share. Records the bytes each rank read to verify. Then
mark an async save in flight unhealthy, resume past it, and save its step again.
``staging OUT``: the entries each rank stages for an asynchronous save of replicated state.
``dirs OUT``: every rank names a checkpoint directory of its own (no shared filesystem).
``machine OUT``: rank 1 runs out of memory loading its trainer state of the newest checkpoint;
then the load is tried again.
``shares_public OUT``: ``shares`` through public DCP only (checkpoint.dcp_io's public path).
``diskfull OUT WHERE MODE``: one process; a save (``sync`` or ``async``) runs out of space (a file
size limit, RLIMIT_FSIZE) while it writes WHERE (``model``, ``optimizer`` or ``trainer``), then
space is freed and the run goes on.

``two_rank_checks.py`` runs the two-rank modes in one launch, with other workers' checks.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

import checkpoint.integrity as integrity
from checkpoint import CheckpointDirectoryError, CheckpointError, CheckpointManager
from checkpoint.dcp_io import IO_ENV_VAR
from checkpoint.integrity import share_of
from checkpoint.manifest import ManifestFiles
from gangs import Gangs, setup_gangs


def make_model(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64), nn.Linear(64, 8))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(3, 64)).sum().backward()
    optimizer.step()
    return model, optimizer


def count_reads(reads: dict[str, int]) -> Callable[[], None]:
    """Record the bytes of every file read to check its digest, or hashed as it loaded (by path);
    returns what stops the counting."""
    digest_file = integrity.digest_file
    check = ManifestFiles.check

    def counting(file: Path, algorithm: str) -> integrity.FileDigest:
        digest = digest_file(file, algorithm)
        reads[str(file)] = reads.get(str(file), 0) + digest.size
        return digest

    def counting_check(files: ManifestFiles, name: str, actual: integrity.FileDigest) -> None:
        file = str(files.step_dir / name)
        reads[file] = reads.get(file, 0) + actual.size
        check(files, name, actual)

    def stop() -> None:
        integrity.digest_file = digest_file
        ManifestFiles.check = check  # type: ignore[method-assign]

    integrity.digest_file = counting  # type: ignore[assignment]
    ManifestFiles.check = counting_check  # type: ignore[method-assign]
    return stop


def shares(output_dir: Path, gangs: Gangs) -> dict[str, Any]:
    rank = gangs.root.rank
    manager = CheckpointManager(output_dir / "checkpoints", gangs)
    manager.check_shared_directory()
    reads: dict[str, int] = {}
    stop_counting = count_reads(reads)
    model, optimizer = make_model(1)
    manager.save_checkpoint(1, model=model, optimizer=optimizer, trainer_state={"rank": rank})
    manager.save_checkpoint(
        2, model=model, optimizer=optimizer, trainer_state={"rank": rank}, async_checkpoint=True
    )
    manager.finish_pending_save()
    report: dict[str, Any] = {"read_while_saving": dict(reads)}
    reads.clear()
    manifest = manager.verify(2)
    report["read_to_verify"] = dict(reads)
    report["manifest_files"] = {name: e["size"] for name, e in manifest["files"].items()}
    reads.clear()
    fresh, fresh_optimizer = make_model(7)
    loaded = manager.load_last_checkpoint(model=fresh, optimizer=fresh_optimizer)
    assert loaded is not None
    report["read_to_load"] = dict(reads)
    report["trainer_state"] = loaded.trainer_state
    report["weights_equal"] = all(
        torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters(), strict=True)
    )

    # Damage a file that rank 1 verifies: every rank must still reach the same verdict.
    sizes = report["manifest_files"]
    victim = manager.checkpoint_dir / "step_2" / share_of(sizes, rank=1, world_size=2)[0]
    if rank == 0:
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0xFF
        victim.write_bytes(bytes(data))
    gangs.root.barrier()
    loaded = manager.load_last_checkpoint(model=fresh, optimizer=fresh_optimizer)
    report["after_damage_loaded_step"] = None if loaded is None else loaded.step_nr
    report["damaged_dirs"] = [path.name for path in manager.damaged_dirs()]
    report.update(unhealthy(manager, model, optimizer, rank))
    stop_counting()
    return report


def shares_public(output_dir: Path, gangs: Gangs) -> dict[str, Any]:
    previous = os.environ.get(IO_ENV_VAR)
    os.environ[IO_ENV_VAR] = "public"
    try:
        return shares(output_dir, gangs)
    finally:
        if previous is None:
            del os.environ[IO_ENV_VAR]
        else:
            os.environ[IO_ENV_VAR] = previous


def unhealthy(
    manager: CheckpointManager, model: nn.Module, optimizer: torch.optim.Optimizer, rank: int
) -> dict[str, Any]:
    """Mark the async save of step 3, still in flight, unhealthy; what each rank sees after."""
    state = {"rank": rank}
    manager.save_checkpoint(
        3, model=model, optimizer=optimizer, trainer_state=state, async_checkpoint=True
    )
    manager.mark_unhealthy([3], reason="a spike")
    report: dict[str, Any] = {"healthy_3": manager.is_healthy(3)}
    report["last_healthy"] = manager.last_healthy_step()
    loaded = manager.load_last_checkpoint(model=model, optimizer=optimizer)
    report["resumed_from"] = None if loaded is None else loaded.step_nr
    manager.save_checkpoint(3, model=model, optimizer=optimizer, trainer_state=state)
    report["healthy_3_again"] = manager.is_healthy(3)
    report["replaced_dirs"] = [path.name for path in manager.replaced_dirs()]
    return report


def staging(output_dir: Path, gangs: Gangs) -> dict[str, Any]:
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from checkpoint.dcp_io import own_entries

    model, optimizer = make_model(1)  # the same on both ranks, as DDP's
    report: dict[str, Any] = {}
    for part, state in zip(("model", "optimizer"), get_state_dict(model, optimizer), strict=True):
        staged = own_entries(state, rank=gangs.root.rank, gather=gangs.root.all_gather_objects)
        report[part] = {"staged": sorted(staged), "entries": sorted(flatten_state_dict(state)[0])}
    return report


def dirs(output_dir: Path, gangs: Gangs) -> dict[str, Any]:
    rank = gangs.root.rank
    manager = CheckpointManager(output_dir / f"rank_{rank}" / "checkpoints", gangs)
    report: dict[str, Any] = {}
    try:
        manager.check_shared_directory()
    except CheckpointDirectoryError as ex:
        report["error"] = str(ex)
    report["probe_left"] = [p.name for p in manager.checkpoint_dir.glob(".*")]
    return report


def machine(output_dir: Path, gangs: Gangs) -> dict[str, Any]:
    manager = CheckpointManager(output_dir / "checkpoints", gangs)
    for step_nr in (10, 20):
        model, optimizer = make_model(step_nr)
        manager.save_checkpoint(
            step_nr, model=model, optimizer=optimizer, trainer_state={"step_nr": step_nr}
        )
    load = torch.load

    def failing(file: Any, *args: Any, **kwargs: Any) -> Any:
        if gangs.root.rank == 1 and "step_20" in str(file):
            raise MemoryError("no memory left for the trainer state")
        return load(file, *args, **kwargs)

    fresh, fresh_optimizer = make_model(0)
    report: dict[str, Any] = {}
    torch.load = failing  # type: ignore[assignment]
    try:
        manager.load_last_checkpoint(model=fresh, optimizer=fresh_optimizer)
    except CheckpointError as ex:
        report["error"] = [type(ex).__name__, str(ex)]
    torch.load = load
    report["left"] = sorted(p.name for p in manager.checkpoint_dir.iterdir())
    loaded = manager.load_last_checkpoint(model=fresh, optimizer=fresh_optimizer)
    report["resumed_from"] = None if loaded is None else loaded.step_nr
    report["weights_equal"] = torch.equal(fresh[0].weight, model[0].weight)
    return report


# Limits that the model (1 MiB), the optimizer (2 MiB) or the trainer state (3 MiB) exceeds first.
DISK_FULL_LIMITS = {"model": 2**19, "optimizer": 3 * 2**19, "trainer": 5 * 2**19}


def disk_full(output_dir: Path, where: str, mode: str) -> dict[str, Any]:
    limit = DISK_FULL_LIMITS[where]
    manager = CheckpointManager(output_dir / "checkpoints", setup_gangs())
    big = nn.Linear(512, 512)  # 1 MiB of weights, 2 MiB of AdamW state
    optimizer = torch.optim.AdamW(big.parameters(), lr=0.1)
    big(torch.randn(2, 512)).sum().backward()
    optimizer.step()
    state = {"blob": torch.arange(3 * 2**18 if where == "trainer" else 16, dtype=torch.float32)}
    manager.save_checkpoint(1, model=big, optimizer=optimizer, trainer_state=state)
    report: dict[str, Any] = {}
    # A write past the limit fails with EFBIG instead of killing the process.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        manager.save_checkpoint(
            2, model=big, optimizer=optimizer, trainer_state=state, async_checkpoint=mode == "async"
        )
        manager.finish_pending_save()
    except CheckpointError as ex:
        report["error"] = str(ex)
    report["left"] = sorted(p.name for p in manager.checkpoint_dir.iterdir())
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))  # space is freed

    fresh = nn.Linear(512, 512)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    loaded = manager.load_last_checkpoint(model=fresh, optimizer=fresh_optimizer)
    report["resumed_from"] = None if loaded is None else loaded.step_nr
    report["weights_equal"] = torch.equal(fresh.weight, big.weight)
    manager.save_checkpoint(2, model=fresh, optimizer=fresh_optimizer, trainer_state=state)
    report["committed_after"] = [info.step_nr for info in manager.list_checkpoints()]
    for step_nr in report["committed_after"]:
        manager.verify(step_nr)
    return report


MODES: dict[str, Callable[[Path, Gangs], dict[str, Any]]] = {
    "shares": shares,
    "shares_public": shares_public,
    "staging": staging,
    "dirs": dirs,
    "machine": machine,
}


if __name__ == "__main__":
    mode, out = sys.argv[1], Path(sys.argv[2])
    rank_nr = int(os.environ.get("RANK", "0"))
    if mode == "diskfull":
        result = disk_full(out, sys.argv[3], sys.argv[4])
        (out / f"rank_{rank_nr}.json").write_text(json.dumps(result))
    else:
        gangs = setup_gangs()
        (out / f"rank_{rank_nr}.json").write_text(json.dumps(MODES[mode](out, gangs)))
        gangs.root.close()
