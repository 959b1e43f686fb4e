"""Digests taken while writing, and verification shared by the ranks."""

from __future__ import annotations

import json
import os
import random
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from checkpoint import CheckpointError, CheckpointManager
from checkpoint.integrity import HashingReader, assign_hashing, digest_file, share_of
from gangs import Gangs
from tests.conftest import rank_reports


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


# Both ways through DCP (checkpoint.dcp_io): the fast path, and public DCP only.
@pytest.mark.parametrize("mode", ["shares", "shares_public"], ids=["fast", "public"])
def test_two_ranks_hash_as_they_write_and_verify_each_byte_once(
    two_rank_checks: Path, mode: str
) -> None:
    out = two_rank_checks / mode
    reports: list[dict[str, Any]] = rank_reports(out, 2)
    files = reports[0]["manifest_files"]
    step_dir = out / "checkpoints" / "step_2"
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
    # A save in flight marked unhealthy commits, and every rank passes it over, then replaces it.
    for report in reports:
        assert not report["healthy_3"] and report["healthy_3_again"]
        assert report["last_healthy"] == report["resumed_from"] == 1
        assert report["replaced_dirs"] == ["step_3.unhealthy"]


def test_two_ranks_of_replicated_state_stage_one_part_each_for_an_async_save(
    two_rank_checks: Path,
) -> None:
    out = two_rank_checks / "staging"
    reports: list[dict[str, Any]] = rank_reports(out, 2)
    for part in ("model", "optimizer"):
        staged = [set(report[part]["staged"]) for report in reports]
        assert staged[0] and staged[1], f"a rank stages nothing of the {part}"
        assert not staged[0] & staged[1], f"an entry of the {part} is staged twice"
        assert staged[0] | staged[1] == set(reports[0][part]["entries"])


def test_verification_is_split_by_size_and_covers_every_file_once() -> None:
    files = {"a": 100, "b": 60, "c": 50, "d": 10, "e": 0}
    shares = [share_of(files, rank=rank, world_size=2) for rank in range(2)]
    assert sorted(shares[0] + shares[1]) == sorted(files)
    assert [sum(files[n] for n in share) for share in shares] == [110, 110]
    assert share_of(files, rank=0, world_size=1) == ["a", "b", "c", "d", "e"]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"format_version": 3}, "has format_version 3, but this version of the project reads 2"),
        ({"format_version": 1}, "has format_version 1, but this version of the project reads 2"),
        ({"algorithm": "sha256"}, "algorithm must be 'xxh3_128', but is 'sha256'"),
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


def test_a_file_hashed_while_it_is_read_in_zip_order_has_the_digest_of_a_plain_read(
    tmp_path: Path,
) -> None:
    file = tmp_path / "blob"
    data = os.urandom(300_000)
    file.write_bytes(data)
    # As torch.load reads a zip: its directory at the end first, then front to back, skipping the
    # headers of records between the parts it reads.
    reads = [(len(data) - 4096, 4096), (0, 30), (100, 200_000), (200_150, 50_000)]
    with HashingReader(file, algorithm="xxh3_128") as reader:
        for offset, size in reads:
            reader.seek(offset)
            assert reader.read(size) == data[offset : offset + size]
        digest = reader.finish()
    assert digest == digest_file(file, "xxh3_128")
    # Read for the digest alone: the 70 and 50 skipped bytes, and the tail past the last read.
    assert reader.reread == 70 + 50 + (len(data) - 250_150)


def test_a_file_read_in_any_order_is_hashed_whole(tmp_path: Path) -> None:
    file = tmp_path / "blob"
    data = os.urandom(1 << 20)
    file.write_bytes(data)
    offsets = list(range(0, len(data), 1000))
    random.Random(0).shuffle(offsets)
    with HashingReader(file, algorithm="xxh3_128") as reader:
        for offset in offsets:
            reader.seek(offset)
            assert reader.read(1000) == data[offset : offset + 1000]
        assert reader.finish() == digest_file(file, "xxh3_128")


def test_each_file_read_at_load_is_hashed_by_one_rank_that_reads_the_most_of_it() -> None:
    reads = [
        {"a": 100, "b": 60, "c": 50, "x": 10},
        {"a": 100, "b": 60, "c": 50, "x": 5},
        {"d": 40},
    ]
    # a: rank 0 (a tie, the lowest rank), b and c: rank 1 (less to hash), x: rank 0 (reads it
    # whole), d: rank 2 (the only reader).
    assert assign_hashing(reads) == [["a", "x"], ["b", "c"], ["d"]]
    assert assign_hashing([{}, {}]) == [[], []]


