"""Checkpoints that are never lost, and resume that is exact: real torchrun, real signals.

Each scenario interrupts ``tests/workers/resume_toy.py`` (10 steps, 5 per data epoch, a checkpoint
every 2 steps, metrics published every 2 steps) and checks that the rerun ends with exactly the
parameters (``torch.equal``) and published train metrics of an uninterrupted run of the same
layout, and that every committed checkpoint left behind verifies. A one-process run that no
signal interrupts runs in this process (``runtime.main``, the command line's path, without a
process's start-up).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

from checkpoint import CheckpointManager
from checkpoint.dcp_io import IO_ENV_VAR
from gangs import Gangs
from tests.conftest import assert_ok, run_python, torchrun
from tests.faults.jobs import run_single

pytestmark = pytest.mark.distributed

WORKER = "tests/workers/resume_toy.py"

# Wall-clock values differ between any two runs; everything else published must match exactly.
# What a resumed run cannot reproduce: how long things took, and how much memory the process held.
TIMING_KEYS = frozenset(
    {
        "elapsed_time",
        "targets_per_second",
        "targets_per_second_per_device",
        "data_wait_time",
        "peak_memory_bytes",
    }
)

LAYOUTS: dict[str, tuple[int, list[str]]] = {
    "dp1": (1, ["batch_size=8"]),
    "dp2": (2, ["batch_size=4"]),
    "dp2_tp2": (4, ["batch_size=4", "tp_size=2", "kind=fsdp"]),
    "hsdp2x2": (4, ["batch_size=2", "kind=hsdp", "dp_shard_size=2"]),
    "dp4": (4, ["batch_size=2"]),
    "hsdp2x2_tp2": (8, ["batch_size=2", "tp_size=2", "kind=hsdp", "dp_shard_size=2"]),
}


# ----------------------------------------------------------------------------------- helpers


def launch(
    layout: str,
    out: Path,
    *overrides: str,
    max_restarts: int = 0,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    nproc, layout_overrides = LAYOUTS[layout]
    config = [*layout_overrides, *overrides]
    return torchrun(
        nproc, WORKER, str(out), "--config", *config, max_restarts=max_restarts, env=env
    )


def launch_single_process(out: Path, *overrides: str) -> subprocess.CompletedProcess[str]:
    """``python worker.py OUT``: no torchrun, the way a single-process recipe runs."""
    return run_python(WORKER, str(out), "--config", *LAYOUTS["dp1"][1], *overrides, timeout=300)


def output(result: subprocess.CompletedProcess[str]) -> str:
    return f"--- stdout ---\n{result.stdout[-6000:]}\n--- stderr ---\n{result.stderr[-6000:]}"


def load_params(out: Path) -> dict[str, Tensor]:
    params: dict[str, Tensor] = torch.load(out / "params.pt", weights_only=True)
    return params


def assert_identical_params(actual: dict[str, Tensor], expected: dict[str, Tensor]) -> None:
    assert actual.keys() == expected.keys()
    different = [name for name in expected if not torch.equal(actual[name], expected[name])]
    assert not different, f"parameters not bit-identical: {different}"


def train_records(out: Path) -> list[dict[str, Any]]:
    lines = (out / "metrics" / "train.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING_KEYS} for line in lines]


def rank_log(out: Path, rank: int) -> str:
    return (out / "logs" / f"rank_{rank}.log").read_text()


def committed_steps(out: Path) -> list[int]:
    manager = CheckpointManager(out / "checkpoints", Gangs.single())
    return [info.step_nr for info in manager.list_checkpoints()]


def assert_committed_checkpoints_verify(out: Path) -> list[int]:
    """Every committed checkpoint passes its size and checksum checks; returns their steps."""
    manager = CheckpointManager(out / "checkpoints", Gangs.single())
    steps = [info.step_nr for info in manager.list_checkpoints()]
    for step_nr in steps:
        manager.verify(step_nr)
    return steps


@dataclass
class ResumedRun:
    """A run stopped after step 3 by SIGTERM, then resumed to the end; and its reference."""

    out: Path
    reference: Path
    first: subprocess.CompletedProcess[str]
    second: subprocess.CompletedProcess[str]
    nproc: int


_resumed_runs: dict[str, ResumedRun] = {}


@pytest.fixture(scope="module")
def resumed_run(
    tmp_path_factory: pytest.TempPathFactory,
    preempted_dp2: tuple[Path, subprocess.CompletedProcess[str]],
) -> Any:
    """``resumed_run(layout)``: one interrupted and resumed run per layout, shared by the tests.

    dp2 is stopped by SIGTERM to torchrun (all ranks get it; the session's ``preempted_dp2``,
    whose reference the fault suite shares); dp1 (one process, no torchrun)
    and dp2_tp2 by the last rank sending SIGTERM to itself (the others must follow it at the
    same step). dp1's resume, which no signal interrupts, runs in this process.
    """

    def get(layout: str) -> ResumedRun:
        if layout not in _resumed_runs:
            if layout == "dp2":
                out, first = preempted_dp2
                second = launch(layout, out)
            elif layout == "dp1":
                out = tmp_path_factory.mktemp(f"resume_{layout}")
                first = launch_single_process(out, "sigterm_at_step=2", "reference_first=true")
                second = run_single(out)
            else:
                out = tmp_path_factory.mktemp(f"resume_{layout}")
                first = launch(layout, out, "sigterm_at_step=2", "reference_first=true")
                second = launch(layout, out)
            _resumed_runs[layout] = ResumedRun(
                out, out / "reference", first, second, LAYOUTS[layout][0]
            )
        return _resumed_runs[layout]

    yield get
    _resumed_runs.clear()


# ------------------------------------------------------------------------------------- tests


@pytest.mark.parametrize(
    "layout",
    [
        "dp1",
        "dp2",
        # Four and eight processes on this machine's cores take a while: `make test-all` runs
        # them. `make test` resumes dp2_tp2 in test_reshard_on_resume_continues_the_data_and_the_math.
        pytest.param("dp2_tp2", marks=pytest.mark.slow),
        pytest.param("hsdp2x2", marks=pytest.mark.slow),
        pytest.param("hsdp2x2_tp2", marks=pytest.mark.slow),
    ],
)
def test_resume_after_sigterm_is_bit_identical(resumed_run: Any, layout: str) -> None:
    run: ResumedRun = resumed_run(layout)
    assert run.first.returncode != 0, output(run.first)
    assert_ok(run.second)

    # Every rank stopped at the same step, mid data epoch (5 steps) and mid publish window.
    for rank in range(run.nproc):
        assert "Stopped at step 3 as requested by a signal." in rank_log(run.out, rank)
    assert "Resumed from the checkpoint of step 3." in rank_log(run.out, 0)

    assert_identical_params(load_params(run.out), load_params(run.reference))
    # Step 4's record spans the interruption (steps 3 and 4); steps 6+ cross a data epoch.
    reference_records = train_records(run.reference)
    assert [r["step_nr"] for r in reference_records] == [2, 4, 6, 8, 10]
    assert reference_records[-1]["data_epoch"] == 2
    assert train_records(run.out) == reference_records

    assert assert_committed_checkpoints_verify(run.out) == [2, 3, 4, 6, 8, 10]


def test_sigterm_to_torchrun_saves_at_the_agreed_step_and_exits_75(resumed_run: Any) -> None:
    run: ResumedRun = resumed_run("dp2")
    # torchrun itself dies of the forwarded signal: SignalException, exit status 1.
    assert run.first.returncode == 1, output(run.first)
    assert "SignalException" in run.first.stderr
    for rank in range(2):
        log_text = rank_log(run.out, rank)
        assert "Received SIGTERM: stopping at the next step boundary." in log_text
        # Each worker exited with PREEMPTED_EXIT_CODE (cli.main logs it, then sys.exit()s it).
        assert "The recipe finished with exit status 75." in log_text
    manifest = json.loads((run.out / "checkpoints" / "step_3" / "manifest.json").read_text())
    assert manifest["step_nr"] == 3
    assert {"trainer/rank_0.pt", "trainer/rank_1.pt"} <= manifest["files"].keys()
    state = torch.load(
        run.out / "checkpoints" / "step_3" / "trainer" / "rank_1.pt", weights_only=True
    )
    # A preempted run is not over: its checkpoint says the run has not stopped.
    assert state["train_state"] == {"step_nr": 3, "data_epoch_nr": 1, "stop_reason": None}


def test_preempted_process_exits_75(resumed_run: Any) -> None:
    run: ResumedRun = resumed_run("dp1")
    assert run.first.returncode == 75, output(run.first)  # PREEMPTED_EXIT_CODE
    assert run.second.returncode == 0


@pytest.mark.slow
def test_torchrun_reports_a_worker_that_exits_75_as_failed(resumed_run: Any) -> None:
    run: ResumedRun = resumed_run("dp2_tp2")
    # Rank 3 signalled itself, so torchrun was not told to stop: to it the workers failed.
    assert run.first.returncode == 1, output(run.first)
    assert "exitcode  : 75" in run.first.stderr


@dataclass
class CrashChain:
    """One dp2 output directory through three crashes, with what was on disk after each."""

    out: Path
    results: list[subprocess.CompletedProcess[str]]
    committed: list[list[int]]  # committed steps after each launch, every one verified
    tmp_dirs: list[list[str]]  # the .tmp directories after each launch
    tmp_contents: list[list[str]]  # the files in them (relative paths)
    logs: list[str]  # rank 0's log after each launch (appended by every launch)


@pytest.fixture(scope="module")
def crash_chain(tmp_path_factory: pytest.TempPathFactory) -> CrashChain:
    out = tmp_path_factory.mktemp("crash_chain")
    chain = CrashChain(out, [], [], [], [], [])

    def record(result: subprocess.CompletedProcess[str]) -> None:
        checkpoints = out / "checkpoints"
        tmp_dirs = sorted(checkpoints.glob("*.tmp"))
        chain.results.append(result)
        chain.committed.append(assert_committed_checkpoints_verify(out))
        chain.tmp_dirs.append([path.name for path in tmp_dirs])
        chain.tmp_contents.append(
            sorted(
                file.relative_to(checkpoints).as_posix()
                for path in tmp_dirs
                for file in path.rglob("*")
                if file.is_file()
            )
        )
        chain.logs.append(rank_log(out, 0))

    # 1. Rank 1 dies once the model of step 4 is written, before its optimizer and the commit.
    record(launch("dp2", out, "sigkill_in_save=after_model", "sigkill_save_step=4"))
    # 2. Rank 0 dies after it wrote the manifest of step 6, before the rename that commits it.
    record(
        launch("dp2", out, "sigkill_in_save=after_manifest", "sigkill_save_step=6", "fault_rank=0")
    )
    # 3. Rank 1 raises at step 7 under --max-restarts 1 (first attempt only). torchrun's
    # rendezvous shares one TCPStore across restarts, so a restarted worker may read the gloo
    # address its peer had in the failed attempt ("Connection refused"; pytorch#135712): the
    # documented opt-out makes each restart use a fresh store.
    record(
        launch(
            "dp2",
            out,
            "raise_at_step=7",
            max_restarts=1,
            env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},
        )
    )
    return chain


def test_kill_9_during_a_save_never_damages_a_committed_checkpoint(
    crash_chain: CrashChain, resumed_run: Any
) -> None:
    chain = crash_chain
    killed_after_model, killed_after_manifest = chain.results[:2]

    assert killed_after_model.returncode != 0, output(killed_after_model)
    assert "exitcode  : -9" in killed_after_model.stderr
    assert chain.committed[0] == [2]
    assert chain.tmp_dirs[0] == ["step_4.tmp"]
    assert "step_4.tmp/model/.metadata" in chain.tmp_contents[0]
    assert not any(name.startswith("step_4.tmp/optimizer") for name in chain.tmp_contents[0])

    assert killed_after_manifest.returncode != 0, output(killed_after_manifest)
    assert "Resumed from the checkpoint of step 2." in chain.logs[1]
    assert "step_4.tmp, left by an interrupted save" in chain.logs[1]
    # A complete manifest inside a .tmp directory still does not make it a checkpoint.
    assert chain.tmp_dirs[1] == ["step_6.tmp"]
    assert "step_6.tmp/manifest.json" in chain.tmp_contents[1]
    assert chain.committed[1] == [2, 4]

    assert "Resumed from the checkpoint of step 4." in chain.logs[2]
    assert chain.committed[2] == [2, 4, 6, 8, 10]
    assert chain.tmp_dirs[2] == []
    assert_identical_params(load_params(chain.out), load_params(resumed_run("dp2").reference))


def test_rank_failure_under_max_restarts_resumes_exactly(
    crash_chain: CrashChain, resumed_run: Any
) -> None:
    result = crash_chain.results[2]
    assert_ok(result)
    log_text = rank_log(crash_chain.out, 1)
    after_first_attempt = log_text.split("Injected failure at step 7 on rank 1.", 1)
    assert len(after_first_attempt) == 2, "the failure was not injected"
    # The restarted attempt resumed from the checkpoint of step 6, saved before the failure.
    assert "Resumed from the checkpoint of step 6." in after_first_attempt[1]
    assert_identical_params(load_params(crash_chain.out), load_params(resumed_run("dp2").reference))


def test_damaged_last_checkpoint_falls_back_to_the_previous_one(
    resumed_run: Any, tmp_path: Path
) -> None:
    source = resumed_run("dp1").reference
    shutil.copytree(source / "checkpoints", tmp_path / "checkpoints")
    checkpoints = tmp_path / "checkpoints"
    damaged = checkpoints / "step_10" / "model" / "__0_0.distcp"
    with damaged.open("r+b") as f:
        f.truncate(damaged.stat().st_size // 2)
    leftover = checkpoints / "step_12.tmp" / "model"
    leftover.mkdir(parents=True)
    (leftover / "__0_0.distcp").write_bytes(b"half written")

    result = run_single(tmp_path)
    assert_ok(result)
    log_text = rank_log(tmp_path, 0)
    assert "Skipping the checkpoint of step 10, which is damaged" in log_text
    assert "it is truncated or altered" in log_text
    assert (
        "Resumed from the checkpoint of step 8 instead of the damaged one of step 10." in log_text
    )
    assert "step_12.tmp, left by an interrupted save" in log_text
    assert not (checkpoints / "step_12.tmp").exists()
    # The damaged one is kept aside for inspection; step 10 was trained and saved again.
    assert (checkpoints / "step_10.damaged" / "manifest.json").is_file()
    assert assert_committed_checkpoints_verify(tmp_path) == [2, 4, 6, 8, 10]
    assert_identical_params(load_params(tmp_path), load_params(source))


def test_resume_with_another_world_size_fails_clearly(resumed_run: Any, tmp_path: Path) -> None:
    source = resumed_run("dp2").reference
    shutil.copytree(source / "checkpoints", tmp_path / "checkpoints")

    result = run_single(tmp_path)
    assert result.returncode == 2, output(result)
    message = (
        "The checkpoint of step 10 in {} was saved by 2 processes (dp_size 2 x tp_size 1), but "
        "this run has 1 process (dp_size 1 x tp_size 1)."
    ).format(tmp_path / "checkpoints")
    # A launch mistake, not a crash: one error line, no traceback.
    (error_line,) = [line for line in result.stderr.splitlines() if "error:" in line]
    assert error_line.startswith("error: ") and message in error_line
    assert "Traceback" not in result.stderr
    assert "Resume with 2 processes and tp_size 1 for a bit-exact resume" in result.stderr
    assert "pass reshard_on_resume=True" in result.stderr
    assert message in rank_log(tmp_path, 0)
    # Not mistaken for damage: every checkpoint is still there, untouched.
    assert assert_committed_checkpoints_verify(tmp_path) == [2, 4, 6, 8, 10]
    assert not list((tmp_path / "checkpoints").glob("*.damaged*"))


@pytest.mark.slow
def test_a_resume_under_fsdp_of_a_ddp_checkpoint_loads_and_warns_it_is_not_bit_identical(
    resumed_run: Any, tmp_path: Path
) -> None:
    source = resumed_run("dp2").reference
    shutil.copytree(source / "checkpoints", tmp_path / "checkpoints")
    manifest = json.loads((tmp_path / "checkpoints" / "step_10" / "manifest.json").read_text())
    assert manifest["dp_shard_size"] == 1

    result = launch("dp2", tmp_path, "kind=fsdp")
    assert result.returncode == 0, output(result)
    assert (
        "The checkpoint of step 10 was saved with parameters replicated over the DP ranks; this "
        "run has parameters sharded over all 2 DP ranks (FSDP2). It resumes, but the gradients "
        "are reduced in another order"
    ) in rank_log(tmp_path, 0)
    assert "Resumed from the checkpoint of step 10." in rank_log(tmp_path, 0)


@pytest.mark.parametrize("layout", ["dp1", "dp2_tp2"])
def test_reshard_on_resume_continues_the_data_and_the_math(
    resumed_run: Any, tmp_path: Path, layout: str
) -> None:
    # The DP2 reference saved step 2 mid data epoch (5 steps of 8 examples each); every layout
    # here takes the same 8 examples a step, so from the resharded step 2 on, the updates are
    # the reference's up to float rounding.
    source = resumed_run("dp2").reference
    shutil.copytree(source / "checkpoints" / "step_2", tmp_path / "checkpoints" / "step_2")

    if layout == "dp1":
        result = run_single(tmp_path, "reshard_on_resume=true")
    else:
        result = launch(layout, tmp_path, "reshard_on_resume=true")
    assert_ok(result)
    log_text = rank_log(tmp_path, 0)
    assert "Resharding the checkpoint of step 2, saved by 2 processes" in log_text
    assert "Resumed from the checkpoint of step 2." in log_text
    expected = load_params(source)
    actual = load_params(tmp_path)
    assert actual.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.slow
def test_hsdp_checkpoint_loads_into_ddp(resumed_run: Any, tmp_path: Path) -> None:
    # HSDP 2x2 and DDP on 4 have the same DP gang, so the data position carries over as is;
    # DCP stores global tensors, so the HSDP shards load into DDP's whole replicas.
    source = resumed_run("hsdp2x2").reference
    shutil.copytree(source / "checkpoints" / "step_2", tmp_path / "checkpoints" / "step_2")

    result = launch("dp4", tmp_path, "reshard_on_resume=true")
    assert_ok(result)
    assert "Resumed from the checkpoint of step 2." in rank_log(tmp_path, 0)
    expected = load_params(source)
    actual = load_params(tmp_path)
    assert actual.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=1e-5, atol=1e-6, msg=name)


def test_async_checkpoint_single_process_matches_sync(resumed_run: Any, tmp_path: Path) -> None:
    result = run_single(tmp_path, "async_checkpoint=true")
    assert_ok(result)
    assert "Checkpoint of step 2 staged; writing it in the background." in rank_log(tmp_path, 0)
    assert_identical_params(load_params(tmp_path), load_params(resumed_run("dp1").reference))
    assert assert_committed_checkpoints_verify(tmp_path) == [2, 4, 6, 8, 10]


def test_async_checkpoint_two_processes_resumes_exactly_and_a_crash_leaves_it_invisible(
    resumed_run: Any, tmp_path: Path
) -> None:
    # At step 4 the save of step 2 commits and step 4 is staged; its commit waits for step 6,
    # so the SIGKILL mid-step 5 (away from any save) catches it in flight.
    first = launch("dp2", tmp_path, "async_checkpoint=true", "sigkill_at_step=5")
    assert first.returncode != 0, output(first)
    assert "exitcode  : -9" in first.stderr
    assert committed_steps(tmp_path) == [2]
    assert (tmp_path / "checkpoints" / "step_4.tmp").is_dir()

    second = launch("dp2", tmp_path, "async_checkpoint=true")
    assert_ok(second)
    log_text = rank_log(tmp_path, 0)
    assert "step_4.tmp, left by an interrupted save" in log_text
    assert "Resumed from the checkpoint of step 2." in log_text
    # Same weights as the synchronous, uninterrupted run: async changes when, not what.
    assert_identical_params(load_params(tmp_path), load_params(resumed_run("dp2").reference))
    assert assert_committed_checkpoints_verify(tmp_path) == [2, 4, 6, 8, 10]
    assert not list((tmp_path / "checkpoints").glob("*.tmp"))


@pytest.mark.slow
def test_async_checkpoint_of_replicated_shards_resumes_exactly(
    resumed_run: Any, tmp_path: Path
) -> None:
    # HSDP replicates each shard across the two shard groups: each rank stages only the entries
    # DCP gives it to write. The run is killed mid step 5, so it resumes from the async save of 2.
    first = launch("hsdp2x2", tmp_path, "async_checkpoint=true", "sigkill_at_step=5")
    assert first.returncode != 0, output(first)
    assert committed_steps(tmp_path) == [2]

    second = launch("hsdp2x2", tmp_path, "async_checkpoint=true")
    assert_ok(second)
    assert "Resumed from the checkpoint of step 2." in rank_log(tmp_path, 0)
    assert_identical_params(load_params(tmp_path), load_params(resumed_run("hsdp2x2").reference))
    assert assert_committed_checkpoints_verify(tmp_path) == [2, 4, 6, 8, 10]


# `make test-all` only: in `make test`, test_integrity saves (sync and async), verifies and loads
# on two ranks through public DCP, test_async saves and loads asynchronously through it, and the
# test above kills an asynchronous save of two ranks and resumes exactly.
@pytest.mark.slow
def test_public_dcp_path_on_two_ranks_resumes_exactly(resumed_run: Any, tmp_path: Path) -> None:
    # The path a torch outside the fast path's tested versions takes: public DCP only, the
    # staging of asynchronous saves included. Killed mid step 5, resumed from step 2.
    env = {IO_ENV_VAR: "public"}
    first = launch("dp2", tmp_path, "async_checkpoint=true", "sigkill_at_step=5", env=env)
    assert first.returncode != 0, output(first)
    assert committed_steps(tmp_path) == [2]

    second = launch("dp2", tmp_path, "async_checkpoint=true", env=env)
    assert_ok(second)
    log_text = rank_log(tmp_path, 1)
    assert "Checkpoints go through the public API of torch.distributed.checkpoint" in log_text
    assert "Resumed from the checkpoint of step 2." in rank_log(tmp_path, 0)
    assert_identical_params(load_params(tmp_path), load_params(resumed_run("dp2").reference))
    assert assert_committed_checkpoints_verify(tmp_path) == [2, 4, 6, 8, 10]
