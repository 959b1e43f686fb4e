"""Checkpoint faults: ranks without a shared directory, a full disk, damaged files, hostile pickles.

Issue 11, items 5, 7, 8 and 12. Each case is a set of trials; the damage variants extend those of
tests/checkpoint/test_manager.py (a truncated, altered or removed DCP file, a cut manifest).
"""

from __future__ import annotations

import json
import os
import pickle
import re
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from checkpoint import CheckpointError, CheckpointLoadError, CheckpointManager
from checkpoint.integrity import digest_file
from gangs import Gangs
from tests.conftest import REPO_ROOT, assert_ok, child_env, rank_reports

pytestmark = [pytest.mark.faults]


def make_model(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def save(manager: CheckpointManager, step_nr: int) -> nn.Module:
    model, optimizer = make_model(step_nr)
    manager.save_checkpoint(
        step_nr, model=model, optimizer=optimizer, trainer_state={"step_nr": step_nr}
    )
    return model


def load_last(manager: CheckpointManager) -> tuple[int | None, nn.Module]:
    model, optimizer = make_model(0)
    loaded = manager.load_last_checkpoint(model=model, optimizer=optimizer)
    return (None if loaded is None else loaded.step_nr), model


def assert_same_weights(a: nn.Module, b: nn.Module) -> None:
    for x, y in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(x, y)


@pytest.fixture
def manager(tmp_path: Path) -> CheckpointManager:
    return CheckpointManager(tmp_path / "checkpoints", Gangs.single())


# ----------------------------------------------------------- 5: a shared checkpoint directory


def test_ranks_that_see_different_checkpoint_directories_all_stop_with_one_clear_error(
    two_rank_checks: Path,
) -> None:
    out = two_rank_checks / "dirs"
    reports = rank_reports(out, 2)
    errors = {report["error"] for report in reports}
    assert len(errors) == 1, "the ranks disagree on the verdict"
    error = errors.pop()
    assert f"rank 0 ({out / 'rank_0' / 'checkpoints'})" in error
    assert f"rank 1 uses {out / 'rank_1' / 'checkpoints'}" in error
    assert "Checkpoints need a filesystem shared by all ranks" in error
    assert [report["probe_left"] for report in reports] == [[], []]


# --------------------------------------------------------------------------- 7: a full disk


@pytest.mark.parametrize(
    ("where", "mode"),
    [
        # `make test` fills the disk in one sync and one async save; `make test-all` in all six.
        pytest.param(where, mode, id=f"{where}-{mode}", marks=() if fast else pytest.mark.slow)
        for where, mode, fast in [
            ("model", "sync", True),
            ("model", "async", False),
            ("optimizer", "sync", False),
            ("optimizer", "async", True),
            ("trainer", "sync", False),
            ("trainer", "async", False),
        ]
    ],
)
def test_a_full_disk_fails_the_save_clearly_keeps_the_last_checkpoint_and_the_run_resumes(
    tmp_path: Path, where: str, mode: str
) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "tests/workers/checkpoint_check.py",
            "diskfull",
            str(tmp_path),
            where,
            mode,
        ],
        env=child_env(),
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert_ok(result)
    report: dict[str, Any] = json.loads((tmp_path / "rank_0.json").read_text())
    assert report["error"].startswith(
        "The checkpoint of step 2 was not saved, and the earlier ones are kept:"
    )
    assert (
        "[Errno 27] File too large. The disk (or a file size or quota limit) is full"
        in (report["error"])
    )
    assert report["left"] == ["step_1"]  # the failed save's .tmp is gone, freeing its space
    assert report["resumed_from"] == 1 and report["weights_equal"]
    assert report["committed_after"] == [1, 2]


# ----------------------------------------------------------------------- 8: damaged files


def _foreign_model_file(step_dir: Path) -> str:
    other = step_dir.parent / "step_10" / "model" / "__0_0.distcp"
    (step_dir / "model" / "__0_0.distcp").write_bytes(other.read_bytes())
    return "__0_0.distcp does not match its xxh3_128 digest"


def _foreign_trainer_file(step_dir: Path) -> str:
    other = step_dir.parent / "step_10" / "trainer" / "rank_0.pt"
    (step_dir / "trainer" / "rank_0.pt").write_bytes(other.read_bytes())
    return "rank_0.pt does not match its xxh3_128 digest"