def _bytes_read_by_this_process() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("/proc/self/io has no rchar line")


@pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="counts reads in /proc/self/io")
def test_a_resume_reads_each_byte_of_the_checkpoint_once(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path / "checkpoints", Gangs.single())
    torch.manual_seed(0)
    # Big enough for the bytes that torch.load reads twice itself (a zip's directory) not to count.
    model = nn.Sequential(*(nn.Linear(1024, 1024) for _ in range(2)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 1024)).sum().backward()
    optimizer.step()
    for step_nr in (1, 2):
        manager.save_checkpoint(step_nr, model=model, optimizer=optimizer, trainer_state={})
    expected = [p.detach().clone() for p in model.parameters()]
    manager.load_checkpoint(2, model=model, optimizer=optimizer)  # imports what loading needs
    step_dir = manager.checkpoint_dir / "step_1"
    size = sum(file.stat().st_size for file in step_dir.rglob("*") if file.is_file())

    with torch.no_grad():
        for param in model.parameters():
            param.zero_()
    before = _bytes_read_by_this_process()
    manager.load_checkpoint(1, model=model, optimizer=optimizer)
    read = _bytes_read_by_this_process() - before

    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), expected, strict=True))
    # Verifying first and loading then read it all twice; a few kB of zip headers are read again.
    assert size <= read < 1.02 * size, (read, size)


def test_an_async_save_stages_only_the_entries_this_rank_writes() -> None:
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

    from checkpoint.dcp_io import staging_writer

    state = {"w": torch.ones(4), "optim": {"w": {"exp_avg": torch.zeros(4)}}}
    writer = staging_writer()
    writer.own_entries = frozenset({"w"})  # another rank writes optim.w.exp_avg
    staged = writer.stage(state)
    state["w"].add_(1)  # the loop goes on
    assert torch.equal(staged["w"], torch.ones(4))
    assert staged["optim"]["w"]["exp_avg"] is state["optim"]["w"]["exp_avg"]  # not copied

    # Were a plan to give this rank an entry it did not stage, it would write nothing.
    plan = SavePlan([WriteItem(MetadataIndex("optim.w.exp_avg"), WriteItemType.TENSOR)])
    with pytest.raises(
        CheckpointError, match=re.escape("entries it did not stage, such as optim.w")
    ):
        writer.write_data(plan, planner=None)  # type: ignore[arg-type]


def _make(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 128), nn.Linear(128, 8))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    for _ in range(seed):
        model(torch.randn(2, 64)).sum().backward()
        optimizer.step()
    return model, optimizer


@pytest.mark.parametrize(
    ("victim", "where"),
    [
        ("optimizer/__0_0.distcp", "middle"),  # a tensor's bytes: it loads, its digest differs
        ("model/__0_0.distcp", "start"),  # a zip header: the load fails
    ],
)
def test_a_damaged_file_of_the_right_size_gives_way_to_the_previous_checkpoint_in_full(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, victim: str, where: str
) -> None:
    manager = CheckpointManager(tmp_path / "checkpoints", Gangs.single())
    for step_nr in (1, 2):
        model, optimizer = _make(step_nr)
        manager.save_checkpoint(step_nr, model=model, optimizer=optimizer, trainer_state={})
    expected_model, expected_optimizer = _make(1)
    file = manager.checkpoint_dir / "step_2" / victim
    data = bytearray(file.read_bytes())
    data[len(data) // 2 if where == "middle" else 2] ^= 0x20
    file.write_bytes(bytes(data))

    model, optimizer = _make(0)
    loaded = manager.load_last_checkpoint(model=model, optimizer=optimizer)

    assert loaded is not None and loaded.step_nr == 1
    assert f"{victim.split('/')[1]} does not match its xxh3_128 digest" in caplog.text
    for param, expected in zip(model.parameters(), expected_model.parameters(), strict=True):
        assert torch.equal(param, expected)
    state = optimizer.state_dict()
    expected_state = expected_optimizer.state_dict()
    for param_nr, moments in expected_state["state"].items():
        for name, value in moments.items():
            assert torch.equal(state["state"][param_nr][name], value), (param_nr, name)


def test_the_exception_chain_follows_causes_then_contexts_and_stops_at_a_loop() -> None:
    from checkpoint.errors import exception_chain

    root = OSError(28, "No space left on device")
    context = ValueError("while writing")
    context.__context__ = root
    top = CheckpointError("save failed")
    top.__cause__ = context
    root.__context__ = top  # a loop, as a re-raise inside a handler can make
    assert list(exception_chain(top)) == [top, context, root]
