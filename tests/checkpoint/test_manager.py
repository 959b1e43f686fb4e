"""The commit protocol, integrity checks and pruning, in one process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from checkpoint import CheckpointError, CheckpointManager, RetentionPolicy
from gangs import Gangs
from runtime.cli import tools
from tests.conftest import in_process, run_python


def make_model(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()  # so the optimizer has state worth saving
    return model, optimizer


def save(manager: CheckpointManager, step_nr: int, score: float | None = None) -> nn.Module:
    model, optimizer = make_model(step_nr)
    manager.save_checkpoint(
        step_nr, model=model, optimizer=optimizer, trainer_state={"step_nr": step_nr}, score=score
    )
    return model


@pytest.fixture
def manager(tmp_path: Path) -> CheckpointManager:
    return CheckpointManager(tmp_path / "checkpoints", Gangs.single())


@pytest.mark.usefixtures("checkpoint_io")
def test_round_trip_restores_model_optimizer_and_trainer_state(manager: CheckpointManager) -> None:
    saved = save(manager, 10)
    _, saved_optimizer = make_model(10)
    model, optimizer = make_model(99)
    loaded = manager.load_last_checkpoint(model=model, optimizer=optimizer)
    assert loaded is not None and loaded.step_nr == 10
    assert loaded.trainer_state == {"step_nr": 10}
    for (name, a), b in zip(saved.state_dict().items(), model.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, msg=name)
    exp_avg = [s["exp_avg"] for s in optimizer.state.values()]
    saved_exp_avg = [s["exp_avg"] for s in saved_optimizer.state.values()]
    for a, b in zip(exp_avg, saved_exp_avg, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.usefixtures("checkpoint_io")
def test_tensors_of_any_layout_and_dtype_round_trip(manager: CheckpointManager) -> None:
    # Whole contiguous tensors are read straight into the model's; the rest as DCP reads them.
    def make(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model = nn.Module()
        model.transposed = nn.Parameter(torch.randn(8, 4).t())  # saved non-contiguous
        model.bf16 = nn.Parameter(torch.randn(4, 4, dtype=torch.bfloat16))
        model.scalar = nn.Parameter(torch.randn(()))
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
        sum(param.float().sum() for param in model.parameters()).backward()
        optimizer.step()
        return model, optimizer

    saved, saved_optimizer = make(1)
    manager.save_checkpoint(1, model=saved, optimizer=saved_optimizer, trainer_state={})
    model, optimizer = make(2)
    manager.load_checkpoint(1, model=model, optimizer=optimizer)

    for (name, expected), actual in zip(
        saved.state_dict().items(), model.state_dict().values(), strict=True
    ):
        assert actual.dtype == expected.dtype and torch.equal(actual, expected), name
    assert not model.transposed.is_contiguous()
    for state, expected_state in zip(
        optimizer.state.values(), saved_optimizer.state.values(), strict=True
    ):
        for key, value in expected_state.items():
            assert torch.equal(state[key], value), key


def test_the_fast_path_loads_as_dcp_does_on_a_torch_without_the_in_place_read(
    manager: CheckpointManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    from checkpoint.dcp_io import IO_ENV_VAR

    monkeypatch.setenv(IO_ENV_VAR, "fast")
    # A tested torch older than PyTorchFileReader.get_record_size, which the in-place read needs.
    monkeypatch.setattr(torch, "__version__", "2.12.1")
    saved = save(manager, 10)
    model, optimizer = make_model(0)
    manager.load_checkpoint(10, model=model, optimizer=optimizer)

    for (name, expected), actual in zip(
        saved.state_dict().items(), model.state_dict().values(), strict=True
    ):
        assert torch.equal(actual, expected), name


def test_manifest_describes_the_checkpoint(manager: CheckpointManager) -> None:
    save(manager, 5, score=1.25)
    manifest = json.loads((manager.checkpoint_dir / "step_5" / "manifest.json").read_text())
    assert manifest["step_nr"] == 5 and manifest["score"] == 1.25 and manifest["kind"] == "full"
    assert manifest["world_size"] == 1 and manifest["tp_size"] == 1
    assert "trainer/rank_0.pt" in manifest["files"]
    assert any(name.startswith("model/") for name in manifest["files"])
    assert manifest["format_version"] == 2 and manifest["algorithm"] == "xxh3_128"
    assert all(len(entry["digest"]) == 32 for entry in manifest["files"].values())


def test_no_checkpoint_means_a_fresh_start(manager: CheckpointManager) -> None:
    model, optimizer = make_model(0)
    assert manager.load_last_checkpoint(model=model, optimizer=optimizer) is None


def test_leftover_temporary_directory_is_ignored_then_removed(manager: CheckpointManager) -> None:
    save(manager, 10)
    leftover = manager.checkpoint_dir / "step_20.tmp"
    (leftover / "model").mkdir(parents=True)
    (leftover / "model" / "junk").write_bytes(b"half written")
    uncommitted = manager.checkpoint_dir / "step_30"
    uncommitted.mkdir()  # no manifest: a crash before the rename, or during a delete
    assert [i.step_nr for i in manager.list_checkpoints()] == [10]
    model, optimizer = make_model(0)
    loaded = manager.load_last_checkpoint(model=model, optimizer=optimizer)
    assert loaded is not None and loaded.step_nr == 10
    manager.remove_leftovers()
    assert not leftover.exists() and not uncommitted.exists()
    assert (manager.checkpoint_dir / "step_10").is_dir()


@pytest.mark.parametrize("damage", ["truncate", "alter", "remove"])
@pytest.mark.usefixtures("checkpoint_io")
def test_damaged_checkpoint_is_detected_and_the_previous_one_loads(
    manager: CheckpointManager, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    save(manager, 10)
    save(manager, 20)
    victim = next((manager.checkpoint_dir / "step_20" / "model").glob("*.distcp"))
    if damage == "truncate":
        victim.write_bytes(victim.read_bytes()[:-10])
    elif damage == "alter":
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0xFF
        victim.write_bytes(bytes(data))
    else:
        victim.unlink()

    with pytest.raises(CheckpointError, match=victim.name):
        manager.verify(20)
    model, optimizer = make_model(0)
    loaded = manager.load_last_checkpoint(model=model, optimizer=optimizer)
    assert loaded is not None and loaded.step_nr == 10
    assert "Skipping the checkpoint of step 20" in caplog.text


def test_all_damaged_is_an_error_not_a_fresh_start(manager: CheckpointManager) -> None:
    save(manager, 10)
    (manager.checkpoint_dir / "step_10" / "trainer" / "rank_0.pt").write_bytes(b"x")
    model, optimizer = make_model(0)
    with pytest.raises(CheckpointError, match="None of the checkpoints"):
        manager.load_last_checkpoint(model=model, optimizer=optimizer)


def test_retention_prunes_and_deletes_only_committed_checkpoints(
    manager: CheckpointManager,
) -> None:
    for step in (10, 20, 30, 40):
        save(manager, step, score=float(step))
    manager.apply_retention(RetentionPolicy(keep_last_n_checkpoints=1, keep_last_n_models=2))
    infos = {i.step_nr: i.kind for i in manager.list_checkpoints()}
    assert infos == {30: "model", 40: "full"}
    pruned = manager.checkpoint_dir / "step_30"
    assert not (pruned / "optimizer").exists() and not (pruned / "trainer").exists()
    manager.verify(30)  # the pruned manifest still matches what is on disk
    model, _ = make_model(0)
    manager.load_model(30, model=model)
    with pytest.raises(CheckpointError, match="holds only the model"):
        manager.load_checkpoint(
            30, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1)
        )


def test_saving_a_step_twice_is_refused(manager: CheckpointManager) -> None:
    save(manager, 10)
    with pytest.raises(CheckpointError, match="exists already"):
        save(manager, 10)


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """``python -m runtime ARGS``, its main in this process."""
    return in_process(tools.main, args)


def test_cli_lists_checkpoints_with_their_state(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path / "checkpoints", Gangs.single())
    save(manager, 10, score=2.5)
    save(manager, 20)
    (manager.checkpoint_dir / "step_30.tmp").mkdir()
    (manager.checkpoint_dir / "step_5.damaged").mkdir()
    (manager.checkpoint_dir / "step_20" / "trainer" / "rank_0.pt").write_bytes(b"x")
    result = run_cli("checkpoints", str(tmp_path))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["step", "score", "size", "kind", "health", "retention", "state"]
    assert lines[1].split()[:2] == ["10", "2.5"] and lines[1].rstrip().endswith("ok")
    assert lines[2].startswith("20") and "damaged" in lines[2] and "rank_0.pt" in lines[2]
    assert lines[3].startswith("step_30.tmp") and "incomplete" in lines[3]
    assert lines[4].startswith("step_5.damaged") and "moved aside by a resume" in lines[4]


@pytest.mark.usefixtures("checkpoint_io")
def test_cli_exports_a_plain_state_dict(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path / "checkpoints", Gangs.single())
    save(manager, 10, score=3.0)
    best = save(manager, 20, score=1.0)
    save(manager, 30, score=2.0)
    out = tmp_path / "export" / "model.pt"
    result = run_cli("export", str(tmp_path), str(out), "--best")
    assert result.returncode == 0, result.stderr
    assert "step 20" in result.stdout
    # A fresh interpreter without this project on its path reads it.
    check = subprocess.run(
        [
            sys.executable,
            "-I",
            "-c",
            f"import torch; print(sorted(torch.load({str(out)!r}, weights_only=True)))",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert check.stdout.strip() == str(sorted(best.state_dict()))
    exported = torch.load(out, weights_only=True)
    for name, value in best.state_dict().items():
        torch.testing.assert_close(exported[name], value)


def test_cli_errors_exit_2_with_one_line(tmp_path: Path) -> None:
    # A real process: the one line is all the terminal gets, and the status is the process's.
    result = run_python("-m", "runtime", "export", str(tmp_path), str(tmp_path / "m.pt"))
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "no committed checkpoints" in result.stderr

    save(CheckpointManager(tmp_path / "checkpoints", Gangs.single()), 10)
    for step, message in (
        ("-1", "which must be 'last', 'best' or a step number, but is -1 instead."),
        ("7", "There is no committed checkpoint of step 7 in"),
    ):
        result = run_cli("export", str(tmp_path), str(tmp_path / "m.pt"), "--step", step)
        assert result.returncode == 2, result.stderr
        assert result.stderr.strip().count("\n") == 0 and message in result.stderr
    assert result.stderr.rstrip().endswith("the steps there are 10.")


def test_unreadable_manifest_is_damage_and_is_moved_aside_after_the_fallback(
    manager: CheckpointManager, caplog: pytest.LogCaptureFixture
) -> None:
    save(manager, 10)
    save(manager, 20)
    (manager.checkpoint_dir / "step_20" / "manifest.json").write_text('{"files": ')
    assert [i.step_nr for i in manager.list_checkpoints()] == [10]  # no crash while listing
    model, optimizer = make_model(0)
    loaded = manager.load_last_checkpoint(model=model, optimizer=optimizer)
    assert loaded is not None and loaded.step_nr == 10
    assert "Skipping the checkpoint of step 20" in caplog.text
    # Kept for inspection under a name that is never loaded; step 20 can be saved again.
    assert (manager.checkpoint_dir / "step_20.damaged" / "model").is_dir()
    save(manager, 20)
    manager.verify(20)


@pytest.mark.parametrize(
    ("version", "fast"),
    [
        ("2.13.0+cpu", True),
        ("2.12.1", True),
        ("2.11.0+cu130", True),
        ("2.10.2", False),
        ("2.14.0.dev20260101", False),
    ],
)
def test_the_fast_path_is_taken_only_on_the_tested_torch_versions(
    version: str, fast: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    from checkpoint.dcp_io import IO_ENV_VAR, fast_io_supported

    monkeypatch.delenv(IO_ENV_VAR, raising=False)
    monkeypatch.setattr(torch, "__version__", version)
    assert fast_io_supported() is fast


def test_an_unknown_checkpoint_io_choice_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from checkpoint.dcp_io import IO_ENV_VAR, fast_io_supported

    monkeypatch.setenv(IO_ENV_VAR, "quick")
    with pytest.raises(CheckpointError, match="must be 'fast', 'public' or unset, but is 'quick'"):
        fast_io_supported()
