"""Checkpoint health and permanent snapshots, on disk: an unhealthy checkpoint is never resumed
from, never the last or the best, and never lets retention delete the newest healthy one."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

from checkpoint import (
    CheckpointError,
    CheckpointManager,
    CheckpointNotFoundError,
    RetentionPolicy,
)
from checkpoint.health import unhealthy_reason
from gangs import Gangs
from runtime import TrainerCallback
from runtime.cli.tools import main as cli_main
from tests.checkpoint.test_manager import make_model, save
from tests.conftest import make_toy_trainer

SPIKE = "Loss spike at step 35"


@pytest.fixture
def manager(tmp_path: Path) -> CheckpointManager:
    return CheckpointManager(tmp_path / "checkpoints", Gangs.single())


def reopened(manager: CheckpointManager) -> CheckpointManager:
    """A new manager on the same directory: what a restarted run sees."""
    return CheckpointManager(manager.checkpoint_dir, Gangs.single())


def healthy_steps(manager: CheckpointManager) -> dict[int, bool]:
    return {info.step_nr: info.healthy for info in manager.list_checkpoints()}


def test_marks_persist_are_idempotent_and_leave_the_checkpoint_intact(
    manager: CheckpointManager,
) -> None:
    for step in (10, 20, 30):
        save(manager, step)
    manifest = (manager.checkpoint_dir / "step_20" / "manifest.json").read_bytes()
    manager.mark_unhealthy([20, 30], reason=SPIKE)
    manager.mark_unhealthy([30], reason="another reason")

    again = reopened(manager)
    assert healthy_steps(again) == {10: True, 20: False, 30: False}
    assert again.is_healthy(10) and not again.is_healthy(30)
    assert unhealthy_reason(again.checkpoint_path(30)) == SPIKE  # the first mark stays
    assert again.last_healthy_step() == 10
    assert again.last_healthy_step(before=10) is None
    assert (manager.checkpoint_dir / "step_20" / "manifest.json").read_bytes() == manifest
    again.verify(20)  # the mark touches no digested file
    with pytest.raises(CheckpointNotFoundError, match="no committed checkpoint of step 25"):
        again.is_healthy(25)


def test_marking_a_step_without_a_checkpoint_marks_none(manager: CheckpointManager) -> None:
    save(manager, 10)
    with pytest.raises(CheckpointNotFoundError, match=r"Cannot mark steps \[15\] unhealthy"):
        manager.mark_unhealthy([10, 15], reason=SPIKE)
    assert manager.is_healthy(10)


@pytest.mark.usefixtures("checkpoint_io")
def test_resume_skips_unhealthy_checkpoints_and_refuses_when_all_are(
    manager: CheckpointManager, caplog: pytest.LogCaptureFixture
) -> None:
    healthy = save(manager, 10)
    save(manager, 20)
    save(manager, 30)
    manager.mark_unhealthy([20, 30], reason=SPIKE)
    model, optimizer = make_model(99)
    loaded = reopened(manager).load_last_checkpoint(model=model, optimizer=optimizer)
    assert loaded is not None and loaded.step_nr == 10
    assert "passing over the newer ones of steps [20, 30]: they are marked unhealthy" in caplog.text
    torch.testing.assert_close(model.state_dict(), healthy.state_dict(), rtol=0, atol=0)

    manager.mark_unhealthy([10], reason=SPIKE)
    with pytest.raises(
        CheckpointError,
        match=r"of steps \[10, 20, 30\] are marked unhealthy, and there is no healthy full",
    ):
        manager.load_last_checkpoint(model=model, optimizer=optimizer)


def test_last_and_best_are_healthy_ones(manager: CheckpointManager) -> None:
    for step, score in ((10, 3.0), (20, 2.0), (30, 1.0), (40, 0.5)):
        save(manager, step, score=score)
    manager.mark_unhealthy([30, 40], reason=SPIKE)
    assert manager.select_checkpoint("last", lower_better=True) == 20
    assert manager.select_checkpoint("best", lower_better=True) == 20
    assert manager.select_checkpoint(40, lower_better=True) == 40  # asked for by name
    manager.mark_unhealthy([10, 20], reason=SPIKE)
    with pytest.raises(CheckpointNotFoundError, match="marked unhealthy, so none is the best"):
        manager.select_checkpoint("best", lower_better=True)


def test_keep_last_2_keeps_the_newest_healthy_behind_3_unhealthy(
    manager: CheckpointManager,
) -> None:
    for step in (10, 20, 30, 40, 50, 60):
        save(manager, step)
    manager.mark_unhealthy([40, 50, 60], reason=SPIKE)
    manager.apply_retention(RetentionPolicy(keep_last_n_checkpoints=2))
    # The last two healthy ones count as the last; the unhealthy ones stay for inspection.
    assert healthy_steps(manager) == {20: True, 30: True, 40: False, 50: False, 60: False}
    assert manager.last_healthy_step() == 30


def test_keep_best_counts_only_healthy_checkpoints(manager: CheckpointManager) -> None:
    for step, score in ((10, 3.0), (20, 2.0), (30, 0.1), (40, 4.0)):
        save(manager, step, score=score)
    manager.mark_unhealthy([30], reason=SPIKE)
    manager.apply_retention(RetentionPolicy(keep_best_n_checkpoints=1))
    assert healthy_steps(manager) == {20: True, 30: False, 40: True}


def test_saving_an_unhealthy_step_again_moves_the_old_one_aside(
    manager: CheckpointManager,
) -> None:
    save(manager, 10)
    save(manager, 20)
    manager.mark_unhealthy([20], reason=SPIKE)
    again = save(manager, 20)  # the rolled-back run reaches step 20 again
    assert healthy_steps(manager) == {10: True, 20: True}
    assert [p.name for p in manager.replaced_dirs()] == ["step_20.unhealthy"]
    assert (manager.checkpoint_dir / "step_20.unhealthy" / "unhealthy.json").is_file()
    model, _ = make_model(0)
    manager.load_model(20, model=model)
    torch.testing.assert_close(model.state_dict(), again.state_dict(), rtol=0, atol=0)
    with pytest.raises(CheckpointError, match="exists already"):
        save(manager, 20)  # a healthy one is never replaced


def test_permanent_snapshots_survive_retention_even_under_a_later_policy(
    manager: CheckpointManager,
) -> None:
    every_20 = RetentionPolicy(keep_last_n_checkpoints=1, keep_checkpoint_every_n_steps=20)
    for step in (10, 20, 30, 40, 50):
        save(manager, step)
        manager.apply_retention(every_20)
    assert [i.step_nr for i in manager.list_checkpoints()] == [20, 40, 50]
    assert [i.step_nr for i in manager.list_checkpoints() if i.permanent] == [20, 40]

    save(manager, 60)
    manager.apply_retention(RetentionPolicy(keep_last_n_checkpoints=1))  # a resume without it
    assert [i.step_nr for i in manager.list_checkpoints()] == [20, 40, 60]


def test_the_cli_shows_health_and_permanent_snapshots(
    manager: CheckpointManager, capsys: pytest.CaptureFixture[str]
) -> None:
    for step in (10, 20, 30):
        save(manager, step)
    manager.apply_retention(RetentionPolicy(keep_checkpoint_every_n_steps=10))
    manager.mark_unhealthy([30], reason=SPIKE)
    save(manager, 30)  # after a rollback; the unhealthy one moves aside
    manager.mark_unhealthy([20], reason=SPIKE)

    assert cli_main(["checkpoints", str(manager.checkpoint_dir.parent)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["step", "score", "size", "kind", "health", "retention", "state"]
    assert lines[1].split()[:1] + lines[1].split()[-3:] == ["10", "healthy", "permanent", "ok"]
    assert lines[2].split()[5:9] == ["unhealthy", "permanent", "ok;", "unhealthy:"]
    assert lines[2].rstrip().endswith(SPIKE)
    assert lines[3].split()[:1] + lines[3].split()[-3:] == ["30", "healthy", "-", "ok"]
    assert lines[4].startswith("step_30.unhealthy") and "never loaded" in lines[4]


@pytest.mark.parametrize(
    ("where", "marked"),
    [
        ("os.fsync", False),  # the mark's bytes written, not yet flushed
        ("os.replace", False),  # flushed, not yet renamed into place
        ("trainkit_utils.files.fsync_dir", True),  # renamed, the rename not yet flushed
    ],
)
def test_a_kill_9_while_marking_leaves_the_checkpoint_marked_or_not_and_whole(
    manager: CheckpointManager, where: str, marked: bool
) -> None:
    save(manager, 10)
    pid = os.fork()
    if pid == 0:  # the child dies of SIGKILL at ``where``; it never returns into pytest
        try:
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(where, lambda *_: os.kill(os.getpid(), signal.SIGKILL))
                manager.mark_unhealthy([10], reason=SPIKE)
        finally:
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL

    again = reopened(manager)
    assert again.is_healthy(10) is not marked
    again.verify(10)
    assert again.last_healthy_step() == (None if marked else 10)
    again.mark_unhealthy([10], reason=SPIKE)  # a retry, or a no-op
    assert unhealthy_reason(reopened(manager).checkpoint_path(10)) == SPIKE


def test_a_crash_between_moving_an_unhealthy_step_aside_and_its_commit_resumes_before_it(
    manager: CheckpointManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    save(manager, 10)
    save(manager, 20)
    manager.mark_unhealthy([20], reason=SPIKE)
    replace = os.replace

    def crash_at_the_commit(src: str | Path, dst: str | Path) -> None:
        if Path(src).name == "step_20.tmp":
            raise KeyboardInterrupt  # no cleanup runs, as after a kill
        replace(src, dst)

    monkeypatch.setattr(os, "replace", crash_at_the_commit)
    with pytest.raises(KeyboardInterrupt):
        save(manager, 20)
    monkeypatch.undo()

    again = reopened(manager)
    again.prepare()  # the next launch removes the uncommitted step_20.tmp
    assert sorted(p.name for p in again.checkpoint_dir.iterdir()) == [
        "step_10",
        "step_20.unhealthy",
    ]
    model, optimizer = make_model(0)
    loaded = again.load_last_checkpoint(model=model, optimizer=optimizer)
    assert loaded is not None and loaded.step_nr == 10


def test_the_trainer_keeps_snapshots_and_resumes_from_the_newest_healthy_checkpoint(
    tmp_path: Path,
) -> None:
    schedule = {"checkpoint_every_n_steps": 2, "keep_last_n_checkpoints": 1}
    first = make_toy_trainer(tmp_path, max_num_steps=9, keep_checkpoint_every_n_steps=4, **schedule)
    assert first.run() == 0
    manager = CheckpointManager(tmp_path / "checkpoints", Gangs.single())
    infos = manager.list_checkpoints()
    assert [(i.step_nr, i.permanent) for i in infos] == [(4, True), (8, True), (9, False)]

    manager.mark_unhealthy([9], reason=SPIKE)
    begins = BeginStep()
    assert make_toy_trainer(tmp_path, max_num_steps=10, callbacks=[begins], **schedule).run() == 0
    assert begins.step_nr == 8
    # Step 10 is the last healthy one now; keep-last-1 took no snapshot and no unhealthy one.
    assert healthy_steps(manager) == {4: True, 8: True, 9: False, 10: True}


class BeginStep(TrainerCallback):
    def __init__(self) -> None:
        self.step_nr: int | None = None

    def on_train_begin(self, *, step_nr: int) -> None:
        self.step_nr = step_nr