def _missing_trainer_file(step_dir: Path) -> str:
    (step_dir / "trainer" / "rank_0.pt").unlink()
    return "rank_0.pt is missing from the checkpoint of step 20"


def _missing_dcp_metadata(step_dir: Path) -> str:
    (step_dir / "optimizer" / ".metadata").unlink()
    return ".metadata is missing from the checkpoint of step 20"


def _emptied_file(step_dir: Path) -> str:
    (step_dir / "model" / "__0_0.distcp").write_bytes(b"")
    return "__0_0.distcp has 0 bytes, but the manifest says"


def _garbage_manifest(content: bytes, message: str) -> Any:
    def damage(step_dir: Path) -> str:
        (step_dir / "manifest.json").write_bytes(content)
        return message

    return damage


def _manifest_entry_out_of_the_checkpoint(step_dir: Path) -> str:
    path = step_dir / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["files"]["../step_10/manifest.json"] = {"size": 1, "digest": "0" * 32}
    path.write_text(json.dumps(manifest))
    return "names a file outside it: ../step_10/manifest.json"


DAMAGE = {
    "foreign model file": _foreign_model_file,
    "foreign trainer file": _foreign_trainer_file,
    "missing trainer file": _missing_trainer_file,
    "missing DCP metadata": _missing_dcp_metadata,
    "emptied file": _emptied_file,
    "binary manifest": _garbage_manifest(os.urandom(64), "cannot be read"),
    "empty manifest": _garbage_manifest(b"", "cannot be read"),
    "manifest a list": _garbage_manifest(b"[1, 2]", "is not a checkpoint manifest"),
    "manifest without files": _garbage_manifest(b'{"step_nr": 20}', "is not a checkpoint manifest"),
    "manifest with bad entries": _garbage_manifest(
        b'{"format_version": 2, "algorithm": "xxh3_128", "files": {"x": 3}}',
        "has a malformed file entry",
    ),
    "manifest naming an outside file": _manifest_entry_out_of_the_checkpoint,
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damage_is_found_with_a_clear_error_and_the_previous_checkpoint_loads(
    manager: CheckpointManager, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    previous = save(manager, 10)
    save(manager, 20)
    message = DAMAGE[damage](manager.checkpoint_dir / "step_20")
    with pytest.raises(CheckpointError, match=re.escape(message)):
        manager.verify(20)
    step_nr, model = load_last(manager)
    assert step_nr == 10
    assert_same_weights(model, previous)
    assert "Skipping the checkpoint of step 20, which is damaged" in caplog.text
    assert message in caplog.text
    assert (manager.checkpoint_dir / "step_20.damaged").is_dir()


def _fail_reading_the_model(monkeypatch: pytest.MonkeyPatch, error: Exception) -> None:
    from checkpoint.dcp_io import _SafeReader

    read_data = _SafeReader.read_data

    def failing(self: _SafeReader, *args: Any, **kwargs: Any) -> Any:
        if "step_20" in str(self.path):
            raise error
        return read_data(self, *args, **kwargs)

    monkeypatch.setattr(_SafeReader, "read_data", failing)


def _fail_loading_the_trainer_state(monkeypatch: pytest.MonkeyPatch, error: Exception) -> None:
    load = torch.load

    def failing(file: Any, *args: Any, **kwargs: Any) -> Any:
        if "step_20" in str(file):
            raise error
        return load(file, *args, **kwargs)

    monkeypatch.setattr(torch, "load", failing)


MACHINE_FAILURES = {
    "a read error in DCP": (_fail_reading_the_model, OSError(5, "Input/output error")),
    "out of memory in DCP": (_fail_reading_the_model, MemoryError()),
    "a failed import": (_fail_loading_the_trainer_state, ModuleNotFoundError("No module 'x'")),
}


@pytest.mark.parametrize("failure", MACHINE_FAILURES)
def test_an_intact_checkpoint_that_the_machine_fails_to_load_is_not_skipped_as_damaged(
    manager: CheckpointManager, monkeypatch: pytest.MonkeyPatch, failure: str
) -> None:
    """Falling back to step 10 would lose the steps after it, and a retry loads step 20."""
    save(manager, 10)
    latest = save(manager, 20)
    inject, error = MACHINE_FAILURES[failure]
    with monkeypatch.context() as patch:
        inject(patch, error)
        with pytest.raises(CheckpointLoadError, match="checkpoint of step 20 is intact") as info:
            load_last(manager)
    assert "That is not damage, so the run does not fall back" in str(info.value)
    assert [p.name for p in sorted(manager.checkpoint_dir.iterdir())] == ["step_10", "step_20"]
    step_nr, model = load_last(manager)
    assert step_nr == 20
    assert_same_weights(model, latest)


def test_ranks_agree_that_an_intact_checkpoint_one_rank_failed_to_load_is_not_damaged(
    two_rank_checks: Path,
) -> None:
    out = two_rank_checks / "machine"
    reports = rank_reports(out, 2)
    assert [report["error"][0] for report in reports] == ["CheckpointLoadError"] * 2
    assert "no memory left for the trainer state" in reports[1]["error"][1]
    for report in reports:
        assert report["left"] == ["step_10", "step_20"]
        assert report["resumed_from"] == 20 and report["weights_equal"]


# ------------------------------------------------------------------- 12: hostile pickles


class _RunsCode:
    """Unpickling this runs a shell command: what a forged checkpoint file would carry."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def _forge(step_dir: Path, name: str, payload: bytes, *, fix_manifest: bool) -> None:
    (step_dir / name).write_bytes(payload)
    if fix_manifest:  # as an attacker who can write the checkpoint can do
        path = step_dir / "manifest.json"
        manifest = json.loads(path.read_text())
        manifest["files"][name] = digest_file(step_dir / name, "xxh3_128").as_entry()
        path.write_text(json.dumps(manifest))


def _torch_payload(marker: Path, tmp_path: Path) -> bytes:
    file = tmp_path / "payload.pt"
    torch.save({"train_state": _RunsCode(marker)}, file)
    return file.read_bytes()


@pytest.mark.parametrize(
    ("name", "fix_manifest", "message"),
    [
        ("trainer/rank_0.pt", False, "it is truncated or altered"),
        ("trainer/rank_0.pt", True, "Weights only load failed"),
        ("model/.metadata", True, "which DCP metadata never holds"),
        ("optimizer/.metadata", True, "which DCP metadata never holds"),
    ],
)
def test_a_checkpoint_file_carrying_a_malicious_pickle_is_refused_and_runs_no_code(
    manager: CheckpointManager,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    name: str,
    fix_manifest: bool,
    message: str,
) -> None:
    marker = tmp_path / "pwned"
    previous = save(manager, 10)
    save(manager, 20)
    if name.endswith(".pt"):
        payload = _torch_payload(marker, tmp_path)
    else:
        payload = pickle.dumps(_RunsCode(marker))
    _forge(manager.checkpoint_dir / "step_20", name, payload, fix_manifest=fix_manifest)

    step_nr, model = load_last(manager)
    assert not marker.exists(), "unpickling the forged file ran its code"
    assert step_nr == 10
    assert_same_weights(model, previous)
    assert "Skipping the checkpoint of step 20, which is damaged" in caplog.text
    assert message in caplog.text


def test_a_forged_optimizer_entry_is_refused_and_runs_no_code(
    manager: CheckpointManager, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """DCP stores non-tensor entries (``param_groups``) as pickles and loads them with
    ``weights_only=False``; a forged one, with its manifest fixed, must not run."""
    from torch.distributed.checkpoint import save as dcp_save
    from torch.distributed.checkpoint.state_dict import get_state_dict

    marker = tmp_path / "pwned"
    previous = save(manager, 10)
    save(manager, 20)
    model, optimizer = make_model(20)
    _, optim_state = get_state_dict(model, optimizer)
    optim_state["param_groups"][0]["lr"] = _RunsCode(marker)
    forged = tmp_path / "forged"
    with warnings.catch_warnings():  # "torch.distributed is disabled": one process is meant
        warnings.simplefilter("ignore", UserWarning)
        dcp_save(optim_state, checkpoint_id=forged, no_dist=True)
    step_dir = manager.checkpoint_dir / "step_20"
    for file in sorted(forged.iterdir()):
        _forge(step_dir, f"optimizer/{file.name}", file.read_bytes(), fix_manifest=True)

    step_nr, model = load_last(manager)
    assert not marker.exists(), "unpickling the forged entry ran its code"
    assert step_nr == 10
    assert_same_weights(model, previous)
    assert "Skipping the checkpoint of step 20, which is damaged" in caplog.text
    assert "Weights only load failed" in caplog.text
