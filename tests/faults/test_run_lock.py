"""One run per output directory; workers that do not outlive their launcher."""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from torch import Tensor

from runtime.cli.run_lock import LOCK_FILE_NAME, RunLock, RunLockError
from tests.conftest import REPO_ROOT, child_env
from tests.faults.conftest import Tally, trial_counts
from tests.faults.jobs import (
    committed,
    identical,
    load_params,
    rank_log,
    run_job,
    start_job,
    wait_for,
    wait_until_gone,
)

pytestmark = pytest.mark.faults


def dead_pid() -> int:
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


def write_lock(out: Path, **record: object) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / LOCK_FILE_NAME).write_text(json.dumps(record))


def test_a_second_run_is_refused_naming_the_holder_and_writes_nothing(tmp_path: Path) -> None:
    out = tmp_path / "run"
    out.mkdir()
    lock = RunLock(out)
    lock.acquire()
    try:
        result = subprocess.run(
            [sys.executable, "-m", "tests.runtime.cli.cli_recipe", str(out)],
            env=child_env(),
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    finally:
        lock.release()
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"error: The output directory {out} is in use by another run ")
    assert f"(pid {os.getpid()} on host {socket.gethostname()}, running since " in line
    assert "Wait for it to end or stop it, or pass another OUTPUT_DIR." in line
    # The refused launch wrote nothing: no config, no logs; and the holder's lock is gone now.
    assert sorted(p.name for p in out.iterdir()) == []


def test_a_held_lock_refuses_a_second_holder_and_is_removed_on_release(tmp_path: Path) -> None:
    first = RunLock(tmp_path)
    first.acquire()
    with pytest.raises(RunLockError, match=f"pid {os.getpid()} on host"):
        RunLock(tmp_path).acquire()
    first.release()
    assert not (tmp_path / LOCK_FILE_NAME).exists()
    second = RunLock(tmp_path)
    second.acquire()
    second.release()


def test_a_lock_left_by_a_dead_process_is_taken_over(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pid = dead_pid()
    write_lock(tmp_path, host=socket.gethostname(), pid=pid, started=0, heartbeat=time.time())
    lock = RunLock(tmp_path)
    with caplog.at_level(logging.WARNING):
        lock.acquire()
    lock.release()
    assert f"left by pid {pid} on {socket.gethostname()}, which is dead." in caplog.text


def test_a_lock_from_another_host_is_taken_over_only_when_its_heartbeat_is_stale(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    write_lock(tmp_path, host="node-7", pid=4242, started=0, heartbeat=time.time())
    with pytest.raises(RunLockError, match=r"pid 4242 on host node-7.*heartbeat 0 s ago"):
        RunLock(tmp_path, stale_after=60).acquire()

    write_lock(tmp_path, host="node-7", pid=4242, started=0, heartbeat=time.time() - 120)
    lock = RunLock(tmp_path, stale_after=60)
    with caplog.at_level(logging.WARNING):
        lock.acquire()
    record = json.loads((tmp_path / LOCK_FILE_NAME).read_text())
    lock.release()
    assert "left by pid 4242 on node-7, which sent its last heartbeat 120 s ago" in caplog.text
    assert record["pid"] == os.getpid()


def test_the_holder_keeps_its_heartbeat_fresh(tmp_path: Path) -> None:
    lock = RunLock(tmp_path, heartbeat_interval=0.05, stale_after=1)
    lock.acquire()
    try:
        first = json.loads((tmp_path / LOCK_FILE_NAME).read_text())["heartbeat"]
        deadline = time.monotonic() + 60
        while json.loads((tmp_path / LOCK_FILE_NAME).read_text())["heartbeat"] == first:
            assert time.monotonic() < deadline, "the heartbeat never changed"
            time.sleep(0.05)
    finally:
        lock.release()


@pytest.mark.distributed
@pytest.mark.parametrize("trials", trial_counts(1, 3))
def test_workers_whose_launcher_died_exit_and_free_the_directory(
    trials: int, reference: dict[str, Tensor], tmp_path: Path, tally: Tally
) -> None:
    rng = random.Random(66)
    pacing = ("step_sleep=0.2", "mark_steps=true")
    for trial in range(trials):
        out = tmp_path / f"trial_{trial}"
        job = start_job(out, *pacing)
        assert wait_for(out / "progress" / f"step_{rng.randint(1, 8)}", job), job.stderr()
        workers = job.workers()
        os.kill(job.process.pid, signal.SIGKILL)  # the launcher only, as the OOM killer might
        job.wait()
        wait_until_gone(workers)  # on their own: nobody else signals them
        last_step = max(int(p.name.removeprefix("step_")) for p in (out / "progress").iterdir())
        noticed = any("The launcher (pid" in rank_log(out, rank) for rank in (0, 1))
        before = committed(out)
        # The directory is free at once, and the run resumes to the uninterrupted result.
        result = run_job(out, *pacing)
        ok = (
            noticed
            and last_step < 10
            and result.returncode == 0
            and identical(load_params(out), reference)
            and set(before) <= set(committed(out))
        )
        tally.add(
            survived=ok,
            detail=f"noticed {noticed}, exit {result.returncode}\n{result.stderr[-3000:]}",
        )
    tally.check()
