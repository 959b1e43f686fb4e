"""Launching, watching and killing real ``torchrun`` jobs of ``tests/workers/resume_toy.py``."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from checkpoint import CheckpointManager
from gangs import Gangs
from tests.conftest import REPO_ROOT, child_env, main_in_process, torchrun, torchrun_command
from tests.workers.resume_toy import ResumeToyConfig, recipe

WORKER = "tests/workers/resume_toy.py"
DP2 = ("batch_size=4",)
"""Two ranks of 4 examples: the run of every dp2 trial and of the reference."""

# A generous bound so that a broken run fails the test instead of hanging it; never a measurement.
HANG_GUARD = 180.0


@dataclass
class Job:
    """A torchrun launch in a session of its own, its output going to files beside ``out``."""

    out: Path
    process: subprocess.Popen[bytes]

    @property
    def stderr_file(self) -> Path:
        return self.out.parent / f"{self.out.name}.stderr"

    def stderr(self) -> str:
        return self.stderr_file.read_text(errors="replace")

    def workers(self) -> list[int]:
        """The pids of the worker processes (torchrun's children)."""
        return children(self.process.pid)

    def wait(self) -> int:
        return self.process.wait(timeout=HANG_GUARD)


def start_job(out: Path, *overrides: str, nproc: int = 2) -> Job:
    out.parent.mkdir(parents=True, exist_ok=True)
    stderr = (out.parent / f"{out.name}.stderr").open("ab")
    process = subprocess.Popen(
        torchrun_command(nproc, [WORKER, str(out), "--config", *DP2, *overrides]),
        env=child_env(),
        cwd=REPO_ROOT,
        stdout=stderr,
        stderr=stderr,
        start_new_session=True,
    )
    stderr.close()
    return Job(out, process)


def run_job(out: Path, *overrides: str) -> subprocess.CompletedProcess[str]:
    """A dp2 launch to its end."""
    return torchrun(2, WORKER, str(out), "--config", *DP2, *overrides, timeout=HANG_GUARD)


def run_single(out: Path, *overrides: str) -> subprocess.CompletedProcess[str]:
    """``python resume_toy.py OUT`` without torchrun (8 examples a step), as
    :func:`~tests.conftest.main_in_process` runs it: in this process."""
    return main_in_process(
        recipe, ResumeToyConfig, [str(out), "--config", "batch_size=8", *overrides]
    )


def children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # The command name may hold spaces; the fields after it are fixed.
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_until_gone(pids: list[int]) -> None:
    deadline = time.monotonic() + HANG_GUARD
    while any(alive(pid) for pid in pids):
        if time.monotonic() > deadline:
            raise AssertionError(f"processes {pids} still run {HANG_GUARD} s later")
        time.sleep(0.05)


def kill_job(job: Job) -> None:
    """SIGKILL the launcher and every worker at once, as an OOM killer or a scheduler may."""
    pids = [job.process.pid, *job.workers()]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    job.wait()
    wait_until_gone(pids)


def wait_for(path: Path, job: Job) -> bool:
    """Wait until ``path`` exists; False if the job ended first."""
    deadline = time.monotonic() + HANG_GUARD
    while not path.exists():
        if job.process.poll() is not None:
            return False
        if time.monotonic() > deadline:
            raise AssertionError(f"{path} did not appear within {HANG_GUARD} s")
        time.sleep(0.02)
    return True


def load_params(out: Path) -> dict[str, Tensor]:
    params: dict[str, Tensor] = torch.load(out / "params.pt", weights_only=True)
    return params


def identical(actual: dict[str, Tensor], expected: dict[str, Tensor]) -> bool:
    return actual.keys() == expected.keys() and all(
        torch.equal(actual[name], expected[name]) for name in expected
    )


def committed(out: Path) -> list[int]:
    """The committed checkpoints' steps, each verified (sizes and checksums)."""
    manager = CheckpointManager(out / "checkpoints", Gangs.single())
    steps = [info.step_nr for info in manager.list_checkpoints()]
    for step_nr in steps:
        manager.verify(step_nr)
    return steps


def rank_log(out: Path, rank: int) -> str:
    path = out / "logs" / f"rank_{rank}.log"
    return path.read_text() if path.exists() else ""


def wait_for_files(paths: list[Path], process: subprocess.Popen[str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not all(path.exists() for path in paths):
        if process.poll() is not None:
            raise AssertionError(f"torchrun exited ({process.returncode}) before the handshake.")
        if time.monotonic() > deadline:
            raise AssertionError(f"{paths} did not appear within {timeout} seconds.")
        time.sleep(0.05)


def stop_by_sigterm_to_torchrun(
    out: Path, nproc: int, *overrides: str
) -> subprocess.CompletedProcess[str]:
    """Preempt like a cluster does: SIGTERM to torchrun once every rank finished step 2.

    The workers wait after step 2 until the signal torchrun forwards has arrived (a file
    handshake, no sleeps), so the stop request is known to all of them at step 3. The launch
    first trains the same run, uninterrupted, in ``out/reference`` (``reference_first``).
    """
    config = [*overrides, "wait_for_sigterm_at_step=2", "reference_first=true"]
    process = subprocess.Popen(
        torchrun_command(nproc, [WORKER, str(out), "--config", *config]),
        env=child_env(),
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        ready = [out / "ready" / f"rank_{rank}" for rank in range(nproc)]
        wait_for_files(ready, process, timeout=120)
        process.send_signal(signal.SIGTERM)
        stdout, stderr = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
