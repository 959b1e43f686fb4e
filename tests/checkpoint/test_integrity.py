"""Digests taken while writing, verification shared by the ranks, and the format 1 checkpoints."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from checkpoint import CheckpointError, CheckpointManager
from checkpoint.integrity import digest_file, share_of
from gangs import Gangs
from tests.conftest import RunTorch, assert_ok

FORMAT_1_CHECKPOINTS = Path(__file__).resolve().parents[1] / "data" / "format_1_run" / "checkpoints"


def save(manager: CheckpointManager, step_nr: int) -> None:
    torch.manual_seed(step_nr)
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 16)).sum().backward()
    optimizer.step()
    manager.save_checkpoint(
        step_nr, model=model, optimizer=optimizer, trainer_state={"step_nr": step_nr}
    )


def test_digests_taken_while_writing_match_the_files(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path / "checkpoints", Gangs.single())
    save(manager, 3)
    step_dir = manager.checkpoint_dir / "step_3"
    manifest = json.loads((step_dir / "manifest.json").read_text())
    on_disk = sorted(
        p.relative_to(step_dir).as_posix()
        for p in step_dir.rglob("*")
        if p.is_file() and p.name != "manifest.json"
    )
    assert sorted(manifest["files"]) == on_disk  # DCP's .metadata included
    for name, entry in manifest["files"].items():
        digest = digest_file(step_dir / name, "xxh3_128")
        assert (digest.size, digest.digest) == (entry["size"], entry["digest"]), name


def test_two_ranks_hash_as_they_write_and_verify_each_byte_once(
    run_torchrun: RunTorch, tmp_path: Path
) -> None:
    assert_ok(run_torchrun(2, "tests/workers/checkpoint_check.py", "shares", str(tmp_path)))
    reports: list[dict[str, Any]] = [
        json.loads((tmp_path / f"rank_{rank}.json").read_text()) for rank in range(2)
    ]
    files = reports[0]["manifest_files"]
    step_dir = tmp_path / "checkpoints" / "step_2"
    # Both ranks wrote DCP files and a trainer file; rank 0 gathered them without reading any.
    assert {"model/__0_0.distcp", "model/__1_0.distcp", "trainer/rank_1.pt"} <= set(files)
    for report in reports:
        assert report["read_while_saving"] == {}
        assert report["weights_equal"]
    assert [r["trainer_state"] for r in reports] == [{"rank": 0}, {"rank": 1}]
    for phase in ("read_to_verify", "read_to_load"):
        shares = [set(report[phase]) for report in reports]
        assert all(shares), f"a rank checked nothing while it could share the work ({phase})"
        assert not shares[0] & shares[1], f"a file was read twice ({phase})"
        read = {path: size for report in reports for path, size in report[phase].items()}
        assert read == {str(step_dir / name): size for name, size in files.items()}
    # A damaged file in rank 1's share: both ranks skip the checkpoint and load the one before.
    assert [r["after_damage_loaded_step"] for r in reports] == [1, 1]
    assert reports[0]["damaged_dirs"] == ["step_2.damaged"]


def test_verification_is_split_by_size_and_covers_every_file_once() -> None:
    files = {"a": 100, "b": 60, "c": 50, "d": 10, "e": 0}
    shares = [share_of(files, rank=rank, world_size=2) for rank in range(2)]
    assert sorted(shares[0] + shares[1]) == sorted(files)
    assert [sum(files[n] for n in share) for share in shares] == [110, 110]
    assert share_of(files, rank=0, world_size=1) == ["a", "b", "c", "d", "e"]


def test_format_1_checkpoints_still_verify_and_damage_is_still_found(tmp_path: Path) -> None:
    shutil.copytree(FORMAT_1_CHECKPOINTS, tmp_path / "checkpoints")
    manager = CheckpointManager(tmp_path / "checkpoints", Gangs.single())
    for step_nr in (3, 6):
        manifest = manager.verify(step_nr)
        assert manifest["format_version"] == 1 and "algorithm" not in manifest
    victim = tmp_path / "checkpoints" / "step_6" / "trainer" / "rank_0.pt"
    data = bytearray(victim.read_bytes())
    data[-30] ^= 0x01
    victim.write_bytes(bytes(data))
    with pytest.raises(
        CheckpointError, match=re.escape("rank_0.pt does not match its sha256 digest")
    ):
        manager.verify(6)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"format_version": 3}, "has format_version 3, but this version of the project reads"),
        ({"algorithm": "md4"}, "algorithm must be 'xxh3_128' or 'sha256', but is 'md4'"),
    ],
)
def test_a_manifest_this_version_cannot_read_is_refused_clearly(
    tmp_path: Path, change: dict[str, Any], message: str
) -> None:
    manager = CheckpointManager(tmp_path / "checkpoints", Gangs.single())
    save(manager, 1)
    path = manager.checkpoint_dir / "step_1" / "manifest.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    with pytest.raises(CheckpointError, match=message):
        manager.verify(1)
