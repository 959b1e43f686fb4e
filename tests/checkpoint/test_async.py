"""Asynchronous saves in one process: staged at once, invisible until committed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from checkpoint import CheckpointManager
from gangs import Gangs


def make_model(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


@pytest.fixture
def manager(tmp_path: Path) -> CheckpointManager:
    return CheckpointManager(tmp_path / "checkpoints", Gangs.single())


def async_save(
    manager: CheckpointManager, step_nr: int, model: nn.Module, optimizer: torch.optim.Optimizer
) -> None:
    manager.save_checkpoint(
        step_nr,
        model=model,
        optimizer=optimizer,
        trainer_state={"step_nr": step_nr},
        async_checkpoint=True,
    )


@pytest.mark.usefixtures("checkpoint_io")
def test_async_save_is_invisible_until_committed_and_holds_the_staged_values(
    manager: CheckpointManager,
) -> None:
    model, optimizer = make_model(1)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    async_save(manager, 5, model, optimizer)
    assert manager.pending_step_nr == 5
    assert manager.list_checkpoints() == []
    assert (manager.checkpoint_dir / "step_5.tmp").is_dir()

    # Training goes on while the write is in flight; the checkpoint keeps the staged values.
    with torch.no_grad():
        for param in model.parameters():
            param.add_(1.0)

    assert manager.finish_pending_save() == 5
    assert manager.pending_step_nr is None
    assert manager.finish_pending_save() is None
    assert [info.step_nr for info in manager.list_checkpoints()] == [5]
    manager.verify(5)

    fresh, fresh_optimizer = make_model(2)
    loaded = manager.load_last_checkpoint(model=fresh, optimizer=fresh_optimizer)
    assert loaded is not None and loaded.trainer_state == {"step_nr": 5}
    for name, value in fresh.state_dict().items():
        assert torch.equal(value, saved[name]), name


@pytest.mark.usefixtures("checkpoint_io")
def test_next_save_commits_the_pending_one_first(manager: CheckpointManager) -> None:
    model, optimizer = make_model(1)
    async_save(manager, 1, model, optimizer)
    async_save(manager, 2, model, optimizer)
    assert [info.step_nr for info in manager.list_checkpoints()] == [1]
    manager.save_checkpoint(3, model=model, optimizer=optimizer, trainer_state={"step_nr": 3})
    assert [info.step_nr for info in manager.list_checkpoints()] == [1, 2, 3]
    for step_nr in (1, 2, 3):
        manager.verify(step_nr)


def test_abandoned_async_save_is_removed_as_a_leftover(tmp_path: Path) -> None:
    # A crash before the commit: the next manager on the directory sees only a .tmp.
    model, optimizer = make_model(1)
    crashed = CheckpointManager(tmp_path / "checkpoints", Gangs.single())
    async_save(crashed, 4, model, optimizer)
    pending = crashed._pending
    assert pending is not None
    for upload in pending.uploads:  # let the writes land, as a crash after them would
        upload.result()

    restarted = CheckpointManager(tmp_path / "checkpoints", Gangs.single())
    assert restarted.list_checkpoints() == []
    assert restarted.incomplete_dirs() == [tmp_path / "checkpoints" / "step_4.tmp"]
    restarted.remove_leftovers()
    assert not (tmp_path / "checkpoints" / "step_4.tmp").exists()
